//! Model-loading flags shared by every subcommand.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use strata_engine::{CacheBudget, Engine, EvictionPolicy, LoadOptions, StreamOptions};

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
    /// demand into the expert cache.
    #[arg(long)]
    pub stream_experts: bool,
    /// Expert cache budget with --stream-experts: bytes (`6GiB`, `512MiB`), a percentage of the
    /// model's expert bytes (`10%`), or `auto` (available memory, cgroup limit included, minus the
    /// dense weights and a 1 GiB + 10% reserve).
    #[arg(long, default_value = "auto", value_parser = clap::value_parser!(CacheBudget))]
    pub expert_cache: CacheBudget,
    /// Read experts with O_DIRECT (bypassing the page cache; needs a filesystem that supports it).
    #[arg(long)]
    pub direct_io: bool,
    /// Expert reads in flight at once (reader threads).
    #[arg(long, default_value_t = 16)]
    pub io_threads: usize,
    /// Expert cache eviction policy: lru, lru2 (LRU-2, frequency-aware) or lfu.
    #[arg(long, default_value = "lru", value_parser = clap::value_parser!(EvictionPolicy))]
    pub expert_cache_policy: EvictionPolicy,
    /// Use only the K best of the router's experts per token (renormalised to the full top-k's
    /// weight). Trades quality for fewer expert bytes per token.
    #[arg(long, env = "STRATA_MOE_TOP_K")]
    pub moe_top_k: Option<usize>,
}

impl ModelArgs {
    /// Sets the thread count (before candle starts its pool), resolves the model path and loads it
    /// with a progress bar.
    pub fn load(&self) -> Result<Engine> {
        self.set_threads();
        let path = match &self.model {
            Some(p) => p.clone(),
            None => crate::default_model::ensure()?,
        };
        let bar = ProgressBar::new(1);
        bar.set_style(ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers").unwrap_or_else(|_| ProgressStyle::default_bar()));
        bar.set_message(path.display().to_string());
        let opts = self.load_options();
        let engine = Engine::load(&path, &opts, &mut |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        });
        bar.finish_and_clear();
        let engine = engine?;
        if let Some(s) = &opts.stream_experts {
            eprintln!(
                "expert streaming: dense weights {:.2} GB resident, expert cache {:.2} GB ({:?}), policy {}, {} reads in flight, O_DIRECT {}",
                engine.resident_weight_bytes as f64 / 1e9,
                engine.model.experts().memory_bytes() as f64 / 1e9,
                s.budget,
                s.policy.name(),
                s.io_threads,
                s.direct_io
            );
        }
        Ok(engine)
    }

    pub fn load_options(&self) -> LoadOptions {
        let mut opts = LoadOptions::new(self.ctx_size, candle_core::Device::Cpu);
        opts.moe_top_k = self.moe_top_k;
        if self.stream_experts {
            opts.stream_experts = Some(StreamOptions {
                budget: self.expert_cache,
                direct_io: self.direct_io,
                io_threads: self.io_threads.max(1),
                policy: self.expert_cache_policy,
            });
        }
        opts
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
    if cores.is_empty() { logical } else { cores.len().min(logical) }
}
