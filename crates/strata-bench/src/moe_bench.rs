//! `strata bench --moe-layer`: one MoE layer of a real model's shape (default Qwen3-30B-A3B: hidden
//! 2048, 128 experts, top-8, expert intermediate 768, Q4_K) with synthetic weights, timed for a
//! decode step (1 token) and a prefill batch (512 tokens), held against the physical floors:
//! expert bytes touched ÷ measured RAM read bandwidth, and FLOPs ÷ the measured rate of the same
//! quantized matmul kernel on one dense matrix.
//!
//! Speed does not depend on weight values, so one random matrix per projection is quantized once and
//! copied into every expert (each expert still has its own memory). Routing does depend on the
//! router: the router and inputs are random, which gives near-uniform routing (no skew).
//!
//! candle's MoE kernel (`QTensor::indexed_moe_forward`) exists only for CUDA in candle 0.11 (it
//! panics on CPU), so on CPU the block runs one quantized matmul per selected expert over the
//! tokens routed to it (tokens grouped by expert).

use std::sync::Arc;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use serde::Serialize;
use strata_formats::{RouterScoring, Weight};
use strata_models::layers::Linear;
use strata_models::mlp::Mlp;
use strata_models::{Expert, ResidentExperts, Router, SparseMoe};

use strata_engine::engine::Result;

/// Shape of the benchmarked MoE layer.
#[derive(Debug, Clone, Serialize)]
pub struct MoeLayerShape {
    pub hidden: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    #[serde(serialize_with = "dtype_name")]
    pub dtype: GgmlDType,
}

fn dtype_name<S: serde::Serializer>(d: &GgmlDType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{d:?}"))
}

impl MoeLayerShape {
    /// Qwen3-30B-A3B's MoE layer, Q4_K.
    pub fn qwen3_30b_a3b() -> Self {
        Self {
            hidden: 2048,
            experts: 128,
            top_k: 8,
            expert_intermediate: 768,
            dtype: GgmlDType::Q4K,
        }
    }
}

/// One timed configuration.
#[derive(Debug, Clone, Serialize)]
pub struct MoeLayerResult {
    pub tokens: usize,
    /// Median wall time of one MoE layer forward (router + experts), ms.
    pub ms_per_layer: f64,
    pub runs_ms: Vec<f64>,
    /// Distinct experts the batch touched (mean over runs).
    pub distinct_experts: usize,
    /// Bytes of expert weights read by one forward (distinct experts × bytes per expert).
    pub expert_bytes: usize,
    /// `expert_bytes / tokens`: bytes of expert weights touched per token.
    pub expert_bytes_per_token: f64,
    /// FLOPs of the selected experts' matmuls (2 · tokens · top_k · 3 · H · I).
    pub flops: f64,
    /// `expert_bytes / RAM bandwidth`, ms.
    pub bandwidth_floor_ms: f64,
    /// `flops / quantized GEMM rate`, ms.
    pub compute_floor_ms: f64,
    /// `max(floors) / ms_per_layer` (1.0 = at the physical limit).
    pub ratio_to_floor: f64,
}

/// The machine figures the floors use.
#[derive(Debug, Clone, Serialize)]
pub struct MachineRates {
    /// Best-of-3 multi-threaded sequential read over a 512 MiB buffer, GB/s (10⁹ bytes).
    pub ram_read_gbps: f64,
    /// Best-of-3 f32 GEMM 1024³ through candle, GFLOP/s.
    pub f32_gemm_gflops: f64,
    /// Best-of-3 quantized GEMM through candle in the experts' format: one dense `[512, H] × [3·I, H]ᵀ`
    /// matmul with the same weight format, GFLOP/s. The prefill compute floor uses this rate: it is
    /// the same kernel with no routing, gathering or per-expert dispatch.
    pub quant_gemm_gflops: f64,
    pub threads: usize,
}

/// Measures RAM read bandwidth with `threads` threads (the plan's calibration measurement).
pub fn ram_read_gbps(threads: usize) -> f64 {
    crate::calibrate::ram_read_gbps(threads)
}

/// Measures candle's f32 GEMM rate on 1024×1024×1024.
pub fn f32_gemm_gflops() -> Result<f64> {
    let n = 1024;
    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
    best_gflops(2.0 * (n * n * n) as f64, || Ok(a.matmul(&b)?))
}

