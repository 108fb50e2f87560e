//! Facts about host processes, read from /proc.

/// True if a process with `pid` exists and is not a zombie.
pub fn is_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat_field(&stat, 3).is_some_and(|s| s != "Z" && s != "X"),
        Err(_) => false,
    }
}

/// The process's start time in clock ticks since boot (field 22 of /proc/PID/stat).
/// Together with the pid it names a process uniquely: pids are reused, start times are not.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat_field(&stat, 22)?.parse().ok()
}

/// A pidfd: a handle on one process that stays valid (and names the same process) even
/// after its pid is reused. Readable once the process has exited.
pub struct PidFd(std::os::fd::OwnedFd);

impl PidFd {
    /// `pidfd_open(2)` on `pid`.
    pub fn open(pid: u32) -> std::io::Result<PidFd> {
        use std::os::fd::FromRawFd;
        let pid = libc::pid_t::try_from(pid)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; no
        // memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = i32::try_from(fd).map_err(|_| std::io::Error::other("pidfd out of range"))?;
        // SAFETY: the kernel just returned `fd` to us; nothing else owns it.
        Ok(PidFd(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    /// A pidfd on `pid` if it is still the process that started at `start_time`. The
    /// start time is checked after the pidfd is open: from then on the pidfd names that
    /// process or none, whatever happens to the pid.
    pub fn open_checked(pid: u32, start_time: u64) -> Option<PidFd> {
        let fd = PidFd::open(pid).ok()?;
        (self::start_time(pid) == Some(start_time)).then_some(fd)
    }

    /// Sends `signal` through the pidfd: it reaches the process the pidfd was opened on
    /// or nobody, never a process that reused its pid.
    pub fn send_signal(&self, signal: nix::sys::signal::Signal) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        // SAFETY: pidfd_send_signal takes a pidfd we own, a signal number, a null info
        // pointer (meaning: as kill(2) would send it) and flags 0.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                signal as libc::c_int,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Resolves when the process has exited.
    pub async fn exited(self) -> std::io::Result<()> {
        // SAFETY: the AsyncFd takes ownership of the OwnedFd, which stays open and names
        // the same pidfd until the AsyncFd is dropped.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(self.0, tokio::io::Interest::READABLE)
        }
        .map_err(|e| e.into_parts().1)?;
        let _ready = fd.readable().await?;
        Ok(())
    }
}

/// Makes the process `cmd` will start the leader of a session of its own, so that it
/// outlives whoever started it: no terminal signal and no hang-up of ours reaches it.
pub fn start_detached(cmd: &mut tokio::process::Command) {
    // SAFETY: runs in the forked child before exec and only calls setsid(2), which is
    // async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            nix::unistd::setsid()
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
}

/// True while the process `pid` that started at `start_time` runs (not a zombie).
pub fn is_running(pid: u32, start_time: u64) -> bool {
    pid != 0 && is_alive(pid) && self::start_time(pid) == Some(start_time)
}

/// SIGKILLs the process `pid` if it is still the one that started at `start_time`, and
/// waits (up to a few seconds) until it is gone. The check and the signal go through one
/// pidfd, so a pid reused in between is never hit. Returns true if it was killed.
pub fn kill(pid: u32, start_time: u64) -> bool {
    if !signal(pid, start_time, nix::sys::signal::Signal::SIGKILL) {
        return false;
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while is_alive(pid) && self::start_time(pid) == Some(start_time) {
        if std::time::Instant::now() > deadline {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    true
}

/// Sends `sig` to the process `pid` if it is still the one that started at
/// `start_time` (through a pidfd, so never to a process that reused the pid). Returns
/// true if it was sent.
pub fn signal(pid: u32, start_time: u64, sig: nix::sys::signal::Signal) -> bool {
    PidFd::open_checked(pid, start_time).is_some_and(|fd| fd.send_signal(sig).is_ok())
}

/// Processes (pid, start time) one of whose command-line arguments contains `needle`:
/// how a VM whose pid was never recorded (its owner died while starting it) is found by
/// the runtime directory its command line names.
pub fn find_by_argument(needle: &str) -> Vec<(u32, u64)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                c.split(|b| *b == 0)
                    .any(|arg| String::from_utf8_lossy(arg).contains(needle))
            })
        })
        .filter_map(|pid| Some((pid, start_time(pid)?)))
        .collect()
}

/// Processes (pid, start time) one of whose arguments names something inside `dir`.
/// Nothing for an empty or root `dir`, which would name everything.
pub fn find_inside(dir: &std::path::Path) -> Vec<(u32, u64)> {
    let inside = format!("{}/", dir.to_string_lossy());
    if inside.len() <= 2 {
        return Vec::new();
    }
    find_by_argument(&inside)
}

/// Kills whatever runs for a VM whose runtime directory is `dir`: its recorded process
/// `pid` (0: none recorded), if it is still the one that started at `start_time`, and
/// every process whose command line names something inside `dir` (every path a VM is
/// given lies there, so this finds one whose pid was never recorded).
pub fn kill_vm(pid: u32, start_time: u64, dir: &std::path::Path) {
    if pid != 0 {
        kill(pid, start_time);
    }
    for (pid, start) in find_inside(dir) {
        kill(pid, start);
    }
}

/// Waits until a backend's exit watch (None while the process runs, then how it ended)
/// says the process has exited, and returns how.
pub async fn wait_for_exit(exit: &tokio::sync::watch::Receiver<Option<String>>) -> String {
    let mut exit = exit.clone();
    let desc = match exit.wait_for(|s| s.is_some()).await {
        Ok(s) => s.clone().unwrap_or_default(),
        Err(_) => "exited".into(),
    };
    desc
}

/// Field `n` (1-based, as in proc(5)) of a /proc/PID/stat line. The command name (field 2)
/// may contain spaces and parentheses, so fields are counted from its closing parenthesis.
fn stat_field(stat: &str, n: usize) -> Option<&str> {
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(n.checked_sub(3)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_count_from_the_command_name() {
        let line = "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 777 0 0";
        assert_eq!(stat_field(line, 3), Some("S"));
        assert_eq!(stat_field(line, 4), Some("1"));
        assert_eq!(stat_field(line, 22), Some("777"));
    }

    #[tokio::test]
    async fn pidfd_resolves_when_the_process_exits() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.2")
            .spawn()
            .unwrap();
        let fd = PidFd::open(child.id()).unwrap();
        let waiter = tokio::spawn(fd.exited());
        assert!(!waiter.is_finished());
        child.wait().unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }

    #[test]
    fn kill_hits_only_the_process_it_names() {
        // The needle is the shell's $0; `; true` keeps the shell from exec'ing sleep.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 30; true", "forkd-test-needle-4c1e"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let started = start_time(pid).unwrap();
        // Give the exec a moment to show in /proc, and the shell's child the moment
        // between its fork (when it still has the shell's arguments) and its exec.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut found = find_by_argument("forkd-test-needle-4c1e");
        while found != vec![(pid, started)] && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
            found = find_by_argument("forkd-test-needle-4c1e");
        }
        assert_eq!(found, vec![(pid, started)]);
        // A wrong start time is another process that once had this pid: left alone.
        assert!(!kill(pid, started + 1));
        assert!(is_alive(pid));
        assert!(kill(pid, started));
        assert!(!child.wait().unwrap().success());
        assert!(find_by_argument("forkd-test-needle-4c1e").is_empty());
    }

    #[test]
    fn this_process_is_alive() {
        let me = std::process::id();
        assert!(is_alive(me));
        assert!(start_time(me).is_some());
        assert!(!is_alive(u32::MAX - 1));
    }
}
