//! `strata serve`: the OpenAI-compatible server.

use std::sync::Arc;

use anyhow::{anyhow, Result};
use clap::Args;
use strata_server::{AppState, ServerConfig};

use crate::generate::SamplingArgs;
use crate::model_args::ModelArgs;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Default (and cap) for max_tokens when a request does not set it.
    #[arg(long, default_value_t = 1024)]
    pub max_tokens: usize,
    /// Sequence slots generating at once (each has its own KV cache of --ctx-size tokens).
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Requests that may wait for a slot; more are answered 503 at once.
    #[arg(long, default_value_t = 16)]
    pub queue_size: usize,
    /// Require `Authorization: Bearer KEY` (also from $STRATA_API_KEY).
    #[arg(long, env = "STRATA_API_KEY")]
    pub api_key: Option<String>,
    /// Allow cross-origin requests from this origin (`*` for any).
    #[arg(long)]
    pub cors: Option<String>,
    /// Largest accepted request body in bytes (413 above).
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub fn run(a: ServeArgs) -> Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into())).with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let (engine, plan) = a.model.load_with_plan()?;
    let engine = Arc::new(engine);
    let config = ServerConfig {
        host: a.host.clone(),
        port: a.port,
        ctx_size: a.model.ctx_size,
        max_tokens: a.max_tokens,
        parallel: a.parallel,
        queue_size: a.queue_size,
        api_key: a.api_key.clone(),
        cors: a.cors.clone(),
        max_body_bytes: a.max_body_bytes,
        prefill_chunk: a.model.prefill_chunk,
        sampling: a.sampling.params(&engine),
        panic_trigger: None,
        plan: serde_json::to_value(&plan).ok(),
    };
    let state = AppState::new(engine, config).map_err(|e| anyhow!(e))?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(strata_server::serve(state, strata_server::shutdown_signal(), std::time::Duration::from_secs(4)))?;
    tracing::info!("stopped");
    Ok(())
}
