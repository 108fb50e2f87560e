//! `/v1/sandboxes`: create children of a snapshot, list, get, delete, set a timeout.

use super::error::ErrorBody;
use super::types::{
    CreateSandboxes, CreatedSandboxes, NetworkBody, SandboxInfo, SandboxLimits, SandboxList,
    SetTimeout,
};
use super::{ApiError, App, JsonBody, PathParams, QueryParams};
use crate::registry::{Listed, RegistryError};
use crate::server::AuditIds;
use crate::service;
use crate::state::OperationRow;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> ApiError {
        match e {
            RegistryError::AtCapacity { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "at_capacity",
                e.to_string(),
            ),
            RegistryError::PausedAtCapacity { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "at_capacity",
                e.to_string(),
            ),
            RegistryError::Memory(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "insufficient_memory",
                e.to_string(),
            ),
            RegistryError::Sandbox(s) => s.into(),
            RegistryError::State(s) => s.into(),
            RegistryError::NoNic { .. }
            | RegistryError::BaseUnavailable { .. }
            | RegistryError::BranchingAlready { .. }
            | RegistryError::TagBeingWritten { .. }
            | RegistryError::StoppedDuringBranch { .. }
            | RegistryError::PauseDuringBranch { .. } => ApiError::conflict(e.to_string()),
        }
    }
}

/// A sandbox as the API shows it: its persisted state, or `failed` with the reason as
/// soon as its handle knows (the reaper records and removes it a moment later).
pub fn info(e: &Listed, hv: &dyn forkd_hypervisor::Hypervisor) -> SandboxInfo {
    // (A handle whose VM a pause ended says the sandbox is paused, not failed.)
    let failure = e
        .sandbox
        .as_ref()
        .and_then(|s| s.failure())
        .filter(|f| !matches!(f, forkd_core::SandboxError::NotReady { .. }));
    let (status, error) = match failure {
        Some(f) => ("failed".to_string(), Some(f.to_string())),
        None => (e.row.state.as_str().to_string(), e.row.error.clone()),
    };
    SandboxInfo {
        id: e.row.id.clone(),
        snapshot: e.row.snapshot.clone(),
        status,
        error,
        pid: e.row.pid,
        vcpus: e.row.config.vcpus,
        memory_mib: e.row.config.memory_mib,
        labels: e.row.labels.clone(),
        created_at: e.row.created_at.clone(),
        timeout_at: e.row.timeout_at,
        limits: limits(e, hv),
        network: e.row.config.network.as_ref().map(|n| (&n.policy).into()),
        host: None,
    }
}

/// A sandbox's limits as its record has them, with what its cgroup counts.
fn limits(e: &Listed, hv: &dyn forkd_hypervisor::Hypervisor) -> Option<SandboxLimits> {
    let l = e.row.config.limits?;
    let cgroup = e.sandbox.as_ref().and_then(|s| s.vm().cgroup());
    Some(SandboxLimits {
        memory_bytes: l.memory_bytes,
        cpu_cores: (l.cpu_millicores != 0).then(|| f64::from(l.cpu_millicores) / 1000.0),
        cpu_weight: l.cpu_weight,
        pids: l.pids,
        disk_bytes: hv.disk_size(&e.row.config.root_disk),
        enforced_by: cgroup.map(|(v, _)| format!("cgroup {}", v.as_str())),
        memory_used_bytes: cgroup.map(|(_, u)| u.memory_bytes),
    })
}

/// Forks `n` children of a snapshot, at most the daemon's fork parallelism restoring at
/// once. All or nothing unless `partial`: then the children that started are kept and
/// each failure is listed. With `wait: false` it answers 202 at once with the fork's
/// operation (progress in `done`/`total`, the children's ids in `result` once done;
/// `DELETE /v1/operations/{id}` cancels it).
#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandboxes,
    responses(
        (status = 201, body = CreatedSandboxes),
        (status = 202, body = OperationRow, description = "with `wait: false`: the fork's operation"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 413, body = ErrorBody),
        (status = 503, body = ErrorBody), (status = 507, body = ErrorBody)))]
