//! HTTP handlers: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`, `/metrics`.
//!
//! A request's body is read under a time limit, then parsed, validated and tokenized on the
//! blocking pool (never on the async runtime, so `/health` stays responsive under huge prompts),
//! after a size check that refuses a prompt whose bytes cannot fit the context before any
//! tokenizer work.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use strata_engine::{GenerateRequest, Generation, TokenLogprobs};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::error::ApiError;
use crate::request::{
    chat_messages, check_model, completion_prompt, gen_params, refuse_unsupported, GenParams,
    Prompt, UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION,
};
use crate::response::{finish_str, logprobs_json, Kind, Meta};
use crate::scheduler::GenEvent;
use crate::AppState;

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

/// Reads the body within `--body-timeout` (408 after it) and `--max-body-bytes` (413 above it).
async fn read_body(st: &AppState, req: Request) -> Result<Bytes, ApiError> {
    let limit = st.config.max_body_bytes;
    let too_large = || ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        ..ApiError::bad_request(format!(
            "The request body is over the {limit}-byte limit (--max-body-bytes)"
        ))
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let timeout = st.config.body_timeout;
    match tokio::time::timeout(timeout, axum::body::to_bytes(req.into_body(), limit)).await {
        Err(_) => Err(ApiError::body_timeout(timeout.as_secs())),
        Ok(Err(_)) => Err(too_large()),
        Ok(Ok(b)) => Ok(b),
    }
}

pub async fn chat_completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    handle(st, req, Kind::Chat).await
}

pub async fn completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    handle(st, req, Kind::Completion).await
}

async fn handle(st: Arc<AppState>, req: Request, kind: Kind) -> Response {
    st.metrics.requests.inc();
    let res = async {
        let body = read_body(&st, req).await?;
        let big = body.len() > 1 << 20;
        let st2 = st.clone();
        let permit = st
            .prepare_permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::shutting_down())?;
        let prepared = tokio::task::spawn_blocking(move || {
            // Held by the blocking work itself: a client that leaves does not free its permit
            // while its body is still being tokenised.
            let _permit = permit;
            let r = prepare(&st2, &body, kind);
            drop(body);
            if big {
                crate::memory::release_free_memory();
            }
            r
        })
        .await
        .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))?;
        let (ids, params) = prepared?;
        run(st.clone(), ids, params, kind).await
    }
    .await;
    res.unwrap_or_else(|e| {
        st.metrics.request_errors.inc();
        e.into_response()
    })
}

/// Parses and validates the body, checks the prompt's size, tokenizes it, and fixes
/// `max_tokens`. Blocking work: runs on the blocking pool.
fn prepare(st: &AppState, body: &[u8], kind: Kind) -> Result<(Vec<u32>, GenParams), ApiError> {
    let body: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Malformed JSON body: {e}")))?;
    let chat = kind == Kind::Chat;
    let mut params = gen_params(&body, &st.config.sampling, chat)?;
    check_model(&body, &st.model_name, &st.config.model_aliases)?;
    refuse_unsupported(&body, if chat { &UNSUPPORTED_CHAT } else { &UNSUPPORTED_COMPLETION })?;
    let prompt = if chat { Prompt::Chat(chat_messages(&body)?) } else { completion_prompt(&body)? };
    drop(body);
    let engine = &st.engine;
    let ctx = st.config.ctx_size;
    let too_long = |n: String| {
        ApiError::context_length(format!(
            "This model's context is {ctx} tokens; the prompt has {n} tokens"
        ))
    };
    let least = engine.tokenizer.min_tokens_for(prompt.text_bytes());
    if least >= ctx {
        return Err(too_long(format!("at least {least}")));
    }
    let ids = match prompt {
        Prompt::Chat(m) => {
            engine
                .chat_prompt(&m)
                .map_err(|e| {
                    ApiError::invalid("messages", format!("Cannot apply the chat template: {e}"))
                })?
                .1
        }
        Prompt::Text(t) => {
            engine.text_prompt(&t).map_err(|e| ApiError::bad_request(e.to_string()))?
        }
        Prompt::Tokens(t) => {
            let vocab = engine.model.config().vocab_size as u64;
            if let Some((i, bad)) = t.iter().enumerate().find(|(_, &x)| x >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("prompt[{i}] = {bad} is outside the vocabulary (0..{vocab})"),
                ));
            }
            t.into_iter().map(|x| x as u32).collect()
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "The prompt is empty"));
    }
    if ids.len() >= ctx {
        return Err(too_long(ids.len().to_string()));
    }
    let cap = st.config.max_tokens;
    params.max_tokens = Some(match params.max_tokens {
        Some(m) if ids.len() + m > ctx => {
            return Err(ApiError::context_length(format!("This model's context is {ctx} tokens; the prompt ({} tokens) plus max_tokens ({m}) exceed it", ids.len())))
        }
        Some(m) if m > cap => {
            let key = params.max_tokens_key.unwrap_or("max_tokens");
            return Err(ApiError::invalid(key, format!("`{key}` is {m}; this server allows at most {cap} (--max-tokens)")));
        }
        Some(m) => m,
        None => cap.min(ctx - ids.len()),
    });
    Ok((ids, params))
}

