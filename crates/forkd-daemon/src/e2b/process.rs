//! envd's `process.Process` service: commands started, streamed, fed, killed, listed and
//! reattached to. Each runs as one streamed exec on forkd's agent; the daemon keeps a
//! table of them by (sandbox, pid), as envd keeps its own.
//!
//! A process outlives the call that started it (E2B's background commands): its output
//! is pumped by a task of its own to whoever is attached (the `Start` call, `Connect`
//! calls), and it is killed by closing its exec stream, on which the agent kills its
//! whole process group.

use super::connect::{self, unary, Code, RpcError};
use super::{user_of, Shared, Target};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use forkd_core::agent::{ExecOutput, TerminalInput};
use forkd_proto::exec::{Command, ExecRequest, ExitStatus, PtySize};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Events queued per attached caller before the process waits for it.
const EVENTS_QUEUED: usize = 64;
/// Stdin writes queued before `SendInput` waits.
const STDIN_QUEUED: usize = 16;

pub(super) fn routes() -> Router<Shared> {
    Router::new()
        .route("/process.Process/Start", post(start))
        .route("/process.Process/Connect", post(connect_call))
        .route("/process.Process/List", post(list))
        .route("/process.Process/SendInput", post(send_input))
        .route("/process.Process/SendSignal", post(send_signal))
        .route("/process.Process/CloseStdin", post(close_stdin))
        .route("/process.Process/StreamInput", post(unimplemented))
        .route("/process.Process/Update", post(update))
}

/// The processes of every sandbox, by (sandbox id, pid). An entry goes when its pump
/// ends: the process ended, was killed, or its sandbox went (its exec stream fails).
#[derive(Default)]
pub(super) struct Table {
    procs: Mutex<HashMap<(String, u32), Arc<Proc>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A running process.
struct Proc {
    pid: u32,
    /// `ProcessConfig` as it was given (`cmd`, `args`, `envs`, `cwd`).
    config: Value,
    tag: Option<String>,
    /// Its stdin, while open.
    stdin: Mutex<Option<mpsc::Sender<Bytes>>>,
    /// Its terminal, for one started with a pty.
    terminal: Option<mpsc::Sender<TerminalInput>>,
    /// The callers attached to its output.
    attached: Mutex<Vec<mpsc::Sender<Value>>>,
    /// Its `end` event, once it ended (under `attached`'s lock): a caller attaching
    /// then still gets it.
    ended: Mutex<Option<Value>>,
    /// Cancelled to kill it.
    kill: CancellationToken,
}

impl Proc {
    fn attach(&self) -> mpsc::Receiver<Value> {
        let (tx, rx) = mpsc::channel(EVENTS_QUEUED);
        let mut attached = lock(&self.attached);
        match lock(&self.ended).clone() {
            // The channel is empty: the end fits, and the stream ends after it.
            Some(end) => drop(tx.try_send(end)),
            None => attached.push(tx),
        }
        rx
    }

    /// Records the end and hands it to every attached caller; nothing follows it.
    async fn finish(&self, end: Value) {
        let callers = {
            let mut attached = lock(&self.attached);
            *lock(&self.ended) = Some(end.clone());
            std::mem::take(&mut *attached)
        };
        for c in callers {
            let _ = c.send(end.clone()).await;
        }
    }

    /// Sends an event to every attached caller, in order; callers gone are dropped.
    async fn publish(&self, event: Value) {
        let callers: Vec<_> = lock(&self.attached).clone();
        let mut gone = false;
        for c in &callers {
            gone |= c.send(event.clone()).await.is_err();
        }
        if gone {
            lock(&self.attached).retain(|c| !c.is_closed());
        }
    }

    fn info(&self) -> Value {
        let mut v = json!({"pid": self.pid, "config": self.config});
        if let Some(t) = &self.tag {
            v["tag"] = json!(t);
        }
        v
    }
}

#[derive(Debug, Deserialize)]
struct ProcessConfig {
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Debug, Deserialize)]
struct StartRequest {
    process: ProcessConfig,
    #[serde(default)]
    stdin: Option<bool>,
    tag: Option<String>,
    pty: Option<Pty>,
}

/// `PTY`: `{"size": {"rows": R, "cols": C}}` (proto3 JSON leaves zeros out).
#[derive(Debug, Deserialize)]
struct Pty {
    #[serde(default)]
    size: PtySizeJson,
}

#[derive(Debug, Default, Deserialize)]
struct PtySizeJson {
    #[serde(default)]
    rows: u16,
    #[serde(default)]
    cols: u16,
}

