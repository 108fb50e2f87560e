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
//! On disk: `console.log` up to half of the cap, then renamed to `console.log.1` (the
//! older half is dropped), so the two files never hold more than the cap. A daemon that
//! re-adopts a running VM reconnects and appends to the same files.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
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

/// Most bytes read from the end of a log to find its last lines: error messages quote
/// a few dozen lines, never a whole log.
pub const TAIL_BYTES: u64 = 64 << 10;

/// An append-only log capped at `cap` bytes over two files: `path` holds up to `cap / 2`
/// bytes, then becomes `path.1` and a new `path` starts.
pub struct CappedLog {
    path: PathBuf,
    older: PathBuf,
    file: File,
    len: u64,
    half: u64,
}

impl CappedLog {
    /// Opens `path` for appending (it may hold what an earlier reader wrote).
    pub fn open(path: &Path, cap: u64) -> std::io::Result<CappedLog> {
        let half = (cap / 2).max(1);
        let older = rotated(path);
        // Files over half the cap were written under a larger one: they would break the
        // bound, so they go.
        for p in [path, older.as_path()] {
            if std::fs::metadata(p).is_ok_and(|m| m.len() > half) {
                std::fs::remove_file(p)?;
            }
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let len = file.metadata()?.len();
        Ok(CappedLog {
            path: path.to_owned(),
            older,
            file,
            len,
            half,
        })
    }

    /// Appends `data`, rotating whenever the current file is full.
    pub fn write(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        // Of a write larger than both files, only its end can stay.
        if data.len() as u64 > 2 * self.half {
            data = &data[data.len() - (2 * self.half) as usize..];
        }
        while !data.is_empty() {
            if self.len >= self.half {
                self.rotate()?;
            }
            let room = usize::try_from(self.half - self.len).unwrap_or(usize::MAX);
            let (now, rest) = data.split_at(room.min(data.len()));
            self.file.write_all(now)?;
            self.len += now.len() as u64;
            data = rest;
        }
        Ok(())
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        std::fs::rename(&self.path, &self.older)?;
        self.file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        self.len = 0;
        Ok(())
    }
}

/// `console.log` → `console.log.1`.
pub fn rotated(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".1");
    PathBuf::from(p)
}

/// The last `lines` lines of the log at `path` (and of its rotated part, when the current
/// file is shorter than that), read from at most [`TAIL_BYTES`] at the end, lossily
/// decoded. Missing files read as empty.
pub fn tail(path: &Path, lines: usize) -> String {
    let mut data = last_bytes(path, TAIL_BYTES);
    let missing = TAIL_BYTES - data.len() as u64;
    if missing > 0 {
        let mut older = last_bytes(&rotated(path), missing);
        older.append(&mut data);
        data = older;
    }
    let text = String::from_utf8_lossy(&data);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Up to `max` bytes from the end of `path`; empty when it cannot be read.
fn last_bytes(path: &Path, max: u64) -> Vec<u8> {
    let Ok(mut f) = File::open(path) else {
        return Vec::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(max);
    if f.seek(SeekFrom::Start(start)).is_err() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let _ = f.take(max).read_to_end(&mut out);
    out
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn on_disk(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum()
    }

    #[test]
    fn the_log_never_exceeds_its_cap_and_keeps_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let mut log = CappedLog::open(&path, 1000).unwrap();
        let mut written = Vec::new();
        for i in 0..2000 {
            let line = format!("line {i}\n");
            log.write(line.as_bytes()).unwrap();
            written.extend_from_slice(line.as_bytes());
            assert!(on_disk(dir.path()) <= 1000);
        }
        assert!(on_disk(dir.path()) > 500, "the older half is kept");
        let mut kept = std::fs::read(rotated(&path)).unwrap();
        kept.extend(std::fs::read(&path).unwrap());
        assert!(
            written.ends_with(&kept),
            "the files hold the last bytes, in order"
        );
        assert_eq!(tail(&path, 2), "line 1998\nline 1999");

        // One write far larger than the cap keeps its end.
        log.write(&[b'x'; 10_000]).unwrap();
        log.write(b"\nend\n").unwrap();
        assert!(on_disk(dir.path()) <= 1000);
        assert_eq!(tail(&path, 1), "end");
    }

    #[test]
    fn a_reopened_log_appends_within_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        CappedLog::open(&path, 100)
            .unwrap()
            .write(&[b'a'; 40])
            .unwrap();
        let mut log = CappedLog::open(&path, 100).unwrap();
        log.write(&[b'b'; 20]).unwrap();
        // 40 + 20 > 50: the first file was rotated when it filled.
        assert_eq!(std::fs::read(rotated(&path)).unwrap().len(), 50);
        assert!(on_disk(dir.path()) <= 100);

        // Reopened with a smaller cap: files over the new half do not survive.
        std::fs::write(&path, [b'c'; 80]).unwrap();
        let mut log = CappedLog::open(&path, 20).unwrap();
        log.write(b"d").unwrap();
        assert!(on_disk(dir.path()) <= 20, "{}", on_disk(dir.path()));
    }

    #[test]
    fn the_tail_reads_only_the_end_of_a_large_log() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.log");
        let mut f = File::create(&path).unwrap();
        // A 4 MiB line without end, then three lines.
        f.write_all(&vec![b'z'; 4 << 20]).unwrap();
        f.write_all(b"\none\ntwo\nthree\n").unwrap();
        drop(f);
        assert_eq!(tail(&path, 2), "two\nthree");
        let all = tail(&path, 100);
        assert!(all.len() as u64 <= TAIL_BYTES, "{}", all.len());
        assert!(all.ends_with("one\ntwo\nthree"));
        assert_eq!(tail(&dir.path().join("missing"), 5), "");
    }

    #[test]
    fn the_tail_spans_the_rotated_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        std::fs::write(rotated(&path), "old 1\nold 2\n").unwrap();
        std::fs::write(&path, "new 1\n").unwrap();
        assert_eq!(tail(&path, 2), "old 2\nnew 1");
    }
}
