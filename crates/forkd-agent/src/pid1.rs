//! The duties of PID 1: mounts, hostname, loopback, reaping orphans, and shutdown.

use crate::children::Children;
use crate::cmdline;
use nix::mount::{mount, MsFlags};
use nix::sys::reboot::{reboot, RebootMode};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag};
use nix::unistd::Pid;
use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};

/// Default hostname when the command line names none.
const DEFAULT_HOSTNAME: &str = "forkd";

/// How often orphans are looked for where SIGCHLD cannot be handled.
const REAP_INTERVAL: Duration = Duration::from_secs(2);

/// Prints a line to the console.
pub fn log(msg: &str) {
    use std::io::Write;
    // Never panic over a console that is gone.
    let _ = writeln!(std::io::stderr(), "forkd-agent: {msg}");
}

/// Prints `msg`, then restarts the machine (with QEMU's `-no-reboot`: ends the VM), so a
/// guest that cannot work stops visibly instead of hanging.
pub fn die(msg: &str) -> ! {
    log(&format!("fatal: {msg}"));
    log("stopping the machine in 2 s");
    std::thread::sleep(Duration::from_secs(2));
    nix::unistd::sync();
    let err = reboot(RebootMode::RB_AUTOBOOT).err();
    log(&format!(
        "reboot failed: {err:?}; exiting (the kernel will panic)"
    ));
    std::process::exit(1)
}

/// Makes sure fds 0-2 are open (on the console, else /dev/null). The kernel leaves them
/// closed when the initramfs has no /dev/console, and an fd opened later (the agent port)
/// must never land on 2, where log lines go.
pub fn ensure_stdio() {
    for fd in 0..=2 {
        if nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFD).is_ok() {
            continue;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/console")
            .or_else(|_| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open("/dev/null")
            });
        if let Ok(file) = file {
            if file.as_raw_fd() != fd {
                // dup2 onto the missing descriptor; the original is closed on drop.
                let _ = nix::unistd::dup2(file.as_raw_fd(), fd);
            } else {
                // It already is that descriptor: keep it open.
                std::mem::forget(file);
            }
        }
    }
}

/// The mount points in /proc/self/mounts.
fn mount_points() -> HashSet<String> {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(1).map(str::to_string))
        .collect()
}

fn mount_missing(
    mounted: &HashSet<String>,
    fstype: &str,
    target: &str,
    flags: MsFlags,
    data: &str,
) {
    if mounted.contains(target) {
        return;
    }
    // On a read-only root the directory may be missing and uncreatable: then the mount
    // fails below and says so.
    let _ = std::fs::create_dir_all(target);
    let data = (!data.is_empty()).then_some(data);
    if let Err(e) = mount(Some(fstype), target, Some(fstype), flags, data) {
        log(&format!("mounting {fstype} on {target} failed: {e}"));
    }
}

/// Mounts what is missing, fixes up /dev, sets the hostname and brings up the links.
/// Failures are logged, not fatal: a guest with one of these missing can still serve.
pub fn setup() {
    let nosuid = MsFlags::MS_NOSUID;
    let common = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if !Path::new("/proc/self/stat").exists() {
        let _ = std::fs::create_dir_all("/proc");
        if let Err(e) = mount(
            Some("proc"),
            "/proc",
            Some("proc"),
            common | MsFlags::MS_NOEXEC,
            None::<&str>,
        ) {
            log(&format!("mounting proc on /proc failed: {e}"));
        }
    }
    let mounted = mount_points();
    mount_missing(&mounted, "sysfs", "/sys", common | MsFlags::MS_NOEXEC, "");
    mount_missing(&mounted, "devtmpfs", "/dev", nosuid, "mode=0755");
    ensure_stdio();
    mount_missing(
        &mounted,
        "devpts",
        "/dev/pts",
        nosuid | MsFlags::MS_NOEXEC,
        "mode=0620,ptmxmode=0666",
    );
    mount_missing(&mounted, "tmpfs", "/dev/shm", common, "mode=1777");
    mount_missing(&mounted, "tmpfs", "/tmp", common, "mode=1777");
    mount_missing(&mounted, "tmpfs", "/run", common, "mode=0755");
    // devtmpfs has no such links, but shells (`<(...)`, `/dev/stdin`) expect them.
    for (link, target) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        if std::fs::symlink_metadata(link).is_err() {
            let _ = std::os::unix::fs::symlink(target, link);
        }
    }

    let cmdline = cmdline::read();
    let hostname = cmdline::get(&cmdline, "forkd.hostname").unwrap_or(DEFAULT_HOSTNAME);
    if let Err(e) = nix::unistd::sethostname(hostname) {
        log(&format!("setting the hostname to {hostname} failed: {e}"));
    }
    if let Err(e) = crate::network::setup(&cmdline) {
        log(&format!("configuring the network failed: {e}"));
    }
    quiet_idle_timers();
}