/// Queues the request and answers (JSON or SSE).
async fn run(
    st: Arc<AppState>,
    ids: Vec<u32>,
    p: GenParams,
    kind: Kind,
) -> Result<Response, ApiError> {
    let mut req = GenerateRequest::new(ids, p.max_tokens.unwrap_or(1), p.sampling.clone());
    req.stop = p.stop.clone();
    req.logprobs = p.logprobs;
    req.ignore_eos = p.ignore_eos;
    req.prefill_chunk = st.config.prefill_chunk;
    let (tx, rx) = unbounded_channel();
    let start = Instant::now();
    let meta = Meta {
        id: new_id(if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }),
        created: now(),
        model: st.model_name.clone(),
        kind,
    };
    let cancel = st.scheduler.submit(req, tx, meta.id.clone())?;
    st.metrics.queue_depth.set(st.scheduler.queue_depth() as i64);
    if p.stream {
        let (sse_tx, sse_rx) = unbounded_channel::<Result<Event, Infallible>>();
        let st2 = st.clone();
        tokio::spawn(async move {
            stream_events(st2, rx, sse_tx, meta, p, start).await;
            cancel.store(true, Ordering::SeqCst);
        });
        return Ok(Sse::new(UnboundedReceiverStream::new(sse_rx))
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    // Dropping `_guard` (client went away, the handler future is dropped) cancels the generation.
    let _guard = CancelOnDrop(cancel);
    let (gen, logprobs) = collect(rx).await?;
    record(&st, &meta.id, &gen, start);
    Ok(Json(meta.full_response(&st, &gen, logprobs, p.logprobs.is_some())).into_response())
}

struct CancelOnDrop(Arc<std::sync::atomic::AtomicBool>);
impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

async fn collect(
    mut rx: UnboundedReceiver<GenEvent>,
) -> Result<(Generation, Vec<(u32, TokenLogprobs)>), ApiError> {
    let mut lps = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(t) => {
                if let Some(l) = t.logprobs {
                    lps.push((t.id, l));
                }
            }
            GenEvent::Done(g) => return Ok((*g, lps)),
            GenEvent::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::internal("generation ended without a result"))
}

fn record(st: &AppState, id: &str, gen: &Generation, start: Instant) {
    let m = &st.metrics;
    m.prompt_tokens.inc_by(gen.prompt_tokens as u64);
    m.generated_tokens.inc_by(gen.tokens.len() as u64);
    m.ttft.observe(gen.timings.ttft_ms / 1e3);
    if gen.tokens.len() > 1 {
        m.token_latency.observe(gen.timings.decode_ms / 1e3 / (gen.tokens.len() - 1) as f64);
    }
    m.queue_depth.set(st.scheduler.queue_depth() as i64);
    if let Some(s) = &gen.spec {
        m.spec.observe(s);
        tracing::info!(id, "{}", s.summary());
    }
    tracing::info!(
        id,
        prompt_tokens = gen.prompt_tokens,
        generated = gen.tokens.len(),
        ttft_ms = format!("{:.0}", gen.timings.ttft_ms),
        tok_s = format!("{:.1}", gen.decode_tok_s()),
        total_ms = format!("{:.0}", start.elapsed().as_secs_f64() * 1e3),
        finish_reason = finish_str(gen.finish_reason),
        "request done"
    );
}

