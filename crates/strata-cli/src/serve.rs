//! `strata serve`: the OpenAI-compatible server.

use std::sync::Arc;

use anyhow::{anyhow, Result};
use clap::builder::TypedValueParser as _;
use clap::Args;
use strata_server::{AppState, ServerConfig};

use crate::generate::SamplingArgs;
use crate::model_args::ModelArgs;

/// `serve --defer-emission`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeferEmission {
    Auto,
    On,
    Off,
}

/// `serve --mixed-steps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MixedSteps {
    Auto,
    Split,
    Merged,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Cap on a request's max_tokens (a request asking for more gets a 400), and its value when
    /// a request does not set it (then also bounded by the context left).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..).map(|v| v as usize))]
    pub max_tokens: usize,
    /// Sequences generating at once, each with its own KV cache of --ctx-size tokens (the memory
    /// plan counts them all and refuses what does not fit). Without speculative decoding they
    /// share forward passes (continuous batching: one pass per step over every active request,
    /// a MoE batch's experts read once); with --spec / --draft-model / --dflash, speculation runs
    /// per sequence and requests do not share passes (measured on SmolLM2, 2 cores, 8 clients:
    /// 81 tok/s with --spec ngram against 203–229 batched; docs/performance.md): for many users
    /// leave speculation off.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024).map(|v| v as usize))]
    pub parallel: usize,
    /// Tokens one batched forward pass runs at most besides one prompt chunk (decode tokens of
    /// running requests plus prefill chunks of new ones; `auto`: 2048 on a GPU, where requests
    /// arriving together then share one prompt pass, 512 on the CPU, where a shorter pass keeps
    /// running requests' tokens coming).
    #[arg(long, default_value = "auto", value_parser = parse_batch_tokens)]
    pub batch_tokens: BatchTokens,
    /// Milliseconds new requests wait for more before their prompt pass, so that requests arriving
    /// together share it (`auto`: 50 where experts stream from the drive — a streamed MoE's
    /// prompt pass reads nearly every expert — else 0). Returns early when the slots are full.
    #[arg(long, default_value = "auto", value_parser = parse_window)]
    pub batch_window: Window,
    /// A step that holds decode tokens of running requests and prompt chunks of new ones runs
    /// as one forward pass (`merged`) or as two, the decode tokens' then the chunks' (`split`).
    /// `split` keeps every running request's tokens what they are alone (greedy: the same
    /// tokens), at the cost of one more pass per such step; `merged` lets the decode rows ride
    /// in the prompt kernels, which on a GPU compute them at another precision (f16 instead of
    /// 8-bit rounded inputs) and can change later tokens. `auto`: `split` on a GPU with every
    /// expert in VRAM, `merged` elsewhere (the CPU's merged passes keep the decode kernels for
    /// decode rows; streamed experts are read once for both). Measured on an H200, 16 clients
    /// arriving at 16 requests/s: `merged` ~7% more tok/s (docs/performance.md).
    #[arg(long, value_enum, default_value_t = MixedSteps::Auto)]
    pub mixed_steps: MixedSteps,
    /// When a decode token's text is made and sent: `on`, while the next step runs on the
    /// device (the step then launches without waiting for the detokenization, stop-string
    /// checks and events of the one before; each decode token reaches its client one step
    /// later, the first token as soon as it is sampled; a stop string ends its request one step
    /// later, with the same text), `off`, before the next step. `auto`: `on` on a GPU (H200,
    /// synthetic 30B, 16 clients: decode steps 0.03-0.24 ms shorter, docs/performance.md),
    /// `off` on the CPU, where the step has no device time to hide it in.
    #[arg(long, value_enum, default_value_t = DeferEmission::Auto)]
    pub defer_emission: DeferEmission,
    /// Keep finished requests' KV entries (in 64-token blocks, least recently used dropped first)
    /// for later requests that share a prompt prefix, up to this many bytes (`0`: off). `auto`:
    /// half of the memory (RAM, or VRAM on a GPU) the plan leaves free, at most 8 GiB — at most
    /// 256 MiB when experts stream, whose cache needs the memory more. Counted by the memory plan
    /// (the start-up log says how much). Not used with speculative decoding.
    #[arg(long, default_value = "auto")]
    pub prefix_cache: strata_plan::PrefixCacheBudget,
    /// Requests that may wait for a slot; more are answered 503 at once.
    #[arg(long, default_value_t = 16)]
    pub queue_size: usize,
    /// Require `Authorization: Bearer KEY` on every route (also from $STRATA_API_KEY); `/health`
    /// then shows only `{"status": "ok"}` without it.
    #[arg(long, env = "STRATA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Another name requests may give as `model` (repeatable); the model's own name (its file
    /// stem) is always accepted.
    #[arg(long)]
    pub alias: Vec<String>,
    /// Seconds a client has to send its request headers (the connection is closed after).
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    /// Seconds a client has to send its request body (408 after).
    #[arg(long, default_value_t = 30)]
    pub body_timeout: u64,
    /// Allow cross-origin requests from this origin (`*` for any).
    #[arg(long)]
    pub cors: Option<String>,
    /// Largest accepted request body in bytes (413 above).
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Skip the warm-up: on a GPU, two short requests run before the server listens, then
    /// batched steps of every size up to --parallel (16 at most) twice each, so the first clients
    /// do not wait for the driver's kernel compilation and graph capture (seconds on a fresh
    /// machine; ~1 s for the synthetic 30B on an H200). Batched serving only (no speculation);
    /// nothing runs on a CPU.
    #[arg(long)]
    pub no_warmup: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub fn run(mut a: ServeArgs) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let speculative = a.model.spec.kind()?.is_some();
    let prefix_cache =
        if speculative { strata_plan::PrefixCacheBudget::Bytes(0) } else { a.prefix_cache };
    a.model.serving = crate::model_args::Serving { parallel: a.parallel, prefix_cache };
    let (engine, plan) = a.model.load_with_plan()?;
    let engine = Arc::new(engine);
    // `..default()` fills the `test-hooks` fields when a workspace build enables that feature.
    #[allow(clippy::needless_update)]
    let config = ServerConfig {
        host: a.host.clone(),
        port: a.port,
        ctx_size: a.model.ctx_size,
        max_tokens: a.max_tokens,
        parallel: a.parallel,
        queue_size: a.queue_size,
        api_key: a.api_key.clone(),
        model_aliases: a.alias.clone(),
        cors: a.cors.clone(),
        max_body_bytes: a.max_body_bytes,
        header_timeout: std::time::Duration::from_secs(a.header_timeout.max(1)),
        body_timeout: std::time::Duration::from_secs(a.body_timeout.max(1)),
        prefill_chunk: a.model.prefill_chunk,
        batch_tokens: a.batch_tokens.0,
        batch_window: a.batch_window.0,
        prefix_cache_bytes: plan.memory.prefix_cache as usize,
        split_mixed: match a.mixed_steps {
            MixedSteps::Auto => None,
            MixedSteps::Split => Some(true),
            MixedSteps::Merged => Some(false),
        },
        defer_emission: match a.defer_emission {
            DeferEmission::Auto => None,
            DeferEmission::On => Some(true),
            DeferEmission::Off => Some(false),
        },
        warm_up: !a.no_warmup && !engine.model.device().is_cpu(),
        sampling: a.sampling.params(&engine),
        plan: Some(plan),
        ..ServerConfig::default()
    };
    let state = AppState::new(engine, config).map_err(|e| anyhow!(e))?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(strata_server::serve(
        state,
        strata_server::shutdown_signal(),
        std::time::Duration::from_secs(4),
    ))?;
    tracing::info!("stopped");
    Ok(())
}

/// `--batch-tokens`: `auto` (`None`) or a number of tokens (1 or more).
#[derive(Debug, Clone, Copy)]
pub struct BatchTokens(Option<usize>);

fn parse_batch_tokens(s: &str) -> Result<BatchTokens, String> {
    let n = auto_or_number(s, 1, "a number of tokens (1 or more)")?;
    Ok(BatchTokens(n.map(|n| n as usize)))
}

/// `--batch-window`: `auto` (`None`) or milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Window(Option<std::time::Duration>);

fn parse_window(s: &str) -> Result<Window, String> {
    let ms = auto_or_number(s, 0, "milliseconds")?;
    Ok(Window(ms.map(std::time::Duration::from_millis)))
}

/// A flag's `auto` (`None`, any case) or a whole number of at least `min`; the error names `what`
/// is wanted.
fn auto_or_number(s: &str, min: u64, what: &str) -> Result<Option<u64>, String> {
    if s.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    match s.parse::<u64>() {
        Ok(n) if n >= min => Ok(Some(n)),
        _ => Err(format!("`{s}`: give {what} or `auto`")),
    }
}
