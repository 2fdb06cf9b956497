//! Chat templates rendered in a child process with its own memory limit.
//!
//! [`ChildRenderer`] is an [`Isolation`]: it starts a worker (a command
//! the program names, for `snug` its own binary with a hidden subcommand
//! that limits its address space and then calls [`serve_renders`]) and
//! sends it [`RenderRequest`]s over the worker's stdin, one frame each: a
//! little-endian `u32` length, then that many bytes of JSON. The worker
//! answers each with one frame, `{"ok": text}` or `{"err": {"kind",
//! "message"}}`. A worker compiles each template source once and keeps it.
//!
//! A render that exhausts the worker's memory aborts the worker; the
//! caller gets [`TemplateError::Memory`] and the next render starts a new
//! worker. A render that outlives the time limit has its worker killed
//! and gets [`TemplateError::Time`]. Workers are kept for the next render,
//! at most [`MAX_WORKERS`] alive at once (a render waits for one when all
//! are busy), and exit when their stdin closes, that is when the program
//! that started them ends, however it ends.
//!
//! Why a process and not a limit inside minijinja: minijinja's fuel counts
//! instructions, and a string that a loop doubles grows 2^n bytes in n
//! instructions; the allocator is shared with the rest of the program, so
//! the only memory limit that cannot be dodged is the kernel's on a
//! process.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::template::{ChatTemplate, Isolation, RenderRequest, TemplateError};

/// Largest frame either side accepts: a request carries a conversation
/// (bounded by the server's body limit), an answer at most
/// [`crate::template::MAX_RENDERED`] bytes of text.
const MAX_FRAME: usize = 256 << 20;

/// Compiled templates a worker keeps (a server has one; a worker that
/// is handed more forgets them all and starts again).
const MAX_CACHED: usize = 8;

/// Workers alive at once. A render waits for one when all are busy
/// (renders are short: the instruction budget stops one within about a
/// second), so that a burst of requests cannot start a process each.
const MAX_WORKERS: usize = 4;

#[derive(Serialize, Deserialize)]
enum Reply {
    #[serde(rename = "ok")]
    Ok(String),
    #[serde(rename = "err")]
    Err { kind: String, message: String },
}

fn reply_of(r: Result<String, TemplateError>) -> Reply {
    match r {
        Ok(text) => Reply::Ok(text),
        Err(e) => {
            let kind = match &e {
                TemplateError::Compile(_) => "compile",
                TemplateError::Budget => "budget",
                TemplateError::TooLong => "too_long",
                _ => "render",
            };
            let message = match e {
                TemplateError::Compile(m) | TemplateError::Render(m) => m,
                other => other.to_string(),
            };
            Reply::Err {
                kind: kind.to_string(),
                message,
            }
        }
    }
}

fn error_of(kind: &str, message: String) -> TemplateError {
    match kind {
        "compile" => TemplateError::Compile(message),
        "budget" => TemplateError::Budget,
        "too_long" => TemplateError::TooLong,
        _ => TemplateError::Render(message),
    }
}

fn write_frame(out: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&n| n as usize <= MAX_FRAME)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    out.write_all(&len.to_le_bytes())?;
    out.write_all(body)?;
    out.flush()
}

/// Reads one frame; `None` at a clean end of input.
fn read_frame(input: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match input.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "frame too large"));
    }
    let mut body = vec![0u8; len];
    input.read_exact(&mut body)?;
    Ok(Some(body))
}

