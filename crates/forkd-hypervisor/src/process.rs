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
    fn this_process_is_alive() {
        let me = std::process::id();
        assert!(is_alive(me));
        assert!(start_time(me).is_some());
        assert!(!is_alive(u32::MAX - 1));
    }
}
