//! Model-loading flags shared by every subcommand.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use strata_engine::{
    CacheBudget, DirectIo, Engine, EvictionPolicy, LoadRequest, PrefetchMode, StreamOptions,
};
use strata_plan::{Plan, StreamMode};

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a .gguf file or a Hugging Face directory (config.json + safetensors). Default: the
    /// SmolLM2-135M-Instruct Q4_1 GGUF, fetched into models/ on first use.
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Context size in tokens (KV cache capacity).
    #[arg(long, default_value_t = 4096)]
    pub ctx_size: usize,
    /// Prompt tokens per prefill forward pass.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// CPU threads (default: physical cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// MoE models: keep dense weights resident and read routed experts from the model file on
    /// demand into the expert cache. `auto` (default) streams only when the memory plan says the
    /// model does not fit; `--stream-experts` alone means `on`.
    #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "on", value_parser = clap::value_parser!(StreamMode))]
    pub stream_experts: StreamMode,
    /// Plan as if the machine had this much available RAM (e.g. `16GiB`; also $STRATA_RAM_BYTES).
    #[arg(long, value_parser = strata_plan::parse_bytes)]
    pub ram: Option<u64>,
    /// With --device cuda: plan as if the GPU had this much free VRAM (e.g. `24GiB`); `strata info
    /// --device cuda --vram 24GiB` plans for a GPU on a machine without one.
    #[arg(long, value_parser = strata_plan::parse_bytes)]
    pub vram: Option<u64>,
    /// Expert cache budget with --stream-experts: bytes (`6GiB`, `512MiB`), a percentage of the
    /// model's expert bytes (`10%`), or `auto` (what the memory plan leaves: available memory,
    /// cgroup limit included, minus dense weights, KV cache, compute buffers and a 512 MiB + 5%
    /// reserve).
    #[arg(long, default_value = "auto", value_parser = clap::value_parser!(CacheBudget))]
    pub expert_cache: CacheBudget,
    /// With --device cuda and --stream-experts: the VRAM expert cache above the host expert cache
    /// (which is page-locked, and fed by the drive): bytes (`20GiB`), a percentage of the model's
    /// experts (`25%`), or `auto` (free VRAM minus dense weights, KV cache, compute buffers and a
    /// 2 GiB reserve).
    #[arg(long, default_value = "auto", value_parser = clap::value_parser!(CacheBudget))]
    pub gpu_expert_cache: CacheBudget,
    /// Read experts with O_DIRECT, bypassing the page cache: `auto` (default) where the model's
    /// filesystem supports it, `on` (an error where it does not), `off` (buffered reads through
    /// the page cache). `--direct-io` alone means `on`.
    #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "on", value_parser = clap::value_parser!(DirectIo))]
    pub direct_io: DirectIo,
    /// Expert reads in flight at once (reader threads).
    #[arg(long, default_value_t = 16)]
    pub io_threads: usize,
    /// Expert cache eviction policy: lru (default), lru2 (LRU-2, frequency-aware) or lfu. LRU
    /// reads the fewest experts for one sequence and for a batch of them on realistic routing
    /// (simulated on recorded traces, `scripts/sim_expert_cache.py`, and measured:
    /// docs/performance.md, "Streamed experts: batch-aware reads").
    #[arg(long, default_value = "lru", value_parser = clap::value_parser!(EvictionPolicy))]
    pub expert_cache_policy: EvictionPolicy,
    /// Expert prefetch with --stream-experts: while a MoE layer computes, read the experts
    /// predicted for the next one. `pregate` (the next layer's router on the current hidden
    /// state), `previous` (the experts that layer used for the previous token), `union` of both,
    /// or `off`. Every predictor's precision/recall is reported either way.
    #[arg(long, default_value = "pregate", value_parser = clap::value_parser!(PrefetchMode))]
    pub prefetch: PrefetchMode,
    /// Read predictions only while the predictor's measured precision on experts the cache lacks
    /// is at least this (measured whether or not they are read; 0: always read them).
    #[arg(long, default_value_t = strata_engine::expert_store::DEFAULT_PREFETCH_MIN_PRECISION)]
    pub prefetch_min_precision: f64,
    /// Split expert reads longer than this into concurrent pieces (e.g. `512KiB`), so a single
    /// missed expert keeps several reads in flight; 0 (default): never (measured slower on our
    /// test drive, see docs/performance.md).
    #[arg(long, default_value = "0", value_parser = strata_plan::parse_bytes)]
    pub read_chunk: u64,
    /// Use only the K best of the router's experts per token (renormalised to the full top-k's
    /// weight). Trades quality for fewer expert bytes per token.
    #[arg(long, env = "STRATA_MOE_TOP_K")]
    pub moe_top_k: Option<usize>,
    /// Compute device: auto (cuda:0 when built with `--features cuda` and a GPU is present, else
    /// cpu), cpu, cuda, cuda:N.
    #[arg(long, default_value = "auto", value_parser = clap::value_parser!(strata_engine::device::DeviceChoice))]
    pub device: strata_engine::device::DeviceChoice,
    /// Element type of the KV cache's keys and values: f32 or f16 (half the cache's memory, each
    /// key and value rounded to nearest when written; attention computes in f32 — the CPU
    /// kernels widen f16 as they load it; on CUDA prompt passes attend on tensor cores, 3.1×
    /// faster 512-token passes after 16k tokens on an H200; accuracy cost and speed in
    /// docs/performance.md). Default: f16 (as llama.cpp); `f32` keeps full precision at twice the
    /// bytes. The memory plan counts the size.
    #[arg(long, value_parser = clap::value_parser!(strata_models::KvDtype))]
    pub kv_cache_dtype: Option<strata_models::KvDtype>,
    #[command(flatten)]
    pub spec: crate::spec_args::SpecArgs,
    /// What the server will hold besides the model (set by `serve` and `info` from their flags).
    #[arg(skip)]
    pub serving: Serving,
}

