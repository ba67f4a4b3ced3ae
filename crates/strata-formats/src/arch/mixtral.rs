//! Mixtral: transformers `models/mixtral/modeling_mixtral.py` — Llama attention, routed experts
//! (`block_sparse_moe.experts.E.w1/w3/w2`), top-k weights always renormalised. llama.cpp converts
//! it as `llama` with experts.

use super::{Arch, HfDenseFfn};
use crate::config::RopeStyle;

pub struct Mixtral;

impl Arch for Mixtral {
    fn name(&self) -> &'static str {
        "mixtral"
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["mixtral"]
    }
    fn claims_gguf(&self, name: &str, experts: usize) -> bool {
        name == "llama" && experts > 0
    }
    fn gguf_rope_style(&self) -> RopeStyle {
        RopeStyle::Interleaved
    }
    fn is_moe(&self) -> bool {
        true
    }
    fn gguf_norm_topk_default(&self) -> bool {
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
}
