//! A stand-in for the Hugging Face hub on loopback, for the pull tests:
//! it serves the hub's URL layout and can be told to fail.
//!
//! ```text
//! GET /api/models/O/R/tree/main?recursive=true[&cursor=K]   the listing (paged)
//! GET /O/R/resolve/main/PATH    LFS file: 302 to /cdn/O/R/PATH on the
//!                               storage port (another origin), with
//!                               X-Linked-Etag (SHA-256), X-Linked-Size, X-Repo-Commit;
//!                               git file: the bytes, ETag = a SHA-1
//! GET /cdn/O/R/PATH             the bytes; Range (206, 416), ETag = SHA-256
//! GET /files/PATH               a plain file: Range, If-Range, a strong ETag, no checksum
//! GET /moved/PATH               302 to /files/PATH (a path on the same host)
//! ```
//!
//! Every listing also holds a file whose path climbs out of the
//! repository (`../../escape-Q4_K_M.gguf`), which a pull must never pick.
//!
//! Two ports, the hub's and storage's, as the real hub redirects to
//! another host; one thread accepts on each, and each connection is one
//! request on a thread of its own, answered with `Connection: close`. Faults are queued per path and
//! taken once: an HTTP status, or a body cut off after some bytes. Every
//! request is logged with the headers the tests look at.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use sha2::{Digest, Sha256};

/// The commit the stand-in says every repository is at.
pub const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A request as the stand-in saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub path: String,
    pub range: Option<String>,
    pub if_range: Option<String>,
    pub authorization: Option<String>,
}

/// A failure to serve once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Answer with this status (a 429 says `Retry-After: 7`).
    Status(u16),
    /// Send the headers and this many bytes of the body, then close.
    CutAfter(usize),
    /// Answer 200 with a web page instead.
    Page,
}

struct File {
    bytes: Vec<u8>,
    lfs: bool,
    /// The SHA-256 the listing and headers publish.
    published: String,
}

#[derive(Default)]
struct State {
    repos: BTreeMap<String, BTreeMap<String, File>>,
    plain: BTreeMap<String, (Vec<u8>, String)>,
    faults: Vec<(String, Fault)>,
    token: Option<String>,
    page: Option<usize>,
    log: Vec<Request>,
}

/// The stand-in hub; stops when dropped.
pub struct FakeHub {
    /// The hub's address and storage's.
    addr: SocketAddr,
    storage: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

/// The SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

impl FakeHub {
    /// Starts serving on a free loopback port.
    pub fn start() -> io::Result<FakeHub> {
        let hub = TcpListener::bind("127.0.0.1:0")?;
        let storage = TcpListener::bind("127.0.0.1:0")?;
        let addrs = Addrs {
            hub: hub.local_addr()?,
            storage: storage.local_addr()?,
        };
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let threads = [hub, storage]
            .into_iter()
            .map(|listener| {
                let (s, st) = (state.clone(), stop.clone());
                std::thread::spawn(move || {
                    for conn in listener.incoming() {
                        if st.load(Ordering::SeqCst) {
                            break;
                        }
                        let Ok(conn) = conn else { continue };
                        let s = s.clone();
                        std::thread::spawn(move || {
                            let _ = serve(conn, &s, addrs);
                        });
                    }
                })
            })
            .collect();
        Ok(FakeHub {
            addr: addrs.hub,
            storage: addrs.storage,
            state,
            stop,
            threads,
        })
    }

    /// The base URL, as `HF_ENDPOINT` takes it.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Adds an LFS file (served through a redirect, checksum published).
    pub fn add_file(&self, repo: &str, path: &str, bytes: &[u8]) {
        self.add(repo, path, bytes, true);
    }

    /// Adds a file kept in git alone (served directly, no SHA-256).
    pub fn add_git_file(&self, repo: &str, path: &str, bytes: &[u8]) {
        self.add(repo, path, bytes, false);
    }

    fn add(&self, repo: &str, path: &str, bytes: &[u8], lfs: bool) {
        self.state().repos.entry(repo.to_string()).or_default().insert(
            path.to_string(),
            File {
                bytes: bytes.to_vec(),
                lfs,
                published: sha256_hex(bytes),
            },
        );
    }