impl Pty {
    fn size(&self) -> Result<PtySize, RpcError> {
        let size = PtySize {
            cols: self.size.cols,
            rows: self.size.rows,
        };
        match size.problem() {
            Some(p) => Err(RpcError::new(Code::InvalidArgument, p)),
            None => Ok(size),
        }
    }
}

/// `{"process": {"pid": N}}` (the selector may also be `{"tag": ...}`).
#[derive(Debug, Deserialize)]
struct Selector {
    process: ProcessSelector,
}

#[derive(Debug, Deserialize)]
struct ProcessSelector {
    pid: Option<u32>,
    tag: Option<String>,
}

/// The process a selector names.
fn find(e2b: &Shared, t: &Target, sel: &ProcessSelector) -> Result<Arc<Proc>, RpcError> {
    match (sel.pid, &sel.tag) {
        (Some(pid), _) => lock(&e2b.processes.procs)
            .get(&(t.id.clone(), pid))
            .cloned()
            .ok_or_else(|| {
                RpcError::new(Code::NotFound, format!("process with pid {pid} not found"))
            }),
        (None, Some(tag)) => lock(&e2b.processes.procs)
            .iter()
            .find(|((sid, _), p)| sid == &t.id && p.tag.as_deref() == Some(tag))
            .map(|(_, p)| p.clone())
            .ok_or_else(|| {
                RpcError::new(Code::NotFound, format!("process with tag {tag} not found"))
            }),
        (None, None) => Err(RpcError::new(
            Code::InvalidArgument,
            "select the process by pid or tag",
        )),
    }
}

/// The stream an attached caller reads: `start` first, then the process's events, a
/// keepalive every `keepalive` while it is quiet, and the end of the stream once the
/// process ended.
fn event_stream(
    pid: u32,
    rx: mpsc::Receiver<Value>,
    keepalive: Option<Duration>,
) -> impl futures::Stream<Item = Bytes> + Send {
    let start = connect::envelope(&json!({"event": {"start": {"pid": pid}}}));
    let ticker = keepalive.map(|d| tokio::time::interval_at(tokio::time::Instant::now() + d, d));
    let events = futures::stream::unfold((rx, ticker), |(mut rx, mut ticker)| async move {
        let event = tokio::select! {
            e = rx.recv() => e?,
            () = tick(&mut ticker) => json!({"keepalive": {}}),
        };
        Some((connect::envelope(&json!({ "event": event })), (rx, ticker)))
    });
    futures::stream::once(async move { start })
        .chain(events)
        .chain(futures::stream::once(async {
            connect::end_of_stream(None)
        }))
}

