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

/// 256 activations quantized to int8 with one f32 scale, and sums of each 16 (ggml's
/// `block_q8_K`) and of each 32 (`sums32[j] = bsums[2j] + bsums[2j + 1]`, what ggml's Q4_K and
/// Q5_K kernels compute from `bsums` for every weight row; here once per activation block, in
/// the alignment padding). Cache-line aligned: the kernels load `qs` 64 bytes at a time.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub struct BlockQ8K {
    pub qs: [i8; QK_K],
    pub d: f32,
    pub bsums: [i16; QK_K / 16],
    pub sums32: [i16; QK_K / 32],
}

/// ggml `quantize_row_q8_K_ref`: scale from the value of largest magnitude (sign kept), round to
/// nearest with ties to even (ggml's `nearest_int`), clamp to 127. On AVX-512 CPUs the same
/// operations on 16 lanes (bit-identical, tested).
pub fn quantize_row_q8k(x: &[f32], out: &mut Vec<BlockQ8K>) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa() >= crate::Isa::Avx512 {
        // SAFETY: the CPU has AVX-512 F and BW (checked by isa()).
        return unsafe { quantize_row_q8k_avx512(x, out) };
    }
    quantize_row_q8k_scalar(x, out)
}

/// [`quantize_row_q8k`] on 16 lanes: the same multiply, rounding (`vrndscaleps` to nearest even
/// equals the magic-number rounding for |v| ≤ 127), clamp and exact integer sums. NaN inputs are
/// skipped by the maximum as the scalar comparison skips them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_row_q8k_avx512(x: &[f32], out: &mut Vec<BlockQ8K>) {
    use std::arch::x86_64::*;
    out.clear();
    for xs in x.chunks_exact(QK_K) {
        let p = xs.as_ptr();
        let mut m = _mm512_setzero_ps();
        for i in 0..QK_K / 16 {
            // maxps returns its second operand when either is NaN: m, never NaN.
            m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(p.add(16 * i))), m);
        }
        let amax = _mm512_reduce_max_ps(m);
        let mut b =
            BlockQ8K { qs: [0; QK_K], d: 0.0, bsums: [0; QK_K / 16], sums32: [0; QK_K / 32] };
        if amax != 0.0 {
            // The first value of that magnitude, as the scalar scan keeps it.
            let max = *xs.iter().find(|v| v.abs() == amax).unwrap_or(&amax);
            let iscale = -127.0 / max;
            let (vs, top) = (_mm512_set1_ps(iscale), _mm512_set1_ps(127.0));
            for i in 0..QK_K / 16 {
                let v = _mm512_mul_ps(vs, _mm512_loadu_ps(p.add(16 * i)));
                let r =
                    _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
                // minps returns its second operand (127) for NaN, as f32::min does.
                let q = _mm512_cvtps_epi32(_mm512_min_ps(r, top));
                let dst = b.qs.as_mut_ptr().add(16 * i) as *mut __m128i;
                _mm_storeu_si128(dst, _mm512_cvtepi32_epi8(q));
                b.bsums[i] = _mm512_reduce_add_epi32(q) as i16;
            }
            for (s, pair) in b.sums32.iter_mut().zip(b.bsums.chunks_exact(2)) {
                *s = pair[0] + pair[1];
            }
            b.d = 1.0 / iscale;
        }
        out.push(b);
    }
}

/// The scalar [`quantize_row_q8k`].
pub(crate) fn quantize_row_q8k_scalar(x: &[f32], out: &mut Vec<BlockQ8K>) {
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
        let mut b =
            BlockQ8K { qs: [0; QK_K], d: 0.0, bsums: [0; QK_K / 16], sums32: [0; QK_K / 32] };
        if amax != 0.0 {
            let iscale = -127.0 / max;
            for (q, &v) in b.qs.iter_mut().zip(xs) {
                *q = crate::q8_1::round_ties_even(iscale * v).min(127.0) as i8;
            }
            for (s, g) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
                *s = g.iter().map(|&q| q as i16).sum();
            }
            for (s, pair) in b.sums32.iter_mut().zip(b.bsums.chunks_exact(2)) {
                *s = pair[0] + pair[1];
            }
            b.d = 1.0 / iscale;
        }
        out.push(b);
    }
}

