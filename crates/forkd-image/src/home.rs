//! The data directory (`FORKD_HOME`) and where each kind of asset lives in it.

use std::path::{Path, PathBuf};

/// The forkd data directory. Guest assets live under `<root>/images`, per-sandbox
/// runtime directories under `<root>/run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Home {
    root: PathBuf,
}

impl Home {
    /// `$FORKD_HOME`, else `/var/lib/forkd` for root, else the XDG data directory
    /// (`$XDG_DATA_HOME/forkd`, or `~/.local/share/forkd`).
    pub fn from_env() -> Home {
        Home::new(default_root(
            std::env::var_os("FORKD_HOME").map(PathBuf::from),
            nix::unistd::geteuid().is_root(),
            std::env::var_os("XDG_DATA_HOME").map(PathBuf::from),
            home_dir(),
        ))
    }

    pub fn new(root: impl Into<PathBuf>) -> Home {
        Home { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/images`: kernels, initramfs archives, rootfs images and their manifests.
    pub fn images_dir(&self) -> PathBuf {
        self.root.join("images")
    }

    /// `<root>/run`: per-sandbox runtime directories (created by forkd-core).
    pub fn run_dir(&self) -> PathBuf {
        self.root.join("run")
    }

    /// `<root>/images/kernel`: one directory per kernel release.
    pub fn kernel_dir(&self) -> PathBuf {
        self.images_dir().join("kernel")
    }

    /// `<root>/images/initramfs`: `<key>.cpio` + `<key>.json`.
    pub fn initramfs_dir(&self) -> PathBuf {
        self.images_dir().join("initramfs")
    }

    /// `<root>/images/rootfs`: `<name>.ext4` + `<name>.json`.
    pub fn rootfs_dir(&self) -> PathBuf {
        self.images_dir().join("rootfs")
    }

    /// `<root>/images/tmp`: scratch space of builds. Only touched under the build
    /// lock, so anything found here when the lock is taken is left over from a crash.
    pub fn tmp_dir(&self) -> PathBuf {
        self.images_dir().join("tmp")
    }

    /// `<root>/images/.lock`: the flock that serialises builds across processes.
    pub fn lock_path(&self) -> PathBuf {
        self.images_dir().join(".lock")
    }
}

/// The decision of [`Home::from_env`], separated from the environment so it can be tested.
fn default_root(
    forkd_home: Option<PathBuf>,
    is_root: bool,
    xdg_data_home: Option<PathBuf>,
    home: Option<PathBuf>,
) -> PathBuf {
    if let Some(dir) = forkd_home.filter(|d| !d.as_os_str().is_empty()) {
        return dir;
    }
    if is_root {
        return PathBuf::from("/var/lib/forkd");
    }
    // The XDG spec says relative values are invalid and must be ignored.
    if let Some(dir) = xdg_data_home.filter(|d| d.is_absolute()) {
        return dir.join("forkd");
    }
    match home {
        Some(h) => h.join(".local/share/forkd"),
        // No home directory at all (a locked-down service account): fall back to
        // a per-user directory rather than failing, so read-only commands still work.
        None => std::env::temp_dir().join(format!("forkd-{}", nix::unistd::geteuid())),
    }
}

fn home_dir() -> Option<PathBuf> {
    if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        return Some(PathBuf::from(h));
    }
    nix::unistd::User::from_uid(nix::unistd::geteuid())
        .ok()
        .flatten()
        .map(|u| u.dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence() {
        let p = |s: &str| Some(PathBuf::from(s));
        assert_eq!(default_root(p("/x"), true, None, None), PathBuf::from("/x"));
        assert_eq!(
            default_root(p(""), true, None, None),
            PathBuf::from("/var/lib/forkd")
        );
        assert_eq!(
            default_root(None, false, p("/d"), p("/h")),
            PathBuf::from("/d/forkd")
        );
        assert_eq!(
            default_root(None, false, p("rel"), p("/h")),
            PathBuf::from("/h/.local/share/forkd")
        );
    }

    #[test]
    fn layout() {
        let h = Home::new("/f");
        assert_eq!(h.images_dir(), PathBuf::from("/f/images"));
        assert_eq!(h.run_dir(), PathBuf::from("/f/run"));
        assert_eq!(h.rootfs_dir(), PathBuf::from("/f/images/rootfs"));
        assert_eq!(h.lock_path(), PathBuf::from("/f/images/.lock"));
    }
}
