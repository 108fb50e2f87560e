//! A snapshot's tag across the cluster (see [`crate::cluster::tags`]): claimed once a
//! snapshot is made on this host, which then gives it up if the tag names another
//! snapshot in the cluster; released when the last living host holding it removes it.
//! Without etcd, snapshots are made all the same and their tags claimed by the next
//! reconciliation.

use super::ApiError;
use crate::api::App;
use crate::cluster::tags::TagClaim;
use forkd_storage::snapshot::Tag;

/// Claims the tags of the snapshots `tags` just made on this host. One whose tag names
/// another snapshot in the cluster is removed here (unless something uses it already)
/// and the answer is 409 naming the other.
pub async fn claim_made(app: &App, tags: &[String]) -> Result<(), ApiError> {
    let Some(cluster) = app.cluster.as_deref() else {
        return Ok(());
    };
    for tag in tags {
        let Ok(t) = Tag::parse(tag) else { continue };
        let Some(digest) = super::placement::local_digest(app, &t) else {
            continue;
        };
        match cluster.claim_tag(tag, &digest).await {
            Ok(TagClaim::Same) => {}
            Ok(TagClaim::Other(held)) => {
                let removed = super::snapshot::remove(app, &t, false).await.is_ok();
                return Err(ApiError::conflict(format!(
                    "the tag {tag} names another snapshot in the cluster (digest {}, first made on host {}): {}; pull that one, or give this one another tag",
                    held.digest,
                    held.host,
                    if removed { "this host's was removed" } else { "this host's is kept while it is in use" }
                )));
            }
            Err(e) => tracing::warn!(%tag, "the tag is claimed in the cluster later: {e}"),
        }
    }
    Ok(())
}

/// Before snapshot `tag` is made new on this host (a build): refused (409) if the tag
/// names a snapshot in the cluster already.
pub async fn check_free(app: &App, tag: &Tag) -> Result<(), ApiError> {
    let Some(cluster) = app.cluster.as_deref() else {
        return Ok(());
    };
    match cluster.tag(tag.as_str()).await {
        Ok(Some(held)) => Err(ApiError::conflict(format!(
            "the tag {tag} names a snapshot of the cluster already (digest {}, made on host {}): pull it, or choose another tag",
            held.digest, held.host
        ))),
        Ok(None) => Ok(()),
        Err(e) => {
            tracing::warn!(%tag, "the tag is checked against the cluster later: {e}");
            Ok(())
        }
    }
}

/// The digest of this host's snapshot `tag`, to release its tag with once removed.
pub fn digest_of(app: &App, tag: &Tag) -> Option<String> {
    app.cluster.as_ref()?;
    super::placement::local_digest(app, tag)
}

/// After this host removed its snapshot `tag` (of `digest`): the tag is released if no
/// other living host holds it.
pub async fn release_removed(app: &App, tag: &Tag, digest: &str) {
    let Some(cluster) = app.cluster.as_deref() else {
        return;
    };
    let released = async {
        let hosts = cluster.hosts().await?;
        let held_elsewhere = hosts.iter().any(|h| {
            h.name != cluster.host_name()
                && h.live
                    .as_ref()
                    .is_some_and(|l| l.snapshots.contains_key(tag.as_str()))
        });
        if !held_elsewhere {
            cluster.release_tag(tag.as_str(), digest).await?;
        }
        Ok::<_, crate::cluster::ClusterError>(())
    };
    if let Err(e) = released.await {
        tracing::warn!(%tag, "the tag stays claimed in the cluster: {e}");
    }
}
