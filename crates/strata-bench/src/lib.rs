//! Measurements and test models, kept out of the engine:
//!
//! - [`bench`]: `strata bench` prefill and decode tok/s on a loaded [`strata_engine::Engine`].
//! - [`moe_bench`]: `strata bench --moe`, one MoE layer's kernels against the RAM floor.
//! - [`calibrate`]: `strata info --calibrate`, the rates the plan's cost model divides by.
//! - [`synth`]: `strata synth`, real-sized synthetic GGUF models with a routing process.
//! - [`synth_dflash`]: random DFlash drafts for a target (speculative-decoding tests).

pub mod bench;
pub mod calibrate;
pub mod moe_bench;
pub mod synth;
pub mod synth_dflash;
