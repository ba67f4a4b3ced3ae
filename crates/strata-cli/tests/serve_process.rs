//! `strata serve` as a process: it logs its address, serves, and on SIGTERM during a stream exits
//! with status 0 within 5 s. Also runs the official `openai` Python client against it
//! (`scripts/test.sh` installs it; the test fails when it is missing).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn model() -> std::path::PathBuf {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let p = std::env::var_os("STRATA_MODELS_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("models"))
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} missing: run `strata fetch-default`", p.display());
    p
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts the server on SmolLM2 and waits for its "listening" log line.
fn spawn(port: u16) -> Child {
    spawn_with(
        port,
        &["--ctx-size", "2048", "-t", "2", "--temp", "0", "--model", &model().to_string_lossy()],
    )
}

/// Starts `strata serve --port PORT ARGS…` and waits for its "listening" log line.
// Callers wait for or kill the child they get.
#[allow(clippy::zombie_processes)]
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
    let body = r#"{"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": true, "stream": true}"#;
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 256];
    let n = c.read(&mut buf).unwrap();
    assert!(n > 0, "the response started before the signal");
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
    // The stream that was cut says so: a server_shutting_down error event, then [DONE].
    let mut rest = String::new();
    let _ = c.read_to_string(&mut rest);
    assert!(
        rest.contains("server_shutting_down") && rest.contains("[DONE]"),
        "stream did not end with the shutdown error and [DONE]: {rest}"
    );
}

/// SIGTERM while two long prompts are still prefilling (one streamed, one not): the prefill stops
/// between layers, each client gets a terminal answer naming the shutdown, and the server exits
/// 0 within 5 s.
#[test]
fn sigterm_during_prefill_ends_every_request_explicitly() {
    let port = free_port();
    let mut child = spawn_with(
        port,
        &[
            "--ctx-size",
            "2048",
            "-t",
            "2",
            "--temp",
            "0",
            "--parallel",
            "2",
            "--prefill-chunk",
            "2048",
            "--model",
            &model().to_string_lossy(),
        ],
    );
    // ~1900 tokens: several seconds of prefill on two cores.
    let prompt = "The quick brown fox jumps over the lazy dog near the river bank. ".repeat(140);
    let send = |stream: bool| {
        let body = serde_json::json!({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt, "max_tokens": 16, "stream": stream}).to_string();
        let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        c
    };
    let (mut streamed, mut plain) = (send(true), send(false));
    std::thread::sleep(Duration::from_millis(800));
    let t = Instant::now();
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let mut out = (String::new(), String::new());
    let _ = streamed.read_to_string(&mut out.0);
    let _ = plain.read_to_string(&mut out.1);
    let code = child.wait().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "exit took {:?}", t.elapsed());
    assert_eq!(code.code(), Some(0));
    assert!(
        out.0.contains(" 200 ")
            && out.0.contains("server_shutting_down")
            && out.0.contains("[DONE]"),
        "streamed client: {}",
        out.0
    );
    assert!(
        !out.0.contains("\"finish_reason\":\"stop\""),
        "a cut stream must not claim to have finished: {}",
        out.0
    );
    assert!(
        out.1.starts_with("HTTP/1.1 503") && out.1.contains("server_shutting_down"),
        "non-streamed client: {}",
        out.1
    );
}

