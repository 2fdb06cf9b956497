//! `snug serve` over loopback: the OpenAI routes, errors as OpenAI error
//! objects, the API key, cancellation, graceful shutdown, the official
//! `openai` Python client, and a load test under a KV budget that cannot
//! hold every request at once.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use snug_model::testing::model_path;

/// A running server; killed when dropped.
struct Server {
    child: Child,
    addr: String,
    stderr: std::sync::mpsc::Receiver<String>,
    /// The resident set's peak before the last `reset_peak_rss`.
    lifetime_peak: u64,
}

impl Server {
    fn start(model: &Path, args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_snug"))
            .arg("serve")
            .arg(model)
            .args(["--port", "0", "--threads", "2"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("snug serve starts");
        let (tx, rx) = std::sync::mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) else {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the server did not say where it listens");
            };
            if let Some(at) = line.find("http://") {
                let addr = line[at + 7..].split_whitespace().next().unwrap().to_string();
                return Server {
                    child,
                    addr,
                    stderr: rx,
                    lifetime_peak: 0,
                };
            }
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn get(&self, path: &str) -> Reply {
        http(&self.addr, "GET", path, &[], b"")
    }

    fn post(&self, path: &str, body: &Value) -> Reply {
        http(&self.addr, "POST", path, &[], body.to_string().as_bytes())
    }

    /// A gauge or counter from /metrics (the sum over matching lines).
    fn metric(&self, prefix: &str) -> f64 {
        self.get("/metrics")
            .body
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    fn status_bytes(&self, field: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kb: u64 = s
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap();
        kb * 1024
    }

    /// The resident set's high-water mark since start (or the last reset).
    fn peak_rss(&self) -> u64 {
        self.status_bytes("VmHWM:")
    }

    fn rss(&self) -> u64 {
        self.status_bytes("VmRSS:")
    }

    /// Starts the high-water mark again from the current resident set
    /// (Linux's `clear_refs` 5), remembering the peak so far.
    fn reset_peak_rss(&mut self) {
        self.lifetime_peak = self.lifetime_peak.max(self.peak_rss());
        std::fs::write(format!("/proc/{}/clear_refs", self.pid()), "5").unwrap();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of a server-sent event stream.
    fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }
}

/// One HTTP/1.1 exchange (the connection is closed after it).
fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    parse_reply(&raw)
}

fn parse_reply(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw);
    let (head, rest) = text.split_once("\r\n\r\n").expect("a header block");
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked { dechunk(rest) } else { rest.to_string() };
    Reply { status, headers, body }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn smollm2() -> Option<PathBuf> {
    model_path("smollm2-135m")
}

/// Prompts of mixed lengths from a real paragraph.
fn prompts() -> Vec<String> {
    let text = include_str!("../../snug-engine/src/calibration.txt");
    let words: Vec<&str> = text.split_whitespace().collect();
    (0..16)
        .map(|i| {
            let n = 8 + (i * 37) % 200;
            let start = (i * 13) % (words.len() / 2);
            let take: Vec<&str> = words.iter().cycle().skip(start).take(n).copied().collect();
            take.join(" ")
        })
        .collect()
}

fn completion(prompt: &str, max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

#[test]
fn routes_answer_as_openai_does_and_match_snug_run() {
    let Some(model) = smollm2() else { return };
    let jsonl = std::env::temp_dir().join(format!("snug-serve-metrics-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&jsonl);
    let s = Server::start(&model, &["--metrics-file", jsonl.to_str().unwrap()]);
    let models = s.get("/v1/models").json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(s.get("/health").json()["status"], "ok");

    // A completion equals `snug run` on the same prompt, greedy.
    let prompt = "The harbour town wakes before the sun. Fishing boats";
    let r = s.post("/v1/completions", &completion(prompt, 20));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let out = Command::new(env!("CARGO_BIN_EXE_snug"))
        .arg("run")
        .arg(&model)
        .args(["-p", prompt, "-n", "20", "--json", "--threads", "2"])
        .output()
        .unwrap();
    let run: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["choices"][0]["text"], run["text"]);
    assert_eq!(v["choices"][0]["finish_reason"], run["finish_reason"]);
    assert_eq!(v["usage"]["prompt_tokens"], run["prompt_tokens"]);
    assert_eq!(v["usage"]["completion_tokens"], 20);

    // Streaming gives the same text in chunks, then usage, then [DONE].
    let mut body = completion(prompt, 20);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, run["text"].as_str().unwrap());
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 20);

    // Chat: the template applied; a stop string ends it with "stop".
    let chat = json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12, "temperature": 0});
    let r = s.post("/v1/chat/completions", &chat);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let said = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let word = said.split_whitespace().nth(1).expect("two words").to_string();
    let mut stopped = chat.clone();
    stopped["stop"] = json!([word.clone()]);
    let v = s.post("/v1/chat/completions", &stopped).json();
    let cut = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(said.starts_with(cut) && !cut.contains(&word), "{cut:?} / {said:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let m = s.get("/metrics").body;
    for family in [
        "snug_generated_tokens_total",
        "snug_time_to_first_token_seconds_bucket",
        "snug_kv_pages{state=\"free\"}",
        "snug_memory_bytes{part=\"kv_reserved\"}",
        "snug_prefix_cache_total{event=\"hits\"}",
        "snug_speculation_rounds_total",
    ] {
        assert!(m.contains(family), "/metrics lacks {family}");
    }
    assert!(s.metric("snug_generated_tokens_total") >= 40.0);
    // The same numbers under vLLM's names, for routers that read those.
    assert_eq!(
        s.metric("vllm:generation_tokens_total{"),
        s.metric("snug_generated_tokens_total ")
    );
    assert_eq!(s.metric("vllm:num_requests_waiting{"), 0.0);
    let usage = s.metric("vllm:kv_cache_usage_perc{");
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    let m = s.get("/metrics").body;
    assert!(
        m.lines()
            .any(|l| l.starts_with("vllm:cache_config_info{block_size=") && l.ends_with("} 1")),
        "{m}"
    );
    assert!(m.contains("vllm:request_success_total{finished_reason=\"stop\""), "{m}");
    assert!(m.contains("vllm:time_to_first_token_seconds_count{model_name="), "{m}");

    // One JSON line per finished request.
    let lines: Vec<Value> = std::fs::read_to_string(&jsonl)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4, "{lines:?}");
    let first = &lines[0];
    assert_eq!(first["output_tokens"], 20);
    assert_eq!(first["prompt_tokens"], run["prompt_tokens"]);
    assert!(first["ttft_ms"].as_f64().unwrap() > 0.0);
    assert!(first["token_latency_ms"]["p50"].as_f64().unwrap() > 0.0);
    assert!(first["token_latency_ms"]["p99"].as_f64() >= first["token_latency_ms"]["p50"].as_f64());
    assert!(first["peak_kv_pages"].as_u64().unwrap() >= 1);
    assert!(first["speculation"]["mode"].is_string());
    assert!(lines
        .iter()
        .all(|l| l["reused_tokens"].is_u64() && l["queue_ms"].is_f64()));
    let _ = std::fs::remove_file(&jsonl);
}

