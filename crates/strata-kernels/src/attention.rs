//! Attention for decode and short passes (one new token, or a speculative verify pass of a few)
//! straight over the KV cache storage, instead of a dozen small tensor ops. Same math as the
//! batched path: `softmax(q·Kᵀ·scale)·V` per head with grouped-query sharing (query head `h`
//! reads kv head `h / (n_heads / n_kv_heads)`).

/// Shapes of one layer's KV cache storage: `[n_kv_heads, capacity, head_dim]` f32, row-major.
#[derive(Debug, Clone, Copy)]
pub struct KvLayout {
    pub n_kv_heads: usize,
    pub capacity: usize,
    pub head_dim: usize,
}

/// Attention of `seq` consecutive query rows `q: [seq, n_heads, head_dim]` (decode: `seq = 1`)
/// over the cache storage `k`/`v`: row `i` attends positions `0..first_len + i` (causal). Output
/// `out: [seq, n_heads, head_dim]`. A batch of one sequence ([`attend_sequences`]).
#[allow(clippy::too_many_arguments)]
pub fn attend_tokens(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv: KvLayout,
    n_heads: usize,
    seq: usize,
    first_len: usize,
    scale: f32,
    out: &mut [f32],
) {
    attend_sequences(&[SeqAttend { q, k, v, kv, seq, first_len }], n_heads, scale, out);
}

/// One sequence's short pass in [`attend_sequences`]: query rows `q: [seq, n_heads, head_dim]`
/// over its own cache storage `k`/`v` (layout `kv`); row `i` attends positions
/// `0..first_len + i`.
#[derive(Debug, Clone, Copy)]
pub struct SeqAttend<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub kv: KvLayout,
    pub seq: usize,
    pub first_len: usize,
}

/// Attention of several sequences' short passes (a continuous batch's decode rows) in one
/// parallel region: `out: [Σ seq, n_heads, head_dim]`, the sequences' rows in order. Units
/// (sequence, row, kv head, chunk of its query heads) run on candle's barrier pool, each reading
/// its K/V rows once for its query heads; each head's arithmetic is the same whatever the batch,
/// `seq`, the grouping and the thread count, so a row's result equals attending that token alone
/// (one barrier per layer for the whole batch, instead of one per sequence).
pub fn attend_sequences(seqs: &[SeqAttend<'_>], n_heads: usize, scale: f32, out: &mut [f32]) {
    let Some(first) = seqs.first() else { return };
    let (hd, n_kv) = (first.kv.head_dim, first.kv.n_kv_heads);
    let rows: usize = seqs.iter().map(|s| s.seq).sum();
    assert_eq!(out.len(), rows * n_heads * hd);
    for s in seqs {
        assert_eq!((s.kv.head_dim, s.kv.n_kv_heads), (hd, n_kv));
        assert_eq!(s.q.len(), s.seq * n_heads * hd);
    }
    let n_rep = n_heads / n_kv;
    // Units: (row, kv head, chunk of its query heads). Each unit reads its K/V rows once for all
    // the chunk's heads; whole groups unless that leaves fewer units than twice the threads.
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    let mut split = 1;
    while rows * n_kv * split < 2 * threads && split < n_rep {
        split += 1;
        while !n_rep.is_multiple_of(split) {
            split += 1;
        }
    }
    let chunk = n_rep / split;
    let per_row = n_heads / chunk;
    // Row r of the batch: its sequence and its row within it.
    let mut row_seq = Vec::with_capacity(rows);
    for (i, s) in seqs.iter().enumerate() {
        row_seq.extend((0..s.seq).map(|r| (i, r)));
    }
    let ptr = crate::SendPtr(out.as_mut_ptr());
    let unit = |u: usize, scores: &mut Vec<f32>| {
        let p = ptr; // the whole SendPtr, not its field
        let row = u / per_row;
        let (si, r) = row_seq[row];
        let s = &seqs[si];
        let h0 = (u % per_row) * chunk;
        let o = row * n_heads * hd + h0 * hd;
        let qo = r * n_heads * hd + h0 * hd;
        // SAFETY: unit u writes out[o..o + chunk · hd] only (heads h0..h0 + chunk of its row), and
        // out has rows · n_heads · hd elements.
        let oh = unsafe { std::slice::from_raw_parts_mut(p.0.add(o), chunk * hd) };
        let args = Group {
            q: &s.q[qo..qo + chunk * hd],
            k: s.k,
            v: s.v,
            kv: s.kv,
            g: kv_head(s.kv, n_heads, h0),
            len: s.first_len + r,
            scale,
        };
        attend_group(&args, oh, scores);
    };
    let units = rows * per_row;
    // Short contexts: less work than a barrier's wake-up costs.
    let positions: usize = seqs.iter().map(|s| s.seq * s.first_len).sum();
    if units == 1 || positions < PARALLEL_MIN_LEN {
        SCORES.with(|s| (0..units).for_each(|i| unit(i, &mut s.borrow_mut())));
        return;
    }
    candle_core::utils::barrier_pool().execute_chunked(units, |range| {
        SCORES.with(|s| range.for_each(|i| unit(i, &mut s.borrow_mut())))
    });
}

/// Contexts shorter than this attend on one thread.
const PARALLEL_MIN_LEN: usize = 16;

thread_local! {
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Grouped-query sharing: query head `h` reads kv head `h / (n_heads / n_kv_heads)`.
fn kv_head(kv: KvLayout, n_heads: usize, h: usize) -> usize {
    h / (n_heads / kv.n_kv_heads)
}

/// Query heads sharing kv head `g`, attending positions `0..len`.
struct Group<'a> {
    /// `[heads, head_dim]`.
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    kv: KvLayout,
    g: usize,
    len: usize,
    scale: f32,
}

/// [`attend_group_generic`] compiled for AVX2 where the CPU has it (the same operations in the
/// same order, on wider registers: results are bit-identical).
fn attend_group(a: &Group<'_>, oh: &mut [f32], scores: &mut Vec<f32>) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::isa() >= crate::Isa::Avx2 {
            // SAFETY: the CPU has AVX2 (checked by isa()).
            return unsafe { attend_group_avx2(a, oh, scores) };
        }
    }
    attend_group_generic::<false>(a, oh, scores)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_group_avx2(a: &Group<'_>, oh: &mut [f32], scores: &mut Vec<f32>) {
    attend_group_generic::<true>(a, oh, scores)
}

