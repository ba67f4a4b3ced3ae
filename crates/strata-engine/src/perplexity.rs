//! Perplexity the way `llama-perplexity` computes it (llama.cpp `tools/perplexity/perplexity.cpp`,
//! `perplexity()`): the token stream is cut into chunks of `n_ctx` tokens, each chunk is evaluated
//! from an empty KV cache, and only the second half is scored: the logits at positions
//! `n_ctx/2 .. n_ctx-1` predict tokens `n_ctx/2+1 .. n_ctx`. PPL = exp(mean NLL); the ± is
//! llama.cpp's standard-error estimate.

use serde::Serialize;
use strata_models::Logits;

use crate::engine::{Engine, Result};
use crate::sampling::log_softmax;

#[derive(Debug, Clone, Serialize)]
pub struct PerplexityResult {
    pub ppl: f64,
    /// Standard error of the PPL estimate (llama.cpp's formula).
    pub ppl_stderr: f64,
    pub chunks: usize,
    pub scored_tokens: usize,
    pub total_tokens: usize,
    /// Running PPL after each chunk.
    pub running: Vec<f64>,
    pub seconds: f64,
}

/// Scores `tokens` in chunks of `n_ctx`; `progress(chunk, n_chunks, running_ppl)` per chunk.
pub fn perplexity(
    engine: &Engine,
    tokens: &[u32],
    n_ctx: usize,
    batch: usize,
    progress: &mut dyn FnMut(usize, usize, f64),
) -> Result<PerplexityResult> {
    let t0 = std::time::Instant::now();
    let n_chunks = tokens.len() / n_ctx;
    let first = n_ctx / 2;
    let mut cache = engine.new_cache(n_ctx)?;
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let mut running = Vec::with_capacity(n_chunks);
    for c in 0..n_chunks {
        let chunk = &tokens[c * n_ctx..(c + 1) * n_ctx];
        cache.clear();
        let mut logits_rows: Vec<Vec<f32>> = Vec::with_capacity(n_ctx);
        for (b, part) in chunk.chunks(batch.max(1)).enumerate() {
            let out = strata_models::prefill_scope(part.len(), 0, || {
                engine.model.forward(part, &mut cache, Logits::All, &[])
            })?;
            let start = b * batch.max(1);
            let rows: Vec<Vec<f32>> = out.logits.to_vec2()?;
            for (i, r) in rows.into_iter().enumerate() {
                // keep only rows that are scored
                if start + i >= first && start + i < n_ctx - 1 {
                    logits_rows.push(r);
                }
            }
        }
        for (k, row) in logits_rows.iter().enumerate() {
            let j = first + k;
            let lp = log_softmax(row);
            let v = -(lp[chunk[j + 1] as usize] as f64);
            nll += v;
            nll2 += v * v;
            count += 1;
        }
        let ppl = (nll / count as f64).exp();
        running.push(ppl);
        progress(c + 1, n_chunks, ppl);
    }
    let mean = nll / count.max(1) as f64;
    let ppl = mean.exp();
    let var = (nll2 / count.max(1) as f64 - mean * mean).max(0.0);
    let stderr = if count > 1 { (var / (count - 1) as f64).sqrt() * ppl } else { 0.0 };
    Ok(PerplexityResult {
        ppl,
        ppl_stderr: stderr,
        chunks: n_chunks,
        scored_tokens: count,
        total_tokens: tokens.len(),
        running,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
