//! The architecture-independent model description, read from GGUF metadata or an HF `config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};

pub use crate::arch::Architecture;
use crate::error::{FormatError, Result};
use crate::synthetic::SyntheticRouting;

mod from_gguf;
mod from_hf;

/// Where q/k RMSNorm applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    None,
    /// Per head over `head_dim` (Qwen3): weights `[head_dim]`.
    PerHead,
    /// Over the whole projection before splitting heads (OLMoE): weights `[heads·head_dim]`.
    Full,
}

/// Order of the value heads of a Gated DeltaNet layer relative to its key heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadOrder {
    /// Value head `h` reads key head `h / (v_heads / k_heads)` (transformers' `repeat_interleave`;
    /// HF checkpoints and llama.cpp's `qwen3next`).
    Grouped,
    /// Value head `h` reads key head `h % k_heads` (llama.cpp's converter reorders `qwen35moe` value
    /// heads so that ggml can broadcast q/k).
    Tiled,
}

/// Gated DeltaNet linear attention (Yang, Kautz, Hatamizadeh 2024, arXiv 2412.06464) as used by
/// Qwen3-Next / Qwen3.5: transformers `models/qwen3_next/modeling_qwen3_next.py`
/// (`Qwen3NextGatedDeltaNet`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinearAttnConfig {
    /// Key (and query) heads.
    pub num_k_heads: usize,
    /// Value heads (a multiple of `num_k_heads`).
    pub num_v_heads: usize,
    pub head_k_dim: usize,
    pub head_v_dim: usize,
    /// Taps of the causal depthwise conv1d over q, k, v.
    pub conv_kernel: usize,
    /// Per layer: `true` for Gated DeltaNet, `false` for full attention.
    pub recurrent_layers: Vec<bool>,
    pub head_order: HeadOrder,
}

impl LinearAttnConfig {
    /// Channels of the conv1d: q, k and v concatenated.
    pub fn conv_dim(&self) -> usize {
        2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim
    }

    /// Bytes of recurrent state per sequence and linear layer (f32 conv window + delta-rule state).
    pub fn state_bytes_per_layer(&self) -> usize {
        4 * ((self.conv_kernel - 1) * self.conv_dim()
            + self.num_v_heads * self.head_k_dim * self.head_v_dim)
    }

    pub fn is_recurrent(&self, layer: usize) -> bool {
        self.recurrent_layers.get(layer).copied().unwrap_or(false)
    }

    /// The layout `full_attention_interval = every` describes: layer `i` is full attention when
    /// `(i + 1) % every == 0`, Gated DeltaNet otherwise (transformers `Qwen3NextConfig`).
    pub fn interval_layout(layers: usize, every: usize) -> Vec<bool> {
        (0..layers).map(|i| (i + 1) % every.max(1) != 0).collect()
    }
}

/// How router logits become expert scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterScoring {
    /// Softmax over all experts, then top-k (Mixtral, Qwen-MoE, OLMoE).
    Softmax,
    /// Independent sigmoid per expert, then top-k (DeepSeek-V3 style; HF `scoring_func: "sigmoid"`).
    Sigmoid,
}

/// Mixture-of-Experts hyper-parameters (Shazeer et al. 2017; Fedus et al. 2021).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Routed experts per MoE layer (E).
    pub num_experts: usize,
    /// Experts each token is routed to (top-k).
    pub experts_per_token: usize,
    /// Intermediate size of one routed expert's SwiGLU.
    pub expert_intermediate_size: usize,
    /// Renormalise the top-k weights to sum to one.
    pub norm_topk_prob: bool,
    pub scoring: RouterScoring,
    /// Intermediate size of the always-active shared expert (qwen2_moe), if any.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Layer `i` is sparse when `(i + 1) % decoder_sparse_step == 0` and `i` is not in `mlp_only_layers`.
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    /// A synthetic model's routing override (`strata synth --routing`); `None` for every model
    /// `strata synth` did not write ([`SyntheticRouting::from_gguf`]).
    #[serde(default)]
    pub synthetic_routing: Option<SyntheticRouting>,
}

