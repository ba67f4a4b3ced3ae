//! OpenAI response bodies: full responses, stream chunks, logprobs, usage.

use serde_json::{json, Value};
use strata_engine::{FinishReason, Generation, TokenLogprobs};

use crate::tools::{parse_output, ToolFormat};
use crate::AppState;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// OpenAI's `finish_reason` for a generation that ran to its end: `stop` (an EOS token or a stop
/// string) or `length` (`max_tokens`, or the context filled up). Generations cut short never get
/// here: a client that cancelled is gone, and a server shutdown answers with a
/// `server_shutting_down` error instead (docs: README, "Serving").
pub fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

/// What every response and chunk of one request carries.
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub kind: Kind,
    /// Chat requests with active tools: how to read calls out of the text.
    pub tool_format: Option<ToolFormat>,
    /// Choices.
    pub n: usize,
}

/// One finished choice and its log-probabilities.
pub struct Choice {
    pub gen: Generation,
    pub logprobs: Vec<(u32, TokenLogprobs)>,
}

impl Meta {
    /// Usage of all choices: the prompt once, every choice's tokens.
    pub fn usage(gens: &[&Generation]) -> Value {
        let prompt = gens.first().map_or(0, |g| g.prompt_tokens);
        let completion: usize = gens.iter().map(|g| g.tokens.len()).sum();
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    /// A chat choice's message and finish reason: tool calls parsed out of the text when the
    /// request has tools (finish reason `tool_calls`).
    pub fn message(&self, gen: &Generation) -> (Value, &'static str) {
        let finish = finish_str(gen.finish_reason);
        match self.tool_format {
            Some(f) => {
                let p = parse_output(&gen.text, f);
                if p.calls.is_empty() {
                    (json!({"role": "assistant", "content": gen.text}), finish)
                } else {
                    let finish = if p.truncated { "length" } else { "tool_calls" };
                    (
                        json!({"role": "assistant", "content": p.content, "tool_calls": p.calls}),
                        finish,
                    )
                }
            }
            None => (json!({"role": "assistant", "content": gen.text}), finish),
        }
    }

    pub fn full_response(&self, st: &AppState, choices: &[Choice], want_lp: bool) -> Value {
        let out: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let lp =
                    if want_lp { logprobs_json(st, &c.logprobs, self.kind) } else { Value::Null };
                match self.kind {
                    Kind::Chat => {
                        let (message, finish) = self.message(&c.gen);
                        json!({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
                    }
                    Kind::Completion => {
                        json!({"index": i, "text": c.gen.text, "logprobs": lp, "finish_reason": finish_str(c.gen.finish_reason)})
                    }
                }
            })
            .collect();
        let object = if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
        let gens: Vec<&Generation> = choices.iter().map(|c| &c.gen).collect();
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": out, "usage": Self::usage(&gens)})
    }

    /// A stream chunk of choice `index`.
    pub fn chunk(
        &self,
        index: usize,
        delta_or_text: Value,
        logprobs: Value,
        finish: Option<&str>,
    ) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                json!({"index": index, "delta": delta_or_text, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Completion => {
                json!({"index": index, "text": delta_or_text, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        let object =
            if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]})
    }

    pub fn text_delta(&self, text: &str) -> Value {
        match self.kind {
            Kind::Chat => json!({"content": text}),
            Kind::Completion => json!(text),
        }
    }
}

/// Logprobs in OpenAI's chat (`content: [{token, logprob, bytes, top_logprobs}]`) or legacy
/// completion (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) shape. `bytes` are the
/// token's raw bytes (a piece of a multi-byte character is its own bytes, not U+FFFD's).
pub fn logprobs_json(st: &AppState, lps: &[(u32, TokenLogprobs)], kind: Kind) -> Value {
    let tok = &st.engine.tokenizer;
    let piece = |id: u32| {
        let b = tok.token_bytes(id);
        (String::from_utf8_lossy(&b).into_owned(), b)
    };
    match kind {
        Kind::Chat => json!({"content": lps.iter().map(|(id, l)| {
            let (t, b) = piece(*id);
            json!({"token": t, "logprob": l.logprob, "bytes": b,
                   "top_logprobs": l.top.iter().map(|(a, lp)| { let (s, b) = piece(*a); json!({"token": s, "logprob": lp, "bytes": b}) }).collect::<Vec<_>>()})
        }).collect::<Vec<_>>()}),
        Kind::Completion => {
            let tokens: Vec<(String, Vec<u8>)> = lps.iter().map(|(id, _)| piece(*id)).collect();
            let mut offset = 0;
            let offsets: Vec<usize> = tokens
                .iter()
                .map(|(_, b)| {
                    let o = offset;
                    offset += b.len();
                    o
                })
                .collect();
            json!({
                "tokens": tokens.iter().map(|t| &t.0).collect::<Vec<_>>(),
                "token_logprobs": lps.iter().map(|(_, l)| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": lps.iter().map(|(_, l)| l.top.iter().map(|(a, lp)| (piece(*a).0, json!(lp))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
    }
}
