//! `strata synth`: write a synthetic (random-weight) MoE GGUF for benchmarks, or a random DFlash
//! draft for a model (`--dflash-draft-for`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use strata_engine::synth::{parse_quant, synth, SynthOptions, SynthPreset};

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Architecture and dimensions: qwen3-30b-a3b (48 layers, hidden 2048, 128 experts, top-8,
    /// expert FFN 768), mixtral-8x7b (32 layers, hidden 4096, 8 experts, top-2, expert FFN 14336),
    /// qwen3.5-122b-a10b (48 layers, 3 of 4 Gated DeltaNet, hidden 3072, 256 experts, top-8 plus a
    /// shared expert, expert FFN 1024), tiny-moe and tiny-hybrid (4 layers; for tests).
    #[arg(long, required_unless_present = "dflash_draft_for")]
    pub preset: Option<String>,
    /// Instead of a model: write a DFlash draft with random weights (z-lab's format, bf16) sized
    /// for this model into the directory `--out`; `--layers` sets the draft's layers (default 2).
    #[arg(long, conflicts_with = "preset")]
    pub dflash_draft_for: Option<PathBuf>,
    /// With `--dflash-draft-for`: tokens per block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Type of every weight matrix (routers and norms stay F32): Q4_K, Q4_1, Q8_0, F32.
    #[arg(long, default_value = "Q4_K")]
    pub quant: String,
    /// Output .gguf path.
    #[arg(long)]
    pub out: PathBuf,
    /// Override the preset's layer count.
    #[arg(long)]
    pub layers: Option<usize>,
    /// PRNG seed (same seed, same file).
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Zipf exponent S of expert popularity, planted as a router bias -S·ln(rank); omitted: random
    /// routers (near-uniform routing, no locality: the worst case for an expert cache).
    #[arg(long)]
    pub routing_skew: Option<f64>,
}

pub fn run(a: SynthArgs) -> Result<()> {
    if let Some(target) = &a.dflash_draft_for {
        let cfg = strata_formats::ModelFiles::open(target)?.config()?;
        let layers = a.layers.unwrap_or(2).max(1);
        let bytes = strata_engine::synth_dflash::write_random_dflash_draft(&cfg, &a.out, layers, a.block_size, a.seed).map_err(anyhow::Error::msg)?;
        println!(
            "{}: random DFlash draft for {} ({layers} layers, block {}, target layers {:?}): {:.2} GB",
            a.out.display(),
            target.display(),
            a.block_size,
            strata_engine::synth_dflash::target_layer_ids(cfg.num_layers, layers),
            bytes as f64 / 1e9
        );
        return Ok(());
    }
    let name = a.preset.as_deref().unwrap_or_default();
    let mut preset = SynthPreset::by_name(name).ok_or_else(|| anyhow::anyhow!("unknown preset `{name}` (one of: {})", SynthPreset::NAMES.join(", ")))?;
    if let Some(l) = a.layers {
        preset.layers = l.max(1);
    }
    let opts = SynthOptions { preset, quant: parse_quant(&a.quant).map_err(anyhow::Error::msg)?, seed: a.seed, routing_skew: a.routing_skew };
    let bar = ProgressBar::new(1);
    bar.set_style(ProgressStyle::with_template("writing {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec})").unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_message(a.out.display().to_string());
    let r = synth(&a.out, &opts, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .map_err(anyhow::Error::msg)?;
    bar.finish_and_clear();
    println!(
        "{}: {} ({:?}, {} layers, routing {}): {:.2} GB, routed experts {:.2} GB",
        a.out.display(),
        opts.preset.name,
        opts.quant,
        opts.preset.layers,
        opts.routing_skew.map_or("uniform (random router)".to_string(), |s| format!("Zipf skew {s}")),
        r.file_bytes as f64 / 1e9,
        r.expert_bytes as f64 / 1e9
    );
    Ok(())
}
