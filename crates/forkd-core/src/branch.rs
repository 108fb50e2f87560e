//! BRANCH: a snapshot of a running sandbox, which goes on running.
//!
//! The sandbox's VM is captured at one instant (see `forkd_hypervisor::Vm::branch`):
//! memory into a new RAM file, device state, and the disk by moving the VM onto a new
//! empty layer so that the layer below is frozen at that instant. The snapshot is a link
//! of a chain: its parent is the snapshot the sandbox builds on (the one it was forked
//! from, or its own latest branch, since its disk now builds on that one), its memory is
//! stored as the pages that differ from the parent's image, its disk as the frozen layer
//! over the parent's disk. The full memory image children map is written once, here.
//!
//! Children of the branch start as children of any snapshot: the resume hook gives each
//! its clock, entropy and hostname, and the agent session starts afresh, so a request in
//! flight in the source at the branch instant is neither answered nor run again.

use crate::error::SandboxError;
use crate::sandbox::{new_sandbox_dir, Sandbox};
use forkd_hypervisor::{
    BranchMode, BranchPlan, BranchStats, DiskFormat, DiskLayer, Hypervisor, MemoryBackend,
};
use forkd_image::Home;
use forkd_storage::snapshot::manifest::{parts, BranchInfo, BuildTimes, Manifest, Part};
use forkd_storage::snapshot::memory_diff::{self, DiffStats};
use forkd_storage::snapshot::{Snapshot, Store, Tag, MANIFEST};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The file in a sandbox's runtime directory naming the snapshot its disk builds on
/// since its latest branch (absent: the one it was forked from).
pub const BASE_FILE: &str = "branch-base";

/// A branch that was written.
#[derive(Debug)]
pub struct Branched {
    /// The new snapshot.
    pub snapshot: Snapshot,
    /// The capture.
    pub stats: BranchStats,
    /// The memory diff.
    pub diff: DiffStats,
    /// From the start to the snapshot's publication.
    pub total: Duration,
}

/// The snapshot a sandbox's next branch builds on: its latest branch if it has one,
/// else `origin` (the snapshot it was forked from).
pub fn base_of(sandbox_dir: &Path, origin: &str) -> String {
    std::fs::read_to_string(sandbox_dir.join(BASE_FILE))
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| origin.to_owned())
}

