//! HTTP for pulls, over `ureq` (blocking, rustls with its own roots).
//!
//! Redirects are followed here rather than inside the client, hop by
//! hop, for two reasons. The hub answers a file's `resolve` URL with a
//! redirect to storage elsewhere, and it is on that first answer that it
//! publishes the file's SHA-256 (`X-Linked-Etag`), size and commit; and
//! the bearer token must reach the endpoint's own host only, never the
//! storage host a redirect names. A `Range` header, in contrast, goes
//! along on every hop.

use std::io::Read;
use std::time::Duration;

use ureq::http::{HeaderMap, Uri};

use super::HubOptions;
use crate::pull::PullError;

/// Redirects followed for one request at most.
const MAX_REDIRECTS: usize = 10;

pub(super) struct Client {
    agent: ureq::Agent,
    /// The endpoint's scheme, host and port: where the token goes.
    origin: Option<Origin>,
    token: Option<String>,
}

#[derive(PartialEq, Eq)]
struct Origin {
    scheme: String,
    host: String,
    port: u16,
}

impl Origin {
    fn of(url: &str) -> Option<Origin> {
        let uri: Uri = url.parse().ok()?;
        let scheme = uri.scheme_str()?.to_ascii_lowercase();
        let port = uri.port_u16().unwrap_or(if scheme == "https" { 443 } else { 80 });
        Some(Origin {
            host: uri.host()?.to_ascii_lowercase(),
            scheme,
            port,
        })
    }
}

/// What the hub says about a file on the answer to its `resolve` URL.
#[derive(Clone, Debug, Default)]
pub(super) struct HubHeaders {
    /// The SHA-256 of an LFS file (`X-Linked-Etag`, or the `ETag` of a
    /// file the hub serves itself), when it has that form.
    pub sha256: Option<String>,
    pub size: Option<u64>,
    pub commit: Option<String>,
}

/// An answer after redirects.
pub(super) struct Answer {
    /// The URL that gave it.
    pub url: String,
    pub status: u16,
    headers: HeaderMap,
    /// What the endpoint's host said on the way, and whether it was on
    /// the way at all.
    pub hub: HubHeaders,
    via_hub: bool,
    body: ureq::Body,
}

impl Client {
    pub fn new(options: &HubOptions) -> Result<Client, PullError> {
        let proxy = match &options.proxy {
            Some(p) => Some(proxy(p, options.no_proxy.as_deref())?),
            None => None,
        };
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .proxy(proxy)
            .user_agent(concat!("snug/", env!("CARGO_PKG_VERSION")))
            // The bytes as stored: a `Range` counts them, and the
            // checksum is theirs.
            .accept_encoding("identity")
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            .timeout_per_read(Some(Duration::from_secs(120)))
            .build()
            .new_agent();
        Ok(Client {
            agent,
            origin: Origin::of(options.endpoint()),
            token: options.token.clone().filter(|t| !t.is_empty()),
        })
    }

    fn is_hub(&self, url: &str) -> bool {
        self.origin.is_some() && Origin::of(url) == self.origin
    }

    /// `GET url`, from byte `from` on if given (with `If-Range: validator`
    /// if given), following redirects. Any status comes back as an
    /// [`Answer`]; a failure to reach the server is an error.
    pub fn get(&self, url: &str, from: Option<u64>, validator: Option<&str>) -> Result<Answer, PullError> {
        let mut url = url.to_string();
        let mut hub = HubHeaders::default();
        let mut via_hub = false;
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent.get(&url);
            if let Some(from) = from {
                req = req.header("Range", format!("bytes={from}-"));
                if let Some(v) = validator {
                    req = req.header("If-Range", v);
                }
            }
            let on_hub = self.is_hub(&url);
            if let (true, Some(token)) = (on_hub, &self.token) {
                req = req.header("Authorization", format!("Bearer {token}"));
            }
            let response = req.call().map_err(|e| PullError::Network {
                url: url.clone(),
                reason: describe(&e),
            })?;
            let (parts, body) = response.into_parts();
            let mut answer = Answer {
                url: url.clone(),
                status: parts.status.as_u16(),
                headers: parts.headers,
                hub: HubHeaders::default(),
                via_hub: false,
                body,
            };
            if on_hub {
                answer.learn(&mut hub);
                via_hub = true;
            }
            let redirect = matches!(answer.status, 301 | 302 | 303 | 307 | 308);
            match answer.header("location").filter(|_| redirect) {
                Some(location) => url = answer.resolve(location),
                None => {
                    answer.hub = hub;
                    answer.via_hub = via_hub;
                    return Ok(answer);
                }
            }
        }
        Err(PullError::Network {
            url,
            reason: format!("more than {MAX_REDIRECTS} redirects"),
        })
    }
}

