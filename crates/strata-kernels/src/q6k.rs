//! Q6_K weights × Q8_K activations, following ggml (`ggml/src/ggml-common.h` `block_q6_K`,
//! `ggml-quants.c` `dequantize_row_q6_K`, `ggml-cpu/arch/x86/quants.c` `ggml_vec_dot_q6_K_q8_K`).
//!
//! A Q6_K super-block holds 256 weights in 210 bytes: 128 bytes of low nibbles `ql`, 64 bytes of
//! 2-bit high parts `qh`, sixteen i8 scales (one per 16 weights) and an f16 `d`; weight `i` is
//! `d · scale[i / 16] · (q − 32)` with `q` the 6-bit value.

use half::f16;

use crate::q4k::{BlockQ8K, QK_K};

pub const BLOCK_BYTES: usize = 210;

/// The 6-bit value of weight `i` (0..256) of a block.
#[inline(always)]
fn q6(blk: &[u8], i: usize) -> i32 {
    let (half, l) = (i / 128, i % 128);
    let (ql, qh) = (&blk[half * 64..half * 64 + 64], &blk[128 + half * 32..128 + half * 32 + 32]);
    let (lo, shift) = match l / 32 {
        0 => (ql[l] & 0xF, 0),
        1 => (ql[l] & 0xF, 2),
        2 => (ql[l - 64] >> 4, 4),
        _ => (ql[l - 64] >> 4, 6),
    };
    let hi = (qh[l % 32] >> shift) & 3;
    (lo | (hi << 4)) as i32
}

/// One row of Q6_K blocks · Q8_K activations (generic version: integer sums per 16-weight
/// sub-block, as ggml's `ggml_vec_dot_q6_K_q8_K_generic`).
pub fn dot_q6k_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let mut sumf = 0f32;
    for (blk, y) in w.chunks_exact(BLOCK_BYTES).zip(a) {
        let d = f16::from_le_bytes([blk[208], blk[209]]).to_f32() * y.d;
        let mut sumi = 0i32;
        for sb in 0..QK_K / 16 {
            let sc = blk[192 + sb] as i8 as i32;
            let s: i32 = (sb * 16..sb * 16 + 16).map(|i| (q6(blk, i) - 32) * y.qs[i] as i32).sum();
            sumi += sc * s;
        }
        sumf += d * sumi as f32;
    }
    sumf
}

/// Dot products of one Q6_K weight row `w` (`nb` blocks) with `R` Q8_K activation rows
/// `a: [R, nb]` into `out[..R]` (AVX2 + FMA + F16C), each block's 6-bit values and scales
/// unpacked once for all `R` tokens. Every token's arithmetic is ggml's `ggml_vec_dot_q6_K_q8_K`
/// (AVX2 branch: the −32 offset subtracted in integers through the Q8_K block sums, one fused
/// multiply-add per block into 8 f32 lanes), so a tile's results are bit-identical to the
/// one-token kernel's whatever `R`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` holds `nb` whole Q6_K blocks and `a` `R · nb`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q6k_tokens_avx2<const R: usize>(
    w: &[u8],
    a: &[BlockQ8K],
    nb: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); R];
    for (b, blk) in w.chunks_exact(BLOCK_BYTES).enumerate() {
        let (q, sc, scales16, d0) = unpack_avx2(blk);
        for j in 0..R {
            let y = &a[j * nb + b];
            let mut sumi = _mm256_setzero_si256();
            for h in 0..2 {
                let mut p = [_mm256_setzero_si256(); 4];
                for (k, p) in p.iter_mut().enumerate() {
                    let q8 =
                        _mm256_load_si256(y.qs.as_ptr().add(h * 128 + k * 32) as *const __m256i);
                    *p = _mm256_madd_epi16(sc[h * 4 + k], _mm256_maddubs_epi16(q[h * 4 + k], q8));
                }
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
            }
            sumi = _mm256_sub_epi32(sumi, offset_sums(scales16, y));
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(y.d * d0), _mm256_cvtepi32_ps(sumi), acc[j]);
        }
    }
    for j in 0..R {
        out[j] = crate::x86::hsum(acc[j]);
    }
}