/// Memory the plan counts for serving: sequence slots and the prefix cache.
#[derive(Debug, Clone, Copy)]
pub struct Serving {
    /// Sequences at once (`--parallel`): one KV cache each.
    pub parallel: usize,
    /// Prefix cache (`--prefix-cache`): bytes, or `auto` (the plan sizes it).
    pub prefix_cache: strata_plan::PrefixCacheBudget,
}

impl Default for Serving {
    fn default() -> Self {
        Self { parallel: 1, prefix_cache: strata_plan::PrefixCacheBudget::Bytes(0) }
    }
}

impl ModelArgs {
    /// Sets the thread count, resolves the model path, makes the memory plan and loads the model
    /// as the plan says, with a progress bar.
    pub fn load(&self) -> Result<Engine> {
        self.load_with_plan().map(|(e, _)| e)
    }

    /// The model path (fetching the default model when none is given).
    pub fn model_path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => crate::default_model::ensure(),
        }
    }

    /// The plan inputs and streaming settings these flags ask for, on `device`.
    pub fn load_request(&self, device: candle_core::Device) -> Result<LoadRequest> {
        let gpu = self.gpu_memory()?;
        let kv_dtype = self.kv_dtype();
        Ok(LoadRequest {
            ctx_size: self.ctx_size,
            prefill_chunk: self.prefill_chunk,
            stream: self.stream_experts,
            ram: self.ram,
            gpu,
            expert_cache: self.expert_cache,
            gpu_expert_cache: self.gpu_expert_cache,
            draft: self.spec.draft_path().map(|p| p.to_path_buf()),
            direct_io: self.direct_io,
            io_threads: self.io_threads,
            policy: self.expert_cache_policy,
            prefetch: self.prefetch,
            prefetch_min_precision: self.prefetch_min_precision,
            read_chunk: self.read_chunk as usize,
            moe_top_k: self.moe_top_k,
            device,
            parallel: self.serving.parallel,
            prefix_cache: self.serving.prefix_cache,
            kv_dtype,
        })
    }

    /// `--kv-cache-dtype`, else f16 on every device (llama.cpp's default).
    pub fn kv_dtype(&self) -> strata_models::KvDtype {
        self.kv_cache_dtype.unwrap_or(strata_models::KvDtype::F16)
    }

    /// The memory plan for this model and these flags (reads metadata only).
    pub fn plan(&self, path: &std::path::Path) -> Result<Plan> {
        let files = strata_formats::ModelFiles::open(path)?;
        Ok(strata_engine::plan_for(&files, path, &self.load_request(candle_core::Device::Cpu)?)?)
    }

    /// The GPU the plan is for: `--vram` (simulated), else the device's free VRAM when `--device`
    /// opens a CUDA device; `None` for the CPU. Errors: CUDA asked for and not available (without
    /// `--vram`).
    pub fn gpu_memory(&self) -> Result<Option<strata_plan::GpuMemory>> {
        let cuda = matches!(self.device, strata_engine::device::DeviceChoice::Cuda(_));
        if let (Some(v), true) = (self.vram, cuda) {
            return Ok(Some(strata_plan::GpuMemory {
                vram_total: v,
                vram_free: v,
                simulated: true,
            }));
        }
        if self.device == strata_engine::device::DeviceChoice::Cpu {
            return Ok(None);
        }
        let device = strata_engine::device::open_device(self.device).map_err(anyhow::Error::msg)?;
        Ok(strata_engine::device::gpu_memory(&device).map(|(free, total)| strata_plan::GpuMemory {
            vram_total: total,
            vram_free: free,
            simulated: false,
        }))
    }

    /// Like [`Self::load`], also returning the plan: [`strata_engine::load_planned`] with a
    /// progress bar, the plan's summary and warnings on stderr, then speculation. A TOO-LARGE
    /// plan is an [`EngineError::PlanRefused`].
    pub fn load_with_plan(&self) -> Result<(Engine, Plan)> {
        self.set_threads();
        let path = self.model_path()?;
        self.spec.kind()?; // flag errors before loading anything
        let device = strata_engine::device::open_device(self.device).map_err(anyhow::Error::msg)?;
        let req = self.load_request(device.clone())?;
        let files = strata_formats::ModelFiles::open(&path)?;
        let plan = strata_engine::plan_for(&files, &path, &req)?;
        eprintln!("{}", plan.summary());
        for w in &plan.warnings {
            eprintln!("warning: {w}");
        }
        let bar = ProgressBar::new(1);
        bar.set_style(
            ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_message(path.display().to_string());
        if plan.strategy != strata_plan::Strategy::TooLarge {
            eprintln!("device: {}", strata_engine::device::device_name(&device));
        }
        let loaded = strata_engine::planned::load_as_planned(&files, &plan, &req, &mut |d, t| {
            bar.set_length(t as u64);
            bar.set_position(d as u64);
        });
        bar.finish_and_clear();
        let mut engine = loaded?;
        let opts = strata_engine::planned::load_options(&req, &plan);
        self.spec.apply(&mut engine, &opts)?;
        if let Some(s) = &opts.stream_experts {
            eprintln!("{}", streaming_summary(&engine, s));
        }
        Ok((engine, plan))
    }

    /// Sets the CPU thread count; must run before candle's first parallel op.
    pub fn set_threads(&self) {
        // candle reads RAYON_NUM_THREADS when it first builds its thread pool.
        std::env::set_var("RAYON_NUM_THREADS", self.threads().to_string());
    }

    pub fn threads(&self) -> usize {
        self.threads.unwrap_or_else(physical_cores).max(1)
    }
}

