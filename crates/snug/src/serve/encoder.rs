//! `snug serve DIR` for an encoder checkpoint directory, with `/health`,
//! `/v1/models` and `/metrics`:
//!
//! - a Laya checkpoint: Laya's `/v1/systemone` and `/v1/systemone/batch`
//!   on the native encoder;
//! - a sentence-embedding checkpoint: `/v1/embeddings` and ollama's
//!   `/api/embed` (the routes of [`super::embeddings`]).
//!
//! One thread owns the checkpoint. It takes a request off the queue, then
//! every request already waiting (up to [`MAX_BATCH_ROWS`] rows), and
//! answers them all in one forward; rows never interact, so each answer is
//! the same as if its request had been alone.

use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use snug_engine::decide::DecideError;
use snug_engine::laya::{parse_request, LayaAgent, LayaRequest};
use snug_model::sentence::SentenceModel;

use super::api::ApiError;
use super::embeddings::{Embedder, Input, MAX_INPUTS};
use super::{key_ok, locked, shutdown_signal, unauthorized, unix_now, Conn, ServeArgs, Usage};

/// Most rows (questions times states) one forward takes from the queue.
pub const MAX_BATCH_ROWS: usize = 64;
/// Most states in one batch request.
const MAX_BATCH_STATES: usize = 64;

type Reply = tokio::sync::oneshot::Sender<Result<Vec<Value>, DecideError>>;
type EmbedReply = tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>, String>>;

enum Job {
    Decide {
        req: LayaRequest,
        states: Vec<Value>,
        reply: Reply,
    },
    Embed {
        inputs: Vec<Vec<u32>>,
        reply: EmbedReply,
    },
}

impl Job {
    fn rows(&self) -> usize {
        match self {
            Job::Decide { req, states, .. } => req.questions.len() * states.len(),
            Job::Embed { inputs, .. } => inputs.len(),
        }
    }
}

/// The checkpoint the worker owns.
enum Checkpoint {
    Laya(Box<LayaAgent>),
    Sentence(Arc<SentenceModel>),
}

/// What the HTTP side knows of the checkpoint.
enum Kind {
    Laya { max_len: usize, head_max_len: usize },
    Sentence(Arc<SentenceModel>),
}

/// Counters for /metrics.
#[derive(Default)]
struct Stats {
    requests: std::collections::BTreeMap<&'static str, u64>,
    errors: std::collections::BTreeMap<u16, u64>,
    questions: u64,
    rows: u64,
    input_tokens: u64,
    forwards: u64,
    forward_seconds: f64,
    /// Request latency histogram (seconds): bucket bounds, counts, sum.
    latency: Vec<u64>,
    latency_sum: f64,
    latency_count: u64,
}

const LATENCY_BOUNDS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

pub(super) struct EncoderState {
    jobs: Mutex<mpsc::Sender<Job>>,
    model_id: String,
    api_key: Option<String>,
    started: u64,
    kind: Kind,
    weight_bytes: usize,
    /// Activation bytes of the largest pass.
    scratch_bytes: usize,
    waiting: AtomicUsize,
    max_queue: usize,
    stats: Arc<Mutex<Stats>>,
    draining: AtomicBool,
}

impl EncoderState {
    fn count_error(&self, e: ApiError) -> ApiError {
        *locked(&self.stats).errors.entry(e.status).or_default() += 1;
        e
    }

    /// Puts a job on the worker's queue, or refuses it: 503 while draining
    /// or when [`ServeArgs::max_queue`] requests already wait.
    fn enqueue(&self, job: Job) -> Result<(), ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(status(503, "the server is shutting down".into(), None));
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.max_queue {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError {
                retry_after: Some(1),
                ..status(503, "server busy, try again later".into(), None)
            });
        }
        if locked(&self.jobs).send(job).is_err() {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(status(503, "the server is shutting down".into(), None));
        }
        Ok(())
    }
}

impl Embedder for EncoderState {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn dim(&self) -> usize {
        match &self.kind {
            Kind::Sentence(m) => m.dim(),
            Kind::Laya { .. } => 0,
        }
    }

