//! OpenAI's chat and completion routes, and the machinery every API that
//! generates shares: rendering a conversation (with tools) into a prompt,
//! running it to a whole answer or a stream of pieces.

use super::routes::{body_bytes, unavailable, usage, Prepared};
use super::*;

/// Which endpoint a response is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Chat,
    Completion,
}

pub(super) async fn chat_completions(
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

/// A chat request read and checked, its prompt rendered and tokenized.
struct ChatPlan {
    id: u64,
    prompt: Vec<u32>,
    settings: api::Settings,
    tools: Option<tools::Tools>,
}

pub(super) async fn chat_inner(
    s: &Arc<AppState>,
    conn: Conn,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let c = plan_chat(s, body).await?;
    let mut p = s.prepare(c.prompt, c.settings, None).map_err(|e| s.bad(e))?;
    p.tools = c.tools;
    respond(s, conn, c.id, Kind::Chat, p).await
}

/// `POST /v1/chat/completions/render` (vLLM's): the prompt token ids a
/// chat request would run on, without running it: `{"token_ids": [...]}`.
/// A router reads them to find which replica holds the prompt's prefix.
pub(super) async fn chat_render(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    locked(&s.metrics).request("render");
    match plan_chat(&s, body).await {
        Ok(c) => Json(json!({"token_ids": c.prompt, "model": s.model_id})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/completions/render` (vLLM's): a completion request's prompt
/// token ids, `{"token_ids": [...]}`.
pub(super) async fn completion_render(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    locked(&s.metrics).request("render");
    let r = body_bytes(body, &s).and_then(|body| {
        let req: CompletionRequest = api::parse(&body).map_err(|e| s.bad(e))?;
        req.common.settings(0).map_err(|e| s.bad(e))?;
        completion_prompt(&s, req.prompt)
    });
    match r {
        Ok(ids) => Json(json!({"token_ids": ids, "model": s.model_id})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn plan_chat(s: &Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<ChatPlan, ApiError> {
    let body = body_bytes(body, s)?;
    let req: ChatRequest = api::parse(&body).map_err(|e| s.bad(e))?;
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let mut settings = req.common.settings(s.seed(id)).map_err(|e| s.bad(e))?;
    if req.messages.is_empty() {
        return Err(s.bad(ApiError::bad("messages must not be empty", Some("messages"))));
    }
    let tools = tools::read(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls.as_ref(),
    )
    .map_err(|e| s.bad(e))?;
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
        let mut v = json!({"role": role, "content": m.text().map_err(|e| s.bad(e))?});
        if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
            v["tool_calls"] = Value::Array(calls.clone());
        }
        if let Some(id) = &m.tool_call_id {
            v["tool_call_id"] = Value::from(id.as_str());
        }
        if let Some(name) = &m.name {
            v["name"] = Value::from(name.as_str());
        }
        messages.push(v);
    }
    let prompt = tool_chat_prompt(s, messages, tools.as_ref(), &mut settings).await?;
    Ok(ChatPlan {
        id,
        prompt,
        settings,
        tools,
    })
}

pub(super) async fn completions(
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

pub(super) async fn completion_inner(
    s: &Arc<AppState>,
    conn: Conn,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body, s)?;
    let req: CompletionRequest = api::parse(&body).map_err(|e| s.bad(e))?;
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let settings = req.common.settings(s.seed(id)).map_err(|e| s.bad(e))?;
    let prompt = completion_prompt(s, req.prompt)?;
    // OpenAI's default for completions.
    let p = s.prepare(prompt, settings, Some(16)).map_err(|e| s.bad(e))?;
    respond(s, conn, id, Kind::Completion, p).await
}

/// A completion request's prompt as token ids.
fn completion_prompt(s: &AppState, prompt: Prompt) -> Result<Vec<u32>, ApiError> {
    Ok(match prompt {
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
    })
}

/// A conversation with tools (or none) as prompt tokens: a template that
/// renders tools itself gets them as `tools`; for any other they are
/// described in the system message. The call grammar, when the tool
/// choice needs one, becomes the request's.
pub(super) async fn tool_chat_prompt(
    s: &Arc<AppState>,
    messages: Vec<Value>,
    tools: Option<&tools::Tools>,
    settings: &mut Settings,
) -> Result<Vec<u32>, ApiError> {
    let native = s.template.source.contains("tools");
    let mut messages = tools::template_messages(messages, native);
    let mut extra = json!({});
    if let Some(t) = tools {
        if native {
            extra["tools"] = Value::Array(t.defs.clone());
        } else if messages.first().is_some_and(|m| m["role"] == "system") {
            let text = format!(
                "{}\n\n{}",
                messages[0]["content"].as_str().unwrap_or_default(),
                t.system_text()
            );
            messages[0]["content"] = Value::from(text);
        } else {
            messages.insert(0, json!({"role": "system", "content": t.system_text()}));
        }
        if let Some(spec) = t
            .grammar(settings.grammar.as_ref().map(|g| &g.spec))
            .map_err(|e| s.bad(e))?
        {
            settings.grammar = Some(Structured { spec, param: "tools" });
        }
    }
    chat_prompt_value(s, Value::Array(messages), extra).await
}

/// A conversation's prompt tokens: the chat template rendered (in the
/// template worker, on the blocking pool, so the HTTP thread never waits
/// on it) and tokenized.
pub(super) async fn chat_prompt(s: &Arc<AppState>, messages: Vec<Message>) -> Result<Vec<u32>, ApiError> {
    let messages = serde_json::to_value(messages).map_err(|e| ApiError::internal(e.to_string()))?;
    chat_prompt_value(s, messages, json!({})).await
}

/// [`chat_prompt`] for messages as JSON (with `tool_calls` and the like)
/// and further template variables (`tools`).
pub(super) async fn chat_prompt_value(s: &Arc<AppState>, messages: Value, extra: Value) -> Result<Vec<u32>, ApiError> {
    // A render is a round trip to the template worker (which may take up
    // to its time limit); the blocking pool keeps the HTTP thread free.
    let state = s.clone();
    let text =
        tokio::task::spawn_blocking(move || state.template.render(&messages, true, &state.bos, &state.eos, &extra))
            .await
            .map_err(|e| ApiError::internal(format!("the chat template's render stopped: {e}")))?
            .map_err(|e| match e {
                snug_model::template::TemplateError::Isolation(_) => ApiError::internal(e.to_string()),
                _ => s.bad(ApiError::bad(
                    format!("the chat template failed: {e}"),
                    Some("messages"),
                )),
            })?;
    Ok(s.tok.encode(
        &text,
        EncodeOptions {
            add_special: s.bos.is_empty() || !text.starts_with(&s.bos),
            parse_special: true,
        },
    ))
}

/// A request's whole answer, for a client that did not ask for a stream:
/// its text, how it ended and when its first text came (the tokens noted
/// for the access log). A client that hangs up meanwhile cancels it
/// (dropping the receiver does).
pub(super) async fn whole_answer(
    conn: &Conn,
    rx: &mut UnboundedReceiver<Event>,
) -> Result<(String, worker::Summary, Option<Instant>), ApiError> {
    let mut text = String::new();
    let mut first = None;
    let mut check = tokio::time::interval(std::time::Duration::from_millis(100));
    loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = check.tick() => {
                if conn.hung_up() {
                    return Err(ApiError::bad("the client closed the connection", None));
                }
                continue;
            }
        };
        match ev {
            Some(Event::Text(t)) => {
                first.get_or_insert_with(Instant::now);
                text.push_str(&t);
            }
            Some(Event::Done(d)) => {
                conn.record(Usage {
                    prompt: d.prompt_tokens,
                    completion: d.completion_tokens,
                    cached: d.reused_tokens,
                });
                return Ok((text, d, first));
            }
            Some(Event::Failed(e)) => return Err(ApiError::internal(e)),
            Some(_) => {}
            None => return Err(unavailable("the engine has stopped", 5)),
        }
    }
}

/// What a streamed answer's formatter is handed, in order: pieces of
/// text, then how it ended (or why it failed).
pub(super) enum Piece<'a> {
    Text(&'a str),
    Done(&'a worker::Summary),
    Failed(&'a str),
}

/// A streamed answer: a task sends `prelude`, then what `format` makes of
/// each of the engine's events, and notes the tokens for the access log.
/// When the client goes away the channel closes, the task ends and drops
/// the engine's receiver, and the engine loop cancels the request.
pub(super) fn stream_answer<T: Send + 'static>(
    mut rx: UnboundedReceiver<Event>,
    conn: Conn,
    prelude: Vec<T>,
    mut format: impl FnMut(Piece<'_>) -> Vec<T> + Send + 'static,
) -> tokio_stream::wrappers::UnboundedReceiverStream<T> {
    let (out, out_rx) = unbounded_channel::<T>();
    tokio::spawn(async move {
        for item in prelude {
            if out.send(item).is_err() {
                return;
            }
        }
        while let Some(ev) = rx.recv().await {
            let (items, last) = match &ev {
                Event::Text(t) => (format(Piece::Text(t)), false),
                Event::Done(d) => {
                    conn.record(Usage {
                        prompt: d.prompt_tokens,
                        completion: d.completion_tokens,
                        cached: d.reused_tokens,
                    });
                    (format(Piece::Done(d)), true)
                }
                Event::Failed(e) => (format(Piece::Failed(e)), true),
                Event::Accepted | Event::Refused(_) => continue,
            };
            for item in items {
                if out.send(item).is_err() {
                    return;
                }
            }
            if last {
                return;
            }
        }
    });
    tokio_stream::wrappers::UnboundedReceiverStream::new(out_rx)
}

/// Runs a prepared request and answers it, streaming or not.
pub(super) async fn respond(
    s: &Arc<AppState>,
    conn: Conn,
    id: u64,
    kind: Kind,
    p: Prepared,
) -> Result<Response, ApiError> {
    let mut rx = s.submit(id, &p).await?;
    let created = unix_now();
    let rid = match kind {
        Kind::Chat => format!("chatcmpl-{id}"),
        Kind::Completion => format!("cmpl-{id}"),
    };
    let call_id = move |i: usize| format!("call_{id}_{i}");
    if !p.settings.stream {
        let (text, d, _) = whole_answer(&conn, &mut rx).await?;
        let u = usage(d.prompt_tokens, d.completion_tokens, d.reused_tokens);
        let mut message = json!({"role": "assistant", "content": text});
        let mut reason = d.finish_reason.as_str();
        if let Some(t) = &p.tools {
            let (content, calls) = tools::split(&text, t);
            message["content"] = content.map_or(Value::Null, Value::from);
            if !calls.is_empty() {
                let calls: Vec<Value> = calls.iter().enumerate().map(|(i, c)| c.json(&call_id(i))).collect();
                message["tool_calls"] = Value::Array(calls);
                reason = "tool_calls";
            }
        }
        let body = match kind {
            Kind::Chat => json!({
                "id": rid, "object": "chat.completion", "created": created, "model": s.model_id,
                "choices": [{"index": 0, "message": message,
                             "logprobs": null, "finish_reason": reason}],
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
    let model = s.model_id.clone();
    let include_usage = p.settings.include_usage;
    let chunk = move |choice: Value| -> Value {
        match kind {
            Kind::Chat => json!({"id": rid, "object": "chat.completion.chunk", "created": created,
                                 "model": model, "choices": [choice]}),
            Kind::Completion => json!({"id": rid, "object": "text_completion", "created": created,
                                       "model": model, "choices": [choice]}),
        }
    };
    let data = |v: Value| SseEvent::default().data(v.to_string());
    let prelude = match kind {
        Kind::Chat => vec![data(chunk(
            json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": null, "finish_reason": null}),
        ))],
        Kind::Completion => Vec::new(),
    };
    // With tools, text passes through the splitter: calls come out as
    // `tool_calls` deltas (each whole: its id and name, and its arguments
    // in one piece), the rest as content.
    let mut splitter = p.tools.as_ref().map(tools::Splitter::new);
    let mut calls = 0usize;
    let delta_chunk = chunk.clone();
    let mut delta = move |out: Vec<tools::Out>| -> Vec<SseEvent> {
        out.into_iter()
            .map(|o| {
                let d = match o {
                    tools::Out::Text(t) => json!({"content": t}),
                    tools::Out::Call(c) => {
                        let mut call = c.json(&call_id(calls));
                        call["index"] = Value::from(calls);
                        calls += 1;
                        json!({"tool_calls": [call]})
                    }
                };
                data(delta_chunk(
                    json!({"index": 0, "delta": d, "logprobs": null, "finish_reason": null}),
                ))
            })
            .collect()
    };
    let stream = stream_answer(rx, conn, prelude, move |piece| match piece {
        Piece::Text(t) => match &mut splitter {
            Some(sp) => delta(sp.push(t)),
            None => vec![data(chunk(match kind {
                Kind::Chat => json!({"index": 0, "delta": {"content": t}, "logprobs": null, "finish_reason": null}),
                Kind::Completion => json!({"index": 0, "text": t, "logprobs": null, "finish_reason": null}),
            }))],
        },
        Piece::Done(d) => {
            let mut out = Vec::new();
            let mut reason = d.finish_reason.as_str();
            if let Some(sp) = &mut splitter {
                out.extend(delta(sp.finish()));
                if sp.calls() > 0 {
                    reason = "tool_calls";
                }
            }
            let last = match kind {
                Kind::Chat => json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason}),
                Kind::Completion => json!({"index": 0, "text": "", "logprobs": null, "finish_reason": reason}),
            };
            out.push(data(chunk(last)));
            if include_usage {
                let mut v = chunk(Value::Null);
                v["choices"] = json!([]);
                v["usage"] = usage(d.prompt_tokens, d.completion_tokens, d.reused_tokens);
                out.push(data(v));
            }
            out.push(SseEvent::default().data("[DONE]"));
            out
        }
        Piece::Failed(e) => vec![data(
            json!({"error": {"message": e, "type": "server_error", "param": null, "code": null}}),
        )],
    });
    Ok(Sse::new(tokio_stream::StreamExt::map(stream, Ok::<_, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response())
}
