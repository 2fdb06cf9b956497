//! Chat templates: the Jinja template a GGUF file carries in
//! `tokenizer.chat_template`, rendered with `minijinja`.
//!
//! The environment matches the one Hugging Face's `apply_chat_template` builds
//! on Python's Jinja2, which is what model authors write templates for:
//! `trim_blocks` and `lstrip_blocks` on, loop controls, Python string methods
//! (`.strip()`, `.startswith()`, ... through `minijinja-contrib`'s pycompat),
//! `raise_exception(msg)`, and a `tojson` that writes what Python's
//! `json.dumps(x, ensure_ascii=False)` writes (no HTML escaping, `", "` and
//! `": "` separators, keys in insertion order). Tests compare rendered strings
//! with Python's Jinja2 byte for byte.
//!
//! A model without a template (a base model such as Gemma 3 270M) gets
//! [`PLAIN_TEMPLATE`]: each message as `role: content` on its own paragraph,
//! and `assistant:` when a generation prompt is asked for.
//!
//! A template comes from a model file, so it is treated as untrusted code.
//! Every render runs under a budget of instructions ([`RENDER_FUEL`]) and
//! output bytes ([`MAX_RENDERED`]). Memory is the one thing minijinja
//! cannot bound: a string that a loop doubles through a `namespace` takes
//! few instructions and any amount of memory. So a program can hand
//! renders to an [`Isolation`], a place with its own memory limit (the
//! `snug` binary uses a child process); the template then renders there,
//! from the same values as JSON, and a render that runs out of memory
//! costs that place, not the caller.

use std::sync::Arc;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

/// The fallback for models whose file has no chat template.
pub const PLAIN_TEMPLATE: &str = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";

/// Why a template could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template does not compile: {0}")]
    Compile(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
    #[error("chat template ran past its budget of {RENDER_FUEL} steps (a template from a model file may not loop without end)")]
    Budget,
    #[error("chat template rendered more than {} MiB", MAX_RENDERED >> 20)]
    TooLong,
    #[error("chat template used more than its {0} MiB of memory")]
    Memory(u64),
    #[error("chat template ran longer than {0} s")]
    Time(u64),
    #[error("chat template could not be rendered in isolation: {0}")]
    Isolation(String),
}

/// One render's inputs as JSON: what crosses to an [`Isolation`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RenderRequest {
    /// The template's source.
    pub source: String,
    pub messages: serde_json::Value,
    pub add_generation_prompt: bool,
    pub bos_token: String,
    pub eos_token: String,
    /// Further variables (a map).
    pub extra: serde_json::Value,
}

impl RenderRequest {
    /// Renders the request with `template` (compiled from `source`) in
    /// this process.
    pub fn render_here(&self, template: &ChatTemplate) -> Result<String, TemplateError> {
        template.render_here(
            Value::from_serialize(&self.messages),
            self.add_generation_prompt,
            &self.bos_token,
            &self.eos_token,
            Value::from_serialize(&self.extra),
        )
    }
}

/// Somewhere else to render: see the module's documentation.
pub trait Isolation: Send + Sync {
    fn render(&self, request: &RenderRequest) -> Result<String, TemplateError>;
}

/// Instructions one render may run: a conversation of thousands of
/// messages renders in far fewer; a template that loops without end (or
/// nests loops to billions of steps) stops here.
pub const RENDER_FUEL: u64 = 20_000_000;

/// Bytes one render may produce.
pub const MAX_RENDERED: usize = 64 << 20;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's source.
    pub source: String,
    /// Whether this is the plain fallback rather than the model's own.
    pub is_fallback: bool,
    isolation: Option<Arc<dyn Isolation>>,
}

impl ChatTemplate {
    /// Compiles `source`.
    pub fn new(source: &str) -> Result<ChatTemplate, TemplateError> {
        Self::build(source.to_string(), false)
    }

    /// The model's template if it has one, else the plain fallback.
    pub fn for_model(source: Option<&str>) -> Result<ChatTemplate, TemplateError> {
        match source {
            Some(s) => Self::build(s.to_string(), false),
            None => Self::build(PLAIN_TEMPLATE.to_string(), true),
        }
    }

    fn build(source: String, is_fallback: bool) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.set_formatter(python_formatter);
        env.set_fuel(Some(RENDER_FUEL));
        env.add_template_owned("chat", source.clone())
            .map_err(|e| TemplateError::Compile(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            source,
            is_fallback,
            isolation: None,
        })
    }

    /// Renders through `isolation` from now on (the plain fallback, which
    /// is snug's own, stays here).
    pub fn isolated(mut self, isolation: Arc<dyn Isolation>) -> ChatTemplate {
        if !self.is_fallback {
            self.isolation = Some(isolation);
        }
        self
    }

    /// Renders `messages` (chat [`Message`]s, or JSON messages with fields
    /// such as `tool_calls`). `extra` adds variables (for example `tools`).
    pub fn render<M: Serialize + ?Sized, E: Serialize>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
        extra: E,
    ) -> Result<String, TemplateError> {
        self.render_value(
            Value::from_serialize(messages),
            add_generation_prompt,
            bos_token,
            eos_token,
            Value::from_serialize(extra),
        )
    }

    /// Renders messages given as any serializable value (so messages may
    /// carry fields beyond role and content, such as `tool_calls`).
    pub fn render_value(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
        extra: Value,
    ) -> Result<String, TemplateError> {
        let Some(isolation) = &self.isolation else {
            return self.render_here(messages, add_generation_prompt, bos_token, eos_token, extra);
        };
        let json = |v: &Value| serde_json::to_value(v).map_err(|e| TemplateError::Render(e.to_string()));
        isolation.render(&RenderRequest {
            source: self.source.clone(),
            messages: json(&messages)?,
            add_generation_prompt,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            extra: json(&extra)?,
        })
    }

    fn render_here(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
        extra: Value,
    ) -> Result<String, TemplateError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError::Render(describe(&e)))?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
            ..extra
        };
        let text = tmpl.render(ctx).map_err(|e| match e.kind() {
            minijinja::ErrorKind::OutOfFuel => TemplateError::Budget,
            _ => TemplateError::Render(describe(&e)),
        })?;
        if text.len() > MAX_RENDERED {
            return Err(TemplateError::TooLong);
        }
        Ok(text)
    }
}

fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// Writes values as Python's Jinja2 prints them: `True`, `False`, `None`.
fn python_formatter(out: &mut minijinja::Output, state: &minijinja::State, value: &Value) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    match value.kind() {
        ValueKind::Bool => out.write_str(if value.is_true() { "True" } else { "False" })?,
        ValueKind::None => out.write_str("None")?,
        _ => minijinja::escape_formatter(out, state, value)?,
    }
    Ok(())
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps(v, ensure_ascii=False)` of a JSON value: the
/// `tojson` filter's writer (`", "` and `": "` separators, Python's float
/// repr, non-ASCII kept).
pub fn python_json(v: &serde_json::Value) -> String {
    let mut out = String::new();
    // A JSON value always converts; the writer fails only on values
    // minijinja cannot iterate, which JSON does not make.
    let _ = write_json(&Value::from_serialize(v), None, 0, &mut out);
    out
}

fn write_json(v: &Value, indent: Option<usize>, depth: usize, out: &mut String) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            let text = v.to_string();
            let is_int = v.as_i64().is_some() && text.bytes().all(|b| b.is_ascii_digit() || b == b'-');
            match f64::try_from(v.clone()) {
                Ok(f) if !is_int => out.push_str(&python_float(f)),
                _ => out.push_str(&text),
            }
        }
        ValueKind::String => write_json_str(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(item, indent, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map | ValueKind::Plain => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(k) => write_json_str(k, out),
                    None => write_json_str(&key.to_string(), out),
                }
                out.push_str(": ");
                write_json(&v.get_item(key)?, indent, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => write_json_str(&v.to_string(), out),
    }
    Ok(())
}

/// A float as Python's `repr` writes it (shortest round-trip digits).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let s = format!("{f:?}");
    // Rust's Debug writes 1e20 as "1e20"; Python writes "1e+20".
    if let Some((m, e)) = s.split_once('e') {
        let e = if e.starts_with('-') {
            e.to_string()
        } else {
            format!("+{e}")
        };
        let e = if e.len() == 2 {
            format!("{}0{}", &e[..1], &e[1..])
        } else {
            e
        };
        return format!("{m}e{e}");
    }
    s
}

fn write_json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_that_loops_for_billions_of_steps_is_stopped_by_its_budget() {
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
        )
        .unwrap();
        let e = t
            .render(&[] as &[Message], false, "", "", minijinja::context! {})
            .unwrap_err();
        assert!(matches!(e, TemplateError::Budget), "{e}");
        // A long conversation stays far within it.
        let many: Vec<Message> = (0..2000)
            .map(|i| Message::new("user", &format!("message {i}")))
            .collect();
        let t = ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}",
        )
        .unwrap();
        assert!(t.render(&many, true, "", "", minijinja::context! {}).is_ok());
    }

    #[test]
    fn fallback_is_plain_transcript() {
        let t = ChatTemplate::for_model(None).unwrap();
        assert!(t.is_fallback);
        let s = t
            .render(&[Message::new("user", "hi")], true, "", "", minijinja::context! {})
            .unwrap();
        assert_eq!(s, "user: hi\n\nassistant:");
    }

    #[test]
    fn tojson_matches_python_dumps() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ y | tojson(indent=2) }}").unwrap();
        let s = t
            .render(
                &[] as &[Message],
                false,
                "",
                "",
                minijinja::context! { x => serde_json::json!({"b": [1, 2.5, "é<>\n"], "a": null}), y => serde_json::json!({"k": [true]}) },
            )
            .unwrap();
        assert_eq!(
            s,
            "{\"b\": [1, 2.5, \"é<>\\n\"], \"a\": null}|{\n  \"k\": [\n    true\n  ]\n}"
        );
    }

    #[test]
    fn raise_exception_is_a_render_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
        let e = t
            .render(&[] as &[Message], false, "", "", minijinja::context! {})
            .unwrap_err();
        assert!(e.to_string().contains("no system role"), "{e}");
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new("{{ '  a b '.strip().upper() }}{{ 'xy'.startswith('x') }}{{ none }}").unwrap();
        assert_eq!(
            t.render(&[] as &[Message], false, "", "", minijinja::context! {})
                .unwrap(),
            "A BTrueNone"
        );
    }
}
