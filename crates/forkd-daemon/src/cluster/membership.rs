//! A host's registration: its permanent record, and a record under a lease that it
//! refreshes while it lives (with its free slots, memory and snapshots). When the lease
//! lapses (the daemon was killed, its host stopped, or it lost etcd for longer than the
//! lease) the other hosts see it unreachable; when it can reach etcd again it registers
//! anew.

use super::keys::{self, HostLive, HostRecord};
use super::{Cluster, ClusterError};
use crate::api::App;
use etcd_client::PutOptions;
use std::sync::Arc;
use std::time::Duration;

/// The longest wait between two attempts to register while etcd does not answer.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Keeps this host registered for as long as the daemon runs.
pub async fn run(cluster: Arc<Cluster>, app: App) {
    let mut backoff = Duration::from_millis(250);
    loop {
        match session(&cluster, &app).await {
            // The lease was lost while etcd answered (it expired there): register again.
            Ok(()) => backoff = Duration::from_millis(250),
            Err(e) => {
                tracing::warn!(
                    host = cluster.host_name(),
                    "cluster registration: {e}; retrying"
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// One registration: a lease granted, the records written, then refreshed until the
/// lease is lost. Ends with an error when etcd stops answering.
async fn session(cluster: &Cluster, app: &App) -> Result<(), ClusterError> {
    let ttl = cluster.config.lease_ttl;
    let err = |e: etcd_client::Error| cluster.unavailable(e);
    let ttl_s = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX);
    let lease = cluster
        .request(|mut c| async move { c.lease_grant(ttl_s, None).await })
        .await?
        .id();
    let (mut keeper, mut answers) = cluster
        .request(|mut c| async move { c.lease_keep_alive(lease).await })
        .await?;
    let record = HostRecord {
        address: cluster.config.advertise.clone(),
        labels: cluster.config.labels.clone(),
        registered_at: crate::now_rfc3339(),
    };
    let name = cluster.host_name();
    let record = to_json(&record);
    cluster
        .request(|mut c| {
            let record = record.clone();
            async move { c.put(keys::host(name), record, None).await }
        })
        .await?;
    let leased = || Some(PutOptions::new().with_lease(lease));
    let put_live = || {
        let value = to_json(&live(cluster, app));
        cluster.request(move |mut c| {
            let value = value.clone();
            async move { c.put(keys::alive(name), value, leased()).await }
        })
    };
    put_live().await?;
    tracing::info!(host = name, lease, "registered in the cluster");
    // Three refreshes per lease: one lost refresh does not make the host unreachable.
    let mut tick = tokio::time::interval(ttl / 3);
    tick.tick().await;
    loop {
        tick.tick().await;
        keeper.keep_alive().await.map_err(err)?;
        let answer = tokio::time::timeout(ttl / 3, answers.message())
            .await
            .map_err(|_| cluster.unavailable("no answer to a lease refresh"))?
            .map_err(err)?;
        match answer {
            Some(a) if a.ttl() > 0 => {}
            _ => {
                tracing::warn!(
                    host = name,
                    lease,
                    "the cluster lease lapsed; registering again"
                );
                return Ok(());
            }
        }
        put_live().await?;
    }
}

fn to_json<T: serde::Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("records serialize")
}

/// What this host says of itself now.
fn live(cluster: &Cluster, app: &App) -> HostLive {
    let registry = &app.registry;
    let snapshots = registry
        .store()
        .list()
        .into_iter()
        .filter_map(|(tag, snap)| {
            Some((tag, super::snapshot_digest(registry.store(), &snap.ok()?)?))
        })
        .collect();
    // The E2B listener at the advertised host, on its own port.
    let e2b_address = app.config.e2b.as_ref().map(|e| {
        let host = cluster
            .config
            .advertise
            .rsplit_once(':')
            .map_or(cluster.config.advertise.as_str(), |(h, _)| h);
        format!("{host}:{}", e.listen.port())
    });
    HostLive {
        address: cluster.config.advertise.clone(),
        e2b_address,
        accel: forkd_hypervisor::accel::resolve(forkd_hypervisor::AccelChoice::Auto)
            .map_or_else(|_| "none".to_owned(), |a| a.as_str().to_owned()),
        cpus: std::thread::available_parallelism()
            .map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX)),
        memory_available_mib: crate::admission::mem_available().unwrap_or(0) >> 20,
        max_sandboxes: registry.capacity(),
        running: registry.running(),
        snapshots,
        labels: cluster.config.labels.clone(),
        draining: cluster.is_draining(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        updated_at: crate::now_rfc3339(),
    }
}
