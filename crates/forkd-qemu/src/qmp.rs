//! A small QMP client: QEMU's JSON control protocol over a unix socket.
//!
//! One reader task owns the socket's read half and routes each `{"return"|"error", "id"}`
//! to the command waiting for it; asynchronous events are kept in a broadcast channel.
//! Written here rather than taken from a crate: the part forkd needs is a page of code,
//! and the crates on offer pull in a generated binding of the whole QAPI schema.

use super::version::QemuVersion;
use forkd_hypervisor::HypervisorError;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{broadcast, oneshot};

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, HypervisorError>>>>>;

/// A connected, capability-negotiated QMP session.
pub struct Qmp {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Pending,
    next_id: AtomicU64,
    events: broadcast::Sender<Value>,
    reader: tokio::task::JoinHandle<()>,
    /// The version of the QEMU at the other end, as its greeting says (which can differ
    /// from the installed program's: the package may have been upgraded since it started).
    version: Option<QemuVersion>,
}

impl Qmp {
    /// Connects to the QMP socket at `path`, retrying until `timeout` while QEMU creates
    /// it, and negotiates capabilities. `alive` is polled between retries so that a QEMU
    /// that died is reported at once instead of after the timeout.
    pub async fn connect(
        path: &Path,
        timeout: Duration,
        mut alive: impl FnMut() -> Result<(), HypervisorError>,
    ) -> Result<Qmp, HypervisorError> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path).await {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    tracing::trace!("QMP not up yet: {e}");
                    alive()?;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err(_) => {
                    alive()?;
                    return Err(HypervisorError::ControlTimeout {
                        socket: path.display().to_string(),
                        secs: timeout.as_secs(),
                    });
                }
            }
        };
        let (read, write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();
        let greeting = tokio::time::timeout_at(deadline.into(), lines.next_line())
            .await
            .map_err(|_| HypervisorError::ControlTimeout {
                socket: path.display().to_string(),
                secs: timeout.as_secs(),
            })?
            .map_err(|e| HypervisorError::ControlClosed(e.to_string()))?
            .ok_or_else(|| HypervisorError::ControlClosed("no greeting".into()))?;
        let Some(version) = parse_greeting(&greeting) else {
            return Err(HypervisorError::ControlClosed(format!(
                "unexpected greeting: {greeting}"
            )));
        };
        let pending: Pending = Arc::default();
        let (events, _) = broadcast::channel(64);
        let reader = tokio::spawn(read_loop(lines, pending.clone(), events.clone()));
        let qmp = Qmp {
            writer: tokio::sync::Mutex::new(write),
            pending,
            next_id: AtomicU64::new(1),
            events,
            reader,
            version,
        };
        qmp.execute("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    /// The version of the QEMU this session talks to, if its greeting said.
    pub fn version(&self) -> Option<QemuVersion> {
        self.version
    }

    /// Runs one command and returns its `return` value.
    pub async fn execute(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, HypervisorError> {
        self.send(command, arguments, None).await
    }

    /// Runs one command with `fd` attached to it (SCM_RIGHTS), as `getfd` and `add-fd`
    /// expect. QEMU keeps its own duplicate; the caller may close `fd` afterwards.
    pub async fn execute_with_fd(
        &self,
        command: &str,
        arguments: Option<Value>,
        fd: BorrowedFd<'_>,
    ) -> Result<Value, HypervisorError> {
        self.send(command, arguments, Some(fd)).await
    }

    async fn send(
        &self,
        command: &str,
        arguments: Option<Value>,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Value, HypervisorError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut msg = json!({ "execute": command, "id": id });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        let mut line = msg.to_string();
        line.push('\n');
        let write = async {
            let mut w = self.writer.lock().await;
            let mut sent = 0;
            if let Some(fd) = fd {
                sent = send_with_fd(w.as_ref(), line.as_bytes(), fd).await?;
            }
            w.write_all(&line.as_bytes()[sent..]).await
        };
        if let Err(e) = write.await {
            lock(&self.pending).remove(&id);
            return Err(HypervisorError::ControlClosed(e.to_string()));
        }
        match rx.await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(HypervisorError::Control { class, desc, .. })) => {
                Err(HypervisorError::Control {
                    command: command.to_owned(),
                    class,
                    desc,
                })
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(HypervisorError::ControlClosed(format!(
                "connection closed while {command} ran"
            ))),
        }
    }

    /// Subscribes to QMP events (`{"event": NAME, "data": ...}`) from now on.
    pub fn events(&self) -> broadcast::Receiver<Value> {
        self.events.subscribe()
    }
}

impl Drop for Qmp {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Sends (part of) `bytes` in one `sendmsg` carrying `fd`; returns how many bytes went.
/// QEMU attaches a received descriptor to the command whose bytes it arrived with.
async fn send_with_fd(
    stream: &UnixStream,
    bytes: &[u8],
    fd: BorrowedFd<'_>,
) -> std::io::Result<usize> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use std::os::fd::AsRawFd;
    loop {
        stream.writable().await?;
        let res = stream.try_io(tokio::io::Interest::WRITABLE, || {
            let fds = [fd.as_raw_fd()];
            let cmsg = [ControlMessage::ScmRights(&fds)];
            sendmsg::<()>(
                stream.as_raw_fd(),
                &[std::io::IoSlice::new(bytes)],
                &cmsg,
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(std::io::Error::from)
        });
        match res {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave the map inconsistent (single inserts
    // and removes), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn read_loop(
    mut lines: tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
    pending: Pending,
    events: broadcast::Sender<Value>,
) {
    let reason = loop {
        let line = match lines.next_line().await {
            Ok(Some(l)) => l,
            Ok(None) => break "QEMU closed the QMP socket".to_string(),
            Err(e) => break e.to_string(),
        };
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            tracing::warn!("unparsable QMP line: {line}");
            continue;
        };
        if msg.get("event").is_some() {
            let _ = events.send(msg);
            continue;
        }
        let Some(id) = msg.get("id").and_then(Value::as_u64) else {
            continue;
        };
        let Some(tx) = lock(&pending).remove(&id) else {
            continue;
        };
        let result = if let Some(ret) = msg.get("return") {
            Ok(ret.clone())
        } else {
            let err = msg.get("error").cloned().unwrap_or(Value::Null);
            Err(HypervisorError::Control {
                command: String::new(),
                class: err["class"].as_str().unwrap_or("unknown").to_owned(),
                desc: err["desc"].as_str().unwrap_or("no description").to_owned(),
            })
        };
        let _ = tx.send(result);
    };
    for (_, tx) in lock(&pending).drain() {
        let _ = tx.send(Err(HypervisorError::ControlClosed(reason.clone())));
    }
}

/// Checks a QMP greeting (`{"QMP": {"version": {"qemu": {major, minor, micro}}, ...}}`)
/// and returns the version it carries: `None` for what is not a greeting, `Some(None)`
/// for a greeting without a readable version.
fn parse_greeting(line: &str) -> Option<Option<QemuVersion>> {
    let v: Value = serde_json::from_str(line).ok()?;
    let qmp = v.get("QMP")?;
    let q = &qmp["version"]["qemu"];
    let part = |k: &str| q[k].as_u64().and_then(|n| u32::try_from(n).ok());
    Some(match (part("major"), part("minor"), part("micro")) {
        (Some(a), Some(b), Some(c)) => Some(QemuVersion(a, b, c)),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greetings_give_the_version() {
        let g = r#"{"QMP": {"version": {"qemu": {"micro": 2, "minor": 0, "major": 10}, "package": "Debian"}, "capabilities": ["oob"]}}"#;
        assert_eq!(parse_greeting(g), Some(Some(QemuVersion(10, 0, 2))));
        assert_eq!(
            parse_greeting(r#"{"QMP": {"capabilities": []}}"#),
            Some(None)
        );
        assert_eq!(parse_greeting(r#"{"return": {}}"#), None);
        assert_eq!(parse_greeting("QMP"), None);
    }
}
