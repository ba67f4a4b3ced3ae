//! The plan on a GPU (`--device cuda`, or `--vram` to plan for one): VRAM, page-locked host RAM
//! and the drive as three tiers.
//!
//! - RESIDENT: dense weights, every expert, the KV cache and compute buffers fit in free VRAM
//!   minus a reserve.
//! - GPU-OFFLOAD: dense weights, KV and compute buffers fit in VRAM with room for at least top-k + 1
//!   experts; the rest of VRAM is the VRAM expert cache (`--gpu-expert-cache`), the host expert
//!   cache (page-locked, `--expert-cache`) holds what RAM allows, and the drive the rest.
//! - TOO-LARGE: the dense weights and KV cache do not fit in VRAM (Strata does not split layers
//!   between the GPU and the CPU, unlike llama.cpp's `-ngl`).
//!
//! Cost model per decoded token: compute (bytes touched ÷ an effective GPU rate) + copies of the
//! experts VRAM misses (÷ pinned host-to-device GB/s) + reads of the experts the host misses
//! (÷ drive GB/s), not overlapped. Hit rates are typical decode routing's at each tier's share
//! ([`crate::hit_curve`]); both caches keep the most recently used experts, so the drive serves
//! `1 − max(VRAM, host)` of them. The GPU rates are measured on the lent H100
//! (docs/performance.md, "CUDA"), not on this machine: the plan says so.

use crate::budget::{cache_entries, cache_room, CacheBudget, VRAM_RESERVE};
use serde::Serialize;

use crate::facts::ModelFacts;

/// The GPU as the plan sees it, bytes.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct GpuMemory {
    pub vram_total: u64,
    /// Free VRAM before the model loads.
    pub vram_free: u64,
    /// True when the figures come from `--vram`, not a device.
    pub simulated: bool,
}

/// Rates of the GPU path, measured on the H100 with the synthetic qwen3-30b-a3b Q4_K
/// (docs/performance.md, "CUDA" and "GPU expert tier").
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct GpuRates {
    /// Pinned host-to-device copy, GB/s (torch, 1 GiB).
    pub h2d_gbps: f64,
    /// Bytes touched per token ÷ decode time, fully resident (fused expert kernels), GB/s.
    pub resident_gbps: f64,
    /// The same with experts behind the VRAM expert tier's pool (Q4_K experts, fused kernels), GB/s.
    pub tiered_gbps: f64,
    /// The same with other formats (one launch per expert and projection), GB/s.
    pub tiered_per_expert_gbps: f64,
    /// Prefill: 2 · active params · tokens ÷ time, GFLOP/s.
    pub prefill_gflops: f64,
}

impl GpuRates {
    /// H100 80GB HBM3, synthetic qwen3-30b-a3b Q4_K (1.76 GB touched per token), over four
    /// device sessions: pinned H2D 52.5–55.1 GB/s; through the VRAM pool 53–63 tok/s (93–111
    /// GB/s), per expert 26–27 tok/s (46 GB/s); pp512 939 tok/s on 3.3 B active params. Resident
    /// decode with the GPU decode step (docs/performance.md "GPU decode step", two sessions):
    /// 132–136 tok/s (232–239 GB/s) launched op by op (device routing, our attention kernels),
    /// 181–183 tok/s (319–322 GB/s) where the step is replayed from a CUDA graph (one sequence,
    /// no hybrid layers). The op-by-op lower end is used: a floor for attention-only models;
    /// hybrids (Gated DeltaNet layers still on the host) decode slower, not re-measured.
    pub const H100: GpuRates = GpuRates {
        h2d_gbps: 52.5,
        resident_gbps: 232.0,
        tiered_gbps: 93.0,
        tiered_per_expert_gbps: 46.0,
        prefill_gflops: 6000.0,
    };
}

/// The GPU part of a plan.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GpuPlan {
    pub memory: GpuMemory,
    /// VRAM for everything resident: dense + experts + KV + compute + reserve.
    pub vram_resident_total: u64,
    /// VRAM that dense weights, KV, compute buffers and the reserve take.
    pub vram_fixed: u64,
    /// GPU-OFFLOAD: the VRAM expert cache, bytes and experts.
    pub vram_expert_cache_bytes: Option<u64>,
    pub vram_expert_cache_experts: Option<u64>,
    /// GPU-OFFLOAD: the page-locked host expert cache, bytes and experts.
    pub host_expert_cache_bytes: Option<u64>,
    pub host_expert_cache_experts: Option<u64>,
    /// Typical decode routing's hit rates at each tier's share of the experts.
    pub expected_vram_hit_rate: Option<f64>,
    pub expected_host_hit_rate: Option<f64>,
    /// Per decoded token, ms: compute, VRAM-miss copies, drive reads.
    pub decode_compute_ms: f64,
    pub decode_copy_ms: f64,
    pub decode_read_ms: f64,
    pub rates: GpuRates,
}

/// What [`plan_gpu`] decides.
#[derive(Debug, Clone, PartialEq)]
pub enum GpuDecision {
    Resident,
    Offload,
    TooLarge(String),
}

