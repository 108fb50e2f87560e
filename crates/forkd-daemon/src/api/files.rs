//! `/v1/sandboxes/{id}/files`: streamed upload and download, and the directory calls.

use super::error::ErrorBody;
use super::types::{FileInfo, FileList, PathBody, RenameBody};
use super::{guest_path, ApiError, App, JsonBody, PathParams, QueryParams};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkd_core::agent::WriteOptions;
use futures::TryStreamExt;
use serde::Deserialize;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, ReadBuf};

/// Largest upload accepted.
pub const MAX_UPLOAD: u64 = 1 << 30;

/// `?path=...`
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PathQuery {
    /// Absolute path in the guest.
    #[param(pattern = "^/")]
    path: String,
}

/// `?path=...&recursive=...`
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RemoveQuery {
    /// Absolute path in the guest.
    #[param(pattern = "^/")]
    path: String,
    /// Remove a directory with everything in it.
    #[serde(default)]
    recursive: bool,
}

/// `?path=...&mode=...`
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WriteQuery {
    /// Absolute path in the guest; missing parent directories are created.
    #[param(pattern = "^/")]
    path: String,
    /// Permission bits, octal (default 644).
    mode: Option<String>,
}

/// Downloads a file (streamed).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), PathQuery),
    responses((status = 200, content_type = "application/octet-stream", body = Vec<u8>),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 502, body = ErrorBody)))]
pub async fn read(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    QueryParams(q): QueryParams<PathQuery>,
) -> Result<Response, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    download(&sandbox, guest_path(&q.path)?.to_owned()).await
}

/// A guest file's bytes as the response body, streamed. The agent answers (or refuses:
/// a missing file, a directory) before the body starts, so errors still get their
/// status.
pub(crate) async fn download(
    sandbox: &forkd_core::Sandbox,
    path: String,
) -> Result<Response, ApiError> {
    let body = sandbox
        .call(|a| async move { a.open_file(&path).await })
        .await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::new(body),
    )
        .into_response())
}

/// Counts what passes through and fails the read once more than `limit` bytes came.
struct Limited<R> {
    inner: R,
    left: u64,
    exceeded: Arc<AtomicBool>,
}

impl<R: AsyncRead + Unpin> AsyncRead for Limited<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = (buf.filled().len() - before) as u64;
        if n > self.left {
            self.exceeded.store(true, Ordering::SeqCst);
            return Poll::Ready(Err(std::io::Error::other("upload too large")));
        }
        self.left -= n;
        r
    }
}

/// Uploads a file (streamed; it replaces the file at once when complete, so a failed
/// upload leaves the old file as it was).
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), WriteQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = FileInfo), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 413, body = ErrorBody),
        (status = 502, body = ErrorBody)))]
pub async fn write(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    QueryParams(q): QueryParams<WriteQuery>,
    request: Request,
) -> Result<Json<FileInfo>, ApiError> {
    if super::declared_length(request.headers()).is_some_and(|n| n > MAX_UPLOAD) {
        return Err(too_large());
    }
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let path = guest_path(&q.path)?.to_owned();
    let mode = match &q.mode {
        None => None,
        Some(m) => Some(
            u32::from_str_radix(m, 8)
                .ok()
                .filter(|m| *m <= 0o7777)
                .ok_or_else(|| ApiError::bad_request(format!("mode {m:?} is not octal 0..7777")))?,
        ),
    };
    let exceeded = Arc::new(AtomicBool::new(false));
    let stream = request
        .into_body()
        .into_data_stream()
        .map_err(std::io::Error::other);
    let reader = Limited {
        inner: tokio_util::io::StreamReader::new(stream),
        left: MAX_UPLOAD,
        exceeded: exceeded.clone(),
    };
    let opts = WriteOptions {
        mode,
        parents: true,
        owner: None,
    };
    let r = sandbox
        .call(|a| async move { a.write_file(&path, reader, opts).await })
        .await;
    if exceeded.load(Ordering::SeqCst) {
        return Err(too_large());
    }
    Ok(Json(r?.into()))
}

fn too_large() -> ApiError {
    ApiError::too_large(format!("uploads are limited to {MAX_UPLOAD} bytes"))
}

