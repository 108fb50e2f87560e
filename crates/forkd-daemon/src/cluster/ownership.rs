//! Which host owns which sandbox, in etcd. A host claims a sandbox with a transaction
//! that succeeds only if no host holds its id, so two hosts never own one; it releases
//! it when the sandbox is removed. The claims follow the host's own database: each
//! fork's children are claimed as they are recorded (from the daemon's lifecycle
//! events) and a reconciliation after every registration, and every few seconds,
//! claims what is missing and releases what is gone (a claim lost with etcd, a removal
//! done while etcd was down).
//!
//! The owner's record carries what the other hosts show of a sandbox while its owner is
//! unreachable (its snapshot, labels and creation time), with the state `unknown`.

use super::keys;
use super::{Cluster, ClusterError};
use crate::api::App;
use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// How often the claims are checked against the host's sandboxes.
const RECONCILE_EVERY: Duration = Duration::from_secs(5);

/// A sandbox's owner, as etcd records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OwnerRecord {
    /// The host that owns it.
    pub host: String,
    /// The snapshot it was forked from.
    pub snapshot: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// When it was made (RFC 3339).
    pub created_at: String,
    /// Set while the sandbox, paused, waits in the cluster's registry for a host (it
    /// was moved off `host`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parked: Option<Parked>,
}

/// A paused sandbox moved off its host: where its image waits, and what a host that
/// takes it needs to make it what it was.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Parked {
    /// Its pause image as a chain link in the cluster's registry, by digest.
    pub reference: String,
    /// The link's tag: the snapshot the sandbox builds on once taken.
    pub tag: String,
    /// The digest of the link's contents ([`super::snapshot_digest`]).
    pub digest: String,
    /// Its deadline's and idleness's rules.
    pub lifecycle: crate::state::Lifecycle,
    /// The limits of its VM.
    pub limits: Option<forkd_host::cgroup::ResourceLimits>,
    /// Its NIC's policy.
    pub network: Option<forkd_host::network::NetworkConfig>,
    /// Its QEMU runs with the syscall filter.
    pub seccomp: bool,
    /// What was left of its timeout when it was paused.
    pub timeout_left_s: Option<u64>,
    /// When it left its host (RFC 3339).
    pub parked_at: String,
}

/// What a claim found.
#[derive(Debug, PartialEq)]
pub enum Claimed {
    /// The sandbox is this host's (now, or already).
    Mine,
    /// Another host holds its id.
    Other(String),
}

