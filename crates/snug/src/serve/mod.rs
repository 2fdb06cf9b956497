//! `snug serve`: an OpenAI-compatible HTTP server over one model.
//!
//! The HTTP side (axum on a small tokio runtime) parses and checks
//! requests, renders chat templates and tokenizes, then hands each
//! generation to the engine loop ([`worker`]) as a job and relays its
//! events: as server-sent events when streaming, as one JSON body when
//! not. The engine loop owns the model and all KV state; the scheduler
//! inside it admits, queues or refuses (503) each job under the KV budget.

pub mod anthropic;
mod anthropic_wire;
pub mod api;
mod args;
mod auth;
mod completions;
mod conn;
mod decisions;
mod embeddings;
pub mod encoder;
pub mod kv_events;
pub mod metrics;
mod ollama;
mod ollama_wire;
mod responses;
mod responses_wire;
mod routes;
mod start;
mod structured;
mod systemone;
mod tools;
mod ui;
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
use snug_engine::grammar::{Constraint, GrammarError, Grammars};
use snug_engine::{Engine, EngineOptions};
use snug_model::template::{ChatTemplate, Message};
use snug_model::{EncodeOptions, ModelFiles, Tokenizer};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use api::{ApiError, ChatRequest, CompletionRequest, Prompt, Settings};
use metrics::Metrics;
use structured::Structured;
use worker::{DecideJob, Event, Job, Msg};

pub use args::ServeArgs;
use auth::authorize;
pub(crate) use auth::{key_ok, unauthorized};
use conn::{AccessLog, Conn, TimedListener, Usage};
use routes::router;
pub use start::cmd_serve;
pub(crate) use start::shutdown_signal;

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
    /// What ollama's `/api/tags` and `/api/show` report.
    facts: ollama::Facts,
    /// Grammar compiler for the model's vocabulary, built when the first
    /// request with a grammar comes.
    grammars: std::sync::OnceLock<std::result::Result<Grammars, String>>,
    /// The web page's conversation folder (`None`: no page).
    chats_dir: Option<PathBuf>,
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
