//! A minimal HTTP/1.1 client for the tests (no extra dependencies): one request per connection.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub struct Resp {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// `data:` payloads of a server-sent-event stream.
    pub fn sse_data(&self) -> Vec<String> {
        self.body.lines().filter_map(|l| l.strip_prefix("data: ")).map(String::from).collect()
    }
}

/// The value of the series `series` (its name and any labels, as `/metrics` prints them, e.g.
/// `strata_batch_size_bucket{le="2.0"}`) in a `/metrics` body; panics, showing the body, when it
/// is absent.
pub fn metric(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in:\n{metrics}"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{series}: {e}"))
}

/// The id the server at `addr` serves (`GET /v1/models`), asked once per address.
pub fn served_model(addr: SocketAddr) -> String {
    served_model_with(addr, &[]).expect("a served model")
}

/// The same, sending `headers` (an API key); `None` when the server refuses to list its models.
fn served_model_with(addr: SocketAddr, headers: &[(&str, &str)]) -> Option<String> {
    static MODELS: std::sync::Mutex<Vec<(SocketAddr, String)>> = std::sync::Mutex::new(Vec::new());
    if let Some((_, m)) = MODELS.lock().unwrap().iter().find(|(a, _)| *a == addr) {
        return Some(m.clone());
    }
    let id = request_raw(addr, "GET", "/v1/models", headers, "").json()["data"][0]["id"]
        .as_str()?
        .to_string();
    MODELS.lock().unwrap().push((addr, id.clone()));
    Some(id)
}

/// Sends one request, as a well-behaved client does: a POST body that is a JSON object without
/// `model` gets the id the server serves (when the server lists it to these headers).
/// [`request_raw`] sends the body untouched.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Resp {
    if method == "POST" {
        if let Ok(serde_json::Value::Object(mut o)) =
            serde_json::from_str::<serde_json::Value>(body)
        {
            if let (false, Some(id)) = (o.contains_key("model"), served_model_with(addr, headers)) {
                o.insert("model".into(), id.into());
                return request_raw(
                    addr,
                    method,
                    path,
                    headers,
                    &serde_json::Value::Object(o).to_string(),
                );
            }
        }
    }
    request_raw(addr, method, path, headers, body)
}

pub fn request_raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type")) {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    // A server that refuses the request early (413 on an oversized body) answers and closes while
    // the body is still being written: the write then fails with a broken pipe or reset, but the
    // response is already in the receive queue. Read it, as curl does.
    if let Err(e) = s.write_all(body.as_bytes()) {
        use std::io::ErrorKind::{BrokenPipe, ConnectionReset};
        assert!(matches!(e.kind(), BrokenPipe | ConnectionReset), "writing the request body: {e}");
    }
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse(&raw)
}

pub fn parse(raw: &[u8]) -> Resp {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let body = if chunked { dechunk(rest) } else { rest.to_string() };
    Resp { status, headers: head.to_string(), body }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            out.push_str(&rest[..n.min(rest.len())]);
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

pub fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Resp {
    request(addr, "POST", path, &[], &body.to_string())
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], "")
}