/// [`q6k_tokens_avx2`] on 512-bit registers (AVX-512 F + BW): two 32-value groups per register;
/// the halves' integer sums are added before the f32 step, giving every lane the AVX2 kernel's
/// integer, so results are bit-identical to it (tested).
///
/// # Safety
/// The CPU must support AVX-512 F and BW, AVX2, FMA and F16C; `w` holds `nb` whole Q6_K blocks
/// and `a` `R · nb`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn q6k_tokens_avx512<const R: usize>(
    w: &[u8],
    a: &[BlockQ8K],
    nb: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); R];
    let join = |lo: __m256i, hi: __m256i| _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    for (b, blk) in w.chunks_exact(BLOCK_BYTES).enumerate() {
        let (q, sc, scales16, d0) = unpack_avx2(blk);
        let q = [join(q[0], q[1]), join(q[2], q[3]), join(q[4], q[5]), join(q[6], q[7])];
        let sc = [join(sc[0], sc[1]), join(sc[2], sc[3]), join(sc[4], sc[5]), join(sc[6], sc[7])];
        for j in 0..R {
            let y = &a[j * nb + b];
            let mut sumi = _mm512_setzero_si512();
            for c in 0..4 {
                let q8 = _mm512_loadu_si512(y.qs.as_ptr().add(c * 64) as *const _);
                sumi = _mm512_add_epi32(
                    sumi,
                    _mm512_madd_epi16(sc[c], _mm512_maddubs_epi16(q[c], q8)),
                );
            }
            let sumi =
                _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1));
            let sumi = _mm256_sub_epi32(sumi, offset_sums(scales16, y));
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(y.d * d0), _mm256_cvtepi32_ps(sumi), acc[j]);
        }
    }
    for j in 0..R {
        out[j] = crate::x86::hsum(acc[j]);
    }
}

/// One block unpacked: the 256 6-bit values as bytes in eight 32-value groups, each group's
/// two sub-block scales as 16 i16 lanes, the sixteen scales as i16, and `d`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn unpack_avx2(
    blk: &[u8],
) -> (
    [std::arch::x86_64::__m256i; 8],
    [std::arch::x86_64::__m256i; 8],
    std::arch::x86_64::__m256i,
    f32,
) {
    use std::arch::x86_64::*;
    let p = blk.as_ptr();
    let m15 = _mm256_set1_epi8(15);
    let scales = _mm_loadu_si128(p.add(192) as *const __m128i);
    let mut q = [_mm256_setzero_si256(); 8];
    let mut sc = [_mm256_setzero_si256(); 8];
    for h in 0..2 {
        let b1 = _mm256_loadu_si256(p.add(h * 64) as *const __m256i);
        let b2 = _mm256_loadu_si256(p.add(h * 64 + 32) as *const __m256i);
        let bh = _mm256_loadu_si256(p.add(128 + h * 32) as *const __m256i);
        let h0 = _mm256_slli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(3)), 4);
        let h1 = _mm256_slli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(12)), 2);
        let h2 = _mm256_and_si256(bh, _mm256_set1_epi8(48));
        let h3 = _mm256_srli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(-64)), 2);
        q[h * 4] = _mm256_or_si256(_mm256_and_si256(b1, m15), h0);
        q[h * 4 + 1] = _mm256_or_si256(_mm256_and_si256(b2, m15), h1);
        q[h * 4 + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m15), h2);
        q[h * 4 + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m15), h3);
        for k in 0..4 {
            // Sub-blocks 2g and 2g + 1 of group g = 4h + k: 8 lanes each.
            let g = (h * 4 + k) as i8;
            let pattern = _mm_setr_epi8(
                2 * g,
                2 * g,
                2 * g,
                2 * g,
                2 * g,
                2 * g,
                2 * g,
                2 * g,
                2 * g + 1,
                2 * g + 1,
                2 * g + 1,
                2 * g + 1,
                2 * g + 1,
                2 * g + 1,
                2 * g + 1,
                2 * g + 1,
            );
            sc[h * 4 + k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pattern));
        }
    }
    let d = crate::x86::h2f(u16::from_le_bytes([blk[208], blk[209]]));
    (q, sc, _mm256_cvtepi8_epi16(scales), d)
}

