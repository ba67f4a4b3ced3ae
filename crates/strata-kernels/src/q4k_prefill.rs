//! The prompt-token (prefill) path for Q4_K weights on AVX-512 VNNI: a tiled matrix multiply over
//! groups of 16 tokens instead of the decode path's per-token `vec_dot` arithmetic.
//!
//! Why: the decode tile kernels ([`crate::q4k`]) keep ggml's per-token arithmetic so that a
//! speculative verify pass equals decoding token by token, which costs two multiplies per 64
//! weight-activation pairs and token. A prompt has no such constraint. Here 4 weight rows and 16
//! tokens (8 for a group of at most 8, on 256-bit registers) share every instruction: activations
//! are transposed so that one `vpdpbusd` multiplies 4 weights of a row (broadcast) by the matching
//! 4 activations of 16 tokens, each sub-block's integer dot is scaled in f32 (a convert and an FMA,
//! which run on either vector port, where `vpdpbusd` and `vpdpwssd` share one), and the mins term
//! is one `vpdpwssd` per sub-block pair. The idea is llama.cpp's tiled CPU matmul
//! (`ggml-cpu/tiled/`, 0c1e570) and the usual VNNI GEMM; the code is ours.
//!
//! Arithmetic, per weight row and token: for each block `b` in order, with the exact integers
//! `D_j = Σ_{i∈j} q_i·a_i` (sub-block `j`) and `M_b = Σ_j min_j · Σ_{i∈j} a_i`,
//! `s = fma(D_j, d·scale_j, s)` over `j = 0..8` from `s = 0` (`d·scale_j` is exact in f32), then
//! `acc = fma(y.d, s, acc)` and `acc = fma(−(y.d·dmin), M_b, acc)`. Every step is per token, in
//! one order, so a token's result does not depend on the other tokens of the pass nor on its lane
//! or register width (tested bit for bit): prompt tokens are independent of how they are batched.
//! Decode and verify tokens never take this path ([`prefill_scope`]).

use std::cell::Cell;

use crate::q4k::BlockQ8K;
#[cfg(target_arch = "x86_64")]
use crate::{
    q4k::{BLOCK_BYTES, QK_K},
    SendPtr,
};

/// Tokens per group (one 32-bit lane of a 512-bit register each).
pub const GROUP: usize = 16;

/// Row groups between the one being computed and the one being prefetched.
#[cfg(target_arch = "x86_64")]
const PF_GROUPS_AHEAD: usize = 2;

/// Weight rows that share each activation load.
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 4;

thread_local! {
    static SCOPE: Cell<Option<(usize, usize)>> = const { Cell::new(None) };
}

/// Runs `f` (one forward pass of `rows` token rows) with rows `first..rows` marked as prompt
/// tokens: Q4_K matrix products over exactly `rows` activation rows on this thread then compute
/// those rows on the prefill path (where the CPU has AVX-512 VNNI and `$STRATA_CPU_PREFILL_GEMM`
/// is not `0`). Rows before `first` (decode tokens of a batch) keep the decode kernels. Products
/// over another number of rows (the logits of selected rows, a draft model's pass) are unaffected.
pub fn prefill_scope<R>(rows: usize, first: usize, f: impl FnOnce() -> R) -> R {
    crate::with_thread_flag(&SCOPE, Some((rows, first)), f)
}

/// The first prompt-token row of a product over `m` rows made inside a [`prefill_scope`] of `m`
/// rows, where the prefill path runs on this CPU.
pub(crate) fn first_prefill_row(m: usize) -> Option<usize> {
    let (rows, first) = SCOPE.with(|s| s.get())?;
    (rows == m && first < m && available()).then_some(first)
}

/// Whether the prefill path runs here: x86-64 with AVX-512 VNNI in use, unless
/// `$STRATA_CPU_PREFILL_GEMM` is `0` (for measuring one path against the other).
pub fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let cpu = crate::isa() == crate::Isa::Avx512
            && std::is_x86_feature_detected!("avx512vnni")
            && std::is_x86_feature_detected!("avx512vl");
        #[cfg(not(target_arch = "x86_64"))]
        let cpu = false;
        cpu && std::env::var("STRATA_CPU_PREFILL_GEMM").as_deref() != Ok("0")
    })
}

