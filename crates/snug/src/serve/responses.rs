//! OpenAI's Responses API, the stateless part: `POST /v1/responses` with
//! `input` (a string or message items) and `instructions`, answered whole
//! or as its stream of typed events. Nothing is stored, so
//! `previous_response_id` and the routes that read stored responses are
//! not offered. Errors are OpenAI's error objects, as on the other `/v1`
//! routes.

use super::*;
use crate::serve::routes::{body_bytes, chat_prompt, stream_answer, whole_answer, Piece};

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/responses", post(responses))
}

fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad(message, Some(param))
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Item>),
}

#[derive(serde::Deserialize)]
struct Item {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<ItemContent>,
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum ItemContent {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(serde::Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ResponsesRequest {
    #[serde(default)]
    model: String,
    input: Input,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    max_output_tokens: Option<i64>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    user: Option<Value>,
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<Value>,
    #[serde(default)]
    reasoning: Option<Value>,
    #[serde(default)]
    truncation: Option<String>,
    #[serde(default)]
    include: Option<Vec<Value>>,
    #[serde(default)]
    service_tier: Option<Value>,
}

/// The conversation as chat messages, checked.
fn conversation(req: &ResponsesRequest) -> Result<Vec<Message>, ApiError> {
    if req.previous_response_id.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(bad(
            "previous_response_id is not supported: responses are not stored; send the conversation as input",
            "previous_response_id",
        ));
    }
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(bad("tool calling is not supported yet", "tools"));
    }
    if req
        .tool_choice
        .as_ref()
        .is_some_and(|t| !t.is_null() && t != "none" && t != "auto")
    {
        return Err(bad("tool calling is not supported yet", "tool_choice"));
    }
    if let Some(text) = &req.text {
        let format = text.get("format").and_then(|f| f.get("type")).and_then(Value::as_str);
        if !matches!(format, None | Some("text")) {
            return Err(bad(
                "only text output is supported (structured output is not yet)",
                "text",
            ));
        }
    }
    if req.reasoning.as_ref().is_some_and(|r| !r.is_null()) {
        return Err(bad("reasoning is not supported", "reasoning"));
    }
    if req.include.as_ref().is_some_and(|i| !i.is_empty()) {
        return Err(bad("include is not supported", "include"));
    }
    if req.truncation.as_deref().is_some_and(|t| t != "disabled") {
        return Err(bad("only truncation \"disabled\" is supported", "truncation"));
    }
    let mut out = Vec::new();
    if let Some(i) = &req.instructions {
        out.push(Message::new("system", i));
    }
    match &req.input {
        Input::Text(t) => out.push(Message::new("user", t)),
        Input::Items(items) => {
            for (n, item) in items.iter().enumerate() {
                if item.kind.as_deref().is_some_and(|k| k != "message") {
                    return Err(bad(
                        format!(
                            "input[{n}]: items of type {:?} are not supported (messages only)",
                            item.kind
                        ),
                        "input",
                    ));
                }
                let role = match item.role.as_deref() {
                    Some("developer") => "system",
                    Some(r @ ("system" | "user" | "assistant")) => r,
                    other => {
                        return Err(bad(
                            format!("input[{n}].role: {other:?} is not a message role"),
                            "input",
                        ))
                    }
                };
                let text = match &item.content {
                    None => String::new(),
                    Some(ItemContent::Text(t)) => t.clone(),
                    Some(ItemContent::Parts(parts)) => {
                        let mut s = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("input_text" | "output_text" | "text", Some(t)) => s.push_str(t),
                                (kind, _) => {
                                    return Err(bad(
                                        format!("input[{n}]: content of type {kind:?} is not supported (text only)"),
                                        "input",
                                    ))
                                }
                            }
                        }
                        s
                    }
                };
                out.push(Message::new(role, &text));
            }
        }
    }
    if !out.iter().any(|m| m.role == "user") {
        return Err(bad("input has no user message", "input"));
    }
    Ok(out)
}

