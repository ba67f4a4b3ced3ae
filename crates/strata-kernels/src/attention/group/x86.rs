//! The group kernels on AVX2 (with FMA and F16C) and AVX-512: the operations of the generic
//! code in `super`, in the same order, on vector registers.

use super::{exp_neg, inv_sum, tail, KvElem, EXP_MIN, EXP_P, LANES, LN2_HI, LN2_LO, LOG2E};
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
pub(super) unsafe fn scores_avx2<E: KvElem>(
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
pub(super) unsafe fn values_avx2<E: KvElem>(
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
unsafe fn block_avx2<E: KvElem, const N: usize>(
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
    let pow =
        _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
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
        let inv = _mm256_set1_ps(inv_sum(lanes, &row[full..]));
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
pub(super) unsafe fn scores_avx512<E: KvElem>(
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
                acc =
                    _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(c)), E::load16(kp.add(j * hd + c)), acc);
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
pub(super) unsafe fn values_avx512<E: KvElem>(
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
unsafe fn block_512<E: KvElem, const H: usize, const N: usize>(
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
