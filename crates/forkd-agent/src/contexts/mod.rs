//! Code contexts: persistent interpreters that keep state between runs.
//!
//! Each context is one `python3` process running [`DRIVER`], spoken to with JSON lines on
//! its stdin and stdout (see `driver.py` for its side). Runs of one context are queued on
//! a lock; the process and its protocol stay in step because a run is always read to its
//! `done` line, even when the host has stopped listening.

use crate::children::{Children, Tracked};
use crate::error::ApiError;
use crate::exec::{kill_group, spawn, Stdios};
use crate::server::{parse_json, AppState};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkd_proto::context::{
    ContextEvent, ContextInfo, CreateContextRequest, Language, RunCodeRequest,
};
use forkd_proto::exec::{Command, ExecRequest};
use forkd_proto::ErrorCode;
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::sync::mpsc;

/// The interpreter side of the protocol.
pub const DRIVER: &str = include_str!("driver.py");

/// How long an interpreter may take to start and report ready.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// After a run's timeout interrupted it, how long the code has to unwind before the
/// context is killed.
const INTERRUPT_GRACE: Duration = Duration::from_secs(5);

/// Content type of run responses.
pub const NDJSON: &str = "application/x-ndjson";

/// The contexts of one sandbox.
#[derive(Debug, Default)]
pub struct Contexts {
    map: Mutex<BTreeMap<String, Arc<Context>>>,
    next_id: AtomicU64,
}

/// One context: its settings and, behind the run lock, its interpreter.
#[derive(Debug)]
pub struct Context {
    id: String,
    spec: CreateContextRequest,
    proc: Arc<tokio::sync::Mutex<Option<Interpreter>>>,
    pid: std::sync::atomic::AtomicU32,
    count: AtomicU64,
}

/// A running interpreter.
#[derive(Debug)]
struct Interpreter {
    child: Child,
    _tracked: Tracked,
    pid: u32,
    requests: ChildStdin,
    events: Lines<BufReader<ChildStdout>>,
}

impl Interpreter {
    async fn start(
        children: &Arc<Children>,
        defaults: &crate::exec::ExecDefaults,
        spec: &CreateContextRequest,
    ) -> Result<Interpreter, ApiError> {
        let Language::Python = spec.language;
        let mut req = ExecRequest::new(Command::Argv(vec![
            "python3".into(),
            "-u".into(),
            "-c".into(),
            DRIVER.into(),
        ]));
        req.cwd = spec.cwd.clone();
        req.env = spec.env.clone();
        // No display in a sandbox: matplotlib renders off-screen, figures come back as PNG.
        req.env
            .entry("MPLBACKEND".into())
            .or_insert_with(|| "Agg".into());
        let mut spawned = spawn(children, defaults, &req, Stdios::Pipes(Stdio::piped()))?;
        let pid = spawned.tracked.pid();
        let child = &mut spawned.child;
        let (Some(requests), Some(stdout), Some(mut stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(ApiError::new(
                ErrorCode::Internal,
                "interpreter pipes missing",
            ));
        };
        // Until the driver has moved its descriptors, errors (a missing module, a broken
        // python3) arrive on this stderr: keep its start for the error message.
        let early_stderr = tokio::spawn(async move {
            let mut buf = Vec::new();
            let _ = (&mut stderr).take(16 * 1024).read_to_end(&mut buf).await;
            String::from_utf8_lossy(&buf).into_owned()
        });
        let mut interp = Interpreter {
            child: spawned.child,
            _tracked: spawned.tracked,
            pid,
            requests,
            events: BufReader::new(stdout).lines(),
        };
        let ready = tokio::time::timeout(START_TIMEOUT, interp.events.next_line()).await;
        match ready {
            Ok(Ok(Some(line))) if line.contains("\"ready\"") => Ok(interp),
            other => {
                interp.kill().await;
                let stderr = tokio::time::timeout(Duration::from_secs(2), early_stderr)
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or_default();
                let why = match other {
                    Err(_) => format!("no answer within {} s", START_TIMEOUT.as_secs()),
                    Ok(Ok(Some(line))) => format!("unexpected first line {line:?}"),
                    Ok(Ok(None)) => "it exited at once".into(),
                    Ok(Err(e)) => e.to_string(),
                };
                Err(ApiError::new(
                    ErrorCode::SpawnFailed,
                    format!(
                        "the python3 interpreter did not start ({why}): {}",
                        stderr.trim()
                    ),
                ))
            }
        }
    }

    async fn kill(&mut self) {
        kill_group(self.pid, Signal::SIGKILL);
        let _ = self.child.wait().await;
    }

    /// Sends one request and reads its events up to `done`, handing each to `sink`.
    /// An interpreter that dies mid-run yields an error event; `Err` then means it is gone.
    async fn request(
        &mut self,
        req: serde_json::Value,
        timeout: Option<Duration>,
        sink: &mpsc::Sender<ContextEvent>,
    ) -> Result<u64, ()> {
        let mut line = req.to_string();
        line.push('\n');
        if self.requests.write_all(line.as_bytes()).await.is_err() {
            let _ = sink.send(died("it no longer reads requests")).await;
            return Err(());
        }
        let mut deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        let mut interrupted = false;
        loop {
            let next = match deadline {
                Some(d) => tokio::time::timeout_at(d, self.events.next_line()).await,
                None => Ok(self.events.next_line().await),
            };
            let line = match next {
                Ok(Ok(Some(l))) => l,
                Ok(Ok(None)) | Ok(Err(_)) => {
                    let status = self.child.wait().await;
                    let how = status.map(|s| s.to_string()).unwrap_or_default();
                    let _ = sink.send(died(&format!("it exited ({how})"))).await;
                    return Err(());
                }
                Err(_) if !interrupted => {
                    // Past the timeout: interrupt the cell (KeyboardInterrupt), then give
                    // it a grace period to unwind.
                    interrupted = true;
                    kill_group(self.pid, Signal::SIGINT);
                    let grace = tokio::time::Instant::now() + INTERRUPT_GRACE;
                    deadline = Some(grace);
                    continue;
                }
                Err(_) => {
                    self.kill().await;
                    let _ = sink
                        .send(died("it did not stop after being interrupted"))
                        .await;
                    return Err(());
                }
            };
            let event = match serde_json::from_str::<ContextEvent>(&line) {
                Ok(e) => e,
                Err(_) => continue,
            };
            if let ContextEvent::Done { execution_count } = event {
                if interrupted {
                    let _ = sink
                        .send(ContextEvent::Error {
                            name: "TimeoutError".into(),
                            value: format!(
                                "the code ran longer than {} ms and was interrupted",
                                timeout.unwrap_or_default().as_millis()
                            ),
                            traceback: String::new(),
                        })
                        .await;
                }
                return Ok(execution_count);
            }
            let _ = sink.send(event).await;
        }
    }
}

fn died(how: &str) -> ContextEvent {
    ContextEvent::Error {
        name: "ContextDied".into(),
        value: format!("the interpreter of this context is gone: {how}; reset the context"),
        traceback: String::new(),
    }
}

impl Context {
    fn info(&self) -> ContextInfo {
        ContextInfo {
            id: self.id.clone(),
            language: self.spec.language,
            pid: self.pid.load(Ordering::Relaxed),
            execution_count: self.count.load(Ordering::Relaxed),
            cwd: self.spec.cwd.clone(),
        }
    }

