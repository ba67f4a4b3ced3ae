//! [`ModelFiles`]: one opened model, GGUF or HF directory, detected from the path.

use std::path::{Path, PathBuf};

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use serde_json::Value as Json;

use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::{FormatError, Result};
use crate::gguf::GgufFile;
use crate::names::{arch_hf_name, gguf_to_hf_candidates};
use crate::safetensors::{hf_weight_files, SafetensorsSet};
use crate::tokenizer::{read_json_opt, TextTokenizer};

/// A loaded weight: ggml-quantized (GGUF) or a dense f32 tensor.
// With candle's `cuda` feature a `QTensor` is 232 bytes: a weight is built once at load and moved
// into its layer, so boxing it would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Weight {
    Quantized(QTensor),
    Dense(Tensor),
}

impl Weight {
    pub fn shape(&self) -> &[usize] {
        match self {
            Weight::Quantized(q) => q.shape().dims(),
            Weight::Dense(t) => t.dims(),
        }
    }

    /// The weight as a dense f32 tensor (dequantizing if needed).
    pub fn dequantize(self, device: &Device) -> candle_core::Result<Tensor> {
        match self {
            Weight::Quantized(q) => q.dequantize(device),
            Weight::Dense(t) => Ok(t),
        }
    }
}

/// Sampling defaults a checkpoint ships (HF `generation_config.json`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GenerationDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
}

/// An HF checkpoint directory.
#[derive(Debug)]
pub struct HfDir {
    pub dir: PathBuf,
    pub config: Json,
    pub generation_config: Option<Json>,
    pub weights: SafetensorsSet,
    /// The architecture `config.json` names, when Strata knows it (its tensor names).
    pub arch: Option<crate::Architecture>,
}

/// One tensor of [`ModelFiles::tensor_table`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: String,
    pub bytes: u64,
}

impl TensorEntry {
    /// A routed expert tensor (GGUF `ffn_*_exps` or per expert `ffn_*.E`, HF `.experts.`): shared
    /// experts are not.
    pub fn is_routed_expert(&self) -> bool {
        self.name.contains("_exps.")
            || crate::experts::is_per_expert_name(&self.name)
            || (self.name.contains(".experts.") && !self.name.contains("shared_expert"))
            || crate::arch::REGISTRY.iter().filter_map(|a| a.hf_fused_experts()).any(|(gu, d)| {
                self.name.ends_with(&format!(".{gu}")) || self.name.ends_with(&format!(".{d}"))
            })
    }

    pub fn elements(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// An opened model: metadata and tensor tables, no weights read yet.
#[derive(Debug)]
pub enum ModelFiles {
    Gguf(GgufFile),
    Hf(HfDir),
}

impl ModelFiles {
    /// Opens a `.gguf` file or an HF directory (with `config.json`), validating headers.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(FormatError::MissingFile { path: path.to_path_buf() });
        }
        if path.is_dir() {
            let cfg_path = path.join("config.json");
            let config = read_json_opt(&cfg_path)?.ok_or_else(|| FormatError::UnknownFormat {
                path: path.to_path_buf(),
                reason: "directory has no config.json".into(),
            })?;
            let generation_config = read_json_opt(&path.join("generation_config.json"))?;
            let weights = SafetensorsSet::open(hf_weight_files(path)?)?;
            let text = config.get("text_config").filter(|t| t.is_object()).unwrap_or(&config);
            let arch = text
                .get("model_type")
                .and_then(|m| m.as_str())
                .and_then(crate::Architecture::from_hf);
            return Ok(ModelFiles::Hf(HfDir {
                dir: path.to_path_buf(),
                config,
                generation_config,
                weights,
                arch,
            }));
        }
        Ok(ModelFiles::Gguf(GgufFile::open(path)?))
    }

    pub fn path(&self) -> &Path {
        match self {
            ModelFiles::Gguf(g) => &g.path,
            ModelFiles::Hf(h) => &h.dir,
        }
    }

