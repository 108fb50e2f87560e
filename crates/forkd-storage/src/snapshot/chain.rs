//! Snapshot chains: branches of branches. A link names its parent by tag (informative)
//! and by the digest of the parent's manifest (what counts): a parent removed, or
//! replaced under the same tag, breaks the chain visibly instead of silently.
//!
//! What a link stores of its own is its device state, its memory diff and its disk layer;
//! its full memory image, which its children map, is made once when the branch is
//! written (and can be made again from the chain: [`verify`] does, to check the diff).

use super::manifest::parts;
use super::memory_diff;
use super::{sha256_file, Snapshot, SnapshotError, Store, Tag, MANIFEST, SEAL};
use std::os::unix::fs::MetadataExt;

/// Most links a chain may have (a guard against a loop of hand-edited manifests).
pub const MAX_DEPTH: usize = 64;

/// Where a snapshot stands in its chain and what it stores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainInfo {
    /// Links above a standalone snapshot (0 for a template).
    pub depth: usize,
    /// Its ancestors' tags, nearest first.
    pub ancestors: Vec<String>,
    /// Bytes on disk that are its own: for a link its state, memory diff and disk layer;
    /// for a standalone snapshot every part that is not a hard link of the guest assets.
    pub own_bytes: u64,
    /// Bytes of the memory image its children map (a link's is made from the chain).
    pub memory_image_bytes: u64,
    /// Bytes on disk of the whole chain up to it: every link's own bytes, the memory
    /// images, and the root's parts.
    pub total_bytes: u64,
}

/// The ancestors of `snap`, nearest first, each checked against the digest its child
/// recorded.
pub fn ancestors(store: &Store, snap: &Snapshot) -> Result<Vec<Snapshot>, SnapshotError> {
    let mut out: Vec<Snapshot> = Vec::new();
    let mut cur = snap.clone();
    while let Some(parent) = cur.manifest.parent.clone() {
        if out.len() >= MAX_DEPTH {
            return Err(damaged(
                snap,
                format!("its chain is deeper than {MAX_DEPTH}"),
            ));
        }
        let tag = Tag::parse(&parent)?;
        let p = store.open(&tag).map_err(|e| match e {
            SnapshotError::NotFound { .. } => {
                damaged(&cur, format!("its parent {parent} is missing"))
            }
            other => other,
        })?;
        if let Some(want) = &cur.manifest.parent_digest {
            let (have, _) = sha256_file(&p.dir.join(MANIFEST))?;
            if &have != want {
                return Err(damaged(
                    &cur,
                    format!("snapshot {parent} is not the parent it was made from (another snapshot took its tag)"),
                ));
            }
        }
        out.push(p.clone());
        cur = p;
    }
    Ok(out)
}

/// Where `snap` stands in its chain.
pub fn info(store: &Store, snap: &Snapshot) -> Result<ChainInfo, SnapshotError> {
    let up = ancestors(store, snap)?;
    // A link's memory image is on disk beside what it owns; a root's is one of its parts.
    let stored = |s: &Snapshot| {
        own_bytes(s)
            + if s.manifest.parent.is_some() {
                allocated(&s.part(parts::MEMORY))
            } else {
                0
            }
    };
    let total_bytes = stored(snap) + up.iter().map(stored).sum::<u64>();
    Ok(ChainInfo {
        depth: up.len(),
        ancestors: up.iter().map(|a| a.tag.to_string()).collect(),
        own_bytes: own_bytes(snap),
        memory_image_bytes: allocated(&snap.part(parts::MEMORY)),
        total_bytes,
    })
}

/// What `snap` stores of its own (see [`ChainInfo::own_bytes`]).
pub fn own_bytes(snap: &Snapshot) -> u64 {
    let names: &[&str] = if snap.manifest.parent.is_some() {
        &[
            parts::STATE,
            parts::MEMORY_DIFF,
            parts::DISK,
            MANIFEST,
            SEAL,
        ]
    } else {
        &[parts::STATE, parts::MEMORY, parts::DISK, MANIFEST, SEAL]
    };
    names.iter().map(|n| allocated(&snap.part(n))).sum()
}

fn allocated(path: &std::path::Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// Snapshots that depend on `tag`, directly or not, deepest first (the order they can
/// be removed in).
pub fn descendants(store: &Store, tag: &Tag) -> Vec<String> {
    let mut out = Vec::new();
    let mut frontier = vec![tag.to_string()];
    while let Some(t) = frontier.pop() {
        let Ok(t) = Tag::parse(&t) else { continue };
        for d in store.dependents(&t) {
            if !out.contains(&d) && out.len() < 4096 {
                out.push(d.clone());
                frontier.push(d);
            }
        }
    }
    out.reverse();
    out
}

/// Verifies the chain up to `tag`, root first: every link's parts against its manifest,
/// each parent against the digest its child recorded, and each link's memory diff by
/// making its image again from its parent's and comparing digests.
pub fn verify(store: &Store, tag: &Tag) -> Result<Vec<Snapshot>, SnapshotError> {
    let mut hashed = super::HashedFiles::default();
    let head = store.verify_sharing(tag, &mut hashed)?;
    let mut chain = ancestors(store, &head)?;
    chain.reverse();
    for a in &chain {
        store.verify_sharing(&a.tag, &mut hashed)?;
    }
    chain.push(head);
    for pair in chain.windows(2) {
        let (parent, link) = (&pair[0], &pair[1]);
        let scratch = store.scratch_path(&format!("verify-{}", link.tag));
        let rebuilt = memory_diff::materialize(
            &parent.part(parts::MEMORY),
            &link.part(parts::MEMORY_DIFF),
            &scratch,
        );
        let _ = std::fs::remove_file(&scratch);
        let rebuilt = rebuilt
            .map_err(|e| damaged(link, format!("its memory diff cannot be applied: {e}")))?;
        let want = &link.manifest.parts[parts::MEMORY].sha256;
        if &rebuilt != want {
            return Err(damaged(
                link,
                format!(
                    "its memory diff over {} does not give its memory image",
                    parent.tag
                ),
            ));
        }
    }
    Ok(chain)
}

fn damaged(snap: &Snapshot, detail: String) -> SnapshotError {
    SnapshotError::Damaged {
        tag: snap.tag.to_string(),
        detail,
    }
}
