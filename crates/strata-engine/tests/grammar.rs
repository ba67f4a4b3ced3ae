//! Constrained decoding and logit bias on SmolLM2: outputs follow a JSON schema, a Lark grammar and
//! a regex under greedy and sampled decoding; `logit_bias` −100 removes a token.

mod common;

use std::ops::ControlFlow;

use serde_json::{json, Value};
use strata_engine::{Engine, FinishReason, GenerateRequest, Generation, SamplingParams};
use strata_grammar::GrammarSpec;

fn run(
    engine: &Engine,
    prompt: &str,
    grammar: Option<GrammarSpec>,
    sampling: SamplingParams,
) -> Generation {
    let mut req = GenerateRequest::new(engine.text_prompt(prompt).unwrap(), 96, sampling);
    req.grammar = grammar;
    let mut cache = engine.new_cache(512).unwrap();
    engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap()
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.9, seed: Some(seed), ..SamplingParams::default() }
}

#[test]
fn outputs_follow_a_json_schema() {
    let engine = common::load_smollm2(512);
    let schema = json!({
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}
        },
        "required": ["answer", "confidence", "tags"],
        "additionalProperties": false
    });
    for sampling in [SamplingParams::greedy(), sampled(1), sampled(2)] {
        let g = run(
            &engine,
            "Is the sky blue? Reply in JSON.",
            Some(GrammarSpec::JsonSchema(schema.clone())),
            sampling,
        );
        assert_eq!(g.finish_reason, FinishReason::Stop, "{}", g.text);
        let v: Value = serde_json::from_str(&g.text).unwrap_or_else(|e| panic!("{e}: {}", g.text));
        assert!(["yes", "no"].contains(&v["answer"].as_str().unwrap()), "{v}");
        let c = v["confidence"].as_i64().unwrap();
        assert!((0..=100).contains(&c), "{v}");
        assert!(v["tags"].as_array().unwrap().len() <= 2);
        assert_eq!(v.as_object().unwrap().len(), 3);
        let m = g.mask.expect("mask stats");
        assert_eq!(m.masks as usize, g.tokens.len());
    }
}

#[test]
fn outputs_follow_a_lark_grammar_and_a_regex() {
    let engine = common::load_smollm2(512);
    for seed in 0..3 {
        let g = run(
            &engine,
            "Answer with one word. Is water wet?",
            Some(GrammarSpec::Lark("start: \"yes\" | \"no\" | \"maybe\"".into())),
            sampled(seed),
        );
        assert!(["yes", "no", "maybe"].contains(&g.text.as_str()), "{:?}", g.text);
        let g = run(
            &engine,
            "My phone number is",
            Some(GrammarSpec::Regex(r"\d{3}-\d{4}".into())),
            sampled(seed),
        );
        assert_eq!(g.text.len(), 8, "{:?}", g.text);
        assert!(g.text.chars().enumerate().all(|(i, c)| if i == 3 {
            c == '-'
        } else {
            c.is_ascii_digit()
        }));
    }
    let engine2 = common::load_smollm2(512);
    let bad = engine2.grammars().unwrap().compile(&GrammarSpec::Lark("start: (".into()));
    assert!(bad.is_err());
}

#[test]
fn logit_bias_minus_100_removes_a_token() {
    let engine = common::load_smollm2(512);
    let prompt = engine.text_prompt("The capital of France is").unwrap();
    let mut req = GenerateRequest::new(prompt, 24, SamplingParams::greedy());
    req.ignore_eos = true;
    let mut cache = engine.new_cache(512).unwrap();
    let plain = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
    let banned = plain.tokens[0];
    req.logit_bias = vec![(banned, -100.0)];
    let biased = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
    assert!(!biased.tokens.contains(&banned), "{:?}", biased.tokens);
    assert_ne!(biased.tokens[0], plain.tokens[0]);
    // +100 on a token makes it the greedy choice.
    req.logit_bias = vec![(42, 100.0)];
    let forced = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
    assert!(forced.tokens.iter().all(|&t| t == 42));
}