/// Best of 3 timed calls of `f` (after one warm-up) doing `flops` each, in GFLOP/s.
fn best_gflops(flops: f64, f: impl Fn() -> Result<Tensor>) -> Result<f64> {
    f()?;
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        std::hint::black_box(f()?);
        best = best.max(flops / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}

/// Measures candle's quantized matmul rate for `shape.dtype` on `[512, H] × [3·I, H]ᵀ`.
pub fn quant_gemm_gflops(shape: &MoeLayerShape) -> Result<f64> {
    let (m, k, n) = (512, shape.hidden, 3 * shape.expert_intermediate);
    let w = QTensor::quantize(&Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?, shape.dtype)?;
    let lin = Linear::new(Weight::Quantized(w), None)?;
    let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
    best_gflops(2.0 * (m * n * k) as f64, || Ok(lin.forward(&x)?))
}

pub fn machine_rates(shape: &MoeLayerShape, threads: usize) -> Result<MachineRates> {
    Ok(MachineRates {
        ram_read_gbps: ram_read_gbps(threads),
        f32_gemm_gflops: f32_gemm_gflops()?,
        quant_gemm_gflops: quant_gemm_gflops(shape)?,
        threads,
    })
}

/// Builds the layer: a dense f32 router and `experts` quantized experts (distinct memory each).
fn build_layer(shape: &MoeLayerShape) -> Result<(SparseMoe, ResidentExperts, usize)> {
    let (h, i) = (shape.hidden, shape.expert_intermediate);
    let q = |rows: usize, cols: usize| -> Result<QTensor> {
        let t = (Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu)? / (cols as f64).sqrt())?;
        Ok(QTensor::quantize(&t, shape.dtype)?)
    };
    let (gate, up, down) = (q(i, h)?, q(i, h)?, q(h, i)?);
    let bytes = |t: &QTensor| -> Result<Vec<u8>> { Ok(t.data()?.into_owned()) };
    let (gb, ub, db) = (bytes(&gate)?, bytes(&up)?, bytes(&down)?);
    let copy = |b: &[u8], rows: usize, cols: usize| -> Result<Linear> {
        let storage = candle_core::quantized::QStorage::from_data(
            std::borrow::Cow::Owned(b.to_vec()),
            &Device::Cpu,
            shape.dtype,
        )?;
        Ok(Linear::for_expert(Weight::Quantized(QTensor::new(storage, (rows, cols))?))?)
    };
    let mut experts = Vec::with_capacity(shape.experts);
    for _ in 0..shape.experts {
        let mlp = Mlp::new(copy(&gb, i, h)?, copy(&ub, i, h)?, copy(&db, h, i)?)?;
        experts.push(Arc::new(Expert { bytes: mlp.weight_bytes(), mlp }));
    }
    let expert_bytes = experts[0].bytes;
    let router_w =
        (Tensor::randn(0f32, 1.0, (shape.experts, h), &Device::Cpu)? / (h as f64).sqrt())?;
    let router = Router::new(
        Linear::new(Weight::Dense(router_w), None)?,
        shape.top_k,
        true,
        RouterScoring::Softmax,
    );
    Ok((SparseMoe::new(0, router), ResidentExperts::from_layers(vec![experts]), expert_bytes))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Everything the MoE-layer benchmark measured.
#[derive(Debug, Clone, Serialize)]
pub struct MoeLayerBench {
    /// First use of each expert, ms per expert (1 token): what a newly built expert costs beyond a
    /// warm one (formats on candle's kernels: its one-time x86 repack; ours read the stored bytes).
    pub first_use_ms_per_expert: f64,
    pub results: Vec<MoeLayerResult>,
}

/// Times the layer for each batch size in `tokens` (`reps` runs each). Every expert is used once
/// before timing (see [`MoeLayerBench::first_use_ms_per_expert`]); every run gets a fresh random
/// input, so decode runs route to different experts (no cache-hot repeats).
pub fn bench_moe_layer(
    shape: &MoeLayerShape,
    tokens: &[usize],
    reps: usize,
    rates: &MachineRates,
) -> Result<MoeLayerBench> {
    let (moe, experts, bytes_per_expert) = build_layer(shape)?;
    let one = Tensor::randn(0f32, 1.0, (1, shape.hidden), &Device::Cpu)?;
    let t = Instant::now();
    for e in 0..shape.experts {
        strata_models::ExpertProvider::expert(&experts, 0, e)?.mlp.forward(&one)?;
    }
    let first_use_ms_per_expert = t.elapsed().as_secs_f64() * 1e3 / shape.experts as f64;
    let mut out = Vec::new();
    for &n in tokens {
        let input = || Tensor::randn(0f32, 1.0, (n, shape.hidden), &Device::Cpu);
        moe.forward(&input()?, &experts)?; // warm-up
        let mut runs = Vec::with_capacity(reps);
        let mut distinct = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            let x = input()?;
            let t = Instant::now();
            let (_, routing) = moe.forward(&x, &experts)?;
            runs.push(t.elapsed().as_secs_f64() * 1e3);
            distinct.push(routing.distinct_experts().len());
        }
        let distinct = distinct.iter().sum::<usize>() / distinct.len();
        let ms = median(&mut runs.clone());
        let expert_bytes = distinct * bytes_per_expert;
        let flops = 2.0 * (n * shape.top_k * 3 * shape.hidden * shape.expert_intermediate) as f64;
        let bandwidth_floor_ms = expert_bytes as f64 / (rates.ram_read_gbps * 1e9) * 1e3;
        let compute_floor_ms = flops / (rates.quant_gemm_gflops * 1e9) * 1e3;
        out.push(MoeLayerResult {
            tokens: n,
            ms_per_layer: ms,
            runs_ms: runs,
            distinct_experts: distinct,
            expert_bytes,
            expert_bytes_per_token: expert_bytes as f64 / n as f64,
            flops,
            bandwidth_floor_ms,
            compute_floor_ms,
            ratio_to_floor: bandwidth_floor_ms.max(compute_floor_ms) / ms,
        });
    }
    Ok(MoeLayerBench { first_use_ms_per_expert, results: out })
}
