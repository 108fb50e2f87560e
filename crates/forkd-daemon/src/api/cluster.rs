//! `GET /v1/cluster/hosts`: the hosts of the cluster this daemon is one of.

use super::{ApiError, App};
use crate::cluster::{ClusterError, HostView};
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Serialize;

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
