//! Server-sent events of a streaming request: one chunk per token and choice, text that may be a
//! tool call held back until it can be parsed (then sent as a `tool_calls` delta), a final chunk
//! per choice with its finish reason, the usage chunk when asked for, and `[DONE]`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::Event;
use serde_json::{json, Value};
use strata_engine::Generation;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::request::GenParams;
use crate::response::{finish_str, logprobs_json, Kind, Meta};
use crate::scheduler::GenEvent;
use crate::tools::{may_be_call, parse_output};
use crate::AppState;

/// One choice's streaming state.
#[derive(Default)]
struct ChoiceState {
    /// Text held back while it may be a tool call.
    held: String,
    /// The text is plain: stream it as it comes.
    plain: bool,
    done: Option<Generation>,
}

pub async fn stream_events(
    st: Arc<AppState>,
    mut rx: UnboundedReceiver<GenEvent>,
    out: UnboundedSender<Result<Event, Infallible>>,
    meta: Meta,
    p: GenParams,
    start: Instant,
) {
    let send = |v: Value| out.send(Ok(Event::default().data(v.to_string()))).is_ok();
    let mut states: Vec<ChoiceState> = (0..meta.n).map(|_| ChoiceState::default()).collect();
    if meta.kind == Kind::Chat {
        for i in 0..meta.n {
            if !send(meta.chunk(i, json!({"role": "assistant", "content": ""}), Value::Null, None))
            {
                return;
            }
        }
    }
    let tools = meta.kind == Kind::Chat && meta.tool_format.is_some();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(c, t) => {
                let Some(state) = states.get_mut(c) else { continue };
                let lp = match (&t.logprobs, p.logprobs.is_some()) {
                    (Some(l), true) => logprobs_json(&st, &[(t.id, l.clone())], meta.kind),
                    _ => Value::Null,
                };
                let mut text = t.text;
                if tools && !state.plain {
                    state.held.push_str(&text);
                    let fmt = meta.tool_format.unwrap_or(crate::tools::ToolFormat::Hermes);
                    if state.held.trim().is_empty() || may_be_call(&state.held, fmt) {
                        text = String::new(); // held until it parses (or turns out to be text)
                    } else {
                        state.plain = true;
                        text = std::mem::take(&mut state.held);
                    }
                }
                if text.is_empty() && lp.is_null() {
                    continue;
                }
                if !send(meta.chunk(c, meta.text_delta(&text), lp, None)) {
                    return;
                }
            }
            GenEvent::Done(c, gen) => {
                let Some(state) = states.get_mut(c) else { continue };
                let mut finish = finish_str(gen.finish_reason);
                if !state.held.is_empty() {
                    let fmt = meta.tool_format.unwrap_or(crate::tools::ToolFormat::Hermes);
                    let parsed = parse_output(&state.held, fmt);
                    let delta = if parsed.calls.is_empty() {
                        meta.text_delta(&state.held)
                    } else {
                        finish = if parsed.truncated { "length" } else { "tool_calls" };
                        let calls: Vec<Value> = parsed
                            .calls
                            .iter()
                            .enumerate()
                            .map(|(i, call)| {
                                let mut call = call.clone();
                                call["index"] = json!(i);
                                call
                            })
                            .collect();
                        json!({"tool_calls": calls})
                    };
                    if !send(meta.chunk(c, delta, Value::Null, None)) {
                        return;
                    }
                }
                let empty = if meta.kind == Kind::Chat { json!({}) } else { json!("") };
                if !send(meta.chunk(c, empty, Value::Null, Some(finish))) {
                    return;
                }
                state.done = Some(*gen);
                if states.iter().all(|s| s.done.is_some()) {
                    let gens: Vec<&Generation> =
                        states.iter().filter_map(|s| s.done.as_ref()).collect();
                    crate::routes::record(&st, &meta.id, &gens, start);
                    if p.include_usage {
                        let mut u = meta.chunk(0, Value::Null, Value::Null, None);
                        u["choices"] = json!([]);
                        u["usage"] = Meta::usage(&gens);
                        send(u);
                    }
                    let _ = out.send(Ok(Event::default().data("[DONE]")));
                    return;
                }
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
