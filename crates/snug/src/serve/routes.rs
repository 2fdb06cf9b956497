//! The HTTP routes and their handlers.

use super::completions::{chat_completions, completions};
use super::systemone::{systemone, systemone_batch};
use super::*;

pub(super) fn router(state: Arc<AppState>, max_body: usize, log: AccessLog) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions/render", post(super::completions::chat_render))
        .route("/v1/completions/render", post(super::completions::completion_render))
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
