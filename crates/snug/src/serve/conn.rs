//! A request's connection, watched for a client that goes away.

use std::future::Future;

use super::*;

/// A request's connection, to notice a client that hangs up while its
/// answer is being generated: HTTP/1 does not read the socket then, so
/// nothing else would tell.
#[derive(Clone, Debug)]
pub(super) struct Conn {
    fd: std::os::fd::RawFd,
    /// Set while a request of this connection is being answered (see
    /// [`TimedIo`]).
    busy: Arc<AtomicBool>,
    /// The client's address.
    pub(super) peer: SocketAddr,
    /// Tokens of the request being answered, for its access-log line (one
    /// request at a time per HTTP/1 connection).
    usage: Arc<Mutex<Option<Usage>>>,
}

/// A generation's token counts.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Usage {
    pub(super) prompt: usize,
    pub(super) completion: usize,
    pub(super) cached: usize,
}

impl Connected<IncomingStream<'_, TimedListener>> for Conn {
    fn connect_info(stream: IncomingStream<'_, TimedListener>) -> Conn {
        use std::os::fd::AsRawFd;
        Conn {
            fd: stream.io().io.as_raw_fd(),
            busy: stream.io().busy.clone(),
            peer: *stream.remote_addr(),
            usage: Arc::new(Mutex::new(None)),
        }
    }
}

/// The server's TCP listener, whose connections must deliver each request
/// within a time limit ([`TimedIo`]).
pub(super) struct TimedListener {
    pub(super) inner: tokio::net::TcpListener,
    pub(super) timeout: std::time::Duration,
    /// One permit per open connection (`--max-connections`).
    pub(super) slots: Arc<tokio::sync::Semaphore>,
}

impl TimedListener {
    pub(super) fn new(
        inner: tokio::net::TcpListener,
        timeout: std::time::Duration,
        max_connections: u64,
    ) -> TimedListener {
        TimedListener {
            inner,
            timeout,
            slots: Arc::new(tokio::sync::Semaphore::new(
                (max_connections as usize).min(tokio::sync::Semaphore::MAX_PERMITS),
            )),
        }
    }
}

