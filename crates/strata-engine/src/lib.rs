//! The Strata inference engine: loading a model for generation, chunked prefill and decode,
//! sampling, stop handling, perplexity and the routing report. Benchmarks and synthetic models
//! live in `strata-bench`.

pub mod batch;
pub mod device;
mod embed;
pub mod engine;
mod output;
pub mod perplexity;
pub mod planned;
pub mod routing_report;
pub mod sampling;
pub mod spec;
pub mod stop;

pub use engine::{
    Engine, EngineError, FinishReason, GenerateRequest, Generation, LoadOptions, TokenEvent,
    TokenLogprobs,
};
pub use planned::{load_planned, plan_for, LoadRequest};
pub use routing_report::{RoutingReport, RoutingTrace};
pub use sampling::{Sampler, SamplingParams};
pub use spec::{
    DraftSource, LogitsConstraint, NgramParams, RoundTrace, SpecConfig, SpecStats, Speculator,
};
pub use strata_expert_store as expert_store;
pub use strata_expert_store::{DirectIo, EvictionPolicy, StreamOptions};
pub use strata_models::{ExpertStats, PrefetchMode, PrefetchStats};
pub use strata_plan::CacheBudget;
