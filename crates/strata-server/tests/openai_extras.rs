//! Structured outputs, tool calls, `n`, `logit_bias`, embeddings and the chat page over HTTP
//! (the official-client version of these checks is `scripts/openai_api_check.py`).

mod common;
mod http;

use serde_json::{json, Value};

fn server() -> common::Server {
    common::start(strata_server::ServerConfig { parallel: 3, max_tokens: 256, ..common::config() })
}

#[test]
fn json_schema_tools_n_and_logit_bias() {
    let s = server();
    let model = http::served_model(s.addr);
    let chat = |extra: Value| {
        let mut b = json!({"model": model, "messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 80, "temperature": 0});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let r = http::post(s.addr, "/v1/chat/completions", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let schema = json!({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": "string", "maxLength": 20}}, "required": ["answer", "why"], "additionalProperties": false});
    let r = chat(
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": true}}}),
    );
    let v: Value =
        serde_json::from_str(r["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    assert!(v["answer"] == "yes" || v["answer"] == "no", "{v}");
    assert!(v["why"].as_str().unwrap().chars().count() <= 20);

    let tool = json!({"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 16}}, "required": ["q"]}}});
    let r = chat(
        json!({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "lookup"}}, "parallel_tool_calls": false}),
    );
    let c = &r["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{r}");
    let call = &c["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "lookup");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["q"].is_string(), "{args}");
    assert!(c["message"]["content"].is_null());

    let r = chat(json!({"n": 3, "temperature": 1.0, "seed": 5, "max_tokens": 6}));
    let idx: Vec<u64> =
        r["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(idx, [0, 1, 2]);
    assert_eq!(r["usage"]["completion_tokens"].as_u64().unwrap(), 18);

    // logit_bias: the greedy first token, banned, is never emitted.
    let comp = |extra: Value| {
        let mut b = json!({"model": model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 0});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        http::post(s.addr, "/v1/completions", &b).json()
    };
    let engine = common::engine();
    let first =
        comp(json!({}))["choices"][0]["logprobs"]["tokens"][0].as_str().unwrap().to_string();
    let id = engine.tokenizer.encode(&first, false).unwrap()[0];
    let biased = comp(json!({"logit_bias": {id.to_string(): -100}}));
    let toks = biased["choices"][0]["logprobs"]["tokens"].as_array().unwrap().clone();
    assert!(!toks.iter().any(|t| t == first.as_str()), "{first:?} in {toks:?}");
}

#[test]
fn embeddings_have_the_model_width_and_are_deterministic() {
    let s = server();
    let model = http::served_model(s.addr);
    let embed = |input: Value| {
        let r = http::post(s.addr, "/v1/embeddings", &json!({"model": model, "input": input}));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let a = embed(json!(["hello world", "the sky is blue"]));
    let b = embed(json!("hello world"));
    let width = common::engine().model.config().hidden_size;
    let v = |r: &Value, i: usize| -> Vec<f64> {
        r["data"][i]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
    };
    assert_eq!(v(&a, 0).len(), width);
    assert_eq!(v(&a, 0), v(&b, 0), "the same input gives the same vector");
    let norm: f64 = v(&a, 1).iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    assert_ne!(v(&a, 0), v(&a, 1));
    let r = http::post(
        s.addr,
        "/v1/embeddings",
        &json!({"model": model, "input": "x", "dimensions": 8}),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "dimensions");
}

#[test]
fn the_chat_page_is_served_at_the_root() {
    let s = server();
    let r = http::get(s.addr, "/");
    assert_eq!(r.status, 200);
    assert!(
        r.body.contains("<title>Strata chat</title>") && r.body.contains("/v1/chat/completions")
    );
}
