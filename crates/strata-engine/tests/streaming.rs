//! Expert streaming (`--stream-experts`) against the resident path on the MoE fixtures: bit-identical
//! logits at every prompt position and identical greedy tokens, for expert-cache budgets of 10%,
//! 50% and 100% of the expert bytes, each eviction policy, buffered and O_DIRECT reads; and the
//! failure modes (a model file truncated under a running engine). Expert prefetch (every predictor,
//! and off) changes no logit and no token.

mod common;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use strata_engine::{
    CacheBudget, Engine, EvictionPolicy, GenerateRequest, LoadOptions, PrefetchMode,
    SamplingParams, StreamOptions,
};
use strata_models::Logits;

fn fixture(name: &str) -> PathBuf {
    common::repo_root().join("tests/fixtures/moe-tiny").join(name)
}

fn load(path: &Path, stream: Option<StreamOptions>) -> Engine {
    let mut opts = LoadOptions::new(128, candle_core::Device::Cpu);
    opts.stream_experts = stream;
    Engine::load(path, &opts, &mut |_, _| {})
        .unwrap_or_else(|e| panic!("load {}: {e}", path.display()))
}

fn stream(percent: f64, policy: EvictionPolicy, direct: bool) -> StreamOptions {
    let direct_io = if direct { strata_engine::DirectIo::On } else { strata_engine::DirectIo::Off };
    // Prefetch gate open: predictions are always read, so the prefetch path is exercised; reads
    // split into 4 KiB pieces (the fixtures' experts are 8–25 KB), so piece splitting is too.
    StreamOptions {
        budget: CacheBudget::Percent(percent),
        direct_io,
        io_threads: 4,
        policy,
        prefetch: PrefetchMode::default(),
        prefetch_min_precision: 0.0,
        read_chunk: 4096,
        gpu_expert_cache: CacheBudget::Auto,
    }
}

const PROMPT: [u32; 12] = [3, 17, 92, 5, 41, 7, 64, 11, 250, 33, 8, 19];

/// Logits at every prompt position (one prefill pass) and 24 greedy tokens (prefill in chunks of 5,
/// then decode).
fn run(engine: &Engine) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut cache = engine.new_cache(128).unwrap();
    let out = engine.model.forward(&PROMPT, &mut cache, Logits::All, &[]).unwrap();
    let logits = out.logits.to_vec2::<f32>().unwrap();
    let mut req = GenerateRequest::new(PROMPT.to_vec(), 24, SamplingParams::greedy());
    req.ignore_eos = true;
    req.prefill_chunk = 5;
    let gen = engine.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(())).unwrap();
    (logits, gen.tokens)
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter().map(|r| r.iter().map(|x| x.to_bits()).collect()).collect()
}

fn check_model(name: &str) {
    let path = fixture(name);
    let (want_logits, want_tokens) = run(&load(&path, None));
    let cases = [
        (10.0, EvictionPolicy::Lru, PrefetchMode::Union),
        (10.0, EvictionPolicy::Lru, PrefetchMode::Off),
        (50.0, EvictionPolicy::Lru2, PrefetchMode::PreGate),
        (100.0, EvictionPolicy::Lfu, PrefetchMode::Previous),
        (10.0, EvictionPolicy::Lfu, PrefetchMode::PreGate),
    ];
    for (percent, policy, prefetch) in cases {
        let engine =
            load(&path, Some(StreamOptions { prefetch, ..stream(percent, policy, false) }));
        let gated = load(
            &path,
            Some(StreamOptions {
                prefetch,
                prefetch_min_precision: strata_engine::expert_store::DEFAULT_PREFETCH_MIN_PRECISION,
                ..stream(percent, policy, false)
            }),
        );
        assert_eq!(
            run(&gated).1,
            want_tokens,
            "{name} at {percent}% (prefetch {prefetch:?}, gated): greedy tokens"
        );
        let g = gated.model.experts().stats().unwrap();
        if percent < 100.0 && prefetch != PrefetchMode::Off {
            assert!(
                g.prefetch_candidates > 0 && g.prefetch_candidates_used <= g.prefetch_candidates,
                "{name}: the gate measured nothing: {g:?}"
            );
        }
        let (logits, tokens) = run(&engine);
        assert_eq!(
            bits(&logits),
            bits(&want_logits),
            "{name} at {percent}% ({policy:?}, prefetch {prefetch:?}): logits"
        );
        assert_eq!(
            tokens, want_tokens,
            "{name} at {percent}% ({policy:?}, prefetch {prefetch:?}): greedy tokens"
        );
        let s = engine.model.experts().stats().expect("streaming stats");
        assert!(s.misses > 0 && s.bytes_read > 0 && s.reads > 0, "{name}: nothing was read: {s:?}");
        assert!(s.touched_bytes >= s.bytes_read / 2, "{name}: {s:?}");
        assert_eq!(engine.model.prefetch_mode(), Some(prefetch));
        let p = engine.model.prefetch_stats().expect("prefetch stats");
        assert!(
            p.pregate.actual > 0 && p.pregate.correct <= p.pregate.predicted,
            "{name}: predictors not scored: {p:?}"
        );
        assert!(s.prefetch_used <= s.prefetch_reads);
        if prefetch == PrefetchMode::Off {
            assert_eq!(s.prefetch_reads, 0, "{name}: --prefetch off read ahead");
        } else if percent < 100.0 {
            assert!(s.prefetch_reads > 0, "{name} {prefetch:?}: nothing was prefetched: {s:?}");
        }
        eprintln!(
            "{name} {percent}% {policy:?} prefetch {prefetch:?}: hit rate {:.2}, {} bytes read in {} reads, {} prefetched ({} used), uncached precision {}/{}; precision/recall pregate {:.2}/{:.2} previous {:.2}/{:.2} union {:.2}/{:.2}",
            s.hit_rate(),
            s.bytes_read,
            s.reads,
            s.prefetch_reads,
            s.prefetch_used,
            s.prefetch_candidates_used,
            s.prefetch_candidates,
            p.pregate.precision(),
            p.pregate.recall(),
            p.previous.precision(),
            p.previous.recall(),
            p.union.precision(),
            p.union.recall()
        );
        if percent == 100.0 {
            // Everything fits: a second run reads nothing more.
            let before = s;
            run(&engine);
            let after = engine.model.experts().stats().unwrap();
            assert_eq!(after.bytes_read, before.bytes_read, "{name}: a full cache re-read experts");
            assert!(after.hits > before.hits);
        }
    }
}