/// Inputs of [`plan_gpu`] besides the model.
#[derive(Debug, Clone, Copy)]
pub struct GpuInputs {
    pub gpu: GpuMemory,
    /// KV cache + recurrent state + compute buffers, bytes (as the host plan counts them).
    pub kv_and_compute: u64,
    /// `--stream-experts on`: offload even when everything fits.
    pub force_offload: bool,
    pub gpu_expert_cache: CacheBudget,
    pub host_expert_cache: CacheBudget,
    /// Host memory available for the host expert cache (RAM available minus the reserve).
    pub host_available: u64,
    pub drive_gbps: f64,
    pub prefill_chunk: usize,
}

fn gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / 1e9)
}

/// Strategy, caches and estimate on a GPU. Returns the decision, its reason, the GPU plan and the
/// prefill estimate (tok/s).
pub fn plan_gpu(model: &ModelFacts, x: &GpuInputs) -> (GpuDecision, String, GpuPlan, f64) {
    let rates = GpuRates::H100;
    // Stored bytes (HF floats widened to f32 as on the host).
    let dense = model.dense_memory_bytes;
    let fixed = dense + x.kv_and_compute + VRAM_RESERVE;
    let resident_total = fixed + model.expert_memory_bytes;
    let free = x.gpu.vram_free;
    let n_experts = (model.experts * model.moe_layers) as u64;
    let entry = model.expert_memory_bytes / n_experts.max(1);
    let min_cache = entry * (model.experts_per_token as u64 + 1);
    let fits = resident_total <= free;
    let decision = if fits && !(x.force_offload && model.is_moe()) {
        GpuDecision::Resident
    } else if model.is_moe() && fixed + min_cache <= free {
        GpuDecision::Offload
    } else {
        let need = if model.is_moe() { fixed + min_cache } else { resident_total };
        GpuDecision::TooLarge(format!(
            "needs {} of VRAM ({} dense weights, KV and compute{}) but {} is free; Strata does not split layers between GPU and CPU: use --device cpu",
            gb(need),
            gb(fixed),
            if model.is_moe() { " plus top-k + 1 experts" } else { "" },
            gb(free)
        ))
    };
    let per_token = model.dense_bytes_per_token + model.expert_bytes_per_token;
    let mut plan = GpuPlan {
        memory: x.gpu,
        vram_resident_total: resident_total,
        vram_fixed: fixed,
        vram_expert_cache_bytes: None,
        vram_expert_cache_experts: None,
        host_expert_cache_bytes: None,
        host_expert_cache_experts: None,
        expected_vram_hit_rate: None,
        expected_host_hit_rate: None,
        decode_compute_ms: per_token as f64 / (rates.resident_gbps * 1e9) * 1e3,
        decode_copy_ms: 0.0,
        decode_read_ms: 0.0,
        rates,
    };
    let reason = match &decision {
        GpuDecision::Resident => {
            format!("everything fits in VRAM: {} needed of {} free", gb(resident_total), gb(free))
        }
        GpuDecision::TooLarge(r) => r.clone(),
        GpuDecision::Offload => {
            let vram_bytes =
                x.gpu_expert_cache.resolve(model.expert_memory_bytes, cache_room(free, fixed, 0));
            let vram_experts = cache_entries(
                CacheBudget::Bytes(vram_bytes),
                n_experts as usize,
                model.experts_per_token,
                entry,
                0,
            ) as u64;
            let host_bytes = x.host_expert_cache.resolve(model.expert_bytes, x.host_available);
            let host_experts = (host_bytes / model.bytes_per_expert.max(1)).min(n_experts);
            let share = |n: u64| n as f64 / n_experts.max(1) as f64;
            let (hv, hh) = (
                crate::hit_curve::typical_hit_rate(share(vram_experts)),
                crate::hit_curve::typical_hit_rate(share(host_experts)),
            );
            plan.vram_expert_cache_bytes = Some(vram_experts * entry);
            plan.vram_expert_cache_experts = Some(vram_experts);
            plan.host_expert_cache_bytes = Some(host_experts * model.bytes_per_expert);
            plan.host_expert_cache_experts = Some(host_experts);
            plan.expected_vram_hit_rate = Some(hv);
            plan.expected_host_hit_rate = Some(hh);
            // The pool takes Q4_K experts (strata_models::FusedExperts::supports).
            let rate = if model.quantization == "Q4K" {
                rates.tiered_gbps
            } else {
                rates.tiered_per_expert_gbps
            };
            plan.decode_compute_ms = per_token as f64 / (rate * 1e9) * 1e3;
            plan.decode_copy_ms =
                model.expert_bytes_per_token as f64 * (1.0 - hv) / (rates.h2d_gbps * 1e9) * 1e3;
            // Both caches keep the most recently used experts: a VRAM miss reads the drive unless
            // the host cache is the larger one and holds it.
            plan.decode_read_ms = model.expert_bytes_per_token as f64 * (1.0 - hv.max(hh))
                / (x.drive_gbps * 1e9)
                * 1e3;
            format!(
                "{} of VRAM for everything but {} free: dense weights + KV in VRAM, VRAM expert cache {} ({vram_experts} of {n_experts} experts), page-locked host expert cache {} ({host_experts}){}",
                gb(resident_total),
                gb(free),
                gb(vram_experts * entry),
                gb(host_experts * model.bytes_per_expert),
                if host_experts < n_experts { ", the rest from the drive" } else { ": every expert in host RAM" }
            )
        }
    };
    let c = x.prefill_chunk.clamp(1, 512) as f64;
    let prefill =
        c / (2.0 * model.active_params as f64 * c / (rates.prefill_gflops * 1e9)).max(1e-9);
    (decision, reason, plan, prefill)
}
