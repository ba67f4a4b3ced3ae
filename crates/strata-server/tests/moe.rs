//! `strata serve` on MoE models works unchanged: the tiny qwen3_moe (HF dir) and mixtral (GGUF)
//! fixtures answer chat and completion requests, and greedy output equals `Engine::generate`
//! (whose tokens `strata-engine/tests/moe_tiny.rs` checks against transformers).

mod common;
mod http;

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::json;
use strata_engine::{Engine, GenerateRequest, LoadOptions, SamplingParams};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/moe-tiny").join(name)
}

fn check(model: &str) {
    let opts = LoadOptions::new(256, candle_core::Device::Cpu);
    let engine = Arc::new(Engine::load(&fixture(model), &opts, &mut |_, _| {}).unwrap());
    let cfg = strata_server::ServerConfig {
        ctx_size: 256,
        max_tokens: 16,
        sampling: SamplingParams::greedy(),
        ..Default::default()
    };
    let server = common::start_with(engine.clone(), cfg);

    let prompt: Vec<u32> = vec![364, 223, 397, 100, 250];
    let r = http::post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{model}: {}", r.body);
    let body = r.json();
    assert_eq!(body["usage"]["completion_tokens"], 12, "{model}: {body}");
    let mut req = GenerateRequest::new(prompt, 12, SamplingParams::greedy());
    req.ignore_eos = true;
    let mut cache = engine.new_cache(256).unwrap();
    let gen = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
    assert_eq!(body["choices"][0]["text"].as_str().unwrap(), gen.text, "{model}");

    let r = http::post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": true}),
    );
    assert_eq!(r.status, 200, "{model}: {}", r.body);
    assert_eq!(r.sse_data().last().map(String::as_str), Some("[DONE]"), "{model}");
}

#[test]
fn serves_qwen3_moe_hf_dir() {
    check("qwen3_moe");
}

#[test]
fn serves_mixtral_gguf() {
    check("mixtral.gguf");
}

/// With `--stream-experts`: requests are answered, `/metrics` reports the expert reads, and a model
/// file truncated under the running server fails requests with a 5xx naming it while `/health`
/// keeps answering; once the file is back the server serves again.
#[test]
fn streams_experts_reports_metrics_and_survives_a_truncated_file() {
    let dir = std::env::temp_dir().join(format!("strata-server-stream-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    std::fs::copy(fixture("qwen3_moe.gguf"), &path).unwrap();
    let mut opts = LoadOptions::new(256, candle_core::Device::Cpu);
    opts.stream_experts = Some(strata_engine::StreamOptions {
        budget: strata_engine::CacheBudget::Percent(10.0),
        ..Default::default()
    });
    let engine = Arc::new(Engine::load(&path, &opts, &mut |_, _| {}).unwrap());
    let cfg = strata_server::ServerConfig {
        ctx_size: 256,
        max_tokens: 16,
        sampling: SamplingParams::greedy(),
        ..Default::default()
    };
    let server = common::start_with(engine, cfg);
    let body = json!({"prompt": [364, 223, 397, 100, 250], "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    assert_eq!(http::post(server.addr, "/v1/completions", &body).status, 200);
    let metrics = http::get(server.addr, "/metrics").body;
    let read = http::metric(&metrics, "strata_expert_read_bytes_total");
    assert!(read > 0.0, "{metrics}");
    assert!(metrics.contains("strata_ssd_read_bytes_per_second"), "{metrics}");
    // The prefetch gate measures the predictor on uncached experts whether or not it reads them.
    let candidates = http::metric(&metrics, "strata_expert_prefetch_candidates_total");
    assert!(candidates > 0.0, "{metrics}");

    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
    let other = json!({"prompt": [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 101, 102, 103], "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let r = http::post(server.addr, "/v1/completions", &other);
    assert!(r.status >= 500, "{} {}", r.status, r.body);
    assert!(r.body.contains("m.gguf"), "error names the file: {}", r.body);
    assert_eq!(http::get(server.addr, "/health").status, 200);
    std::fs::copy(fixture("qwen3_moe.gguf"), &path).unwrap();
    assert_eq!(http::post(server.addr, "/v1/completions", &other).status, 200);
    let _ = std::fs::remove_dir_all(&dir);
}