/// A proxy for every request but those to the hosts `no_proxy` lists.
fn proxy(url: &str, no_proxy: Option<&str>) -> Result<ureq::Proxy, PullError> {
    let bad = |e: ureq::Error| PullError::BadName {
        name: url.to_string(),
        reason: format!("not a proxy URL ({e})"),
    };
    let p = ureq::Proxy::new(url).map_err(bad)?;
    let Some(list) = no_proxy else { return Ok(p) };
    let mut b = ureq::Proxy::builder(p.protocol()).host(p.host()).port(p.port());
    if let Some(u) = p.username() {
        b = b.username(u);
    }
    if let Some(pw) = p.password() {
        b = b.password(pw);
    }
    for host in list.split(',').map(str::trim).filter(|h| !h.is_empty()) {
        b = b.no_proxy(host);
    }
    b.build().map_err(bad)
}

fn describe(e: &ureq::Error) -> String {
    match e {
        ureq::Error::HostNotFound => "the host is not found (no network, or a wrong name)".to_string(),
        ureq::Error::ConnectionFailed => "the connection failed".to_string(),
        ureq::Error::Io(io) => format!("connection failed: {io}"),
        ureq::Error::Timeout(t) => format!("timed out ({t})"),
        other => other.to_string(),
    }
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)?.to_str().ok()
    }

    fn learn(&self, hub: &mut HubHeaders) {
        let sha = self
            .header("x-linked-etag")
            .or_else(|| self.header("etag"))
            .map(unquote)
            .filter(|s| super::is_sha256(s));
        if let Some(s) = sha {
            hub.sha256 = Some(s.to_string());
        }
        if let Some(n) = self.header("x-linked-size").and_then(|v| v.trim().parse().ok()) {
            hub.size = Some(n);
        }
        if let Some(c) = self.header("x-repo-commit").filter(|c| c.len() <= 64) {
            hub.commit = Some(c.trim().to_string());
        }
    }

    /// The SHA-256 in this answer's `X-Linked-Etag`, the hub's way of
    /// publishing a file's checksum on any URL of it.
    pub fn linked_sha256(&self) -> Option<String> {
        self.header("x-linked-etag")
            .map(unquote)
            .filter(|s| super::is_sha256(s))
            .map(str::to_string)
    }

    /// `target` (absolute, or relative to this answer's URL) as a URL.
    pub fn resolve(&self, target: &str) -> String {
        join(&self.url, target)
    }

    /// A validator for `If-Range`: a strong `ETag`, else `Last-Modified`.
    pub fn validator(&self) -> Option<String> {
        self.header("etag")
            .filter(|e| !e.starts_with("W/"))
            .or_else(|| self.header("last-modified"))
            .map(|v| v.trim().to_string())
    }

    /// `(first byte, total size)` of a 206's `Content-Range: bytes a-b/n`.
    pub fn content_range(&self) -> Option<(u64, Option<u64>)> {
        let v = self.header("content-range")?.trim().strip_prefix("bytes")?.trim();
        let (range, total) = v.split_once('/')?;
        let total = total.trim().parse().ok();
        let (first, _) = range.split_once('-')?;
        Some((first.trim().parse().ok()?, total))
    }

    /// The total size of a 416's `Content-Range: bytes */n`.
    pub fn unsatisfied_total(&self) -> Option<u64> {
        let v = self.header("content-range")?.trim().strip_prefix("bytes")?.trim();
        v.strip_prefix("*/")?.trim().parse().ok()
    }

    pub fn content_length(&self) -> Option<u64> {
        self.header("content-length")?.trim().parse().ok()
    }

    /// This answer if it is a success, else the error its status means;
    /// `what` names the thing asked for.
    pub fn expect_ok(self, what: &str) -> Result<Answer, PullError> {
        if (200..300).contains(&self.status) {
            return Ok(self);
        }
        Err(self.into_error(what))
    }

    /// The error this answer's status means; `what` names the thing
    /// asked for.
    pub fn into_error(self, what: &str) -> PullError {
        let detail = match self.status {
            401 | 403 if self.via_hub => format!(
                "{what} is not found, or private or gated: a token with access to it goes in HF_TOKEN (HTTP {})",
                self.status
            ),
            401 | 403 => format!("access denied (HTTP {})", self.status),
            404 => format!("{what} is not found (HTTP 404)"),
            429 => match self.header("retry-after").map(str::trim) {
                Some(wait) if wait.len() < 40 => {
                    format!("too many requests (HTTP 429); the server asks to wait {wait} s")
                }
                _ => "too many requests (HTTP 429); try again later".to_string(),
            },
            s @ 500..=599 => format!("the server failed (HTTP {s}); try again later"),
            s => format!("the server answered HTTP {s}"),
        };
        PullError::Http {
            url: self.url,
            status: self.status,
            detail,
        }
    }

    /// The whole body, refused past `limit` bytes.
    pub fn read_all(self, limit: u64) -> Result<Vec<u8>, PullError> {
        let url = self.url;
        self.body
            .into_with_config()
            .limit(limit)
            .read_to_vec()
            .map_err(|e| PullError::Network {
                url,
                reason: format!("reading the answer: {}", describe(&e)),
            })
    }

    /// The body as a reader of the bytes as they arrive.
    pub fn into_reader(self) -> impl Read {
        self.body.into_reader()
    }
}

