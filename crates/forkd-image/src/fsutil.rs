//! File-system helpers shared by the builders: crash-safe publishing, hashing,
//! space accounting and safe removal of scratch trees.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{ImageError, Result};

pub(crate) fn create_dir_all(path: &Path) -> Result<()> {
    fs::create_dir_all(path).map_err(|e| ImageError::io("create directory", path, e))
}

/// fsync a directory so that a rename into it survives a crash.
pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| ImageError::io("sync directory", dir, e))
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Publishes the finished file `tmp` as `dest`: fsync, rename (atomic within one
/// file system), fsync the directory. Readers see either the old file or the new
/// one, never a partial one.
pub(crate) fn publish(tmp: &Path, dest: &Path) -> Result<()> {
    File::open(tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| ImageError::io("sync", tmp, e))?;
    fs::rename(tmp, dest).map_err(|e| ImageError::io("rename into place", dest, e))?;
    fsync_dir(parent_of(dest))
}

/// Writes `bytes` to `dest` through a temporary file in the same directory.
/// The file is 0600: the data directory's files are its owner's alone.
pub(crate) fn write_atomic(dest: &Path, bytes: &[u8]) -> Result<()> {
    forkd_host::atomic_file::write(dest, bytes).map_err(|e| ImageError::io("write", dest, e))
}

/// A writer that hashes and counts what passes through it, so an asset's digest
/// is computed while it is written instead of by reading it back.
pub(crate) struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    written: u64,
}

impl<W: Write> HashingWriter<W> {
    pub(crate) fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hasher: Sha256::new(),
            written: 0,
        }
    }

    /// The wrapped writer, the hex sha256 and the byte count.
    pub(crate) fn finish(self) -> (W, String, u64) {
        (
            self.inner,
            hex::encode(self.hasher.finalize()),
            self.written,
        )
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// The hex sha256 and size of a file.
pub(crate) fn sha256_file(path: &Path) -> Result<(String, u64)> {
    let mut f = File::open(path).map_err(|e| ImageError::io("open", path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| ImageError::io("read", path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((hex::encode(hasher.finalize()), size))
}

/// Bytes a tree will occupy on a fresh ext4 file system, roughly: every file and
/// directory rounded up to 4 KiB blocks, hard links counted once.
pub(crate) fn tree_usage(root: &Path) -> Result<u64> {
    const BLOCK: u64 = 4096;
    let mut seen = HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        total += BLOCK;
        let entries = fs::read_dir(&dir).map_err(|e| ImageError::io("list", &dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| ImageError::io("list", &dir, e))?;
            let path = entry.path();
            let md = fs::symlink_metadata(&path).map_err(|e| ImageError::io("stat", &path, e))?;
            if md.is_dir() {
                stack.push(path);
            } else if md.nlink() > 1 && !seen.insert((md.dev(), md.ino())) {
                continue;
            } else {
                total += md.len().div_ceil(BLOCK) * BLOCK;
            }
        }
    }
    Ok(total)
}

/// Bytes available to unprivileged writers on the file system holding `path`.
pub(crate) fn free_bytes(path: &Path) -> Result<u64> {
    let st = nix::sys::statvfs::statvfs(path)
        .map_err(|e| ImageError::io("check free space of", path, io::Error::from(e)))?;
    // The field widths differ between libc targets; widen before multiplying.
    #[allow(clippy::useless_conversion)]
    let free = u64::from(st.blocks_available()) * u64::from(st.fragment_size());
    Ok(free)
}

/// Removes a scratch tree. A failed debootstrap can leave `proc`/`sys` mounted
/// inside its target; deleting through a mount point would delete host files, so
/// everything mounted under `dir` is detached first.
pub(crate) fn remove_tree(dir: &Path) -> Result<()> {
    let canonical = match fs::canonicalize(dir) {
        Ok(c) => c,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(ImageError::io("resolve", dir, e)),
    };
    unmount_under(&canonical)?;
    match fs::remove_dir_all(&canonical) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ImageError::io("remove", canonical, e)),
    }
}

/// Detaches every mount at or below `dir` (deepest first).
pub(crate) fn unmount_under(dir: &Path) -> Result<()> {
    let canonical = fs::canonicalize(dir).map_err(|e| ImageError::io("resolve", dir, e))?;
    let mut mounts = mounts_under(&canonical);
    // Deepest first, so a mount inside another mount is detached before its parent.
    mounts.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    for m in &mounts {
        tracing::warn!(mount = %m.display(), "detaching a mount left in a build directory");
        nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH)
            .map_err(|e| ImageError::io("unmount", m, io::Error::from(e)))?;
    }
    Ok(())
}

fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(text) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    parse_mount_points(&text)
        .into_iter()
        .filter(|m| m.starts_with(dir))
        .collect()
}

/// Mount points of a mountinfo text, with the kernel's octal escapes undone.
fn parse_mount_points(mountinfo: &str) -> Vec<PathBuf> {
    forkd_host::mountinfo::parse(mountinfo)
        .into_iter()
        .map(|m| m.mount_point)
        .collect()
}

/// A scratch directory under the images tmp dir, removed (mount-safely) on drop,
/// whether the build succeeded or not.
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// A new directory in `parent`, its name starting with `prefix`.
    pub fn new(parent: &Path, prefix: &str) -> Result<ScratchDir> {
        create_dir_all(parent)?;
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in(parent)
            .map_err(|e| ImageError::io("create a scratch directory in", parent, e))?;
        // Removal is ours (mount-safe), not tempfile's.
        Ok(ScratchDir { path: dir.keep() })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Err(e) = remove_tree(&self.path) {
            tracing::warn!("{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_points() {
        let text = "22 1 8:1 / / rw - ext4 /dev/vda rw\n\
                    30 22 0:5 / /tmp/a\\040b/proc rw - proc proc rw\n";
        assert_eq!(
            parse_mount_points(text),
            vec![PathBuf::from("/"), PathBuf::from("/tmp/a b/proc")]
        );
    }

    #[test]
    fn atomic_write_and_hash() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        write_atomic(&p, b"abc").unwrap();
        let (h, n) = sha256_file(&p).unwrap();
        assert_eq!(n, 3);
        assert_eq!(
            h,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let mut w = HashingWriter::new(Vec::new());
        w.write_all(b"abc").unwrap();
        let (_, h2, n2) = w.finish();
        assert_eq!((h2, n2), (h, 3));
    }

    #[test]
    fn usage_counts_blocks() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("a"), vec![0u8; 5000]).unwrap();
        fs::create_dir(dir.path().join("d")).unwrap();
        fs::hard_link(dir.path().join("a"), dir.path().join("d/b")).unwrap();
        // root dir + d + one 8 KiB file (the hard link is not counted twice)
        assert_eq!(tree_usage(dir.path()).unwrap(), 4096 * 2 + 8192);
    }
}
