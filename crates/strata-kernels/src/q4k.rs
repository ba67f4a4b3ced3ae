//! Q4_K weights × Q8_K activations, following ggml (`ggml/src/ggml-common.h` `block_q4_K`,
//! `ggml-quants.c` `quantize_row_q8_K_ref`, `ggml-cpu/arch/x86/quants.c` `ggml_vec_dot_q4_K_q8_K`).
//!
//! A Q4_K super-block holds 256 weights: f16 `d`, f16 `dmin`, 12 bytes packing eight 6-bit scales
//! and eight 6-bit mins, and 128 bytes of nibbles; weight `i` of sub-block `j` (32 weights) is
//! `d·scale[j]·q − dmin·min[j]`. Running it here instead of through candle avoids candle's x86
//! repack, which keeps a second 1.33× copy of every matrix and costs ~6 ms per streamed expert
//! on its first use (measured, docs/performance.md).

use half::f16;

pub const QK_K: usize = 256;
pub const BLOCK_BYTES: usize = 144;

/// 256 activations quantized to int8 with one f32 scale, and sums of each 16.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub struct BlockQ8K {
    pub qs: [i8; QK_K],
    pub d: f32,
    pub bsums: [i16; QK_K / 16],
}

/// ggml `quantize_row_q8_K_ref`: scale from the value of largest magnitude (sign kept), round to
/// nearest, clamp to 127.
pub fn quantize_row_q8k(x: &[f32], out: &mut Vec<BlockQ8K>) {
    out.clear();
    for xs in x.chunks_exact(QK_K) {
        let mut max = 0f32;
        let mut amax = 0f32;
        for &v in xs {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let mut b = BlockQ8K { qs: [0; QK_K], d: 0.0, bsums: [0; QK_K / 16] };
        if amax != 0.0 {
            let iscale = -127.0 / max;
            for (q, &v) in b.qs.iter_mut().zip(xs) {
                *q = (iscale * v).round().min(127.0) as i8;
            }
            for (s, g) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
                *s = g.iter().map(|&q| q as i16).sum();
            }
            b.d = 1.0 / iscale;
        }
        out.push(b);
    }
}

/// ggml `get_scale_min_k4` for all eight sub-blocks.
#[inline(always)]
fn scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        if j < 4 {
            sc[j] = s[j] & 63;
            mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
            mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
    (sc, mn)
}

/// One row of Q4_K blocks · Q8_K activations (generic version).
pub fn dot_q4k_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let mut sumf = 0f32;
    for (blk, y) in w.chunks_exact(BLOCK_BYTES).zip(a) {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32() * y.d;
        let dmin = f16::from_le_bytes([blk[2], blk[3]]).to_f32() * y.d;
        let (sc, mn) = scales_mins(&blk[4..16]);
        let qs = &blk[16..];
        let mut sumi = 0i32;
        let mut summ = 0i32;
        for c in 0..4 {
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                let q = qs[c * 32 + l];
                lo += (q & 0xF) as i32 * y.qs[c * 64 + l] as i32;
                hi += (q >> 4) as i32 * y.qs[c * 64 + 32 + l] as i32;
            }
            sumi += lo * sc[2 * c] as i32 + hi * sc[2 * c + 1] as i32;
        }
        for (j, &m) in mn.iter().enumerate() {
            summ += m as i32 * (y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32);
        }
        sumf += d * sumi as f32 - dmin * summ as f32;
    }
    sumf
}

