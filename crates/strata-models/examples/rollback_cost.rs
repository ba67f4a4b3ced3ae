//! What rolling back a hybrid model's recurrent state costs, at Qwen3.5-122B-A10B's dimensions
//! (36 Gated DeltaNet layers, 16 key / 64 value heads of 128, conv kernel 4):
//!
//! - checkpoint: one copy of every layer's state before a speculative round;
//! - replay: restoring that copy and re-applying the logged updates of the accepted tokens
//!   (what `RecurrentCache::rollback` does);
//! - the alternative, storing a state per verified position: one state copy per position.
//!
//! `cargo run --release -p strata-models --example rollback_cost [tokens]`

use std::time::Instant;

use strata_formats::{HeadOrder, LinearAttnConfig};
use strata_models::recurrent::{delta_update, RecurrentCache};

fn main() {
    let tokens: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(4);
    let layers = 36;
    let cfg = LinearAttnConfig {
        num_k_heads: 16,
        num_v_heads: 64,
        head_k_dim: 128,
        head_v_dim: 128,
        conv_kernel: 4,
        recurrent_layers: vec![true; layers],
        head_order: HeadOrder::Grouped,
    };
    let state_bytes = cfg.state_bytes_per_layer() * layers;
    let mut cache = RecurrentCache::new(Some(&cfg));
    let (kw, vw, cd, nv) = (16 * 128, 64 * 128, cfg.conv_dim(), 64);
    let raw = vec![0.01f32; cd];
    let k: Vec<f32> = (0..kw).map(|i| ((i % 7) as f32 - 3.0) / 30.0).collect();
    let v = vec![0.1f32; vw];
    let (decay, beta) = (vec![0.9f32; nv], vec![0.5f32; nv]);
    let step = |cache: &mut RecurrentCache| {
        let mut mem = vec![0f32; 128];
        for l in 0..layers {
            let (s, log) = cache.layer_mut(l).expect("recurrent layer");
            s.push_conv_row(&raw);
            for h in 0..nv {
                let kh = h / 4;
                delta_update(
                    &mut s.ssm[h * 128 * 128..(h + 1) * 128 * 128],
                    &k[kh * 128..(kh + 1) * 128],
                    &v[h * 128..(h + 1) * 128],
                    decay[h],
                    beta[h],
                    &mut mem,
                );
            }
            if let Some(log) = log {
                log.push(&raw, &k, &v, &decay, &beta);
            }
        }
    };
    let reps = 10;
    let (mut ck, mut upd, mut rb) = (0f64, 0f64, 0f64);
    for r in 0..reps + 1 {
        let t = Instant::now();
        cache.checkpoint(100);
        let c = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..tokens + 1 {
            step(&mut cache);
        }
        let u = t.elapsed().as_secs_f64() / (tokens + 1) as f64;
        // Accept half the drafts: restore and replay tokens/2 + 1 updates.
        let t = Instant::now();
        cache
            .rollback(100 + tokens / 2 + 1, 100 + tokens + 1)
            .expect("rollback after the checkpoint");
        let b = t.elapsed().as_secs_f64();
        if r > 0 {
            ck += c;
            upd += u;
            rb += b;
        }
    }
    let ms = |s: f64| s * 1e3 / reps as f64;
    println!(
        "Qwen3.5-122B-A10B recurrent state: {layers} layers, {:.1} MB per sequence",
        state_bytes as f64 / 1e6
    );
    println!(
        "checkpoint (one copy):             {:.2} ms ({:.1} GB/s)",
        ms(ck),
        state_bytes as f64 / (ck / reps as f64) / 1e9
    );
    println!("state update, one token:           {:.2} ms", ms(upd));
    println!(
        "rollback to {} of {} verified:      {:.2} ms (restore + replay {} tokens)",
        tokens / 2 + 1,
        tokens + 1,
        ms(rb),
        tokens / 2 + 1
    );
    println!(
        "per-position states instead:       {:.2} ms of copies per verify pass of {} tokens, {:.1} MB each",
        ms(ck) * (tokens + 1) as f64,
        tokens + 1,
        state_bytes as f64 / 1e6
    );
}
