//! ollama's API over the same engine: `POST /api/chat` and `/api/generate`
//! (a stream of JSON lines, or one object with `"stream": false`),
//! `GET /api/tags`, `POST /api/show`, `GET /api/ps` and `GET /api/version`,
//! so that ollama's client libraries, and the chat front-ends built on
//! them, connect to snug unchanged. Requests run through the same
//! scheduler, template worker and engine as the OpenAI routes; only the
//! shapes differ. Errors are ollama's `{"error": "..."}`.

use super::ollama_wire::*;
use super::*;
use crate::serve::completions::{chat_prompt, stream_answer, tool_chat_prompt, whole_answer, Piece};
use crate::serve::routes::{body_bytes, Prepared};

/// What `/api/tags` and `/api/show` say of the model, read at start.
pub(super) struct Facts {
    pub(super) family: String,
    pub(super) parameters: u64,
    pub(super) quantization: String,
    pub(super) size: u64,
    pub(super) modified: SystemTime,
    /// Floats in an embedding (the model's width).
    pub(super) embedding_length: usize,
}

impl Facts {
    pub(super) fn of(file: &snug_model::GgufFile, path: &std::path::Path) -> Facts {
        let meta = std::fs::metadata(path).ok();
        let size = meta.as_ref().map_or(0, std::fs::Metadata::len);
        let info = snug_model::info::ModelInfo::from_header(&file.header, size);
        // The tensor type holding the most bytes, as ollama names a
        // model's quantization.
        let quantization = info
            .tensor_types
            .iter()
            .max_by_key(|(_, u)| u.bytes)
            .map(|(t, _)| t.to_uppercase())
            .unwrap_or_default();
        Facts {
            family: info.architecture.clone().unwrap_or_default(),
            parameters: info.parameters,
            quantization,
            size,
            modified: meta.and_then(|m| m.modified().ok()).unwrap_or(UNIX_EPOCH),
            embedding_length: info.geometry.embedding.unwrap_or(0) as usize,
        }
    }

    fn parameter_size(&self) -> String {
        let p = self.parameters as f64;
        if p >= 1e9 {
            format!("{:.1}B", p / 1e9)
        } else {
            format!("{:.0}M", p / 1e6)
        }
    }

    fn details(&self) -> Value {
        json!({
            "parent_model": "",
            "format": "gguf",
            "family": self.family,
            "families": [self.family],
            "parameter_size": self.parameter_size(),
            "quantization_level": self.quantization,
        })
    }
}

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/api/chat", post(chat))
        .route("/api/generate", post(generate))
        .route("/api/tags", get(tags))
        .route("/api/show", post(show))
        .route("/api/ps", get(ps))
        .route("/api/version", get(version))
}

/// ollama's error shape.
fn error(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    (status, Json(json!({"error": e.message}))).into_response()
}

/// `t` as RFC 3339 in UTC with nanoseconds, as ollama writes times.
pub(super) fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_nanos()
    )
}

async fn chat(
    State(s): State<Arc<AppState>>,
    ConnectInfo(conn): ConnectInfo<Conn>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    locked(&s.metrics).request("ollama_chat");
    chat_inner(&s, conn, body).await.unwrap_or_else(error)
}

async fn chat_inner(s: &Arc<AppState>, conn: Conn, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let started = Instant::now();
    let body = body_bytes(body, s)?;
    let req: ChatBody = api::parse(&body).map_err(|e| s.bad(e))?;
    let _ = (&req.model, &req.keep_alive);
    refuse_unsupported(&req.think).map_err(|e| s.bad(e))?;
    let tool_list = req.tools.clone().map(Value::Array);
    let tools = super::tools::read(tool_list.as_ref(), None, None).map_err(|e| s.bad(e))?;
    if req.messages.is_empty() {
        // ollama's way to load a model: nothing to generate.
        return Ok(Json(json!({
            "model": s.model_id, "created_at": rfc3339(SystemTime::now()),
            "message": {"role": "assistant", "content": ""}, "done_reason": "load", "done": true,
        }))
        .into_response());
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
            return Err(s.bad(bad(format!("unknown message role {:?}", m.role))));
        }
        if m.images.as_ref().is_some_and(|i| !i.is_empty()) {
            return Err(s.bad(bad("images are not supported (text only)".into())));
        }
        let _ = &m.thinking;
        let mut v = json!({"role": m.role, "content": m.content});
        if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
            v["tool_calls"] = Value::Array(calls.clone());
        }
        if let Some(name) = &m.tool_name {
            v["name"] = Value::from(name.as_str());
        }
        messages.push(v);
    }
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let mut settings = settings(req.options.as_ref(), s.seed(id), req.stream.unwrap_or(true)).map_err(|e| s.bad(e))?;
    settings.grammar = format_grammar(&req.format).map_err(|e| s.bad(e))?;
    let prompt = tool_chat_prompt(s, messages, tools.as_ref(), &mut settings).await?;
    let mut p = s.prepare(prompt, settings, None).map_err(|e| s.bad(e))?;
    p.tools = tools;
    answer(s, conn, id, p, true, started).await
}