/// Removes a file, or a directory (`recursive` for a non-empty one).
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), RemoveQuery),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn remove(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    QueryParams(q): QueryParams<RemoveQuery>,
) -> Result<StatusCode, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let path = guest_path(&q.path)?.to_owned();
    sandbox
        .call(|a| async move { a.remove(&path, q.recursive).await })
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Lists a directory.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", params(("id" = String, Path), PathQuery),
    responses((status = 200, body = FileList), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn list(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    QueryParams(q): QueryParams<PathQuery>,
) -> Result<Json<FileList>, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let path = guest_path(&q.path)?.to_owned();
    let entries = sandbox
        .call(|a| async move { a.list_dir(&path).await })
        .await?;
    Ok(Json(FileList {
        entries: entries.into_iter().map(FileInfo::from).collect(),
    }))
}

/// Describes a path.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/stat", params(("id" = String, Path), PathQuery),
    responses((status = 200, body = FileInfo), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn stat(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    QueryParams(q): QueryParams<PathQuery>,
) -> Result<Json<FileInfo>, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let path = guest_path(&q.path)?.to_owned();
    let st = sandbox.call(|a| async move { a.stat(&path).await }).await?;
    Ok(Json(st.into()))
}

/// Creates a directory (and its missing parents).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", params(("id" = String, Path)),
    request_body = PathBody,
    responses((status = 200, body = FileInfo), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn mkdir(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    JsonBody(b): JsonBody<PathBody>,
) -> Result<Json<FileInfo>, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let path = guest_path(&b.path)?.to_owned();
    let st = sandbox
        .call(|a| async move { a.mkdir(&path).await })
        .await?;
    Ok(Json(st.into()))
}

/// Renames (moves) a path.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/rename", params(("id" = String, Path)),
    request_body = RenameBody,
    responses((status = 200, body = FileInfo), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn rename(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    JsonBody(b): JsonBody<RenameBody>,
) -> Result<Json<FileInfo>, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let from = guest_path(&b.from)?.to_owned();
    let to = guest_path(&b.to)?.to_owned();
    let st = sandbox
        .call(|a| async move { a.rename(&from, &to).await })
        .await?;
    Ok(Json(st.into()))
}

/// `?path=...&recursive=...` of a watch.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WatchParams {
    /// Absolute path of a directory in the guest.
    #[param(pattern = "^/")]
    path: String,
    /// Its subdirectories too (those made while watched as well).
    #[serde(default)]
    recursive: bool,
}

/// One line of a watch's stream.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct WatchLine {
    /// `create`, `write`, `remove`, `rename` (moved away; the new name comes as a
    /// `create`), `chmod`, `overflow` (events were dropped: more came than were read),
    /// or, last, `error` (the watch ended: the message says why, e.g. the sandbox was
    /// paused or removed).
    #[serde(rename = "type")]
    pub kind: String,
    /// The path (absolute); absent for an overflow or an error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Whether the path is a directory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<bool>,
    /// For an overflow: how many events were dropped at least.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropped: Option<u64>,
    /// For an error: why the watch ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl From<forkd_proto::files::WatchEvent> for WatchLine {
    fn from(e: forkd_proto::files::WatchEvent) -> WatchLine {
        let kind = serde_json::to_value(e.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let overflow = e.kind == forkd_proto::files::WatchKind::Overflow;
        WatchLine {
            kind,
            path: (!overflow).then_some(e.path),
            dir: (!overflow).then_some(e.dir),
            dropped: e.dropped,
            message: None,
        }
    }
}

/// Watches a directory: its changes as NDJSON lines, as they happen, until the caller
/// hangs up (or the directory goes: the stream ends; or the sandbox is paused or
/// removed: a last `error` line says so). What the caller does not read in time is
/// dropped and announced by an `overflow` line, never buffered without bound.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/watch", params(("id" = String, Path), WatchParams),
    responses((status = 200, content_type = "application/x-ndjson", body = WatchLine),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 502, body = ErrorBody)))]
pub async fn watch(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    QueryParams(q): QueryParams<WatchParams>,
) -> Result<Response, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let path = guest_path(&q.path)?;
    let watched = sandbox.watch(path, q.recursive).await?;
    // The stream holds the sandbox: an open watch keeps it from counting as idle.
    let lines = futures::stream::unfold(Some((watched, sandbox)), |state| async move {
        let (mut watched, sandbox) = state?;
        let (line, next) = match watched.next().await {
            Ok(Some(e)) => (WatchLine::from(e), Some((watched, sandbox))),
            Ok(None) => return None,
            Err(e) => (
                WatchLine {
                    kind: "error".into(),
                    path: None,
                    dir: None,
                    dropped: None,
                    message: Some(e.to_string()),
                },
                None,
            ),
        };
        Some((super::run::line(&line), next))
    });
    Ok(super::run::ndjson(lines))
}
