//! Background processes: `/v1/processes` and `/v1/processes/{id}/...`.
//!
//! Each process gets an id of the agent's own (pids are reused), a task that captures the
//! tail of its stdout and stderr and waits for it, and a watch channel that tells waiters
//! when it ended.

use crate::error::ApiError;
use crate::exec::{self, kill_group};
use crate::server::{parse_json, parse_query, AppState};
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkd_proto::exec::{
    ExecRequest, ExitStatus, ProcessInfo, SignalRequest, StdinQuery, WaitQuery,
    BACKGROUND_OUTPUT_LIMIT, STDIN_WRITE_LIMIT,
};
use forkd_proto::ErrorCode;
use nix::sys::signal::Signal;
use std::collections::{BTreeMap, VecDeque};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

/// Once a process exited, how long its output pipes may stay open (held by a descendant
/// that left its group) before its exit is published anyway.
const PIPE_GRACE: Duration = Duration::from_millis(500);

/// How long one write to a process's stdin may wait for the process to read (a full
/// pipe holds 64 KiB).
const STDIN_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// The table of background processes.
#[derive(Debug, Default)]
pub struct Processes {
    next_id: AtomicU64,
    table: Mutex<BTreeMap<u64, Arc<Proc>>>,
}

#[derive(Debug)]
struct Proc {
    id: u64,
    pid: u32,
    argv: Vec<String>,
    started_at_ms: u64,
    output: Mutex<Output>,
    /// The write end of its stdin, while open (only for processes started with `stdin`).
    stdin: tokio::sync::Mutex<Option<tokio::process::ChildStdin>>,
    /// Mirrors whether `stdin` holds a pipe, for `info` without awaiting its lock.
    stdin_open: std::sync::atomic::AtomicBool,
    /// `Some` once the process ended and its exit is final.
    exit: watch::Receiver<Option<ExitStatus>>,
}

#[derive(Debug, Default)]
struct Output {
    stdout: Tail,
    stderr: Tail,
}

/// The last [`BACKGROUND_OUTPUT_LIMIT`] bytes of a stream.
#[derive(Debug, Default)]
struct Tail(VecDeque<u8>);

impl Tail {
    fn push(&mut self, data: &[u8]) {
        let data = &data[data.len().saturating_sub(BACKGROUND_OUTPUT_LIMIT)..];
        let excess = (self.0.len() + data.len()).saturating_sub(BACKGROUND_OUTPUT_LIMIT);
        self.0.drain(..excess);
        self.0.extend(data);
    }