/// A call in ollama's shape: the arguments as an object.
fn ollama_call(c: &super::tools::Call) -> Value {
    let arguments: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
    json!({"function": {"name": c.name, "arguments": arguments}})
}

async fn generate(
    State(s): State<Arc<AppState>>,
    ConnectInfo(conn): ConnectInfo<Conn>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    locked(&s.metrics).request("ollama_generate");
    generate_inner(&s, conn, body).await.unwrap_or_else(error)
}

async fn generate_inner(
    s: &Arc<AppState>,
    conn: Conn,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let body = body_bytes(body, s)?;
    let req: GenerateBody = api::parse(&body).map_err(|e| s.bad(e))?;
    let _ = (&req.model, &req.keep_alive);
    refuse_unsupported(&req.think).map_err(|e| s.bad(e))?;
    let refuse = |what: &str| Err(s.bad(bad(format!("{what} is not supported"))));
    if req.suffix.as_deref().is_some_and(|x| !x.is_empty()) {
        return refuse("suffix (fill in the middle)");
    }
    if req.template.as_deref().is_some_and(|x| !x.is_empty()) {
        return refuse("template (the model's own is used)");
    }
    if req.images.as_ref().is_some_and(|i| !i.is_empty()) {
        return refuse("images");
    }
    if req.context.as_ref().is_some_and(|c| !c.is_empty()) {
        return refuse("context (send the conversation to /api/chat)");
    }
    if req.prompt.is_empty() {
        return Ok(Json(json!({
            "model": s.model_id, "created_at": rfc3339(SystemTime::now()),
            "response": "", "done_reason": "load", "done": true,
        }))
        .into_response());
    }
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let mut settings = settings(req.options.as_ref(), s.seed(id), req.stream.unwrap_or(true)).map_err(|e| s.bad(e))?;
    settings.grammar = format_grammar(&req.format).map_err(|e| s.bad(e))?;
    let prompt = if req.raw == Some(true) {
        if req.system.is_some() {
            return refuse("system with raw");
        }
        s.tok.encode(
            &req.prompt,
            EncodeOptions {
                add_special: true,
                parse_special: true,
            },
        )
    } else {
        let mut messages: Vec<Message> = req.system.iter().map(|t| Message::new("system", t)).collect();
        messages.push(Message::new("user", &req.prompt));
        chat_prompt(s, messages).await?
    };
    let p = s.prepare(prompt, settings, None).map_err(|e| s.bad(e))?;
    answer(s, conn, id, p, false, started).await
}

/// One line of an answer: a piece of text, or the last with the counts.
fn line(model: &str, chat: bool, text: &str, done: Option<(&worker::Summary, Instant, Option<Instant>)>) -> Value {
    let mut v = json!({"model": model, "created_at": rfc3339(SystemTime::now())});
    if chat {
        v["message"] = json!({"role": "assistant", "content": text});
    } else {
        v["response"] = json!(text);
    }
    match done {
        None => v["done"] = json!(false),
        Some((d, started, first)) => {
            let now = Instant::now();
            let first = first.unwrap_or(now);
            let ns = |from: Instant, to: Instant| to.saturating_duration_since(from).as_nanos() as u64;
            v["done"] = json!(true);
            v["done_reason"] = json!(d.finish_reason.as_str());
            v["total_duration"] = json!(ns(started, now));
            v["load_duration"] = json!(0);
            v["prompt_eval_count"] = json!(d.prompt_tokens);
            v["prompt_eval_duration"] = json!(ns(started, first));
            v["eval_count"] = json!(d.completion_tokens);
            v["eval_duration"] = json!(ns(first, now));
        }
    }
    v
}

