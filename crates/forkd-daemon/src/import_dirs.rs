//! What a client may make the daemon open on the host: nothing, unless the operator
//! started it with `--import-dir` and the path lies under one of those directories.
//!
//! The daemon runs as root; a recipe's `from = "docker-archive:/etc/shadow"` would
//! otherwise have it open any file for any client (and tell whether a path exists). A
//! path is refused by its text first, without touching the file system, so a refusal
//! tells nothing about the host. One that passes is opened at once, from the import
//! directory's own descriptor with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`: no
//! symbolic link anywhere on the way (nor, for a layout, in it), nothing outside the
//! directory, and only regular files and directories (a FIFO would hang a reader). What
//! is read later is what was opened then: a rename or a link made after the check
//! changes nothing. The opened image then goes the way of an uploaded one
//! ([`Opened::reader`]).

use forkd_storage::oci::image::ImageSource;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

/// The directories clients' recipes may name paths under, resolved at start.
#[derive(Debug, Clone, Default)]
pub struct ImportDirs(Vec<PathBuf>);

/// A path a client named that the daemon will not open.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// Outside every import directory (or no import directory at all).
    #[error("{path} is a path on the daemon's host, which a client may not make it read: send the image instead (POST /v1/images; `forkd template build` does it for a recipe's docker-archive: or oci-layout: source), or start the daemon with --import-dir naming a directory that holds it")]
    Outside {
        /// The path, as the client wrote it.
        path: String,
    },
    /// Under an import directory, but not to be read there.
    #[error("{path} under the import directory cannot be read: {why}")]
    Unreadable {
        /// The path, as the client wrote it.
        path: String,
        /// Why (a symbolic link on the way, not a regular file, missing...).
        why: String,
    },
}

/// An image source under an import directory, opened.
#[derive(Debug)]
pub enum Opened {
    /// An archive (`docker-archive:`), and the image it names.
    Archive {
        /// The file.
        file: File,
        /// `REPO:TAG`.
        tag: Option<String>,
    },
    /// A layout (`oci-layout:`): its files by their names in it, and the image's tag.
    Layout {
        /// `oci-layout`, `index.json` and `blobs/sha256/<hex>`.
        files: Vec<(String, File)>,
        /// `org.opencontainers.image.ref.name`.
        tag: Option<String>,
    },
}

impl Opened {
    /// The image as an archive a reader reads (a layout's files written as a tar by a
    /// thread as they are read), and the tag of the image in it.
    pub fn reader(self) -> std::io::Result<(File, Option<String>)> {
        match self {
            Opened::Archive { file, tag } => Ok((file, tag)),
            Opened::Layout { files, tag } => {
                let (read, write) = nix::unistd::pipe()?;
                std::thread::Builder::new()
                    .name("forkd-import".into())
                    .spawn(move || {
                        let mut tar = tar::Builder::new(File::from(write));
                        for (name, mut file) in files {
                            let written = file.metadata().and_then(|m| {
                                let mut h = tar::Header::new_gnu();
                                h.set_size(m.len());
                                h.set_mode(0o644);
                                h.set_cksum();
                                tar.append_data(&mut h, &name, &mut file)
                            });
                            if let Err(e) = written {
                                // The reader sees the tar end short and refuses it.
                                tracing::warn!("reading {name} of an imported layout: {e}");
                                return;
                            }
                        }
                        let _ = tar.finish();
                    })?;
                Ok((File::from(read), tag))
            }
        }
    }
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

    /// Opens the host path `source` names, if it names one and the daemon may open it
    /// for a client; `None` for a source that is not a host path.
    pub fn open(&self, source: &ImageSource) -> Result<Option<Opened>, Refused> {
        let Some(path) = source.host_path() else {
            return Ok(None);
        };
        let shown = path.display().to_string();
        let unreadable = |why: String| Refused::Unreadable {
            path: shown.clone(),
            why,
        };
        // By its text alone first: absolute, plain names only, under a directory.
        let plain = path.is_absolute()
            && path
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        let under = self
            .0
            .iter()
            .find_map(|d| path.strip_prefix(d).ok().map(|rel| (d, rel)));
        let (Some((dir, rel)), true) = (under, plain) else {
            return Err(Refused::Outside { path: shown });
        };
        let root = File::open(dir).map_err(|e| unreadable(e.to_string()))?;
        let opened = match source {
            ImageSource::DockerArchive { tag, .. } => Opened::Archive {
                file: beneath(&root, rel, false).map_err(unreadable)?,
                tag: tag.clone(),
            },
            ImageSource::Layout { tag, .. } => {
                let layout = beneath(&root, rel, true).map_err(unreadable)?;
                Opened::Layout {
                    files: layout_files(&layout).map_err(unreadable)?,
                    tag: tag.clone(),
                }
            }
            ImageSource::Registry(_) | ImageSource::Upload(_) => return Ok(None),
        };
        Ok(Some(opened))
    }

