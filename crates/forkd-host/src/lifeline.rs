//! A lifeline: binds a process that changes user to the life of the process that
//! starts it.
//!
//! A VM that belongs to the process starting it (a template's parent, a build VM,
//! `forkd run`, a branch's receiver) must die with that process, even when it is killed
//! outright. The parent-death signal does that for a QEMU running as forkd's user, but
//! the kernel clears it when a process changes its credentials, which a jailed QEMU does
//! once it has opened what it needs (`-run-with user=`). So a jailed QEMU of that kind is
//! started in a PID namespace of its own, whose first process (its init) does nothing
//! but wait for end-of-file on a pipe whose write end only this process holds. However
//! this process ends, the kernel closes that end; the init returns, and the kernel kills
//! every other process of the namespace: the QEMU. No signal, user or thread is
//! involved, so nothing the QEMU does can undo it.

use nix::sched::CloneFlags;
use nix::unistd::Pid;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

/// One PID namespace whose processes live as long as this handle (or this process).
pub struct Lifeline {
    /// The namespace's init, our child.
    init: Pid,
    /// The pipe's write end: the init returns when the last copy is closed.
    _held: OwnedFd,
    /// The namespace, for setns(2).
    namespace: std::fs::File,
}

impl Lifeline {
    /// Makes the namespace and its init. Needs CAP_SYS_ADMIN.
    pub fn new() -> std::io::Result<Lifeline> {
        // Close-on-exec: no process this one starts keeps the write end open.
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let read_fd = read.as_raw_fd();
        let mut stack = vec![0_u8; 64 * 1024];
        // SAFETY: the child runs `init` on `stack`, in a copy of this process's memory
        // (no CLONE_VM), and calls only async-signal-safe system calls before it exits.
        let init = unsafe {
            nix::sched::clone(
                Box::new(move || init(read_fd)),
                &mut stack,
                CloneFlags::CLONE_NEWPID,
                Some(libc::SIGCHLD),
            )
        }?;
        drop(read);
        match std::fs::File::open(format!("/proc/{init}/ns/pid")) {
            Ok(namespace) => Ok(Lifeline {
                init,
                _held: write,
                namespace,
            }),
            Err(e) => {
                end(init);
                Err(e)
            }
        }
    }

    /// Spawns `cmd` as a process of the namespace (its second), from a thread of its own:
    /// setns(2) moves only the calling thread's future children.
    pub fn spawn(
        &self,
        cmd: &mut tokio::process::Command,
    ) -> std::io::Result<tokio::process::Child> {
        let runtime = tokio::runtime::Handle::current();
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    // The child registers with the runtime for its exit.
                    let _entered = runtime.enter();
                    nix::sched::setns(&self.namespace, CloneFlags::CLONE_NEWPID)?;
                    cmd.spawn()
                })
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the spawning thread panicked")))
        })
    }
}

/// Why this process cannot make lifelines, if it cannot (a root without CAP_SYS_ADMIN,
/// as in a container): found out once, by making one.
pub fn unavailable() -> Option<String> {
    static WHY: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    WHY.get_or_init(|| {
        Lifeline::new()
            .err()
            .map(|e| format!("a PID namespace cannot be made here ({e})"))
    })
    .clone()
}

impl Drop for Lifeline {
    fn drop(&mut self) {
        end(self.init);
    }
}

/// Kills the init `init`, and with it whatever is left in its namespace, and reaps it.
/// The init's exit waits until every process of its namespace has been reaped, by
/// whoever is its parent (this process, for a QEMU): so it is reaped on a thread of its
/// own, never by a caller that may have such a process still to reap.
fn end(init: Pid) {
    let _ = nix::sys::signal::kill(init, nix::sys::signal::Signal::SIGKILL);
    let reaper = std::thread::Builder::new().name("lifeline-reaper".into());
    // Without a thread (none left to make) the init stays a zombie: nothing else is lost.
    let _ = reaper.spawn(move || nix::sys::wait::waitpid(init, None));
}

/// The init: keeps nothing of this process's descriptors but the pipe's read end, and
/// waits until the pipe's writer is gone.
fn init(read: RawFd) -> isize {
    // SAFETY: close_range(2), read(2) and _exit(2) take plain numbers and a buffer on
    // this stack; all are async-signal-safe.
    unsafe {
        if read > 0 {
            libc::syscall(libc::SYS_close_range, 0, read - 1, 0);
        }
        libc::syscall(libc::SYS_close_range, read + 1, u32::MAX, 0);
        let mut byte = 0_u8;
        loop {
            let n = libc::read(read, (&mut byte as *mut u8).cast(), 1);
            if n == 0 || (n < 0 && nix::errno::Errno::last() != nix::errno::Errno::EINTR) {
                break;
            }
        }
        libc::_exit(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process of the namespace dies when the lifeline goes.
    #[tokio::test]
    async fn the_namespaces_processes_die_with_the_lifeline() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: making a PID namespace needs root");
            return;
        }
        let lifeline = Lifeline::new().unwrap();
        let mut cmd = tokio::process::Command::new("sleep");
        cmd.arg("600");
        let mut child = lifeline.spawn(&mut cmd).unwrap();
        let pid = child.id().unwrap();
        // It is in the namespace, not in ours.
        let ours = std::fs::read_link("/proc/self/ns/pid").unwrap();
        let its = std::fs::read_link(format!("/proc/{pid}/ns/pid")).unwrap();
        assert_ne!(ours, its);
        assert!(child.try_wait().unwrap().is_none());
        drop(lifeline);
        let status = tokio::time::timeout(std::time::Duration::from_secs(10), child.wait())
            .await
            .expect("the process outlived its lifeline")
            .unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }
}
