//! What the installed QEMU is and can do (for `forkd doctor` and snapshot manifests).

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

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

/// Where `binary` is: itself if it names a directory, else the first match on `PATH`.
fn resolve(binary: &Path) -> Option<PathBuf> {
    if binary.components().count() > 1 {
        return Some(binary.to_owned());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(binary))
        .find(|p| p.is_file())
}

/// [`installed_version`], remembered while the program file stays the same (device, inode,
/// modification time): a fork asks on every call, and running `--version` costs a process
/// (10–30 ms), while a package upgrade replaces the file.
pub fn current_version(binary: &Path) -> Result<QemuVersion, String> {
    type Identity = (u64, u64, i64, i64);
    static SEEN: Mutex<Option<HashMap<PathBuf, (Identity, QemuVersion)>>> = Mutex::new(None);
    let identity = resolve(binary)
        .and_then(|p| std::fs::metadata(p).ok())
        .map(|m| (m.dev(), m.ino(), m.mtime(), m.mtime_nsec()));
    let Some(identity) = identity else {
        return installed_version(binary);
    };
    if let Some((id, v)) = SEEN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(binary)
    {
        if *id == identity {
            return Ok(*v);
        }
    }
    let v = installed_version(binary)?;
    SEEN.lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(binary.to_owned(), (identity, v));
    Ok(v)
}

/// The `major.minor` release of a version string such as `10.0.2` (snapshot manifests
/// record the backend's version so).
pub fn release_of(version: &str) -> Option<(u32, u32)> {
    let mut it = version.split('.');
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// Why device state saved by QEMU `made` cannot be restored by QEMU `now`: another
/// `major.minor` release. Its device state is QEMU's migration format of that release,
/// for the `microvm` machine, which has no versioned machine types to keep it loadable
/// by later releases. A version either side cannot read is left to the restore.
pub fn release_refusal(made: &str, now: &str) -> Option<String> {
    match (release_of(made), release_of(now)) {
        (Some(a), Some(b)) if a != b => Some(format!(
            "it was made by QEMU {made} and this host runs QEMU {now}; a snapshot's device state does not carry across QEMU releases, so build it again (`forkd template build`, or branch its source again)"
        )),
        _ => None,
    }
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
    fn snapshots_of_another_qemu_release_are_refused() {
        assert_eq!(release_refusal("10.0.2", "10.0.7"), None);
        let why = release_refusal("7.2.22", "10.0.2").unwrap();
        assert!(
            why.contains("QEMU 7.2.22") && why.contains("QEMU 10.0.2"),
            "{why}"
        );
        // A version that is not a QEMU release is left alone.
        assert_eq!(release_refusal("fake-0.1.0", "10.0.2"), None);
    }

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

    #[test]
    fn releases_are_major_and_minor() {
        assert_eq!(release_of("10.0.2"), Some((10, 0)));
        assert_eq!(release_of("7.2.22"), Some((7, 2)));
        assert_eq!(release_of("fake-0.1.0"), None);
        assert_eq!(release_of("unknown (no qemu)"), None);
    }

    #[test]
    fn the_current_version_is_remembered_per_program_file() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("qemu");
        let write = |v: &str| {
            std::fs::write(
                &bin,
                format!("#!/bin/sh\necho 'QEMU emulator version {v}'\n"),
            )
            .unwrap();
            std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
        };
        write("9.2.1");
        assert_eq!(current_version(&bin), Ok(QemuVersion(9, 2, 1)));
        // A new program file (an upgrade) is asked again.
        std::fs::remove_file(&bin).unwrap();
        write("10.0.2");
        assert_eq!(current_version(&bin), Ok(QemuVersion(10, 0, 2)));
    }
}
