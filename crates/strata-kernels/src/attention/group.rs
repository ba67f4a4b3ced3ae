//! One unit of decode attention: the query heads that share a kv head, over positions `0..len`
//! of its cache rows (`softmax(q·Kᵀ·scale)·V`, Vaswani et al. 2017, grouped-query sharing as in
//! Ainslie et al. 2023), on the widest kernels the CPU has.
//!
//! Every kernel does the same arithmetic, so the results are bit-identical whichever runs:
//! - score `s[h][j]`: 16 lanes, lane `i` the fused multiply-add chain of `q[16c + i] · k[16c + i]`
//!   over chunks `c` in order; the lanes reduced pairwise (lane `i` + lane `i + 8`, then `+ 4`,
//!   `+ 2`, `+ 1`, as [`crate::f32`]'s products); a head dimension's tail after that, one fused
//!   multiply-add per element in order; then times `scale`;
//! - softmax per head: `e^(s − max)` by [`exp_neg`] (Cephes' `expf` polynomial), the values summed
//!   in f64 in 16 lanes (element `j` into lane `j mod 16` over the full chunks, the lanes by the
//!   same pairwise tree, then the tail in order), each value times `1 / Σ` in f32;
//! - output `o[h][d]`: the fused multiply-add chain of `w[h][j] · v[j][d]` over `j` in order,
//!   from zero.
//!
//! The AVX-512 kernel computes sixteen positions' scores together and reduces their sixteen
//! accumulators with one transposing network of shuffles (the same pairwise tree per position);
//! the AVX2 kernel keeps the sixteen lanes in two registers.

use super::{KvElem, KvLayout, KvStorage};

/// Lanes of a score's partial sums.
const LANES: usize = 16;

/// Query heads sharing kv head `g`, attending positions `0..len`.
pub(super) struct Group<'a> {
    /// `[heads, head_dim]`.
    pub q: &'a [f32],
    /// The layer's cache storage, keys and values `[n_kv_heads, capacity, head_dim]` each.
    pub cache: KvStorage<'a>,
    pub kv: KvLayout,
    pub g: usize,
    pub len: usize,
    pub scale: f32,
}

/// Which kernels run a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Simd {
    Generic,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Simd {
    fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            match crate::isa() {
                crate::Isa::Avx512 => return Self::Avx512,
                crate::Isa::Avx2 => return Self::Avx2,
                crate::Isa::Scalar => {}
            }
        }
        Self::Generic
    }
}

/// The group's output `oh: [heads, head_dim]`; `scores`: a reused buffer (no allocation per
/// unit once it has grown).
pub(super) fn attend_group(a: &Group<'_>, oh: &mut [f32], scores: &mut Vec<f32>) {
    attend_group_with(a, oh, scores, Simd::best())
}

fn attend_group_with(a: &Group<'_>, oh: &mut [f32], scores: &mut Vec<f32>, simd: Simd) {
    match a.cache {
        KvStorage::F32 { k, v } => attend_rows(a, k, v, oh, scores, simd),
        KvStorage::F16 { k, v } => attend_rows(a, k, v, oh, scores, simd),
    }
}

/// [`attend_group_with`] over storage of element type `E`.
fn attend_rows<E: Wide>(
    a: &Group<'_>,
    k: &[E],
    v: &[E],
    oh: &mut [f32],
    scores: &mut Vec<f32>,
    simd: Simd,
) {
    let hd = a.kv.head_dim;
    let (heads, len) = (a.q.len() / hd, a.len);
    assert_eq!(oh.len(), heads * hd);
    assert!(len >= 1 && len <= a.kv.capacity, "attention over {len} positions");
    scores.resize(heads * len, 0.0);
    let base = a.g * a.kv.capacity * hd;
    let (k, v) = (&k[base..base + len * hd], &v[base..base + len * hd]);
    match simd {
        Simd::Generic => scores_generic(a.q, k, hd, a.scale, scores),
        // SAFETY: `best` picks these only on CPUs with the features they enable.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { x86::scores_avx2(a.q, k, hd, a.scale, scores) },
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 => unsafe { x86::scores_avx512(a.q, k, hd, a.scale, scores) },
    }
    match simd {
        Simd::Generic => softmax_generic(scores, len),
        // SAFETY: as above.
        // (Not the hot part: the AVX2 kernel serves AVX-512 CPUs too.)
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 | Simd::Avx512 => unsafe { x86::softmax_avx2(scores, len) },
    }
    match simd {
        Simd::Generic => values_generic(scores, v, hd, len, oh),
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { x86::values_avx2(scores, v, hd, len, oh) },
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 => unsafe { x86::values_avx512(scores, v, hd, len, oh) },
    }
}

