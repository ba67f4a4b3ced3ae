//! HTTP handlers: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`, `/metrics`
//! (`/v1/embeddings` is `embeddings.rs`, the chat page `web.rs`).
//!
//! A request's body is read under a time limit, then parsed, validated and tokenized on the
//! blocking pool (never on the async runtime, so `/health` stays responsive under huge prompts),
//! after a size check that refuses a prompt whose bytes cannot fit the context before any
//! tokenizer work.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode, Uri};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use strata_engine::{GenerateRequest, Generation};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::error::ApiError;
use crate::request::{
    chat_messages, check_model, completion_prompt, gen_params, refuse_unsupported, GenParams,
    Prompt, UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION,
};
use crate::response::{Choice, Kind, Meta};
use crate::scheduler::GenEvent;
use crate::tools::ToolFormat;
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
        let prepared = prepared?;
        run(st.clone(), prepared, kind).await
    }
    .await;
    res.unwrap_or_else(|e| {
        st.metrics.request_errors.inc();
        e.into_response()
    })
}

/// A validated request ready to queue.
pub struct Prepared {
    pub ids: Vec<u32>,
    pub params: GenParams,
    /// The tool-call format to parse the output with (chat requests with active tools).
    pub tool_format: Option<ToolFormat>,
}

/// Parses and validates the body, checks the prompt's size, tokenizes it (tools rendered into
/// it), checks the grammar compiles, and fixes `max_tokens`. Blocking work: runs on the blocking
/// pool.
fn prepare(st: &AppState, body: &[u8], kind: Kind) -> Result<Prepared, ApiError> {
    let body: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Malformed JSON body: {e}")))?;
    let chat = kind == Kind::Chat;
    let mut params = gen_params(&body, &st.config.sampling, chat)?;
    check_model(&body, &st.model_name, &st.config.model_aliases)?;
    refuse_unsupported(&body, if chat { &UNSUPPORTED_CHAT } else { &UNSUPPORTED_COMPLETION })?;
    check_n(st, params.n)?;
    let prompt = if chat { Prompt::Chat(chat_messages(&body)?) } else { completion_prompt(&body)? };
    let grammar_param = if body.get("response_format").is_some_and(|v| !v.is_null()) {
        "response_format"
    } else {
        "grammar"
    };
    drop(body);
    let engine = &st.engine;
    let ctx = st.config.ctx_size;
    let input_param = if chat { "messages" } else { "prompt" };
    let too_long = |n: String| {
        ApiError::context_length(
            Some(input_param),
            format!("This model's context is {ctx} tokens; the prompt has {n} tokens"),
        )
    };
    let least = engine.tokenizer.min_tokens_for(prompt.text_bytes());
    if least >= ctx {
        return Err(too_long(format!("at least {least}")));
    }
    let vocab = engine.model.config().vocab_size as u64;
    if let Some((id, _)) = params.logit_bias.iter().find(|(id, _)| *id >= vocab) {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("`logit_bias` token {id} is outside the vocabulary (0..{vocab})"),
        ));
    }
    let mut tool_format = None;
    let ids = match prompt {
        Prompt::Chat(m) => {
            let tpl_err = |e: strata_engine::EngineError| {
                ApiError::invalid("messages", format!("Cannot apply the chat template: {e}"))
            };
            let tpl = engine
                .chat_template
                .as_ref()
                .ok_or_else(|| tpl_err(strata_engine::EngineError::NoChatTemplate))?;
            let active = params.tools.as_ref().filter(|t| t.active());
            let (messages, defs, format) = if tpl.takes_tools() {
                (m, active.map(|t| &t.defs), ToolFormat::of_template(&tpl.source))
            } else {
                (crate::tools::for_plain_template(m, active), None, ToolFormat::Hermes)
            };
            if let Some(t) = active {
                params.grammar = t.grammar(format);
                tool_format = Some(format);
            }
            engine.chat_prompt_with_tools(&messages, defs).map_err(tpl_err)?.1
        }
        Prompt::Text(t) => {
            engine.text_prompt(&t).map_err(|e| ApiError::bad_request(e.to_string()))?
        }
        Prompt::Tokens(t) => {
            if let Some((i, bad)) = t.iter().enumerate().find(|(_, &x)| x >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("prompt[{i}] = {bad} is outside the vocabulary (0..{vocab})"),
                ));
            }
            t.into_iter().map(|x| x as u32).collect()
        }
    };
    if let Some(g) = &params.grammar {
        let param = if tool_format.is_some() { "tools" } else { grammar_param };
        engine
            .grammars()
            .map_err(|e| ApiError::invalid(param, e.to_string()))?
            .compile(g)
            .map_err(|e| ApiError::invalid(param, e.to_string()))?;
    }
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "The prompt is empty"));
    }
    if ids.len() >= ctx {
        return Err(too_long(ids.len().to_string()));
    }
    let cap = st.config.max_tokens;
    params.max_tokens = Some(match params.max_tokens {
        Some(m) if ids.len() + m > ctx => {
            return Err(ApiError::context_length(Some(input_param), format!("This model's context is {ctx} tokens; the prompt ({} tokens) plus max_tokens ({m}) exceed it", ids.len())))
        }
        Some(m) if m > cap => {
            let key = params.max_tokens_key.unwrap_or("max_tokens");
            return Err(ApiError::invalid(key, format!("`{key}` is {m}; this server allows at most {cap} (--max-tokens)")));
        }
        Some(m) => m,
        None => cap.min(ctx - ids.len()),
    });
    Ok(Prepared { ids, params, tool_format })
}

