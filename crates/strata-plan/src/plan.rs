//! The plan: which strategy fits this model on this machine, how big the expert cache is, and what
//! speed to expect, from [`ModelFacts`], [`SystemMemory`] and [`Bandwidths`] only.
//!
//! Cost model (per decoded token, reads and compute not overlapped, as the engine runs today):
//! `expert bytes touched × (1 − hit rate) ÷ drive GB/s + (dense bytes per token + expert bytes
//! touched) ÷ matvec GB/s`. The expected hit rate is that of typical decode routing
//! ([`crate::hit_curve`], calibrated to published measurements of trained models); the uniform
//! floor (cached ÷ all experts) is reported beside it. When previous runs of the
//! model were measured ([`crate::observed`]), their hit rate (scaled to this cache size) and compute
//! time per token replace the floor and the bandwidth-derived compute time. Prefill per chunk of `C`
//! tokens: `2 · active params · C ÷ GEMM rate` plus, when streaming, the reads of the experts the
//! chunk touches (`1 − (1 − k/E)^C` of each layer's experts under uniform routing).

use crate::budget::{cache_entries, cache_room, host_reserve, CacheBudget};
use serde::Serialize;

use crate::calibrate::{Bandwidths, RatesSource};
use crate::facts::ModelFacts;
use crate::gpu::{plan_gpu, GpuDecision, GpuInputs, GpuMemory, GpuPlan};
use crate::observed::{miss_rate_at, Observed};
use crate::prefix::PrefixCacheBudget;
use crate::system::SystemMemory;

/// `--stream-experts`: `auto` streams only when the model does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamMode {
    #[default]
    Auto,
    On,
    Off,
}

impl std::str::FromStr for StreamMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match crate::switch::parse_switch("--stream-experts", s)? {
            crate::switch::Switch::Auto => Self::Auto,
            crate::switch::Switch::On => Self::On,
            crate::switch::Switch::Off => Self::Off,
        })
    }
}

/// What the user asked for.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    pub ctx_size: usize,
    pub prefill_chunk: usize,
    pub stream: StreamMode,
    /// `--expert-cache`; `Auto` sizes it from what is left.
    pub expert_cache: CacheBudget,
    pub draft: Option<ModelFacts>,
    /// What previous runs of this model measured ([`crate::observed`]).
    pub observed: Option<Observed>,
    /// Plan for this GPU (`--device cuda`, or `--vram`); `None`: the CPU.
    pub gpu: Option<GpuMemory>,
    /// `--gpu-expert-cache` (with `gpu`).
    pub gpu_expert_cache: CacheBudget,
    /// Sequences served at once (`serve --parallel`): one KV cache (and draft KV cache) each.
    pub parallel: usize,
    /// The server's prefix cache (`serve --prefix-cache`): bytes, or `auto`
    /// ([`crate::prefix::auto_bytes`]; the plan's [`MemoryBudget::prefix_cache`] says how many).
    pub prefix_cache: PrefixCacheBudget,
}

/// The strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Strategy {
    #[serde(rename = "RESIDENT")]
    Resident,
    #[serde(rename = "EXPERT-STREAMING")]
    ExpertStreaming,
    /// On a GPU: dense weights in VRAM, experts in a VRAM expert cache over page-locked host RAM
    /// (and the drive).
    #[serde(rename = "GPU-OFFLOAD")]
    GpuOffload,
    #[serde(rename = "TOO-LARGE")]
    TooLarge,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Self::Resident => "RESIDENT",
            Self::ExpertStreaming => "EXPERT-STREAMING",
            Self::GpuOffload => "GPU-OFFLOAD",
            Self::TooLarge => "TOO-LARGE",
        }
    }
}

/// Memory the plan accounts for, bytes.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MemoryBudget {
    /// Dense weights once loaded (stored bytes; safetensors widened to f32).
    pub dense_weights: u64,
    /// All routed experts if resident.
    pub expert_weights: u64,
    /// KV caches and recurrent state of every sequence slot: `parallel × (ctx × per-token +
    /// recurrent state)`.
    pub kv_cache: u64,
    /// The server's prefix cache (KV blocks kept for reuse): `--prefix-cache` bytes, or what
    /// `auto` chose ([`crate::prefix::auto_bytes`]).
    pub prefix_cache: u64,
    /// Activations, logits, thread stacks: `prefill_chunk · hidden · 64 + vocab · 8 + 64 MiB`.
    pub compute_buffers: u64,
    /// Draft model weights and one draft KV cache per sequence slot.
    pub draft: u64,
    /// Kept free for the OS and page cache: 512 MiB + 5% of available.
    pub reserve: u64,
    /// Everything resident: dense + experts + KV + compute + draft.
    pub resident_total: u64,
    pub available: u64,
}

