//! [`ModelConfig`] from GGUF metadata (llama.cpp's `{arch}.*` keys).

use super::*;
use crate::gguf::GgufFile;

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
