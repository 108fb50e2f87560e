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
//! 33.6 s, idle CPU the same; context switches per child ~95 against ~360 at 100
//! children.
//!
//! The daemon and everything else on the host keep the default policy, so their
//! wakeups may still preempt a VM. The cost: under overload a VM's wakeup (a packet, a
//! timer) can wait for the running VM's slice to end. KVM VMs keep the policy they inherit: their vCPUs run in
//! the guest, not in translated code, and nothing was measured there.
//! [`SCHED_ENV`]`=normal` does the same for TCG.

/// The environment variable that picks the scheduling of TCG VMs: `batch` (the
/// default) or `normal` (QEMU inherits the policy of whoever starts it, as KVM VMs
/// always do).
pub const SCHED_ENV: &str = "FORKD_VM_SCHED";

/// The slice a batch VM's threads ask for.
const BATCH_SLICE_NS: u64 = 20_000_000;

/// How a VM's process is scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmSched {
    /// Whatever the starting thread has (the host's default unless the daemon itself
    /// was started otherwise, e.g. under `chrt`).
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

/// Has the VM process `cmd` starts scheduled as [`SCHED_ENV`] asks when its guest runs
/// under TCG (`tcg`); otherwise it inherits the policy of the thread that starts it.
pub fn schedule(cmd: &mut tokio::process::Command, tcg: bool) {
    if tcg && tcg_sched() == Ok(VmSched::Batch) {
        // SAFETY: runs in the forked child before exec; make_batch only makes system
        // calls.
        unsafe {
            cmd.pre_exec(|| {
                make_batch();
                Ok(())
            });
        }
    }
}

/// Makes the calling thread `SCHED_BATCH` with the batch slice, keeping its nice value.
/// Where the kernel refuses that, the policy alone; where it refuses that too, nothing:
/// how a VM is scheduled never stops it from starting. For `pre_exec`, where the caller
/// is a VM's process about to exec QEMU (whose threads then inherit it): only makes
/// system calls, so it is async-signal-safe.
fn make_batch() {
    if set_batch_attr().is_err() {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: sched_setscheduler reads `param`, for the calling thread (pid 0).
        unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    }
}

/// sched_attr's size as the kernel takes it.
#[expect(
    clippy::cast_possible_truncation,
    reason = "a struct of a few dozen bytes: its size fits a u32"
)]
const ATTR_SIZE: u32 = std::mem::size_of::<libc::sched_attr>() as u32;

/// sched_setattr(2) of the calling thread: `SCHED_BATCH`, [`BATCH_SLICE_NS`] as its
/// slice (kernels before 6.12 ignore a fair policy's runtime), its nice value kept.
fn set_batch_attr() -> std::io::Result<()> {
    // SAFETY: getpriority reads the calling thread's nice value (on Linux nice is per
    // thread). -1 is also a valid value; the call cannot fail for the caller itself.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    let attr = libc::sched_attr {
        size: ATTR_SIZE,
        sched_policy: libc::SCHED_BATCH as u32,
        sched_flags: 0,
        sched_nice: nice,
        sched_priority: 0,
        sched_runtime: BATCH_SLICE_NS,
        sched_deadline: 0,
        sched_period: 0,
    };
    // SAFETY: sched_setattr reads `attr`, a valid sched_attr of the size it states, for
    // the calling thread (pid 0).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_sched_setattr,
            0,
            &attr as *const libc::sched_attr,
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sched_getattr(2) of thread `tid` (0: the caller).
    fn attr_of(tid: libc::pid_t) -> libc::sched_attr {
        // SAFETY: all-zero is a valid sched_attr (plain integers).
        let mut attr: libc::sched_attr = unsafe { std::mem::zeroed() };
        let size = ATTR_SIZE;
        // SAFETY: sched_getattr writes at most `size` bytes into `attr`.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_sched_getattr,
                tid,
                &mut attr as *mut libc::sched_attr,
                size,
                0,
            )
        };
        assert_eq!(rc, 0, "sched_getattr: {}", std::io::Error::last_os_error());
        attr
    }

    fn gettid() -> libc::pid_t {
        // SAFETY: gettid cannot fail.
        unsafe { libc::gettid() }
    }

    /// In a thread of its own (policy and nice are per thread, so the test's other
    /// threads are untouched): the attribute call itself succeeds, keeps the nice value,
    /// sets the slice where the kernel has custom slices, and a thread started
    /// afterwards inherits all of it, as QEMU's threads do.
    #[test]
    fn a_batch_thread_keeps_its_nice_and_the_threads_it_starts_inherit_it() {
        std::thread::spawn(|| {
            // SAFETY: setpriority changes the calling thread's nice value.
            let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 5) };
            assert_eq!(rc, 0);
            // A kernel with custom slices reports an ordinary thread's slice as its
            // runtime; an older one reports 0 and ignores the one asked for.
            let custom_slices = attr_of(0).sched_runtime != 0;
            set_batch_attr().expect("sched_setattr");
            let inherited = std::thread::spawn(|| attr_of(gettid()))
                .join()
                .expect("inner thread");
            for attr in [attr_of(0), inherited] {
                assert_eq!(attr.sched_policy, libc::SCHED_BATCH as u32);
                assert_eq!(attr.sched_nice, 5);
                if custom_slices {
                    assert_eq!(attr.sched_runtime, BATCH_SLICE_NS);
                }
            }
        })
        .join()
        .expect("test thread");
    }
}
