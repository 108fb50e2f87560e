//! One daemon per data directory. The daemon holds an exclusive `flock` on
//! `daemon.lock` in its data directory for as long as it runs; the file names the holder
//! (pid, socket), so that a second daemon refuses to start with a message saying who owns
//! the directory, and `forkd quickstart` finds the running daemon instead of starting
//! another.
//!
//! Why a lock and not the socket: a second daemon on another `--socket` answers its own
//! socket fine, but it cannot reach the QMP sockets the first one holds, and used to take
//! every running sandbox for dead. The kernel drops a `flock` when its holder dies however
//! it dies, so a `kill -9` never leaves a stale lock behind.
//!
//! The lock that decides is on the data directory itself (a `flock` of the directory):
//! a lock on a file alone is sidestepped by moving the file away, after which a second
//! daemon makes a new one and locks that. The directory cannot be swapped under a
//! daemon that holds it open. The file only says who the owner is.

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The lock file's name inside the data directory.
pub const LOCK_FILE: &str = "daemon.lock";

/// Who owns a data directory, as its lock file says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// The daemon's pid.
    pub pid: u32,
    /// The unix socket it serves on.
    pub socket: PathBuf,
}

/// Why the data directory could not be owned.
#[derive(Debug, thiserror::Error)]
pub enum OwnerError {
    /// Another daemon holds the lock.
    #[error("another forkd daemon (pid {}, socket {}) owns the data directory {}; stop it first, talk to it (FORKD_URL=unix:{}), or give this one another FORKD_HOME", owner.pid, owner.socket.display(), dir.display(), owner.socket.display())]
    Taken {
        /// The data directory.
        dir: PathBuf,
        /// Its owner.
        owner: Owner,
    },
    /// Another daemon holds the lock and has not written its name yet.
    #[error("another forkd daemon is starting on the data directory {}; stop it first or give this one another FORKD_HOME", dir.display())]
    Starting {
        /// The data directory.
        dir: PathBuf,
    },
    /// The lock file could not be opened, locked or written.
    #[error("locking the data directory ({}): {source}", path.display())]
    Io {
        /// The lock file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// The held lock: the data directory is this daemon's until it is dropped (or the
/// process ends).
pub struct OwnerLock {
    _dir: Flock<File>,
    _lock: Flock<File>,
}

impl std::fmt::Debug for OwnerLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OwnerLock")
    }
}

impl OwnerLock {
    /// Takes the data directory `dir` for a daemon serving on `socket`, or says who has it.
    pub fn acquire(dir: &Path, socket: &Path) -> Result<OwnerLock, OwnerError> {
        let path = dir.join(LOCK_FILE);
        let io = |source| OwnerError::Io {
            path: path.clone(),
            source,
        };
        let taken = || match read_owner(&path) {
            Some(owner) => OwnerError::Taken {
                dir: dir.to_owned(),
                owner,
            },
            None => OwnerError::Starting {
                dir: dir.to_owned(),
            },
        };
        let dir_lock = match Flock::lock(
            File::open(dir).map_err(io)?,
            FlockArg::LockExclusiveNonblock,
        ) {
            Ok(l) => l,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Err(taken()),
            Err((_, e)) => return Err(io(e.into())),
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(l) => l,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Err(taken()),
            Err((_, e)) => return Err(io(e.into())),
        };
        let me = Owner {
            pid: std::process::id(),
            socket: std::path::absolute(socket).unwrap_or_else(|_| socket.to_owned()),
        };
        let json = serde_json::to_vec(&me).map_err(|e| io(e.into()))?;
        lock.set_len(0).map_err(io)?;
        lock.rewind().map_err(io)?;
        lock.write_all(&json).map_err(io)?;
        lock.sync_all().map_err(io)?;
        Ok(OwnerLock {
            _dir: dir_lock,
            _lock: lock,
        })
    }
}

/// The daemon that owns the data directory `dir` now, if one does (its lock is held).
pub fn current_owner(dir: &Path) -> Option<Owner> {
    let file = File::open(dir).ok()?;
    match Flock::lock(file, FlockArg::LockSharedNonblock) {
        // We got it: nobody holds the exclusive lock, so nobody owns the directory.
        Ok(_) => None,
        Err(_) => read_owner(&dir.join(LOCK_FILE)),
    }
}

/// The owner a lock file names. Small and written by forkd, but read with a bound all
/// the same.
fn read_owner(path: &Path) -> Option<Owner> {
    let mut buf = Vec::new();
    File::open(path)
        .ok()?
        .take(4096)
        .read_to_end(&mut buf)
        .ok()?;
    serde_json::from_slice(&buf).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_owner_is_refused_and_named() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(current_owner(dir.path()), None);
        let first = OwnerLock::acquire(dir.path(), Path::new("/run/a.sock")).unwrap();
        let owner = current_owner(dir.path()).unwrap();
        assert_eq!(owner.pid, std::process::id());
        assert_eq!(owner.socket, Path::new("/run/a.sock"));
        // flock locks belong to the open file description: a second open in this very
        // process conflicts just as another process would.
        let e = OwnerLock::acquire(dir.path(), Path::new("/run/b.sock")).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        assert!(msg.contains("/run/a.sock"), "{msg}");
        // Moving the lock file away sidesteps nothing: the directory itself is locked.
        std::fs::rename(dir.path().join(LOCK_FILE), dir.path().join("moved")).unwrap();
        let e = OwnerLock::acquire(dir.path(), Path::new("/run/b.sock")).unwrap_err();
        assert!(matches!(e, OwnerError::Starting { .. }), "{e}");
        drop(first);
        assert_eq!(current_owner(dir.path()), None);
        let _second = OwnerLock::acquire(dir.path(), Path::new("/run/b.sock")).unwrap();
        assert_eq!(
            current_owner(dir.path()).unwrap().socket,
            Path::new("/run/b.sock")
        );
    }
}
