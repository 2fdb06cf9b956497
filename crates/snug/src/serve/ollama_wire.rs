//! The request bodies of ollama.rs's routes and their checks: plain
//! data and functions, apart from the handlers so that the `http` fuzz
//! target compiles them as they are.

use super::api::{ApiError, Settings};
use super::structured::Structured;
use serde_json::Value;
use snug_engine::grammar::GrammarSpec;
use snug_engine::sampling::SamplingParams;

pub(super) fn bad(message: String) -> ApiError {
    ApiError::bad(message, None)
}

/// `options` into sampling settings, from ollama's defaults.
pub(super) fn settings(
    options: Option<&serde_json::Map<String, Value>>,
    seed: u64,
    stream: bool,
) -> Result<Settings, ApiError> {
    let mut p = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        min_p: 0.0,
        repeat_penalty: 1.1,
        presence_penalty: 0.0,
        penalty_last_n: 64,
        seed,
        logit_bias: Vec::new(),
    };
    let mut max_tokens = None;
    let mut stop = Vec::new();
    for (k, v) in options.into_iter().flatten() {
        let num = |lo: f64, hi: f64| -> Result<f64, ApiError> {
            v.as_f64()
                .filter(|x| (lo..=hi).contains(x))
                .ok_or_else(|| bad(format!("options.{k} must be a number in [{lo}, {hi}]; got {v}")))
        };
        let int = || -> Result<i64, ApiError> {
            v.as_i64()
                .ok_or_else(|| bad(format!("options.{k} must be an integer; got {v}")))
        };
        match k.as_str() {
            "temperature" => p.temperature = num(0.0, 5.0)? as f32,
            "top_k" => p.top_k = usize::try_from(int()?).map_err(|_| bad("options.top_k must be 0 or more".into()))?,
            "top_p" => p.top_p = num(0.0, 1.0)? as f32,
            "min_p" => p.min_p = num(0.0, 1.0)? as f32,
            "repeat_penalty" => p.repeat_penalty = num(0.0, 10.0)? as f32,
            "presence_penalty" => p.presence_penalty = num(-2.0, 2.0)? as f32,
            "repeat_last_n" => {
                p.penalty_last_n = match int()? {
                    -1 => usize::MAX,
                    n => usize::try_from(n).map_err(|_| bad("options.repeat_last_n must be -1 or more".into()))?,
                }
            }
            "seed" => {
                let s = int()?;
                if s >= 0 {
                    p.seed = s as u64;
                }
            }
            "num_predict" => {
                max_tokens = match int()? {
                    -1 | -2 => None,
                    n if n >= 1 => Some(n as usize),
                    n => {
                        return Err(bad(format!(
                            "options.num_predict must be -1, -2 or at least 1; got {n}"
                        )))
                    }
                }
            }
            "stop" => {
                let list = v
                    .as_array()
                    .ok_or_else(|| bad("options.stop must be a list of strings".into()))?;
                for s in list {
                    match s.as_str() {
                        Some(s) if !s.is_empty() => stop.push(s.to_string()),
                        _ => return Err(bad("options.stop must be a list of non-empty strings".into())),
                    }
                }
                if stop.len() > 16 {
                    return Err(bad("options.stop takes up to 16 strings".into()));
                }
            }
            // Sampling snug does not do: refused unless off.
            "frequency_penalty" if v.as_f64() == Some(0.0) => {}
            "mirostat" if v.as_f64() == Some(0.0) => {}
            "typical_p" | "tfs_z" if v.as_f64() == Some(1.0) => {}
            "mirostat_tau" | "mirostat_eta" => {}
            "frequency_penalty" | "mirostat" | "typical_p" | "tfs_z" => {
                return Err(bad(format!("options.{k} is not supported")));
            }
            // How a runner loads and runs the model: snug's flags decide.
            "num_ctx" | "num_batch" | "num_gpu" | "main_gpu" | "use_mmap" | "use_mlock" | "num_thread" | "numa"
            | "low_vram" | "f16_kv" | "vocab_only" | "num_keep" | "penalize_newline" | "logits_all"
            | "embedding_only" => {}
            other => return Err(bad(format!("unknown option {other:?}"))),
        }
    }
    Ok(Settings {
        params: p,
        max_tokens,
        stop,
        stream,
        include_usage: false,
        ignore_eos: false,
        grammar: None,
    })
}

/// ollama's `format`: `"json"` (any JSON object) or a JSON schema.
pub(super) fn format_grammar(format: &Option<Value>) -> Result<Option<Structured>, ApiError> {
    let spec = match format {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) if s.is_empty() => return Ok(None),
        Some(Value::String(s)) if s == "json" => GrammarSpec::JsonObject,
        Some(v @ Value::Object(_)) => GrammarSpec::JsonSchema(v.clone()),
        Some(_) => return Err(bad("format must be \"json\" or a JSON schema object".into())),
    };
    Ok(Some(Structured { spec, param: "format" }))
}

/// Fields of a request that ask for what snug does not do yet.
pub(super) fn refuse_unsupported(think: &Option<Value>) -> Result<(), ApiError> {
    if think.as_ref().is_some_and(|t| t == true || t.is_string()) {
        return Err(bad("think is not supported".into()));
    }
    Ok(())
}

#[derive(serde::Deserialize)]
pub(super) struct OllamaMessage {
    pub(super) role: String,
    #[serde(default)]
    pub(super) content: String,
    #[serde(default)]
    pub(super) images: Option<Vec<Value>>,
    #[serde(default)]
    pub(super) tool_calls: Option<Vec<Value>>,
    #[serde(default)]
    pub(super) thinking: Option<String>,
    #[serde(default)]
    pub(super) tool_name: Option<String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ChatBody {
    #[serde(default)]
    pub(super) model: String,
    #[serde(default)]
    pub(super) messages: Vec<OllamaMessage>,
    #[serde(default)]
    pub(super) stream: Option<bool>,
    #[serde(default)]
    pub(super) options: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    pub(super) format: Option<Value>,
    #[serde(default)]
    pub(super) tools: Option<Vec<Value>>,
    #[serde(default)]
    pub(super) think: Option<Value>,
    #[serde(default)]
    pub(super) keep_alive: Option<Value>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct GenerateBody {
    #[serde(default)]
    pub(super) model: String,
    #[serde(default)]
    pub(super) prompt: String,
    #[serde(default)]
    pub(super) system: Option<String>,
    #[serde(default)]
    pub(super) suffix: Option<String>,
    #[serde(default)]
    pub(super) template: Option<String>,
    #[serde(default)]
    pub(super) raw: Option<bool>,
    #[serde(default)]
    pub(super) stream: Option<bool>,
    #[serde(default)]
    pub(super) options: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    pub(super) format: Option<Value>,
    #[serde(default)]
    pub(super) images: Option<Vec<Value>>,
    #[serde(default)]
    pub(super) context: Option<Vec<Value>>,
    #[serde(default)]
    pub(super) think: Option<Value>,
    #[serde(default)]
    pub(super) keep_alive: Option<Value>,
}
