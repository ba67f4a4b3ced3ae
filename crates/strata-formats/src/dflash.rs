//! DFlash draft checkpoints (block-diffusion drafting, z-lab, arXiv 2602.06036; reference
//! implementation `dflash/model.py` of github.com/z-lab/dflash): an HF directory whose `config.json`
//! has `architectures: ["DFlashDraftModel"]`, a Qwen3 decoder-layer config, `block_size` and
//! `dflash_config: {mask_token_id, target_layer_ids}`, and safetensors with `fc [H, k·H]`,
//! `hidden_norm`, `norm` and `layers.i.*` (no embeddings, no lm_head: the draft uses the target's).

use serde_json::Value as Json;

use crate::error::{FormatError, Result};
use crate::model_files::ModelFiles;

/// The DFlash-specific part of a draft's config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DFlashConfig {
    /// Tokens per drafted block: the last committed token and `block_size − 1` mask tokens
    /// (`block_size`, default 16 as in z-lab's code).
    pub block_size: usize,
    /// The token id that fills a block's undecided positions.
    pub mask_token_id: u32,
    /// Target decoder layers whose outputs (concatenated in this order) condition the draft.
    pub target_layer_ids: Vec<usize>,
    /// Layers of the target the draft was trained on (`num_target_layers`), when stated.
    pub num_target_layers: Option<usize>,
}

impl DFlashConfig {
    /// Reads the config of a DFlash draft directory. Like z-lab's `_draft_value`, a key is looked
    /// up in `dflash_config` first, then at the top level.
    ///
    /// Errors: not an HF directory, `architectures` does not name `DFlashDraftModel`, or
    /// `mask_token_id` / `target_layer_ids` are missing or malformed.
    pub fn from_files(files: &ModelFiles) -> Result<Self> {
        let ModelFiles::Hf(h) = files else {
            return Err(FormatError::invalid(
                files.path(),
                "a DFlash draft is an HF directory (config.json + safetensors), not a GGUF file",
            ));
        };
        let path = h.dir.join("config.json");
        Self::from_json(&h.config).map_err(|m| FormatError::invalid(&path, m))
    }

    fn from_json(cfg: &Json) -> std::result::Result<Self, String> {
        let archs: Vec<&str> = cfg
            .get("architectures")
            .and_then(Json::as_array)
            .map(|a| a.iter().filter_map(Json::as_str).collect())
            .unwrap_or_default();
        if !archs.iter().any(|a| a.starts_with("DFlash")) {
            return Err(format!(
                "not a DFlash draft: architectures is {archs:?}, expected [\"DFlashDraftModel\"]"
            ));
        }
        if archs.iter().any(|a| *a != "DFlashDraftModel") {
            return Err(format!(
                "unsupported DFlash variant {archs:?}: only DFlashDraftModel is implemented"
            ));
        }
        let value =
            |k: &str| cfg.get("dflash_config").and_then(|d| d.get(k)).or_else(|| cfg.get(k));
        let uint = |k: &str| value(k).and_then(Json::as_u64);
        let mask_token_id =
            uint("mask_token_id").ok_or("`dflash_config.mask_token_id` is missing")?;
        let ids = value("target_layer_ids")
            .and_then(Json::as_array)
            .ok_or("`dflash_config.target_layer_ids` is missing")?;
        let target_layer_ids: Vec<usize> = ids
            .iter()
            .map(|v| v.as_u64().map(|x| x as usize))
            .collect::<Option<_>>()
            .ok_or("`target_layer_ids` must be non-negative integers")?;
        if target_layer_ids.is_empty() {
            return Err("`target_layer_ids` is empty".into());
        }
        let block_size = uint("block_size").unwrap_or(16) as usize;
        if block_size < 2 {
            return Err(format!("block_size {block_size}: a block needs the anchor token and at least one mask position"));
        }
        Ok(Self {
            block_size,
            mask_token_id: u32::try_from(mask_token_id)
                .map_err(|_| format!("mask_token_id {mask_token_id} is out of range"))?,
            target_layer_ids,
            num_target_layers: uint("num_target_layers").map(|n| n as usize),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_nested_and_top_level_keys() {
        let j: Json = serde_json::json!({
            "architectures": ["DFlashDraftModel"], "block_size": 8,
            "dflash_config": {"mask_token_id": 511, "target_layer_ids": [1, 2]}, "num_target_layers": 5
        });
        let c = DFlashConfig::from_json(&j).unwrap();
        assert_eq!(
            c,
            DFlashConfig {
                block_size: 8,
                mask_token_id: 511,
                target_layer_ids: vec![1, 2],
                num_target_layers: Some(5)
            }
        );
        let j: Json = serde_json::json!({"architectures": ["DFlashDraftModel"], "mask_token_id": 7, "target_layer_ids": [0]});
        assert_eq!(DFlashConfig::from_json(&j).unwrap().block_size, 16);
    }

    #[test]
    fn rejects_other_models_and_missing_keys() {
        let e =
            DFlashConfig::from_json(&serde_json::json!({"architectures": ["Qwen3ForCausalLM"]}))
                .unwrap_err();
        assert!(e.contains("not a DFlash draft"), "{e}");
        let e = DFlashConfig::from_json(
            &serde_json::json!({"architectures": ["DFlashDraftModel"], "target_layer_ids": [1]}),
        )
        .unwrap_err();
        assert!(e.contains("mask_token_id"), "{e}");
        let e = DFlashConfig::from_json(&serde_json::json!({"architectures": ["DFlash2DraftModel"], "mask_token_id": 1, "target_layer_ids": [1]})).unwrap_err();
        assert!(e.contains("only DFlashDraftModel"), "{e}");
    }
}
