//! Grouped-query self-attention (Ainslie et al. 2023) with RoPE, optional q/k RMSNorm (Qwen3 per head,
//! OLMoE over the whole projection), optional q/k/v clipping (OLMoE), q/k/v bias (Qwen2) and
//! sigmoid output gate (Qwen3-Next), reading and writing the preallocated [`KvCache`].
//! Reference: transformers `models/llama/modeling_llama.py`, `models/qwen3/modeling_qwen3.py`.

use candle_core::Tensor;
use strata_formats::{ModelConfig, QkNorm};

use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::layers::{Linear, RmsNorm, WeightLoader};
use crate::rope::RotaryEmbedding;

/// The q, k and v projections: stacked into one matrix (one activation quantization, one dispatch)
/// when the format allows, the separate copies then dropped.
#[derive(Debug, Clone)]
enum Qkv {
    Fused(Linear),
    Separate { q: Linear, k: Linear, v: Linear },
}

#[derive(Debug, Clone)]
pub struct Attention {
    qkv: Qkv,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    /// Where q/k norms apply (per head, or over the whole projection).
    qk_norm: QkNorm,
    clip_qkv: Option<f64>,
    /// The q projection also computes a per-head output gate (Qwen3-Next gated attention).
    output_gate: bool,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f64,
}

