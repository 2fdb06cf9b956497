//! `snug serve`: an OpenAI-compatible HTTP server over one model.
//!
//! The HTTP side (axum on a small tokio runtime) parses and checks
//! requests, renders chat templates and tokenizes, then hands each
//! generation to the engine loop ([`worker`]) as a job and relays its
//! events: as server-sent events when streaming, as one JSON body when
//! not. The engine loop owns the model and all KV state; the scheduler
//! inside it admits, queues or refuses (503) each job under the KV budget.

pub mod api;
pub mod laya;
pub mod metrics;
pub mod worker;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use axum::body::Bytes;
use axum::extract::connect_info::Connected;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::IncomingStream;
use axum::{Json, Router};
use clap::Args;
use serde_json::{json, Value};
use snug_core::schedule::{Refused, ScheduleConfig};
use snug_engine::{Engine, EngineOptions};
use snug_model::template::{ChatTemplate, Message};
use snug_model::{EncodeOptions, GgufFile, Tokenizer};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use api::{ApiError, ChatRequest, CompletionRequest, Prompt, Settings};
use metrics::Metrics;
use worker::{DecideJob, Event, Job, Msg};

#[derive(Args)]
pub struct ServeArgs {
    /// A model alias (pulled if needed) or a path to a GGUF file.
    #[arg(default_value = snug_model::catalog::DEFAULT_ALIAS)]
    model: String,
    /// Address to listen on. Anything but a loopback address needs
    /// --api-key.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Clients must send `Authorization: Bearer KEY` (every route but
    /// /health). Also read from SNUG_API_KEY.
    #[arg(long, env = "SNUG_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Bytes the KV cache may take for all requests together (e.g.
    /// 512MiB). Requests are admitted only with room for their prompt and
    /// guaranteed output inside it. [default: --parallel contexts of
    /// --ctx]
    #[arg(long, value_name = "SIZE")]
    memory_budget: Option<String>,
    /// Requests that may wait for admission; more get 503.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 8)]
    parallel: usize,
    /// Output tokens every admitted request is sure to have room for
    /// (reserved with its prompt); past it, a request grows into free
    /// pages.
    #[arg(long, default_value_t = 256)]
    guaranteed_output: usize,
    /// Prompt tokens per prefill chunk.
    #[arg(long, default_value_t = 128)]
    prefill_chunk: usize,
    /// Decode steps between two prefill chunks while requests decode.
    #[arg(long, default_value_t = 2)]
    decode_steps: usize,
    /// Context length per request (default: the model's, at most 4096).
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    #[arg(short = 't', long)]
    threads: Option<usize>,
    #[command(flatten)]
    cache: crate::KvArgs,
    /// Speculative decoding (for a request running alone): on, off or
    /// auto. The output is the same either way.
    #[arg(long, default_value = "auto")]
    speculate: String,
    /// Largest request body in bytes (e.g. 4MiB).
    #[arg(long, value_name = "SIZE", default_value = "4MiB")]
    max_body: String,
    /// Append one JSON line per finished request (tokens, TTFT, per-token
    /// latency percentiles, speculation, peak KV pages) to this file.
    #[arg(long, value_name = "PATH")]
    metrics_file: Option<PathBuf>,
    /// The model's name in /v1/models and responses [default: the model
    /// argument].
    #[arg(long)]
    alias: Option<String>,
    /// Keep full KV pages of earlier prompts here too (the prefix cache's
    /// disk tier).
    #[arg(long, value_name = "DIR")]
    prefix_cache_dir: Option<PathBuf>,
    #[arg(long, value_name = "SIZE", default_value = "2GiB")]
    prefix_cache_size: String,
    /// Do not share cached KV pages between requests.
    #[arg(long, conflicts_with = "prefix_cache_dir")]
    no_prefix_cache: bool,
    /// Give the output head's resident pages back to the system while
    /// only prompt chunks that need no logits run (they fault back in
    /// when logits are next wanted). Lowers resident memory during long
    /// prefills, at the cost of re-reading the head; see docs/SERVER.md.
    #[arg(long)]
    lease_head: bool,
}

