//! Compacting a chain link into a standalone snapshot: its memory image and device state
//! copied, its layered disk flattened over the root filesystem, no parent. It forks
//! exactly as the link did, and its ancestors can then be removed.

use crate::error::SandboxError;
use forkd_hypervisor::Hypervisor;
use forkd_storage::snapshot::manifest::parts;
use forkd_storage::snapshot::{memory_diff, Snapshot, Store, Tag};

/// Writes `tag`, a standalone copy of the snapshot `head` (a chain link).
pub async fn compact(
    hv: &dyn Hypervisor,
    store: &Store,
    head: &Snapshot,
    tag: &Tag,
) -> Result<Snapshot, SandboxError> {
    if head.manifest.parent.is_none() {
        return Err(SandboxError::Snapshot(
            forkd_storage::snapshot::SnapshotError::Damaged {
                tag: head.tag.to_string(),
                detail: "it is standalone already (it has no parent)".into(),
            },
        ));
    }
    forkd_host::space::ensure_room(
        store.root(),
        (u64::from(head.manifest.machine.memory_mib) << 20) * 2,
        &format!("compacting snapshot {} into {tag}", head.tag),
    )?;
    let mut staging = store.stage(tag)?;
    staging.link_assets_from(head)?;
    let io = |what: String| {
        move |source: std::io::Error| SandboxError::Io {
            context: what,
            source,
        }
    };
    let (from, to) = (head.part(parts::MEMORY), staging.part(parts::MEMORY));
    tokio::task::spawn_blocking(move || memory_diff::copy_sparse(&from, &to))
        .await
        .map_err(|e| SandboxError::Io {
            context: "copying the memory image".into(),
            source: std::io::Error::other(e.to_string()),
        })?
        .map_err(io("copying the memory image".into()))?;
    std::fs::copy(head.part(parts::STATE), staging.part(parts::STATE))
        .map_err(io("copying the device state".into()))?;
    hv.flatten_disk(
        &head.part(parts::DISK),
        std::path::Path::new(parts::ROOTFS),
        &staging.part(parts::DISK),
    )
    .await?;
    let mut manifest = head.manifest.clone();
    manifest.tag = tag.to_string();
    manifest.parent = None;
    manifest.parent_digest = None;
    manifest.created_at = forkd_image::timestamp::rfc3339_utc(std::time::SystemTime::now());
    manifest.parts.clear();
    let snap = tokio::task::spawn_blocking(move || staging.publish(manifest, &|_| {}))
        .await
        .map_err(|e| SandboxError::Io {
            context: "publishing the compacted snapshot".into(),
            source: std::io::Error::other(e.to_string()),
        })??;
    Ok(snap)
}
