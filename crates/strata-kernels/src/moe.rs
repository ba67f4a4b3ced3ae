//! One MoE layer's routed SwiGLU experts on the CPU in two parallel regions: every selected
//! expert's gate+up rows in one, every expert's down rows in the other (work items: expert × row
//! block, taken from a shared cursor so that the cores stay busy whatever the experts' token
//! counts). Each token's activations are quantized once per layer, not once per expert.
//!
//! The arithmetic is the per-expert path's (`down(silu(gate·x) ⊙ up·x)` through
//! [`QuantMatrix`]'s kernels, SiLU as candle computes it, `x / (1 + e^(−x))`, weighted sum in the
//! experts' order), so results are bit-identical to running the experts one by one. Reference:
//! transformers `Qwen2MoeSparseMoeBlock`; the grouping of tokens by expert is llama.cpp's
//! `ggml_compute_forward_mul_mat_id` (its work split is not).

use crate::matrix::{QuantMatrix, QuantizedActs};
use crate::SendPtr;

/// One selected expert of a layer and the tokens routed to it.
pub struct RoutedExpert<'a> {
    /// `[2I, H]`: gate rows `0..I`, then up rows `I..2I`.
    pub gate_up: &'a QuantMatrix,
    /// `[H, I]`.
    pub down: &'a QuantMatrix,
    /// Rows of `x` routed to this expert, ascending.
    pub tokens: &'a [u32],
}

/// Weight rows per work item: small enough to balance two cores over one token's 8 experts,
/// large enough that taking an item costs little.
const ROWS_PER_ITEM: usize = 32;

/// (token, expert) pairs from which a layer's per-expert activation work (gather, SiLU,
/// quantization) runs in parallel.
const PARALLEL_PAIRS: usize = 32;

/// Every expert's unweighted output `down_e(silu(gate_e x_t) ⊙ up_e x_t)` for its tokens `t`, from
/// `x: [seq, H]`: one `[n_e, H]` buffer per expert, rows in the order of its `tokens`. The caller
/// weighs and sums them (in a fixed expert order, so that results do not depend on which experts
/// were computed together).
///
/// # Panics
/// When shapes disagree (`gate_up` not `[2I, H]`, `down` not `[H, I]`, a token row ≥ `seq`).
///
/// Inside a [`crate::prefill_scope`] of `seq` rows, the scope's prompt tokens take the Q4_K
/// prefill path ([`crate::q4k_prefill`]) in every expert they are routed to.
pub fn expert_outputs(x: &[f32], seq: usize, experts: &[RoutedExpert<'_>]) -> Vec<Vec<f32>> {
    let h = x.len() / seq.max(1);
    let first_prompt = crate::q4k_prefill::first_prefill_row(seq);
    // Each expert's first prompt-token row (its tokens are ascending).
    let split = |e: &RoutedExpert<'_>| {
        first_prompt.map(|f| e.tokens.partition_point(|&t| (t as usize) < f))
    };
    // Each token's activations quantized once per activation kind (all experts of a layer share
    // one format in practice), then gathered per expert.
    let mut full: Vec<(crate::BlockFormat, QuantizedActs)> = Vec::new();
    for e in experts {
        assert_eq!((e.gate_up.cols(), e.down.rows()), (h, h), "expert shape");
        assert_eq!(e.gate_up.rows(), 2 * e.down.cols(), "gate_up is not [2I, H]");
        let f = e.gate_up.format();
        if !full.iter().any(|(g, _)| g.uses_q8k() == f.uses_q8k()) {
            full.push((f, e.gate_up.quantize_parallel(x, seq)));
        }
    }
    // Few (token, expert) pairs (decode, short verify passes): on this thread.
    let parallel = experts.iter().map(|e| e.tokens.len()).sum::<usize>() >= PARALLEL_PAIRS;
    let acts = per_expert(experts.len(), parallel, |i| {
        let e = &experts[i];
        let f = e.gate_up.format();
        let q = &full.iter().find(|(g, _)| g.uses_q8k() == f.uses_q8k()).expect("quantized").1;
        let nb = h / f.block_elems();
        let q = if e.tokens.len() == seq {
            q.clone()
        } else {
            q.gather(e.tokens.iter().map(|&t| t as usize), nb)
        };
        q.for_prefill(e.gate_up, split(e))
    });
    // gate+up of every expert: [n_e, 2I] each.
    let gu = run_region(experts, |e| e.gate_up, &acts);
    // silu(gate) ⊙ up, quantized for down.
    let down_acts = per_expert(experts.len(), parallel, |i| {
        let (e, y) = (&experts[i], &gu[i]);
        let inter = e.down.cols();
        let mut a = Vec::with_capacity(e.tokens.len() * inter);
        for row in y.chunks_exact(2 * inter) {
            let (g, u) = row.split_at(inter);
            a.extend(g.iter().zip(u).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u));
        }
        e.down.quantize(&a, e.tokens.len()).for_prefill(e.down, split(e))
    });
    run_region(experts, |e| e.down, &down_acts)
}