    /// A short model name for APIs (`/v1/models`): the file stem or directory name.
    pub fn short_name(&self) -> String {
        let p = self.path();
        let stem = if p.is_dir() { p.file_name() } else { p.file_stem() };
        stem.map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
    }

    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            ModelFiles::Gguf(g) => ModelConfig::from_gguf(g),
            ModelFiles::Hf(h) => ModelConfig::from_hf(&h.dir.join("config.json"), &h.config),
        }
    }

    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        match self {
            ModelFiles::Gguf(g) => TextTokenizer::from_gguf(g),
            ModelFiles::Hf(h) => {
                TextTokenizer::from_hf_dir(&h.dir, &h.config, h.generation_config.as_ref())
            }
        }
    }

    /// The model's chat template, if it has one.
    pub fn chat_template(&self, tok: &TextTokenizer) -> Result<Option<ChatTemplate>> {
        let source = match self {
            ModelFiles::Gguf(g) => g.get_str("tokenizer.chat_template").ok().map(str::to_string),
            ModelFiles::Hf(h) => hf_chat_template(&h.dir)?,
        };
        let Some(source) = source else { return Ok(None) };
        let piece = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
        let bos = piece(tok.bos_id);
        let eos = piece(tok.eos_ids.first().copied());
        ChatTemplate::new(&source, &bos, &eos).map(Some)
    }

    pub fn generation_defaults(&self) -> GenerationDefaults {
        let ModelFiles::Hf(HfDir { generation_config: Some(g), .. }) = self else {
            return GenerationDefaults::default();
        };
        let f = |k: &str| g.get(k).and_then(|v| v.as_f64());
        GenerationDefaults {
            temperature: f("temperature"),
            top_p: f("top_p"),
            top_k: g.get("top_k").and_then(|v| v.as_u64()).map(|v| v as usize),
            min_p: f("min_p"),
            repetition_penalty: f("repetition_penalty"),
        }
    }

    /// Shape of a tensor given by its GGUF name, if present.
    pub fn tensor_shape(&self, name: &str) -> Option<Vec<usize>> {
        match self {
            ModelFiles::Gguf(g) => g.tensors.get(name).map(|t| t.shape.clone()),
            ModelFiles::Hf(h) => h.weights.info(&self.hf_name(name)?).map(|t| t.shape.clone()),
        }
    }

    /// The HF name under which this checkpoint stores the tensor with GGUF name `name` (the first
    /// candidate present; the primary candidate when none is).
    fn hf_name(&self, name: &str) -> Option<String> {
        let ModelFiles::Hf(h) = self else { return None };
        let mut c: Vec<String> =
            h.arch.and_then(|a| arch_hf_name(a.spec(), name)).into_iter().collect();
        c.extend(gguf_to_hf_candidates(name));
        c.iter().find(|n| h.weights.info(n).is_some()).or(c.first()).cloned()
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_shape(name).is_some()
    }

    /// Loads the tensor with GGUF name `name`, checking its shape against `expected`.
    ///
    /// Errors: the tensor is missing (named with the name the file would use), its shape differs,
    /// its type is unsupported.
    pub fn load(&self, name: &str, expected: &[usize], device: &Device) -> Result<Weight> {
        let (file_name, actual) = match self {
            ModelFiles::Gguf(_) => (name.to_string(), self.tensor_shape(name)),
            ModelFiles::Hf(_) => {
                let hf = self.hf_name(name).unwrap_or_else(|| name.to_string());
                (hf, self.tensor_shape(name))
            }
        };
        self.check_shape(&file_name, actual, expected)?;
        match self {
            ModelFiles::Gguf(g) => g.read_qtensor(name, device).map(Weight::Quantized),
            ModelFiles::Hf(h) => h.weights.load_f32(&file_name, device).map(Weight::Dense),
        }
    }

    /// Every tensor's name (as stored), shape, type name (`Q4K`, `BF16`, …) and bytes, reading no
    /// weights.
    pub fn tensor_table(&self) -> Vec<TensorEntry> {
        match self {
            ModelFiles::Gguf(g) => g
                .tensors
                .iter()
                .map(|(n, t)| TensorEntry {
                    name: n.clone(),
                    shape: t.shape.clone(),
                    dtype: format!("{:?}", t.dtype),
                    bytes: t.size,
                })
                .collect(),
            ModelFiles::Hf(h) => h
                .weights
                .tensors
                .iter()
                .map(|(n, t)| TensorEntry {
                    name: n.clone(),
                    shape: t.shape.clone(),
                    dtype: t.dtype.clone(),
                    bytes: t.size,
                })
                .collect(),
        }
    }

    /// Total bytes of all tensors in the file(s).
    pub fn total_tensor_bytes(&self) -> u64 {
        match self {
            ModelFiles::Gguf(g) => g.tensors.values().map(|t| t.size).sum(),
            ModelFiles::Hf(h) => h.weights.tensors.values().map(|t| t.size).sum(),
        }
    }
}

fn hf_chat_template(dir: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return std::fs::read_to_string(&jinja).map(Some).map_err(|e| FormatError::io(&jinja, e));
    }
    let Some(cfg) = read_json_opt(&dir.join("tokenizer_config.json"))? else { return Ok(None) };
    Ok(match cfg.get("chat_template") {
        Some(Json::String(s)) => Some(s.clone()),
        Some(Json::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(String::from),
        _ => None,
    })
}
