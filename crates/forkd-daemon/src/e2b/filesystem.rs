//! envd's `filesystem.Filesystem` service: stat, list, make a directory, move, remove,
//! on forkd's agent; its watches are in [`super::watch`].

use super::connect::unary;
use super::connect::{self, Code, RpcError};
use super::{resolve, user_of, Shared, Target};
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use forkd_core::Sandbox;
use forkd_proto::files::{FileKind, FileStat};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// Deepest listing (deeper asks get this).
const MAX_DEPTH: u32 = 64;
/// Most entries one ListDir answers.
const MAX_ENTRIES: usize = 100_000;

pub(super) fn routes() -> Router<Shared> {
    Router::new()
        .route("/filesystem.Filesystem/Stat", post(stat))
        .route("/filesystem.Filesystem/ListDir", post(list_dir))
        .route("/filesystem.Filesystem/MakeDir", post(make_dir))
        .route("/filesystem.Filesystem/Move", post(move_entry))
        .route("/filesystem.Filesystem/Remove", post(remove))
        .route(
            "/filesystem.Filesystem/WatchDir",
            post(super::watch::watch_dir),
        )
        .route(
            "/filesystem.Filesystem/CreateWatcher",
            post(super::watch::create_watcher),
        )
        .route(
            "/filesystem.Filesystem/GetWatcherEvents",
            post(super::watch::get_watcher_events),
        )
        .route(
            "/filesystem.Filesystem/RemoveWatcher",
            post(super::watch::remove_watcher),
        )
}

/// `ls -l`'s rendering of a mode.
fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// A file as envd's `EntryInfo` (proto3 JSON: int64 as a string).
pub(super) fn entry(f: &FileStat) -> Value {
    let kind = match f.kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let mtime = std::time::UNIX_EPOCH
        + std::time::Duration::from_millis(u64::try_from(f.mtime_ms).unwrap_or(0));
    json!({
        "name": f.name,
        "type": kind,
        "path": f.path,
        "size": f.size.to_string(),
        "mode": f.mode & 0o7777,
        "permissions": permissions(f.kind, f.mode),
        "modifiedTime": forkd_image::timestamp::rfc3339_utc(mtime),
    })
}

#[derive(Debug, Deserialize)]
struct PathRequest {
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct MoveRequest {
    source: String,
    destination: String,
}

/// A filesystem call: its message, the caller's user and the sandbox, or the Connect
/// error that stops it before the guest is asked anything.
struct Call<R> {
    sandbox: Arc<Sandbox>,
    user: String,
    req: R,
}

impl<R: DeserializeOwned> Call<R> {
    /// A path of the request, for the caller's user.
    fn path(&self, p: &str) -> Result<String, RpcError> {
        resolve(&self.user, p)
    }
}

impl<R: DeserializeOwned + Send> FromRequest<Shared> for Call<R> {
    type Rejection = Response;

    async fn from_request(req: Request, e2b: &Shared) -> Result<Self, Response> {
        let go = async {
            let t = req
                .extensions()
                .get::<Target>()
                .cloned()
                .ok_or_else(|| RpcError::new(Code::Internal, "the request names no sandbox"))?;
            let user = user_of(req.headers())?;
            let body = Bytes::from_request(req, e2b)
                .await
                .map_err(|e| RpcError::new(Code::InvalidArgument, e.body_text()))?;
            Ok::<_, RpcError>(Call {
                req: connect::unary_request(&body)?,
                sandbox: e2b.sandbox(&t.id).await?,
                user,
            })
        };
        go.await.map_err(IntoResponse::into_response)
    }
}

async fn stat(call: Call<PathRequest>) -> Response {
    unary(async {
        let path = call.path(&call.req.path)?;
        let f = call
            .sandbox
            .call(|a| async move { a.stat(&path).await })
            .await?;
        Ok(json!({ "entry": entry(&f) }))
    })
    .await
}

/// `ListDir`: the entries under a directory, `depth` levels down (1: its own).
async fn list_dir(call: Call<PathRequest>) -> Response {
    unary(async {
        let depth = call.req.depth.unwrap_or(1).clamp(1, MAX_DEPTH);
        let mut entries = Vec::new();
        let mut level = vec![call.path(&call.req.path)?];
        for _ in 0..depth {
            if level.is_empty() {
                break;
            }
            let mut next = Vec::new();
            for dir in level {
                let listed = call
                    .sandbox
                    .call(|a| async move { a.list_dir(&dir).await })
                    .await?;
                for f in listed {
                    if f.kind == FileKind::Dir {
                        next.push(f.path.clone());
                    }
                    entries.push(entry(&f));
                }
                if entries.len() > MAX_ENTRIES {
                    return Err(RpcError::new(
                        Code::ResourceExhausted,
                        format!("more than {MAX_ENTRIES} entries: list less deep"),
                    ));
                }
            }
            level = next;
        }
        Ok(json!({ "entries": entries }))
    })
    .await
}

/// `MakeDir`: creates the directory and its parents (the caller's); one that exists is
/// `already_exists`, as envd answers.
async fn make_dir(call: Call<PathRequest>) -> Response {
    unary(async {
        let path = call.path(&call.req.path)?;
        let p = path.clone();
        if call
            .sandbox
            .call(|a| async move { a.stat(&p).await })
            .await
            .is_ok()
        {
            return Err(RpcError::new(
                Code::AlreadyExists,
                format!("{path} already exists"),
            ));
        }
        let user = call.user.clone();
        let f = call
            .sandbox
            .call(|a| async move { a.mkdir_owned(&path, Some(&user)).await })
            .await?;
        Ok(json!({ "entry": entry(&f) }))
    })
    .await
}

async fn move_entry(call: Call<MoveRequest>) -> Response {
    unary(async {
        let (from, to) = (
            call.path(&call.req.source)?,
            call.path(&call.req.destination)?,
        );
        let f = call
            .sandbox
            .call(|a| async move { a.rename(&from, &to).await })
            .await?;
        Ok(json!({ "entry": entry(&f) }))
    })
    .await
}

async fn remove(call: Call<PathRequest>) -> Response {
    unary(async {
        let path = call.path(&call.req.path)?;
        call.sandbox
            .call(|a| async move { a.remove(&path, true).await })
            .await?;
        Ok(json!({}))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions(FileKind::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::Symlink, 0o777), "lrwxrwxrwx");
    }
}
