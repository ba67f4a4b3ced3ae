//! The chat page at `/`: one static HTML file compiled into the binary (no build step, no external
//! assets): streaming answers, markdown (HTML-escaped first), a stop button, the model name, the
//! memory plan and the last answer's speed. It calls the same OpenAI endpoints as any client, with
//! the API key the user types when the server asks for one.

use axum::http::header;
use axum::response::IntoResponse;

const PAGE: &str = include_str!("web/index.html");

pub async fn index() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'",
            ),
        ],
        PAGE,
    )
}