/// A cache element the vector kernels widen to f32 as they load it (exactly: an f16 is an f32).
trait Wide: KvElem {
    /// Eight elements from `p` as f32 (AVX2 with F16C).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen elements from `p` as f32 (AVX-512 F).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl Wide for f32 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
}

impl Wide for half::f16 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const half::f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
}

/// The 16 partial sums reduced pairwise: lane i + lane i+8, then +4, +2, +1.
#[inline(always)]
fn tree(mut acc: [f32; LANES]) -> f32 {
    let mut n = LANES / 2;
    while n > 0 {
        for i in 0..n {
            acc[i] += acc[i + n];
        }
        n /= 2;
    }
    acc[0]
}

/// A head dimension's elements past its last full chunk of 16, after the tree.
#[inline(always)]
fn tail<E: KvElem>(q: &[f32], k: &[E], mut s: f32) -> f32 {
    for d in q.len() / LANES * LANES..q.len() {
        s = q[d].mul_add(k[d].to_f32(), s);
    }
    s
}

/// `scores[h · len + j]` for every head of `q: [heads, hd]` and row `j` of `k: [len, hd]`.
fn scores_generic<E: KvElem>(q: &[f32], k: &[E], hd: usize, scale: f32, scores: &mut [f32]) {
    let len = k.len() / hd;
    let full = hd / LANES * LANES;
    for (h, qh) in q.chunks_exact(hd).enumerate() {
        for (j, kj) in k.chunks_exact(hd).enumerate() {
            let mut acc = [0f32; LANES];
            for c in (0..full).step_by(LANES) {
                for i in 0..LANES {
                    acc[i] = qh[c + i].mul_add(kj[c + i].to_f32(), acc[i]);
                }
            }
            scores[h * len + j] = tail(qh, kj, tree(acc)) * scale;
        }
    }
}

