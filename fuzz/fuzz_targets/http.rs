//! Any request body, for every route that reads one, is parsed and
//! checked, or refused with an OpenAI error object: never a panic, and a
//! compressed body never decodes past its limit.
//!
//! The first byte's low nibble picks the route (chat, completions,
//! systemone, systemone batch, the Laya checkpoint's route, Anthropic's
//! messages, OpenAI's responses, ollama's chat and generate) and its high
//! nibble the encoding (0 none, 1 gzip, 2 zstd); the rest is the body.
//! The server's request modules are compiled in as they are.

#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;

#[allow(dead_code)]
#[path = "../../crates/snug/src/serve/anthropic_wire.rs"]
mod anthropic_wire;
#[allow(dead_code)]
#[path = "../../crates/snug/src/serve/api.rs"]
mod api;
#[allow(dead_code)]
#[path = "../../crates/snug/src/serve/ollama_wire.rs"]
mod ollama_wire;
#[allow(dead_code)]
#[path = "../../crates/snug/src/serve/responses_wire.rs"]
mod responses_wire;
#[allow(dead_code)]
#[path = "../../crates/snug/src/serve/structured.rs"]
mod structured;
#[allow(dead_code)]
#[path = "../../crates/snug/src/serve/tools.rs"]
mod tools;

/// The server's own answer is built elsewhere; the status is all the
/// request module needs here.
impl axum::response::IntoResponse for api::ApiError {
    fn into_response(self) -> axum::response::Response {
        let status = axum::http::StatusCode::from_u16(self.status).unwrap_or(axum::http::StatusCode::BAD_REQUEST);
        (status, self.body().to_string()).into_response()
    }
}

const MAX_BODY: usize = 1 << 16;

fn questions(v: &Value, batch: bool) {
    let Some(obj) = v.as_object() else { return };
    let _ = snug_engine::decide::parse_questions(obj.get("questions").unwrap_or(&Value::Null));
    if let Some(m) = obj.get("min_confidence") {
        let _ = snug_engine::decide::MinConfidence::parse(m);
    }
    let mut checked = v.clone();
    if batch {
        if let Some(first) = obj.get("states").and_then(Value::as_array).and_then(|a| a.first()) {
            checked["state"] = first.clone();
        }
    }
    let _ = snug_engine::laya::parse_request(&checked);
}

fuzz_target!(|data: &[u8]| {
    let Some((&flag, body)) = data.split_first() else {
        return;
    };
    let decoded;
    let body = match flag >> 4 {
        1 | 2 => {
            let encoding = if flag >> 4 == 1 { "gzip" } else { "zstd" };
            match api::decode(encoding, body, MAX_BODY) {
                Ok(Some(d)) => {
                    assert!(d.len() <= MAX_BODY);
                    decoded = d;
                    &decoded[..]
                }
                _ => return,
            }
        }
        _ => body,
    };
    match (flag & 0x0f) % 9 {
        0 => {
            let Ok(req) = api::parse::<api::ChatRequest>(body) else {
                return;
            };
            let settings = req.common.settings(1);
            let mut messages = Vec::new();
            for m in &req.messages {
                let text = m.text().unwrap_or_default();
                let mut v = serde_json::json!({"role": m.role, "content": text});
                if let Some(calls) = &m.tool_calls {
                    v["tool_calls"] = Value::Array(calls.clone());
                }
                messages.push(v);
                // Any text, read as an answer, splits into text and calls.
                if let Ok(Some(t)) = tools::read(Some(&serde_json::json!([{"type": "function", "function": {"name": "f"}}])), None, None) {
                    let _ = tools::split(&text, &t);
                }
            }
            let _ = tools::template_messages(messages.clone(), true);
            let _ = tools::template_messages(messages, false);
            if let Ok(Some(t)) = tools::read(req.tools.as_ref(), req.tool_choice.as_ref(), req.parallel_tool_calls.as_ref()) {
                let answer = settings.ok().and_then(|s| s.grammar).map(|g| g.spec);
                let _ = t.grammar(answer.as_ref());
                let _ = t.system_text();
            }
        }
        1 => {
            let Ok(req) = api::parse::<api::CompletionRequest>(body) else {
                return;
            };
            let _ = req.common.settings(1);
        }
        r @ (2..=4) => {
            let Ok(v) = api::parse::<Value>(body) else { return };
            questions(&v, r == 3);
        }
        5 => {
            let Ok(req) = api::parse::<anthropic_wire::MessagesRequest>(body) else {
                return;
            };
            let _ = anthropic_wire::conversation_json(&req);
            if let Ok((defs, choice, parallel)) = anthropic_wire::tool_fields(&req) {
                let _ = tools::read(defs.as_ref(), choice.as_ref(), parallel.as_ref());
            }
            let _ = anthropic_wire::settings(&req, 1);
        }
        6 => {
            let Ok(req) = api::parse::<responses_wire::ResponsesRequest>(body) else {
                return;
            };
            let _ = responses_wire::conversation(&req);
            if let Ok((defs, choice, parallel)) = responses_wire::tool_fields(&req) {
                let _ = tools::read(defs.as_ref(), choice.as_ref(), parallel.as_ref());
            }
            let _ = responses_wire::settings(&req, 1);
        }
        7 => {
            let Ok(req) = api::parse::<ollama_wire::ChatBody>(body) else {
                return;
            };
            let _ = ollama_wire::refuse_unsupported(&req.think);
            let _ = ollama_wire::format_grammar(&req.format);
            let _ = tools::read(req.tools.clone().map(Value::Array).as_ref(), None, None);
            let _ = ollama_wire::settings(req.options.as_ref(), 1, true);
        }
        _ => {
            let Ok(req) = api::parse::<ollama_wire::GenerateBody>(body) else {
                return;
            };
            let _ = ollama_wire::refuse_unsupported(&req.think);
            let _ = ollama_wire::format_grammar(&req.format);
            let _ = ollama_wire::settings(req.options.as_ref(), 1, false);
        }
    }
});