/// Each head: `softmax(q·Kᵀ·scale)·V` over positions `0..len` of kv head `g`, every K and V row
/// read once for all heads of the group. A head's arithmetic is the same as attending it alone.
/// `AVX2`: called from an AVX2 function (the four-position dot products in AVX2 registers; the
/// same operations in the same order as [`dot`]).
#[inline(always)]
fn attend_group_generic<const AVX2: bool>(a: &Group<'_>, oh: &mut [f32], scores: &mut Vec<f32>) {
    let hd = a.kv.head_dim;
    let (heads, len) = (a.q.len() / hd, a.len);
    // Scores, then each head's 1 / Σ exp in the same reused buffer (no allocation per unit).
    scores.resize(heads * len + heads, 0.0);
    let (scores, inv) = scores.split_at_mut(heads * len);
    let base = a.g * a.kv.capacity * hd;
    let krow = |j: usize| &a.k[base + j * hd..base + (j + 1) * hd];
    // Four positions at a time: four independent dot products in flight (each one's arithmetic
    // that of `dot`).
    let mut j = 0;
    while j + 4 <= len {
        let ks = [krow(j), krow(j + 1), krow(j + 2), krow(j + 3)];
        for h in 0..heads {
            let d = dot4::<AVX2>(&a.q[h * hd..(h + 1) * hd], ks);
            for (i, d) in d.into_iter().enumerate() {
                scores[h * len + j + i] = d * a.scale;
            }
        }
        j += 4;
    }
    for j in j..len {
        for h in 0..heads {
            scores[h * len + j] = dot(&a.q[h * hd..(h + 1) * hd], krow(j)) * a.scale;
        }
    }
    for (h, s) in scores.chunks_exact_mut(len).enumerate() {
        let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0f64;
        for x in s.iter_mut() {
            *x = (*x - max).exp();
            sum += *x as f64;
        }
        inv[h] = (1.0 / sum) as f32;
    }
    // out[h][d] = Σ_j w[h][j] · v[j][d], summed in position order: a block of V_BLOCK columns
    // of one head stays in registers over all positions.
    for h in 0..heads {
        let w = &scores[h * len..(h + 1) * len];
        let mut d0 = 0;
        while d0 < hd {
            let n = V_BLOCK.min(hd - d0);
            let o = &mut oh[h * hd + d0..h * hd + d0 + n];
            if n == V_BLOCK {
                let mut acc = [0f32; V_BLOCK];
                for (jj, &s) in w.iter().enumerate() {
                    let wj = s * inv[h];
                    let vr = &a.v[base + jj * hd + d0..base + jj * hd + d0 + V_BLOCK];
                    for i in 0..V_BLOCK {
                        acc[i] += wj * vr[i];
                    }
                }
                o.copy_from_slice(&acc);
            } else {
                o.fill(0.0);
                for (jj, &s) in w.iter().enumerate() {
                    let wj = s * inv[h];
                    let vr = &a.v[base + jj * hd + d0..base + jj * hd + d0 + n];
                    for (o, &x) in o.iter_mut().zip(vr) {
                        *o += wj * x;
                    }
                }
            }
            d0 += n;
        }
    }
}

