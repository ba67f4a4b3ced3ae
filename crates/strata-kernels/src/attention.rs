//! Attention for decode and short passes (one new token, or a speculative verify pass of a few)
//! straight over the KV cache storage, instead of a dozen small tensor ops. Same math as the
//! batched path: `softmax(q·Kᵀ·scale)·V` per head with grouped-query sharing (query head `h`
//! reads kv head `h / (n_heads / n_kv_heads)`).

mod group;

use group::{attend_group, Group};

/// Shapes of one layer's KV cache storage: `[n_kv_heads, capacity, head_dim]`, row-major.
#[derive(Debug, Clone, Copy)]
pub struct KvLayout {
    pub n_kv_heads: usize,
    pub capacity: usize,
    pub head_dim: usize,
}

/// One layer's key and value storage, `[n_kv_heads, capacity, head_dim]` each ([`KvLayout`]):
/// f32, or f16 (IEEE half, `--kv-cache-dtype f16`: half the bytes; the kernels widen each element
/// to f32 as they load it, exactly, so an f16 cache computes as an f32 cache holding the same
/// rounded values).
#[derive(Debug, Clone, Copy)]
pub enum KvStorage<'a> {
    F32 { k: &'a [f32], v: &'a [f32] },
    F16 { k: &'a [half::f16], v: &'a [half::f16] },
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
    let cache = KvStorage::F32 { k, v };
    attend_sequences(&[SeqAttend { q, cache, kv, seq, first_len }], n_heads, scale, out);
}

/// One sequence's short pass in [`attend_sequences`]: query rows `q: [seq, n_heads, head_dim]`
/// over its own cache storage (layout `kv`); row `i` attends positions `0..first_len + i`.
#[derive(Debug, Clone, Copy)]
pub struct SeqAttend<'a> {
    pub q: &'a [f32],
    pub cache: KvStorage<'a>,
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
            cache: s.cache,
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
            SeqAttend {
                q: &q[..rows],
                cache: KvStorage::F32 { k: &k0, v: &v0 },
                kv,
                seq: 1,
                first_len: 40,
            },
            SeqAttend {
                q: &q[rows..],
                cache: KvStorage::F32 { k: &k1, v: &v1 },
                kv,
                seq: 3,
                first_len: 5,
            },
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
