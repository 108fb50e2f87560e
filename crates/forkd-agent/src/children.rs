//! The set of processes the agent spawned itself.
//!
//! As PID 1 the agent must reap orphans, but `tokio::process` needs to collect the exit
//! status of the agent's own children, so the reaper may never `waitpid(-1)`. Instead
//! every spawn registers its pid here while holding the lock, and the reaper holds the
//! same lock while it scans, so a child that exits at once can never be reaped by the
//! reaper before it is known to be the agent's.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::process::{Child, Command};

/// Pids of live children the agent spawned (and will wait for itself).
#[derive(Debug, Default)]
pub struct Children {
    pids: Mutex<HashSet<u32>>,
}

impl Children {
    /// An empty set.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> MutexGuard<'_, HashSet<u32>> {
        // A poisoned lock only means another thread panicked while holding it; the set
        // itself is always consistent (single inserts and removes).
        self.pids.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Spawns `cmd` and registers the child before anyone else can look.
    pub fn spawn(self: &Arc<Self>, cmd: &mut Command) -> std::io::Result<(Child, Tracked)> {
        let mut pids = self.lock();
        let child = cmd.spawn()?;
        let pid = child.id().unwrap_or(0);
        pids.insert(pid);
        drop(pids);
        Ok((
            child,
            Tracked {
                pid,
                children: Arc::clone(self),
            },
        ))
    }

    /// Runs `f` with the set locked (the reaper's scan).
    pub fn with_locked<R>(&self, f: impl FnOnce(&HashSet<u32>) -> R) -> R {
        f(&self.lock())
    }
}

/// Keeps a child's pid in [`Children`] until dropped: drop it only after the child was
/// waited for (or abandoned: then any reaper may have it).
#[derive(Debug)]
pub struct Tracked {
    pid: u32,
    children: Arc<Children>,
}

impl Tracked {
    /// The child's pid (also its process group id: every child calls `setsid`).
    pub fn pid(&self) -> u32 {
        self.pid
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.children.lock().remove(&self.pid);
    }
}