fn settings(req: &ResponsesRequest, seed: u64) -> Result<Settings, ApiError> {
    let mut p = api::default_params();
    p.seed = seed;
    if let Some(t) = req.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(bad(format!("temperature must be in [0, 2]; got {t}"), "temperature"));
        }
        p.temperature = t;
    }
    if let Some(t) = req.top_p {
        if !(t > 0.0 && t <= 1.0) {
            return Err(bad(format!("top_p must be in (0, 1]; got {t}"), "top_p"));
        }
        p.top_p = t;
    }
    let max_tokens = match req.max_output_tokens {
        Some(n) if n < 1 => {
            return Err(bad(
                format!("max_output_tokens must be at least 1; got {n}"),
                "max_output_tokens",
            ))
        }
        Some(n) => Some(n as usize),
        None => None,
    };
    let _ = (
        &req.model,
        &req.store,
        &req.metadata,
        &req.user,
        &req.parallel_tool_calls,
        &req.service_tier,
    );
    Ok(Settings {
        params: p,
        max_tokens,
        stop: Vec::new(),
        stream: req.stream,
        include_usage: false,
        ignore_eos: false,
    })
}

/// The response object, `status` `in_progress` (no output yet) or done.
fn response_object(
    id: &str,
    msg_id: &str,
    created: u64,
    model: &str,
    req: &Echo,
    done: Option<(&str, &worker::Summary)>,
) -> Value {
    let (status, incomplete, output, usage) = match done {
        None => ("in_progress", Value::Null, json!([]), Value::Null),
        Some((text, d)) => {
            let cut = d.finish_reason == snug_engine::generate::FinishReason::Length;
            (
                if cut { "incomplete" } else { "completed" },
                if cut {
                    json!({"reason": "max_output_tokens"})
                } else {
                    Value::Null
                },
                json!([message_item(msg_id, "completed", text)]),
                json!({"input_tokens": d.prompt_tokens,
                       "input_tokens_details": {"cached_tokens": d.reused_tokens},
                       "output_tokens": d.completion_tokens,
                       "output_tokens_details": {"reasoning_tokens": 0},
                       "total_tokens": d.prompt_tokens + d.completion_tokens}),
            )
        }
    };
    json!({
        "id": id, "object": "response", "created_at": created, "status": status,
        "error": null, "incomplete_details": incomplete, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": model, "output": output,
        "parallel_tool_calls": true, "previous_response_id": null, "reasoning": {"effort": null, "summary": null},
        "store": false, "temperature": req.temperature, "text": {"format": {"type": "text"}},
        "tool_choice": "auto", "tools": [], "top_p": req.top_p, "truncation": "disabled",
        "usage": usage, "user": null, "metadata": {},
    })
}

