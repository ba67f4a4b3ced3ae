//! Model definitions for Strata. Our own code (not candle-transformers) because the engine needs
//! hooks those models lack: a preallocated, rollback-able KV cache, hidden-state taps, and (later)
//! an expert provider for streamed MoE weights.

pub mod attention;
pub mod error;
pub mod kv_cache;
pub mod layers;
pub mod mlp;
pub mod rope;
pub mod transformer;

pub use error::{ModelError, Result};
pub use kv_cache::KvCache;
pub use transformer::{ForwardOutput, Logits, Transformer};