/// `e^x` for `x ≤ 0` in fused multiply-adds (S. L. Moshier's Cephes `expf`: `x = n·ln 2 + r`,
/// a degree-7 polynomial in `r`, times `2ⁿ`), within 2 ulp of `e^x`; 0 below [`EXP_MIN`]. The
/// vector kernels do these operations in this order.
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    if x < EXP_MIN {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut y = EXP_P[0];
    for p in &EXP_P[1..] {
        y = y.mul_add(r, *p);
    }
    let y = y.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Below this `e^x` is taken as 0 (`2ⁿ` stays a normal number above it).
const EXP_MIN: f32 = -87.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 in two parts (the first exact in few bits).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' `expf` coefficients, highest degree first.
const EXP_P: [f32; 6] =
    [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// Each head's row of `len` scores → its softmax weights.
fn softmax_generic(scores: &mut [f32], len: usize) {
    let full = len / LANES * LANES;
    for row in scores.chunks_exact_mut(len) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut lanes = [0f64; LANES];
        for (j, x) in row.iter_mut().enumerate() {
            *x = exp_neg(*x - max);
            if j < full {
                lanes[j % LANES] += *x as f64;
            }
        }
        let inv = sum_lanes(lanes, &row[full..]);
        for x in row.iter_mut() {
            *x *= inv;
        }
    }
}

/// `1 / Σ` in f32 of 16 f64 lanes reduced by the pairwise tree, then the tail added in order.
#[inline(always)]
fn sum_lanes(mut lanes: [f64; LANES], tail: &[f32]) -> f32 {
    let mut n = LANES / 2;
    while n > 0 {
        for i in 0..n {
            lanes[i] += lanes[i + n];
        }
        n /= 2;
    }
    let sum = tail.iter().fold(lanes[0], |s, &x| s + x as f64);
    (1.0 / sum) as f32
}

/// `oh[h][d] = Σ_j w[h][j] · v[j][d]` (`w = scores: [heads, len]`, `v: [len, hd]`).
fn values_generic<E: KvElem>(w: &[f32], v: &[E], hd: usize, len: usize, oh: &mut [f32]) {
    for (wh, o) in w.chunks_exact(len).zip(oh.chunks_exact_mut(hd)) {
        o.fill(0.0);
        for (&wj, vj) in wh.iter().zip(v.chunks_exact(hd)) {
            for (o, &x) in o.iter_mut().zip(vj) {
                *o = wj.mul_add(x.to_f32(), *o);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{exp_neg, sum_lanes, tail, Wide, EXP_MIN, EXP_P, LANES, LN2_HI, LN2_LO, LOG2E};
    use crate::attention::KvElem;
    use std::arch::x86_64::*;

    /// The tree of [`super::tree`] over two registers holding lanes 0–7 and 8–15.
    #[inline(always)]
    unsafe fn tree_256(lo: __m256, hi: __m256) -> f32 {
        let s1 = _mm256_add_ps(lo, hi);
        let s2 = _mm_add_ps(_mm256_castps256_ps128(s1), _mm256_extractf128_ps::<1>(s1));
        let s3 = _mm_add_ps(s2, _mm_movehl_ps(s2, s2));
        _mm_cvtss_f32(_mm_add_ss(s3, _mm_shuffle_ps::<1>(s3, s3)))
    }

    /// [`super::scores_generic`] on AVX2: four positions at a time, each one's 16 lanes in two
    /// registers.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores_avx2<E: Wide>(
        q: &[f32],
        k: &[E],
        hd: usize,
        scale: f32,
        s: &mut [f32],
    ) {
        let len = k.len() / hd;
        let full = hd / LANES * LANES;
        assert!(q.len().is_multiple_of(hd) && s.len() >= q.len() / hd * len);
        let kp = k.as_ptr();
        for (h, qh) in q.chunks_exact(hd).enumerate() {
            let qp = qh.as_ptr();
            let mut j = 0;
            while j + 4 <= len {
                let mut lo = [_mm256_setzero_ps(); 4];
                let mut hi = [_mm256_setzero_ps(); 4];
                for c in (0..full).step_by(LANES) {
                    let (ql, qhh) = (_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(qp.add(c + 8)));
                    for p in 0..4 {
                        let r = kp.add((j + p) * hd + c);
                        lo[p] = _mm256_fmadd_ps(ql, E::load8(r), lo[p]);
                        hi[p] = _mm256_fmadd_ps(qhh, E::load8(r.add(8)), hi[p]);
                    }
                }
                for p in 0..4 {
                    let kj = &k[(j + p) * hd..(j + p + 1) * hd];
                    s[h * len + j + p] = tail(qh, kj, tree_256(lo[p], hi[p])) * scale;
                }
                j += 4;
            }
            for j in j..len {
                let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for c in (0..full).step_by(LANES) {
                    let r = kp.add(j * hd + c);
                    lo = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c)), E::load8(r), lo);
                    hi = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c + 8)), E::load8(r.add(8)), hi);
                }
                let kj = &k[j * hd..(j + 1) * hd];
                s[h * len + j] = tail(qh, kj, tree_256(lo, hi)) * scale;
            }
        }
    }

    /// [`super::values_generic`] on AVX2: up to 64 columns of one head in registers over all
    /// positions.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn values_avx2<E: Wide>(
        w: &[f32],
        v: &[E],
        hd: usize,
        len: usize,
        oh: &mut [f32],
    ) {
        assert!(w.len() >= oh.len() / hd * len && v.len() >= len * hd);
        let chunks = hd / 8;
        for (wh, o) in w.chunks_exact(len).zip(oh.chunks_exact_mut(hd)) {
            let mut c0 = 0;
            while c0 < chunks {
                let n = match chunks - c0 {
                    8.. => 8,
                    4..=7 => 4,
                    2 | 3 => 2,
                    _ => 1,
                };
                match n {
                    8 => block_avx2::<E, 8>(wh, v, hd, c0 * 8, o),
                    4 => block_avx2::<E, 4>(wh, v, hd, c0 * 8, o),
                    2 => block_avx2::<E, 2>(wh, v, hd, c0 * 8, o),
                    _ => block_avx2::<E, 1>(wh, v, hd, c0 * 8, o),
                }
                c0 += n;
            }
            column_tail(wh, v, hd, chunks * 8, o);
        }
    }

    /// Columns `d0..d0 + 8N` of one head.
    #[inline(always)]
    unsafe fn block_avx2<E: Wide, const N: usize>(
        w: &[f32],
        v: &[E],
        hd: usize,
        d0: usize,
        o: &mut [f32],
    ) {
        let mut acc = [_mm256_setzero_ps(); N];
        let vp = v.as_ptr().add(d0);
        for (j, &wj) in w.iter().enumerate() {
            let b = _mm256_set1_ps(wj);
            for (n, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(b, E::load8(vp.add(j * hd + 8 * n)), *acc);
            }
        }
        for (n, acc) in acc.into_iter().enumerate() {
            _mm256_storeu_ps(o.as_mut_ptr().add(d0 + 8 * n), acc);
        }
    }

    /// Columns `from..hd` of one head, one at a time (a head dimension not a multiple of the
    /// registers' width).
    #[inline(always)]
    fn column_tail<E: KvElem>(w: &[f32], v: &[E], hd: usize, from: usize, o: &mut [f32]) {
        for (d, o) in o.iter_mut().enumerate().skip(from) {
            let mut acc = 0f32;
            for (j, &wj) in w.iter().enumerate() {
                acc = wj.mul_add(v[j * hd + d].to_f32(), acc);
            }
            *o = acc;
        }
    }

    /// [`super::exp_neg`] over eight lanes.
    #[inline(always)]
    unsafe fn exp_neg_256(x: __m256) -> __m256 {
        let n = _mm256_round_ps::<0x08>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)));
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut y = _mm256_set1_ps(EXP_P[0]);
        for p in &EXP_P[1..] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*p));
        }
        let y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
        let y = _mm256_add_ps(y, _mm256_set1_ps(1.0));
        let pow = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        let e = _mm256_mul_ps(y, _mm256_castsi256_ps(pow));
        _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_MIN)), e)
    }

    /// [`super::softmax_generic`] on AVX2: a chunk's 16 lanes in two registers, the f64 lanes
    /// in four.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax_avx2(scores: &mut [f32], len: usize) {
        let full = len / LANES * LANES;
        for row in scores.chunks_exact_mut(len) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let (m, p) = (_mm256_set1_ps(max), row.as_mut_ptr());
            let mut acc = [_mm256_setzero_pd(); 4];
            for c in (0..full).step_by(LANES) {
                for half in 0..2 {
                    let e = exp_neg_256(_mm256_sub_ps(_mm256_loadu_ps(p.add(c + 8 * half)), m));
                    _mm256_storeu_ps(p.add(c + 8 * half), e);
                    let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(e));
                    let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e));
                    acc[2 * half] = _mm256_add_pd(acc[2 * half], lo);
                    acc[2 * half + 1] = _mm256_add_pd(acc[2 * half + 1], hi);
                }
            }
            for x in &mut row[full..] {
                *x = exp_neg(*x - max);
            }
            let mut lanes = [0f64; LANES];
            for (i, a) in acc.into_iter().enumerate() {
                _mm256_storeu_pd(lanes.as_mut_ptr().add(4 * i), a);
            }
            let inv = _mm256_set1_ps(sum_lanes(lanes, &row[full..]));
            scale_row(row, inv);
        }
    }

    /// Every value of `row` times `inv` (eight lanes of it).
    #[inline(always)]
    unsafe fn scale_row(row: &mut [f32], inv: __m256) {
        let p = row.as_mut_ptr();
        let n8 = row.len() / 8 * 8;
        for c in (0..n8).step_by(8) {
            _mm256_storeu_ps(p.add(c), _mm256_mul_ps(_mm256_loadu_ps(p.add(c)), inv));
        }
        let s = _mm256_cvtss_f32(inv);
        for x in &mut row[n8..] {
            *x *= s;
        }
    }

    /// The tree of [`super::tree`] over one register.
    #[inline(always)]
    unsafe fn tree_512(acc: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(acc);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
        tree_256(lo, hi)
    }

    /// Sixteen positions' accumulators `a[p]` → their sixteen scores, lane `p` = position `p`,
    /// each one's lanes reduced by [`super::tree`]'s pairs: a transposing network (level 1 adds
    /// lanes i and i+8 of two positions at once, …, level 4 lanes 0 and 1 of sixteen), then one
    /// permutation back to position order.
    #[inline(always)]
    unsafe fn transpose_tree(a: [__m512; 16]) -> __m512 {
        let mut b = [_mm512_setzero_ps(); 8];
        for j in 0..8 {
            b[j] = add_quarters::<0b0100_0100, 0b1110_1110>(a[j], a[j + 8]);
        }
        let mut c = [_mm512_setzero_ps(); 4];
        for j in 0..4 {
            c[j] = add_quarters::<0b1000_1000, 0b1101_1101>(b[j], b[j + 4]);
        }
        let mut d = [_mm512_setzero_ps(); 2];
        for j in 0..2 {
            d[j] = add_lanes::<0b0100_0100, 0b1110_1110>(c[j], c[j + 2]);
        }
        let e = add_lanes::<0b1000_1000, 0b1101_1101>(d[0], d[1]);
        // Lane L of e holds position P[L]; P is its own inverse.
        let p = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
        _mm512_permutexvar_ps(p, e)
    }

    /// One level of [`transpose_tree`] across 128-bit quarters: the sum of two selections
    /// (`_mm512_shuffle_f32x4` with `A` and `B`) of `x`'s and `y`'s quarters.
    #[inline(always)]
    unsafe fn add_quarters<const A: i32, const B: i32>(x: __m512, y: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_f32x4::<A>(x, y), _mm512_shuffle_f32x4::<B>(x, y))
    }

    /// One level of [`transpose_tree`] within 128-bit quarters (`_mm512_shuffle_ps`).
    #[inline(always)]
    unsafe fn add_lanes<const A: i32, const B: i32>(x: __m512, y: __m512) -> __m512 {
        _mm512_add_ps(_mm512_shuffle_ps::<A>(x, y), _mm512_shuffle_ps::<B>(x, y))
    }

    /// [`super::scores_generic`] on AVX-512: sixteen positions at a time through
    /// [`transpose_tree`] when the head dimension is a multiple of 16, one at a time otherwise.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn scores_avx512<E: Wide>(
        q: &[f32],
        k: &[E],
        hd: usize,
        scale: f32,
        s: &mut [f32],
    ) {
        let len = k.len() / hd;
        let full = hd / LANES * LANES;
        assert!(q.len().is_multiple_of(hd) && s.len() >= q.len() / hd * len);
        let kp = k.as_ptr();
        let sc = _mm512_set1_ps(scale);
        for (h, qh) in q.chunks_exact(hd).enumerate() {
            let qp = qh.as_ptr();
            let mut j = 0;
            if full == hd {
                while j + 16 <= len {
                    let mut acc = [_mm512_setzero_ps(); 16];
                    for c in (0..hd).step_by(LANES) {
                        let qv = _mm512_loadu_ps(qp.add(c));
                        for (p, acc) in acc.iter_mut().enumerate() {
                            *acc = _mm512_fmadd_ps(qv, E::load16(kp.add((j + p) * hd + c)), *acc);
                        }
                    }
                    let r = _mm512_mul_ps(transpose_tree(acc), sc);
                    _mm512_storeu_ps(s.as_mut_ptr().add(h * len + j), r);
                    j += 16;
                }
            }
            for j in j..len {
                let mut acc = _mm512_setzero_ps();
                for c in (0..full).step_by(LANES) {
                    acc = _mm512_fmadd_ps(
                        _mm512_loadu_ps(qp.add(c)),
                        E::load16(kp.add(j * hd + c)),
                        acc,
                    );
                }
                let kj = &k[j * hd..(j + 1) * hd];
                s[h * len + j] = tail(qh, kj, tree_512(acc)) * scale;
            }
        }
    }

    /// [`super::values_generic`] on AVX-512: two heads at a time, up to 64 columns of each in
    /// registers over all positions (each value row loaded once for both).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn values_avx512<E: Wide>(
        w: &[f32],
        v: &[E],
        hd: usize,
        len: usize,
        oh: &mut [f32],
    ) {
        let heads = oh.len() / hd;
        assert!(w.len() >= heads * len && v.len() >= len * hd);
        let chunks = hd / LANES;
        let mut h = 0;
        while h < heads {
            let pair = (heads - h).min(2);
            let mut c0 = 0;
            while c0 < chunks {
                let n = (chunks - c0).min(4);
                let d0 = c0 * LANES;
                match (pair, n) {
                    (2, 4) => block_512::<E, 2, 4>(w, v, hd, len, h, d0, oh),
                    (2, 3) => block_512::<E, 2, 3>(w, v, hd, len, h, d0, oh),
                    (2, 2) => block_512::<E, 2, 2>(w, v, hd, len, h, d0, oh),
                    (2, _) => block_512::<E, 2, 1>(w, v, hd, len, h, d0, oh),
                    (_, 4) => block_512::<E, 1, 4>(w, v, hd, len, h, d0, oh),
                    (_, 3) => block_512::<E, 1, 3>(w, v, hd, len, h, d0, oh),
                    (_, 2) => block_512::<E, 1, 2>(w, v, hd, len, h, d0, oh),
                    _ => block_512::<E, 1, 1>(w, v, hd, len, h, d0, oh),
                }
                c0 += n;
            }
            for hh in h..h + pair {
                let o = &mut oh[hh * hd..(hh + 1) * hd];
                column_tail(&w[hh * len..(hh + 1) * len], v, hd, chunks * LANES, o);
            }
            h += pair;
        }
    }

    /// Columns `d0..d0 + 16N` of heads `h0..h0 + H`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn block_512<E: Wide, const H: usize, const N: usize>(
        w: &[f32],
        v: &[E],
        hd: usize,
        len: usize,
        h0: usize,
        d0: usize,
        oh: &mut [f32],
    ) {
        let mut acc = [[_mm512_setzero_ps(); N]; H];
        let vp = v.as_ptr().add(d0);
        let wp = w.as_ptr().add(h0 * len);
        for j in 0..len {
            let mut vr = [_mm512_setzero_ps(); N];
            for (n, vr) in vr.iter_mut().enumerate() {
                *vr = E::load16(vp.add(j * hd + LANES * n));
            }
            for (hh, acc) in acc.iter_mut().enumerate() {
                let b = _mm512_set1_ps(*wp.add(hh * len + j));
                for (acc, &x) in acc.iter_mut().zip(&vr) {
                    *acc = _mm512_fmadd_ps(b, x, *acc);
                }
            }
        }
        for (hh, acc) in acc.into_iter().enumerate() {
            for (n, acc) in acc.into_iter().enumerate() {
                _mm512_storeu_ps(oh.as_mut_ptr().add((h0 + hh) * hd + d0 + LANES * n), acc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`exp_neg`] against f64's `exp` over `[EXP_MIN, 0]`: within 2 ulp (relative 2.4e-7).
    #[test]
    fn exp_neg_is_within_two_ulp() {
        let mut worst = 0f64;
        for i in 0..=1_000_000 {
            let x = EXP_MIN * i as f32 / 1e6;
            let want = (x as f64).exp();
            worst = worst.max(((exp_neg(x) as f64) - want).abs() / want);
        }
        assert!(worst < 2.4e-7, "worst relative error {worst:e}");
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(-100.0), 0.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
    }

    /// Every kernel this CPU has equals the generic one bit for bit, over f32 and f16 storage:
    /// head dimensions with and without a tail under 16, position counts around the AVX-512
    /// kernel's 16, group sizes 1–4; and an f16 cache gives the same bits as an f32 cache
    /// holding the same (f16-rounded) values.
    #[test]
    fn kernels_equal_the_generic_one() {
        let f = |i: usize| ((i as f32) * 0.173).cos();
        let mut kinds = vec![Simd::Generic];
        #[cfg(target_arch = "x86_64")]
        {
            if crate::isa() >= crate::Isa::Avx2 {
                kinds.push(Simd::Avx2);
            }
            if crate::isa() >= crate::Isa::Avx512 {
                kinds.push(Simd::Avx512);
            }
        }
        let cases = [(64, 37, 3), (12, 9, 3), (80, 130, 2), (64, 3, 1), (128, 48, 4), (64, 16, 3)];
        for (hd, len, heads) in cases {
            let kv = KvLayout { n_kv_heads: 2, capacity: 160, head_dim: hd };
            let round = |x: f32| half::f16::from_f32(x);
            let k16: Vec<half::f16> = (0..2 * 160 * hd).map(|i| round(f(i + 3))).collect();
            let v16: Vec<half::f16> = (0..2 * 160 * hd).map(|i| round(f(i + 40_000))).collect();
            let k: Vec<f32> = k16.iter().map(|x| x.to_f32()).collect();
            let v: Vec<f32> = v16.iter().map(|x| x.to_f32()).collect();
            let q: Vec<f32> = (0..heads * hd).map(|i| f(i + 777)).collect();
            let group = |cache| Group { q: &q, cache, kv, g: 1, len, scale: 0.2 };
            let (g32, g16) = (
                group(KvStorage::F32 { k: &k, v: &v }),
                group(KvStorage::F16 { k: &k16, v: &v16 }),
            );
            let mut want = vec![0f32; heads * hd];
            let mut scores = Vec::new();
            attend_group_with(&g32, &mut want, &mut scores, Simd::Generic);
            for &kind in &kinds {
                for (g, dtype) in [(&g32, "f32"), (&g16, "f16")] {
                    let mut got = vec![0f32; heads * hd];
                    attend_group_with(g, &mut got, &mut scores, kind);
                    let same = want.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{kind:?} {dtype}, hd {hd}, len {len}, heads {heads}");
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        assert!(kinds.len() > 1, "this test needs an AVX2 CPU");
    }
}