    fn count_request(&self, route: &'static str) {
        *locked(&self.stats).requests.entry(route).or_default() += 1;
    }

    fn refuse(&self, e: ApiError) -> ApiError {
        self.count_error(e)
    }

    fn body(&self, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
        body.map_err(|e| self.count_error(rejected_body(e)))
    }

    async fn embed_input(&self, conn: &Conn, input: Input) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
        let Kind::Sentence(m) = &self.kind else {
            return Err(self.count_error(status(404, "this checkpoint makes no embeddings".into(), None)));
        };
        let inputs = sentence_inputs(m, input).map_err(|e| self.count_error(e))?;
        let tokens: usize = inputs.iter().map(Vec::len).sum();
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.enqueue(Job::Embed { inputs, reply })
            .map_err(|e| self.count_error(e))?;
        let vectors = match rx.await {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => return Err(self.count_error(status(500, e, None))),
            Err(_) => return Err(self.count_error(status(503, "the server is shutting down".into(), None))),
        };
        conn.record(Usage {
            prompt: tokens,
            completion: 0,
            cached: 0,
        });
        Ok((vectors, tokens))
    }
}

/// Each input's tokens, checked against the vocabulary and the model's
/// longest input. Nothing is cut: an over-long text is refused, naming
/// its length, since a cut text's vector is not the text's.
fn sentence_inputs(m: &SentenceModel, input: Input) -> Result<Vec<Vec<u32>>, ApiError> {
    let bad = |message: String| ApiError::bad(message, Some("input"));
    let inputs: Vec<Vec<u32>> = match input {
        Input::Text(t) => vec![m.tokenize(&t).map_err(|e| bad(e.to_string()))?],
        Input::Texts(v) => v
            .iter()
            .map(|t| m.tokenize(t).map_err(|e| bad(e.to_string())))
            .collect::<Result<_, _>>()?,
        Input::Tokens(v) => vec![super::embeddings::token_ids(v, m.vocab())?],
        Input::TokenLists(v) => v
            .into_iter()
            .map(|t| super::embeddings::token_ids(t, m.vocab()))
            .collect::<Result<_, _>>()?,
    };
    if inputs.is_empty() || inputs.len() > MAX_INPUTS {
        return Err(bad(format!("input takes 1 to {MAX_INPUTS} items")));
    }
    for (i, t) in inputs.iter().enumerate() {
        if t.is_empty() {
            return Err(bad(format!("input {i} is empty")));
        }
        if t.len() > m.max_tokens {
            return Err(ApiError {
                code: Some("context_length_exceeded"),
                ..bad(format!(
                    "input {i} has {} tokens; this model takes at most {} (its max_seq_length); split the text",
                    t.len(),
                    m.max_tokens
                ))
            });
        }
    }
    Ok(inputs)
}

/// A body axum could not read, as an API error.
fn rejected_body(e: BytesRejection) -> ApiError {
    let code = e.status().as_u16();
    status(
        code,
        if code == 413 {
            "request body too large".into()
        } else {
            e.body_text()
        },
        None,
    )
}

