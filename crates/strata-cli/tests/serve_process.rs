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

/// Starts the server and waits for its "listening" log line.
fn spawn(port: u16) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "--port", &port.to_string(), "--ctx-size", "2048", "-t", "2", "--temp", "0", "--model"])
        .arg(model())
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
