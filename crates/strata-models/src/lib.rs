//! Model definitions for Strata. Our own code (not candle-transformers) because the engine needs
//! hooks those models lack: a preallocated, rollback-able KV cache, output hidden states of chosen layers, observable MoE
//! routing, and an [`ExpertProvider`] through which routed experts are read (resident or streamed).

pub mod attention;
pub mod dflash;
pub mod error;
pub mod experts;
pub mod gated_delta_net;
pub mod gpu;
pub mod kv_cache;
pub mod layers;
pub mod mlp;
pub mod moe;
pub mod prefetch;
pub mod recurrent;
pub mod rope;
pub mod synthetic_routing;
pub mod transformer;

pub use attention::EXACT_ROWS_MAX;
pub use dflash::DFlashDraft;
pub use error::{ModelError, Result};
pub use experts::{Expert, ExpertProvider, ExpertStats, FusedCall, FusedExperts, ResidentExperts};
pub use kv_cache::{KvBlock, KvCache, KvDtype};
pub use moe::{ExpertFailure, LayerRouting, Router, SeqRoute, SparseMoe};
pub use prefetch::{PredictorStats, PrefetchMode, PrefetchStats};
pub use recurrent::RecurrentSnapshot;
pub use strata_kernels::prefill_scope;
pub use synthetic_routing::{RoutingHistory, SyntheticRouter};
pub use transformer::{BatchOptions, BatchSeq, ForwardOutput, Logits, Transformer};
