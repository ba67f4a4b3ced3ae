//! Tool calling (OpenAI `tools`, `tool_choice`, `parallel_tool_calls`): the tools go to the chat
//! template (transformers' `tools` variable) or, for a template that takes none, into a Hermes-style
//! system prompt (Strata's default, below); the model's output is parsed back into `tool_calls`.
//!
//! Output formats, chosen from the chat template: Hermes / Qwen (`<tool_call>{"name", "arguments"}
//! </tool_call>`, also the default), Llama 3.x JSON (`{"name", "parameters"}`, optionally after
//! `<|python_tag|>`), Mistral (`[TOOL_CALLS][{"name", "arguments"}, …]`).
//!
//! `tool_choice` `required` and a named function are enforced with a grammar (the call's JSON must
//! follow the tool's `parameters` schema); `auto` lets the model answer in text or call tools, the
//! calls grammar-checked: an answer that starts with the format's opening marker is a call.

use serde_json::{json, Value};
use strata_formats::ChatMessage;
use strata_grammar::GrammarSpec;

use crate::error::ApiError;

/// How the model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
    Mistral,
}

impl ToolFormat {
    /// The format a chat template uses (Hermes when it shows none).
    pub fn of_template(source: &str) -> Self {
        if source.contains("[TOOL_CALLS]") {
            Self::Mistral
        } else if source.contains("<tool_call>") {
            Self::Hermes
        } else if source.contains("<|python_tag|>") || source.contains("<|start_header_id|>") {
            Self::Llama3
        } else {
            Self::Hermes
        }
    }

    /// The text a call starts with.
    fn opener(self) -> &'static str {
        match self {
            Self::Hermes => "<tool_call>",
            Self::Llama3 => "{",
            Self::Mistral => "[TOOL_CALLS]",
        }
    }
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's validated tools.
#[derive(Debug, Clone)]
pub struct Tools {
    /// As sent: `[{type: "function", function: {name, description?, parameters?}}]`.
    pub defs: Value,
    pub choice: ToolChoice,
    pub parallel: bool,
}

fn name_ok(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Parses `tools`, `tool_choice`, `parallel_tool_calls`. `None` without tools (then
/// `tool_choice` may only be `none` / `auto`).
pub fn parse(body: &Value) -> Result<Option<Tools>, ApiError> {
    let list = match body.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) if a.is_empty() => None,
        Some(Value::Array(a)) => Some(a),
        Some(_) => return Err(ApiError::invalid("tools", "`tools` must be a list")),
    };
    let choice = match body.get("tool_choice") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` `{other}` is not none, auto, required or an object"),
                ))
            }
        }),
        Some(o @ Value::Object(_)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` must be {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )
                })?;
            Some(ToolChoice::Named(name.to_string()))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` must be a string or object",
            ))
        }
    };
    let parallel = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be a boolean",
            ))
        }
    };
    let Some(list) = list else {
        return match choice {
            None | Some(ToolChoice::None) | Some(ToolChoice::Auto) => Ok(None),
            Some(_) => Err(ApiError::invalid("tool_choice", "`tool_choice` needs `tools`")),
        };
    };
    let mut names = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(&param, format!("{param}.type must be \"function\"")));
        }
        let f = t
            .get("function")
            .filter(|f| f.is_object())
            .ok_or_else(|| ApiError::invalid(&param, format!("{param}.function is required")))?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        if !name_ok(name) {
            return Err(ApiError::invalid(
                &param,
                format!("{param}.function.name must be 1-64 letters, digits, _ or -"),
            ));
        }
        if names.contains(&name) {
            return Err(ApiError::invalid(&param, format!("two tools are named `{name}`")));
        }
        match f.get("parameters") {
            None | Some(Value::Null) | Some(Value::Object(_)) => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    &param,
                    format!("{param}.function.parameters must be a JSON schema object"),
                ))
            }
        }
        names.push(name);
    }
    let choice = choice.unwrap_or(ToolChoice::Auto);
    if let ToolChoice::Named(n) = &choice {
        if !names.contains(&n.as_str()) {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` names `{n}`, which is not among `tools`"),
            ));
        }
    }
    Ok(Some(Tools { defs: Value::Array(list.clone()), choice, parallel }))
}

