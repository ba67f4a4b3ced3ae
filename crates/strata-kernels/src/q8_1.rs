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
/// is the same without `s`.
pub fn quantize_row(x: &[f32], out: &mut Vec<BlockQ8_1>) {
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
    #[test]
    fn round_ties_even_matches_std() {
        for i in -3000..3000 {
            let v = i as f32 * 0.25 + 0.01 * (i % 3) as f32;
            assert_eq!(super::round_ties_even(v), v.round_ties_even(), "{v}");
        }
    }
}
