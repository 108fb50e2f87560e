//! The snapshot store: immutable directories under `$FORKD_HOME/snapshots/<tag>/`.
//!
//! A snapshot is written into a staging directory, hashed, sealed, fsynced and then
//! renamed into place in one step, so a reader finds either a whole snapshot or none.
//! Once published nothing in it is written again; its files are read-only.
//!
//! - [`tag`]: which names are allowed.
//! - [`manifest`]: what a snapshot records about itself, and the seal a fork checks.

pub mod chain;
pub mod manifest;
pub mod memory_diff;
pub mod tag;

pub use manifest::{Manifest, Seal};
pub use tag::Tag;

use manifest::{parts, FileStamp};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

/// File name of the manifest.
pub const MANIFEST: &str = "manifest.json";
/// File name of the seal.
pub const SEAL: &str = "seal.json";
/// Staging directories live here, inside the store, so the final rename stays on one
/// filesystem.
const STAGING: &str = ".staging";

/// What can go wrong with snapshots.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("invalid snapshot tag {tag:?}: {reason}")]
    InvalidTag {
        /// (The start of) the tag.
        tag: String,
        /// What is wrong with it.
        reason: String,
    },
    #[error("no snapshot {tag} (see `forkd snapshots`)")]
    NotFound {
        /// The tag.
        tag: String,
    },
    #[error(
        "snapshot {tag} already exists (remove it with `forkd rmi {tag}`, or use another tag)"
    )]
    Exists {
        /// The tag.
        tag: String,
    },
    #[error("snapshot {tag} is damaged and will not be forked: {detail} (check it with `forkd snapshot verify {tag}`; rebuild it to repair)")]
    Damaged {
        /// The tag.
        tag: String,
        /// What is wrong.
        detail: String,
    },
    #[error("snapshot {tag}: {part} does not match its digest (expected sha256 {expected}, found {actual})")]
    DigestMismatch {
        /// The tag.
        tag: String,
        /// The part.
        part: String,
        /// From the manifest.
        expected: String,
        /// Of the file.
        actual: String,
    },
    #[error("snapshot {tag} is in use by {users}; stop those first")]
    InUse {
        /// The tag.
        tag: String,
        /// Who uses it, named.
        users: String,
    },
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> SnapshotError {
    let context = context.into();
    move |source| SnapshotError::Io { context, source }
}

/// The store: a directory of snapshots.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

/// A published snapshot whose seal was checked when it was opened.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Its tag.
    pub tag: Tag,
    /// Its directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
}

