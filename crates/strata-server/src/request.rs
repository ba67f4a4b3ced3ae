//! Parsing and validation of OpenAI request bodies. Every rejection names the field (`param`).
//! Fields OpenAI defines that Strata does not implement are refused by name (never silently
//! ignored, [`UNSUPPORTED_CHAT`], [`UNSUPPORTED_COMPLETION`]); fields OpenAI does not define are
//! ignored, as OpenAI does.

use serde_json::Value;
use strata_engine::SamplingParams;
use strata_formats::ChatMessage;
use strata_grammar::GrammarSpec;

use crate::error::ApiError;
use crate::tools::Tools;

/// What both endpoints share after validation.
#[derive(Debug, Clone)]
pub struct GenParams {
    pub max_tokens: Option<usize>,
    /// The field `max_tokens` came from (`max_completion_tokens` or `max_tokens`).
    pub max_tokens_key: Option<&'static str>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Number of top alternatives per token when logprobs were asked for.
    pub logprobs: Option<usize>,
    /// llama.cpp extension: keep generating past EOS.
    pub ignore_eos: bool,
    /// Choices sampled from one prefill (OpenAI `n`).
    pub n: usize,
    /// `logit_bias`: `[(token id, bias)]`, ids checked against the vocabulary by the caller.
    pub logit_bias: Vec<(u64, f32)>,
    /// The grammar the output follows: `response_format` (`json_object`, `json_schema`) or the
    /// `grammar` extension (a Lark grammar in llguidance's dialect).
    pub grammar: Option<GrammarSpec>,
    /// Chat only: `tools`, `tool_choice`, `parallel_tool_calls`.
    pub tools: Option<Tools>,
}

pub enum Prompt {
    Chat(Vec<ChatMessage>),
    Text(String),
    /// Token ids as sent (checked against the vocabulary before use).
    Tokens(Vec<u64>),
}

impl Prompt {
    /// Bytes of text to tokenize (0 for token ids): what bounds the tokenizer's work.
    pub fn text_bytes(&self) -> usize {
        match self {
            Prompt::Chat(m) => m.iter().map(|m| m.content.len()).sum(),
            Prompt::Text(t) => t.len(),
            Prompt::Tokens(_) => 0,
        }
    }
}

/// OpenAI chat-completion fields that change the output and that Strata does not implement:
/// each is refused with a 400 naming it when present with a non-default value. (`user`,
/// `metadata`, `service_tier`, `prompt_cache_key` and `safety_identifier` do not change the
/// output and are accepted.)
pub const UNSUPPORTED_CHAT: [&str; 9] = [
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "reasoning_effort",
    "verbosity",
    "store",
];

/// The same for `/v1/completions`.
pub const UNSUPPORTED_COMPLETION: [&str; 3] = ["echo", "suffix", "best_of"];

/// Whether `v` is the value OpenAI treats as "not set" for `key` (absent, null, false, empty,
/// `best_of: 1`, `parallel_tool_calls: true`, `tool_choice: "none"`).
fn is_default(key: &str, v: &Value) -> bool {
    match (key, v) {
        (_, Value::Null | Value::Bool(false)) => true,
        (_, Value::String(s)) if s.is_empty() => true,
        (_, Value::Array(a)) if a.is_empty() => true,
        (_, Value::Object(o)) if o.is_empty() => true,
        ("best_of", Value::Number(n)) => n.as_u64() == Some(1),
        ("modalities", Value::Array(a)) => a.iter().all(|m| m == "text"),
        _ => false,
    }
}

/// Refuses any field of `unsupported` that `body` sets.
pub fn refuse_unsupported(body: &Value, unsupported: &[&str]) -> Result<(), ApiError> {
    for key in unsupported {
        if let Some(v) = body.get(*key) {
            if !is_default(key, v) {
                return Err(ApiError::invalid(key, format!("`{key}` is not supported by this server (Strata); remove it or send its default")));
            }
        }
    }
    Ok(())
}

/// `model`: required, a string, the served model's id or one of its aliases.
pub fn check_model(body: &Value, served: &str, aliases: &[String]) -> Result<(), ApiError> {
    match body.get("model") {
        None | Some(Value::Null) => Err(ApiError::invalid(
            "model",
            format!("`model` is required (this server serves `{served}`)"),
        )),
        Some(Value::String(m)) if m == served || aliases.iter().any(|a| a == m) => Ok(()),
        Some(Value::String(m)) => Err(ApiError::model_not_found(m, served)),
        Some(_) => Err(ApiError::invalid("model", "`model` must be a string")),
    }
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
        Some(x) if !(lo..=hi).contains(&x) => {
            Err(ApiError::invalid(key, format!("`{key}` must be between {lo} and {hi}, got {x}")))
        }
        _ => Ok(v),
    }
}

