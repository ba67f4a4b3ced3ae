//! Expert streaming (`--stream-experts`): MoE models larger than memory run with the dense weights
//! resident and the routed experts read on demand from the model file(s).
//!
//! - [`io`]: the I/O engine: reader threads issuing concurrent `pread`s (optionally `O_DIRECT`).
//! - [`slab`]: the cache's memory, fixed 4 KiB-aligned slots allocated once.
//! - [`cache`]: [`cache::ExpertCache`], the cache bookkeeping (entries, use history, eviction,
//!   protected experts) shared by the host cache and the VRAM tier.
//! - [`policy`]: eviction policies (LRU, LRU-2, LFU).
//! - [`disk_bench`]: `strata bench --disk`, the drive's random-read bandwidth.
//! - [`prefetch_gate`]: whether predictions of the next layer's experts are precise enough to read.
//! - [`protect`]: the experts each thread's current pass needs, spared by eviction.
//! - [`provider`]: [`StreamingExperts`], the [`strata_models::ExpertProvider`] tying them together.
//! - `gpu_tier` (cargo feature `cuda`): `GpuExperts`, a VRAM expert cache above the host cache
//!   (page-locked), copies on their own CUDA stream.

pub mod cache;
pub mod disk_bench;
#[cfg(feature = "cuda")]
pub mod gpu_tier;
pub mod io;
pub mod policy;
pub mod prefetch_gate;
pub mod protect;
pub mod provider;
pub mod slab;

pub use io::DirectIo;
pub use policy::EvictionPolicy;
pub use provider::{
    open_streaming, ExpertBytes, StreamOptions, StreamingExperts, DEFAULT_PREFETCH_MIN_PRECISION,
    DEFAULT_READ_CHUNK,
};
