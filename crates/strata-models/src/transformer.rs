//! The Llama-family decoder (llama, qwen2, qwen3) as one parameterised implementation.
//! Reference: transformers `models/llama/modeling_llama.py`, candle-transformers
//! `models/quantized_llama.rs` and `models/qwen3.rs`.
//!
//! Weights are shared (`&self`); per-sequence state lives in a [`KvCache`], so several sequences can
//! run on one loaded model.

use candle_core::quantized::QMatMul;
use candle_core::{Device, Tensor};
use strata_formats::{ModelConfig, ModelFiles, Weight};

use crate::attention::{causal_mask, Attention};
use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;
use crate::layers::{Linear, RmsNorm, WeightLoader};
use crate::mlp::Mlp;
use crate::rope::RotaryEmbedding;

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position: `[1, vocab]`.
    Last,
    /// Every position: `[seq, vocab]` (perplexity, speculative verification).
    All,
}

/// Output of one forward pass.
#[derive(Debug)]
pub struct ForwardOutput {
    /// `[1 or seq, vocab]` f32.
    pub logits: Tensor,
    /// Hidden states `[seq, hidden]` after each layer listed in the request's `taps`, in order.
    pub taps: Vec<Tensor>,
}

#[derive(Debug, Clone)]
enum FeedForward {
    Dense(Mlp),
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    attn_norm: RmsNorm,
    attn: Attention,
    ffn_norm: RmsNorm,
    ffn: FeedForward,
}

/// Token embedding: quantized rows (GGUF) are dequantized on lookup.
#[derive(Debug, Clone)]
struct Embedding(QMatMul);

/// A loaded decoder-only transformer.
#[derive(Debug)]
pub struct Transformer {
    cfg: ModelConfig,
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: RotaryEmbedding,
    device: Device,
}

impl Transformer {
    /// Loads every weight, checking shapes against the config. `max_positions` sizes the RoPE tables
    /// (at least the context size that caches will use). `progress` is called after each layer with
    /// `(done, total)`.
    pub fn load(files: &ModelFiles, device: &Device, max_positions: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        let cfg = files.config()?;
        let l = WeightLoader::new(files, device.clone());
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed_w = match l.weight("token_embd.weight", &[v, h])? {
            Weight::Quantized(q) => std::sync::Arc::new(q),
            Weight::Dense(t) => std::sync::Arc::new(candle_core::quantized::QTensor::quantize(&t, candle_core::quantized::GgmlDType::F32)?),
        };
        let embed = Embedding(QMatMul::QTensor(embed_w.clone()));
        let total = cfg.num_layers + 1;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("blk.{i}.{s}");
            layers.push(DecoderLayer {
                attn_norm: RmsNorm::load(&l, &p("attn_norm.weight"), h, cfg.rms_norm_eps)?,
                attn: Attention::load(&l, &cfg, i)?,
                ffn_norm: RmsNorm::load(&l, &p("ffn_norm.weight"), h, cfg.rms_norm_eps)?,
                ffn: FeedForward::Dense(Mlp::load(&l, &cfg, i)?),
            });
            progress(i + 1, total);
        }
        let norm = RmsNorm::load(&l, "output_norm.weight", h, cfg.rms_norm_eps)?;
        let lm_head = if l.has("output.weight") {
            l.linear("output", v, h, false)?
        } else {
            Linear::from_shared(embed_w)?
        };
        progress(total, total);
        let positions = max_positions.max(1);
        let rope = RotaryEmbedding::new(cfg.rope_theta, cfg.rope_dim, &cfg.rope_scaling, cfg.rope_style, positions, device)?;
        Ok(Self { cfg, embed, layers, norm, lm_head, rope, device: device.clone() })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A KV cache for `capacity` tokens (clamped to the RoPE table size).
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let cap = capacity.min(self.rope.max_positions());
        KvCache::new(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, cap, &self.device)
    }

    /// Runs `tokens` at positions `cache.len()..` and commits them to the cache.
    ///
    /// Errors: the cache is full (`ModelError::ContextFull`), a token id is outside the vocabulary.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, logits: Logits, taps: &[usize]) -> Result<ForwardOutput> {
        let seq = tokens.len();
        cache.check_room(seq)?;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::BadToken { id, vocab: self.cfg.vocab_size });
        }
        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.embed.0.embedding(&ids)?; // [seq, hidden]
        let mask = if seq > 1 { Some(causal_mask(seq, cache.len(), &self.device)?) } else { None };
        let mut tapped = Vec::with_capacity(taps.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer.attn.forward(&layer.attn_norm.forward(&x)?, i, cache, &self.rope, mask.as_ref())?;
            x = (x + h)?;
            let h = match &layer.ffn {
                FeedForward::Dense(m) => m.forward(&layer.ffn_norm.forward(&x)?)?,
            };
            x = (x + h)?;
            if taps.contains(&i) {
                tapped.push(x.clone());
            }
        }
        cache.advance(seq);
        let x = match logits {
            Logits::Last => x.narrow(0, seq - 1, 1)?,
            Logits::All => x,
        };
        let logits = self.lm_head.forward(&self.norm.forward(&x)?)?;
        Ok(ForwardOutput { logits, taps: tapped })
    }
}
