//! The `forkd.*` parameters of the kernel command line.

/// Reads `/proc/cmdline` (empty if it cannot be read).
pub fn read() -> String {
    std::fs::read_to_string("/proc/cmdline").unwrap_or_default()
}

/// The value of `key=` in `cmdline` (the last one wins, as with the kernel's own
/// parameters). Quoting is not supported: forkd's values never contain spaces.
pub fn get<'a>(cmdline: &'a str, key: &str) -> Option<&'a str> {
    cmdline
        .split_ascii_whitespace()
        .rev()
        .filter_map(|w| w.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

/// True when `key` is present as `key`, `key=1`, `key=yes` or `key=true`.
pub fn flag(cmdline: &str, key: &str) -> bool {
    cmdline.split_ascii_whitespace().any(|w| w == key)
        || matches!(get(cmdline, key), Some("1" | "yes" | "true" | "on"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters() {
        let c = "console=ttyS0 forkd.root=/dev/vdb forkd.ro=1 forkd.hostname=a forkd.hostname=b\n";
        assert_eq!(get(c, "forkd.root"), Some("/dev/vdb"));
        assert_eq!(get(c, "forkd.rootfstype"), None);
        assert_eq!(get(c, "forkd.hostname"), Some("b"));
        assert!(flag(c, "forkd.ro"));
        assert!(!flag("forkd.ro=0", "forkd.ro"));
    }
}
