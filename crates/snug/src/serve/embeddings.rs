//! Embeddings from the served decoder: OpenAI's `POST /v1/embeddings` and
//! ollama's `POST /api/embed`. An input's embedding is the mean of its
//! tokens' last hidden states (after the output norm, what the output
//! head reads), scaled to unit length ([`snug_engine::Engine::embed`]).
//! The engine loop computes them between two steps, as it answers
//! decisions.
//!
//! The same routes serve a sentence-embedding checkpoint
//! ([`super::encoder`]): the handlers are written once over [`Embedder`],
//! which the decoder's state and the encoder's both implement.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use snug_model::EncodeOptions;

use super::api::{self, ApiError};
use super::routes::{body_bytes, unavailable};
use super::worker::{EmbedJob, Msg};
use super::{locked, AppState, Conn, Usage};

pub(super) fn routes<S: Embedder>() -> Router<Arc<S>> {
    Router::new()
        .route("/v1/embeddings", post(embeddings::<S>))
        .route("/api/embed", post(ollama_embed::<S>))
}

/// Most inputs in one request (OpenAI's limit).
pub(super) const MAX_INPUTS: usize = 2048;

/// A server state that makes embeddings.
pub(super) trait Embedder: Send + Sync + 'static {
    fn model_id(&self) -> &str;
    /// The vectors' length.
    fn dim(&self) -> usize;
    /// Counts a request to `route` for /metrics.
    fn count_request(&self, route: &'static str);
    /// Counts a refused request for /metrics and hands the error back.
    fn refuse(&self, e: ApiError) -> ApiError;
    /// The request body, or the error for one that could not be read.
    fn body(&self, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError>;
    /// `input` checked and embedded, counted for the access log: the
    /// vectors and the tokens they took.
    fn embed_input(
        &self,
        conn: &Conn,
        input: Input,
    ) -> impl std::future::Future<Output = Result<(Vec<Vec<f32>>, usize), ApiError>> + Send;
}

/// Token ids from a request, checked against a vocabulary of `vocab`.
pub(super) fn token_ids(v: Vec<i64>, vocab: usize) -> Result<Vec<u32>, ApiError> {
    v.into_iter()
        .map(|t| {
            u32::try_from(t)
                .ok()
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| bad(format!("token id {t} is outside the vocabulary of {vocab}"), "input"))
        })
        .collect()
}

/// `input`: a text, texts, token ids, or lists of token ids.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub(super) enum Input {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

#[derive(Deserialize, Debug)]
pub(super) struct EmbeddingsRequest {
    pub(super) input: Input,
    pub(super) model: Option<String>,
    pub(super) encoding_format: Option<String>,
    pub(super) dimensions: Option<i64>,
    pub(super) user: Option<String>,
    #[serde(flatten)]
    pub(super) rest: serde_json::Map<String, Value>,
}

fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad(message, Some(param))
}

impl AppState {
    /// Each input's tokens, checked against the vocabulary and context.
    fn embedding_inputs(&self, input: Input) -> Result<Vec<Vec<u32>>, ApiError> {
        let text = |t: &str| {
            self.tok.encode(
                t,
                EncodeOptions {
                    add_special: true,
                    parse_special: false,
                },
            )
        };
        let ids = |v: Vec<i64>| token_ids(v, self.vocab);
        let inputs: Vec<Vec<u32>> = match input {
            Input::Text(t) => vec![text(&t)],
            Input::Texts(v) => v.iter().map(|t| text(t)).collect(),
            Input::Tokens(v) => vec![ids(v)?],
            Input::TokenLists(v) => v.into_iter().map(ids).collect::<Result<_, _>>()?,
        };
        if inputs.is_empty() || inputs.len() > MAX_INPUTS {
            return Err(bad(format!("input takes 1 to {MAX_INPUTS} items"), "input"));
        }
        for (i, t) in inputs.iter().enumerate() {
            if t.is_empty() {
                return Err(bad(format!("input {i} is empty"), "input"));
            }
            if t.len() > self.ctx {
                return Err(ApiError {
                    code: Some("context_length_exceeded"),
                    ..bad(
                        format!("input {i} has {} tokens, over the context of {}", t.len(), self.ctx),
                        "input",
                    )
                });
            }
        }
        Ok(inputs)
    }

