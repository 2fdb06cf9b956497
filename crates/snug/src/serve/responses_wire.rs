//! The request bodies of responses.rs's routes and their checks: plain
//! data and functions, apart from the handlers so that the `http` fuzz
//! target compiles them as they are.

use super::api;
use super::api::{ApiError, Settings};
use super::structured::Structured;
use serde_json::Value;
use snug_engine::grammar::GrammarSpec;
use snug_model::template::Message;

pub(super) fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad(message, Some(param))
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
pub(super) enum Input {
    Text(String),
    Items(Vec<Item>),
}

#[derive(serde::Deserialize)]
pub(super) struct Item {
    #[serde(rename = "type", default)]
    pub(super) kind: Option<String>,
    #[serde(default)]
    pub(super) role: Option<String>,
    #[serde(default)]
    pub(super) content: Option<ItemContent>,
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
pub(super) enum ItemContent {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(serde::Deserialize)]
pub(super) struct Part {
    #[serde(rename = "type")]
    pub(super) kind: String,
    #[serde(default)]
    pub(super) text: Option<String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ResponsesRequest {
    #[serde(default)]
    pub(super) model: String,
    pub(super) input: Input,
    #[serde(default)]
    pub(super) instructions: Option<String>,
    #[serde(default)]
    pub(super) max_output_tokens: Option<i64>,
    #[serde(default)]
    pub(super) temperature: Option<f32>,
    #[serde(default)]
    pub(super) top_p: Option<f32>,
    #[serde(default)]
    pub(super) stream: bool,
    #[serde(default)]
    pub(super) store: Option<bool>,
    #[serde(default)]
    pub(super) metadata: Option<Value>,
    #[serde(default)]
    pub(super) user: Option<Value>,
    #[serde(default)]
    pub(super) text: Option<Value>,
    #[serde(default)]
    pub(super) tools: Option<Vec<Value>>,
    #[serde(default)]
    pub(super) tool_choice: Option<Value>,
    #[serde(default)]
    pub(super) parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub(super) previous_response_id: Option<Value>,
    #[serde(default)]
    pub(super) reasoning: Option<Value>,
    #[serde(default)]
    pub(super) truncation: Option<String>,
    #[serde(default)]
    pub(super) include: Option<Vec<Value>>,
    #[serde(default)]
    pub(super) service_tier: Option<Value>,
}

/// The conversation as chat messages, checked.
pub(super) fn conversation(req: &ResponsesRequest) -> Result<Vec<Message>, ApiError> {
    if req.previous_response_id.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(bad(
            "previous_response_id is not supported: responses are not stored; send the conversation as input",
            "previous_response_id",
        ));
    }
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(bad("tool calling is not supported yet", "tools"));
    }
    if req
        .tool_choice
        .as_ref()
        .is_some_and(|t| !t.is_null() && t != "none" && t != "auto")
    {
        return Err(bad("tool calling is not supported yet", "tool_choice"));
    }
    if req.reasoning.as_ref().is_some_and(|r| !r.is_null()) {
        return Err(bad("reasoning is not supported", "reasoning"));
    }
    if req.include.as_ref().is_some_and(|i| !i.is_empty()) {
        return Err(bad("include is not supported", "include"));
    }
    if req.truncation.as_deref().is_some_and(|t| t != "disabled") {
        return Err(bad("only truncation \"disabled\" is supported", "truncation"));
    }
    let mut out = Vec::new();
    if let Some(i) = &req.instructions {
        out.push(Message::new("system", i));
    }
    match &req.input {
        Input::Text(t) => out.push(Message::new("user", t)),
        Input::Items(items) => {
            for (n, item) in items.iter().enumerate() {
                if item.kind.as_deref().is_some_and(|k| k != "message") {
                    return Err(bad(
                        format!(
                            "input[{n}]: items of type {:?} are not supported (messages only)",
                            item.kind
                        ),
                        "input",
                    ));
                }
                let role = match item.role.as_deref() {
                    Some("developer") => "system",
                    Some(r @ ("system" | "user" | "assistant")) => r,
                    other => {
                        return Err(bad(
                            format!("input[{n}].role: {other:?} is not a message role"),
                            "input",
                        ))
                    }
                };
                let text = match &item.content {
                    None => String::new(),
                    Some(ItemContent::Text(t)) => t.clone(),
                    Some(ItemContent::Parts(parts)) => {
                        let mut s = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("input_text" | "output_text" | "text", Some(t)) => s.push_str(t),
                                (kind, _) => {
                                    return Err(bad(
                                        format!("input[{n}]: content of type {kind:?} is not supported (text only)"),
                                        "input",
                                    ))
                                }
                            }
                        }
                        s
                    }
                };
                out.push(Message::new(role, &text));
            }
        }
    }
    if !out.iter().any(|m| m.role == "user") {
        return Err(bad("input has no user message", "input"));
    }
    Ok(out)
}

pub(super) fn settings(req: &ResponsesRequest, seed: u64) -> Result<Settings, ApiError> {
    let mut p = api::default_params();
    p.seed = seed;
    if let Some(t) = req.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(bad(format!("temperature must be in [0, 2]; got {t}"), "temperature"));
        }
        p.temperature = t;
    }
    if let Some(t) = req.top_p {
        if !(t > 0.0 && t <= 1.0) {
            return Err(bad(format!("top_p must be in (0, 1]; got {t}"), "top_p"));
        }
        p.top_p = t;
    }
    let max_tokens = match req.max_output_tokens {
        Some(n) if n < 1 => {
            return Err(bad(
                format!("max_output_tokens must be at least 1; got {n}"),
                "max_output_tokens",
            ))
        }
        Some(n) => Some(n as usize),
        None => None,
    };
    let _ = (
        &req.model,
        &req.store,
        &req.metadata,
        &req.user,
        &req.parallel_tool_calls,
        &req.service_tier,
    );
    Ok(Settings {
        params: p,
        max_tokens,
        stop: Vec::new(),
        stream: req.stream,
        include_usage: false,
        ignore_eos: false,
        grammar: text_format(req.text.as_ref())?,
    })
}

/// `text.format`: `text`, `json_object`, or `json_schema` with its schema
/// beside the type (the Responses API's flat shape).
fn text_format(text: Option<&Value>) -> Result<Option<Structured>, ApiError> {
    let Some(format) = text.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let spec = match format.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => GrammarSpec::JsonObject,
        Some("json_schema") => match format.get("schema") {
            Some(s) if s.is_object() => GrammarSpec::JsonSchema(s.clone()),
            _ => return Err(bad("text.format json_schema needs a schema object", "text")),
        },
        _ => return Err(bad("text.format type must be text, json_object or json_schema", "text")),
    };
    Ok(Some(Structured { spec, param: "text" }))
}
