//! Model file formats for Strata: GGUF and Hugging Face checkpoint directories (safetensors,
//! sharded or not), with the tokenizer, chat template and generation defaults they carry.
//!
//! Entry point: [`ModelFiles::open`] detects the format from the path. Model code asks for tensors
//! by their GGUF names (`blk.3.attn_q.weight`); HF checkpoints are mapped onto those names
//! ([`names`]), so every model definition is written once.

pub mod arch;
pub mod chat;
pub mod config;
pub mod dflash;
pub mod error;
mod experts;
pub mod gguf;
pub mod gguf_write;
mod model_files;
pub mod names;
pub mod repack;
pub mod safetensors;
pub mod synthetic;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate, Rendered};
pub use config::{
    Architecture, HeadOrder, LinearAttnConfig, ModelConfig, MoeConfig, QkNorm, RopeScaling,
    RopeStyle, RouterScoring, Scales,
};
pub use dflash::DFlashConfig;
pub use error::{FormatError, Result};
pub use experts::{
    weight_from_bytes, ByteRange, ExpertDims, ExpertEncoding, ExpertExtent, ExpertLayout,
    ExpertTensors,
};
pub use model_files::{GenerationDefaults, ModelFiles, TensorEntry, Weight};
pub use synthetic::{RoutingMode, SyntheticRouting};
pub use tokenizer::{StreamDecoder, TextTokenizer};