pub(super) async fn tick(t: &mut Option<tokio::time::Interval>) {
    match t {
        Some(t) => {
            t.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// The keepalive period the caller asked for (`Keepalive-Ping-Interval`, seconds).
pub(super) fn keepalive_of(h: &HeaderMap) -> Option<Duration> {
    h.get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(|s| Duration::from_secs(s.min(600)))
}

/// The `end` event of a process that ended with `s`, as envd reports it.
fn end_event(s: &ExitStatus) -> Value {
    match (s.code, s.signal) {
        (Some(code), _) => {
            json!({"end": {"exitCode": code, "exited": true, "status": format!("exit status {code}")}})
        }
        (None, Some(sig)) => {
            json!({"end": {"exitCode": -1, "exited": false, "status": format!("signal: {}", signal_name(sig))}})
        }
        (None, None) => json!({"end": {"exitCode": -1, "exited": false, "status": "unknown"}}),
    }
}

fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| match s {
            nix::sys::signal::Signal::SIGKILL => "killed".to_owned(),
            nix::sys::signal::Signal::SIGTERM => "terminated".to_owned(),
            s => s.as_str().to_owned(),
        })
        .unwrap_or_else(|_| sig.to_string())
}

async fn start(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match start_process(&e2b, &t, &headers, &body).await {
        Ok(r) => r,
        Err(e) => connect::stream_error(e),
    }
}

async fn start_process(
    e2b: &Shared,
    t: &Target,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, RpcError> {
    let req: StartRequest = connect::stream_request(body)?;
    let size = req.pty.as_ref().map(Pty::size).transpose()?;
    let user = user_of(headers)?;
    let sandbox = e2b.sandbox(&t.id).await?;
    let p = &req.process;
    if p.cmd.is_empty() {
        return Err(RpcError::new(Code::InvalidArgument, "cmd is empty"));
    }
    let mut argv = vec![p.cmd.clone()];
    argv.extend(p.args.iter().cloned());
    let mut exec = ExecRequest::new(Command::Argv(argv));
    exec.env = p.envs.clone();
    // No cwd: the agent starts in the user's home, from the guest's passwd.
    exec.cwd = match p.cwd.as_deref() {
        None | Some("") => None,
        Some(c) => Some(super::resolve(&user, c)?),
    };
    exec.user = Some(user);
    if let Some(problem) = forkd_proto::exec::env_problem(&exec.env) {
        return Err(RpcError::new(Code::InvalidArgument, problem));
    }
    let (stdin_tx, stdin) = if req.stdin.unwrap_or(false) && size.is_none() {
        let (tx, rx) = mpsc::channel::<Bytes>(STDIN_QUEUED);
        let chunks = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx))
        });
        let reader = tokio_util::io::StreamReader::new(Box::pin(chunks));
        (Some(tx), Some(Box::new(reader) as forkd_core::agent::Stdin))
    } else {
        (None, None)
    };
    let (terminal, mut stream) = match size {
        Some(size) => {
            let (tx, rx) = mpsc::channel(STDIN_QUEUED);
            (Some(tx), sandbox.exec_on_terminal(exec, size, rx).await?)
        }
        None => (None, sandbox.exec_stream(exec, stdin).await?),
    };
    let data_field = if terminal.is_some() { "pty" } else { "stdout" };
    let pid = match stream.next().await? {
        Some(ExecOutput::Started(pid)) => pid,
        _ => {
            return Err(RpcError::new(
                Code::Internal,
                "the agent did not report the process's start",
            ))
        }
    };
    let proc = Arc::new(Proc {
        pid,
        config: json!({"cmd": p.cmd, "args": p.args, "envs": p.envs, "cwd": p.cwd}),
        tag: req.tag.clone(),
        stdin: Mutex::new(stdin_tx),
        terminal,
        attached: Mutex::new(Vec::new()),
        ended: Mutex::new(None),
        kill: CancellationToken::new(),
    });
    let rx = proc.attach();
    if let Some(stale) = lock(&e2b.processes.procs).insert((t.id.clone(), pid), proc.clone()) {
        // The guest reused the pid of a process whose end is still being delivered.
        tracing::debug!(
            pid = stale.pid,
            "a new process took the pid of one that ended"
        );
    }
    let e2b2 = e2b.clone();
    let id = t.id.clone();
    tokio::spawn(async move {
        let killed = json!({"end": {"exitCode": -1, "exited": false, "status": "signal: killed"}});
        let end = loop {
            let item = tokio::select! {
                item = stream.next() => item,
                // Dropping the stream makes the agent kill the process group.
                () = proc.kill.cancelled() => break killed,
            };
            let event = match item {
                Ok(Some(ExecOutput::Stdout(b))) => json!({"data": {data_field: BASE64.encode(&b)}}),
                Ok(Some(ExecOutput::Stderr(b))) => json!({"data": {"stderr": BASE64.encode(&b)}}),
                Ok(Some(ExecOutput::Started(_))) => continue,
                Ok(Some(ExecOutput::Exited(s))) => break end_event(&s),
                Ok(None) => {
                    break json!({"end": {"exitCode": -1, "exited": false, "status": "unknown", "error": "the output ended without an exit status"}})
                }
                Err(e) => {
                    break json!({"end": {"exitCode": -1, "exited": false, "status": "error", "error": e.to_string()}})
                }
            };
            // A caller that does not read holds the output back (no byte is dropped),
            // but never a kill.
            tokio::select! {
                () = proc.publish(event) => {}
                () = proc.kill.cancelled() => break killed,
            }
        };
        drop(stream);
        {
            let mut procs = lock(&e2b2.processes.procs);
            let key = (id, pid);
            if procs.get(&key).is_some_and(|p| Arc::ptr_eq(p, &proc)) {
                procs.remove(&key);
            }
        }
        proc.finish(end).await;
    });
    Ok(connect::stream_response(event_stream(
        pid,
        rx,
        keepalive_of(headers),
    )))
}

/// `Connect`: attaches to a running process's output.
async fn connect_call(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let attach = || -> Result<Response, RpcError> {
        let sel: Selector = connect::stream_request(&body)?;
        let proc = find(&e2b, &t, &sel.process)?;
        let rx = proc.attach();
        Ok(connect::stream_response(event_stream(
            proc.pid,
            rx,
            keepalive_of(&headers),
        )))
    };
    attach().unwrap_or_else(connect::stream_error)
}

