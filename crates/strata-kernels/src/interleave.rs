//! Row-interleaved ("x8") layouts of dense Q4_1 and Q8_0 matrices, and their AVX2 tile kernels.
//!
//! In the file's layout each row's blocks follow one another, so a SIMD dot product sums one row
//! at a time and ends in a horizontal sum; per 32 weights the kernel converts two f16 scales one
//! at a time and spends ~20 instructions. Here eight rows' blocks are stored together: one 32-byte
//! load holds 4 bytes of each of the 8 rows, `vpmaddubsw` + `vpmaddwd` (or one `vpdpbusd` where the
//! CPU has AVX-512 VNNI: the same integers) against 4 activation bytes broadcast to every lane sum
//! them one row per 32-bit lane, and the 8 rows' f16 scales convert in
//! one instruction — ~5 instructions per row and block, no horizontal sums. The idea is that of
//! llama.cpp's repacked CPU layouts (`ggml-cpu/repack.cpp`, `ggml-cpu/amx/`); this layout and code
//! are our own.
//!
//! Layout: rows go in groups of 8 (a matrix is interleaved only when its row count is a multiple
//! of 8); group `g` takes bytes `g · 8 · row_bytes ..`, its blocks in order, block `b` being
//! - Q4_1: `d[8]` (f16, one per row), `m[8]` (f16), then 4 chunks `k` of 32 bytes: bytes
//!   `4k..4k+4` of each row's 16 nibble bytes, row `r` at `4r` — 160 bytes = 8 × 20;
//! - Q8_0: `d[8]` (f16), then 8 chunks `k` of 32 bytes: each row's quants `4k..4k+4`, row `r`
//!   at `4r` — 272 bytes = 8 × 34.
//!
//! The same bytes as the file's blocks, moved: interleaving at load keeps one copy.
//!
//! Arithmetic per row and token (every tile width does exactly this, so a verify pass is
//! bit-identical to decoding token by token): per block the exact integer dot product `sumi`
//! (`Σ q_w · q_a`), then `acc = fma(d · d_a, sumi, acc)` and, for Q4_1, `acc = fma(m, s_a, acc)`.
//! It equals ggml's `ggml_vec_dot_q4_1_q8_1` / `ggml_vec_dot_q8_0_q8_0` up to f32 rounding order
//! (tested against [`crate::matrix::dot_q4_1_scalar`] / `dot_q8_0_scalar`).

use crate::matrix::BlockFormat;

/// Rows per interleaved group.
pub const GROUP: usize = 8;

/// Whether a `[rows, ·]` matrix in `format` can be interleaved.
pub fn supports(format: BlockFormat, rows: usize) -> bool {
    matches!(format, BlockFormat::Q4_1 | BlockFormat::Q8_0) && rows.is_multiple_of(GROUP)
}

/// Bytes of a block's scales in the group layout (and at the start of a file block).
const fn scale_bytes(format: BlockFormat) -> usize {
    match format {
        BlockFormat::Q4_1 => 4,
        _ => 2,
    }
}

