//! `strata serve` as a process: it logs its address, serves, and on SIGTERM during a stream exits
//! with status 0 within 5 s. Also runs the official `openai` Python client against it when
//! `python3 -c "import openai"` works (`scripts/test.sh` installs it).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn model() -> std::path::PathBuf {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let p = std::env::var_os("STRATA_MODELS_DIR").map(std::path::PathBuf::from).unwrap_or_else(|| root.join("models")).join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} missing: run `strata fetch-default`", p.display());
    p
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts the server on SmolLM2 and waits for its "listening" log line.
fn spawn(port: u16) -> Child {
    spawn_with(port, &["--ctx-size", "2048", "-t", "2", "--temp", "0", "--model", &model().to_string_lossy()])
}

/// Starts `strata serve --port PORT ARGS…` and waits for its "listening" log line.
fn spawn_with(port: u16, args: &[&str]) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--port", &port.to_string()])
        .args(args)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(60) {
        line.clear();
        if err.read_line(&mut line).unwrap_or(0) == 0 {
            panic!("server exited before listening");
        }
        if line.contains("listening on http://127.0.0.1:") {
            // keep draining stderr so the server never blocks on a full pipe
            std::thread::spawn(move || {
                let mut sink = String::new();
                let _ = err.read_to_string(&mut sink);
            });
            return child;
        }
    }
    panic!("server did not start");
}

#[test]
fn sigterm_during_a_stream_exits_zero_within_5s() {
    let port = free_port();
    let mut child = spawn(port);
    let body = r#"{"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": true, "stream": true}"#;
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 256];
    c.read(&mut buf).unwrap();
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let t = Instant::now();
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            panic!("still running 5 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code.code(), Some(0), "exit status after SIGTERM");
    // The stream that was cut still ended properly: a finish_reason, then [DONE].
    let mut rest = String::new();
    let _ = c.read_to_string(&mut rest);
    assert!(rest.contains("[DONE]"), "stream did not end with [DONE]: {rest}");
}

#[test]
fn official_openai_python_client() {
    let has_openai = Command::new("python3").args(["-c", "import openai"]).status().map(|s| s.success()).unwrap_or(false);
    if !has_openai {
        eprintln!("skipping: the `openai` Python package is not installed (scripts/test.sh installs it)");
        return;
    }
    let port = free_port();
    let mut child = spawn(port);
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/openai_client_check.py");
    let out = Command::new("python3").arg(script).arg(format!("http://127.0.0.1:{port}/v1")).output().unwrap();
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let _ = child.wait();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "openai client check failed:\n{text}");
    assert!(text.contains("openai client check: ok"), "{text}");
}

/// Sends one HTTP/1.1 request (`Connection: close`) and returns the status line and the body,
/// de-chunked.
fn post(port: u16, path: &str, body: &str) -> (String, String) {
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(c, "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    let (head, mut rest) = out.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no header end: {out}"));
    let status = head.lines().next().unwrap_or_default().to_string();
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return (status, rest.to_string());
    }
    let mut body = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or_else(|e| panic!("bad chunk size `{size}`: {e}"));
        if n == 0 {
            break;
        }
        body.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    (status, body)
}

/// DFlash through the server (SwiftLM's DFlash path crashed on a long prompt and streamed
/// `finish_reason: null`): a prompt of several blocks and prefill chunks completes, and the stream
/// ends with a finish_reason, usage and `[DONE]`.
#[test]
fn dflash_long_prompt_streams_to_a_finish_reason() {
    let fx = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/dflash-tiny");
    let (target, draft) = (fx.join("target"), fx.join("draft_memo"));
    let port = free_port();
    let args = ["--ctx-size", "1024", "-t", "2", "--temp", "0", "--prefill-chunk", "16", "--dflash", "--draft-model", &draft.to_string_lossy(), "--model", &target.to_string_lossy()];
    let mut child = spawn_with(port, &args);
    let prompt = "the quick brown fox jumps over the lazy dog while a random draft model proposes blocks of tokens. ".repeat(8);
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 120, "ignore_eos": true}).to_string();
    let (status, plain) = post(port, "/v1/completions", &body);
    assert!(status.contains(" 200"), "{status}: {plain}");
    let json: serde_json::Value = serde_json::from_str(&plain).unwrap_or_else(|e| panic!("{e}: {plain}"));
    let prompt_tokens = json["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 8 * 16, "the prompt must span several blocks and prefill chunks: {prompt_tokens} tokens");
    assert_eq!(json["usage"]["completion_tokens"].as_u64(), Some(120), "{json}");
    assert_eq!(json["choices"][0]["finish_reason"], "length", "{json}");

    let body = serde_json::json!({"prompt": prompt, "max_tokens": 120, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}).to_string();
    let (status, sse) = post(port, "/v1/completions", &body);
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let _ = child.wait();
    assert!(status.contains(" 200"), "{status}: {sse}");
    let chunks: Vec<serde_json::Value> =
        sse.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}"))).collect();
    let finishes: Vec<&serde_json::Value> = chunks.iter().filter_map(|c| c["choices"].get(0)).map(|c| &c["finish_reason"]).filter(|f| !f.is_null()).collect();
    assert_eq!(finishes, [&serde_json::json!("length")], "exactly one chunk carries the finish_reason");
    let text: String = chunks.iter().filter_map(|c| c["choices"].get(0)?["text"].as_str()).collect();
    assert_eq!(text, json["choices"][0]["text"].as_str().unwrap(), "streamed text differs from the non-streamed response");
    assert!(chunks.iter().any(|c| c["usage"]["completion_tokens"] == 120), "no usage chunk");
    assert!(sse.trim_end().ends_with("data: [DONE]"), "{sse}");
}
