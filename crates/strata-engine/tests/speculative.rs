//! Speculative decoding is lossless:
//! - greedy: with each draft source (n-gram, self-draft, draft model; fixed and adaptive length),
//!   200 tokens on the SmolLM2 oracle prompts equal plain greedy decoding token for token; the same
//!   on `tiny-moe` synthetic models with streamed experts;
//! - sampling: see `speculative_sampling.rs`;
//! - a draft model with another vocabulary is refused with both sizes named.

mod common;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata_bench::synth::{synth, SynthOptions, SynthPreset};
use strata_engine::CacheBudget;
use strata_engine::{
    DraftSource, Engine, GenerateRequest, LoadOptions, NgramParams, SamplingParams, SpecConfig,
    StreamOptions,
};

fn generate(
    engine: &Engine,
    prompt: &[u32],
    n: usize,
    sampling: SamplingParams,
) -> strata_engine::Generation {
    let mut cache = engine.new_cache(1024).unwrap();
    let mut req = GenerateRequest::new(prompt.to_vec(), n, sampling);
    req.ignore_eos = true;
    engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap()
}

fn spec(source: DraftSource, max_draft: usize, fixed: bool) -> SpecConfig {
    SpecConfig { source, max_draft, fixed: fixed.then_some(max_draft) }
}

fn smollm2_prompts(engine: &Engine) -> Vec<(String, Vec<u32>)> {
    let p = common::repo_root().join("tests/fixtures/spec/smollm2_prompts.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_string(),
                engine.text_prompt(p["prompt"].as_str().unwrap()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn smollm2_greedy_speculation_equals_plain_decoding() {
    let mut engine = common::load_smollm2(1024);
    let prompts = smollm2_prompts(&engine);
    let plain: Vec<Vec<u32>> = prompts
        .iter()
        .map(|(_, p)| generate(&engine, p, 200, SamplingParams::greedy()).tokens)
        .collect();
    let draft = Engine::load_draft_model(
        &common::smollm2_path(),
        &LoadOptions::new(1024, candle_core::Device::Cpu),
    )
    .unwrap()
    .0;
    let ngram = DraftSource::Ngram(NgramParams { max: 3, min: 1 });
    let configs = [
        ("ngram fixed 4", spec(ngram.clone(), 4, true)),
        ("ngram adaptive 8", spec(ngram, 8, false)),
        ("self 8 layers fixed 2", spec(DraftSource::SelfDraft { layers: 8 }, 2, true)),
        ("draft model fixed 3", spec(DraftSource::Model(draft), 3, true)),
    ];
    for (name, cfg) in configs {
        engine.set_speculation(Some(cfg)).unwrap();
        for ((pname, prompt), want) in prompts.iter().zip(&plain) {
            let g = generate(&engine, prompt, 200, SamplingParams::greedy());
            let s = g.spec.as_ref().unwrap();
            eprintln!("{name} / {pname}: {}", s.summary());
            assert_eq!(&g.tokens, want, "{name} on {pname}");
            assert!(s.rounds > 0 && s.rounds < 200 + 1);
        }
    }
}

fn tiny_moe(name: &str, seed: u64, skew: Option<f64>) -> PathBuf {
    tiny_moe_routed(name, seed, skew, None)
}

fn tiny_moe_routed(
    name: &str,
    seed: u64,
    skew: Option<f64>,
    routing: Option<strata_formats::SyntheticRouting>,
) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join(name);
    if !out.exists() {
        let o = SynthOptions {
            preset: SynthPreset::by_name("tiny-moe").unwrap(),
            quant: strata_bench::synth::parse_quant("Q4_K").unwrap(),
            seed,
            routing_skew: skew,
            routing,
        };
        synth(&out, &o, &mut |_, _| {}).unwrap();
    }
    out
}

fn load(path: &Path, stream: Option<&str>) -> Engine {
    let mut opts = LoadOptions::new(512, candle_core::Device::Cpu);
    opts.stream_experts = stream.map(|b| StreamOptions {
        budget: b.parse::<CacheBudget>().unwrap(),
        ..StreamOptions::default()
    });
    Engine::load(path, &opts, &mut |_, _| {}).unwrap()
}

#[test]
fn tiny_moe_streamed_greedy_speculation_equals_plain_decoding() {
    // Local routing with a planted skew, and the realistic routing override (whose choices depend
    // on each token's position and the previous token's experts: verify passes must route as
    // token-by-token decoding does).
    check_streamed_speculation(&tiny_moe("target.gguf", 1, Some(1.0)));
    check_streamed_speculation(&tiny_moe_routed(
        "target-realistic.gguf",
        1,
        None,
        Some(strata_formats::SyntheticRouting::realistic(1)),
    ));
}

fn check_streamed_speculation(target: &Path) {
    let draft_path = tiny_moe("draft.gguf", 2, None);
    let draft =
        Engine::load_draft_model(&draft_path, &LoadOptions::new(512, candle_core::Device::Cpu))
            .unwrap()
            .0;
    let resident = load(target, None);
    let prompt = resident
        .text_prompt("The quick brown fox jumps over the lazy dog. The quick brown fox")
        .unwrap();
    let want = generate(&resident, &prompt, 64, SamplingParams::greedy()).tokens;
    for budget in ["25%", "100%"] {
        let mut engine = load(target, Some(budget));
        for (name, cfg) in [
            ("ngram", spec(DraftSource::Ngram(NgramParams { max: 3, min: 1 }), 4, true)),
            ("self", spec(DraftSource::SelfDraft { layers: 2 }, 4, true)),
            ("draft model", spec(DraftSource::Model(draft.clone()), 4, true)),
            ("draft model adaptive", spec(DraftSource::Model(draft.clone()), 4, false)),
        ] {
            engine.set_speculation(Some(cfg)).unwrap();
            let g = generate(&engine, &prompt, 64, SamplingParams::greedy());
            let s = g.spec.as_ref().unwrap();
            eprintln!("{name} at {budget}: {} | experts {:?}", s.summary(), g.experts);
            assert_eq!(g.tokens, want, "{name} at {budget}");
            assert!(s.mean_fanout().is_some(), "verify fan-out is measured on MoE models");
            if budget == "25%" {
                assert!(g.experts.unwrap().bytes_read > 0, "a 25% cache must read experts");
            }
        }
    }
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let mut engine = common::load_smollm2(256);
    let draft: Arc<_> = Engine::load_draft_model(
        &tiny_moe("vocab-draft.gguf", 3, None),
        &LoadOptions::new(256, candle_core::Device::Cpu),
    )
    .unwrap()
    .0;
    let err = engine
        .set_speculation(Some(spec(DraftSource::Model(draft), 4, false)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("512") && err.contains("49152"), "{err}");
    assert!(engine.spec.is_none());
    let err = engine
        .set_speculation(Some(spec(DraftSource::SelfDraft { layers: 30 }, 4, false)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("1..30"), "{err}");
}