impl axum::serve::Listener for TimedListener {
    type Io = TimedIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TimedIo, SocketAddr) {
        // At the limit, accept nothing until a connection closes: the
        // semaphore is never closed, so the permit always comes.
        let slot = self.slots.clone().acquire_owned().await.ok();
        let (io, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        let mut io = TimedIo::new(io, self.timeout);
        io.slot = slot;
        (io, addr)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// A connection whose reads fail with `TimedOut` once the server has been
/// waiting for a request for `timeout`: a client has that long to send a
/// whole request, however it paces the bytes, and an idle connection is
/// closed after it. The clock starts at the first read that has to wait
/// and stops at the next write; it does not run while a request is being
/// answered (`busy`, set by [`answering`] from the request's start to the
/// end of its answer's body), when HTTP/1 may read only to notice a close.
pub(super) struct TimedIo {
    io: tokio::net::TcpStream,
    timeout: std::time::Duration,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    armed: bool,
    busy: Arc<AtomicBool>,
    /// This connection's place under `--max-connections`, given back when
    /// it closes.
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl TimedIo {
    fn new(io: tokio::net::TcpStream, timeout: std::time::Duration) -> TimedIo {
        TimedIo {
            io,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            armed: false,
            busy: Arc::new(AtomicBool::new(false)),
            slot: None,
        }
    }
}

impl tokio::io::AsyncRead for TimedIo {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = &mut *self;
        match std::pin::Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending if this.busy.load(Ordering::SeqCst) => {
                this.armed = false;
                Poll::Pending
            }
            Poll::Pending => {
                if !this.armed {
                    let at = tokio::time::Instant::now() + this.timeout;
                    this.deadline.as_mut().reset(at);
                    this.armed = true;
                }
                match this.deadline.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the client did not send a whole request in time",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl tokio::io::AsyncWrite for TimedIo {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.armed = false;
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.armed = false;
        std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl Conn {
    /// Notes the answered request's tokens for its access-log line.
    pub(super) fn record(&self, usage: Usage) {
        *self.usage.lock().unwrap_or_else(|p| p.into_inner()) = Some(usage);
    }

    /// Whether the peer has closed or reset the connection. (The socket
    /// stays open while its request is handled, so the descriptor is this
    /// connection's.)
    pub(super) fn hung_up(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.fd,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no timeout; poll only reads the
        // socket's state.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}

/// Marks the request's connection busy from here to the end of the
/// answer's body, so that its read deadline does not run meanwhile.
pub(super) async fn answering(req: Request, next: Next) -> Response {
    let Some(busy) = req.extensions().get::<ConnectInfo<Conn>>().map(|c| c.0.busy.clone()) else {
        return next.run(req).await;
    };
    busy.store(true, Ordering::SeqCst);
    let guard = Busy(busy);
    let (parts, body) = next.run(req).await.into_parts();
    let body = axum::body::Body::from_stream(tokio_stream::StreamExt::map(body.into_data_stream(), move |chunk| {
        let _ = &guard;
        chunk
    }));
    Response::from_parts(parts, body)
}

/// Clears a connection's busy flag when dropped (its answer's body done).
struct Busy(Arc<AtomicBool>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// How requests are logged (`--log-format`, `--no-access-log`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum AccessLog {
    Off,
    Text,
    Json,
}

/// One line on stderr per request once its answer's body is done (or the
/// client gone): method, path, status, tokens, time.
pub(super) async fn access_log(State(format): State<AccessLog>, req: Request, next: Next) -> Response {
    if format == AccessLog::Off {
        return next.run(req).await;
    }
    let conn = req.extensions().get::<ConnectInfo<Conn>>().map(|c| c.0.clone());
    if let Some(c) = &conn {
        *c.usage.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
    let line = LogLine {
        format,
        started: std::time::Instant::now(),
        method: req.method().to_string(),
        path: req.uri().path().chars().take(256).collect(),
        status: 0,
        conn,
    };
    let (parts, body) = next.run(req).await.into_parts();
    let mut line = line;
    line.status = parts.status.as_u16();
    let body = axum::body::Body::from_stream(tokio_stream::StreamExt::map(body.into_data_stream(), move |chunk| {
        let _ = &line;
        chunk
    }));
    Response::from_parts(parts, body)
}

/// Written when dropped, that is when the answer's body is done.
struct LogLine {
    format: AccessLog,
    started: std::time::Instant,
    method: String,
    path: String,
    status: u16,
    conn: Option<Conn>,
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let ms = self.started.elapsed().as_secs_f64() * 1e3;
        let peer = self.conn.as_ref().map(|c| c.peer.to_string()).unwrap_or_default();
        let usage = self
            .conn
            .as_ref()
            .and_then(|c| *c.usage.lock().unwrap_or_else(|p| p.into_inner()));
        let line = match self.format {
            AccessLog::Json => {
                let mut v = json!({
                    "time": unix_now_f64(),
                    "remote": peer,
                    "method": self.method,
                    "path": self.path,
                    "status": self.status,
                    "duration_ms": (ms * 10.0).round() / 10.0,
                });
                if let Some(u) = usage {
                    v["prompt_tokens"] = json!(u.prompt);
                    v["completion_tokens"] = json!(u.completion);
                    v["cached_tokens"] = json!(u.cached);
                }
                v.to_string()
            }
            _ => {
                let tokens = usage
                    .map(|u| format!(" tokens {}+{} (cached {})", u.prompt, u.completion, u.cached))
                    .unwrap_or_default();
                format!(
                    "{peer} \"{} {}\" {}{tokens} {ms:.1} ms",
                    self.method, self.path, self.status
                )
            }
        };
        eprintln!("{line}");
    }
}

fn unix_now_f64() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| (d.as_secs_f64() * 1e3).round() / 1e3)
}
