//! Chat templates rendered with `minijinja` the way transformers' `apply_chat_template` renders them
//! (transformers `src/transformers/utils/chat_template_utils.py`: jinja2 sandbox with
//! `trim_blocks=True, lstrip_blocks=True`, the `raise_exception` and `strftime_now` globals and a
//! `tojson` filter that is Python's `json.dumps(ensure_ascii=False)`).

use serde::{Deserialize, Serialize};

use crate::error::{FormatError, Result};

/// One chat message. `content` is plain text (array-of-parts content is flattened by the caller).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
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
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

fn py_tojson(value: minijinja::Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = Vec::new();
    let res = match indent {
        Some(n) => {
            let ind = " ".repeat(n);
            let mut ser = serde_json::Serializer::with_formatter(&mut out, serde_json::ser::PrettyFormatter::with_indent(ind.as_bytes()));
            serde::Serialize::serialize(&json, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PyFormatter);
            serde::Serialize::serialize(&json, &mut ser)
        }
    };
    res.map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

impl ChatTemplate {
    /// Compiles `source`. Errors name the template syntax problem.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String { chrono::Local::now().format(&fmt).to_string() });
        env.add_filter("tojson", py_tojson);
        env.add_template_owned("chat", source.to_string()).map_err(tpl_err)?;
        Ok(ChatTemplate { env, source: source.to_string(), bos_token: bos_token.to_string(), eos_token: eos_token.to_string() })
    }

    /// Renders the conversation; with `add_generation_prompt` the assistant header is appended.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tpl = self.env.get_template("chat").map_err(tpl_err)?;
        tpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(tpl_err)
    }
}
