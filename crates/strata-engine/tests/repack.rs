//! `strata repack` (bundled expert layout) on the MoE fixture GGUFs: the repacked file loads
//! resident and streamed, gives bit-identical logits and identical greedy tokens, plans the same
//! expert bytes, and reads each streamed expert in one request instead of three. Error cases: a
//! dense model, a file already repacked, the output being the input. HF checkpoints need no repack:
//! their per-expert tensors are read as one range.

mod common;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use strata_engine::{
    CacheBudget, Engine, GenerateRequest, LoadOptions, PrefetchMode, SamplingParams, StreamOptions,
};
use strata_formats::repack::{repack_gguf, BUNDLE_ALIGN};
use strata_formats::{ExpertDims, ExpertLayout, ModelFiles};
use strata_models::Logits;

const PROMPT: [u32; 10] = [3, 17, 92, 5, 41, 7, 64, 11, 250, 33];

fn tmp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-repack-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn load(path: &Path, stream: Option<StreamOptions>) -> Engine {
    let mut opts = LoadOptions::new(128, candle_core::Device::Cpu);
    opts.stream_experts = stream;
    Engine::load(path, &opts, &mut |_, _| {})
        .unwrap_or_else(|e| panic!("load {}: {e}", path.display()))
}

/// Logits at every prompt position and 16 greedy tokens.
fn run(engine: &Engine) -> (Vec<Vec<u32>>, Vec<u32>) {
    let mut cache = engine.new_cache(128).unwrap();
    let logits = engine
        .model
        .forward(&PROMPT, &mut cache, Logits::All, &[])
        .unwrap()
        .logits
        .to_vec2::<f32>()
        .unwrap();
    let mut req = GenerateRequest::new(PROMPT.to_vec(), 16, SamplingParams::greedy());
    req.ignore_eos = true;
    req.prefill_chunk = 4;
    let gen = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
    (logits.iter().map(|r| r.iter().map(|x| x.to_bits()).collect()).collect(), gen.tokens)
}

/// Prefetch off: both layouts then read the same experts. With the whole model cached no expert
/// is evicted before use, so each is read exactly once.
fn streamed(percent: f64) -> Option<StreamOptions> {
    Some(StreamOptions {
        budget: CacheBudget::Percent(percent),
        io_threads: 2,
        prefetch: PrefetchMode::Off,
        ..StreamOptions::default()
    })
}

fn routed_expert_bytes(path: &Path) -> u64 {
    ModelFiles::open(path)
        .unwrap()
        .tensor_table()
        .iter()
        .filter(|t| t.is_routed_expert())
        .map(|t| t.bytes)
        .sum()
}

