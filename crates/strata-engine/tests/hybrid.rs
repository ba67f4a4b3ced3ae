//! Hybrid models (Gated DeltaNet + gated attention + MoE): qwen3_next and qwen3_5_moe from
//! `tests/fixtures/moe-tiny` (copied from `../shared/fixtures/moe-tiny`: transformers 5.23 tiny
//! models and llama.cpp's GGUF conversions; their logits against transformers are checked in
//! `moe_tiny.rs`). Here: a multi-token prefill equals token-by-token decoding, speculative decoding
//! (rollback of the recurrent state) equals plain greedy decoding, and streamed experts change nothing.

mod common;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use strata_engine::CacheBudget;
use strata_engine::{
    DraftSource, Engine, GenerateRequest, LoadOptions, NgramParams, SamplingParams, SpecConfig,
    StreamOptions,
};
use strata_models::{Logits, ModelError};

const ARCHS: [&str; 2] = ["qwen3_next", "qwen3_5_moe"];

fn fixtures() -> PathBuf {
    common::repo_root().join("tests/fixtures/moe-tiny")
}

fn forms(arch: &str) -> [PathBuf; 2] {
    [fixtures().join(arch), fixtures().join(format!("{arch}.gguf"))]
}

fn prompt(arch: &str) -> Vec<u32> {
    let p = fixtures().join(format!("{arch}.reference.json"));
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    r["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn load(path: &Path, stream: Option<&str>) -> Engine {
    let mut opts = LoadOptions::new(512, candle_core::Device::Cpu);
    opts.stream_experts = stream.map(|b| StreamOptions {
        budget: b.parse::<CacheBudget>().unwrap(),
        ..StreamOptions::default()
    });
    Engine::load(path, &opts, &mut |_, _| {}).unwrap()
}

fn generate(engine: &Engine, prompt: &[u32], n: usize) -> strata_engine::Generation {
    let mut cache = engine.new_cache(512).unwrap();
    let mut req = GenerateRequest::new(prompt.to_vec(), n, SamplingParams::greedy());
    req.ignore_eos = true;
    engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

#[test]
fn prefill_equals_token_by_token_decode() {
    for arch in ARCHS {
        for path in forms(arch) {
            let engine = common::load(&path, 256);
            // 93 tokens: one pass runs the chunked form (> EXACT_ROWS_MAX tokens, chunks of 64 and
            // 29), token by token the recurrent form.
            let prompt = prompt(arch).repeat(3);
            assert!(prompt.len() > strata_models::EXACT_ROWS_MAX);
            let mut cache = engine.new_cache(256).unwrap();
            let all = engine
                .model
                .forward(&prompt, &mut cache, Logits::All, &[])
                .unwrap()
                .logits
                .to_vec2::<f32>()
                .unwrap();
            // One token per forward (the decode path), and prefill chunks of 8 then decode.
            for chunk in [1, 8] {
                let mut cache = engine.new_cache(256).unwrap();
                let mut worst = 0f32;
                let mut pos = 0;
                for part in prompt.chunks(chunk) {
                    let rows = engine
                        .model
                        .forward(part, &mut cache, Logits::All, &[])
                        .unwrap()
                        .logits
                        .to_vec2::<f32>()
                        .unwrap();
                    for (i, row) in rows.iter().enumerate() {
                        worst = worst.max(max_diff(row, &all[pos + i]));
                    }
                    pos += part.len();
                }
                eprintln!(
                    "{}: chunks of {chunk} vs one prefill: max |Δlogit| = {worst:.2e}",
                    path.display()
                );
                assert!(worst <= 1e-4, "{}: chunks of {chunk} differ by {worst}", path.display());
            }
        }
    }
}

#[test]
fn rollback_before_the_checkpoint_is_an_error() {
    let engine = common::load(&fixtures().join("qwen3_next.gguf"), 64);
    let mut cache = engine.new_cache(64).unwrap();
    engine.model.forward(&[1, 2, 3], &mut cache, Logits::Last, &[]).unwrap();
    engine.model.checkpoint(&mut cache);
    engine.model.forward(&[4, 5], &mut cache, Logits::Last, &[]).unwrap();
    let err = engine.model.rollback(&mut cache, 2).unwrap_err();
    assert!(matches!(err, ModelError::Rollback { to: 2, checkpoint: Some(3) }), "{err}");
    assert_eq!(cache.len(), 5, "a refused rollback leaves the state as it was");
    // Rolling back to the checkpoint and decoding again reproduces the logits.
    let want = engine
        .model
        .forward(&[6], &mut cache, Logits::Last, &[])
        .unwrap()
        .logits
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    engine.model.rollback(&mut cache, 3).unwrap();
    engine.model.forward(&[9, 9, 9], &mut cache, Logits::Last, &[]).unwrap();
    engine.model.rollback(&mut cache, 3).unwrap();
    engine.model.forward(&[4, 5], &mut cache, Logits::Last, &[]).unwrap();
    let got = engine
        .model
        .forward(&[6], &mut cache, Logits::Last, &[])
        .unwrap()
        .logits
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(got, want, "restored state decodes bit-identically");
    // While the checkpoint is held every token logs its update; once released, nothing grows.
    let logging = cache.bytes();
    engine.model.forward(&[7], &mut cache, Logits::Last, &[]).unwrap();
    assert!(cache.bytes() > logging);
    engine.model.release_checkpoint(&mut cache);
    let released = cache.bytes();
    engine.model.forward(&[8, 9], &mut cache, Logits::Last, &[]).unwrap();
    assert_eq!(cache.bytes(), released, "no log after release");
    assert!(engine.model.rollback(&mut cache, 8).is_err(), "no rollback after release");
}

fn spec(source: DraftSource, max_draft: usize, fixed: bool) -> SpecConfig {
    SpecConfig { source, max_draft, fixed: fixed.then_some(max_draft) }
}

#[test]
fn greedy_speculation_equals_plain_decoding() {
    // A prompt that repeats itself gives the n-gram drafter something to propose.
    for arch in ARCHS {
        let gguf = fixtures().join(format!("{arch}.gguf"));
        let other = fixtures().join(format!(
            "{}.gguf",
            if arch == "qwen3_next" { "qwen3_5_moe" } else { "qwen3_next" }
        ));
        let draft =
            Engine::load_draft_model(&other, &LoadOptions::new(512, candle_core::Device::Cpu))
                .unwrap()
                .0;
        let mut p = prompt(arch);
        p.extend(prompt(arch));
        let resident = load(&gguf, None);
        let want = generate(&resident, &p, 64).tokens;
        // A random DFlash draft for this target (z-lab's format; it reads the target's hidden states).
        let dir = std::env::temp_dir().join(format!("strata-dflash-{arch}-{}", std::process::id()));
        strata_bench::synth_dflash::write_random_dflash_draft(
            resident.model.config(),
            &dir,
            2,
            6,
            7,
        )
        .unwrap();
        let dflash = Engine::load_dflash_draft(
            &dir,
            &LoadOptions::new(512, candle_core::Device::Cpu),
            &resident.model,
        )
        .unwrap()
        .0;
        let _ = std::fs::remove_dir_all(&dir);
        for stream in [None, Some("50%")] {
            let mut engine = load(&gguf, stream);
            assert_eq!(
                generate(&engine, &p, 64).tokens,
                want,
                "{arch}: streamed experts ({stream:?})"
            );
            for (name, cfg) in [
                (
                    "ngram fixed 4",
                    spec(DraftSource::Ngram(NgramParams { max: 3, min: 1 }), 4, true),
                ),
                (
                    "ngram adaptive",
                    spec(DraftSource::Ngram(NgramParams { max: 3, min: 1 }), 6, false),
                ),
                ("self 2 layers fixed 3", spec(DraftSource::SelfDraft { layers: 2 }, 3, true)),
                ("hybrid draft model fixed 3", spec(DraftSource::Model(draft.clone()), 3, true)),
                (
                    "dflash block 6 fixed 5",
                    spec(DraftSource::DFlash { draft: dflash.clone(), block_size: 6 }, 5, true),
                ),
            ] {
                engine.set_speculation(Some(cfg)).unwrap();
                let g = generate(&engine, &p, 64);
                let s = g.spec.as_ref().unwrap();
                eprintln!("{arch} {name} (stream {stream:?}): {}", s.summary());
                assert_eq!(g.tokens, want, "{arch}: {name}, stream {stream:?}");
                if name != "ngram adaptive" {
                    assert!(
                        s.drafted > s.accepted,
                        "{arch} {name}: no draft was rejected, so no rollback was exercised"
                    );
                }
            }
        }
    }
}

#[test]
fn synthetic_hybrid_streams_and_speculates_like_resident() {
    // `strata synth --preset tiny-hybrid`: the qwen3.5-122b-a10b layout at test size (Q4_K).
    let dir = std::env::temp_dir().join(format!("strata-hybrid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny-hybrid.gguf");
    let preset = strata_bench::synth::SynthPreset::by_name("tiny-hybrid").unwrap();
    let o = strata_bench::synth::SynthOptions {
        preset,
        quant: strata_bench::synth::parse_quant("Q4_K").unwrap(),
        seed: 7,
        routing_skew: Some(1.0),
        routing: None,
    };
    strata_bench::synth::synth(&path, &o, &mut |_, _| {}).unwrap();
    let cfg = strata_formats::ModelFiles::open(&path).unwrap().config().unwrap();
    assert_eq!(cfg.arch.name(), "qwen3_5_moe");
    assert_eq!(cfg.attention_layers(), 1);
    let resident = load(&path, None);
    let p = resident
        .text_prompt("The quick brown fox jumps over the lazy dog. The quick brown fox")
        .unwrap();
    let want = generate(&resident, &p, 32).tokens;
    let mut streamed = load(&path, Some("25%"));
    let g = generate(&streamed, &p, 32);
    assert_eq!(g.tokens, want, "streamed experts");
    assert!(g.experts.unwrap().bytes_read > 0, "a 25% cache reads experts");
    streamed.set_speculation(Some(spec(DraftSource::SelfDraft { layers: 2 }, 3, true))).unwrap();
    assert_eq!(generate(&streamed, &p, 32).tokens, want, "self-draft on streamed experts");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn image_text_checkpoint_layout_loads_the_text_model() {
    // Qwen3.5-MoE checkpoints as released: config under `text_config` of a `qwen3_5_moe` config,
    // tensors under `model.language_model.` — same weights, same greedy ids as the reference.
    let src = fixtures().join("qwen3_5_moe");
    let dir = std::env::temp_dir().join(format!("strata-qwen35-vl-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in
        ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]
    {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let cfg = serde_json::json!({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    // Rename every tensor in the safetensors header; the data section is unchanged.
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let renamed: serde_json::Map<String, serde_json::Value> = header
        .into_iter()
        .map(|(k, v)| {
            (k.strip_prefix("model.").map_or(k.clone(), |r| format!("model.language_model.{r}")), v)
        })
        .collect();
    let h = serde_json::to_vec(&renamed).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(dir.join("model.safetensors"), out).unwrap();

    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen3_5_moe.reference.json")).unwrap(),
    )
    .unwrap();
    let want: Vec<u32> =
        r["greedy_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let engine = common::load(&dir, 256);
    assert_eq!(generate(&engine, &prompt("qwen3_5_moe"), want.len()).tokens, want);
    let _ = std::fs::remove_dir_all(&dir);
}
