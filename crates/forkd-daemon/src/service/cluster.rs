//! The cluster's use cases: where a sandbox lives (the one owner lookup every request
//! for a sandbox goes through, whichever front door it came by), and the list of every
//! host's sandboxes.

use super::ApiError;
use crate::api::types::SandboxInfo;
use crate::api::App;
use crate::client::{Client, Endpoint};
use crate::cluster::ownership::OwnerRecord;
use crate::cluster::{Cluster, HostState, Remote};
use axum::http::StatusCode;

/// Marks a request one host forwarded to another: the owner serves it as its own and
/// never forwards it again.
pub const FORWARDED_BY: &str = "x-forkd-forwarded-by";

/// Where a sandbox lives.
#[derive(Debug, PartialEq)]
pub enum Located {
    /// On this host (or nowhere: the request then gets this host's 404).
    Here,
    /// On another host of the cluster.
    Remote(Remote),
    /// It was parked (moved off its host, waiting for one) and the request removed it:
    /// answered 204 where it arrived.
    Removed,
}

/// What a front door asks of the sandbox a request names.
#[derive(Debug, Clone, Copy, Default)]
pub struct Asked {
    /// Another host forwarded the request here.
    pub forwarded: bool,
    /// The request removes the sandbox.
    pub removal: bool,
}

/// Where a request for the sandbox `id` is served. Sandboxes of this host are found
/// without asking etcd, and so are those found on another host before (until it stops
/// answering there); another host's answers 503 naming it when it is unreachable, and
/// when etcd is. A request another host forwarded is served here, unless the sandbox
/// moved off this host since that host learnt where it was (then it is passed on). A
/// parked sandbox is removed by a removal, and taken by a host for any other request.
pub async fn locate(app: &App, id: &str, asked: Asked) -> Result<Located, ApiError> {
    let Some(cluster) = app.cluster.as_deref() else {
        return Ok(Located::Here);
    };
    if asked.forwarded && !cluster.was_moved(id) {
        return Ok(Located::Here);
    }
    if app.registry.describe(id).is_ok() {
        return Ok(Located::Here);
    }
    // A sandbox found on another host stays there: no etcd round trip per request.
    if let Some(remote) = cluster.remembered(id) {
        return Ok(Located::Remote(remote));
    }
    let Some(owner) = cluster.owner(id).await? else {
        return Ok(Located::Here);
    };
    if owner.parked.is_some() {
        if !asked.removal {
            // Moved off its host: taken by a host now, for this request.
            return super::moving::take(app, cluster, id).await;
        }
        if cluster.remove_parked(id).await? {
            tracing::info!(%id, "a parked sandbox was removed");
            return Ok(Located::Removed);
        }
        // Taken meanwhile: where it is now.
        return Box::pin(locate(app, id, asked)).await;
    }
    if owner.host == cluster.host_name() {
        return Ok(Located::Here);
    }
    match cluster.live(&owner.host).await? {
        Some(live) => {
            let remote = Remote {
                host: owner.host,
                address: live.address,
                e2b_address: live.e2b_address,
            };
            cluster.remember(id, &remote);
            Ok(Located::Remote(remote))
        }
        None => Err(unreachable(id, &owner.host, "its lease lapsed")),
    }
}

/// The answer for a sandbox whose host does not answer.
pub fn unreachable(id: &str, host: &str, why: &str) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "host_unreachable",
        format!("the sandbox {id} is on host {host}, which is unreachable ({why}); its state is unknown until the host is back"),
    )
}

/// The answer for a request to a host that does not answer.
pub fn unreachable_host(host: &str) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "host_unreachable",
        format!("host {host} is unreachable (its lease lapsed)"),
    )
}

/// A client of the host at `address`, with this daemon's token if `with_token` (the
/// hosts of a cluster share one) and, when the cluster was given one, the CA their
/// certificates are signed by.
pub fn peer(app: &App, cluster: &Cluster, address: &str, with_token: bool) -> Client {
    let endpoint = match &cluster.config().peer_ca {
        Some(ca) => Endpoint::Https {
            addr: address.to_owned(),
            ca: ca.clone(),
        },
        None => Endpoint::Tcp(address.to_owned()),
    };
    Client::new(endpoint, app.config.token.clone().filter(|_| with_token))
}