/// `f(i)` for every expert `i < n` (its activations: gathering, SiLU, quantization), results in
/// the experts' order: in one parallel region when `parallel`, else on the calling thread (a few
/// tokens: less work than waking the pool costs). `f` must not start a parallel region.
fn per_expert<T: Send>(n: usize, parallel: bool, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    if !parallel {
        return (0..n).map(f).collect();
    }
    let slots: Vec<std::sync::Mutex<Option<T>>> =
        (0..n).map(|_| std::sync::Mutex::new(None)).collect();
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        for i in range {
            let v = f(i);
            *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
        }
    });
    slots
        .into_iter()
        .map(|s| s.into_inner().unwrap_or_else(|p| p.into_inner()).expect("every expert ran"))
        .collect()
}

/// One parallel region computing `mat(e) · acts[e]` for every expert: returns `[n_e, rows]` per
/// expert.
fn run_region<'a>(
    experts: &[RoutedExpert<'a>],
    mat: impl Fn(&RoutedExpert<'a>) -> &'a QuantMatrix + Sync,
    acts: &[QuantizedActs],
) -> Vec<Vec<f32>> {
    // Not zeroed: the items below write every element (each expert's rows, all of its tokens).
    let mut outs: Vec<Vec<f32>> =
        experts.iter().map(|e| Vec::with_capacity(e.tokens.len() * mat(e).rows())).collect();
    // Work items: (expert, first row), row blocks of ROWS_PER_ITEM.
    let mut items = Vec::new();
    for (i, e) in experts.iter().enumerate() {
        items.extend((0..mat(e).rows()).step_by(ROWS_PER_ITEM).map(|r| (i, r)));
    }
    let ptrs: Vec<SendPtr> = outs.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
    candle_core::utils::barrier_pool().execute_chunked(items.len(), |range| {
        for &(i, r) in &items[range] {
            let (e, m) = (&experts[i], mat(&experts[i]));
            let rows = r..(r + ROWS_PER_ITEM).min(m.rows());
            // SAFETY: item (i, r) alone writes rows `rows` of expert i's [n_e, rows] buffer.
            unsafe { m.rows_into(&acts[i], e.tokens.len(), rows, ptrs[i], m.rows()) };
        }
    });
    for (o, e) in outs.iter_mut().zip(experts) {
        // SAFETY: every element was written above (a panicking item propagates before this).
        unsafe { o.set_len(e.tokens.len() * mat(e).rows()) };
    }
    outs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BlockFormat;

    fn pseudo(i: usize, salt: f32) -> f32 {
        ((i as f32 * 0.7131 + salt).sin() * 43758.547).fract() - 0.5
    }

    /// A random Q4_1 matrix (every byte pattern is a valid Q4_1 block once d and m are finite).
    fn q4_1(rows: usize, cols: usize, salt: usize) -> QuantMatrix {
        let mut data = Vec::new();
        for b in 0..rows * cols / 32 {
            data.extend_from_slice(
                &half::f16::from_f32(0.02 + 0.001 * (b % 5) as f32).to_le_bytes(),
            );
            data.extend_from_slice(&half::f16::from_f32(-0.1).to_le_bytes());
            data.extend((0..16).map(|j| ((b * 31 + j * 7 + salt * 13) % 256) as u8));
        }
        QuantMatrix::new(BlockFormat::Q4_1, data, rows, cols).unwrap()
    }

    /// The fused layer equals running each expert on each token alone through `matmul` (bit for
    /// bit).
    #[test]
    fn equals_experts_one_by_one() {
        let (h, inter, seq) = (64, 96, 5);
        let mats: Vec<(QuantMatrix, QuantMatrix)> =
            (0..3).map(|e| (q4_1(2 * inter, h, e), q4_1(h, inter, e + 7))).collect();
        let x: Vec<f32> = (0..seq * h).map(|i| pseudo(i, 0.3)).collect();
        let routes: [Vec<u32>; 3] = [vec![0, 1, 2, 3, 4], vec![1, 3], vec![0, 2, 4]];
        let experts: Vec<RoutedExpert> = mats
            .iter()
            .zip(&routes)
            .map(|((gu, d), t)| RoutedExpert { gate_up: gu, down: d, tokens: t })
            .collect();
        let fused = expert_outputs(&x, seq, &experts);
        for (e, got) in experts.iter().zip(&fused) {
            assert_eq!(got.len(), e.tokens.len() * h);
            for (&t, got) in e.tokens.iter().zip(got.chunks_exact(h)) {
                let xs = &x[t as usize * h..(t as usize + 1) * h];
                let mut gu = vec![0f32; 2 * inter];
                e.gate_up.matmul(xs, 1, &mut gu);
                let a: Vec<f32> =
                    (0..inter).map(|i| gu[i] / (1.0 + (-gu[i]).exp()) * gu[inter + i]).collect();
                let mut want = vec![0f32; h];
                e.down.matmul(&a, 1, &mut want);
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
                assert!(got.iter().any(|&v| v != 0.0));
            }
        }
    }
}
