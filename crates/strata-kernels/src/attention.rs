//! Single-query attention for decode (one new token) straight over the KV cache storage, instead of
//! a dozen small tensor ops. Same math as the batched path: `softmax(q·Kᵀ·scale)·V` per head with
//! grouped-query sharing (query head `h` reads kv head `h / (n_heads / n_kv_heads)`).

/// Shapes of one layer's KV cache storage: `[n_kv_heads, capacity, head_dim]` f32, row-major.
#[derive(Debug, Clone, Copy)]
pub struct KvLayout {
    pub n_kv_heads: usize,
    pub capacity: usize,
    pub head_dim: usize,
}

/// `q: [n_heads, head_dim]`, `k`/`v`: cache storage, `len`: positions to attend (`0..len`),
/// `out: [n_heads, head_dim]`. `scores` is scratch (resized as needed).
#[allow(clippy::too_many_arguments)]
pub fn attend_one(q: &[f32], k: &[f32], v: &[f32], kv: KvLayout, n_heads: usize, len: usize, scale: f32, out: &mut [f32], scores: &mut Vec<f32>) {
    let hd = kv.head_dim;
    let n_rep = n_heads / kv.n_kv_heads;
    scores.resize(len, 0.0);
    for h in 0..n_heads {
        let g = h / n_rep;
        let qh = &q[h * hd..(h + 1) * hd];
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
        let oh = &mut out[h * hd..(h + 1) * hd];
        oh.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            let vr = &v[base + j * hd..base + (j + 1) * hd];
            let w = p * inv;
            for (o, &x) in oh.iter_mut().zip(vr) {
                *o += w * x;
            }
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

    #[test]
    fn matches_naive_softmax_attention() {
        let kv = KvLayout { n_kv_heads: 2, capacity: 10, head_dim: 12 };
        let (nh, len) = (6, 7);
        let f = |i: usize| ((i as f32) * 0.37).sin();
        let q: Vec<f32> = (0..nh * 12).map(f).collect();
        let k: Vec<f32> = (0..2 * 10 * 12).map(|i| f(i + 1000)).collect();
        let v: Vec<f32> = (0..2 * 10 * 12).map(|i| f(i + 5000)).collect();
        let mut out = vec![0f32; nh * 12];
        attend_one(&q, &k, &v, kv, nh, len, 0.3, &mut out, &mut Vec::new());
        for h in 0..nh {
            let g = h / 3;
            let s: Vec<f32> = (0..len).map(|j| (0..12).map(|d| q[h * 12 + d] * k[(g * 10 + j) * 12 + d]).sum::<f32>() * 0.3).collect();
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
