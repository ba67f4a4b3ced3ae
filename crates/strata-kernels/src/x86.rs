//! x86-64 SIMD dot products of Q4_0 / Q4_1 / Q8_0 weight rows with Q8_0 / Q8_1 / Q8_0 activation
//! rows, after ggml's AVX2 kernels (`ggml-cpu/arch/x86/quants.c`: `ggml_vec_dot_q4_0_q8_0`,
//! `ggml_vec_dot_q4_1_q8_1`, `ggml_vec_dot_q8_0_q8_0`): the same integer sums and the same f32 accumulation order (8 lanes,
//! one fused multiply-add per 32-weight block) as llama.cpp.
//!
//! AVX-512 VNNI (`vpdpbusd` in place of `maddubs` + `madd`, bit-identical) was measured on this
//! project's AVX-512 machine and gave no decode or prefill gain; two blocks per 512-bit register
//! sped prefill up ~10% but changes the rounding order away from llama.cpp's (docs/performance.md).
//!
//! Each kernel takes `R` activation rows (tokens) per weight row, unpacking each weight block once
//! for all of them, and does every row's arithmetic exactly as the one-row kernel does (a token's
//! result does not depend on how many tokens share a pass: speculative verification relies on it).

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::matrix::BlockFormat;
use crate::q8_1::BlockQ8_1;

/// Horizontal sum of 8 f32 lanes (ggml's `hsum_float_8`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum(acc: __m256) -> f32 {
    let hi = _mm256_extractf128_ps(acc, 1);
    let s = _mm_add_ps(hi, _mm256_castps256_ps128(acc));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// One f16 (little-endian bits) to f32 with the F16C instruction.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn h2f(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

const Q4_0: usize = BlockFormat::Q4_0.block_bytes();
const Q4_1: usize = BlockFormat::Q4_1.block_bytes();
const Q8_0: usize = BlockFormat::Q8_0.block_bytes();

/// The 16 bytes at `qs`: their 16 low nibbles then their 16 high nibbles, as bytes (the order ggml
/// pairs a Q4_0 / Q4_1 block with the activation block's 32 values).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibbles(qs: *const u8) -> __m256i {
    let tmp = _mm_loadu_si128(qs as *const __m128i);
    _mm256_and_si256(
        _mm256_insertf128_si256(_mm256_castsi128_si256(tmp), _mm_srli_epi16(tmp, 4), 1),
        _mm256_set1_epi8(0x0F),
    )
}

/// AVX2 + FMA + F16C (ggml's x86 kernels).
pub mod avx2 {
    use super::*;

    /// Whether this CPU runs these kernels.
    pub fn available() -> bool {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }

    /// Per 32-bit lane, the sum of four u8 × i8 products (`maddubs` then `madd` with ones).
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn pairs(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    /// Dot products of one Q8_0 weight row `w` (`nb` blocks) with `R` Q8_0 activation rows
    /// `a: [R, nb]` into `out[..R]`: ggml's `ggml_vec_dot_q8_0_q8_0` (`mul_sum_i8_pairs_float`:
    /// |w| · sign(a, w)) for every row, the weight block's signs taken once.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q8_0_tokens<const R: usize>(
        w: &[u8],
        a: &[BlockQ8_1],
        nb: usize,
        out: &mut [f32],
    ) {
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, blk) in w.chunks_exact(Q8_0).enumerate() {
            let d = h2f(u16::from_le_bytes([blk[0], blk[1]]));
            let qx = _mm256_loadu_si256(blk.as_ptr().add(2) as *const __m256i);
            let ax = _mm256_sign_epi8(qx, qx);
            for (j, acc) in acc.iter_mut().enumerate() {
                let y = &a[j * nb + b];
                let qy = _mm256_load_si256(y.qs.as_ptr() as *const __m256i);
                let dot = pairs(ax, _mm256_sign_epi8(qy, qx));
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(dot), *acc);
            }
        }
        for (o, acc) in out.iter_mut().zip(acc) {
            *o = hsum(acc);
        }
    }

    /// Dot products of one Q4_0 weight row `w` (`nb` blocks: f16 `d`, 16 bytes of nibbles;
    /// `w = d·(q − 8)`) with `R` Q8_0 activation rows `a: [R, nb]` into `out[..R]`: ggml's
    /// `ggml_vec_dot_q4_0_q8_0` for every row, the nibbles unpacked and offset once.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q4_0_tokens<const R: usize>(
        w: &[u8],
        a: &[BlockQ8_1],
        nb: usize,
        out: &mut [f32],
    ) {
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, blk) in w.chunks_exact(Q4_0).enumerate() {
            let d = h2f(u16::from_le_bytes([blk[0], blk[1]]));
            let qx = _mm256_sub_epi8(nibbles(blk.as_ptr().add(2)), _mm256_set1_epi8(8));
            let ax = _mm256_sign_epi8(qx, qx);
            for (j, acc) in acc.iter_mut().enumerate() {
                let y = &a[j * nb + b];
                let qy = _mm256_load_si256(y.qs.as_ptr() as *const __m256i);
                let dot = pairs(ax, _mm256_sign_epi8(qy, qx));
                *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(dot), *acc);
            }
        }
        for (o, acc) in out.iter_mut().zip(acc) {
            *o = hsum(acc);
        }
    }

    /// Dot products of one Q4_1 weight row `w` (`nb` blocks) with `R` Q8_1 activation rows
    /// `a: [R, nb]` into `out[..R]`: ggml's `ggml_vec_dot_q4_1_q8_1` for every row, the nibbles
    /// unpacked once.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q4_1_tokens<const R: usize>(
        w: &[u8],
        a: &[BlockQ8_1],
        nb: usize,
        out: &mut [f32],
    ) {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut summs = [0f32; R];
        for (b, blk) in w.chunks_exact(Q4_1).enumerate() {
            let d = h2f(u16::from_le_bytes([blk[0], blk[1]]));
            let m = h2f(u16::from_le_bytes([blk[2], blk[3]]));
            let qx = nibbles(blk.as_ptr().add(4));
            for j in 0..R {
                let y = &a[j * nb + b];
                summs[j] += m * y.s;
                let qy = _mm256_load_si256(y.qs.as_ptr() as *const __m256i);
                let dot = pairs(qx, qy);
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(dot), acc[j]);
            }
        }
        for j in 0..R {
            out[j] = hsum(acc[j]) + summs[j];
        }
    }
}
