//! The Llama-family decoder as one parameterised implementation: dense (llama, qwen2, qwen3) and MoE
//! (qwen2_moe, qwen3_moe, mixtral, olmoe) feed-forwards, and hybrids whose token mixer is Gated
//! DeltaNet or gated full attention per layer (qwen3_next, qwen3_5_moe). Reference: transformers
//! `models/llama/modeling_llama.py`, `models/qwen3_moe/modeling_qwen3_moe.py`,
//! `models/qwen3_next/modeling_qwen3_next.py`, candle-transformers `models/quantized_llama.rs` and
//! `models/qwen3.rs`.
//!
//! Weights are shared (`&self`); per-sequence state lives in a [`KvCache`], so several sequences can
//! run on one loaded model.

use std::sync::Arc;

use candle_core::quantized::QMatMul;
use candle_core::{Device, Tensor};
use strata_formats::{ModelConfig, ModelFiles, Weight};

use crate::attention::Attention;
use crate::error::{ModelError, Result};
use crate::experts::{ExpertProvider, ResidentExperts};
use crate::gated_delta_net::GatedDeltaNet;
use crate::kv_cache::KvCache;
use crate::layers::{Linear, RmsNorm, WeightLoader};
use crate::mlp::Mlp;
use crate::moe::{LayerRouting, SparseMoe};
use crate::prefetch::{PrefetchMode, PrefetchStats, Prefetcher};
use crate::rope::RotaryEmbedding;

mod batch;
#[cfg(feature = "cuda")]
mod batch_graph;
#[cfg(feature = "cuda")]
mod device_routing;
#[cfg(feature = "cuda")]
mod graph;
mod pick;
pub use batch::{BatchOptions, BatchSeq};
#[cfg(feature = "cuda")]
pub(crate) use graph::DecodeGraphs;

/// Which positions get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position: `[1, vocab]`.
    Last,
    /// Every position: `[seq, vocab]` (perplexity, speculative verification).
    All,
    /// Only the last position's greedy token (a sampler that would take the argmax of the raw
    /// logits): on a GPU ([`crate::gpu::GpuPath::Argmax`] on) the pick is made on the device —
    /// [`ForwardOutput::greedy`] holds it and `logits` is empty `[0, vocab]`, so a batch's
    /// logits never come to the host; elsewhere as [`Logits::Last`] with `greedy` `None`.
    Greedy,
}

/// Output of one forward pass.
#[derive(Debug)]
pub struct ForwardOutput {
    /// `[1 or seq, vocab]` f32 (`[0, vocab]` when `greedy` holds the pick).
    pub logits: Tensor,
    /// With [`Logits::Greedy`] on a GPU: the index of the last position's largest logit (the
    /// first on ties, as `strata_kernels::pick::argmax`); `None` otherwise.
    pub greedy: Option<u32>,
    /// Hidden states `[seq, hidden]` after each layer listed in the request's `hidden_layers`, in order.
    pub hidden_states: Vec<Tensor>,
    /// The routing of every MoE layer, in layer order (empty for dense models).
    pub routing: Vec<LayerRouting>,
}

#[derive(Debug, Clone)]
enum FeedForward {
    Dense(Mlp),
    Moe(SparseMoe),
}

/// The token mixer of a layer.
#[derive(Debug, Clone)]
enum Mixer {
    Attention(Attention),
    /// Gated DeltaNet linear attention (recurrent state instead of a KV cache).
    GatedDeltaNet(GatedDeltaNet),
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    attn_norm: RmsNorm,
    mixer: Mixer,
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
    experts: Arc<dyn ExpertProvider>,
    /// Predicts the next MoE layer's experts for a streaming provider (`None`: no prediction).
    prefetcher: Option<Prefetcher>,
    device: Device,
    /// Element type of the KV caches [`Self::new_cache`] makes.
    kv_dtype: crate::KvDtype,
    /// Batched decode steps captured as CUDA graphs, shared by every sequence
    /// ([`batch_graph`]).
    #[cfg(feature = "cuda")]
    batch_graphs: std::sync::Mutex<Option<batch_graph::BatchGraphs>>,
}