/// Serves the checkpoint in `dir` on `listener` until SIGINT or SIGTERM.
pub fn serve(a: &ServeArgs, dir: &Path, listener: TcpListener, max_body: usize) -> Result<()> {
    let (checkpoint, kind, weight_bytes, scratch_bytes) = if snug_model::laya::is_checkpoint(dir) {
        let agent = crate::decide::laya_agent(dir, a.threads, None)?;
        let m = &agent.model;
        let kind = Kind::Laya {
            max_len: m.config.max_len,
            head_max_len: m.config.head_max_len,
        };
        let (w, sc) = (
            m.weight_bytes(),
            m.scratch_bytes(m.forward_tokens().max(m.config.max_len)),
        );
        (Checkpoint::Laya(Box::new(agent)), kind, w, sc)
    } else {
        let threads = a.threads.unwrap_or_else(snug_kernels::pool::physical_cores);
        let m = Arc::new(SentenceModel::open(dir, threads).with_context(|| format!("{}", dir.display()))?);
        let (w, sc) = (m.weight_bytes(), m.scratch_bytes());
        (Checkpoint::Sentence(m.clone()), Kind::Sentence(m), w, sc)
    };
    let stats = Arc::new(Mutex::new(Stats {
        latency: vec![0; LATENCY_BOUNDS.len() + 1],
        ..Stats::default()
    }));
    let (tx, rx) = mpsc::channel::<Job>();
    let state = Arc::new(EncoderState {
        jobs: Mutex::new(tx),
        model_id: a.alias.clone().unwrap_or_else(|| a.model.clone()),
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        started: unix_now(),
        kind,
        weight_bytes,
        scratch_bytes,
        waiting: AtomicUsize::new(0),
        max_queue: a.max_queue,
        stats: stats.clone(),
        draining: AtomicBool::new(false),
    });
    let worker = {
        let state = state.clone();
        std::thread::Builder::new()
            .name("snug-encoder".into())
            .spawn(move || work(checkpoint, rx, &state))?
    };
    let routes = match state.kind {
        Kind::Laya { .. } => Router::new()
            .route("/v1/systemone", post(systemone))
            .route("/v1/systemone/batch", post(systemone_batch)),
        Kind::Sentence(_) => super::embeddings::routes(),
    };
    let app = routes
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(max_body, super::api::decompress))
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(
            max_body,
            super::routes::limit_body_uncounted,
        ))
        .layer(middleware::from_fn(super::conn::answering))
        .with_state(state.clone());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    let http_state = state.clone();
    rt.block_on(async move {
        let listener = super::TimedListener::new(
            tokio::net::TcpListener::from_std(listener)?,
            std::time::Duration::from_secs(a.read_timeout),
            a.max_connections,
        );
        let what = match &http_state.kind {
            Kind::Laya { max_len, head_max_len } => {
                format!(
                    "Laya checkpoint {} (max_len {max_len}, head_max_len {head_max_len}",
                    http_state.model_id
                )
            }
            Kind::Sentence(m) => format!(
                "sentence embeddings {} ({} dimensions, {} pooling, inputs up to {} tokens",
                http_state.model_id,
                m.dim(),
                m.pooling.name(),
                m.max_tokens
            ),
        };
        eprintln!(
            "snug serve: {what}; {} MiB of weights mapped, at most {} MiB of activations a pass) on http://{}",
            http_state.weight_bytes >> 20,
            http_state.scratch_bytes >> 20,
            axum::serve::Listener::local_addr(&listener)?,
        );
        let s = http_state.clone();
        let signalled = Arc::new(tokio::sync::Notify::new());
        let told = signalled.clone();
        let server = axum::serve(listener, app.into_make_service_with_connect_info::<super::Conn>())
            .with_graceful_shutdown(async move {
                shutdown_signal().await;
                s.draining.store(true, Ordering::SeqCst);
                eprintln!("snug serve: draining (finishing running requests)");
                told.notify_one();
            });
        tokio::select! {
            r = server => r?,
            _ = super::start::stragglers(
                &signalled,
                || http_state.waiting.load(Ordering::SeqCst) as u64,
                std::time::Duration::from_secs(a.shutdown_timeout),
            ) => {
                eprintln!("snug serve: closing connections that have no request under way");
            }
        }
        anyhow::Ok(())
    })?;
    // Closing the channel ends the worker once the queue is empty.
    drop(std::mem::replace(&mut *locked(&state.jobs), mpsc::channel().0));
    let _ = worker.join();
    eprintln!("snug serve: stopped");
    Ok(())
}

/// The checkpoint's thread: batches waiting jobs into one forward.
fn work(checkpoint: Checkpoint, rx: mpsc::Receiver<Job>, state: &EncoderState) {
    while let Ok(first) = rx.recv() {
        let mut rows = first.rows();
        let mut batch = vec![first];
        while rows < MAX_BATCH_ROWS {
            match rx.try_recv() {
                Ok(j) => {
                    rows += j.rows();
                    batch.push(j);
                }
                Err(_) => break,
            }
        }
        state.waiting.fetch_sub(batch.len(), Ordering::SeqCst);
        let t0 = Instant::now();
        match &checkpoint {
            Checkpoint::Laya(agent) => decide(agent, batch, state),
            Checkpoint::Sentence(model) => embed(model, batch, state),
        }
        let secs = t0.elapsed().as_secs_f64();
        let mut st = locked(&state.stats);
        st.forwards += 1;
        st.forward_seconds += secs;
        st.rows += rows as u64;
    }
}

