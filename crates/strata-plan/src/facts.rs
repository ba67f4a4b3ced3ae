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
    /// Bytes of the copies candle makes of dense Q4_K / Q6_K matmul weights on x86 and keeps:
    /// a one-token (GEMV) pack at 4/3 of their size, and, on CPUs with AVX-512 VNNI, a second
    /// pack for multi-token passes (prefill, verification) at 2× of the matrices those passes
    /// use (all but the token embedding and lm_head). Measured on the synthetic Qwen3-30B-A3B
    /// (48 layers: 0.99 GB more after a 43-token prefill than after one token, for 0.51 GB of
    /// attention weights; docs/performance.md, "Realistic routing").
    pub dense_repack_bytes: u64,
    /// Memory the dense weights take once loaded: stored bytes, safetensors floats widened to f32,
    /// plus the repacked copies.
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
        let (
            mut total_params,
            mut expert_params,
            mut dense_bytes,
            mut expert_bytes,
            mut repack,
            mut per_token,
        ) = (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
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
            if t.shape.len() == 2
                && matches!(t.dtype.as_str(), "Q4K" | "Q6K")
                && (!is_embedding || tied)
                && cfg!(target_arch = "x86_64")
            {
                repack += t.bytes * 4 / 3;
                let lm_head =
                    is_embedding || t.name == "output.weight" || t.name == "lm_head.weight";
                if !lm_head && avx512_vnni() {
                    repack += t.bytes * 2;
                }
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
            dense_repack_bytes: repack,
            dense_memory_bytes: dense_mem + repack,
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

/// Whether candle's x86 multi-token repack runs on this CPU (its `X86Level::Avx512Vnni`).
fn avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
