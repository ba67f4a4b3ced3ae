//! One file per architecture: how its GGUF metadata and HF `config.json` map onto
//! [`ModelConfig`], its tensor names, and its norm / RoPE / head-order conventions, behind the
//! [`Arch`] trait. [`REGISTRY`] lists them; the rest of Strata (the generic transformer in
//! `strata-models`, the plan, the expert store) reads only [`ModelConfig`] and these methods.
//!
//! Adding an architecture: a file here implementing [`Arch`] and one line in [`REGISTRY`]
//! (`granitemoe.rs` was added that way).

mod granitemoe;
mod llama;
mod mixtral;
mod olmoe;
mod qwen2;
mod qwen2_moe;
mod qwen3;
mod qwen3_5_moe;
mod qwen3_moe;
mod qwen3_next;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::config::{HeadOrder, ModelConfig, QkNorm, RopeStyle};
use crate::error::Result;
use crate::gguf::GgufFile;

/// Every architecture Strata runs.
pub static REGISTRY: &[&dyn Arch] = &[
    &llama::Llama,
    &qwen2::Qwen2,
    &qwen3::Qwen3,
    &qwen2_moe::Qwen2Moe,
    &qwen3_moe::Qwen3Moe,
    &mixtral::Mixtral,
    &olmoe::Olmoe,
    &qwen3_next::Qwen3Next,
    &qwen3_5_moe::Qwen35Moe,
    &granitemoe::GraniteMoe,
];

/// Whether an HF architecture has a dense feed-forward `intermediate_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfDenseFfn {
    /// `intermediate_size` is required (dense models, Qwen-MoE's dense layers).
    Required,
    /// No dense feed-forward: `intermediate_size` is the routed expert's (Mixtral, OLMoE).
    ExpertSized,
    /// No dense feed-forward; `intermediate_size` is used when present (Qwen3.5-MoE).
    Optional,
}

/// An architecture's description. Defaults are the Llama family's conventions; each file
/// overrides what its architecture does differently, citing the reference it follows
/// (transformers' `modeling_<arch>.py`, llama.cpp's `llama-model.cpp` / converter).
pub trait Arch: Sync {
    /// Canonical name (the HF `model_type` spelling): `qwen3_moe`.
    fn name(&self) -> &'static str;
    /// HF `model_type` values this architecture reads.
    fn hf_model_types(&self) -> &'static [&'static str];
    /// Whether a GGUF file with `general.architecture = name` and `experts` routed experts per
    /// layer is this architecture.
    fn claims_gguf(&self, _name: &str, _experts: usize) -> bool {
        false
    }

    /// q/k RMSNorm before RoPE (used when the file has the norm tensors).
    fn qk_norm(&self) -> QkNorm {
        QkNorm::None
    }
    /// RoPE pairing of GGUF files (llama.cpp's `LLAMA_ROPE_TYPE_*` for the architecture); HF
    /// checkpoints always use NEOX-style halves.
    fn gguf_rope_style(&self) -> RopeStyle {
        RopeStyle::Neox
    }
    /// Whether routed experts exist (HF configs; GGUF files say it with `expert_count`).
    fn is_moe(&self) -> bool {
        false
    }
    /// llama.cpp's default for `expert_weights_norm` (renormalise the top-k weights) when the
    /// GGUF file does not say.
    fn gguf_norm_topk_default(&self) -> bool {
        false
    }
    /// The HF key of a routed expert's intermediate size.
    fn hf_expert_intermediate_key(&self) -> &'static str {
        "moe_intermediate_size"
    }
    /// HF routers that renormalise the top-k weights whatever `norm_topk_prob` says.
    fn hf_norm_topk_always(&self) -> bool {
        false
    }
    /// How the HF config's `intermediate_size` is read.
    fn hf_dense_ffn(&self) -> HfDenseFfn {
        HfDenseFfn::Required
    }
    /// q/k/v bias when the HF config has no `attention_bias` / `qkv_bias` key.
    fn hf_attention_bias_default(&self) -> bool {
        false
    }
    /// Hybrid models: Gated DeltaNet layers beside gated full attention (`linear_*` config keys,
    /// `ssm_*` GGUF keys).
    fn is_hybrid(&self) -> bool {
        false
    }
    /// Value-head order of GGUF Gated DeltaNet layers.
    fn gguf_head_order(&self) -> HeadOrder {
        HeadOrder::Grouped
    }
    /// Added to every RMSNorm weight of HF checkpoints (hybrids store `w` for `(1 + w)`;
    /// llama.cpp's converter adds the 1).
    fn hf_norm_shift(&self) -> f32 {
        0.0
    }
    /// HF name of a layer tensor whose GGUF stem (`ffn_gate_inp`) this architecture names its
    /// own way, without the `model.layers.L.` prefix and the suffix (`block_sparse_moe.router.layer`).
    fn hf_layer_tensor(&self, _gguf_stem: &str) -> Option<&'static str> {
        None
    }
    /// HF names of a layer's fused routed experts, `[E, 2I, H]` (gate rows, then up) and
    /// `[E, H, I]`, under `model.layers.L.`, when they differ from transformers'
    /// `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`.
    fn hf_fused_experts(&self) -> Option<(&'static str, &'static str)> {
        None
    }
    /// Architecture-specific HF keys beyond the common ones (scales, multipliers).
    fn adjust_hf(
        &self,
        _path: &std::path::Path,
        _v: &serde_json::Value,
        _cfg: &mut ModelConfig,
    ) -> Result<()> {
        Ok(())
    }
    /// Architecture-specific GGUF keys beyond the common ones.
    fn adjust_gguf(&self, _g: &GgufFile, _cfg: &mut ModelConfig) -> Result<()> {
        Ok(())
    }
}