impl Transformer {
    /// Loads every weight, routed experts included (held by a [`ResidentExperts`]), checking shapes
    /// against the config. `max_positions` sizes the RoPE tables (at least the context size that
    /// caches will use). `progress` is called after each layer with `(done, total)`.
    pub fn load(
        files: &ModelFiles,
        device: &Device,
        max_positions: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        Self::load_with_experts(files, device, max_positions, None, progress)
    }

    /// Like [`Self::load`], but routed experts come from `experts` when given (an expert-streaming
    /// provider) instead of being read into memory.
    pub fn load_with_experts(
        files: &ModelFiles,
        device: &Device,
        max_positions: usize,
        experts: Option<Arc<dyn ExpertProvider>>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let cfg = files.config()?;
        let mut resident = ResidentExperts::new(cfg.num_layers);
        let mut l = WeightLoader::new(files, device.clone());
        if matches!(files, ModelFiles::Hf(_)) {
            l.norm_shift = cfg.arch.spec().hf_norm_shift();
        }
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed_w = match l.weight("token_embd.weight", &[v, h])? {
            Weight::Quantized(q) => std::sync::Arc::new(q),
            Weight::Dense(t) => std::sync::Arc::new(candle_core::quantized::QTensor::quantize(
                &t,
                candle_core::quantized::GgmlDType::F32,
            )?),
        };
        let embed = Embedding(QMatMul::QTensor(embed_w.clone()));
        let total = cfg.num_layers + 1;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("blk.{i}.{s}");
            let mixer = match &cfg.linear_attn {
                Some(la) if la.is_recurrent(i) => {
                    Mixer::GatedDeltaNet(GatedDeltaNet::load(&l, &cfg, la, i)?)
                }
                _ => Mixer::Attention(Attention::load(&l, &cfg, i)?),
            };
            // llama.cpp names the second norm of qwen3next / qwen35moe `post_attention_norm`.
            let ffn_norm = if l.has(&p("ffn_norm.weight")) {
                p("ffn_norm.weight")
            } else {
                p("post_attention_norm.weight")
            };
            layers.push(DecoderLayer {
                attn_norm: RmsNorm::load(&l, &p("attn_norm.weight"), h, cfg.rms_norm_eps)?,
                mixer,
                ffn_norm: RmsNorm::load(&l, &ffn_norm, h, cfg.rms_norm_eps)?,
                ffn: match &cfg.moe {
                    Some(m) if cfg.is_moe_layer(i) => {
                        if experts.is_none() {
                            resident.load_layer(files, &cfg, i, device)?;
                        }
                        FeedForward::Moe(SparseMoe::load(&l, &cfg, m, i)?)
                    }
                    _ => FeedForward::Dense(Mlp::load(&l, i, "", h, cfg.intermediate_size)?),
                },
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
        let rope = RotaryEmbedding::new(
            cfg.rope_theta,
            cfg.rope_dim,
            &cfg.rope_scaling,
            cfg.rope_style,
            positions,
            device,
        )?;
        let experts = experts.unwrap_or_else(|| Arc::new(resident));
        let mut model = Self {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            experts,
            prefetcher: None,
            device: device.clone(),
            kv_dtype: crate::KvDtype::F32,
            #[cfg(feature = "cuda")]
            batch_graphs: std::sync::Mutex::new(None),
        };
        model.set_prefetch(PrefetchMode::default());
        Ok(model)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Whether any layer is a Gated DeltaNet layer (recurrent state).
    pub fn has_recurrent_layers(&self) -> bool {
        self.layers.iter().any(|l| matches!(l.mixer, Mixer::GatedDeltaNet(_)))
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `--kv-cache-dtype`: the element type of the KV caches [`Self::new_cache`] makes from now
    /// on (f32 by default).
    pub fn set_kv_dtype(&mut self, dtype: crate::KvDtype) {
        self.kv_dtype = dtype;
    }

    /// The element type of the KV caches [`Self::new_cache`] makes.
    pub fn kv_dtype(&self) -> crate::KvDtype {
        self.kv_dtype
    }

    /// `--moe-top-k`: every MoE layer uses only the `k` best of its router's choices (see
    /// [`crate::Router::set_top_k_override`]); `None` restores the model's top-k.
    pub fn set_moe_top_k(&mut self, k: Option<usize>) {
        for l in &mut self.layers {
            if let FeedForward::Moe(m) = &mut l.ffn {
                m.router_mut().set_top_k_override(k);
            }
        }
    }

    /// `--prefetch`: which prediction of the next MoE layer's experts is read ahead (see
    /// [`crate::prefetch`]). Only a provider with a [`ExpertProvider::prefetch_limit`] gets
    /// predictions; with [`PrefetchMode::Off`] every predictor is still scored, nothing is read.
    pub fn set_prefetch(&mut self, mode: PrefetchMode) {
        let limit = self.experts.prefetch_limit();
        let moe = self.layers.iter().any(|l| matches!(l.ffn, FeedForward::Moe(_)));
        self.prefetcher =
            (limit > 0 && moe).then(|| Prefetcher::new(mode, self.layers.len(), limit));
    }

    /// Scores the prefetch predictors on every pass without reading anything, also where the
    /// provider takes no predictions (resident experts), so that a routing report can give
    /// their recall on any MoE model. A streaming provider's prefetcher is kept as it is.
    pub fn score_prefetch(&mut self) {
        let moe = self.cfg.moe.as_ref().map(|m| m.num_experts);
        if let (None, Some(experts)) = (&self.prefetcher, moe) {
            self.prefetcher = Some(Prefetcher::new(PrefetchMode::Off, self.layers.len(), experts));
        }
    }

    /// Cumulative precision/recall counters of the prefetch predictors (`None` without prefetch).
    pub fn prefetch_stats(&self) -> Option<PrefetchStats> {
        self.prefetcher.as_ref().map(Prefetcher::stats)
    }

    /// The predictor whose predictions are read ahead (`None` without a streaming provider).
    pub fn prefetch_mode(&self) -> Option<PrefetchMode> {
        self.prefetcher.as_ref().map(Prefetcher::mode)
    }

    /// The first MoE layer in `from..end`.
    fn next_moe_layer(&self, from: usize, end: usize) -> Option<usize> {
        (from..end).find(|&j| matches!(self.layers[j].ffn, FeedForward::Moe(_)))
    }

    /// The provider routed experts are read through.
    pub fn experts(&self) -> &Arc<dyn ExpertProvider> {
        &self.experts
    }

    /// A KV cache (and recurrent state, for hybrid models) for `capacity` tokens (clamped to the
    /// RoPE table size), its keys and values of [`Self::kv_dtype`].
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let cap = capacity.min(self.rope.max_positions());
        KvCache::with_dtype(&self.cfg, cap, &self.device, self.kv_dtype)
    }

    /// Runs `tokens` at positions `cache.len()..` and commits them to the cache.
    ///
    /// Errors: the cache is full (`ModelError::ContextFull`), a token id is outside the vocabulary.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        logits: Logits,
        hidden_layers: &[usize],
    ) -> Result<ForwardOutput> {
        self.forward_layers(tokens, cache, logits, hidden_layers, self.layers.len())
    }

    /// Token embeddings `[n, hidden]` (f32) of `tokens` (draft models that share the target's
    /// embedding, DFlash). Errors on a token outside the vocabulary.
    pub fn embed_tokens(&self, tokens: &[u32]) -> Result<Tensor> {
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::BadToken { id, vocab: self.cfg.vocab_size });
        }
        Ok(self.embed.0.embedding(&Tensor::new(tokens, &self.device)?)?)
    }