/// How rotary embeddings pair up dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeStyle {
    /// Adjacent pairs (x0,x1),(x2,x3)… — ggml's "normal" mode; llama.cpp's converter permutes
    /// Llama q/k weights for it.
    Interleaved,
    /// Halves (x_i, x_{i+d/2}) — HF `rotate_half`, ggml's NEOX mode.
    Neox,
}

/// RoPE frequency scaling (HF `rope_scaling`, GGUF `*.rope.scaling.*`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (Chen et al. 2023, "position interpolation").
    Linear {
        factor: f64,
    },
    /// YaRN (Peng et al. 2023, arXiv 2309.00071), as in transformers' `_compute_yarn_parameters`.
    Yarn {
        factor: f64,
        original_max_position: usize,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: Option<f64>,
    },
    /// Llama 3.1 frequency-dependent scaling (transformers `_compute_llama3_parameters`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: usize,
    },
}

/// Scalar multipliers some architectures put on the Llama layer (Granite's `*_multiplier`s);
/// all 1 (and `attention` `None`: `1/√head_dim`) elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Scales {
    /// Token embeddings are multiplied by this.
    pub embedding: f64,
    /// Each attention / feed-forward output is multiplied by this before the residual add.
    pub residual: f64,
    /// Attention score scale; `None`: `1/√head_dim`.
    pub attention: Option<f64>,
    /// Logits are multiplied by this.
    pub logits: f64,
}

impl Default for Scales {
    fn default() -> Self {
        Self { embedding: 1.0, residual: 1.0, attention: None, logits: 1.0 }
    }
}

impl Scales {
    /// True when every scale is the Llama default.
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// Dimensions and hyper-parameters of a decoder-only transformer of the Llama family.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Number of leading dims of each head that are rotated (== head_dim for full rotary).
    pub rope_dim: usize,
    pub rope_style: RopeStyle,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2).
    pub attention_bias: bool,
    /// RMSNorm of q and k before RoPE (Qwen3 per head, OLMoE over the whole projection).
    pub qk_norm: QkNorm,
    /// Clamp q, k and v to `[-c, c]` after projection (OLMoE `clip_qkv`).
    pub clip_qkv: Option<f64>,
    /// Present for MoE models.
    pub moe: Option<MoeConfig>,
    /// Full attention multiplies its output by `sigmoid(gate)`, the gate computed by the q
    /// projection beside each head's query (Qwen3-Next "gated attention").
    #[serde(default)]
    pub attn_output_gate: bool,
    /// Present for hybrid models (Gated DeltaNet layers).
    #[serde(default)]
    pub linear_attn: Option<LinearAttnConfig>,
    /// Embedding, residual, attention and logit multipliers (Granite).
    #[serde(default)]
    pub scales: Scales,
}

/// Upper bounds on what a config may declare (far above any released model), checked before
/// anything is sized from them: a hostile file's `block_count = 2^40` must be an error, not an
/// allocation.
const MAX_LAYERS: usize = 4096;
const MAX_DIM: usize = 1 << 20;
const MAX_HEADS: usize = 1 << 12;
const MAX_VOCAB: usize = 1 << 22;
const MAX_EXPERTS: usize = 1 << 14;

fn bounded(path: &Path, what: &str, v: usize, max: usize) -> Result<usize> {
    if v > max {
        return Err(FormatError::invalid(
            path,
            format!("{what} = {v} is beyond any supported model (at most {max})"),
        ));
    }
    Ok(v)
}

fn hf_err(path: &Path, key: &str) -> FormatError {
    FormatError::MissingKey { path: path.to_path_buf(), key: key.to_string() }
}

