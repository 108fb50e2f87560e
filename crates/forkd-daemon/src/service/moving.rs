//! Paused sandboxes moving between the hosts of a cluster, and the drain of a host.
//!
//! A host gives a sandbox up by **parking** it: paused (if it ran), branched from its
//! pause image into a chain link (`moved-ID-XXXX`), the link pushed to the cluster's
//! registry, and its etcd record turned, in one transaction, from this host's claim
//! into a parked record that says where the link is and what the sandbox was (labels,
//! lifecycle, limits, network policy, what was left of its timeout). Only then are its
//! files here removed: from the transaction on, the registry holds it.
//!
//! The next request for it, at any host's front door, has it **taken**: by the host
//! reached if that one can run it, else by the living host with the most room. That
//! host pulls the link (checked by digest), installs it as a paused sandbox under the
//! same id ([`forkd_core::arrival`]) and claims it in a transaction that succeeds for
//! one host only. The request then goes on as for any paused sandbox: one that needs
//! the VM resumes it, the same machine continuing.
//!
//! **Drain** (`forkd drain HOST`): the host takes no new sandboxes (placement and
//! taking skip it) and parks every sandbox it holds.

use super::cluster::{peer, Located};
use super::ApiError;
use crate::api::App;
use crate::cluster::ownership::{record_of, Claimed, OwnerRecord, Parked};
use crate::cluster::{Cluster, Remote};
use crate::state::SandboxRow;
use axum::http::StatusCode;
use forkd_core::lifecycle::SandboxState;
use forkd_core::pause::PauseKeeps;
use forkd_storage::snapshot::Tag;
use serde::Serialize;

/// The prefix of the chain links that carry moved sandboxes.
const MOVED_PREFIX: &str = "moved-";

/// One sandbox takes (or parks) at a time on a host: two requests for one parked
/// sandbox must not both install it.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What a drain did.
#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct DrainReport {
    /// The host drained.
    pub host: String,
    /// Sandboxes parked in the cluster's registry, to be resumed on another host at
    /// their next use.
    pub moved: Vec<String>,
    /// Sandboxes left on the host, each with why.
    pub kept: Vec<Kept>,
}

/// A sandbox a drain could not move.
#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Kept {
    /// The sandbox.
    pub id: String,
    /// Why it stays.
    pub reason: String,
}

/// Drains this host: it takes no new sandboxes, and each of its sandboxes is parked
/// (paused first if it runs). One that cannot be is kept, with why.
pub async fn drain(app: &App) -> Result<DrainReport, ApiError> {
    let cluster = crate::api::cluster::cluster_of(app)?;
    if cluster.config().registry.is_none() {
        return Err(ApiError::conflict(
            "draining moves the host's sandboxes through the cluster's registry, and this host has none (start it with --registry)",
        ));
    }
    cluster.set_draining(true);
    tracing::info!("draining this host: its sandboxes are parked in the cluster's registry");
    let mut report = DrainReport {
        host: cluster.host_name().to_owned(),
        moved: Vec::new(),
        kept: Vec::new(),
    };
    for listed in app.registry.list() {
        let id = listed.row.id;
        match park(app, cluster, &id).await {
            Ok(()) => report.moved.push(id),
            Err(e) => {
                tracing::warn!(%id, "not moved off the drained host: {}", e.message);
                report.kept.push(Kept {
                    id,
                    reason: e.message,
                });
            }
        }
    }
    Ok(report)
}

/// Parks this host's sandbox `id` in the cluster's registry (see the module's text).
async fn park(app: &App, cluster: &Cluster, id: &str) -> Result<(), ApiError> {
    let _one = ONE_AT_A_TIME.lock().await;
    let listed = app.registry.describe(id)?;
    match listed.row.state {
        SandboxState::Running => {
            super::pause::pause(app, id, PauseKeeps::Memory).await?;
        }
        SandboxState::Paused => {}
        state => {
            return Err(ApiError::conflict(format!(
                "the sandbox {id} is {state}: only a running or paused sandbox can move"
            )))
        }
    }
    let row = app.registry.describe(id)?.row;
    let image = forkd_core::pause::read_record(&row.config.dir)?
        .ok_or_else(|| ApiError::internal(format!("the sandbox {id} has no pause image")))?;
    if image.keeps == PauseKeeps::Disk {
        return Err(ApiError::conflict(format!(
            "the sandbox {id} was paused with its disk only; resume it (or remove it) to move it"
        )));
    }
    let tag = format!("{MOVED_PREFIX}{id}-{}", forkd_host::ids::random_hex(2));
    super::branch::start(app, id, Some(&tag), None)
        .await?
        .outcome()
        .await?;
    let tag = Tag::parse(&tag)?;
    let parked = async {
        let reference = super::placement::publish(app, cluster, &tag).await?;
        let digest = super::placement::local_digest(app, &tag)
            .ok_or_else(|| ApiError::internal(format!("the snapshot {tag} is gone")))?;
        let record = OwnerRecord {
            parked: Some(Parked {
                reference,
                tag: tag.to_string(),
                digest,
                lifecycle: row.lifecycle,
                limits: row.config.limits,
                network: row.config.network.clone(),
                seccomp: row.config.seccomp,
                timeout_left_s: image.timeout_left_s,
                parked_at: crate::now_rfc3339(),
            }),
            ..record_of(cluster, &row)
        };
        cluster.set_moved(id, true);
        if !cluster.park(id, &record).await? {
            return Err(ApiError::conflict(format!(
                "the sandbox {id} is not claimed by this host in the cluster yet; try again in a moment"
            )));
        }
        Ok(())
    }
    .await;
    if let Err(e) = parked {
        cluster.set_moved(id, false);
        remove_snapshot(app, &tag).await;
        return Err(e);
    }
    // The registry holds it now: its files here go, and so does the link.
    if let Err(e) = super::sandbox::delete(app, id).await {
        tracing::warn!(%id, "removing a moved sandbox's files: {}", e.message);
    }
    remove_snapshot(app, &tag).await;
    tracing::info!(%id, %tag, "sandbox parked in the cluster's registry");
    Ok(())
}