/// ggml `get_scale_min_k4` for all eight sub-blocks.
#[inline(always)]
pub(crate) fn scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
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

/// One Q4_K block's header as ggml's AVX2 kernel unpacks it: `d` and `dmin` in f32, and 16 i16
/// lanes holding the eight 6-bit scales (lanes 0–7) then the eight mins (lanes 8–15).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn q4k_header(blk: &[u8]) -> (f32, f32, std::arch::x86_64::__m256i) {
    use std::arch::x86_64::*;
    let u = |i: usize| u32::from_le_bytes([blk[4 + i], blk[5 + i], blk[6 + i], blk[7 + i]]);
    let (u0, u1, u2) = (u(0), u(4), u(8));
    let sc03 = u0 & 0x3F3F_3F3F;
    let mn03 = u1 & 0x3F3F_3F3F;
    let sc47 = (u2 & 0x0F0F_0F0F) | (((u0 >> 6) & 0x0303_0303) << 4);
    let mn47 = ((u2 >> 4) & 0x0F0F_0F0F) | (((u1 >> 6) & 0x0303_0303) << 4);
    let packed = _mm_set_epi32(mn47 as i32, mn03 as i32, sc47 as i32, sc03 as i32);
    (
        crate::x86::h2f(u16::from_le_bytes([blk[0], blk[1]])),
        crate::x86::h2f(u16::from_le_bytes([blk[2], blk[3]])),
        _mm256_cvtepu8_epi16(packed),
    )
}

/// `pshufb` pattern broadcasting i16 lane `k` across each 128-bit half.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn scale_pattern(k: usize) -> i16 {
    ((2 * k) | ((2 * k + 1) << 8)) as i16
}

/// The mins term of one block for one token: 4 i32 lanes of `min[2i]·s[2i] + min[2i+1]·s[2i+1]`
/// where `s[j]` sums the Q8_K block's values of sub-block `j` (ggml's `prod`; ggml gets `s` by a
/// horizontal add of `bsums`, the same i16 sums as `sums32`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn mins_prod(
    mins: std::arch::x86_64::__m128i,
    y: &BlockQ8K,
) -> std::arch::x86_64::__m128i {
    use std::arch::x86_64::*;
    _mm_madd_epi16(mins, _mm_loadu_si128(y.sums32.as_ptr() as *const __m128i))
}

/// ggml's final reduction: 8 lanes of `d`-scaled sums plus 4 lanes of mins terms.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4k_finish(acc: std::arch::x86_64::__m256, acc_m: std::arch::x86_64::__m128) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    let m = _mm_add_ss(m, _mm_movehdup_ps(m));
    crate::x86::hsum(acc) + _mm_cvtss_f32(m)
}

