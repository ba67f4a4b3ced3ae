//! OLMoE: transformers `models/olmoe/modeling_olmoe.py` — q/k RMSNorm over the whole projection,
//! optional q/k/v clipping, routed experts without renormalisation.

use super::{Arch, HfDenseFfn};
use crate::config::QkNorm;

pub struct Olmoe;

impl Arch for Olmoe {
    fn name(&self) -> &'static str {
        "olmoe"
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &["olmoe"]
    }
    fn claims_gguf(&self, name: &str, _experts: usize) -> bool {
        name == "olmoe"
    }
    fn qk_norm(&self) -> QkNorm {
        QkNorm::Full
    }
    fn is_moe(&self) -> bool {
        true
    }
    fn hf_expert_intermediate_key(&self) -> &'static str {
        "intermediate_size"
    }
    fn hf_dense_ffn(&self) -> HfDenseFfn {
        HfDenseFfn::ExpertSized
    }
}
