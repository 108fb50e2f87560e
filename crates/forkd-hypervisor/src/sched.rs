//! How the host's scheduler treats a VM's threads.
//!
//! Under TCG a busy guest keeps its vCPU thread on the host CPU, and a fan-out keeps a
//! hundred of them runnable on a few cores. With the default policy each one is
//! preempted every few milliseconds (on slice expiry and on every other thread's
//! wakeup) and comes back to caches the others have filled: the same work costs more
//! CPU the more children run it. A TCG VM's process therefore starts as `SCHED_BATCH`
//! (its threads' wakeups do not preempt whoever runs) with a 20 ms slice where the
//! kernel takes one (EEVDF's custom slices, Linux 6.12+; older kernels ignore it).
//! All of QEMU's threads inherit both.
//!
//! Measured on a 2-core host, python children from a warm pool, each then running
//! `true` (QEMU's CPU per child for that exec; 10 and 100 children at once; the policy
//! set on the children after the fork):
//!
//! | policy | 10 | 100 |
//! |---|---|---|
//! | default | 0.074 core-s | 0.102 core-s |
//! | `SCHED_BATCH` | 0.063 | 0.088 |
//! | `SCHED_BATCH`, 20 ms slice | 0.057 | 0.075 |
//!
//! Started that way, against the default in interleaved runs: 0.068-0.074 against
//! 0.089-0.096 at 100 children, a fresh fork of 100 with its execs 29.4 s against
//! 33.6 s, idle CPU the same; context switches per child ~360 against ~95 at 100
//! children.
//!
//! The daemon and everything else on the host keep the default policy, so their
//! wakeups may still preempt a VM. The cost: under overload a VM's wakeup (a packet, a timer) can wait for the
//! running VM's slice to end. KVM VMs keep the default: their vCPUs run in the guest,
//! not in translated code, and nothing was measured there.
//! [`SCHED_ENV`]`=normal` keeps the default for TCG too.

/// The environment variable that picks the scheduling of TCG VMs: `batch` (the
/// default) or `normal` (the host's default policy).
pub const SCHED_ENV: &str = "FORKD_VM_SCHED";

/// The slice a batch VM's threads ask for.
const BATCH_SLICE_NS: u64 = 20_000_000;

/// How a VM's process is scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmSched {
    /// The host's default (`SCHED_OTHER`, default slice).
    Normal,
    /// `SCHED_BATCH` with a [`BATCH_SLICE_NS`] slice.
    Batch,
}

/// The scheduling [`SCHED_ENV`] asks for TCG VMs, read once per process; an error for a
/// value other than `batch` or `normal`. `forkd` checks it at start and refuses to run
/// with a bad one.
pub fn tcg_sched() -> Result<VmSched, String> {
    static CHOICE: std::sync::OnceLock<Result<VmSched, String>> = std::sync::OnceLock::new();
    CHOICE
        .get_or_init(|| match std::env::var(SCHED_ENV) {
            Err(_) => Ok(VmSched::Batch),
            Ok(v) => match v.trim() {
                "batch" => Ok(VmSched::Batch),
                "normal" => Ok(VmSched::Normal),
                _ => Err(format!("{SCHED_ENV}={v:?}: must be batch or normal")),
            },
        })
        .clone()
}

/// `struct sched_attr` as sched_setattr(2) takes it (its first version, 48 bytes).
#[repr(C)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
}

/// Makes the calling thread (in a VM's process before exec: the threads QEMU starts
/// inherit it) `SCHED_BATCH` with the batch slice, keeping its nice value. Where the
/// kernel refuses the slice, the policy alone; where it refuses that too, nothing: how
/// the VM is scheduled never stops it from starting. Only makes system calls, so it is
/// async-signal-safe (for `pre_exec`).
pub fn make_batch() {
    // SAFETY: getpriority reads this process's nice value; -1 is also a valid value and
    // only matters when the call fails, which it cannot for the caller itself.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: libc::SCHED_BATCH as u32,
        flags: 0,
        nice,
        priority: 0,
        runtime: BATCH_SLICE_NS,
        deadline: 0,
        period: 0,
    };
    // SAFETY: sched_setattr reads `attr`, a valid sched_attr of the size it states, for
    // the calling thread (pid 0).
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if rc != 0 {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: sched_setscheduler reads `param` for the calling process.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// Field 41 of /proc/<pid>/stat: the scheduling policy.
    fn policy_of(pid: u32) -> u32 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
        let fields: Vec<&str> = stat[stat.rfind(')').expect(")") + 2..]
            .split_whitespace()
            .collect();
        // Fields after the command name start at 3 (state).
        fields[41 - 3].parse().expect("policy")
    }

    #[test]
    fn a_batch_process_and_the_threads_it_starts_are_batch() {
        let mut cmd = std::process::Command::new("python3");
        cmd.args([
            "-c",
            "import threading,time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)",
        ]);
        // SAFETY: make_batch only makes system calls.
        unsafe {
            cmd.pre_exec(|| {
                make_batch();
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("spawn python3");
        let pid = child.id();
        // Wait until the second thread exists.
        let tasks = format!("/proc/{pid}/task");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let threads = loop {
            let tids: Vec<u32> = std::fs::read_dir(&tasks)
                .expect("tasks")
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect();
            if tids.len() >= 2 || std::time::Instant::now() > deadline {
                break tids;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let policies: Vec<u32> = threads.iter().map(|tid| policy_of(*tid)).collect();
        let _ = child.kill();
        let _ = child.wait();
        assert!(threads.len() >= 2, "the second thread never started");
        assert!(
            policies.iter().all(|p| *p == libc::SCHED_BATCH as u32),
            "{policies:?}"
        );
    }
}