/// Expected speed.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Estimate {
    pub decode_tok_s: f64,
    pub prefill_tok_s: f64,
    /// Per decoded token: drive reads and compute, ms.
    pub decode_read_ms: f64,
    pub decode_compute_ms: f64,
    pub rates: Bandwidths,
    pub rates_source: RatesSource,
    /// Measurements of previous runs used instead of the typical-routing hit rate and the
    /// bandwidth-derived compute time, when there are any.
    pub observed: Option<Observed>,
}

/// A plan (`strata info`; `serve` and `generate` make the same one at start-up).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Plan {
    pub model: ModelFacts,
    pub system: SystemMemory,
    pub ctx_size: usize,
    /// Sequence slots the KV caches are counted for.
    pub parallel: usize,
    pub memory: MemoryBudget,
    /// Everything resident ÷ available memory (> 1: does not fit resident).
    pub overcommit: f64,
    pub strategy: Strategy,
    pub reason: String,
    /// Expert cache when streaming, bytes, and how many experts it holds.
    pub expert_cache_bytes: Option<u64>,
    pub expert_cache_experts: Option<u64>,
    /// Under typical decode routing ([`crate::hit_curve`]), or scaled from previous runs.
    pub expected_hit_rate: Option<f64>,
    /// Under uniform routing: cached ÷ all experts (the worst case).
    pub hit_rate_floor: Option<f64>,
    pub estimate: Estimate,
    pub warnings: Vec<String>,
    /// The `strata serve` command line this plan recommends (absent when TOO-LARGE).
    pub recommended_command: Option<String>,
    /// The GPU tiers, when planning for a GPU ([`crate::gpu`]).
    pub gpu: Option<GpuPlan>,
}

impl Strategy {
    /// Whether routed experts stream (from the drive, or through the GPU expert tier).
    pub fn streams_experts(self) -> bool {
        matches!(self, Self::ExpertStreaming | Self::GpuOffload)
    }
}

const GB: f64 = 1e9;

fn gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / GB)
}

