//! OpenAI response bodies: full responses, stream chunks, logprobs, usage.

use serde_json::{json, Value};
use strata_engine::{FinishReason, Generation, TokenLogprobs};

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
}

impl Meta {
    pub fn usage(gen: &Generation) -> Value {
        json!({"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.tokens.len(), "total_tokens": gen.prompt_tokens + gen.tokens.len()})
    }

    pub fn full_response(
        &self,
        st: &AppState,
        gen: &Generation,
        lps: Vec<(u32, TokenLogprobs)>,
        want_lp: bool,
    ) -> Value {
        let logprobs = if want_lp { logprobs_json(st, &lps, self.kind) } else { Value::Null };
        let choice = match self.kind {
            Kind::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": gen.text}, "logprobs": logprobs, "finish_reason": finish_str(gen.finish_reason)})
            }
            Kind::Completion => {
                json!({"index": 0, "text": gen.text, "logprobs": logprobs, "finish_reason": finish_str(gen.finish_reason)})
            }
        };
        let object = if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice], "usage": Self::usage(gen)})
    }

    pub fn chunk(&self, delta_or_text: Value, logprobs: Value, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                json!({"index": 0, "delta": delta_or_text, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Completion => {
                json!({"index": 0, "text": delta_or_text, "logprobs": logprobs, "finish_reason": finish})
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
