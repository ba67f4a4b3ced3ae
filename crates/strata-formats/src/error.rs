//! Load errors. Every variant names the file, tensor or key at fault so that a user can act on it;
//! loading never panics on bad input.

use std::path::PathBuf;

/// An error while reading a model's files (weights, config, tokenizer, chat template).
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("model path {path} does not exist")]
    MissingFile { path: PathBuf },

    #[error("{path}: not a model: expected a .gguf file or a Hugging Face directory with config.json ({reason})")]
    UnknownFormat { path: PathBuf, reason: String },

    #[error("{path}: file is truncated: tensor `{tensor}` needs bytes {start}..{end} but the file has {file_len} bytes")]
    Truncated { path: PathBuf, tensor: String, start: u64, end: u64, file_len: u64 },

    #[error("{path}: unknown architecture `{arch}` (supported: {supported})")]
    UnknownArchitecture { path: PathBuf, arch: String, supported: String },

    #[error("{path}: tensor `{tensor}` has unsupported type {dtype}")]
    UnsupportedTensorType { path: PathBuf, tensor: String, dtype: String },

    #[error("{path}: tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch { path: PathBuf, tensor: String, expected: Vec<usize>, actual: Vec<usize> },

    #[error("{path}: tensor `{tensor}` is missing")]
    MissingTensor { path: PathBuf, tensor: String },

    #[error("{path}: metadata key `{key}` is missing or has the wrong type")]
    MissingKey { path: PathBuf, key: String },

    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },

    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    #[error("{path}: {source}")]
    Candle { path: PathBuf, source: candle_core::Error },

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("chat template: {0}")]
    ChatTemplate(String),
}

pub type Result<T> = std::result::Result<T, FormatError>;

impl FormatError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            return FormatError::MissingFile { path: path.into() };
        }
        FormatError::Io { path: path.into(), source }
    }
    pub(crate) fn candle(path: impl Into<PathBuf>, source: candle_core::Error) -> Self {
        FormatError::Candle { path: path.into(), source }
    }
    pub(crate) fn invalid(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        FormatError::Invalid { path: path.into(), message: message.into() }
    }
}
