//! Causal attention for prompt passes (more than a verify pass's rows) straight over the KV cache
//! storage, blocked as FlashAttention (Dao et al. 2022, arXiv:2205.14135, Algorithm 1, forward
//! pass on the CPU): per unit (kv head, block of query rows) the query heads that share the kv head
//! are stacked into one matrix; for each tile of keys the scores `S = (scale·Q)·Kᵀ` and the
//! update `O += P·V` are matrix products by the `gemm` crate (one thread each; units run in
//! parallel), with an online softmax (a running max and sum per row, `O` rescaled when the max
//! grows). Key tiles past a block's last causal position are never read, and nothing of size
//! `seq × seq` is allocated (candle's path allocated the scores, the masked scores and the
//! probabilities, 32 MiB each for 512 tokens of a 32-head model, then multiplied the masked half
//! too).
//!
//! Not bit-identical to [`crate::attention::attend_tokens`] (another summation order); passes
//! that must equal decoding token by token (speculative verification) use that one.

use crate::attention::{KvLayout, KvStorage};

/// Query rows (tokens) per unit times the query heads per kv head is about this many matrix rows.
const UNIT_ROWS: usize = 128;
/// Keys per tile.
const KEY_TILE: usize = 256;

/// Attention of `seq` consecutive query rows `q: [seq, n_heads, head_dim]` over the cache storage
/// `cache` (keys and values `[n_kv_heads, capacity, head_dim]`; an f16 cache's tiles are widened
/// to f32 before their products): row `i` attends positions `0..first_len + i`.
/// Output `out: [seq, n_heads, head_dim]`. Query head `h` reads kv head
/// `h / (n_heads / n_kv_heads)`.
///
/// # Panics
/// When `q` or `out` is not `seq · n_heads · head_dim` long, `n_heads` is not a multiple of
/// `n_kv_heads`, `first_len` is 0, or the cache is shorter than `first_len + seq − 1` positions.
#[allow(clippy::too_many_arguments)]
pub fn attend_prefill(
    q: &[f32],
    cache: KvStorage<'_>,
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
    assert!(n_heads.is_multiple_of(kv.n_kv_heads), "query heads not a multiple of kv heads");
    assert!(first_len >= 1 && first_len + seq - 1 <= kv.capacity, "attending past the cache");
    let block_len = kv.n_kv_heads * kv.capacity * hd;
    let (k_len, v_len) = match cache {
        KvStorage::F32 { k, v } => (k.len(), v.len()),
        KvStorage::F16 { k, v } => (k.len(), v.len()),
    };
    assert!(k_len >= block_len && v_len >= block_len, "cache storage too short");
    let n_rep = n_heads / kv.n_kv_heads;
    let block = UNIT_ROWS.div_ceil(n_rep).clamp(1, seq.max(1));
    let blocks = seq.div_ceil(block);
    let ptr = crate::SendPtr(out.as_mut_ptr());
    let args = Args { q, cache, kv, n_heads, first_len, scale };
    // Later blocks attend more keys: hand them out first so that the shared cursor balances.
    let units = blocks * kv.n_kv_heads;
    let unit = |u: usize, s: &mut Scratch| {
        let b = blocks - 1 - u / kv.n_kv_heads;
        let g = u % kv.n_kv_heads;
        let rows = b * block..((b + 1) * block).min(seq);
        let p = ptr; // the whole SendPtr, not its field
        attend_unit(&args, g, rows, p, s);
    };
    candle_core::utils::barrier_pool().execute_chunked(units, |range| {
        SCRATCH.with(|s| range.for_each(|u| unit(u, &mut s.borrow_mut())))
    });
}

struct Args<'a> {
    q: &'a [f32],
    cache: KvStorage<'a>,
    kv: KvLayout,
    n_heads: usize,
    first_len: usize,
    scale: f32,
}