    fn bytes(&self) -> Vec<u8> {
        self.0.iter().copied().collect()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Poisoning only says a holder panicked; the data (bytes, a map) stays usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Proc {
    fn info(&self) -> ProcessInfo {
        let out = lock(&self.output);
        ProcessInfo {
            id: self.id,
            pid: self.pid,
            argv: self.argv.clone(),
            started_at_ms: self.started_at_ms,
            exit: *self.exit.borrow(),
            stdin_open: self.stdin_open.load(Ordering::Relaxed) && self.running(),
            stdout: out.stdout.bytes(),
            stderr: out.stderr.bytes(),
        }
    }

    fn running(&self) -> bool {
        self.exit.borrow().is_none()
    }

    /// Waits until the process ended, or `timeout` passed.
    async fn wait(&self, timeout: Option<Duration>) {
        let mut rx = self.exit.clone();
        let ended = async move {
            let _ = rx.wait_for(Option::is_some).await;
        };
        match timeout {
            Some(t) => {
                let _ = tokio::time::timeout(t, ended).await;
            }
            None => ended.await,
        }
    }
}

impl Processes {
    fn get(&self, id: &str) -> Result<Arc<Proc>, ApiError> {
        let not_found = || ApiError::not_found(format!("no background process with id {id}"));
        let id: u64 = id.parse().map_err(|_| not_found())?;
        lock(&self.table).get(&id).cloned().ok_or_else(not_found)
    }
}

/// `POST /v1/processes`.
pub async fn start(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: ExecRequest = match parse_json(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if req.pty.is_some() {
        return ApiError::invalid(
            "a background process cannot have a terminal: run it in the foreground (/v1/exec)",
        )
        .into_response();
    }
    let stdin = if req.stdin {
        Stdio::piped()
    } else {
        Stdio::null()
    };
    let stdios = exec::Stdios::Pipes(stdin);
    let mut sp = match exec::spawn(&state.children, &state.exec_defaults(), &req, stdios) {
        Ok(sp) => sp,
        Err(e) => return e.into_response(),
    };
    let id = state.processes.next_id.fetch_add(1, Ordering::Relaxed) + 1;
    let (exit_tx, exit_rx) = watch::channel(None);
    let proc = Arc::new(Proc {
        id,
        pid: sp.tracked.pid(),
        argv: sp.argv.clone(),
        started_at_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0),
        output: Mutex::new(Output::default()),
        stdin_open: std::sync::atomic::AtomicBool::new(sp.child.stdin.is_some()),
        stdin: tokio::sync::Mutex::new(sp.child.stdin.take()),
        exit: exit_rx,
    });
    lock(&state.processes.table).insert(id, Arc::clone(&proc));

    let stdout = sp.child.stdout.take();
    let stderr = sp.child.stderr.take();
    let p = Arc::clone(&proc);
    let timeout = req.timeout_ms.map(Duration::from_millis);
    tokio::spawn(async move {
        let mut pumps = exec::Pumps::default();
        if let Some(r) = stdout {
            pumps.spawn(capture(r, Arc::clone(&p), false));
        }
        if let Some(r) = stderr {
            pumps.spawn(capture(r, Arc::clone(&p), true));
        }
        let (status, timed_out) = match timeout {
            None => (sp.child.wait().await, false),
            Some(t) => match tokio::time::timeout(t, sp.child.wait()).await {
                Ok(s) => (s, false),
                Err(_) => {
                    kill_group(p.pid, Signal::SIGKILL);
                    (sp.child.wait().await, true)
                }
            },
        };
        // Let the pipes drain so the captured output is complete when the exit shows.
        let _ = tokio::time::timeout(PIPE_GRACE, pumps.join()).await;
        let exit = match status {
            Ok(s) => exec::exit_status(s, timed_out, sp.started),
            // wait(2) failing on our own child cannot really happen; report an exit
            // without code or signal rather than leave waiters hanging.
            Err(_) => ExitStatus {
                code: None,
                signal: None,
                timed_out,
                duration_ms: elapsed_ms(sp.started),
            },
        };
        let _ = exit_tx.send(Some(exit));
        drop(sp.tracked);
        p.stdin_open.store(false, Ordering::Relaxed);
        *p.stdin.lock().await = None;
        // Output of a descendant still holding the pipes keeps being captured.
        pumps.join().await;
    });
    (StatusCode::CREATED, Json(proc.info())).into_response()
}

fn elapsed_ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

async fn capture(mut r: impl AsyncRead + Unpin, p: Arc<Proc>, stderr: bool) {
    let mut buf = vec![0u8; exec::CHUNK];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut out = lock(&p.output);
                let tail = if stderr {
                    &mut out.stderr
                } else {
                    &mut out.stdout
                };
                tail.push(&buf[..n]);
            }
        }
    }
}

/// `GET /v1/processes`.
pub async fn list(State(state): State<Arc<AppState>>) -> Json<Vec<ProcessInfo>> {
    let procs: Vec<Arc<Proc>> = lock(&state.processes.table).values().cloned().collect();
    Json(procs.iter().map(|p| p.info()).collect())
}

