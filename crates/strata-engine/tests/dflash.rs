//! DFlash block-diffusion drafting against z-lab's own code: `tests/fixtures/dflash-tiny`
//! (copied from `../shared/fixtures/dflash-tiny`; tiny Qwen3 target, two z-lab-format drafts,
//! `reference.json` from z-lab/dflash at commit 44947fbf, float32 on CPU).

mod common;

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;

use strata_engine::{
    DraftSource, Engine, GenerateRequest, LoadOptions, Sampler, SamplingParams, SpecConfig,
    Speculator,
};

fn fixture(rel: &str) -> PathBuf {
    common::repo_root().join("tests/fixtures/dflash-tiny").join(rel)
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("reference.json")).unwrap()).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn dflash(engine: &Engine, draft: &str, fixed: bool) -> SpecConfig {
    let opts = LoadOptions::new(256, candle_core::Device::Cpu);
    let (draft, _) = Engine::load_dflash_draft(&fixture(draft), &opts, &engine.model).unwrap();
    assert_eq!((draft.block_size(), draft.mask_token_id()), (8, 511));
    SpecConfig {
        source: DraftSource::DFlash { draft: Arc::clone(&draft), block_size: 8 },
        max_draft: 7,
        fixed: fixed.then_some(7),
    }
}

/// Every round of both drafts equals z-lab's: block start, the draft's tokens at all 7 block
/// positions, accepted length, committed tokens (accepted drafts + bonus); the first two rounds'
/// draft logits within 1e-4; the output equals the target's greedy ids.
#[test]
fn rounds_equal_zlab_reference() {
    let r = reference();
    let engine = common::load(&fixture("target"), 256);
    let prompt = ids(&r["input_ids"]);
    let greedy = ids(&r["target_greedy_ids"]);
    for name in ["draft_random", "draft_memo"] {
        let want = &r["drafts"][name];
        let cfg = dflash(&engine, name, true);
        cfg.validate(&engine.model).unwrap();
        let mut cache = engine.new_cache(256).unwrap();
        // Prefill chunk 5 < 24 prompt tokens: the context features arrive in pieces.
        let mut spec = Speculator::new(&engine.model, &cfg, cache.capacity(), false, 5).unwrap();
        spec.trace = Some(Vec::new());
        let logits = spec.prefill(&mut cache, &prompt, &|| false).unwrap();
        let first = strata_engine::sampling::argmax(&logits);
        assert_eq!(first as u64, want["prefill_first_token"].as_u64().unwrap(), "{name}");
        let mut sampler = Sampler::new(SamplingParams::greedy());
        let mut history = prompt.clone();
        history.push(first);
        let mut out = vec![first];
        // z-lab's loop runs until its output holds more than the 48 tokens asked for (49 here) and
        // drafts full blocks to the end; ask for a block more so that no round of ours is cut short.
        while out.len() <= greedy.len() {
            let emitted = spec
                .round(&mut cache, &history, &mut sampler, greedy.len() + 8 - out.len(), None)
                .unwrap();
            for (t, _) in emitted {
                out.push(t);
                history.push(t);
            }
        }
        assert_eq!(
            &out[..greedy.len()],
            &greedy[..],
            "{name}: output differs from the target's greedy ids"
        );
        assert_eq!(&out[..greedy.len()], &ids(&want["output_ids"])[..], "{name}");
        let rounds = want["rounds"].as_array().unwrap();
        let trace = spec.trace.as_ref().unwrap();
        assert_eq!(trace.len(), rounds.len(), "{name}: rounds");
        for (got, w) in trace.iter().zip(rounds) {
            let i = w["round"].as_u64().unwrap();
            assert_eq!(got.start as u64, w["start"].as_u64().unwrap(), "{name} round {i}: start");
            assert_eq!(got.block_argmax, ids(&w["draft_tokens"]), "{name} round {i}: draft tokens");
            assert_eq!(got.drafts, ids(&w["draft_tokens"]), "{name} round {i}: verified drafts");
            assert_eq!(
                got.accepted as u64,
                w["accepted"].as_u64().unwrap(),
                "{name} round {i}: accepted"
            );
            assert_eq!(
                got.emitted,
                ids(&w["committed"]),
                "{name} round {i}: committed (accepted + bonus)"
            );
            assert_eq!(
                *got.emitted.last().unwrap() as u64,
                w["bonus"].as_u64().unwrap(),
                "{name} round {i}: bonus"
            );
        }
        for d in want["round_detail"].as_array().unwrap() {
            let i = d["round"].as_u64().unwrap() as usize;
            let rows = d["draft_logits"].as_array().unwrap(); // [7][512] (batch dim dropped)
            let got = &trace[i].draft_logits;
            assert_eq!(got.len(), rows.len(), "{name} round {i}");
            let mut worst = 0f64;
            for (g, w) in got.iter().zip(rows) {
                let w = w.as_array().unwrap();
                assert_eq!(g.len(), w.len());
                for (a, b) in g.iter().zip(w) {
                    worst = worst.max((*a as f64 - b.as_f64().unwrap()).abs());
                }
            }
            eprintln!("{name} round {i}: max |draft logit − z-lab| = {worst:.2e}");
            assert!(worst < 1e-4, "{name} round {i}: draft logits differ from z-lab's by {worst}");
        }
        let accepted: u64 = rounds.iter().map(|w| w["accepted"].as_u64().unwrap()).sum();
        assert_eq!(spec.stats.accepted, accepted, "{name}: accepted tokens over the run");
    }
}

