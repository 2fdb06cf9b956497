//! `/v1/systemone`: typed decisions in Laya's shape (see docs/DECIDE.md).

use super::routes::{body_bytes, unavailable};
use super::*;

/// `POST /v1/systemone`: Laya's typed decisions (see docs/DECIDE.md).
pub(super) async fn systemone(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    locked(&s.metrics).request("systemone");
    laya_errors(systemone_inner(&s, body, false).await)
}

/// `POST /v1/systemone/batch`: the same questions about several states.
pub(super) async fn systemone_batch(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    locked(&s.metrics).request("systemone_batch");
    laya_errors(systemone_inner(&s, body, true).await)
}

/// An error as the OpenAI object plus Laya's `detail` string.
pub(super) fn laya_errors(r: Result<Response, ApiError>) -> Response {
    match r {
        Ok(r) => r,
        Err(e) => {
            let mut body = e.body();
            body["detail"] = json!(e.message);
            let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut r = (status, Json(body)).into_response();
            if let Some(secs) = e.retry_after {
                r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
            }
            r
        }
    }
}

pub(super) fn unprocessable(message: String, code: Option<&'static str>) -> ApiError {
    ApiError {
        status: 422,
        code,
        ..ApiError::bad(message, None)
    }
}

/// Most states in one batch request.
pub(super) const MAX_BATCH_STATES: usize = 64;

pub(super) async fn systemone_inner(
    s: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    batch: bool,
) -> Result<Response, ApiError> {
    use snug_engine::decide::{self, MinConfidence};
    let body = body_bytes(body, s)?;
    let v: Value = api::parse(&body).map_err(|e| s.bad(e))?;
    let Some(obj) = v.as_object().filter(|o| o.contains_key("questions")) else {
        return Err(s.bad(ApiError::bad(
            "request body must be an object with a 'questions' field",
            None,
        )));
    };
    let states: Vec<String> = if batch {
        match obj.get("states") {
            Some(Value::Array(a)) if !a.is_empty() && a.len() <= MAX_BATCH_STATES && a.iter().all(|x| !x.is_null()) => {
                a.iter().map(crate::decide::state_text).collect()
            }
            _ => {
                return Err(s.bad(ApiError::bad(
                    format!("'states' must be a list of 1 to {MAX_BATCH_STATES} states"),
                    Some("states"),
                )))
            }
        }
    } else {
        match obj.get("state") {
            None | Some(Value::Null) => return Err(s.bad(ApiError::bad("'state' is required", Some("state")))),
            Some(v) => vec![crate::decide::state_text(v)],
        }
    };
    let questions =
        decide::parse_questions(&obj["questions"]).map_err(|e| s.bad(unprocessable(e.to_string(), None)))?;
    let min = match obj.get("min_confidence") {
        None | Some(Value::Null) => None,
        Some(m) => Some(MinConfidence::parse(m).map_err(|e| s.bad(unprocessable(e.to_string(), None)))?),
    };
    let t0 = Instant::now();
    let mut results = Vec::with_capacity(states.len());
    let mut total = 0;
    for state in states {
        let (scored, usage) = decide_one(s, state, questions.clone()).await?;
        total += usage.input_tokens;
        results.push(decide::response_json(&s.model_id, &scored, &usage, min.as_ref()));
    }
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let body = if batch {
        json!({"results": results, "total_usage": {"input_tokens": total, "output_tokens": 0}})
    } else {
        results.pop().expect("one state")
    };
    let mut r = Json(body).into_response();
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&format!("inference;dur={ms:.1}")) {
        h.insert("server-timing", v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("{ms:.1}")) {
        h.insert("x-inference-time-ms", v);
    }
    Ok(r)
}

/// One state's questions, answered by the engine loop.
pub(super) async fn decide_one(
    s: &Arc<AppState>,
    state: String,
    questions: Vec<snug_engine::decide::Question>,
) -> Result<(Vec<snug_engine::decide::Scored>, snug_engine::decide::DecideUsage), ApiError> {
    use snug_engine::decide::DecideError;
    if s.draining.load(Ordering::SeqCst) {
        return Err(unavailable("the server is shutting down", 5));
    }
    let (reply, answer) = tokio::sync::oneshot::channel();
    let job = DecideJob {
        state,
        questions,
        reply,
    };
    if locked(&s.jobs).send(Msg::Decide(job)).is_err() {
        return Err(unavailable("the engine has stopped", 5));
    }
    match answer.await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e @ DecideError::TooLong { .. })) => {
            Err(s.bad(unprocessable(e.to_string(), Some("context_length_exceeded"))))
        }
        Ok(Err(e @ DecideError::Invalid(_))) => Err(s.bad(unprocessable(e.to_string(), None))),
        Ok(Err(e @ DecideError::OverBudget { .. })) => {
            locked(&s.metrics).rejected("never_fits");
            Err(unavailable(
                &format!("the request cannot fit in the KV memory budget: {e}"),
                30,
            ))
        }
        Ok(Err(DecideError::Engine(snug_engine::EngineError::Pages(e)))) => {
            Err(unavailable(&format!("no KV room for the questions now: {e}"), 1))
        }
        Ok(Err(e)) => Err(ApiError {
            status: 500,
            kind: "server_error",
            ..ApiError::bad(e.to_string(), None)
        }),
        Err(_) => Err(unavailable("the engine has stopped", 5)),
    }
}