/// Kernel work that wakes an idle guest for nothing a sandbox needs. Under TCG every
/// wakeup costs the host real CPU (measured: an idle guest, 0.49 % of a host core with
/// proactive compaction on, 0.37 % with it off).
const QUIET_SYSCTLS: &[(&str, &str)] = &[
    // kcompactd wakes every 500 ms to consider proactive compaction: pointless for a
    // guest of a few hundred MiB that lives minutes, and the largest idle wakeup left.
    ("/proc/sys/vm/compaction_proactiveness", "0"),
];

fn quiet_idle_timers() {
    for (path, value) in QUIET_SYSCTLS {
        // Older kernels lack some knobs; a guest without them only idles a bit louder.
        if let Err(e) = std::fs::write(path, value) {
            if e.kind() != std::io::ErrorKind::NotFound {
                log(&format!("setting {path} to {value} failed: {e}"));
            }
        }
    }
}

/// One process as /proc/<pid>/stat tells it: (pid, state, ppid).
fn proc_stat(pid: i32) -> Option<(char, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may itself contain ") ", so split at
    // the last one.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

fn pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Reaps zombies that were re-parented to PID 1 and are not the agent's own children
/// (those are tokio's to wait for). Runs on every SIGCHLD, so at least once per command.
fn reap_once(children: &Children) {
    children.with_locked(|ours| {
        // waitpid with WNOHANG reaps a zombie and leaves a running child alone, so the
        // children lists need no reading per child.
        let candidates = own_children().unwrap_or_else(orphaned_zombies);
        for pid in candidates
            .into_iter()
            .filter(|p| !u32::try_from(*p).is_ok_and(|p| ours.contains(&p)))
        {
            let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
        }
    });
}

/// Zombies whose parent is PID 1, from a scan of every /proc entry: for kernels without
/// the children lists [`own_children`] reads.
fn orphaned_zombies() -> Vec<i32> {
    pids()
        .into_iter()
        .filter(|pid| matches!(proc_stat(*pid), Some(('Z', 1))))
        .collect()
}

/// PID 1's children, from each of its threads' `/proc/self/task/<tid>/children` (a
/// child is listed under the thread that started it; orphans under the main thread).
/// None where the kernel lacks those files (CONFIG_PROC_CHILDREN).
///
/// Why not scan all of /proc: that reads every process's `stat`, ~50 of them in a guest
/// (mostly kernel threads), on every command's exit. Under TCG a `true` run through the
/// agent cost QEMU ~19 ms of CPU with that scan and ~14 ms with these lists (python
/// template, 20 runs each). A list can skip an entry when another child of the same
/// thread is reaped during the read (tokio waiting for one of the agent's own; see
/// proc(5)); an orphan missed so stays a zombie until the next SIGCHLD.
fn own_children() -> Option<Vec<i32>> {
    let mut pids = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        match std::fs::read_to_string(task.path().join("children")) {
            Ok(list) => pids.extend(
                list.split_ascii_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            ),
            // The thread ended since the directory was read.
            Err(_) if !task.path().exists() => {}
            Err(_) => return None,
        }
    }
    Some(pids)
}