    /// Whether the daemon may open `path` for a client (see [`ImportDirs::open`]).
    #[cfg(test)]
    fn check(&self, path: &Path) -> Result<(), Refused> {
        let source = ImageSource::DockerArchive {
            file: path.to_owned(),
            tag: None,
        };
        self.open(&source).map(drop)
    }
}

/// `rel` opened under the directory `dir` with no symbolic link and nothing outside
/// `dir` on the way: a directory when `want_dir`, else a regular file.
fn beneath(dir: &File, rel: &Path, want_dir: bool) -> Result<File, String> {
    let mut flags = OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK;
    if want_dir {
        flags |= OFlag::O_DIRECTORY;
    }
    let how = OpenHow::new()
        .flags(flags)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
    let fd = nix::fcntl::openat2(dir.as_raw_fd(), rel, how).map_err(|e| match e {
        nix::errno::Errno::ELOOP | nix::errno::Errno::EXDEV => {
            "a symbolic link (or `..`) is on its way; name the real path".to_owned()
        }
        e => e.desc().to_owned(),
    })?;
    // SAFETY: openat2 returned a new descriptor that nothing else owns.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let kind = file.metadata().map_err(|e| e.to_string())?.file_type();
    match (want_dir, kind.is_dir(), kind.is_file()) {
        (true, true, _) | (false, _, true) => Ok(file),
        (true, ..) => Err("not a directory".into()),
        (false, ..) => Err("not a regular file".into()),
    }
}

/// The files of the OCI layout `dir` (opened), each opened as [`beneath`] opens them:
/// `oci-layout`, `index.json` and every `blobs/sha256/<hex>`.
fn layout_files(dir: &File) -> Result<Vec<(String, File)>, String> {
    let mut files = Vec::new();
    for name in ["oci-layout", "index.json"] {
        let f = beneath(dir, Path::new(name), false).map_err(|e| format!("{name}: {e}"))?;
        files.push((name.to_owned(), f));
    }
    let blobs =
        beneath(dir, Path::new("blobs/sha256"), true).map_err(|e| format!("blobs/sha256: {e}"))?;
    let mut names: Vec<String> = Vec::new();
    // Listed through its own descriptor: the directory that was opened.
    let listed = std::fs::read_dir(format!("/proc/self/fd/{}", blobs.as_raw_fd()))
        .map_err(|e| format!("blobs/sha256: {e}"))?;
    for entry in listed {
        let entry = entry.map_err(|e| format!("blobs/sha256: {e}"))?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    for name in names {
        let f = beneath(&blobs, Path::new(&name), false)
            .map_err(|e| format!("blobs/sha256/{name}: {e}"))?;
        files.push((format!("blobs/sha256/{name}"), f));
    }
    Ok(files)
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
        // Under the directory, what is missing or a FIFO is said so.
        let e = dirs
            .check(&real.join("missing.tar"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot be read"), "{e}");
        nix::unistd::mkfifo(&real.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = dirs.check(&real.join("fifo")).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        // A layout whose blob is a link out of it is refused.
        let layout = allowed.join("layout");
        std::fs::create_dir_all(layout.join("blobs/sha256")).unwrap();
        std::fs::write(layout.join("oci-layout"), "{}").unwrap();
        std::fs::write(layout.join("index.json"), "{}").unwrap();
        std::fs::write(layout.join("blobs/sha256/aa"), "blob").unwrap();
        let source = |p: &Path| ImageSource::Layout {
            dir: p.to_owned(),
            tag: None,
        };
        match dirs.open(&source(&real.join("layout"))).unwrap() {
            Some(Opened::Layout { files, .. }) => assert_eq!(files.len(), 3),
            other => panic!("{other:?}"),
        }
        std::os::unix::fs::symlink(tmp.path().join("secret"), layout.join("blobs/sha256/bb"))
            .unwrap();
        let e = dirs
            .open(&source(&real.join("layout")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blobs/sha256/bb") && e.contains("symbolic link"),
            "{e}"
        );
    }
}
