//! The OpenAI API surface against a live server on 127.0.0.1 with SmolLM2: every endpoint, field
//! and error the server issue lists (status codes, shapes, finish_reason, usage arithmetic).

mod common;
mod http;

use std::ops::ControlFlow;

use serde_json::json;
use strata_engine::{GenerateRequest, SamplingParams};
use strata_formats::ChatMessage;

fn chat(content: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut b = json!({"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 12});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[test]
fn chat_completion_shape_and_usage() {
    let addr = common::shared();
    let r = http::post(
        addr,
        "/v1/chat/completions",
        &chat("Say hello.", json!({"user": "u1", "unknown_field": 5})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert!(v["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(v["model"], "SmolLM2-135M-Instruct.Q4_1");
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    assert!(!c["message"]["content"].as_str().unwrap().is_empty());
    assert!(["stop", "length"].contains(&c["finish_reason"].as_str().unwrap()));
    let u = &v["usage"];
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    assert!(u["completion_tokens"].as_u64().unwrap() <= 12);
    if c["finish_reason"] == "length" {
        assert_eq!(u["completion_tokens"], 12);
    }
}

#[test]
fn content_parts_and_max_completion_tokens() {
    let addr = common::shared();
    let body = json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Count: "}, {"type": "text", "text": "1, 2, 3"}]}],
                      "max_completion_tokens": 3, "temperature": 0});
    let r = http::post(addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[test]
fn greedy_chat_equals_engine_generate() {
    let addr = common::shared();
    let q = "What is the capital of France? Answer in one sentence.";
    let r = http::post(addr, "/v1/chat/completions", &chat(q, json!({"max_tokens": 24})));
    let server_text = r.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let engine = common::engine();
    let (_, ids) = engine.chat_prompt(&[ChatMessage::new("user", q)]).unwrap();
    let mut cache = engine.new_cache(2048).unwrap();
    let gen = engine
        .generate(&mut cache, &GenerateRequest::new(ids, 24, SamplingParams::greedy()), &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(server_text, gen.text);
}

#[test]
fn streaming_chat_chunks() {
    let addr = common::shared();
    let r = http::post(
        addr,
        "/v1/chat/completions",
        &chat(
            "Tell me a story.",
            json!({"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 10}),
        ),
    );
    assert_eq!(r.status, 200);
    assert!(
        r.headers.to_ascii_lowercase().contains("content-type: text/event-stream"),
        "{}",
        r.headers
    );
    let data = r.sse_data();
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<serde_json::Value> =
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], 10);
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    for c in &chunks[..chunks.len() - 2] {
        assert!(c["choices"][0]["finish_reason"].is_null());
    }
    let text: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    let r2 = http::post(
        addr,
        "/v1/chat/completions",
        &chat("Tell me a story.", json!({"max_tokens": 10})),
    );
    assert_eq!(
        text,
        r2.json()["choices"][0]["message"]["content"].as_str().unwrap(),
        "streamed text equals the non-streamed text"
    );
}

#[test]
fn stop_strings_and_seeded_sampling() {
    let addr = common::shared();
    let r = http::post(
        addr,
        "/v1/completions",
        &json!({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 30, "temperature": 0, "stop": [" 8"]}),
    );
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(!v["choices"][0]["text"].as_str().unwrap().contains(" 8"));
    let body = json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 42, "presence_penalty": 0.5, "frequency_penalty": 0.2, "repetition_penalty": 1.1, "top_k": 40, "min_p": 0.01});
    let a = http::post(addr, "/v1/completions", &body).json();
    let b = http::post(addr, "/v1/completions", &body).json();
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"], "same seed, same output");
}

#[test]
fn completions_string_and_token_prompts() {
    let addr = common::shared();
    let r = http::post(
        addr,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(text.starts_with(" Paris"), "{text}");
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    let r = http::post(
        addr,
        "/v1/completions",
        &json!({"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.json()["choices"][0]["text"].as_str().unwrap(), text);
    let r = http::post(
        addr,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "logprobs": 2}),
    );
    let lp = &r.json()["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
}

#[test]
fn chat_logprobs() {
    let addr = common::shared();
    let r = http::post(
        addr,
        "/v1/chat/completions",
        &chat("Hi", json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 4})),
    );
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), v["usage"]["completion_tokens"].as_u64().unwrap() as usize);
    for t in content {
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert!(
            (top[0]["logprob"].as_f64().unwrap() - t["logprob"].as_f64().unwrap()).abs() < 1e-6
        );
    }
}

#[test]
fn models_health_metrics() {
    let addr = common::shared();
    let v = http::get(addr, "/v1/models").json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    assert!(!v["data"][0]["id"].as_str().unwrap().contains('/'));
    let h = http::get(addr, "/health").json();
    assert_eq!(h["status"], "ok");
    assert_eq!(h["slots"]["total"], 1);
    http::post(addr, "/v1/completions", &json!({"prompt": "Hello", "max_tokens": 2}));
    let m = http::get(addr, "/metrics");
    assert_eq!(m.status, 200);
    for name in [
        "strata_requests_total",
        "strata_prompt_tokens_total",
        "strata_generated_tokens_total",
        "strata_time_to_first_token_seconds_bucket",
        "strata_token_latency_seconds_bucket",
        "strata_queue_depth",
    ] {
        assert!(m.body.contains(name), "{name} missing from /metrics:\n{}", m.body);
    }
}

fn assert_error(r: &http::Resp, status: u16, param: Option<&str>) -> serde_json::Value {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
    v
}

#[test]
fn client_errors_are_4xx_with_openai_bodies() {
    let addr = common::shared();
    let raw = |body: &str| http::request(addr, "POST", "/v1/chat/completions", &[], body);
    assert_error(&raw("{not json"), 400, None);
    assert_error(&raw("[1, 2]"), 400, None);
    assert_error(
        &http::post(addr, "/v1/chat/completions", &json!({"messages": []})),
        400,
        Some("messages"),
    );
    assert_error(&http::post(addr, "/v1/chat/completions", &json!({})), 400, Some("messages"));
    assert_error(
        &http::post(addr, "/v1/chat/completions", &json!({"messages": "hi"})),
        400,
        Some("messages"),
    );
    assert_error(
        &http::post(
            addr,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "wizard", "content": "x"}]}),
        ),
        400,
        Some("messages[0]"),
    );
    assert_error(
        &http::post(addr, "/v1/chat/completions", &chat("x", json!({"temperature": -1}))),
        400,
        Some("temperature"),
    );
    assert_error(
        &http::post(addr, "/v1/chat/completions", &chat("x", json!({"temperature": "hot"}))),
        400,
        Some("temperature"),
    );
    assert_error(
        &http::post(addr, "/v1/chat/completions", &chat("x", json!({"max_tokens": 0}))),
        400,
        Some("max_tokens"),
    );
    assert_error(
        &http::post(addr, "/v1/chat/completions", &chat("x", json!({"top_p": 1.5}))),
        400,
        Some("top_p"),
    );
    assert_error(
        &http::post(addr, "/v1/chat/completions", &chat("x", json!({"stop": 3}))),
        400,
        Some("stop"),
    );
    assert_error(
        &http::post(addr, "/v1/chat/completions", &chat("x", json!({"stream": "yes"}))),
        400,
        Some("stream"),
    );
    let v = assert_error(
        &http::post(addr, "/v1/chat/completions", &chat("x", json!({"n": 2}))),
        400,
        Some("n"),
    );
    assert!(v["error"]["message"].as_str().unwrap().contains("--parallel"));
    assert_error(
        &http::post(addr, "/v1/completions", &json!({"max_tokens": 3})),
        400,
        Some("prompt"),
    );
    assert_error(
        &http::post(addr, "/v1/completions", &json!({"prompt": [999999]})),
        400,
        Some("prompt"),
    );
    assert_error(
        &http::post(addr, "/v1/completions", &json!({"prompt": [1u64 << 40]})),
        400,
        Some("prompt"),
    );
    assert_error(
        &http::post(addr, "/v1/completions", &json!({"prompt": [-1]})),
        400,
        Some("prompt"),
    );
    assert_error(
        &http::post(addr, "/v1/completions", &json!({"prompt": [1.5]})),
        400,
        Some("prompt"),
    );
    let v = assert_error(
        &http::post(addr, "/v1/chat/completions", &chat("x", json!({"max_tokens": 5000}))),
        400,
        Some("messages"),
    );
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let long = "word ".repeat(3000);
    let v = assert_error(
        &http::post(addr, "/v1/completions", &json!({"prompt": long})),
        400,
        Some("prompt"),
    );
    assert_eq!(v["error"]["code"], "context_length_exceeded", "never silently truncated");
    assert_error(&http::get(addr, "/v1/nothing"), 404, None);
    assert_error(&http::get(addr, "/v1/chat/completions"), 405, None);
    let huge = format!("{{\"prompt\": \"{}\"}}", "a".repeat(9 << 20));
    assert_error(&http::request(addr, "POST", "/v1/completions", &[], &huge), 413, None);
    // The server still serves after all of that.
    assert_eq!(
        http::post(addr, "/v1/completions", &json!({"prompt": "Hi", "max_tokens": 1})).status,
        200
    );
}

#[test]
fn api_key_is_required_when_set() {
    let s = common::start(strata_server::ServerConfig {
        api_key: Some("sekret".into()),
        ..common::config()
    });
    let body = json!({"prompt": "Hi", "max_tokens": 1}).to_string();
    assert_error(&http::request(s.addr, "POST", "/v1/completions", &[], &body), 401, None);
    assert_error(
        &http::request(
            s.addr,
            "POST",
            "/v1/completions",
            &[("Authorization", "Bearer wrong")],
            &body,
        ),
        401,
        None,
    );
    assert_eq!(
        http::request(
            s.addr,
            "POST",
            "/v1/completions",
            &[("Authorization", "Bearer sekret")],
            &body
        )
        .status,
        200
    );
    // The scheme is case-insensitive (RFC 7235).
    assert_eq!(
        http::request(
            s.addr,
            "POST",
            "/v1/completions",
            &[("Authorization", "bearer sekret")],
            &body
        )
        .status,
        200
    );
    assert_error(
        &http::request(
            s.addr,
            "POST",
            "/v1/completions",
            &[("Authorization", "Basic sekret")],
            &body,
        ),
        401,
        None,
    );
    // /health stays open for load balancers, but says nothing more without the key.
    let open = http::get(s.addr, "/health");
    assert_eq!(open.status, 200);
    assert_eq!(open.json(), json!({"status": "ok"}));
    let full =
        http::request(s.addr, "GET", "/health", &[("Authorization", "Bearer sekret")], "").json();
    assert_eq!(full["slots"]["total"], 1, "{full}");
    assert!(
        !full.to_string().contains(".gguf") && !full.to_string().contains("/models"),
        "no file paths: {full}"
    );
}

#[test]
fn panic_in_generation_is_a_500_and_the_server_keeps_serving() {
    let engine = common::engine();
    let trigger = engine.text_prompt("PANIC NOW").unwrap();
    let s = common::start(strata_server::ServerConfig {
        panic_trigger: Some(trigger),
        ..common::config()
    }); // the `test-hooks` feature
    assert_error(
        &http::post(s.addr, "/v1/completions", &json!({"prompt": "PANIC NOW", "max_tokens": 2})),
        500,
        None,
    );
    let r = http::post(s.addr, "/v1/completions", &json!({"prompt": "Hello", "max_tokens": 2}));
    assert_eq!(r.status, 200, "{}", r.body);
    let r = http::post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "PANIC NOW", "max_tokens": 2, "stream": true}),
    );
    let data = r.sse_data();
    assert!(data.iter().any(|d| d.contains("\"error\"")), "{data:?}");
    assert_eq!(data.last().unwrap(), "[DONE]");
    assert_eq!(
        http::post(s.addr, "/v1/completions", &json!({"prompt": "Hello", "max_tokens": 2})).status,
        200
    );
}

#[test]
fn cors_preflight_and_headers() {
    let s = common::start(strata_server::ServerConfig {
        cors: Some("http://app.example".into()),
        ..common::config()
    });
    let r = http::request(
        s.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &[("Origin", "http://app.example"), ("Access-Control-Request-Method", "POST")],
        "",
    );
    assert!(r.status < 300, "{}", r.status);
    assert!(
        r.headers.to_ascii_lowercase().contains("access-control-allow-origin: http://app.example"),
        "{}",
        r.headers
    );
    let r = http::request(s.addr, "GET", "/v1/models", &[("Origin", "http://app.example")], "");
    assert!(
        r.headers.to_ascii_lowercase().contains("access-control-allow-origin: http://app.example"),
        "{}",
        r.headers
    );
}