/// Q8_K activations of prompt tokens rearranged for the 16-lane kernel, per group of [`GROUP`]
/// tokens and block: the 256 int8 values as 64 vectors of 16 lanes (lane `t`: values `4k..4k+4`
/// of token `t`), the eight 32-value sums as 4 vectors of i16 pairs, and the 16 scales. Lanes
/// past the last token are zero.
#[derive(Debug, Clone)]
// Read only by the x86-64 kernels; elsewhere `first_prefill_row` is always `None`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct Q8KPanel {
    tokens: usize,
    nb: usize,
    q: Vec<i32>,
    s: Vec<i32>,
    d: Vec<f32>,
}

impl Q8KPanel {
    /// The panel of `a: [tokens, nb]` Q8_K blocks.
    ///
    /// # Panics
    /// When `a` holds fewer than `tokens · nb` blocks.
    pub fn new(a: &[BlockQ8K], tokens: usize, nb: usize) -> Self {
        assert!(a.len() >= tokens * nb);
        let groups = tokens.div_ceil(GROUP);
        let mut q = vec![0i32; groups * nb * 64 * GROUP];
        let mut s = vec![0i32; groups * nb * 4 * GROUP];
        let mut d = vec![0f32; groups * nb * GROUP];
        for t in 0..tokens {
            let (g, lane) = (t / GROUP, t % GROUP);
            for b in 0..nb {
                let y = &a[t * nb + b];
                let gb = g * nb + b;
                for (k, v) in y.qs.chunks_exact(4).enumerate() {
                    q[(gb * 64 + k) * GROUP + lane] =
                        i32::from_le_bytes([v[0] as u8, v[1] as u8, v[2] as u8, v[3] as u8]);
                }
                for p in 0..4 {
                    let (lo, hi) =
                        (y.sums32[2 * p] as u16 as u32, y.sums32[2 * p + 1] as u16 as u32);
                    s[(gb * 4 + p) * GROUP + lane] = (lo | hi << 16) as i32;
                }
                d[gb * GROUP + lane] = y.d;
            }
        }
        Self { tokens, nb, q, s, d }
    }
}