impl ModelConfig {
    fn validate(self, path: &Path) -> Result<Self> {
        let bad = |m: String| Err(FormatError::invalid(path, m));
        bounded(path, "layers", self.num_layers, MAX_LAYERS)?;
        bounded(path, "vocabulary", self.vocab_size, MAX_VOCAB)?;
        for (what, v) in [
            ("hidden size", self.hidden_size),
            ("intermediate size", self.intermediate_size),
            ("head dim", self.head_dim),
        ] {
            bounded(path, what, v, MAX_DIM)?;
        }
        bounded(path, "attention heads", self.num_heads, MAX_HEADS)?;
        bounded(path, "kv heads", self.num_kv_heads, MAX_HEADS)?;
        if let Some(m) = &self.moe {
            bounded(path, "experts", m.num_experts, MAX_EXPERTS)?;
            bounded(path, "expert intermediate size", m.expert_intermediate_size, MAX_DIM)?;
        }
        if let Some(la) = &self.linear_attn {
            for (what, v) in
                [("linear key heads", la.num_k_heads), ("linear value heads", la.num_v_heads)]
            {
                bounded(path, what, v, MAX_HEADS)?;
            }
            for (what, v) in [
                ("linear key head dim", la.head_k_dim),
                ("linear value head dim", la.head_v_dim),
                ("conv kernel", la.conv_kernel),
            ] {
                bounded(path, what, v, MAX_DIM)?;
            }
        }
        if self.num_layers == 0
            || self.hidden_size == 0
            || self.num_heads == 0
            || self.vocab_size == 0
        {
            return bad(format!("config has a zero dimension: {self:?}"));
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} attention heads is not a multiple of {} kv heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return bad(format!(
                "rope dimension {} does not fit head dim {}",
                self.rope_dim, self.head_dim
            ));
        }
        if let Some(la) = &self.linear_attn {
            let ok = la.num_k_heads > 0
                && la.num_v_heads % la.num_k_heads == 0
                && la.head_k_dim > 0
                && la.head_v_dim > 0
                && la.conv_kernel > 0
                && la.recurrent_layers.len() == self.num_layers;
            if !ok {
                return bad(format!(
                    "linear attention config is not valid for {} layers: {la:?}",
                    self.num_layers
                ));
            }
        }
        if let Some(m) = &self.moe {
            if m.num_experts == 0 || m.experts_per_token == 0 || m.experts_per_token > m.num_experts
            {
                return bad(format!(
                    "top-{} of {} experts is not a valid routing",
                    m.experts_per_token, m.num_experts
                ));
            }
            if m.expert_intermediate_size == 0 || m.decoder_sparse_step == 0 {
                return bad(format!("MoE config has a zero dimension: {m:?}"));
            }
        }
        Ok(self)
    }

    /// Whether layer `i` has a sparse MoE block (else a dense SwiGLU of `intermediate_size`).
    /// transformers `Qwen2MoeDecoderLayer.__init__`.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| {
            !m.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(m.decoder_sparse_step)
        })
    }

    /// Whether layer `i` is a Gated DeltaNet layer (recurrent state, no KV cache).
    pub fn is_recurrent_layer(&self, i: usize) -> bool {
        self.linear_attn.as_ref().is_some_and(|la| la.is_recurrent(i))
    }

    /// Layers with full attention (and so a KV cache).
    pub fn attention_layers(&self) -> usize {
        (0..self.num_layers).filter(|&i| !self.is_recurrent_layer(i)).count()
    }

    /// Bytes of KV cache per token (f32 K and V for every full-attention layer).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.attention_layers() * self.num_kv_heads * self.head_dim * 4
    }

    /// Bytes of recurrent state per sequence, independent of its length (0 without linear layers).
    pub fn recurrent_state_bytes(&self) -> usize {
        self.linear_attn.as_ref().map_or(0, |la| {
            la.state_bytes_per_layer() * (self.num_layers - self.attention_layers())
        })
    }
}