/// What handlers share.
struct AppState {
    jobs: Mutex<mpsc::Sender<Msg>>,
    tok: Tokenizer,
    template: ChatTemplate,
    bos: String,
    eos: String,
    model_id: String,
    ctx: usize,
    vocab: usize,
    metrics: Arc<Mutex<Metrics>>,
    api_key: Option<String>,
    next_id: AtomicU64,
    started: u64,
    draining: AtomicBool,
}

/// A request's connection, to notice a client that hangs up while its
/// answer is being generated: HTTP/1 does not read the socket then, so
/// nothing else would tell.
#[derive(Clone, Copy, Debug)]
struct Conn {
    fd: std::os::fd::RawFd,
}

impl Connected<IncomingStream<'_, tokio::net::TcpListener>> for Conn {
    fn connect_info(stream: IncomingStream<'_, tokio::net::TcpListener>) -> Conn {
        use std::os::fd::AsRawFd;
        Conn {
            fd: stream.io().as_raw_fd(),
        }
    }
}

impl Conn {
    /// Whether the peer has closed or reset the connection. (The socket
    /// stays open while its request is handled, so the descriptor is this
    /// connection's.)
    fn hung_up(self) -> bool {
        let mut p = libc::pollfd {
            fd: self.fd,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no timeout; poll only reads the
        // socket's state.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}

/// The value behind a lock, even if a thread panicked while holding it:
/// the counters and the job sender stay usable, and one failure does not
/// turn every later request into a panic.
pub(crate) fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

pub fn cmd_serve(a: ServeArgs) -> Result<()> {
    if !is_loopback(&a.host) && a.api_key.as_deref().is_none_or(str::is_empty) {
        bail!(
            "--host {} is not a loopback address: set --api-key (or SNUG_API_KEY) so that only clients with the key are served",
            a.host
        );
    }
    let speculate = snug_core::speculate::Mode::parse(&a.speculate)
        .with_context(|| format!("unknown --speculate {:?} (on, off or auto)", a.speculate))?;
    let max_body = crate::parse_size(&a.max_body)?;
    if a.parallel == 0 || a.prefill_chunk == 0 {
        bail!("--parallel and --prefill-chunk must be at least 1");
    }
    let laya_dir = snug_model::laya::is_checkpoint(std::path::Path::new(&a.model));
    let opened = if laya_dir {
        None
    } else {
        Some(crate::open_model_at(&a.model)?)
    };
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .or_else(|_| {
            std::net::ToSocketAddrs::to_socket_addrs(&(a.host.as_str(), a.port))
                .map_err(anyhow::Error::from)
                .and_then(|mut it| it.next().context("no address"))
        })
        .with_context(|| format!("--host {}: not an address", a.host))?;
    // Bind first: a port in use is a clear error before the model loads.
    let std_listener = std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    std_listener.set_nonblocking(true)?;
    let Some((path, file)) = opened else {
        return laya::serve(&a, std::path::Path::new(&a.model), std_listener, max_body);
    };

    let tok = Tokenizer::from_gguf(&file)?;
    let template = ChatTemplate::for_model(file.get_str("tokenizer.chat_template"))?;
    let bos = tok.bos.and_then(|b| tok.token_text(b)).unwrap_or("").to_string();
    let eos = tok.eos.and_then(|e| tok.token_text(e)).unwrap_or("").to_string();
    let model_id = a.alias.clone().unwrap_or_else(|| a.model.clone());

    let (tx, rx) = mpsc::channel::<Msg>();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(usize, usize, Arc<Mutex<Metrics>>)>>();
    let engine_thread = {
        let a = EngineArgs::from(&a);
        let path = path.clone();
        std::thread::Builder::new()
            .name("snug-engine".into())
            .spawn(move || engine_main(a, path, file, speculate, rx, ready_tx))?
    };
    let (ctx, vocab, metrics) = match ready_rx.recv() {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Err(e),
        Err(_) => bail!("the engine stopped while starting"),
    };
    let state = Arc::new(AppState {
        jobs: Mutex::new(tx),
        tok,
        template,
        bos,
        eos,
        model_id,
        ctx,
        vocab,
        metrics,
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        next_id: AtomicU64::new(1),
        started: unix_now(),
        draining: AtomicBool::new(false),
    });
    let app = router(state.clone(), max_body);
    let http_state = state.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    rt.block_on(async move {
        let state = http_state;
        let listener = tokio::net::TcpListener::from_std(std_listener)?;
        let tokens = {
            let m = locked(&state.metrics);
            m.kv_pages_total * m.kv_page_tokens
        };
        eprintln!(
            "snug serve: {} on http://{} (context {}, the KV budget holds {} tokens)",
            state.model_id,
            listener.local_addr()?,
            state.ctx,
            tokens
        );
        let shutdown_state = state.clone();
        axum::serve(listener, app.into_make_service_with_connect_info::<Conn>())
            .with_graceful_shutdown(async move {
                shutdown_signal().await;
                shutdown_state.draining.store(true, Ordering::SeqCst);
                eprintln!("snug serve: draining (finishing running requests)");
            })
            .await?;
        anyhow::Ok(())
    })?;
    // Every connection is closed: let the engine finish and stop.
    let _ = locked(&state.jobs).send(Msg::Drain);
    let _ = engine_thread.join();
    eprintln!("snug serve: stopped");
    Ok(())
}

pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// The flags the engine thread needs (the rest stay with HTTP).
struct EngineArgs {
    gen: crate::GenArgs,
    budget: Option<String>,
    parallel: usize,
    max_queue: usize,
    guaranteed_output: usize,
    prefill_chunk: usize,
    decode_steps: usize,
    metrics_file: Option<PathBuf>,
    model: String,
    lease_head: bool,
}

impl From<&ServeArgs> for EngineArgs {
    fn from(a: &ServeArgs) -> EngineArgs {
        EngineArgs {
            gen: crate::GenArgs {
                max_tokens: 0,
                temperature: None,
                top_k: None,
                top_p: None,
                min_p: None,
                repeat_penalty: None,
                presence_penalty: None,
                seed: None,
                threads: a.threads,
                ctx: a.ctx,
                stop: Vec::new(),
                cache: crate::KvArgs {
                    kv: a.cache.kv.clone(),
                    kv_k: a.cache.kv_k.clone(),
                    kv_v: a.cache.kv_v.clone(),
                    kv_page: a.cache.kv_page,
                    numerics: a.cache.numerics.clone(),
                },
                kv_budget: None,
                speculate: a.speculate.clone(),
                metrics_file: None,
                prefix_cache_dir: a.prefix_cache_dir.clone(),
                prefix_cache_size: a.prefix_cache_size.clone(),
                no_prefix_cache: a.no_prefix_cache,
            },
            budget: a.memory_budget.clone(),
            parallel: a.parallel,
            max_queue: a.max_queue,
            guaranteed_output: a.guaranteed_output,
            prefill_chunk: a.prefill_chunk,
            decode_steps: a.decode_steps,
            metrics_file: a.metrics_file.clone(),
            model: a.model.clone(),
            lease_head: a.lease_head,
        }
    }
}

type Ready = mpsc::Sender<Result<(usize, usize, Arc<Mutex<Metrics>>)>>;

/// The engine thread: loads the model, sizes the engine and the scheduler
/// from the budget, reports ready, then runs the loop.
fn engine_main(
    a: EngineArgs,
    path: PathBuf,
    file: GgufFile,
    speculate: snug_core::speculate::Mode,
    rx: mpsc::Receiver<Msg>,
    ready: Ready,
) {
    let setup = || -> Result<_> {
        let model = crate::load_model(&file, &a.gen.cache)?;
        let tok = Tokenizer::from_gguf(&file)?;
        let mut o: EngineOptions = crate::run::engine_options(&a.gen, &model, &tok, None)?;
        o.max_seqs = a.parallel;
        // One step carries a prefill chunk and every running request's
        // decode row (or one request's verify).
        o.batch = a.prefill_chunk + a.parallel.max(snug_core::speculate::MAX_DRAFT + 1);
        let page = snug_engine::kv_page_bytes(&model, &o);
        if let Some(b) = &a.budget {
            let budget = crate::parse_size(b)?;
            let twins = snug_engine::kv_twin_bytes(&model, &o);
            if budget < page + twins {
                bail!(
                    "--memory-budget {b} holds no KV page: a page takes {} ({} positions in these formats){}",
                    crate::human_bytes(page as u64),
                    o.page_tokens,
                    if twins > 0 {
                        format!(
                            " after the exact window's F16 twin pages, {} for --parallel {}",
                            crate::human_bytes(twins as u64),
                            a.parallel
                        )
                    } else {
                        String::new()
                    }
                );
            }
            o.kv_budget = Some(budget);
        }
        Ok((model, tok, o, page))
    };
    let (model, tok, opts, page) = match setup() {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    // Requests are checked against the context asked for; a prompt the
    // budget cannot hold is the scheduler's refusal (503), not a context
    // error.
    let ctx = opts.ctx.min(model.config.context_length);
    let mut engine = Engine::new(&model, opts);
    if a.gen.prefix_cache_dir.is_some() {
        let identity = crate::session::model_identity(&path, &file, &a.model);
        let r = identity.and_then(|id| crate::run::enable_prefix_disk(&a.gen, &mut engine, Some(&id)));
        if let Err(e) = r {
            let _ = ready.send(Err(e));
            return;
        }
    }
    let speculate = crate::run::speculation_for(speculate, engine.model);
    let mut calibration = (speculate == snug_core::speculate::Mode::Auto)
        .then(|| crate::calibration::load(&path, engine.options.threads, &mut engine));
    let total = engine.kv_pages().total;
    let pt = engine.options.page_tokens;
    let metrics = Arc::new(Mutex::new(Metrics::new(pt, page)));
    locked(&metrics).kv_pages_total = total as u64;
    let template = match ChatTemplate::for_model(file.get_str("tokenizer.chat_template")) {
        Ok(t) => t,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return;
        }
    };
    let framing = match snug_engine::decide::Framing::new(Some(&template), &tok) {
        Ok(f) => f,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return;
        }
    };
    let temperatures = match crate::decide::load_temperatures(&path, None) {
        Ok(t) => t,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let cfg = worker::LoopConfig {
        schedule: ScheduleConfig {
            pages: total,
            page_tokens: pt,
            guaranteed_output: a.guaranteed_output,
            max_queue: a.max_queue,
            max_running: a.parallel,
            prefill_chunk: a.prefill_chunk,
            decode_steps: a.decode_steps,
        },
        speculate,
        metrics_file: a.metrics_file.clone(),
        framing,
        temperatures,
    };
    let _ = ready.send(Ok((ctx, model.config.vocab, metrics.clone())));
    let head = model.head_bytes();
    let release = || file.release(head);
    let lease: Option<&dyn Fn() -> u64> = if a.lease_head { Some(&release) } else { None };
    worker::run(
        &mut engine,
        &tok,
        cfg,
        rx,
        metrics,
        |e| crate::run::ledger(&file, e, 0),
        lease,
    );
    if let Some(c) = &mut calibration {
        crate::calibration::save(c, &engine);
    }
}

fn router(state: Arc<AppState>, max_body: usize) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/systemone", post(systemone))
        .route("/v1/systemone/batch", post(systemone_batch))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(max_body, api::decompress))
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
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

/// Whether `req` may pass: no key is set, the route is /health, or it
/// sends `Authorization: Bearer KEY` (compared in constant time).
pub(crate) fn key_ok(req: &Request, key: Option<&str>) -> bool {
    let Some(key) = key else { return true };
    if req.uri().path() == "/health" {
        return true;
    }
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()))
}

