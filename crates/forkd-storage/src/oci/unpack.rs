//! `forkd unpack`: an archive into the store. The archive is received whole into a
//! layout first (every blob checked against its digest, every entry against the
//! layout's shape), its manifests are checked, and only then is anything installed:
//! each snapshot through a staging directory, renamed into place when all of it checks
//! out, root first. If a later link fails, the ones this unpack installed are removed.
//!
//! What is rewritten on the way in is what names the host: a link's disk layer names its
//! parent's disk by path, and its manifest names its parent by tag and manifest digest.

use super::layout::{Artifact, Layout};
use super::{blob, io, ArchiveError};
use crate::snapshot::manifest::parts;
use crate::snapshot::{memory_diff, Manifest, Snapshot, Store, Tag, MANIFEST};
use forkd_hypervisor::Hypervisor;
use std::io::Read;
use std::path::PathBuf;

/// Most vCPUs a snapshot from elsewhere may ask for.
const MAX_VCPUS: u32 = 256;

/// What an unpack (or pull) installed.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Unpacked {
    /// The tag of the chain's head.
    pub tag: String,
    /// Snapshots written, root first.
    pub installed: Vec<String>,
    /// Snapshots of the chain that were here already (same state and memory).
    pub present: Vec<String>,
}

/// Reads the archive `r` and installs its chain; the head goes under `rename` if given,
/// else under the tag it was packed with. `hv` reads and checks the disk layers.
pub fn unpack(
    store: &Store,
    hv: &dyn Hypervisor,
    r: impl Read,
    rename: Option<&Tag>,
    progress: &dyn Fn(&str),
) -> Result<Unpacked, ArchiveError> {
    let layout = Layout::receive(store, r, progress)?;
    let chain = layout.index_chain()?;
    install(store, hv, &layout, &chain, rename, progress)
}

/// Installs `chain` (root first) from `layout`.
pub fn install(
    store: &Store,
    hv: &dyn Hypervisor,
    layout: &Layout,
    chain: &[Artifact],
    rename: Option<&Tag>,
    progress: &dyn Fn(&str),
) -> Result<Unpacked, ArchiveError> {
    // Every name is settled before anything is written.
    let mut plan: Vec<(Tag, Option<Snapshot>)> = Vec::new();
    for (i, a) in chain.iter().enumerate() {
        check_machine(&a.manifest)?;
        let head = i + 1 == chain.len();
        let tag = match rename.filter(|_| head) {
            Some(t) => t.clone(),
            None => Tag::parse(&a.manifest.tag).map_err(|e| {
                ArchiveError::Refused(format!("its snapshot tag is not valid here: {e}"))
            })?,
        };
        let present = if store.exists(&tag) {
            let have = store.open(&tag)?;
            if !same_snapshot(&have.manifest, &a.manifest) {
                if head {
                    return Err(crate::snapshot::SnapshotError::Exists {
                        tag: tag.to_string(),
                    }
                    .into());
                }
                return Err(ArchiveError::Refused(format!(
                    "its snapshot {tag} is an ancestor of {}, and a different snapshot {tag} exists here (remove it first)",
                    chain.last().map_or("", |h| h.manifest.tag.as_str())
                )));
            }
            Some(have)
        } else {
            None
        };
        if present.is_none() {
            let parent = i.checked_sub(1).map(|p| &chain[p].manifest);
            let needed = |name: &str| !linked_from_parent(name, &a.manifest, parent);
            if let Some((name, b)) = a.parts.iter().find(|(n, b)| !b.present && needed(n)) {
                return Err(ArchiveError::Refused(format!(
                    "snapshot {}: part {name}'s blob sha256:{} is missing",
                    a.manifest.tag, b.hex
                )));
            }
        }
        plan.push((tag, present));
    }
    let mut installed: Vec<Tag> = Vec::new();
    let mut parent: Option<Snapshot> = None;
    let mut present = Vec::new();
    for (a, (tag, here)) in chain.iter().zip(plan) {
        let snap = match here {
            Some(s) => {
                present.push(tag.to_string());
                s
            }
            None => match install_one(store, hv, layout, a, &tag, parent.as_ref(), progress) {
                Ok(s) => {
                    installed.push(tag);
                    s
                }
                Err(e) => {
                    for t in installed.iter().rev() {
                        let _ = store.remove(t, &[]);
                    }
                    return Err(e);
                }
            },
        };
        parent = Some(snap);
    }
    Ok(Unpacked {
        tag: parent.map(|p| p.tag.to_string()).unwrap_or_default(),
        installed: installed.iter().map(ToString::to_string).collect(),
        present,
    })
}

/// Whether the part `name` of `m` is installed as a link to its parent's (whose
/// manifest is `parent`): the same bytes (a chain's guest assets), so its blob is
/// neither read nor needed.
pub fn linked_from_parent(name: &str, m: &Manifest, parent: Option<&Manifest>) -> bool {
    let Some(p) = parent else {
        return false;
    };
    name != parts::DISK
        && name != parts::MEMORY_DIFF
        && p.parts.get(name).map(|x| &x.sha256) == m.parts.get(name).map(|x| &x.sha256)
}

/// Whether the store holds `m` under `tag` already: a pull does not fetch its parts.
pub fn is_here(store: &Store, tag: &Tag, m: &Manifest) -> bool {
    store.exists(tag)
        && store
            .open(tag)
            .is_ok_and(|have| same_snapshot(&have.manifest, m))
}

/// Two snapshots are the same if they froze the same device state over the same memory.
fn same_snapshot(a: &Manifest, b: &Manifest) -> bool {
    [parts::STATE, parts::MEMORY]
        .iter()
        .all(|p| a.parts.get(*p).map(|x| &x.sha256) == b.parts.get(*p).map(|x| &x.sha256))
}

