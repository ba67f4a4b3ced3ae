//! The HTTP layer: routes and middleware (API key, JSON-only POST bodies, OpenAI-shaped errors),
//! and the listener: HTTP/1.1 connections through hyper with a header-read time limit, closed
//! gracefully on shutdown within a grace period.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;

use crate::error::ApiError;
use crate::{routes, AppState};

/// Compares in time that depends only on the lengths, not on where the bytes differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether the request carries the API key (`Authorization: Bearer KEY`, scheme in any case), or
/// no key is configured.
pub fn authorized(st: &AppState, headers: &HeaderMap) -> bool {
    let Some(key) = &st.config.api_key else { return true };
    let Some(v) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let mut parts = v.trim().splitn(2, ' ');
    let scheme_ok = parts.next().is_some_and(|s| s.eq_ignore_ascii_case("bearer"));
    let token = parts.next().unwrap_or("").trim();
    scheme_ok & constant_time_eq(token.as_bytes(), key.as_bytes())
}

/// Every route but `/health` and the chat page (`/`, static) needs the key (when one is set);
/// `/health` answers everyone but shows its details only with the key.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let open = matches!(req.uri().path(), "/health" | "/");
    if !open && !authorized(&st, req.headers()) {
        return ApiError::unauthorized().into_response();
    }
    next.run(req).await
}

/// POST bodies must be declared JSON: a web page can send a cross-site `text/plain` or form POST
/// without a CORS preflight, never an `application/json` one.
async fn json_only(req: Request, next: Next) -> Response {
    if req.method() == Method::POST {
        let ct =
            req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
        let mime = ct.split(';').next().unwrap_or("").trim();
        if !mime.eq_ignore_ascii_case("application/json") {
            return ApiError::unsupported_media_type().into_response();
        }
    }
    next.run(req).await
}

/// Maps axum's own plain-text rejections (405, …) to OpenAI error bodies.
async fn json_errors(req: Request, next: Next) -> Response {
    let res = next.run(req).await;
    let status = res.status();
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
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
        .route("/v1/embeddings", post(crate::embeddings::embeddings))
        .route("/", get(crate::web::index))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(axum::middleware::from_fn(json_only))
        .layer(axum::middleware::from_fn_with_state(st.clone(), auth))
        .layer(axum::middleware::from_fn(json_errors));
    if let Some(origin) = &st.config.cors {
        let cors = tower_http::cors::CorsLayer::new()
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]);
        let cors = if origin == "*" {
            cors.allow_origin(tower_http::cors::Any)
        } else {
            cors.allow_origin(
                HeaderValue::from_str(origin).unwrap_or(HeaderValue::from_static("null")),
            )
        };
        r = r.layer(cors);
    }
    r.with_state(st)
}

/// Binds and serves until `shutdown` resolves; then stops accepting, ends every in-flight
/// generation explicitly (streams get a `server_shutting_down` error event and `[DONE]`, other
/// requests a 503 body) and returns once connections close (at most `grace` later).
pub async fn serve(
    st: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let addr: SocketAddr =
        format!("{}:{}", st.config.host, st.config.port).parse().map_err(|e| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("bad address: {e}"))
        })?;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    serve_on(listener, st, shutdown, grace).await
}

/// [`serve`] on an already bound listener (tests bind port 0).
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    st: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!(
        "strata listening on http://{addr} (model {}, {} slot(s), ctx {})",
        st.model_name,
        st.config.parallel,
        st.config.ctx_size
    );
    let sched = st.scheduler.clone();
    let header_timeout = st.config.header_timeout;
    let app = router(st);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            conn = listener.accept() => match conn {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let svc = TowerToHyperService::new(app.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .serve_connection(TokioIo::new(stream), svc);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection: {e}");
            }
        });
    }
    drop(listener);
    tracing::info!("shutting down: ending in-flight requests");
    sched.shut_down();
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!("connections still open after the {grace:?} grace period; closing");
    }
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_compares() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(constant_time_eq(b"", b""));
    }
}