/// Dot products of one Q4_K weight row `w` (`nb` blocks) with `R` Q8_K activation rows
/// `a: [R, nb]` into `out[..R]` (AVX2 + FMA + F16C), each block's scales and nibbles unpacked once
/// for all `R` tokens. Every token's arithmetic is ggml's `ggml_vec_dot_q4_K_q8_K` (AVX2 branch):
/// integer sums per block, one fused multiply-add per block into 8 f32 lanes for the scaled sums
/// and into 4 lanes for the mins, reduced at the end of the row. So a tile's results are
/// bit-identical to the one-token kernel's, whatever `R`; equal to [`dot_q4k_scalar`] up to f32
/// rounding order. (`y.d · d` is computed as a vector product: the same IEEE product in every
/// lane; `y.d · (−dmin)` equals ggml's `(−y.d) · dmin` exactly.)
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C (checked by the caller at run time).
///
/// # Panics
/// When `w` holds fewer than `nb` Q4_K blocks, `a` fewer than `R · nb` blocks or `out` fewer
/// than `R` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4k_tokens_avx2<const R: usize>(
    w: &[u8],
    a: &[BlockQ8K],
    nb: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    assert!(w.len() >= nb * BLOCK_BYTES && a.len() >= R * nb && out.len() >= R);
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut acc_m = [_mm_setzero_ps(); R];
    for b in 0..nb {
        let blk = w.get_unchecked(b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES);
        let p = blk.as_ptr();
        let (d0, dmin0, ms) = q4k_header(blk);
        let (d0, ndmin0) = (_mm256_set1_ps(d0), _mm_set1_ps(-dmin0));
        let mins = _mm256_extracti128_si256(ms, 1);
        let sc128 = _mm256_castsi256_si128(ms);
        let scales = _mm256_set_m128i(sc128, sc128);
        let mut q4 = [_mm256_setzero_si256(); 8];
        let mut sc = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            let bits = _mm256_loadu_si256(p.add(16 + c * 32) as *const __m256i);
            q4[2 * c] = _mm256_and_si256(bits, low);
            q4[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low);
        }
        for (k, s) in sc.iter_mut().enumerate() {
            *s = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(scale_pattern(k)));
        }
        for j in 0..R {
            let y = a.get_unchecked(j * nb + b);
            let yd = _mm256_broadcast_ss(&y.d);
            let dmin = _mm_mul_ps(_mm256_castps256_ps128(yd), ndmin0);
            acc_m[j] = _mm_fmadd_ps(dmin, _mm_cvtepi32_ps(mins_prod(mins, y)), acc_m[j]);
            let mut sumi = _mm256_setzero_si256();
            for c in 0..4 {
                let q8l = _mm256_load_si256(y.qs.as_ptr().add(c * 64) as *const __m256i);
                let q8h = _mm256_load_si256(y.qs.as_ptr().add(c * 64 + 32) as *const __m256i);
                // u8 × i8 pairs: at most 2·15·128 per i16 lane, no saturation.
                let pl = _mm256_madd_epi16(sc[2 * c], _mm256_maddubs_epi16(q4[2 * c], q8l));
                let ph = _mm256_madd_epi16(sc[2 * c + 1], _mm256_maddubs_epi16(q4[2 * c + 1], q8h));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
            }
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(yd, d0), _mm256_cvtepi32_ps(sumi), acc[j]);
        }
    }
    for j in 0..R {
        out[j] = q4k_finish(acc[j], acc_m[j]);
    }
}

/// One Q4_K block's nibbles and scales on 512-bit registers: `q4[c]` holds chunk `c`'s low
/// nibbles (weights `64c..64c+32`) then its high nibbles (`64c+32..64c+64`), and `sc[c]` the
/// matching sub-block scales as i16 pairs (from `ms`, [`q4k_header`]'s scales and mins).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
#[inline]
pub(crate) unsafe fn unpack_512(
    blk: &[u8],
    ms: std::arch::x86_64::__m256i,
) -> ([std::arch::x86_64::__m512i; 4], [std::arch::x86_64::__m512i; 4]) {
    use std::arch::x86_64::*;
    assert!(blk.len() >= BLOCK_BYTES);
    let low = _mm512_set1_epi8(0x0F);
    let scales = _mm512_broadcast_i32x4(_mm256_castsi256_si128(ms));
    let mut q4 = [_mm512_setzero_si512(); 4];
    let mut sc = [_mm512_setzero_si512(); 4];
    for c in 0..4 {
        let bits = _mm256_loadu_si256(blk.as_ptr().add(16 + c * 32) as *const __m256i);
        let both = _mm512_inserti64x4(_mm512_castsi256_si512(bits), _mm256_srli_epi16(bits, 4), 1);
        q4[c] = _mm512_and_si512(both, low);
        let pattern = _mm512_inserti64x4(
            _mm512_set1_epi16(scale_pattern(2 * c)),
            _mm256_set1_epi16(scale_pattern(2 * c + 1)),
            1,
        );
        sc[c] = _mm512_shuffle_epi8(scales, pattern);
    }
    (q4, sc)
}

