//! The request bodies of anthropic.rs's routes and their checks: plain
//! data and functions, apart from the handlers so that the `http` fuzz
//! target compiles them as they are.

use super::api::{ApiError, Settings};
use serde_json::Value;
use snug_engine::sampling::SamplingParams;

pub(super) fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad(message, None)
}

/// `content`: a string, or blocks of which only text is understood.
#[derive(serde::Deserialize)]
#[serde(untagged)]
pub(super) enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(serde::Deserialize)]
pub(super) struct Block {
    #[serde(rename = "type")]
    pub(super) kind: String,
    #[serde(default)]
    pub(super) text: Option<String>,
    /// A `tool_use` block's id, name and input.
    #[serde(default)]
    pub(super) id: Option<String>,
    #[serde(default)]
    pub(super) name: Option<String>,
    #[serde(default)]
    pub(super) input: Option<Value>,
    /// A `tool_result` block's call id and content (text or text blocks).
    #[serde(default)]
    pub(super) tool_use_id: Option<String>,
    #[serde(default)]
    pub(super) content: Option<Value>,
    #[serde(default)]
    pub(super) is_error: Option<bool>,
    #[serde(default)]
    pub(super) cache_control: Option<Value>,
}

impl Content {
    pub(super) fn text(&self, field: &str) -> Result<String, ApiError> {
        match self {
            Content::Text(t) => Ok(t.clone()),
            Content::Blocks(blocks) => {
                let mut out = String::new();
                for b in blocks {
                    match (b.kind.as_str(), &b.text) {
                        ("text", Some(t)) => out.push_str(t),
                        (kind, _) => {
                            return Err(bad(format!(
                                "{field}: content blocks of type {kind:?} are not supported (text only)"
                            )))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

#[derive(serde::Deserialize)]
pub(super) struct InMessage {
    pub(super) role: String,
    pub(super) content: Content,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MessagesRequest {
    #[serde(default)]
    pub(super) model: String,
    #[serde(default)]
    pub(super) max_tokens: Option<i64>,
    pub(super) messages: Vec<InMessage>,
    #[serde(default)]
    pub(super) system: Option<Content>,
    #[serde(default)]
    pub(super) stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub(super) stream: bool,
    #[serde(default)]
    pub(super) temperature: Option<f64>,
    #[serde(default)]
    pub(super) top_k: Option<i64>,
    #[serde(default)]
    pub(super) top_p: Option<f64>,
    #[serde(default)]
    pub(super) metadata: Option<Value>,
    #[serde(default)]
    pub(super) service_tier: Option<Value>,
    #[serde(default)]
    pub(super) tools: Option<Vec<Value>>,
    #[serde(default)]
    pub(super) tool_choice: Option<Value>,
    #[serde(default)]
    pub(super) thinking: Option<Value>,
    // Newer clients' fields about routing, billing and caching hints:
    // nothing snug does depends on them (its prefix cache is always on).
    #[serde(default)]
    pub(super) cache_control: Option<Value>,
    #[serde(default)]
    pub(super) inference_geo: Option<Value>,
    #[serde(default)]
    pub(super) speed: Option<Value>,
    #[serde(default)]
    pub(super) diagnostics: Option<Value>,
    #[serde(default)]
    pub(super) user_profile_id: Option<Value>,
    #[serde(default)]
    pub(super) workspace_id: Option<Value>,
    // Asks for what snug does not do: refused unless null.
    #[serde(default)]
    pub(super) output_config: Option<Value>,
    #[serde(default)]
    pub(super) container: Option<Value>,
}

/// `tools`, `tool_choice` and `parallel_tool_calls` as the OpenAI route
/// takes them.
pub(super) type ToolFields = (Option<Value>, Option<Value>, Option<Value>);

/// `tools` and `tool_choice` in the OpenAI shapes the tool machinery
/// reads: client tools (`name`, `description`, `input_schema`) become
/// functions; `auto`, `any` (required), `tool` (named) and `none`.
pub(super) fn tool_fields(req: &MessagesRequest) -> Result<ToolFields, ApiError> {
    let Some(tools) = req.tools.as_ref().filter(|t| !t.is_empty()) else {
        if req
            .tool_choice
            .as_ref()
            .is_some_and(|c| c.get("type").and_then(Value::as_str) != Some("none"))
        {
            return Err(bad("tool_choice: tools are required"));
        }
        return Ok((None, None, None));
    };
    let mut defs = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str).is_some_and(|k| k != "custom") {
            return Err(bad(format!(
                "tools.{i}: only client tools (name, description, input_schema) are supported"
            )));
        }
        let name = t.get("name").cloned().unwrap_or(Value::Null);
        let mut f = serde_json::json!({"name": name});
        if let Some(d) = t.get("description") {
            f["description"] = d.clone();
        }
        f["parameters"] = t
            .get("input_schema")
            .cloned()
            .unwrap_or_else(|| serde_json::json!({"type": "object"}));
        defs.push(serde_json::json!({"type": "function", "function": f}));
    }
    let choice = req.tool_choice.as_ref();
    let parallel = choice
        .and_then(|c| c.get("disable_parallel_tool_use"))
        .and_then(Value::as_bool)
        .map(|d| Value::Bool(!d));
    let choice = match choice.and_then(|c| c.get("type")).and_then(Value::as_str) {
        None | Some("auto") => None,
        Some("any") => Some(Value::from("required")),
        Some("none") => Some(Value::from("none")),
        Some("tool") => {
            let name = choice.and_then(|c| c.get("name")).cloned().unwrap_or(Value::Null);
            Some(serde_json::json!({"type": "function", "function": {"name": name}}))
        }
        Some(other) => {
            return Err(bad(format!(
                "tool_choice: type {other:?} is not auto, any, tool or none"
            )))
        }
    };
    Ok((Some(Value::Array(defs)), choice, parallel))
}

/// A tool result's text: a string, or text blocks joined.
fn result_text(v: Option<&Value>, field: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut out = String::new();
            for b in blocks {
                match (
                    b.get("type").and_then(Value::as_str),
                    b.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (kind, _) => {
                        return Err(bad(format!(
                            "{field}: tool result blocks of type {kind:?} are not supported (text only)"
                        )))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(bad(format!("{field}: a tool result's content is text or text blocks"))),
    }
}

/// The conversation as chat messages in the OpenAI shape the templates
/// read (system first): `tool_use` blocks become an assistant's
/// `tool_calls`, `tool_result` blocks `tool` messages before the user's
/// text.
pub(super) fn conversation_json(req: &MessagesRequest) -> Result<Vec<Value>, ApiError> {
    check(req)?;
    let mut out = Vec::with_capacity(req.messages.len() + 1);
    if let Some(system) = &req.system {
        out.push(serde_json::json!({"role": "system", "content": system.text("system")?}));
    }
    for (i, m) in req.messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "user" | "assistant") {
            return Err(bad(format!("messages.{i}.role: {:?} is not user or assistant", m.role)));
        }
        let field = format!("messages.{i}.content");
        let blocks = match &m.content {
            Content::Text(t) => {
                out.push(serde_json::json!({"role": m.role, "content": t}));
                continue;
            }
            Content::Blocks(b) => b,
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for b in blocks {
            let _ = (&b.cache_control, b.is_error);
            match (b.kind.as_str(), m.role.as_str()) {
                ("text", _) => text.push_str(b.text.as_deref().unwrap_or_default()),
                ("tool_use", "assistant") => {
                    let input = b.input.clone().unwrap_or_else(|| serde_json::json!({}));
                    calls.push(serde_json::json!({"id": b.id, "type": "function",
                        "function": {"name": b.name, "arguments": input.to_string()}}));
                }
                ("tool_result", "user") => out.push(serde_json::json!({
                    "role": "tool", "tool_call_id": b.tool_use_id,
                    "content": result_text(b.content.as_ref(), &field)?,
                })),
                (kind, role) => {
                    return Err(bad(format!(
                        "{field}: content blocks of type {kind:?} are not supported in a {role} message"
                    )))
                }
            }
        }
        if m.role == "assistant" {
            let mut v = serde_json::json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                v["tool_calls"] = Value::Array(calls);
            }
            out.push(v);
        } else if !text.is_empty() {
            out.push(serde_json::json!({"role": "user", "content": text}));
        }
    }
    Ok(out)
}

/// The request's fields that ask for what snug does not do.
fn check(req: &MessagesRequest) -> Result<(), ApiError> {
    if req
        .thinking
        .as_ref()
        .is_some_and(|t| t.get("type").and_then(Value::as_str) != Some("disabled"))
    {
        return Err(bad("extended thinking is not supported"));
    }
    if req.output_config.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(bad("output_config is not supported yet"));
    }
    if req.container.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(bad("container is not supported"));
    }
    if req.messages.is_empty() {
        return Err(bad("messages: at least one message is required"));
    }
    Ok(())
}

pub(super) fn settings(req: &MessagesRequest, seed: u64) -> Result<Settings, ApiError> {
    // Anthropic's defaults: temperature 1, no top-k or top-p cut.
    let mut p = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        presence_penalty: 0.0,
        penalty_last_n: 64,
        seed,
        logit_bias: Vec::new(),
    };
    if let Some(t) = req.temperature {
        if !(0.0..=1.0).contains(&t) {
            return Err(bad(format!("temperature: must be in [0, 1]; got {t}")));
        }
        p.temperature = t as f32;
    }
    if let Some(k) = req.top_k {
        p.top_k = usize::try_from(k).map_err(|_| bad("top_k: must be 0 or more"))?;
    }
    if let Some(t) = req.top_p {
        if !(t > 0.0 && t <= 1.0) {
            return Err(bad(format!("top_p: must be in (0, 1]; got {t}")));
        }
        p.top_p = t as f32;
    }
    let max = req.max_tokens.ok_or_else(|| bad("max_tokens: Field required"))?;
    if max < 1 {
        return Err(bad(format!("max_tokens: must be at least 1; got {max}")));
    }
    let stop = req.stop_sequences.clone().unwrap_or_default();
    if stop.len() > 16 || stop.iter().any(String::is_empty) {
        return Err(bad("stop_sequences: up to 16 non-empty strings"));
    }
    let _ = (
        &req.model,
        &req.metadata,
        &req.service_tier,
        &req.cache_control,
        &req.inference_geo,
    );
    let _ = (&req.speed, &req.diagnostics, &req.user_profile_id, &req.workspace_id);
    Ok(Settings {
        params: p,
        max_tokens: Some(max as usize),
        stop,
        stream: req.stream,
        include_usage: false,
        ignore_eos: false,
        grammar: None,
    })
}
