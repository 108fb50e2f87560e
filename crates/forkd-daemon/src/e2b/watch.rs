//! envd's directory watches: `WatchDir` (a server stream, what the async Python and the
//! JS SDKs use) and `CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher` (polled, what
//! the sync Python SDK uses), on the agent's watch ([`forkd_core::Sandbox::watch`]).
//!
//! A polled watcher keeps at most [`KEPT`] events between two polls; older ones are
//! dropped first (E2B's protocol has no overflow event), so a watcher nobody polls costs
//! a bounded buffer.

use super::connect::{self, unary, Code, RpcError};
use super::{resolve, user_of, Shared, Target};
use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::Response;
use forkd_proto::files::{WatchEvent, WatchKind};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Events a polled watcher keeps until they are read.
const KEPT: usize = 4096;

/// The polled watchers, by id.
#[derive(Default)]
pub(super) struct Watchers {
    table: Mutex<HashMap<String, Watcher>>,
}

struct Watcher {
    sandbox: String,
    events: Arc<Mutex<VecDeque<Value>>>,
    /// Set when the watch ended (the directory or the sandbox went): the next poll says
    /// so.
    ended: Arc<Mutex<Option<String>>>,
    task: tokio::task::AbortHandle,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug, Deserialize)]
struct WatchRequest {
    path: String,
    #[serde(default)]
    recursive: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatcherRequest {
    watcher_id: String,
}

/// An agent event as envd's `FilesystemEvent` (its name relative to the watched
/// directory), if E2B has a type for it.
fn event(root: &str, e: &WatchEvent) -> Option<Value> {
    let kind = match e.kind {
        WatchKind::Create => "EVENT_TYPE_CREATE",
        WatchKind::Write => "EVENT_TYPE_WRITE",
        WatchKind::Remove => "EVENT_TYPE_REMOVE",
        WatchKind::Rename => "EVENT_TYPE_RENAME",
        WatchKind::Chmod => "EVENT_TYPE_CHMOD",
        WatchKind::Overflow => return None,
    };
    let name = std::path::Path::new(&e.path)
        .strip_prefix(root)
        .map_or_else(|_| e.path.clone(), |p| p.to_string_lossy().into_owned());
    Some(json!({ "name": name, "type": kind }))
}

/// Starts the agent's watch of the request's directory.
async fn start(
    e2b: &Shared,
    t: &Target,
    headers: &HeaderMap,
    req: &WatchRequest,
) -> Result<(String, forkd_core::WatchedFiles), RpcError> {
    let user = user_of(headers)?;
    let path = resolve(&user, &req.path)?;
    let sandbox = e2b.sandbox(&t.id).await?;
    let watched = sandbox.watch(&path, req.recursive).await?;
    Ok((path, watched))
}

/// `WatchDir`: `start`, then each event, a keepalive while quiet, until the caller
/// hangs up or the watch ends.
pub(super) async fn watch_dir(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let go = async {
        let req: WatchRequest = connect::stream_request(&body)?;
        let (root, watched) = start(&e2b, &t, &headers, &req).await?;
        let keepalive = super::process::keepalive_of(&headers);
        let ticker =
            keepalive.map(|d| tokio::time::interval_at(tokio::time::Instant::now() + d, d));
        use futures::StreamExt;
        let events = futures::stream::unfold(Some((watched, ticker, root)), |state| async move {
            let (mut watched, mut ticker, root) = state?;
            loop {
                let got = tokio::select! {
                    e = watched.next() => e,
                    () = super::process::tick(&mut ticker) => {
                        let keep = connect::envelope(&json!({"keepalive": {}}));
                        return Some((keep, Some((watched, ticker, root))));
                    }
                };
                match got {
                    Ok(Some(e)) => {
                        if let Some(v) = event(&root, &e) {
                            let msg = connect::envelope(&json!({ "filesystem": v }));
                            return Some((msg, Some((watched, ticker, root))));
                        }
                    }
                    Ok(None) => return Some((connect::end_of_stream(None), None)),
                    Err(e) => {
                        let err = RpcError::from(e);
                        return Some((connect::end_of_stream(Some(&err)), None));
                    }
                }
            }
        });
        let start = connect::envelope(&json!({"start": {}}));
        Ok::<_, RpcError>(connect::stream_response(
            futures::stream::once(async move { start }).chain(events),
        ))
    };
    go.await.unwrap_or_else(connect::stream_error)
}

/// `CreateWatcher`: a watch whose events are kept until polled.
pub(super) async fn create_watcher(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    unary(async {
        let req: WatchRequest = connect::unary_request(&body)?;
        let (root, mut watched) = start(&e2b, &t, &headers, &req).await?;
        let events = Arc::new(Mutex::new(VecDeque::new()));
        let ended = Arc::new(Mutex::new(None));
        let (kept, end) = (events.clone(), ended.clone());
        let task = tokio::spawn(async move {
            loop {
                match watched.next().await {
                    Ok(Some(e)) => {
                        if let Some(v) = event(&root, &e) {
                            let mut q = lock(&kept);
                            if q.len() == KEPT {
                                q.pop_front();
                            }
                            q.push_back(v);
                        }
                    }
                    Ok(None) => {
                        *lock(&end) = Some(format!("{root} is gone"));
                        return;
                    }
                    Err(e) => {
                        *lock(&end) = Some(e.to_string());
                        return;
                    }
                }
            }
        });
        let id = format!("w-{}", forkd_host::ids::random_hex(8));
        lock(&e2b.watchers.table).insert(
            id.clone(),
            Watcher {
                sandbox: t.id.clone(),
                events,
                ended,
                task: task.abort_handle(),
            },
        );
        Ok(json!({ "watcherId": id }))
    })
    .await
}

/// A watcher this sandbox does not have.
fn unknown(id: &str) -> RpcError {
    RpcError::new(Code::NotFound, format!("watcher {id} not found"))
}

/// `GetWatcherEvents`: the events since the last poll.
pub(super) async fn get_watcher_events(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    body: Bytes,
) -> Response {
    unary(async {
        let req: WatcherRequest = connect::unary_request(&body)?;
        let table = lock(&e2b.watchers.table);
        let w = table
            .get(&req.watcher_id)
            .filter(|w| w.sandbox == t.id)
            .ok_or_else(|| unknown(&req.watcher_id))?;
        let events: Vec<Value> = lock(&w.events).drain(..).collect();
        if events.is_empty() {
            if let Some(why) = lock(&w.ended).clone() {
                return Err(RpcError::new(
                    Code::NotFound,
                    format!("watcher {} ended: {why}", req.watcher_id),
                ));
            }
        }
        Ok(json!({ "events": events }))
    })
    .await
}

/// `RemoveWatcher`.
pub(super) async fn remove_watcher(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    body: Bytes,
) -> Response {
    unary(async {
        let req: WatcherRequest = connect::unary_request(&body)?;
        let mut table = lock(&e2b.watchers.table);
        if table.get(&req.watcher_id).is_none_or(|w| w.sandbox != t.id) {
            return Err(unknown(&req.watcher_id));
        }
        table.remove(&req.watcher_id);
        Ok(json!({}))
    })
    .await
}