/// Reaps orphans forever: on every SIGCHLD (else every [`REAP_INTERVAL`]).
pub async fn reaper(children: Arc<Children>) {
    let mut sigchld = match signal(SignalKind::child()) {
        Ok(s) => Some(s),
        Err(e) => {
            log(&format!(
                "cannot handle SIGCHLD ({e}); reaping orphans by timer only"
            ));
            None
        }
    };
    loop {
        // Signals that arrive together are delivered once, but each delivery reaps
        // every zombie there is, so none waits for another signal. The timer is only
        // the fallback where SIGCHLD cannot be handled: an idle guest must not wake.
        match sigchld.as_mut() {
            Some(s) => {
                s.recv().await;
            }
            None => tokio::time::sleep(REAP_INTERVAL).await,
        }
        reap_once(&children);
    }
}

/// True while a user process other than PID 1 is alive (zombies and kernel threads do
/// not count).
fn others_alive() -> bool {
    pids().into_iter().any(|pid| {
        pid != 1
            && pid != 2
            && matches!(proc_stat(pid), Some((state, ppid)) if state != 'Z' && ppid != 2)
    })
}

/// Reaps every zombie child; at shutdown nobody wants their status any more.
fn reap_all() {
    while let Ok(status) = waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
        if status == nix::sys::wait::WaitStatus::StillAlive {
            break;
        }
    }
}

/// Stops every process, syncs and remounts the disks read-only, then powers off or
/// restarts the machine.
pub async fn shutdown(poweroff: bool) {
    // kill(-1) and reboot(2) are only safe for the init of a guest; `pid1` run by hand
    // on a host must never take the host down.
    if nix::unistd::getpid().as_raw() != 1 {
        log("shutdown requested, but not running as PID 1: exiting only this process");
        std::process::exit(0);
    }
    log(if poweroff {
        "powering off"
    } else {
        "restarting"
    });
    let all = Pid::from_raw(-1);
    let _ = kill(all, Signal::SIGTERM);
    for _ in 0..20 {
        reap_all();
        if !others_alive() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = kill(all, Signal::SIGKILL);
    tokio::time::sleep(Duration::from_millis(50)).await;
    reap_all();
    nix::unistd::sync();
    if let Err(e) = mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
        None::<&str>,
    ) {
        log(&format!("remounting / read-only failed: {e}"));
    }
    nix::unistd::sync();
    let mode = if poweroff {
        RebootMode::RB_POWER_OFF
    } else {
        RebootMode::RB_AUTOBOOT
    };
    let err = reboot(mode).err();
    log(&format!(
        "reboot failed: {err:?}; exiting (the kernel will panic)"
    ));
    std::process::exit(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_stat_parses() {
        let me = i32::try_from(std::process::id()).unwrap();
        let (state, ppid) = proc_stat(me).expect("our own /proc entry");
        assert!(matches!(state, 'R' | 'S'), "{state}");
        assert_eq!(ppid, nix::unistd::getppid().as_raw());
    }

    /// A child started by another thread is listed too: the agent starts commands from
    /// tokio's worker and blocking threads, not only from its main thread. The thread
    /// lives on while the lists are read, so the child is not under the main thread.
    #[test]
    fn own_children_lists_those_started_by_any_thread() {
        let (spawned, got_pid) = std::sync::mpsc::channel();
        let (done, wait_done) = std::sync::mpsc::channel::<()>();
        let spawner = std::thread::spawn(move || {
            let mut child = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .expect("spawn sleep");
            spawned
                .send(i32::try_from(child.id()).unwrap())
                .expect("send pid");
            let _ = wait_done.recv();
            let _ = child.kill();
            let _ = child.wait();
        });
        let pid = got_pid.recv().expect("pid");
        let listed = own_children().expect("this kernel has the children lists");
        let main_thread =
            std::fs::read_to_string(format!("/proc/self/task/{}/children", std::process::id()))
                .expect("the main thread's list");
        done.send(()).expect("release the spawner");
        spawner.join().expect("spawner");
        assert!(listed.contains(&pid), "{listed:?}");
        assert!(
            !main_thread.split_whitespace().any(|p| p == pid.to_string()),
            "{main_thread}"
        );
        assert!(!listed.contains(&i32::try_from(std::process::id()).unwrap()));
    }
}
