//! The OpenAI request and response bodies `snug serve` reads and writes,
//! and the checks that turn a bad field into a 400 with an OpenAI-style
//! error object.

use serde::Deserialize;
use serde_json::{json, Value};
use snug_engine::sampling::SamplingParams;

use super::structured::{GrammarFields, Structured};

/// An error answer: HTTP status and OpenAI's `{"error": {...}}` body.
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
    /// Seconds for `Retry-After` (503s).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
            retry_after: None,
        }
    }

    /// A 500: the server failed, not the request.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 500,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// `stop`: one string or a list.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields both endpoints share.
#[derive(Deserialize, Debug, Default)]
pub struct Common {
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub logprobs: Option<Value>,
    pub echo: Option<bool>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
    /// Token id (as a string) to a bias in [-100, 100] added to its logit.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Never end at an end-of-generation token (llama.cpp's field): they
    /// are banned through the logit bias.
    pub ignore_eos: Option<bool>,
    /// The output's grammar (`response_format` and the others).
    #[serde(flatten)]
    pub structured: GrammarFields,
    /// Every other field, checked by [`Common::settings`].
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

/// Fields accepted and ignored: they change nothing snug does.
const IGNORED: &[&str] = &["model", "user", "metadata", "store", "cache_prompt", "service_tier"];

/// Fields accepted only with a value that asks for nothing.
fn asks_nothing(name: &str, v: &Value) -> bool {
    match name {
        "tools" | "functions" => v.is_null() || v.as_array().is_some_and(Vec::is_empty),
        "tool_choice" | "function_call" => v.is_null() || v == "none",
        "parallel_tool_calls" => v.is_null() || v.is_boolean(),
        "top_logprobs" => v.is_null() || v == 0,
        // Extensions of vLLM and SGLang that routers built for them (the
        // sglang and vllm routers) send on every request at their
        // defaults: accepted where they ask for what snug does anyway.
        "no_stop_trim" | "continue_final_message" | "return_hidden_states" => v.is_null() || v == false,
        "skip_special_tokens" => v.is_null() || v == true,
        // How a reasoning model's thinking is split out; nothing is split
        // from a model's text here, whatever they say.
        "separate_reasoning" | "stream_reasoning" | "include_reasoning" => v.is_null() || v.is_boolean(),
        _ => false,
    }
}

/// A field's refusal: 400 naming it.
fn unsupported(name: &str) -> ApiError {
    let what = match name {
        "tools" | "tool_choice" => "tools are taken by /v1/chat/completions only".to_string(),
        "functions" | "function_call" => {
            "functions and function_call are replaced by tools and tool_choice; send those".to_string()
        }
        "top_logprobs" => "logprobs are not supported".to_string(),
        _ => format!("unknown or unsupported field {name:?}"),
    };
    // `param` is a static string: the known names keep theirs, others are
    // named in the message.
    const NAMES: &[&str] = &["tools", "functions", "tool_choice", "function_call", "top_logprobs"];
    ApiError::bad(what, NAMES.iter().copied().find(|n| *n == name))
}

/// A chat message's content: text, or a list of parts of which only text
/// parts are understood.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize, Debug)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant's calls (`role: assistant`).
    pub tool_calls: Option<Vec<Value>>,
    /// Which call a `tool` message answers.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<Value>,
    #[serde(flatten)]
    pub common: Common,
}

/// `prompt` of `/v1/completions`: text, one text in a list, or token ids.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
}

/// Parses a JSON body, naming what is wrong.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::bad("the request body is empty; send a JSON object", None));
    }
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "the request body is not valid JSON"
        } else {
            "a field of the request is missing or has the wrong type"
        };
        ApiError::bad(format!("{what}: {e}"), None)
    })
}

/// The server's sampling defaults (llama-server's), for fields a request
/// leaves out.
pub fn default_params() -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        ..SamplingParams::default()
    }
}

/// What a request asks for, checked.
#[derive(Debug)]
pub struct Settings {
    pub params: SamplingParams,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Ban end-of-generation tokens (the route knows which they are).
    pub ignore_eos: bool,
    /// The grammar the output follows.
    pub grammar: Option<Structured>,
}

fn range(v: Option<f32>, lo: f32, hi: f32, name: &'static str) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) || x.is_nan() => Err(ApiError::bad(
            format!("{name} must be between {lo} and {hi}; got {x}"),
            Some(name),
        )),
        v => Ok(v),
    }
}

