//! Parsing and validation of OpenAI request bodies. Every rejection names the field (`param`).
//! Unknown fields are ignored, as OpenAI does.

use serde_json::Value;
use strata_engine::SamplingParams;
use strata_formats::ChatMessage;

use crate::error::ApiError;

/// What both endpoints share after validation.
#[derive(Debug, Clone)]
pub struct GenParams {
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Number of top alternatives per token when logprobs were asked for.
    pub logprobs: Option<usize>,
    /// llama.cpp extension: keep generating past EOS.
    pub ignore_eos: bool,
}

pub enum Prompt {
    Chat(Vec<ChatMessage>),
    Text(String),
    Tokens(Vec<u32>),
}

fn num(body: &Value, key: &str) -> Result<Option<f64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be a number"))),
    }
}

fn int(body: &Value, key: &str) -> Result<Option<i64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.is_i64() => Ok(n.as_i64()),
        Some(Value::Number(n)) if n.is_u64() => Ok(Some(i64::MAX)),
        Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be an integer"))),
    }
}

fn boolean(body: &Value, key: &str) -> Result<Option<bool>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be a boolean"))),
    }
}

fn range(key: &str, v: Option<f64>, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::invalid(key, format!("`{key}` must be between {lo} and {hi}, got {x}"))),
        _ => Ok(v),
    }
}

/// Parses the fields shared by `/v1/chat/completions` and `/v1/completions`. `defaults` are the
/// server's sampling defaults; `chat` selects OpenAI's chat semantics for `logprobs`.
pub fn gen_params(body: &Value, defaults: &SamplingParams, chat: bool) -> Result<GenParams, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request("The request body must be a JSON object"));
    }
    if let Some(n) = int(body, "n")? {
        if n != 1 {
            return Err(ApiError::invalid("n", format!("Only n = 1 is supported, got {n}")));
        }
    }
    let mut max_tokens = None;
    for key in ["max_completion_tokens", "max_tokens"] {
        if let Some(m) = int(body, key)? {
            if m < 1 {
                return Err(ApiError::invalid(key, format!("`{key}` must be at least 1, got {m}")));
            }
            max_tokens.get_or_insert(m as usize);
        }
    }
    let mut s = defaults.clone();
    if let Some(t) = range("temperature", num(body, "temperature")?, 0.0, 2.0)? {
        s.temperature = t;
    }
    if let Some(p) = range("top_p", num(body, "top_p")?, 0.0, 1.0)? {
        s.top_p = p;
    }
    if let Some(k) = int(body, "top_k")? {
        // -1 or 0 disable top-k (vLLM / llama.cpp conventions).
        if k < -1 {
            return Err(ApiError::invalid("top_k", format!("`top_k` must be -1, 0 or positive, got {k}")));
        }
        s.top_k = k.max(0) as usize;
    }
    if let Some(p) = range("min_p", num(body, "min_p")?, 0.0, 1.0)? {
        s.min_p = p;
    }
    if let Some(p) = range("presence_penalty", num(body, "presence_penalty")?, -2.0, 2.0)? {
        s.presence_penalty = p;
    }
    if let Some(p) = range("frequency_penalty", num(body, "frequency_penalty")?, -2.0, 2.0)? {
        s.frequency_penalty = p;
    }
    if let Some(p) = num(body, "repetition_penalty")? {
        if p <= 0.0 {
            return Err(ApiError::invalid("repetition_penalty", format!("`repetition_penalty` must be positive, got {p}")));
        }
        s.repeat_penalty = p;
    }
    if let Some(seed) = body.get("seed").filter(|v| !v.is_null()) {
        s.seed = Some(seed.as_u64().or_else(|| seed.as_i64().map(|x| x as u64)).ok_or_else(|| ApiError::invalid("seed", "`seed` must be an integer"))?);
    }
    let stop = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(x)) => vec![x.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(String::from).ok_or_else(|| ApiError::invalid("stop", "`stop` must be a string or a list of strings")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::invalid("stop", "`stop` must be a string or a list of strings")),
    };
    let stream = boolean(body, "stream")?.unwrap_or(false);
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(o @ Value::Object(_)) => boolean(o, "include_usage")?.unwrap_or(false),
        Some(_) => return Err(ApiError::invalid("stream_options", "`stream_options` must be an object")),
    };
    let logprobs = if chat {
        match boolean(body, "logprobs")? {
            Some(true) => {
                let n = int(body, "top_logprobs")?.unwrap_or(0);
                if !(0..=20).contains(&n) {
                    return Err(ApiError::invalid("top_logprobs", "`top_logprobs` must be between 0 and 20"));
                }
                Some(n as usize)
            }
            _ => None,
        }
    } else {
        match int(body, "logprobs")? {
            Some(n) if !(0..=20).contains(&n) => return Err(ApiError::invalid("logprobs", "`logprobs` must be between 0 and 20")),
            Some(n) => Some(n as usize),
            None => None,
        }
    };
    let ignore_eos = boolean(body, "ignore_eos")?.unwrap_or(false);
    Ok(GenParams { max_tokens, sampling: s, stop, stream, include_usage, logprobs, ignore_eos })
}

/// `messages`: a non-empty list of `{role, content}` where content is a string or a list of
/// `{type: "text", text}` parts.
pub fn chat_messages(body: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let msgs = match body.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "`messages` must not be empty")),
        None | Some(Value::Null) => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(_) => return Err(ApiError::invalid("messages", "`messages` must be a list")),
    };
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            let param = format!("messages[{i}]");
            let role = m.get("role").and_then(|r| r.as_str()).ok_or_else(|| ApiError::invalid(&param, format!("{param}.role must be a string")))?;
            if !["system", "user", "assistant", "developer", "tool"].contains(&role) {
                return Err(ApiError::invalid(&param, format!("{param}.role `{role}` is not one of system, user, assistant")));
            }
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                None | Some(Value::Null) => String::new(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match (p.get("type").and_then(|t| t.as_str()), p.get("text").and_then(|t| t.as_str())) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            _ => return Err(ApiError::invalid(&param, format!("{param}.content parts must be {{\"type\": \"text\", \"text\": ...}} (only text is supported)"))),
                        }
                    }
                    text
                }
                Some(_) => return Err(ApiError::invalid(&param, format!("{param}.content must be a string or a list of text parts"))),
            };
            let role = if role == "developer" { "system" } else { role };
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// `prompt` of `/v1/completions`: a string, a list with one string, or a list of token ids.
pub fn completion_prompt(body: &Value) -> Result<Prompt, ApiError> {
    match body.get("prompt") {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => Ok(Prompt::Text(a[0].as_str().unwrap_or_default().to_string())),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|x| x.is_u64()) => {
            Ok(Prompt::Tokens(a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect()))
        }
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(_) => Err(ApiError::invalid("prompt", "`prompt` must be a string, a list with one string, or a list of token ids")),
    }
}