    /// Runs one request under the run lock, to the end, sending events to `sink`.
    async fn run(
        self: &Arc<Self>,
        req: serde_json::Value,
        timeout: Option<Duration>,
        sink: mpsc::Sender<ContextEvent>,
    ) {
        let slot = self.proc.clone().lock_owned().await;
        self.run_locked(slot, req, timeout, sink).await
    }

    /// Runs `req` in the interpreter whose lock is `slot`: runs queue on that lock
    /// (tokio's mutex is fair), so whoever took it first runs first.
    async fn run_locked(
        &self,
        mut slot: tokio::sync::OwnedMutexGuard<Option<Interpreter>>,
        req: serde_json::Value,
        timeout: Option<Duration>,
        sink: mpsc::Sender<ContextEvent>,
    ) {
        let Some(interp) = slot.as_mut() else {
            let _ = sink
                .send(died("it was not restarted after it failed"))
                .await;
            let _ = sink
                .send(ContextEvent::Done {
                    execution_count: self.count.load(Ordering::Relaxed),
                })
                .await;
            return;
        };
        match interp.request(req, timeout, &sink).await {
            Ok(n) => self.count.store(n, Ordering::Relaxed),
            Err(()) => *slot = None,
        }
        let _ = sink
            .send(ContextEvent::Done {
                execution_count: self.count.load(Ordering::Relaxed),
            })
            .await;
    }
}

impl Contexts {
    fn get(&self, id: &str) -> Result<Arc<Context>, ApiError> {
        lock(&self.map)
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("no code context {id}")))
    }

    fn all(&self) -> Vec<Arc<Context>> {
        lock(&self.map).values().cloned().collect()
    }

    /// Queues a reseed of `random` and `numpy.random` in every context, ahead of any code
    /// sent to it later, waiting up to `wait` for a busy one. Returns how many were
    /// queued. The reseeds run in the background: a restored child answers its host
    /// without waiting for its interpreters (whose first instructions, under TCG, are
    /// slow), and no code of the child's can run in a context before its reseed has;
    /// with `settle` this waits for them (a warm pool member is paused next).
    /// `env` joins each interpreter's `os.environ` in the same step.
    pub async fn reseed_all(
        &self,
        wait: Duration,
        env: &BTreeMap<String, String>,
        settle: bool,
    ) -> (u32, ReseedGate) {
        let mut n = 0;
        let mut reseeds = Vec::new();
        let (go, gate) = tokio::sync::watch::channel(false);
        for ctx in self.all() {
            let Ok(slot) = tokio::time::timeout(wait, ctx.proc.clone().lock_owned()).await else {
                continue;
            };
            n += 1;
            let env = env.clone();
            let mut gate = gate.clone();
            reseeds.push(tokio::spawn(async move {
                // The context is held from here; its interpreter is woken once the gate
                // opens (a closed gate counts as open).
                let _ = gate.wait_for(|open| *open).await;
                let (tx, mut rx) = mpsc::channel(16);
                let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
                let op = serde_json::json!({ "op": "reseed", "env": env });
                ctx.run_locked(slot, op, None, tx).await;
                let _ = drain.await;
            }));
        }
        if settle {
            let _ = go.send(true);
            for reseed in reseeds {
                let _ = reseed.await;
            }
        }
        (n, ReseedGate(go))
    }
}