/// Rows `rows` of a Q4_K matrix (`data`: row-major blocks, `nb` per row) times the prompt tokens
/// of `panel`: writes `out[(first + t) · stride + r]` for every
/// token `t` of the panel and row `r` in `rows`.
///
/// # Safety
/// [`available`] must be true; `out` must be valid for those writes and no other thread may
/// write those elements meanwhile.
///
/// # Panics
/// When `data` is shorter than `rows.end` rows or the panel has another block count.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn rows_into(
    data: &[u8],
    nb: usize,
    panel: &Q8KPanel,
    rows: std::ops::Range<usize>,
    (out, first, stride): (SendPtr, usize, usize),
) {
    assert_eq!(panel.nb, nb);
    assert!(data.len() >= rows.end * nb * BLOCK_BYTES);
    let row_bytes = nb * BLOCK_BYTES;
    let n = panel.tokens;
    let groups = n.div_ceil(GROUP);
    // The rows being computed, unpacked (a per-thread buffer, reused across calls).
    let mut u = UNPACKED.take().unwrap_or_default();
    u.resize(nb);
    let mut r = rows.start;
    while r < rows.end {
        let take = if rows.end - r >= ROWS { ROWS } else { 1 };
        if r == rows.start && PF_GROUPS_AHEAD > 0 {
            let n = (rows.end - r - take).min(PF_GROUPS_AHEAD * ROWS);
            crate::prefetch(data.as_ptr().wrapping_add((r + take) * row_bytes), n * row_bytes);
        }
        u.fill(&data[r * row_bytes..(r + take) * row_bytes], take);
        // The next rows' weights are fetched a few lines per block during the first group's
        // product (spread out: a burst of a whole row group's lines stalls on the line-fill
        // buffers, and fetched all at once they arrive before the unpacking needs them only if
        // the product is long).
        let pf_row = (r + take + PF_GROUPS_AHEAD * ROWS).min(rows.end);
        let next = (rows.end - pf_row).min(ROWS);
        let pf = Prefetch {
            at: data.as_ptr().wrapping_add(pf_row * row_bytes),
            step: (next * row_bytes).div_ceil(nb).next_multiple_of(64),
        };
        for g in 0..groups {
            let t0 = g * GROUP;
            let valid = (n - t0).min(GROUP);
            let mut v = [[0f32; GROUP]; ROWS];
            let pf = if g == 0 { pf } else { Prefetch::NONE };
            match (take == ROWS, valid > GROUP / 2) {
                (true, true) => gemm_group::<ROWS>(&u, panel, g, pf, &mut v),
                (false, true) => gemm_group::<1>(&u, panel, g, pf, &mut v),
                (true, false) => gemm_half::<ROWS>(&u, panel, g, pf, &mut v),
                (false, false) => gemm_half::<1>(&u, panel, g, pf, &mut v),
            }
            for t in 0..valid {
                // SAFETY: the caller owns these elements (see the function's contract).
                let dst = unsafe { out.0.add((first + t0 + t) * stride + r) };
                for (i, vr) in v.iter().enumerate().take(take) {
                    // SAFETY: as above.
                    unsafe { *dst.add(i) = vr[t] };
                }
            }
        }
        r += take;
    }
    UNPACKED.set(Some(u));
}

/// Weights to fetch during a product: `step` bytes from `at + b · step` in block `b`'s iteration.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Prefetch {
    at: *const u8,
    step: usize,
}

#[cfg(target_arch = "x86_64")]
impl Prefetch {
    const NONE: Prefetch = Prefetch { at: std::ptr::null(), step: 0 };

    #[inline(always)]
    fn block(self, b: usize) {
        crate::prefetch(self.at.wrapping_add(b * self.step), self.step);
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    static UNPACKED: Cell<Option<Unpacked>> = const { Cell::new(None) };
}

/// Up to [`ROWS`] weight rows unpacked for the 16-lane kernel: nibbles as bytes in weight order,
/// `d` times each sub-block's scale and `dmin` as f32, mins as i16 pairs.
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
struct Unpacked {
    nb: usize,
    q: Vec<u8>,
    dsc: Vec<f32>,
    mn: Vec<i32>,
    dmin: Vec<f32>,
}

#[cfg(target_arch = "x86_64")]
impl Unpacked {
    /// Room for rows of `nb` blocks (contents are overwritten by [`Self::fill`]).
    fn resize(&mut self, nb: usize) {
        self.nb = nb;
        self.q.resize(ROWS * nb * QK_K, 0);
        self.dsc.resize(ROWS * nb * 8, 0.0);
        self.mn.resize(ROWS * nb * 4, 0);
        self.dmin.resize(ROWS * nb, 0.0);
    }