impl Attention {
    pub fn load(l: &WeightLoader, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let p = |s: &str| format!("blk.{layer}.{s}");
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q_dim, k_dim) = match cfg.qk_norm {
            QkNorm::Full => (cfg.num_heads * hd, cfg.num_kv_heads * hd),
            _ => (hd, hd),
        };
        let (q_norm, k_norm) = if cfg.qk_norm == QkNorm::None {
            (None, None)
        } else {
            (
                Some(RmsNorm::load(l, &p("attn_q_norm.weight"), q_dim, cfg.rms_norm_eps)?),
                Some(RmsNorm::load(l, &p("attn_k_norm.weight"), k_dim, cfg.rms_norm_eps)?),
            )
        };
        let gate = if cfg.attn_output_gate { 2 } else { 1 };
        let q = l.linear(&p("attn_q"), gate * cfg.num_heads * hd, h, cfg.attention_bias)?;
        let k = l.linear(&p("attn_k"), cfg.num_kv_heads * hd, h, cfg.attention_bias)?;
        let v = l.linear(&p("attn_v"), cfg.num_kv_heads * hd, h, cfg.attention_bias)?;
        let qkv = match Linear::fuse(&[&q, &k, &v])? {
            Some(f) => Qkv::Fused(f),
            None => Qkv::Separate { q, k, v },
        };
        Ok(Self {
            qkv,
            o: l.linear(&p("attn_output"), h, cfg.num_heads * hd, false)?,
            q_norm,
            k_norm,
            qk_norm: cfg.qk_norm,
            clip_qkv: cfg.clip_qkv,
            output_gate: cfg.attn_output_gate,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: hd,
            scale: cfg.scales.attention.unwrap_or(1.0 / (hd as f64).sqrt()),
        })
    }

    /// `x: [seq, hidden]` at positions `cache.len()..+seq` → `[seq, hidden]`. `mask: [seq, total]`
    /// additive (0 / -inf), `None` for a single token.
    pub fn forward(
        &self,
        x: &Tensor,
        layer: usize,
        cache: &mut KvCache,
        rope: &RotaryEmbedding,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let seq = x.dim(0)?;
        let pos = cache.len();
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let per_head = self.qk_norm == QkNorm::PerHead;
        // transformers order: projection → norm (OLMoE: whole projection) → clip → split heads.
        let heads = |t: Tensor, n: usize, norm: &Option<RmsNorm>| -> candle_core::Result<Tensor> {
            let t = match norm {
                Some(nm) if !per_head => nm.forward(&t)?,
                _ => t,
            };
            let t = match self.clip_qkv {
                Some(c) => t.clamp(-c, c)?,
                None => t,
            };
            let t = t.reshape((seq, n, hd))?;
            let t = match norm {
                Some(nm) if per_head => nm.forward(&t)?,
                _ => t,
            };
            t.transpose(0, 1)?.unsqueeze(0)?.contiguous()
        };
        let qw = if self.output_gate { 2 * nh * hd } else { nh * hd };
        let (q, k, v) = match &self.qkv {
            Qkv::Fused(qkv) => {
                let y = qkv.forward(x)?;
                (
                    y.narrow(1, 0, qw)?,
                    y.narrow(1, qw, nkv * hd)?,
                    y.narrow(1, qw + nkv * hd, nkv * hd)?,
                )
            }
            Qkv::Separate { q, k, v } => (q.forward(x)?, k.forward(x)?, v.forward(x)?),
        };
        // Gated attention: each head's projection is [query, gate] (transformers
        // `Qwen3NextAttention`: `torch.chunk(q_proj(x).view(.., heads, 2·head_dim), 2, -1)`).
        let (q, gate) = if self.output_gate {
            let qg = q.reshape((seq, nh, 2 * hd))?;
            (
                qg.narrow(2, 0, hd)?.reshape((seq, nh * hd))?,
                Some(qg.narrow(2, hd, hd)?.reshape((seq, nh * hd))?),
            )
        } else {
            (q, None)
        };
        let finish = |out: Tensor| -> Result<Tensor> {
            let out = match &gate {
                Some(g) => (out * candle_nn::ops::sigmoid(g)?)?,
                None => out,
            };
            Ok(self.o.forward(&out)?)
        };
        let q = heads(q.contiguous()?, nh, &self.q_norm)?;
        let k = heads(k.contiguous()?, nkv, &self.k_norm)?;
        let v = heads(v.contiguous()?, nkv, &None)?;
        let q = rope.apply(&q, pos)?;
        let k = rope.apply(&k, pos)?;
        let (k_all, v_all) = cache.append(layer, &k, &v)?;
        if seq <= EXACT_ROWS_MAX && x.device().is_cpu() {
            // One query row at a time over its causal prefix, with the decode kernel: the logits of
            // a short multi-token pass (speculative verification) are bit-identical to decoding the
            // same tokens one by one, so greedy speculation reproduces plain decoding exactly.
            let qv = q.flatten_all()?.to_vec1::<f32>()?; // [nh, seq, hd]
            let mut rows = vec![0f32; seq * nh * hd]; // [seq, nh, hd]
            for i in 0..seq {
                for h in 0..nh {
                    rows[(i * nh + h) * hd..(i * nh + h + 1) * hd]
                        .copy_from_slice(&qv[(h * seq + i) * hd..(h * seq + i + 1) * hd]);
                }
            }
            let out = cache
                .attend_tokens(layer, &rows, seq, nh, self.scale as f32, pos + 1)?
                .ok_or_else(|| candle_core::Error::Msg("the KV cache is not on the CPU".into()))?;
            return finish(Tensor::from_vec(out, (seq, nh * hd), x.device())?);
        }
        let total = k_all.dim(2)?;
        // Group the query heads that share a kv head: [1, nkv, n_rep·seq, hd].
        let n_rep = nh / nkv;
        let q = q.reshape((1, nkv, n_rep * seq, hd))?;
        let att = (q.matmul(&k_all.t()?)? * self.scale)?;
        let att =
            match mask {
                Some(m) => att
                    .reshape((1, nkv, n_rep, seq, total))?
                    .broadcast_add(m)?
                    .reshape((1, nkv, n_rep * seq, total))?,
                None => att,
            };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let out = att.matmul(&v_all)?; // [1, nkv, n_rep·seq, hd]
        finish(out.reshape((nh, seq, hd))?.transpose(0, 1)?.reshape((seq, nh * hd))?)
    }
}

/// Passes of at most this many tokens attend row by row with the decode kernel (CPU), which makes
/// their logits bit-identical to token-by-token decoding (speculative verification widths).
pub const EXACT_ROWS_MAX: usize = 32;

/// Additive causal mask `[seq, past + seq]`: query i may see keys `0..=past + i`.
pub fn causal_mask(
    seq: usize,
    past: usize,
    device: &candle_core::Device,
) -> candle_core::Result<Tensor> {
    let total = past + seq;
    let mask: Vec<f32> = (0..seq)
        .flat_map(|i| (0..total).map(move |j| if j <= past + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(mask, (seq, total), device)
}