/// Removes the snapshot `tag` of this host if nothing uses it.
async fn remove_snapshot(app: &App, tag: &Tag) {
    if let Err(e) = super::snapshot::remove(app, tag, false).await {
        tracing::warn!(%tag, "removing the snapshot: {}", e.message);
    }
}

/// After the removal of sandbox `id` whose disk built on `snapshot`: the link that
/// brought it here goes too, unless something else uses it.
pub async fn removed(app: &App, id: &str, snapshot: &str) {
    if snapshot.starts_with(&format!("{MOVED_PREFIX}{id}-")) {
        if let Ok(tag) = Tag::parse(snapshot) {
            remove_snapshot(app, &tag).await;
        }
    }
}

/// Has the parked sandbox `id` taken by a host: this one if it can run it, else the
/// living host with the most free slots. Returns where it is now.
pub async fn take(app: &App, cluster: &Cluster, id: &str) -> Result<Located, ApiError> {
    if !cluster.is_draining() && super::placement::free_here(app) > 0 {
        take_here(app, id).await?;
        return Ok(Located::Here);
    }
    let hosts = cluster.hosts().await?;
    let Some((host, live)) = super::placement::roomiest_other(cluster, &hosts, |_| true) else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "at_capacity",
            format!("the sandbox {id} waits in the cluster's registry for a host, and no host that is up and not draining has a free slot"),
        ));
    };
    let path = format!("/v1/cluster/sandboxes/{id}/take");
    peer(app, cluster, &host.address, true)
        .json::<serde_json::Value>(http::Method::POST, &path, None)
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "take_failed",
                format!("host {} could not take the sandbox {id}: {e:#}", host.name),
            )
        })?;
    let remote = Remote {
        host: host.name.clone(),
        address: live.address.clone(),
        e2b_address: live.e2b_address.clone(),
    };
    cluster.remember(id, &remote);
    Ok(Located::Remote(remote))
}

/// Takes the parked sandbox `id` on this host: pulls its link, installs it paused under
/// its id and claims it. Nothing is done if it is here already.
pub async fn take_here(app: &App, id: &str) -> Result<(), ApiError> {
    let cluster = crate::api::cluster::cluster_of(app)?;
    let _one = ONE_AT_A_TIME.lock().await;
    if app.registry.describe(id).is_ok() {
        return Ok(());
    }
    let record = cluster
        .owner(id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no sandbox {id} in the cluster")))?;
    let Some(parked) = record.parked.clone() else {
        return Err(ApiError::conflict(format!(
            "the sandbox {id} is on host {}, not waiting for one",
            record.host
        )));
    };
    if cluster.is_draining() {
        return Err(ApiError::conflict(format!(
            "this host is draining: it takes no sandbox ({id})"
        )));
    }
    tracing::info!(%id, from = %record.host, "taking a parked sandbox");
    super::placement::ensure_snapshot(app, &parked.tag, Some(&parked.reference), &parked.digest)
        .await?;
    let tag = Tag::parse(&parked.tag)?;
    let snap = app
        .registry
        .store()
        .open(&tag)
        .map_err(forkd_core::SandboxError::from)?;
    let arrival = forkd_core::arrival::Arrival {
        id: id.to_owned(),
        limits: parked.limits,
        network: parked.network.clone(),
        seccomp: parked.seccomp,
        timeout_left_s: parked.timeout_left_s,
    };
    let hv = app.registry.hypervisor().clone();
    let config =
        match forkd_core::arrival::install(hv.as_ref(), app.registry.home(), &snap, &arrival).await
        {
            Ok(c) => c,
            Err(e) => {
                remove_snapshot(app, &tag).await;
                return Err(e.into());
            }
        };
    let row = SandboxRow {
        id: id.to_owned(),
        snapshot: parked.tag.clone(),
        pid: 0,
        start_time: 0,
        config,
        state: SandboxState::Paused,
        error: None,
        labels: record.labels.clone(),
        timeout_at: None,
        created_at: record.created_at.clone(),
        lifecycle: parked.lifecycle,
    };
    let mine = record_of(cluster, &row);
    let dir = row.config.dir.clone();
    if let Err(e) = app.registry.insert_arrived(row) {
        let _ = std::fs::remove_dir_all(&dir);
        remove_snapshot(app, &tag).await;
        return Err(e.into());
    }
    match cluster.take_parked(id, &mine).await {
        Ok(Claimed::Mine) => {
            tracing::info!(%id, "the parked sandbox is this host's, paused");
            Ok(())
        }
        Ok(Claimed::Other(host)) => {
            // Another host took it first: this copy goes (and its link with it).
            if let Err(e) = super::sandbox::delete(app, id).await {
                tracing::warn!(%id, "removing a copy another host took: {}", e.message);
            }
            Err(ApiError::conflict(format!(
                "the sandbox {id} was taken by host {host} meanwhile"
            )))
        }
        // Kept: the claim is made by the reconciliation once etcd answers (it takes
        // a parked sandbox that is here), or the copy is found another's then.
        Err(e) => Err(e.into()),
    }
}
