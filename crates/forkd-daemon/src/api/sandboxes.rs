//! `/v1/sandboxes`: create children of a snapshot, list, get, delete, set a timeout.

use super::error::ErrorBody;
use super::types::{
    CreateSandboxes, CreatedSandboxes, LimitsBody, NetworkBody, SandboxInfo, SandboxLimits,
    SandboxList, SetTimeout,
};
use super::{ApiError, App, JsonBody, PathParams, QueryParams};
use crate::registry::{CreateOutcome, CreateSpec, Listed, RegistryError};
use crate::server::AuditIds;
use crate::state::OperationRow;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use forkd_core::snapshot::Tag;
use forkd_host::cgroup::LimitOverrides;
use serde::Deserialize;

/// Most labels on one sandbox, and the longest key or value.
const MAX_LABELS: usize = 32;
const MAX_LABEL_LEN: usize = 256;
/// Most bytes a sandbox's `env` may take as JSON: it travels in the resume hook, one
/// agent request.
const MAX_ENV_BYTES: usize = 64 << 10;

/// Longest timeout accepted: 30 days.
pub(crate) const MAX_TIMEOUT_S: u64 = 30 * 24 * 3600;

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> ApiError {
        match e {
            RegistryError::AtCapacity { .. } => ApiError::new(
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
            RegistryError::Conflict(m) => ApiError::conflict(m),
        }
    }
}

