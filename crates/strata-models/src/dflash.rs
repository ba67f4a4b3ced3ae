//! DFlash block-diffusion draft model (z-lab, "DFlash: Block Diffusion for Flash Speculative
//! Decoding", arXiv 2602.06036; reference implementation `dflash/model.py` of
//! github.com/z-lab/dflash, `DFlashDraftModel` and `dflash_generate`).
//!
//! The draft is a stack of Qwen3 decoder layers conditioned on the target's hidden states:
//! - **context features**: the outputs of the target's decoder layers `target_layer_ids`
//!   (HF `hidden_states[L + 1]`; for the last layer HF returns the final-normed state, so we norm
//!   it too), concatenated `[n, k·H]`, projected by `fc` and normed by `hidden_norm` → `[n, H]`;
//! - **draft cache**: each layer's K (k_norm, then RoPE at the absolute position) and V of the
//!   context features — context features skip `input_layernorm` — kept across rounds;
//! - **one forward per block**: the block `[anchor, mask × (B−1)]` is embedded with the target's
//!   embedding; each layer attends from the block's queries to cached context + new context +
//!   block keys, bidirectionally (no causal mask); the final norm and the target's lm_head give
//!   logits for block positions `1..B`. The block's own K/V are dropped afterwards (the cache keeps
//!   only context positions, z-lab's `_crop_to(past_key_values_draft, start)`).

use candle_core::{Device, Tensor};
use strata_formats::{DFlashConfig, ModelConfig, ModelFiles};

use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;
use crate::layers::{Linear, RmsNorm, WeightLoader};
use crate::rope::RotaryEmbedding;
use crate::transformer::Transformer;