/// `n` choices need `n` sequence slots of continuous batching.
fn check_n(st: &AppState, n: usize) -> Result<(), ApiError> {
    if n > 1 && !st.scheduler.is_batched() {
        return Err(ApiError::invalid(
            "n",
            "`n` > 1 is not available with speculative decoding (the server runs one generation per slot)",
        ));
    }
    if n > st.config.parallel {
        return Err(ApiError::invalid(
            "n",
            format!(
                "`n` = {n} needs {n} sequence slots; this server has {} (--parallel)",
                st.config.parallel
            ),
        ));
    }
    Ok(())
}

/// Queues the request and answers (JSON or SSE).
async fn run(st: Arc<AppState>, prep: Prepared, kind: Kind) -> Result<Response, ApiError> {
    let p = prep.params;
    let mut req = GenerateRequest::new(prep.ids, p.max_tokens.unwrap_or(1), p.sampling.clone());
    req.stop = p.stop.clone();
    req.logprobs = p.logprobs;
    req.ignore_eos = p.ignore_eos;
    req.prefill_chunk = st.config.prefill_chunk;
    req.grammar = p.grammar.clone();
    req.logit_bias = p.logit_bias.iter().map(|&(id, b)| (id as u32, b)).collect();
    let (tx, rx) = unbounded_channel();
    let start = Instant::now();
    let meta = Meta {
        id: new_id(if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }),
        created: now(),
        model: st.model_name.clone(),
        kind,
        tool_format: prep.tool_format,
        n: p.n,
    };
    let cancel = st.scheduler.submit(req, p.n, tx, meta.id.clone())?;
    st.metrics.queue_depth.set(st.scheduler.queue_depth() as i64);
    if p.stream {
        let (sse_tx, sse_rx) = unbounded_channel();
        let st2 = st.clone();
        tokio::spawn(async move {
            crate::stream::stream_events(st2, rx, sse_tx, meta, p, start).await;
            cancel.store(true, Ordering::SeqCst);
        });
        return Ok(Sse::new(UnboundedReceiverStream::new(sse_rx))
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    // Dropping `_guard` (client went away, the handler future is dropped) cancels the generation.
    let _guard = CancelOnDrop(cancel);
    let choices = collect(rx, p.n).await?;
    let gens: Vec<&Generation> = choices.iter().map(|c| &c.gen).collect();
    record(&st, &meta.id, &gens, start);
    Ok(Json(meta.full_response(&st, &choices, p.logprobs.is_some())).into_response())
}

struct CancelOnDrop(Arc<std::sync::atomic::AtomicBool>);
impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Waits for every choice's `Done`.
async fn collect(mut rx: UnboundedReceiver<GenEvent>, n: usize) -> Result<Vec<Choice>, ApiError> {
    let mut lps: Vec<Vec<_>> = vec![Vec::new(); n];
    let mut done: Vec<Option<Generation>> = (0..n).map(|_| None).collect();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(c, t) => {
                if let (Some(l), Some(v)) = (t.logprobs, lps.get_mut(c)) {
                    v.push((t.id, l));
                }
            }
            GenEvent::Done(c, g) => {
                if let Some(d) = done.get_mut(c) {
                    *d = Some(*g);
                }
                if done.iter().all(Option::is_some) {
                    // Every entry is `Some`: flattening keeps all n, in order.
                    return Ok(done
                        .into_iter()
                        .flatten()
                        .zip(lps)
                        .map(|(gen, logprobs)| Choice { gen, logprobs })
                        .collect());
                }
            }
            GenEvent::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::internal("generation ended without a result"))
}

/// Counts a finished request's choices in the metrics and logs it.
pub(crate) fn record(st: &AppState, id: &str, gens: &[&Generation], start: Instant) {
    let m = &st.metrics;
    let Some(first) = gens.first() else { return };
    m.prompt_tokens.inc_by(first.prompt_tokens as u64);
    m.ttft.observe(first.timings.ttft_ms / 1e3);
    let generated: usize = gens.iter().map(|g| g.tokens.len()).sum();
    m.generated_tokens.inc_by(generated as u64);
    for gen in gens {
        if gen.tokens.len() > 1 {
            m.token_latency.observe(gen.timings.decode_ms / 1e3 / (gen.tokens.len() - 1) as f64);
        }
        if let Some(s) = &gen.spec {
            m.spec.observe(s);
            tracing::info!(id, "{}", s.summary());
        }
        if let Some(k) = &gen.mask {
            tracing::info!(
                id,
                grammar_compile_us = k.compile_us,
                masks = k.masks,
                mask_us_per_token = k.mask_us / k.masks.max(1),
                "grammar"
            );
        }
    }
    m.queue_depth.set(st.scheduler.queue_depth() as i64);
    tracing::info!(
        id,
        prompt_tokens = first.prompt_tokens,
        generated,
        choices = gens.len(),
        ttft_ms = format!("{:.0}", first.timings.ttft_ms),
        tok_s = format!("{:.1}", first.decode_tok_s()),
        total_ms = format!("{:.0}", start.elapsed().as_secs_f64() * 1e3),
        finish_reason = crate::response::finish_str(first.finish_reason),
        "request done"
    );
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
