//! Snapshot archives over the API: `GET /v1/snapshots/{tag}/archive` streams a snapshot
//! and its ancestors as an OCI image layout in a tar; `POST /v1/archives`
//! installs one sent as the request body. The daemon may be on another host than its
//! client, so both stream instead of naming files.

use super::error::ErrorBody;
use super::types::{UnpackQuery, Unpacked};
use super::{ApiError, App, PathParams, QueryParams};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use forkd_storage::oci::{pack, unpack};
use forkd_storage::snapshot::{SnapshotError, Tag};
use futures::TryStreamExt;
use std::io::Write;

/// Bytes per chunk of the streamed archive.
const CHUNK: usize = 1 << 20;

/// The media type of an archive.
pub const ARCHIVE_MEDIA_TYPE: &str = "application/x-tar";

/// A snapshot and its ancestors as an archive. The parts are compressed before the
/// answer starts (so a damaged part still gets an error status), then streamed.
#[utoipa::path(get, path = "/v1/snapshots/{tag}/archive", params(("tag" = String, Path)),
    responses((status = 200, content_type = "application/x-tar", body = Vec<u8>),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 507, body = ErrorBody)))]
pub async fn download(
    State(app): State<App>,
    PathParams(tag): PathParams<String>,
) -> Result<Response, ApiError> {
    let tag = Tag::parse(&tag)?;
    let store = app.registry.store().clone();
    let shown = tag.to_string();
    let packed = tokio::task::spawn_blocking(move || {
        pack::pack(&store, &tag, &|m| tracing::info!(tag = %shown, "{m}"))
    })
    .await
    .map_err(|e| ApiError::internal(format!("packing: {e}")))??;
    let size = packed.layout.tar_size()?;
    let snapshots: Vec<String> = packed.snapshots.iter().map(|(t, _)| t.clone()).collect();
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(4);
    tokio::task::spawn_blocking(move || {
        let mut w = ChannelWriter {
            tx: tx.clone(),
            buf: Vec::with_capacity(CHUNK),
        };
        let r = packed.layout.write_tar(&mut w);
        if let Err(e) = r {
            // The client may be gone (nothing to tell), or reading failed midway: the
            // body ends with an error, and the client sees a short archive.
            let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Ok((
        [
            (header::CONTENT_TYPE, ARCHIVE_MEDIA_TYPE.to_owned()),
            (header::CONTENT_LENGTH, size.to_string()),
            (
                header::HeaderName::from_static("x-forkd-snapshots"),
                snapshots.join(","),
            ),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// Sends what is written to it as body chunks.
struct ChannelWriter {
    tx: tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
    buf: Vec<u8>,
}

impl ChannelWriter {
    fn send(&mut self) -> std::io::Result<()> {
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client gone"))
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let n = data.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        self.send()
    }
}

/// Installs the snapshots of an archive sent as the body. The whole archive is received
/// and checked before anything is installed; a refused archive installs nothing.
#[utoipa::path(post, path = "/v1/archives", params(UnpackQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream",
        description = "An archive written by `forkd pack` (a tar; any content type is taken)"),
    responses((status = 201, body = Unpacked), (status = 400, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 422, body = ErrorBody),
        (status = 507, body = ErrorBody)))]
pub async fn upload(
    State(app): State<App>,
    QueryParams(q): QueryParams<UnpackQuery>,
    request: Request,
) -> Result<(StatusCode, Json<Unpacked>), ApiError> {
    let stream = request
        .into_body()
        .into_data_stream()
        .map_err(std::io::Error::other);
    let mut reader = tokio_util::io::StreamReader::new(stream);
    let store = app.registry.store().clone();
    let hv = app.registry.hypervisor().clone();
    let rename = match q.tag.as_deref().map(Tag::parse).transpose() {
        Ok(Some(t)) if store.exists(&t) => Err(SnapshotError::Exists { tag: t.to_string() }),
        other => other,
    };
    let rename = match rename {
        Ok(r) => r,
        Err(e) => {
            discard(&mut reader).await;
            return Err(e.into());
        }
    };
    let (result, reader) = tokio::task::spawn_blocking(move || {
        let mut bridge = tokio_util::io::SyncIoBridge::new(reader);
        let r = unpack::unpack(&store, hv.as_ref(), &mut bridge, rename.as_ref(), &|m| {
            tracing::debug!("unpacking: {m}");
        });
        (r, bridge.into_inner())
    })
    .await
    .map_err(|e| ApiError::internal(format!("unpacking: {e}")))?;
    let unpacked = match result {
        Ok(u) => u,
        Err(e) => {
            let mut reader = reader;
            discard(&mut reader).await;
            return Err(e.into());
        }
    };
    for t in &unpacked.installed {
        tracing::info!(tag = %t, "snapshot installed from an archive");
        app.registry.reopen_pool(t, false);
    }
    crate::service::tags::claim_made(&app, &unpacked.installed).await?;
    Ok((
        StatusCode::CREATED,
        Json(Unpacked {
            tag: unpacked.tag,
            installed: unpacked.installed,
            present: unpacked.present,
        }),
    ))
}

/// Reads what the client still sends before it is answered: an HTTP/1 client writing
/// its upload would otherwise see the connection closed under it instead of the answer.
async fn discard(body: &mut (impl tokio::io::AsyncRead + Unpin)) {
    let _ = tokio::io::copy(body, &mut tokio::io::sink()).await;
}
