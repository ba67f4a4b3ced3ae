//! The memory plan (`strata info`): before any weight is read, what this model needs, what this
//! machine has, which strategy fits (RESIDENT, EXPERT-STREAMING, TOO-LARGE; GPU offload arrives with
//! the CUDA backend), the expert cache size, and the speed to expect from measured bandwidths.
//!
//! - [`facts`]: [`ModelFacts`] from metadata and tensor tables.
//! - [`system`]: [`SystemMemory`] (RAM, available, cgroup limit; overridable for tests).
//! - [`calibrate`]: measured drive / RAM / kernel rates, cached per drive.
//! - [`observed`]: hit rate and compute time measured by previous runs of the model.
//! - [`plan`]: [`make_plan`], the strategy and the cost model.

pub mod calibrate;
pub mod facts;
pub mod observed;
pub mod plan;
pub mod system;

pub use calibrate::{Bandwidths, RatesSource};
pub use facts::ModelFacts;
pub use observed::Observed;
pub use plan::{make_plan, Estimate, MemoryBudget, Plan, PlanRequest, Strategy, StreamMode};
pub use system::SystemMemory;