/// The file layout's `data` (`rows` rows of `nb` blocks) in the interleaved layout.
///
/// # Panics
/// When [`supports`] is false or `data` is not `rows · nb` blocks.
pub fn interleave(format: BlockFormat, data: &[u8], rows: usize, nb: usize) -> Vec<u8> {
    assert!(supports(format, rows), "{format:?} with {rows} rows is not interleaved");
    let bb = format.block_bytes();
    assert_eq!(data.len(), rows * nb * bb);
    let (sb, rb) = (scale_bytes(format), nb * bb);
    let quant = bb - sb; // bytes of quants per block and row
    let mut out = vec![0u8; data.len()];
    for g in 0..rows / GROUP {
        for b in 0..nb {
            let dst = &mut out[(g * nb + b) * GROUP * bb..][..GROUP * bb];
            for r in 0..GROUP {
                let src = &data[(g * GROUP + r) * rb + b * bb..][..bb];
                // Scales: each f16 of the block in its own array of 8.
                for s in 0..sb / 2 {
                    dst[s * 2 * GROUP + 2 * r..][..2].copy_from_slice(&src[2 * s..2 * s + 2]);
                }
                for k in 0..quant / 4 {
                    let at = sb * GROUP + k * 4 * GROUP + 4 * r;
                    dst[at..at + 4].copy_from_slice(&src[sb + 4 * k..sb + 4 * k + 4]);
                }
            }
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use crate::q8_1::BlockQ8_1;

    use super::GROUP;

    use crate::BlockFormat;

    /// Bytes of one block of a group.
    const Q4_1X8: usize = GROUP * BlockFormat::Q4_1.block_bytes();
    const Q8_0X8: usize = GROUP * BlockFormat::Q8_0.block_bytes();

    /// `sum` plus the 8 lanes' exact `Σ u · s` over 4 bytes per lane (`u` unsigned, `s` signed;
    /// at most 2 · 255 · 128 per 16-bit pair: no saturation for these formats' ranges).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dot4_avx2(sum: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
    }

    /// [`dot4_avx2`] in one `vpdpbusd` (AVX-512 VNNI on 256-bit registers): the same integers.
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    #[inline]
    unsafe fn dot4_vnni(sum: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(sum, u, s)
    }

    /// A Q4_1 block's exact `Σ q_w · q_a` for each of the 8 rows (one per 32-bit lane): nibbles
    /// `lo[k]` (weights 4k..4k+4) and `hi[k]` (16+4k..) against the token's bytes. Without VNNI
    /// the eight `vpmaddubsw` products are added in 16 bits and widened once (one `vpmaddwd`),
    /// instead of a widening per product: each 16-bit lane holds at most 8 · 2 · 15 · 128 =
    /// 30,720 in magnitude (nibbles ≤ 15, any i8 activation), so no sum saturates and the
    /// integers equal [`dot4_avx2`]'s chain (and VNNI's) exactly — 9 multiply-port instructions
    /// instead of 16.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn q4_1_block_avx2(lo: &[__m256i; 4], hi: &[__m256i; 4], y: &BlockQ8_1) -> __m256i {
        let mut s16 = _mm256_maddubs_epi16(lo[0], bcast(y, 0));
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[0], bcast(y, 4)));
        for k in 1..4 {
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[k], bcast(y, k)));
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[k], bcast(y, 4 + k)));
        }
        _mm256_madd_epi16(s16, _mm256_set1_epi16(1))
    }

    /// [`q4_1_block_avx2`] with `vpdpbusd`: the same integers.
    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    #[inline]
    unsafe fn q4_1_block_vnni(lo: &[__m256i; 4], hi: &[__m256i; 4], y: &BlockQ8_1) -> __m256i {
        let mut sumi = _mm256_setzero_si256();
        for k in 0..4 {
            // Low nibbles: weights 4k..4k+4; high: weights 16+4k..16+4k+4.
            sumi = dot4_vnni(sumi, lo[k], bcast(y, k));
            sumi = dot4_vnni(sumi, hi[k], bcast(y, 4 + k));
        }
        sumi
    }

    /// Whether this CPU runs the VNNI variants.
    pub fn vnni_available() -> bool {
        std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vl")
    }

    /// Bytes ahead of the block being computed that are prefetched, a block's worth of lines at
    /// a time (a burst of a whole group's lines fills the line-fill buffers and stalls the
    /// kernel; a steady stream keeps DRAM reads in flight).
    const PREFETCH_AHEAD: usize = 2048;

    /// Token `j`'s 8 row sums to `out[8j..8j + 8]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store(acc: &[__m256], out: &mut [f32]) {
        for (v, o) in acc.iter().zip(out.chunks_exact_mut(GROUP)) {
            _mm256_storeu_ps(o.as_mut_ptr(), *v);
        }
    }

    /// 4 activation bytes `qs[4k..4k+4]` in every 32-bit lane.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn bcast(y: &BlockQ8_1, k: usize) -> __m256i {
        _mm256_set1_epi32((y.qs.as_ptr().add(4 * k) as *const i32).read_unaligned())
    }

    /// The Q4_1 and Q8_0 group kernels for one instruction set: `$q4_1_block` sums a Q4_1
    /// block's products per row, `$dot` 4 bytes per lane.
    macro_rules! group_kernels {
        ($features:literal, $q4_1_block:ident, $dot:ident, $q4_1:ident, $q8_0:ident) => {
            /// One group of 8 interleaved Q4_1 rows (`nb` blocks each) times `R` Q8_1 activation
            /// rows `a: [R, nb]` → `out[j · 8 + r]` for token `j`, row `r`.
            ///
            /// # Safety
            /// The CPU must have the function's target features; `g` holds the group's `nb`
            /// blocks (`nb · 160` bytes), `a` `R · nb` blocks, `out` at least `8 · R` values.
            #[target_feature(enable = $features)]
            pub unsafe fn $q4_1<const R: usize>(
                g: &[u8],
                a: &[BlockQ8_1],
                nb: usize,
                out: &mut [f32],
            ) {
                assert!(g.len() >= nb * Q4_1X8 && a.len() >= R * nb && out.len() >= R * GROUP);
                let low = _mm256_set1_epi8(0x0F);
                let mut acc = [_mm256_setzero_ps(); R];
                for b in 0..nb {
                    let p = g.as_ptr().add(b * Q4_1X8);
                    crate::prefetch(p.wrapping_add(PREFETCH_AHEAD), Q4_1X8);
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                    let m = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i));
                    let mut lo = [_mm256_setzero_si256(); 4];
                    let mut hi = [_mm256_setzero_si256(); 4];
                    for k in 0..4 {
                        let bits = _mm256_loadu_si256(p.add(32 + 32 * k) as *const __m256i);
                        lo[k] = _mm256_and_si256(bits, low);
                        hi[k] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low);
                    }
                    for j in 0..R {
                        let y = &a[j * nb + b];
                        let sumi = $q4_1_block(&lo, &hi, y);
                        let dd = _mm256_mul_ps(d, _mm256_set1_ps(y.d));
                        acc[j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi), acc[j]);
                        acc[j] = _mm256_fmadd_ps(m, _mm256_set1_ps(y.s), acc[j]);
                    }
                }
                store(&acc, out);
            }

            /// The Q8_0 kernel (`nb · 272` bytes per group; `a`'s `s` unused).
            ///
            /// # Safety
            /// As the Q4_1 kernel.
            #[target_feature(enable = $features)]
            pub unsafe fn $q8_0<const R: usize>(
                g: &[u8],
                a: &[BlockQ8_1],
                nb: usize,
                out: &mut [f32],
            ) {
                assert!(g.len() >= nb * Q8_0X8 && a.len() >= R * nb && out.len() >= R * GROUP);
                let mut acc = [_mm256_setzero_ps(); R];
                for b in 0..nb {
                    let p = g.as_ptr().add(b * Q8_0X8);
                    crate::prefetch(p.wrapping_add(PREFETCH_AHEAD), Q8_0X8);
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                    let mut w = [_mm256_setzero_si256(); 8];
                    let mut abs = [_mm256_setzero_si256(); 8];
                    for k in 0..8 {
                        w[k] = _mm256_loadu_si256(p.add(16 + 32 * k) as *const __m256i);
                        abs[k] = _mm256_sign_epi8(w[k], w[k]);
                    }
                    for j in 0..R {
                        let y = &a[j * nb + b];
                        let mut sumi = _mm256_setzero_si256();
                        for k in 0..8 {
                            // |w| · (a with w's sign): ggml's signed × signed trick (|a| ≤ 127).
                            sumi = $dot(sumi, abs[k], _mm256_sign_epi8(bcast(y, k), w[k]));
                        }
                        let dd = _mm256_mul_ps(d, _mm256_set1_ps(y.d));
                        acc[j] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi), acc[j]);
                    }
                }
                store(&acc, out);
            }
        };
    }

    group_kernels!("avx2,fma,f16c", q4_1_block_avx2, dot4_avx2, q4_1x8_tokens, q8_0x8_tokens);
    group_kernels!(
        "avx2,fma,f16c,avx512vnni,avx512vl",
        q4_1_block_vnni,
        dot4_vnni,
        q4_1x8_tokens_vnni,
        q8_0x8_tokens_vnni
    );
}

