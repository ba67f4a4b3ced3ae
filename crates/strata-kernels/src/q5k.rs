//! Q5_K weights × Q8_K activations, following ggml (`ggml/src/ggml-common.h` `block_q5_K`,
//! `ggml-quants.c` `dequantize_row_q5_K`, `ggml-cpu/arch/x86/quants.c` `ggml_vec_dot_q5_K_q8_K`).
//!
//! A Q5_K super-block holds 256 weights in 176 bytes: f16 `d` and `dmin`, the 12 bytes of 6-bit
//! scales and mins Q4_K has, 32 bytes of high bits `qh` and 128 bytes of low nibbles; weight `i`
//! of sub-block `j` is `d·scale[j]·q − dmin·min[j]` with `q` 5 bits.

use half::f16;

use crate::q4k::{scales_mins, BlockQ8K};

pub const BLOCK_BYTES: usize = 176;

/// One row of Q5_K blocks · Q8_K activations (generic version).
pub fn dot_q5k_scalar(w: &[u8], a: &[BlockQ8K]) -> f32 {
    let mut sumf = 0f32;
    for (blk, y) in w.chunks_exact(BLOCK_BYTES).zip(a) {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32() * y.d;
        let dmin = f16::from_le_bytes([blk[2], blk[3]]).to_f32() * y.d;
        let (sc, mn) = scales_mins(&blk[4..16]);
        let (qh, qs) = (&blk[16..48], &blk[48..176]);
        let (mut sumi, mut summ) = (0i32, 0i32);
        for c in 0..4 {
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                let q = qs[c * 32 + l];
                let vl = (q & 0xF) as i32 + (((qh[l] >> (2 * c)) & 1) as i32) * 16;
                let vh = (q >> 4) as i32 + (((qh[l] >> (2 * c + 1)) & 1) as i32) * 16;
                lo += vl * y.qs[c * 64 + l] as i32;
                hi += vh * y.qs[c * 64 + 32 + l] as i32;
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

/// Dot products of one Q5_K weight row `w` (`nb` blocks) with `R` Q8_K activation rows
/// `a: [R, nb]` into `out[..R]` (AVX2 + FMA + F16C), each block unpacked once for all `R` tokens.
/// Every token's arithmetic is ggml's `ggml_vec_dot_q5_K_q8_K` (AVX2 branch: integer sums per
/// block, one fused multiply-add per block into 8 f32 lanes, the mins term summed in scalar f32),
/// so a tile's results are bit-identical to the one-token kernel's whatever `R`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` holds `nb` whole Q5_K blocks and `a` `R · nb`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q5k_tokens_avx2<const R: usize>(
    w: &[u8],
    a: &[BlockQ8K],
    nb: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = [0f32; R];
    for (b, blk) in w.chunks_exact(BLOCK_BYTES).enumerate() {
        let (d0, dmin0, q, sc, mins) = unpack_avx2(blk);
        for j in 0..R {
            let y = &a[j * nb + b];
            summs[j] += -y.d * dmin0 * mins_sum(mins, y) as f32;
            let mut sumi = _mm256_setzero_si256();
            for c in 0..4 {
                let q8l = _mm256_load_si256(y.qs.as_ptr().add(c * 64) as *const __m256i);
                let q8h = _mm256_load_si256(y.qs.as_ptr().add(c * 64 + 32) as *const __m256i);
                let pl = _mm256_madd_epi16(sc[2 * c], _mm256_maddubs_epi16(q[2 * c], q8l));
                let ph = _mm256_madd_epi16(sc[2 * c + 1], _mm256_maddubs_epi16(q[2 * c + 1], q8h));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
            }
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(y.d * d0), _mm256_cvtepi32_ps(sumi), acc[j]);
        }
    }
    for j in 0..R {
        out[j] = crate::x86::hsum(acc[j]) + summs[j];
    }
}

/// [`q5k_tokens_avx2`] on 512-bit registers (AVX-512 F + BW); the halves' integer sums are added
/// before the f32 step, so results are bit-identical to it (tested).
///
/// # Safety
/// The CPU must support AVX-512 F and BW, AVX2, FMA and F16C; `w` holds `nb` whole Q5_K blocks
/// and `a` `R · nb`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn q5k_tokens_avx512<const R: usize>(
    w: &[u8],
    a: &[BlockQ8K],
    nb: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = [0f32; R];
    let join = |lo: __m256i, hi: __m256i| _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    for (b, blk) in w.chunks_exact(BLOCK_BYTES).enumerate() {
        let (d0, dmin0, q, sc, mins) = unpack_avx2(blk);
        let q = [join(q[0], q[1]), join(q[2], q[3]), join(q[4], q[5]), join(q[6], q[7])];
        let sc = [join(sc[0], sc[1]), join(sc[2], sc[3]), join(sc[4], sc[5]), join(sc[6], sc[7])];
        for j in 0..R {
            let y = &a[j * nb + b];
            summs[j] += -y.d * dmin0 * mins_sum(mins, y) as f32;
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
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(y.d * d0), _mm256_cvtepi32_ps(sumi), acc[j]);
        }
    }
    for j in 0..R {
        out[j] = crate::x86::hsum(acc[j]) + summs[j];
    }
}