/// Columns of one head's output kept in registers over all positions.
const V_BLOCK: usize = 64;

/// Four dot products of `a` with `bs`, each with the arithmetic of [`dot`] (same lanes, same
/// order): independent chains for the CPU to overlap. `AVX2`: the caller runs with AVX2.
#[inline(always)]
fn dot4<const AVX2: bool>(a: &[f32], bs: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: AVX2 callers only (`attend_group_avx2`).
        return unsafe { dot4_avx2(a, bs) };
    }
    bs.map(|b| dot(a, b))
}

/// [`dot4`] on AVX2 registers: lane `i` of each accumulator sums `x[8c + i] · y[8c + i]` over
/// chunks `c` in order (a multiply, then an add: no FMA, as in [`dot`]), then the eight lanes in
/// order, then the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot4_avx2(a: &[f32], bs: [&[f32]; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let full = a.len() / 8 * 8;
    for b in &bs {
        assert!(b.len() >= a.len());
    }
    let mut acc = [_mm256_setzero_ps(); 4];
    for c in (0..full).step_by(8) {
        let x = _mm256_loadu_ps(a.as_ptr().add(c));
        for (acc, b) in acc.iter_mut().zip(&bs) {
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, _mm256_loadu_ps(b.as_ptr().add(c))));
        }
    }
    let mut out = [0f32; 4];
    for ((o, acc), b) in out.iter_mut().zip(acc).zip(&bs) {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut s: f32 = lanes.iter().sum();
        for (x, y) in a[full..].iter().zip(&b[full..]) {
            s += x * y;
        }
        *o = s;
    }
    out
}