/// The architecture of a model: a registry entry (compares and serialises by name).
#[derive(Clone, Copy)]
pub struct Architecture(&'static dyn Arch);

impl Architecture {
    /// Names accepted, for error messages.
    pub fn supported() -> String {
        let names: Vec<&str> = REGISTRY.iter().map(|a| a.name()).collect();
        let hf: Vec<&str> =
            REGISTRY.iter().flat_map(|a| a.hf_model_types().iter().copied()).collect();
        format!("{} (HF model_type: {})", names.join(", "), hf.join(", "))
    }

    /// The architecture of a GGUF file's `general.architecture` with `experts` routed experts.
    pub fn from_gguf(name: &str, experts: usize) -> Option<Self> {
        REGISTRY.iter().find(|a| a.claims_gguf(name, experts)).map(|a| Self(*a))
    }

    /// The architecture of an HF `model_type`.
    pub fn from_hf(model_type: &str) -> Option<Self> {
        REGISTRY.iter().find(|a| a.hf_model_types().contains(&model_type)).map(|a| Self(*a))
    }

    /// The architecture named `name` ([`Arch::name`]).
    pub fn by_name(name: &str) -> Option<Self> {
        REGISTRY.iter().find(|a| a.name() == name).map(|a| Self(*a))
    }

    pub fn name(&self) -> &'static str {
        self.0.name()
    }

    /// Its description.
    pub fn spec(&self) -> &'static dyn Arch {
        self.0
    }

    pub fn is_hybrid(&self) -> bool {
        self.0.is_hybrid()
    }
}

impl std::fmt::Debug for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl PartialEq for Architecture {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl Eq for Architecture {}

impl Serialize for Architecture {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Architecture {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Self::by_name(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown architecture `{name}`")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_resolve() {
        let mut names: Vec<&str> = REGISTRY.iter().map(|a| a.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), REGISTRY.len());
        for a in REGISTRY {
            for t in a.hf_model_types() {
                assert_eq!(Architecture::from_hf(t).map(|x| x.name()), Some(a.name()));
            }
        }
        assert_eq!(Architecture::from_gguf("llama", 0).map(|a| a.name()), Some("llama"));
        assert_eq!(Architecture::from_gguf("llama", 8).map(|a| a.name()), Some("mixtral"));
        assert_eq!(
            Architecture::from_gguf("qwen35moe", 256).map(|a| a.name()),
            Some("qwen3_5_moe")
        );
        assert!(Architecture::from_gguf("mamba9", 0).is_none());
    }
}