/// `32 · Σ scale[s] · (sum of the Q8_K block's values in sub-block s)`, in 8 i32 lanes (ggml's
/// `q8sclsub`): what the −32 offset of every 6-bit value takes from the block's sum.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn offset_sums(
    scales16: std::arch::x86_64::__m256i,
    y: &BlockQ8K,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let bs = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
    _mm256_slli_epi32(_mm256_madd_epi16(bs, scales16), 5)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q4k::quantize_row_q8k;
    use crate::{BlockFormat, QuantMatrix};
    use candle_core::quantized::{GgmlDType, QStorage, QTensor};

    /// Random Q6_K blocks and their f32 weights from candle's dequantizer (an outside reference
    /// for the block layout).
    fn matrix(rows: usize, cols: usize) -> (QuantMatrix, Vec<f32>) {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut data = vec![0u8; rows * cols / QK_K * BLOCK_BYTES];
        for b in data.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *b = s as u8;
        }
        for (i, blk) in data.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            blk[208..210]
                .copy_from_slice(&f16::from_f32(1.5e-4 * (1.0 + (i % 3) as f32)).to_le_bytes());
        }
        let storage = QStorage::from_data(
            std::borrow::Cow::Borrowed(&data),
            &candle_core::Device::Cpu,
            GgmlDType::Q6K,
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
        (QuantMatrix::new(BlockFormat::Q6K, data, rows, cols).unwrap(), dense)
    }

    #[test]
    fn q6k_matches_candle_dequantized_and_scalar() {
        let (rows, cols, m) = (20, 768, 11);
        let (w, dense) = matrix(rows, cols);
        let x: Vec<f32> =
            (0..m * cols).map(|i| ((i as f32 * 0.7131).sin() * 43758.547).fract() - 0.5).collect();
        let mut out = vec![0f32; m * rows];
        w.matmul(&x, m, &mut out);
        let mut q = Vec::new();
        for t in 0..m {
            let mut one = vec![0f32; rows];
            w.matmul(&x[t * cols..(t + 1) * cols], 1, &mut one);
            quantize_row_q8k(&x[t * cols..(t + 1) * cols], &mut q);
            for r in 0..rows {
                let got = out[t * rows + r];
                assert_eq!(got.to_bits(), one[r].to_bits(), "tile differs from one token");
                let s = dot_q6k_scalar(w.row(r), &q);
                assert!((s - got).abs() <= 1e-4 * s.abs().max(1.0), "simd {got} scalar {s}");
                let exact: f32 = (0..cols).map(|c| dense[r * cols + c] * x[t * cols + c]).sum();
                let scale: f32 =
                    (0..cols).map(|c| (dense[r * cols + c] * x[t * cols + c]).abs()).sum();
                assert!((exact - s).abs() < 0.01 * scale, "q8k {s} exact {exact} (Σ|wx| {scale})");
            }
        }
    }

    /// AVX2 and AVX-512 tiles of every width bit-identical to the AVX2 one-token kernel.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q6k_isas_are_bit_identical() {
        if !crate::x86::avx2::available() {
            eprintln!("no AVX2 on this CPU: only the scalar kernel runs here");
            return;
        }
        let (rows, cols) = (5, 512);
        let nb = cols / QK_K;
        let (w, _) = matrix(rows, cols);
        let x: Vec<f32> =
            (0..8 * cols).map(|i| ((i as f32 * 0.377).cos() * 9631.3).fract() - 0.5).collect();
        let mut q = Vec::new();
        quantize_row_q8k(&x, &mut q);
        let avx512 =
            std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw");
        for r in 0..rows {
            let mut tile = [0f32; 8];
            let mut wide = [0f32; 8];
            unsafe { q6k_tokens_avx2::<8>(w.row(r), &q, nb, &mut tile) };
            if avx512 {
                unsafe { q6k_tokens_avx512::<8>(w.row(r), &q, nb, &mut wide) };
            }
            for t in 0..8 {
                let mut one = [0f32];
                unsafe { q6k_tokens_avx2::<1>(w.row(r), &q[t * nb..(t + 1) * nb], nb, &mut one) };
                assert_eq!(one[0].to_bits(), tile[t].to_bits(), "avx2 row {r} token {t}");
                if avx512 {
                    assert_eq!(one[0].to_bits(), wide[t].to_bits(), "avx512 row {r} token {t}");
                }
            }
        }
    }
}
