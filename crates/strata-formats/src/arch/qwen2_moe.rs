//! Qwen1.5-MoE / Qwen2-MoE: transformers `models/qwen2_moe/modeling_qwen2_moe.py` — routed
//! experts plus a sigmoid-gated shared expert, q/k/v biases, no top-k renormalisation by default.

use super::Arch;

pub struct Qwen2Moe;

impl Arch for Qwen2Moe {
    fn name(&self) -> &'static str {
        "qwen2_moe"
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["qwen2_moe"]
    }
    fn claims_gguf(&self, name: &str, _experts: usize) -> bool {
        name == "qwen2moe"
    }
    fn is_moe(&self) -> bool {
        true
    }
    fn hf_attention_bias_default(&self) -> bool {
        true
    }
}