fn unquote(v: &str) -> &str {
    let v = v.trim();
    let v = v.strip_prefix("W/").unwrap_or(v);
    v.trim_matches('"')
}

/// `target` resolved against `base`: an absolute URL as it is, a
/// scheme-relative or absolute path on `base`'s host, a relative path
/// beside `base`'s.
fn join(base: &str, target: &str) -> String {
    if target.starts_with("http://") || target.starts_with("https://") {
        return target.to_string();
    }
    let Ok(uri) = base.parse::<Uri>() else {
        return target.to_string();
    };
    let scheme = uri.scheme_str().unwrap_or("https");
    if let Some(rest) = target.strip_prefix("//") {
        return format!("{scheme}://{rest}");
    }
    let authority = uri.authority().map(|a| a.as_str()).unwrap_or("");
    if target.starts_with('/') {
        return format!("{scheme}://{authority}{target}");
    }
    let path = uri.path();
    let dir = &path[..path.rfind('/').map_or(0, |i| i + 1)];
    let dir = if dir.is_empty() { "/" } else { dir };
    format!("{scheme}://{authority}{dir}{target}")
}

/// A repository path for a URL: each segment percent-encoded, the
/// slashes kept.
pub(super) fn encode_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_targets_resolve_against_the_url_that_gave_them() {
        let base = "http://127.0.0.1:8080/o/r/resolve/main/a/b.gguf";
        assert_eq!(join(base, "/cdn/x"), "http://127.0.0.1:8080/cdn/x");
        assert_eq!(join(base, "c.gguf"), "http://127.0.0.1:8080/o/r/resolve/main/a/c.gguf");
        assert_eq!(join(base, "https://cdn.example/x?sig=1"), "https://cdn.example/x?sig=1");
        assert_eq!(join(base, "//cdn.example/x"), "http://cdn.example/x");
    }

    #[test]
    fn paths_are_percent_encoded_but_keep_their_slashes() {
        assert_eq!(encode_path("dir/My Model+v2.gguf"), "dir/My%20Model%2Bv2.gguf");
    }
}