/// [`q4k_tokens_avx2`] on 512-bit registers: each 32-byte chunk's low and high nibbles in one
/// register against the Q8_K block's 64 matching bytes. The two 256-bit halves' integer sums are
/// added before the f32 step, which gives every 32-bit lane exactly the integer the AVX2 kernel
/// has there, so results are bit-identical to [`q4k_tokens_avx2`] (tested). `$scaled_add(sum, sc,
/// p)` adds `sc · p` pairwise to `sum` (`vpmaddwd` + `vpaddd`, or one `vpdpwssd` with AVX-512
/// VNNI: the same integers).
macro_rules! q4k_avx512_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal, $scaled_add:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU must support the target features named on the function (checked by the caller
        /// at run time).
        ///
        /// # Panics
        /// When `w` holds fewer than `nb` Q4_K blocks, `a` fewer than `R · nb` blocks or `out`
        /// fewer than `R` values.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        pub unsafe fn $name<const R: usize>(
            w: &[u8],
            a: &[BlockQ8K],
            nb: usize,
            out: &mut [f32],
        ) {
            use std::arch::x86_64::*;
            assert!(w.len() >= nb * BLOCK_BYTES && a.len() >= R * nb && out.len() >= R);
            let mut acc = [_mm256_setzero_ps(); R];
            let mut acc_m = [_mm_setzero_ps(); R];
            for b in 0..nb {
                let blk = w.get_unchecked(b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES);
                let (d0, dmin0, ms) = q4k_header(blk);
                let (d0, ndmin0) = (_mm256_set1_ps(d0), _mm_set1_ps(-dmin0));
                let mins = _mm256_extracti128_si256(ms, 1);
                let (q4, sc) = unpack_512(blk, ms);
                for j in 0..R {
                    let y = a.get_unchecked(j * nb + b);
                    let yd = _mm256_broadcast_ss(&y.d);
                    let dmin = _mm_mul_ps(_mm256_castps256_ps128(yd), ndmin0);
                    acc_m[j] = _mm_fmadd_ps(dmin, _mm_cvtepi32_ps(mins_prod(mins, y)), acc_m[j]);
                    let mut sumi = _mm512_setzero_si512();
                    for c in 0..4 {
                        let q8 = _mm512_load_si512(y.qs.as_ptr().add(c * 64) as *const _);
                        sumi = $scaled_add(sumi, sc[c], _mm512_maddubs_epi16(q4[c], q8));
                    }
                    let sumi = _mm256_add_epi32(
                        _mm512_castsi512_si256(sumi),
                        _mm512_extracti64x4_epi64(sumi, 1),
                    );
                    acc[j] =
                        _mm256_fmadd_ps(_mm256_mul_ps(yd, d0), _mm256_cvtepi32_ps(sumi), acc[j]);
                }
            }
            for j in 0..R {
                out[j] = q4k_finish(acc[j], acc_m[j]);
            }
        }
    };
}

/// `sum + sc · p` pairwise (`vpmaddwd` then `vpaddd`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn scaled_add_512(
    sum: std::arch::x86_64::__m512i,
    sc: std::arch::x86_64::__m512i,
    p: std::arch::x86_64::__m512i,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    _mm512_add_epi32(sum, _mm512_madd_epi16(sc, p))
}

/// [`scaled_add_512`] in one `vpdpwssd` (AVX-512 VNNI; not the saturating `vpdpwssds`): the same
/// integers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn scaled_add_vnni(
    sum: std::arch::x86_64::__m512i,
    sc: std::arch::x86_64::__m512i,
    p: std::arch::x86_64::__m512i,
) -> std::arch::x86_64::__m512i {
    std::arch::x86_64::_mm512_dpwssd_epi32(sum, sc, p)
}

q4k_avx512_kernel!(
    /// [`q4k_tokens_avx2`] on 512-bit registers (AVX-512 F + BW).
    q4k_tokens_avx512,
    "avx512f,avx512bw,avx2,fma,f16c",
    scaled_add_512
);

