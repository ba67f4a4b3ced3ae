//! Qwen3.5-MoE (text model): transformers `models/qwen3_5_moe/modeling_qwen3_5_moe.py` —
//! Qwen3-Next's layer types with separate q/k/v, z, b, a in-projections, no dense feed-forward,
//! top-k weights always renormalised (`Qwen3_5MoeTopKRouter`). llama.cpp's converter reorders the
//! value heads (`HeadOrder::Tiled`) so that ggml can broadcast q/k.

use super::{Arch, HfDenseFfn};
use crate::config::{HeadOrder, QkNorm};

pub struct Qwen35Moe;

impl Arch for Qwen35Moe {
    fn name(&self) -> &'static str {
        "qwen3_5_moe"
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["qwen3_5_moe", "qwen3_5_moe_text"]
    }
    fn claims_gguf(&self, name: &str, _experts: usize) -> bool {
        name == "qwen35moe"
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
    fn hf_norm_topk_always(&self) -> bool {
        true
    }
    fn hf_dense_ffn(&self) -> HfDenseFfn {
        HfDenseFfn::Optional
    }
    fn is_hybrid(&self) -> bool {
        true
    }
    fn gguf_head_order(&self) -> HeadOrder {
        HeadOrder::Tiled
    }
    fn hf_norm_shift(&self) -> f32 {
        1.0
    }
}
