//! `POST /v1/images`: a container image sent as the request body (a `docker save` tar
//! or a tar of an OCI image layout), kept so that a recipe can build on it with
//! `from = "upload:sha256:<hex>"`. Clients send images rather than name host paths:
//! the daemon opens no host file for a client (see [`crate::import_dirs`]).

use super::error::ErrorBody;
use super::types::{ImageUploadQuery, UploadedImage};
use super::{ApiError, App, QueryParams};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::Json;
use forkd_storage::oci::upload;
use futures::TryStreamExt;

/// The largest image archive taken.
const MAX_IMAGE: u64 = 64 << 30;

/// What is read of a refused upload's rest before the answer.
const DRAINED: u64 = 16 << 20;

/// Receives an image archive and keeps its image.
#[utoipa::path(post, path = "/v1/images", params(ImageUploadQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream",
        description = "A `docker save` archive or a tar of an OCI image layout (any content type is taken)"),
    responses((status = 201, body = UploadedImage), (status = 400, body = ErrorBody),
        (status = 422, body = ErrorBody), (status = 507, body = ErrorBody)))]
pub async fn upload(
    State(app): State<App>,
    QueryParams(q): QueryParams<ImageUploadQuery>,
    request: Request,
) -> Result<(StatusCode, Json<UploadedImage>), ApiError> {
    let home = app.config.home.clone();
    // The archive is copied out once and its blobs once more into the cache: a declared
    // size that cannot fit is refused before a byte is read.
    if let Some(n) = super::declared_length(request.headers()) {
        if n > MAX_IMAGE {
            return Err(ApiError::too_large(format!(
                "the image declares {n} bytes; at most {MAX_IMAGE} are taken"
            )));
        }
        forkd_host::space::ensure_room(&home.tmp_dir(), n.saturating_mul(2), "receiving an image")?;
    }
    if q.name
        .as_deref()
        .is_some_and(|n| n.is_empty() || n.len() > 256)
    {
        return Err(ApiError::bad_request("name must be 1 to 256 characters"));
    }
    let stream = request
        .into_body()
        .into_data_stream()
        .map_err(std::io::Error::other);
    // A body without a length is cut at the same bound as one that declares it.
    let reader =
        tokio::io::AsyncReadExt::take(tokio_util::io::StreamReader::new(stream), MAX_IMAGE + 1);
    let home2 = home.clone();
    let (received, mut reader) = tokio::task::spawn_blocking(move || {
        let mut bridge = tokio_util::io::SyncIoBridge::new(reader);
        let r = upload::receive(&home2, &mut bridge, q.name.as_deref());
        (r, bridge.into_inner())
    })
    .await
    .map_err(|e| ApiError::internal(format!("receiving an image: {e}")))?;
    let scratch = match received {
        Ok(s) => s,
        Err(e) => {
            // An HTTP/1 client still writing would see the connection closed under it
            // instead of the answer: what it still sends is read, up to a bound.
            let mut rest = tokio::io::AsyncReadExt::take(&mut reader, DRAINED);
            let _ = tokio::io::copy(&mut rest, &mut tokio::io::sink()).await;
            if reader.limit() == 0 {
                return Err(ApiError::too_large(format!(
                    "the image is larger than {MAX_IMAGE} bytes"
                )));
            }
            return Err(e.into());
        }
    };
    let kept = upload::install(&home, scratch.path(), &|m| {
        tracing::debug!("image upload: {m}")
    })
    .await?;
    tracing::info!(digest = %kept.digest, "image uploaded");
    Ok((
        StatusCode::CREATED,
        Json(UploadedImage {
            from: kept.from,
            digest: kept.digest,
            layers: kept.layers,
        }),
    ))
}
