//! The HTTP routes and their handlers.

use super::*;

pub(super) fn router(state: Arc<AppState>, max_body: usize, log: AccessLog) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_one))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .merge(super::ollama::routes())
        .merge(super::anthropic::routes())
        .merge(super::responses::routes())
        .merge(super::embeddings::routes())
        .merge(super::ui::routes())
        .route("/v1/systemone", post(systemone))
        .route("/v1/systemone/batch", post(systemone_batch))
        .route("/v1/decisions", post(super::decisions::decisions))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(max_body, api::decompress))
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state((state.clone(), max_body), limit_body))
        .layer(middleware::from_fn(super::conn::answering))
        .layer(middleware::from_fn_with_state(log, super::conn::access_log))
        .with_state(state)
}

/// The 413 for a request whose `Content-Length` is over `max`, if it is.
pub(super) fn declared_over(req: &Request, max: usize) -> Option<Response> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())?;
    if declared <= max as u64 {
        return None;
    }
    let mut r = ApiError {
        status: 413,
        message: format!("the request body is larger than the limit of {max} bytes"),
        kind: "invalid_request_error",
        param: None,
        code: Some("request_too_large"),
        retry_after: None,
    }
    .into_response();
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    Some(r)
}

/// [`limit_body`] for a server without request metrics (a Laya
/// checkpoint's).
pub(super) async fn limit_body_uncounted(State(max): State<usize>, req: Request, next: Next) -> Response {
    match declared_over(&req, max) {
        Some(r) => r,
        None => next.run(req).await,
    }
}

/// Refuses a body declared larger than the limit before reading any of it
/// (a client cannot hold the connection by sending it slowly), and counts
/// every 413, wherever it was decided (here, by the body limit, or by the
/// decoding of a compressed body).
pub(super) async fn limit_body(State((s, max)): State<(Arc<AppState>, usize)>, req: Request, next: Next) -> Response {
    if let Some(r) = declared_over(&req, max) {
        locked(&s.metrics).rejected("too_large");
        return r;
    }
    let r = next.run(req).await;
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        locked(&s.metrics).rejected("too_large");
    }
    r
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

