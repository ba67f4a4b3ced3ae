//! Qwen3 dense: transformers `models/qwen3/modeling_qwen3.py` (q/k RMSNorm per head).

use super::Arch;
use crate::config::QkNorm;

pub struct Qwen3;

impl Arch for Qwen3 {
    fn name(&self) -> &'static str {
        "qwen3"
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["qwen3"]
    }
    fn claims_gguf(&self, name: &str, _experts: usize) -> bool {
        name == "qwen3"
    }
    fn qk_norm(&self) -> QkNorm {
        QkNorm::PerHead
    }
}
