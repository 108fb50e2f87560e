//! `POST /v1/sandboxes/{id}/pause` and `/resume`: a sandbox written to disk, its VM
//! ended, and run again from there.

use super::error::ErrorBody;
use super::{ApiError, App, PathParams};
use crate::registry::{PauseOutcome, ResumeOutcome};
use axum::extract::State;
use axum::Json;

/// The pause's body (optional): what is kept.
#[derive(Debug, Default, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PauseRequest {
    /// `memory` (default): the whole machine, resumed as it was. `disk`: its disk only,
    /// flushed by the guest first; a resume boots it from that disk (its processes and
    /// memory are gone, its files kept).
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub keep: Option<forkd_core::pause::PauseKeeps>,
}

/// Pauses a running sandbox: its memory (the pages that differ from its snapshot's),
/// device state and disk stay under the daemon's data directory, its VM exits and its
/// memory and running slot are released. It keeps its id, labels, limits, network
/// policy, processes and files. The guest stops only for the copy's last pass. With
/// `{"keep": "disk"}` only its disk is kept and a resume boots it.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", params(("id" = String, Path)),
    request_body(content = Option<PauseRequest>),
    responses((status = 200, body = PauseOutcome),
        (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "not running (the message names its state), or being branched"),
        (status = 507, body = ErrorBody, description = "no room for the pause image; the sandbox runs on")))]
pub async fn pause(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    body: axum::body::Bytes,
) -> Result<Json<PauseOutcome>, ApiError> {
    let req: PauseRequest = if body.iter().all(u8::is_ascii_whitespace) {
        PauseRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("the pause's body: {e}")))?
    };
    let keeps = req.keep.unwrap_or_default();
    Ok(Json(crate::service::pause::pause(&app, &id, keeps).await?))
}

/// Resumes a paused sandbox in place: same id, same disk and network policy, its
/// memory and processes as they were, its clock set from the host's. A running sandbox
/// is left as it is (`total_ms` 0); concurrent resumes wait for one.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", params(("id" = String, Path)),
    responses((status = 200, body = ResumeOutcome),
        (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "starting, stopping or failed (the message names the state), or a damaged pause image (the sandbox is then failed, its files kept)"),
        (status = 503, body = ErrorBody, description = "no running slot or memory for it")))]
pub async fn resume(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<Json<ResumeOutcome>, ApiError> {
    Ok(Json(crate::service::pause::resume(&app, &id).await?))
}