pub(super) async fn not_found(req: Request) -> ApiError {
    ApiError {
        status: 404,
        message: format!("no route {} {}", req.method(), req.uri().path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
        retry_after: None,
    }
}

pub(super) async fn health(State(s): State<Arc<AppState>>) -> Response {
    let m = locked(&s.metrics).clone();
    let draining = s.draining.load(Ordering::SeqCst);
    let body = json!({
        "status": if draining { "draining" } else { "ok" },
        "running": m.running,
        "waiting": m.waiting,
        "kv_pages_free": m.kv_pages_total.saturating_sub(m.kv_pages_used + m.kv_pages_cached),
        "kv_pages_total": m.kv_pages_total,
    });
    let status = if draining {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (status, Json(body)).into_response()
}

pub(super) async fn metrics_text(State(s): State<Arc<AppState>>) -> Response {
    let text = {
        let mut m = locked(&s.metrics);
        m.request("metrics");
        m.render(crate::run::rss_bytes("VmRSS:"), crate::run::peak_rss_bytes())
    };
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

pub(super) async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    locked(&s.metrics).request("models");
    Json(json!({"object": "list", "data": [model_object(&s)]}))
}

fn model_object(s: &AppState) -> Value {
    json!({
        "id": s.model_id,
        "object": "model",
        "created": s.started,
        "owned_by": "snug",
        "meta": {"n_ctx": s.ctx, "n_vocab": s.vocab},
    })
}

/// `GET /v1/models/{id}`: the served model, or 404 for any other id.
pub(super) async fn model_one(
    State(s): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    locked(&s.metrics).request("models");
    if id != s.model_id {
        return Err(ApiError {
            status: 404,
            code: Some("model_not_found"),
            ..ApiError::bad(
                format!("the model {id:?} does not exist (this server has {:?})", s.model_id),
                None,
            )
        });
    }
    Ok(Json(model_object(&s)))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TokenizeRequest {
    content: String,
    #[serde(default)]
    add_special: bool,
    #[serde(default = "yes")]
    parse_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

fn yes() -> bool {
    true
}

/// `POST /tokenize` (llama.cpp's): `{"content"}` to `{"tokens": [...]}`,
/// or with `with_pieces`, `[{"id", "piece"}]`.
pub(super) async fn tokenize(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    locked(&s.metrics).request("tokenize");
    let body = body_bytes(body, &s)?;
    let req: TokenizeRequest = api::parse(&body).map_err(|e| s.bad(e))?;
    let ids = s.tok.encode(
        &req.content,
        EncodeOptions {
            add_special: req.add_special,
            parse_special: req.parse_special,
        },
    );
    if !req.with_pieces {
        return Ok(Json(json!({"tokens": ids})));
    }
    let tokens: Vec<Value> = ids
        .iter()
        .map(|&id| json!({"id": id, "piece": s.tok.piece(id, true)}))
        .collect();
    Ok(Json(json!({"tokens": tokens})))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DetokenizeRequest {
    tokens: Vec<i64>,
}

/// `POST /detokenize` (llama.cpp's): `{"tokens"}` to `{"content"}`.
pub(super) async fn detokenize(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    locked(&s.metrics).request("detokenize");
    let body = body_bytes(body, &s)?;
    let req: DetokenizeRequest = api::parse(&body).map_err(|e| s.bad(e))?;
    let mut ids = Vec::with_capacity(req.tokens.len());
    for t in req.tokens {
        match u32::try_from(t).ok().filter(|&t| (t as usize) < s.vocab) {
            Some(t) => ids.push(t),
            None => {
                return Err(s.bad(ApiError::bad(
                    format!("token id {t} is outside the vocabulary of {}", s.vocab),
                    Some("tokens"),
                )))
            }
        }
    }
    Ok(Json(json!({"content": s.tok.decode(&ids, true)})))
}

/// The body, or the limit's 413 as an OpenAI error.
pub(super) fn body_bytes(body: Result<Bytes, BytesRejection>, s: &AppState) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status().as_u16();
        // 413s are counted where every one passes (`limit_body`).
        if status != 413 {
            locked(&s.metrics).rejected("bad_request");
        }
        ApiError {
            status,
            message: e.body_text(),
            kind: "invalid_request_error",
            param: None,
            code: (status == 413).then_some("request_too_large"),
            retry_after: None,
        }
    })
}

/// A request ready for the engine.
pub(super) struct Prepared {
    pub(super) prompt: Vec<u32>,
    pub(super) settings: Settings,
    pub(super) max_tokens: usize,
    /// The request's tools: the answer is split into text and calls.
    pub(super) tools: Option<tools::Tools>,
}

impl AppState {
    pub(super) fn bad(&self, e: ApiError) -> ApiError {
        self.metrics
            .lock()
            .expect("metrics")
            .rejected(if e.code == Some("context_length_exceeded") {
                "context_length"
            } else {
                "bad_request"
            });
        e
    }

    /// Checks the prompt against the context and settles `max_tokens`
    /// (default: up to the context's end, or `default_max`).
    /// `ignore_eos`'s bias: far below any logit, and finite, so that it
    /// survives JSON and penalties.
    const BANNED: f32 = -1.0e30;

    pub(super) fn prepare(
        &self,
        prompt: Vec<u32>,
        mut settings: Settings,
        default_max: Option<usize>,
    ) -> Result<Prepared, ApiError> {
        if let Some(&(t, _)) = settings
            .params
            .logit_bias
            .iter()
            .find(|&&(t, _)| t as usize >= self.vocab)
        {
            return Err(ApiError::bad(
                format!(
                    "logit_bias names token id {t}, outside the vocabulary of {}",
                    self.vocab
                ),
                Some("logit_bias"),
            ));
        }
        if settings.ignore_eos {
            let bias = &mut settings.params.logit_bias;
            for &t in self.tok.eog_tokens() {
                match bias.iter_mut().find(|(b, _)| *b == t) {
                    Some(b) => b.1 = Self::BANNED,
                    None => bias.push((t, Self::BANNED)),
                }
            }
            bias.sort_by_key(|&(t, _)| t);
        }
        if prompt.is_empty() {
            return Err(ApiError::bad("the prompt is empty", Some("prompt")));
        }
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(ApiError::bad(
                format!("token id {t} is outside the vocabulary of {}", self.vocab),
                Some("prompt"),
            ));
        }
        if prompt.len() >= self.ctx {
            return Err(ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::bad(
                    format!(
                        "This model's maximum context length is {} tokens; the prompt has {} tokens, which leaves no room to generate.",
                        self.ctx,
                        prompt.len()
                    ),
                    Some("messages"),
                )
            });
        }
        let room = self.ctx - prompt.len();
        let max_tokens = settings.max_tokens.or(default_max).unwrap_or(room).min(room);
        Ok(Prepared {
            prompt,
            settings,
            max_tokens,
            tools: None,
        })
    }

    /// Compiles a request's grammar off the HTTP threads. The vocabulary's
    /// trie is built on the first constrained request and kept.
    pub(super) async fn constraint(self: &Arc<Self>, g: &Structured) -> Result<Constraint, ApiError> {
        let state = self.clone();
        let spec = g.spec.clone();
        let param = g.param;
        let compiled = tokio::task::spawn_blocking(move || {
            let grammars = state
                .grammars
                .get_or_init(|| Grammars::new(&state.tok, state.vocab).map_err(|e| e.to_string()));
            match grammars {
                Ok(g) => g.compile(&spec),
                Err(e) => Err(GrammarError::Engine(e.clone())),
            }
        })
        .await
        .map_err(|e| ApiError::internal(format!("compiling the grammar stopped: {e}")))?;
        compiled.map_err(|e| match e {
            GrammarError::Invalid(m) => self.bad(ApiError::bad(format!("{param}: {m}"), Some(param))),
            GrammarError::Engine(m) => ApiError::internal(m),
        })
    }

    pub(super) fn seed(&self, id: u64) -> u64 {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    /// Hands the job to the engine loop; returns its events once admitted
    /// or queued, or the refusal as a 503.
    pub(super) async fn submit(self: &Arc<Self>, id: u64, p: &Prepared) -> Result<UnboundedReceiver<Event>, ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(unavailable("the server is shutting down", 5));
        }
        let constraint = match &p.settings.grammar {
            Some(g) => Some(self.constraint(g).await?),
            None => None,
        };
        let (events, mut rx) = unbounded_channel();
        let job = Job {
            id,
            prompt: p.prompt.clone(),
            max_tokens: p.max_tokens,
            params: p.settings.params.clone(),
            stop: p.settings.stop.clone(),
            constraint,
            events,
            received: Instant::now(),
        };
        if locked(&self.jobs).send(Msg::Job(job)).is_err() {
            return Err(unavailable("the engine has stopped", 5));
        }
        match rx.recv().await {
            Some(Event::Accepted) => Ok(rx),
            Some(Event::Refused(r)) => Err(match r {
                Refused::QueueFull { .. } => unavailable(&format!("the server is busy: {r}"), 1),
                Refused::NeverFits { .. } => {
                    unavailable(&format!("the request cannot fit in the KV memory budget: {r}"), 30)
                }
            }),
            Some(Event::Failed(e)) => Err(ApiError::bad(e, None)),
            _ => Err(unavailable("the engine has stopped", 5)),
        }
    }
}

