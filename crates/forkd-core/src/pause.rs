//! PAUSE to disk: a running sandbox written under its own directory, its VM ended.
//!
//! A pause is a live branch whose source then stops for good (see [`crate::branch`] and
//! `forkd_hypervisor::Vm::branch`): the memory is copied while the guest runs, the guest
//! stops only for the last pass and the device state, and the source's vCPUs are never
//! started again. What is kept, in `<sandbox dir>/paused/`:
//! - `memory.diff`: the pages of the guest's RAM that differ from the RAM file the
//!   sandbox maps privately (its snapshot's image). The full image the copy produced is
//!   removed once the diff is written: a paused sandbox stores what it changed, not its
//!   whole memory.
//! - `state`: the device state, without RAM.
//! - `pause.json`: what the image is made against and the digests of the two files,
//!   written last: a directory without it is an unfinished pause.
//!
//! The disk is not copied: the VM's top disk layer is frozen as it is, in place, and the
//! resumed VM writes to it again. So a sandbox paused and resumed any number of times
//! keeps one memory diff (always against the same RAM file) and one disk chain: nothing
//! grows with the number of pauses.
//!
//! A pause that fails before the image is complete leaves the sandbox running, its VM
//! started again, and no image.

use crate::error::SandboxError;
use crate::sandbox::{new_sandbox_dir, Sandbox};
use forkd_hypervisor::{BranchMode, BranchPlan, DiskFormat, DiskLayer, Hypervisor, MemoryBackend};
use forkd_image::Home;
use forkd_storage::snapshot::memory_diff;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The pause image's directory in a sandbox's directory.
pub const IMAGE_DIR: &str = "paused";
/// Where a pause writes before the image is complete.
const PARTIAL_DIR: &str = "paused.partial";
/// The record, written last.
const RECORD: &str = "pause.json";
/// The device state.
pub(crate) const STATE: &str = "state";
/// The pages that differ from the RAM file.
pub(crate) const MEMORY_DIFF: &str = "memory.diff";
/// The full RAM image the copy writes (removed once diffed).
const COPIED_RAM: &str = "memory.ram";
/// The record's format.
pub(crate) const FORMAT: u32 = 1;

/// What a pause image is, as `pause.json` records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PauseRecord {
    /// The record's format.
    pub format: u32,
    /// When the pause was written (RFC 3339).
    pub paused_at: String,
    /// The RAM file the VM maps privately: the image holds the pages that differ from it.
    pub memory_base: PathBuf,
    /// Its size (the guest's RAM).
    pub memory_size: u64,
    /// sha256 of `memory.diff`.
    pub memory_sha256: String,
    /// sha256 of `state`.
    pub state_sha256: String,
    /// The top layer of the VM's disk, frozen at the pause, written again after it.
    pub disk_top: PathBuf,
    /// How the memory was copied.
    pub mode: BranchMode,
    /// How long the guest was stopped before its image was complete, ms.
    pub stall_ms: f64,
    /// Bytes of the migration stream.
    pub transferred: u64,
    /// Pages that differ from the RAM file.
    pub pages: u64,
    /// Size of `memory.diff`.
    pub diff_bytes: u64,
    /// Size of `state`.
    pub state_bytes: u64,
    /// Seconds that were left of the sandbox's timeout, if it had one (its clock stops
    /// while it is paused).
    #[serde(default)]
    pub timeout_left_s: Option<u64>,
    /// What the image keeps: the whole machine, or (E2B's `mode="filesystem"`) its disk
    /// only, which a resume boots afresh. Images of format 1 without it kept memory.
    #[serde(default, skip_serializing_if = "PauseKeeps::is_memory")]
    pub keeps: PauseKeeps,
}

/// What a pause keeps of a sandbox.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseKeeps {
    /// Its memory, device state and disk: a resume continues the same machine.
    #[default]
    Memory,
    /// Its disk only (flushed by the guest first): a resume boots it from that disk, so
    /// its processes and memory are gone and its files are kept.
    Disk,
}

