//! `strata compare-devices`: the same model on the CPU and on another device (`--device cuda`):
//! every position's logits over a prompt (max |Δ| ÷ max |cpu logit| and relative L2), and greedy
//! tokens from both; with `--batch N`, batched decoding on the device against decoding alone
//! there (`compare_batch`). The H100 acceptance check of the CUDA backend
//! (scripts/cuda_device_check.sh).

use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use strata_engine::device::{device_name, open_device, DeviceChoice};
use strata_engine::{Engine, GenerateRequest, LoadOptions, SamplingParams};
use strata_models::Logits;

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// Model (.gguf or HF directory).
    #[arg(long, short = 'm')]
    pub model: PathBuf,
    /// The device compared with the CPU.
    #[arg(long, default_value = "cuda")]
    pub device: DeviceChoice,
    /// Prompt text (tokenized with BOS as the model asks).
    #[arg(long, short = 'p', conflicts_with = "ids")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub ids: Vec<u32>,
    /// Greedy tokens generated on each device.
    #[arg(long, short = 'n', default_value_t = 64)]
    pub tokens: usize,
    /// Fail (exit 1) when the relative logit error exceeds this.
    #[arg(long, default_value_t = 1e-3)]
    pub tolerance: f64,
    /// Run the device side with streamed experts through the GPU expert tier: every expert in the
    /// host cache, this much in VRAM (e.g. `10%`, so that experts are evicted and copied again),
    /// predictions copied ahead whatever their precision.
    #[arg(long)]
    pub gpu_expert_cache: Option<strata_engine::CacheBudget>,
    /// Also decode this many sequences together on the device (one forward pass per step, as
    /// `serve --parallel` batches them; prompts cut from the prompt cycled to 240+ tokens and
    /// prefilled in one pass, the last sequence joining at step 2 beside the others' decode rows
    /// and leaving halfway) and compare each with decoding it alone there: greedy
    /// tokens equal and logits within --batch-tolerance, or exit 1.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Fail (exit 1) when a batched step's logits differ from the sequence's alone by more than
    /// this (max |Δ| ÷ max |logit|).
    #[arg(long, default_value_t = 1e-5)]
    pub batch_tolerance: f64,
    /// The device side's KV cache element type (f32 or f16; the CPU side keeps f32). Default
    /// f32, the exact check (`run`, `serve` and `bench` default to f16 on a CUDA device): with
    /// f16 the comparison measures the half-precision cache's accuracy cost, its prompt passes'
    /// tensor-core attention included.
    #[arg(long, default_value = "f32", value_parser = clap::value_parser!(strata_models::KvDtype))]
    pub kv_cache_dtype: strata_models::KvDtype,
}

pub fn run(a: CompareArgs) -> Result<()> {
    let device = open_device(a.device).map_err(anyhow::Error::msg)?;
    if device.is_cpu() {
        bail!("--device {:?} opened the CPU: nothing to compare", a.device);
    }
    let load = |opts: LoadOptions| Engine::load(&a.model, &opts, &mut |_, _| {});
    let mut dev_opts = LoadOptions::new(4096, device.clone());
    dev_opts.kv_dtype = a.kv_cache_dtype;
    dev_opts.stream_experts =
        a.gpu_expert_cache.map(|gpu_expert_cache| strata_engine::StreamOptions {
            budget: strata_engine::CacheBudget::Percent(100.0),
            gpu_expert_cache,
            prefetch_min_precision: 0.0,
            io_threads: 4,
            ..Default::default()
        });
    let (cpu, dev) = (load(LoadOptions::new(4096, candle_core::Device::Cpu))?, load(dev_opts)?);
    let ids = match &a.prompt {
        Some(p) => cpu.text_prompt(p)?,
        None if !a.ids.is_empty() => a.ids.clone(),
        None => bail!("give --prompt or --ids"),
    };
    let logits = |e: &Engine| -> Result<Vec<Vec<f32>>> {
        let mut cache = e.new_cache(ids.len() + 1)?;
        Ok(e.model
            .forward(&ids, &mut cache, Logits::All, &[])?
            .logits
            .to_dtype(candle_core::DType::F32)?
            .to_vec2()?)
    };
    let (lc, ld) = (logits(&cpu)?, logits(&dev)?);
    let (mut worst_rel, mut worst_l2, mut argmax_same) = (0f64, 0f64, 0);
    for (c, d) in lc.iter().zip(&ld) {
        let l2 = (c.iter().zip(d).map(|(&x, &y)| ((x - y) as f64).powi(2)).sum::<f64>()
            / c.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().max(1e-30))
        .sqrt();
        worst_rel = worst_rel.max(max_rel_diff(c, d));
        worst_l2 = worst_l2.max(l2);
        argmax_same +=
            usize::from(strata_engine::sampling::argmax(c) == strata_engine::sampling::argmax(d));
    }
    let greedy = |e: &Engine| -> Result<Vec<u32>> {
        let mut req = GenerateRequest::new(ids.clone(), a.tokens, SamplingParams::greedy());
        req.ignore_eos = true;
        let mut cache = e.new_cache(ids.len() + a.tokens + 1)?;
        Ok(e.generate(&mut cache, &req, &mut |_| ControlFlow::Continue(()))?.tokens)
    };
    let (gc, gd) = (greedy(&cpu)?, greedy(&dev)?);
    let same = gc.iter().zip(&gd).take_while(|(x, y)| x == y).count();
    println!("| model | device | positions | max |Δlogit| ÷ max |logit| | max relative L2 | argmax equal | greedy tokens equal |");
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} | {worst_rel:.2e} | {worst_l2:.2e} | {argmax_same}/{} | {same}/{} |",
        a.model.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(),
        device_name(&device),
        lc.len(),
        lc.len(),
        gc.len()
    );
    if let Some(x) = dev.model.experts().stats() {
        println!(
            "GPU expert tier: {} hits, {} misses, {} copies ({:.1} MB) to VRAM, {} prefetched ({} used)",
            x.hits,
            x.misses,
            x.uploads,
            x.upload_bytes as f64 / 1e6,
            x.prefetch_reads,
            x.prefetch_used
        );
    }
    // The batched check runs whatever the devices' difference: it compares the device with
    // itself.
    if let Some(n) = a.batch {
        crate::compare_batch::batched_equals_alone(&dev, &ids, n, a.tokens, a.batch_tolerance)?;
    }
    if worst_rel > a.tolerance {
        bail!("logits differ by {worst_rel:.2e} (relative) > --tolerance {}", a.tolerance);
    }
    Ok(())
}

/// max |reference − other| ÷ max |reference| over one row of logits (the scale at least 1e-12).
pub(crate) fn max_rel_diff(reference: &[f32], other: &[f32]) -> f64 {
    let scale = reference.iter().fold(0f64, |m, &x| m.max(x.abs() as f64)).max(1e-12);
    let diff = reference.iter().zip(other).fold(0f64, |m, (&x, &y)| m.max((x - y).abs() as f64));
    diff / scale
}
