//! f32 weights times f32 activations for short passes (decode, verify): rows split over the
//! barrier pool, every (token, row) dot product computed the same way whatever the number of
//! tokens (16 lanes of fused multiply-adds, then a fixed pairwise reduction), so a verify pass is
//! bit-identical to one-token decoding. candle's GEMM runs a one-token pass on one thread (its
//! `gemm` crate picks no parallelism for it); MoE routers (`[E, H]` f32) sit on that path every
//! layer.

use crate::SendPtr;

const LANES: usize = 16;

/// `out[t, r] = Σ_c x[t, c] · w[r, c]` for `w: [rows, cols]`, `x: [m, cols]`, `out: [m, rows]`.
///
/// # Panics
/// When the slices' lengths disagree with the shapes.
pub fn matmul_f32(w: &[f32], rows: usize, cols: usize, x: &[f32], m: usize, out: &mut [f32]) {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(x.len(), m * cols);
    assert_eq!(out.len(), m * rows);
    let dot = select();
    let ptr = SendPtr(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(rows, |range| {
        let p = ptr;
        for t in 0..m {
            let xs = &x[t * cols..(t + 1) * cols];
            for r in range.clone() {
                // SAFETY: each (t, r) is written by exactly one task; out has m·rows elements.
                unsafe { *p.0.add(t * rows + r) = dot(&w[r * cols..(r + 1) * cols], xs) };
            }
        }
    });
}

/// `out[i] = silu(g[i]) · u[i]`, with candle's `silu` arithmetic (`g / (1 + e^(−g))`, then the
/// product: the same bits as candle's `silu(g) * u`), in chunks over the barrier pool — the MLP
/// activation of a CPU pass without candle's two ops (its unary op spreads over rayon's pool,
/// whose wake-ups cost more than the work for a decode step's few rows).
///
/// # Panics
/// When the three slices' lengths differ.
pub fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(g.len() == u.len() && g.len() == out.len(), "silu_mul: lengths differ");
    let ptr = SendPtr(out.as_mut_ptr());
    let n = g.len();
    candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(SILU_CHUNK), |range| {
        let p = ptr;
        for i in range.start * SILU_CHUNK..(range.end * SILU_CHUNK).min(n) {
            // SAFETY: each index is written by exactly one task; out has n elements.
            unsafe { *p.0.add(i) = silu_times(g[i], u[i]) };
        }
    });
}

/// [`silu_mul`] over a stacked gate/up product: `y: [m, 2·inter]`, each row its gate's `inter`
/// values then its up's → `out: [m, inter]`, `out[t, i] = silu(y[t, i]) · y[t, inter + i]` —
/// the same bits as [`silu_mul`] of the two halves, without copying them out first.
///
/// # Panics
/// When `inter` is 0 or `y` is not `[m, 2·inter]` for `out: [m, inter]`.
pub fn silu_mul_halves(y: &[f32], inter: usize, out: &mut [f32]) {
    assert!(
        inter > 0 && out.len().is_multiple_of(inter) && y.len() == 2 * out.len(),
        "silu_mul_halves: y is not [m, 2·{inter}] for out of {} values",
        out.len()
    );
    let ptr = SendPtr(out.as_mut_ptr());
    let per_row = inter.div_ceil(SILU_CHUNK);
    candle_core::utils::barrier_pool().execute_chunked(out.len() / inter * per_row, |range| {
        let p = ptr;
        for unit in range {
            let (t, c) = (unit / per_row, unit % per_row);
            let (g, u) = y[2 * t * inter..2 * (t + 1) * inter].split_at(inter);
            for i in c * SILU_CHUNK..((c + 1) * SILU_CHUNK).min(inter) {
                // SAFETY: each (t, i) is written by exactly one task; out has m·inter elements.
                unsafe { *p.0.add(t * inter + i) = silu_times(g[i], u[i]) };
            }
        }
    });
}

/// `Σ a²` of a row: each square in f32, summed in f64 (ggml's `ggml_compute_forward_rms_norm_f32`
/// precision) over eight lanes — element `i` into lane `i mod 8`, the lanes reduced by
/// [`pairwise`], then the tail in order — instead of ggml's one serial chain (a vectorizable sum:
/// the chain's latency was ~3% of a CPU batch step); the order differs from ggml's only below
/// f64's rounding. RMSNorm's sum on the CPU (`strata-models`).
pub fn sum_squares_f64(row: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += (x * x) as f64;
        }
    }
    tail.iter().fold(pairwise(acc), |s, &x| s + (x * x) as f64)
}

/// Elements per task of [`silu_mul`] and [`silu_mul_halves`].
const SILU_CHUNK: usize = 2048;

