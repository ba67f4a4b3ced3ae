//! Block-quantized weight matrices times f32 activations quantized to 8 bits per ggml's pairing:
//! - Q4_1 (block: f16 d, f16 m, 16 bytes of nibbles; `w = d·q + m`) × Q8_1,
//! - Q8_0 (block: f16 d, 32 int8; `w = d·q`) × Q8_0,
//! - Q4_K (256-weight super-blocks, see [`crate::q4k`]) × Q8_K.

use half::f16;

use crate::bytes::WeightBytes;
use crate::q8_1::{quantize_row, BlockQ8_1, QK};
use crate::SendPtr;

/// The weight block formats these kernels implement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFormat {
    Q4_1,
    Q8_0,
    Q4K,
}

impl BlockFormat {
    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q8_0 => 34,
            BlockFormat::Q4K => crate::q4k::BLOCK_BYTES,
        }
    }

    /// Weights per block.
    pub const fn block_elems(self) -> usize {
        match self {
            BlockFormat::Q4K => crate::q4k::QK_K,
            _ => QK,
        }
    }
}

/// A `[rows, cols]` block-quantized matrix in ggml's byte layout (row-major blocks).
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    format: BlockFormat,
    data: WeightBytes,
    rows: usize,
    cols: usize,
}

impl QuantMatrix {
    /// `data` must hold `rows · cols / block_elems` blocks; `cols` must be a multiple of the
    /// format's block size (32, or 256 for Q4_K).
    pub fn new(format: BlockFormat, data: impl Into<WeightBytes>, rows: usize, cols: usize) -> Result<Self, String> {
        let data = data.into();
        let need = rows * cols / format.block_elems() * format.block_bytes();
        if cols % format.block_elems() != 0 || data.len() != need {
            return Err(format!("{format:?} matrix [{rows}, {cols}] needs {need} bytes, got {}", data.len()));
        }
        Ok(Self { format, data, rows, cols })
    }

    /// Stacks matrices with the same format and column count row-wise (e.g. q, k and v into one
    /// matrix so that one pass quantizes the activations and one dispatch computes all three).
    pub fn concat_rows(parts: &[&QuantMatrix]) -> Option<QuantMatrix> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.format != first.format || p.cols != first.cols) {
            return None;
        }
        let data: Vec<u8> = parts.iter().flat_map(|p| p.data.as_slice().iter().copied()).collect();
        Some(QuantMatrix { format: first.format, data: data.into(), rows: parts.iter().map(|p| p.rows).sum(), cols: first.cols })
    }

    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// Bytes of the quantized blocks.
    pub fn size_in_bytes(&self) -> usize {
        self.data.len()
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    #[cfg(test)]
    pub(crate) fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data.as_slice()[r * rb..(r + 1) * rb]
    }

    fn row_bytes(&self) -> usize {
        self.cols / self.format.block_elems() * self.format.block_bytes()
    }

    /// `out[t, r] = Σ_c x[t, c] · W[r, c]` for `m` activation rows; `x: [m, cols]`, `out: [m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        assert_eq!(x.len(), m * self.cols);
        assert_eq!(out.len(), m * self.rows);
        if self.format == BlockFormat::Q4K {
            let mut qx = Vec::with_capacity(m * self.cols / crate::q4k::QK_K);
            let mut tmp = Vec::new();
            for t in 0..m {
                crate::q4k::quantize_row_q8k(&x[t * self.cols..(t + 1) * self.cols], &mut tmp);
                qx.extend_from_slice(&tmp);
            }
            return self.run(&qx, m, out, select_dot_q4k(), None);
        }
        let nb = self.cols / QK;
        let mut qx = Vec::with_capacity(m * nb);
        let mut tmp = Vec::with_capacity(nb);
        for t in 0..m {
            quantize_row(&x[t * self.cols..(t + 1) * self.cols], &mut tmp);
            qx.extend_from_slice(&tmp);
        }
        self.run(&qx, m, out, select_dot(self.format), select_dot4(self.format));
    }

    /// Every (row, token) dot product over quantized activations `qx: [m, blocks per row]`. With
    /// `dot4`, tokens go four at a time through it (each weight block unpacked once for four
    /// tokens); its per-token arithmetic is the same as `dot`'s, operation for operation, so a
    /// token's result does not depend on how many tokens share the pass (a verify pass of several
    /// tokens gives bit-identical outputs to decoding them one by one).
    fn run<A: Sync>(&self, qx: &[A], m: usize, out: &mut [f32], dot: fn(&[u8], &[A]) -> f32, dot4: Option<Dot4Fn<A>>) {
        let nb = qx.len() / m.max(1);
        let rows = self.rows;
        let ptr = SendPtr(out.as_mut_ptr());
        let (data, rb) = (self.data.as_slice(), self.row_bytes());
        // candle's persistent barrier pool: the calling thread works too, and its workers are the
        // ones candle's own ops use, so no second pool competes for the cores.
        candle_core::utils::barrier_pool().execute_chunked(rows, |range| {
            let p = ptr;
            for r in range {
                let w = &data[r * rb..(r + 1) * rb];
                let mut t = 0;
                if let Some(dot4) = dot4 {
                    while t + 4 <= m {
                        let v = dot4(w, &qx[t * nb..(t + 4) * nb], nb);
                        for (j, &x) in v.iter().enumerate() {
                            // SAFETY: each (t, r) is written by exactly one task, and out has m·rows elements.
                            unsafe { *p.0.add((t + j) * rows + r) = x };
                        }
                        t += 4;
                    }
                }
                for t in t..m {
                    let v = dot(w, &qx[t * nb..(t + 1) * nb]);
                    // SAFETY: as above.
                    unsafe { *p.0.add(t * rows + r) = v };
                }
            }
        });
    }
}

