//! Which snapshot a tag names across the cluster: `/forkd/snapshots/TAG` holds the
//! digest of its contents ([`super::snapshot_digest`]), claimed in a transaction that
//! succeeds only if no host gave the tag a digest yet, so that two hosts never give one
//! tag two digests. Every host that makes a snapshot (a build, a branch, a pull, an
//! upload) claims its tag once it is written, and removes it again if the tag names
//! another snapshot in the cluster; each host also claims its snapshots' tags in its
//! reconciliation (those made while etcd was down).

use super::{keys, Cluster, ClusterError};
use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What a tag names in the cluster.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TagRecord {
    /// The digest of the snapshot's contents.
    pub digest: String,
    /// The host that claimed it first.
    pub host: String,
    /// When (RFC 3339).
    pub claimed_at: String,
}

/// What a tag's claim found.
#[derive(Debug, PartialEq)]
pub enum TagClaim {
    /// The tag names this digest in the cluster (now, or already).
    Same,
    /// The tag names another snapshot.
    Other(TagRecord),
}

impl Cluster {
    /// Claims `tag` for the snapshot of `digest`.
    pub async fn claim_tag(&self, tag: &str, digest: &str) -> Result<TagClaim, ClusterError> {
        let key = keys::snapshot(tag);
        let record = TagRecord {
            digest: digest.to_owned(),
            host: self.host_name().to_owned(),
            claimed_at: crate::now_rfc3339(),
        };
        let value = serde_json::to_vec(&record).expect("records serialize");
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.clone(), value, None)])
            .or_else([TxnOp::get(key.clone(), None)]);
        let answer = self.txn(txn).await?;
        if answer.succeeded() {
            return Ok(TagClaim::Same);
        }
        Ok(match self.tag(tag).await? {
            Some(r) if r.digest == digest => TagClaim::Same,
            Some(r) => TagClaim::Other(r),
            // Released between the two reads: claim again.
            None => Box::pin(self.claim_tag(tag, digest)).await?,
        })
    }

    /// Releases `tag` if it still names `digest` (no host holds it any more).
    pub async fn release_tag(&self, tag: &str, digest: &str) -> Result<(), ClusterError> {
        let key = keys::snapshot(tag);
        let Some(held) = self.tag(tag).await? else {
            return Ok(());
        };
        if held.digest != digest {
            return Ok(());
        }
        let value = serde_json::to_vec(&held).expect("records serialize");
        let txn = Txn::new()
            .when([Compare::value(key.clone(), CompareOp::Equal, value)])
            .and_then([TxnOp::delete(key.clone(), None)]);
        self.txn(txn).await?;
        Ok(())
    }

    /// What `tag` names in the cluster, if a host claimed it.
    pub async fn tag(&self, tag: &str) -> Result<Option<TagRecord>, ClusterError> {
        let key = keys::snapshot(tag);
        Ok(self
            .records(&key, keys::SNAPSHOTS, false)
            .await?
            .remove(tag))
    }

    /// Every tag the cluster knows, with what it names.
    pub async fn tags(&self) -> Result<BTreeMap<String, TagRecord>, ClusterError> {
        self.records(keys::SNAPSHOTS, keys::SNAPSHOTS, true).await
    }
}

/// Claims the tags of this host's snapshots that the cluster does not know yet (made
/// while etcd was down). A snapshot whose tag names another one in the cluster is
/// reported once (in `reported`), and left for its owner to remove or retag.
pub async fn reconcile(
    cluster: &Cluster,
    app: &crate::api::App,
    reported: &mut std::collections::BTreeSet<String>,
) -> Result<usize, ClusterError> {
    let known = cluster.tags().await?;
    let store = app.registry.store();
    let mut claimed = 0;
    for (tag, snap) in store.list() {
        let Ok(snap) = snap else { continue };
        let Some(digest) = super::snapshot_digest(store, &snap) else {
            continue;
        };
        let held = match known.get(tag.as_str()) {
            Some(r) => Some(r.clone()),
            None => match cluster.claim_tag(tag.as_str(), &digest).await? {
                TagClaim::Same => {
                    claimed += 1;
                    None
                }
                TagClaim::Other(r) => Some(r),
            },
        };
        match held {
            Some(r) if r.digest != digest && reported.insert(tag.to_string()) => tracing::error!(
                %tag,
                other = %r.digest,
                host = %r.host,
                "this host's snapshot is not the one its tag names in the cluster; remove or retag it"
            ),
            _ => {}
        }
    }
    Ok(claimed)
}
