//! Chat templates rendered with `minijinja` the way transformers' `apply_chat_template` renders them
//! (transformers `src/transformers/utils/chat_template_utils.py`: jinja2 sandbox with
//! `trim_blocks=True, lstrip_blocks=True`, the `raise_exception` and `strftime_now` globals and a
//! `tojson` filter that is Python's `json.dumps(ensure_ascii=False)`).

use serde::{Deserialize, Serialize};

use crate::error::{FormatError, Result};

/// One chat message. `content` is plain text (array-of-parts content is flattened by the caller).
/// Tool use follows transformers' chat-template convention: an assistant message's `tool_calls`
/// (`[{type: "function", function: {name, arguments}}]`, arguments an object) and a `tool`
/// message's `tool_call_id`; absent fields are undefined in the template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// Instructions a chat template may execute per rendering (minijinja fuel): ample for any real
/// template over a long conversation, a bound for a hostile one.
pub const TEMPLATE_FUEL: u64 = 20_000_000;

/// Bytes a chat template may write per rendering.
pub const TEMPLATE_MAX_OUTPUT: usize = 64 << 20;

/// An output buffer that refuses to grow past `limit` bytes.
struct LimitedWriter {
    buf: Vec<u8>,
    limit: usize,
}

impl std::io::Write for LimitedWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.limit {
            return Err(std::io::Error::other(format!(
                "the chat template's output exceeds {} bytes",
                self.limit
            )));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A compiled chat template with the special-token strings it may reference.
#[derive(Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
}

fn tpl_err(e: minijinja::Error) -> FormatError {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    FormatError::ChatTemplate(msg)
}

/// Python-style JSON (`json.dumps` separators `", "` and `": "`).
struct PyFormatter;
impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

fn py_tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}"))
    })?;
    let mut out = Vec::new();
    let res = match indent {
        Some(n) => {
            let ind = " ".repeat(n);
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(ind.as_bytes()),
            );
            serde::Serialize::serialize(&json, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PyFormatter);
            serde::Serialize::serialize(&json, &mut ser)
        }
    };
    res.map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}"))
    })?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

impl ChatTemplate {
    /// Whether the template reads a `tools` variable (renders tool definitions itself).
    pub fn takes_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// Compiles `source`. Errors name the template syntax problem.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |fmt: String| -> String {
            chrono::Local::now().format(&fmt).to_string()
        });
        env.add_filter("tojson", py_tojson);
        // A template comes from the model file: bound its work and its output (a hostile
        // template must fail the request, never hang or exhaust memory).
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned("chat", source.to_string()).map_err(tpl_err)?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders the conversation and finds where each message's content landed in the text: the
    /// spans a tokenizer must treat as plain text (special-token strings a user typed must not
    /// become control tokens). The template is rendered a second time with a sentinel in place of
    /// each content, and the real rendering is matched against the literal text between the
    /// sentinels; a content the template passed through unchanged or trimmed is found.
    /// `spans` is `None` when the template transforms contents in a way this cannot follow.
    pub fn render_spans(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<Rendered> {
        let text = self.render_with_tools(messages, add_generation_prompt, tools)?;
        let marked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage { content: sentinel(i), ..m.clone() })
            .collect();
        let spans = self
            .render_with_tools(&marked, add_generation_prompt, tools)
            .ok()
            .and_then(|t| content_spans(&text, &t, messages));
        Ok(Rendered { text, spans })
    }

    /// Renders the conversation; with `add_generation_prompt` the assistant header is appended.
    ///
    /// Errors: the template fails, runs out of its instruction budget ([`TEMPLATE_FUEL`]) or
    /// writes more than [`TEMPLATE_MAX_OUTPUT`] bytes.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, add_generation_prompt, None)
    }

    /// [`Self::render`] with the request's `tools` (`[{type: "function", function: {…}}]`) in
    /// the template's `tools` variable, as transformers passes them.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String> {
        let tpl = self.env.get_template("chat").map_err(tpl_err)?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
            tools => tools,
        };
        let mut out = LimitedWriter { buf: Vec::new(), limit: TEMPLATE_MAX_OUTPUT };
        tpl.render_captured_to(ctx, &mut out).map_err(tpl_err)?;
        String::from_utf8(out.buf).map_err(|e| {
            FormatError::ChatTemplate(format!("the template wrote invalid UTF-8: {e}"))
        })
    }
}

/// A rendered conversation and the byte ranges of `text` that hold message contents.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub text: String,
    /// Byte ranges of `text` that came from message contents, in order (`None`: not found).
    pub spans: Option<Vec<std::ops::Range<usize>>>,
}

/// Private-use code points around a message index: never produced by a tokenizer's vocabulary
/// of chat markers, unchanged by `trim`, `strip` and the like.
const MARK: char = '\u{F8FF}';

fn sentinel(i: usize) -> String {
    format!("{MARK}{i}{MARK}")
}

/// Matches `real` (the rendering) against `marked` (the rendering with sentinels): literal pieces
/// must be equal, each sentinel stands for its message's content as is or trimmed.
fn content_spans(
    real: &str,
    marked: &str,
    messages: &[ChatMessage],
) -> Option<Vec<std::ops::Range<usize>>> {
    let mut parts = marked.split(MARK);
    let mut literal = parts.next()?;
    let mut pos = 0;
    let mut spans = Vec::new();
    loop {
        real.get(pos..)?.strip_prefix(literal)?;
        pos += literal.len();
        let Some(index) = parts.next() else { return (pos == real.len()).then_some(spans) };
        let content = &messages.get(index.parse::<usize>().ok()?)?.content;
        literal = parts.next()?;
        let rest = &real[pos..];
        let found = [content.as_str(), content.trim(), content.trim_start(), content.trim_end()]
            .into_iter()
            .find(|c| rest.strip_prefix(c).is_some_and(|after| after.starts_with(literal)))?;
        spans.push(pos..pos + found.len());
        pos += found.len();
    }
}