/// Per-thread buffers, reused across units and calls.
#[derive(Default)]
struct Scratch {
    /// `[rows, head_dim]`: the unit's queries times `scale`, row `(token, head in group)`.
    q: Vec<f32>,
    /// `[rows, KEY_TILE]`: scores, then probabilities.
    s: Vec<f32>,
    /// `[rows, head_dim]`: the unnormalized output.
    o: Vec<f32>,
    /// Running max and sum per row.
    max: Vec<f32>,
    sum: Vec<f32>,
    /// An f16 cache's key and value tile widened to f32, `[KEY_TILE, head_dim]` each.
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Rows `j0..j0 + n` of kv head `g`'s keys and values as f32: pointers into an f32 cache, or
/// into `s`'s tiles after widening an f16 cache's rows.
fn tile(a: &Args<'_>, g: usize, j0: usize, n: usize, s: &mut Scratch) -> (*const f32, *const f32) {
    let hd = a.kv.head_dim;
    let at = (g * a.kv.capacity + j0) * hd..(g * a.kv.capacity + j0 + n) * hd;
    match a.cache {
        KvStorage::F32 { k, v } => (k[at.clone()].as_ptr(), v[at].as_ptr()),
        KvStorage::F16 { k, v } => {
            use half::slice::HalfFloatSliceExt;
            s.k.resize(at.len(), 0.0);
            s.v.resize(at.len(), 0.0);
            k[at.clone()].convert_to_f32_slice(&mut s.k);
            v[at].convert_to_f32_slice(&mut s.v);
            (s.k.as_ptr(), s.v.as_ptr())
        }
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Kv head `g`'s query heads for query rows `tokens`; writes their rows of `out`.
fn attend_unit(
    a: &Args<'_>,
    g: usize,
    tokens: std::ops::Range<usize>,
    out: crate::SendPtr,
    s: &mut Scratch,
) {
    let hd = a.kv.head_dim;
    let n_rep = a.n_heads / a.kv.n_kv_heads;
    let m = tokens.len() * n_rep;
    // The query heads of one token that share kv head g are contiguous in q and out.
    let span = |t: usize| (t * a.n_heads + g * n_rep) * hd..(t * a.n_heads + (g + 1) * n_rep) * hd;
    s.q.clear();
    for t in tokens.clone() {
        s.q.extend(a.q[span(t)].iter().map(|&x| x * a.scale));
    }
    s.o.clear();
    s.o.resize(m * hd, 0.0);
    s.max.clear();
    s.max.resize(m, f32::NEG_INFINITY);
    s.sum.clear();
    s.sum.resize(m, 0.0);
    s.s.resize(m * KEY_TILE, 0.0);
    // Row r (token tokens.start + r / n_rep) attends keys 0..first_len + token.
    let len_of = |r: usize| a.first_len + tokens.start + r / n_rep;
    let end = len_of(m - 1);
    for j0 in (0..end).step_by(KEY_TILE) {
        let n = KEY_TILE.min(end - j0);
        let (k, v) = tile(a, g, j0, n, s);
        // SAFETY: S [m, n] (row stride KEY_TILE) = Q [m, hd] · K[j0..j0+n]ᵀ, every index in bounds
        // (K rows j0..j0+n < capacity were checked by the caller).
        unsafe {
            product(
                (m, n, hd),
                (s.s.as_mut_ptr(), KEY_TILE, false),
                (s.q.as_ptr(), hd),
                (k, hd, 1),
            );
        }
        for r in 0..m {
            let valid = len_of(r).saturating_sub(j0).min(n);
            let row = &mut s.s[r * KEY_TILE..r * KEY_TILE + n];
            let tile_max = row[..valid].iter().fold(f32::NEG_INFINITY, |x, &y| x.max(y));
            let new_max = s.max[r].max(tile_max);
            if new_max > s.max[r] && s.sum[r] > 0.0 {
                let f = (s.max[r] - new_max).exp();
                s.sum[r] *= f;
                s.o[r * hd..(r + 1) * hd].iter_mut().for_each(|x| *x *= f);
            }
            s.max[r] = new_max;
            let mut sum = 0f32;
            for x in &mut row[..valid] {
                *x = (*x - new_max).exp();
                sum += *x;
            }
            row[valid..].fill(0.0);
            s.sum[r] += sum;
        }
        // SAFETY: O [m, hd] += P [m, n] (row stride KEY_TILE) · V[j0..j0+n] [n, hd], in bounds.
        unsafe {
            product((m, hd, n), (s.o.as_mut_ptr(), hd, true), (s.s.as_ptr(), KEY_TILE), (v, 1, hd));
        }
    }
    for (i, t) in tokens.enumerate() {
        let dst = span(t);
        // SAFETY: unit (g, tokens) alone writes these elements of out (kv head g's query heads of
        // its tokens), and out holds seq · n_heads · head_dim elements (checked by the caller).
        let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(dst.start), dst.len()) };
        for (h, d) in dst.chunks_exact_mut(hd).enumerate() {
            let r = i * n_rep + h;
            let inv = 1.0 / s.sum[r];
            for (d, &o) in d.iter_mut().zip(&s.o[r * hd..(r + 1) * hd]) {
                *d = o * inv;
            }
        }
    }
}

/// `dst [m, n] (+)= lhs [m, k] · rhs [k, n]` by the `gemm` crate on this thread: `dst` and `lhs`
/// row-major with the given row strides (elements), `rhs` element `(i, j)` at
/// `i · rhs_rs + j · rhs_cs`; with `accumulate` the product is added to `dst`.
///
/// # Safety
/// Every element so addressed must be valid (and `dst`'s writable, not aliased).
unsafe fn product(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs, accumulate): (*mut f32, usize, bool),
    (lhs, lhs_rs): (*const f32, usize),
    (rhs, rhs_cs, rhs_rs): (*const f32, usize, usize),
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        lhs,
        1,
        lhs_rs as isize,
        rhs,
        rhs_cs as isize,
        rhs_rs as isize,
        if accumulate { 1.0 } else { 0.0 },
        1.0,
        false,
        false,
        false,
        gemm::Parallelism::None,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive causal softmax attention in f64.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        kv: KvLayout,
        nh: usize,
        seq: usize,
        first: usize,
        scale: f32,
    ) -> Vec<f32> {
        let hd = kv.head_dim;
        let mut out = vec![0f32; seq * nh * hd];
        for i in 0..seq {
            for h in 0..nh {
                let g = h / (nh / kv.n_kv_heads);
                let len = first + i;
                let qr = &q[(i * nh + h) * hd..(i * nh + h + 1) * hd];
                let s: Vec<f64> = (0..len)
                    .map(|j| {
                        let kr = &k[(g * kv.capacity + j) * hd..(g * kv.capacity + j + 1) * hd];
                        qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let o: f64 =
                        (0..len).map(|j| e[j] / z * v[(g * kv.capacity + j) * hd + d] as f64).sum();
                    out[(i * nh + h) * hd + d] = o as f32;
                }
            }
        }
        out
    }

    /// Against the naive reference: several key tiles, a cached prefix, one and several query
    /// blocks, grouped-query sharing, and a scale that makes the softmax peaky (the running max
    /// must rescale).
    #[test]
    fn matches_naive_causal_attention() {
        let f = |i: usize| ((i as f32) * 0.731).sin();
        for (nkv, nh, hd, seq, first, scale) in
            [(2, 8, 16, 40, 1, 0.25), (3, 9, 8, 300, 250, 0.5), (1, 1, 32, 70, 1, 0.1)]
        {
            let kv = KvLayout { n_kv_heads: nkv, capacity: first + seq + 3, head_dim: hd };
            // Keys grow along the positions, so later tiles raise the running max.
            let k: Vec<f32> = (0..nkv * kv.capacity * hd)
                .map(|i| f(i + 7) * (1.0 + ((i / hd) % kv.capacity) as f32 / 64.0))
                .collect();
            let v: Vec<f32> = (0..nkv * kv.capacity * hd).map(|i| f(i + 9000)).collect();
            let q: Vec<f32> = (0..seq * nh * hd).map(|i| f(i + 333)).collect();
            let mut got = vec![0f32; seq * nh * hd];
            attend_prefill(
                &q,
                KvStorage::F32 { k: &k, v: &v },
                kv,
                nh,
                seq,
                first,
                scale,
                &mut got,
            );
            let want = reference(&q, &k, &v, kv, nh, seq, first, scale);
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 2e-5, "nkv {nkv} nh {nh} seq {seq} first {first}: {worst}");
            // An f16 cache: the same bits as an f32 cache holding its rounded values.
            let (k16, v16): (Vec<half::f16>, Vec<half::f16>) = (
                k.iter().map(|&x| half::f16::from_f32(x)).collect(),
                v.iter().map(|&x| half::f16::from_f32(x)).collect(),
            );
            let (kr, vr): (Vec<f32>, Vec<f32>) = (
                k16.iter().map(|x| x.to_f32()).collect(),
                v16.iter().map(|x| x.to_f32()).collect(),
            );
            let (mut a16, mut a32) = (vec![0f32; got.len()], vec![0f32; got.len()]);
            let f16 = KvStorage::F16 { k: &k16, v: &v16 };
            attend_prefill(&q, f16, kv, nh, seq, first, scale, &mut a16);
            attend_prefill(
                &q,
                KvStorage::F32 { k: &kr, v: &vr },
                kv,
                nh,
                seq,
                first,
                scale,
                &mut a32,
            );
            assert!(
                a16.iter().zip(&a32).all(|(x, y)| x.to_bits() == y.to_bits()),
                "f16, seq {seq}"
            );
        }
    }
}