pub(super) fn unavailable(message: &str, retry_after: u64) -> ApiError {
    ApiError {
        status: 503,
        message: message.to_string(),
        kind: "server_error",
        param: None,
        code: Some("server_overloaded"),
        retry_after: Some(retry_after),
    }
}

pub(super) fn usage(prompt: usize, completion: usize, reused: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": reused},
    })
}

/// Which endpoint a response is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Chat,
    Completion,
}

pub(super) async fn chat_completions(
    State(s): State<Arc<AppState>>,
    ConnectInfo(conn): ConnectInfo<Conn>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    locked(&s.metrics).request("chat_completions");
    match chat_inner(&s, conn, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn chat_inner(
    s: &Arc<AppState>,
    conn: Conn,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body, s)?;
    let req: ChatRequest = api::parse(&body).map_err(|e| s.bad(e))?;
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let mut settings = req.common.settings(s.seed(id)).map_err(|e| s.bad(e))?;
    if req.messages.is_empty() {
        return Err(s.bad(ApiError::bad("messages must not be empty", Some("messages"))));
    }
    let tools = tools::read(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls.as_ref(),
    )
    .map_err(|e| s.bad(e))?;
    let mut messages = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer" | "tool") {
            return Err(s.bad(ApiError::bad(
                format!("unknown message role {:?}", m.role),
                Some("messages"),
            )));
        }
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        let mut v = json!({"role": role, "content": m.text().map_err(|e| s.bad(e))?});
        if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
            v["tool_calls"] = Value::Array(calls.clone());
        }
        if let Some(id) = &m.tool_call_id {
            v["tool_call_id"] = Value::from(id.as_str());
        }
        if let Some(name) = &m.name {
            v["name"] = Value::from(name.as_str());
        }
        messages.push(v);
    }
    let prompt = tool_chat_prompt(s, messages, tools.as_ref(), &mut settings).await?;
    let mut p = s.prepare(prompt, settings, None).map_err(|e| s.bad(e))?;
    p.tools = tools;
    respond(s, conn, id, Kind::Chat, p).await
}

