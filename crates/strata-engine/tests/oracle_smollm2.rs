//! SmolLM2-135M Q4_1 against llama.cpp b4748 (`tests/fixtures/smollm2-oracle/oracles.json`, from
//! `../shared/oracles/smollm2`): prompt token ids, greedy tokens, and first-token log-probabilities.

mod common;

use std::ops::ControlFlow;

use strata_engine::sampling::log_softmax;
use strata_engine::{GenerateRequest, SamplingParams};
use strata_models::Logits;

fn oracles() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(common::oracle("oracles.json")).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn prompt_tokens_match_llama_cpp() {
    let o = oracles();
    let engine = common::load_smollm2(512);
    for p in o["prompts"].as_array().unwrap() {
        let ours = engine.text_prompt(p["prompt"].as_str().unwrap()).unwrap();
        assert_eq!(ours, ids(&p["prompt_token_ids"]), "prompt {}", p["name"]);
    }
}

/// Steps where llama.cpp's own top-1/top-2 logprob gap is below this are near-ties: any other
/// float implementation (summation order, f16 KV cache, exp approximations) may pick either token.
/// Measured on this model: our top-5 log-probabilities deviate from llama.cpp's by 0.12–0.45
/// (median per prompt; p90 up to 0.85), so a gap under 0.5 can flip. A wrong model (e.g. NEOX
/// instead of interleaved RoPE) deviates by 3–6 (median), so these checks still catch real bugs.
const NEAR_TIE: f64 = 0.5;

fn top2_gap(step: &serde_json::Value) -> f64 {
    step["top5"][0][2].as_f64().unwrap() - step["top5"][1][2].as_f64().unwrap()
}

#[test]
fn first_token_logprobs_track_llama_cpp() {
    let o = oracles();
    let engine = common::load_smollm2(1024);
    let mut worst_alt = 0f32;
    for p in o["prompts"].as_array().unwrap() {
        let prompt = ids(&p["prompt_token_ids"]);
        let mut cache = engine.new_cache(1024).unwrap();
        let out = engine.model.forward(&prompt, &mut cache, Logits::Last, &[]).unwrap();
        let lp = log_softmax(&out.logits.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let top5 = p["greedy"]["first_token_top5"].as_array().unwrap();
        let best = top5[0]["id"].as_u64().unwrap() as usize;
        assert_eq!(strata_engine::sampling::argmax(&lp) as usize, best, "prompt {}", p["name"]);
        let want = top5[0]["logprob"].as_f64().unwrap() as f32;
        // Two f32 summation orders of the same kernels' integer sums (the file layout's ggml
        // order, `STRATA_CPU_INTERLEAVE=0`, and the row-interleaved layout) measured top-1
        // deviations up to 0.087 and 0.100 here (prompt `chat_template_capital`); a wrong model
        // deviates by several units.
        assert!(
            (lp[best] - want).abs() < 0.15,
            "prompt {} top-1 {best}: ours {} llama.cpp {want}",
            p["name"],
            lp[best]
        );
        for t in top5 {
            let id = t["id"].as_u64().unwrap() as usize;
            worst_alt = worst_alt.max((lp[id] - t["logprob"].as_f64().unwrap() as f32).abs());
        }
    }
    eprintln!("first token: largest top-5 deviation {worst_alt:.4}");
    assert!(worst_alt < 0.3, "top-5 alternatives deviate by {worst_alt}");
}

/// Teacher-forced over llama.cpp's 64 greedy tokens: we pick the same argmax at every step that is
/// not a near-tie, and our log-probabilities of its top-5 stay close.
#[test]
fn teacher_forced_logprobs_track_llama_cpp() {
    let o = oracles();
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
        let mut devs = Vec::new();
        for (step, t) in p["greedy"]["per_token_top5"].as_array().unwrap().iter().enumerate() {
            let lp = log_softmax(&rows[prompt.len() - 1 + step]);
            if top2_gap(t) >= NEAR_TIE {
                let ours = strata_engine::sampling::argmax(&lp);
                assert_eq!(
                    ours, gen[step],
                    "prompt {} step {step}: llama.cpp top5 {} ; ours: {ours} {} vs {} {}",
                    p["name"], t["top5"], lp[ours as usize], gen[step], lp[gen[step] as usize]
                );
            }
            let mut step_worst = 0f32;
            for alt in t["top5"].as_array().unwrap() {
                let id = alt[0].as_u64().unwrap() as usize;
                let want = alt[2].as_f64().unwrap() as f32;
                step_worst = step_worst.max((lp[id] - want).abs());
            }
            devs.push(step_worst);
            worst = worst.max(step_worst);
        }
        devs.sort_by(f32::total_cmp);
        eprintln!(
            "{}: per-step top-5 logprob deviation median {:.4}, p90 {:.4}, max {:.4}",
            p["name"],
            devs[devs.len() / 2],
            devs[devs.len() * 9 / 10],
            devs[devs.len() - 1]
        );
    }
    assert!(worst < 1.0, "largest logprob deviation {worst}");
}

/// Free-running greedy generation through the KV cache equals llama.cpp's tokens up to the first
/// near-tie (and at least 8 tokens); reports how many of 64 match.
#[test]
fn greedy_generation_matches_llama_cpp() {
    let o = oracles();
    let engine = common::load_smollm2(1024);
    let mut report = Vec::new();
    for p in o["prompts"].as_array().unwrap() {
        let want = ids(&p["greedy"]["generated_token_ids"]);
        let steps = p["greedy"]["per_token_top5"].as_array().unwrap();
        let mut req =
            GenerateRequest::new(ids(&p["prompt_token_ids"]), want.len(), SamplingParams::greedy());
        req.prefill_chunk = 512;
        let mut cache = engine.new_cache(1024).unwrap();
        let gen = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
        let same = gen.tokens.iter().zip(&want).take_while(|(a, b)| a == b).count();
        let first_tie = steps.iter().position(|t| top2_gap(t) < NEAR_TIE).unwrap_or(want.len());
        let gap = steps.get(same).map(top2_gap).unwrap_or(f64::NAN);
        report.push(format!("{}: {same}/{} tokens match (first llama.cpp near-tie at step {first_tie}; its top-2 gap where we differ: {gap:.3})", p["name"], want.len()));
        let need = first_tie.min(want.len()).max(8.min(want.len()));
        assert!(
            same >= need,
            "prompt {}: {same} tokens match, need {need}; ours {:?}",
            p["name"],
            gen.tokens
        );
    }
    eprintln!("{}", report.join("\n"));
}