/// Makes the plan. Never fails: a model that cannot run gets `TOO-LARGE` with the reason.
/// `--prefix-cache auto` plans twice: without a prefix cache, then with what
/// [`crate::prefix::auto_bytes`] takes of the memory that plan leaves.
pub fn make_plan(
    model: &ModelFacts,
    system: &SystemMemory,
    rates: (Bandwidths, RatesSource),
    req: &PlanRequest,
) -> Plan {
    let prefix_cache = match req.prefix_cache {
        PrefixCacheBudget::Bytes(b) => b,
        PrefixCacheBudget::Auto => {
            let mut sized = req.clone();
            sized.prefix_cache = PrefixCacheBudget::Bytes(0);
            let base = make_plan(model, system, rates.clone(), &sized);
            sized.prefix_cache = PrefixCacheBudget::Bytes(crate::prefix::auto_bytes(&base));
            return make_plan(model, system, rates, &sized);
        }
    };
    let slots = req.parallel.max(1) as u64;
    let per_seq_kv = req.ctx_size as u64 * model.kv_bytes_per_token + model.recurrent_state_bytes;
    let kv = slots * per_seq_kv + prefix_cache;
    let compute = (req.prefill_chunk.min(req.ctx_size) * model.hidden * 64 + model.vocab * 8)
        as u64
        + (64 << 20);
    let draft = req.draft.as_ref().map_or(0, |d| {
        d.dense_memory_bytes
            + d.expert_memory_bytes
            + slots * req.ctx_size as u64 * d.kv_bytes_per_token
    });
    let available = system.available;
    let reserve = host_reserve(available);
    let fixed = model.dense_memory_bytes + kv + compute + draft;
    let resident_total = fixed + model.expert_memory_bytes;
    let memory = MemoryBudget {
        dense_weights: model.dense_memory_bytes,
        expert_weights: model.expert_memory_bytes,
        kv_cache: kv - prefix_cache,
        prefix_cache,
        compute_buffers: compute,
        draft,
        reserve,
        resident_total,
        available,
    };
    let overcommit = resident_total as f64 / available.max(1) as f64;
    let mut warnings = Vec::new();
    if let Some(d) = &req.draft {
        // Memory guard (SwiftLM #72): a draft model's weights compete with the expert cache.
        let main = model.dense_memory_bytes + model.expert_memory_bytes;
        let draft_w = d.dense_memory_bytes + d.expert_memory_bytes;
        let weights = main + draft_w;
        if weights as f64 > 0.7 * system.ram_total as f64 {
            warnings.push(format!(
                "main weights {} + draft weights {} = {} is {:.0}% of {} RAM (> 70%): the expert cache shrinks so that main + draft + cache stay inside memory",
                gb(main),
                gb(draft_w),
                gb(weights),
                100.0 * weights as f64 / system.ram_total.max(1) as f64,
                gb(system.ram_total),
            ));
        }
    }
    if let Some(g) = req.gpu {
        let x = GpuInputs {
            gpu: g,
            kv_and_compute: kv + compute + draft,
            force_offload: req.stream == StreamMode::On,
            gpu_expert_cache: req.gpu_expert_cache,
            host_expert_cache: req.expert_cache,
            host_available: cache_room(available, compute, reserve),
            drive_gbps: rates.0.drive_gbps,
            prefill_chunk: req.prefill_chunk,
        };
        let (decision, reason, gpu, prefill) = plan_gpu(model, &x);
        let strategy = match decision {
            GpuDecision::Resident => Strategy::Resident,
            GpuDecision::Offload => Strategy::GpuOffload,
            GpuDecision::TooLarge(_) => Strategy::TooLarge,
        };
        let ms = gpu.decode_compute_ms + gpu.decode_copy_ms + gpu.decode_read_ms;
        let estimate = Estimate {
            decode_tok_s: 1e3 / ms.max(1e-9),
            prefill_tok_s: prefill,
            decode_read_ms: gpu.decode_read_ms,
            decode_compute_ms: gpu.decode_compute_ms,
            rates: rates.0,
            rates_source: rates.1,
            observed: None,
        };
        let recommended_command = (strategy != Strategy::TooLarge).then(|| {
            let mut c = format!(
                "strata serve --model {} --ctx-size {} --device cuda",
                shell_quote(&model.path),
                req.ctx_size
            );
            match (gpu.host_expert_cache_bytes, gpu.vram_expert_cache_bytes) {
                (Some(h), Some(v)) => {
                    c += &format!(
                        " --stream-experts on --expert-cache {}MiB --gpu-expert-cache {}MiB",
                        h >> 20,
                        v >> 20
                    )
                }
                _ => c += " --stream-experts off",
            }
            c
        });
        return Plan {
            model: model.clone(),
            system: *system,
            ctx_size: req.ctx_size,
            parallel: req.parallel.max(1),
            overcommit: gpu.vram_resident_total as f64 / g.vram_free.max(1) as f64,
            memory,
            strategy,
            reason,
            expert_cache_bytes: gpu.host_expert_cache_bytes,
            expert_cache_experts: gpu.host_expert_cache_experts,
            expected_hit_rate: gpu.expected_vram_hit_rate,
            hit_rate_floor: gpu
                .vram_expert_cache_experts
                .map(|n| n as f64 / (model.experts * model.moe_layers).max(1) as f64),
            estimate,
            warnings,
            recommended_command,
            gpu: Some(gpu),
        };
    }
    // Memory one cached expert costs: its slot, plus f32 tensors decoded beside it for safetensors.
    let entry = if model.expert_memory_bytes > model.expert_bytes {
        model.bytes_per_expert
            + model.expert_memory_bytes / (model.experts * model.moe_layers).max(1) as u64
    } else {
        model.bytes_per_expert
    };
    let min_cache = entry * (model.experts_per_token as u64 + 1);
    let fits_resident = resident_total + reserve <= available;
    let can_stream = model.is_moe() && fixed + min_cache + reserve <= available;
    let (strategy, reason) = match req.stream {
        StreamMode::Off | StreamMode::Auto if fits_resident => (
            Strategy::Resident,
            format!(
                "everything fits: {} needed of {} available",
                gb(resident_total + reserve),
                gb(available)
            ),
        ),
        StreamMode::On if !model.is_moe() && fits_resident => {
            warnings.push(
                "--stream-experts on: the model has no routed experts; loading it resident".into(),
            );
            (
                Strategy::Resident,
                format!("dense model, fits: {} of {}", gb(resident_total + reserve), gb(available)),
            )
        }
        StreamMode::On | StreamMode::Auto if can_stream => (
            Strategy::ExpertStreaming,
            if fits_resident {
                "streaming asked for (--stream-experts on) although everything fits".to_string()
            } else {
                format!("all weights need {} but {} is available; dense weights + KV fit, experts stream from disk", gb(resident_total + reserve), gb(available))
            },
        ),
        mode => {
            let need = if model.is_moe() && mode != StreamMode::Off {
                fixed + min_cache + reserve
            } else {
                resident_total + reserve
            };
            let mut reason = format!(
                "needs {} but {} is available ({} short)",
                gb(need),
                gb(available),
                gb(need.saturating_sub(available))
            );
            if mode == StreamMode::Off && model.is_moe() && can_stream {
                reason += "; --stream-experts auto would stream the experts";
            }
            reason += &lower_kv_hint(model, req, prefix_cache, need - kv, available);
            let bits = (model.dense_bytes + model.expert_bytes) as f64 * 8.0
                / model.total_params.max(1) as f64;
            if bits > 5.0 {
                reason += &format!(
                    "; a ~4.5-bit quantization (Q4_K) would store the weights in about {}",
                    gb((model.total_params as f64 * 4.5 / 8.0) as u64)
                );
            }
            (Strategy::TooLarge, reason)
        }
    };
    let (cache, cache_experts, hit) = if strategy == Strategy::ExpertStreaming {
        let left = cache_room(available, fixed, reserve);
        let asked = req.expert_cache.resolve(model.expert_bytes, left);
        let asked = match (asked > left, req.draft.is_some()) {
            (true, true) => {
                warnings.push(format!(
                    "--expert-cache {} shrunk to {}: the draft model's {} leaves no more",
                    gb(asked),
                    gb(left),
                    gb(draft)
                ));
                left
            }
            (true, false) => {
                warnings.push(format!(
                    "--expert-cache {} exceeds the {} left after dense weights, KV and reserve",
                    gb(asked),
                    gb(left)
                ));
                asked
            }
            (false, _) => asked,
        };
        let n_experts = (model.experts * model.moe_layers) as u64;
        let cache_experts = cache_entries(
            CacheBudget::Bytes(asked),
            n_experts as usize,
            model.experts_per_token,
            entry,
            left,
        ) as u64;
        let f = cache_experts as f64 / n_experts.max(1) as f64;
        let miss = req
            .observed
            .as_ref()
            .map_or(1.0 - crate::hit_curve::typical_hit_rate(f), |o| miss_rate_at(o, f));
        (Some(cache_experts * entry), Some(cache_experts), Some((1.0 - miss, f)))
    } else {
        (None, None, None)
    };
    let (hit, hit_rate_floor) = (hit.map(|h| h.0), hit.map(|h| h.1));
    let estimate = estimate(model, req, hit, rates);
    let recommended_command = (strategy != Strategy::TooLarge).then(|| {
        let mut c = format!(
            "strata serve --model {} --ctx-size {}",
            shell_quote(&model.path),
            req.ctx_size
        );
        if req.parallel > 1 {
            c += &format!(" --parallel {}", req.parallel);
        }
        match (strategy, cache) {
            (Strategy::ExpertStreaming, Some(b)) => {
                c += &format!(" --stream-experts on --expert-cache {}MiB", b >> 20)
            }
            _ => c += " --stream-experts off",
        }
        c
    });
    Plan {
        model: model.clone(),
        system: *system,
        ctx_size: req.ctx_size,
        parallel: req.parallel.max(1),
        memory,
        overcommit,
        strategy,
        reason,
        expert_cache_bytes: cache,
        expert_cache_experts: cache_experts,
        expected_hit_rate: hit,
        hit_rate_floor,
        estimate,
        warnings,
        recommended_command,
        gpu: None,
    }
}

