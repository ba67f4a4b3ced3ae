//! Qwen2 / Qwen2.5: transformers `models/qwen2/modeling_qwen2.py` (q/k/v biases).

use super::Arch;

pub struct Qwen2;

impl Arch for Qwen2 {
    fn name(&self) -> &'static str {
        "qwen2"
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["qwen2"]
    }
    fn claims_gguf(&self, name: &str, _experts: usize) -> bool {
        name == "qwen2"
    }
    fn hf_attention_bias_default(&self) -> bool {
        true
    }
}
