//! RESUME: a paused sandbox's VM restored in place from its pause image (see
//! [`crate::pause`]), under the same id, directory, disk and network policy.
//!
//! The VM maps the same RAM file privately as before the pause, so every page it had not
//! changed is shared again with the file and with the other sandboxes mapping it; the
//! pages of `memory.diff` are written into its RAM before its vCPUs first run (see
//! `forkd_hypervisor::PreparedVm::ram_writer`). Then the device state is loaded and the
//! vCPUs start. The agent gets only the host's clock: it is the same machine
//! continuing, so its RNG, hostname, variables, processes and contexts are its own.
//!
//! The pause image is checked against the digests its record holds while it is read; a
//! damaged image is refused and kept, as is every file of the sandbox. The image is
//! removed by the caller once the resume is recorded ([`crate::pause::discard_image`]).

use crate::error::SandboxError;
use crate::pause::{self, PauseKeeps, PauseRecord};
use crate::sandbox::{DirGuard, Launch, Sandbox, SandboxOptions};
use forkd_hypervisor::{Hypervisor, MemoryBackend, PreparedVm, VmConfig};
use forkd_storage::snapshot::memory_diff;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{Duration, Instant};

/// Written into the pause image just before the resumed VM's vCPUs first run. From then
/// on its guest may write to its disk, so the image alone is no longer the sandbox: a
/// daemon stopped before the resume was recorded finds here the VM to take over (see
/// [`read_started`]).
pub const STARTED: &str = "started.json";

/// The resumed VM whose vCPUs were started, as [`STARTED`] records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Started {
    /// Its QEMU's pid.
    pub pid: u32,
    /// Its QEMU's start time (with the pid, it names the process).
    pub start_time: u64,
    /// What the VM runs with (its disk layer, RAM file, network).
    pub config: VmConfig,
}