/// Physical cores (unique core ids in /proc/cpuinfo), falling back to logical CPUs.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else { return logical };
    let mut cores = std::collections::HashSet::new();
    let (mut phys, mut core) = (None, None);
    for line in info.lines() {
        if let Some(v) = line.strip_prefix("physical id") {
            phys = v.split(':').nth(1).map(|s| s.trim().to_string());
        } else if let Some(v) = line.strip_prefix("core id") {
            core = v.split(':').nth(1).map(|s| s.trim().to_string());
        } else if line.trim().is_empty() {
            if let (Some(p), Some(c)) = (phys.take(), core.take()) {
                cores.insert((p, c));
            }
        }
    }
    if cores.is_empty() {
        logical
    } else {
        cores.len().min(logical)
    }
}

/// The one-line description of how experts stream, printed after loading.
fn streaming_summary(engine: &Engine, s: &StreamOptions) -> String {
    let experts = engine.model.experts();
    format!(
        "expert streaming: dense weights {:.2} GB resident, expert cache {:.2} GB ({:?}){}, policy {}, {} reads in flight, O_DIRECT {} ({}), prefetch {}",
        engine.resident_weight_bytes as f64 / 1e9,
        experts.memory_bytes() as f64 / 1e9,
        s.budget,
        match experts.device_cache_bytes() {
            0 => String::new(),
            v => format!(
                " in page-locked host RAM under a VRAM expert cache of {:.2} GB ({:?})",
                v as f64 / 1e9,
                s.gpu_expert_cache
            ),
        },
        s.policy.name(),
        s.io_threads,
        experts.direct_io().map_or("n/a".into(), |d| d.to_string()),
        s.direct_io.name(),
        match engine.model.prefetch_mode() {
            Some(_) => s.prefetch.name(),
            // The GPU tier's mapped experts route on the device: nothing is predicted.
            None if experts.routes_on_device() => "none (mapped experts, routed on the device)",
            None => "none",
        }
    )
}
