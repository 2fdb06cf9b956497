//! `POST /v1/decisions`: typed decisions in the shape of OpenAI's other
//! endpoints. The questions are Laya's (`choice`, `score`, `noul`; see
//! docs/DECIDE.md); the text they are about comes as chat `messages` (or
//! one `input` string); the response is an object with an `id`, `object`,
//! `created`, `model`, one entry per question under `decisions`, and
//! OpenAI's `usage`.
//!
//! Two ways to answer:
//! - `"method": "score"` (the default): the label probabilities of
//!   `/v1/systemone`, every question in one batched forward.
//! - `"method": "generate"`: each question is asked as a chat turn and the
//!   model writes its answer under a grammar that admits exactly the
//!   options' names (the machinery of `response_format`), greedily; the
//!   answer is whatever the model wrote, always one of the options.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use snug_engine::decide::{self, Kind, MinConfidence, Question};
use snug_engine::grammar::GrammarSpec;

use super::api::{self, ApiError, Common};
use super::completions::{chat_prompt_value, whole_answer};
use super::routes::{body_bytes, usage};
use super::structured::Structured;
use super::systemone::{decide_one, unprocessable};
use super::{locked, unix_now, AppState, Conn};

/// The text the questions are about: one `input` string, or the messages
/// as `role: content` lines (a lone user message is its content).
fn state_of(obj: &Map<String, Value>) -> Result<String, ApiError> {
    match (obj.get("messages"), obj.get("input")) {
        (Some(_), Some(_)) => Err(ApiError::bad("give 'messages' or 'input', not both", Some("messages"))),
        (None, None) | (None, Some(Value::Null)) | (Some(Value::Null), None) => Err(ApiError::bad(
            "'messages' (or 'input') is required: the text the questions are about",
            Some("messages"),
        )),
        (None, Some(v)) => Ok(crate::decide::state_text(v)),
        (Some(Value::Array(ms)), None) if !ms.is_empty() => {
            let mut lines = Vec::with_capacity(ms.len());
            for m in ms {
                let role = m.get("role").and_then(Value::as_str).unwrap_or("");
                if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
                    return Err(ApiError::bad(
                        format!("unknown message role {role:?}"),
                        Some("messages"),
                    ));
                }
                let content = match m.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect::<Vec<_>>()
                        .join(""),
                    _ => {
                        return Err(ApiError::bad(
                            "each message needs a 'content' string (or text parts)",
                            Some("messages"),
                        ))
                    }
                };
                lines.push((role.to_string(), content));
            }
            if let [(role, content)] = lines.as_slice() {
                if role == "user" {
                    return Ok(content.clone());
                }
            }
            Ok(lines
                .iter()
                .map(|(r, c)| format!("{r}: {c}"))
                .collect::<Vec<_>>()
                .join("\n"))
        }
        _ => Err(ApiError::bad("'messages' must be a non-empty list", Some("messages"))),
    }
}

/// What the answer field holds, by type: the chosen label, the most
/// probable level's index, or whether P(true) is at least one half.
fn answer_value(q: &Question, p: &[f32]) -> Value {
    let best = p.iter().enumerate().fold(0, |b, (i, &x)| if x > p[b] { i } else { b });
    match q.kind {
        Kind::Choice => json!(q.options[best].0),
        Kind::Score => json!(best),
        Kind::Noul => json!(p.get(1).copied().unwrap_or(0.0) >= 0.5),
    }
}

/// The names the model may write for each option under `generate`.
fn option_names(q: &Question) -> Vec<String> {
    match q.kind {
        Kind::Choice => q.options.iter().map(|(k, _)| k.clone()).collect(),
        Kind::Score => q.options.iter().map(|(k, _)| k.clone()).collect(),
        Kind::Noul => vec!["no".into(), "yes".into()],
    }
}

/// The chat turn that asks `q` about `state` under `generate`.
fn question_turn(state: &str, q: &Question) -> String {
    let mut t = format!("{state}\n\n{}\n", q.instructions);
    match q.kind {
        Kind::Choice => {
            t.push_str("Options:\n");
            for (k, d) in &q.options {
                match d {
                    Some(d) => t.push_str(&format!("- {k}: {d}\n")),
                    None => t.push_str(&format!("- {k}\n")),
                }
            }
            t.push_str("Answer with one option's name, exactly as written.");
        }
        Kind::Score => {
            t.push_str("Levels:\n");
            for (k, d) in &q.options {
                t.push_str(&format!("{k} = {}\n", d.as_deref().unwrap_or("")));
            }
            t.push_str("Answer with the level's number.");
        }
        Kind::Noul => t.push_str("Answer yes or no."),
    }
    t
}

