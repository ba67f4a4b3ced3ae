//! OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 `invalid_request_error`, naming the offending field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param: Some(param.to_string()), code: None }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param: None, code: None }
    }

    pub fn context_length(message: impl Into<String>) -> Self {
        Self { code: Some("context_length_exceeded"), param: Some("messages".into()), ..Self::bad_request(message) }
    }

    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect or missing API key: send `Authorization: Bearer <key>`".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn not_found(path: &str) -> Self {
        Self { status: StatusCode::NOT_FOUND, message: format!("Unknown route {path}"), kind: "invalid_request_error", param: None, code: Some("not_found") }
    }

    pub fn overloaded(queue: usize) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!("The server is busy: all sequence slots are in use and {queue} requests are already waiting; retry later"),
            kind: "server_error",
            param: None,
            code: Some("server_overloaded"),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), kind: "server_error", param: None, code: None }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