    /// The final norm on hidden states `[n, hidden]` (what HF's `hidden_states` holds for the last
    /// layer).
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.norm.forward(x)?)
    }

    /// The lm_head alone, for draft models: hidden states `[n, hidden]` (already normed) → logits
    /// `[n, vocab]` in one GEMM (not bit-identical to one-row passes, see
    /// [`Linear::forward_batched`]).
    pub fn lm_head(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.lm_head.forward_batched(x)?)
    }

    /// Decoder layers in the model.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Like [`Self::forward`] but through the first `n_layers` decoder layers only, then the final
    /// norm and lm_head: the self-speculative draft (LayerSkip, Elhoushi et al. 2024; Draft &
    /// Verify, Zhang et al. 2023) sharing every weight with the target. The cache advances by
    /// `tokens.len()`, but only layers `0..n_layers` are written at those positions: roll back
    /// ([`Self::rollback`]) before a full forward over the same positions.
    pub fn forward_layers(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        logits: Logits,
        hidden_layers: &[usize],
        n_layers: usize,
    ) -> Result<ForwardOutput> {
        self.forward_impl(tokens, cache, logits, hidden_layers, n_layers, None)
    }

    /// [`Self::forward`] that polls `stop` before every layer and returns
    /// `ModelError::Interrupted` when it says so (a long prefill cut short by a server's
    /// shutdown). The cache's length is unchanged then, but layers already run have written
    /// their KV entries and recurrent state: clear the cache before using it again.
    pub fn forward_interruptible(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        logits: Logits,
        hidden_layers: &[usize],
        stop: &dyn Fn() -> bool,
    ) -> Result<ForwardOutput> {
        self.forward_impl(tokens, cache, logits, hidden_layers, self.layers.len(), Some(stop))
    }

    fn forward_impl(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        logits: Logits,
        hidden_layers: &[usize],
        n_layers: usize,
        stop: Option<&dyn Fn() -> bool>,
    ) -> Result<ForwardOutput> {
        let opts =
            BatchOptions { hidden_layers, n_layers: Some(n_layers), stop, ..Default::default() };
        let mut seq = [BatchSeq { tokens, cache, logits }];
        self.forward_batch(&mut seq, opts)?.pop().expect("one result per sequence")
    }

    /// Speculative decoding: marks the sequence's current length as one [`Self::rollback`] can
    /// return to, with every later position. Copies the recurrent state of hybrid models (free
    /// otherwise) and logs every later token's update until [`Self::release_checkpoint`]; call it
    /// before drafting.
    pub fn checkpoint(&self, cache: &mut KvCache) {
        cache.checkpoint();
    }

    /// Ends a speculative round: stops the logging [`Self::checkpoint`] started.
    pub fn release_checkpoint(&self, cache: &mut KvCache) {
        cache.release_checkpoint();
    }

    /// Speculative-decoding rollback hook: keeps the first `len` tokens of the sequence state and
    /// drops the rest (rejected draft tokens). Attention layers move the KV cache's length (storage
    /// is kept); Gated DeltaNet layers restore the checkpointed state and replay the updates up to
    /// `len` ([`crate::recurrent`]).
    ///
    /// Errors: `ModelError::Rollback` when a hybrid model's `len` is before its checkpoint (the
    /// state is then unchanged; clear the cache and prefill again).
    pub fn rollback(&self, cache: &mut KvCache, len: usize) -> Result<()> {
        cache.rollback(len)
    }
}

impl Transformer {
    /// The residual add that ends layer `i`: `x + residual_scaled(h)`, and, when layer `i + 1`
    /// runs in this pass (`i + 1 < end`), its attention norm of the sum in the same launch
    /// ([`RmsNorm::add_forward`]) → `(x, Some(next layer's normed input))`; else `(x, None)`.
    /// Shared by `forward_batch` and the graph's decode step, so that both launch the same kernels.
    fn end_layer(
        &self,
        i: usize,
        end: usize,
        x: &Tensor,
        h: Tensor,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let h = residual_scaled(h, self.cfg.scales.residual)?;
        match self.layers.get(i + 1).filter(|_| i + 1 < end) {
            Some(next) => next.attn_norm.add_forward(x, &h).map(|(x, xn)| (x, Some(xn))),
            None => Ok(((x + h)?, None)),
        }
    }
}

/// A sub-layer's output times the residual multiplier (Granite's `residual_multiplier`); no op
/// at 1.
fn residual_scaled(h: Tensor, scale: f64) -> candle_core::Result<Tensor> {
    if scale == 1.0 {
        Ok(h)
    } else {
        h * scale
    }
}