    /// Makes the hub publish `sha256` for a file instead of its own.
    pub fn publish_sha256(&self, repo: &str, path: &str, sha256: &str) {
        if let Some(f) = self.state().repos.get_mut(repo).and_then(|r| r.get_mut(path)) {
            f.published = sha256.to_string();
        }
    }

    /// Serves `bytes` at `/files/PATH` with the validator `etag`.
    pub fn add_plain(&self, path: &str, bytes: &[u8], etag: &str) {
        self.state()
            .plain
            .insert(path.to_string(), (bytes.to_vec(), etag.to_string()));
    }

    /// The next request whose path contains `path` gets `fault`.
    pub fn fail_next(&self, path: &str, fault: Fault) {
        self.state().faults.push((path.to_string(), fault));
    }

    /// Listing and resolve want `Authorization: Bearer TOKEN`.
    pub fn require_token(&self, token: &str) {
        self.state().token = Some(token.to_string());
    }

    /// Listings come in pages of `n` entries.
    pub fn page_size(&self, n: usize) {
        self.state().page = Some(n.max(1));
    }

    /// The requests so far.
    pub fn requests(&self) -> Vec<Request> {
        self.state().log.clone()
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        let _ = TcpStream::connect(self.storage);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[derive(Clone, Copy)]
struct Addrs {
    hub: SocketAddr,
    storage: SocketAddr,
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// An answer to write.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Bytes of the body to send before closing, if cut.
    cut: Option<usize>,
}

impl Answer {
    fn new(status: u16, body: Vec<u8>) -> Answer {
        Answer {
            status,
            headers: Vec::new(),
            body,
            cut: None,
        }
    }

    fn header(mut self, k: &str, v: impl Into<String>) -> Answer {
        self.headers.push((k.to_string(), v.into()));
        self
    }
}

fn serve(mut conn: TcpStream, state: &Mutex<State>, addrs: Addrs) -> io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = conn.read(&mut buf)?;
        if n == 0 || head.len() > 64 << 10 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut lines = text.split("\r\n");
    let target = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("/")
        .to_string();
    let mut headers = BTreeMap::new();
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let request = Request {
        path: target.clone(),
        range: headers.get("range").cloned(),
        if_range: headers.get("if-range").cloned(),
        authorization: headers.get("authorization").cloned(),
    };
    let answer = {
        let mut s = lock(state);
        s.log.push(request.clone());
        let fault = s.faults.iter().position(|(p, _)| target.contains(p.as_str()));
        let fault = fault.map(|i| s.faults.remove(i).1);
        let mut answer = match fault {
            Some(Fault::Status(code)) => {
                let a = Answer::new(code, format!("{{\"error\":\"HTTP {code}\"}}").into_bytes());
                if code == 429 {
                    a.header("Retry-After", "7")
                } else {
                    a
                }
            }
            Some(Fault::Page) => Answer::new(200, b"<!DOCTYPE html><html>Not here</html>".to_vec()),
            _ => route(&s, &request, addrs),
        };
        if let Some(Fault::CutAfter(n)) = fault {
            answer.cut = Some(n);
        }
        answer
    };
    write_answer(&mut conn, answer)
}

fn route(s: &State, req: &Request, addrs: Addrs) -> Answer {
    let base = format!("http://{}", addrs.hub);
    let (path, query) = req.path.split_once('?').unwrap_or((&req.path, ""));
    let not_found = || Answer::new(404, b"{\"error\":\"Entry not found\"}".to_vec());
    let authorized = s
        .token
        .as_ref()
        .is_none_or(|t| req.authorization.as_deref() == Some(&format!("Bearer {t}")));
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        ["api", "models", o, r, "tree", "main"] => {
            if !authorized {
                return Answer::new(401, b"{\"error\":\"Invalid credentials\"}".to_vec());
            }
            let repo = format!("{o}/{r}");
            let Some(files) = s.repos.get(&repo) else {
                return not_found();
            };
            listing(files, &repo, query, s.page, &base)
        }
        [o, r, "resolve", "main", rest @ ..] => {
            if !authorized {
                return Answer::new(401, b"{\"error\":\"Invalid credentials\"}".to_vec());
            }
            let file_path = rest.join("/");
            let Some(f) = s.repos.get(&format!("{o}/{r}")).and_then(|fs| fs.get(&file_path)) else {
                return not_found();
            };
            if f.lfs {
                Answer::new(302, Vec::new())
                    .header("Location", format!("http://{}/cdn/{o}/{r}/{file_path}", addrs.storage))
                    .header("X-Linked-Etag", format!("\"{}\"", f.published))
                    .header("X-Linked-Size", f.bytes.len().to_string())
                    .header("X-Repo-Commit", COMMIT)
                    .header("ETag", "\"1111111111111111111111111111111111111111\"")
            } else {
                ranged(&f.bytes, "\"2222222222222222222222222222222222222222\"", req).header("X-Repo-Commit", COMMIT)
            }
        }
        ["cdn", o, r, rest @ ..] => match s.repos.get(&format!("{o}/{r}")).and_then(|fs| fs.get(&rest.join("/"))) {
            Some(f) => ranged(&f.bytes, &format!("\"{}\"", sha256_hex(&f.bytes)), req),
            None => not_found(),
        },
        ["moved", rest @ ..] => Answer::new(302, Vec::new()).header("Location", format!("/files/{}", rest.join("/"))),
        ["files", rest @ ..] => match s.plain.get(&rest.join("/")) {
            Some((bytes, etag)) => ranged(bytes, etag, req),
            None => not_found(),
        },
        _ => not_found(),
    }
}

fn listing(files: &BTreeMap<String, File>, repo: &str, query: &str, page: Option<usize>, base: &str) -> Answer {
    let mut entries = Vec::new();
    let mut dirs = std::collections::BTreeSet::new();
    for (path, f) in files {
        let mut d = path.as_str();
        while let Some((parent, _)) = d.rsplit_once('/') {
            dirs.insert(parent.to_string());
            d = parent;
        }
        let mut e = serde_json::json!({
            "type": "file",
            "oid": "3333333333333333333333333333333333333333",
            "size": f.bytes.len(),
            "path": path,
        });
        if f.lfs {
            e["lfs"] = serde_json::json!({"oid": f.published, "size": f.bytes.len(), "pointerSize": 134});
        }
        entries.push(e);
    }
    // What a hostile listing might hold: a path out of the repository.
    entries.push(serde_json::json!({
        "type": "file", "oid": "5555555555555555555555555555555555555555", "size": 4, "path": "../../escape-Q4_K_M.gguf",
        "lfs": {"oid": "6".repeat(64), "size": 4},
    }));
    for d in dirs {
        entries.push(serde_json::json!({"type": "directory", "oid": "4444444444444444444444444444444444444444", "size": 0, "path": d}));
    }
    let cursor: usize = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("cursor="))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let size = page.unwrap_or(entries.len().max(1));
    let end = (cursor + size).min(entries.len());
    let shown: Vec<_> = entries.get(cursor..end).unwrap_or_default().to_vec();
    let mut answer = Answer::new(200, serde_json::Value::Array(shown).to_string().into_bytes())
        .header("Content-Type", "application/json");
    if end < entries.len() {
        answer = answer.header(
            "Link",
            format!("<{base}/api/models/{repo}/tree/main?recursive=true&cursor={end}>; rel=\"next\""),
        );
    }
    answer
}

