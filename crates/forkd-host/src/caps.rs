//! The capabilities a QEMU can ever hold. A root process keeps, across exec, what its
//! bounding set allows, so QEMU is started with a bounding set of only what it uses:
//! nothing when it is not jailed (it opens files the daemon owns and descriptors it is
//! handed; seccomp needs no capability), and when jailed, the three that `-run-with
//! user=,chroot=` itself needs (`CAP_SETGID`, `CAP_SETUID`, `CAP_SYS_CHROOT`). Its change
//! of user then clears even those from its permitted and effective sets, and its
//! seccomp filter sets `no_new_privs`, so no later exec gains any. The ambient set is
//! cleared either way.
//!
//! A bounding set can only shrink, and only a process that holds `CAP_SETPCAP` may
//! shrink it: the dropping happens in the child between fork and exec, where it is
//! still forkd's (a forkd that does not run as root has nothing to drop).

/// `CAP_SETGID` (linux/capability.h).
pub const CAP_SETGID: u32 = 6;
/// `CAP_SETUID`.
pub const CAP_SETUID: u32 = 7;
/// `CAP_SYS_CHROOT`.
pub const CAP_SYS_CHROOT: u32 = 18;

/// What a jailed QEMU keeps in its bounding set.
pub const JAILED: &[u32] = &[CAP_SETGID, CAP_SETUID, CAP_SYS_CHROOT];

/// The highest capability this kernel knows (read before fork: `/proc` is not for a
/// child between fork and exec).
fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(63)
}

/// Has the process `cmd` starts run with a bounding set of `keep` only and no ambient
/// capabilities.
pub fn restrict(cmd: &mut tokio::process::Command, keep: &'static [u32]) {
    warn_if_unable();
    let last = last_cap();
    // SAFETY: runs in the forked child before exec and only calls prctl(2), which is
    // async-signal-safe; it touches no memory but its own stack.
    unsafe {
        cmd.pre_exec(move || drop_all_but(keep, last));
    }
}

/// `CAP_SETPCAP`, which shrinking a bounding set takes.
const CAP_SETPCAP: u32 = 8;

/// Says once, in the log, when a root forkd cannot shrink its QEMUs' bounding sets (it
/// was started without `CAP_SETPCAP`, e.g. by a service manager that took it away):
/// its QEMUs then keep whatever bounding set forkd has.
fn warn_if_unable() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let effective = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.starts_with("CapEff:"))?.to_owned();
                u64::from_str_radix(line.split_whitespace().nth(1)?, 16).ok()
            });
        if effective.is_some_and(|e| e & mask(&[CAP_SETPCAP]) == 0) {
            tracing::warn!(
                "forkd runs as root without CAP_SETPCAP: its QEMUs keep its bounding set"
            );
        }
    });
}

fn drop_all_but(keep: &[u32], last: u32) -> std::io::Result<()> {
    let prctl = |op: libc::c_int, arg: libc::c_ulong| {
        // SAFETY: PR_CAP_AMBIENT and PR_CAPBSET_DROP take integer arguments only.
        let r = unsafe { libc::prctl(op, arg, 0 as libc::c_ulong, 0 as libc::c_ulong, 0) };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    match prctl(
        libc::PR_CAP_AMBIENT,
        libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
    ) {
        // EINVAL: a kernel before 4.3, which has no ambient set.
        Err(e) if e.raw_os_error() != Some(libc::EINVAL) => return Err(e),
        _ => {}
    }
    for cap in (0..=last).filter(|c| !keep.contains(c)) {
        match prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap)) {
            Ok(()) => {}
            // Not ours to drop: forkd does not hold CAP_SETPCAP, and so neither can
            // what it starts gain more than it has.
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => return Ok(()),
            // A capability this kernel does not know.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The mask of `caps`, as `/proc/PID/status` prints `CapBnd`.
pub fn mask(caps: &[u32]) -> u64 {
    caps.iter().fold(0, |m, c| m | 1u64 << c)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a thread of its own (a bounding set is per thread, and this one ends).
    #[test]
    fn a_thread_keeps_only_what_it_was_told_to_keep() {
        let status = std::thread::spawn(|| {
            drop_all_but(JAILED, last_cap()).unwrap();
            std::fs::read_to_string("/proc/thread-self/status").unwrap()
        })
        .join()
        .unwrap();
        let field = |name: &str| {
            let line = status.lines().find(|l| l.starts_with(name)).unwrap();
            u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
        };
        assert_eq!(field("CapAmb:"), 0);
        if nix::unistd::geteuid().is_root() {
            assert_eq!(field("CapBnd:"), mask(JAILED), "{status}");
        }
    }
}