/// A sandbox as the API shows it: its persisted state, or `failed` with the reason as
/// soon as its handle knows (the reaper records and removes it a moment later).
pub fn info(e: &Listed, hv: &dyn forkd_hypervisor::Hypervisor) -> SandboxInfo {
    let failure = e.sandbox.as_ref().and_then(|s| s.failure());
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

/// The limits a fork asks for, checked.
fn limit_overrides(
    body: Option<&LimitsBody>,
    vcpus: u32,
    memory_mib: u32,
) -> Result<LimitOverrides, ApiError> {
    let Some(body) = body else {
        return Ok(LimitOverrides::default());
    };
    let cpu_millicores = match body.cpu_cores {
        None => None,
        Some(c) if c.is_finite() && (0.0..=1024.0).contains(&c) => Some((c * 1000.0).ceil() as u32),
        Some(c) => {
            return Err(ApiError::bad_request(format!(
                "limits.cpu_cores = {c} is outside 0..=1024"
            )))
        }
    };
    if body.memory_mib.is_some_and(|m| m > 1 << 20) {
        return Err(ApiError::bad_request(
            "limits.memory_mib is more than 1048576".to_string(),
        ));
    }
    if body.pids.is_some_and(|p| p > 65_536) {
        return Err(ApiError::bad_request(
            "limits.pids is more than 65536".to_string(),
        ));
    }
    let chosen = LimitOverrides {
        memory_bytes: body.memory_mib.map(|m| m << 20),
        cpu_millicores,
        cpu_weight: body.cpu_weight,
        pids: body.pids,
    };
    chosen
        .resolve(vcpus, memory_mib)
        .check(memory_mib)
        .map_err(|e| ApiError::bad_request(format!("limits: {e}")))?;
    Ok(chosen)
}

fn deadline(timeout_s: Option<u64>) -> Result<Option<i64>, ApiError> {
    match timeout_s {
        None => Ok(None),
        Some(t) if (1..=MAX_TIMEOUT_S).contains(&t) => Ok(Some(crate::unix_now() + t as i64)),
        Some(t) => Err(ApiError::bad_request(format!(
            "timeout_s = {t} is outside 1..={MAX_TIMEOUT_S}"
        ))),
    }
}

/// Refuses labels and an environment a sandbox cannot take.
pub(crate) fn check_labels_and_env(
    labels: &std::collections::BTreeMap<String, String>,
    env: &std::collections::BTreeMap<String, String>,
) -> Result<(), ApiError> {
    if labels.len() > MAX_LABELS
        || labels
            .iter()
            .any(|(k, v)| k.is_empty() || k.len() > MAX_LABEL_LEN || v.len() > MAX_LABEL_LEN)
    {
        return Err(ApiError::bad_request(format!(
            "labels: at most {MAX_LABELS}, keys of 1 to {MAX_LABEL_LEN} bytes, values of at most {MAX_LABEL_LEN}"
        )));
    }
    if let Some(problem) = forkd_proto::exec::env_problem(env) {
        return Err(ApiError::bad_request(problem));
    }
    if serde_json::to_vec(env).map_or(0, |v| v.len()) > MAX_ENV_BYTES {
        return Err(ApiError::bad_request(format!(
            "env takes more than {MAX_ENV_BYTES} bytes as JSON"
        )));
    }
    Ok(())
}

/// Starts a fork in a task of its own: a client that hangs up mid-fork must not cancel
/// it half way, leaving children that run with no record.
pub(crate) fn spawn_fork(
    app: &App,
    snap: forkd_core::snapshot::Snapshot,
    spec: CreateSpec,
) -> tokio::task::JoinHandle<Result<CreateOutcome, RegistryError>> {
    let app = app.clone();
    let t = std::time::Instant::now();
    tokio::spawn(async move {
        let r = app.registry.create(&snap, spec).await;
        if let Ok(o) = &r {
            app.metrics.forks.inc_by(o.entries.len() as u64);
            app.metrics.fork_seconds.observe(t.elapsed().as_secs_f64());
        }
        r
    })
}

/// Waits for a fork [`spawn_fork`] started. A partial fork in which no child started
/// fails with its first failure.
pub(crate) async fn finish_fork(
    task: tokio::task::JoinHandle<Result<CreateOutcome, RegistryError>>,
) -> Result<CreateOutcome, ApiError> {
    let mut outcome = task
        .await
        .map_err(|e| ApiError::internal(format!("the fork task failed: {e}")))??;
    if outcome.entries.is_empty() && !outcome.failures.is_empty() {
        return Err(outcome.failures.swap_remove(0).into());
    }
    Ok(outcome)
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
    JsonBody(req): JsonBody<CreateSandboxes>,
) -> Result<Response, ApiError> {
    let max = forkd_core::fork::MAX_CHILDREN as u32;
    if req.n == 0 || req.n > max {
        return Err(ApiError::bad_request(format!(
            "n = {} is outside 1..={max}",
            req.n
        )));
    }
    check_labels_and_env(&req.labels, &req.env)?;
    let timeout_at = deadline(req.timeout_s)?;
    let tag = Tag::parse(&req.snapshot)?;
    let snap = app.registry.store().open(&tag)?;
    let m = &snap.manifest.machine;
    // A restored VM has exactly its snapshot's vCPUs and RAM (the device state and the
    // memory image fix both): other numbers cannot be honoured.
    for (what, asked, has) in [
        ("vcpus", req.vcpus, m.vcpus),
        ("memory_mib", req.memory_mib, m.memory_mib),
    ] {
        if let Some(a) = asked {
            if a != has {
                return Err(ApiError::bad_request(format!(
                    "{what} = {a}: children of snapshot {tag} have {what} = {has} (the snapshot fixes it)"
                )));
            }
        }
    }
    let limits = limit_overrides(req.limits.as_ref(), m.vcpus, m.memory_mib)?;
    let egress = match req.network {
        None => snap.manifest.egress.clone().unwrap_or_default(),
        Some(body) => {
            if !m.nic {
                return Err(ApiError::bad_request(format!(
                    "network: children of snapshot {tag} have no NIC (its template was built with network = \"none\", or on a host without networking)"
                )));
            }
            body.policy()
                .map_err(|e| ApiError::bad_request(format!("network: {e}")))?
        }
    };
    let spec = CreateSpec {
        labels: req.labels,
        limits,
        egress,
        env: req.env,
        timeout_at,
        partial: req.partial,
        ..CreateSpec::new(req.n as usize)
    };
    let op_id = spec.op_id.clone();
    if !req.wait {
        // Refused now rather than in an operation nobody may look at.
        app.registry.admit(snap.tag.as_str(), spec.count)?;
    }
    let task = spawn_fork(&app, snap, spec);
    if !req.wait {
        // The operation row is written as the fork starts: wait for it briefly so that
        // the answer is the row itself.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            if let Some(op) = app.registry.state().operation(&op_id)? {
                return Ok((StatusCode::ACCEPTED, Json(op)).into_response());
            }
            if task.is_finished() || std::time::Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        finish_fork(task).await?;
        return Err(ApiError::internal(
            "the fork ended before its operation was recorded",
        ));
    }
    let outcome = finish_fork(task).await?;
    // The path names no id: the audit record gets the children's from here.
    let ids = AuditIds(outcome.entries.iter().map(|e| e.row.id.clone()).collect());
    let body = CreatedSandboxes {
        sandboxes: outcome
            .entries
            .into_iter()
            .map(|e| {
                info(
                    &Listed {
                        row: e.row,
                        sandbox: Some(e.sandbox),
                    },
                    app.registry.hypervisor().as_ref(),
                )
            })
            .collect(),
        errors: outcome.failures.iter().map(|e| e.to_string()).collect(),
        operation: op_id,
    };
    Ok((StatusCode::CREATED, axum::Extension(ids), Json(body)).into_response())
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
    Ok(Json(SandboxList { sandboxes }))
}

/// One sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    Ok(Json(info(
        &app.registry.describe(&id)?,
        app.registry.hypervisor().as_ref(),
    )))
}

/// Stops a sandbox and removes its files.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<StatusCode, ApiError> {
    app.registry.delete(&id).await?;
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
    let e = app.registry.set_egress(&id, policy).await?;
    Ok(Json(info(
        &Listed {
            row: e.row,
            sandbox: Some(e.sandbox),
        },
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
    let at = deadline(req.timeout_s)?;
    let e = app.registry.set_timeout(&id, at)?;
    Ok(Json(info(
        &Listed {
            row: e.row,
            sandbox: Some(e.sandbox),
        },
        app.registry.hypervisor().as_ref(),
    )))
}
