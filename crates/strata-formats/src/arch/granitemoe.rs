//! IBM Granite MoE (granite-3.x-*-a*b): transformers `models/granitemoe/modeling_granitemoe.py`.
//! Mixtral's layer with four scalars: embeddings × `embedding_multiplier`, attention scores ×
//! `attention_multiplier` (instead of `1/√head_dim`), each sub-layer's output ×
//! `residual_multiplier` before the residual add, logits ÷ `logits_scaling`. The router
//! (`block_sparse_moe.router.layer`) takes the softmax of the top-k logits — the renormalised
//! top-k of the full softmax. Experts are fused: `block_sparse_moe.input_linear` `[E, 2I, H]`
//! (gate rows, then up) and `block_sparse_moe.output_linear` `[E, H, I]`.

use std::path::Path;

use super::{Arch, HfDenseFfn};
use crate::config::ModelConfig;
use crate::error::{FormatError, Result};

pub struct GraniteMoe;

impl Arch for GraniteMoe {
    fn name(&self) -> &'static str {
        "granitemoe"
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["granitemoe"]
    }
    fn is_moe(&self) -> bool {
        true
    }
    fn hf_expert_intermediate_key(&self) -> &'static str {
        "intermediate_size"
    }
    fn hf_norm_topk_always(&self) -> bool {
        true
    }
    fn hf_dense_ffn(&self) -> HfDenseFfn {
        HfDenseFfn::ExpertSized
    }
    fn hf_layer_tensor(&self, gguf_stem: &str) -> Option<&'static str> {
        (gguf_stem == "ffn_gate_inp").then_some("block_sparse_moe.router.layer")
    }
    fn hf_fused_experts(&self) -> Option<(&'static str, &'static str)> {
        Some(("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight"))
    }
    fn adjust_hf(&self, path: &Path, v: &serde_json::Value, cfg: &mut ModelConfig) -> Result<()> {
        let f = |k: &str, default: f64| v.get(k).and_then(|x| x.as_f64()).unwrap_or(default);
        let logits_scaling = f("logits_scaling", 1.0);
        if !(logits_scaling.is_finite() && logits_scaling != 0.0) {
            return Err(FormatError::invalid(
                path,
                format!("logits_scaling = {logits_scaling} is not a finite non-zero number"),
            ));
        }
        cfg.scales.embedding = f("embedding_multiplier", 1.0);
        cfg.scales.residual = f("residual_multiplier", 1.0);
        cfg.scales.attention = v.get("attention_multiplier").and_then(|x| x.as_f64());
        cfg.scales.logits = 1.0 / logits_scaling;
        Ok(())
    }
}