    /// Unpacks `rows` consecutive rows of `data`.
    fn fill(&mut self, data: &[u8], rows: usize) {
        let n = rows * self.nb;
        assert!(data.len() >= n * BLOCK_BYTES && n <= self.dmin.len());
        // SAFETY: the prefill path runs only where AVX2, FMA and F16C are (see `available`);
        // every block index below is < n, within each buffer (sized for ROWS rows of nb blocks).
        unsafe { self.fill_blocks(data, n) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fill_blocks(&mut self, data: &[u8], n: usize) {
        use std::arch::x86_64::*;
        for rb in 0..n {
            let blk = data.get_unchecked(rb * BLOCK_BYTES..(rb + 1) * BLOCK_BYTES);
            // Scales in i16 lanes 0–7, mins in lanes 8–15 (ggml's unpacking).
            let (d, dmin, ms) = crate::q4k::q4k_header(blk);
            *self.dmin.get_unchecked_mut(rb) = dmin;
            // d · scale is exact in f32 (an 11-bit significand times a 6-bit integer).
            let sc = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(ms)));
            let dsc = _mm256_mul_ps(sc, _mm256_set1_ps(d));
            _mm256_storeu_ps(self.dsc.as_mut_ptr().add(rb * 8), dsc);
            // Mins as i16 pairs: lanes 8–15 are already in that layout.
            let mn = _mm256_extracti128_si256(ms, 1);
            _mm_storeu_si128(self.mn.as_mut_ptr().add(rb * 4) as *mut __m128i, mn);
            nibbles(blk, self.q.get_unchecked_mut(rb * QK_K..(rb + 1) * QK_K));
        }
    }
}

/// A Q4_K block's 256 nibbles as bytes in weight order: chunk `c`'s low nibbles are weights
/// `64c..64c+32`, its high nibbles `64c+32..64c+64`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn nibbles(blk: &[u8], q: &mut [u8]) {
    use std::arch::x86_64::*;
    assert!(blk.len() >= BLOCK_BYTES && q.len() >= QK_K);
    let low = _mm256_set1_epi8(0x0F);
    for c in 0..4 {
        let bits = _mm256_loadu_si256(blk.as_ptr().add(16 + 32 * c) as *const __m256i);
        let dst = q.as_mut_ptr().add(64 * c) as *mut __m256i;
        _mm256_storeu_si256(dst, _mm256_and_si256(bits, low));
        _mm256_storeu_si256(dst.add(1), _mm256_and_si256(_mm256_srli_epi16(bits, 4), low));
    }
}

/// The lane-per-token kernel on one register width: the first `width` lanes of group `g` of
/// `panel` times the first `R` rows of `w`, into `out[r][..width]`.
///
/// Per block and row: each sub-block's integer dot in two accumulators (its first and last 16
/// weights: twice the independent `vpdpbusd` chains), added, converted and scaled by one FMA with
/// `d·scale`; the mins term by `vpdpwssd` over the panel's 32-value sums; then the two f32 steps
/// of the module's arithmetic.
#[cfg(target_arch = "x86_64")]
macro_rules! lane_kernel {
    ($name:ident, $features:literal, $setzero:ident, $setzero_ps:ident, $load:ident,
     $set1:ident, $dpbusd:ident, $dpwssd:ident, $add:ident, $load_ps:ident, $set1_ps:ident, $mul_ps:ident,
     $fmadd:ident, $fnmadd:ident, $cvt:ident, $store_ps:ident) => {
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize>(
            w: &Unpacked,
            panel: &Q8KPanel,
            g: usize,
            pf: Prefetch,
            out: &mut [[f32; GROUP]; ROWS],
        ) {
            use std::arch::x86_64::*;
            let nb = w.nb;
            let mut acc = [$setzero_ps(); R];
            for b in 0..nb {
                pf.block(b);
                let gb = g * nb + b;
                let qa = panel.q.as_ptr().add(gb * 64 * GROUP);
                let mut blk = [$setzero_ps(); R];
                for j in 0..8 {
                    let mut lo = [$setzero(); R];
                    let mut hi = [$setzero(); R];
                    for k in 0..4 {
                        let a0 = $load(qa.add((8 * j + k) * GROUP) as *const _);
                        let a1 = $load(qa.add((8 * j + k + 4) * GROUP) as *const _);
                        for r in 0..R {
                            let wq = w.q.as_ptr().add((r * nb + b) * QK_K + 32 * j + 4 * k);
                            let wq = wq as *const i32;
                            // u8 weights (0..15) × i8 activations, four per lane, no saturation.
                            lo[r] = $dpbusd(lo[r], $set1(wq.read_unaligned()), a0);
                            hi[r] = $dpbusd(hi[r], $set1(wq.add(4).read_unaligned()), a1);
                        }
                    }
                    for (r, bl) in blk.iter_mut().enumerate() {
                        let dsc = $set1_ps(*w.dsc.get_unchecked((r * nb + b) * 8 + j));
                        *bl = $fmadd($cvt($add(lo[r], hi[r])), dsc, *bl);
                    }
                }
                let mut msum = [$setzero(); R];
                for p in 0..4 {
                    let sv = $load(panel.s.as_ptr().add((gb * 4 + p) * GROUP) as *const _);
                    for (r, ms) in msum.iter_mut().enumerate() {
                        let mv = $set1(*w.mn.get_unchecked((r * nb + b) * 4 + p));
                        *ms = $dpwssd(*ms, sv, mv);
                    }
                }
                let yd = $load_ps(panel.d.as_ptr().add(gb * GROUP));
                for r in 0..R {
                    let dmin = $mul_ps(yd, $set1_ps(*w.dmin.get_unchecked(r * nb + b)));
                    acc[r] = $fmadd(yd, blk[r], acc[r]);
                    acc[r] = $fnmadd(dmin, $cvt(msum[r]), acc[r]);
                }
            }
            for r in 0..R {
                $store_ps(out[r].as_mut_ptr(), acc[r]);
            }
        }
    };
}