async fn stream_events(
    st: Arc<AppState>,
    mut rx: UnboundedReceiver<GenEvent>,
    out: tokio::sync::mpsc::UnboundedSender<Result<Event, Infallible>>,
    meta: Meta,
    p: GenParams,
    start: Instant,
) {
    let send = |v: Value| out.send(Ok(Event::default().data(v.to_string()))).is_ok();
    if meta.kind == Kind::Chat
        && !send(meta.chunk(json!({"role": "assistant", "content": ""}), Value::Null, None))
    {
        return;
    }
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(t) => {
                let lp = match (&t.logprobs, p.logprobs.is_some()) {
                    (Some(l), true) => logprobs_json(&st, &[(t.id, l.clone())], meta.kind),
                    _ => Value::Null,
                };
                if t.text.is_empty() && lp.is_null() {
                    continue;
                }
                if !send(meta.chunk(meta.text_delta(&t.text), lp, None)) {
                    return;
                }
            }
            GenEvent::Done(gen) => {
                record(&st, &meta.id, &gen, start);
                let empty = if meta.kind == Kind::Chat { json!({}) } else { json!("") };
                send(meta.chunk(empty, Value::Null, Some(finish_str(gen.finish_reason))));
                if p.include_usage {
                    let mut u = meta.chunk(Value::Null, Value::Null, None);
                    u["choices"] = json!([]);
                    u["usage"] = Meta::usage(&gen);
                    send(u);
                }
                let _ = out.send(Ok(Event::default().data("[DONE]")));
                return;
            }
            GenEvent::Failed(e) => {
                st.metrics.request_errors.inc();
                send(e.body());
                let _ = out.send(Ok(Event::default().data("[DONE]")));
                return;
            }
        }
    }
}

pub async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    let mut data = vec![
        json!({"id": st.model_name, "object": "model", "created": st.started, "owned_by": "strata"}),
    ];
    data.extend(
        st.config.model_aliases.iter().map(
            |a| json!({"id": a, "object": "model", "created": st.started, "owned_by": "strata"}),
        ),
    );
    Json(json!({"object": "list", "data": data}))
}

/// `{"status": "ok"}` for anyone; with the API key (or when none is set) also the model, slots
/// and the memory plan (without file paths).
pub async fn health(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
) -> Json<Value> {
    if !crate::http::authorized(&st, &headers) {
        return Json(json!({"status": "ok"}));
    }
    let mut plan =
        st.config.plan.as_ref().and_then(|p| serde_json::to_value(p).ok()).unwrap_or(Value::Null);
    strip_paths(&mut plan);
    Json(json!({
        "status": "ok",
        "model": st.model_name,
        "slots": {"total": st.config.parallel, "active": st.scheduler.active(), "queued": st.scheduler.queue_depth()},
        "plan": plan,
    }))
}

/// Removes every `path` field and the recommended command (both name the model file's location on
/// the server) from the plan object.
fn strip_paths(v: &mut Value) {
    match v {
        Value::Object(o) => {
            o.remove("path");
            o.remove("recommended_command");
            o.values_mut().for_each(strip_paths);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_paths),
        _ => {}
    }
}

pub async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.queue_depth.set(st.scheduler.queue_depth() as i64);
    st.metrics.active.set(st.scheduler.active() as i64);
    if let Some(x) = st.engine.model.experts().stats() {
        st.metrics.experts.observe(x);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], st.metrics.render())
        .into_response()
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

pub async fn method_not_allowed() -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        ..ApiError::bad_request("Method not allowed for this route")
    }
}
