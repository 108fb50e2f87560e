//! The virtio-serial port the agent is reached through, as async IO.
//!
//! The port outlives sessions: every session borrows it through a cheap clone of
//! [`PortIo`]. While the host side is disconnected a read returns 0 at once and again
//! and again, so after such a read the agent waits for SIGIO (the kernel raises it when
//! the host connects or data arrives) or a short timer instead of spinning.

use crate::error::InitError;
use crate::session::Channel;
use forkd_proto::AGENT_PORT_NAME;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::signal::unix::{signal, Signal, SignalKind};

/// How long to wait for the port to appear at start.
const APPEAR_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest wait between two reads while the host is away (in case a SIGIO is missed).
const IDLE_POLL: Duration = Duration::from_millis(50);

/// The open port.
#[derive(Debug)]
pub struct Port {
    fd: AsyncFd<File>,
    sigio: tokio::sync::Mutex<Signal>,
    path: PathBuf,
}

/// A handle on the port that sessions read and write through.
#[derive(Debug, Clone)]
pub struct PortIo(Arc<Port>);

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

impl Port {
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
        let io_err = |action, source| InitError::Io {
            action,
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| io_err("opening", e))?;
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
        // SAFETY: `file` owns its descriptor, moves into the AsyncFd and stays there,
        // unclosed, for the AsyncFd's whole life; File::as_raw_fd always returns it.
        let fd = unsafe { AsyncFd::register(file) }.map_err(|e| io_err("polling", e.into()))?;
        Ok(PortIo(Arc::new(Port {
            fd,
            sigio: tokio::sync::Mutex::new(sigio),
            path: path.to_path_buf(),
        })))
    }
}

impl PortIo {
    /// The device node.
    pub fn path(&self) -> &Path {
        &self.0.path
    }
}

impl Channel for PortIo {
    async fn idle(&mut self) -> bool {
        let mut sig = self.0.sigio.lock().await;
        tokio::select! {
            _ = sig.recv() => {}
            () = tokio::time::sleep(IDLE_POLL) => {}
        }
        true
    }
}

impl AsyncRead for PortIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.0.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|f| {
                let mut file: &File = f.get_ref();
                file.read(unfilled)
            }) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                // Not ready after all: readiness was cleared, poll again.
                Err(_would_block) => continue,
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
        loop {
            // While the host is away writes fail with EAGAIN and this waits until it
            // is back.
            let mut guard = ready!(self.0.fd.poll_write_ready(cx))?;
            match guard.try_io(|f| {
                let mut file: &File = f.get_ref();
                file.write(buf)
            }) {
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => continue,
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