fn estimate(
    model: &ModelFacts,
    req: &PlanRequest,
    hit: Option<f64>,
    (rates, source): (Bandwidths, RatesSource),
) -> Estimate {
    let miss = 1.0 - hit.unwrap_or(1.0);
    // Reads stall decoding except for what prefetch hid behind compute in previous runs.
    let hidden_s = req
        .observed
        .as_ref()
        .filter(|o| o.cache_fraction < 1.0)
        .map_or(0.0, |o| o.hidden_read_ms_per_token / 1e3);
    let read_s =
        (model.expert_bytes_per_token as f64 * miss / (rates.drive_gbps * GB) - hidden_s).max(0.0);
    // Streaming plans take streamed runs' compute time (their reads' CPU work included), resident
    // plans resident runs'; the calibrated matvec rate otherwise.
    let measured = req.observed.as_ref().and_then(|o| {
        if hit.is_some() {
            (o.cache_fraction < 1.0).then_some(o.compute_ms_per_token)
        } else {
            o.resident_compute_ms_per_token
        }
    });
    let compute_s = match measured {
        Some(ms) => ms / 1e3,
        None => {
            model.dense_bytes_per_token as f64
                / (rates.dense_matvec_gbps.unwrap_or(rates.matvec_gbps) * GB)
                + model.expert_bytes_per_token as f64 / (rates.matvec_gbps * GB)
        }
    };
    let c = req.prefill_chunk.clamp(1, 512) as f64;
    let prefill_compute = 2.0 * model.active_params as f64 * c / (rates.gemm_gflops * 1e9);
    let touched = if model.experts > 0 {
        1.0 - (1.0 - model.experts_per_token as f64 / model.experts as f64).powf(c)
    } else {
        0.0
    };
    let prefill_read = model.expert_bytes as f64 * touched * miss / (rates.drive_gbps * GB);
    Estimate {
        decode_tok_s: 1.0 / (read_s + compute_s).max(1e-9),
        prefill_tok_s: c / (prefill_compute + prefill_read).max(1e-9),
        decode_read_ms: read_s * 1e3,
        decode_compute_ms: compute_s * 1e3,
        rates,
        rates_source: source,
        observed: req.observed,
    }
}