#[derive(Debug, Clone)]
struct DraftLayer {
    input_norm: RmsNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    post_norm: RmsNorm,
    /// SwiGLU: `down(silu(gate(x)) · up(x))`.
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A loaded DFlash draft (weights only; per-sequence state is a [`KvCache`] from
/// [`DFlashDraft::new_cache`]).
#[derive(Debug)]
pub struct DFlashDraft {
    cfg: ModelConfig,
    dflash: DFlashConfig,
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<DraftLayer>,
    norm: RmsNorm,
    rope: RotaryEmbedding,
    /// The target layers to tap, ascending and distinct ([`Transformer::forward`]'s `hidden_layers` order),
    /// and for each entry of `target_layer_ids` its index among them.
    hidden_layers: Vec<usize>,
    hidden_order: Vec<usize>,
    target_layers: usize,
}

impl DFlashDraft {
    /// Loads a draft in z-lab's checkpoint format for `target`, with RoPE tables for
    /// `max_positions` (the context size plus a block).
    ///
    /// Errors: not a `DFlashDraftModel` directory; its hidden size differs from the target's; a
    /// target layer id is outside the target; the mask token is outside the target's vocabulary;
    /// `fc` is not `[H, k·H]`; any missing tensor or shape mismatch.
    pub fn load(files: &ModelFiles, target: &Transformer, max_positions: usize) -> Result<Self> {
        let dflash = DFlashConfig::from_files(files)?;
        let cfg = files.config()?;
        let tcfg = target.config();
        let bad = |m: String| {
            ModelError::from(strata_formats::FormatError::Invalid {
                path: files.path().to_path_buf(),
                message: m,
            })
        };
        if cfg.hidden_size != tcfg.hidden_size {
            return Err(bad(format!("the DFlash draft's hidden size {} differs from the target's {}: it was made for another model", cfg.hidden_size, tcfg.hidden_size)));
        }
        if let Some(&l) = dflash.target_layer_ids.iter().find(|&&l| l >= tcfg.num_layers) {
            return Err(bad(format!("the DFlash draft reads target layer {l} but the target has {} layers: it was made for another model", tcfg.num_layers)));
        }
        if dflash.mask_token_id as usize >= tcfg.vocab_size {
            return Err(bad(format!(
                "mask_token_id {} is outside the target's vocabulary ({})",
                dflash.mask_token_id, tcfg.vocab_size
            )));
        }
        if let Some(n) = dflash.num_target_layers.filter(|&n| n != tcfg.num_layers) {
            return Err(bad(format!(
                "the DFlash draft was made for a target with {n} layers but this one has {}",
                tcfg.num_layers
            )));
        }
        let device = target.device().clone();
        let l = WeightLoader::new(files, device.clone());
        let (h, hd, eps) = (cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps);
        let k = dflash.target_layer_ids.len();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = |s: &str| format!("blk.{i}.{s}");
            layers.push(DraftLayer {
                input_norm: RmsNorm::load(&l, &p("attn_norm.weight"), h, eps)?,
                q: l.linear(&p("attn_q"), cfg.num_heads * hd, h, cfg.attention_bias)?,
                k: l.linear(&p("attn_k"), cfg.num_kv_heads * hd, h, cfg.attention_bias)?,
                v: l.linear(&p("attn_v"), cfg.num_kv_heads * hd, h, cfg.attention_bias)?,
                o: l.linear(&p("attn_output"), h, cfg.num_heads * hd, cfg.attention_bias)?,
                q_norm: RmsNorm::load(&l, &p("attn_q_norm.weight"), hd, eps)?,
                k_norm: RmsNorm::load(&l, &p("attn_k_norm.weight"), hd, eps)?,
                post_norm: RmsNorm::load(&l, &p("ffn_norm.weight"), h, eps)?,
                gate: l.linear(&p("ffn_gate"), cfg.intermediate_size, h, false)?,
                up: l.linear(&p("ffn_up"), cfg.intermediate_size, h, false)?,
                down: l.linear(&p("ffn_down"), h, cfg.intermediate_size, false)?,
            });
        }
        let mut hidden_layers = dflash.target_layer_ids.clone();
        hidden_layers.sort_unstable();
        hidden_layers.dedup();
        let hidden_order = dflash
            .target_layer_ids
            .iter()
            .map(|id| hidden_layers.iter().position(|t| t == id).unwrap_or(0))
            .collect();
        let rope = RotaryEmbedding::new(
            cfg.rope_theta,
            cfg.rope_dim,
            &cfg.rope_scaling,
            cfg.rope_style,
            max_positions.max(1),
            &device,
        )?;
        Ok(Self {
            fc: l.linear("fc", h, k * h, false)?,
            hidden_norm: RmsNorm::load(&l, "hidden_norm.weight", h, eps)?,
            norm: RmsNorm::load(&l, "output_norm.weight", h, eps)?,
            layers,
            rope,
            hidden_layers,
            hidden_order,
            target_layers: tcfg.num_layers,
            dflash,
            cfg,
        })
    }

    pub fn dflash_config(&self) -> &DFlashConfig {
        &self.dflash
    }

    /// Tokens per block (anchor + mask positions).
    pub fn block_size(&self) -> usize {
        self.dflash.block_size
    }

    pub fn mask_token_id(&self) -> u32 {
        self.dflash.mask_token_id
    }

    /// The target layers whose outputs a forward pass must tap (ascending), for
    /// [`Transformer::forward`]'s `hidden_layers`.
    pub fn hidden_layers(&self) -> &[usize] {
        &self.hidden_layers
    }

    /// A draft cache for `capacity` context positions; give it a block more than the target's
    /// capacity (the block's K/V are written past the context before being dropped).
    pub fn new_cache(&self, capacity: usize, device: &Device) -> Result<KvCache> {
        KvCache::new(&self.cfg, capacity.min(self.rope.max_positions()), device)
    }

    /// Raw context features `[n, k·H]` from one target forward's `hidden_layers` (each `[n, H]`, in
    /// [`Self::hidden_layers`] order): concatenated in `target_layer_ids` order, the last target
    /// layer final-normed as HF's `hidden_states` has it. [`Self::project`] turns them into the
    /// draft's context when a draft pass needs them (one GEMM over every pending row; rounds that
    /// do not draft only keep them).
    pub fn target_features(
        &self,
        target: &Transformer,
        hidden_states: &[Tensor],
    ) -> Result<Tensor> {
        if hidden_states.len() != self.hidden_layers.len() {
            return Err(ModelError::Candle(candle_core::Error::Msg(format!(
                "DFlash: {} hidden_states layers, {} expected",
                hidden_states.len(),
                self.hidden_layers.len()
            ))));
        }
        let parts = self
            .dflash
            .target_layer_ids
            .iter()
            .zip(&self.hidden_order)
            .map(|(&id, &t)| {
                if id + 1 == self.target_layers {
                    target.final_norm(&hidden_states[t])
                } else {
                    Ok(hidden_states[t].clone())
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 1)?)
    }

    /// Context features `[n, H]` = `hidden_norm(fc(raw))` of raw features `[n, k·H]`.
    pub fn project(&self, raw: &Tensor) -> Result<Tensor> {
        Ok(self.hidden_norm.forward(&self.fc.forward_batched(raw)?)?)
    }

    /// One draft pass. `ctx: [C, H]` are the context features of positions
    /// `cache.len()..start` (not yet in the draft cache; `C = start − cache.len()`), `block` the
    /// block's tokens at positions `start..start + B` (the anchor, then mask tokens). Appends the
    /// context's K/V to `cache` and returns the draft's logits `[B − 1, vocab]` for block
    /// positions `1..B`, through the target's lm_head.
    ///
    /// Errors: `start` does not match `cache.len() + C`; the cache or RoPE table has no room for
    /// the block; a block token is outside the vocabulary.
    pub fn draft_block(
        &self,
        target: &Transformer,
        cache: &mut KvCache,
        ctx: Option<&Tensor>,
        start: usize,
        block: &[u32],
    ) -> Result<Tensor> {
        let c = match ctx {
            Some(t) => t.dim(0)?,
            None => 0,
        };
        if cache.len() + c != start {
            return Err(ModelError::Candle(candle_core::Error::Msg(format!(
                "DFlash: draft cache holds {} positions + {c} new, but the block starts at {start}",
                cache.len()
            ))));
        }
        let b = block.len();
        cache.check_room(c + b)?;
        if start + b > self.rope.max_positions() {
            return Err(ModelError::ContextFull {
                needed: start + b,
                capacity: self.rope.max_positions(),
            });
        }
        let (nh, nkv, hd) = (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim);
        let scale = 1.0 / (hd as f64).sqrt();
        // [rows, n·hd] → [1, n, rows, hd], per-head norm first when given.
        let heads = |t: Tensor, rows: usize, n: usize, norm: Option<&RmsNorm>| -> Result<Tensor> {
            let t = t.reshape((rows, n, hd))?;
            let t = match norm {
                Some(nm) => nm.forward(&t)?,
                None => t,
            };
            Ok(t.transpose(0, 1)?.unsqueeze(0)?.contiguous()?)
        };
        let mut x = target.embed_tokens(block)?; // [B, H]
        for (i, layer) in self.layers.iter().enumerate() {
            let xn = layer.input_norm.forward(&x)?;
            let kv_in = match ctx {
                Some(t) => Tensor::cat(&[t, &xn], 0)?,
                None => xn.clone(),
            };
            let q = self
                .rope
                .apply(&heads(layer.q.forward_batched(&xn)?, b, nh, Some(&layer.q_norm))?, start)?;
            let k = self.rope.apply(
                &heads(layer.k.forward_batched(&kv_in)?, c + b, nkv, Some(&layer.k_norm))?,
                start - c,
            )?;
            let v = heads(layer.v.forward_batched(&kv_in)?, c + b, nkv, None)?;
            let (k_all, v_all) = cache.append(i, &k, &v)?;
            // Bidirectional attention over everything cached: no mask. Query heads sharing a kv
            // head are grouped: [1, nkv, n_rep·B, hd].
            let n_rep = nh / nkv;
            let q = q.reshape((1, nkv, n_rep * b, hd))?;
            let att = (q.matmul(&k_all.t()?)? * scale)?;
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let out =
                att.matmul(&v_all)?.reshape((nh, b, hd))?.transpose(0, 1)?.reshape((b, nh * hd))?;
            x = (x + layer.o.forward_batched(&out)?)?;
            let xn = layer.post_norm.forward(&x)?;
            let g = candle_nn::ops::silu(&layer.gate.forward_batched(&xn)?)?;
            x = (x + layer.down.forward_batched(&(g * layer.up.forward_batched(&xn)?)?)?)?;
        }
        // Keep the context's K/V; the block's are overwritten by the next pass.
        cache.advance(c);
        let hidden = self.norm.forward(&x.narrow(0, 1, b - 1)?)?;
        target.lm_head(&hidden)
    }
}
