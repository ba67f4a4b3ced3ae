//! Many clients at once with one sequence slot: all finish (or get 503 past the queue bound), none
//! hang; a client that disconnects mid-stream frees its slot.

mod common;
mod http;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use serde_json::json;

fn stream_body(n: usize) -> String {
    json!({"messages": [{"role": "user", "content": format!("Write about the number {n}.")}], "max_tokens": 8, "temperature": 0, "stream": true}).to_string()
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn sixteen_clients(addr: std::net::SocketAddr) -> Vec<http::Resp> {
    let handles: Vec<_> = (0..16)
        .map(|i| {
            std::thread::spawn(move || {
                http::request(addr, "POST", "/v1/chat/completions", &[], &stream_body(i))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn sixteen_streaming_clients_with_one_slot() {
    let s = common::start(strata_server::ServerConfig {
        parallel: 1,
        queue_size: 16,
        ..common::config()
    });
    let addr = s.addr;
    sixteen_clients(addr); // warm-up: allocator pools, thread-local scratch
    let before = rss_kib();
    let handles: Vec<_> = (0..16)
        .map(|i| {
            std::thread::spawn(move || {
                http::request(addr, "POST", "/v1/chat/completions", &[], &stream_body(i))
            })
        })
        .collect();
    let mut ok = 0;
    for h in handles {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let data = r.sse_data();
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
        let fin: serde_json::Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
        assert!(fin["choices"][0]["finish_reason"].is_string());
        ok += 1;
    }
    assert_eq!(ok, 16);
    let after = rss_kib();
    eprintln!("RSS before {before} KiB, after {after} KiB");
    assert!(after as f64 <= before as f64 * 1.10, "RSS grew from {before} KiB to {after} KiB");
    let h = http::get(addr, "/health").json();
    assert_eq!((h["slots"]["active"].as_u64(), h["slots"]["queued"].as_u64()), (Some(0), Some(0)));
}

#[test]
fn full_queue_answers_503() {
    let s = common::start(strata_server::ServerConfig {
        parallel: 1,
        queue_size: 1,
        ..common::config()
    });
    let addr = s.addr;
    let body = json!({"prompt": "Count slowly:", "max_tokens": 48, "temperature": 0}).to_string();
    let handles: Vec<_> = (0..6)
        .map(|_| {
            let b = body.clone();
            std::thread::spawn(move || http::request(addr, "POST", "/v1/completions", &[], &b))
        })
        .collect();
    let statuses: Vec<u16> = handles.into_iter().map(|h| h.join().unwrap().status).collect();
    assert!(statuses.iter().all(|s| *s == 200 || *s == 503), "{statuses:?}");
    assert!(
        statuses.contains(&503),
        "6 requests on 1 slot + 1 queue place: some must be refused: {statuses:?}"
    );
    assert!(statuses.contains(&200), "{statuses:?}");
}

/// With `--defer-emission on` as well (the failed send is seen one step later).
#[test]
fn disconnect_cancels_generation() {
    for defer_emission in [None, Some(true)] {
        disconnect_cancels(defer_emission);
    }
}

fn disconnect_cancels(defer_emission: Option<bool>) {
    let s = common::start(strata_server::ServerConfig {
        max_tokens: 2000,
        defer_emission,
        ..common::config()
    });
    let body = json!({"model": http::served_model(s.addr), "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "stream": true, "ignore_eos": true}).to_string();
    let mut c = std::net::TcpStream::connect(s.addr).unwrap();
    write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 512];
    let _ = c.read(&mut buf).unwrap();
    // The response headers can precede the worker taking the job: wait (bounded) until it generates.
    let t = Instant::now();
    while http::get(s.addr, "/health").json()["slots"]["active"] != 1 {
        assert!(t.elapsed() < Duration::from_secs(10), "the request never started generating");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(c);
    let t = Instant::now();
    loop {
        let h = http::get(s.addr, "/health").json();
        if h["slots"]["active"] == 0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "generation not cancelled after the client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `--parallel 4`: concurrent requests share forward passes (`/metrics` shows batches of more than
/// one sequence) and each gets the greedy answer it gets alone.
/// With `--defer-emission on` as well (each decode token's text made during the next step).
#[test]
fn parallel_requests_share_passes_and_answer_as_alone() {
    for defer_emission in [None, Some(true)] {
        parallel_as_alone(defer_emission);
    }
}

fn parallel_as_alone(defer_emission: Option<bool>) {
    let s = common::start(strata_server::ServerConfig {
        parallel: 4,
        prefix_cache_bytes: 64 << 20,
        defer_emission,
        ..common::config()
    });
    let addr = s.addr;
    let body = |i: usize| json!({"model": http::served_model(addr), "prompt": format!("Story number {i}: once upon a time"), "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let alone: Vec<String> = (0..4)
        .map(|i| {
            http::post(addr, "/v1/completions", &body(i)).json()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let b = body(i);
            std::thread::spawn(move || http::post(addr, "/v1/completions", &b))
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["choices"][0]["text"], alone[i], "request {i} ({defer_emission:?})");
    }
    let metrics = http::get(addr, "/metrics").body;
    let value = |name: &str| http::metric(&metrics, name);
    let (sum, count) = (value("strata_batch_size_sum"), value("strata_batch_size_count"));
    assert!(sum / count > 1.0, "mean batch size {} over {count} steps", sum / count);
    // Every request looked for a cached prefix (these prompts are shorter than one 64-token block,
    // so none is found: the engine tests cover hits).
    assert_eq!(value("strata_prefix_cache_lookups_total"), 8.0);
}

/// `--batch-window`: requests arriving 100 ms apart wait for each other and share every pass
/// (`/metrics` records no step with fewer than all three sequences); the wait ends when the slots
/// are full, long before the 20 s window. Without a window the first request starts alone.
#[test]
fn batch_window_gathers_requests_arriving_apart() {
    let run = |window_ms: u64| {
        let s = common::start(strata_server::ServerConfig {
            parallel: 3,
            batch_window: Some(std::time::Duration::from_millis(window_ms)),
            ..common::config()
        });
        let addr = s.addr;
        let model = http::served_model(addr);
        let started = std::time::Instant::now();
        let handles: Vec<_> = (0..3)
            .map(|i| {
                std::thread::sleep(std::time::Duration::from_millis(100));
                let b = json!({"model": model, "prompt": format!("Story number {i}: once upon a time"), "max_tokens": 8, "temperature": 0, "ignore_eos": true});
                std::thread::spawn(move || http::post(addr, "/v1/completions", &b))
            })
            .collect();
        for h in handles {
            let r = h.join().unwrap();
            assert_eq!(r.status, 200, "{}", r.body);
        }
        let elapsed = started.elapsed();
        let metrics = http::get(addr, "/metrics").body;
        // Steps of at most 2 sequences: the histogram's `le="2"` bucket.
        let small_steps = http::metric(&metrics, "strata_batch_size_bucket{le=\"2.0\"}");
        (small_steps, elapsed)
    };
    let (small, elapsed) = run(20_000);
    assert_eq!(small, 0.0, "with a window every step holds all three requests");
    assert!(elapsed < std::time::Duration::from_secs(15), "the window ended early: {elapsed:?}");
    let (small, _) = run(0);
    assert!(small > 0.0, "without a window the first request starts alone");
}