/// Runs a prepared request and answers it in ollama's shapes.
async fn answer(
    s: &Arc<AppState>,
    conn: Conn,
    id: u64,
    p: Prepared,
    chat: bool,
    started: Instant,
) -> Result<Response, ApiError> {
    let stream = p.settings.stream;
    let mut rx = s.submit(id, &p).await?;
    let model = s.model_id.clone();
    if !stream {
        let (text, d, first) = whole_answer(&conn, &mut rx).await?;
        let Some(t) = &p.tools else {
            return Ok(Json(line(&model, chat, &text, Some((&d, started, first)))).into_response());
        };
        let (content, calls) = super::tools::split(&text, t);
        let mut v = line(
            &model,
            chat,
            content.as_deref().unwrap_or(""),
            Some((&d, started, first)),
        );
        if !calls.is_empty() {
            v["message"]["tool_calls"] = Value::Array(calls.iter().map(ollama_call).collect());
        }
        return Ok(Json(v).into_response());
    }
    let mut splitter = p.tools.as_ref().map(super::tools::Splitter::new);
    let ndjson = |v: Value| {
        let mut b = v.to_string().into_bytes();
        b.push(b'\n');
        Ok::<_, Infallible>(Bytes::from(b))
    };
    let mut first = None;
    let stream = stream_answer(rx, conn, Vec::new(), move |piece| {
        // With tools, text passes through the splitter; each call is a
        // line of its own with `message.tool_calls`.
        let parts = |out: Vec<super::tools::Out>| -> Vec<Value> {
            out.into_iter()
                .map(|o| match o {
                    super::tools::Out::Text(t) => line(&model, chat, &t, None),
                    super::tools::Out::Call(c) => {
                        let mut v = line(&model, chat, "", None);
                        v["message"]["tool_calls"] = json!([ollama_call(&c)]);
                        v
                    }
                })
                .collect()
        };
        let lines = match piece {
            Piece::Text(t) => {
                first.get_or_insert_with(Instant::now);
                match &mut splitter {
                    Some(sp) => {
                        let out = sp.push(t);
                        parts(out)
                    }
                    None => vec![line(&model, chat, t, None)],
                }
            }
            Piece::Done(d) => {
                let mut v = match &mut splitter {
                    Some(sp) => {
                        let out = sp.finish();
                        parts(out)
                    }
                    None => Vec::new(),
                };
                v.push(line(&model, chat, "", Some((d, started, first))));
                v
            }
            Piece::Failed(e) => vec![json!({"error": e})],
        };
        lines.into_iter().map(ndjson).collect()
    });
    let body = axum::body::Body::from_stream(stream);
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response())
}

fn model_entry(s: &AppState) -> Value {
    let f = &s.facts;
    json!({
        "name": s.model_id,
        "model": s.model_id,
        "modified_at": rfc3339(f.modified),
        "size": f.size,
        "digest": "",
        "details": f.details(),
    })
}

async fn tags(State(s): State<Arc<AppState>>) -> Json<Value> {
    locked(&s.metrics).request("ollama_tags");
    Json(json!({"models": [model_entry(&s)]}))
}

async fn ps(State(s): State<Arc<AppState>>) -> Json<Value> {
    locked(&s.metrics).request("ollama_ps");
    let mut m = model_entry(&s);
    m["size_vram"] = json!(0);
    m["expires_at"] = json!("2318-01-01T00:00:00Z");
    Json(json!({"models": [m]}))
}

async fn version(State(s): State<Arc<AppState>>) -> Json<Value> {
    locked(&s.metrics).request("ollama_version");
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

#[derive(serde::Deserialize)]
struct ShowRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

async fn show(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    locked(&s.metrics).request("ollama_show");
    let inner = || -> Result<Value, ApiError> {
        let body = body_bytes(body, &s)?;
        let req: ShowRequest = api::parse(&body).map_err(|e| s.bad(e))?;
        let name = req.model.or(req.name).unwrap_or_default();
        if name != s.model_id && name.trim_end_matches(":latest") != s.model_id {
            return Err(ApiError {
                status: 404,
                ..bad(format!("model '{name}' not found (this server has '{}')", s.model_id))
            });
        }
        let f = &s.facts;
        Ok(json!({
            "modelfile": "",
            "parameters": "",
            "template": s.template.source,
            "details": f.details(),
            "model_info": {
                "general.architecture": f.family,
                "general.parameter_count": f.parameters,
                format!("{}.context_length", f.family): s.ctx,
            },
            "capabilities": ["completion", "tools"],
            "modified_at": rfc3339(f.modified),
        }))
    };
    match inner() {
        Ok(v) => Json(v).into_response(),
        Err(e) => error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_written_as_ollama_writes_them() {
        let t = UNIX_EPOCH + std::time::Duration::new(1_691_176_965, 499_127_000);
        assert_eq!(rfc3339(t), "2023-08-04T19:22:45.499127000Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
        let leap = UNIX_EPOCH + std::time::Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(&rfc3339(leap)[..10], "2000-02-29");
    }

    #[test]
    fn options_follow_ollama_defaults_and_refuse_what_snug_lacks() {
        let s = settings(None, 7, true).unwrap();
        assert_eq!(
            (s.params.temperature, s.params.top_p, s.params.repeat_penalty),
            (0.8, 0.9, 1.1)
        );
        assert_eq!(s.params.seed, 7);
        let o = |v: Value| settings(v.as_object(), 7, false);
        let s = o(json!({"temperature": 0, "num_predict": 5, "stop": ["\n"], "seed": 3, "num_ctx": 8192})).unwrap();
        assert_eq!((s.params.temperature, s.max_tokens, s.params.seed), (0.0, Some(5), 3));
        assert_eq!(s.stop, vec!["\n".to_string()]);
        assert!(o(json!({"num_predict": -1})).unwrap().max_tokens.is_none());
        assert!(o(json!({"mirostat": 2})).unwrap_err().message.contains("mirostat"));
        assert!(o(json!({"mirostat": 0})).is_ok());
        assert!(o(json!({"temperature": "hot"}))
            .unwrap_err()
            .message
            .contains("temperature"));
        assert!(o(json!({"bogus": 1})).unwrap_err().message.contains("bogus"));
    }
}
