//! The architecture-independent model description, read from GGUF metadata or an HF `config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};

pub use crate::arch::Architecture;
use crate::arch::HfDenseFfn;
use crate::error::{FormatError, Result};
use crate::gguf::GgufFile;
use crate::synthetic::SyntheticRouting;

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
    /// Reads the config from GGUF metadata (`{arch}.block_count`, `{arch}.embedding_length`, …).
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_name = g.get_str("general.architecture")?;
        let expert_count = bounded(
            &g.path,
            "expert_count",
            g.get_u64(&format!("{arch_name}.expert_count")).unwrap_or(0) as usize,
            MAX_EXPERTS,
        )?;
        bounded(
            &g.path,
            "block_count",
            g.get_u64(&format!("{arch_name}.block_count")).unwrap_or(0) as usize,
            MAX_LAYERS,
        )?;
        let arch = Architecture::from_gguf(arch_name, expert_count).ok_or_else(|| {
            FormatError::UnknownArchitecture {
                path: g.path.clone(),
                arch: arch_name.to_string(),
                supported: Architecture::supported(),
            }
        })?;
        let spec = arch.spec();
        let k = |s: &str| format!("{arch_name}.{s}");
        let hidden = g.get_u64(&k("embedding_length"))? as usize;
        let num_heads = g.get_u64(&k("attention.head_count"))? as usize;
        let num_kv_heads =
            g.get_u64(&k("attention.head_count_kv")).map(|v| v as usize).unwrap_or(num_heads);
        let head_dim = g
            .get_u64(&k("attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(hidden / num_heads.max(1));
        let vocab_size = match g.get_u64(&k("vocab_size")) {
            Ok(v) => v as usize,
            Err(_) => g.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let scaling_type = g.get_str(&k("rope.scaling.type")).unwrap_or("none");
        let factor = g.get_f64(&k("rope.scaling.factor")).unwrap_or(1.0);
        let rope_scaling = match scaling_type {
            "linear" if factor != 1.0 => RopeScaling::Linear { factor },
            "yarn" => RopeScaling::Yarn {
                factor,
                original_max_position: g
                    .get_u64(&k("rope.scaling.original_context_length"))
                    .unwrap_or(4096) as usize,
                beta_fast: g.get_f64(&k("rope.scaling.yarn_beta_fast")).unwrap_or(32.0),
                beta_slow: g.get_f64(&k("rope.scaling.yarn_beta_slow")).unwrap_or(1.0),
                attention_factor: None,
            },
            _ => RopeScaling::None,
        };
        let has_output = g.tensors.contains_key("output.weight");
        // Checked for every file: override keys in a file strata synth did not write are an error.
        let synthetic_routing = SyntheticRouting::from_gguf(g)?;
        // qwen35moe files have no dense feed-forward length (every layer is sparse).
        let ffn = match g.get_u64(&k("feed_forward_length")) {
            Ok(v) => v as usize,
            Err(e) => g.get_u64(&k("expert_feed_forward_length")).map_err(|_| e)? as usize,
        };
        let moe = if expert_count > 0 {
            Some(MoeConfig {
                num_experts: expert_count,
                experts_per_token: g.get_u64(&k("expert_used_count"))? as usize,
                expert_intermediate_size: g
                    .get_u64(&k("expert_feed_forward_length"))
                    .map(|v| v as usize)
                    .unwrap_or(ffn),
                norm_topk_prob: g
                    .get_bool(&k("expert_weights_norm"))
                    .unwrap_or(spec.gguf_norm_topk_default()),
                scoring: match g.get_u64(&k("expert_gating_func")) {
                    Ok(2) => RouterScoring::Sigmoid,
                    _ => RouterScoring::Softmax,
                },
                shared_expert_intermediate_size: g
                    .get_u64(&k("expert_shared_feed_forward_length"))
                    .ok()
                    .map(|v| v as usize),
                // GGUF names every layer's tensors; dense layers are those without `ffn_gate_inp`.
                decoder_sparse_step: 1,
                mlp_only_layers: (0..g.get_u64(&k("block_count"))? as usize)
                    .filter(|i| !g.tensors.contains_key(&format!("blk.{i}.ffn_gate_inp.weight")))
                    .collect(),
                synthetic_routing,
            })
        } else {
            None
        };
        let mut cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size: hidden,
            intermediate_size: ffn,
            num_layers: g.get_u64(&k("block_count"))? as usize,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: g.get_f64(&k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
            rope_theta: g.get_f64(&k("rope.freq_base")).unwrap_or(10_000.0),
            rope_dim: g.get_u64(&k("rope.dimension_count")).map(|v| v as usize).unwrap_or(head_dim),
            rope_style: spec.gguf_rope_style(),
            rope_scaling,
            max_position_embeddings: g.get_u64(&k("context_length")).unwrap_or(4096) as usize,
            tie_word_embeddings: !has_output,
            // Any layer: the first layers of hybrid models are linear attention.
            attention_bias: g.tensors.keys().any(|n| n.ends_with(".attn_q.bias")),
            qk_norm: if g.tensors.keys().any(|n| n.ends_with(".attn_q_norm.weight")) {
                spec.qk_norm()
            } else {
                QkNorm::None
            },
            clip_qkv: g.get_f64(&k("attention.clamp_kqv")).ok(),
            moe,
            attn_output_gate: arch.is_hybrid(),
            linear_attn: if arch.is_hybrid() { Some(gguf_linear_attn(g, arch)?) } else { None },
            scales: Scales::default(),
        };
        spec.adjust_gguf(g, &mut cfg)?;
        cfg.validate(&g.path)
    }

    /// Reads the config from an HF `config.json` value.
    pub fn from_hf(path: &Path, v: &serde_json::Value) -> Result<Self> {
        // Image-text checkpoints (qwen3_5_moe) keep the language model's config in `text_config`.
        let v = v.get("text_config").filter(|t| t.is_object()).unwrap_or(v);
        let model_type = v
            .get("model_type")
            .and_then(|m| m.as_str())
            .ok_or_else(|| hf_err(path, "model_type"))?;
        let arch =
            Architecture::from_hf(model_type).ok_or_else(|| FormatError::UnknownArchitecture {
                path: path.to_path_buf(),
                arch: model_type.to_string(),
                supported: Architecture::supported(),
            })?;
        let spec = arch.spec();
        let u = |key: &str| {
            v.get(key).and_then(|x| x.as_u64()).map(|x| x as usize).ok_or_else(|| hf_err(path, key))
        };
        let f = |key: &str| v.get(key).and_then(|x| x.as_f64());
        bounded(path, "num_hidden_layers", u("num_hidden_layers")?, MAX_LAYERS)?;
        let hidden = u("hidden_size")?;
        let num_heads = u("num_attention_heads")?;
        let head_dim = v
            .get("head_dim")
            .and_then(|x| x.as_u64())
            .map(|x| x as usize)
            .unwrap_or(hidden / num_heads.max(1));
        let rope_params =
            v.get("rope_scaling").filter(|x| !x.is_null()).or_else(|| v.get("rope_parameters"));
        let rope_theta = f("rope_theta")
            .or_else(|| rope_params.and_then(|r| r.get("rope_theta")).and_then(|x| x.as_f64()))
            .unwrap_or(10_000.0);
        let rope_scaling = rope_params
            .map(|r| parse_hf_rope_scaling(path, r))
            .transpose()?
            .unwrap_or(RopeScaling::None);
        let partial = f("partial_rotary_factor")
            .or_else(|| {
                rope_params.and_then(|r| r.get("partial_rotary_factor")).and_then(|x| x.as_f64())
            })
            .unwrap_or(1.0);
        let moe = hf_moe_config(path, arch, v)?;
        let expert_sized = moe.as_ref().map_or(0, |m| m.expert_intermediate_size);
        let intermediate_size = match spec.hf_dense_ffn() {
            HfDenseFfn::ExpertSized => expert_sized,
            HfDenseFfn::Optional => u("intermediate_size").unwrap_or(expert_sized),
            HfDenseFfn::Required => u("intermediate_size")?,
        };
        let mut cfg = ModelConfig {
            arch,
            vocab_size: u("vocab_size")?,
            hidden_size: hidden,
            intermediate_size,
            num_layers: u("num_hidden_layers")?,
            num_heads,
            num_kv_heads: u("num_key_value_heads").unwrap_or(num_heads),
            head_dim,
            rms_norm_eps: f("rms_norm_eps").unwrap_or(1e-6),
            rope_theta,
            rope_dim: ((head_dim as f64) * partial) as usize,
            rope_style: RopeStyle::Neox,
            rope_scaling,
            max_position_embeddings: u("max_position_embeddings").unwrap_or(4096),
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(|x| x.as_bool())
                .unwrap_or(false),
            attention_bias: v
                .get("attention_bias")
                .or_else(|| v.get("qkv_bias"))
                .and_then(|x| x.as_bool())
                .unwrap_or(spec.hf_attention_bias_default()),
            qk_norm: spec.qk_norm(),
            clip_qkv: f("clip_qkv"),
            moe,
            attn_output_gate: arch.is_hybrid(),
            linear_attn: if arch.is_hybrid() { Some(hf_linear_attn(path, v)?) } else { None },
            scales: Scales::default(),
        };
        spec.adjust_hf(path, v, &mut cfg)?;
        cfg.validate(path)
    }

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
        if self.num_kv_heads == 0 || self.num_heads % self.num_kv_heads != 0 {
            return bad(format!(
                "{} attention heads is not a multiple of {} kv heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.rope_dim > self.head_dim || self.rope_dim % 2 != 0 {
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
            !m.mlp_only_layers.contains(&i) && (i + 1) % m.decoder_sparse_step == 0
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

/// The MoE part of an HF config (`num_experts` / `num_local_experts`, `num_experts_per_tok`,
/// `moe_intermediate_size`, …); `None` for dense architectures.
fn hf_moe_config(
    path: &Path,
    arch: Architecture,
    v: &serde_json::Value,
) -> Result<Option<MoeConfig>> {
    let spec = arch.spec();
    if !spec.is_moe() {
        return Ok(None);
    }
    let u = |key: &str| v.get(key).and_then(|x| x.as_u64()).map(|x| x as usize);
    let need = |key: &str| u(key).ok_or_else(|| hf_err(path, key));
    let num_experts = u("num_experts")
        .or_else(|| u("num_local_experts"))
        .ok_or_else(|| hf_err(path, "num_experts"))?;
    let expert_intermediate_size = need(spec.hf_expert_intermediate_key())?;
    let mlp_only_layers = v
        .get("mlp_only_layers")
        .and_then(|x| x.as_array())
        .map(|a| a.iter().filter_map(|i| i.as_u64().map(|i| i as usize)).collect())
        .unwrap_or_default();
    Ok(Some(MoeConfig {
        num_experts,
        experts_per_token: need("num_experts_per_tok")?,
        expert_intermediate_size,
        norm_topk_prob: spec.hf_norm_topk_always()
            || v.get("norm_topk_prob").and_then(|x| x.as_bool()).unwrap_or(false),
        scoring: match v.get("scoring_func").and_then(|x| x.as_str()) {
            Some("sigmoid") => RouterScoring::Sigmoid,
            _ => RouterScoring::Softmax,
        },
        shared_expert_intermediate_size: u("shared_expert_intermediate_size").filter(|&s| s > 0),
        decoder_sparse_step: u("decoder_sparse_step").unwrap_or(1).max(1),
        mlp_only_layers,
        synthetic_routing: None,
    }))
}

/// `linear_*` keys and `layer_types` (or `full_attention_interval`) of a Qwen3-Next / Qwen3.5 config.
fn hf_linear_attn(path: &Path, v: &serde_json::Value) -> Result<LinearAttnConfig> {
    let need = |key: &str| {
        v.get(key).and_then(|x| x.as_u64()).map(|x| x as usize).ok_or_else(|| hf_err(path, key))
    };
    let layers = need("num_hidden_layers")?;
    let recurrent_layers = match v.get("layer_types").and_then(|x| x.as_array()) {
        Some(types) => types.iter().map(|t| t.as_str() == Some("linear_attention")).collect(),
        None => LinearAttnConfig::interval_layout(layers, need("full_attention_interval")?),
    };
    Ok(LinearAttnConfig {
        num_k_heads: need("linear_num_key_heads")?,
        num_v_heads: need("linear_num_value_heads")?,
        head_k_dim: need("linear_key_head_dim")?,
        head_v_dim: need("linear_value_head_dim")?,
        conv_kernel: need("linear_conv_kernel_dim")?,
        recurrent_layers,
        head_order: HeadOrder::Grouped,
    })
}

/// llama.cpp's `{arch}.ssm.*` keys: `group_count` key heads of `state_size`, `time_step_rank`
/// value heads sharing `inner_size`, `conv_kernel`; `attention.recurrent_layers` (or
/// `full_attention_interval`).
fn gguf_linear_attn(g: &GgufFile, arch: Architecture) -> Result<LinearAttnConfig> {
    let arch_name = g.get_str("general.architecture")?;
    let k = |s: &str| format!("{arch_name}.{s}");
    let u = |s: &str| g.get_u64(&k(s)).map(|v| v as usize);
    let layers = u("block_count")?;
    let recurrent_layers = match g.get_bool_array(&k("attention.recurrent_layers")) {
        Ok(r) => r,
        Err(_) => LinearAttnConfig::interval_layout(layers, u("full_attention_interval")?),
    };
    let num_v_heads = u("ssm.time_step_rank")?;
    Ok(LinearAttnConfig {
        num_k_heads: u("ssm.group_count")?,
        num_v_heads,
        head_k_dim: u("ssm.state_size")?,
        head_v_dim: u("ssm.inner_size")? / num_v_heads.max(1),
        conv_kernel: u("ssm.conv_kernel")?,
        recurrent_layers,
        head_order: arch.spec().gguf_head_order(),
    })
}

fn parse_hf_rope_scaling(path: &Path, r: &serde_json::Value) -> Result<RopeScaling> {
    let ty =
        r.get("rope_type").or_else(|| r.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
    let g = |k: &str| r.get(k).and_then(|x| x.as_f64());
    let factor = g("factor").unwrap_or(1.0);
    Ok(match ty {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor },
        "yarn" => RopeScaling::Yarn {
            factor,
            original_max_position: g("original_max_position_embeddings").unwrap_or(4096.0) as usize,
            beta_fast: g("beta_fast").unwrap_or(32.0),
            beta_slow: g("beta_slow").unwrap_or(1.0),
            attention_factor: g("attention_factor"),
        },
        "llama3" => RopeScaling::Llama3 {
            factor,
            low_freq_factor: g("low_freq_factor").unwrap_or(1.0),
            high_freq_factor: g("high_freq_factor").unwrap_or(4.0),
            original_max_position: g("original_max_position_embeddings").unwrap_or(8192.0) as usize,
        },
        other => {
            return Err(FormatError::invalid(
                path,
                format!("rope_scaling type `{other}` is not supported"),
            ))
        }
    })
}