/// Through `Engine::generate` (the CLI's and server's path): output equals plain greedy decoding
/// for both policies; the trained draft is accepted as in the reference.
#[test]
fn generate_with_dflash_equals_plain_greedy() {
    let r = reference();
    let mut engine = common::load(&fixture("target"), 256);
    let greedy = ids(&r["target_greedy_ids"]);
    for (name, fixed) in [("draft_memo", true), ("draft_memo", false), ("draft_random", false)] {
        let cfg = dflash(&engine, name, fixed);
        engine.set_speculation(Some(cfg)).unwrap();
        let mut req =
            GenerateRequest::new(ids(&r["input_ids"]), greedy.len(), SamplingParams::greedy());
        req.ignore_eos = true;
        req.prefill_chunk = 7;
        let mut cache = engine.new_cache(256).unwrap();
        let g = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
        assert_eq!(g.tokens, greedy, "{name} fixed={fixed}");
        let s = g.spec.unwrap();
        eprintln!("{name} fixed={fixed}: {} rounds, {} drafted, {} accepted, mean acceptance length {:.2}", s.rounds, s.drafted, s.accepted, s.mean_accepted_length());
        assert_eq!(s.source, "dflash");
        if fixed {
            assert_eq!(
                s.accepted, 36,
                "draft_memo accepts [7,0,3,7,7,7,0,5,0,...] in the reference"
            );
        }
    }
}

#[test]
fn mismatched_drafts_are_load_errors() {
    let opts = LoadOptions::new(64, candle_core::Device::Cpu);
    // A normal model is not a DFlash draft.
    let engine = common::load(&fixture("target"), 64);
    let e = Engine::load_dflash_draft(&fixture("target"), &opts, &engine.model)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a DFlash draft"), "{e}");
    // The draft reads target layers 1 and 2 of a 5-layer, hidden-64 target: the tiny qwen3_moe
    // fixture does not fit.
    let moe = common::load(&common::repo_root().join("tests/fixtures/moe-tiny/qwen3_moe"), 64);
    let e = Engine::load_dflash_draft(&fixture("draft_memo"), &opts, &moe.model)
        .unwrap_err()
        .to_string();
    assert!(e.contains("hidden size") || e.contains("layers"), "{e}");
    // A bad block size is refused by the speculation settings.
    let mut cfg = dflash(&engine, "draft_memo", false);
    if let DraftSource::DFlash { block_size, .. } = &mut cfg.source {
        *block_size = 64;
    }
    assert!(cfg.validate(&engine.model).unwrap_err().to_string().contains("--dflash-block-size"));
}