/// Dot products of one weight row with four activation rows `a: [4, nb]`.
type Dot4Fn<A> = fn(&[u8], &[A], usize) -> [f32; 4];

fn select_dot4(format: BlockFormat) -> Option<Dot4Fn<BlockQ8_1>> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c") {
            return match format {
                BlockFormat::Q4_1 => Some(|w, a, nb| unsafe { dot4_q4_1_avx2(w, a, nb) }),
                BlockFormat::Q8_0 => Some(|w, a, nb| unsafe { dot4_q8_0_avx2(w, a, nb) }),
                BlockFormat::Q4K => None,
            };
        }
    }
    let _ = format;
    None
}

fn select_dot_q4k() -> fn(&[u8], &[crate::q4k::BlockQ8K]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c") {
            return |w, a| unsafe { crate::q4k::dot_q4k_avx2(w, a) };
        }
    }
    crate::q4k::dot_q4k_scalar
}

type DotFn = fn(&[u8], &[BlockQ8_1]) -> f32;

fn select_dot(format: BlockFormat) -> DotFn {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c") {
            return match format {
                BlockFormat::Q4_1 => |w, a| unsafe { dot_q4_1_avx2(w, a) },
                BlockFormat::Q8_0 => |w, a| unsafe { dot_q8_0_avx2(w, a) },
                BlockFormat::Q4K => unreachable!("Q4_K pairs with Q8_K activations (select_dot_q4k)"),
            };
        }
    }
    match format {
        BlockFormat::Q4_1 => dot_q4_1_scalar,
        BlockFormat::Q8_0 => dot_q8_0_scalar,
        BlockFormat::Q4K => unreachable!("Q4_K pairs with Q8_K activations (select_dot_q4k)"),
    }
}

/// ggml `ggml_vec_dot_q8_0_q8_0`, generic version.
pub fn dot_q8_0_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0f32;
    for (blk, y) in w.chunks_exact(BlockFormat::Q8_0.block_bytes()).zip(a) {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let sumi: i32 = blk[2..34].iter().zip(&y.qs).map(|(&q, &v)| q as i8 as i32 * v as i32).sum();
        sumf += sumi as f32 * (d * y.d);
    }
    sumf
}

