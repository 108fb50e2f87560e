//! The virtio-serial port the agent is reached through, as async IO.
//!
//! The port outlives sessions: the one [`PortIo`] is lent to each session in turn.
//!
//! Two behaviours of the port shape this code (both seen on a guest):
//! - while the host side is disconnected a read returns 0 at once, again and again, and a
//!   write fails with EAGAIN; so after such a read or write the agent waits for SIGIO (the
//!   kernel raises it when the host connects or data arrives) or a short timer instead of
//!   spinning;
//! - while the host is away, poll reports POLLHUP. Tokio takes a hang-up as final and
//!   from then on reports the descriptor ready forever, which turns every EAGAIN into a
//!   busy loop (on one vCPU it starves everything else). So once a hang-up was seen, the
//!   descriptor is registered afresh (a dup of it: same open file, so O_ASYNC and the
//!   SIGIO owner carry over) before its readiness is trusted again.

use crate::error::InitError;
use crate::session::Channel;
use forkd_proto::AGENT_PORT_NAME;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use std::fs::File;
use std::future::Future;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::time::Sleep;

/// How long to wait for the port to appear at start.
const APPEAR_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest wait between two tries while the host is away (in case a SIGIO is missed).
const IDLE_POLL: Duration = Duration::from_millis(50);

/// The open port, as async IO.
#[derive(Debug)]
pub struct PortIo {
    fd: AsyncFd<File>,
    /// Set when the registration saw a hang-up: its readiness is stuck on "ready".
    stale: bool,
    sigio: Signal,
    backoff: Option<Pin<Box<Sleep>>>,
    path: PathBuf,
}

/// Looks for the port named [`AGENT_PORT_NAME`] in sysfs; returns its device node.
fn find_port() -> Option<PathBuf> {
    let dir = std::fs::read_dir("/sys/class/virtio-ports").ok()?;
    for entry in dir.flatten() {
        let name = std::fs::read_to_string(entry.path().join("name")).unwrap_or_default();
        if name.trim_end() == AGENT_PORT_NAME {
            let node = Path::new("/dev").join(entry.file_name());
            if node.exists() {
                return Some(node);
            }
        }
    }
    None
}

fn register(file: File) -> io::Result<AsyncFd<File>> {
    // SAFETY: `file` owns its descriptor, moves into the AsyncFd and stays there,
    // unclosed, for the AsyncFd's whole life; File::as_raw_fd always returns it.
    unsafe { AsyncFd::register(file) }.map_err(io::Error::from)
}

fn hung_up(guard: &AsyncFdReadyGuard<'_, File>) -> bool {
    let r = guard.ready();
    r.is_read_closed() || r.is_write_closed()
}

impl PortIo {
    /// Waits (up to 10 s) for the agent port and opens it.
    pub async fn open() -> Result<PortIo, InitError> {
        let deadline = Instant::now() + APPEAR_TIMEOUT;
        let path = loop {
            if let Some(p) = find_port() {
                break p;
            }
            if Instant::now() >= deadline {
                return Err(InitError::NoAgentPort(AGENT_PORT_NAME));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        Self::open_path(&path)
    }

    fn open_path(path: &Path) -> Result<PortIo, InitError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|source| InitError::Io {
                action: "opening",
                path: path.to_path_buf(),
                source,
            })?;
        Self::from_file(file, path)
    }

    /// Wraps an open character device: non-blocking, SIGIO on, registered with tokio.
    fn from_file(file: File, path: &Path) -> Result<PortIo, InitError> {
        let io_err = |action, source| InitError::Io {
            action,
            path: path.to_path_buf(),
            source,
        };
        // The handler must exist before O_ASYNC is set: SIGIO's default action would
        // kill the agent.
        let sigio = signal(SignalKind::io()).map_err(|e| io_err("handling SIGIO for", e))?;
        let fd = file.as_raw_fd();
        // SAFETY: F_SETOWN on a file descriptor we own, with our own pid; it only
        // changes who receives SIGIO for it.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETOWN, libc::getpid()) };
        if rc < 0 {
            return Err(io_err(
                "setting the SIGIO owner of",
                io::Error::last_os_error(),
            ));
        }
        let flags =
            fcntl(fd, FcntlArg::F_GETFL).map_err(|e| io_err("reading the flags of", e.into()))?;
        let flags = OFlag::from_bits_truncate(flags) | OFlag::O_ASYNC | OFlag::O_NONBLOCK;
        fcntl(fd, FcntlArg::F_SETFL(flags)).map_err(|e| io_err("setting O_ASYNC on", e.into()))?;
        let fd = register(file).map_err(|e| io_err("polling", e))?;
        Ok(PortIo {
            fd,
            stale: false,
            sigio,
            backoff: None,
            path: path.to_path_buf(),
        })
    }