/// The 401 for a missing or wrong key.
pub(crate) fn unauthorized() -> ApiError {
    ApiError {
        status: 401,
        message: "missing or wrong API key (send Authorization: Bearer KEY)".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("invalid_api_key"),
        retry_after: None,
    }
}

/// Checks the API key on every route but /health.
async fn authorize(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if !key_ok(&req, s.api_key.as_deref()) {
        locked(&s.metrics).rejected("unauthorized");
        return unauthorized().into_response();
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(req: Request) -> ApiError {
    ApiError {
        status: 404,
        message: format!("no route {} {}", req.method(), req.uri().path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
        retry_after: None,
    }
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
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

async fn metrics_text(State(s): State<Arc<AppState>>) -> Response {
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

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    locked(&s.metrics).request("models");
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.model_id,
            "object": "model",
            "created": s.started,
            "owned_by": "snug",
            "meta": {"n_ctx": s.ctx, "n_vocab": s.vocab},
        }],
    }))
}

/// The body, or the limit's 413 as an OpenAI error.
fn body_bytes(body: Result<Bytes, BytesRejection>, s: &AppState) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status().as_u16();
        s.metrics
            .lock()
            .expect("metrics")
            .rejected(if status == 413 { "too_large" } else { "bad_request" });
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
struct Prepared {
    prompt: Vec<u32>,
    settings: Settings,
    max_tokens: usize,
}

