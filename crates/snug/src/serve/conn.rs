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
}

impl Connected<IncomingStream<'_, TimedListener>> for Conn {
    fn connect_info(stream: IncomingStream<'_, TimedListener>) -> Conn {
        use std::os::fd::AsRawFd;
        Conn {
            fd: stream.io().io.as_raw_fd(),
            busy: stream.io().busy.clone(),
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