impl Common {
    /// The settings, or a 400 naming the field. `seed` is used when the
    /// request has none.
    pub fn settings(&self, seed: u64) -> Result<Settings, ApiError> {
        for (name, v) in &self.rest {
            if !IGNORED.contains(&name.as_str()) && !asks_nothing(name, v) {
                return Err(unsupported(name));
            }
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad("only n = 1 is supported", Some("n")));
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(ApiError::bad("only best_of = 1 is supported", Some("best_of")));
        }
        if matches!(&self.logprobs, Some(v) if !v.is_null() && v != &Value::Bool(false)) {
            return Err(ApiError::bad("logprobs are not supported", Some("logprobs")));
        }
        if self.echo == Some(true) {
            return Err(ApiError::bad("echo is not supported", Some("echo")));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::bad("suffix is not supported", Some("suffix")));
        }
        if range(self.frequency_penalty, -2.0, 2.0, "frequency_penalty")?.is_some_and(|f| f != 0.0) {
            return Err(ApiError::bad(
                "frequency_penalty is not supported; use presence_penalty or repeat_penalty",
                Some("frequency_penalty"),
            ));
        }
        let mut p = default_params();
        if let Some(t) = range(self.temperature, 0.0, 2.0, "temperature")? {
            p.temperature = t;
        }
        if let Some(t) = self.top_p {
            if !(t > 0.0 && t <= 1.0) {
                return Err(ApiError::bad(
                    format!("top_p must be in (0, 1]; got {t}"),
                    Some("top_p"),
                ));
            }
            p.top_p = t;
        }
        if let Some(k) = self.top_k {
            p.top_k = usize::try_from(k).map_err(|_| ApiError::bad("top_k must be 0 or more", Some("top_k")))?;
        }
        if let Some(m) = range(self.min_p, 0.0, 1.0, "min_p")? {
            p.min_p = m;
        }
        if let Some(r) = range(self.repeat_penalty, 0.0, 10.0, "repeat_penalty")? {
            p.repeat_penalty = r;
        }
        if let Some(r) = range(self.presence_penalty, -2.0, 2.0, "presence_penalty")? {
            p.presence_penalty = r;
        }
        if let Some(bias) = &self.logit_bias {
            if bias.len() > 1024 {
                return Err(ApiError::bad("logit_bias takes up to 1024 tokens", Some("logit_bias")));
            }
            for (k, v) in bias {
                let t: u32 = k.parse().map_err(|_| {
                    ApiError::bad(format!("logit_bias keys are token ids; got {k:?}"), Some("logit_bias"))
                })?;
                let b = v.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
                    ApiError::bad(
                        format!("logit_bias values are numbers in [-100, 100]; got {v}"),
                        Some("logit_bias"),
                    )
                })?;
                p.logit_bias.push((t, b as f32));
            }
            p.logit_bias.sort_by_key(|&(t, _)| t);
        }
        p.seed = match self.seed {
            Some(s) => s as u64,
            None => seed,
        };
        let max = self.max_completion_tokens.or(self.max_tokens);
        let max_tokens = match max {
            Some(n) if n < 1 => {
                return Err(ApiError::bad(
                    format!("max_tokens must be at least 1; got {n}"),
                    Some("max_tokens"),
                ))
            }
            Some(n) => Some(n as usize),
            None => None,
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > 16 || stop.iter().any(String::is_empty) {
            return Err(ApiError::bad("stop takes up to 16 non-empty strings", Some("stop")));
        }
        let include_usage = self.stream_options.as_ref().is_some_and(|o| o.include_usage);
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::bad(
                "stream_options is only allowed when stream is true",
                Some("stream_options"),
            ));
        }
        Ok(Settings {
            params: p,
            max_tokens,
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            stream: self.stream,
            include_usage,
            ignore_eos: self.ignore_eos == Some(true),
            grammar: self.structured.read()?,
        })
    }
}

impl ChatMessage {
    /// The message's text (text parts joined).
    pub fn text(&self) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(t)) => Ok(t.clone()),
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::bad(
                                format!("content parts of type {kind:?} are not supported (text only)"),
                                Some("messages"),
                            ))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

