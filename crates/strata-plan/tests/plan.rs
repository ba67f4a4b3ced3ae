//! Strategy selection on the MoE fixtures and on `strata synth` models of several sizes under
//! simulated memory sizes, and the JSON fields documented in docs/memory-plan.md.

use std::path::{Path, PathBuf};

use strata_formats::ModelFiles;
use strata_plan::{
    make_plan, Bandwidths, ModelFacts, Plan, PlanRequest, RatesSource, Strategy, StreamMode,
    SystemMemory,
};
use strata_plan::{CacheBudget, PrefixCacheBudget};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn facts(path: &Path) -> ModelFacts {
    ModelFacts::read(&ModelFiles::open(path).unwrap()).unwrap()
}

fn ram(bytes: u64) -> SystemMemory {
    SystemMemory { ram_total: bytes, available: bytes, cgroup_limit: None, simulated: true }
}

/// `ctx 1024`, one slot, automatic caches, no prefix cache, on the CPU.
fn request(stream: StreamMode) -> PlanRequest {
    PlanRequest {
        ctx_size: 1024,
        prefill_chunk: 512,
        stream,
        expert_cache: CacheBudget::Auto,
        draft: None,
        observed: None,
        gpu: None,
        gpu_expert_cache: CacheBudget::Auto,
        parallel: 1,
        prefix_cache: PrefixCacheBudget::Bytes(0),
    }
}

fn plan(m: &ModelFacts, bytes: u64, stream: StreamMode) -> Plan {
    make_plan(m, &ram(bytes), (Bandwidths::DEFAULTS, RatesSource::Defaults), &request(stream))
}

fn synth(name: &str, layers: usize) -> PathBuf {
    let out = std::env::temp_dir().join(format!("strata-plan-{}-{name}.gguf", std::process::id()));
    let preset = strata_bench::synth::SynthPreset {
        layers,
        ..strata_bench::synth::SynthPreset::by_name("tiny-moe").unwrap()
    };
    let o = strata_bench::synth::SynthOptions {
        preset,
        quant: candle_core::quantized::GgmlDType::Q8_0,
        seed: 1,
        routing_skew: None,
        routing: None,
    };
    strata_bench::synth::synth(&out, &o, &mut |_, _| {}).unwrap();
    out
}

#[test]
fn fixtures_fit_resident_on_a_normal_machine() {
    for f in ["qwen3_moe", "mixtral.gguf", "olmoe.gguf", "qwen2_moe.gguf"] {
        let m = facts(&repo().join("tests/fixtures/moe-tiny").join(f));
        assert!(m.is_moe(), "{f}");
        assert!(m.active_params < m.total_params, "{f}: {m:?}");
        let p = plan(&m, 8 << 30, StreamMode::Auto);
        assert_eq!(p.strategy, Strategy::Resident, "{f}: {}", p.reason);
        assert!(p.recommended_command.as_deref().unwrap().contains("--stream-experts off"));
    }
}

