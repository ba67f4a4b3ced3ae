//! Tensor names. Model code uses llama.cpp's GGUF names (`token_embd.weight`,
//! `blk.N.attn_q.weight`, …); [`gguf_to_hf`] maps them onto transformers' names.

use crate::arch::Arch;

/// HF names a GGUF tensor may have, most common first (Mixtral checkpoints name the MoE block
/// `block_sparse_moe`, the Qwen and OLMoE ones `mlp`).
///
/// A name with no GGUF mapping is its own (only) candidate: tensors that exist only in HF
/// checkpoints (a DFlash draft's `fc.weight`) are loaded by their HF name.
pub fn gguf_to_hf_candidates(name: &str) -> Vec<String> {
    let Some(primary) = gguf_to_hf(name) else { return vec![name.to_string()] };
    let alt = primary
        .contains(".mlp.gate.")
        .then(|| primary.replace(".mlp.gate.", ".block_sparse_moe.gate."));
    // Image-text checkpoints (qwen3_5_moe) nest the language model under `model.language_model.`;
    // DFlash drafts (z-lab) store their layers without the `model.` prefix (`layers.0.…`, `norm`).
    let rest = primary.strip_prefix("model.").map(str::to_string);
    let nested = rest.as_ref().map(|rest| format!("model.language_model.{rest}"));
    std::iter::once(primary).chain(alt).chain(nested).chain(rest).collect()
}

/// The HF name of a layer tensor that `arch` names its own way ([`Arch::hf_layer_tensor`]).
pub fn arch_hf_name(arch: &dyn Arch, name: &str) -> Option<String> {
    let (layer, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    let (stem, suffix) = rest.rsplit_once('.')?;
    Some(format!("model.layers.{layer}.{}.{suffix}", arch.hf_layer_tensor(stem)?))
}

/// Maps a GGUF tensor name to the HF (transformers) name of the same tensor, if there is one.
pub fn gguf_to_hf(name: &str) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    // Gated DeltaNet tensors whose HF name has no `.weight` suffix; the loader converts values
    // (`ssm_a = -exp(A_log)`).
    let bare = match rest {
        "ssm_a" => Some("linear_attn.A_log"),
        "ssm_dt.bias" => Some("linear_attn.dt_bias"),
        _ => None,
    };
    if let Some(b) = bare {
        return Some(format!("model.layers.{layer}.{b}"));
    }
    let (stem, suffix) = rest.rsplit_once('.')?;
    let hf = match stem {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "ffn_gate_inp" => "mlp.gate",
        "ffn_gate_inp_shexp" => "mlp.shared_expert_gate",
        "ffn_gate_shexp" => "mlp.shared_expert.gate_proj",
        "ffn_up_shexp" => "mlp.shared_expert.up_proj",
        "ffn_down_shexp" => "mlp.shared_expert.down_proj",
        // Qwen3-Next / Qwen3.5 (hybrid) names.
        "post_attention_norm" => "post_attention_layernorm",
        "attn_qkv" => "linear_attn.in_proj_qkv",
        "attn_gate" => "linear_attn.in_proj_z",
        "ssm_beta" => "linear_attn.in_proj_b",
        "ssm_alpha" => "linear_attn.in_proj_a",
        "ssm_ba" => "linear_attn.in_proj_ba",
        // Qwen3-Next's fused q/k/v/z projection (llama.cpp's converter splits it into attn_qkv
        // and attn_gate).
        "ssm_in" => "linear_attn.in_proj_qkvz",
        "ssm_conv1d" => "linear_attn.conv1d",
        "ssm_norm" => "linear_attn.norm",
        "ssm_out" => "linear_attn.out_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_layer_and_global_names() {
        assert_eq!(
            gguf_to_hf("blk.12.attn_q.weight").as_deref(),
            Some("model.layers.12.self_attn.q_proj.weight")
        );
        assert_eq!(
            gguf_to_hf("blk.0.attn_q.bias").as_deref(),
            Some("model.layers.0.self_attn.q_proj.bias")
        );
        assert_eq!(
            gguf_to_hf("blk.3.ffn_down.weight").as_deref(),
            Some("model.layers.3.mlp.down_proj.weight")
        );
        assert_eq!(gguf_to_hf("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(gguf_to_hf("blk.3.unknown.weight"), None);
        assert_eq!(
            gguf_to_hf_candidates("blk.1.ffn_gate_inp.weight"),
            [
                "model.layers.1.mlp.gate.weight",
                "model.layers.1.block_sparse_moe.gate.weight",
                "model.language_model.layers.1.mlp.gate.weight",
                "layers.1.mlp.gate.weight"
            ]
        );
        assert_eq!(
            gguf_to_hf("blk.0.ffn_up_shexp.weight").as_deref(),
            Some("model.layers.0.mlp.shared_expert.up_proj.weight")
        );
        assert_eq!(gguf_to_hf("blk.2.ssm_a").as_deref(), Some("model.layers.2.linear_attn.A_log"));
        assert_eq!(
            gguf_to_hf("blk.2.ssm_dt.bias").as_deref(),
            Some("model.layers.2.linear_attn.dt_bias")
        );
        assert_eq!(
            gguf_to_hf("blk.2.ssm_conv1d.weight").as_deref(),
            Some("model.layers.2.linear_attn.conv1d.weight")
        );
        assert_eq!(
            gguf_to_hf_candidates("blk.0.attn_norm.weight"),
            [
                "model.layers.0.input_layernorm.weight",
                "model.language_model.layers.0.input_layernorm.weight",
                "layers.0.input_layernorm.weight"
            ]
        );
        assert_eq!(gguf_to_hf_candidates("fc.weight"), ["fc.weight"]);
    }
}