pub async fn create(
    State(app): State<App>,
    headers: axum::http::HeaderMap,
    JsonBody(raw): JsonBody<serde_json::Value>,
) -> Result<Response, ApiError> {
    use service::placement::{PULL_FROM, SNAPSHOT_DIGEST};
    let req = CreateSandboxes::deserialize(&raw)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid: {e}")))?;
    if req.placement.is_some() && app.cluster.is_none() {
        return Err(ApiError::conflict(
            "placement spreads a fork over the hosts of a cluster, and this daemon is not part of one (start it with --cluster)",
        ));
    }
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let forwarded = headers.contains_key(service::cluster::FORWARDED_BY);
    // A share of a fork placed by another host of the cluster: its snapshot first.
    if let (true, Some(digest)) = (forwarded, header(SNAPSHOT_DIGEST)) {
        service::placement::ensure_snapshot(&app, &req.snapshot, header(PULL_FROM), digest).await?;
    }
    let created = if app.cluster.is_some() && !forwarded && req.wait {
        let handed = headers.contains_key(service::placement::HANDED_BY);
        service::placement::fork(&app, req, &raw, handed).await?
    } else if !req.wait {
        let fork = service::fork::start_request(&app, req)?;
        let op = fork.operation(&app).await?;
        return Ok((StatusCode::ACCEPTED, Json(op)).into_response());
    } else {
        service::fork::create_here(&app, req).await?
    };
    // The path names no id: the audit record gets the children's from here.
    let ids = AuditIds(created.sandboxes.iter().map(|s| s.id.clone()).collect());
    Ok((StatusCode::CREATED, axum::Extension(ids), Json(created)).into_response())
}

/// Filters of the sandbox list.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListFilter {
    /// Only children of this snapshot.
    snapshot: Option<String>,
    /// Only sandboxes with this label, as `key=value`.
    #[param(pattern = "^[^=]+=")]
    label: Option<String>,
    /// In a cluster: `cluster` (the default) lists every host's sandboxes, `host` only
    /// this one's.
    scope: Option<ListScope>,
}

/// Which sandboxes a daemon in a cluster lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ListScope {
    /// Every host's.
    Cluster,
    /// This host's.
    Host,
}

/// Lists the sandboxes, oldest first.
#[utoipa::path(get, path = "/v1/sandboxes", params(ListFilter),
    responses((status = 200, body = SandboxList), (status = 400, body = ErrorBody)))]
pub async fn list(
    State(app): State<App>,
    QueryParams(f): QueryParams<ListFilter>,
) -> Result<Json<SandboxList>, ApiError> {
    let label = match &f.label {
        None => None,
        Some(l) => Some(l.split_once('=').ok_or_else(|| {
            ApiError::bad_request(format!("label filter {l:?} is not key=value"))
        })?),
    };
    let sandboxes = app
        .registry
        .list()
        .iter()
        .filter(|e| f.snapshot.as_deref().is_none_or(|s| e.row.snapshot == s))
        .filter(|e| label.is_none_or(|(k, v)| e.row.labels.get(k).map(String::as_str) == Some(v)))
        .map(|e| info(e, app.registry.hypervisor().as_ref()))
        .collect();
    let sandboxes = match (&app.cluster, f.scope) {
        (Some(_), None | Some(ListScope::Cluster)) => {
            let query = [("snapshot", &f.snapshot), ("label", &f.label)];
            service::cluster::list(&app, sandboxes, &query).await?
        }
        _ => sandboxes,
    };
    Ok(Json(SandboxList { sandboxes }))
}

/// One sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    let mut info = info(
        &app.registry.describe(&id)?,
        app.registry.hypervisor().as_ref(),
    );
    // On a host of a cluster, it says which (a request may have come through another).
    info.host = app.cluster.as_deref().map(|c| c.host_name().to_owned());
    Ok(Json(info))
}

/// Stops a sandbox and removes its files.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<StatusCode, ApiError> {
    service::sandbox::delete(&app, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Replaces a running sandbox's egress policy; `off` takes its NIC's link down.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", params(("id" = String, Path)),
    request_body = NetworkBody,
    responses((status = 200, body = SandboxInfo), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn set_network(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    JsonBody(req): JsonBody<NetworkBody>,
) -> Result<Json<SandboxInfo>, ApiError> {
    let policy = req
        .policy()
        .map_err(|e| ApiError::bad_request(format!("network: {e}")))?;
    let e = service::sandbox::set_egress(&app, &id, policy).await?;
    Ok(Json(info(
        &Listed::from(e),
        app.registry.hypervisor().as_ref(),
    )))
}

/// Sets or clears the time after which the daemon stops the sandbox.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/timeout", params(("id" = String, Path)),
    request_body = SetTimeout,
    responses((status = 200, body = SandboxInfo), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 413, body = ErrorBody)))]
pub async fn set_timeout(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    JsonBody(req): JsonBody<SetTimeout>,
) -> Result<Json<SandboxInfo>, ApiError> {
    let e = service::sandbox::set_timeout(&app, &id, req.timeout_s)?;
    Ok(Json(info(
        &Listed::from(e),
        app.registry.hypervisor().as_ref(),
    )))
}