/// `silu(g) · u` as candle computes `silu(g) * u`: `g / (1 + e^(−g))`, then the product.
#[inline(always)]
fn silu_times(g: f32, u: f32) -> f32 {
    (g / (1.0 + (-g).exp())) * u
}

fn select() -> fn(&[f32], &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::isa() >= crate::Isa::Avx2 {
            return |a, b| unsafe { dot_fma(a, b) };
        }
    }
    dot_scalar
}

/// The 16-lane partial sums reduced pairwise (lane i + lane i+8, then +4, +2, +1), and the tail.
#[inline(always)]
fn reduce(acc: [f32; LANES], tail: f32) -> f32 {
    pairwise(acc) + tail
}

/// `N` partial sums (a power of two) reduced pairwise: lane i + lane i+N/2, then +N/4, .., +1
/// (this module's dot products and sums of squares, and the decode attention's scores and softmax
/// sums, `crate::attention`).
#[inline(always)]
pub(crate) fn pairwise<T: Copy + std::ops::AddAssign, const N: usize>(mut acc: [T; N]) -> T {
    let mut n = N / 2;
    while n > 0 {
        for i in 0..n {
            let x = acc[i + n];
            acc[i] += x;
        }
        n /= 2;
    }
    acc[0]
}

/// Generic version (multiply then add: other CPUs have no guaranteed FMA).
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    reduce(acc, tail)
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_fma(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    reduce(acc, tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_equals_candles_silu_then_mul() {
        use candle_core::{Device, Tensor};
        let n = 5000;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.13).sin() * 12.0).collect();
        let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.71).cos() * 3.0).collect();
        let mut out = vec![0f32; n];
        silu_mul(&g, &u, &mut out);
        let (gt, ut) = (
            Tensor::new(g.as_slice(), &Device::Cpu).unwrap(),
            Tensor::new(u.as_slice(), &Device::Cpu).unwrap(),
        );
        let want = (gt.silu().unwrap() * ut).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(out, want);
    }

    /// The eight-lane sum equals ggml's serial f64 chain over the f32 squares up to f64
    /// rounding, for lengths with and without a tail.
    #[test]
    fn sum_squares_f64_matches_the_serial_chain() {
        for n in [0, 5, 8, 576, 2051] {
            let row: Vec<f32> = (0..n).map(|i| (i as f32 * 0.61).sin() * 7.0).collect();
            let serial: f64 = row.iter().map(|&a| (a * a) as f64).sum();
            let got = sum_squares_f64(&row);
            assert!((got - serial).abs() <= 1e-12 * serial.max(1.0), "{n}: {got} vs {serial}");
        }
    }

    /// The stacked form gives the bits of [`silu_mul`] over each row's two halves, for widths
    /// below, at and past one task's chunk.
    #[test]
    fn silu_mul_halves_equals_silu_mul_of_the_halves() {
        for (m, inter) in [(1, 5), (3, 1536), (2, 2048), (4, 2500)] {
            let y: Vec<f32> =
                (0..m * 2 * inter).map(|i| (i as f32 * 0.37).sin() * 9.0 - 1.0).collect();
            let mut got = vec![0f32; m * inter];
            silu_mul_halves(&y, inter, &mut got);
            for t in 0..m {
                let (g, u) = y[2 * t * inter..2 * (t + 1) * inter].split_at(inter);
                let mut want = vec![0f32; inter];
                silu_mul(g, u, &mut want);
                assert_eq!(&got[t * inter..(t + 1) * inter], want.as_slice(), "m {m}, row {t}");
            }
        }
    }

    #[test]
    fn matches_f64_reference_and_is_row_count_independent() {
        let (rows, cols, m) = (37, 2050, 5);
        let w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin() * 0.1).collect();
        let x: Vec<f32> = (0..m * cols).map(|i| (i as f32 * 0.91).cos()).collect();
        let mut out = vec![0f32; m * rows];
        matmul_f32(&w, rows, cols, &x, m, &mut out);
        for t in 0..m {
            let mut one = vec![0f32; rows];
            matmul_f32(&w, rows, cols, &x[t * cols..(t + 1) * cols], 1, &mut one);
            for r in 0..rows {
                let got = out[t * rows + r];
                assert_eq!(got.to_bits(), one[r].to_bits());
                let exact: f64 =
                    (0..cols).map(|c| w[r * cols + c] as f64 * x[t * cols + c] as f64).sum();
                let scale: f64 = (0..cols)
                    .map(|c| (w[r * cols + c] as f64 * x[t * cols + c] as f64).abs())
                    .sum();
                assert!((got as f64 - exact).abs() <= 1e-5 * scale, "{got} vs {exact}");
            }
        }
    }
}
