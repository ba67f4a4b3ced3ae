//! The memory plan (`strata info`): before any weight is read, what this model needs, what this
//! machine has, which strategy fits (RESIDENT, EXPERT-STREAMING, GPU-OFFLOAD with `--device cuda`,
//! TOO-LARGE), the expert cache size, and the speed to expect from measured bandwidths.
//!
//! - [`facts`]: [`ModelFacts`] from metadata and tensor tables.
//! - [`system`]: [`SystemMemory`] (RAM, available, cgroup limit; overridable for tests), the
//!   process's RSS.
//! - [`budget`]: `--expert-cache` sizes and the one expert-cache sizing rule (host and VRAM).
//! - [`calibrate`]: measured drive / RAM / kernel rates, cached per drive (measured by
//!   `strata-bench`).
//! - [`hit_curve`]: the expert-cache hit rate of typical decode routing at a cache share.
//! - [`observed`]: hit rate and compute time measured by previous runs of the model.
//! - [`plan`]: [`make_plan`], the strategy and the cost model.
//! - [`prefix`]: `serve --prefix-cache` sizes and what `auto` takes of the memory the plan leaves.
//! - [`gpu`]: the same on a GPU: VRAM, page-locked host RAM and the drive as tiers.

pub mod budget;
pub mod calibrate;
pub mod facts;
pub mod gpu;
pub mod hit_curve;
pub mod observed;
pub mod plan;
pub mod prefix;
pub mod switch;
pub mod system;

pub use budget::{parse_bytes, CacheBudget};
pub use calibrate::{Bandwidths, RatesSource};
pub use facts::ModelFacts;
pub use gpu::{GpuMemory, GpuPlan};
pub use observed::Observed;
pub use plan::{make_plan, Estimate, MemoryBudget, Plan, PlanRequest, Strategy, StreamMode};
pub use prefix::PrefixCacheBudget;
pub use system::SystemMemory;
