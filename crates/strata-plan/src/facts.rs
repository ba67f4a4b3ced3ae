//! What a model is, from metadata and tensor tables only (no weight bytes read).

use serde::Serialize;
use strata_formats::{ModelConfig, ModelFiles, Result};

/// Facts about a model that the plan needs.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ModelFacts {
    pub path: String,
    pub architecture: String,
    pub layers: usize,
    pub hidden: usize,
    pub vocab: usize,
    /// Parameters of every tensor.
    pub total_params: u64,
    /// Parameters used per token: everything but the routed experts not selected.
    pub active_params: u64,
    /// The type holding most weight bytes (`Q4K`, `BF16`, …).
    pub quantization: String,
    /// Routed experts per MoE layer (0 for dense models).
    pub experts: usize,
    pub experts_per_token: usize,
    pub moe_layers: usize,
    /// Bytes of everything but routed experts, as stored.
    pub dense_bytes: u64,
    /// Bytes of all routed experts, as stored.
    pub expert_bytes: u64,
    /// Bytes of one expert (gate + up + down), as stored.
    pub bytes_per_expert: u64,
    /// Routed-expert bytes one token touches: MoE layers × top-k × bytes per expert.
    pub expert_bytes_per_token: u64,
    /// Memory the dense weights take once loaded: stored bytes (our CPU kernels for Q4_0, Q4_1,
    /// Q8_0 and Q4_K/Q5_K/Q6_K read them as stored, no repacked copies), safetensors floats
    /// widened to f32.
    pub dense_memory_bytes: u64,
    /// Memory all routed experts take when resident (safetensors floats widened to f32).
    pub expert_memory_bytes: u64,
    /// Bytes a decode step reads from dense weights (all but the token embedding, which is a
    /// lookup; included when tied as lm_head).
    pub dense_bytes_per_token: u64,
    /// KV cache bytes per token of context (f32 K and V, every full-attention layer).
    pub kv_bytes_per_token: u64,
    /// Recurrent state of a sequence (Gated DeltaNet layers of hybrid models), twice: the live
    /// state and speculative decoding's checkpoint copy. 0 for attention-only models.
    #[serde(default)]
    pub recurrent_state_bytes: u64,
}

impl ModelFacts {
    /// Errors: the config cannot be read (unknown architecture, missing keys).
    pub fn read(files: &ModelFiles) -> Result<Self> {
        let cfg: ModelConfig = files.config()?;
        let table = files.tensor_table();
        let mut by_type: std::collections::HashMap<String, u64> = Default::default();
        let (mut total_params, mut expert_params, mut dense_bytes, mut expert_bytes, mut per_token) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        let (mut dense_mem, mut expert_mem) = (0u64, 0u64);
        // Safetensors weights are held as f32.
        let memory = |t: &strata_formats::TensorEntry| {
            if matches!(files, ModelFiles::Hf(_)) {
                t.elements() * 4
            } else {
                t.bytes
            }
        };
        let tied = !table.iter().any(|t| t.name == "output.weight" || t.name == "lm_head.weight");
        for t in &table {
            *by_type.entry(t.dtype.clone()).or_default() += t.bytes;
            total_params += t.elements();
            if t.is_routed_expert() {
                expert_params += t.elements();
                expert_bytes += t.bytes;
                expert_mem += memory(t);
                continue;
            }
            dense_bytes += t.bytes;
            dense_mem += memory(t);
            let is_embedding = t.name.contains("token_embd") || t.name.contains("embed_tokens");
            if !is_embedding || tied {
                per_token += t.bytes;
            }
        }
        let quantization =
            by_type.into_iter().max_by_key(|(_, b)| *b).map(|(d, _)| d).unwrap_or_default();
        let (experts, k) =
            cfg.moe.as_ref().map_or((0, 0), |m| (m.num_experts, m.experts_per_token));
        let moe_layers =
            (0..cfg.num_layers).filter(|&l| cfg.moe.is_some() && cfg.is_moe_layer(l)).count();
        let n_experts = (experts * moe_layers) as u64;
        let bytes_per_expert = expert_bytes.checked_div(n_experts).unwrap_or(0);
        let active_params = total_params - expert_params
            + expert_params.checked_div(n_experts).unwrap_or(0) * (k * moe_layers) as u64;
        Ok(Self {
            path: files.path().display().to_string(),
            architecture: format!("{:?}", cfg.arch),
            layers: cfg.num_layers,
            hidden: cfg.hidden_size,
            vocab: cfg.vocab_size,
            total_params,
            active_params,
            quantization,
            experts,
            experts_per_token: k,
            moe_layers,
            dense_bytes,
            expert_bytes,
            bytes_per_expert,
            expert_bytes_per_token: bytes_per_expert * (k * moe_layers) as u64,
            dense_memory_bytes: dense_mem,
            expert_memory_bytes: expert_mem,
            dense_bytes_per_token: per_token,
            kv_bytes_per_token: cfg.kv_bytes_per_token() as u64,
            recurrent_state_bytes: 2 * cfg.recurrent_state_bytes() as u64,
        })
    }

    pub fn is_moe(&self) -> bool {
        self.experts > 0 && self.expert_bytes > 0
    }
}
