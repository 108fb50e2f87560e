//! `GET /v1/cluster/hosts`: the hosts of the cluster this daemon is one of.

use super::{ApiError, App};
use crate::cluster::{ClusterError, HostView};
use crate::service::moving::DrainReport;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};

/// The hosts of the cluster.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ClusterHosts {
    /// This daemon's name in the cluster.
    pub this_host: String,
    /// Every host that registered, by name: those whose lease lapsed are `unreachable`.
    pub hosts: Vec<HostView>,
}

impl From<ClusterError> for ApiError {
    fn from(e: ClusterError) -> ApiError {
        let msg = e.to_string();
        match e {
            ClusterError::Unavailable { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "cluster_unavailable", msg)
            }
            ClusterError::Record { .. } | ClusterError::Setup(_) => ApiError::internal(msg),
        }
    }
}

/// The cluster of `app`, or the answer of a daemon that is in none.
pub(crate) fn cluster_of(app: &App) -> Result<&crate::cluster::Cluster, ApiError> {
    app.cluster.as_deref().ok_or_else(|| {
        ApiError::conflict("this daemon is not part of a cluster (start it with --cluster)")
    })
}

/// The hosts of the cluster, and whether each lives (503 when etcd cannot be reached).
#[utoipa::path(get, path = "/v1/cluster/hosts", responses(
    (status = 200, body = ClusterHosts),
    (status = 409, description = "this daemon is in no cluster"),
    (status = 503, description = "the cluster's store (etcd) cannot be reached"),
))]
pub async fn hosts(State(app): State<App>) -> Result<Json<ClusterHosts>, ApiError> {
    let cluster = cluster_of(&app)?;
    Ok(Json(ClusterHosts {
        this_host: cluster.host_name().to_owned(),
        hosts: cluster.hosts().await?,
    }))
}

/// Drains the host `name`: it takes no new sandboxes, and each of its sandboxes is
/// paused and parked in the cluster's registry, to be resumed on another host at its
/// next use. Asked of any host; done by the host drained.
#[utoipa::path(post, path = "/v1/cluster/hosts/{name}/drain",
    params(("name" = String, Path, description = "The host to drain")),
    responses(
        (status = 200, body = DrainReport),
        (status = 404, description = "no host of that name"),
        (status = 409, description = "this daemon is in no cluster, or has no registry"),
        (status = 503, description = "etcd or the host cannot be reached"),
))]
pub async fn drain(
    State(app): State<App>,
    Path(name): Path<String>,
) -> Result<Json<DrainReport>, ApiError> {
    on_host(&app, &name, http::Method::POST, "drain", || async {
        crate::service::moving::drain(&app).await
    })
    .await
    .map(Json)
}

/// Ends the drain of host `name`: it takes new sandboxes again (those moved off it
/// stay where they went).
#[utoipa::path(delete, path = "/v1/cluster/hosts/{name}/drain",
    params(("name" = String, Path, description = "The host")),
    responses(
        (status = 200, body = DrainReport),
        (status = 404, description = "no host of that name"),
        (status = 409, description = "this daemon is in no cluster"),
        (status = 503, description = "etcd or the host cannot be reached"),
))]
pub async fn undrain(
    State(app): State<App>,
    Path(name): Path<String>,
) -> Result<Json<DrainReport>, ApiError> {
    on_host(&app, &name, http::Method::DELETE, "drain", || async {
        let cluster = cluster_of(&app)?;
        cluster.set_draining(false);
        tracing::info!("this host takes new sandboxes again");
        Ok(DrainReport {
            host: cluster.host_name().to_owned(),
            moved: Vec::new(),
            kept: Vec::new(),
        })
    })
    .await
    .map(Json)
}

/// What forgetting a host removed.
#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Forgotten {
    /// The host.
    pub host: String,
    /// The sandboxes it still claimed, which the cluster forgot with it (their files,
    /// if its disk comes back, are its own).
    pub sandboxes: Vec<String>,
}

/// Whether a host may be forgotten with sandboxes it still claims.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct ForgetQuery {
    /// Forget it even if it still claims sandboxes (they are forgotten with it).
    #[serde(default)]
    pub force: bool,
}