impl AppState {
    fn bad(&self, e: ApiError) -> ApiError {
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
    fn prepare(&self, prompt: Vec<u32>, settings: Settings, default_max: Option<usize>) -> Result<Prepared, ApiError> {
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
        })
    }

    fn seed(&self, id: u64) -> u64 {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    /// Hands the job to the engine loop; returns its events once admitted
    /// or queued, or the refusal as a 503.
    async fn submit(&self, id: u64, p: &Prepared) -> Result<UnboundedReceiver<Event>, ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(unavailable("the server is shutting down", 5));
        }
        let (events, mut rx) = unbounded_channel();
        let job = Job {
            id,
            prompt: p.prompt.clone(),
            max_tokens: p.max_tokens,
            params: p.settings.params.clone(),
            stop: p.settings.stop.clone(),
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

fn unavailable(message: &str, retry_after: u64) -> ApiError {
    ApiError {
        status: 503,
        message: message.to_string(),
        kind: "server_error",
        param: None,
        code: Some("server_overloaded"),
        retry_after: Some(retry_after),
    }
}

fn usage(prompt: usize, completion: usize, reused: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": reused},
    })
}

/// Which endpoint a response is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat_completions(
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

async fn chat_inner(s: &Arc<AppState>, conn: Conn, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body_bytes(body, s)?;
    let req: ChatRequest = api::parse(&body).map_err(|e| s.bad(e))?;
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let settings = req.common.settings(s.seed(id)).map_err(|e| s.bad(e))?;
    if req.messages.is_empty() {
        return Err(s.bad(ApiError::bad("messages must not be empty", Some("messages"))));
    }
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
        messages.push(Message::new(role, &m.text().map_err(|e| s.bad(e))?));
    }
    let text = s
        .template
        .render(
            &messages,
            true,
            &s.bos,
            &s.eos,
            std::collections::BTreeMap::<String, String>::new(),
        )
        .map_err(|e| {
            s.bad(ApiError::bad(
                format!("the chat template failed: {e}"),
                Some("messages"),
            ))
        })?;
    let prompt = s.tok.encode(
        &text,
        EncodeOptions {
            add_special: s.bos.is_empty() || !text.starts_with(&s.bos),
            parse_special: true,
        },
    );
    let p = s.prepare(prompt, settings, None).map_err(|e| s.bad(e))?;
    respond(s, conn, id, Kind::Chat, p).await
}