/// AVX2 version of [`dot_q4k_scalar`] (same integer sums, so the same result up to f32 rounding
/// order).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C (checked by the caller at run time); `w` holds whole
/// Q4_K blocks, one per block of `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4k_avx2(w: &[u8], a: &[BlockQ8K]) -> f32 {
    use std::arch::x86_64::*;
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0f32;
    for (blk, y) in w.chunks_exact(BLOCK_BYTES).zip(a) {
        let p = blk.as_ptr();
        let d = crate::x86::h2f(u16::from_le_bytes([blk[0], blk[1]])) * y.d;
        let dmin = crate::x86::h2f(u16::from_le_bytes([blk[2], blk[3]])) * y.d;
        let (sc, mn) = scales_mins(&blk[4..16]);
        let mut summ = 0i32;
        for (j, &m) in mn.iter().enumerate() {
            summ += m as i32 * (y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32);
        }
        summs -= dmin * summ as f32;
        let mut sumi = _mm256_setzero_si256();
        for c in 0..4 {
            let bits = _mm256_loadu_si256(p.add(16 + c * 32) as *const __m256i);
            let q4l = _mm256_and_si256(bits, low);
            let q4h = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low);
            let q8l = _mm256_load_si256(y.qs.as_ptr().add(c * 64) as *const __m256i);
            let q8h = _mm256_load_si256(y.qs.as_ptr().add(c * 64 + 32) as *const __m256i);
            // u8 × i8 pairs: at most 2·15·128 per i16 lane, no saturation.
            let pl = _mm256_madd_epi16(
                _mm256_maddubs_epi16(q4l, q8l),
                _mm256_set1_epi16(sc[2 * c] as i16),
            );
            let ph = _mm256_madd_epi16(
                _mm256_maddubs_epi16(q4h, q8h),
                _mm256_set1_epi16(sc[2 * c + 1] as i16),
            );
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    crate::x86::hsum(acc) + summs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockFormat, QuantMatrix};
    use candle_core::quantized::{GgmlDType, QStorage, QTensor};

    /// Random Q4_K blocks; the f32 weights come from candle's dequantizer (an outside reference for
    /// the block layout).
    fn matrix(rows: usize, cols: usize) -> (QuantMatrix, Vec<f32>) {
        let mut s = 0x1234_5678_9ABC_DEF1u64;
        let mut data = vec![0u8; rows * cols / QK_K * BLOCK_BYTES];
        for b in data.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *b = s as u8;
        }
        for (i, blk) in data.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            blk[0..2]
                .copy_from_slice(&f16::from_f32(2.5e-4 * (1.0 + (i % 3) as f32)).to_le_bytes());
            blk[2..4].copy_from_slice(&f16::from_f32(1.875e-3).to_le_bytes());
        }
        let storage = QStorage::from_data(
            std::borrow::Cow::Borrowed(&data),
            &candle_core::Device::Cpu,
            GgmlDType::Q4K,
        )
        .unwrap();
        let dense = QTensor::new(storage, (rows, cols))
            .unwrap()
            .dequantize(&candle_core::Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        (QuantMatrix::new(BlockFormat::Q4K, data, rows, cols).unwrap(), dense)
    }

    #[test]
    fn q4k_matches_candle_dequantized_and_scalar() {
        let (rows, cols, m) = (24, 512, 3);
        let (w, dense) = matrix(rows, cols);
        let x: Vec<f32> =
            (0..m * cols).map(|i| ((i as f32 * 0.7131).sin() * 43758.547).fract() - 0.5).collect();
        let mut out = vec![0f32; m * rows];
        w.matmul(&x, m, &mut out);
        let mut q = Vec::new();
        for t in 0..m {
            quantize_row_q8k(&x[t * cols..(t + 1) * cols], &mut q);
            for r in 0..rows {
                let s = dot_q4k_scalar(w.row(r), &q);
                assert!(
                    (s - out[t * rows + r]).abs() <= 1e-4 * s.abs().max(1.0),
                    "simd {} scalar {s}",
                    out[t * rows + r]
                );
                let exact: f32 = (0..cols).map(|c| dense[r * cols + c] * x[t * cols + c]).sum();
                let scale: f32 =
                    (0..cols).map(|c| (dense[r * cols + c] * x[t * cols + c]).abs()).sum();
                assert!((exact - s).abs() < 0.01 * scale, "q8k {s} exact {exact} (Σ|wx| {scale})");
            }
        }
    }
}