// All 16 lanes of a group.
#[cfg(target_arch = "x86_64")]
lane_kernel!(
    gemm_group,
    "avx512f,avx512bw,avx512vnni,avx512vl,fma",
    _mm512_setzero_si512,
    _mm512_setzero_ps,
    _mm512_loadu_si512,
    _mm512_set1_epi32,
    _mm512_dpbusd_epi32,
    _mm512_dpwssd_epi32,
    _mm512_add_epi32,
    _mm512_loadu_ps,
    _mm512_set1_ps,
    _mm512_mul_ps,
    _mm512_fmadd_ps,
    _mm512_fnmadd_ps,
    _mm512_cvtepi32_ps,
    _mm512_storeu_ps
);

// 8 lanes on 256-bit registers (a group of at most 8 tokens wastes no second half; 256-bit VNNI
// runs on two ports where 512-bit runs on one). Lane for lane the same operations as gemm_group,
// so the same results.
#[cfg(target_arch = "x86_64")]
lane_kernel!(
    gemm_half,
    "avx512f,avx512bw,avx512vnni,avx512vl,avx2,fma",
    _mm256_setzero_si256,
    _mm256_setzero_ps,
    _mm256_loadu_si256,
    _mm256_set1_epi32,
    _mm256_dpbusd_epi32,
    _mm256_dpwssd_epi32,
    _mm256_add_epi32,
    _mm256_loadu_ps,
    _mm256_set1_ps,
    _mm256_mul_ps,
    _mm256_fmadd_ps,
    _mm256_fnmadd_ps,
    _mm256_cvtepi32_ps,
    _mm256_storeu_ps
);

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::q4k::{dot_q4k_scalar, quantize_row_q8k};
    use crate::{BlockFormat, QuantMatrix};

    /// A random Q4_K matrix with finite scales.
    fn matrix(rows: usize, cols: usize) -> QuantMatrix {
        let bytes = rows * cols / QK_K * BLOCK_BYTES;
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let v: Vec<u8> = (0..bytes)
            .map(|i| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let b = (seed >> 24) as u8;
                if i % BLOCK_BYTES < 4 && i % 2 == 1 {
                    b & 0x1B
                } else {
                    b
                }
            })
            .collect();
        QuantMatrix::new(BlockFormat::Q4K, v, rows, cols).unwrap()
    }

    fn acts(tokens: usize, cols: usize, salt: f32) -> Vec<BlockQ8K> {
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i as f32 * 0.377 + salt).cos() * 9631.3).fract() - 0.5)
            .collect();
        let mut q = Vec::new();
        quantize_row_q8k(&x, &mut q);
        q
    }

    fn run(w: &QuantMatrix, a: &[BlockQ8K], tokens: usize) -> Vec<f32> {
        let nb = w.cols() / QK_K;
        let panel = Q8KPanel::new(a, tokens, nb);
        let mut out = vec![f32::NAN; tokens * w.rows()];
        let ptr = SendPtr(out.as_mut_ptr());
        unsafe { rows_into(w.data(), nb, &panel, 0..w.rows(), (ptr, 0, w.rows())) };
        out
    }

    /// Every token's result is ggml's dot product up to f32 rounding order, and bit for bit the
    /// same whatever the other tokens of the pass, its lane, the kernel's register width (16 or
    /// 8 lanes) and the row block (4 rows or 1).
    #[test]
    fn prefill_matches_scalar_and_does_not_depend_on_the_batch() {
        if !available() {
            eprintln!("no AVX-512 VNNI on this CPU: the prefill path does not run here");
            return;
        }
        let (rows, cols) = (7, 1024);
        let nb = cols / QK_K;
        let w = matrix(rows, cols);
        let a = acts(37, cols, 0.3);
        let all = run(&w, &a, 37);
        for t in 0..37 {
            for r in 0..rows {
                let s = dot_q4k_scalar(w.row(r), &a[t * nb..(t + 1) * nb]);
                let got = all[t * rows + r];
                assert!(
                    (s - got).abs() <= 1e-4 * s.abs().max(1.0),
                    "token {t} row {r}: {got} vs {s}"
                );
            }
        }
        // Token 20 alone and in a group of 5 (8-lane kernel, lanes 0 and 2), in a group of 9
        // (16-lane kernel, lane 4), and at lane 0 of a full group.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let want = bits(&all[20 * rows..21 * rows]);
        let one = run(&w, &a[20 * nb..21 * nb], 1);
        assert_eq!(bits(&one), want, "alone");
        let five = run(&w, &a[18 * nb..23 * nb], 5);
        assert_eq!(bits(&five[2 * rows..3 * rows]), want, "group of 5");
        let nine = run(&w, &a[16 * nb..25 * nb], 9);
        assert_eq!(bits(&nine[4 * rows..5 * rows]), want, "group of 9");
        let full = run(&w, &a[20 * nb..36 * nb], 16);
        assert_eq!(bits(&full[..rows]), want, "full group");
    }

    /// Through `matmul`: inside a scope of 37 rows whose first 5 are decode tokens, those 5 equal
    /// the decode path bit for bit (no scope), and each prompt token equals its prefill result
    /// in a pass of its own; outside a matching scope nothing changes.
    #[test]
    fn prefill_scope_marks_only_the_prompt_rows_of_its_pass() {
        if !available() {
            eprintln!("no AVX-512 VNNI on this CPU: the prefill path does not run here");
            return;
        }
        let (rows, cols, m, first) = (12, 512, 37, 5);
        let w = matrix(rows, cols);
        let x: Vec<f32> = (0..m * cols).map(|i| ((i as f32 * 0.123).sin() * 3.7).fract()).collect();
        let matmul = |x: &[f32], m: usize| {
            let mut out = vec![0f32; m * rows];
            w.matmul(x, m, &mut out);
            out
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let decode = matmul(&x, m);
        let mixed = prefill_scope(m, first, || matmul(&x, m));
        assert_eq!(bits(&mixed[..first * rows]), bits(&decode[..first * rows]), "decode rows");
        let mut differs = false;
        for t in first..m {
            let row = &x[t * cols..(t + 1) * cols];
            let alone = prefill_scope(1, 0, || matmul(row, 1));
            assert_eq!(bits(&mixed[t * rows..(t + 1) * rows]), bits(&alone), "prompt token {t}");
            differs |= bits(&alone) != bits(&decode[t * rows..(t + 1) * rows]);
        }
        assert!(differs, "the prompt rows ran on the decode path");
        // A scope of another row count leaves the product on the decode path.
        let other = prefill_scope(m + 1, 0, || matmul(&x, m));
        assert_eq!(bits(&other), bits(&decode));
    }
}