q4k_avx512_kernel!(
    /// [`q4k_tokens_avx512`] with each chunk's scale multiply and sum in one `vpdpwssd`
    /// (AVX-512 VNNI).
    q4k_tokens_vnni,
    "avx512f,avx512bw,avx512vnni,avx2,fma,f16c",
    scaled_add_vnni
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockFormat, QuantMatrix};
    use candle_core::quantized::{GgmlDType, QStorage, QTensor};

    /// The AVX-512 quantizer equals the scalar one bit for bit: random blocks, exact ties (scale
    /// 1, values k + 0.5), a tie in magnitude between signs, zeros, NaN and infinity.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn quantize_avx512_equals_scalar() {
        if crate::isa() < crate::Isa::Avx512 {
            eprintln!("no AVX-512 here: the scalar quantizer is the only one");
            return;
        }
        let mut x: Vec<f32> =
            (0..8 * QK_K).map(|i| ((i as f32 * 0.7131).sin() * 43758.547).fract() - 0.5).collect();
        // Block 1: largest magnitude -127 first (scale exactly 1), then ties k + 0.5.
        x[QK_K] = -127.0;
        for (i, v) in x[QK_K + 1..2 * QK_K].iter_mut().enumerate() {
            *v = (i as f32 % 250.0) - 125.0 + 0.5;
        }
        // Block 2: +3 and -3 both of the largest magnitude (the first wins).
        x[2 * QK_K + 5] = 3.0;
        x[2 * QK_K + 9] = -3.0;
        x[3 * QK_K..4 * QK_K].fill(0.0);
        x[4 * QK_K + 17] = f32::NAN;
        x[5 * QK_K + 200] = f32::INFINITY;
        x[6 * QK_K + 3] = -1e-30;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        quantize_row_q8k_scalar(&x, &mut a);
        // SAFETY: AVX-512 checked above.
        unsafe { quantize_row_q8k_avx512(&x, &mut b) };
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            assert_eq!(a.qs, b.qs, "block {i}");
            assert_eq!(a.d.to_bits(), b.d.to_bits(), "block {i}");
            assert_eq!((a.bsums, a.sums32), (b.bsums, b.sums32), "block {i}");
        }
        assert_eq!(a.len(), 8);
        assert!(a[1].qs[1..].iter().all(|&q| q % 2 == 0) && a[1].d == 1.0, "ties to even");
    }

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

    /// Every tile width, AVX2 and AVX-512 (where this CPU has them): each token's result
    /// bit-identical to the AVX2 one-token kernel's.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q4k_tiles_and_isas_are_bit_identical_to_one_token() {
        if !crate::x86::avx2::available() {
            eprintln!("no AVX2 on this CPU: only the scalar kernel runs here");
            return;
        }
        let (rows, cols) = (6, 1024);
        let nb = cols / QK_K;
        let (w, _) = matrix(rows, cols);
        let x: Vec<f32> =
            (0..8 * cols).map(|i| ((i as f32 * 0.377).cos() * 9631.3).fract() - 0.5).collect();
        let mut q = Vec::new();
        quantize_row_q8k(&x, &mut q);
        let avx512 =
            std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw");
        let vnni = avx512 && std::is_x86_feature_detected!("avx512vnni");
        macro_rules! check_width {
            ($r:literal) => {
                for r in 0..rows {
                    let mut tile = [0f32; $r];
                    unsafe { q4k_tokens_avx2::<$r>(w.row(r), &q[..$r * nb], nb, &mut tile) };
                    let mut wide = [0f32; $r];
                    if avx512 {
                        unsafe { q4k_tokens_avx512::<$r>(w.row(r), &q[..$r * nb], nb, &mut wide) };
                    }
                    let mut dp = [0f32; $r];
                    if vnni {
                        unsafe { q4k_tokens_vnni::<$r>(w.row(r), &q[..$r * nb], nb, &mut dp) };
                    }
                    for t in 0..$r {
                        let mut one = [0f32];
                        let a = &q[t * nb..(t + 1) * nb];
                        unsafe { q4k_tokens_avx2::<1>(w.row(r), a, nb, &mut one) };
                        assert_eq!(
                            one[0].to_bits(),
                            tile[t].to_bits(),
                            "avx2 width {} row {r} token {t}",
                            $r
                        );
                        if avx512 {
                            assert_eq!(
                                one[0].to_bits(),
                                wide[t].to_bits(),
                                "avx512 width {} row {r} token {t}",
                                $r
                            );
                        }
                        if vnni {
                            assert_eq!(
                                one[0].to_bits(),
                                dp[t].to_bits(),
                                "vnni width {} row {r} token {t}",
                                $r
                            );
                        }
                        let s = dot_q4k_scalar(w.row(r), a);
                        assert!(
                            (s - one[0]).abs() <= 1e-4 * s.abs().max(1.0),
                            "simd {} scalar {s}",
                            one[0]
                        );
                    }
                }
            };
        }
        check_width!(1);
        check_width!(2);
        check_width!(3);
        check_width!(4);
        check_width!(5);
        check_width!(6);
        check_width!(7);
        check_width!(8);
        if !avx512 {
            eprintln!("no AVX-512 BW on this CPU: AVX2 tiles checked only");
        } else if !vnni {
            eprintln!("no AVX-512 VNNI on this CPU: its variant not checked");
        }
    }
}