#[cfg(target_arch = "x86_64")]
type Unpacked = (
    f32,
    f32,
    [std::arch::x86_64::__m256i; 8],
    [std::arch::x86_64::__m256i; 8],
    std::arch::x86_64::__m128i,
);

/// One block unpacked: `d`, `dmin`, the 5-bit values as bytes (`q[2c]` the low nibbles of chunk
/// `c`, `q[2c + 1]` its high nibbles, each with its `qh` bit), each sub-block's scale as 16 i16
/// lanes, and the eight mins as i16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn unpack_avx2(blk: &[u8]) -> Unpacked {
    use std::arch::x86_64::*;
    let (d, dmin, ms) = crate::q4k::q4k_header(blk);
    let sc128 = _mm256_castsi256_si128(ms);
    let scales = _mm256_set_m128i(sc128, sc128);
    let p = blk.as_ptr();
    let m4 = _mm256_set1_epi8(0xF);
    let hbits = _mm256_loadu_si256(p.add(16) as *const __m256i);
    let mut q = [_mm256_setzero_si256(); 8];
    let mut sc = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        let bits = _mm256_loadu_si256(p.add(48 + c * 32) as *const __m256i);
        // Bit 2c of each qh byte goes with the low nibbles, bit 2c + 1 with the high ones.
        let hl = _mm256_and_si256(hbits, _mm256_set1_epi8(1 << (2 * c)));
        let hh = _mm256_and_si256(hbits, _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8));
        let hl = _mm256_min_epu8(hl, _mm256_set1_epi8(1));
        let hh = _mm256_min_epu8(hh, _mm256_set1_epi8(1));
        q[2 * c] = _mm256_add_epi8(_mm256_and_si256(bits, m4), _mm256_slli_epi16(hl, 4));
        q[2 * c + 1] = _mm256_add_epi8(
            _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4),
            _mm256_slli_epi16(hh, 4),
        );
        for k in 0..2 {
            let pat = crate::q4k::scale_pattern(2 * c + k);
            sc[2 * c + k] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(pat));
        }
    }
    (d, dmin, q, sc, _mm256_extracti128_si256(ms, 1))
}

/// `Σ_j min[j] · (bsums[2j] + bsums[2j + 1])`, exact in i32 (ggml's `prod` reduced).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn mins_sum(mins: std::arch::x86_64::__m128i, y: &BlockQ8K) -> i32 {
    use std::arch::x86_64::*;
    let prod = crate::q4k::mins_prod(mins, y);
    let z = _mm_setzero_si128();
    _mm_cvtsi128_si32(_mm_hadd_epi32(_mm_hadd_epi32(prod, z), z))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q4k::{quantize_row_q8k, QK_K};
    use crate::{BlockFormat, QuantMatrix};
    use candle_core::quantized::{GgmlDType, QStorage, QTensor};

    /// Random Q5_K blocks and their f32 weights from candle's dequantizer.
    fn matrix(rows: usize, cols: usize) -> (QuantMatrix, Vec<f32>) {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
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
            GgmlDType::Q5K,
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
        (QuantMatrix::new(BlockFormat::Q5K, data, rows, cols).unwrap(), dense)
    }

    #[test]
    fn q5k_matches_candle_dequantized_and_scalar() {
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
                let s = dot_q5k_scalar(w.row(r), &q);
                assert!((s - got).abs() <= 1e-4 * s.abs().max(1.0), "simd {got} scalar {s}");
                let exact: f32 = (0..cols).map(|c| dense[r * cols + c] * x[t * cols + c]).sum();
                let scale: f32 =
                    (0..cols).map(|c| (dense[r * cols + c] * x[t * cols + c]).abs()).sum();
                assert!((exact - s).abs() < 0.01 * scale, "q8k {s} exact {exact} (Σ|wx| {scale})");
            }
        }
    }

    /// AVX2 and AVX-512 tiles bit-identical to the AVX2 one-token kernel.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q5k_isas_are_bit_identical() {
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
            unsafe { q5k_tokens_avx2::<8>(w.row(r), &q, nb, &mut tile) };
            if avx512 {
                unsafe { q5k_tokens_avx512::<8>(w.row(r), &q, nb, &mut wide) };
            }
            for t in 0..8 {
                let mut one = [0f32];
                unsafe { q5k_tokens_avx2::<1>(w.row(r), &q[t * nb..(t + 1) * nb], nb, &mut one) };
                assert_eq!(one[0].to_bits(), tile[t].to_bits(), "avx2 row {r} token {t}");
                if avx512 {
                    assert_eq!(one[0].to_bits(), wide[t].to_bits(), "avx512 row {r} token {t}");
                }
            }
        }
    }
}
