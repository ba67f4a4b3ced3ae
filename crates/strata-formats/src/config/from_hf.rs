//! [`ModelConfig`] from an HF `config.json` (transformers' `PretrainedConfig` keys).

use super::*;
use crate::arch::HfDenseFfn;

impl ModelConfig {
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
