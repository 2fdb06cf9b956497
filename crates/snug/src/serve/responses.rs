//! OpenAI's Responses API, the stateless part: `POST /v1/responses` with
//! `input` (a string, message items, function calls and their outputs),
//! `instructions` and function `tools`, answered whole or as its stream
//! of typed events. Nothing is stored, so
//! `previous_response_id` and the routes that read stored responses are
//! not offered. Errors are OpenAI's error objects, as on the other `/v1`
//! routes.

use super::responses_wire::*;
use super::*;
use crate::serve::completions::{stream_answer, tool_chat_prompt, whole_answer, Piece};
use crate::serve::routes::body_bytes;
use crate::serve::tools::{self, Out};

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/responses", post(responses))
}

/// The response object: `in_progress` with no output yet, or done with
/// its output items.
fn response_object(
    id: &str,
    created: u64,
    model: &str,
    req: &Echo,
    done: Option<(&[Value], &worker::Summary)>,
) -> Value {
    let (status, incomplete, output, usage) = match done {
        None => ("in_progress", Value::Null, json!([]), Value::Null),
        Some((items, d)) => {
            let cut = d.finish_reason == snug_engine::generate::FinishReason::Length;
            (
                if cut { "incomplete" } else { "completed" },
                if cut {
                    json!({"reason": "max_output_tokens"})
                } else {
                    Value::Null
                },
                Value::Array(items.to_vec()),
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
        "parallel_tool_calls": req.parallel, "previous_response_id": null,
        "reasoning": {"effort": null, "summary": null},
        "store": false, "temperature": req.temperature, "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice, "tools": req.tools, "top_p": req.top_p, "truncation": "disabled",
        "usage": usage, "user": null, "metadata": {},
    })
}

fn message_item(id: &str, status: &str, text: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

/// A call as a `function_call` output item.
fn call_item(id: u64, i: usize, status: &str, c: &tools::Call, arguments: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_snug{id:016x}_{i}"), "call_id": format!("call_{id}_{i}"),
           "name": c.name, "arguments": arguments, "status": status})
}

/// What the response object repeats of the request.
struct Echo {
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    temperature: f32,
    top_p: f32,
    tools: Value,
    tool_choice: Value,
    parallel: bool,
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

/// The events of a streamed answer's output items, in order: the message
/// (opened when its first text comes, or at once without tools) and each
/// function call; and the items as they end, for the last event.
struct Items {
    id: u64,
    msg_id: String,
    /// Index of the item being written, or of the next one.
    index: usize,
    msg_open: bool,
    text: String,
    calls: usize,
    done: Vec<Value>,
}

impl Items {
    fn new(id: u64, msg_id: String) -> Items {
        Items {
            id,
            msg_id,
            index: 0,
            msg_open: false,
            text: String::new(),
            calls: 0,
            done: Vec::new(),
        }
    }

    fn open_message(&mut self, ev: &mut Vec<Value>) {
        let part = json!({"type": "output_text", "text": "", "annotations": []});
        ev.push(json!({"type": "response.output_item.added", "output_index": self.index,
                       "item": message_item(&self.msg_id, "in_progress", "")}));
        ev.push(json!({"type": "response.content_part.added", "item_id": self.msg_id,
                       "output_index": self.index, "content_index": 0, "part": part}));
        self.msg_open = true;
    }

