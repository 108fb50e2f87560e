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

    #[test]
    fn this_process_is_alive() {
        let me = std::process::id();
        assert!(is_alive(me));
        assert!(start_time(me).is_some());
        assert!(!is_alive(u32::MAX - 1));
    }
}
