//! `POST /v1/sandboxes/{id}/pause` and `/resume`: a sandbox written to disk, its VM
//! ended, and run again from there.

use super::error::ErrorBody;
use super::{ApiError, App, PathParams};
use crate::registry::{PauseOutcome, ResumeOutcome};
use axum::extract::State;
use axum::Json;

/// Pauses a running sandbox: its memory (the pages that differ from its snapshot's),
/// device state and disk stay under the daemon's data directory, its VM exits and its
/// memory and running slot are released. It keeps its id, labels, limits, network
/// policy, processes and files. The guest stops only for the copy's last pass.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", params(("id" = String, Path)),
    responses((status = 200, body = PauseOutcome),
        (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "not running (the message names its state), or being branched"),
        (status = 507, body = ErrorBody, description = "no room for the pause image; the sandbox runs on")))]
pub async fn pause(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<Json<PauseOutcome>, ApiError> {
    Ok(Json(crate::service::pause::pause(&app, &id).await?))
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