impl Snapshot {
    /// The path of a part.
    pub fn part(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Bytes the parts take on disk (allocated blocks: the memory image is sparse).
    pub fn disk_usage(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.manifest
            .part_names()
            .iter()
            .filter_map(|p| std::fs::metadata(self.part(p)).ok())
            .map(|m| m.blocks() * 512)
            .sum()
    }
}

/// A snapshot being written. Dropped without [`Staging::publish`], it is removed.
#[derive(Debug)]
pub struct Staging {
    tag: Tag,
    dir: PathBuf,
    dest: PathBuf,
    published: bool,
    /// Digests known without hashing (parts linked from a sealed parent, or hashed as
    /// they were written).
    known: std::collections::BTreeMap<String, manifest::Part>,
}

impl Staging {
    /// The directory the parts are written into.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The path of a part inside the staging directory.
    pub fn part(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Records a part's digest so that [`Staging::publish`] does not hash it again.
    pub fn know(&mut self, name: &str, part: manifest::Part) {
        self.known.insert(name.to_owned(), part);
    }

    /// Hard-links `from`'s guest assets (kernel, initramfs, root filesystem) into this
    /// snapshot, taking their digests from `from`'s manifest where its seal shows the
    /// file is the one that was hashed (same inode, size and modification time): the
    /// links cost neither a copy nor a re-hash.
    pub fn link_assets_from(&mut self, from: &Snapshot) -> Result<(), SnapshotError> {
        let sealed: Option<Seal> = read_json(&from.dir.join(SEAL)).ok();
        for name in [parts::KERNEL, parts::INITRAMFS, parts::ROOTFS] {
            let src = from.part(name);
            std::fs::hard_link(&src, self.part(name))
                .or_else(|_| std::fs::copy(&src, self.part(name)).map(drop))
                .map_err(io(format!("linking {}", src.display())))?;
            let stamp = FileStamp::of(&self.part(name)).ok();
            if let (Some(seal), Some(stamp), Some(part)) =
                (&sealed, stamp, from.manifest.parts.get(name))
            {
                if seal.files.get(name) == Some(&stamp) {
                    self.know(name, part.clone());
                }
            }
        }
        Ok(())
    }

    /// Hashes every part (in parallel), fills in `manifest.parts`, writes the manifest
    /// and the seal, makes everything read-only, fsyncs, and renames the directory into
    /// place. `progress` hears about the slow step.
    pub fn publish(
        mut self,
        mut manifest: Manifest,
        progress: &dyn Fn(&str),
    ) -> Result<Snapshot, SnapshotError> {
        progress("hashing the snapshot's parts");
        let hashing = std::time::Instant::now();
        manifest.tag = self.tag.to_string();
        let names = manifest.part_names();
        let known = &self.known;
        let digests: Vec<Result<(String, u64), SnapshotError>> = std::thread::scope(|s| {
            let handles: Vec<_> = names
                .iter()
                .map(|p| {
                    let path = self.part(p);
                    let known = known.get(*p).cloned();
                    s.spawn(move || match known {
                        Some(k) => Ok((k.sha256, k.size)),
                        None => sha256_file(&path),
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("hash thread"))
                .collect()
        });
        manifest.parts.clear();
        for (name, d) in names.iter().zip(digests) {
            let (sha256, size) = d?;
            manifest
                .parts
                .insert((*name).to_owned(), manifest::Part { size, sha256 });
        }
        let hashed_ms = u64::try_from(hashing.elapsed().as_millis()).unwrap_or(u64::MAX);
        manifest.build.publish_ms = hashed_ms;
        manifest.build.total_ms = manifest.build.total_ms.saturating_add(hashed_ms);
        let json = serde_json::to_vec_pretty(&manifest).expect("manifests serialize");
        let mpath = self.part(MANIFEST);
        write_synced(&mpath, &json)?;
        let mut seal = Seal {
            files: Default::default(),
        };
        for name in names.iter().chain([&MANIFEST]) {
            let path = self.part(name);
            // QEMU 7.2 opens a memory-backend-file read-write even for a private
            // mapping (its `readonly` would make guest RAM read-only), so the memory
            // image keeps its owner's write bit. Nobody but the owner reads a part: a
            // guest's memory and disk are its secrets.
            make_read_only(&path, if *name == parts::MEMORY { 0o600 } else { 0o400 })?;
            // fsync the data before the stamp is taken: the stamp vouches for it.
            std::fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(io(format!("syncing {}", path.display())))?;
            let stamp = FileStamp::of(&path).map_err(io(format!("stat {}", path.display())))?;
            seal.files.insert((*name).to_owned(), stamp);
        }
        let spath = self.part(SEAL);
        write_synced(
            &spath,
            &serde_json::to_vec_pretty(&seal).expect("seals serialize"),
        )?;
        make_read_only(&spath, 0o400)?;
        fsync_dir(&self.dir)?;
        if self.dest.exists() {
            return Err(SnapshotError::Exists {
                tag: self.tag.to_string(),
            });
        }
        std::fs::rename(&self.dir, &self.dest)
            .map_err(io(format!("renaming {} into place", self.dir.display())))?;
        self.published = true;
        if let Some(parent) = self.dest.parent() {
            fsync_dir(parent)?;
        }
        Ok(Snapshot {
            tag: self.tag.clone(),
            dir: self.dest.clone(),
            manifest,
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.published {
            let _ = remove_tree(&self.dir);
        }
    }
}

impl Store {
    /// The store of a forkd home: `$FORKD_HOME/snapshots`.
    pub fn of_home(home: &forkd_image::Home) -> Store {
        Store::at(home.root().join("snapshots"))
    }

    /// A store rooted at `root`.
    pub fn at(root: impl Into<PathBuf>) -> Store {
        Store { root: root.into() }
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the snapshot `tag` lives (whether or not it exists).
    pub fn path(&self, tag: &Tag) -> PathBuf {
        self.root.join(tag.as_str())
    }

    /// True if a snapshot is published under `tag`.
    pub fn exists(&self, tag: &Tag) -> bool {
        self.path(tag).join(MANIFEST).exists()
    }

    /// Starts writing a snapshot for `tag`. Fails at once if the tag is taken.
    pub fn stage(&self, tag: &Tag) -> Result<Staging, SnapshotError> {
        if self.exists(tag) {
            return Err(SnapshotError::Exists {
                tag: tag.to_string(),
            });
        }
        let staging_root = self.root.join(STAGING);
        std::fs::create_dir_all(&staging_root)
            .map_err(io(format!("creating {}", staging_root.display())))?;
        let dir = staging_root.join(format!("{tag}-{}", forkd_host::ids::random_hex(4)));
        std::fs::create_dir(&dir).map_err(io(format!("creating {}", dir.display())))?;
        Ok(Staging {
            tag: tag.clone(),
            dir,
            dest: self.path(tag),
            published: false,
            known: Default::default(),
        })
    }

    /// A path in the staging area for a scratch file (removed by its user; a crash
    /// leaves it to `remove_staging_of`'s sweep of its prefix).
    pub fn scratch_path(&self, name: &str) -> PathBuf {
        let dir = self.root.join(STAGING);
        let _ = std::fs::create_dir_all(&dir);
        dir.join(format!("{name}-{}", forkd_host::ids::random_hex(4)))
    }

    /// Removes what unfinished builds of `tag` left in the staging area (a build
    /// interrupted by a crash). Only for tags no build is writing now.
    pub fn remove_staging_of(&self, tag: &Tag) {
        let Ok(entries) = std::fs::read_dir(self.root.join(STAGING)) else {
            return;
        };
        let prefix = format!("{tag}-");
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // `{tag}-{8 hex}`: an exact match, so that tag `a` spares `a-b-1234abcd`.
            let rest = name.strip_prefix(&prefix).unwrap_or_default();
            if rest.len() == 8 && rest.chars().all(|c| c.is_ascii_hexdigit()) {
                let _ = remove_tree(&e.path());
            }
        }
    }

    /// Opens a snapshot for forking: reads the manifest and checks the seal (sizes,
    /// inodes and modification times; no hashing).
    pub fn open(&self, tag: &Tag) -> Result<Snapshot, SnapshotError> {
        let dir = self.path(tag);
        let damaged = |detail: String| SnapshotError::Damaged {
            tag: tag.to_string(),
            detail,
        };
        if !dir.is_dir() {
            return Err(SnapshotError::NotFound {
                tag: tag.to_string(),
            });
        }
        let seal: Seal = read_json(&dir.join(SEAL)).map_err(damaged)?;
        // Every file the seal vouches for, the parts first: a damaged part is named
        // even when the manifest was touched too.
        for name in seal.files.keys().filter(|n| n.as_str() != MANIFEST) {
            check_stamp(&dir, &seal, name).map_err(damaged)?;
        }
        check_stamp(&dir, &seal, MANIFEST).map_err(damaged)?;
        let manifest: Manifest = read_json(&dir.join(MANIFEST)).map_err(damaged)?;
        if manifest.format != manifest::FORMAT {
            return Err(damaged(format!(
                "manifest format {} is not the supported {}",
                manifest.format,
                manifest::FORMAT
            )));
        }
        for name in manifest.part_names() {
            if !seal.files.contains_key(name) {
                return Err(damaged(format!("the seal does not cover {name}")));
            }
        }
        for name in manifest.part_names() {
            match manifest.parts.get(name) {
                Some(p) if p.size == seal.files[name].size => {}
                Some(p) => {
                    return Err(damaged(format!(
                        "the manifest gives {name} {} bytes, the file has {}",
                        p.size, seal.files[name].size
                    )))
                }
                None => return Err(damaged(format!("the manifest does not list {name}"))),
            }
        }
        Ok(Snapshot {
            tag: tag.clone(),
            dir,
            manifest,
        })
    }

    /// Opens a snapshot and re-hashes every part against the manifest.
    pub fn verify(&self, tag: &Tag) -> Result<Snapshot, SnapshotError> {
        self.verify_sharing(tag, &mut HashedFiles::default())
    }

    /// [`Store::verify`], hashing a file once however many snapshots of `hashed` hold
    /// it: the links of a chain share their guest assets as hard links of one
    /// read-only file (a 2 GiB rootfs would be read once per link).
    pub(crate) fn verify_sharing(
        &self,
        tag: &Tag,
        hashed: &mut HashedFiles,
    ) -> Result<Snapshot, SnapshotError> {
        let snap = match self.open(tag) {
            Ok(s) => s,
            // A damaged seal still deserves the precise answer the digests give.
            Err(SnapshotError::Damaged { .. }) => self.open_unsealed(tag)?,
            Err(e) => return Err(e),
        };
        for name in snap.manifest.part_names() {
            let expected = &snap.manifest.parts[name].sha256;
            let actual = hashed.sha256(&snap.part(name))?;
            if &actual != expected {
                return Err(SnapshotError::DigestMismatch {
                    tag: tag.to_string(),
                    part: name.to_owned(),
                    expected: expected.clone(),
                    actual,
                });
            }
        }
        // Parts that hash right but whose seal is off (touched, or the seal edited).
        self.open(tag)
    }

    fn open_unsealed(&self, tag: &Tag) -> Result<Snapshot, SnapshotError> {
        let dir = self.path(tag);
        let manifest: Manifest =
            read_json(&dir.join(MANIFEST)).map_err(|detail| SnapshotError::Damaged {
                tag: tag.to_string(),
                detail,
            })?;
        for name in manifest.part_names() {
            if !manifest.parts.contains_key(name) {
                return Err(SnapshotError::Damaged {
                    tag: tag.to_string(),
                    detail: format!("the manifest does not list {name}"),
                });
            }
        }
        Ok(Snapshot {
            tag: tag.clone(),
            dir,
            manifest,
        })
    }

    /// Every published snapshot, by tag. Ones that cannot be opened are listed with
    /// their error.
    pub fn list(&self) -> Vec<(String, Result<Snapshot, SnapshotError>)> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut out: Vec<_> = entries
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|name| !name.starts_with('.'))
            .map(|name| {
                let res = Tag::parse(&name).and_then(|t| self.open(&t));
                (name, res)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Snapshots whose parent is `tag`.
    pub fn dependents(&self, tag: &Tag) -> Vec<String> {
        self.list()
            .into_iter()
            .filter_map(|(name, s)| {
                s.ok()
                    .filter(|s| s.manifest.parent.as_deref() == Some(tag.as_str()))
                    .map(|_| name)
            })
            .collect()
    }

    /// Removes a snapshot. `users` names whatever still runs from it (children): the
    /// removal is refused while there are any, or while other snapshots depend on it.
    pub fn remove(&self, tag: &Tag, users: &[String]) -> Result<(), SnapshotError> {
        let dir = self.path(tag);
        if !dir.is_dir() {
            return Err(SnapshotError::NotFound {
                tag: tag.to_string(),
            });
        }
        let mut all: Vec<String> = users.iter().map(|u| format!("sandbox {u}")).collect();
        all.extend(
            self.dependents(tag)
                .into_iter()
                .map(|d| format!("snapshot {d}")),
        );
        if !all.is_empty() {
            return Err(SnapshotError::InUse {
                tag: tag.to_string(),
                users: all.join(", "),
            });
        }
        // Rename first: the tag disappears in one step, then the files go.
        let doomed = self
            .root
            .join(STAGING)
            .join(format!("rm-{tag}-{}", forkd_host::ids::random_hex(4)));
        std::fs::create_dir_all(self.root.join(STAGING))
            .map_err(io("creating the staging directory"))?;
        std::fs::rename(&dir, &doomed).map_err(io(format!("removing {}", dir.display())))?;
        remove_tree(&doomed)
    }
}

/// Checks that `name` in `dir` is the file the seal vouches for.
fn check_stamp(dir: &Path, seal: &Seal, name: &str) -> Result<(), String> {
    let Some(want) = seal.files.get(name) else {
        return Err(format!("the seal does not cover {name}"));
    };
    let have = FileStamp::of(&dir.join(name)).map_err(|e| format!("{name}: {e}"))?;
    if have.size != want.size {
        return Err(format!(
            "{name} is {} bytes, but was {} bytes when the snapshot was written (truncated or overwritten)",
            have.size, want.size
        ));
    }
    if have != *want {
        return Err(format!(
            "{name} was modified after the snapshot was written"
        ));
    }
    Ok(())
}

/// The digests of the files one verification has read, by file (device and inode: a
/// hard link is the same file).
#[derive(Default)]
pub(crate) struct HashedFiles(std::collections::HashMap<(u64, u64), String>);

impl HashedFiles {
    fn sha256(&mut self, path: &Path) -> Result<String, SnapshotError> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).map_err(io(format!("reading {}", path.display())))?;
        let file = (meta.dev(), meta.ino());
        if let Some(digest) = self.0.get(&file) {
            return Ok(digest.clone());
        }
        let (digest, _) = sha256_file(path)?;
        self.0.insert(file, digest.clone());
        Ok(digest)
    }
}

/// sha256 and length of a file, read in 1 MiB blocks.
pub fn sha256_file(path: &Path) -> Result<(String, u64), SnapshotError> {
    let mut f = std::fs::File::open(path).map_err(io(format!("opening {}", path.display())))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f
            .read(&mut buf)
            .map_err(io(format!("reading {}", path.display())))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((hex::encode(h.finalize()), n))
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, String> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let bytes = std::fs::read(path).map_err(|e| format!("{name}: {e}"))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("{name} is not valid: {e}"))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), SnapshotError> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(io(format!("creating {}", path.display())))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(io(format!("writing {}", path.display())))
}

fn make_read_only(path: &Path, mode: u32) -> Result<(), SnapshotError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(io(format!("making {} read-only", path.display())))
}

fn fsync_dir(dir: &Path) -> Result<(), SnapshotError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io(format!("syncing {}", dir.display())))
}

fn remove_tree(dir: &Path) -> Result<(), SnapshotError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SnapshotError::Io {
            context: format!("removing {}", dir.display()),
            source: e,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftovers_of_interrupted_builds_are_removed_by_exact_tag() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::at(dir.path());
        let staging = dir.path().join(STAGING);
        for name in ["a-0123abcd", "a-b-0123abcd", "a-nothex!", "ab-0123abcd"] {
            std::fs::create_dir_all(staging.join(name)).unwrap();
        }
        store.remove_staging_of(&Tag::parse("a").unwrap());
        let mut left: Vec<String> = std::fs::read_dir(&staging)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["a-b-0123abcd", "a-nothex!", "ab-0123abcd"]);
    }
}
