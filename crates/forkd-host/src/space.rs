//! Disk space checked before work that writes a lot: a fork or a template build on a
//! data directory without room fails at once with its own error (the API's 507) saying
//! how much is needed, instead of failing half way through with whatever write ran out
//! first, while running sandboxes keep what is left.

use std::path::Path;

/// Not enough disk space for the work asked for; nothing was started.
#[derive(Debug, thiserror::Error)]
#[error("not enough disk space for {what} in {path}: {needed_mib} MiB needed, {available_mib} MiB free; free some space (remove sandboxes or snapshots) or give forkd a bigger FORKD_HOME")]
pub struct NoSpace {
    /// What was asked for.
    pub what: String,
    /// Where it would have been written.
    pub path: String,
    /// What it needs, MiB.
    pub needed_mib: u64,
    /// What is free, MiB.
    pub available_mib: u64,
}

/// Why there is no room for some work, or it could not be told.
#[derive(Debug, thiserror::Error)]
pub enum SpaceError {
    /// Too little room.
    #[error(transparent)]
    NoSpace(#[from] NoSpace),
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
}

/// What each forked child may write on the host before it answers, besides its serial
/// console: its qcow2 layer's metadata and first writes, its logs and its record.
pub const PER_CHILD: u64 = 8 << 20;

/// Room kept free for the state database and the audit log, whatever is asked.
pub const RESERVE: u64 = 4 << 20;

/// Bytes free for an unprivileged writer on the filesystem holding `path` (its nearest
/// existing ancestor).
pub fn available(path: &Path) -> std::io::Result<u64> {
    let existing = path
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or_else(|| Path::new("/"));
    let st = nix::sys::statvfs::statvfs(existing).map_err(std::io::Error::from)?;
    Ok(st.blocks_available().saturating_mul(st.fragment_size()))
}

/// Fails with [`SpaceError::NoSpace`] unless `needed` bytes (plus [`RESERVE`]) are
/// free where `path` lives.
pub fn ensure_room(path: &Path, needed: u64, what: &str) -> Result<(), SpaceError> {
    let available = available(path).map_err(|source| SpaceError::Io {
        context: format!("reading the free space of {}", path.display()),
        source,
    })?;
    if available < needed.saturating_add(RESERVE) {
        return Err(NoSpace {
            what: what.to_owned(),
            path: path.display().to_string(),
            needed_mib: needed.saturating_add(RESERVE).div_ceil(1 << 20),
            available_mib: available / (1 << 20),
        }
        .into());
    }
    Ok(())
}

/// On a tmpfs, allocates every hole of `file` (a snapshot's RAM image). Children map
/// that file privately: on tmpfs the page cache *is* the storage, so the first touch of
/// a hole must take a tmpfs page, and on a full tmpfs the kernel answers with SIGBUS,
/// killing the child's QEMU. Allocated once here, the pages are the snapshot's, and a
/// child's writes land in its own anonymous memory. On other filesystems a hole reads
/// as zeros through the page cache without taking disk space, so nothing is done.
/// Returns whether it allocated.
pub fn fill_holes_on_tmpfs(file: &Path) -> Result<bool, SpaceError> {
    let io = |source| SpaceError::Io {
        context: format!("allocating {} on its tmpfs", file.display()),
        source,
    };
    let fs = nix::sys::statfs::statfs(file).map_err(|e| io(e.into()))?;
    if fs.filesystem_type() != nix::sys::statfs::TMPFS_MAGIC {
        return Ok(false);
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    let len = i64::try_from(len).map_err(|_| io(std::io::Error::other("file too large")))?;
    match nix::fcntl::fallocate(
        std::os::fd::AsRawFd::as_raw_fd(&f),
        nix::fcntl::FallocateFlags::empty(),
        0,
        len,
    ) {
        Ok(()) => Ok(true),
        Err(nix::errno::Errno::ENOSPC) => Err(NoSpace {
            what: format!("the memory image {}", file.display()),
            path: file.display().to_string(),
            needed_mib: len.unsigned_abs().div_ceil(1 << 20),
            available_mib: available(file).unwrap_or(0) / (1 << 20),
        }
        .into()),
        Err(e) => Err(io(e.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asking_for_more_than_the_disk_has_names_both_figures() {
        let dir = tempfile::tempdir().unwrap();
        let free = available(dir.path()).unwrap();
        assert!(free > 0);
        ensure_room(dir.path(), 1, "a test").unwrap();
        // A path that does not exist yet is judged by its nearest existing ancestor.
        ensure_room(&dir.path().join("not/yet"), 1, "a test").unwrap();
        let e = ensure_room(dir.path(), u64::MAX / 2, "forking 3 children").unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, SpaceError::NoSpace(_)), "{msg}");
        assert!(msg.contains("forking 3 children"), "{msg}");
        assert!(
            msg.contains(&format!("{} MiB free", free / (1 << 20))),
            "{msg}"
        );
    }

    #[test]
    fn holes_are_filled_only_on_tmpfs() {
        use std::os::unix::fs::MetadataExt;
        // /dev/shm is a tmpfs on every Linux host forkd runs on.
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let ram = shm.path().join("memory.ram");
        let f = std::fs::File::create(&ram).unwrap();
        f.set_len(4 << 20).unwrap();
        drop(f);
        assert_eq!(std::fs::metadata(&ram).unwrap().blocks(), 0, "sparse");
        assert!(fill_holes_on_tmpfs(&ram).unwrap());
        assert!(std::fs::metadata(&ram).unwrap().blocks() * 512 >= 4 << 20);
        assert_eq!(std::fs::read(&ram).unwrap(), vec![0u8; 4 << 20]);
        let disk = tempfile::tempdir().unwrap();
        let other = disk.path().join("memory.ram");
        std::fs::File::create(&other)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let on_tmpfs = nix::sys::statfs::statfs(disk.path())
            .unwrap()
            .filesystem_type()
            == nix::sys::statfs::TMPFS_MAGIC;
        assert_eq!(fill_holes_on_tmpfs(&other).unwrap(), on_tmpfs);
    }
}
