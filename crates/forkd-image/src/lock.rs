//! The build lock: one exclusive flock on `<home>/images/.lock` serialises all
//! builds across processes (parallel tests, a CLI next to the daemon).

use std::fs::{File, OpenOptions};
use std::io;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use crate::error::{ImageError, Result};
use crate::fsutil;
use crate::home::Home;
use crate::progress::Progress;

/// Held while building; the lock is released when this is dropped (or the process dies).
pub(crate) struct BuildLock {
    _lock: Flock<File>,
}

impl BuildLock {
    /// Waits for the lock, showing a step while another build holds it, then clears
    /// scratch left in `images/tmp` by builds that crashed: every builder holds this
    /// lock while its scratch exists, so none of it can belong to a live build.
    /// The asset `current` finds, unless `opts.force`; otherwise the build lock, after
    /// checking once more under it (another process may have built the asset while we
    /// waited). The caller builds while holding the returned lock.
    pub(crate) fn reuse_or_acquire(
        home: &Home,
        opts: &crate::BuildOptions,
        current: impl Fn() -> Option<crate::asset::Asset>,
    ) -> Result<std::result::Result<crate::asset::Asset, BuildLock>> {
        if !opts.force {
            if let Some(a) = current() {
                return Ok(Ok(a));
            }
        }
        let lock = BuildLock::acquire(home, &opts.progress)?;
        if !opts.force {
            if let Some(a) = current() {
                return Ok(Ok(a));
            }
        }
        Ok(Err(lock))
    }

    pub(crate) fn acquire(home: &Home, progress: &Progress) -> Result<BuildLock> {
        let path = home.lock_path();
        fsutil::create_dir_all(&home.images_dir())?;
        let open = || {
            OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
        };
        let file = open().map_err(|source| ImageError::Lock {
            path: path.clone(),
            source,
        })?;
        let lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((file, Errno::EWOULDBLOCK)) => {
                let step = progress.step("waiting for another forkd build to finish");
                let lock = Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| {
                    ImageError::Lock {
                        path: path.clone(),
                        source: io::Error::from(e),
                    }
                })?;
                step.finish();
                lock
            }
            Err((_, e)) => {
                return Err(ImageError::Lock {
                    path,
                    source: io::Error::from(e),
                })
            }
        };
        clear_stale_scratch(home);
        Ok(BuildLock { _lock: lock })
    }
}

/// The prefixes of the builders' scratch directories (`ScratchDir`). Only those are
/// swept: whatever else lives in the tmp directory (a test daemon's data directory,
/// kept on the assets' filesystem so that snapshots hard-link them) is not a build's.
const SCRATCH_PREFIXES: [&str; 4] = ["kernel-", "rootfs-", "initramfs-", "oci-"];

fn clear_stale_scratch(home: &Home) {
    let tmp = home.tmp_dir();
    let Ok(entries) = std::fs::read_dir(&tmp) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !SCRATCH_PREFIXES.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        tracing::info!(path = %entry.path().display(), "removing scratch left by an interrupted build");
        let path = entry.path();
        let res = if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            fsutil::remove_tree(&path)
        } else {
            std::fs::remove_file(&path).map_err(|e| ImageError::io("remove", &path, e))
        };
        if let Err(e) = res {
            tracing::warn!("{e}");
        }
    }
}
