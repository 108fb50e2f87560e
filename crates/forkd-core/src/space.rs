//! Disk space checked before work that writes a lot: a fork or a template build on a
//! data directory without room fails at once with its own error (the API's 507) saying
//! how much is needed, instead of failing half way through with whatever write ran out
//! first, while running sandboxes keep what is left.

use crate::error::SandboxError;
use std::path::Path;

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

/// Fails with [`SandboxError::NoSpace`] unless `needed` bytes (plus [`RESERVE`]) are
/// free where `path` lives.
pub fn ensure_room(path: &Path, needed: u64, what: &str) -> Result<(), SandboxError> {
    let available = available(path).map_err(|source| SandboxError::Io {
        context: format!("reading the free space of {}", path.display()),
        source,
    })?;
    if available < needed.saturating_add(RESERVE) {
        return Err(SandboxError::NoSpace {
            what: what.to_owned(),
            path: path.display().to_string(),
            needed_mib: needed.saturating_add(RESERVE).div_ceil(1 << 20),
            available_mib: available / (1 << 20),
        });
    }
    Ok(())
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
        assert!(matches!(e, SandboxError::NoSpace { .. }), "{msg}");
        assert!(msg.contains("forking 3 children"), "{msg}");
        assert!(
            msg.contains(&format!("{} MiB free", free / (1 << 20))),
            "{msg}"
        );
    }
}