/// Holds the reseeds [`Contexts::reseed_all`] queued until it is dropped. Their contexts
/// are locked already, so no code runs in one before its reseed; they only wait to wake
/// their interpreters. A restored child answers its host first: on its one vCPU, an
/// interpreter woken earlier would run ahead of the answer.
pub struct ReseedGate(tokio::sync::watch::Sender<bool>);

impl Drop for ReseedGate {
    fn drop(&mut self) {
        let _ = self.0.send(true);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `POST /v1/contexts`.
pub async fn create(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<ContextInfo>, ApiError> {
    let spec: CreateContextRequest = if body.is_empty() {
        CreateContextRequest::default()
    } else {
        parse_json(&body)?
    };
    let interp = Interpreter::start(&state.children, &state.exec_defaults(), &spec).await?;
    let n = state.contexts.next_id.fetch_add(1, Ordering::Relaxed) + 1;
    let ctx = Arc::new(Context {
        id: format!("ctx-{n}"),
        spec,
        pid: interp.pid.into(),
        proc: Arc::new(tokio::sync::Mutex::new(Some(interp))),
        count: AtomicU64::new(0),
    });
    lock(&state.contexts.map).insert(ctx.id.clone(), ctx.clone());
    Ok(Json(ctx.info()))
}

/// `GET /v1/contexts`.
pub async fn list(State(state): State<Arc<AppState>>) -> Json<Vec<ContextInfo>> {
    Json(state.contexts.all().iter().map(|c| c.info()).collect())
}

/// `GET /v1/contexts/{id}`.
pub async fn get(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ContextInfo>, ApiError> {
    Ok(Json(state.contexts.get(&id)?.info()))
}

/// `DELETE /v1/contexts/{id}`: kills the interpreter (waiting for a running cell's lock
/// would let a runaway cell block the delete forever, so the kill comes first).
pub async fn delete(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ContextInfo>, ApiError> {
    let ctx = state.contexts.get(&id)?;
    lock(&state.contexts.map).remove(&id);
    kill_group(ctx.pid.load(Ordering::Relaxed), Signal::SIGKILL);
    if let Some(mut interp) = ctx.proc.lock().await.take() {
        interp.kill().await;
    }
    Ok(Json(ctx.info()))
}

/// `POST /v1/contexts/{id}/reset`: a fresh interpreter, same settings, same id.
pub async fn reset(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ContextInfo>, ApiError> {
    let ctx = state.contexts.get(&id)?;
    kill_group(ctx.pid.load(Ordering::Relaxed), Signal::SIGKILL);
    let mut slot = ctx.proc.lock().await;
    if let Some(mut old) = slot.take() {
        old.kill().await;
    }
    let interp = Interpreter::start(&state.children, &state.exec_defaults(), &ctx.spec).await?;
    ctx.pid.store(interp.pid, Ordering::Relaxed);
    ctx.count.store(0, Ordering::Relaxed);
    *slot = Some(interp);
    drop(slot);
    Ok(Json(ctx.info()))
}

/// `POST /v1/contexts/{id}/run`: streams the run's events as NDJSON.
pub async fn run(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let ctx = match state.contexts.get(&id) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let req: RunCodeRequest = match parse_json(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let (tx, rx) = mpsc::channel::<ContextEvent>(64);
    let timeout = req.timeout_ms.map(Duration::from_millis);
    // The run goes on in its own task: if the host goes away, it still reads the cell to
    // its end, so the next run starts in step.
    tokio::spawn(async move {
        ctx.run(
            serde_json::json!({ "op": "run", "code": req.code, "env": req.env }),
            timeout,
            tx,
        )
        .await
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let event = rx.recv().await?;
        let mut line = serde_json::to_vec(&event).expect("events always serialize");
        line.push(b'\n');
        Some((Ok::<_, std::convert::Infallible>(Bytes::from(line)), rx))
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, NDJSON)],
        Body::from_stream(stream),
    )
        .into_response()
}
