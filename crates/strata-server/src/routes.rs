//! HTTP handlers: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`, `/metrics`.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use strata_engine::{FinishReason, GenerateRequest, Generation, TokenLogprobs};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::error::ApiError;
use crate::request::{chat_messages, completion_prompt, gen_params, GenParams, Prompt};
use crate::scheduler::GenEvent;
use crate::AppState;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

fn parse_json(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("Malformed JSON body: {e}")))
}

pub async fn chat_completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let res = async {
        let body = parse_json(&body)?;
        let params = gen_params(&body, &st.config.sampling, true)?;
        let messages = chat_messages(&body)?;
        run(st.clone(), Prompt::Chat(messages), params, Kind::Chat).await
    }
    .await;
    res.unwrap_or_else(|e| {
        st.metrics.request_errors.inc();
        e.into_response()
    })
}

pub async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let res = async {
        let body = parse_json(&body)?;
        let params = gen_params(&body, &st.config.sampling, false)?;
        let prompt = completion_prompt(&body)?;
        run(st.clone(), prompt, params, Kind::Completion).await
    }
    .await;
    res.unwrap_or_else(|e| {
        st.metrics.request_errors.inc();
        e.into_response()
    })
}

/// Tokenizes, checks the context, queues the request and answers (JSON or SSE).
async fn run(st: Arc<AppState>, prompt: Prompt, p: GenParams, kind: Kind) -> Result<Response, ApiError> {
    st.metrics.requests.inc();
    let engine = &st.engine;
    let ids = match prompt {
        Prompt::Chat(m) => engine.chat_prompt(&m).map_err(|e| ApiError::bad_request(format!("Cannot apply the chat template: {e}")))?.1,
        Prompt::Text(t) => engine.text_prompt(&t).map_err(|e| ApiError::bad_request(e.to_string()))?,
        Prompt::Tokens(t) => {
            let vocab = engine.model.config().vocab_size as u32;
            if let Some(bad) = t.iter().find(|&&x| x >= vocab) {
                return Err(ApiError::invalid("prompt", format!("token id {bad} is outside the vocabulary ({vocab})")));
            }
            t
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "The prompt is empty"));
    }
    let ctx = st.config.ctx_size;
    if ids.len() >= ctx {
        return Err(ApiError::context_length(format!("This model's context is {ctx} tokens; the prompt has {} tokens", ids.len())));
    }
    let max_tokens = match p.max_tokens {
        Some(m) if ids.len() + m > ctx => {
            return Err(ApiError::context_length(format!(
                "This model's context is {ctx} tokens; the prompt ({} tokens) plus max_tokens ({m}) exceed it",
                ids.len()
            )))
        }
        Some(m) => m,
        None => st.config.max_tokens.min(ctx - ids.len()),
    };
    let mut req = GenerateRequest::new(ids, max_tokens, p.sampling.clone());
    req.stop = p.stop.clone();
    req.logprobs = p.logprobs;
    req.ignore_eos = p.ignore_eos;
    req.prefill_chunk = st.config.prefill_chunk;
    let (tx, rx) = unbounded_channel();
    let start = Instant::now();
    let cancel = st.scheduler.submit(req, tx)?;
    st.metrics.queue_depth.set(st.scheduler.queue_depth() as i64);
    let meta = Meta { id: new_id(if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }), created: now(), model: st.model_name.clone(), kind };
    if p.stream {
        let (sse_tx, sse_rx) = unbounded_channel::<Result<Event, Infallible>>();
        let st2 = st.clone();
        tokio::spawn(async move {
            stream_events(st2, rx, sse_tx, meta, p, start).await;
            cancel.store(true, Ordering::SeqCst);
        });
        return Ok(Sse::new(UnboundedReceiverStream::new(sse_rx)).keep_alive(KeepAlive::default()).into_response());
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

async fn collect(mut rx: UnboundedReceiver<GenEvent>) -> Result<(Generation, Vec<(u32, TokenLogprobs)>), ApiError> {
    let mut lps = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(t) => {
                if let Some(l) = t.logprobs {
                    lps.push((t.id, l));
                }
            }
            GenEvent::Done(g) => return Ok((g, lps)),
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

/// Clients never see `cancelled` (they are gone, or the server is stopping): report `stop`.
fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

impl Meta {
    fn usage(gen: &Generation) -> Value {
        json!({"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.tokens.len(), "total_tokens": gen.prompt_tokens + gen.tokens.len()})
    }

    fn full_response(&self, st: &AppState, gen: &Generation, lps: Vec<(u32, TokenLogprobs)>, want_lp: bool) -> Value {
        let logprobs = if want_lp { logprobs_json(st, &lps, self.kind) } else { Value::Null };
        let choice = match self.kind {
            Kind::Chat => json!({"index": 0, "message": {"role": "assistant", "content": gen.text}, "logprobs": logprobs, "finish_reason": finish_str(gen.finish_reason)}),
            Kind::Completion => json!({"index": 0, "text": gen.text, "logprobs": logprobs, "finish_reason": finish_str(gen.finish_reason)}),
        };
        let object = if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice], "usage": Self::usage(gen)})
    }

    fn chunk(&self, delta_or_text: Value, logprobs: Value, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({"index": 0, "delta": delta_or_text, "logprobs": logprobs, "finish_reason": finish}),
            Kind::Completion => json!({"index": 0, "text": delta_or_text, "logprobs": logprobs, "finish_reason": finish}),
        };
        let object = if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]})
    }

    fn text_delta(&self, text: &str) -> Value {
        match self.kind {
            Kind::Chat => json!({"content": text}),
            Kind::Completion => json!(text),
        }
    }
}