/// `GET /v1/processes/{id}`.
pub async fn get(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ProcessInfo>, ApiError> {
    Ok(Json(state.processes.get(&id)?.info()))
}

/// `POST /v1/processes/{id}/wait?timeout_ms=N`.
pub async fn wait(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Json<ProcessInfo>, ApiError> {
    let q: WaitQuery = parse_query(query.as_deref())?;
    let p = state.processes.get(&id)?;
    p.wait(q.timeout_ms.map(Duration::from_millis)).await;
    Ok(Json(p.info()))
}

/// `POST /v1/processes/{id}/stdin[?close=true]`: writes the body to the process's stdin,
/// then closes it if asked. Writes of one process are applied in the order they arrive.
pub async fn stdin(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Result<Json<ProcessInfo>, ApiError> {
    let q: StdinQuery = parse_query(query.as_deref())?;
    let p = state.processes.get(&id)?;
    if body.len() > STDIN_WRITE_LIMIT {
        return Err(ApiError::invalid(format!(
            "{} bytes for stdin in one write; the limit is {STDIN_WRITE_LIMIT}",
            body.len()
        )));
    }
    let mut pipe = p.stdin.lock().await;
    let Some(w) = pipe.as_mut() else {
        return Err(ApiError::new(
            ErrorCode::StdinClosed,
            format!(
                "the stdin of process {id} is closed (or was not kept open: start it with stdin: true)"
            ),
        ));
    };
    let failed = if body.is_empty() {
        None
    } else {
        let written = tokio::time::timeout(STDIN_WRITE_TIMEOUT, async {
            w.write_all(&body).await?;
            w.flush().await
        })
        .await;
        match written {
            Ok(Ok(())) => None,
            // EPIPE: every reader is gone, the process ended or closed its stdin.
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => Some(ApiError::new(
                ErrorCode::StdinClosed,
                format!("process {id} no longer reads its stdin (it ended or closed it)"),
            )),
            Ok(Err(e)) => Some(ApiError::new(
                ErrorCode::Io,
                format!("writing to the stdin of process {id}: {e}"),
            )),
            Err(_) => Some(ApiError::new(
                ErrorCode::Io,
                format!(
                    "process {id} did not read its stdin within {} s",
                    STDIN_WRITE_TIMEOUT.as_secs()
                ),
            )),
        }
    };
    // A pipe that failed is not written again either: what it took is unknown.
    if q.close || failed.is_some() {
        *pipe = None;
        p.stdin_open.store(false, Ordering::Relaxed);
    }
    drop(pipe);
    match failed {
        Some(e) => Err(e),
        None => Ok(Json(p.info())),
    }
}

/// `POST /v1/signal`: a signal to any process of the guest by pid, or to its group;
/// never to the agent, its group or pid 1 (what ends the guest's session is the host's
/// to decide, through its own routes).
pub async fn signal_pid(body: Bytes) -> Result<Json<serde_json::Value>, ApiError> {
    let req: forkd_proto::exec::PidSignalRequest = parse_json(&body)?;
    let sig = Signal::try_from(req.signal)
        .map_err(|_| ApiError::invalid(format!("{} is not a signal number", req.signal)))?;
    let me = nix::unistd::getpid();
    let pid = i32::try_from(req.pid)
        .ok()
        .filter(|&p| p > 1 && p != me.as_raw())
        .map(nix::unistd::Pid::from_raw)
        .ok_or_else(|| ApiError::invalid(format!("pid {} cannot be signalled", req.pid)))?;
    let gone = |e: nix::Error| {
        let code = match e {
            nix::Error::ESRCH => forkd_proto::ErrorCode::NotFound,
            e => forkd_proto::ErrorCode::from_io(&std::io::Error::from(e)),
        };
        ApiError::new(code, format!("sending {sig} to process {pid}: {e}"))
    };
    if req.group {
        let pgid = nix::unistd::getpgid(Some(pid)).map_err(gone)?;
        if pgid.as_raw() <= 1 || pgid == nix::unistd::getpgrp() {
            return Err(ApiError::invalid(format!(
                "process {pid} is in the agent's process group, which is not signalled"
            )));
        }
        nix::sys::signal::killpg(pgid, sig).map_err(gone)?;
    } else {
        nix::sys::signal::kill(pid, sig).map_err(gone)?;
    }
    Ok(Json(serde_json::json!({})))
}

/// `POST /v1/processes/{id}/signal`.
///
/// Signals go to the process group (or the process alone, if asked). Once the process has ended nothing is sent: its
/// pid, and so its group id, may already belong to someone else.
pub async fn signal(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<ProcessInfo>, ApiError> {
    let p = state.processes.get(&id)?;
    let req: SignalRequest = parse_json(&body)?;
    let sig = match req.signal {
        0 => None,
        n => Some(
            Signal::try_from(n)
                .map_err(|_| ApiError::invalid(format!("{n} is not a signal number")))?,
        ),
    };
    if p.running() {
        if let Ok(pgid) = i32::try_from(p.pid) {
            if pgid > 0 {
                let pid = nix::unistd::Pid::from_raw(pgid);
                let sent = if req.process_only {
                    nix::sys::signal::kill(pid, sig)
                } else {
                    nix::sys::signal::killpg(pid, sig)
                };
                sent.map_err(|e| {
                    ApiError::new(
                        forkd_proto::ErrorCode::from_io(&std::io::Error::from(e)),
                        format!("sending signal {} to process {id} failed: {e}", req.signal),
                    )
                })
                .or_else(|e| {
                    // The group vanished between the check and the kill: it just ended.
                    if p.running() {
                        Err(e)
                    } else {
                        Ok(())
                    }
                })?;
            }
        }
    }
    Ok(Json(p.info()))
}

/// `DELETE /v1/processes/{id}`: kill the group, wait for the process, forget it.
pub async fn delete(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ProcessInfo>, ApiError> {
    let p = state.processes.get(&id)?;
    if p.running() {
        kill_group(p.pid, Signal::SIGKILL);
    }
    p.wait(None).await;
    lock(&state.processes.table).remove(&p.id);
    Ok(Json(p.info()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_bytes() {
        let mut t = Tail::default();
        t.push(b"abc");
        t.push(&vec![b'x'; BACKGROUND_OUTPUT_LIMIT - 1]);
        assert_eq!(t.0.len(), BACKGROUND_OUTPUT_LIMIT);
        assert_eq!(t.0.front(), Some(&b'c'));
        t.push(&vec![b'y'; BACKGROUND_OUTPUT_LIMIT + 5]);
        assert_eq!(t.0.len(), BACKGROUND_OUTPUT_LIMIT);
        assert!(t.0.iter().all(|&b| b == b'y'));
    }
}