#[test]
fn official_openai_python_client() {
    let has_openai = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(has_openai, "the `openai` Python package is not installed: `python3 -m pip install openai` (scripts/test.sh does)");
    let port = free_port();
    let mut child = spawn(port);
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../scripts/openai_client_check.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(format!("http://127.0.0.1:{port}/v1"))
        .output()
        .unwrap();
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let _ = child.wait();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
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
    let (head, mut rest) =
        out.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no header end: {out}"));
    let status = head.lines().next().unwrap_or_default().to_string();
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return (status, rest.to_string());
    }
    let mut body = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16)
            .unwrap_or_else(|e| panic!("bad chunk size `{size}`: {e}"));
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
    let fx = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/dflash-tiny");
    let (target, draft) = (fx.join("target"), fx.join("draft_memo"));
    let port = free_port();
    let args = [
        "--ctx-size",
        "1024",
        "-t",
        "2",
        "--temp",
        "0",
        "--prefill-chunk",
        "16",
        "--dflash",
        "--draft-model",
        &draft.to_string_lossy(),
        "--model",
        &target.to_string_lossy(),
    ];
    let mut child = spawn_with(port, &args);
    let prompt = "the quick brown fox jumps over the lazy dog while a random draft model proposes blocks of tokens. ".repeat(8);
    let body = serde_json::json!({"model": "target", "prompt": prompt, "max_tokens": 120, "ignore_eos": true}).to_string();
    let (status, plain) = post(port, "/v1/completions", &body);
    assert!(status.contains(" 200"), "{status}: {plain}");
    let json: serde_json::Value =
        serde_json::from_str(&plain).unwrap_or_else(|e| panic!("{e}: {plain}"));
    let prompt_tokens = json["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        prompt_tokens > 8 * 16,
        "the prompt must span several blocks and prefill chunks: {prompt_tokens} tokens"
    );
    assert_eq!(json["usage"]["completion_tokens"].as_u64(), Some(120), "{json}");
    assert_eq!(json["choices"][0]["finish_reason"], "length", "{json}");

    let body = serde_json::json!({"model": "target", "prompt": prompt, "max_tokens": 120, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}).to_string();
    let (status, sse) = post(port, "/v1/completions", &body);
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let _ = child.wait();
    assert!(status.contains(" 200"), "{status}: {sse}");
    let chunks: Vec<serde_json::Value> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect();
    let finishes: Vec<&serde_json::Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .map(|c| &c["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(
        finishes,
        [&serde_json::json!("length")],
        "exactly one chunk carries the finish_reason"
    );
    let text: String =
        chunks.iter().filter_map(|c| c["choices"].get(0)?["text"].as_str()).collect();
    assert_eq!(
        text,
        json["choices"][0]["text"].as_str().unwrap(),
        "streamed text differs from the non-streamed response"
    );
    assert!(chunks.iter().any(|c| c["usage"]["completion_tokens"] == 120), "no usage chunk");
    assert!(sse.trim_end().ends_with("data: [DONE]"), "{sse}");
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn get_status(port: u16, path: &str) -> u16 {
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    let _ = c.read_to_string(&mut out);
    out.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// 50 concurrent 1 MB prompts: each is refused from its size (it cannot fit the context) before
/// any tokenizer work; `/health` answers within 100 ms (p99) meanwhile, and the server's RSS is
/// back within 10% of where it started afterwards.
#[test]
fn huge_prompts_under_load_keep_health_fast_and_memory_returns() {
    let port = free_port();
    let mut child = spawn(port);
    let pid = child.id();
    let body = serde_json::json!({"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "lorem ipsum dolor sit amet ".repeat(40_000), "max_tokens": 1}).to_string();
    assert!(body.len() > 1_000_000);
    let (status, one) = post(port, "/v1/completions", &body);
    assert!(
        status.contains(" 400")
            && one.contains("context_length_exceeded")
            && one.contains("at least"),
        "{status}: {one}"
    );
    // Warm-up (allocator arenas of the runtime and blocking threads), then the baseline.
    let warm: Vec<_> = (0..8)
        .map(|_| {
            let b = body.clone();
            std::thread::spawn(move || post(port, "/v1/completions", &b))
        })
        .collect();
    warm.into_iter().for_each(|h| {
        h.join().unwrap();
    });
    std::thread::sleep(Duration::from_millis(300));
    let before = rss_kib(pid);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut lat = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let t = Instant::now();
                assert_eq!(get_status(port, "/health"), 200);
                lat.push(t.elapsed());
                std::thread::sleep(Duration::from_millis(5));
            }
            lat
        })
    };
    let clients: Vec<_> = (0..50)
        .map(|_| {
            let b = body.clone();
            std::thread::spawn(move || post(port, "/v1/completions", &b).0)
        })
        .collect();
    let statuses: Vec<String> = clients.into_iter().map(|h| h.join().unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut lat = prober.join().unwrap();
    let after = rss_kib(pid);
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let _ = child.wait();
    lat.sort();
    let p99 = lat[(lat.len() * 99 / 100).min(lat.len() - 1)];
    eprintln!("/health p99 {p99:?} over {} probes; server RSS {before} → {after} KiB", lat.len());
    assert!(statuses.iter().all(|s| s.contains(" 400")), "{statuses:?}");
    assert!(p99 < Duration::from_millis(100), "/health p99 {p99:?}");
    assert!(
        after as f64 <= before as f64 * 1.10,
        "server RSS grew from {before} KiB to {after} KiB"
    );
}

/// `--parallel 0` and `--batch-tokens` other than `auto` or a positive count are refused by the
/// argument parser; `serve --help` never prints the API key.
#[test]
fn serve_flags_are_checked_and_the_key_is_not_shown() {
    for (flag, value) in [("--parallel", "0"), ("--batch-tokens", "0"), ("--batch-tokens", "many")]
    {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["serve", flag, value])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag} {value}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(flag),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--help"])
        .env("STRATA_API_KEY", "hunter2-secret")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("STRATA_API_KEY") && !help.contains("hunter2-secret"), "{help}");
}