impl PauseKeeps {
    /// True for a whole-machine pause.
    pub fn is_memory(&self) -> bool {
        *self == PauseKeeps::Memory
    }
}

impl PauseRecord {
    /// Bytes the image holds on disk.
    pub fn stored_bytes(&self) -> u64 {
        self.diff_bytes + self.state_bytes
    }
}

/// A pause that was written.
#[derive(Debug)]
pub struct Paused {
    /// The image.
    pub record: PauseRecord,
    /// From the start to the VM's end.
    pub total: Duration,
}

/// The pause image's directory of the sandbox in `dir`.
pub fn image_dir(dir: &Path) -> PathBuf {
    dir.join(IMAGE_DIR)
}

/// The pause image of the sandbox in `dir`: None if it has none.
pub fn read_record(dir: &Path) -> Result<Option<PauseRecord>, SandboxError> {
    let path = image_dir(dir).join(RECORD);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(SandboxError::Io {
                context: format!("reading {}", path.display()),
                source,
            })
        }
    };
    let record: PauseRecord = serde_json::from_slice(&bytes).map_err(|e| SandboxError::Io {
        context: format!("reading {}", path.display()),
        source: std::io::Error::other(e),
    })?;
    if record.format != FORMAT {
        return Err(SandboxError::Io {
            context: format!("reading {}", path.display()),
            source: std::io::Error::other(format!(
                "pause image format {} is not {FORMAT}, the one this forkd reads",
                record.format
            )),
        });
    }
    Ok(Some(record))
}

/// Removes the pause image of the sandbox in `dir`, once its resume is recorded.
pub fn discard_image(dir: &Path) {
    let _ = std::fs::remove_dir_all(image_dir(dir));
}

/// Removes what an interrupted pause wrote in `dir` (the image is not complete).
pub fn discard_partial(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir.join(PARTIAL_DIR));
}

/// Writes the pause image of the sandbox in `dir`: `fill` puts its files in the partial
/// directory it is given, then `record` is written and the image takes its final name.
/// An image left half written is the partial directory, never taken for an image.
pub(crate) fn publish_image(
    dir: &Path,
    record: &PauseRecord,
    fill: impl FnOnce(&Path) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let partial = dir.join(PARTIAL_DIR);
    let published = serde_json::to_vec_pretty(record)
        .map_err(std::io::Error::other)
        .and_then(|json| {
            std::fs::create_dir(&partial)?;
            fill(&partial)?;
            forkd_host::atomic_file::write(&partial.join(RECORD), &json)?;
            std::fs::rename(&partial, image_dir(dir))?;
            std::fs::File::open(dir)?.sync_all()
        });
    if published.is_err() {
        discard_partial(dir);
    }
    published
}

