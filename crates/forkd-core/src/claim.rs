//! A sandbox directory's claim: an exclusive lock on `<dir>/claim`, taken when the
//! directory is made and held by the process that made the sandbox for as long as it
//! keeps it. A daemon clearing directories nobody owns at its start (its database has
//! no row for them) leaves a claimed one alone: it belongs to a sandbox another process
//! is making or running (`forkd run`, a benchmark). The lock is the kernel's, so a
//! process that dies releases it, and there is no record to go stale.

use crate::error::SandboxError;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// File name of the lock inside a sandbox's directory.
const CLAIM: &str = "claim";

/// Held while this process keeps the sandbox of a directory (see the module's text).
#[derive(Debug)]
pub struct Claim {
    _lock: Flock<File>,
}

fn open(dir: &Path) -> std::io::Result<File> {
    // Opened close-on-exec (the standard library's default): QEMU and other children
    // never inherit the lock, so it lasts exactly as long as this process keeps it.
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(dir.join(CLAIM))
}

/// Claims the sandbox directory `dir` for this process.
pub fn take(dir: &Path) -> Result<Claim, SandboxError> {
    let io = |source| SandboxError::Io {
        context: format!("claiming {}", dir.display()),
        source,
    };
    let file = open(dir).map_err(io)?;
    let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| io(std::io::Error::from(e)))?;
    Ok(Claim { _lock: lock })
}

/// Whether a process holds the claim of the sandbox directory `dir`. A directory
/// without a claim file is nobody's.
pub fn is_claimed(dir: &Path) -> bool {
    let Ok(file) = open(dir) else {
        return false;
    };
    matches!(
        Flock::lock(file, FlockArg::LockExclusiveNonblock),
        Err((_, Errno::EWOULDBLOCK))
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_claim_is_seen_while_it_is_held_and_gone_after() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!super::is_claimed(dir.path()));
        let claim = super::take(dir.path()).unwrap();
        assert!(super::is_claimed(dir.path()));
        assert!(
            super::take(dir.path()).is_err(),
            "a second claim is refused"
        );
        drop(claim);
        assert!(!super::is_claimed(dir.path()));
    }
}