pub(super) async fn completions(
    State(s): State<Arc<AppState>>,
    ConnectInfo(conn): ConnectInfo<Conn>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    locked(&s.metrics).request("completions");
    match completion_inner(&s, conn, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn completion_inner(
    s: &Arc<AppState>,
    conn: Conn,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body, s)?;
    let req: CompletionRequest = api::parse(&body).map_err(|e| s.bad(e))?;
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let settings = req.common.settings(s.seed(id)).map_err(|e| s.bad(e))?;
    let prompt = match req.prompt {
        Prompt::Text(t) => s.tok.encode(&t, EncodeOptions::default()),
        Prompt::Texts(v) if v.len() == 1 => s.tok.encode(&v[0], EncodeOptions::default()),
        Prompt::Texts(_) => {
            return Err(s.bad(ApiError::bad(
                "prompt: one text per request is supported",
                Some("prompt"),
            )))
        }
        Prompt::Tokens(ids) => {
            let mut out = Vec::with_capacity(ids.len());
            for t in ids {
                out.push(
                    u32::try_from(t)
                        .map_err(|_| s.bad(ApiError::bad(format!("token id {t} is not valid"), Some("prompt"))))?,
                );
            }
            out
        }
    };
    // OpenAI's default for completions.
    let p = s.prepare(prompt, settings, Some(16)).map_err(|e| s.bad(e))?;
    respond(s, conn, id, Kind::Completion, p).await
}

/// A conversation with tools (or none) as prompt tokens: a template that
/// renders tools itself gets them as `tools`; for any other they are
/// described in the system message. The call grammar, when the tool
/// choice needs one, becomes the request's.
pub(super) async fn tool_chat_prompt(
    s: &Arc<AppState>,
    messages: Vec<Value>,
    tools: Option<&tools::Tools>,
    settings: &mut Settings,
) -> Result<Vec<u32>, ApiError> {
    let native = s.template.source.contains("tools");
    let mut messages = tools::template_messages(messages, native);
    let mut extra = json!({});
    if let Some(t) = tools {
        if native {
            extra["tools"] = Value::Array(t.defs.clone());
        } else if messages.first().is_some_and(|m| m["role"] == "system") {
            let text = format!(
                "{}\n\n{}",
                messages[0]["content"].as_str().unwrap_or_default(),
                t.system_text()
            );
            messages[0]["content"] = Value::from(text);
        } else {
            messages.insert(0, json!({"role": "system", "content": t.system_text()}));
        }
        if let Some(spec) = t
            .grammar(settings.grammar.as_ref().map(|g| &g.spec))
            .map_err(|e| s.bad(e))?
        {
            settings.grammar = Some(Structured { spec, param: "tools" });
        }
    }
    chat_prompt_value(s, Value::Array(messages), extra).await
}

/// A conversation's prompt tokens: the chat template rendered (in the
/// template worker, on the blocking pool, so the HTTP thread never waits
/// on it) and tokenized.
pub(super) async fn chat_prompt(s: &Arc<AppState>, messages: Vec<Message>) -> Result<Vec<u32>, ApiError> {
    let messages = serde_json::to_value(messages).map_err(|e| ApiError::internal(e.to_string()))?;
    chat_prompt_value(s, messages, json!({})).await
}

/// [`chat_prompt`] for messages as JSON (with `tool_calls` and the like)
/// and further template variables (`tools`).
pub(super) async fn chat_prompt_value(s: &Arc<AppState>, messages: Value, extra: Value) -> Result<Vec<u32>, ApiError> {
    // A render is a round trip to the template worker (which may take up
    // to its time limit); the blocking pool keeps the HTTP thread free.
    let state = s.clone();
    let text =
        tokio::task::spawn_blocking(move || state.template.render(&messages, true, &state.bos, &state.eos, &extra))
            .await
            .map_err(|e| ApiError::internal(format!("the chat template's render stopped: {e}")))?
            .map_err(|e| match e {
                snug_model::template::TemplateError::Isolation(_) => ApiError::internal(e.to_string()),
                _ => s.bad(ApiError::bad(
                    format!("the chat template failed: {e}"),
                    Some("messages"),
                )),
            })?;
    Ok(s.tok.encode(
        &text,
        EncodeOptions {
            add_special: s.bos.is_empty() || !text.starts_with(&s.bos),
            parse_special: true,
        },
    ))
}

/// A request's whole answer, for a client that did not ask for a stream:
/// its text, how it ended and when its first text came (the tokens noted
/// for the access log). A client that hangs up meanwhile cancels it
/// (dropping the receiver does).
pub(super) async fn whole_answer(
    conn: &Conn,
    rx: &mut UnboundedReceiver<Event>,
) -> Result<(String, worker::Summary, Option<Instant>), ApiError> {
    let mut text = String::new();
    let mut first = None;
    let mut check = tokio::time::interval(std::time::Duration::from_millis(100));
    loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = check.tick() => {
                if conn.hung_up() {
                    return Err(ApiError::bad("the client closed the connection", None));
                }
                continue;
            }
        };
        match ev {
            Some(Event::Text(t)) => {
                first.get_or_insert_with(Instant::now);
                text.push_str(&t);
            }
            Some(Event::Done(d)) => {
                conn.record(Usage {
                    prompt: d.prompt_tokens,
                    completion: d.completion_tokens,
                    cached: d.reused_tokens,
                });
                return Ok((text, d, first));
            }
            Some(Event::Failed(e)) => return Err(ApiError::internal(e)),
            Some(_) => {}
            None => return Err(unavailable("the engine has stopped", 5)),
        }
    }
}

