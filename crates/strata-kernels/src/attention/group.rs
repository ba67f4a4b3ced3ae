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

use super::{KvLayout, KvStorage};
use crate::f32::pairwise;
use crate::Isa;

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

/// The group's output `oh: [heads, head_dim]`; `scores`: a reused buffer (no allocation per
/// unit once it has grown).
pub(super) fn attend_group(a: &Group<'_>, oh: &mut [f32], scores: &mut Vec<f32>) {
    attend_group_with(a, oh, scores, crate::isa())
}

fn attend_group_with(a: &Group<'_>, oh: &mut [f32], scores: &mut Vec<f32>, isa: Isa) {
    match a.cache {
        KvStorage::F32 { k, v } => attend_rows(a, k, v, oh, scores, isa),
        KvStorage::F16 { k, v } => attend_rows(a, k, v, oh, scores, isa),
    }
}

/// [`attend_group_with`] over storage of element type `E`.
fn attend_rows<E: KvElem>(
    a: &Group<'_>,
    k: &[E],
    v: &[E],
    oh: &mut [f32],
    scores: &mut Vec<f32>,
    isa: Isa,
) {
    let hd = a.kv.head_dim;
    let (heads, len) = (a.q.len() / hd, a.len);
    assert_eq!(oh.len(), heads * hd);
    assert!(len >= 1 && len <= a.kv.capacity, "attention over {len} positions");
    scores.resize(heads * len, 0.0);
    let base = a.g * a.kv.capacity * hd;
    let (k, v) = (&k[base..base + len * hd], &v[base..base + len * hd]);
    // SAFETY (the x86 arms): `crate::isa()` names these only on CPUs with the features they
    // enable (AVX2 with FMA and F16C; AVX-512 F besides).
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::scores_avx2(a.q, k, hd, a.scale, scores) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::scores_avx512(a.q, k, hd, a.scale, scores) },
        _ => scores_generic(a.q, k, hd, a.scale, scores),
    }
    match isa {
        // (Not the hot part: the AVX2 kernel serves AVX-512 CPUs too.)
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { x86::softmax_avx2(scores, len) },
        _ => softmax_generic(scores, len),
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::values_avx2(scores, v, hd, len, oh) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::values_avx512(scores, v, hd, len, oh) },
        _ => values_generic(scores, v, hd, len, oh),
    }
}

/// An element type of [`KvStorage`], widened to f32 as the kernels load it (exactly: an f16 is
/// an f32).
trait KvElem: Copy {
    fn to_f32(self) -> f32;
    /// Eight elements from `p` as f32 (AVX2 with F16C).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen elements from `p` as f32 (AVX-512 F).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
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

impl KvElem for half::f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
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
            scores[h * len + j] = tail(qh, kj, pairwise(acc)) * scale;
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
        let inv = inv_sum(lanes, &row[full..]);
        for x in row.iter_mut() {
            *x *= inv;
        }
    }
}

/// `1 / Σ` in f32 of 16 f64 lanes reduced by the pairwise tree, then the tail added in order.
#[inline(always)]
fn inv_sum(lanes: [f64; LANES], tail: &[f32]) -> f32 {
    let sum = tail.iter().fold(pairwise(lanes), |s, &x| s + x as f64);
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
mod x86;

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
        let kinds: Vec<Isa> = [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&i| i <= crate::isa())
            .collect();
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
            attend_group_with(&g32, &mut want, &mut scores, Isa::Scalar);
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