#[test]
fn qwen3_moe_hf_streamed_equals_resident() {
    check_model("qwen3_moe");
}

#[test]
fn qwen3_moe_gguf_streamed_equals_resident() {
    check_model("qwen3_moe.gguf");
}

#[test]
fn mixtral_hf_and_gguf_streamed_equal_resident() {
    check_model("mixtral");
    check_model("mixtral.gguf");
}

#[test]
fn qwen2_moe_shared_expert_streamed_equals_resident() {
    check_model("qwen2_moe.gguf");
}

#[test]
fn direct_io_streamed_equals_resident() {
    let path = fixture("olmoe.gguf");
    let (want_logits, want_tokens) = run(&load(&path, None));
    let mut opts = LoadOptions::new(128, candle_core::Device::Cpu);
    opts.stream_experts = Some(stream(10.0, EvictionPolicy::Lru, true));
    match Engine::load(&path, &opts, &mut |_, _| {}) {
        Ok(engine) => {
            let (logits, tokens) = run(&engine);
            assert_eq!(bits(&logits), bits(&want_logits), "O_DIRECT logits");
            assert_eq!(tokens, want_tokens);
        }
        // Filesystems without O_DIRECT (tmpfs, some overlays) are reported at load.
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("O_DIRECT"), "{msg}");
            eprintln!("skipping O_DIRECT comparison: {msg}");
        }
    }
}