/// Request bodies sent with `Content-Encoding: zstd` or `gzip` are
/// decoded before any route reads them (Laya's Python SDK sends bodies of
/// 1 KiB or more as zstd). The decoded body is held to `max` bytes like
/// any other: past it, 413 (a small compressed body cannot expand without
/// limit). An encoding other than these, or a body that does not decode,
/// is a 415 or a 400 naming it.
pub async fn decompress(
    axum::extract::State(max): axum::extract::State<usize>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::http::header::{CONTENT_ENCODING, CONTENT_LENGTH};
    use axum::response::IntoResponse;
    let encoding = req
        .headers()
        .get(CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("").trim().to_ascii_lowercase());
    let Some(encoding) = encoding.filter(|e| !e.is_empty() && e != "identity") else {
        return next.run(req).await;
    };
    let too_large = || ApiError {
        status: 413,
        message: format!("the request body is larger than {max} bytes (decoded)"),
        kind: "invalid_request_error",
        param: None,
        code: Some("body_too_large"),
        retry_after: None,
    };
    if encoding != "zstd" && encoding != "gzip" {
        return ApiError {
            status: 415,
            message: format!("Content-Encoding {encoding:?} is not supported; send zstd, gzip or identity"),
            ..ApiError::bad("", None)
        }
        .into_response();
    }
    let (mut parts, body) = req.into_parts();
    let Ok(raw) = axum::body::to_bytes(body, max).await else {
        return too_large().into_response();
    };
    let decoded = match decode(&encoding, &raw, max) {
        Ok(Some(d)) => d,
        Ok(None) => return too_large().into_response(),
        Err(e) => {
            return ApiError::bad(format!("the {encoding} request body does not decode: {e}"), None).into_response()
        }
    };
    parts.headers.remove(CONTENT_ENCODING);
    parts.headers.insert(CONTENT_LENGTH, decoded.len().into());
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(decoded),
    ))
    .await
}

/// `raw` decoded, or `None` when it holds more than `max` bytes.
pub fn decode(encoding: &str, raw: &[u8], max: usize) -> std::io::Result<Option<Vec<u8>>> {
    use std::io::Read;
    let mut out = Vec::new();
    let limit = max as u64 + 1;
    match encoding {
        "zstd" => {
            let dec = ruzstd::decoding::StreamingDecoder::new(raw)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
            dec.take(limit).read_to_end(&mut out)?;
        }
        _ => {
            // Every member, as gunzip reads a file of several.
            flate2::read::MultiGzDecoder::new(raw)
                .take(limit)
                .read_to_end(&mut out)?;
        }
    }
    Ok((out.len() <= max).then_some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gzip_body_of_two_members_decodes_whole() {
        use std::io::Write;
        let member = |text: &str| {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            e.write_all(text.as_bytes()).unwrap();
            e.finish().unwrap()
        };
        let mut body = member("{\"prompt\": ");
        body.extend(member("\"hi\"}"));
        let out = decode("gzip", &body, 1 << 20).unwrap().unwrap();
        assert_eq!(out, b"{\"prompt\": \"hi\"}");
        assert!(decode("gzip", &body, 8).unwrap().is_none(), "over the limit");
    }

    #[test]
    fn bad_fields_are_named() {
        let r: ChatRequest = parse(br#"{"messages": [], "temperature": 3}"#).unwrap();
        let e = r.common.settings(0).unwrap_err();
        assert_eq!(e.param, Some("temperature"));
        assert_eq!(e.status, 400);
        let e = parse::<ChatRequest>(br#"{"messages": 5}"#).unwrap_err();
        assert!(e.message.contains("wrong type"), "{}", e.message);
        let e = parse::<ChatRequest>(b"{not json").unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        let r: ChatRequest = parse(br#"{"messages": [], "n": 2}"#).unwrap();
        assert_eq!(r.common.settings(0).unwrap_err().param, Some("n"));
        // Grammar fields are read as such, not refused as unknown.
        let r: ChatRequest =
            parse(br#"{"messages": [], "response_format": {"type": "json_object"}, "guided_regex": null}"#).unwrap();
        assert!(r.common.rest.is_empty(), "{:?}", r.common.rest);
        assert!(r.common.settings(0).unwrap().grammar.is_some());
    }

    #[test]
    fn settings_take_defaults_and_overrides() {
        let r: CompletionRequest =
            parse(br#"{"prompt": "hi", "seed": 7, "stop": "x", "max_tokens": 5, "top_p": 0.5}"#).unwrap();
        let s = r.common.settings(99).unwrap();
        assert_eq!(s.params.seed, 7);
        assert_eq!(s.params.top_p, 0.5);
        assert_eq!(s.params.temperature, 0.8);
        assert_eq!(s.stop, vec!["x".to_string()]);
        assert_eq!(s.max_tokens, Some(5));
        let r: CompletionRequest = parse(br#"{"prompt": [1, 2, 3]}"#).unwrap();
        assert!(matches!(r.prompt, Prompt::Tokens(_)));
        assert_eq!(r.common.settings(99).unwrap().params.seed, 99);
    }

    #[test]
    fn content_parts_join_text() {
        let m: ChatMessage = serde_json::from_str(
            r#"{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}"#,
        )
        .unwrap();
        assert_eq!(m.text().unwrap(), "ab");
        let m: ChatMessage =
            serde_json::from_str(r#"{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}"#).unwrap();
        assert!(m.text().is_err());
    }
}
