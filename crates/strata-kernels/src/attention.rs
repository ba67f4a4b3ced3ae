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
/// `out: [seq, n_heads, head_dim]`. The (row, head) pairs run in parallel on candle's barrier pool;
/// each pair's arithmetic is the same whatever `seq` and the thread count, so a row's result equals
/// attending that token alone.
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
    let hd = kv.head_dim;
    assert_eq!(q.len(), seq * n_heads * hd);
    assert_eq!(out.len(), seq * n_heads * hd);
    let ptr = crate::SendPtr(out.as_mut_ptr());
    let unit = |i: usize, scores: &mut Vec<f32>| {
        let p = ptr; // the whole SendPtr, not its field
        let (row, h) = (i / n_heads, i % n_heads);
        let o = row * n_heads * hd + h * hd;
        // SAFETY: unit i writes out[o..o + hd] only, and out has seq · n_heads · hd elements.
        let oh = unsafe { std::slice::from_raw_parts_mut(p.0.add(o), hd) };
        attend_head(
            &q[o..o + hd],
            k,
            v,
            kv,
            kv_head(kv, n_heads, h),
            first_len + row,
            scale,
            oh,
            scores,
        );
    };
    let units = seq * n_heads;
    // Short contexts: less work than a barrier's wake-up costs.
    if units == 1 || first_len < PARALLEL_MIN_LEN {
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

/// One head: `softmax(q·Kᵀ·scale)·V` over positions `0..len` of kv head `g`.
#[allow(clippy::too_many_arguments)]
fn attend_head(
    qh: &[f32],
    k: &[f32],
    v: &[f32],
    kv: KvLayout,
    g: usize,
    len: usize,
    scale: f32,
    oh: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let hd = kv.head_dim;
    scores.resize(len, 0.0);
    let base = g * kv.capacity * hd;
    let mut max = f32::NEG_INFINITY;
    for (j, s) in scores.iter_mut().enumerate() {
        let kr = &k[base + j * hd..base + (j + 1) * hd];
        *s = dot(qh, kr) * scale;
        max = max.max(*s);
    }
    let mut sum = 0f64;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s as f64;
    }
    let inv = (1.0 / sum) as f32;
    oh.fill(0.0);
    for (j, &p) in scores.iter().enumerate() {
        let vr = &v[base + j * hd..base + (j + 1) * hd];
        let w = p * inv;
        for (o, &x) in oh.iter_mut().zip(vr) {
            *o += w * x;
        }
    }
}

/// Dot product with 8 independent accumulators (lets the compiler use SIMD lanes).
#[inline]
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