/// What a manifest from elsewhere asks of this host stays within reason.
fn check_machine(m: &Manifest) -> Result<(), ArchiveError> {
    let refused = |msg: String| ArchiveError::Refused(format!("snapshot {}: {msg}", m.tag));
    if m.machine.vcpus == 0 || m.machine.vcpus > MAX_VCPUS {
        return Err(refused(format!("{} vCPUs", m.machine.vcpus)));
    }
    // A model name, not QEMU options smuggled after a comma.
    if !forkd_hypervisor::accel::is_cpu_model_name(&m.machine.cpu) {
        return Err(refused(format!(
            "its CPU model {:?} is not a model name",
            m.machine.cpu
        )));
    }
    let memory = m.parts.get(parts::MEMORY).map_or(0, |p| p.size);
    if memory != u64::from(m.machine.memory_mib) << 20 {
        return Err(refused(format!(
            "its memory image is {memory} bytes for {} MiB of guest RAM",
            m.machine.memory_mib
        )));
    }
    Ok(())
}

/// What installing `a` may write: each part it does not link from its parent, at
/// most its size (what its layer's annotation says when it says less: holes are not
/// written), and for a link the memory image made from its parent's.
fn space_needed(
    a: &Artifact,
    parent: Option<&Snapshot>,
    same_as_parent: &dyn Fn(&str) -> Option<PathBuf>,
) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let written: u64 = a
        .parts
        .iter()
        .filter(|(name, _)| same_as_parent(name).is_none())
        .map(|(name, b)| {
            let size = a.manifest.parts[name].size;
            b.stored.map_or(size, |s| s.min(size))
        })
        .sum();
    let memory = parent.map_or(0, |p| {
        std::fs::metadata(p.part(parts::MEMORY)).map_or(0, |m| m.blocks() * 512)
            + a.manifest
                .parts
                .get(parts::MEMORY_DIFF)
                .map_or(0, |d| d.size)
    });
    written + memory
}

fn install_one(
    store: &Store,
    hv: &dyn Hypervisor,
    layout: &Layout,
    a: &Artifact,
    tag: &Tag,
    parent: Option<&Snapshot>,
    progress: &dyn Fn(&str),
) -> Result<Snapshot, ArchiveError> {
    let refused = |m: String| ArchiveError::Refused(format!("snapshot {}: {m}", a.manifest.tag));
    let same_as_parent = |name: &str| -> Option<PathBuf> {
        let p = parent?;
        linked_from_parent(name, &a.manifest, Some(&p.manifest)).then(|| p.part(name))
    };
    let needed = space_needed(a, parent, &same_as_parent);
    forkd_host::space::ensure_room(store.root(), needed, &format!("unpacking snapshot {tag}"))?;
    let mut staging = store.stage(tag)?;
    for (name, b) in &a.parts {
        let want = &a.manifest.parts[name];
        if let Some(src) = same_as_parent(name) {
            std::fs::hard_link(&src, staging.part(name))
                .or_else(|_| std::fs::copy(&src, staging.part(name)).map(drop))
                .map_err(io(format!("linking {}", src.display())))?;
            staging.know(name, want.clone());
            continue;
        }
        progress(&format!(
            "writing {name} of {tag} ({} MiB)",
            want.size >> 20
        ));
        let sha = blob::decompress_bounded(
            &layout.blob_path(&b.hex),
            &staging.part(name),
            want.size,
            b.stored,
        )
        .map_err(|e| refused(format!("part {name}: {e}")))?;
        if sha != want.sha256 {
            return Err(refused(format!(
                "part {name} does not match its digest (expected sha256 {}, found {sha})",
                want.sha256
            )));
        }
        if name != parts::DISK {
            staging.know(name, want.clone());
        }
    }
    let disk = staging.part(parts::DISK);
    hv.check_foreign_layer(&disk)
        .map_err(|e| refused(format!("its disk layer: {e}")))?;
    let mut manifest = a.manifest.clone();
    match parent {
        Some(p) => {
            progress(&format!("making {tag}'s memory image from {}'s", p.tag));
            let sha = memory_diff::materialize(
                &p.part(parts::MEMORY),
                &staging.part(parts::MEMORY_DIFF),
                &staging.part(parts::MEMORY),
            )
            .map_err(|e| refused(format!("its memory diff cannot be applied: {e}")))?;
            let want = &a.manifest.parts[parts::MEMORY];
            if sha != want.sha256 {
                return Err(refused(format!(
                    "its memory diff over {} does not give its memory image",
                    p.tag
                )));
            }
            staging.know(parts::MEMORY, want.clone());
            // The layer names its parent's disk where it is on this host.
            let base = p.part(parts::DISK);
            let name = base
                .to_str()
                .ok_or_else(|| refused(format!("{} is not UTF-8", base.display())))?;
            hv.set_layer_base_name(&disk, name)
                .map_err(|e| refused(format!("its disk layer: {e}")))?;
            manifest.parent = Some(p.tag.to_string());
            manifest.parent_digest = Some(crate::snapshot::sha256_file(&p.dir.join(MANIFEST))?.0);
        }
        None => {
            let base = hv
                .layer_base_name(&disk)
                .map_err(|e| refused(format!("its disk layer: {e}")))?;
            if base.as_deref() != Some(parts::ROOTFS) {
                return Err(refused(format!(
                    "its disk layer builds on {base:?}, not its own {}",
                    parts::ROOTFS
                )));
            }
        }
    }
    Ok(staging.publish(manifest, &|m| progress(m))?)
}
