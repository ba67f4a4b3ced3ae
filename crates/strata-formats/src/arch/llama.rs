//! Llama (and Mistral dense): transformers `models/llama/modeling_llama.py`; llama.cpp
//! `LLM_ARCH_LLAMA` (rope type NORM: its converter permutes q/k for adjacent-pair RoPE).

use super::Arch;
use crate::config::RopeStyle;

pub struct Llama;

impl Arch for Llama {
    fn name(&self) -> &'static str {
        "llama"
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["llama", "mistral"]
    }
    fn claims_gguf(&self, name: &str, experts: usize) -> bool {
        name == "llama" && experts == 0
    }
    fn gguf_rope_style(&self) -> RopeStyle {
        RopeStyle::Interleaved
    }
}