/// What a streamed answer's formatter is handed, in order: pieces of
/// text, then how it ended (or why it failed).
pub(super) enum Piece<'a> {
    Text(&'a str),
    Done(&'a worker::Summary),
    Failed(&'a str),
}

/// A streamed answer: a task sends `prelude`, then what `format` makes of
/// each of the engine's events, and notes the tokens for the access log.
/// When the client goes away the channel closes, the task ends and drops
/// the engine's receiver, and the engine loop cancels the request.
pub(super) fn stream_answer<T: Send + 'static>(
    mut rx: UnboundedReceiver<Event>,
    conn: Conn,
    prelude: Vec<T>,
    mut format: impl FnMut(Piece<'_>) -> Vec<T> + Send + 'static,
) -> tokio_stream::wrappers::UnboundedReceiverStream<T> {
    let (out, out_rx) = unbounded_channel::<T>();
    tokio::spawn(async move {
        for item in prelude {
            if out.send(item).is_err() {
                return;
            }
        }
        while let Some(ev) = rx.recv().await {
            let (items, last) = match &ev {
                Event::Text(t) => (format(Piece::Text(t)), false),
                Event::Done(d) => {
                    conn.record(Usage {
                        prompt: d.prompt_tokens,
                        completion: d.completion_tokens,
                        cached: d.reused_tokens,
                    });
                    (format(Piece::Done(d)), true)
                }
                Event::Failed(e) => (format(Piece::Failed(e)), true),
                Event::Accepted | Event::Refused(_) => continue,
            };
            for item in items {
                if out.send(item).is_err() {
                    return;
                }
            }
            if last {
                return;
            }
        }
    });
    tokio_stream::wrappers::UnboundedReceiverStream::new(out_rx)
}

/// Runs a prepared request and answers it, streaming or not.
pub(super) async fn respond(
    s: &Arc<AppState>,
    conn: Conn,
    id: u64,
    kind: Kind,
    p: Prepared,
) -> Result<Response, ApiError> {
    let mut rx = s.submit(id, &p).await?;
    let created = unix_now();
    let rid = match kind {
        Kind::Chat => format!("chatcmpl-{id}"),
        Kind::Completion => format!("cmpl-{id}"),
    };
    let call_id = move |i: usize| format!("call_{id}_{i}");
    if !p.settings.stream {
        let (text, d, _) = whole_answer(&conn, &mut rx).await?;
        let u = usage(d.prompt_tokens, d.completion_tokens, d.reused_tokens);
        let mut message = json!({"role": "assistant", "content": text});
        let mut reason = d.finish_reason.as_str();
        if let Some(t) = &p.tools {
            let (content, calls) = tools::split(&text, t);
            message["content"] = content.map_or(Value::Null, Value::from);
            if !calls.is_empty() {
                let calls: Vec<Value> = calls.iter().enumerate().map(|(i, c)| c.json(&call_id(i))).collect();
                message["tool_calls"] = Value::Array(calls);
                reason = "tool_calls";
            }
        }
        let body = match kind {
            Kind::Chat => json!({
                "id": rid, "object": "chat.completion", "created": created, "model": s.model_id,
                "choices": [{"index": 0, "message": message,
                             "logprobs": null, "finish_reason": reason}],
                "usage": u,
            }),
            Kind::Completion => json!({
                "id": rid, "object": "text_completion", "created": created, "model": s.model_id,
                "choices": [{"index": 0, "text": text, "logprobs": null,
                             "finish_reason": d.finish_reason.as_str()}],
                "usage": u,
            }),
        };
        return Ok(Json(body).into_response());
    }
    let model = s.model_id.clone();
    let include_usage = p.settings.include_usage;
    let chunk = move |choice: Value| -> Value {
        match kind {
            Kind::Chat => json!({"id": rid, "object": "chat.completion.chunk", "created": created,
                                 "model": model, "choices": [choice]}),
            Kind::Completion => json!({"id": rid, "object": "text_completion", "created": created,
                                       "model": model, "choices": [choice]}),
        }
    };
    let data = |v: Value| SseEvent::default().data(v.to_string());
    let prelude = match kind {
        Kind::Chat => vec![data(chunk(
            json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": null, "finish_reason": null}),
        ))],
        Kind::Completion => Vec::new(),
    };
    // With tools, text passes through the splitter: calls come out as
    // `tool_calls` deltas (each whole: its id and name, and its arguments
    // in one piece), the rest as content.
    let mut splitter = p.tools.as_ref().map(tools::Splitter::new);
    let mut calls = 0usize;
    let delta_chunk = chunk.clone();
    let mut delta = move |out: Vec<tools::Out>| -> Vec<SseEvent> {
        out.into_iter()
            .map(|o| {
                let d = match o {
                    tools::Out::Text(t) => json!({"content": t}),
                    tools::Out::Call(c) => {
                        let mut call = c.json(&call_id(calls));
                        call["index"] = Value::from(calls);
                        calls += 1;
                        json!({"tool_calls": [call]})
                    }
                };
                data(delta_chunk(
                    json!({"index": 0, "delta": d, "logprobs": null, "finish_reason": null}),
                ))
            })
            .collect()
    };
    let stream = stream_answer(rx, conn, prelude, move |piece| match piece {
        Piece::Text(t) => match &mut splitter {
            Some(sp) => delta(sp.push(t)),
            None => vec![data(chunk(match kind {
                Kind::Chat => json!({"index": 0, "delta": {"content": t}, "logprobs": null, "finish_reason": null}),
                Kind::Completion => json!({"index": 0, "text": t, "logprobs": null, "finish_reason": null}),
            }))],
        },
        Piece::Done(d) => {
            let mut out = Vec::new();
            let mut reason = d.finish_reason.as_str();
            if let Some(sp) = &mut splitter {
                out.extend(delta(sp.finish()));
                if sp.calls() > 0 {
                    reason = "tool_calls";
                }
            }
            let last = match kind {
                Kind::Chat => json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason}),
                Kind::Completion => json!({"index": 0, "text": "", "logprobs": null, "finish_reason": reason}),
            };
            out.push(data(chunk(last)));
            if include_usage {
                let mut v = chunk(Value::Null);
                v["choices"] = json!([]);
                v["usage"] = usage(d.prompt_tokens, d.completion_tokens, d.reused_tokens);
                out.push(data(v));
            }
            out.push(SseEvent::default().data("[DONE]"));
            out
        }
        Piece::Failed(e) => vec![data(
            json!({"error": {"message": e, "type": "server_error", "param": null, "code": null}}),
        )],
    });
    Ok(Sse::new(tokio_stream::StreamExt::map(stream, Ok::<_, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// `POST /v1/systemone`: Laya's typed decisions (see docs/DECIDE.md).
pub(super) async fn systemone(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    locked(&s.metrics).request("systemone");
    laya_errors(systemone_inner(&s, body, false).await)
}

/// `POST /v1/systemone/batch`: the same questions about several states.
pub(super) async fn systemone_batch(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    locked(&s.metrics).request("systemone_batch");
    laya_errors(systemone_inner(&s, body, true).await)
}

/// An error as the OpenAI object plus Laya's `detail` string.
pub(super) fn laya_errors(r: Result<Response, ApiError>) -> Response {
    match r {
        Ok(r) => r,
        Err(e) => {
            let mut body = e.body();
            body["detail"] = json!(e.message);
            let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut r = (status, Json(body)).into_response();
            if let Some(secs) = e.retry_after {
                r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
            }
            r
        }
    }
}

pub(super) fn unprocessable(message: String, code: Option<&'static str>) -> ApiError {
    ApiError {
        status: 422,
        code,
        ..ApiError::bad(message, None)
    }
}

/// Most states in one batch request.
pub(super) const MAX_BATCH_STATES: usize = 64;

pub(super) async fn systemone_inner(
    s: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    batch: bool,
) -> Result<Response, ApiError> {
    use snug_engine::decide::{self, MinConfidence};
    let body = body_bytes(body, s)?;
    let v: Value = api::parse(&body).map_err(|e| s.bad(e))?;
    let Some(obj) = v.as_object().filter(|o| o.contains_key("questions")) else {
        return Err(s.bad(ApiError::bad(
            "request body must be an object with a 'questions' field",
            None,
        )));
    };
    let states: Vec<String> = if batch {
        match obj.get("states") {
            Some(Value::Array(a)) if !a.is_empty() && a.len() <= MAX_BATCH_STATES && a.iter().all(|x| !x.is_null()) => {
                a.iter().map(crate::decide::state_text).collect()
            }
            _ => {
                return Err(s.bad(ApiError::bad(
                    format!("'states' must be a list of 1 to {MAX_BATCH_STATES} states"),
                    Some("states"),
                )))
            }
        }
    } else {
        match obj.get("state") {
            None | Some(Value::Null) => return Err(s.bad(ApiError::bad("'state' is required", Some("state")))),
            Some(v) => vec![crate::decide::state_text(v)],
        }
    };
    let questions =
        decide::parse_questions(&obj["questions"]).map_err(|e| s.bad(unprocessable(e.to_string(), None)))?;
    let min = match obj.get("min_confidence") {
        None | Some(Value::Null) => None,
        Some(m) => Some(MinConfidence::parse(m).map_err(|e| s.bad(unprocessable(e.to_string(), None)))?),
    };
    let t0 = Instant::now();
    let mut results = Vec::with_capacity(states.len());
    let mut total = 0;
    for state in states {
        let (scored, usage) = decide_one(s, state, questions.clone()).await?;
        total += usage.input_tokens;
        results.push(decide::response_json(&s.model_id, &scored, &usage, min.as_ref()));
    }
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let body = if batch {
        json!({"results": results, "total_usage": {"input_tokens": total, "output_tokens": 0}})
    } else {
        results.pop().expect("one state")
    };
    let mut r = Json(body).into_response();
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&format!("inference;dur={ms:.1}")) {
        h.insert("server-timing", v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("{ms:.1}")) {
        h.insert("x-inference-time-ms", v);
    }
    Ok(r)
}

/// One state's questions, answered by the engine loop.
pub(super) async fn decide_one(
    s: &Arc<AppState>,
    state: String,
    questions: Vec<snug_engine::decide::Question>,
) -> Result<(Vec<snug_engine::decide::Scored>, snug_engine::decide::DecideUsage), ApiError> {
    use snug_engine::decide::DecideError;
    if s.draining.load(Ordering::SeqCst) {
        return Err(unavailable("the server is shutting down", 5));
    }
    let (reply, answer) = tokio::sync::oneshot::channel();
    let job = DecideJob {
        state,
        questions,
        reply,
    };
    if locked(&s.jobs).send(Msg::Decide(job)).is_err() {
        return Err(unavailable("the engine has stopped", 5));
    }
    match answer.await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e @ DecideError::TooLong { .. })) => {
            Err(s.bad(unprocessable(e.to_string(), Some("context_length_exceeded"))))
        }
        Ok(Err(e @ DecideError::Invalid(_))) => Err(s.bad(unprocessable(e.to_string(), None))),
        Ok(Err(e @ DecideError::OverBudget { .. })) => {
            locked(&s.metrics).rejected("never_fits");
            Err(unavailable(
                &format!("the request cannot fit in the KV memory budget: {e}"),
                30,
            ))
        }
        Ok(Err(DecideError::Engine(snug_engine::EngineError::Pages(e)))) => {
            Err(unavailable(&format!("no KV room for the questions now: {e}"), 1))
        }
        Ok(Err(e)) => Err(ApiError {
            status: 500,
            kind: "server_error",
            ..ApiError::bad(e.to_string(), None)
        }),
        Err(_) => Err(unavailable("the engine has stopped", 5)),
    }
}
