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
/// `out: [seq, n_heads, head_dim]`. (row, kv head, query heads) units run in parallel on candle's
/// barrier pool, each reading its K/V rows once for its query heads; each head's arithmetic is the
/// same whatever `seq`, the grouping and the thread count, so a row's result equals attending that
/// token alone.
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
    let n_rep = n_heads / kv.n_kv_heads;
    // Units: (row, kv head, chunk of its query heads). Each unit reads its K/V rows once for all
    // the chunk's heads; whole groups unless that leaves fewer units than twice the threads.
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    let mut split = 1;
    while seq * kv.n_kv_heads * split < 2 * threads && split < n_rep {
        split += 1;
        while !n_rep.is_multiple_of(split) {
            split += 1;
        }
    }
    let chunk = n_rep / split;
    let ptr = crate::SendPtr(out.as_mut_ptr());
    let unit = |i: usize, scores: &mut Vec<f32>| {
        let p = ptr; // the whole SendPtr, not its field
        let row = i / (n_heads / chunk);
        let h0 = (i % (n_heads / chunk)) * chunk;
        let o = row * n_heads * hd + h0 * hd;
        // SAFETY: unit i writes out[o..o + chunk · hd] only (heads h0..h0 + chunk of its row), and
        // out has seq · n_heads · hd elements.
        let oh = unsafe { std::slice::from_raw_parts_mut(p.0.add(o), chunk * hd) };
        let args = Group {
            q: &q[o..o + chunk * hd],
            k,
            v,
            kv,
            g: kv_head(kv, n_heads, h0),
            len: first_len + row,
            scale,
        };
        attend_group(&args, oh, scores);
    };
    let units = seq * n_heads / chunk;
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
    attend_group_generic(a, oh, scores)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_group_avx2(a: &Group<'_>, oh: &mut [f32], scores: &mut Vec<f32>) {
    attend_group_generic(a, oh, scores)
}

/// Each head: `softmax(q·Kᵀ·scale)·V` over positions `0..len` of kv head `g`, every K and V row
/// read once for all heads of the group. A head's arithmetic is the same as attending it alone.
#[inline(always)]
fn attend_group_generic(a: &Group<'_>, oh: &mut [f32], scores: &mut Vec<f32>) {
    let hd = a.kv.head_dim;
    let (heads, len) = (a.q.len() / hd, a.len);
    // Scores, then each head's 1 / Σ exp in the same reused buffer (no allocation per unit).
    scores.resize(heads * len + heads, 0.0);
    let (scores, inv) = scores.split_at_mut(heads * len);
    let base = a.g * a.kv.capacity * hd;
    for j in 0..len {
        let kr = &a.k[base + j * hd..base + (j + 1) * hd];
        for h in 0..heads {
            scores[h * len + j] = dot(&a.q[h * hd..(h + 1) * hd], kr) * a.scale;
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
    oh.fill(0.0);
    for j in 0..len {
        let vr = &a.v[base + j * hd..base + (j + 1) * hd];
        for h in 0..heads {
            let w = scores[h * len + j] * inv[h];
            for (o, &x) in oh[h * hd..(h + 1) * hd].iter_mut().zip(vr) {
                *o += w * x;
            }
        }
    }
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