async fn completions(
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

async fn completion_inner(
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

/// Runs a prepared request and answers it, streaming or not.
async fn respond(s: &Arc<AppState>, conn: Conn, id: u64, kind: Kind, p: Prepared) -> Result<Response, ApiError> {
    let mut rx = s.submit(id, &p).await?;
    let created = unix_now();
    let rid = match kind {
        Kind::Chat => format!("chatcmpl-{id}"),
        Kind::Completion => format!("cmpl-{id}"),
    };
    if !p.settings.stream {
        let mut text = String::new();
        let mut check = tokio::time::interval(std::time::Duration::from_millis(100));
        loop {
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                _ = check.tick() => {
                    if conn.hung_up() {
                        // Dropping the receiver cancels the request.
                        return Err(ApiError::bad("the client closed the connection", None));
                    }
                    continue;
                }
            };
            match ev {
                Some(Event::Text(t)) => text.push_str(&t),
                Some(Event::Done(d)) => {
                    let u = usage(d.prompt_tokens, d.completion_tokens, d.reused_tokens);
                    let body = match kind {
                        Kind::Chat => json!({
                            "id": rid, "object": "chat.completion", "created": created, "model": s.model_id,
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                         "logprobs": null, "finish_reason": d.finish_reason.as_str()}],
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
                Some(Event::Failed(e)) => {
                    return Err(ApiError {
                        status: 500,
                        kind: "server_error",
                        ..ApiError::bad(e, None)
                    })
                }
                Some(_) => {}
                None => return Err(unavailable("the engine has stopped", 5)),
            }
        }
    }
    // Streaming: a task turns engine events into SSE chunks; when the
    // client goes away the chunk channel closes, the task ends and drops
    // the engine's receiver, and the engine loop cancels the request.
    let (out, out_rx) = unbounded_channel::<Result<SseEvent, Infallible>>();
    let model = s.model_id.clone();
    let include_usage = p.settings.include_usage;
    tokio::spawn(async move {
        let chunk = |choice: Value| -> Value {
            match kind {
                Kind::Chat => json!({"id": rid, "object": "chat.completion.chunk", "created": created,
                                     "model": model, "choices": [choice]}),
                Kind::Completion => json!({"id": rid, "object": "text_completion", "created": created,
                                           "model": model, "choices": [choice]}),
            }
        };
        let send = |v: Value| out.send(Ok(SseEvent::default().data(v.to_string()))).is_ok();
        if kind == Kind::Chat
            && !send(chunk(json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": null, "finish_reason": null})))
        {
            return;
        }
        while let Some(ev) = rx.recv().await {
            let ok = match ev {
                Event::Text(t) => send(chunk(match kind {
                    Kind::Chat => json!({"index": 0, "delta": {"content": t}, "logprobs": null, "finish_reason": null}),
                    Kind::Completion => json!({"index": 0, "text": t, "logprobs": null, "finish_reason": null}),
                })),
                Event::Done(d) => {
                    let reason = d.finish_reason.as_str();
                    let last = match kind {
                        Kind::Chat => json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason}),
                        Kind::Completion => json!({"index": 0, "text": "", "logprobs": null, "finish_reason": reason}),
                    };
                    send(chunk(last));
                    if include_usage {
                        let mut v = chunk(Value::Null);
                        v["choices"] = json!([]);
                        v["usage"] = usage(d.prompt_tokens, d.completion_tokens, d.reused_tokens);
                        send(v);
                    }
                    let _ = out.send(Ok(SseEvent::default().data("[DONE]")));
                    return;
                }
                Event::Failed(e) => {
                    send(json!({"error": {"message": e, "type": "server_error", "param": null, "code": null}}));
                    return;
                }
                Event::Accepted | Event::Refused(_) => true,
            };
            if !ok {
                return;
            }
        }
    });
    let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(out_rx);
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()).into_response())
}

/// `POST /v1/systemone`: Laya's typed decisions (see docs/DECIDE.md).
async fn systemone(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    locked(&s.metrics).request("systemone");
    laya_errors(systemone_inner(&s, body, false).await)
}

/// `POST /v1/systemone/batch`: the same questions about several states.
async fn systemone_batch(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    locked(&s.metrics).request("systemone_batch");
    laya_errors(systemone_inner(&s, body, true).await)
}

/// An error as the OpenAI object plus Laya's `detail` string.
fn laya_errors(r: Result<Response, ApiError>) -> Response {
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

fn unprocessable(message: String, code: Option<&'static str>) -> ApiError {
    ApiError {
        status: 422,
        code,
        ..ApiError::bad(message, None)
    }
}

/// Most states in one batch request.
const MAX_BATCH_STATES: usize = 64;

async fn systemone_inner(
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
async fn decide_one(
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