#[test]
fn bad_requests_get_openai_error_objects() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--ctx", "64", "--max-body", "2KiB"]);
    let bad = |r: &Reply, status: u16, needle: &str| {
        assert_eq!(r.status, status, "{}", r.body);
        let e = &r.json()["error"];
        assert!(e["message"].as_str().unwrap().contains(needle), "{e}");
        assert!(e["type"].is_string(), "{e}");
    };
    bad(
        &http(&s.addr, "POST", "/v1/chat/completions", &[], b"{nope"),
        400,
        "not valid JSON",
    );
    bad(
        &s.post("/v1/chat/completions", &json!({"messages": 3})),
        400,
        "wrong type",
    );
    bad(
        &s.post("/v1/chat/completions", &json!({"messages": [], "max_tokens": 4})),
        400,
        "messages",
    );
    bad(
        &s.post("/v1/completions", &json!({"prompt": "hi", "top_p": 0})),
        400,
        "top_p",
    );
    bad(
        &s.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 0})),
        400,
        "max_tokens",
    );
    bad(
        &s.post("/v1/completions", &json!({"prompt": [1, 99999999]})),
        400,
        "vocabulary",
    );
    let long = "word ".repeat(100);
    let r = s.post("/v1/completions", &json!({"prompt": long}));
    bad(&r, 400, "maximum context length is 64");
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    let huge = json!({"prompt": "x".repeat(4096)});
    bad(&s.post("/v1/completions", &huge), 413, "");
    bad(&s.get("/v1/nothing"), 404, "no route");
    // What snug does not do is refused, never ignored.
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let r = s.post("/v1/completions", &json!({"prompt": "hi", "tools": tools}));
    bad(&r, 400, "chat/completions only");
    assert_eq!(r.json()["error"]["param"], "tools");
    let r = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "code_interpreter"}]}),
    );
    bad(&r, 400, "only tools of type");
    let r = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}),
    );
    bad(&r, 400, "response_format");
    let r = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "guided_regex": "(unclosed"}),
    );
    bad(&r, 400, "guided_regex: ");
    assert!(r.body.contains("unclosed group"), "{}", r.body);
    bad(
        &s.post("/v1/completions", &json!({"prompt": "hi", "mirostat": 2})),
        400,
        "\"mirostat\"",
    );
    bad(
        &s.post("/v1/completions", &json!({"prompt": "hi", "logit_bias": {"x": 1}})),
        400,
        "token ids",
    );
    bad(
        &s.post("/v1/completions", &json!({"prompt": "hi", "logit_bias": {"5": 200}})),
        400,
        "[-100, 100]",
    );
    bad(
        &s.post(
            "/v1/completions",
            &json!({"prompt": "hi", "logit_bias": {"99999999": 1}}),
        ),
        400,
        "outside the vocabulary",
    );
    // Fields that ask for nothing snug lacks are accepted.
    let fine = json!({"prompt": "Hello", "max_tokens": 3, "model": "any", "user": "u", "tools": [],
                      "tool_choice": "none", "response_format": {"type": "text"}});
    assert_eq!(s.post("/v1/completions", &fine).status, 200);
    // The server is still fine.
    assert_eq!(s.post("/v1/completions", &completion("Hello", 3)).status, 200);
    assert!(s.metric("snug_requests_rejected_total{reason=\"bad_request\"}") >= 5.0);
}

#[test]
fn an_api_key_guards_every_route_but_health_and_the_page() {
    let Some(model) = smollm2() else { return };
    // Anything but loopback needs a key.
    let out = Command::new(env!("CARGO_BIN_EXE_snug"))
        .arg("serve")
        .arg(&model)
        .args(["--host", "0.0.0.0", "--port", "0"])
        .env_remove("SNUG_API_KEY")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: ") && err.contains("--api-key"), "{err}");

    let s = Server::start(&model, &["--api-key", "sesame"]);
    // The web page itself holds no data and asks for the key; what it
    // reads is guarded.
    let r = http(&s.addr, "GET", "/", &[], b"");
    assert_eq!(r.status, 200);
    assert!(r.body.contains("<title>snug</title>"));
    let r = http(&s.addr, "GET", "/ui/conversations", &[], b"");
    assert_eq!(r.status, 401);
    let body = completion("Hello", 2).to_string();
    let r = http(&s.addr, "POST", "/v1/completions", &[], body.as_bytes());
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let r = http(
        &s.addr,
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer wrong")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 401);
    let r = http(
        &s.addr,
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer sesame")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(s.get("/health").status, 200);
    assert_eq!(s.get("/metrics").status, 401);
}

#[test]
fn a_request_that_can_never_fit_gets_503_with_retry_after() {
    let Some(model) = smollm2() else { return };
    // 8 pages of 32 positions (SmolLM2, F16: 720 KiB a page).
    let s = Server::start(&model, &["--memory-budget", "5760KiB", "--guaranteed-output", "64"]);
    let long: String = prompts()[5].clone() + " " + &prompts()[6] + " " + &prompts()[7];
    let r = s.post("/v1/completions", &completion(&long, 100));
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.header("retry-after").is_some());
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("budget"));
    assert_eq!(s.post("/v1/completions", &completion("Hi", 4)).status, 200);
}