/// Dot product with 8 independent accumulators (lets the compiler use SIMD lanes).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of a multi-row pass equal one-row calls bit for bit (parallel or not).
    #[test]
    fn rows_equal_one_row_at_a_time() {
        let kv = KvLayout { n_kv_heads: 3, capacity: 200, head_dim: 16 };
        let (nh, seq) = (9, 5);
        let f = |i: usize| ((i as f32) * 0.731).sin();
        let k: Vec<f32> = (0..3 * 200 * 16).map(|i| f(i + 7)).collect();
        let v: Vec<f32> = (0..3 * 200 * 16).map(|i| f(i + 9000)).collect();
        let q: Vec<f32> = (0..seq * nh * 16).map(|i| f(i + 333)).collect();
        for first in [3, 150] {
            let mut rows = vec![0f32; seq * nh * 16];
            attend_tokens(&q, &k, &v, kv, nh, seq, first, 0.25, &mut rows);
            for i in 0..seq {
                let mut one = vec![0f32; nh * 16];
                attend_tokens(
                    &q[i * nh * 16..(i + 1) * nh * 16],
                    &k,
                    &v,
                    kv,
                    nh,
                    1,
                    first + i,
                    0.25,
                    &mut one,
                );
                assert!(
                    one.iter()
                        .zip(&rows[i * nh * 16..(i + 1) * nh * 16])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "row {i}, first {first}"
                );
            }
        }
    }

    /// A batch of sequences with caches of their own equals each sequence alone, bit for bit.
    #[test]
    fn sequences_in_one_call_equal_each_alone() {
        let kv = KvLayout { n_kv_heads: 3, capacity: 64, head_dim: 16 };
        let nh = 9;
        let f = |i: usize| ((i as f32) * 0.419).sin();
        let cache = |o: usize| -> Vec<f32> { (0..3 * 64 * 16).map(|i| f(i + o)).collect() };
        let (k0, v0, k1, v1) = (cache(1), cache(50_000), cache(7_000), cache(90_000));
        let q: Vec<f32> = (0..4 * nh * 16).map(|i| f(i + 12_345)).collect();
        let rows = nh * 16;
        // Sequence 0: one decode row at 40 positions; sequence 1: three rows from 5 positions.
        let batch = [
            SeqAttend { q: &q[..rows], k: &k0, v: &v0, kv, seq: 1, first_len: 40 },
            SeqAttend { q: &q[rows..], k: &k1, v: &v1, kv, seq: 3, first_len: 5 },
        ];
        let mut all = vec![0f32; 4 * rows];
        attend_sequences(&batch, nh, 0.3, &mut all);
        let mut a = vec![0f32; rows];
        attend_tokens(&q[..rows], &k0, &v0, kv, nh, 1, 40, 0.3, &mut a);
        let mut b = vec![0f32; 3 * rows];
        attend_tokens(&q[rows..], &k1, &v1, kv, nh, 3, 5, 0.3, &mut b);
        let alone: Vec<f32> = a.into_iter().chain(b).collect();
        assert!(all.iter().zip(&alone).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert!(all.iter().any(|x| *x != 0.0));
    }

    /// The AVX2 build of a group's attention (four-position dot products in registers) equals
    /// the generic one bit for bit, head dimensions with and without a tail of under 8.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_group_equals_generic() {
        assert!(crate::isa() >= crate::Isa::Avx2, "this test needs an AVX2 CPU");
        let f = |i: usize| ((i as f32) * 0.173).cos();
        for (hd, len) in [(64, 37), (12, 9), (80, 130), (64, 3)] {
            let kv = KvLayout { n_kv_heads: 2, capacity: 160, head_dim: hd };
            let k: Vec<f32> = (0..2 * 160 * hd).map(|i| f(i + 3)).collect();
            let v: Vec<f32> = (0..2 * 160 * hd).map(|i| f(i + 40_000)).collect();
            let q: Vec<f32> = (0..3 * hd).map(|i| f(i + 777)).collect();
            let g = Group { q: &q, k: &k, v: &v, kv, g: 1, len, scale: 0.2 };
            let (mut a, mut b) = (vec![0f32; 3 * hd], vec![0f32; 3 * hd]);
            let mut scores = Vec::new();
            attend_group_generic::<false>(&g, &mut a, &mut scores);
            // SAFETY: the CPU has AVX2 (checked above).
            unsafe { attend_group_avx2(&g, &mut b, &mut scores) };
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "hd {hd}");
        }
    }

    #[test]
    fn matches_naive_softmax_attention() {
        let kv = KvLayout { n_kv_heads: 2, capacity: 10, head_dim: 12 };
        let (nh, len) = (6, 7);
        let f = |i: usize| ((i as f32) * 0.37).sin();
        let q: Vec<f32> = (0..nh * 12).map(f).collect();
        let k: Vec<f32> = (0..2 * 10 * 12).map(|i| f(i + 1000)).collect();
        let v: Vec<f32> = (0..2 * 10 * 12).map(|i| f(i + 5000)).collect();
        let mut out = vec![0f32; nh * 12];
        attend_tokens(&q, &k, &v, kv, nh, 1, len, 0.3, &mut out);
        for h in 0..nh {
            let g = h / 3;
            let s: Vec<f32> = (0..len)
                .map(|j| {
                    (0..12).map(|d| q[h * 12 + d] * k[(g * 10 + j) * 12 + d]).sum::<f32>() * 0.3
                })
                .collect();
            let m = s.iter().cloned().fold(f32::MIN, f32::max);
            let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for d in 0..12 {
                let want: f32 = (0..len).map(|j| e[j] / z * v[(g * 10 + j) * 12 + d]).sum();
                assert!((want - out[h * 12 + d]).abs() < 1e-5);
            }
        }
    }
}
