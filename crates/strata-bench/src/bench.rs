//! `llama-bench`-style throughput: pp (prompt processing: one forward over N tokens from an empty
//! cache) and tg (text generation: N single-token forwards), median of several runs.

use serde::Serialize;
use strata_models::Logits;

use strata_engine::engine::{Engine, Result};

#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub test: String,
    pub tokens: usize,
    /// tok/s of each run.
    pub runs: Vec<f64>,
    pub median_tok_s: f64,
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Prompt processing: `n` tokens in one forward pass (chunked by `chunk`), `reps` times.
pub fn bench_prefill(engine: &Engine, n: usize, chunk: usize, reps: usize) -> Result<BenchResult> {
    let vocab = engine.model.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut cache = engine.new_cache(n + 1)?;
    // warm-up
    let prefill = |part: &[u32], cache: &mut strata_models::KvCache| {
        // Prompt tokens, as the engine's prefill runs them.
        strata_models::prefill_scope(part.len(), 0, || {
            engine.model.forward(part, cache, Logits::Last, &[])
        })
    };
    prefill(&tokens[..n.min(16)], &mut cache)?;
    let mut runs = Vec::new();
    for _ in 0..reps {
        cache.clear();
        let t = std::time::Instant::now();
        for part in tokens.chunks(chunk.max(1)) {
            prefill(part, &mut cache)?;
        }
        runs.push(n as f64 / t.elapsed().as_secs_f64());
    }
    Ok(BenchResult { test: format!("pp{n}"), tokens: n, median_tok_s: median(&runs), runs })
}

/// Text generation: `n` single-token forwards from an empty cache, `reps` times.
pub fn bench_decode(engine: &Engine, n: usize, reps: usize) -> Result<BenchResult> {
    let vocab = engine.model.config().vocab_size as u32;
    let mut cache = engine.new_cache(n + 1)?;
    let mut runs = Vec::new();
    engine.model.forward(&[1], &mut cache, Logits::Last, &[])?;
    for _ in 0..reps {
        cache.clear();
        let t = std::time::Instant::now();
        for i in 0..n as u32 {
            engine.model.forward(&[(i * 7919 + 13) % vocab], &mut cache, Logits::Last, &[])?;
        }
        runs.push(n as f64 / t.elapsed().as_secs_f64());
    }
    Ok(BenchResult { test: format!("tg{n}"), tokens: n, median_tok_s: median(&runs), runs })
}

/// Batched text generation (llama-batched-bench's S_TG): `batch` sequences decoding together, one
/// forward pass over all of them per step ([`strata_models::Transformer::forward_batch`]), `n`
/// steps from empty caches, `reps` times; tok/s counts every sequence's tokens.
pub fn bench_batch_decode(
    engine: &Engine,
    batch: usize,
    n: usize,
    reps: usize,
) -> Result<BenchResult> {
    use strata_models::{BatchOptions, BatchSeq};
    let vocab = engine.model.config().vocab_size as u32;
    let mut caches =
        (0..batch.max(1)).map(|_| engine.new_cache(n + 2)).collect::<Result<Vec<_>>>()?;
    let step = |caches: &mut [strata_models::KvCache], i: u32| -> Result<()> {
        let toks: Vec<[u32; 1]> =
            (0..caches.len() as u32).map(|s| [(i * 7919 + s * 104_729 + 13) % vocab]).collect();
        let mut seqs: Vec<BatchSeq<'_>> = caches
            .iter_mut()
            .zip(&toks)
            .map(|(cache, t)| BatchSeq { tokens: t, cache, logits: Logits::Last })
            .collect();
        for r in engine.model.forward_batch(&mut seqs, BatchOptions::default())? {
            r?;
        }
        Ok(())
    };
    step(&mut caches, 0)?; // warm-up
    let mut runs = Vec::new();
    for _ in 0..reps {
        caches.iter_mut().for_each(|c| c.clear());
        let t = std::time::Instant::now();
        for i in 0..n as u32 {
            step(&mut caches, i)?;
        }
        runs.push((n * caches.len()) as f64 / t.elapsed().as_secs_f64());
    }
    Ok(BenchResult {
        test: format!("tg{n} x{}", caches.len()),
        tokens: n * caches.len(),
        median_tok_s: median(&runs),
        runs,
    })
}
