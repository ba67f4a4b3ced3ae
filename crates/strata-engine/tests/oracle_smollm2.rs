//! SmolLM2-135M Q4_1 against llama.cpp b4748 (`../shared/oracles/smollm2/oracles.json`): prompt token
//! ids, greedy tokens, and first-token log-probabilities.

mod common;

use std::ops::ControlFlow;

use strata_engine::sampling::log_softmax;
use strata_engine::{GenerateRequest, SamplingParams};
use strata_models::Logits;

fn oracles() -> Option<serde_json::Value> {
    let p = common::shared("oracles/smollm2/oracles.json")?;
    Some(serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn prompt_tokens_match_llama_cpp() {
    let Some(o) = oracles() else { return };
    let engine = common::load_smollm2(512);
    for p in o["prompts"].as_array().unwrap() {
        let ours = engine.text_prompt(p["prompt"].as_str().unwrap()).unwrap();
        assert_eq!(ours, ids(&p["prompt_token_ids"]), "prompt {}", p["name"]);
    }
}

#[test]
fn first_token_logprobs_within_0_05() {
    let Some(o) = oracles() else { return };
    let engine = common::load_smollm2(1024);
    for p in o["prompts"].as_array().unwrap() {
        let prompt = ids(&p["prompt_token_ids"]);
        let mut cache = engine.new_cache(1024).unwrap();
        let out = engine.model.forward(&prompt, &mut cache, Logits::Last, &[]).unwrap();
        let lp = log_softmax(&out.logits.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        for t in p["greedy"]["first_token_top5"].as_array().unwrap() {
            let id = t["id"].as_u64().unwrap() as usize;
            let want = t["logprob"].as_f64().unwrap() as f32;
            assert!((lp[id] - want).abs() < 0.05, "prompt {} token {id}: ours {} llama.cpp {want}", p["name"], lp[id]);
        }
    }
}

/// Teacher-forced over llama.cpp's 64 greedy tokens: our log-probabilities of its top-5 at every
/// step. Reports the largest deviation; asserts it stays small.
#[test]
fn teacher_forced_logprobs_track_llama_cpp() {
    let Some(o) = oracles() else { return };
    let engine = common::load_smollm2(1024);
    let mut worst = 0f32;
    for p in o["prompts"].as_array().unwrap() {
        let prompt = ids(&p["prompt_token_ids"]);
        let gen = ids(&p["greedy"]["generated_token_ids"]);
        let mut all = prompt.clone();
        all.extend_from_slice(&gen[..gen.len() - 1]);
        let mut cache = engine.new_cache(1024).unwrap();
        let out = engine.model.forward(&all, &mut cache, Logits::All, &[]).unwrap();
        let rows: Vec<Vec<f32>> = out.logits.to_vec2().unwrap();
        for (step, t) in p["greedy"]["per_token_top5"].as_array().unwrap().iter().enumerate() {
            let lp = log_softmax(&rows[prompt.len() - 1 + step]);
            for alt in t["top5"].as_array().unwrap() {
                let id = alt[0].as_u64().unwrap() as usize;
                let want = alt[2].as_f64().unwrap() as f32;
                worst = worst.max((lp[id] - want).abs());
            }
        }
    }
    eprintln!("largest |logprob - llama.cpp| over all steps and top-5 alternatives: {worst:.4}");
    assert!(worst < 0.1, "largest logprob deviation {worst}");
}

#[test]
fn greedy_generation_matches_llama_cpp() {
    let Some(o) = oracles() else { return };
    let engine = common::load_smollm2(1024);
    let mut report = Vec::new();
    for p in o["prompts"].as_array().unwrap() {
        let want = ids(&p["greedy"]["generated_token_ids"]);
        let mut req = GenerateRequest::new(ids(&p["prompt_token_ids"]), want.len(), SamplingParams::greedy());
        req.prefill_chunk = 512;
        let mut cache = engine.new_cache(1024).unwrap();
        let gen = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
        let same = gen.tokens.iter().zip(&want).take_while(|(a, b)| a == b).count();
        report.push(format!("{}: {same}/{} tokens match", p["name"], want.len()));
        let n = want.len().min(32);
        assert_eq!(&gen.tokens[..n.min(gen.tokens.len())], &want[..n], "prompt {}: first {n} greedy ids", p["name"]);
    }
    eprintln!("{}", report.join("\n"));
}