/// Branches `source` (whose disk and memory build on `base`) into a snapshot `tag`.
/// `progress` hears each step.
#[allow(clippy::too_many_arguments)]
pub async fn branch(
    hv: &dyn Hypervisor,
    home: &Home,
    store: &Store,
    source: &Sandbox,
    base: &Snapshot,
    tag: &Tag,
    mode: BranchMode,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Branched, SandboxError> {
    let t0 = Instant::now();
    check_layers(hv, source)?;
    source
        .can_branch(mode)
        .map_err(|detail| SandboxError::Unbranchable {
            id: source.id().to_owned(),
            detail,
        })?;
    let machine = &base.manifest.machine;
    forkd_host::space::ensure_room(
        store.root(),
        (u64::from(machine.memory_mib) << 20) * 2 + (64 << 20),
        &format!("branching {} into snapshot {tag}", source.id()),
    )?;
    let mut staging = store.stage(tag)?;
    staging.link_assets_from(base)?;
    // The contexts the source has now (informative: children have what memory has).
    let contexts = source
        .call(|a| async move { a.list_contexts().await })
        .await
        .unwrap_or_default();

    // The receiver: the source's machine with its own runtime directory, a throwaway
    // disk and, as RAM, the branch's memory image.
    let (rid, rdir, _rguard) = new_sandbox_dir(home)?;
    let mut receiver = source.config().clone();
    receiver.id = rid;
    receiver.root_disk = rdir.join("root.qcow2");
    receiver.dir = rdir;
    receiver.memory = MemoryBackend::File {
        path: staging.part(parts::MEMORY),
        shared: true,
    };
    receiver.detached = false;
    hv.create_disk_layer(DiskLayer {
        path: &receiver.root_disk,
        base: &base.part(parts::DISK),
        base_format: DiskFormat::Layer,
        relative: false,
        named: None,
    })
    .await?;
    // The source's next top layer names, as what it builds on, the frozen layer under the
    // path it is published at.
    let next_layer = next_layer_path(source.dir());
    let published_disk = store.path(tag).join(parts::DISK);
    hv.create_disk_layer(DiskLayer {
        path: &next_layer,
        base: &source.config().root_disk,
        base_format: DiskFormat::Layer,
        relative: false,
        named: Some(&published_disk),
    })
    .await?;
    let plan = BranchPlan {
        receiver,
        state: staging.part(parts::STATE),
        next_layer: Some(next_layer),
        at_instant: Some(|| forkd_host::failpoint::hit("branch.at_instant")),
    };
    progress(&format!("capturing {} ({mode})", source.id()));
    let stats = source.branch_vm(mode, &plan).await?;
    progress(&format!(
        "{} runs again after a {:.1} ms pause; writing the snapshot",
        source.id(),
        stats.pause.as_secs_f64() * 1000.0
    ));
    // From here the source's disk builds on this branch, whatever happens next: if the
    // branch is not published, its frozen layer stays in the source's directory, which
    // is all the source needs.
    std::fs::write(source.dir().join(BASE_FILE), tag.as_str()).map_err(|e| SandboxError::Io {
        context: format!("recording {}'s disk base", source.id()),
        source: e,
    })?;
    std::fs::hard_link(&stats.frozen_layer, staging.part(parts::DISK)).map_err(|e| {
        SandboxError::Io {
            context: format!("linking {}", stats.frozen_layer.display()),
            source: e,
        }
    })?;

    let link = Link {
        source: source.id().to_owned(),
        mode,
        pause_ms: stats.pause.as_secs_f64() * 1000.0,
        transferred: stats.transferred,
        freeze_ms: u64::try_from(stats.copy.as_millis()).unwrap_or(u64::MAX),
        contexts,
    };
    let (snapshot, diff) = publish_link(hv, staging, base, tag, link, t0).await?;
    Ok(Branched {
        snapshot,
        stats,
        diff,
        total: t0.elapsed(),
    })
}

/// Branches a paused sandbox (in `dir`, whose disk and memory build on `base`) into a
/// snapshot `tag` from its pause image, without running it: the image's memory (its RAM
/// file with its own pages over it), its device state, and a copy of its top disk layer
/// (the sandbox writes that layer again once resumed). The pause image is checked
/// against its digests first.
pub async fn branch_paused(
    store: &Store,
    hv: &dyn Hypervisor,
    dir: &Path,
    id: &str,
    base: &Snapshot,
    tag: &Tag,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Branched, SandboxError> {
    let t0 = Instant::now();
    let damaged = |detail: String| SandboxError::PauseImage {
        id: id.to_owned(),
        detail,
    };
    let record =
        crate::pause::read_record(dir)?.ok_or_else(|| damaged("it has no pause image".into()))?;
    let image = crate::pause::image_dir(dir);
    let layer_size = std::fs::metadata(&record.disk_top).map_or(0, |m| m.len());
    forkd_host::space::ensure_room(
        store.root(),
        record.memory_size * 2 + layer_size + (64 << 20),
        &format!("branching paused sandbox {id} into snapshot {tag}"),
    )?;
    let state = image.join(crate::pause::STATE);
    let (state_sha, _) = forkd_storage::snapshot::sha256_file(&state)?;
    if state_sha != record.state_sha256 {
        return Err(damaged("its device state does not match its digest".into()));
    }
    let mut staging = store.stage(tag)?;
    staging.link_assets_from(base)?;
    let io = |context: String| move |source| SandboxError::Io { context, source };
    std::fs::hard_link(&state, staging.part(parts::STATE))
        .map_err(io(format!("linking {}", state.display())))?;
    progress(&format!("copying {id}'s disk layer"));
    std::fs::copy(&record.disk_top, staging.part(parts::DISK))
        .map_err(io(format!("copying {}", record.disk_top.display())))?;
    progress(&format!("writing {id}'s memory image"));
    let (ram_file, diff, out) = (
        record.memory_base.clone(),
        image.join(crate::pause::MEMORY_DIFF),
        staging.part(parts::MEMORY),
    );
    let size = record.memory_size;
    let diff_sha = tokio::task::spawn_blocking(move || {
        memory_diff::copy_sparse(&ram_file, &out)?;
        let f = std::fs::OpenOptions::new().write(true).open(&out)?;
        use std::os::unix::fs::FileExt;
        memory_diff::apply(&diff, size, &mut |at, pages| f.write_all_at(pages, at))?;
        f.sync_all()?;
        memory_diff::sha256_sparse(&diff)
    })
    .await
    .map_err(|e| SandboxError::Io {
        context: "writing the memory image".into(),
        source: std::io::Error::other(e.to_string()),
    })?
    .map_err(|e| damaged(format!("its memory: {e}")))?;
    if diff_sha != record.memory_sha256 {
        return Err(damaged("its memory does not match its digest".into()));
    }
    let link = Link {
        source: id.to_owned(),
        mode: record.mode,
        pause_ms: record.stall_ms,
        transferred: record.transferred,
        freeze_ms: 0,
        contexts: base.manifest.contexts.clone(),
    };
    let (snapshot, diff) = publish_link(hv, staging, base, tag, link, t0).await?;
    Ok(Branched {
        snapshot,
        stats: BranchStats {
            frozen_layer: record.disk_top,
            pause: Duration::ZERO,
            copy: Duration::ZERO,
            transferred: record.transferred,
        },
        diff,
        total: t0.elapsed(),
    })
}

/// What a chain link records of the capture that made it.
struct Link {
    source: String,
    mode: BranchMode,
    pause_ms: f64,
    transferred: u64,
    freeze_ms: u64,
    contexts: Vec<forkd_proto::context::ContextInfo>,
}

/// Publishes a staged chain link whose memory image, device state and disk are in
/// place: writes its memory diff against `base`'s image and its manifest.
async fn publish_link(
    hv: &dyn Hypervisor,
    mut staging: forkd_storage::snapshot::Staging,
    base: &Snapshot,
    tag: &Tag,
    link: Link,
    t0: Instant,
) -> Result<(Snapshot, DiffStats), SandboxError> {
    let parent_memory = base.part(parts::MEMORY);
    let image = staging.part(parts::MEMORY);
    let diff_path = staging.part(parts::MEMORY_DIFF);
    let (diff, memory_sha) = tokio::task::spawn_blocking(move || {
        memory_diff::write_diff(&parent_memory, &image, &diff_path)
    })
    .await
    .map_err(|e| SandboxError::Io {
        context: "diffing the memory".into(),
        source: std::io::Error::other(e.to_string()),
    })?
    .map_err(|e| SandboxError::Io {
        context: "diffing the branch's memory against its parent's".into(),
        source: e,
    })?;
    staging.know(
        parts::MEMORY,
        Part {
            size: diff.image_size,
            sha256: memory_sha,
        },
    );
    let parent_digest = forkd_storage::snapshot::sha256_file(&base.dir.join(MANIFEST))?.0;
    let mut versions = base.manifest.versions.clone();
    versions.hypervisor = hv.name().to_owned();
    versions.hypervisor_version = crate::template::hypervisor_version(hv);
    let manifest = Manifest {
        format: forkd_storage::snapshot::manifest::FORMAT,
        tag: tag.to_string(),
        template: base.manifest.template.clone(),
        created_at: forkd_image::timestamp::rfc3339_utc(std::time::SystemTime::now()),
        parent: Some(base.tag.to_string()),
        parent_digest: Some(parent_digest),
        branch: Some(BranchInfo {
            source: link.source,
            mode: link.mode,
            pause_ms: link.pause_ms,
            transferred: link.transferred,
            pages_changed: diff.pages,
        }),
        machine: base.manifest.machine.clone(),
        versions,
        parts: Default::default(),
        contexts: link.contexts,
        build: BuildTimes {
            freeze_ms: link.freeze_ms,
            total_ms: u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX),
            ..Default::default()
        },
        pool: 0,
        egress: base.manifest.egress.clone(),
        lifecycle: base.manifest.lifecycle,
    };
    let snapshot = tokio::task::spawn_blocking(move || staging.publish(manifest, &|_| {}))
        .await
        .map_err(|e| SandboxError::Io {
            context: "publishing the branch".into(),
            source: std::io::Error::other(e.to_string()),
        })??;
    Ok((snapshot, diff))
}

/// The source's disk layers (`root.qcow2`, `root.N.qcow2`), each with its number (0 for
/// `root.qcow2`).
fn layers(dir: &Path) -> Vec<(u32, PathBuf)> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let n = if name == "root.qcow2" {
                0
            } else {
                name.strip_prefix("root.")?
                    .strip_suffix(".qcow2")?
                    .parse::<u32>()
                    .ok()?
            };
            Some((n, e.path()))
        })
        .collect()
}

