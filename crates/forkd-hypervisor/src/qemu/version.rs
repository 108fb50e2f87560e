//! What the installed QEMU is and can do (for `forkd doctor` and snapshot manifests).

use std::path::Path;

/// QEMU's version, as `major.minor.micro`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct QemuVersion(pub u32, pub u32, pub u32);

impl std::fmt::Display for QemuVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// Parses the first line of `qemu-system-x86_64 --version`.
pub fn parse_version(text: &str) -> Option<QemuVersion> {
    let rest = text.split("version ").nth(1)?;
    let ver = rest
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .next()?;
    let mut it = ver.split('.').map(|p| p.parse::<u32>().ok());
    Some(QemuVersion(
        it.next()??,
        it.next().flatten().unwrap_or(0),
        it.next().flatten().unwrap_or(0),
    ))
}

/// Runs `binary --version`.
pub fn installed_version(binary: &Path) -> Result<QemuVersion, String> {
    let out = std::process::Command::new(binary)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", binary.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_version(&text).ok_or_else(|| format!("unrecognised version output: {}", text.trim()))
}

/// The machine types `binary -machine help` lists.
pub fn machine_types(binary: &Path) -> Result<Vec<String>, String> {
    let out = std::process::Command::new(binary)
        .args(["-machine", "help"])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", binary.display()))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse() {
        assert_eq!(
            parse_version("QEMU emulator version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u18)\n"),
            Some(QemuVersion(7, 2, 19))
        );
        assert_eq!(
            parse_version("QEMU emulator version 10.0\n"),
            Some(QemuVersion(10, 0, 0))
        );
        assert_eq!(parse_version("nonsense"), None);
        assert!(QemuVersion(7, 2, 0) > QemuVersion(6, 9, 9));
    }
}
