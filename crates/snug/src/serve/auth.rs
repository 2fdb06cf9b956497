//! The API key: checked on every route but `/health` and the web page
//! itself (`GET /`, which holds no data and asks for the key), in constant
//! time.

use super::*;

/// Whether `req` may pass: no key is set, the route is /health or the
/// page at `/`, or it
/// sends `Authorization: Bearer KEY` or (as Anthropic's clients do)
/// `x-api-key: KEY`, compared in constant time.
pub(crate) fn key_ok(req: &Request, key: Option<&str>) -> bool {
    let Some(key) = key else { return true };
    let path = req.uri().path();
    if path == "/health" || (path == "/" && req.method() == axum::http::Method::GET) {
        return true;
    }
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let x_api_key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok());
    [bearer, x_api_key]
        .into_iter()
        .flatten()
        .any(|g| constant_time_eq(g.as_bytes(), key.as_bytes()))
}

/// The 401 for a missing or wrong key.
pub(crate) fn unauthorized() -> ApiError {
    ApiError {
        status: 401,
        message: "missing or wrong API key (send Authorization: Bearer KEY)".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("invalid_api_key"),
        retry_after: None,
    }
}

/// Checks the API key on every route but /health.
pub(super) async fn authorize(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if !key_ok(&req, s.api_key.as_deref()) {
        locked(&s.metrics).rejected("unauthorized");
        return unauthorized().into_response();
    }
    next.run(req).await
}

pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