impl Tools {
    /// Whether the model may call tools at all.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    fn functions(&self) -> impl Iterator<Item = &Value> {
        self.defs.as_array().into_iter().flatten().filter_map(|t| t.get("function"))
    }

    /// The JSON schema of one call in `format`: `{"name": const, "arguments" or "parameters":
    /// the tool's schema}`, one alternative per allowed tool.
    fn call_schema(&self, format: ToolFormat) -> Value {
        let args = if format == ToolFormat::Llama3 { "parameters" } else { "arguments" };
        let alts: Vec<Value> = self
            .functions()
            .filter(|f| match &self.choice {
                ToolChoice::Named(n) => f.get("name").and_then(Value::as_str) == Some(n),
                _ => true,
            })
            .map(|f| {
                let params = f
                    .get("parameters")
                    .cloned()
                    .filter(|p| p.as_object().is_some_and(|o| !o.is_empty()))
                    .unwrap_or_else(|| json!({"type": "object"}));
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, args: params},
                    "required": ["name", args],
                    "additionalProperties": false
                })
            })
            .collect();
        if alts.len() == 1 {
            alts.into_iter().next().unwrap_or(Value::Null)
        } else {
            json!({"anyOf": alts})
        }
    }

    /// The grammar that enforces `tool_choice`: calls only (`required`, named), or text that does
    /// not start with the call marker, or calls (`auto`). `None` for `none`.
    pub fn grammar(&self, format: ToolFormat) -> Option<GrammarSpec> {
        let schema = strata_grammar::compact(self.call_schema(format)).to_string();
        let calls = match (format, self.parallel) {
            (ToolFormat::Hermes, true) => "calls: call (\"\\n\" call)*",
            (ToolFormat::Hermes, false) => "calls: call",
            (ToolFormat::Llama3, _) => "calls: call",
            (ToolFormat::Mistral, true) => "calls: \"[TOOL_CALLS][\" call (\", \" call)* \"]\"",
            (ToolFormat::Mistral, false) => "calls: \"[TOOL_CALLS][\" call \"]\"",
        };
        let call = match format {
            ToolFormat::Hermes => {
                format!("call: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"")
            }
            _ => format!("call: %json {schema}"),
        };
        // Text answers may not start like a call (`auto`); an empty answer ends at once.
        let text = match format {
            ToolFormat::Hermes => "TEXT: /[^<](.|\\n)*/",
            ToolFormat::Llama3 => "TEXT: /[^{](.|\\n)*/",
            ToolFormat::Mistral => "TEXT: /[^\\[](.|\\n)*/",
        };
        let start = match self.choice {
            ToolChoice::None => return None,
            ToolChoice::Auto => "start: TEXT | calls",
            ToolChoice::Required | ToolChoice::Named(_) => "start: calls",
        };
        Some(GrammarSpec::Lark(format!("{start}\n{calls}\n{call}\n{text}\n")))
    }

    /// Strata's default tool prompt (the Hermes function-calling format) for templates that take
    /// no `tools`: a system message listing them, merged into the first system message.
    pub fn default_prompt(&self) -> String {
        let mut s = String::from(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        );
        for t in self.defs.as_array().into_iter().flatten() {
            s.push('\n');
            s.push_str(&t.to_string());
        }
        s.push_str(
            "\n</tools>\n\nFor each function call, return a json object with function name and \
             arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
             {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        s
    }
}

/// Rewrites a conversation for a template that takes no `tools`: the default tool prompt in the
/// system message, earlier calls as `<tool_call>` text, tool results as user messages in
/// `<tool_response>` tags (Hermes' convention; any template renders these roles).
pub fn for_plain_template(messages: Vec<ChatMessage>, tools: Option<&Tools>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    if let Some(t) = tools.filter(|t| t.active()) {
        let prompt = t.default_prompt();
        match messages.first().filter(|m| m.role == "system") {
            Some(m) => out.push(ChatMessage::new("system", format!("{}\n\n{prompt}", m.content))),
            None => out.push(ChatMessage::new("system", prompt)),
        }
    }
    let skip = usize::from(!out.is_empty() && messages.first().is_some_and(|m| m.role == "system"));
    for m in messages.into_iter().skip(skip) {
        match (m.role.as_str(), &m.tool_calls) {
            ("assistant", Some(calls)) => {
                let mut text = m.content.clone();
                for c in calls.as_array().into_iter().flatten() {
                    let f = &c["function"];
                    let call = json!({"name": f["name"], "arguments": f["arguments"]});
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                }
                out.push(ChatMessage::new("assistant", text));
            }
            ("tool", _) => out.push(ChatMessage::new(
                "user",
                format!("<tool_response>\n{}\n</tool_response>", m.content),
            )),
            _ => out.push(ChatMessage::new(m.role, m.content)),
        }
    }
    out
}

/// Model output split into text and tool calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub content: Option<String>,
    /// OpenAI `tool_calls`: `[{id, type: "function", function: {name, arguments: JSON text}}]`.
    pub calls: Vec<Value>,
    /// A last, incomplete call was dropped (the output was cut off).
    pub truncated: bool,
}

fn call_id() -> String {
    const ABC: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let s: String =
        (0..24).map(|_| ABC[rand::random::<u32>() as usize % ABC.len()] as char).collect();
    format!("call_{s}")
}

fn openai_call(v: &Value, args_key: &str) -> Option<Value> {
    let name = v.get("name")?.as_str()?;
    let args = v.get(args_key).or_else(|| v.get("arguments")).or_else(|| v.get("parameters"))?;
    let args = match args {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    Some(
        json!({"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}),
    )
}

/// Whether `text` (the output so far) is, or may still become, a tool call in `format`: the
/// streaming side holds such text back.
pub fn may_be_call(text: &str, format: ToolFormat) -> bool {
    let t = text.trim_start();
    let t = match format {
        ToolFormat::Llama3 => t.strip_prefix("<|python_tag|>").unwrap_or(t).trim_start(),
        _ => t,
    };
    let opener = format.opener();
    t.starts_with(opener) || (!t.is_empty() && opener.starts_with(t))
}

/// Splits the model's output into text and tool calls. Output that starts with the format's
/// opening marker and parses is calls; anything else is text.
pub fn parse_output(text: &str, format: ToolFormat) -> Parsed {
    let text_only =
        || Parsed { content: Some(text.to_string()), calls: Vec::new(), truncated: false };
    let t = text.trim();
    if !may_be_call(t, format) || t.len() < format.opener().len() {
        return text_only();
    }
    let mut calls = Vec::new();
    match format {
        ToolFormat::Hermes => {
            let (open, close) = (format.opener(), "</tool_call>");
            let mut rest = t;
            while let Some(start) = rest.find(open) {
                let body = &rest[start + open.len()..];
                let end = body.find(close);
                let (json_text, after) = match end {
                    Some(end) => (&body[..end], &body[end + close.len()..]),
                    None => (body, ""),
                };
                let closed = end.is_some();
                match serde_json::from_str::<Value>(json_text.trim())
                    .ok()
                    .and_then(|v| openai_call(&v, "arguments"))
                {
                    Some(c) => calls.push(c),
                    // A last call cut off by `max_tokens`: the complete ones stand.
                    None if !closed && !calls.is_empty() => {
                        return Parsed { content: None, calls, truncated: true }
                    }
                    None => return text_only(),
                }
                rest = after;
            }
            let rest = rest.trim();
            // The next call's opener cut off by `max_tokens`: the complete ones stand.
            if !rest.is_empty() && open.starts_with(rest) && !calls.is_empty() {
                return Parsed { content: None, calls, truncated: true };
            }
            if !rest.is_empty() {
                return text_only();
            }
        }
        ToolFormat::Llama3 => {
            let body = t.trim_start_matches("<|python_tag|>");
            for part in body.split(';').map(str::trim).filter(|p| !p.is_empty()) {
                match serde_json::from_str::<Value>(part)
                    .ok()
                    .and_then(|v| openai_call(&v, "parameters"))
                {
                    Some(c) => calls.push(c),
                    None => return text_only(),
                }
            }
        }
        ToolFormat::Mistral => {
            let body = t.trim_start_matches("[TOOL_CALLS]").trim();
            match serde_json::from_str::<Value>(body) {
                Ok(Value::Array(items)) => {
                    for v in &items {
                        match openai_call(v, "arguments") {
                            Some(c) => calls.push(c),
                            None => return text_only(),
                        }
                    }
                }
                _ => return text_only(),
            }
        }
    }
    if calls.is_empty() {
        return text_only();
    }
    Parsed { content: None, calls, truncated: false }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_format_and_leaves_text_alone() {
        let h = parse_output(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>",
            ToolFormat::Hermes,
        );
        assert_eq!(h.content, None);
        assert_eq!(h.calls.len(), 2);
        assert_eq!(h.calls[0]["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(h.calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Oslo"}));
        let l = parse_output(
            "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}",
            ToolFormat::Llama3,
        );
        assert_eq!(l.calls[0]["function"]["arguments"], "{\"x\":1}");
        let m = parse_output(
            "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\", \"arguments\": {\"k\": \"v\"}}]",
            ToolFormat::Mistral,
        );
        assert_eq!(m.calls.len(), 2);
        let cut = parse_output(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"na",
            ToolFormat::Hermes,
        );
        assert_eq!((cut.calls.len(), cut.truncated), (1, true));
        // Cut off inside the next call's opening marker.
        let cut = parse_output(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n<tool",
            ToolFormat::Hermes,
        );
        assert_eq!((cut.calls.len(), cut.truncated), (1, true));
        for (text, f) in [
            ("The weather is fine.", ToolFormat::Hermes),
            ("<tool_call>\n{\"name\": broken", ToolFormat::Hermes),
            ("{not json", ToolFormat::Llama3),
        ] {
            let p = parse_output(text, f);
            assert_eq!((p.content.as_deref(), p.calls.len()), (Some(text), 0));
        }
        assert!(may_be_call("  <tool", ToolFormat::Hermes));
        assert!(!may_be_call("Hello", ToolFormat::Hermes));
    }

    #[test]
    fn validates_tools_and_choice() {
        let tool = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
        let ok = parse(&json!({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}))
            .unwrap()
            .unwrap();
        assert_eq!(ok.choice, ToolChoice::Named("f".into()));
        for bad in [
            json!({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
            json!({"tools": [tool, tool]}),
            json!({"tool_choice": "required"}),
            json!({"tools": "f"}),
        ] {
            assert!(parse(&bad).is_err(), "{bad}");
        }
        assert!(parse(&json!({"tool_choice": "none"})).unwrap().is_none());
    }

    #[test]
    fn plain_templates_get_the_default_prompt_and_hermes_history() {
        let tools = parse(&json!({"tools": [{"type": "function", "function": {"name": "f"}}]}))
            .unwrap()
            .unwrap();
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls =
            Some(json!([{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]));
        let mut result = ChatMessage::new("tool", "42");
        result.tool_call_id = Some("call_1".into());
        let msgs = for_plain_template(
            vec![
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "hi"),
                call,
                result,
            ],
            Some(&tools),
        );
        assert_eq!(msgs.len(), 4);
        assert!(msgs[0].content.starts_with("Be brief.") && msgs[0].content.contains("<tools>"));
        assert!(msgs[2].content.contains("<tool_call>\n{\"name\":\"f\",\"arguments\":{\"a\":1}}"));
        assert_eq!(msgs[3].role, "user");
        assert!(msgs[3].content.contains("<tool_response>\n42"));
    }
}
