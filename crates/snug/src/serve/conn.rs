//! A request's connection, watched for a client that goes away.

use super::*;

/// A request's connection, to notice a client that hangs up while its
/// answer is being generated: HTTP/1 does not read the socket then, so
/// nothing else would tell.
#[derive(Clone, Copy, Debug)]
pub(super) struct Conn {
    fd: std::os::fd::RawFd,
}

impl Connected<IncomingStream<'_, tokio::net::TcpListener>> for Conn {
    fn connect_info(stream: IncomingStream<'_, tokio::net::TcpListener>) -> Conn {
        use std::os::fd::AsRawFd;
        Conn {
            fd: stream.io().as_raw_fd(),
        }
    }
}

impl Conn {
    /// Whether the peer has closed or reset the connection. (The socket
    /// stays open while its request is handled, so the descriptor is this
    /// connection's.)
    pub(super) fn hung_up(self) -> bool {
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