/// The resumed VM recorded as started in the pause image of the sandbox in `dir`, if
/// any: its guest has run since the image was written.
pub fn read_started(dir: &Path) -> Option<Started> {
    let bytes = std::fs::read(pause::image_dir(dir).join(STARTED)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

fn write_started(image: &Path, vm: &dyn PreparedVm, config: &VmConfig) -> Result<(), SandboxError> {
    let gone = || SandboxError::Gone {
        id: config.id.clone(),
    };
    let started = Started {
        pid: vm.pid().ok_or_else(gone)?,
        start_time: vm.start_time().ok_or_else(gone)?,
        config: config.clone(),
    };
    let bytes = serde_json::to_vec(&started).map_err(|e| SandboxError::Io {
        context: "recording the resumed VM".into(),
        source: std::io::Error::other(e),
    })?;
    forkd_host::atomic_file::write(&image.join(STARTED), &bytes).map_err(|source| {
        SandboxError::Io {
            context: format!("recording the resumed VM in {}", image.display()),
            source,
        }
    })
}

/// A sandbox that runs again.
pub struct Resumed {
    /// The sandbox.
    pub sandbox: Sandbox,
    /// Its image.
    pub record: PauseRecord,
    /// From the start until the agent answered.
    pub total: Duration,
}

/// How a paused sandbox runs again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ResumeHow {
    /// As its image allows: the same machine continuing if its memory was kept, else
    /// booted from its disk.
    #[default]
    Restore,
    /// Booted from its disk whatever its image kept (E2B's `on_resume="reboot"`, for a
    /// guest that would not answer as it was).
    Reboot,
}

/// Restores the paused sandbox whose VM was `config` from its pause image.
pub async fn resume(
    hv: &dyn Hypervisor,
    config: &VmConfig,
    opts: &SandboxOptions,
    how: ResumeHow,
) -> Result<Resumed, SandboxError> {
    let t0 = Instant::now();
    let id = config.id.clone();
    let damaged = |detail: String| SandboxError::PauseImage {
        id: id.clone(),
        detail,
    };
    let record =
        pause::read_record(&config.dir)?.ok_or_else(|| damaged("it has no pause image".into()))?;
    if record.keeps == PauseKeeps::Disk || how == ResumeHow::Reboot {
        return reboot(hv, config, opts, record, t0).await;
    }
    let image = pause::image_dir(&config.dir);
    // The RAM file must be the one the image was diffed against.
    let base_size = std::fs::metadata(&record.memory_base)
        .map_err(|e| damaged(format!("{}: {e}", record.memory_base.display())))?
        .len();
    if base_size != record.memory_size {
        return Err(damaged(format!(
            "its RAM file {} is {base_size} bytes, not the {} it was paused against",
            record.memory_base.display(),
            record.memory_size
        )));
    }
    if !record.disk_top.exists() {
        return Err(damaged(format!(
            "its disk layer {} is missing",
            record.disk_top.display()
        )));
    }
    let state = image.join(pause::STATE);
    let (state_sha, _) = forkd_storage::snapshot::sha256_file(&state)
        .map_err(|e| damaged(format!("its device state: {e}")))?;
    if state_sha != record.state_sha256 {
        return Err(damaged(format!(
            "its device state does not match its digest (sha256 {state_sha}, recorded {})",
            record.state_sha256
        )));
    }
    let mut config = config.clone();
    config.root_disk = record.disk_top.clone();
    config.memory = MemoryBackend::File {
        path: record.memory_base.clone(),
        shared: false,
    };
    config.detached = true;
    let guard = DirGuard::keep(&config.dir)?;

    let diff = image.join(pause::MEMORY_DIFF);
    // The diff's digest is taken on another thread from now, while QEMU starts and the
    // pages are written: writing them (a copy-on-write fault each) takes longer than
    // hashing them, so the digest is ready by the time they are in.
    let hashing = {
        let diff = diff.clone();
        tokio::task::spawn_blocking(move || memory_diff::sha256_sparse(&diff))
    };
    let checked = t0.elapsed();
    let prepared = hv.prepare_restore(&config, &state).await?;
    let qemu_up = t0.elapsed();
    let written = async {
        let mut ram = prepared.ram_writer()?;
        let size = record.memory_size;
        let joined = |e: tokio::task::JoinError| SandboxError::Io {
            context: "writing the memory".into(),
            source: std::io::Error::other(e.to_string()),
        };
        tokio::task::spawn_blocking(move || {
            memory_diff::apply(&diff, size, &mut |at, pages| ram.write_at(at, pages))
        })
        .await
        .map_err(joined)?
        .map_err(|e| damaged(format!("its memory: {e}")))?;
        let sha = hashing
            .await
            .map_err(joined)?
            .map_err(|e| damaged(format!("its memory: {e}")))?;
        if sha != record.memory_sha256 {
            return Err(damaged(format!(
                "its memory does not match its digest (sha256 {sha}, recorded {})",
                record.memory_sha256
            )));
        }
        Ok::<_, SandboxError>(())
    };
    let written = written.await;
    let memory = t0.elapsed();
    if let Err(e) = written {
        prepared.discard().await;
        return Err(e);
    }
    forkd_host::failpoint::hit("resume.after_memory");
    if let Err(e) = write_started(&image, prepared.as_ref(), &config) {
        prepared.discard().await;
        return Err(e);
    }
    let vm = match prepared.finish().await {
        Ok(vm) => vm,
        Err(e) => {
            // Its vCPUs never ran: the image is still the whole sandbox.
            let _ = std::fs::remove_file(image.join(STARTED));
            return Err(e.into());
        }
    };
    // From here the guest has run: it may have written to its disk, which its image no
    // longer matches. A resume that fails now must not leave it to be resumed again
    // from that image: it is failed, its files kept.
    let started = t0.elapsed();
    let sandbox = Sandbox::launch(hv, config, Launch::Resumed { vm }, opts, guard)
        .await
        .map_err(|e| {
            damaged(format!(
                "its VM started but did not come up ({e}); its disk may have moved past its image"
            ))
        })?;
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    tracing::info!(
        id = %sandbox.id(),
        pages = record.pages,
        "resumed: image checked at {:.0} ms, QEMU up at {:.0} ms, memory written and verified at {:.0} ms, vCPUs started at {:.0} ms, agent answered at {:.0} ms",
        ms(checked),
        ms(qemu_up),
        ms(memory),
        ms(started),
        ms(t0.elapsed())
    );
    Ok(Resumed {
        sandbox,
        record,
        total: t0.elapsed(),
    })
}

/// Resumes a sandbox paused with its disk only: its VM boots afresh from that disk,
/// under the sandbox's id and network; nothing of its memory is kept.
async fn reboot(
    hv: &dyn Hypervisor,
    config: &VmConfig,
    opts: &SandboxOptions,
    record: PauseRecord,
    t0: Instant,
) -> Result<Resumed, SandboxError> {
    if !record.disk_top.exists() {
        return Err(SandboxError::PauseImage {
            id: config.id.clone(),
            detail: format!("its disk layer {} is missing", record.disk_top.display()),
        });
    }
    let mut config = config.clone();
    config.root_disk = record.disk_top.clone();
    // Its RAM stays the snapshot's image mapped privately: a booting kernel takes no
    // RAM's contents for granted, pages it never touches stay shared, and a later pause
    // of the whole machine diffs against that image as for any child.
    config.detached = true;
    // Its hostname is its own, not its template's builder's.
    config.cmdline = config
        .cmdline
        .split_whitespace()
        .map(|w| match w.split_once('=') {
            Some(("forkd.hostname", _)) => format!("forkd.hostname={}", config.id),
            _ => w.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ");
    let guard = DirGuard::keep(&config.dir)?;
    let sandbox = Sandbox::launch(hv, config, Launch::Boot, opts, guard).await?;
    Ok(Resumed {
        sandbox,
        record,
        total: t0.elapsed(),
    })
}