async fn list(State(e2b): State<Shared>, Extension(t): Extension<Target>) -> Response {
    if let Err(e) = e2b.sandbox(&t.id).await {
        return e.into_response();
    }
    let procs: Vec<Value> = lock(&e2b.processes.procs)
        .iter()
        .filter(|((sid, _), _)| sid == &t.id)
        .map(|(_, p)| p.info())
        .collect();
    connect::unary_response(&json!({ "processes": procs }))
}

#[derive(Debug, Deserialize)]
struct SendInputRequest {
    process: ProcessSelector,
    input: ProcessInput,
}

#[derive(Debug, Deserialize)]
struct ProcessInput {
    stdin: Option<String>,
    pty: Option<String>,
}

async fn send_input(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    body: Bytes,
) -> Response {
    unary(async {
        let req: SendInputRequest = connect::unary_request(&body)?;
        let proc = find(&e2b, &t, &req.process)?;
        if let Some(typed) = req.input.pty {
            let data = BASE64.decode(typed).map_err(|e| {
                RpcError::new(
                    Code::InvalidArgument,
                    format!("pty input is not base64: {e}"),
                )
            })?;
            return to_terminal(&proc, TerminalInput::Typed(Bytes::from(data))).await;
        }
        let data = BASE64
            .decode(req.input.stdin.unwrap_or_default())
            .map_err(|e| {
                RpcError::new(Code::InvalidArgument, format!("stdin is not base64: {e}"))
            })?;
        let tx = lock(&proc.stdin).clone().ok_or_else(|| {
            RpcError::new(
                Code::FailedPrecondition,
                format!(
                    "the stdin of process {} is closed (or was not opened: start it with stdin)",
                    proc.pid
                ),
            )
        })?;
        tx.send(Bytes::from(data)).await.map_err(|_| {
            RpcError::new(
                Code::FailedPrecondition,
                format!("process {} no longer reads its stdin", proc.pid),
            )
        })?;
        Ok(json!({}))
    })
    .await
}

async fn close_stdin(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    body: Bytes,
) -> Response {
    unary(async {
        let req: Selector = connect::unary_request(&body)?;
        let proc = find(&e2b, &t, &req.process)?;
        lock(&proc.stdin).take();
        Ok(json!({}))
    })
    .await
}

#[derive(Debug, Deserialize)]
struct SignalRequest {
    process: ProcessSelector,
    signal: Value,
}

/// `SendSignal`: SIGKILL (what the SDKs send) kills the process's group, as its stream
/// does on a kill; SIGTERM goes to the process's group through the agent.
async fn send_signal(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    body: Bytes,
) -> Response {
    unary(async {
        let req: SignalRequest = connect::unary_request(&body)?;
        let proc = find(&e2b, &t, &req.process)?;
        let named = |name: &str, number: i32| {
            matches!(&req.signal, Value::String(s) if s == name) || req.signal == json!(number)
        };
        if named("SIGNAL_SIGKILL", 9) {
            proc.kill.cancel();
        } else if named("SIGNAL_SIGTERM", 15) {
            let sandbox = e2b.sandbox(&t.id).await?;
            let pid = proc.pid;
            sandbox
                .call(|a| async move { a.signal_pid(pid, 15, true).await })
                .await?;
        } else {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!("{} is not a signal of E2B's protocol", req.signal),
            ));
        }
        Ok(json!({}))
    })
    .await
}

/// Hands `item` to the terminal of `proc`.
async fn to_terminal(proc: &Proc, item: TerminalInput) -> Result<Value, RpcError> {
    let tx = proc.terminal.as_ref().ok_or_else(|| {
        RpcError::new(
            Code::FailedPrecondition,
            format!("process {} has no terminal (start it with pty)", proc.pid),
        )
    })?;
    tx.send(item).await.map_err(|_| {
        RpcError::new(
            Code::FailedPrecondition,
            format!("the terminal of process {} has ended", proc.pid),
        )
    })?;
    Ok(json!({}))
}

#[derive(Debug, Deserialize)]
struct UpdateRequest {
    process: ProcessSelector,
    pty: Option<Pty>,
}

/// `Update`: a terminal's new size (the only update envd knows).
async fn update(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    body: Bytes,
) -> Response {
    unary(async {
        let req: UpdateRequest = connect::unary_request(&body)?;
        let proc = find(&e2b, &t, &req.process)?;
        match req.pty {
            Some(pty) => to_terminal(&proc, TerminalInput::Resize(pty.size()?)).await,
            None => Ok(json!({})),
        }
    })
    .await
}

async fn unimplemented() -> Response {
    RpcError::new(Code::Unimplemented, "this call is not supported by forkd").into_response()
}
