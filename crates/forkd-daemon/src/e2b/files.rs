//! envd's plain HTTP routes: `GET /files` (a file's bytes), `POST /files` (upload, as
//! multipart parts named `file` whose file names are the destinations, or one raw
//! `application/octet-stream` body for `?path=`), and `GET /health`. Errors answer
//! `{"code": <status>, "message"}` as envd does.

use super::control::{fail, E2bError};
use super::{resolve, user_of, Shared, Target};
use axum::body::Bytes;
use axum::extract::{FromRequest, Multipart, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use forkd_core::agent::WriteOptions;
use forkd_core::Sandbox;
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

use crate::api::files::MAX_UPLOAD;

pub(super) fn routes() -> Router<Shared> {
    Router::new()
        .route("/files", get(read).post(write))
        .route("/health", get(health))
}

#[derive(Debug, Deserialize)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

impl FileQuery {
    /// The user: `?username=`, else the Basic auth header's, else `user`.
    fn user(&self, headers: &HeaderMap) -> Result<String, E2bError> {
        match &self.username {
            Some(u) if !u.is_empty() => Ok(u.clone()),
            _ => Ok(user_of(headers)?),
        }
    }
}

async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}

async fn read(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
) -> Result<Response, E2bError> {
    let user = q.user(&headers)?;
    let path = resolve(&user, q.path.as_deref().unwrap_or(""))?;
    let sandbox = e2b.sandbox(&t.id).await?;
    readable_by(&sandbox, &user, &path).await?;
    Ok(crate::api::files::download(&sandbox, path).await?)
}

/// Refuses (403) a read of `path` that `user` could not make himself. The agent reads
/// as root; the guest's kernel decides what the user may read (modes, ACLs, each
/// directory on the way), so the file is opened for reading as that user first.
async fn readable_by(sandbox: &Arc<Sandbox>, user: &str, path: &str) -> Result<(), E2bError> {
    if user == "root" {
        return Ok(());
    }
    use forkd_proto::exec::{Command, ExecRequest};
    let argv = ["head", "-c", "0", "--", path].map(str::to_owned).to_vec();
    let mut req = ExecRequest::new(Command::Argv(argv));
    req.user = Some(user.to_owned());
    req.timeout_ms = Some(30_000);
    let r = sandbox
        .exec(req, None)
        .await
        .map_err(crate::api::ApiError::from)?;
    let stderr = String::from_utf8_lossy(&r.stderr);
    if !r.status.success() && stderr.contains("Permission denied") {
        return Err(fail(
            StatusCode::FORBIDDEN,
            format!("permission denied: user {user} may not read {path}"),
        ));
    }
    // Anything else (no such file, a directory) is for the read itself to say.
    Ok(())
}

async fn write(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Result<Response, E2bError> {
    let user = q.user(req.headers())?;
    let multipart = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"));
    // A raw upload is one file: a declared size over the limit is refused before a byte
    // is read. (A multipart one may carry several files, each checked as it streams.)
    let declared = crate::api::declared_length(req.headers());
    if let Some(n) = declared.filter(|n| !multipart && *n > MAX_UPLOAD) {
        return Err(fail(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the upload declares {n} bytes; a file may have at most {MAX_UPLOAD}"),
        ));
    }
    // The SDKs' gzip uploads (`gzip=True`): not decoded here, so refused rather
    // than written compressed.
    if let Some(enc) = req.headers().get(header::CONTENT_ENCODING) {
        if enc.as_bytes() != b"identity" {
            return Err(fail(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "uploads with Content-Encoding {:?} are not supported: send them uncompressed",
                    String::from_utf8_lossy(enc.as_bytes())
                ),
            ));
        }
    }
    let sandbox = e2b.sandbox(&t.id).await?;
    let mut written = Vec::new();
    if !multipart {
        let path = q
            .path
            .as_deref()
            .ok_or_else(|| fail(StatusCode::BAD_REQUEST, "a raw upload needs ?path="))?;
        let path = resolve(&user, path)?;
        let body = req
            .into_body()
            .into_data_stream()
            .map(|r| r.map_err(std::io::Error::other));
        written.push(upload(&sandbox, &path, &user, body).await?);
        return Ok(Json(written).into_response());
    }
    let mut parts = Multipart::from_request(req, &())
        .await
        .map_err(|e| fail(StatusCode::BAD_REQUEST, e.body_text()))?;
    let mut count = 0;
    while let Some(field) = parts
        .next_field()
        .await
        .map_err(|e| fail(StatusCode::BAD_REQUEST, e.body_text()))?
    {
        if field.name() != Some("file") {
            continue;
        }
        count += 1;
        // One file may be named by ?path=; otherwise each part's file name is its
        // destination.
        let dest = match (&q.path, field.file_name()) {
            (Some(p), _) if count == 1 => p.clone(),
            (_, Some(name)) => name.to_owned(),
            _ => {
                return Err(fail(
                    StatusCode::BAD_REQUEST,
                    "a part named file has no file name to write it to",
                ))
            }
        };
        let path = resolve(&user, &dest)?;
        let body = field.map(|r| r.map_err(std::io::Error::other));
        written.push(upload(&sandbox, &path, &user, body).await?);
    }
    if written.is_empty() {
        return Err(fail(
            StatusCode::BAD_REQUEST,
            "the upload has no part named file",
        ));
    }
    Ok(Json(written).into_response())
}

/// Streams `body` into the guest's file `path`, owned by `user`, and answers envd's
/// `{name, path, type}` of it.
async fn upload(
    sandbox: &Arc<Sandbox>,
    path: &str,
    user: &str,
    body: impl Stream<Item = std::io::Result<Bytes>> + Send,
) -> Result<Value, E2bError> {
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(4);
    let reader = tokio_util::io::StreamReader::new(Box::pin(futures::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|c| (c, rx)) },
    )));
    let opts = WriteOptions {
        mode: None,
        parents: true,
        owner: Some(user.to_owned()),
    };
    let p = path.to_owned();
    let write = sandbox.call(|a| async move { a.write_file(&p, reader, opts).await });
    // The body is read here, in this task (a multipart part borrows the request), and
    // handed to the write through the channel; a body over the limit fails the write.
    let pump = async move {
        let mut body = std::pin::pin!(body);
        let mut total = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return false;
                }
            };
            total += chunk.len() as u64;
            if total > MAX_UPLOAD {
                let _ = tx
                    .send(Err(std::io::Error::other("upload too large")))
                    .await;
                return true;
            }
            if tx.send(Ok(chunk)).await.is_err() {
                return false;
            }
        }
        false
    };
    let (written, too_large) = tokio::join!(write, pump);
    if too_large {
        return Err(fail(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a file of more than {MAX_UPLOAD} bytes"),
        ));
    }
    let f = written?;
    Ok(json!({"name": f.name, "path": f.path, "type": "file"}))
}
