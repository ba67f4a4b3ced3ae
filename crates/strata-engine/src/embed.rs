//! Sentence embeddings from a generative model (`/v1/embeddings`): the mean over the input's
//! positions of the last layer's hidden state after the final norm, L2-normalised — the mean
//! pooling of sentence-transformers (`Pooling(pooling_mode_mean_tokens)`) applied to a decoder, as
//! llama.cpp's `--pooling mean` does. Width: the model's hidden size.

use strata_models::Logits;

use crate::engine::{Engine, EngineError, Result};

impl Engine {
    /// The embedding `[hidden]` of `tokens` (prefilled in chunks of `chunk` into a cache of its
    /// own). Deterministic: the same tokens give the same vector. Errors: no tokens, more tokens
    /// than `ctx` allows, a token outside the vocabulary.
    pub fn embed(&self, tokens: &[u32], ctx: usize, chunk: usize) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if tokens.len() >= ctx {
            return Err(EngineError::PromptTooLong { prompt: tokens.len(), ctx });
        }
        let last = self.model.num_layers() - 1;
        let mut cache = self.model.new_cache(tokens.len() + 1)?;
        let mut sum = vec![0f64; self.model.config().hidden_size];
        for part in tokens.chunks(chunk.max(1)) {
            let out = strata_models::prefill_scope(part.len(), 0, || {
                self.model.forward(part, &mut cache, Logits::Last, &[last])
            })?;
            let h = out.hidden_states.last().ok_or(EngineError::EmptyPrompt)?;
            let rows =
                self.model.final_norm(h)?.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
            for row in rows {
                for (s, x) in sum.iter_mut().zip(row) {
                    *s += x as f64;
                }
            }
        }
        let n = tokens.len() as f64;
        let mean: Vec<f64> = sum.iter().map(|s| s / n).collect();
        let norm = mean.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
        Ok(mean.iter().map(|x| (x / norm) as f32).collect())
    }
}
