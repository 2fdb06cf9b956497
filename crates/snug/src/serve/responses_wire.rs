//! The request bodies of responses.rs's routes and their checks: plain
//! data and functions, apart from the handlers so that the `http` fuzz
//! target compiles them as they are.

use super::api;
use super::api::{ApiError, Settings};
use super::structured::Structured;
use serde_json::Value;
use snug_engine::grammar::GrammarSpec;

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
    /// A `function_call` item's call id, name and arguments (JSON text),
    /// or a `function_call_output` item's call id and output.
    #[serde(default)]
    pub(super) call_id: Option<String>,
    #[serde(default)]
    pub(super) name: Option<String>,
    #[serde(default)]
    pub(super) arguments: Option<String>,
    #[serde(default)]
    pub(super) output: Option<Value>,
    #[serde(default)]
    pub(super) id: Option<String>,
    #[serde(default)]
    pub(super) status: Option<String>,
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

/// `tools`, `tool_choice` and `parallel_tool_calls` as the chat route
/// takes them.
pub(super) type ToolFields = (Option<Value>, Option<Value>, Option<Value>);

/// The request's function tools in the chat route's shapes: `{"type":
/// "function", "name", "description", "parameters"}` becomes a function;
/// `tool_choice` `auto`, `none`, `required` or `{"type": "function",
/// "name"}`. Hosted tools (web search, file search, ...) are refused.
pub(super) fn tool_fields(req: &ResponsesRequest) -> Result<ToolFields, ApiError> {
    let mut defs = Vec::new();
    for (i, t) in req.tools.iter().flatten().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(format!("tools[{i}]: only function tools are supported"), "tools"));
        }
        let mut f = serde_json::json!({"name": t.get("name").cloned().unwrap_or(Value::Null)});
        if let Some(d) = t.get("description") {
            f["description"] = d.clone();
        }
        if let Some(p) = t.get("parameters") {
            f["parameters"] = p.clone();
        }
        defs.push(serde_json::json!({"type": "function", "function": f}));
    }
    let choice = match &req.tool_choice {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(Value::from(s.as_str())),
        Some(v) if v.get("type").and_then(Value::as_str) == Some("function") => Some(serde_json::json!(
            {"type": "function", "function": {"name": v.get("name").cloned().unwrap_or(Value::Null)}}
        )),
        Some(_) => {
            return Err(bad(
                "tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                "tool_choice",
            ))
        }
    };
    let defs = (!defs.is_empty()).then_some(Value::Array(defs));
    Ok((defs, choice, req.parallel_tool_calls.map(Value::Bool)))
}

/// The conversation as chat messages in the shape the templates read,
/// checked: `function_call` items become an assistant's `tool_calls`,
/// `function_call_output` items `tool` messages.
pub(super) fn conversation(req: &ResponsesRequest) -> Result<Vec<Value>, ApiError> {
    use serde_json::json;
    if req.previous_response_id.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(bad(
            "previous_response_id is not supported: responses are not stored; send the conversation as input",
            "previous_response_id",
        ));
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
    let mut out: Vec<Value> = Vec::new();
    if let Some(i) = &req.instructions {
        out.push(json!({"role": "system", "content": i}));
    }
    match &req.input {
        Input::Text(t) => out.push(json!({"role": "user", "content": t})),
        Input::Items(items) => {
            for (n, item) in items.iter().enumerate() {
                let _ = (&item.id, &item.status);
                match item.kind.as_deref() {
                    None | Some("message") => {}
                    Some("function_call") => {
                        let call = json!({"id": item.call_id, "type": "function",
                            "function": {"name": item.name, "arguments": item.arguments.clone().unwrap_or_default()}});
                        // Calls made together join one assistant turn.
                        match out.last_mut() {
                            Some(m) if m["role"] == "assistant" => match m["tool_calls"].as_array_mut() {
                                Some(calls) => calls.push(call),
                                None => m["tool_calls"] = json!([call]),
                            },
                            _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                        }
                        continue;
                    }
                    Some("function_call_output") => {
                        let output = match &item.output {
                            Some(Value::String(s)) => s.clone(),
                            Some(v) => v.to_string(),
                            None => String::new(),
                        };
                        out.push(json!({"role": "tool", "tool_call_id": item.call_id, "content": output}));
                        continue;
                    }
                    Some(other) => {
                        return Err(bad(
                            format!(
                                "input[{n}]: items of type {other:?} are not supported (messages and function calls)"
                            ),
                            "input",
                        ))
                    }
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
                out.push(json!({"role": role, "content": text}));
            }
        }
    }
    if !out.iter().any(|m| m["role"] == "user") {
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