    /// Runs the inputs through the engine loop.
    async fn embed(&self, inputs: Vec<Vec<u32>>) -> Result<Vec<Vec<f32>>, ApiError> {
        if self.draining.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(unavailable("the server is shutting down", 5));
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        if locked(&self.jobs).send(Msg::Embed(EmbedJob { inputs, reply })).is_err() {
            return Err(unavailable("the engine has stopped", 5));
        }
        match answer.await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(snug_engine::EngineError::Pages(e))) => {
                Err(unavailable(&format!("no KV room for the input now: {e}"), 1))
            }
            Ok(Err(e)) => Err(ApiError::internal(e.to_string())),
            Err(_) => Err(unavailable("the engine has stopped", 5)),
        }
    }
}

impl Embedder for AppState {
    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn dim(&self) -> usize {
        self.facts.embedding_length
    }

    fn count_request(&self, route: &'static str) {
        locked(&self.metrics).request(route);
    }

    fn refuse(&self, e: ApiError) -> ApiError {
        self.bad(e)
    }

    fn body(&self, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
        body_bytes(body, self)
    }

    /// `input` checked, run through the engine loop and counted for the
    /// access log.
    async fn embed_input(&self, conn: &Conn, input: Input) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
        let inputs = self.embedding_inputs(input).map_err(|e| self.bad(e))?;
        let tokens: usize = inputs.iter().map(Vec::len).sum();
        let vectors = self.embed(inputs).await?;
        conn.record(Usage {
            prompt: tokens,
            completion: 0,
            cached: 0,
        });
        Ok((vectors, tokens))
    }
}

/// An embedding as OpenAI's `base64` format carries it: the floats'
/// little-endian bytes.
fn base64(v: &[f32]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(ABC[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

async fn embeddings<S: Embedder>(
    State(s): State<Arc<S>>,
    ConnectInfo(conn): ConnectInfo<Conn>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    s.count_request("embeddings");
    match embeddings_inner(&s, &conn, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn embeddings_inner<S: Embedder>(
    s: &Arc<S>,
    conn: &Conn,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = s.body(body)?;
    let req: EmbeddingsRequest = api::parse(&body).map_err(|e| s.refuse(e))?;
    if let Some(name) = req.rest.keys().next() {
        return Err(s.refuse(ApiError::bad(format!("unknown or unsupported field {name:?}"), None)));
    }
    let base64_out = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(s.refuse(bad(
                format!("encoding_format must be float or base64; got {other:?}"),
                "encoding_format",
            )))
        }
    };
    let dim = s.dim();
    if let Some(d) = req.dimensions.filter(|&d| d as usize != dim) {
        return Err(s.refuse(bad(
            format!("this model's embeddings have {dim} dimensions; dimensions {d} is not offered"),
            "dimensions",
        )));
    }
    let _ = (&req.model, &req.user);
    let (vectors, tokens) = s.embed_input(conn, req.input).await?;
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let e = if base64_out { Value::from(base64(v)) } else { json!(v) };
            json!({"object": "embedding", "index": i, "embedding": e})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": s.model_id(),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}

/// ollama's `/api/embed`: `input` a text or texts; `{"embeddings": [...]}`.
#[derive(Deserialize)]
struct OllamaEmbed {
    #[allow(dead_code)]
    model: Option<String>,
    input: Input,
    truncate: Option<bool>,
    options: Option<Value>,
    keep_alive: Option<Value>,
}

async fn ollama_embed<S: Embedder>(
    State(s): State<Arc<S>>,
    ConnectInfo(conn): ConnectInfo<Conn>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    s.count_request("ollama_embed");
    let r: Result<Response, ApiError> = async {
        let body = s.body(body)?;
        let req: OllamaEmbed = api::parse(&body).map_err(|e| s.refuse(e))?;
        // Inputs over the context are refused, whatever `truncate` says:
        // a cut input's embedding would not be the text's.
        let _ = (&req.options, &req.keep_alive, req.truncate);
        let started = std::time::Instant::now();
        let (vectors, tokens) = s.embed_input(&conn, req.input).await?;
        Ok(Json(json!({
            "model": s.model_id(),
            "embeddings": vectors,
            "total_duration": started.elapsed().as_nanos() as u64,
            "prompt_eval_count": tokens,
        }))
        .into_response())
    }
    .await;
    r.unwrap_or_else(|e| {
        // ollama's error shape.
        let status = axum::http::StatusCode::from_u16(e.status).unwrap_or(axum::http::StatusCode::BAD_REQUEST);
        (status, Json(json!({"error": e.message}))).into_response()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_the_floats_little_endian_bytes() {
        // 1.0f32 = 00 00 80 3f; two floats: 8 bytes, 12 characters.
        assert_eq!(base64(&[1.0]), "AACAPw==");
        assert_eq!(base64(&[1.0, -2.0]), "AACAPwAAAMA=");
        assert_eq!(base64(&[]), "");
    }
}