/// Every host's sandboxes: `local` (this host's, already filtered), each living host's
/// as it lists them (with `query`'s filters), and those of unreachable hosts from their
/// claims, `unknown`. Each names its host.
pub async fn list(
    app: &App,
    mut local: Vec<SandboxInfo>,
    query: &[(&str, &Option<String>)],
) -> Result<Vec<SandboxInfo>, ApiError> {
    let cluster = crate::api::cluster::cluster_of(app)?;
    let me = cluster.host_name().to_owned();
    for s in &mut local {
        s.host = Some(me.clone());
    }
    let mut all = local;
    let mut params: Vec<(&str, &str)> = query
        .iter()
        .filter_map(|(k, v)| v.as_deref().map(|v| (*k, v)))
        .collect();
    params.push(("scope", "host"));
    let path = format!(
        "/v1/sandboxes?{}",
        form_urlencoded::Serializer::new(String::new())
            .extend_pairs(params)
            .finish()
    );
    let hosts = cluster.hosts().await?;
    let others = hosts.iter().filter(|h| h.name != me);
    let lists = others.map(|h| async {
        let listed = match h.state {
            HostState::Up => peer(app, cluster, &h.address, true)
                .json::<crate::api::types::SandboxList>(http::Method::GET, &path, None)
                .await
                .map_err(|e| tracing::warn!(host = %h.name, "listing its sandboxes: {e}"))
                .ok(),
            HostState::Unreachable => None,
        };
        match listed {
            Some(l) => Ok(l.sandboxes),
            None => unknown(cluster, &h.name, query).await,
        }
        .map(|mut list| {
            for s in &mut list {
                s.host = Some(h.name.clone());
            }
            list
        })
    });
    for list in futures::future::join_all(lists).await {
        all.extend(list?);
    }
    // Those moved off their host, waiting for one: paused, on no host yet.
    let parked = cluster.parked().await?;
    all.extend(filtered(parked, query).map(|(id, r)| {
        let mut info = info_of(id, r, "paused", None);
        info.host = None;
        info
    }));
    all.sort_by(|a, b| (&a.created_at, &a.id).cmp(&(&b.created_at, &b.id)));
    Ok(all)
}

/// The sandboxes host `host` claimed, as far as the claims say (for a host that does
/// not answer): state `unknown`, filtered as `query` says.
async fn unknown(
    cluster: &Cluster,
    host: &str,
    query: &[(&str, &Option<String>)],
) -> Result<Vec<SandboxInfo>, ApiError> {
    let records = cluster.owned_by(host).await?;
    Ok(filtered(records, query)
        .map(|(id, r)| {
            let why = format!("its host {host} is unreachable");
            info_of(id, r, "unknown", Some(why))
        })
        .collect())
}

/// The records of `records` that `query`'s filters (snapshot, label) let through.
fn filtered<'a>(
    records: std::collections::BTreeMap<String, OwnerRecord>,
    query: &'a [(&str, &Option<String>)],
) -> impl Iterator<Item = (String, OwnerRecord)> + 'a {
    let filter = move |k: &str| {
        query
            .iter()
            .find(|(name, _)| *name == k)
            .and_then(|(_, v)| v.as_deref())
    };
    let label = filter("label").and_then(|l| l.split_once('='));
    let snapshot = filter("snapshot");
    records
        .into_iter()
        .filter(move |(_, r)| snapshot.is_none_or(|s| r.snapshot == s))
        .filter(move |(_, r)| {
            label.is_none_or(|(k, v)| r.labels.get(k).map(String::as_str) == Some(v))
        })
}

/// What the cluster's records show of sandbox `id` without its host's answer.
fn info_of(id: String, r: OwnerRecord, status: &str, error: Option<String>) -> SandboxInfo {
    SandboxInfo {
        id,
        snapshot: r.snapshot,
        status: status.into(),
        error,
        pid: 0,
        vcpus: 0,
        memory_mib: 0,
        labels: r.labels,
        created_at: r.created_at,
        timeout_at: None,
        limits: None,
        network: None,
        host: Some(r.host),
    }
}