/// ggml `ggml_vec_dot_q4_1_q8_1`, generic version.
pub fn dot_q4_1_scalar(w: &[u8], a: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0f32;
    for (blk, y) in w.chunks_exact(BlockFormat::Q4_1.block_bytes()).zip(a) {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let m = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
        let qs = &blk[4..20];
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            sumi += (qs[j] & 0x0F) as i32 * y.qs[j] as i32 + (qs[j] >> 4) as i32 * y.qs[j + QK / 2] as i32;
        }
        sumf += sumi as f32 * d * y.d + m * y.s;
    }
    sumf
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum(acc: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let hi = _mm256_extractf128_ps(acc, 1);
    let s = _mm_add_ps(hi, _mm256_castps256_ps128(acc));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// One f16 (little-endian bits) to f32 with the F16C instruction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn h2f(bits: u16) -> f32 {
    use std::arch::x86_64::*;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// ggml's AVX2 `ggml_vec_dot_q8_0_q8_0` (`mul_sum_i8_pairs_float`: |x| · sign(y, x)).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0_avx2(w: &[u8], a: &[BlockQ8_1]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    let ones = _mm256_set1_epi16(1);
    for (blk, y) in w.chunks_exact(BlockFormat::Q8_0.block_bytes()).zip(a) {
        let d = h2f(u16::from_le_bytes([blk[0], blk[1]]));
        let qx = _mm256_loadu_si256(blk.as_ptr().add(2) as *const __m256i);
        let qy = _mm256_load_si256(y.qs.as_ptr() as *const __m256i);
        let ax = _mm256_sign_epi8(qx, qx);
        let sy = _mm256_sign_epi8(qy, qx);
        let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(dot), acc);
    }
    hsum(acc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_1_avx2(w: &[u8], a: &[BlockQ8_1]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0f32;
    let low = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    for (blk, y) in w.chunks_exact(BlockFormat::Q4_1.block_bytes()).zip(a) {
        let p = blk.as_ptr();
        let d = h2f(u16::from_le_bytes([blk[0], blk[1]]));
        let m = h2f(u16::from_le_bytes([blk[2], blk[3]]));
        summs += m * y.s;
        let tmp = _mm_loadu_si128(p.add(4) as *const __m128i);
        let qx = _mm256_and_si256(_mm256_insertf128_si256(_mm256_castsi128_si256(tmp), _mm_srli_epi16(tmp, 4), 1), low);
        let qy = _mm256_load_si256(y.qs.as_ptr() as *const __m256i);
        let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(qx, qy), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(dot), acc);
    }
    hsum(acc) + summs
}

/// [`dot_q8_0_avx2`] for four activation rows at once: the weight block is loaded and its signs
/// taken once; every token's accumulation is the single-row kernel's, in the same order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_q8_0_avx2(w: &[u8], a: &[BlockQ8_1], nb: usize) -> [f32; 4] {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 4];
    let ones = _mm256_set1_epi16(1);
    for (b, blk) in w.chunks_exact(BlockFormat::Q8_0.block_bytes()).enumerate() {
        let d = h2f(u16::from_le_bytes([blk[0], blk[1]]));
        let qx = _mm256_loadu_si256(blk.as_ptr().add(2) as *const __m256i);
        let ax = _mm256_sign_epi8(qx, qx);
        for (j, acc) in acc.iter_mut().enumerate() {
            let y = &a[j * nb + b];
            let qy = _mm256_load_si256(y.qs.as_ptr() as *const __m256i);
            let sy = _mm256_sign_epi8(qy, qx);
            let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(dot), *acc);
        }
    }
    [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
}