    fn close_message(&mut self, ev: &mut Vec<Value>) {
        if !self.msg_open {
            return;
        }
        let (id, i, text) = (&self.msg_id, self.index, &self.text);
        ev.push(
            json!({"type": "response.output_text.done", "item_id": id, "output_index": i,
                       "content_index": 0, "text": text, "logprobs": []}),
        );
        ev.push(
            json!({"type": "response.content_part.done", "item_id": id, "output_index": i,
                       "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}}),
        );
        let item = message_item(id, "completed", text);
        ev.push(json!({"type": "response.output_item.done", "output_index": i, "item": item}));
        self.done.push(item);
        self.index += 1;
        self.msg_open = false;
    }

    fn push(&mut self, out: Vec<Out>) -> Vec<Value> {
        let mut ev = Vec::new();
        for o in out {
            match o {
                Out::Text(t) => {
                    if !self.msg_open {
                        self.open_message(&mut ev);
                    }
                    self.text.push_str(&t);
                    ev.push(json!({"type": "response.output_text.delta", "item_id": self.msg_id,
                                   "output_index": self.index, "content_index": 0, "delta": t, "logprobs": []}));
                }
                Out::Call(c) => {
                    self.close_message(&mut ev);
                    let started = call_item(self.id, self.calls, "in_progress", &c, "");
                    let item_id = started["id"].clone();
                    let i = self.index;
                    ev.push(json!({"type": "response.output_item.added", "output_index": i, "item": started}));
                    ev.push(
                        json!({"type": "response.function_call_arguments.delta", "item_id": item_id,
                                   "output_index": i, "delta": c.arguments}),
                    );
                    ev.push(
                        json!({"type": "response.function_call_arguments.done", "item_id": item_id,
                                   "output_index": i, "arguments": c.arguments}),
                    );
                    let item = call_item(self.id, self.calls, "completed", &c, &c.arguments);
                    ev.push(json!({"type": "response.output_item.done", "output_index": i, "item": item}));
                    self.done.push(item);
                    self.index += 1;
                    self.calls += 1;
                }
            }
        }
        ev
    }
}

async fn inner(s: &Arc<AppState>, conn: Conn, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let body = body_bytes(body, s)?;
    let req: ResponsesRequest = api::parse(&body).map_err(|e| s.bad(e))?;
    let messages = conversation(&req).map_err(|e| s.bad(e))?;
    let (defs, choice, parallel) = tool_fields(&req).map_err(|e| s.bad(e))?;
    let tools = tools::read(defs.as_ref(), choice.as_ref(), parallel.as_ref()).map_err(|e| s.bad(e))?;
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let mut settings = settings(&req, s.seed(id)).map_err(|e| s.bad(e))?;
    let echo = Echo {
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        temperature: settings.params.temperature,
        top_p: settings.params.top_p,
        tools: json!(req.tools.clone().unwrap_or_default()),
        tool_choice: req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        parallel: req.parallel_tool_calls.unwrap_or(true),
    };
    let prompt = tool_chat_prompt(s, messages, tools.as_ref(), &mut settings).await?;
    let mut p = s.prepare(prompt, settings, None).map_err(|e| s.bad(e))?;
    p.tools = tools;
    let mut rx = s.submit(id, &p).await?;
    let resp_id = format!("resp_snug{id:016x}");
    let msg_id = format!("msg_snug{id:016x}");
    let created = unix_now();
    let model = s.model_id.clone();
    let mut splitter = p.tools.as_ref().map(tools::Splitter::new);
    if !p.settings.stream {
        let (text, d, _) = whole_answer(&conn, &mut rx).await?;
        let mut items = Items::new(id, msg_id);
        match &mut splitter {
            Some(sp) => {
                let mut out = sp.push(&text);
                out.extend(sp.finish());
                items.push(out);
            }
            None => {
                items.msg_open = true;
                items.text = text;
            }
        }
        items.close_message(&mut Vec::new());
        if items.done.is_empty() {
            // An answer with nothing in it is still one (empty) message.
            items.msg_open = true;
            items.close_message(&mut Vec::new());
        }
        return Ok(Json(response_object(
            &resp_id,
            created,
            &model,
            &echo,
            Some((&items.done, &d)),
        ))
        .into_response());
    }
    let started = response_object(&resp_id, created, &model, &echo, None);
    let mut items = Items::new(id, msg_id);
    let mut prelude = vec![
        json!({"type": "response.created", "response": started}),
        json!({"type": "response.in_progress", "response": started}),
    ];
    if splitter.is_none() {
        items.open_message(&mut prelude);
    }
    let events = stream_answer(rx, conn, prelude, move |piece| match piece {
        Piece::Text(t) => match &mut splitter {
            Some(sp) => {
                let out = sp.push(t);
                items.push(out)
            }
            None => items.push(vec![Out::Text(t.to_string())]),
        },
        Piece::Done(d) => {
            let mut ev = match &mut splitter {
                Some(sp) => {
                    let out = sp.finish();
                    items.push(out)
                }
                None => Vec::new(),
            };
            items.close_message(&mut ev);
            if items.done.is_empty() {
                items.open_message(&mut ev);
                items.close_message(&mut ev);
            }
            let last = response_object(&resp_id, created, &model, &echo, Some((&items.done, d)));
            let kind = if last["status"] == "completed" {
                "response.completed"
            } else {
                "response.incomplete"
            };
            ev.push(json!({"type": kind, "response": last}));
            ev
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
        let roles: Vec<&str> = m.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "system", "user", "assistant", "user"]);
        assert_eq!(m[2]["content"], "Hi");
        // Function calls and their outputs: one assistant turn of calls,
        // then tool messages.
        let r = req(json!({"input": [{"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "12 C"}]}));
        let m = conversation(&r).unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m[1]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(m[2], json!({"role": "tool", "tool_call_id": "c1", "content": "12 C"}));
        let hosted = req(json!({"input": "x", "tools": [{"type": "web_search"}]}));
        assert_eq!(tool_fields(&hosted).unwrap_err().param, Some("tools"));
        let refused = |v: Value, param: &str| {
            let e = conversation(&req(v)).unwrap_err();
            assert_eq!(e.param, Some(param), "{}", e.message);
        };
        refused(
            json!({"input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        );
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
        refused(json!({"input": [{"type": "file_search_call", "id": "1"}]}), "input");
        refused(
            json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
            "input",
        );
        assert!(serde_json::from_value::<ResponsesRequest>(json!({"input": "x", "bogus": 1})).is_err());
        let s = settings(&req(json!({"input": "x", "max_output_tokens": 9, "temperature": 0})), 1).unwrap();
        assert_eq!((s.max_tokens, s.params.temperature), (Some(9), 0.0));
    }
}
