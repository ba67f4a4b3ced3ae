//! Qwen3-MoE: transformers `models/qwen3_moe/modeling_qwen3_moe.py` — routed experts, q/k
//! RMSNorm per head, optional dense layers (`mlp_only_layers`, `decoder_sparse_step`); llama.cpp
//! renormalises the top-k weights.

use super::Arch;
use crate::config::QkNorm;

pub struct Qwen3Moe;

impl Arch for Qwen3Moe {
    fn name(&self) -> &'static str {
        "qwen3_moe"
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["qwen3_moe"]
    }
    fn claims_gguf(&self, name: &str, _experts: usize) -> bool {
        name == "qwen3moe"
    }
    fn qk_norm(&self) -> QkNorm {
        QkNorm::PerHead
    }
    fn is_moe(&self) -> bool {
        true
    }
    fn gguf_norm_topk_default(&self) -> bool {
        true
    }
}
