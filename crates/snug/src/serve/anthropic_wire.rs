//! The request bodies of anthropic.rs's routes and their checks: plain
//! data and functions, apart from the handlers so that the `http` fuzz
//! target compiles them as they are.

use super::api::{ApiError, Settings};
use serde_json::Value;
use snug_engine::sampling::SamplingParams;
use snug_model::template::Message;

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

/// The conversation as chat messages (system first), checked.
pub(super) fn conversation(req: &MessagesRequest) -> Result<Vec<Message>, ApiError> {
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) || req.tool_choice.is_some() {
        return Err(bad("tools are not supported yet"));
    }
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
    let mut out = Vec::with_capacity(req.messages.len() + 1);
    if let Some(system) = &req.system {
        out.push(Message::new("system", &system.text("system")?));
    }
    for (i, m) in req.messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "user" | "assistant") {
            return Err(bad(format!("messages.{i}.role: {:?} is not user or assistant", m.role)));
        }
        out.push(Message::new(
            &m.role,
            &m.content.text(&format!("messages.{i}.content"))?,
        ));
    }
    Ok(out)
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
