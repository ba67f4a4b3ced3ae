//! `POST /v1/embeddings`: `input` a string, a list of strings, a list of token ids or a list of
//! such lists; `encoding_format` `float` (default) or `base64` (little-endian f32); pooling as
//! [`strata_engine::Engine::embed`] documents (mean of the final-normed last hidden state,
//! L2-normalised). Computed on the blocking pool, one request at a time beside generation.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::request::{check_model, refuse_unsupported};
use crate::AppState;

/// Inputs per request at most.
const MAX_INPUTS: usize = 256;

enum Input {
    Text(String),
    Tokens(Vec<u64>),
}

fn inputs(body: &Value) -> Result<Vec<Input>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "input",
            "`input` must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        )
    };
    let ids = |a: &[Value]| -> Option<Vec<u64>> { a.iter().map(Value::as_u64).collect() };
    let list = match body.get("input") {
        Some(Value::String(s)) => return Ok(vec![Input::Text(s.clone())]),
        Some(Value::Array(a)) if !a.is_empty() => a,
        None | Some(Value::Null) => return Err(ApiError::invalid("input", "`input` is required")),
        Some(_) => return Err(bad()),
    };
    if list.iter().all(Value::is_number) {
        return Ok(vec![Input::Tokens(ids(list).ok_or_else(bad)?)]);
    }
    if list.len() > MAX_INPUTS {
        return Err(ApiError::invalid("input", format!("at most {MAX_INPUTS} inputs per request")));
    }
    list.iter()
        .map(|v| match v {
            Value::String(s) => Ok(Input::Text(s.clone())),
            Value::Array(a) if !a.is_empty() => ids(a).map(Input::Tokens).ok_or_else(bad),
            _ => Err(bad()),
        })
        .collect()
}

pub async fn embeddings(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let res = async {
        let body = axum::body::to_bytes(req.into_body(), st.config.max_body_bytes)
            .await
            .map_err(|_| ApiError::bad_request("The request body is too large or unreadable"))?;
        let st2 = st.clone();
        let permit =
            st.embed_permit.clone().acquire_owned().await.map_err(|_| ApiError::shutting_down())?;
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            embed(&st2, &body)
        })
        .await
        .map_err(|e| ApiError::internal(format!("embedding failed: {e}")))?
    }
    .await;
    match res {
        Ok(v) => Json(v).into_response(),
        Err(e) => {
            st.metrics.request_errors.inc();
            e.into_response()
        }
    }
}

fn embed(st: &AppState, body: &[u8]) -> Result<Value, ApiError> {
    let body: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Malformed JSON body: {e}")))?;
    if !body.is_object() {
        return Err(ApiError::bad_request("The request body must be a JSON object"));
    }
    check_model(&body, &st.model_name, &st.config.model_aliases)?;
    refuse_unsupported(&body, &["dimensions"])?;
    let base64 = match body.get("encoding_format").and_then(Value::as_str) {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` must be float or base64, got {other}"),
            ))
        }
    };
    let engine = &st.engine;
    let vocab = engine.model.config().vocab_size as u64;
    let ctx = st.config.ctx_size;
    let mut data = Vec::new();
    let mut total = 0;
    for (i, input) in inputs(&body)?.into_iter().enumerate() {
        let ids: Vec<u32> = match input {
            Input::Text(t) => engine
                .tokenizer
                .encode(&t, true)
                .map_err(|e| ApiError::bad_request(e.to_string()))?,
            Input::Tokens(t) => {
                if let Some(bad) = t.iter().find(|&&x| x >= vocab) {
                    return Err(ApiError::invalid(
                        "input",
                        format!("token {bad} is outside the vocabulary (0..{vocab})"),
                    ));
                }
                t.into_iter().map(|x| x as u32).collect()
            }
        };
        if ids.is_empty() {
            return Err(ApiError::invalid("input", format!("input[{i}] is empty")));
        }
        if ids.len() >= ctx {
            return Err(ApiError::context_length(
                Some("input"),
                format!(
                    "This model's context is {ctx} tokens; input[{i}] has {} tokens",
                    ids.len()
                ),
            ));
        }
        total += ids.len();
        let v = engine
            .embed(&ids, ctx, st.config.prefill_chunk)
            .map_err(|e| ApiError::internal(format!("embedding failed: {e}")))?;
        let embedding = if base64 {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            json!(base64_encode(&bytes))
        } else {
            json!(v)
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    Ok(
        json!({"object": "list", "data": data, "model": st.model_name, "usage": {"prompt_tokens": total, "total_tokens": total}}),
    )
}

/// Standard base64 with padding (RFC 4648 §4).
fn base64_encode(bytes: &[u8]) -> String {
    const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (i, o) in
            [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foobar", "Zm9vYmFy")]
        {
            assert_eq!(super::base64_encode(i.as_bytes()), o);
        }
    }
}
