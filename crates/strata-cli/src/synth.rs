//! `strata synth`: write a synthetic (random-weight) MoE GGUF for benchmarks, or a random DFlash
//! draft for a model (`--dflash-draft-for`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use strata_bench::synth::{parse_quant, synth, SynthOptions, SynthPreset};

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
    /// Override the preset's routed experts per MoE layer.
    #[arg(long)]
    pub experts: Option<usize>,
    /// Override the preset's experts per token (top-k).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// PRNG seed (same seed, same file).
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// How the model routes tokens to experts. `realistic` (default): a routing process written
    /// into the file's metadata, calibrated to published decode statistics of trained MoE models
    /// (Zipf popularity per layer drifting over the sequence, previous-token reuse, pre-gating
    /// recall; docs/performance.md, "Routing"). `uniform`: every token's top-k drawn uniformly,
    /// the worst case for an expert cache. `local`: the random routers decide (their hidden states
    /// barely vary, so decoding reuses a few experts: far more cache hits than a real model).
    /// Only Strata applies the override; llama.cpp routes such files by their random routers.
    #[arg(long, default_value = "realistic", value_parser = ["realistic", "uniform", "local"])]
    pub routing: String,
    /// `--routing realistic`: Zipf exponent of each layer's expert popularity.
    #[arg(long, default_value_t = 0.6)]
    pub routing_zipf: f64,
    /// `--routing realistic`: probability of keeping each of the previous token's experts (the
    /// measured previous-token reuse).
    #[arg(long, default_value_t = 0.35)]
    pub routing_reuse: f64,
    /// `--routing realistic`: deviation of each expert's log-popularity drift per 256 tokens.
    #[arg(long, default_value_t = 0.5)]
    pub routing_drift: f64,
    /// `--routing realistic|uniform`: recall of the pre-gating prediction of the next layer's
    /// experts (published: 0.8–0.9 one layer ahead).
    #[arg(long, default_value_t = 0.8)]
    pub routing_pregate_recall: f64,
    /// `--routing local`: Zipf exponent S of expert popularity, planted as a router bias
    /// -S·ln(rank).
    #[arg(long)]
    pub routing_skew: Option<f64>,
}

/// The routing override `--routing` and its parameters select (`None` for `local`).
fn routing(a: &SynthArgs) -> Result<Option<strata_formats::SyntheticRouting>> {
    use strata_formats::SyntheticRouting;
    let r = match a.routing.as_str() {
        "local" => return Ok(None),
        "uniform" => SyntheticRouting::uniform(a.seed),
        _ => SyntheticRouting {
            zipf: a.routing_zipf,
            reuse: a.routing_reuse,
            drift: a.routing_drift,
            ..SyntheticRouting::realistic(a.seed)
        },
    };
    if a.routing_skew.is_some() {
        anyhow::bail!("--routing-skew plants a bias in the random routers; it applies to --routing local only");
    }
    let r = SyntheticRouting { pregate_recall: a.routing_pregate_recall, ..r };
    r.validate().map_err(|m| anyhow::anyhow!("--routing {}: {m}", a.routing))?;
    Ok(Some(r))
}

pub fn run(a: SynthArgs) -> Result<()> {
    if let Some(target) = &a.dflash_draft_for {
        let cfg = strata_formats::ModelFiles::open(target)?.config()?;
        let layers = a.layers.unwrap_or(2).max(1);
        let bytes = strata_bench::synth_dflash::write_random_dflash_draft(
            &cfg,
            &a.out,
            layers,
            a.block_size,
            a.seed,
        )
        .map_err(anyhow::Error::msg)?;
        println!(
            "{}: random DFlash draft for {} ({layers} layers, block {}, target layers {:?}): {:.2} GB",
            a.out.display(),
            target.display(),
            a.block_size,
            strata_bench::synth_dflash::target_layer_ids(cfg.num_layers, layers),
            bytes as f64 / 1e9
        );
        return Ok(());
    }
    let name = a.preset.as_deref().unwrap_or_default();
    let mut preset = SynthPreset::by_name(name).ok_or_else(|| {
        anyhow::anyhow!("unknown preset `{name}` (one of: {})", SynthPreset::NAMES.join(", "))
    })?;
    if let Some(l) = a.layers {
        preset.layers = l.max(1);
    }
    preset.experts = a.experts.unwrap_or(preset.experts);
    preset.top_k = a.top_k.unwrap_or(preset.top_k);
    anyhow::ensure!(
        preset.experts >= 1 && (1..=preset.experts).contains(&preset.top_k),
        "top-{} of {} experts is not a valid routing",
        preset.top_k,
        preset.experts
    );
    let opts = SynthOptions {
        preset,
        quant: parse_quant(&a.quant).map_err(anyhow::Error::msg)?,
        seed: a.seed,
        routing_skew: a.routing_skew,
        routing: routing(&a)?,
    };
    let bar = ProgressBar::new(1);
    bar.set_style(
        ProgressStyle::with_template(
            "writing {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
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
        routing_summary(&opts),
        r.file_bytes as f64 / 1e9,
        r.expert_bytes as f64 / 1e9
    );
    Ok(())
}

/// The routing a synthetic file was written with, in words.
fn routing_summary(o: &SynthOptions) -> String {
    match (&o.routing, o.routing_skew) {
        (Some(r), _) if r.mode == strata_formats::RoutingMode::Uniform => {
            format!("uniform override, pre-gating recall {}", r.pregate_recall)
        }
        (Some(r), _) => format!(
            "realistic override: Zipf {}, reuse {}, drift {}, pre-gating recall {}",
            r.zipf, r.reuse, r.drift, r.pregate_recall
        ),
        (None, Some(s)) => format!("local (random routers) with a planted Zipf skew {s}"),
        (None, None) => "local (random routers)".to_string(),
    }
}