/// What to lower so that the KV caches fit, when that is enough: `--parallel`, `--prefix-cache`,
/// `--ctx-size` (`without_kv`: what the plan needs besides KV caches and the `prefix` bytes of
/// the prefix cache).
fn lower_kv_hint(
    model: &ModelFacts,
    req: &PlanRequest,
    prefix: u64,
    without_kv: u64,
    available: u64,
) -> String {
    let mut hint = String::new();
    if available <= without_kv || model.kv_bytes_per_token == 0 {
        return hint;
    }
    let room = available - without_kv;
    let per_seq = req.ctx_size as u64 * model.kv_bytes_per_token + model.recurrent_state_bytes;
    let slots = req.parallel.max(1) as u64;
    if prefix > 0 {
        hint += &format!("; the prefix cache takes {} (--prefix-cache 0 frees it)", gb(prefix));
    }
    if slots > 1 {
        let fit = room.saturating_sub(prefix) / per_seq.max(1);
        if fit >= 1 {
            hint += &format!("; --parallel {} would fit", fit.min(slots - 1));
        }
    }
    let per_slot = room.saturating_sub(prefix) / slots;
    let ctx = per_slot.saturating_sub(model.recurrent_state_bytes) / model.kv_bytes_per_token;
    if ctx >= 256 {
        hint += &format!("; --ctx-size {} would fit", ctx / 256 * 256);
    }
    hint
}

fn shell_quote(s: &str) -> String {
    if s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-+:".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

impl Plan {
    /// One line for start-up logs.
    pub fn summary(&self) -> String {
        let mut s = format!("plan: {} ({})", self.strategy.name(), self.reason);
        if let (Some(c), Some(n), Some(h)) =
            (self.expert_cache_bytes, self.expert_cache_experts, self.expected_hit_rate)
        {
            let basis = if self.estimate.observed.is_some() {
                "from previous runs"
            } else {
                "typical routing"
            };
            s += &format!(
                " | expert cache {} ({n} experts, expected hit rate {:.0}%, {basis})",
                gb(c),
                h * 100.0
            );
        }
        if self.memory.prefix_cache > 0 {
            s += &format!(" | prefix cache {}", gb(self.memory.prefix_cache));
        }
        if self.strategy != Strategy::TooLarge {
            s += &format!(
                " | est. decode {:.1} tok/s, prefill {:.0} tok/s",
                self.estimate.decode_tok_s, self.estimate.prefill_tok_s
            );
            if self.estimate.rates_source == RatesSource::Defaults {
                s += " (default bandwidths: run `strata info --calibrate`)";
            }
        }
        s
    }
}
