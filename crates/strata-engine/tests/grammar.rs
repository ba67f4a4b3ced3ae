//! Constrained decoding and logit bias on SmolLM2: outputs follow a JSON schema, a Lark grammar and
//! a regex under greedy and sampled decoding; `logit_bias` −100 removes a token; speculative
//! decoding under a grammar or a bias stays lossless (greedy: the same tokens as plain decoding).

mod common;

use std::ops::ControlFlow;

use serde_json::{json, Value};
use strata_engine::{
    DraftSource, Engine, FinishReason, GenerateRequest, Generation, LoadOptions, NgramParams,
    SamplingParams, SpecConfig,
};
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

/// Speculation under a mask: drafts are cut to what the grammar accepts and verified against the
/// masked distributions, so greedy output equals plain greedy output token for token with every
/// draft source; sampled output still follows the schema; drafts were really proposed and accepted
/// (speculation ran, it was not turned off for these requests). The same under `logit_bias`.
#[test]
fn speculation_stays_lossless_under_a_grammar_and_a_bias() {
    let mut engine = common::load_smollm2(512);
    let schema = json!({
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "minItems": 3,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "rgb": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
                    "required": ["name", "rgb"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["colors"],
        "additionalProperties": false
    });
    let grammar = Some(GrammarSpec::JsonSchema(schema));
    let prompt = "Give three colors with their hex codes as JSON.";
    let bias_prompt = engine.text_prompt("The capital of France is").unwrap();
    let biased = |engine: &Engine, banned: u32| {
        let mut req = GenerateRequest::new(bias_prompt.clone(), 48, SamplingParams::greedy());
        req.ignore_eos = true;
        req.logit_bias = vec![(banned, -100.0)];
        let mut cache = engine.new_cache(512).unwrap();
        engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap()
    };
    let plain = run(&engine, prompt, grammar.clone(), SamplingParams::greedy());
    assert_eq!(plain.finish_reason, FinishReason::Stop, "{}", plain.text);
    let banned = biased(&engine, u32::MAX).tokens[0];
    let plain_biased = biased(&engine, banned);
    assert!(!plain_biased.tokens.contains(&banned));

    let draft = Engine::load_draft_model(
        &common::smollm2_path(),
        &LoadOptions::new(512, candle_core::Device::Cpu),
    )
    .unwrap()
    .0;
    let sources = [
        ("ngram", DraftSource::Ngram(NgramParams { max: 3, min: 1 })),
        ("self 20 layers", DraftSource::SelfDraft { layers: 20 }),
        ("draft model", DraftSource::Model(draft)),
    ];
    for (name, source) in sources {
        engine.set_speculation(Some(SpecConfig { source, max_draft: 4, fixed: Some(4) })).unwrap();
        let g = run(&engine, prompt, grammar.clone(), SamplingParams::greedy());
        let s = g.spec.as_ref().expect("speculation ran");
        eprintln!("{name}: {}", s.summary());
        assert!(s.drafted > 0 && s.accepted > 0, "{name}: {}", s.summary());
        assert_eq!(g.tokens, plain.tokens, "{name}: {} vs {}", g.text, plain.text);
        for seed in 1..3 {
            let g = run(&engine, prompt, grammar.clone(), sampled(seed));
            assert!(g.spec.as_ref().is_some_and(|s| s.drafted > 0), "{name}");
            let v: Value =
                serde_json::from_str(&g.text).unwrap_or_else(|e| panic!("{name}: {e}: {}", g.text));
            assert_eq!(v["colors"].as_array().unwrap().len(), 3, "{name}: {v}");
        }
        let g = biased(&engine, banned);
        assert!(g.spec.as_ref().is_some_and(|s| s.accepted > 0), "{name}");
        assert_eq!(g.tokens, plain_biased.tokens, "{name} under logit_bias");
    }
}