fn decide(agent: &LayaAgent, batch: Vec<Job>, state: &EncoderState) {
    let mut jobs = Vec::new();
    for job in batch {
        match job {
            Job::Decide { req, states, reply } => jobs.push((req, states, reply)),
            Job::Embed { reply, .. } => {
                let _ = reply.send(Err("this checkpoint answers decisions, not embeddings".into()));
            }
        }
    }
    let work: Vec<(&LayaRequest, &[Value])> = jobs.iter().map(|(r, s, _)| (r, s.as_slice())).collect();
    let results = agent.answer_jobs(&work);
    for ((_, _, reply), result) in jobs.into_iter().zip(results) {
        let result = result.map(|r| {
            let mut st = locked(&state.stats);
            for (v, answers) in &r {
                st.questions += answers.len() as u64;
                st.input_tokens += v["usage"]["input_tokens"].as_u64().unwrap_or(0);
            }
            r.into_iter().map(|(v, _)| v).collect()
        });
        let _ = reply.send(result);
    }
}

/// Every waiting request's inputs in one call; each input's vector is the
/// same bits as alone.
fn embed(model: &SentenceModel, batch: Vec<Job>, state: &EncoderState) {
    let mut inputs = Vec::new();
    let mut replies = Vec::new();
    for job in batch {
        match job {
            Job::Embed { inputs: i, reply } => {
                replies.push((reply, i.len()));
                inputs.extend(i);
            }
            Job::Decide { reply, .. } => {
                let _ = reply.send(Err(DecideError::Invalid(
                    "this checkpoint makes embeddings; it answers no decisions".into(),
                )));
            }
        }
    }
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    locked(&state.stats).input_tokens += tokens as u64;
    match model.embed(&inputs) {
        Ok(vectors) => {
            let mut it = vectors.into_iter();
            for (reply, n) in replies {
                let _ = reply.send(Ok(it.by_ref().take(n).collect()));
            }
        }
        Err(e) => {
            for (reply, _) in replies {
                let _ = reply.send(Err(e.to_string()));
            }
        }
    }
}

async fn authorize(State(s): State<Arc<EncoderState>>, req: Request, next: Next) -> Response {
    if !key_ok(&req, s.api_key.as_deref()) {
        return laya_error(s.count_error(unauthorized()));
    }
    next.run(req).await
}

/// An error as the OpenAI object plus Laya's `detail` string.
fn laya_error(e: ApiError) -> Response {
    let mut body = e.body();
    body["detail"] = json!(e.message);
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, Json(body)).into_response();
    if let Some(secs) = e.retry_after {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    r
}

