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
    let cfg = strata_server::ServerConfig { ctx_size: 256, max_tokens: 16, sampling: SamplingParams::greedy(), ..Default::default() };
    let server = common::start_with(engine.clone(), cfg);

    let prompt: Vec<u32> = vec![364, 223, 397, 100, 250];
    let r = http::post(server.addr, "/v1/completions", &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true}));
    assert_eq!(r.status, 200, "{model}: {}", r.body);
    let body = r.json();
    assert_eq!(body["usage"]["completion_tokens"], 12, "{model}: {body}");
    let mut req = GenerateRequest::new(prompt, 12, SamplingParams::greedy());
    req.ignore_eos = true;
    let mut cache = engine.new_cache(256).unwrap();
    let gen = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
    assert_eq!(body["choices"][0]["text"].as_str().unwrap(), gen.text, "{model}");

    let r = http::post(server.addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": true}));
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