fn logprobs_json(st: &AppState, lps: &[(u32, TokenLogprobs)], kind: Kind) -> Value {
    let tok = &st.engine.tokenizer;
    let piece = |id: u32| tok.token_text(id);
    match kind {
        Kind::Chat => json!({"content": lps.iter().map(|(id, l)| {
            let t = piece(*id);
            json!({"token": t, "logprob": l.logprob, "bytes": t.as_bytes(),
                   "top_logprobs": l.top.iter().map(|(a, lp)| { let s = piece(*a); json!({"token": s, "logprob": lp, "bytes": s.as_bytes()}) }).collect::<Vec<_>>()})
        }).collect::<Vec<_>>()}),
        Kind::Completion => {
            let tokens: Vec<String> = lps.iter().map(|(id, _)| piece(*id)).collect();
            let mut offset = 0;
            let offsets: Vec<usize> = tokens.iter().map(|t| { let o = offset; offset += t.len(); o }).collect();
            json!({
                "tokens": tokens,
                "token_logprobs": lps.iter().map(|(_, l)| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": lps.iter().map(|(_, l)| l.top.iter().map(|(a, lp)| (piece(*a), json!(lp))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
    }
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
    if meta.kind == Kind::Chat && !send(meta.chunk(json!({"role": "assistant", "content": ""}), Value::Null, None)) {
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
    Json(json!({"object": "list", "data": [{"id": st.model_name, "object": "model", "created": st.started, "owned_by": "strata"}]}))
}

pub async fn health(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "status": "ok",
        "model": st.model_name,
        "slots": {"total": st.config.parallel, "active": st.scheduler.active(), "queued": st.scheduler.queue_depth()},
        "plan": st.config.plan.clone().unwrap_or(Value::Null),
    }))
}

pub async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.queue_depth.set(st.scheduler.queue_depth() as i64);
    st.metrics.active.set(st.scheduler.active() as i64);
    if let Some(x) = st.engine.model.experts().stats() {
        st.metrics.experts.observe(x);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], st.metrics.render()).into_response()
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

pub async fn method_not_allowed() -> ApiError {
    ApiError { status: StatusCode::METHOD_NOT_ALLOWED, ..ApiError::bad_request("Method not allowed for this route") }
}
