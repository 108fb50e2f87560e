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
use forkd_core::oci::upload;
use futures::TryStreamExt;

/// Receives an image archive and keeps its image.
#[utoipa::path(post, path = "/v1/images", params(ImageUploadQuery),
    request_body(content = Vec<u8>, content_type = "application/x-tar",
        description = "A `docker save` archive or a tar of an OCI image layout"),
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
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared {
        forkd_core::space::ensure_room(&home.tmp_dir(), n.saturating_mul(2), "receiving an image")?;
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
    let reader = tokio_util::io::StreamReader::new(stream);
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
            // instead of the answer.
            let _ = tokio::io::copy(&mut reader, &mut tokio::io::sink()).await;
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