/// Parses the fields shared by `/v1/chat/completions` and `/v1/completions`. `defaults` are the
/// server's sampling defaults; `chat` selects OpenAI's chat semantics for `logprobs`.
pub fn gen_params(
    body: &Value,
    defaults: &SamplingParams,
    chat: bool,
) -> Result<GenParams, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request("The request body must be a JSON object"));
    }
    let n = match int(body, "n")? {
        None => 1,
        Some(n) if (1..=MAX_N).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                "n",
                format!("`n` must be between 1 and {MAX_N}, got {n}"),
            ))
        }
    };
    let (mut max_tokens, mut max_tokens_key) = (None, None);
    for key in ["max_completion_tokens", "max_tokens"] {
        if let Some(m) = int(body, key)? {
            if m < 1 {
                return Err(ApiError::invalid(key, format!("`{key}` must be at least 1, got {m}")));
            }
            if max_tokens.is_none() {
                max_tokens = Some(m as usize);
                max_tokens_key = Some(key);
            }
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
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1, 0 or positive, got {k}"),
            ));
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
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("`repetition_penalty` must be positive, got {p}"),
            ));
        }
        s.repeat_penalty = p;
    }
    if let Some(seed) = body.get("seed").filter(|v| !v.is_null()) {
        s.seed = Some(
            seed.as_u64()
                .or_else(|| seed.as_i64().map(|x| x as u64))
                .ok_or_else(|| ApiError::invalid("seed", "`seed` must be an integer"))?,
        );
    }
    let stop = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(x)) => vec![x.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str().map(String::from).ok_or_else(|| {
                    ApiError::invalid("stop", "`stop` must be a string or a list of strings")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid("stop", "`stop` must be a string or a list of strings"))
        }
    };
    let stream = boolean(body, "stream")?.unwrap_or(false);
    let include_usage = match body.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(o @ Value::Object(_)) => boolean(o, "include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid("stream_options", "`stream_options` must be an object"))
        }
    };
    let logprobs = if chat {
        let top = int(body, "top_logprobs")?;
        match boolean(body, "logprobs")? {
            Some(true) => {
                let n = top.unwrap_or(0);
                if !(0..=20).contains(&n) {
                    return Err(ApiError::invalid(
                        "top_logprobs",
                        "`top_logprobs` must be between 0 and 20",
                    ));
                }
                Some(n as usize)
            }
            _ if top.is_some() => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs: true`",
                ))
            }
            _ => None,
        }
    } else {
        match int(body, "logprobs")? {
            Some(n) if !(0..=20).contains(&n) => {
                return Err(ApiError::invalid("logprobs", "`logprobs` must be between 0 and 20"))
            }
            Some(n) => Some(n as usize),
            None => None,
        }
    };
    let ignore_eos = boolean(body, "ignore_eos")?.unwrap_or(false);
    let tools = if chat { crate::tools::parse(body)? } else { None };
    let grammar = grammar(body)?;
    // The tools' grammar is made with the model's call format (routes.rs).
    if grammar.is_some() && tools.as_ref().is_some_and(Tools::active) {
        return Err(ApiError::invalid(
            "tools",
            "`tools` cannot be combined with `response_format` / `grammar`",
        ));
    }
    Ok(GenParams {
        max_tokens,
        max_tokens_key,
        sampling: s,
        stop,
        stream,
        include_usage,
        logprobs,
        ignore_eos,
        n,
        logit_bias: logit_bias(body)?,
        grammar,
        tools,
    })
}

/// Most choices one request may ask for.
pub const MAX_N: i64 = 16;

/// `logit_bias`: `{"token id": bias}` with biases in −100..=100.
fn logit_bias(body: &Value) -> Result<Vec<(u64, f32)>, ApiError> {
    let map = match body.get("logit_bias") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(ApiError::invalid(
                "logit_bias",
                "`logit_bias` must be an object of token ids to biases",
            ))
        }
    };
    map.iter()
        .map(|(k, v)| {
            let id = k.parse::<u64>().map_err(|_| {
                ApiError::invalid("logit_bias", format!("`logit_bias` key `{k}` is not a token id"))
            })?;
            match v.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                _ => Err(ApiError::invalid(
                    "logit_bias",
                    format!("`logit_bias[{k}]` must be a number between -100 and 100"),
                )),
            }
        })
        .collect()
}

/// `response_format` (`text`, `json_object`, `json_schema` with `schema` and `strict`) and the
/// `grammar` extension (a Lark grammar, llguidance's dialect); at most one of them.
fn grammar(body: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    let from_format = match body.get("response_format") {
        None | Some(Value::Null) => None,
        Some(rf @ Value::Object(_)) => match rf.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(GrammarSpec::JsonObject),
            Some("json_schema") => {
                let js = rf.get("json_schema").filter(|j| j.is_object()).ok_or_else(|| {
                    ApiError::invalid(
                        "response_format",
                        "`response_format.json_schema` is required",
                    )
                })?;
                boolean(js, "strict")?;
                match js.get("schema") {
                    Some(s @ Value::Object(_)) => Some(GrammarSpec::JsonSchema(s.clone())),
                    Some(Value::Bool(true)) | None => Some(GrammarSpec::JsonObject),
                    Some(_) => {
                        return Err(ApiError::invalid(
                            "response_format",
                            "`response_format.json_schema.schema` must be a JSON schema object",
                        ))
                    }
                }
            }
            other => {
                return Err(ApiError::invalid(
                    "response_format",
                    format!(
                        "`response_format.type` must be text, json_object or json_schema, got {}",
                        other.unwrap_or("nothing")
                    ),
                ))
            }
        },
        Some(_) => {
            return Err(ApiError::invalid("response_format", "`response_format` must be an object"))
        }
    };
    let from_grammar = match body.get("grammar") {
        None | Some(Value::Null) => None,
        Some(Value::String(g)) if !g.trim().is_empty() => Some(GrammarSpec::Lark(g.clone())),
        Some(_) => {
            return Err(ApiError::invalid(
                "grammar",
                "`grammar` must be a non-empty string (a Lark grammar, llguidance's dialect)",
            ))
        }
    };
    match (from_format, from_grammar) {
        (Some(_), Some(_)) => {
            Err(ApiError::invalid("grammar", "`grammar` cannot be combined with `response_format`"))
        }
        (a, b) => Ok(a.or(b)),
    }
}

/// `messages`: a non-empty list of `{role, content}` where content is a string or a list of
/// `{type: "text", text}` parts.
pub fn chat_messages(body: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let msgs = match body.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid("messages", "`messages` must not be empty"))
        }
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("messages", "`messages` is required"))
        }
        Some(_) => return Err(ApiError::invalid("messages", "`messages` must be a list")),
    };
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            let param = format!("messages[{i}]");
            let role = m.get("role").and_then(|r| r.as_str()).ok_or_else(|| ApiError::invalid(&param, format!("{param}.role must be a string")))?;
            if !["system", "user", "assistant", "developer", "tool"].contains(&role) {
                return Err(ApiError::invalid(&param, format!("{param}.role `{role}` is not one of system, user, assistant, tool")));
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
            let mut msg = ChatMessage::new(role, content);
            if role == "assistant" {
                msg.tool_calls = message_tool_calls(m, &param)?;
            }
            if role == "tool" {
                match m.get("tool_call_id") {
                    Some(Value::String(id)) => msg.tool_call_id = Some(id.clone()),
                    _ => return Err(ApiError::invalid(&param, format!("{param}.tool_call_id is required for role tool"))),
                }
            }
            if let Some(Value::String(n)) = m.get("name") {
                msg.name = Some(n.clone());
            }
            Ok(msg)
        })
        .collect()
}

/// `prompt` of `/v1/completions`: a string, a list with one string, or a list of token ids
/// (non-negative integers; their range is checked against the vocabulary by the caller).
pub fn completion_prompt(body: &Value) -> Result<Prompt, ApiError> {
    match body.get("prompt") {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(Prompt::Text(a[0].as_str().unwrap_or_default().to_string()))
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => a
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_u64().ok_or_else(|| {
                    ApiError::invalid(
                        "prompt",
                        format!("prompt[{i}] = {x} is not a token id (a non-negative integer)"),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Prompt::Tokens),
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(_) => Err(ApiError::invalid(
            "prompt",
            "`prompt` must be a string, a list with one string, or a list of token ids",
        )),
    }
}

/// An assistant message's `tool_calls` in the chat-template convention (arguments parsed from
/// their JSON text into an object).
fn message_tool_calls(m: &Value, param: &str) -> Result<Option<Value>, ApiError> {
    let calls = match m.get("tool_calls") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) if a.is_empty() => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::invalid(param, format!("{param}.tool_calls must be a list")))
        }
    };
    let bad = || {
        ApiError::invalid(
            param,
            format!("{param}.tool_calls entries must be {{id, type: \"function\", function: {{name, arguments}}}}"),
        )
    };
    let mut out = Vec::with_capacity(calls.len());
    for c in calls {
        let f = c.get("function").ok_or_else(bad)?;
        let name = f.get("name").and_then(Value::as_str).ok_or_else(bad)?;
        let args = match f.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).map_err(|e| {
                ApiError::invalid(param, format!("{param}.tool_calls: arguments are not JSON: {e}"))
            })?,
            Some(v @ Value::Object(_)) => v.clone(),
            None | Some(Value::Null) => serde_json::json!({}),
            Some(_) => return Err(bad()),
        };
        out.push(serde_json::json!({
            "id": c.get("id").cloned().unwrap_or(Value::Null),
            "type": "function",
            "function": {"name": name, "arguments": args}
        }));
    }
    Ok(Some(Value::Array(out)))
}