/// Removes host `name` from the cluster for good (a machine retired): its record, and
/// with `force` the sandboxes it still claims. Refused while it lives (its lease is
/// held), and without `force` while it claims sandboxes.
#[utoipa::path(delete, path = "/v1/cluster/hosts/{name}",
    params(("name" = String, Path, description = "The host to forget"), ForgetQuery),
    responses(
        (status = 200, body = Forgotten),
        (status = 404, description = "no host of that name"),
        (status = 409, description = "the host lives, still claims sandboxes, or this daemon is in no cluster"),
        (status = 503, description = "etcd cannot be reached"),
))]
pub async fn forget(
    State(app): State<App>,
    Path(name): Path<String>,
    axum::extract::Query(q): axum::extract::Query<ForgetQuery>,
) -> Result<Json<Forgotten>, ApiError> {
    let cluster = cluster_of(&app)?;
    let hosts = cluster.hosts().await?;
    let Some(host) = hosts.iter().find(|h| h.name == name) else {
        return Err(ApiError::not_found(format!(
            "no host {name} in the cluster"
        )));
    };
    if host.state == crate::cluster::HostState::Up {
        return Err(ApiError::conflict(format!(
            "host {name} is up: stop its daemon (drain it first to move its sandboxes) before forgetting it"
        )));
    }
    let claimed: Vec<String> = cluster.owned_by(&name).await?.into_keys().collect();
    if !claimed.is_empty() && !q.force {
        return Err(ApiError::conflict(format!(
            "host {name} still claims {} sandbox(es) ({}); drain it, or forget them with it (force)",
            claimed.len(),
            claimed.join(", ")
        )));
    }
    if !cluster.forget_host(&name).await? {
        return Err(ApiError::conflict(format!(
            "host {name} registered again meanwhile: it is up"
        )));
    }
    tracing::info!(host = %name, sandboxes = claimed.len(), "host forgotten");
    Ok(Json(Forgotten {
        host: name,
        sandboxes: claimed,
    }))
}

/// Runs `here` if `name` is this host, else sends the same request (`method`,
/// `/v1/cluster/hosts/{name}/{verb}`) to that host.
async fn on_host<F, Fut>(
    app: &App,
    name: &str,
    method: http::Method,
    verb: &str,
    here: F,
) -> Result<DrainReport, ApiError>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<DrainReport, ApiError>>,
{
    let cluster = cluster_of(app)?;
    if name == cluster.host_name() {
        return here().await;
    }
    let hosts = cluster.hosts().await?;
    let host = hosts
        .iter()
        .find(|h| h.name == name)
        .ok_or_else(|| ApiError::not_found(format!("no host {name} in the cluster")))?;
    if host.state != crate::cluster::HostState::Up {
        return Err(crate::service::cluster::unreachable_host(name));
    }
    let path = format!("/v1/cluster/hosts/{name}/{verb}");
    crate::service::cluster::peer(app, cluster, &host.address, true)
        .json::<DrainReport>(method, &path, None)
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "host_failed",
                format!("host {name}: {e:#}"),
            )
        })
}

/// A parked sandbox a host took.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Taken {
    /// The sandbox, paused on its new host.
    pub id: String,
    /// Its new host.
    pub host: String,
}

/// Has this host take the parked sandbox `id` (another host asks it, for a request
/// that sandbox got): pulled, installed paused, claimed.
#[utoipa::path(post, path = "/v1/cluster/sandboxes/{id}/take",
    params(("id" = String, Path, description = "The parked sandbox")),
    responses(
        (status = 200, body = Taken),
        (status = 404, description = "no such sandbox in the cluster"),
        (status = 409, description = "it waits for no host, this host is draining, or it is in no cluster"),
        (status = 503, description = "etcd cannot be reached"),
))]
pub async fn take(State(app): State<App>, Path(id): Path<String>) -> Result<Json<Taken>, ApiError> {
    crate::service::moving::take_here(&app, &id).await?;
    Ok(Json(Taken {
        host: cluster_of(&app)?.host_name().to_owned(),
        id,
    }))
}