/// The plan counts one KV cache per `--parallel` slot (and the prefix cache): `serve --parallel 64`
/// where 64 caches do not fit is refused at start (exit 2, saying what to lower); `info` says
/// the same, and a `--parallel` that fits is planned, with a fixed or an `auto` prefix cache.
#[test]
fn parallel_slots_that_do_not_fit_are_refused_by_the_plan() {
    let m = model().to_string_lossy().into_owned();
    // SmolLM2: 23 KB of f16 KV per token (the default); 64 × 4096 tokens = 6 GB, 2 GB of RAM.
    let args = ["--model", &m, "--ctx-size", "4096", "--ram", "2GiB", "--parallel", "64"];
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--port", &free_port().to_string()])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--parallel") && err.contains("would fit"), "{err}");
    let info = |extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["info", "--json", "--model", &m, "--ctx-size", "4096", "--ram", "2GiB"])
            .args(extra)
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (o.status.code(), v)
    };
    let (code, v) = info(&["--parallel", "64"]);
    assert_eq!(code, Some(2));
    assert_eq!(v["strategy"], "TOO-LARGE", "{v}");
    let per_slot = v["memory"]["kv_cache"].as_u64().unwrap() / 64;
    let (code, v) = info(&["--parallel", "4", "--prefix-cache", "256MiB"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["parallel"], 4);
    assert_eq!(v["memory"]["kv_cache"].as_u64().unwrap(), 4 * per_slot);
    assert_eq!(v["memory"]["prefix_cache"].as_u64().unwrap(), 256 << 20);
    // `auto` (serve's default): half of what the plan without a prefix cache leaves free.
    let m0 = &v["memory"];
    let free = m0["available"].as_u64().unwrap()
        - (m0["resident_total"].as_u64().unwrap() - (256 << 20))
        - m0["reserve"].as_u64().unwrap();
    let (code, v) = info(&["--parallel", "4", "--prefix-cache", "auto"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["memory"]["prefix_cache"].as_u64().unwrap(), free / 2, "{v}");
}

/// Issue 27's API surface through the official `openai` client (`scripts/openai_api_check.py`):
/// tool round trips, `tool_choice` required / named, 20 JSON schemas validated with `jsonschema`,
/// JSON mode, `n`, `logit_bias`, embeddings, refused fields.
#[test]
fn openai_client_tools_structured_outputs_and_more() {
    let m = model();
    let port = free_port();
    let mut child = spawn_with(
        port,
        &["--ctx-size", "2048", "-t", "2", "--parallel", "3", "--model", &m.to_string_lossy()],
    );
    // The id greedy decoding starts with, for the logit_bias check, and the model's width.
    let engine = strata_engine::Engine::load(
        &m,
        &strata_engine::LoadOptions::new(64, candle_core::Device::Cpu),
        &mut |_, _| {},
    )
    .unwrap();
    let req = strata_engine::GenerateRequest::new(
        engine.text_prompt("The capital of France is").unwrap(),
        1,
        strata_engine::SamplingParams::greedy(),
    );
    let mut cache = engine.new_cache(64).unwrap();
    let first =
        engine.generate(&mut cache, &req, &mut |_| std::ops::ControlFlow::Continue(())).unwrap();
    let args = [
        format!("http://127.0.0.1:{port}/v1"),
        first.tokens[0].to_string(),
        engine.model.config().hidden_size.to_string(),
    ];
    run_check_script(&mut child, "openai_api_check.py", &args, "openai api check");
}

/// Runs `scripts/NAME` with `args` against the server `child`, stops the server, and asserts the
/// script succeeded and printed `"{what}: ok"` (its output is shown).
fn run_check_script(child: &mut std::process::Child, name: &str, args: &[String], what: &str) {
    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts").join(name);
    let out = Command::new("python3").arg(script).args(args).output().unwrap();
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let _ = child.wait();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{text}");
    assert!(out.status.success(), "{what} failed:\n{text}");
    assert!(text.contains(&format!("{what}: ok")), "{text}");
}

/// The chat page at `/` in a real headless Chromium (`scripts/web_chat_check.py`, selenium with
/// Debian's chromium and chromedriver, which `scripts/test.sh` installs): a message sent from the
/// page gets a streamed answer on the page; the screenshot is left in the test output directory.
#[test]
fn web_chat_page_answers_in_chromium() {
    let port = free_port();
    let mut child = spawn(port);
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("test-output");
    std::fs::create_dir_all(&dir).unwrap();
    let shot = dir.join("web_chat.png");
    let _ = std::fs::remove_file(&shot);
    let args = [format!("http://127.0.0.1:{port}"), shot.to_string_lossy().into_owned()];
    run_check_script(&mut child, "web_chat_check.py", &args, "web chat check");
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "screenshot at {}", shot.display());
    eprintln!("screenshot: {}", shot.display());
}
