//! Strata's OpenAI-compatible HTTP server (axum + tokio).
//!
//! Request flow: `http.rs` (listener with time limits, API key, JSON-only POST bodies) → handler
//! (`routes.rs`: body read under a time limit; parsing, validation (`request.rs`, 4xx with an
//! OpenAI error body from `error.rs`), the prompt's size check and tokenization on the blocking
//! pool) → `scheduler`: a bounded FIFO queue in front of the batch thread (`batch_loop.rs`:
//! every active request in shared forward passes, `--parallel` KV-cache slots, a prefix cache)
//! or, with speculative decoding, per-slot worker threads (`slots.rs`). Tokens come back over a channel and are returned as JSON or streamed as
//! server-sent events (`response.rs`). Dropping the channel (client gone) cancels the generation
//! at the next token; a shutdown ends every generation between two layers and answers it with a
//! `server_shutting_down` error.

mod batch_loop;
pub use batch_loop::{CPU_BATCH_TOKENS, GPU_BATCH_TOKENS, STREAMED_BATCH_WINDOW};
mod embeddings;
pub mod error;
mod http;
mod memory;
pub mod metrics;
pub mod request;
mod response;
mod routes;
pub mod scheduler;
mod slots;
mod stream;
pub mod tools;
mod web;

use std::sync::Arc;
use std::time::Duration;

use strata_engine::{Engine, SamplingParams};

use crate::metrics::Metrics;
use crate::scheduler::Scheduler;

pub use http::{router, serve, serve_on, shutdown_signal};

/// Server settings (the `strata serve` flags).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Context per sequence slot (tokens).
    pub ctx_size: usize,
    /// Cap on `max_tokens` (larger requests get a 400), and its value when a request is silent.
    pub max_tokens: usize,
    /// Sequence slots generating at once (at least 1).
    pub parallel: usize,
    /// Requests that may wait for a slot; more get 503.
    pub queue_size: usize,
    pub api_key: Option<String>,
    /// Names besides the model's own that requests may give as `model` (`--alias`).
    pub model_aliases: Vec<String>,
    /// Allowed CORS origin (`*` for any).
    pub cors: Option<String>,
    /// Request body limit in bytes (413 above it).
    pub max_body_bytes: usize,
    /// Time a client has to send a request's headers (the connection is closed after it).
    pub header_timeout: Duration,
    /// Time a client has to send a request's body (408 after it).
    pub body_timeout: Duration,
    pub prefill_chunk: usize,
    /// Tokens one batched forward pass runs at most beyond one prefill chunk (`--batch-tokens`;
    /// `None`: [`GPU_BATCH_TOKENS`] on a GPU, [`CPU_BATCH_TOKENS`]
    /// elsewhere).
    pub batch_tokens: Option<usize>,
    /// How long new requests wait for more before their prompt pass (`--batch-window`; `None`:
    /// [`STREAMED_BATCH_WINDOW`] where experts stream from the drive, else none).
    pub batch_window: Option<Duration>,
    /// Bytes of KV entries kept for reuse by later requests sharing a prompt prefix
    /// (`--prefix-cache`; 0: none).
    pub prefix_cache_bytes: usize,
    /// `--mixed-steps`: a step of decode rows and prompt chunks as two passes (`Some(true)`), one
    /// (`Some(false)`), or the device's default (`None`,
    /// [`strata_models::Transformer::splits_mixed`]).
    pub split_mixed: Option<bool>,
    /// `--defer-emission`: a decode token's text and event made while the next step runs on the
    /// device (`Some(true)`), or before it (`Some(false)`); `None`: on a GPU
    /// ([`strata_engine::batch::BatchConfig::defer_emission`]).
    pub defer_emission: Option<bool>,
    /// Run [`strata_engine::batch::Batcher::warm_up`] before serving (`serve` turns it on for
    /// GPU devices unless `--no-warmup`).
    pub warm_up: bool,
    /// Sampling used where a request is silent.
    pub sampling: SamplingParams,
    /// The memory plan made at start-up (`strata info --json`'s object), shown by `GET /health`
    /// (without file paths) to clients holding the API key.
    pub plan: Option<strata_plan::Plan>,
    /// A prompt (token ids) that makes a worker panic: tests of panic isolation only.
    #[cfg(feature = "test-hooks")]
    pub panic_trigger: Option<Vec<u32>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            ctx_size: 4096,
            max_tokens: 1024,
            parallel: 1,
            queue_size: 16,
            api_key: None,
            model_aliases: Vec::new(),
            cors: None,
            max_body_bytes: 8 << 20,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            prefill_chunk: 512,
            batch_tokens: None,
            batch_window: None,
            prefix_cache_bytes: 0,
            split_mixed: None,
            defer_emission: None,
            warm_up: false,
            sampling: SamplingParams::default(),
            plan: None,
            #[cfg(feature = "test-hooks")]
            panic_trigger: None,
        }
    }
}

pub struct AppState {
    pub engine: Arc<Engine>,
    pub config: ServerConfig,
    pub scheduler: Scheduler,
    pub metrics: Metrics,
    pub model_name: String,
    pub started: u64,
    /// Requests being parsed, size-checked and tokenised at once (on the blocking pool): one per
    /// core, so a burst of large bodies never spawns a thread (and a malloc arena) per request.
    pub prepare_permits: Arc<tokio::sync::Semaphore>,
    /// One embedding computed at a time (on the blocking pool, beside generation).
    pub embed_permit: Arc<tokio::sync::Semaphore>,
}

impl AppState {
    /// Errors: `parallel` is 0, or a KV cache or worker thread cannot be made.
    pub fn new(engine: Arc<Engine>, config: ServerConfig) -> Result<Arc<Self>, String> {
        if config.parallel == 0 {
            return Err("--parallel must be at least 1".into());
        }
        let metrics =
            Metrics::with_families(engine.model.experts().stats().is_some(), engine.spec.is_some());
        #[cfg(feature = "test-hooks")]
        let trigger = config.panic_trigger.clone();
        #[cfg(not(feature = "test-hooks"))]
        let trigger = None;
        let scheduler = Scheduler::start(
            engine.clone(),
            &config,
            metrics.cancellations.clone(),
            metrics.batch.clone(),
            trigger,
        )?;
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Ok(Arc::new(Self {
            model_name: engine.name.clone(),
            engine,
            config,
            scheduler,
            metrics,
            started,
            prepare_permits: Arc::new(tokio::sync::Semaphore::new(cores)),
            embed_permit: Arc::new(tokio::sync::Semaphore::new(1)),
        }))
    }
}