pub(super) async fn decisions(
    State(s): State<Arc<AppState>>,
    ConnectInfo(conn): ConnectInfo<Conn>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    locked(&s.metrics).request("decisions");
    match decisions_inner(&s, &conn, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn decisions_inner(
    s: &Arc<AppState>,
    conn: &Conn,
    body: Result<Bytes, BytesRejection>,
) -> Result<Value, ApiError> {
    let body = body_bytes(body, s)?;
    let v: Value = api::parse(&body).map_err(|e| s.bad(e))?;
    let Some(obj) = v.as_object() else {
        return Err(s.bad(ApiError::bad("the body must be a JSON object", None)));
    };
    const KNOWN: [&str; 7] = [
        "model",
        "messages",
        "input",
        "questions",
        "min_confidence",
        "method",
        "user",
    ];
    if let Some(k) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(s.bad(ApiError::bad(format!("unknown or unsupported field {k:?}"), None)));
    }
    let state = state_of(obj).map_err(|e| s.bad(e))?;
    let questions = match obj.get("questions") {
        Some(q) => decide::parse_questions(q).map_err(|e| s.bad(unprocessable(e.to_string(), None)))?,
        None => return Err(s.bad(ApiError::bad("'questions' is required", Some("questions")))),
    };
    let min = match obj.get("min_confidence") {
        None | Some(Value::Null) => None,
        Some(m) => Some(MinConfidence::parse(m).map_err(|e| s.bad(unprocessable(e.to_string(), None)))?),
    };
    let generate = match obj.get("method").and_then(Value::as_str) {
        None | Some("score") if obj.get("method").is_none_or(Value::is_string) => false,
        Some("generate") => true,
        _ => {
            return Err(s.bad(ApiError::bad(
                "method must be \"score\" or \"generate\"",
                Some("method"),
            )))
        }
    };
    let id = s.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let t0 = Instant::now();
    let (decisions, totals) = if generate {
        if min.is_some() {
            return Err(s.bad(ApiError::bad(
                "min_confidence needs probabilities: use method \"score\"",
                Some("min_confidence"),
            )));
        }
        generated(s, conn, id, &state, &questions).await?
    } else {
        let (scored, u) = decide_one(s, state, questions).await?;
        let answers = decide::response_json(&s.model_id, &scored, &u, min.as_ref());
        let list: Vec<Value> = scored
            .iter()
            .enumerate()
            .map(|(i, sc)| {
                let mut d = json!({"index": i, "name": sc.question.name,
                                   "answer": answer_value(&sc.question, &sc.probabilities)});
                if let Value::Object(a) = &answers["answers"][&sc.question.name] {
                    d.as_object_mut().expect("object").extend(a.clone());
                }
                d
            })
            .collect();
        conn.record(super::Usage {
            prompt: u.input_tokens,
            completion: 0,
            cached: u.cached_tokens,
        });
        (list, usage(u.input_tokens, 0, u.cached_tokens))
    };
    Ok(json!({
        "id": format!("decision-{id}"),
        "object": "decision",
        "created": unix_now(),
        "model": s.model_id,
        "method": if generate { "generate" } else { "score" },
        "decisions": decisions,
        "usage": totals,
        "x_inference_time_ms": (t0.elapsed().as_secs_f64() * 1e4).round() / 10.0,
    }))
}

/// Each question as a chat turn, answered under a grammar of its options;
/// the questions run as concurrent requests.
async fn generated(
    s: &Arc<AppState>,
    conn: &Conn,
    id: u64,
    state: &str,
    questions: &[Question],
) -> Result<(Vec<Value>, Value), ApiError> {
    let mut pending = Vec::with_capacity(questions.len());
    for q in questions {
        let names = option_names(q);
        let longest = names
            .iter()
            .map(|n| {
                s.tok
                    .encode(
                        n,
                        snug_model::EncodeOptions {
                            add_special: false,
                            parse_special: false,
                        },
                    )
                    .len()
            })
            .max()
            .unwrap_or(1);
        let messages = json!([{"role": "user", "content": question_turn(state, q)}]);
        let prompt = chat_prompt_value(s, messages, json!({})).await?;
        let common = Common {
            temperature: Some(0.0),
            max_tokens: Some(longest as i64 + 8),
            ..Common::default()
        };
        let mut settings = common.settings(s.seed(id)).map_err(|e| s.bad(e))?;
        settings.grammar = Some(Structured {
            spec: GrammarSpec::Choice(names.clone()),
            param: "questions",
        });
        let p = s
            .prepare(prompt, settings, None)
            .map_err(|e| s.bad(ApiError { status: 422, ..e }))?;
        // Each question is its own engine request, with its own id (the
        // engine tells requests apart by id).
        let qid = if pending.is_empty() {
            id
        } else {
            s.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        };
        pending.push((s.submit(qid, &p).await?, names));
    }
    let (mut prompt_tokens, mut completion_tokens, mut cached) = (0, 0, 0);
    let mut out = Vec::with_capacity(questions.len());
    for (i, (q, (mut rx, names))) in questions.iter().zip(pending).enumerate() {
        let (text, d, _) = whole_answer(conn, &mut rx).await?;
        prompt_tokens += d.prompt_tokens;
        completion_tokens += d.completion_tokens;
        cached += d.reused_tokens;
        let chosen = names.iter().position(|n| *n == text);
        let answer = match (q.kind, chosen) {
            (Kind::Choice, Some(c)) => json!(q.options[c].0),
            (Kind::Score, Some(c)) => json!(c),
            (Kind::Noul, Some(c)) => json!(c == 1),
            // Only a length cut can leave an option unfinished.
            (_, None) => Value::Null,
        };
        out.push(json!({
            "index": i, "name": q.name, "type": q.kind.name(), "answer": answer, "text": text,
            "finish_reason": d.finish_reason.as_str(),
        }));
    }
    Ok((out, usage(prompt_tokens, completion_tokens, cached)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_is_the_input_or_the_messages() {
        let o = |v: Value| v.as_object().unwrap().clone();
        assert_eq!(state_of(&o(json!({"input": "hello"}))).unwrap(), "hello");
        assert_eq!(
            state_of(&o(json!({"messages": [{"role": "user", "content": "only me"}]}))).unwrap(),
            "only me"
        );
        assert_eq!(
            state_of(&o(json!({"messages": [{"role": "system", "content": "s"},
                                            {"role": "user", "content": [{"type": "text", "text": "u"}]}]})))
            .unwrap(),
            "system: s\nuser: u"
        );
        assert!(state_of(&o(json!({}))).is_err());
        assert!(state_of(&o(json!({"input": "a", "messages": []}))).is_err());
        assert!(state_of(&o(json!({"messages": [{"role": "robot", "content": "x"}]}))).is_err());
        assert!(state_of(&o(json!({"messages": []}))).is_err());
    }

    #[test]
    fn answers_by_type() {
        let q = |kind, options: &[&str]| Question {
            name: "q".into(),
            kind,
            instructions: "?".into(),
            options: options.iter().map(|o| (o.to_string(), None)).collect(),
        };
        assert_eq!(
            answer_value(&q(Kind::Choice, &["a", "b", "c"]), &[0.2, 0.5, 0.3]),
            json!("b")
        );
        // Ties go to the first option, as Laya's `choice` does.
        assert_eq!(answer_value(&q(Kind::Choice, &["a", "b"]), &[0.5, 0.5]), json!("a"));
        assert_eq!(
            answer_value(&q(Kind::Score, &["0", "1", "2"]), &[0.1, 0.2, 0.7]),
            json!(2)
        );
        assert_eq!(
            answer_value(&q(Kind::Noul, &["false", "true"]), &[0.4, 0.6]),
            json!(true)
        );
        assert_eq!(
            answer_value(&q(Kind::Noul, &["false", "true"]), &[0.6, 0.4]),
            json!(false)
        );
        let turn = question_turn("S", &q(Kind::Choice, &["billing", "tech"]));
        assert!(turn.starts_with("S\n\n?\nOptions:\n- billing\n- tech\n"), "{turn}");
    }
}
