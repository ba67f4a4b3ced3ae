//! Strata's OpenAI-compatible HTTP server (axum + tokio).
//!
//! Request flow: handler (`routes.rs`) validates the body (`request.rs`, 4xx with an OpenAI error
//! body from `error.rs`), tokenizes, checks the context, and submits to the `scheduler`: worker
//! threads that each own a KV cache (`--parallel` slots) behind a bounded FIFO queue. Tokens come
//! back over a channel and are returned as JSON or streamed as server-sent events. Dropping the
//! channel (client gone) cancels the generation at the next token.

pub mod error;
pub mod metrics;
pub mod request;
mod routes;
pub mod scheduler;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use strata_engine::{Engine, SamplingParams};

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::scheduler::Scheduler;

/// Server settings (the `strata serve` flags).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// Context per sequence slot (tokens).
    pub ctx_size: usize,
    /// Default and cap for `max_tokens` when a request does not set it.
    pub max_tokens: usize,
    /// Sequence slots generating at once.
    pub parallel: usize,
    /// Requests that may wait for a slot; more get 503.
    pub queue_size: usize,
    pub api_key: Option<String>,
    /// Allowed CORS origin (`*` for any).
    pub cors: Option<String>,
    /// Request body limit in bytes (413 above it).
    pub max_body_bytes: usize,
    pub prefill_chunk: usize,
    /// Sampling used where a request is silent.
    pub sampling: SamplingParams,
    /// A prompt (token ids) that makes a worker panic: tests of panic isolation only.
    pub panic_trigger: Option<Vec<u32>>,
    /// The memory plan made at start-up (`strata info --json`'s object), shown by `GET /health`.
    pub plan: Option<serde_json::Value>,
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
            cors: None,
            max_body_bytes: 8 << 20,
            prefill_chunk: 512,
            sampling: SamplingParams::default(),
            panic_trigger: None,
            plan: None,
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
}

impl AppState {
    pub fn new(engine: Arc<Engine>, config: ServerConfig) -> Result<Arc<Self>, String> {
        let scheduler = Scheduler::start(engine.clone(), config.parallel, config.ctx_size, config.queue_size, config.panic_trigger.clone())?;
        let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let metrics = Metrics::with_families(engine.model.experts().stats().is_some(), engine.spec.is_some());
        Ok(Arc::new(Self { model_name: engine.name.clone(), engine, config, scheduler, metrics, started }))
    }
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.config.api_key {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|v| v.trim() == key);
        let open = req.uri().path() == "/health";
        if !ok && !open {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Maps axum's own plain-text rejections (413 body too large, 415, …) to OpenAI error bodies.
async fn json_errors(req: Request, next: Next) -> Response {
    let res = next.run(req).await;
    let status = res.status();
    let is_json = res.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if (status.is_client_error() || status.is_server_error()) && !is_json {
        let body = axum::body::to_bytes(res.into_body(), 1 << 16).await.unwrap_or_default();
        let msg = String::from_utf8_lossy(&body).into_owned();
        let mut e = ApiError::bad_request(if msg.is_empty() { status.to_string() } else { msg });
        e.status = status;
        return e.into_response();
    }
    res
}

/// The router with every endpoint and middleware.
pub fn router(st: Arc<AppState>) -> Router {
    let mut r = Router::new()
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/models", get(routes::models))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(st.config.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(st.clone(), auth))
        .layer(axum::middleware::from_fn(json_errors));
    if let Some(origin) = &st.config.cors {
        let cors = tower_http::cors::CorsLayer::new()
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]);
        let cors = if origin == "*" {
            cors.allow_origin(tower_http::cors::Any)
        } else {
            cors.allow_origin(HeaderValue::from_str(origin).unwrap_or(HeaderValue::from_static("null")))
        };
        r = r.layer(cors);
    }
    r.with_state(st)
}

/// Binds and serves until `shutdown` resolves; then stops accepting, cancels in-flight generations
/// and returns once connections close (at most `grace` later).
pub async fn serve(st: Arc<AppState>, shutdown: impl std::future::Future<Output = ()> + Send + 'static, grace: std::time::Duration) -> std::io::Result<()> {
    let addr: SocketAddr = format!("{}:{}", st.config.host, st.config.port)
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("bad address: {e}")))?;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    serve_on(listener, st, shutdown, grace).await
}

/// [`serve`] on an already bound listener (tests bind port 0).
pub async fn serve_on(listener: tokio::net::TcpListener, st: Arc<AppState>, shutdown: impl std::future::Future<Output = ()> + Send + 'static, grace: std::time::Duration) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!("strata listening on http://{addr} (model {}, {} slot(s), ctx {})", st.model_name, st.config.parallel, st.config.ctx_size);
    let sched = st.scheduler.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let app = router(st);
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        shutdown.await;
        tracing::info!("shutting down: cancelling in-flight requests");
        sched.shut_down();
        let _ = stop_tx.send(());
    });
    let server = tokio::spawn(async move { server.await });
    let _ = stop_rx.await;
    // Streams end at the next token; give connections `grace` to close.
    match tokio::time::timeout(grace, server).await {
        Ok(Ok(r)) => r,
        _ => Ok(()),
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}