/// The bytes, or the range `Range` asks for (unless `If-Range` names
/// another version).
fn ranged(bytes: &[u8], etag: &str, req: &Request) -> Answer {
    let len = bytes.len();
    let from = req
        .range
        .as_deref()
        .filter(|_| req.if_range.as_deref().is_none_or(|v| v == etag))
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .and_then(|(a, _)| a.parse::<usize>().ok());
    let answer = match from {
        None => Answer::new(200, bytes.to_vec()),
        Some(a) if a >= len => return Answer::new(416, Vec::new()).header("Content-Range", format!("bytes */{len}")),
        Some(a) => {
            Answer::new(206, bytes[a..].to_vec()).header("Content-Range", format!("bytes {a}-{}/{len}", len - 1))
        }
    };
    answer.header("ETag", etag).header("Accept-Ranges", "bytes")
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        401 => "Unauthorized",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        _ => "Status",
    }
}

fn write_answer(conn: &mut TcpStream, a: Answer) -> io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        a.status,
        reason(a.status),
        a.body.len()
    );
    for (k, v) in &a.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes())?;
    let sent = a.cut.unwrap_or(a.body.len()).min(a.body.len());
    conn.write_all(&a.body[..sent])?;
    conn.flush()?;
    conn.shutdown(Shutdown::Both)
}