/// Writes the running `sandbox` to disk and ends its VM. `timeout_left_s` is kept in
/// the record. `progress` hears each step.
pub async fn pause(
    hv: &dyn Hypervisor,
    home: &Home,
    sandbox: &Sandbox,
    timeout_left_s: Option<u64>,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Paused, SandboxError> {
    let t0 = Instant::now();
    let id = sandbox.id().to_owned();
    let config = sandbox.config();
    let MemoryBackend::File {
        path: memory_base,
        shared: false,
    } = &config.memory
    else {
        return Err(SandboxError::Unbranchable {
            id,
            detail: "only a sandbox restored from a snapshot can be paused (its RAM is not a snapshot's image)".into(),
        });
    };
    let mode = match sandbox.can_branch(BranchMode::Live) {
        Ok(()) => BranchMode::Live,
        Err(why) => {
            tracing::info!(%id, "paused with its vCPUs stopped for the whole copy: {why}");
            BranchMode::Pause
        }
    };
    let memory_size = u64::from(config.memory_mib) << 20;
    // The copied RAM (sparse, at most the guest's RAM) until it is diffed, and the diff.
    forkd_host::space::ensure_room(
        sandbox.dir(),
        memory_size * 2 + (64 << 20),
        &format!("pausing sandbox {id}"),
    )?;
    // An image a resume did not get to remove (its daemon died after recording the
    // sandbox running) is older than the sandbox's disk: it must never be taken for
    // this pause's.
    discard_image(sandbox.dir());
    discard_partial(sandbox.dir());
    let partial = sandbox.dir().join(PARTIAL_DIR);
    std::fs::create_dir(&partial).map_err(|source| SandboxError::Io {
        context: format!("creating {}", partial.display()),
        source,
    })?;
    let written = write_image(
        hv,
        home,
        sandbox,
        &partial,
        memory_base,
        memory_size,
        mode,
        timeout_left_s,
        progress,
    )
    .await;
    let record = match written {
        Ok(r) => r,
        Err(e) => {
            discard_partial(sandbox.dir());
            // A VM left stopped after its capture runs again: the sandbox was not paused.
            if let Err(again) = sandbox.vm().resume().await {
                tracing::warn!(%id, "starting the VM again after a failed pause: {again}");
            }
            return Err(e);
        }
    };
    progress(&format!("{id} is written; ending its VM"));
    // The image is complete once it has its final name: from here the sandbox is paused
    // whatever happens to its VM.
    let image = image_dir(sandbox.dir());
    let _ = std::fs::remove_dir_all(&image);
    std::fs::rename(&partial, &image)
        .and_then(|()| std::fs::File::open(sandbox.dir())?.sync_all())
        .map_err(|source| SandboxError::Io {
            context: format!("publishing {}", image.display()),
            source,
        })?;
    forkd_host::failpoint::hit("pause.after_image");
    if let Err(e) = sandbox.end_paused().await {
        // Paused all the same: the image is complete. Its QEMU must not run on.
        tracing::warn!(id = %sandbox.id(), "ending the paused VM: {e}; killing it");
        sandbox.vm().kill();
    }
    Ok(Paused {
        record,
        total: t0.elapsed(),
    })
}

/// Pauses the running `sandbox` keeping its disk only: the guest flushes its
/// filesystems, its vCPUs stop, the record is written and its VM ends. A resume boots
/// it from that disk ([`crate::resume`]). A pause that fails before the record is
/// written leaves the sandbox running.
pub async fn pause_disk(
    sandbox: &Sandbox,
    timeout_left_s: Option<u64>,
) -> Result<Paused, SandboxError> {
    let t0 = Instant::now();
    let id = sandbox.id().to_owned();
    let config = sandbox.config();
    discard_image(sandbox.dir());
    discard_partial(sandbox.dir());
    sandbox.call(|a| async move { a.sync().await }).await?;
    sandbox.vm().pause().await?;
    let record = PauseRecord {
        format: FORMAT,
        paused_at: forkd_image::timestamp::rfc3339_utc(std::time::SystemTime::now()),
        memory_base: match &config.memory {
            MemoryBackend::File { path, .. } => path.clone(),
            MemoryBackend::Anonymous => PathBuf::new(),
        },
        memory_size: u64::from(config.memory_mib) << 20,
        memory_sha256: String::new(),
        state_sha256: String::new(),
        disk_top: config.root_disk.clone(),
        mode: BranchMode::Pause,
        stall_ms: 0.0,
        transferred: 0,
        pages: 0,
        diff_bytes: 0,
        state_bytes: 0,
        timeout_left_s,
        keeps: PauseKeeps::Disk,
    };
    let image = image_dir(sandbox.dir());
    let published = publish_image(sandbox.dir(), &record, |_| Ok(()));
    if let Err(source) = published {
        discard_partial(sandbox.dir());
        if let Err(again) = sandbox.vm().resume().await {
            tracing::warn!(%id, "starting the VM again after a failed pause: {again}");
        }
        return Err(SandboxError::Io {
            context: format!("writing {}", image.display()),
            source,
        });
    }
    forkd_host::failpoint::hit("pause.after_image");
    // QEMU quits, writing back what its disk layer caches.
    if let Err(e) = sandbox.end_paused().await {
        tracing::warn!(%id, "ending the paused VM: {e}; killing it");
        sandbox.vm().kill();
    }
    Ok(Paused {
        record,
        total: t0.elapsed(),
    })
}

/// Captures the VM into `partial` (its vCPUs stay stopped on success) and writes the
/// record there.
#[allow(clippy::too_many_arguments)]
async fn write_image(
    hv: &dyn Hypervisor,
    home: &Home,
    sandbox: &Sandbox,
    partial: &Path,
    memory_base: &Path,
    memory_size: u64,
    mode: BranchMode,
    timeout_left_s: Option<u64>,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<PauseRecord, SandboxError> {
    let id = sandbox.id();
    // The receiver: the sandbox's machine with its own runtime directory, a throwaway
    // disk and, as RAM, a fresh shared file the copy fills.
    let (rid, rdir, _rguard) = new_sandbox_dir(home)?;
    let mut receiver = sandbox.config().clone();
    receiver.id = rid;
    receiver.root_disk = rdir.join("root.qcow2");
    receiver.dir = rdir;
    receiver.memory = MemoryBackend::File {
        path: partial.join(COPIED_RAM),
        shared: true,
    };
    receiver.detached = false;
    hv.create_disk_layer(DiskLayer {
        path: &receiver.root_disk,
        base: &sandbox.config().root_disk,
        base_format: DiskFormat::Layer,
        relative: false,
        named: None,
    })
    .await?;
    let plan = BranchPlan {
        receiver,
        state: partial.join(STATE),
        next_layer: None,
        at_instant: Some(|| forkd_host::failpoint::hit("pause.at_instant")),
    };
    progress(&format!("copying {id}'s memory ({mode})"));
    let stats = sandbox.branch_vm(mode, &plan).await?;
    progress(&format!(
        "{id} stopped after a {:.1} ms switch-over; diffing its memory",
        stats.pause.as_secs_f64() * 1000.0
    ));
    let copied = partial.join(COPIED_RAM);
    let diff_path = partial.join(MEMORY_DIFF);
    let base = memory_base.to_owned();
    let (diff, memory_sha256) = tokio::task::spawn_blocking(move || {
        let diffed = memory_diff::write_diff(&base, &copied, &diff_path);
        let _ = std::fs::remove_file(&copied);
        let (stats, _) = diffed?;
        let sha = memory_diff::sha256_sparse(&diff_path)?;
        Ok::<_, std::io::Error>((stats, sha))
    })
    .await
    .map_err(|e| SandboxError::Io {
        context: "diffing the memory".into(),
        source: std::io::Error::other(e.to_string()),
    })?
    .map_err(|source| SandboxError::Io {
        context: format!("diffing {id}'s memory against {}", memory_base.display()),
        source,
    })?;
    let (state_sha256, state_bytes) = forkd_storage::snapshot::sha256_file(&partial.join(STATE))?;
    let record = PauseRecord {
        format: FORMAT,
        paused_at: forkd_image::timestamp::rfc3339_utc(std::time::SystemTime::now()),
        memory_base: memory_base.to_owned(),
        memory_size,
        memory_sha256,
        state_sha256,
        disk_top: stats.frozen_layer.clone(),
        mode,
        stall_ms: stats.pause.as_secs_f64() * 1000.0,
        transferred: stats.transferred,
        pages: diff.pages,
        diff_bytes: diff.bytes,
        state_bytes,
        timeout_left_s,
        keeps: PauseKeeps::Memory,
    };
    let json = serde_json::to_vec_pretty(&record).map_err(|e| SandboxError::Io {
        context: "writing the pause record".into(),
        source: std::io::Error::other(e),
    })?;
    forkd_host::atomic_file::write(&partial.join(RECORD), &json).map_err(|source| {
        SandboxError::Io {
            context: format!("writing {}", partial.join(RECORD).display()),
            source,
        }
    })?;
    // The diff is synced by its writer; the state by the save.
    Ok(record)
}