/// The worker's loop: answers render frames from `input` on `output`
/// until `input` ends. Call it in a process whose memory is limited.
pub fn serve_renders(mut input: impl Read, mut output: impl Write) -> io::Result<()> {
    let mut compiled: HashMap<String, ChatTemplate> = HashMap::new();
    while let Some(frame) = read_frame(&mut input)? {
        let result = match serde_json::from_slice::<RenderRequest>(&frame) {
            Err(e) => Err(TemplateError::Render(format!("bad render request: {e}"))),
            Ok(req) => {
                if !compiled.contains_key(&req.source) {
                    if compiled.len() >= MAX_CACHED {
                        compiled.clear();
                    }
                    match ChatTemplate::new(&req.source) {
                        Ok(t) => {
                            compiled.insert(req.source.clone(), t);
                        }
                        Err(e) => {
                            write_frame(&mut output, &serde_json::to_vec(&reply_of(Err(e)))?)?;
                            continue;
                        }
                    }
                }
                req.render_here(&compiled[&req.source])
            }
        };
        write_frame(&mut output, &serde_json::to_vec(&reply_of(result))?)?;
    }
    Ok(())
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What went wrong talking to a worker.
enum Failure {
    /// The worker ended (or its pipe broke).
    Gone,
    /// No answer within the time limit.
    Late,
    /// Anything else, with a description.
    Other(String),
}

impl Worker {
    /// Waits until the worker's stdout can be read, or the deadline.
    fn wait_readable(&self, deadline: Instant) -> Result<(), Failure> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Failure::Late);
            }
            let mut fd = libc::pollfd {
                fd: self.stdout.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd, for a descriptor this worker owns.
            let n = unsafe { libc::poll(&mut fd, 1, ms) };
            if n > 0 {
                return Ok(());
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(Failure::Other(e.to_string()));
                }
            }
        }
    }

    fn read_exact_by(&mut self, buf: &mut [u8], deadline: Instant) -> Result<(), Failure> {
        let mut done = 0;
        while done < buf.len() {
            self.wait_readable(deadline)?;
            match self.stdout.read(&mut buf[done..]) {
                Ok(0) => return Err(Failure::Gone),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Err(Failure::Gone),
            }
        }
        Ok(())
    }

    fn call(&mut self, request: &[u8], deadline: Instant) -> Result<Reply, Failure> {
        write_frame(&mut self.stdin, request).map_err(|e| match e.kind() {
            io::ErrorKind::InvalidInput => Failure::Other("the conversation is too large to render".into()),
            _ => Failure::Gone,
        })?;
        let mut len = [0u8; 4];
        self.read_exact_by(&mut len, deadline)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_FRAME {
            return Err(Failure::Other("the template worker sent a frame too large".into()));
        }
        let mut body = vec![0u8; len];
        self.read_exact_by(&mut body, deadline)?;
        serde_json::from_slice(&body).map_err(|e| Failure::Other(format!("the template worker's answer: {e}")))
    }
}

/// Renders in child processes: see the module's documentation.
pub struct ChildRenderer {
    program: std::path::PathBuf,
    args: Vec<String>,
    memory_mib: u64,
    timeout: Duration,
    pool: Mutex<Pool>,
    /// Signalled when a worker becomes idle or ends.
    freed: std::sync::Condvar,
}

/// The workers: those waiting for a render, and how many are alive.
struct Pool {
    idle: Vec<Worker>,
    live: usize,
}

impl ChildRenderer {
    /// Workers run `program args…`; `memory_mib` is the limit the worker
    /// sets on itself (reported in [`TemplateError::Memory`]); a render
    /// that takes longer than `timeout` is stopped.
    pub fn new(
        program: impl Into<std::path::PathBuf>,
        args: Vec<String>,
        memory_mib: u64,
        timeout: Duration,
    ) -> ChildRenderer {
        ChildRenderer {
            program: program.into(),
            args,
            memory_mib,
            timeout,
            pool: Mutex::new(Pool {
                idle: Vec::new(),
                live: 0,
            }),
            freed: std::sync::Condvar::new(),
        }
    }