fn check(name: &str) {
    let src = common::repo_root().join("tests/fixtures/moe-tiny").join(name);
    let out = tmp_dir(name).join("bundled.gguf");
    let report = repack_gguf(&src, &out, &mut |_, _| {}).unwrap();
    assert!(report.layers > 0 && report.experts > 0, "{report:?}");

    // The layout: per-expert tensors, each gate 4 KiB-aligned, up and down right behind it.
    let files = ModelFiles::open(&out).unwrap();
    let cfg = files.config().unwrap();
    let moe = cfg.moe.clone().unwrap();
    let dims = ExpertDims {
        num_experts: moe.num_experts,
        hidden: cfg.hidden_size,
        intermediate: moe.expert_intermediate_size,
    };
    let layer = (0..cfg.num_layers).find(|&l| cfg.is_moe_layer(l)).unwrap();
    let layout = files.expert_layout(layer, dims).unwrap();
    assert_eq!(layout, ExpertLayout::GgufPerExpert { layer });
    for e in 0..moe.num_experts {
        let x = files.expert_extent(&layout, e).unwrap();
        assert_eq!(x.parts[0].offset % BUNDLE_ALIGN, 0, "{name}: expert {e} not aligned");
        for k in 1..3 {
            let gap = x.parts[k].offset - (x.parts[k - 1].offset + x.parts[k - 1].len);
            assert!(gap < 32, "{name}: expert {e} part {k} is {gap} bytes after the previous one");
        }
    }
    assert_eq!(
        routed_expert_bytes(&out),
        routed_expert_bytes(&src),
        "{name}: the plan sees different expert bytes"
    );

    let (want_logits, want_tokens) = run(&load(&src, None));
    let (logits, tokens) = run(&load(&out, None));
    assert_eq!(logits, want_logits, "{name}: resident logits differ after repack");
    assert_eq!(tokens, want_tokens, "{name}: resident tokens differ after repack");

    for percent in [10.0, 100.0] {
        let (orig, packed) = (load(&src, streamed(percent)), load(&out, streamed(percent)));
        let (l1, t1) = run(&orig);
        let (l2, t2) = run(&packed);
        assert_eq!(
            (&l1, &t1),
            (&want_logits, &want_tokens),
            "{name}: streamed original at {percent}%"
        );
        assert_eq!(
            (&l2, &t2),
            (&want_logits, &want_tokens),
            "{name}: streamed repacked at {percent}%"
        );
        if percent == 100.0 {
            let (a, b) =
                (orig.model.experts().stats().unwrap(), packed.model.experts().stats().unwrap());
            assert_eq!(a.misses, b.misses, "{name}: the layouts read different experts");
            assert_eq!(
                a.reads,
                3 * b.reads,
                "{name}: original {} reads, repacked {} (want one per expert)",
                a.reads,
                b.reads
            );
            assert_eq!(b.reads, b.misses, "{name}: not one read per expert");
            // One read per expert never reads more than three (with O_DIRECT the original's three
            // reads are each rounded out to the block size, so it may read less).
            assert!(
                b.bytes_read < a.bytes_read + 64 * b.reads,
                "{name}: {} vs {} bytes",
                b.bytes_read,
                a.bytes_read
            );
            eprintln!(
                "{name}: {} experts bundled; streamed reads {} -> {}, bytes {} -> {}",
                report.experts, a.reads, b.reads, a.bytes_read, b.bytes_read
            );
        }
    }

    // Repacking again is refused (nothing left to bundle), and the file is not touched.
    let again = tmp_dir(name).join("again.gguf");
    let err = repack_gguf(&out, &again, &mut |_, _| {}).unwrap_err();
    assert!(err.contains("already repacked"), "{err}");
    assert!(!again.exists());
    let _ = std::fs::remove_dir_all(out.parent().unwrap());
}

#[test]
fn qwen3_moe_repacked_equals_original() {
    check("qwen3_moe.gguf");
}

#[test]
fn mixtral_repacked_equals_original() {
    check("mixtral.gguf");
}

#[test]
fn qwen2_moe_shared_expert_repacked_equals_original() {
    check("qwen2_moe.gguf");
}

#[test]
fn hybrid_qwen3_next_repacked_equals_original() {
    check("qwen3_next.gguf");
}

#[test]
fn repack_refuses_bad_inputs_and_keeps_the_input() {
    let src = common::repo_root().join("tests/fixtures/moe-tiny/qwen3_moe.gguf");
    let dir = tmp_dir("errors");
    let copy = dir.join("model.gguf");
    std::fs::copy(&src, &copy).unwrap();
    let before = std::fs::read(&copy).unwrap();
    let err = repack_gguf(&copy, &copy, &mut |_, _| {}).unwrap_err();
    assert!(err.contains("different file"), "{err}");
    assert_eq!(std::fs::read(&copy).unwrap(), before, "the input was changed");
    // A dense model has nothing to bundle.
    let err =
        repack_gguf(&common::smollm2_path(), &dir.join("dense.gguf"), &mut |_, _| {}).unwrap_err();
    assert!(err.contains("no `blk.L.ffn_*_exps.weight`"), "{err}");
    // A truncated input fails cleanly and leaves no output.
    std::fs::write(&copy, &before[..before.len() / 2]).unwrap();
    assert!(repack_gguf(&copy, &dir.join("t.gguf"), &mut |_, _| {}).is_err());
    assert!(!dir.join("t.gguf").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hf_per_expert_tensors_are_one_read_per_expert() {
    // safetensors stores an expert's down, gate and up projections back to back (names sorted):
    // read as one range, then put in place.
    for name in ["qwen3_moe", "mixtral"] {
        let path = common::repo_root().join("tests/fixtures/moe-tiny").join(name);
        let (want_logits, want_tokens) = run(&load(&path, None));
        let engine = load(&path, streamed(100.0));
        assert_eq!(run(&engine), (want_logits, want_tokens), "{name}: streamed");
        let s = engine.model.experts().stats().unwrap();
        assert_eq!(s.reads, s.misses, "{name}: {} reads for {} experts", s.reads, s.misses);
    }
}
