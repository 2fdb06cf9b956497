//! `snug serve DIR` for a Laya checkpoint directory: Laya's
//! `/v1/systemone` and `/v1/systemone/batch` on the native encoder, with
//! `/health`, `/v1/models` and `/metrics`.
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

use super::api::ApiError;
use super::{key_ok, locked, shutdown_signal, unauthorized, unix_now, ServeArgs};

/// Most rows (questions times states) one forward takes from the queue.
pub const MAX_BATCH_ROWS: usize = 64;
/// Most states in one batch request.
const MAX_BATCH_STATES: usize = 64;

type Reply = tokio::sync::oneshot::Sender<Result<Vec<Value>, DecideError>>;

struct Job {
    req: LayaRequest,
    states: Vec<Value>,
    reply: Reply,
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

struct LayaState {
    jobs: Mutex<mpsc::Sender<Job>>,
    model_id: String,
    api_key: Option<String>,
    started: u64,
    max_len: usize,
    head_max_len: usize,
    weight_bytes: usize,
    /// Activation bytes of the largest pass.
    scratch_bytes: usize,
    waiting: AtomicUsize,
    max_queue: usize,
    stats: Arc<Mutex<Stats>>,
    draining: AtomicBool,
}

impl LayaState {
    fn count_error(&self, e: ApiError) -> ApiError {
        *locked(&self.stats).errors.entry(e.status).or_default() += 1;
        e
    }
}

/// Serves the checkpoint in `dir` on `listener` until SIGINT or SIGTERM.
pub fn serve(a: &ServeArgs, dir: &Path, listener: TcpListener, max_body: usize) -> Result<()> {
    let agent = crate::decide::laya_agent(dir, a.threads, None)?;
    let stats = Arc::new(Mutex::new(Stats {
        latency: vec![0; LATENCY_BOUNDS.len() + 1],
        ..Stats::default()
    }));
    let (tx, rx) = mpsc::channel::<Job>();
    let state = Arc::new(LayaState {
        jobs: Mutex::new(tx),
        model_id: a.alias.clone().unwrap_or_else(|| a.model.clone()),
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        started: unix_now(),
        max_len: agent.model.config.max_len,
        head_max_len: agent.model.config.head_max_len,
        weight_bytes: agent.model.weight_bytes(),
        scratch_bytes: agent
            .model
            .scratch_bytes(agent.model.forward_tokens().max(agent.model.config.max_len)),
        waiting: AtomicUsize::new(0),
        max_queue: a.max_queue,
        stats: stats.clone(),
        draining: AtomicBool::new(false),
    });
    let worker = {
        let state = state.clone();
        std::thread::Builder::new()
            .name("snug-laya".into())
            .spawn(move || work(agent, rx, &state))?
    };
    let app = Router::new()
        .route("/v1/systemone", post(systemone))
        .route("/v1/systemone/batch", post(systemone_batch))
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
        eprintln!(
            "snug serve: Laya checkpoint {} on http://{} (max_len {}, head_max_len {}; {} MiB of weights mapped, at most {} MiB of activations a pass)",
            http_state.model_id,
            axum::serve::Listener::local_addr(&listener)?,
            http_state.max_len,
            http_state.head_max_len,
            http_state.weight_bytes >> 20,
            http_state.scratch_bytes >> 20
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
fn work(agent: LayaAgent, rx: mpsc::Receiver<Job>, state: &LayaState) {
    while let Ok(first) = rx.recv() {
        let rows_of = |j: &Job| j.req.questions.len() * j.states.len();
        let mut rows = rows_of(&first);
        let mut batch = vec![first];
        while rows < MAX_BATCH_ROWS {
            match rx.try_recv() {
                Ok(j) => {
                    rows += rows_of(&j);
                    batch.push(j);
                }
                Err(_) => break,
            }
        }
        state.waiting.fetch_sub(batch.len(), Ordering::SeqCst);
        let t0 = Instant::now();
        let work: Vec<(&LayaRequest, &[Value])> = batch.iter().map(|j| (&j.req, j.states.as_slice())).collect();
        let results = agent.answer_jobs(&work);
        let secs = t0.elapsed().as_secs_f64();
        {
            let mut st = locked(&state.stats);
            st.forwards += 1;
            st.forward_seconds += secs;
            st.rows += rows as u64;
        }
        for (job, result) in batch.into_iter().zip(results) {
            let result = result.map(|r| {
                let mut st = locked(&state.stats);
                for (v, answers) in &r {
                    st.questions += answers.len() as u64;
                    st.input_tokens += v["usage"]["input_tokens"].as_u64().unwrap_or(0);
                }
                r.into_iter().map(|(v, _)| v).collect()
            });
            let _ = job.reply.send(result);
        }
    }
}

async fn authorize(State(s): State<Arc<LayaState>>, req: Request, next: Next) -> Response {
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

async fn systemone(State(s): State<Arc<LayaState>>, body: Result<Bytes, BytesRejection>) -> Response {
    *locked(&s.stats).requests.entry("systemone").or_default() += 1;
    respond(&s, body, false).await
}

async fn systemone_batch(State(s): State<Arc<LayaState>>, body: Result<Bytes, BytesRejection>) -> Response {
    *locked(&s.stats).requests.entry("systemone_batch").or_default() += 1;
    respond(&s, body, true).await
}

async fn respond(s: &Arc<LayaState>, body: Result<Bytes, BytesRejection>, batch: bool) -> Response {
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

async fn answer(s: &Arc<LayaState>, body: Result<Bytes, BytesRejection>, batch: bool) -> Result<Value, ApiError> {
    let body = body.map_err(|e| {
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
    })?;
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
    if s.draining.load(Ordering::SeqCst) {
        return Err(status(503, "the server is shutting down".into(), None));
    }
    if s.waiting.fetch_add(1, Ordering::SeqCst) >= s.max_queue {
        s.waiting.fetch_sub(1, Ordering::SeqCst);
        return Err(ApiError {
            retry_after: Some(1),
            ..status(503, "server busy, try again later".into(), None)
        });
    }
    let (reply, rx) = tokio::sync::oneshot::channel();
    if locked(&s.jobs).send(Job { req, states, reply }).is_err() {
        s.waiting.fetch_sub(1, Ordering::SeqCst);
        return Err(status(503, "the server is shutting down".into(), None));
    }
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

async fn health(State(s): State<Arc<LayaState>>) -> Response {
    let draining = s.draining.load(Ordering::SeqCst);
    let body = json!({
        "status": if draining { "draining" } else { "ok" },
        "loaded": true,
        "model": s.model_id,
        "max_len": s.max_len,
        "head_max_len": s.head_max_len,
        "waiting": s.waiting.load(Ordering::SeqCst),
    });
    let code = if draining {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (code, Json(body)).into_response()
}

async fn models(State(s): State<Arc<LayaState>>) -> Json<Value> {
    *locked(&s.stats).requests.entry("models").or_default() += 1;
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.model_id,
            "object": "model",
            "created": s.started,
            "owned_by": "snug",
            "meta": {"kind": "laya", "max_len": s.max_len, "head_max_len": s.head_max_len},
        }],
    }))
}

async fn metrics(State(s): State<Arc<LayaState>>) -> Response {
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
    let counters = [
        (
            "snug_decide_questions_total",
            "Questions answered.",
            st.questions as f64,
        ),
        (
            "snug_decide_rows_total",
            "Encoder rows run (questions times states).",
            st.rows as f64,
        ),
        (
            "snug_decide_input_tokens_total",
            "Encoder tokens run.",
            st.input_tokens as f64,
        ),
        ("snug_decide_forwards_total", "Batched forwards.", st.forwards as f64),
        (
            "snug_decide_forward_seconds_total",
            "Time in forwards.",
            st.forward_seconds,
        ),
    ];
    for (name, help, v) in counters {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    }
    let _ = writeln!(
        o,
        "# HELP snug_decide_waiting Requests waiting for the encoder.\n# TYPE snug_decide_waiting gauge\nsnug_decide_waiting {}",
        s.waiting.load(Ordering::SeqCst)
    );
    let _ = writeln!(
        o,
        "# HELP snug_request_duration_seconds Decision request latency.\n# TYPE snug_request_duration_seconds histogram"
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
        "# HELP snug_decide_scratch_bytes Activation bytes of the largest encoder pass.\n# TYPE snug_decide_scratch_bytes gauge\nsnug_decide_scratch_bytes {}",
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
