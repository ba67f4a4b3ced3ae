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
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 400 `context_length_exceeded`; `param`: the field holding the input (`messages`,
    /// `prompt`, `input`), `None` where the request is no longer at hand.
    pub fn context_length(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            code: Some("context_length_exceeded"),
            param: param.map(Into::into),
            ..Self::bad_request(message)
        }
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
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("Unknown route {path}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    /// 404 `model_not_found` (OpenAI's answer for an unknown model).
    pub fn model_not_found(model: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist; this server serves `{served}`"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 503 `server_shutting_down`: the server stopped before the answer was complete (streams get
    /// this as their last event before `[DONE]`).
    pub fn shutting_down() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "The server is shutting down; the answer was cut short. Retry on another server or after the restart".into(),
            kind: "server_error",
            param: None,
            code: Some("server_shutting_down"),
        }
    }

    /// 408: the client did not send its request body in time.
    pub fn body_timeout(secs: u64) -> Self {
        Self {
            status: StatusCode::REQUEST_TIMEOUT,
            code: Some("request_timeout"),
            ..Self::bad_request(format!("The request body did not arrive within {secs} s"))
        }
    }

    /// 415: POST bodies must be JSON (so that a web page cannot send a simple cross-site form post).
    pub fn unsupported_media_type() -> Self {
        Self {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ..Self::bad_request("Send the body as JSON with `Content-Type: application/json`")
        }
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
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
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
