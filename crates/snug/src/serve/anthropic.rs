//! Anthropic's Messages API over the same engine: `POST /v1/messages`
//! (whole, or as its stream of named events) and
//! `POST /v1/messages/count_tokens`, so that Anthropic's client libraries
//! connect to snug unchanged. The key may come as `x-api-key` (what those
//! clients send) as well as `Authorization: Bearer`. Errors are Anthropic's
//! `{"type": "error", "error": {"type", "message"}}`.

use super::anthropic_wire::*;
use super::*;
use crate::serve::routes::{body_bytes, chat_prompt, stream_answer, whole_answer, Piece};

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
}

/// Anthropic's error shape, with its error type for the status.
fn error(e: ApiError) -> Response {
    let kind = match e.status {
        401 => "authentication_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    let mut r = (
        status,
        Json(json!({"type": "error", "error": {"type": kind, "message": e.message}})),
    )
        .into_response();
    if let Some(after) = e.retry_after {
        if let Ok(v) = HeaderValue::from_str(&after.to_string()) {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
    }
    r
}

/// Anthropic's stop reason, and the stop sequence when it can say which.
fn stop_reason(d: &worker::Summary, stops: &[String]) -> (&'static str, Value) {
    match (d.finish_reason, d.stopped_by_string) {
        (snug_engine::generate::FinishReason::Length, _) => ("max_tokens", Value::Null),
        (_, true) => (
            "stop_sequence",
            // The engine says that a stop string matched, not which.
            if stops.len() == 1 { json!(stops[0]) } else { Value::Null },
        ),
        _ => ("end_turn", Value::Null),
    }
}

async fn messages(
    State(s): State<Arc<AppState>>,
    ConnectInfo(conn): ConnectInfo<Conn>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    locked(&s.metrics).request("messages");
    messages_inner(&s, conn, body).await.unwrap_or_else(error)
}

async fn messages_inner(
    s: &Arc<AppState>,
    conn: Conn,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body, s)?;
    let req: MessagesRequest = api::parse(&body).map_err(|e| s.bad(e))?;
    let messages = conversation(&req).map_err(|e| s.bad(e))?;
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let settings = settings(&req, s.seed(id)).map_err(|e| s.bad(e))?;
    let stops = settings.stop.clone();
    let prompt = chat_prompt(s, messages).await?;
    let p = s.prepare(prompt, settings, None).map_err(|e| s.bad(e))?;
    let prompt_tokens = p.prompt.len();
    let mut rx = s.submit(id, &p).await?;
    let msg_id = format!("msg_snug{id:016x}");
    let model = s.model_id.clone();
    if !p.settings.stream {
        let (text, d, _) = whole_answer(&conn, &mut rx).await?;
        let (reason, sequence) = stop_reason(&d, &stops);
        return Ok(Json(json!({
            "id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": d.prompt_tokens, "output_tokens": d.completion_tokens,
                      "cache_read_input_tokens": d.reused_tokens, "cache_creation_input_tokens": 0},
        }))
        .into_response());
    }
    let event = |name: &str, v: Value| SseEvent::default().event(name).data(v.to_string());
    let prelude = vec![
        event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}),
        ),
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        event("ping", json!({"type": "ping"})),
    ];
    let stream = stream_answer(rx, conn, prelude, move |piece| match piece {
        Piece::Text(t) => vec![event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}),
        )],
        Piece::Done(d) => {
            let (reason, sequence) = stop_reason(d, &stops);
            vec![
                event("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
                event(
                    "message_delta",
                    json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                           "usage": {"output_tokens": d.completion_tokens}}),
                ),
                event("message_stop", json!({"type": "message_stop"})),
            ]
        }
        Piece::Failed(e) => vec![event(
            "error",
            json!({"type": "error", "error": {"type": "api_error", "message": e}}),
        )],
    });
    Ok(Sse::new(tokio_stream::StreamExt::map(stream, Ok::<_, Infallible>)).into_response())
}

async fn count_tokens(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    locked(&s.metrics).request("count_tokens");
    let inner = async {
        let body = body_bytes(body, &s)?;
        let req: MessagesRequest = api::parse(&body).map_err(|e| s.bad(e))?;
        let messages = conversation(&req).map_err(|e| s.bad(e))?;
        let prompt = chat_prompt(&s, messages).await?;
        Ok::<_, ApiError>(Json(json!({"input_tokens": prompt.len()})).into_response())
    };
    inner.await.unwrap_or_else(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> MessagesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn requests_are_checked_as_anthropic_checks_them() {
        let ok = req(
            json!({"model": "x", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
                            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
        );
        let msgs = conversation(&ok).unwrap();
        assert_eq!(msgs[0], Message::new("system", "Be brief."));
        assert_eq!(msgs[1], Message::new("user", "Hi"));
        let s = settings(&ok, 3).unwrap();
        assert_eq!((s.params.temperature, s.params.top_k, s.max_tokens), (1.0, 0, Some(5)));
        let no_max = req(json!({"messages": [{"role": "user", "content": "Hi"}]}));
        assert!(settings(&no_max, 0).unwrap_err().message.contains("max_tokens"));
        let hot = req(json!({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "Hi"}]}));
        assert!(settings(&hot, 0).unwrap_err().message.contains("temperature"));
        let image = req(json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}));
        assert!(conversation(&image).unwrap_err().message.contains("image"));
        let tools =
            req(json!({"max_tokens": 5, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "x"}]}));
        assert!(conversation(&tools).unwrap_err().message.contains("tools"));
        assert!(serde_json::from_value::<MessagesRequest>(json!({"messages": [], "bogus": 1})).is_err());
    }
}