#[test]
fn truncated_file_under_a_running_engine_fails_the_request_cleanly() {
    let dir = std::env::temp_dir().join(format!("strata-stream-trunc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("m.gguf");
    std::fs::copy(fixture("qwen3_moe.gguf"), &copy).unwrap();
    let engine = load(&copy, Some(stream(10.0, EvictionPolicy::Lru, false)));
    run(&engine);
    let len = std::fs::metadata(&copy).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&copy).unwrap().set_len(len / 2).unwrap();
    let mut cache = engine.new_cache(128).unwrap();
    let req = GenerateRequest::new(
        vec![9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 101, 102],
        8,
        SamplingParams::greedy(),
    );
    let err = engine
        .generate(&mut cache, &req, &mut |_| ControlFlow::Continue(()))
        .expect_err("reads past the new end must fail");
    let msg = err.to_string();
    assert!(msg.contains("changed size") || msg.contains("short read"), "{msg}");
    // Restored, the same engine serves again.
    std::fs::copy(fixture("qwen3_moe.gguf"), &copy).unwrap();
    engine
        .generate(&mut cache, &req, &mut |_| ControlFlow::Continue(()))
        .expect("serves again once the file is back");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn moe_top_k_override_keeps_the_best_experts() {
    let path = fixture("qwen3_moe");
    let mut opts = LoadOptions::new(128, candle_core::Device::Cpu);
    opts.moe_top_k = Some(1);
    let engine = Engine::load(&path, &opts, &mut |_, _| {}).unwrap();
    let full = load(&path, None);
    let mut c1 = engine.new_cache(128).unwrap();
    let mut c2 = full.new_cache(128).unwrap();
    let one = engine.model.forward(&PROMPT, &mut c1, Logits::Last, &[]).unwrap();
    let all = full.model.forward(&PROMPT, &mut c2, Logits::Last, &[]).unwrap();
    // The first MoE layer sees the same input in both runs (later ones see different hidden states).
    for (a, b) in one.routing.iter().zip(&all.routing).take(1) {
        assert_eq!(a.top_k, 1);
        for t in 0..a.num_tokens() {
            let (ids, w) = a.token(t);
            let (full_ids, full_w) = b.token(t);
            assert_eq!(ids[0], full_ids[0], "the kept expert is the router's best");
            let mass: f32 = full_w.iter().sum();
            assert!((w[0] - mass).abs() < 1e-5, "weight rescaled to the top-k mass");
        }
    }
}

/// Mean KL(full top-k ‖ reduced top-k) of the next-token distributions over every prompt position.
fn mean_kl(full: &[Vec<f32>], reduced: &[Vec<f32>]) -> f64 {
    let logp = |row: &[f32]| strata_engine::sampling::log_softmax(row);
    let mut total = 0f64;
    for (a, b) in full.iter().zip(reduced) {
        let (la, lb) = (logp(a), logp(b));
        total += la.iter().zip(&lb).map(|(&p, &q)| (p.exp() * (p - q)) as f64).sum::<f64>();
    }
    total / full.len() as f64
}

/// `--moe-top-k`'s quality cost on the fixtures: KL divergence of the next-token distribution from
/// the model's own top-k, for every smaller k (printed; docs/performance.md records them).
#[test]
fn moe_top_k_quality_cost_is_measured() {
    for name in ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"] {
        let path = fixture(&format!("{name}.gguf"));
        let path = if path.exists() { path } else { fixture(name) };
        let full = load(&path, None);
        let top_k = full.model.config().moe.as_ref().unwrap().experts_per_token;
        let logits = |engine: &Engine| {
            let mut cache = engine.new_cache(128).unwrap();
            engine
                .model
                .forward(&PROMPT, &mut cache, Logits::All, &[])
                .unwrap()
                .logits
                .to_vec2::<f32>()
                .unwrap()
        };
        let want = logits(&full);
        let mut line = format!("{name} (top-{top_k}):");
        for k in 1..=top_k {
            let mut opts = LoadOptions::new(128, candle_core::Device::Cpu);
            opts.moe_top_k = Some(k);
            let kl = mean_kl(&want, &logits(&Engine::load(&path, &opts, &mut |_, _| {}).unwrap()));
            line += &format!(" k={k}: KL {kl:.4}");
            if k == top_k {
                assert!(kl.abs() < 1e-9, "{name}: the full top-k must not change logits (KL {kl})");
            } else {
                assert!(kl > 0.0 && kl.is_finite(), "{name}: k={k} KL {kl}");
            }
        }
        eprintln!("{line}");
    }
}

/// The host tier's raw access (what the GPU expert tier copies to VRAM): an expert's gate, up and
/// down bytes as stored in the file, in that order, whatever the file's order (safetensors stores
/// down first); `ready_bytes` never reads and answers only once the read is done.
#[test]
fn expert_bytes_are_the_stored_bytes_in_gate_up_down_order() {
    use std::os::unix::fs::FileExt;
    for name in ["qwen3_moe.gguf", "qwen3_moe", "mixtral"] {
        let files = strata_formats::ModelFiles::open(fixture(name)).unwrap();
        let cfg = files.config().unwrap();
        let moe = cfg.moe.clone().unwrap();
        let host = strata_engine::expert_store::StreamingExperts::open(
            &files,
            &cfg,
            &candle_core::Device::Cpu,
            &stream(50.0, EvictionPolicy::Lru, false),
        )
        .unwrap();
        let paths = files.weight_files();
        let dims = strata_formats::ExpertDims {
            num_experts: moe.num_experts,
            hidden: cfg.hidden_size,
            intermediate: moe.expert_intermediate_size,
        };
        let layer = (0..cfg.num_layers).find(|&l| cfg.is_moe_layer(l)).unwrap();
        let layout = files.expert_layout(layer, dims).unwrap();
        for e in [0, moe.num_experts - 1] {
            assert!(host.ready_bytes(layer, e).is_none(), "{name}: nothing read yet");
            let b = host.expert_bytes(layer, e).unwrap();
            let extent = files.expert_extent(&layout, e).unwrap();
            let slot: &[u8] = AsRef::<[u8]>::as_ref(b.slot.as_ref());
            for (k, part) in extent.parts.iter().enumerate() {
                let mut want = vec![0u8; part.len as usize];
                std::fs::File::open(&paths[part.file])
                    .unwrap()
                    .read_exact_at(&mut want, part.offset)
                    .unwrap();
                assert_eq!(
                    &slot[b.ranges[k].clone()],
                    want.as_slice(),
                    "{name}: expert {e} part {k}"
                );
            }
            assert_eq!(b.bytes as u64, extent.bytes());
            assert_eq!(
                b.shapes,
                [
                    [dims.intermediate, dims.hidden],
                    [dims.intermediate, dims.hidden],
                    [dims.hidden, dims.intermediate]
                ]
            );
            let again = host.ready_bytes(layer, e).expect("cached after expert_bytes");
            assert!(std::sync::Arc::ptr_eq(&again.slot, &b.slot), "{name}: same slot");
        }
    }
}
