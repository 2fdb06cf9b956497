//! OpenAI's Responses API, the stateless part: `POST /v1/responses` with
//! `input` (a string or message items) and `instructions`, answered whole
//! or as its stream of typed events. Nothing is stored, so
//! `previous_response_id` and the routes that read stored responses are
//! not offered. Errors are OpenAI's error objects, as on the other `/v1`
//! routes.

use super::responses_wire::*;
use super::*;
use crate::serve::routes::{body_bytes, chat_prompt, stream_answer, whole_answer, Piece};

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/responses", post(responses))
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
        // A json_schema format without its schema is refused; with one it
        // becomes the output's grammar.
        let e = settings(
            &req(json!({"input": "x", "text": {"format": {"type": "json_schema"}}})),
            1,
        )
        .unwrap_err();
        assert_eq!(e.param, Some("text"));
        let with_schema = json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "p",
                                 "schema": {"type": "object"}}}});
        assert!(settings(&req(with_schema), 1).unwrap().grammar.is_some());
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