#[test]
fn a_client_that_goes_away_frees_its_pages() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--speculate", "off"]);
    let mut body = completion(&prompts()[3], 100_000);
    body["stream"] = json!(true);
    let body = body.to_string();
    let mut c = TcpStream::connect(&s.addr).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Read until a few chunks have come, then hang up.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while got.windows(6).filter(|w| w == b"data: ").count() < 5 {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(s.metric("snug_kv_pages{state=\"used\"}") > 0.0);
    drop(c);
    let deadline = Instant::now() + Duration::from_secs(60);
    // The gauges follow the counter within a step.
    while s.metric("snug_requests_finished_total{reason=\"cancelled\"}") < 1.0
        || s.metric("snug_kv_pages{state=\"used\"}") > 0.0
        || s.metric("snug_requests_running") > 0.0
    {
        assert!(
            Instant::now() < deadline,
            "the request was not cancelled, or kept its pages"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // A client waiting for a whole (non-streamed) answer hangs up too.
    let body = completion(&prompts()[4], 100_000).to_string();
    let mut c = TcpStream::connect(&s.addr).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    while s.metric("snug_requests_running") < 1.0 {
        assert!(Instant::now() < deadline, "the request never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(c);
    while s.metric("snug_requests_finished_total{reason=\"cancelled\"}") < 2.0
        || s.metric("snug_kv_pages{state=\"used\"}") > 0.0
    {
        assert!(
            Instant::now() < deadline,
            "the waiting client's request was not cancelled"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn shutdown_drains_running_requests() {
    let Some(model) = smollm2() else { return };
    let mut s = Server::start(&model, &[]);
    let addr = s.addr.clone();
    let client = std::thread::spawn(move || {
        let body = completion("Count with me: one, two, three,", 48).to_string();
        http(&addr, "POST", "/v1/completions", &[], body.as_bytes())
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.metric("snug_requests_running") < 1.0 {
        assert!(Instant::now() < deadline, "the request never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    let kill = Command::new("kill")
        .args(["-TERM", &s.pid().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let r = client.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["completion_tokens"], 48);
    let status = s.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let log: Vec<String> = s.stderr.try_iter().collect();
    assert!(log.iter().any(|l| l.contains("draining")), "{log:?}");
}

/// Runs `scripts/PACKAGE-client-check.py ARGS` with the Python that has
/// the official client libraries (`SNUG_OPENAI_PYTHON`, which scripts/test
/// sets up) and returns its stdout; `None` (the test skipped) only when no
/// such Python is named and models are not required.
fn client_check(package: &str, args: &[String]) -> Option<String> {
    let Some(python) = std::env::var_os("SNUG_OPENAI_PYTHON") else {
        assert!(
            std::env::var_os("SNUG_REQUIRE_MODELS").is_none(),
            "SNUG_OPENAI_PYTHON must name a python with the client packages for scripts/{package}-client-check.py (scripts/test installs one)"
        );
        eprintln!("skipping: SNUG_OPENAI_PYTHON is not set");
        return None;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../scripts/{package}-client-check.py"));
    let out = Command::new(python).arg(script).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn the_openai_python_client_drives_the_server() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--api-key", "k"]);
    let Some(out) = client_check("openai", &[format!("http://{}/v1", s.addr), "k".into()]) else {
        return;
    };
    assert!(out.contains("ok"), "{out}");
}

/// A free TCP port on this machine (for a socket the server binds itself).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `--kv-events`: a subscriber written from vLLM's documented event format
/// (pyzmq + msgpack) decodes every batch, recomputes each block hash from
/// its tokens, sees a shared prefix stored once and evicted pages
/// removed, and replays the batches from the start; in both wire forms.
#[test]
fn a_vllm_kv_event_subscriber_follows_the_prefix_cache() {
    let Some(model) = smollm2() else { return };
    for format in ["map", "array"] {
        let (publish, replay) = (free_port(), free_port());
        let s = Server::start(
            &model,
            &[
                "--memory-budget",
                "8MiB",
                "--guaranteed-output",
                "16",
                "--kv-events",
                &format!("tcp://*:{publish}"),
                "--kv-events-replay",
                &format!("tcp://*:{replay}"),
                "--kv-events-topic",
                "kv",
                "--kv-events-format",
                format,
            ],
        );
        let Some(out) = client_check(
            "kv-events",
            &[
                format!("http://{}/v1", s.addr),
                format!("tcp://127.0.0.1:{publish}"),
                format!("tcp://127.0.0.1:{replay}"),
                "kv".into(),
            ],
        ) else {
            return;
        };
        let v: Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(v["ok"], true, "{format}: {v}");
        assert!(v["removed"].as_u64().unwrap() > 0, "{format}: {v}");
        assert_eq!(v["batches"], v["replayed"], "{format}: {v}");
        assert_eq!(s.metric("snug_kv_events_dropped_total"), 0.0);
    }
}

/// Three replicas behind vllm-router (from PyPI) with its kv_aware policy,
/// which reads their KV events and their render route: the openai client,
/// pointed at the router, is answered by every replica, each request by
/// the one holding its prefix, with the answers a replica gives directly.
#[test]
fn replicas_behind_vllm_router_follow_their_kv_events() {
    let Some(model) = smollm2() else { return };
    let Some(python) = std::env::var_os("SNUG_OPENAI_PYTHON") else {
        assert!(
            std::env::var_os("SNUG_REQUIRE_MODELS").is_none(),
            "SNUG_OPENAI_PYTHON must name the python whose folder holds vllm-router (scripts/test installs it)"
        );
        eprintln!("skipping: SNUG_OPENAI_PYTHON is not set");
        return;
    };
    let router_bin = Path::new(&python).with_file_name("vllm-router");
    assert!(
        router_bin.exists(),
        "{} is missing (scripts/test installs it)",
        router_bin.display()
    );
    let mut replicas = Vec::new();
    let mut sources = Vec::new();
    for _ in 0..3 {
        let events = free_port();
        let s = Server::start(
            &model,
            &["--kv-page", "16", "--kv-events", &format!("tcp://*:{events}")],
        );
        sources.push(format!("http://{}=tcp://127.0.0.1:{events}", s.addr));
        replicas.push(s);
    }
    let port = free_port();
    let mut cmd = Command::new(&router_bin);
    cmd.args([
        "--port",
        &port.to_string(),
        "--prometheus-port",
        &free_port().to_string(),
    ])
    .args([
        "--policy",
        "kv_aware",
        "--kv-event-block-size",
        "16",
        "--kv-event-model",
        "snug",
    ])
    .arg("--worker-urls")
    .args(replicas.iter().map(|s| format!("http://{}", s.addr)));
    for src in &sources {
        cmd.args(["--kv-event-source", src]);
    }
    let mut router = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let up = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(up.elapsed() < Duration::from_secs(60), "the router did not start");
        assert!(router.try_wait().unwrap().is_none(), "the router exited");
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut args = vec![format!("http://127.0.0.1:{port}/v1")];
    args.extend(replicas.iter().map(|s| format!("http://{}", s.addr)));
    let out = client_check("router", &args);
    let _ = router.kill();
    let _ = router.wait();
    let v: Value = serde_json::from_str(out.unwrap().trim()).unwrap();
    assert_eq!(v["routed_to"], json!([0, 1, 2]), "{v}");
}

/// vLLM's render routes give the prompt a request runs on: the chat
/// route's ids are as many as the request's `prompt_tokens`, the
/// completion route's are `/tokenize`'s, and a bad request is refused
/// as the request itself would be.
#[test]
fn render_routes_give_the_prompt_tokens() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &[]);
    let chat = json!({"messages": [{"role": "user", "content": "Name a river."}], "max_tokens": 2});
    let r = s.post("/v1/chat/completions/render", &chat);
    assert_eq!(r.status, 200, "{}", r.body);
    let ids = r.json()["token_ids"].as_array().unwrap().len();
    let ran = s.post("/v1/chat/completions", &chat).json();
    assert_eq!(ran["usage"]["prompt_tokens"], ids);
    let r = s.post(
        "/v1/completions/render",
        &json!({"prompt": "Hello world", "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let tokenized = s.post("/tokenize", &json!({"content": "Hello world"})).json();
    assert_eq!(r.json()["token_ids"], tokenized["tokens"]);
    let bad = s.post("/v1/chat/completions/render", &json!({"messages": [], "max_tokens": 2}));
    assert_eq!(bad.status, 400);
    let bad = s.post("/v1/completions/render", &json!({"prompt": "x", "best_fit": true}));
    assert_eq!(bad.status, 400);
}

/// An event endpoint in use is a one-line error before the model loads.
#[test]
fn an_event_endpoint_in_use_is_a_clear_error() {
    let Some(model) = smollm2() else { return };
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = Command::new(env!("CARGO_BIN_EXE_snug"))
        .arg("serve")
        .arg(&model)
        .args(["--port", "0", "--kv-events", &format!("tcp://*:{port}")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("--kv-events tcp://*:{port}")), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Replicas sharing one `--prefix-cache-dir` (a network file system in a
/// real deployment): a conversation's second turn, sent to another replica
/// than its first, prefills only what is new (the earlier turn's pages are
/// read from the folder) and is answered exactly as a replica that never
/// saw the conversation answers it. Two replicas writing the same pages at
/// once leave files a third reads whole.
#[test]
fn a_conversation_moves_between_replicas_through_a_shared_cache_folder() {
    let Some(model) = smollm2() else { return };
    let dir = std::env::temp_dir().join(format!("snug-shared-prefix-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let shared = ["--prefix-cache-dir", dir.to_str().unwrap()];
    let (a, b) = (Server::start(&model, &shared), Server::start(&model, &shared));
    let system = "You are a careful assistant. Answer in one short sentence, and never use lists. \
                  Keep to the facts you are given and say so when you are unsure.";
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "Name a planet with rings."}),
    ];
    let ask = |s: &Server, messages: &[Value]| {
        let r = s.post(
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 24, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let first = ask(&a, &messages);
    messages.push(json!({"role": "assistant", "content": first}));
    messages.push(json!({"role": "user", "content": "And one without rings?"}));
    let second = ask(&b, &messages);
    assert!(b.metric("snug_prefix_cache_total{event=\"disk_reads\"}") > 0.0);
    assert!(b.metric("snug_prefix_cache_total{event=\"reused_tokens\"}") >= 64.0);
    let alone = Server::start(&model, &["--no-prefix-cache"]);
    assert_eq!(
        second,
        ask(&alone, &messages),
        "the moved turn's answer is the one computed from scratch"
    );

    // Both replicas write one new prompt's pages at the same time.
    let prompt =
        json!({"prompt": "Lorem ipsum dolor sit amet, consectetur adipiscing elit. ".repeat(12), "max_tokens": 2});
    std::thread::scope(|t| {
        for addr in [a.addr.clone(), b.addr.clone()] {
            let body = prompt.to_string();
            t.spawn(move || assert_eq!(http(&addr, "POST", "/v1/completions", &[], body.as_bytes()).status, 200));
        }
    });
    let c = Server::start(&model, &shared);
    assert_eq!(c.post("/v1/completions", &prompt).status, 200);
    let read = c.metric("snug_prefix_cache_total{event=\"disk_reads\"}");
    assert!(read >= 3.0, "the third replica read the pages the two wrote: {read}");
    let temps = std::fs::read_dir(&dir)
        .unwrap()
        .flat_map(|d| std::fs::read_dir(d.unwrap().path()).unwrap())
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".tmp"))
        .count();
    assert_eq!(temps, 0, "no temporary file is left");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The web chat page in a real headless browser: an answer streams in,
/// a long one is stopped part way and kept, and after a reload both
/// conversations are listed and open again (saved by the server).
#[test]
fn the_web_page_chats_in_a_headless_browser() {
    let Some(model) = smollm2() else { return };
    let browser = ["/usr/bin/chromium", "/usr/bin/chromedriver"];
    if !browser.iter().all(|p| Path::new(p).exists()) {
        assert!(
            std::env::var_os("SNUG_REQUIRE_MODELS").is_none(),
            "the browser test needs Debian's chromium and chromium-driver (scripts/test installs them)"
        );
        eprintln!("skipping: no chromium and chromedriver");
        return;
    }
    let chats = std::env::temp_dir().join(format!("snug-serve-chats-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&chats);
    let s = Server::start(&model, &["--chats-dir", chats.to_str().unwrap()]);
    let Some(out) = client_check("browser", &[format!("http://{}", s.addr)]) else {
        return;
    };
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(v["stream_states"].as_u64().unwrap() >= 3, "{v}");
    assert_eq!(v["titles"].as_array().unwrap().len(), 2, "{v}");
    // The conversations are files in the folder, each a whole JSON object.
    let files: Vec<_> = std::fs::read_dir(&chats).unwrap().flatten().collect();
    assert_eq!(files.len(), 2);
    for f in files {
        let c: Value = serde_json::from_slice(&std::fs::read(f.path()).unwrap()).unwrap();
        assert_eq!(c["messages"].as_array().unwrap().len(), 2, "{c}");
    }
    // The page's store refuses ids that could name other files.
    let r = http(&s.addr, "GET", "/ui/conversations/..%2Fx", &[], b"");
    assert_eq!(r.status, 400, "{}", r.body);
    let r = http(&s.addr, "PUT", "/ui/conversations/a", &[], b"{\"messages\": 3}");
    assert_eq!(r.status, 400, "{}", r.body);
    let _ = std::fs::remove_dir_all(&chats);
}

/// `parse()` with Pydantic models, JSON mode, a constrained answer equal
/// alone and batched, and tool calls (required, named, auto; streamed and
/// not; a result sent back), through the `openai` client on every model.
#[test]
fn structured_output_and_tool_calls_through_the_openai_client() {
    for alias in snug_model::testing::MODELS {
        let Some(model) = model_path(alias) else { continue };
        let s = Server::start(&model, &[]);
        let Some(out) = client_check("structured", &[format!("http://{}/v1", s.addr), "--tools".into()]) else {
            return;
        };
        let v: Value = serde_json::from_str(&out).unwrap();
        eprintln!("{alias}: {v}");
        assert_eq!(v["parsed"].as_array().unwrap().len(), 4, "{v}");
        assert_eq!(v["batched_equal"], true, "{v}");
        assert!(!v["required"].as_array().unwrap().is_empty(), "{v}");
        assert!(!v["responses_calls"].as_array().unwrap().is_empty(), "{v}");
    }
}

#[test]
fn the_ollama_python_client_drives_the_server() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--alias", "smollm2"]);
    let Some(out) = client_check("ollama", &[format!("http://{}", s.addr)]) else {
        return;
    };
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["model"], "smollm2");
    assert_eq!(v["details"]["family"], "llama");
    assert_eq!(v["details"]["quantization_level"], "Q4_1");
    assert!(v["format_schema"]["colour"].is_string(), "{v}");
    assert_eq!(v["embed_dims"], 576, "{v}");
    assert!(v["chat_chunks"].as_u64().unwrap() > 2, "{v}");
    // Raw generation is the plain greedy continuation `snug run` gives
    // (ollama's default repeat penalty of 1.1 aside, it starts the same).
    assert!(v["generate"].as_str().unwrap().starts_with(" Paris."), "{v}");
    drop(s);
    // Tool calls in ollama's shape, from a model whose template renders
    // tools (the script checks streamed calls equal whole ones).
    let Some(qwen) = model_path("qwen2.5-coder-0.5b") else {
        return;
    };
    let s = Server::start(&qwen, &[]);
    let out = client_check("ollama", &[format!("http://{}", s.addr)]).unwrap();
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["capabilities"], json!(["completion", "tools"]), "{v}");
    assert_eq!(v["tool_calls"][0]["name"], "get_weather", "{v}");
    assert!(v["tool_calls"][0]["arguments"]["city"].is_string(), "{v}");
}

#[test]
fn the_anthropic_python_client_drives_the_server() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--api-key", "k"]);
    let Some(out) = client_check("anthropic", &[format!("http://{}", s.addr), "k".into()]) else {
        return;
    };
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["streamed_equal"], true, "{v}");
    assert_eq!(v["stop_sequence"], "e", "{v}");
    assert_eq!(v["tool_use"][0]["name"], "get_weather", "{v}");
    // The same greedy answer as the OpenAI route gives the same messages.
    let r = http(
        &s.addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer k")],
        json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
               "max_tokens": 12, "temperature": 0})
        .to_string()
        .as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["message"]["content"], v["text"]);
}

/// 16 clients at once with mixed prompt lengths under a KV budget that
/// holds only a few of them: the rest queue (or, past the queue, get a
/// planned 503 and retry); none fails otherwise, the resident set grows
/// under the load by no more than the budget and a bounded overhead, and
/// every greedy completion equals the same request run alone.
#[test]
fn sixteen_clients_under_a_tight_budget_get_what_they_would_alone() {
    let Some(model) = smollm2() else { return };
    const BUDGET: u64 = 16 << 20;
    // Scratch, heap, the tokenizer, runtime and libraries.
    const OVERHEAD: u64 = 64 << 20;
    // What the load may add beyond the budget: scratch for the batch,
    // per-request heap (prompts, grammars, replies), connection buffers.
    const LOAD_OVERHEAD: u64 = 32 << 20;
    let mut s = Server::start(
        &model,
        &[
            "--memory-budget",
            "16MiB",
            "--max-queue",
            "6",
            "--guaranteed-output",
            "32",
            "--prefill-chunk",
            "64",
        ],
    );
    let prompts = prompts();
    // One request first, so that every weight page a forward reads is in;
    // then the peak is reset and the load's own growth is measured.
    let warm = s.post("/v1/completions", &completion(&prompts[0], 8));
    assert_eq!(warm.status, 200, "{}", warm.body);
    let before = s.rss();
    s.reset_peak_rss();
    let started = Instant::now();
    let workers: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let addr = s.addr.clone();
            let body = completion(p, 16 + (i % 3) * 8).to_string();
            std::thread::spawn(move || {
                let mut refusals = 0;
                loop {
                    let r = http(&addr, "POST", "/v1/completions", &[], body.as_bytes());
                    match r.status {
                        200 => return (r.json(), refusals),
                        503 => {
                            assert!(r.header("retry-after").is_some(), "{}", r.body);
                            refusals += 1;
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        other => panic!("status {other}: {}", r.body),
                    }
                }
            })
        })
        .collect();
    let results: Vec<(Value, usize)> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let together = started.elapsed();
    let refused: usize = results.iter().map(|r| r.1).sum();
    let queued = s.metric("snug_requests_queued_total");
    let peak = s.peak_rss();
    let ledger = s
        .get("/metrics")
        .body
        .lines()
        .filter(|l| l.starts_with("snug_memory_bytes"))
        .collect::<Vec<_>>()
        .join("; ");
    assert!(
        peak < before + BUDGET + LOAD_OVERHEAD,
        "under load the resident set grew from {before} to {peak}, over the budget {BUDGET} + {LOAD_OVERHEAD} ({ledger})"
    );
    // And at no time more than every mapped weight byte (the file and its
    // packed panels) + budget + overhead.
    let mapped = s.metric("snug_memory_bytes{part=\"weights_mapped\"}") as u64;
    assert!(mapped >= std::fs::metadata(&model).unwrap().len());
    let lifetime = s.lifetime_peak.max(peak);
    assert!(
        lifetime < mapped + BUDGET + OVERHEAD,
        "peak RSS {lifetime} exceeds mapped weights {mapped} + budget {BUDGET} + {OVERHEAD} ({ledger})"
    );
    assert!(queued + refused as f64 > 0.0, "the budget held every request at once");
    // Each request again, alone.
    for (i, (p, (got, _))) in prompts.iter().zip(&results).enumerate() {
        let alone = s.post("/v1/completions", &completion(p, 16 + (i % 3) * 8)).json();
        assert_eq!(
            got["choices"][0]["text"], alone["choices"][0]["text"],
            "request {i} differs under load"
        );
        for field in ["prompt_tokens", "completion_tokens"] {
            assert_eq!(got["usage"][field], alone["usage"][field], "request {i}");
        }
    }
    eprintln!(
        "16 clients: {:.1} s together, {queued} queued, {refused} planned 503s, peak RSS {} MiB ({} MiB before the load)",
        together.as_secs_f64(),
        peak >> 20,
        before >> 20
    );
    assert_eq!(s.metric("snug_requests_finished_total{reason=\"error\"}"), 0.0);
}

#[test]
fn a_leased_head_comes_back_with_the_same_logits() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--lease-head", "--prefill-chunk", "16", "--speculate", "off"]);
    let prompt = &prompts()[9];
    let leased = s.post("/v1/completions", &completion(prompt, 12)).json();
    assert!(
        s.metric("snug_lease_releases_total") >= 1.0,
        "no chunk ran without logits"
    );
    assert!(s.metric("snug_lease_returns_total") >= 1.0);
    assert!(s.metric("snug_lease_released_bytes_total") > 0.0);
    let plain = Server::start(&model, &["--prefill-chunk", "16", "--speculate", "off"]);
    let want = plain.post("/v1/completions", &completion(prompt, 12)).json();
    assert_eq!(leased["choices"][0]["text"], want["choices"][0]["text"]);
    assert_eq!(plain.metric("snug_lease_releases_total"), 0.0);
}

#[test]
fn systemone_answers_typed_questions_as_the_cli_does() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--ctx", "256"]);
    let request = json!({
        "state": "The parcel arrived two weeks late and the box was crushed. I want my money back.",
        "questions": {
            "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
            "mood": {"type": "choice", "instructions": "How does the customer feel?", "criteria": ["happy", "upset", "neutral"]},
            "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["low", "medium", "high"]},
        },
        "min_confidence": 0.99,
    });
    let r = s.post("/v1/systemone", &request);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.header("x-inference-time-ms").is_some());
    let v = r.json();
    let a = &v["answers"];
    assert_eq!(a["mood"]["type"], "choice");
    assert!(["happy", "upset", "neutral"].contains(&a["mood"]["choice"].as_str().unwrap()));
    let sum: f64 = a["mood"]["probabilities"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| p.as_f64().unwrap())
        .sum();
    assert!((sum - 1.0).abs() < 1e-3, "{sum}");
    let score = a["urgency"]["score"].as_f64().unwrap();
    assert!((0.0..=2.0).contains(&score));
    assert_eq!(a["urgency"]["legend"]["2"], "high");
    let noul = a["refund"]["noul"].as_f64().unwrap();
    assert_eq!(a["refund"]["probabilities"]["true"].as_f64().unwrap(), noul);
    // A threshold of 0.99 marks (but keeps) the answers below it.
    assert!(a
        .as_object()
        .unwrap()
        .values()
        .all(|x| x["abstention_threshold"] == 0.99));
    assert_eq!(v["usage"]["output_tokens"], 0);

    // The CLI gives the same numbers.
    let mut cli = Command::new(env!("CARGO_BIN_EXE_snug"))
        .arg("decide")
        .arg(&model)
        .args(["--json", "--threads", "2", "--ctx", "256"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    cli.stdin
        .take()
        .unwrap()
        .write_all(request.to_string().as_bytes())
        .unwrap();
    let out = cli.wait_with_output().unwrap();
    assert!(out.status.success());
    let c: Value = serde_json::from_slice(&out.stdout).unwrap();
    for q in ["refund", "mood", "urgency"] {
        assert_eq!(c["answers"][q]["probabilities"], a[q]["probabilities"], "{q}");
    }

    // Errors: a bad question is a 422 naming it; an over-long state is a
    // capacity error naming the limit; a body without questions is a 400.
    let bad = s.post(
        "/v1/systemone",
        &json!({"state": "x", "questions": {"q": {"type": "vote", "instructions": "?"}}}),
    );
    assert_eq!(bad.status, 422, "{}", bad.body);
    assert!(bad.json()["detail"].as_str().unwrap().contains("unknown type"));
    let long = s.post(
        "/v1/systemone",
        &json!({"state": "word ".repeat(400), "questions": {"q": {"type": "noul", "instructions": "Is it long?"}}}),
    );
    assert_eq!(long.status, 422, "{}", long.body);
    assert!(long.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("the context holds 256"));
    assert_eq!(s.post("/v1/systemone", &json!({"state": "x"})).status, 400);
    assert!(s.metric("snug_decide_questions_total") >= 3.0);

    // The batch route: the same questions about several states, each
    // answered as alone.
    let mut batch = request.clone();
    batch.as_object_mut().unwrap().remove("state");
    batch["states"] = json!([request["state"], "Everything was perfect, thank you!"]);
    let b = s.post("/v1/systemone/batch", &batch);
    assert_eq!(b.status, 200, "{}", b.body);
    let b = b.json();
    assert_eq!(b["results"].as_array().unwrap().len(), 2);
    assert_eq!(b["results"][0]["answers"], v["answers"]);
    assert!(b["total_usage"]["input_tokens"].as_u64().unwrap() > v["usage"]["input_tokens"].as_u64().unwrap());
    assert_eq!(
        s.post("/v1/systemone/batch", &json!({"states": [], "questions": {}}))
            .status,
        400
    );
}

/// `/v1/decisions`: scored answers are `/v1/systemone`'s probabilities in
/// OpenAI's shape; generated answers are always one of the options (the
/// grammar admits nothing else), the same on a second ask; fields it
/// does not know are refused.
#[test]
fn decisions_score_as_systemone_does_and_generate_only_options() {
    for alias in ["smollm2-135m", "qwen2.5-coder-0.5b"] {
        let Some(model) = model_path(alias) else { continue };
        let s = Server::start(&model, &["--ctx", "1024"]);
        let state = "The parcel arrived two weeks late and the box was crushed. I want my money back.";
        let questions = json!({
            "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
            "mood": {"type": "choice", "instructions": "How does the customer feel?", "criteria": ["happy", "upset", "neutral"]},
            "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["low", "medium", "high"]},
        });
        let one = s.post("/v1/systemone", &json!({"state": state, "questions": questions}));
        assert_eq!(one.status, 200, "{}", one.body);
        let one = one.json();
        let r = s.post(
            "/v1/decisions",
            &json!({"model": "any", "messages": [{"role": "user", "content": state}], "questions": questions}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["object"], "decision");
        assert_eq!(v["method"], "score");
        assert!(v["id"].as_str().unwrap().starts_with("decision-"));
        let list = v["decisions"].as_array().unwrap();
        assert_eq!(list.len(), 3);
        for (i, d) in list.iter().enumerate() {
            assert_eq!(d["index"], i);
            let name = d["name"].as_str().unwrap();
            assert_eq!(
                d["probabilities"], one["answers"][name]["probabilities"],
                "{alias} {name}"
            );
        }
        let by = |n: &str| list.iter().find(|d| d["name"] == n).unwrap().clone();
        assert_eq!(by("mood")["answer"], one["answers"]["mood"]["choice"]);
        assert!(by("refund")["answer"].is_boolean());
        assert!(by("urgency")["answer"].as_u64().unwrap() <= 2);
        assert_eq!(v["usage"]["completion_tokens"], 0);
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 20);

        let gen = json!({"input": state, "questions": questions, "method": "generate"});
        let g = s.post("/v1/decisions", &gen);
        assert_eq!(g.status, 200, "{}", g.body);
        let g = g.json();
        eprintln!("{alias}: {}", g["decisions"]);
        for d in g["decisions"].as_array().unwrap() {
            let text = d["text"].as_str().unwrap();
            match d["type"].as_str().unwrap() {
                "choice" => {
                    assert!(["happy", "upset", "neutral"].contains(&text), "{d}");
                    assert_eq!(d["answer"], text);
                }
                "score" => {
                    assert!(["0", "1", "2"].contains(&text), "{d}");
                    assert_eq!(d["answer"].as_u64().unwrap().to_string(), text);
                }
                _ => {
                    assert!(["yes", "no"].contains(&text), "{d}");
                    assert_eq!(d["answer"], text == "yes");
                }
            }
            assert_eq!(d["finish_reason"], "stop", "{d}");
        }
        assert!(g["usage"]["completion_tokens"].as_u64().unwrap() >= 3);
        let again = s.post("/v1/decisions", &gen).json();
        assert_eq!(again["decisions"], g["decisions"]);

        for (body, status) in [
            (json!({"input": state, "questions": questions, "temperature": 1}), 400),
            (json!({"input": state, "questions": questions, "method": "vote"}), 400),
            (
                json!({"input": state, "questions": questions, "method": "generate", "min_confidence": 0.9}),
                400,
            ),
            (json!({"questions": questions}), 400),
            (
                json!({"input": state, "questions": {"q": {"type": "vote", "instructions": "?"}}}),
                422,
            ),
        ] {
            let r = s.post("/v1/decisions", &body);
            assert_eq!(r.status, status, "{body}: {}", r.body);
            assert!(r.json()["error"]["message"].is_string(), "{}", r.body);
        }
    }
}

#[test]
fn decisions_between_decode_steps_leave_a_stream_unchanged() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--speculate", "off"]);
    let prompt = &prompts()[2];
    let want = s.post("/v1/completions", &completion(prompt, 48)).json();
    let addr = s.addr.clone();
    let body = completion(prompt, 48).to_string();
    let stream = std::thread::spawn(move || http(&addr, "POST", "/v1/completions", &[], body.as_bytes()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.metric("snug_requests_running") < 1.0 {
        assert!(Instant::now() < deadline, "the request never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    for _ in 0..3 {
        let d = s.post(
            "/v1/systemone",
            &json!({"state": prompt, "questions": {"long": {"type": "noul", "instructions": "Is this text long?"}}}),
        );
        assert_eq!(d.status, 200, "{}", d.body);
    }
    let got = stream.join().unwrap().json();
    assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
}

fn laya_data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/laya")
}

#[test]
fn a_laya_checkpoint_is_served_as_the_reference_answers_it() {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(laya_data().join("reference.json")).unwrap()).unwrap();
    let s = Server::start(&laya_data().join("tiny-modernbert"), &[]);
    assert_eq!(s.get("/health").json()["status"], "ok");
    assert_eq!(s.get("/v1/models").json()["data"][0]["meta"]["kind"], "laya");
    let cases = reference["tiny-modernbert"]["cases"].as_array().unwrap();
    // Every case at once from its own client: the encoder thread batches
    // whatever is waiting, and each answer must still be the reference's.
    let addr = s.addr.clone();
    let replies: Vec<(Value, Reply)> = std::thread::scope(|sc| {
        let handles: Vec<_> = cases
            .iter()
            .map(|c| {
                let addr = &addr;
                sc.spawn(move || {
                    let body = c["request"].to_string();
                    (c.clone(), http(addr, "POST", "/v1/systemone", &[], body.as_bytes()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (case, r) in replies {
        let name = case["name"].as_str().unwrap();
        if let Some(err) = case.get("error") {
            assert_eq!(r.status, 422, "{name}: {}", r.body);
            assert_eq!(r.json()["detail"], *err, "{name}");
            continue;
        }
        assert_eq!(r.status, 200, "{name}: {}", r.body);
        assert!(r.header("x-inference-time-ms").is_some());
        let got = r.json();
        let want = &case["response"];
        for (q, a) in want["answers"].as_object().unwrap() {
            let g = &got["answers"][q];
            for key in ["choice", "type", "legend", "abstention"] {
                assert_eq!(g.get(key), a.get(key), "{name}/{q}: {key}");
            }
            for key in ["noul", "score", "confidence", "answer_confidence"] {
                if let Some(w) = a.get(key).and_then(Value::as_f64) {
                    assert!((g[key].as_f64().unwrap() - w).abs() <= 1.0001e-4, "{name}/{q}: {key}");
                }
            }
            if let Some(p) = a.get("probabilities").and_then(Value::as_object) {
                for (k, w) in p {
                    assert!((g["probabilities"][k].as_f64().unwrap() - w.as_f64().unwrap()).abs() <= 1.0001e-4);
                }
            }
        }
        assert_eq!(got["usage"], want["usage"], "{name}: usage");
    }
    // The batch route, and errors.
    let batch = s.post(
        "/v1/systemone/batch",
        &json!({"states": ["one text", {"k": "two"}], "questions": cases[0]["request"]["questions"]}),
    );
    assert_eq!(batch.status, 200, "{}", batch.body);
    assert_eq!(batch.json()["results"].as_array().unwrap().len(), 2);
    // Compressed bodies (Laya's Python SDK sends zstd): the same answer.
    let body = cases[0]["request"].to_string();
    let plain = s.post("/v1/systemone", &cases[0]["request"]).json();
    let z = ruzstd::encoding::compress_to_vec(body.as_bytes(), ruzstd::encoding::CompressionLevel::Fastest);
    let r = http(&s.addr, "POST", "/v1/systemone", &[("Content-Encoding", "zstd")], &z);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["answers"], plain["answers"]);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(body.as_bytes()).unwrap();
    let r = http(
        &s.addr,
        "POST",
        "/v1/systemone",
        &[("Content-Encoding", "gzip")],
        &gz.finish().unwrap(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["answers"], plain["answers"]);
    let r = http(
        &s.addr,
        "POST",
        "/v1/systemone",
        &[("Content-Encoding", "br")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 415, "{}", r.body);
    let r = http(
        &s.addr,
        "POST",
        "/v1/systemone",
        &[("Content-Encoding", "zstd")],
        b"not zstd at all",
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let bad = s.post(
        "/v1/systemone",
        &json!({"state": "x", "questions": {"q": {"type": "vote"}}}),
    );
    assert_eq!(bad.status, 422);
    assert!(bad.json()["detail"].as_str().unwrap().contains("unknown type"));
    let no_state = s.post("/v1/systemone", &json!({"questions": {}}));
    assert_eq!(no_state.status, 400);
    assert!(s.metric("snug_decide_questions_total") >= 20.0);
    drop(s);

    // The API key guards every route but /health.
    let k = Server::start(&laya_data().join("tiny-mmbert"), &["--api-key", "sekrit"]);
    assert_eq!(k.get("/health").status, 200);
    let r = k.post("/v1/systemone", &cases[0]["request"]);
    assert_eq!(r.status, 401, "{}", r.body);
    let r = http(
        &k.addr,
        "POST",
        "/v1/systemone",
        &[("Authorization", "Bearer sekrit")],
        cases[0]["request"].to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A sentence-embedding checkpoint served: the official `openai` and
/// `ollama` clients get the vectors sentence-transformers computes (the
/// reference the encoder's own test uses), inputs batched across clients
/// embed to the same bits as alone, and decoder-only routes are 404s.
#[test]
fn an_embedding_model_serves_the_reference_vectors_to_its_clients() {
    let Some(dir) = model_path("all-minilm-l6-v2") else {
        return;
    };
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../snug-model/tests/data");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("minilm-reference.json")).unwrap()).unwrap();
    let s = Server::start(&dir, &[]);
    let models = s.get("/v1/models").json();
    assert_eq!(models["data"][0]["meta"]["kind"], "sentence_embeddings", "{models}");
    assert_eq!(models["data"][0]["meta"]["dimensions"], 384);
    let texts = data.join("sentences.txt");
    let Some(out) = client_check(
        "embeddings",
        &[format!("http://{}", s.addr), texts.to_str().unwrap().to_string()],
    ) else {
        return;
    };
    let v: Value = serde_json::from_str(&out).unwrap();
    let want = reference["embeddings"].as_array().unwrap();
    let got = v["embeddings"].as_array().unwrap();
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g: Vec<f64> = g.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        let w: Vec<f64> = w.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        let dot: f64 = g.iter().zip(&w).map(|(a, b)| a * b).sum();
        let norms = g.iter().map(|a| a * a).sum::<f64>().sqrt() * w.iter().map(|a| a * a).sum::<f64>().sqrt();
        let worst = g.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(
            dot / norms > 0.999_999 && worst < 1e-5,
            "text {i}: {} {worst}",
            dot / norms
        );
    }
    let tokens: usize = reference["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_array().unwrap().len())
        .sum();
    assert_eq!(v["prompt_tokens"], tokens);

    // Eight clients at once, each with one text: the worker batches what
    // waits, and every vector is the one the text gets alone.
    let lines: Vec<String> = std::fs::read_to_string(&texts)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let alone: Vec<Value> = lines[..8]
        .iter()
        .map(|t| s.post("/v1/embeddings", &json!({"input": t})).json()["data"][0]["embedding"].clone())
        .collect();
    let addr = s.addr.clone();
    let together: Vec<Value> = std::thread::scope(|sc| {
        let hs: Vec<_> = lines[..8]
            .iter()
            .map(|t| {
                let addr = &addr;
                sc.spawn(move || {
                    let body = json!({"input": t}).to_string();
                    http(addr, "POST", "/v1/embeddings", &[], body.as_bytes()).json()["data"][0]["embedding"].clone()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(alone, together);

    // Token ids are inputs too; an id past the vocabulary is a 400.
    let ids = &reference["token_ids"][0];
    let r = s.post("/v1/embeddings", &json!({"input": ids}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["data"][0]["embedding"], alone[0]);
    let r = s.post("/v1/embeddings", &json!({"input": [[1, 99999999]]}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(s.post("/v1/embeddings", &json!({"input": []})).status, 400);
    assert_eq!(
        s.post("/v1/embeddings", &json!({"input": "x", "dimensions": 12}))
            .status,
        400
    );
    assert_eq!(s.post("/v1/chat/completions", &json!({"messages": []})).status, 404);
    assert!(
        s.metric("snug_embedding_inputs_total") >= 30.0,
        "{}",
        s.get("/metrics").body
    );
}

#[test]
fn a_body_declared_over_the_limit_is_refused_before_it_is_sent() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--max-body", "64KiB"]);
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    // Headers only: the declared megabyte never comes.
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n",
        s.addr
    );
    c.write_all(head.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = c.read_to_end(&mut raw);
    let r = parse_reply(&raw);
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "request_too_large");
    // Every 413 is counted, this one and one the body limit finds.
    let big = "x".repeat(80 * 1024);
    let r = s.post("/v1/completions", &json!({"prompt": big}));
    assert_eq!(r.status, 413);
    assert_eq!(s.metric("snug_requests_rejected_total{reason=\"too_large\"}"), 2.0);
}

#[test]
fn sigterm_does_not_wait_for_a_half_sent_request() {
    let Some(model) = smollm2() else { return };
    let mut s = Server::start(&model, &[]);
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let kill = Command::new("kill")
        .args(["-TERM", &s.pid().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            assert!(status.success(), "{status:?}");
            break;
        }
        assert!(Instant::now() < deadline, "still running 30 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(c);
}

#[test]
fn a_client_that_sends_its_request_slowly_is_disconnected() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--read-timeout", "2"]);
    let mut slow = Vec::new();
    for _ in 0..4 {
        let c = TcpStream::connect(&s.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        slow.push(c);
    }
    // One header line every half second: progress, but never a whole
    // request. Each connection is closed once its two seconds are up.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut closed = vec![false; slow.len()];
    let mut line = 0;
    while closed.iter().any(|c| !c) {
        assert!(
            Instant::now() < deadline,
            "slow connections still open after 30 s: {closed:?}"
        );
        for (c, done) in slow.iter_mut().zip(&mut closed) {
            if *done {
                continue;
            }
            let head = if line == 0 {
                "POST /v1/completions HTTP/1.1\r\n".to_string()
            } else {
                format!("X-Slow-{line}: 1\r\n")
            };
            let mut b = [0u8; 256];
            *done = c.write_all(head.as_bytes()).is_err()
                || match c.read(&mut b) {
                    Ok(_) => true, // end of stream, or an error answer before it
                    Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
                };
        }
        line += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(s.get("/health").status, 200);
}

#[test]
fn an_answer_that_takes_longer_than_the_read_timeout_is_not_cut() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--read-timeout", "1"]);
    let body = completion("Count with me: one, two, three,", 400);
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["usage"]["completion_tokens"], 400, "{}", r.body);
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let r = s.post("/v1/completions", &stream);
    assert_eq!(r.status, 200);
    assert!(r.body.contains("data: [DONE]"), "{}", r.body);
}

#[test]
fn systemone_over_the_memory_budget_is_503_never_fits_as_chat_is() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--memory-budget", "4MiB"]);
    let state = "The delivery was late and the box was damaged. ".repeat(40);
    let request = json!({
        "state": state,
        "questions": {"upset": {"type": "noul", "instructions": "Is the customer upset?"}},
    });
    let r = s.post("/v1/systemone", &request);
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("KV memory budget"), "{}", r.body);
    let chat = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": state}], "max_tokens": 4}),
    );
    assert_eq!(chat.status, 503, "{}", chat.body);
    assert_eq!(s.metric("snug_requests_rejected_total{reason=\"never_fits\"}"), 2.0);
}

#[test]
fn a_template_that_exhausts_memory_fails_its_request_and_the_server_goes_on() {
    let Some(model) = smollm2() else { return };
    let dir = std::env::temp_dir().join(format!("snug-serve-bomb-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bomb = dir.join("bomb.gguf");
    // ChatML, except that a conversation opening with "boom" doubles a
    // string 40 times.
    let doubling = concat!(
        "{% if messages[0]['content'] == 'boom' %}",
        "{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "{% else %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{% endif %}"
    );
    std::fs::write(
        &bomb,
        snug_model::testing::with_chat_template(&std::fs::read(&model).unwrap(), doubling),
    )
    .unwrap();
    let server = Server::start(&bomb, &[]);
    let chat = |text: &str| json!({"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0});
    let fine = server.post("/v1/chat/completions", &chat("hi"));
    assert_eq!(fine.status, 200, "{}", fine.body);
    let before = server.peak_rss();
    for _ in 0..2 {
        let r = server.post("/v1/chat/completions", &chat("boom"));
        assert_eq!(r.status, 400, "{}", r.body);
        let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(msg.contains("MiB of memory"), "{msg}");
    }
    // The server never held the string, and still answers.
    let after = server.peak_rss();
    assert!(
        after < before + (64 << 20),
        "peak RSS {} MiB, then {} MiB",
        before >> 20,
        after >> 20
    );
    let again = server.post("/v1/chat/completions", &chat("hi"));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json()["choices"], fine.json()["choices"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_cuts_requests_that_outlive_the_shutdown_timeout() {
    let Some(model) = smollm2() else { return };
    let mut s = Server::start(&model, &["--shutdown-timeout", "1", "--ctx", "4096"]);
    let addr = s.addr.clone();
    let client = std::thread::spawn(move || {
        let body = completion("Count with me: one, two, three,", 4000).to_string();
        let mut c = TcpStream::connect(&addr).unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        c.write_all(head.as_bytes()).unwrap();
        c.write_all(body.as_bytes()).unwrap();
        let mut answer = Vec::new();
        let _ = c.read_to_end(&mut answer);
        answer
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.metric("snug_requests_running") < 1.0 {
        assert!(Instant::now() < deadline, "the request never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    let signalled = Instant::now();
    let kill = Command::new("kill")
        .args(["-TERM", &s.pid().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(20),
            "still running 20 s after SIGTERM with --shutdown-timeout 1"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    let log: Vec<String> = s.stderr.try_iter().collect();
    assert!(log.iter().any(|l| l.contains("--shutdown-timeout")), "{log:?}");
    // The client's request was cut: no answer came.
    let answer = client.join().unwrap();
    assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
}

#[test]
fn connections_past_the_limit_wait_for_one_to_close() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--max-connections", "2", "--read-timeout", "120"]);
    let held: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(&s.addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    // A third connection is not served while two are held.
    let mut third = TcpStream::connect(&s.addr).unwrap();
    third.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    third
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut b = [0u8; 512];
    let waited = third.read(&mut b);
    assert!(
        matches!(&waited, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
        "answered past the limit: {waited:?}"
    );
    // Once one closes, it is.
    drop(held);
    third.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut answer = Vec::new();
    third.read_to_end(&mut answer).unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[test]
fn logit_bias_and_ignore_eos_steer_the_sampler() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &[]);
    let greedy = |extra: Value| {
        let mut body = json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let r = s.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let plain = greedy(json!({}));
    let text = plain["choices"][0]["text"].as_str().unwrap().to_string();
    // Ban the first token greedy picked: the answer changes.
    let tok = s.post("/tokenize", &json!({"content": text}));
    assert_eq!(tok.status, 200, "{}", tok.body);
    let first = tok.json()["tokens"][0].as_u64().unwrap();
    let banned = greedy(json!({"logit_bias": {first.to_string(): -100}}));
    assert_ne!(banned["choices"][0]["text"], plain["choices"][0]["text"], "{banned}");
    // A zero bias changes nothing.
    let zero = greedy(json!({"logit_bias": {first.to_string(): 0}}));
    assert_eq!(zero["choices"], plain["choices"]);
    // A chat answer that ends by itself goes on to max_tokens with ignore_eos.
    let chat = |ignore: bool| {
        let r = s.post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Say only the word yes."}],
                    "max_tokens": 48, "temperature": 0, "ignore_eos": ignore}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let ends = chat(false);
    assert_eq!(ends["choices"][0]["finish_reason"], "stop", "{ends}");
    let goes_on = chat(true);
    assert_eq!(goes_on["choices"][0]["finish_reason"], "length", "{goes_on}");
    assert_eq!(goes_on["usage"]["completion_tokens"], 48);
}

#[test]
fn tokenize_detokenize_and_one_model_answer_as_llama_server_does() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--alias", "smol"]);
    let text = "Hello, world! <|im_start|>";
    let r = s.post("/tokenize", &json!({"content": text}));
    assert_eq!(r.status, 200, "{}", r.body);
    let ids: Vec<u64> = r.json()["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    // The same ids as `snug tokenize --no-bos` (special text parsed).
    let out = Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(["tokenize", model.to_str().unwrap(), text, "--json", "--no-bos"])
        .output()
        .unwrap();
    let cli: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json!(ids), cli["ids"]);
    let pieces = s
        .post("/tokenize", &json!({"content": text, "with_pieces": true}))
        .json();
    let joined: String = pieces["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["piece"].as_str().unwrap())
        .collect();
    assert_eq!(joined, text);
    let back = s.post("/detokenize", &json!({"tokens": ids}));
    assert_eq!(back.json()["content"], text);
    assert_eq!(s.post("/detokenize", &json!({"tokens": [-1]})).status, 400);
    assert_eq!(s.post("/tokenize", &json!({"content": "x", "nope": 1})).status, 400);
    let one = s.get("/v1/models/smol");
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(one.json()["id"], "smol");
    let other = s.get("/v1/models/gpt-4");
    assert_eq!(other.status, 404);
    assert_eq!(other.json()["error"]["code"], "model_not_found");
}

#[test]
fn every_request_gets_an_access_log_line() {
    let Some(model) = smollm2() else { return };
    let s = Server::start(&model, &["--log-format", "json"]);
    assert_eq!(s.post("/v1/completions", &completion("Hello", 3)).status, 200);
    let mut streamed = completion("Hello there", 5);
    streamed["stream"] = json!(true);
    assert_eq!(s.post("/v1/completions", &streamed).status, 200);
    assert_eq!(s.get("/v1/nothing").status, 404);
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while lines.len() < 3 && Instant::now() < deadline {
        if let Ok(l) = s.stderr.recv_timeout(Duration::from_millis(200)) {
            if let Ok(v) = serde_json::from_str::<Value>(&l) {
                lines.push(v);
            }
        }
    }
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(lines[0]["method"], "POST");
    assert_eq!(lines[0]["path"], "/v1/completions");
    assert_eq!(lines[0]["status"], 200);
    assert_eq!(lines[0]["completion_tokens"], 3);
    assert!(lines[0]["duration_ms"].as_f64().unwrap() > 0.0);
    assert!(lines[0]["remote"].as_str().unwrap().starts_with("127.0.0.1:"));
    // A stream's line is written when its last event has gone out.
    assert_eq!(lines[1]["completion_tokens"], 5);
    assert_eq!(lines[2]["status"], 404);
    assert!(lines[2].get("completion_tokens").is_none());
}