/// [`dot_q4_1_avx2`] for four activation rows at once (the nibbles unpacked once).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_q4_1_avx2(w: &[u8], a: &[BlockQ8_1], nb: usize) -> [f32; 4] {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut summs = [0f32; 4];
    let low = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    for (b, blk) in w.chunks_exact(BlockFormat::Q4_1.block_bytes()).enumerate() {
        let p = blk.as_ptr();
        let d = h2f(u16::from_le_bytes([blk[0], blk[1]]));
        let m = h2f(u16::from_le_bytes([blk[2], blk[3]]));
        let tmp = _mm_loadu_si128(p.add(4) as *const __m128i);
        let qx = _mm256_and_si256(_mm256_insertf128_si256(_mm256_castsi128_si256(tmp), _mm_srli_epi16(tmp, 4), 1), low);
        for j in 0..4 {
            let y = &a[j * nb + b];
            summs[j] += m * y.s;
            let qy = _mm256_load_si256(y.qs.as_ptr() as *const __m256i);
            let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(qx, qy), ones);
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(dot), acc[j]);
        }
    }
    [hsum(acc[0]) + summs[0], hsum(acc[1]) + summs[1], hsum(acc[2]) + summs[2], hsum(acc[3]) + summs[3]]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo(i: usize) -> f32 {
        ((i as f32 * 0.7131).sin() * 43758.547).fract() - 0.5
    }

    fn make_q4_1(rows: usize, cols: usize) -> (QuantMatrix, Vec<f32>) {
        let mut data = Vec::new();
        let mut dense = Vec::new();
        for b in 0..rows * cols / QK {
            let d = f16::from_f32(0.01 + 0.001 * (b % 7) as f32);
            let m = f16::from_f32(-0.08 + 0.002 * (b % 5) as f32);
            data.extend_from_slice(&d.to_le_bytes());
            data.extend_from_slice(&m.to_le_bytes());
            let qs: Vec<u8> = (0..16).map(|j| ((b * 31 + j * 7) % 256) as u8).collect();
            data.extend_from_slice(&qs);
            let mut vals = [0f32; QK];
            for j in 0..16 {
                vals[j] = d.to_f32() * (qs[j] & 0xF) as f32 + m.to_f32();
                vals[j + 16] = d.to_f32() * (qs[j] >> 4) as f32 + m.to_f32();
            }
            dense.extend_from_slice(&vals);
        }
        (QuantMatrix::new(BlockFormat::Q4_1, data, rows, cols).unwrap(), dense)
    }

    fn make_q8_0(rows: usize, cols: usize) -> (QuantMatrix, Vec<f32>) {
        let mut data = Vec::new();
        let mut dense = Vec::new();
        for b in 0..rows * cols / QK {
            let d = f16::from_f32(0.002 + 0.0003 * (b % 7) as f32);
            data.extend_from_slice(&d.to_le_bytes());
            for j in 0..QK {
                let q = ((b * 37 + j * 11) % 255) as i32 - 127;
                data.push(q as i8 as u8);
                dense.push(d.to_f32() * q as f32);
            }
        }
        (QuantMatrix::new(BlockFormat::Q8_0, data, rows, cols).unwrap(), dense)
    }

    #[test]
    fn q8_0_simd_equals_scalar_and_approximates_f32() {
        check(make_q8_0(29, 320), dot_q8_0_scalar);
    }

    #[test]
    fn q4_1_simd_equals_scalar_and_approximates_f32() {
        check(make_q4_1(37, 256), dot_q4_1_scalar);
    }

    fn check((w, dense): (QuantMatrix, Vec<f32>), dot_scalar: DotFn) {
        // 6 tokens: one four-token tile and two single rows.
        let (rows, cols, m) = (w.rows(), w.cols(), 6);
        let x: Vec<f32> = (0..m * cols).map(pseudo).collect();
        let mut out = vec![0f32; m * rows];
        w.matmul(&x, m, &mut out);
        // Bit-identical to one token at a time (speculative verification relies on it).
        for t in 0..m {
            let mut one = vec![0f32; rows];
            w.matmul(&x[t * cols..(t + 1) * cols], 1, &mut one);
            assert!(one.iter().zip(&out[t * rows..(t + 1) * rows]).all(|(a, b)| a.to_bits() == b.to_bits()), "token {t}: batched differs from single");
        }
        let mut q = Vec::new();
        for t in 0..m {
            quantize_row(&x[t * cols..(t + 1) * cols], &mut q);
            for r in 0..rows {
                let s = dot_scalar(w.row(r), &q);
                assert!((s - out[t * rows + r]).abs() <= 1e-4 * s.abs().max(1.0), "simd {} scalar {s}", out[t * rows + r]);
                let exact: f32 = (0..cols).map(|c| dense[r * cols + c] * x[t * cols + c]).sum();
                let scale: f32 = (0..cols).map(|c| (dense[r * cols + c] * x[t * cols + c]).abs()).sum();
                // 8-bit activations: error well under 1% of Σ|w·x|.
                assert!((exact - s).abs() < 0.01 * scale, "q8 {s} exact {exact} (Σ|wx| {scale})");
            }
        }
    }
}