#[cfg(test)]
mod tests {
    use half::f16;

    use crate::matrix::{dot_q4_1_scalar, dot_q8_0_scalar};
    use crate::q8_1::quantize_row;
    use crate::{BlockFormat, QuantMatrix};

    /// Random blocks with finite scales, in the file's layout.
    fn blocks(format: BlockFormat, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let bb = format.block_bytes();
        let mut s = seed;
        let mut data = vec![0u8; rows * cols / 32 * bb];
        for b in data.iter_mut() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *b = s as u8;
        }
        for (i, blk) in data.chunks_exact_mut(bb).enumerate() {
            let d = 1e-2 * (1.0 + (i % 7) as f32);
            blk[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
            if format == BlockFormat::Q4_1 {
                blk[2..4].copy_from_slice(&f16::from_f32(-0.05 * (i % 5) as f32).to_le_bytes());
            }
        }
        data
    }

    fn acts(m: usize, cols: usize) -> Vec<f32> {
        (0..m * cols).map(|i| ((i as f32 * 0.377).cos() * 9631.3).fract() - 0.5).collect()
    }

    /// The interleaved matrix gives ggml's dot products (the scalar kernels on the file layout) up
    /// to f32 rounding order, for every row and for 1–19 tokens (every tile width and
    /// remainders), and each token's outputs bit for bit those of a one-token pass.
    #[test]
    fn interleaved_matches_ggml_and_tiles_equal_one_token() {
        if !super::supports(BlockFormat::Q4_1, 8) || crate::isa() < crate::Isa::Avx2 {
            eprintln!("interleaved kernels need x86-64 AVX2: not run on this CPU");
            return;
        }
        for format in [BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let (rows, cols) = (48, 256);
            let nb = cols / 32;
            let data = blocks(format, rows, cols, 0x9E37_79B9_7F4A_7C15);
            let file = QuantMatrix::new(format, data.clone(), rows, cols).unwrap();
            let x8 = QuantMatrix::interleaved(format, data.clone(), rows, cols).unwrap();
            assert_eq!(x8.row_unit(), 8, "{format:?} not interleaved");
            assert_eq!(x8.size_in_bytes(), file.size_in_bytes());
            let m = 19;
            let x = acts(m, cols);
            let mut got = vec![0f32; m * rows];
            x8.matmul(&x, m, &mut got);
            let mut q = Vec::new();
            for t in 0..m {
                quantize_row(&x[t * cols..(t + 1) * cols], &mut q);
                let mut one = vec![0f32; rows];
                x8.matmul(&x[t * cols..(t + 1) * cols], 1, &mut one);
                for r in 0..rows {
                    let w =
                        &data[r * nb * format.block_bytes()..(r + 1) * nb * format.block_bytes()];
                    let want = match format {
                        BlockFormat::Q4_1 => dot_q4_1_scalar(w, &q),
                        _ => dot_q8_0_scalar(w, &q),
                    };
                    let g = got[t * rows + r];
                    assert!(
                        (g - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{format:?} token {t} row {r}: {g} vs ggml {want}"
                    );
                    assert_eq!(g.to_bits(), one[r].to_bits(), "{format:?} token {t} row {r}");
                }
            }
            // Stacked interleaved matrices (fused q/k/v) equal the interleaved stack.
            let a = QuantMatrix::interleaved(format, data[..data.len() / 2].to_vec(), 24, cols);
            let b = QuantMatrix::interleaved(format, data[data.len() / 2..].to_vec(), 24, cols);
            let both = QuantMatrix::concat_rows(&[&a.unwrap(), &b.unwrap()]).unwrap();
            let mut stacked = vec![0f32; m * rows];
            both.matmul(&x, m, &mut stacked);
            assert_eq!(stacked, got, "{format:?} stacked");
            // A row count that is not a multiple of 8 keeps the file layout.
            let odd = QuantMatrix::interleaved(
                format,
                data[..nb * format.block_bytes() * 7].to_vec(),
                7,
                cols,
            );
            assert_eq!(odd.unwrap().row_unit(), 1);
        }
    }

    /// The AVX2 Q4_1 kernel adds a block's eight `vpmaddubsw` products in 16 bits: at the
    /// largest magnitudes (every nibble 15, every activation byte −128 or 127, and mixed signs)
    /// its integers stay exact — the result equals ggml's scalar dot product to f32 rounding
    /// (a saturated 16-bit sum would be off by thousands of units).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q4_1_kernel_sums_extreme_blocks_exactly() {
        use crate::q8_1::BlockQ8_1;
        if !crate::x86::avx2::available() {
            eprintln!("the interleaved kernels need x86-64 AVX2: not run on this CPU");
            return;
        }
        let (rows, nb) = (8, 4);
        let bb = BlockFormat::Q4_1.block_bytes();
        let mut data = vec![0xFFu8; rows * nb * bb];
        for blk in data.chunks_exact_mut(bb) {
            blk[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
            blk[2..4].copy_from_slice(&f16::from_f32(0.0).to_le_bytes());
        }
        let g = super::interleave(BlockFormat::Q4_1, &data, rows, nb);
        let fills: [fn(usize) -> i8; 3] =
            [|_| -128, |_| 127, |i| if i % 3 == 0 { 127 } else { -128 }];
        for fill in fills {
            let a: Vec<BlockQ8_1> = (0..nb)
                .map(|b| BlockQ8_1 {
                    qs: std::array::from_fn(|i| fill(32 * b + i)),
                    d: 1.0,
                    s: 0.0,
                })
                .collect();
            let mut out = [0f32; 8];
            unsafe { super::avx2::q4_1x8_tokens::<1>(&g, &a, nb, &mut out) };
            let want = dot_q4_1_scalar(&data[..nb * bb], &a);
            assert!(want.abs() > 10_000.0, "{want}");
            for (r, &v) in out.iter().enumerate() {
                assert_eq!(v, want, "row {r}");
            }
        }
    }

    /// The VNNI kernels (`vpdpbusd`) give the AVX2 kernels' bits at every tile width.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_kernels_equal_avx2_bit_for_bit() {
        use super::avx2::*;
        if !(crate::x86::avx2::available() && vnni_available()) {
            eprintln!("no AVX-512 VNNI on this CPU: only the AVX2 kernels run here");
            return;
        }
        let (rows, cols) = (16, 512);
        let nb = cols / 32;
        let x = acts(8, cols);
        let mut q = Vec::new();
        let mut qa = Vec::new();
        for t in 0..8 {
            quantize_row(&x[t * cols..(t + 1) * cols], &mut q);
            qa.extend_from_slice(&q);
        }
        for format in [BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let data = super::interleave(format, &blocks(format, rows, cols, 77), rows, nb);
            let gb = 8 * nb * format.block_bytes();
            macro_rules! check_width {
                ($r:literal) => {
                    for g in data.chunks_exact(gb) {
                        let (mut plain, mut vnni) = ([0f32; 8 * $r], [0f32; 8 * $r]);
                        let a = &qa[..$r * nb];
                        unsafe {
                            if format == BlockFormat::Q4_1 {
                                q4_1x8_tokens::<$r>(g, a, nb, &mut plain);
                                q4_1x8_tokens_vnni::<$r>(g, a, nb, &mut vnni);
                            } else {
                                q8_0x8_tokens::<$r>(g, a, nb, &mut plain);
                                q8_0x8_tokens_vnni::<$r>(g, a, nb, &mut vnni);
                            }
                        }
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&plain), bits(&vnni), "{format:?} width {}", $r);
                        assert!(plain.iter().any(|&v| v != 0.0));
                    }
                };
            }
            check_width!(1);
            check_width!(2);
            check_width!(3);
            check_width!(5);
            check_width!(8);
        }
    }
}