fn message_item(id: &str, status: &str, text: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

/// What the response object repeats of the request.
struct Echo {
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    temperature: f32,
    top_p: f32,
}

async fn responses(
    State(s): State<Arc<AppState>>,
    ConnectInfo(conn): ConnectInfo<Conn>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    locked(&s.metrics).request("responses");
    match inner(&s, conn, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn inner(s: &Arc<AppState>, conn: Conn, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body_bytes(body, s)?;
    let req: ResponsesRequest = api::parse(&body).map_err(|e| s.bad(e))?;
    let messages = conversation(&req).map_err(|e| s.bad(e))?;
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let settings = settings(&req, s.seed(id)).map_err(|e| s.bad(e))?;
    let echo = Echo {
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        temperature: settings.params.temperature,
        top_p: settings.params.top_p,
    };
    let prompt = chat_prompt(s, messages).await?;
    let p = s.prepare(prompt, settings, None).map_err(|e| s.bad(e))?;
    let mut rx = s.submit(id, &p).await?;
    let resp_id = format!("resp_snug{id:016x}");
    let msg_id = format!("msg_snug{id:016x}");
    let created = unix_now();
    let model = s.model_id.clone();
    if !p.settings.stream {
        let (text, d, _) = whole_answer(&conn, &mut rx).await?;
        return Ok(Json(response_object(
            &resp_id,
            &msg_id,
            created,
            &model,
            &echo,
            Some((&text, &d)),
        ))
        .into_response());
    }
    let started = response_object(&resp_id, &msg_id, created, &model, &echo, None);
    let part = json!({"type": "output_text", "text": "", "annotations": []});
    let prelude = vec![
        json!({"type": "response.created", "response": started}),
        json!({"type": "response.in_progress", "response": started}),
        json!({"type": "response.output_item.added", "output_index": 0,
               "item": message_item(&msg_id, "in_progress", "")}),
        json!({"type": "response.content_part.added", "item_id": msg_id, "output_index": 0,
               "content_index": 0, "part": part}),
    ];
    let mut text = String::new();
    let events = stream_answer(rx, conn, prelude, move |piece| match piece {
        Piece::Text(t) => {
            text.push_str(t);
            vec![
                json!({"type": "response.output_text.delta", "item_id": msg_id, "output_index": 0,
                        "content_index": 0, "delta": t, "logprobs": []}),
            ]
        }
        Piece::Done(d) => {
            let done_part = json!({"type": "output_text", "text": text, "annotations": []});
            let last = response_object(&resp_id, &msg_id, created, &model, &echo, Some((&text, d)));
            let kind = if last["status"] == "completed" {
                "response.completed"
            } else {
                "response.incomplete"
            };
            vec![
                json!({"type": "response.output_text.done", "item_id": msg_id, "output_index": 0,
                       "content_index": 0, "text": text, "logprobs": []}),
                json!({"type": "response.content_part.done", "item_id": msg_id, "output_index": 0,
                       "content_index": 0, "part": done_part}),
                json!({"type": "response.output_item.done", "output_index": 0,
                       "item": message_item(&msg_id, "completed", &text)}),
                json!({"type": kind, "response": last}),
            ]
        }
        Piece::Failed(e) => vec![json!({"type": "error", "code": "server_error", "message": e, "param": null})],
    });
    // Every event carries its place in the stream.
    let mut seq = 0u64;
    let stream = tokio_stream::StreamExt::map(events, move |mut v: Value| {
        v["sequence_number"] = json!(seq);
        seq += 1;
        let name = v["type"].as_str().unwrap_or("message").to_string();
        Ok::<_, Infallible>(SseEvent::default().event(name).data(v.to_string()))
    });
    Ok(Sse::new(stream).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> ResponsesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn input_items_become_the_conversation_and_the_rest_is_refused() {
        let r = req(json!({"input": [{"role": "developer", "content": "Be brief."},
                                     {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                                     {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
                                     {"role": "user", "content": "Again"}],
                           "instructions": "Speak French."}));
        let m = conversation(&r).unwrap();
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "system", "user", "assistant", "user"]);
        assert_eq!(m[2].content, "Hi");
        let refused = |v: Value, param: &str| {
            let e = conversation(&req(v)).unwrap_err();
            assert_eq!(e.param, Some(param), "{}", e.message);
        };
        refused(
            json!({"input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        );
        refused(json!({"input": "x", "tools": [{"type": "function"}]}), "tools");
        refused(
            json!({"input": "x", "text": {"format": {"type": "json_schema"}}}),
            "text",
        );
        refused(
            json!({"input": [{"type": "function_call_output", "output": "1"}]}),
            "input",
        );
        refused(
            json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
            "input",
        );
        assert!(serde_json::from_value::<ResponsesRequest>(json!({"input": "x", "bogus": 1})).is_err());
        let s = settings(&req(json!({"input": "x", "max_output_tokens": 9, "temperature": 0})), 1).unwrap();
        assert_eq!((s.max_tokens, s.params.temperature), (Some(9), 0.0));
    }
}
