//! Anthropic's Messages API over the same engine: `POST /v1/messages`
//! (whole, or as its stream of named events) and
//! `POST /v1/messages/count_tokens`, so that Anthropic's client libraries
//! connect to snug unchanged. The key may come as `x-api-key` (what those
//! clients send) as well as `Authorization: Bearer`. Errors are Anthropic's
//! `{"type": "error", "error": {"type", "message"}}`.

use super::anthropic_wire::*;
use super::*;
use crate::serve::completions::{stream_answer, tool_chat_prompt, whole_answer, Piece};
use crate::serve::routes::body_bytes;
use crate::serve::tools::{self, Out};

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

/// The request's tools, read through the OpenAI machinery.
fn request_tools(req: &MessagesRequest) -> Result<Option<tools::Tools>, ApiError> {
    let (defs, choice, parallel) = tool_fields(req)?;
    tools::read(defs.as_ref(), choice.as_ref(), parallel.as_ref())
}

/// A call as a `tool_use` block.
fn tool_use(id: &str, c: &tools::Call) -> Value {
    let input: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": id, "name": c.name, "input": input})
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
    let messages = conversation_json(&req).map_err(|e| s.bad(e))?;
    let tools = request_tools(&req).map_err(|e| s.bad(e))?;
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let mut settings = settings(&req, s.seed(id)).map_err(|e| s.bad(e))?;
    let stops = settings.stop.clone();
    let prompt = tool_chat_prompt(s, messages, tools.as_ref(), &mut settings).await?;
    let mut p = s.prepare(prompt, settings, None).map_err(|e| s.bad(e))?;
    p.tools = tools;
    let prompt_tokens = p.prompt.len();
    let mut rx = s.submit(id, &p).await?;
    let msg_id = format!("msg_snug{id:016x}");
    let call_id = move |i: usize| format!("toolu_snug{id:016x}_{i}");
    let model = s.model_id.clone();
    if !p.settings.stream {
        let (text, d, _) = whole_answer(&conn, &mut rx).await?;
        let (mut reason, sequence) = stop_reason(&d, &stops);
        let mut content = Vec::new();
        match &p.tools {
            None => content.push(json!({"type": "text", "text": text})),
            Some(t) => {
                let (answer, calls) = tools::split(&text, t);
                if let Some(a) = answer {
                    content.push(json!({"type": "text", "text": a}));
                }
                for (i, c) in calls.iter().enumerate() {
                    content.push(tool_use(&call_id(i), c));
                }
                if !calls.is_empty() {
                    reason = "tool_use";
                }
            }
        }
        return Ok(Json(json!({
            "id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": d.prompt_tokens, "output_tokens": d.completion_tokens,
                      "cache_read_input_tokens": d.reused_tokens, "cache_creation_input_tokens": 0},
        }))
        .into_response());
    }
    let event = |name: &str, v: Value| SseEvent::default().event(name).data(v.to_string());
    let mut prelude = vec![event(
        "message_start",
        json!({"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}),
    )];
    // Without tools the one text block opens at once; with tools, blocks
    // open as text or calls come: text, then each call a `tool_use` block
    // whose input arrives as one `input_json_delta`.
    let mut splitter = p.tools.as_ref().map(tools::Splitter::new);
    let mut open_text = splitter.is_none();
    if open_text {
        prelude.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ));
    }
    prelude.push(event("ping", json!({"type": "ping"})));
    let mut index = 0usize;
    let mut calls = 0usize;
    // `None` closes the text block if one is open.
    let mut blocks = move |out: Vec<Option<Out>>| -> Vec<SseEvent> {
        let mut ev = Vec::new();
        for o in out {
            match o {
                None => {
                    if open_text {
                        ev.push(event(
                            "content_block_stop",
                            json!({"type": "content_block_stop", "index": index}),
                        ));
                        open_text = false;
                    }
                }
                Some(Out::Text(t)) => {
                    if !open_text {
                        ev.push(event(
                            "content_block_start",
                            json!({"type": "content_block_start", "index": index,
                                   "content_block": {"type": "text", "text": ""}}),
                        ));
                        open_text = true;
                    }
                    ev.push(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index,
                               "delta": {"type": "text_delta", "text": t}}),
                    ));
                }
                Some(Out::Call(c)) => {
                    if open_text {
                        ev.push(event(
                            "content_block_stop",
                            json!({"type": "content_block_stop", "index": index}),
                        ));
                        index += 1;
                        open_text = false;
                    }
                    let mut start = tool_use(&call_id(calls), &c);
                    start["input"] = json!({});
                    ev.push(event(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": index, "content_block": start}),
                    ));
                    ev.push(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta", "partial_json": c.arguments}}),
                    ));
                    ev.push(event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": index}),
                    ));
                    index += 1;
                    calls += 1;
                }
            }
        }
        ev
    };
    let some = |out: Vec<Out>| out.into_iter().map(Some).collect::<Vec<_>>();
    let stream = stream_answer(rx, conn, prelude, move |piece| match piece {
        Piece::Text(t) => match &mut splitter {
            Some(sp) => {
                let out = sp.push(t);
                blocks(some(out))
            }
            None => blocks(vec![Some(Out::Text(t.to_string()))]),
        },
        Piece::Done(d) => {
            let (mut reason, sequence) = stop_reason(d, &stops);
            let mut rest = match &mut splitter {
                Some(sp) => {
                    let out = sp.finish();
                    if sp.calls() > 0 {
                        reason = "tool_use";
                    }
                    some(out)
                }
                None => Vec::new(),
            };
            rest.push(None);
            let mut ev = blocks(rest);
            ev.push(event(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": {"output_tokens": d.completion_tokens}}),
            ));
            ev.push(event("message_stop", json!({"type": "message_stop"})));
            ev
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
        let messages = conversation_json(&req).map_err(|e| s.bad(e))?;
        let tools = request_tools(&req).map_err(|e| s.bad(e))?;
        // The settings only carry the call grammar here; nothing runs.
        let mut settings = api::Settings {
            params: snug_engine::sampling::SamplingParams::default(),
            max_tokens: None,
            stop: Vec::new(),
            stream: false,
            include_usage: false,
            ignore_eos: false,
            grammar: None,
        };
        let prompt = tool_chat_prompt(&s, messages, tools.as_ref(), &mut settings).await?;
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
        let msgs = conversation_json(&ok).unwrap();
        assert_eq!(msgs[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(msgs[1], json!({"role": "user", "content": "Hi"}));
        let s = settings(&ok, 3).unwrap();
        assert_eq!((s.params.temperature, s.params.top_k, s.max_tokens), (1.0, 0, Some(5)));
        let no_max = req(json!({"messages": [{"role": "user", "content": "Hi"}]}));
        assert!(settings(&no_max, 0).unwrap_err().message.contains("max_tokens"));
        let hot = req(json!({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "Hi"}]}));
        assert!(settings(&hot, 0).unwrap_err().message.contains("temperature"));
        let image = req(json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}));
        assert!(conversation_json(&image).unwrap_err().message.contains("image"));
        // Server tools are refused by name; client tools read as functions.
        let server_tool = req(
            json!({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "w"}],
                                     "messages": [{"role": "user", "content": "x"}]}),
        );
        assert!(request_tools(&server_tool)
            .unwrap_err()
            .message
            .contains("client tools"));
        let any = req(
            json!({"max_tokens": 5, "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
                             "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                             "messages": [{"role": "user", "content": "x"}]}),
        );
        let t = request_tools(&any).unwrap().unwrap();
        assert_eq!((t.choice.clone(), t.parallel), (tools::Choice::Required, false));
        // A tool round trip becomes an assistant call and a tool message.
        let trip = req(json!({"max_tokens": 5, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                "content": [{"type": "text", "text": "12 C"}]}, {"type": "text", "text": "Thanks"}]}]}));
        let m = conversation_json(&trip).unwrap();
        assert_eq!(m[1]["tool_calls"][0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
        assert_eq!(m[2], json!({"role": "tool", "tool_call_id": "t1", "content": "12 C"}));
        assert_eq!(m[3], json!({"role": "user", "content": "Thanks"}));
        assert!(serde_json::from_value::<MessagesRequest>(json!({"messages": [], "bogus": 1})).is_err());
    }
}
