//! Q8_1 activation blocks: 32 int8 values with scale `d` and `s = d · Σq` (both rounded to f16 as
//! ggml stores them; kept here as f32 to skip conversions in the dot product).

use half::f16;

pub const QK: usize = 32;

#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub struct BlockQ8_1 {
    pub qs: [i8; QK],
    pub d: f32,
    pub s: f32,
}

/// Quantizes `x` (length a multiple of 32) bit-exactly like ggml's x86 `quantize_row_q8_1`
/// (`ggml-cpu-quants.c`, AVX2 branch): scale `127 / amax`, round half to even. The Q8_0 quantizer
/// is the same without `s`. On AVX-512 CPUs the same operations on 16 lanes (bit-identical,
/// tested): this runs on the calling thread for every dense product of a few rows, where the
/// scalar loop took 4.5% of a SmolLM2 8-sequence decode step (docs/performance.md).
pub fn quantize_row(x: &[f32], out: &mut Vec<BlockQ8_1>) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa() >= crate::Isa::Avx512 {
        // SAFETY: the CPU has AVX-512 F and BW (checked by isa()).
        return unsafe { quantize_row_avx512(x, out) };
    }
    quantize_row_scalar(x, out)
}

/// [`quantize_row`] on 16 lanes: the maximum of |x| (NaN skipped, as `f32::max` skips it), the
/// same product `v · id`, rounding to nearest even (`vrndscaleps`, equal to the magic-number
/// rounding for |v| < 2^22), NaN products as 0 (what `as i8` gives), exact integer sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_row_avx512(x: &[f32], out: &mut Vec<BlockQ8_1>) {
    use std::arch::x86_64::*;
    out.clear();
    for xs in x.chunks_exact(QK) {
        let p = xs.as_ptr();
        let (lo, hi) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
        // maxps returns its second operand when either is NaN: never NaN here.
        let m = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_setzero_ps());
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(hi), m));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let vid = _mm512_set1_ps(id);
        let mut b = BlockQ8_1 { qs: [0; QK], d: 0.0, s: 0.0 };
        let mut sum = 0i32;
        for (half, v) in [lo, hi].into_iter().enumerate() {
            let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(v, vid),
            );
            let r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r), r);
            let q = _mm512_cvtps_epi32(r);
            let dst = b.qs.as_mut_ptr().add(16 * half) as *mut __m128i;
            _mm_storeu_si128(dst, _mm512_cvtepi32_epi8(q));
            sum += _mm512_reduce_add_epi32(q);
        }
        b.d = f16::from_f32(d).to_f32();
        b.s = f16::from_f32(sum as f32 * d).to_f32();
        out.push(b);
    }
}

/// The scalar [`quantize_row`].
pub(crate) fn quantize_row_scalar(x: &[f32], out: &mut Vec<BlockQ8_1>) {
    out.clear();
    for xs in x.chunks_exact(QK) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut qs = [0i8; QK];
        let mut sum = 0i32;
        for (q, &v) in qs.iter_mut().zip(xs) {
            *q = round_ties_even(v * id) as i8;
            sum += *q as i32;
        }
        out.push(BlockQ8_1 {
            qs,
            d: f16::from_f32(d).to_f32(),
            s: f16::from_f32(sum as f32 * d).to_f32(),
        });
    }
}

/// Round half to even for |v| < 2^22 (the default FP rounding mode, as `_mm256_round_ps` with
/// `_MM_FROUND_TO_NEAREST_INT` does) without a libm call.
#[inline(always)]
pub(crate) fn round_ties_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    (v + MAGIC) - MAGIC
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatched quantizer (AVX-512 where the CPU has it) equals the scalar one bit for bit:
    /// random magnitudes, exact ties of the rounding, zeros, an all-zero block, NaN and ±inf.
    #[test]
    fn quantize_row_equals_the_scalar_quantizer() {
        let mut x: Vec<f32> = Vec::new();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for i in 0..64 * QK {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let r = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            x.push(r * [1e-3, 1.0, 40.0, 3e4][i / QK % 4]);
        }
        // A block whose scale makes exact halves: amax 127 → id 1, values k + 0.5.
        for (j, v) in x[5 * QK..6 * QK].iter_mut().enumerate() {
            *v = if j == 0 { 127.0 } else { (j as f32 - 16.0) + 0.5 };
        }
        x[7 * QK..8 * QK].fill(0.0);
        x[9 * QK + 3] = f32::NAN;
        x[10 * QK + 4] = f32::INFINITY;
        x[11 * QK + 5] = f32::NEG_INFINITY;
        x[12 * QK + 6] = -0.0;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        quantize_row(&x, &mut a);
        quantize_row_scalar(&x, &mut b);
        assert_eq!(a.len(), b.len());
        for (i, (p, q)) in a.iter().zip(&b).enumerate() {
            assert_eq!(p.qs, q.qs, "block {i} quants");
            assert_eq!(p.d.to_bits(), q.d.to_bits(), "block {i} d");
            assert!(
                p.s.to_bits() == q.s.to_bits() || (p.s.is_nan() && q.s.is_nan()),
                "block {i} s"
            );
        }
    }

    #[test]
    fn round_ties_even_matches_std() {
        for i in -3000..3000 {
            let v = i as f32 * 0.25 + 0.01 * (i % 3) as f32;
            assert_eq!(super::round_ties_even(v), v.round_ties_even(), "{v}");
        }
    }
}
