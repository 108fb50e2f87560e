//! `POST /v1/sandboxes/{id}/branch`: a snapshot of a running sandbox, which goes on.

use super::error::ErrorBody;
use super::{ApiError, App, JsonBody, PathParams};
use crate::branch::BranchOutcome;
use crate::state::OperationRow;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkd_hypervisor::BranchMode;
use serde::Deserialize;

/// What a branch is asked for.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BranchBody {
    /// The new snapshot's tag (default: `br-` and 8 random hex digits).
    #[serde(default)]
    #[schema(pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
    pub tag: Option<String>,
    /// `live` (memory is copied while the source runs, which stops only for the last
    /// pages and the device state) or `pause` (stopped for the whole copy). The default
    /// is `live` where the hypervisor copies a running guest faithfully (KVM, or QEMU 9.0
    /// and newer under TCG) and `pause` elsewhere; asking for `live` there gets a 409.
    #[serde(default)]
    #[schema(value_type = Option<String>, example = "live")]
    pub mode: Option<BranchMode>,
    /// Answer when the snapshot is written (201, the default), or at once with the
    /// branch's operation (202) to poll.
    #[serde(default = "yes")]
    pub wait: bool,
}

fn yes() -> bool {
    true
}

/// Branches a running sandbox: its memory, devices, disk and code contexts are captured
/// at one instant into a new snapshot (a diff on the snapshot the sandbox builds on),
/// and the sandbox runs on. Children of the snapshot start with everything the sandbox
/// had at that instant.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/branch", params(("id" = String, Path)),
    request_body = BranchBody,
    responses((status = 201, body = BranchOutcome),
        (status = 202, body = OperationRow, description = "with `wait: false`: the branch's operation"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 507, body = ErrorBody)))]
pub async fn branch(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    JsonBody(b): JsonBody<BranchBody>,
) -> Result<Response, ApiError> {
    let branch = crate::service::branch::start(&app, &id, b.tag.as_deref(), b.mode).await?;
    if !b.wait {
        return Ok((StatusCode::ACCEPTED, Json(branch.op)).into_response());
    }
    let outcome = branch.outcome().await?;
    Ok((StatusCode::CREATED, Json(outcome)).into_response())
}
