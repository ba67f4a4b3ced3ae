//! Measuring the rates of [`strata_plan::Bandwidths`] (`strata info --calibrate`, < 20 s): the
//! drive through the expert store's reader, RAM, our Q4_K expert matvec, candle's dense matvec and
//! GEMM. The plan only reads the cached result ([`strata_plan::calibrate::load`]).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use strata_plan::Bandwidths;

/// Measures every rate (drive on `model`'s file, which should be large) and caches them.
///
/// Errors: the drive measurement fails (file too small or unreadable), the cache cannot be written.
pub fn calibrate(model: &Path, threads: usize) -> Result<Bandwidths, String> {
    let file = if model.is_dir() { largest_file(model)? } else { model.to_path_buf() };
    // The way the expert store reads (`--direct-io auto`): O_DIRECT where the file system takes it.
    let bench = |direct: bool| {
        strata_expert_store::disk_bench::bench_disk(
            &file,
            &[4 << 20],
            &[32],
            &[direct],
            Duration::from_secs(3),
        )
    };
    let drive = bench(true).or_else(|_| bench(false))?;
    let b = Bandwidths {
        drive_gbps: drive.first().map_or(Bandwidths::DEFAULTS.drive_gbps, |r| r.gbps),
        ram_gbps: ram_read_gbps(threads),
        matvec_gbps: matvec_gbps(),
        dense_matvec_gbps: Some(dense_matvec_gbps().map_err(|e| e.to_string())?),
        gemm_gflops: gemm_gflops().map_err(|e| e.to_string())?,
        threads,
    };
    strata_plan::calibrate::save(model, b)?;
    Ok(b)
}

fn largest_file(dir: &Path) -> Result<PathBuf, String> {
    std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.metadata().ok()?.len(), e.path())))
        .max()
        .map(|(_, p)| p)
        .ok_or_else(|| format!("{}: no files", dir.display()))
}

/// Multi-threaded sequential read of a 512 MiB buffer, best of 3, GB/s.
pub fn ram_read_gbps(threads: usize) -> f64 {
    let words = (512usize << 20) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let threads = threads.max(1);
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(words.div_ceil(threads))
                .map(|part| s.spawn(move || part.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// Our Q4_K matvec on expert-shaped matrices (Qwen3-30B-A3B's: gate+up `[1536, 2048]` and down
/// `[2048, 768]`, 24 experts = 64 MB, one call per matrix as a decode step makes them), one token,
/// best of 4, GB/s. Per-call costs (activation quantization, thread dispatch) are included, so the
/// rate is what a decode step achieves, not the kernel's peak.
pub fn matvec_gbps() -> f64 {
    let (h, i) = (2048, 768);
    let make = |rows: usize, cols: usize, seed: u8| {
        let bytes = rows * cols / strata_kernels::q4k::QK_K * strata_kernels::q4k::BLOCK_BYTES;
        let mut data: Vec<u8> =
            (0..bytes).map(|j| (j as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        for blk in data.chunks_exact_mut(strata_kernels::q4k::BLOCK_BYTES) {
            blk[0..2].copy_from_slice(&half::f16::from_f32(2.5e-4).to_le_bytes());
            blk[2..4].copy_from_slice(&half::f16::from_f32(1.9e-3).to_le_bytes());
        }
        strata_kernels::QuantMatrix::new(strata_kernels::BlockFormat::Q4K, data, rows, cols)
            .expect("valid Q4_K matrix")
    };
    let experts: Vec<_> =
        (0..24u8).map(|e| (make(2 * i, h, e), make(h, i, e.wrapping_add(100)))).collect();
    let bytes: usize = experts.iter().map(|(a, b)| a.size_in_bytes() + b.size_in_bytes()).sum();
    let x: Vec<f32> = (0..h).map(|j| (j as f32 * 0.37).sin()).collect();
    let (mut gu, mut y) = (vec![0f32; 2 * i], vec![0f32; h]);
    let mut best = 0f64;
    for _ in 0..4 {
        let t = Instant::now();
        for (a, b) in &experts {
            a.matmul(&x, 1, &mut gu);
            b.matmul(&gu[..i], 1, &mut y);
        }
        best = best.max(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// candle's quantized matvec on dense-shaped matrices (Q4_K attention projections `[4096, 2048]`
/// and `[2048, 4096]`, a Q6_K LM-head slice `[16384, 2048]`; ~64 MB, one call per matrix as a
/// decode step makes them), one token, best of 4 after a warm-up, GB/s.
pub fn dense_matvec_gbps() -> candle_core::Result<f64> {
    let mut mats = Vec::new();
    for (rows, cols, dtype, n) in [
        (4096, 2048, GgmlDType::Q4K, 5),
        (2048, 4096, GgmlDType::Q4K, 5),
        (16384, 2048, GgmlDType::Q6K, 2),
    ] {
        for _ in 0..n {
            let w =
                QTensor::quantize(&Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu)?, dtype)?;
            let bytes = w.storage_size_in_bytes();
            mats.push((
                QMatMul::from_qtensor(w)?,
                Tensor::randn(0f32, 1.0, (1, cols), &Device::Cpu)?,
                bytes,
            ));
        }
    }
    let bytes: usize = mats.iter().map(|m| m.2).sum();
    for (mm, x, _) in &mats {
        mm.forward(x)?;
    }
    let mut best = 0f64;
    for _ in 0..4 {
        let t = Instant::now();
        for (mm, x, _) in &mats {
            std::hint::black_box(mm.forward(x)?);
        }
        best = best.max(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}

/// candle's Q4_K GEMM on `[512, 2048] × [2304, 2048]ᵀ`, best of 3 after a warm-up, GFLOP/s.
pub fn gemm_gflops() -> candle_core::Result<f64> {
    let (m, k, n) = (512, 2048, 2304);
    let w = QTensor::quantize(&Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?, GgmlDType::Q4K)?;
    let mm = QMatMul::from_qtensor(w)?;
    let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
    mm.forward(&x)?;
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        std::hint::black_box(mm.forward(&x)?);
        best = best.max(2.0 * (m * n * k) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}
