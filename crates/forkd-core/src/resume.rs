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
use crate::pause::{self, PauseRecord};
use crate::sandbox::{DirGuard, Launch, Sandbox, SandboxOptions};
use forkd_hypervisor::{Hypervisor, MemoryBackend, VmConfig};
use forkd_storage::snapshot::memory_diff;
use std::time::{Duration, Instant};

/// A sandbox that runs again.
pub struct Resumed {
    /// The sandbox.
    pub sandbox: Sandbox,
    /// Its image.
    pub record: PauseRecord,
    /// From the start until the agent answered.
    pub total: Duration,
}

/// Restores the paused sandbox whose VM was `config` from its pause image.
pub async fn resume(
    hv: &dyn Hypervisor,
    config: &VmConfig,
    opts: &SandboxOptions,
) -> Result<Resumed, SandboxError> {
    let t0 = Instant::now();
    let id = config.id.clone();
    let damaged = |detail: String| SandboxError::PauseImage {
        id: id.clone(),
        detail,
    };
    let record =
        pause::read_record(&config.dir)?.ok_or_else(|| damaged("it has no pause image".into()))?;
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
    // The diff's digest is taken on another thread while its pages are written.
    let hashing = {
        let diff = diff.clone();
        tokio::task::spawn_blocking(move || memory_diff::sha256_sparse(&diff))
    };
    let prepared = hv.prepare_restore(&config, &state).await?;
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
    if let Err(e) = written.await {
        prepared.discard().await;
        return Err(e);
    }
    forkd_host::failpoint::hit("resume.after_memory");
    let vm = prepared.finish().await?;
    // From here the guest has run: it may have written to its disk, which its image no
    // longer matches. A resume that fails now must not leave it to be resumed again
    // from that image: it is failed, its files kept.
    let sandbox = Sandbox::launch(hv, config, Launch::Resumed { vm }, opts, guard)
        .await
        .map_err(|e| {
            damaged(format!(
                "its VM started but did not come up ({e}); its disk may have moved past its image"
            ))
        })?;
    Ok(Resumed {
        sandbox,
        record,
        total: t0.elapsed(),
    })
}