impl Cluster {
    /// Claims `record`'s sandbox `id` for this host.
    pub async fn claim(&self, id: &str, record: &OwnerRecord) -> Result<Claimed, ClusterError> {
        let key = keys::sandbox(id);
        let value = serde_json::to_vec(record).expect("records serialize");
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(key.clone(), value.clone(), None),
                TxnOp::put(keys::owned(self.host_name(), id), value, None),
            ])
            .or_else([TxnOp::get(key.clone(), None)]);
        let answer = self.txn(txn).await?;
        if answer.succeeded() {
            return Ok(Claimed::Mine);
        }
        let held = self.owner(id).await?;
        Ok(match held {
            // This host took it in and was stopped before its claim: the claim is made.
            Some(r) if r.parked.is_some() => self.take_parked(id, record).await?,
            Some(r) if r.host == self.host_name() => Claimed::Mine,
            Some(r) => Claimed::Other(r.host),
            // Released between the two reads: claim again.
            None => Box::pin(self.claim(id, record)).await?,
        })
    }

    /// Claims the new sandboxes `records` for this host before their fork answers, so
    /// that every host finds them at once: a transaction per few dozen (each fails
    /// whole if any id is held; those are then claimed one by one).
    pub async fn claim_all(&self, records: &[(String, OwnerRecord)]) -> Result<(), ClusterError> {
        // etcd takes at most 128 operations in a transaction by default: two per id.
        for chunk in records.chunks(50) {
            let compares: Vec<Compare> = chunk
                .iter()
                .map(|(id, _)| Compare::create_revision(keys::sandbox(id), CompareOp::Equal, 0))
                .collect();
            let puts: Vec<TxnOp> = chunk
                .iter()
                .flat_map(|(id, r)| {
                    let value = serde_json::to_vec(r).expect("records serialize");
                    [
                        TxnOp::put(keys::sandbox(id), value.clone(), None),
                        TxnOp::put(keys::owned(self.host_name(), id), value, None),
                    ]
                })
                .collect();
            let txn = Txn::new().when(compares).and_then(puts);
            let answer = self.txn(txn).await?;
            if !answer.succeeded() {
                for (id, r) in chunk {
                    if let Claimed::Other(host) = self.claim(id, r).await? {
                        tracing::error!(%id, %host, "the new sandbox's id is claimed by another host");
                    }
                }
            }
        }
        Ok(())
    }

    /// Releases this host's claim on `id` (nothing if it holds none).
    pub async fn release(&self, id: &str) -> Result<(), ClusterError> {
        let mine = keys::owned(self.host_name(), id);
        let txn = Txn::new()
            .when([Compare::create_revision(
                mine.clone(),
                CompareOp::Greater,
                0,
            )])
            .and_then([
                TxnOp::delete(keys::sandbox(id), None),
                TxnOp::delete(mine, None),
            ]);
        self.txn(txn).await?;
        Ok(())
    }

    /// Gives up this host's sandbox `id`, paused and pushed as `record.parked` says:
    /// from now it waits for a host to take it. False if this host does not hold it.
    pub async fn park(&self, id: &str, record: &OwnerRecord) -> Result<bool, ClusterError> {
        let mine = keys::owned(self.host_name(), id);
        let value = serde_json::to_vec(record).expect("records serialize");
        let txn = Txn::new()
            .when([Compare::create_revision(
                mine.clone(),
                CompareOp::Greater,
                0,
            )])
            .and_then([
                TxnOp::put(keys::sandbox(id), value.clone(), None),
                TxnOp::put(keys::parked(id), value, None),
                TxnOp::delete(mine, None),
            ]);
        let answer = self.txn(txn).await?;
        Ok(answer.succeeded())
    }

    /// Claims the parked sandbox `id` for this host, with `record`: it succeeds for one
    /// host only, while the sandbox waits.
    pub async fn take_parked(
        &self,
        id: &str,
        record: &OwnerRecord,
    ) -> Result<Claimed, ClusterError> {
        let value = serde_json::to_vec(record).expect("records serialize");
        let txn = Txn::new()
            .when([Compare::create_revision(
                keys::parked(id),
                CompareOp::Greater,
                0,
            )])
            .and_then([
                TxnOp::delete(keys::parked(id), None),
                TxnOp::put(keys::sandbox(id), value.clone(), None),
                TxnOp::put(keys::owned(self.host_name(), id), value, None),
            ]);
        let answer = self.txn(txn).await?;
        if answer.succeeded() {
            return Ok(Claimed::Mine);
        }
        Ok(match self.owner(id).await? {
            Some(r) if r.host == self.host_name() && r.parked.is_none() => Claimed::Mine,
            Some(r) => Claimed::Other(r.host),
            None => Claimed::Other(String::new()),
        })
    }

    /// Removes the parked sandbox `id` (its record; its link stays in the registry
    /// until the registry collects it). False if it was not parked.
    pub async fn remove_parked(&self, id: &str) -> Result<bool, ClusterError> {
        let txn = Txn::new()
            .when([Compare::create_revision(
                keys::parked(id),
                CompareOp::Greater,
                0,
            )])
            .and_then([
                TxnOp::delete(keys::parked(id), None),
                TxnOp::delete(keys::sandbox(id), None),
            ]);
        let answer = self.txn(txn).await?;
        Ok(answer.succeeded())
    }

    /// Removes host `name`'s record, for a host that is gone for good, with its claims
    /// (whose sandboxes the cluster then forgets too). Refused (`Ok(false)`) while the
    /// host lives: its lease is held.
    pub async fn forget_host(&self, name: &str) -> Result<bool, ClusterError> {
        let claims = self.owned_by(name).await?;
        let mut ops = vec![
            TxnOp::delete(keys::host(name), None),
            TxnOp::delete(
                keys::owned(name, ""),
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            ),
        ];
        ops.extend(
            claims
                .keys()
                .map(|id| TxnOp::delete(keys::sandbox(id), None)),
        );
        let txn = Txn::new()
            .when([Compare::create_revision(
                keys::alive(name),
                CompareOp::Equal,
                0,
            )])
            .and_then(ops);
        let answer = self.txn(txn).await?;
        Ok(answer.succeeded())
    }

    /// The sandboxes that wait for a host, by id.
    pub async fn parked(&self) -> Result<BTreeMap<String, OwnerRecord>, ClusterError> {
        self.records(keys::PARKED, keys::PARKED, true).await
    }

    /// The owner of sandbox `id`, if a host claimed it.
    pub async fn owner(&self, id: &str) -> Result<Option<OwnerRecord>, ClusterError> {
        let key = keys::sandbox(id);
        Ok(self.records(&key, keys::SANDBOXES, false).await?.remove(id))
    }

    /// The sandboxes host `host` claimed, by id.
    pub async fn owned_by(
        &self,
        host: &str,
    ) -> Result<BTreeMap<String, OwnerRecord>, ClusterError> {
        let prefix = keys::owned(host, "");
        self.records(&prefix, &prefix, true).await
    }

    /// Makes this host's claims those of `local`: claims what is missing, releases what
    /// is no longer there. Returns how many were claimed and released.
    pub async fn reconcile(
        &self,
        local: &BTreeMap<String, OwnerRecord>,
    ) -> Result<(usize, usize), ClusterError> {
        let claimed = self.owned_by(self.host_name()).await?;
        let (mut added, mut removed) = (0, 0);
        for (id, record) in local {
            if claimed.contains_key(id) {
                continue;
            }
            match self.claim(id, record).await? {
                Claimed::Mine => added += 1,
                Claimed::Other(host) => tracing::error!(
                    %id,
                    %host,
                    "the sandbox's id is claimed by another host of the cluster; requests for it go there"
                ),
            }
        }
        let gone: BTreeSet<&String> = claimed
            .keys()
            .filter(|id| !local.contains_key(*id))
            .collect();
        for id in gone {
            self.release(id).await?;
            removed += 1;
        }
        Ok((added, removed))
    }
}

