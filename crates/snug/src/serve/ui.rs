//! The web chat page: `GET /` answers one HTML file built into the binary
//! (its script and styles inline: no CDN, no build step), which talks to
//! the server's own routes: `/v1/chat/completions` (streamed), `/metrics`
//! (the gauges) and the conversation store below.
//!
//! Conversations are JSON files in one folder (`--chats-dir`, by default
//! `chats/` in snug's cache), one per conversation, written whole through a
//! temporary file, fsync and rename, so a crash leaves the old or the new
//! version, never a torn one; a restarted server lists them again.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::{Path as UrlPath, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use super::api::{self, ApiError};
use super::routes::body_bytes;
use super::{locked, AppState};

const PAGE: &str = include_str!("ui/chat.html");

/// Most conversations the folder lists (the newest first).
const MAX_LISTED: usize = 500;

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/", get(page))
        .route("/ui/conversations", get(list))
        .route("/ui/conversations/{id}", get(load).put(save).delete(remove))
}

async fn page(State(s): State<Arc<AppState>>) -> Response {
    if s.chats_dir.is_none() {
        return ApiError {
            status: 404,
            code: Some("not_found"),
            ..ApiError::bad("the web page is off (--no-web)", None)
        }
        .into_response();
    }
    locked(&s.metrics).request("ui");
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            // The page runs only its own inline script and talks only to
            // this server.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:",
            ),
        ],
        PAGE,
    )
        .into_response()
}

fn dir(s: &AppState) -> Result<&Path, ApiError> {
    s.chats_dir
        .as_deref()
        .ok_or_else(|| ApiError::bad("the web page is off (--no-web)", None))
}

/// A conversation's file, for an id of 1 to 64 letters, digits, `-`, `_`.
fn file(s: &AppState, id: &str) -> Result<PathBuf, ApiError> {
    let ok = !id.is_empty() && id.len() <= 64 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !ok {
        return Err(ApiError::bad(
            "a conversation id is 1 to 64 letters, digits, '-' or '_'",
            Some("id"),
        ));
    }
    Ok(dir(s)?.join(format!("{id}.json")))
}

fn not_found(id: &str) -> ApiError {
    ApiError {
        status: 404,
        code: Some("not_found"),
        ..ApiError::bad(format!("no conversation {id:?}"), Some("id"))
    }
}

async fn list(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let d = dir(&s)?.to_path_buf();
    let items = tokio::task::spawn_blocking(move || {
        let mut items: Vec<(u64, Value)> = Vec::new();
        let Ok(entries) = std::fs::read_dir(&d) else {
            return items;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().and_then(|x| x.to_str()) != Some("json") {
                continue;
            }
            let Ok(text) = snug_core::durable::read_regular_string(&path) else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<Value>(&text) else {
                continue;
            };
            let id = path
                .file_stem()
                .and_then(|x| x.to_str())
                .unwrap_or_default()
                .to_string();
            let updated = v.get("updated").and_then(Value::as_u64).unwrap_or(0);
            let title = v.get("title").and_then(Value::as_str).unwrap_or("").to_string();
            items.push((updated, json!({"id": id, "title": title, "updated": updated})));
        }
        items.sort_by_key(|x| std::cmp::Reverse(x.0));
        items.truncate(MAX_LISTED);
        items
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(Json(
        json!({"conversations": items.into_iter().map(|x| x.1).collect::<Vec<_>>()}),
    ))
}

async fn load(State(s): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> Result<Response, ApiError> {
    let path = file(&s, &id)?;
    let text = tokio::task::spawn_blocking(move || snug_core::durable::read_regular_string(&path))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|_| not_found(&id))?;
    Ok(([(header::CONTENT_TYPE, "application/json")], text).into_response())
}

async fn save(
    State(s): State<Arc<AppState>>,
    UrlPath(id): UrlPath<String>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let path = file(&s, &id)?;
    let body = body_bytes(body, &s)?;
    let v: Value = api::parse(&body)?;
    if !v.get("messages").is_some_and(Value::is_array) {
        return Err(ApiError::bad(
            "a conversation is an object with a messages list",
            Some("messages"),
        ));
    }
    let dir = dir(&s)?.to_path_buf();
    let bytes = serde_json::to_vec(&v).map_err(|e| ApiError::internal(e.to_string()))?;
    tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&dir)?;
        snug_core::durable::write(&path, &bytes)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
    .map_err(|e| ApiError::internal(format!("saving the conversation: {e}")))?;
    Ok(StatusCode::NO_CONTENT)
}

async fn remove(State(s): State<Arc<AppState>>, UrlPath(id): UrlPath<String>) -> Result<StatusCode, ApiError> {
    let path = file(&s, &id)?;
    match std::fs::remove_file(&path) {
        Ok(()) => {
            snug_core::durable::sync_dir_of(&path);
            Ok(StatusCode::NO_CONTENT)
        }
        Err(_) => Err(not_found(&id)),
    }
}