/// Refuses a source one of whose disk layers builds on a file that is not there: a
/// branch whose capture moved the source onto a new layer but which was never
/// published (it failed, or the daemon died, after the capture). Branching it again
/// would make a snapshot whose disk cannot be opened.
fn check_layers(hv: &dyn Hypervisor, source: &Sandbox) -> Result<(), SandboxError> {
    for (_, layer) in layers(source.dir()) {
        let base = hv.layer_base(&layer)?;
        if let Some(base) = base.filter(|b| !b.exists()) {
            return Err(SandboxError::Unbranchable {
                id: source.id().to_owned(),
                detail: format!(
                    "its disk builds on {}, which a branch that was not written left missing; fork a new sandbox to branch from",
                    base.display()
                ),
            });
        }
    }
    Ok(())
}

/// After an interrupted branch: removes the layers above `top` (the one the VM writes
/// to), made for a capture that never moved the VM onto them.
pub fn remove_unused_layers(sandbox_dir: &Path, top: &Path) {
    let Some(top_n) = layers(sandbox_dir)
        .into_iter()
        .find(|(_, p)| p == top)
        .map(|(n, _)| n)
    else {
        return;
    };
    for (n, p) in layers(sandbox_dir) {
        if n > top_n {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A new file name for the source's next top layer: `root.N.qcow2`, N one more than any
/// layer its directory holds.
fn next_layer_path(dir: &Path) -> PathBuf {
    let highest = layers(dir).into_iter().map(|(n, _)| n).max().unwrap_or(0);
    dir.join(format!("root.{}.qcow2", highest + 1))
}
