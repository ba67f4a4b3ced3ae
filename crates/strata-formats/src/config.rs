//! The architecture-independent model description, read from GGUF metadata or an HF `config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{FormatError, Result};
use crate::gguf::GgufFile;

/// The architectures Strata implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
}

impl Architecture {
    pub const SUPPORTED: &'static str = "llama, qwen2, qwen3 (GGUF: llama, qwen2, qwen3; HF: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)";

    fn from_gguf(name: &str) -> Option<Self> {
        Some(match name {
            "llama" => Self::Llama,
            "qwen2" => Self::Qwen2,
            "qwen3" => Self::Qwen3,
            _ => return None,
        })
    }

    fn from_hf(model_type: &str) -> Option<Self> {
        Some(match model_type {
            "llama" | "mistral" => Self::Llama,
            "qwen2" => Self::Qwen2,
            "qwen3" => Self::Qwen3,
            _ => return None,
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }
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
    Linear { factor: f64 },
    /// YaRN (Peng et al. 2023, arXiv 2309.00071), as in transformers' `_compute_yarn_parameters`.
    Yarn { factor: f64, original_max_position: usize, beta_fast: f64, beta_slow: f64, attention_factor: Option<f64> },
    /// Llama 3.1 frequency-dependent scaling (transformers `_compute_llama3_parameters`).
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position: usize },
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
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
}

fn hf_err(path: &Path, key: &str) -> FormatError {
    FormatError::MissingKey { path: path.to_path_buf(), key: key.to_string() }
}

impl ModelConfig {
    /// Reads the config from GGUF metadata (`{arch}.block_count`, `{arch}.embedding_length`, …).
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_name = g.get_str("general.architecture")?;
        let arch = Architecture::from_gguf(arch_name).ok_or_else(|| FormatError::UnknownArchitecture {
            path: g.path.clone(),
            arch: arch_name.to_string(),
            supported: Architecture::SUPPORTED.to_string(),
        })?;
        let k = |s: &str| format!("{arch_name}.{s}");
        let hidden = g.get_u64(&k("embedding_length"))? as usize;
        let num_heads = g.get_u64(&k("attention.head_count"))? as usize;
        let num_kv_heads = g.get_u64(&k("attention.head_count_kv")).map(|v| v as usize).unwrap_or(num_heads);
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
                original_max_position: g.get_u64(&k("rope.scaling.original_context_length")).unwrap_or(4096) as usize,
                beta_fast: g.get_f64(&k("rope.scaling.yarn_beta_fast")).unwrap_or(32.0),
                beta_slow: g.get_f64(&k("rope.scaling.yarn_beta_slow")).unwrap_or(1.0),
                attention_factor: None,
            },
            _ => RopeScaling::None,
        };
        let has_output = g.tensors.contains_key("output.weight");
        let cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size: hidden,
            intermediate_size: g.get_u64(&k("feed_forward_length"))? as usize,
            num_layers: g.get_u64(&k("block_count"))? as usize,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: g.get_f64(&k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
            rope_theta: g.get_f64(&k("rope.freq_base")).unwrap_or(10_000.0),
            rope_dim: g.get_u64(&k("rope.dimension_count")).map(|v| v as usize).unwrap_or(head_dim),
            // llama.cpp: LLM_ARCH_LLAMA uses LLAMA_ROPE_TYPE_NORM (its converter permutes q/k);
            // qwen2/qwen3 use LLAMA_ROPE_TYPE_NEOX.
            rope_style: if arch == Architecture::Llama { RopeStyle::Interleaved } else { RopeStyle::Neox },
            rope_scaling,
            max_position_embeddings: g.get_u64(&k("context_length")).unwrap_or(4096) as usize,
            tie_word_embeddings: !has_output,
            attention_bias: g.tensors.contains_key("blk.0.attn_q.bias"),
            qk_norm: g.tensors.contains_key("blk.0.attn_q_norm.weight"),
        };
        cfg.validate(&g.path)
    }

    /// Reads the config from an HF `config.json` value.
    pub fn from_hf(path: &Path, v: &serde_json::Value) -> Result<Self> {
        let model_type = v.get("model_type").and_then(|m| m.as_str()).ok_or_else(|| hf_err(path, "model_type"))?;
        let arch = Architecture::from_hf(model_type).ok_or_else(|| FormatError::UnknownArchitecture {
            path: path.to_path_buf(),
            arch: model_type.to_string(),
            supported: Architecture::SUPPORTED.to_string(),
        })?;
        let u = |key: &str| v.get(key).and_then(|x| x.as_u64()).map(|x| x as usize).ok_or_else(|| hf_err(path, key));
        let f = |key: &str| v.get(key).and_then(|x| x.as_f64());
        let hidden = u("hidden_size")?;
        let num_heads = u("num_attention_heads")?;
        let head_dim = v
            .get("head_dim")
            .and_then(|x| x.as_u64())
            .map(|x| x as usize)
            .unwrap_or(hidden / num_heads.max(1));
        let rope_params = v.get("rope_scaling").filter(|x| !x.is_null()).or_else(|| v.get("rope_parameters"));
        let rope_theta = f("rope_theta")
            .or_else(|| rope_params.and_then(|r| r.get("rope_theta")).and_then(|x| x.as_f64()))
            .unwrap_or(10_000.0);
        let rope_scaling = rope_params.map(|r| parse_hf_rope_scaling(path, r)).transpose()?.unwrap_or(RopeScaling::None);
        let partial = f("partial_rotary_factor").unwrap_or(1.0);
        let cfg = ModelConfig {
            arch,
            vocab_size: u("vocab_size")?,
            hidden_size: hidden,
            intermediate_size: u("intermediate_size")?,
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
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(|x| x.as_bool()).unwrap_or(false),
            attention_bias: v
                .get("attention_bias")
                .and_then(|x| x.as_bool())
                .unwrap_or(arch == Architecture::Qwen2),
            qk_norm: arch == Architecture::Qwen3,
        };
        cfg.validate(path)
    }

    fn validate(self, path: &Path) -> Result<Self> {
        let bad = |m: String| Err(FormatError::invalid(path, m));
        if self.num_layers == 0 || self.hidden_size == 0 || self.num_heads == 0 || self.vocab_size == 0 {
            return bad(format!("config has a zero dimension: {self:?}"));
        }
        if self.num_kv_heads == 0 || self.num_heads % self.num_kv_heads != 0 {
            return bad(format!("{} attention heads is not a multiple of {} kv heads", self.num_heads, self.num_kv_heads));
        }
        if self.rope_dim > self.head_dim || self.rope_dim % 2 != 0 {
            return bad(format!("rope dimension {} does not fit head dim {}", self.rope_dim, self.head_dim));
        }
        Ok(self)
    }

    /// Bytes of KV cache per token (f32 K and V for every layer).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
    }
}

fn parse_hf_rope_scaling(path: &Path, r: &serde_json::Value) -> Result<RopeScaling> {
    let ty = r.get("rope_type").or_else(|| r.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
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
        other => return Err(FormatError::invalid(path, format!("rope_scaling type `{other}` is not supported"))),
    })
}
