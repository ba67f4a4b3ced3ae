//! Qwen3-Next: transformers `models/qwen3_next/modeling_qwen3_next.py` — Gated DeltaNet layers
//! beside gated full attention, routed experts plus a sigmoid-gated shared expert; HF norms
//! store `w` for `(1 + w)`.

use super::Arch;
use crate::config::QkNorm;

pub struct Qwen3Next;

impl Arch for Qwen3Next {
    fn name(&self) -> &'static str {
        "qwen3_next"
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["qwen3_next"]
    }
    fn claims_gguf(&self, name: &str, _experts: usize) -> bool {
        name == "qwen3next"
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
    fn is_hybrid(&self) -> bool {
        true
    }
    fn hf_norm_shift(&self) -> f32 {
        1.0
    }
}