async fn not_found(req: Request) -> Response {
    laya_error(ApiError {
        status: 404,
        message: format!("no route {} {}", req.method(), req.uri().path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
        retry_after: None,
    })
}

fn status(status: u16, message: String, code: Option<&'static str>) -> ApiError {
    ApiError {
        status,
        code,
        ..ApiError::bad(message, None)
    }
}

async fn systemone(State(s): State<Arc<EncoderState>>, body: Result<Bytes, BytesRejection>) -> Response {
    *locked(&s.stats).requests.entry("systemone").or_default() += 1;
    respond(&s, body, false).await
}

async fn systemone_batch(State(s): State<Arc<EncoderState>>, body: Result<Bytes, BytesRejection>) -> Response {
    *locked(&s.stats).requests.entry("systemone_batch").or_default() += 1;
    respond(&s, body, true).await
}

async fn respond(s: &Arc<EncoderState>, body: Result<Bytes, BytesRejection>, batch: bool) -> Response {
    let t0 = Instant::now();
    let r = answer(s, body, batch).await;
    let secs = t0.elapsed().as_secs_f64();
    match r {
        Ok(v) => {
            {
                let mut st = locked(&s.stats);
                let b = LATENCY_BOUNDS
                    .iter()
                    .position(|&x| secs <= x)
                    .unwrap_or(LATENCY_BOUNDS.len());
                st.latency[b] += 1;
                st.latency_sum += secs;
                st.latency_count += 1;
            }
            let ms = secs * 1e3;
            let mut r = Json(v).into_response();
            let h = r.headers_mut();
            if let Ok(v) = HeaderValue::from_str(&format!("inference;dur={ms:.1}")) {
                h.insert("server-timing", v);
            }
            if let Ok(v) = HeaderValue::from_str(&format!("{ms:.1}")) {
                h.insert("x-inference-time-ms", v);
            }
            r
        }
        Err(e) => laya_error(s.count_error(e)),
    }
}

async fn answer(s: &Arc<EncoderState>, body: Result<Bytes, BytesRejection>, batch: bool) -> Result<Value, ApiError> {
    let body = body.map_err(rejected_body)?;
    let v: Value = super::api::parse(&body)?;
    let Some(obj) = v.as_object().filter(|o| o.contains_key("questions")) else {
        return Err(ApiError::bad(
            "request body must be an object with a 'questions' field",
            None,
        ));
    };
    let states: Vec<Value> = if batch {
        match obj.get("states") {
            Some(Value::Array(a)) if !a.is_empty() && a.len() <= MAX_BATCH_STATES && a.iter().all(|x| !x.is_null()) => {
                a.clone()
            }
            _ => {
                return Err(ApiError::bad(
                    format!("'states' must be a list of 1 to {MAX_BATCH_STATES} states"),
                    Some("states"),
                ))
            }
        }
    } else {
        Vec::new()
    };
    let mut checked = v.clone();
    if batch {
        checked["state"] = states[0].clone();
    }
    let req = parse_request(&checked).map_err(|e| match e {
        DecideError::Invalid(m) if m == "'state' is required" => ApiError::bad(m, Some("state")),
        e => status(422, e.to_string(), None),
    })?;
    let states = if batch { states } else { vec![req.state.clone()] };
    let (reply, rx) = tokio::sync::oneshot::channel();
    s.enqueue(Job::Decide { req, states, reply })?;
    let results = match rx.await {
        Ok(Ok(r)) => r,
        Ok(Err(e @ DecideError::Capacity(_))) => {
            return Err(status(422, e.to_string(), Some("context_length_exceeded")))
        }
        Ok(Err(e @ DecideError::Invalid(_))) => return Err(status(422, e.to_string(), None)),
        Ok(Err(e)) => return Err(status(500, e.to_string(), None)),
        Err(_) => return Err(status(503, "the server is shutting down".into(), None)),
    };
    if !batch {
        return Ok(results.into_iter().next().unwrap_or(Value::Null));
    }
    let total: u64 = results
        .iter()
        .map(|r| r["usage"]["input_tokens"].as_u64().unwrap_or(0))
        .sum();
    Ok(json!({"results": results, "total_usage": {"input_tokens": total, "output_tokens": 0}}))
}

async fn health(State(s): State<Arc<EncoderState>>) -> Response {
    let draining = s.draining.load(Ordering::SeqCst);
    let mut body = json!({
        "status": if draining { "draining" } else { "ok" },
        "loaded": true,
        "model": s.model_id,
        "waiting": s.waiting.load(Ordering::SeqCst),
    });
    if let Value::Object(facts) = s.meta() {
        body.as_object_mut().expect("object").extend(facts);
    }
    let code = if draining {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (code, Json(body)).into_response()
}

impl EncoderState {
    /// The checkpoint's facts for `/v1/models` and `/health`.
    fn meta(&self) -> Value {
        match &self.kind {
            Kind::Laya { max_len, head_max_len } => {
                json!({"kind": "laya", "max_len": max_len, "head_max_len": head_max_len})
            }
            Kind::Sentence(m) => json!({
                "kind": "sentence_embeddings",
                "dimensions": m.dim(),
                "max_input_tokens": m.max_tokens,
                "pooling": m.pooling.name(),
                "normalized": m.normalize,
            }),
        }
    }
}

async fn models(State(s): State<Arc<EncoderState>>) -> Json<Value> {
    *locked(&s.stats).requests.entry("models").or_default() += 1;
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.model_id,
            "object": "model",
            "created": s.started,
            "owned_by": "snug",
            "meta": s.meta(),
        }],
    }))
}

