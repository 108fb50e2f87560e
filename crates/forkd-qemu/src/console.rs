//! The guest's serial console: QEMU serves it on a unix socket, and a task of the process
//! holding the VM copies it into a capped pair of files.
//!
//! Why not QEMU's `-serial file:`: the file grows as fast as the guest prints (~300 KB/s
//! under TCG, without end), and reading its tail meant reading all of it. Why a socket
//! rather than `-chardev ringbuf` + QMP `ringbuf-read`: the ring lives in QEMU's memory
//! and dies with it, while the console matters most once QEMU has exited (a guest panic,
//! a failed boot). Measured with QEMU 7.2 (TCG, a kernel panicking at boot):
//!
//! - no client connected: QEMU drops the output and the guest runs at full speed, so a
//!   guest can never fill the disk while no forkd process holds its VM;
//! - a reader connected right after QEMU starts gets the console from its first line;
//! - a client that connects and never reads stalls the guest (its console writes wait on
//!   the UART): the reader therefore never stops draining, even when writing the file
//!   fails.
//!
//! On disk: a [`CappedLog`] (`console.log` and `console.log.1`). A daemon that re-adopts
//! a running VM reconnects and appends to the same files.

use forkd_host::capped_log::CappedLog;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;

/// How long the reader waits for QEMU to create the console socket.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);

/// How often it retries meanwhile.
const CONNECT_RETRY: Duration = Duration::from_millis(5);

/// How long the exit of QEMU waits for the reader to copy the console's last bytes, so
/// that an error about the exit can show them.
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// The task copying a VM's console into its capped log; stopped when dropped (the VM
/// runs on, and QEMU drops its console output while nobody reads it).
pub(crate) struct Reader(tokio::task::AbortHandle);

impl Drop for Reader {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts copying the console served on `socket` into `log` (capped at `cap` bytes).
/// Returns the handle that stops it and the task, which ends when QEMU closes the socket.
pub(crate) fn spawn(
    socket: PathBuf,
    log: PathBuf,
    cap: u64,
) -> (Reader, tokio::task::JoinHandle<()>) {
    let task = tokio::spawn(async move {
        if let Err(e) = copy(&socket, &log, cap).await {
            tracing::debug!("console reader of {} ended: {e}", socket.display());
        }
    });
    (Reader(task.abort_handle()), task)
}

async fn copy(socket: &Path, log: &Path, cap: u64) -> std::io::Result<()> {
    let deadline = tokio::time::Instant::now() + CONNECT_TIMEOUT;
    let mut stream = loop {
        match UnixStream::connect(socket).await {
            Ok(s) => break s,
            Err(e) if tokio::time::Instant::now() > deadline => return Err(e),
            Err(_) => tokio::time::sleep(CONNECT_RETRY).await,
        }
    };
    let mut file = match CappedLog::open(log, cap) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!("cannot write the console log {}: {e}", log.display());
            None
        }
    };
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        // A failed write loses console lines, never stalls the guest: keep draining.
        if let Some(f) = &mut file {
            if let Err(e) = f.write(&buf[..n]) {
                tracing::warn!("writing the console log {} failed: {e}", log.display());
                file = None;
            }
        }
    }
}