    fn spawn(&self) -> Result<Worker, TemplateError> {
        let mut child = Command::new(&self.program)
            .args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| TemplateError::Isolation(format!("cannot start {}: {e}", self.program.display())))?;
        // Both pipes were asked for above, so both are there.
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(TemplateError::Isolation("the worker has no pipes".into()));
        };
        Ok(Worker { child, stdin, stdout })
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle worker, else a new one while fewer than [`MAX_WORKERS`]
    /// live, else the next to become idle; with whether it is new.
    fn acquire(&self) -> Result<(Worker, bool), TemplateError> {
        let mut pool = self.pool();
        loop {
            if let Some(w) = pool.idle.pop() {
                return Ok((w, false));
            }
            if pool.live < MAX_WORKERS {
                pool.live += 1;
                drop(pool);
                return match self.spawn() {
                    Ok(w) => Ok((w, true)),
                    Err(e) => {
                        self.ended();
                        Err(e)
                    }
                };
            }
            pool = self.freed.wait(pool).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn put_idle(&self, w: Worker) {
        self.pool().idle.push(w);
        self.freed.notify_one();
    }

    /// A worker has ended (and been dropped).
    fn ended(&self) {
        let mut pool = self.pool();
        pool.live = pool.live.saturating_sub(1);
        drop(pool);
        self.freed.notify_one();
    }

    /// Number of workers waiting for a render (for tests).
    pub fn idle_workers(&self) -> usize {
        self.pool().idle.len()
    }

    /// Number of workers alive (for tests).
    pub fn live_workers(&self) -> usize {
        self.pool().live
    }
}

impl Isolation for ChildRenderer {
    fn render(&self, request: &RenderRequest) -> Result<String, TemplateError> {
        let body = serde_json::to_vec(request).map_err(|e| TemplateError::Render(e.to_string()))?;
        // An idle worker may have gone since it last answered (killed from
        // outside); such a worker is replaced once, before the render is
        // blamed for anything.
        let (mut worker, mut fresh) = self.acquire()?;
        loop {
            let deadline = Instant::now() + self.timeout;
            match worker.call(&body, deadline) {
                Ok(reply) => {
                    self.put_idle(worker);
                    return match reply {
                        Reply::Ok(text) => Ok(text),
                        Reply::Err { kind, message } => Err(error_of(&kind, message)),
                    };
                }
                Err(Failure::Gone) => {
                    let status = exit_status(&mut worker);
                    drop(worker);
                    let aborted = status.is_some_and(|s| s.signal() == Some(libc::SIGABRT));
                    // The kernel's OOM killer, on a worker that was rendering.
                    let oom_killed = fresh && status.is_some_and(|s| s.signal() == Some(libc::SIGKILL));
                    if !aborted && !oom_killed && !fresh {
                        // In the place of the one that went.
                        fresh = true;
                        worker = match self.spawn() {
                            Ok(w) => w,
                            Err(e) => {
                                self.ended();
                                return Err(e);
                            }
                        };
                        continue;
                    }
                    self.ended();
                    return Err(if aborted || oom_killed {
                        TemplateError::Memory(self.memory_mib)
                    } else {
                        TemplateError::Isolation(match status {
                            Some(s) => format!("the template worker ended ({s})"),
                            None => "the template worker stopped answering".into(),
                        })
                    });
                }
                Err(Failure::Late) => {
                    drop(worker);
                    self.ended();
                    return Err(TemplateError::Time(self.timeout.as_secs().max(1)));
                }
                Err(Failure::Other(m)) => {
                    drop(worker);
                    self.ended();
                    return Err(TemplateError::Isolation(m));
                }
            }
        }
    }
}

/// How a worker that stopped answering ended, if it has.
fn exit_status(w: &mut Worker) -> Option<std::process::ExitStatus> {
    // The pipe closes as the process exits; give the kernel a moment to
    // make the status visible.
    for _ in 0..250 {
        match w.child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) => std::thread::sleep(Duration::from_millis(2)),
            Err(_) => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(source: &str) -> RenderRequest {
        RenderRequest {
            source: source.to_string(),
            messages: serde_json::json!([{"role": "user", "content": "hi"}]),
            add_generation_prompt: true,
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
            extra: serde_json::json!({}),
        }
    }

    fn frames(reqs: &[RenderRequest]) -> Vec<u8> {
        let mut input = Vec::new();
        for r in reqs {
            write_frame(&mut input, &serde_json::to_vec(r).unwrap()).unwrap();
        }
        input
    }

    fn replies(mut output: &[u8]) -> Vec<Reply> {
        let mut out = Vec::new();
        while let Some(f) = read_frame(&mut output).unwrap() {
            out.push(serde_json::from_slice(&f).unwrap());
        }
        out
    }

    #[test]
    fn the_worker_loop_answers_each_frame_in_order() {
        let good = request("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}");
        let bad = request("{% for m in messages %}");
        let raises = request("{{ raise_exception('no') }}");
        let mut output = Vec::new();
        serve_renders(&frames(&[good.clone(), bad, raises, good])[..], &mut output).unwrap();
        let r = replies(&output);
        assert_eq!(r.len(), 4);
        assert!(matches!(&r[0], Reply::Ok(t) if t == "[user]hi</s>"));
        assert!(matches!(&r[1], Reply::Err { kind, .. } if kind == "compile"));
        assert!(matches!(&r[2], Reply::Err { kind, message } if kind == "render" && message.contains("no")));
        assert!(matches!(&r[3], Reply::Ok(t) if t == "[user]hi</s>"));
    }

    #[test]
    fn a_frame_declared_too_large_ends_the_worker_with_an_error() {
        let mut input = Vec::new();
        input.extend_from_slice(&u32::MAX.to_le_bytes());
        let mut output = Vec::new();
        assert!(serve_renders(&input[..], &mut output).is_err());
        assert!(output.is_empty());
    }

    #[test]
    fn errors_keep_their_kind_across_the_pipe() {
        for e in [
            TemplateError::Compile("x".into()),
            TemplateError::Render("y".into()),
            TemplateError::Budget,
            TemplateError::TooLong,
        ] {
            let before = e.to_string();
            let Reply::Err { kind, message } = reply_of(Err(e)) else {
                panic!("an error became a text")
            };
            assert_eq!(error_of(&kind, message).to_string(), before);
        }
    }
}
