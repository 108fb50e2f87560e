//! What a client may make the daemon open on the host: nothing, unless the operator
//! started it with `--import-dir` and the path lies under one of those directories.
//!
//! The daemon runs as root; a recipe's `from = "docker-archive:/etc/shadow"` would
//! otherwise have it open any file for any client (and tell whether a path exists). A
//! path is refused by its text first, without touching the file system, so a refusal
//! tells nothing about the host; one that passes is resolved (symbolic links followed)
//! and must still lie under the directory.

use std::path::{Component, Path, PathBuf};

/// The directories clients' recipes may name paths under, resolved at start.
#[derive(Debug, Clone, Default)]
pub struct ImportDirs(Vec<PathBuf>);

/// A path a client named that the daemon will not open.
#[derive(Debug, thiserror::Error)]
#[error("{path} is a path on the daemon's host, which a client may not make it read: send the image instead (POST /v1/images; `forkd template build` does it for a recipe's docker-archive: or oci-layout: source), or start the daemon with --import-dir naming a directory that holds it")]
pub struct Refused {
    /// The path, as the client wrote it.
    pub path: String,
}

impl ImportDirs {
    /// `dirs`, each resolved; a directory that cannot be resolved is an error.
    pub fn new(dirs: &[PathBuf]) -> std::io::Result<ImportDirs> {
        let mut out = Vec::new();
        for d in dirs {
            let real = d.canonicalize().map_err(|e| {
                std::io::Error::new(e.kind(), format!("--import-dir {}: {e}", d.display()))
            })?;
            if !real.is_dir() {
                return Err(std::io::Error::other(format!(
                    "--import-dir {} is not a directory",
                    d.display()
                )));
            }
            out.push(real);
        }
        Ok(ImportDirs(out))
    }

    /// The directories.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.0
    }

    /// Whether the daemon may open `path` for a client.
    pub fn check(&self, path: &Path) -> Result<(), Refused> {
        let refused = || Refused {
            path: path.display().to_string(),
        };
        // By its text alone first: absolute, plain names only, under a directory.
        let plain = path.is_absolute()
            && path
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        if !plain || !self.0.iter().any(|d| path.starts_with(d)) {
            return Err(refused());
        }
        let real = path.canonicalize().map_err(|_| refused())?;
        if !self.0.iter().any(|d| real.starts_with(d)) {
            return Err(refused());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_paths_under_an_import_dir_pass() {
        let none = ImportDirs::default();
        assert!(none.check(Path::new("/etc/shadow")).is_err());

        let tmp = tempfile::tempdir().unwrap();
        let allowed = tmp.path().join("imports");
        std::fs::create_dir(&allowed).unwrap();
        std::fs::write(allowed.join("img.tar"), b"x").unwrap();
        std::fs::write(tmp.path().join("secret"), b"x").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("secret"), allowed.join("link")).unwrap();
        let dirs = ImportDirs::new(std::slice::from_ref(&allowed)).unwrap();
        let real = allowed.canonicalize().unwrap();

        assert!(dirs.check(&real.join("img.tar")).is_ok());
        // Outside, relative, climbing out, or out through a link: refused.
        assert!(dirs.check(&tmp.path().join("secret")).is_err());
        assert!(dirs.check(Path::new("img.tar")).is_err());
        assert!(dirs.check(&real.join("../secret")).is_err());
        assert!(dirs.check(&real.join("link")).is_err());
        // A missing file under the directory is refused like any other.
        let e = dirs
            .check(&real.join("missing.tar"))
            .unwrap_err()
            .to_string();
        let e2 = dirs
            .check(Path::new("/etc/shadow"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e.replace(&real.join("missing.tar").display().to_string(), "P"),
            e2.replace("/etc/shadow", "P")
        );
    }
}
