//! Loading a model as the memory plan says: the one way the CLI, the server and tests load
//! "as planned". [`plan_for`] makes the plan from the files' metadata (no weight read);
//! [`load_planned`] refuses what does not fit and loads the rest with the strategy and cache
//! sizes the plan chose.

use std::path::{Path, PathBuf};

use candle_core::Device;
use strata_formats::ModelFiles;
use strata_plan::{CacheBudget, GpuMemory, Plan, PlanRequest, Strategy, StreamMode};

use crate::engine::{Engine, EngineError, LoadOptions, Result};
use crate::{DirectIo, EvictionPolicy, PrefetchMode, StreamOptions};

/// What to load and how: the memory-plan inputs and the expert-streaming settings the plan does
/// not decide.
#[derive(Debug, Clone)]
pub struct LoadRequest {
    /// Context size in tokens (KV cache capacity).
    pub ctx_size: usize,
    /// Prompt tokens per prefill pass (sizes compute buffers in the plan).
    pub prefill_chunk: usize,
    /// `--stream-experts`: auto (stream only when the plan says the model does not fit), on, off.
    pub stream: StreamMode,
    /// Plan as if the machine had this much available RAM, bytes (`--ram`).
    pub ram: Option<u64>,
    /// The GPU the plan is for (`None`: the CPU).
    pub gpu: Option<GpuMemory>,
    /// Host expert cache budget (`--expert-cache`).
    pub expert_cache: CacheBudget,
    /// VRAM expert cache budget (`--gpu-expert-cache`).
    pub gpu_expert_cache: CacheBudget,
    /// A draft model whose memory the plan counts (`--draft-model`).
    pub draft: Option<PathBuf>,
    pub direct_io: DirectIo,
    /// Expert reads in flight (reader threads).
    pub io_threads: usize,
    pub policy: EvictionPolicy,
    pub prefetch: PrefetchMode,
    pub prefetch_min_precision: f64,
    /// Split expert reads longer than this many bytes (0: never).
    pub read_chunk: usize,
    /// Experts per token override (`--moe-top-k`).
    pub moe_top_k: Option<usize>,
    pub device: Device,
    /// Sequences served at once (`serve --parallel`): the plan counts one KV cache each.
    pub parallel: usize,
    /// The server's prefix cache, counted by the plan (`auto`: sized by it; the bytes it chose
    /// are the plan's `memory.prefix_cache`).
    pub prefix_cache: strata_plan::PrefixCacheBudget,
    /// Element type of the KV caches (`--kv-cache-dtype`): the plan counts its bytes.
    pub kv_dtype: strata_models::KvDtype,
}

impl LoadRequest {
    /// Defaults of `strata serve` on `device`.
    pub fn new(ctx_size: usize, device: Device) -> Self {
        let s = StreamOptions::default();
        Self {
            ctx_size,
            prefill_chunk: 512,
            stream: StreamMode::Auto,
            ram: None,
            gpu: None,
            expert_cache: CacheBudget::Auto,
            gpu_expert_cache: CacheBudget::Auto,
            draft: None,
            direct_io: s.direct_io,
            io_threads: s.io_threads,
            policy: s.policy,
            prefetch: s.prefetch,
            prefetch_min_precision: s.prefetch_min_precision,
            read_chunk: s.read_chunk,
            moe_top_k: None,
            device,
            parallel: 1,
            prefix_cache: strata_plan::PrefixCacheBudget::Bytes(0),
            kv_dtype: strata_models::KvDtype::F32,
        }
    }
}

/// The memory plan for `files` (opened from `path`) under `req`: metadata only, plus the
/// calibrated rates and what earlier runs of the model observed.
///
/// Errors: the draft model cannot be opened or its metadata is invalid.
pub fn plan_for(files: &ModelFiles, path: &Path, req: &LoadRequest) -> Result<Plan> {
    let mut facts = strata_plan::ModelFacts::read(files)?;
    // ModelFacts counts f32 keys and values.
    facts.kv_bytes_per_token = facts.kv_bytes_per_token / 4 * req.kv_dtype.bytes() as u64;
    let draft = match &req.draft {
        Some(d) => Some(strata_plan::ModelFacts::read(&ModelFiles::open(d)?)?),
        None => None,
    };
    let plan_req = PlanRequest {
        ctx_size: req.ctx_size,
        prefill_chunk: req.prefill_chunk,
        stream: req.stream,
        expert_cache: req.expert_cache,
        draft,
        observed: strata_plan::observed::load(path),
        gpu: req.gpu,
        gpu_expert_cache: req.gpu_expert_cache,
        parallel: req.parallel,
        prefix_cache: req.prefix_cache,
    };
    let system = strata_plan::SystemMemory::detect(req.ram);
    Ok(strata_plan::make_plan(&facts, &system, strata_plan::calibrate::load(path), &plan_req))
}

/// Load options that follow `plan`: experts stream when its strategy streams them, into the
/// cache sizes it chose (`auto` budgets become the plan's bytes; a draft model's memory shrinks
/// the host cache to the plan's figure whatever was asked).
pub fn load_options(req: &LoadRequest, plan: &Plan) -> LoadOptions {
    let mut opts = LoadOptions::new(req.ctx_size, req.device.clone());
    opts.moe_top_k = req.moe_top_k;
    opts.kv_dtype = req.kv_dtype;
    if plan.strategy.streams_experts() {
        let budget = match (req.expert_cache, plan.expert_cache_bytes) {
            (CacheBudget::Auto, Some(b)) => CacheBudget::Bytes(b),
            (_, Some(b)) if plan.memory.draft > 0 => CacheBudget::Bytes(b),
            (asked, _) => asked,
        };
        let vram = plan.gpu.as_ref().and_then(|g| g.vram_expert_cache_bytes);
        opts.stream_experts = Some(StreamOptions {
            budget,
            direct_io: req.direct_io,
            io_threads: req.io_threads.max(1),
            policy: req.policy,
            prefetch: req.prefetch,
            prefetch_min_precision: req.prefetch_min_precision,
            read_chunk: req.read_chunk,
            gpu_expert_cache: match (req.gpu_expert_cache, vram) {
                (CacheBudget::Auto, Some(b)) => CacheBudget::Bytes(b),
                (asked, _) => asked,
            },
        });
    }
    opts
}

/// Opens `path`, makes the plan, and loads the model as it says. `progress(done, total)` is
/// called as layers load.
///
/// Errors: [`EngineError::PlanRefused`] when the plan's strategy is TOO-LARGE (nothing is
/// loaded), and every load error of [`Engine::from_files`].
pub fn load_planned(
    path: &Path,
    req: &LoadRequest,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Engine, Plan)> {
    let files = ModelFiles::open(path)?;
    let plan = plan_for(&files, path, req)?;
    let engine = load_as_planned(&files, &plan, req, progress)?;
    Ok((engine, plan))
}

/// [`load_planned`] for files already open and a plan already made (the CLI prints the plan
/// before loading).
///
/// Errors: as [`load_planned`].
pub fn load_as_planned(
    files: &ModelFiles,
    plan: &Plan,
    req: &LoadRequest,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Engine> {
    if plan.strategy == Strategy::TooLarge {
        let path = files.path().display();
        return Err(EngineError::PlanRefused(format!(
            "{path} does not fit: {} (see `strata info --model {path}`)",
            plan.reason
        )));
    }
    Engine::from_files(files, &load_options(req, plan), progress)
}