async fn metrics(State(s): State<Arc<EncoderState>>) -> Response {
    use std::fmt::Write;
    let st = locked(&s.stats);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# HELP snug_requests_total Requests by route.\n# TYPE snug_requests_total counter"
    );
    for (route, n) in &st.requests {
        let _ = writeln!(o, "snug_requests_total{{route=\"{route}\"}} {n}");
    }
    let _ = writeln!(
        o,
        "# HELP snug_errors_total Error responses by status.\n# TYPE snug_errors_total counter"
    );
    for (code, n) in &st.errors {
        let _ = writeln!(o, "snug_errors_total{{status=\"{code}\"}} {n}");
    }
    // A decision checkpoint's counters are `snug_decide_*`; an embedding
    // model's are `snug_embedding_*` (its rows are inputs).
    let (p, rows_help) = match s.kind {
        Kind::Laya { .. } => ("decide", "Encoder rows run (questions times states)."),
        Kind::Sentence(_) => ("embedding", "Inputs embedded."),
    };
    let mut counters = vec![
        (
            format!("snug_{p}_{}_total", if p == "decide" { "rows" } else { "inputs" }),
            rows_help,
            st.rows as f64,
        ),
        (
            format!("snug_{p}_input_tokens_total"),
            "Encoder tokens run.",
            st.input_tokens as f64,
        ),
        (
            format!("snug_{p}_forwards_total"),
            "Batched forwards.",
            st.forwards as f64,
        ),
        (
            format!("snug_{p}_forward_seconds_total"),
            "Time in forwards.",
            st.forward_seconds,
        ),
    ];
    if p == "decide" {
        counters.insert(
            0,
            (
                "snug_decide_questions_total".into(),
                "Questions answered.",
                st.questions as f64,
            ),
        );
    }
    for (name, help, v) in counters {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    }
    let _ = writeln!(
        o,
        "# HELP snug_{p}_waiting Requests waiting for the encoder.\n# TYPE snug_{p}_waiting gauge\nsnug_{p}_waiting {}",
        s.waiting.load(Ordering::SeqCst)
    );
    let _ = writeln!(
        o,
        "# HELP snug_request_duration_seconds Request latency.\n# TYPE snug_request_duration_seconds histogram"
    );
    let mut cum = 0;
    for (i, b) in LATENCY_BOUNDS.iter().enumerate() {
        cum += st.latency[i];
        let _ = writeln!(o, "snug_request_duration_seconds_bucket{{le=\"{b}\"}} {cum}");
    }
    cum += st.latency[LATENCY_BOUNDS.len()];
    let _ = writeln!(o, "snug_request_duration_seconds_bucket{{le=\"+Inf\"}} {cum}");
    let _ = writeln!(o, "snug_request_duration_seconds_sum {}", st.latency_sum);
    let _ = writeln!(o, "snug_request_duration_seconds_count {}", st.latency_count);
    let _ = writeln!(
        o,
        "# HELP snug_weights_bytes Mapped checkpoint bytes.\n# TYPE snug_weights_bytes gauge\nsnug_weights_bytes {}",
        s.weight_bytes
    );
    let _ = writeln!(
        o,
        "# HELP snug_{p}_scratch_bytes Activation bytes of the largest encoder pass.\n# TYPE snug_{p}_scratch_bytes gauge\nsnug_{p}_scratch_bytes {}",
        s.scratch_bytes
    );
    let rss = crate::run::rss_bytes("VmRSS:");
    {
        let _ = writeln!(
            o,
            "# HELP snug_process_resident_bytes Resident memory.\n# TYPE snug_process_resident_bytes gauge\nsnug_process_resident_bytes {rss}"
        );
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], o).into_response()
}
