//! Decode attention of one token (`attend_tokens`: every query head over `len` cached
//! positions) on the barrier pool, f32 and f16 caches, best of five runs:
//!
//!     cargo run --release -p strata-kernels --example attention_bench
//!
//! Shapes: SmolLM2-135M (9 query heads, 3 kv heads, head dim 64) at 40 and 150 positions, a
//! Qwen3-style layer (32 / 4, head dim 128) at 500 and 4,000. Prints µs per call.

use strata_kernels::attention::{attend_sequences, KvLayout, KvStorage, SeqAttend};

fn main() {
    let shapes = [(9, 3, 64, 40), (9, 3, 64, 150), (32, 4, 128, 500), (32, 4, 128, 4000)];
    for (nh, nkv, hd, len) in shapes {
        let kv = KvLayout { n_kv_heads: nkv, capacity: 4096, head_dim: hd };
        let f = |i: usize| ((i as f32) * 0.37).sin();
        let k: Vec<f32> = (0..nkv * 4096 * hd).map(f).collect();
        let v: Vec<f32> = (0..nkv * 4096 * hd).map(|i| f(i + 7)).collect();
        let (k16, v16): (Vec<half::f16>, Vec<half::f16>) = (
            k.iter().map(|&x| half::f16::from_f32(x)).collect(),
            v.iter().map(|&x| half::f16::from_f32(x)).collect(),
        );
        let q: Vec<f32> = (0..nh * hd).map(|i| f(i + 99)).collect();
        let mut out = vec![0f32; nh * hd];
        for (name, cache) in
            [("f32", KvStorage::F32 { k: &k, v: &v }), ("f16", KvStorage::F16 { k: &k16, v: &v16 })]
        {
            let seq = [SeqAttend { q: &q, cache, kv, seq: 1, first_len: len }];
            let calls = (2_000_000 / len).max(50);
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                for _ in 0..calls {
                    attend_sequences(&seq, nh, 0.125, &mut out);
                }
                best = best.min(t.elapsed().as_secs_f64() / calls as f64 * 1e6);
            }
            println!(
                "heads {nh}/{nkv}, head dim {hd}, {len} positions, {name} cache: {best:.2} µs"
            );
        }
    }
}