/// This host's sandboxes as owner records.
pub fn local_records(cluster: &Cluster, app: &App) -> BTreeMap<String, OwnerRecord> {
    app.registry
        .list()
        .into_iter()
        // One leaving is the cluster's to place, not this host's to claim.
        .filter(|l| !cluster.was_moved(&l.row.id))
        .map(|l| (l.row.id.clone(), record_of(cluster, &l.row)))
        .collect()
}

/// This host's claim on the sandbox `row`.
pub fn record_of(cluster: &Cluster, row: &crate::state::SandboxRow) -> OwnerRecord {
    OwnerRecord {
        host: cluster.host_name().to_owned(),
        snapshot: row.snapshot.clone(),
        labels: row.labels.clone(),
        created_at: row.created_at.clone(),
        parked: None,
    }
}

/// Keeps this host's claims following its sandboxes while the daemon runs: a
/// reconciliation as soon as sandboxes are made or removed (a burst of events makes
/// one), and every few seconds.
pub async fn run(cluster: std::sync::Arc<Cluster>, app: App) {
    use crate::events::EventKind;
    let mut events = app.registry.events().subscribe();
    let mut tick = tokio::time::interval(RECONCILE_EVERY);
    let changes =
        [EventKind::Created, EventKind::Killed, EventKind::TimedOut].map(EventKind::as_str);
    // Snapshot tags change with builds and pulls, not with sandboxes: on a timer alone.
    let mut tags_tick = tokio::time::interval(RECONCILE_EVERY);
    let mut reported = BTreeSet::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                match cluster.reconcile(&local_records(&cluster, &app)).await {
                    Ok((0, 0)) => {}
                    Ok((claimed, released)) => tracing::debug!(claimed, released, "cluster claims reconciled"),
                    Err(e) => tracing::debug!("cluster claims not reconciled: {e}"),
                }
            }
            _ = tags_tick.tick() => {
                match super::tags::reconcile(&cluster, &app, &mut reported).await {
                    Ok(0) => {}
                    Ok(claimed) => tracing::debug!(claimed, "snapshot tags claimed in the cluster"),
                    Err(e) => tracing::debug!("snapshot tags not reconciled: {e}"),
                }
            }
            event = events.recv() => match event {
                Ok(e) if changes.contains(&e.kind.as_str()) => tick.reset_immediately(),
                Ok(_) => {}
                // Missed events: reconcile now.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => tick.reset_immediately(),
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    }
}