    /// The device node.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces a registration whose readiness is stuck after a hang-up.
    fn refresh(&mut self) -> io::Result<()> {
        if self.stale {
            let dup = self.fd.get_ref().try_clone()?;
            self.fd = register(dup)?;
            self.stale = false;
        }
        Ok(())
    }

    /// Ready on the next SIGIO or after [`IDLE_POLL`], whichever comes first: the wait
    /// while the host is away.
    fn poll_host(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let backoff = self
            .backoff
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(IDLE_POLL)));
        if backoff.as_mut().poll(cx).is_ready() || self.sigio.poll_recv(cx).is_ready() {
            self.backoff = None;
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

impl Channel for PortIo {
    async fn idle(&mut self) -> bool {
        std::future::poll_fn(|cx| self.poll_host(cx)).await;
        true
    }
}

impl AsyncRead for PortIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            this.refresh()?;
            let mut guard = ready!(this.fd.poll_read_ready(cx))?;
            let hup = hung_up(&guard);
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|f| {
                let mut file: &File = f.get_ref();
                file.read(unfilled)
            }) {
                // 0 bytes: the host is away, which the caller sees as end-of-file.
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                // EAGAIN means the host is there (else the read returns 0), so a fresh
                // registration reports true readiness.
                Err(_would_block) => this.stale |= hup,
            }
        }
    }
}

impl AsyncWrite for PortIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            let fresh = this.stale;
            this.refresh()?;
            let mut guard = ready!(this.fd.poll_write_ready(cx))?;
            let hup = hung_up(&guard);
            match guard.try_io(|f| {
                let mut file: &File = f.get_ref();
                file.write(buf)
            }) {
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) if hup => {
                    // An old hang-up: register afresh and try again at once. A hang-up
                    // seen by a fresh registration: the host is away now; wait for it.
                    this.stale = true;
                    if fresh {
                        ready!(this.poll_host(cx));
                    }
                }
                Err(_would_block) => {}
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    /// The port belongs to the agent, not to a session: a session ending does not close it.
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::children::Children;
    use crate::server::{AppState, Mode};
    use forkd_proto::handshake::{find_ready, hello, ReadyScan};
    use http_body_util::{BodyExt, Empty};
    use nix::sys::termios;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A pty stands in for the virtio port: a character device that the agent opens by
    /// path, with the test holding the other end (through the same IO type).
    #[tokio::test]
    async fn sessions_run_over_a_character_device() {
        let pty = nix::pty::openpty(None, None).expect("openpty");
        let mut raw = termios::tcgetattr(&pty.slave).expect("tcgetattr");
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(&pty.slave, termios::SetArg::TCSANOW, &raw).expect("tcsetattr");
        let slave_path = std::fs::read_link(format!("/proc/self/fd/{}", pty.slave.as_raw_fd()))
            .expect("slave path");
        let port = PortIo::open_path(&slave_path).expect("open the pty as the port");
        let state = AppState::new(Mode::Dev, Children::new());
        tokio::spawn(crate::session::serve_channel(port, state, "test"));

        let mut host =
            PortIo::from_file(File::from(pty.master), Path::new("ptmx")).expect("master");
        let nonce = "00112233445566778899aabbccddeeff";
        host.write_all(&hello(nonce)).await.expect("hello");
        let mut buf = Vec::new();
        let rest = loop {
            let mut chunk = [0u8; 1024];
            let n = host.read(&mut chunk).await.expect("read");
            buf.extend_from_slice(&chunk[..n]);
            if let ReadyScan::Found { end, .. } = find_ready(&buf, nonce) {
                break buf.split_off(end);
            }
        };
        let (mut send, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(forkd_proto::io::Rewind::new(rest, host)),
        )
        .await
        .expect("h2 handshake");
        tokio::spawn(conn);
        for _ in 0..3 {
            let req = axum::http::Request::get("http://agent/v1/ping")
                .body(Empty::<bytes::Bytes>::new())
                .expect("request");
            let resp = tokio::time::timeout(Duration::from_secs(10), send.send_request(req))
                .await
                .expect("answer within 10 s")
                .expect("response");
            assert_eq!(resp.status(), 200);
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            let ping: forkd_proto::PingResponse = serde_json::from_slice(&body).expect("ping");
            assert_eq!(ping.protocol, forkd_proto::PROTOCOL_VERSION);
        }
    }
}
