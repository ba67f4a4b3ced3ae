//! `strata synth --dflash-draft-for TARGET`: a DFlash draft with random weights, in z-lab's
//! checkpoint format (`config.json` with `architectures: ["DFlashDraftModel"]`, bf16
//! safetensors), sized for a target, for benchmarks of the drafting machinery. Its proposals are
//! essentially never accepted (like the fixture's `draft_random`): the worst case the adaptive
//! policy must fall back from.
//!
//! Target layers follow z-lab's `build_target_layer_ids` (`dflash/model.py`): one per draft layer,
//! evenly from layer 1 to layer `n − 3` (Python's round-half-even), the middle layer for a
//! one-layer draft.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use strata_formats::ModelConfig;

use crate::synth::Rng;

/// z-lab's default target layers for a draft of `draft_layers` layers over `target_layers`.
pub fn target_layer_ids(target_layers: usize, draft_layers: usize) -> Vec<usize> {
    if draft_layers <= 1 {
        return vec![target_layers / 2];
    }
    let (start, end) = (1.0, target_layers.saturating_sub(3) as f64);
    (0..draft_layers)
        .map(|i| {
            (start + i as f64 * (end - start) / (draft_layers - 1) as f64).round_ties_even()
                as usize
        })
        .collect()
}

/// Writes `out/config.json` and `out/model.safetensors`: `draft_layers` Qwen3 layers with the
/// target's hidden size, heads and dense FFN size, `block_size`, mask token = the target's last
/// vocabulary id. Weights uniform in ±0.02 (norms 1), from `seed`. Returns the bytes written.
pub fn write_random_dflash_draft(
    target: &ModelConfig,
    out: &Path,
    draft_layers: usize,
    block_size: usize,
    seed: u64,
) -> Result<u64, String> {
    let (h, hd, nh, nkv, inter) = (
        target.hidden_size,
        target.head_dim,
        target.num_heads,
        target.num_kv_heads,
        target.intermediate_size.max(1),
    );
    let ids = target_layer_ids(target.num_layers, draft_layers);
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let config = serde_json::json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": draft_layers,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
        "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings, "vocab_size": target.vocab_size,
        "attention_bias": false, "tie_word_embeddings": false, "hidden_act": "silu",
        "block_size": block_size, "num_target_layers": target.num_layers,
        "dflash_config": {"mask_token_id": target.vocab_size - 1, "target_layer_ids": ids},
        "torch_dtype": "bfloat16",
        "note": "synthetic: random weights (strata synth --dflash-draft-for)"
    });
    let cfg_text = serde_json::to_string_pretty(&config).map_err(|e| e.to_string())?;
    std::fs::write(out.join("config.json"), cfg_text)
        .map_err(|e| format!("{}: {e}", out.display()))?;
    let mut rng = Rng::new(seed);
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut add = |name: String, shape: &[usize], ones: bool| -> Result<(), String> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> =
            if ones { vec![1.0; n] } else { (0..n).map(|_| 0.02 * rng.unit()).collect() };
        let t = Tensor::from_vec(v, shape, &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::BF16))
            .map_err(|e| e.to_string())?;
        tensors.insert(name, t);
        Ok(())
    };
    add("fc.weight".into(), &[h, ids.len() * h], false)?;
    add("hidden_norm.weight".into(), &[h], true)?;
    add("norm.weight".into(), &[h], true)?;
    for i in 0..draft_layers {
        let p = |s: &str| format!("layers.{i}.{s}");
        add(p("input_layernorm.weight"), &[h], true)?;
        add(p("post_attention_layernorm.weight"), &[h], true)?;
        add(p("self_attn.q_proj.weight"), &[nh * hd, h], false)?;
        add(p("self_attn.k_proj.weight"), &[nkv * hd, h], false)?;
        add(p("self_attn.v_proj.weight"), &[nkv * hd, h], false)?;
        add(p("self_attn.o_proj.weight"), &[h, nh * hd], false)?;
        add(p("self_attn.q_norm.weight"), &[hd], true)?;
        add(p("self_attn.k_norm.weight"), &[hd], true)?;
        add(p("mlp.gate_proj.weight"), &[inter, h], false)?;
        add(p("mlp.up_proj.weight"), &[inter, h], false)?;
        add(p("mlp.down_proj.weight"), &[h, inter], false)?;
    }
    let path = out.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    std::fs::metadata(&path).map(|m| m.len()).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// z-lab's rule on published shapes: Qwen3-8B (36 layers) with a 5-layer draft reads
    /// layers 1, 9, 17, 25, 33.
    #[test]
    fn target_layers_follow_zlab() {
        assert_eq!(target_layer_ids(36, 5), [1, 9, 17, 25, 33]);
        assert_eq!(target_layer_ids(48, 5), [1, 12, 23, 34, 45]);
        assert_eq!(target_layer_ids(48, 1), [24]);
        // Halves round to even as Python's round does: 1 + 1.5 = 2.5 → 2.
        assert_eq!(target_layer_ids(7, 3), [1, 2, 4]);
    }
}