#[test]
fn synthetic_models_pick_the_strategy_their_memory_allows() {
    for layers in [16, 64] {
        let path = synth(&format!("l{layers}"), layers);
        let m = facts(&path);
        let file = std::fs::metadata(&path).unwrap().len();
        let tensors = m.dense_bytes + m.expert_bytes;
        assert!(
            tensors <= file && tensors > file / 10 * 9,
            "tensor bytes {tensors} vs file {file}"
        );
        assert_eq!(m.bytes_per_expert * (m.experts * m.moe_layers) as u64, m.expert_bytes);
        let kv = 1024 * m.kv_bytes_per_token;
        // Plenty of RAM: resident.
        assert_eq!(plan(&m, 64 << 30, StreamMode::Auto).strategy, Strategy::Resident);
        // Room for the dense weights, KV and a slice of the experts: streaming, with a cache smaller
        // than the experts and a hit rate below 1.
        // (available = fixed + reserve + experts/4, where reserve = 512 MiB + 5% of available.)
        let compute = plan(&m, 64 << 30, StreamMode::Auto).memory.compute_buffers;
        let tight = ((m.dense_memory_bytes + kv + compute + (512 << 20) + m.expert_bytes / 4)
            as f64
            / 0.95) as u64;
        let p = plan(&m, tight, StreamMode::Auto);
        assert_eq!(
            p.strategy,
            Strategy::ExpertStreaming,
            "{layers} layers at {tight}: {}",
            p.reason
        );
        let cache = p.expert_cache_bytes.unwrap();
        assert!(cache < m.expert_bytes && cache > 0, "{cache}");
        let hit = p.expected_hit_rate.unwrap();
        assert!(hit > 0.0 && hit < 1.0);
        assert!(p.estimate.decode_read_ms > 0.0, "misses cost reads");
        assert!(p
            .recommended_command
            .as_deref()
            .unwrap()
            .contains("--stream-experts on --expert-cache"));
        // The same memory with streaming off: too large, and the reason says streaming would work.
        let off = plan(&m, tight, StreamMode::Off);
        assert_eq!(off.strategy, Strategy::TooLarge);
        assert!(off.reason.contains("--stream-experts auto"), "{}", off.reason);
        // Not even the dense weights: too large, with the shortfall.
        let tiny = plan(&m, 256 << 20, StreamMode::Auto);
        assert_eq!(tiny.strategy, Strategy::TooLarge);
        assert!(tiny.reason.contains("short"), "{}", tiny.reason);
        assert!(tiny.recommended_command.is_none());
        // Forced on with plenty of RAM: streams anyway.
        assert_eq!(plan(&m, 64 << 30, StreamMode::On).strategy, Strategy::ExpertStreaming);
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn a_big_context_is_what_does_not_fit() {
    let m = facts(&repo().join("tests/fixtures/moe-tiny/mixtral.gguf"));
    let req = PlanRequest {
        ctx_size: 1 << 22,
        prefill_chunk: 512,
        stream: StreamMode::Auto,
        expert_cache: CacheBudget::Auto,
        draft: None,
        observed: None,
        gpu: None,
        gpu_expert_cache: CacheBudget::Auto,
        parallel: 1,
        prefix_cache: PrefixCacheBudget::Bytes(0),
    };
    let p = make_plan(&m, &ram(2 << 30), (Bandwidths::DEFAULTS, RatesSource::Defaults), &req);
    assert_eq!(p.strategy, Strategy::TooLarge);
    assert!(p.reason.contains("--ctx-size"), "{}", p.reason);
}

#[test]
fn a_draft_model_over_70_percent_of_ram_warns_and_shrinks_the_cache() {
    let path = synth("draft", 32);
    let m = facts(&path);
    let ram_bytes = m.dense_memory_bytes * 3 + m.expert_bytes / 2;
    let req = |draft: Option<ModelFacts>| PlanRequest {
        ctx_size: 512,
        prefill_chunk: 512,
        stream: StreamMode::Auto,
        expert_cache: CacheBudget::Auto,
        draft,
        observed: None,
        gpu: None,
        gpu_expert_cache: CacheBudget::Auto,
        parallel: 1,
        prefix_cache: PrefixCacheBudget::Bytes(0),
    };
    let rates = || (Bandwidths::DEFAULTS, RatesSource::Defaults);
    let alone = make_plan(&m, &ram(ram_bytes), rates(), &req(None));
    let with = make_plan(&m, &ram(ram_bytes), rates(), &req(Some(m.clone())));
    assert!(with.warnings.iter().any(|w| w.contains("70%")), "{:?}", with.warnings);
    assert!(with.memory.draft > 0);
    if let (Some(a), Some(b)) = (alone.expert_cache_bytes, with.expert_cache_bytes) {
        assert!(b < a, "cache {b} with draft vs {a} alone");
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn json_fields_are_the_documented_ones() {
    let m = facts(&repo().join("tests/fixtures/moe-tiny/qwen3_moe.gguf"));
    let v = serde_json::to_value(plan(&m, 8 << 30, StreamMode::Auto)).unwrap();
    let doc = std::fs::read_to_string(repo().join("docs/memory-plan.md")).unwrap();
    let mut keys = Vec::new();
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<String>) {
        if let serde_json::Value::Object(o) = v {
            for (k, x) in o {
                let name = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                out.push(name.clone());
                walk(&name, x, out);
            }
        }
    }
    walk("", &v, &mut keys);
    for k in keys {
        assert!(doc.contains(&format!("`{k}`")), "docs/memory-plan.md does not document `{k}`");
    }
}

#[test]
fn observed_runs_replace_the_typical_curve() {
    let path = synth("obs", 32);
    let m = facts(&path);
    let compute = plan(&m, 64 << 30, StreamMode::Auto).memory.compute_buffers;
    let tight = ((m.dense_memory_bytes
        + 1024 * m.kv_bytes_per_token
        + compute
        + (512 << 20)
        + m.expert_bytes / 4) as f64
        / 0.95) as u64;
    let base = plan(&m, tight, StreamMode::Auto);
    let f = base.expert_cache_experts.unwrap() as f64 / (m.experts * m.moe_layers) as f64;
    assert!(
        (base.hit_rate_floor.unwrap() - f).abs() < 1e-9,
        "the uniform floor is the cached share"
    );
    let typical = strata_plan::hit_curve::typical_hit_rate(f);
    assert!(
        (base.expected_hit_rate.unwrap() - typical).abs() < 1e-9,
        "without observations: typical routing's hit rate"
    );
    assert!(typical > f, "typical routing caches better than uniform");
    let o = strata_plan::Observed {
        cache_fraction: f,
        hit_rate: 0.9,
        hidden_read_ms_per_token: 0.0,
        compute_ms_per_token: 40.0,
        resident_compute_ms_per_token: None,
        tokens: 31,
    };
    let req = PlanRequest {
        ctx_size: 1024,
        prefill_chunk: 512,
        stream: StreamMode::Auto,
        expert_cache: CacheBudget::Auto,
        draft: None,
        observed: Some(o),
        gpu: None,
        gpu_expert_cache: CacheBudget::Auto,
        parallel: 1,
        prefix_cache: PrefixCacheBudget::Bytes(0),
    };
    let p = make_plan(&m, &ram(tight), (Bandwidths::DEFAULTS, RatesSource::Defaults), &req);
    assert!(
        (p.expected_hit_rate.unwrap() - 0.9).abs() < 1e-9,
        "same cache share: the observed hit rate"
    );
    assert!((p.estimate.decode_compute_ms - 40.0).abs() < 1e-9);
    // Read time that prefetch hid behind compute in the recorded run is not charged again.
    assert!(p.estimate.decode_read_ms > 1.0, "a 10% byte miss rate reads something");
    let hidden = strata_plan::Observed { hidden_read_ms_per_token: 1.0, ..o };
    let req_hidden = PlanRequest { observed: Some(hidden), ..req.clone() };
    let q = make_plan(&m, &ram(tight), (Bandwidths::DEFAULTS, RatesSource::Defaults), &req_hidden);
    assert!((q.estimate.decode_read_ms - (p.estimate.decode_read_ms - 1.0)).abs() < 1e-9);
    assert!(q.estimate.decode_tok_s > p.estimate.decode_tok_s);
    // A bigger cache misses less, along the typical curve's shape; a full one never.
    let miss = |x: f64| 1.0 - strata_plan::hit_curve::typical_hit_rate(x);
    let half = (1.0 + f) / 2.0;
    assert!(
        (strata_plan::observed::miss_rate_at(&o, half) - 0.1 * miss(half) / miss(f)).abs() < 1e-9
    );
    assert_eq!(strata_plan::observed::miss_rate_at(&o, 1.0), 0.0);
    let _ = std::fs::remove_file(&path);
}

fn gpu_plan(m: &ModelFacts, vram: u64, ram_bytes: u64, stream: StreamMode) -> Plan {
    let gpu = strata_plan::GpuMemory { vram_total: vram, vram_free: vram, simulated: true };
    let req = PlanRequest {
        ctx_size: 1024,
        prefill_chunk: 512,
        stream,
        expert_cache: CacheBudget::Auto,
        draft: None,
        observed: None,
        gpu: Some(gpu),
        gpu_expert_cache: CacheBudget::Auto,
        parallel: 1,
        prefix_cache: PrefixCacheBudget::Bytes(0),
    };
    make_plan(m, &ram(ram_bytes), (Bandwidths::DEFAULTS, RatesSource::Defaults), &req)
}

#[test]
fn gpu_plans_use_vram_then_pinned_host_memory_then_the_drive() {
    let path = synth("gpu", 16);
    let m = facts(&path);
    let roomy = gpu_plan(&m, 64 << 30, 64 << 30, StreamMode::Auto);
    assert_eq!(roomy.strategy, Strategy::Resident, "{}", roomy.reason);
    let g = roomy.gpu.as_ref().unwrap();
    assert!(g.vram_expert_cache_bytes.is_none() && g.decode_copy_ms == 0.0);
    assert!(roomy
        .recommended_command
        .as_deref()
        .unwrap()
        .contains("--device cuda --stream-experts off"));
    // VRAM for the dense weights, KV and about a quarter of the experts: GPU-OFFLOAD, every expert
    // in (page-locked) host RAM, none from the drive.
    let fixed = g.vram_fixed;
    let vram = fixed + m.expert_memory_bytes / 4;
    let p = gpu_plan(&m, vram, 64 << 30, StreamMode::Auto);
    assert_eq!(p.strategy, Strategy::GpuOffload, "{}", p.reason);
    assert!(p.strategy.streams_experts());
    let g = p.gpu.as_ref().unwrap();
    let (vb, hit) = (g.vram_expert_cache_bytes.unwrap(), g.expected_vram_hit_rate.unwrap());
    assert!(
        vb <= vram - fixed && vb * 5 > m.expert_memory_bytes,
        "VRAM cache {vb} of {}",
        m.expert_memory_bytes
    );
    let share = g.vram_expert_cache_experts.unwrap() as f64 / (m.experts * m.moe_layers) as f64;
    assert!(share > 0.2 && share < 0.3, "{share}");
    assert!((hit - strata_plan::hit_curve::typical_hit_rate(share)).abs() < 1e-9, "{hit}");
    assert_eq!(g.host_expert_cache_experts.unwrap(), (m.experts * m.moe_layers) as u64);
    assert!(g.decode_copy_ms > 0.0 && g.decode_read_ms == 0.0, "{g:?}");
    let cmd = p.recommended_command.as_deref().unwrap();
    assert!(cmd.contains("--stream-experts on") && cmd.contains("--gpu-expert-cache"), "{cmd}");
    // Little RAM too: the host cache shrinks and misses read the drive.
    let host =
        ((m.expert_bytes / 2 + (512 << 20) + roomy.memory.compute_buffers) as f64 / 0.95) as u64;
    let small_ram = gpu_plan(&m, vram, host, StreamMode::Auto);
    let g = small_ram.gpu.as_ref().unwrap();
    assert_eq!(small_ram.strategy, Strategy::GpuOffload);
    assert!(g.host_expert_cache_experts.unwrap() < (m.experts * m.moe_layers) as u64);
    assert!(g.decode_read_ms > 0.0, "{g:?}");
    // Streaming asked for although everything fits: offload anyway.
    assert_eq!(gpu_plan(&m, 64 << 30, 64 << 30, StreamMode::On).strategy, Strategy::GpuOffload);
    // Not even the dense weights and KV: too large, and the reason says why.
    let tiny = gpu_plan(&m, fixed / 2, 64 << 30, StreamMode::Auto);
    assert_eq!(tiny.strategy, Strategy::TooLarge);
    assert!(tiny.reason.contains("VRAM") && tiny.recommended_command.is_none(), "{}", tiny.reason);
    let _ = std::fs::remove_file(&path);
}

/// `--prefix-cache auto`: half of the memory a plan without one leaves free, at most
/// `prefix::AUTO_MAX`, resident in RAM or in VRAM; at most `AUTO_STREAMING_MAX` (an eighth of
/// the expert cache's room) where experts stream; none when nothing fits. The plan with it keeps
/// its strategy and still fits.
#[test]
fn an_auto_prefix_cache_takes_what_the_plan_leaves() {
    use strata_plan::prefix::{AUTO_MAX, AUTO_STREAMING_MAX};
    let path = synth("prefix-auto", 16);
    let m = facts(&path);
    let with = |p: PrefixCacheBudget, ram_bytes: u64, gpu: Option<u64>| {
        let gpu =
            gpu.map(|v| strata_plan::GpuMemory { vram_total: v, vram_free: v, simulated: true });
        let req = PlanRequest { gpu, parallel: 4, prefix_cache: p, ..request(StreamMode::Auto) };
        make_plan(&m, &ram(ram_bytes), (Bandwidths::DEFAULTS, RatesSource::Defaults), &req)
    };
    let pair = |ram_bytes: u64, gpu: Option<u64>| {
        (
            with(PrefixCacheBudget::Bytes(0), ram_bytes, gpu),
            with(PrefixCacheBudget::Auto, ram_bytes, gpu),
        )
    };
    let resident = m.dense_memory_bytes + m.expert_memory_bytes;
    // Resident in RAM: a machine with ~3 GB free after everything, and one with far more.
    for spare in [3u64 << 30, 64 << 30] {
        let (base, auto) = pair(resident + spare, None);
        assert_eq!(base.strategy, Strategy::Resident, "{}", base.reason);
        let m0 = &base.memory;
        let free = m0.available - m0.resident_total - m0.reserve;
        assert_eq!(auto.memory.prefix_cache, (free / 2).min(AUTO_MAX));
        assert_eq!(auto.strategy, Strategy::Resident, "{}", auto.reason);
        assert_eq!(auto.memory.kv_cache, m0.kv_cache);
        assert_eq!(auto.memory.resident_total, m0.resident_total + auto.memory.prefix_cache);
    }
    assert_eq!(pair(resident + (64 << 30), None).1.memory.prefix_cache, AUTO_MAX);
    // Resident in VRAM: half of the VRAM left free.
    let (base, auto) = pair(64 << 30, Some(resident + (6 << 30)));
    assert_eq!(base.strategy, Strategy::Resident, "{}", base.reason);
    let g = base.gpu.as_ref().unwrap();
    let free = g.memory.vram_free - g.vram_resident_total;
    assert!(free > 1 << 30, "{free}");
    assert_eq!(auto.memory.prefix_cache, free / 2);
    assert_eq!(auto.strategy, Strategy::Resident, "{}", auto.reason);
    // Experts streaming from the drive: a small share of the expert cache's room.
    // (Available memory that leaves a third of the experts' bytes after everything else and
    // the host reserve of 512 MiB + 5% of available.)
    let big = pair(64 << 30, None).0;
    let room = big.memory.resident_total - big.memory.expert_weights + m.expert_memory_bytes / 3;
    let (base, auto) = pair((room + (512 << 20)) * 20 / 19, None);
    assert_eq!(base.strategy, Strategy::ExpertStreaming, "{}", base.reason);
    let p = auto.memory.prefix_cache;
    assert!(p > 0 && p <= AUTO_STREAMING_MAX, "{p}");
    assert_eq!(auto.strategy, Strategy::ExpertStreaming, "{}", auto.reason);
    let (c0, c1) = (base.expert_cache_bytes.unwrap(), auto.expert_cache_bytes.unwrap());
    assert!(c1 < c0 && c0 - c1 <= p + m.bytes_per_expert, "cache {c0} → {c1}, prefix {p}");
    // Nothing fits: none.
    let (base, auto) = pair(m.dense_memory_bytes / 2, None);
    assert_eq!(base.strategy, Strategy::TooLarge);
    assert_eq!(auto.memory.prefix_cache, 0);
    let _ = std::fs::remove_file(&path);
}
