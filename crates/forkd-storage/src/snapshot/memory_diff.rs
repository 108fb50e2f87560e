//! A chain link's memory: the pages of its RAM image that differ from its parent's.
//!
//! A branch's RAM image is mostly its parent's: the source shared every page it had not
//! written. The link stores only the pages that differ (`memory.diff`); the full image
//! children map (`memory.ram`) is made once, when the branch is written, and can be made
//! again from the chain ([`materialize`]), never per fork.
//!
//! Format (little-endian): `FORKDMD1`, page size (u32), zero (u32), image size (u64),
//! page count (u64), the page indices (u64 each, ascending), then the pages in that order.
//! Holes in both images are skipped without reading (`SEEK_DATA`), so comparing two
//! sparse 1 GiB images costs what their data does.

use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The page granularity of a diff.
pub const PAGE: usize = PAGE_U32 as usize;
const PAGE_U32: u32 = 4096;
const MAGIC: &[u8; 8] = b"FORKDMD1";
const HEADER_LEN: usize = 8 + 4 + 4 + 8 + 8;
const HEADER: u64 = HEADER_LEN as u64;
/// Bytes compared per read.
const CHUNK: usize = 1 << 20;

/// What a diff holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiffStats {
    /// Pages that differ.
    pub pages: u64,
    /// Size of the diff file.
    pub bytes: u64,
    /// Size of the image.
    pub image_size: u64,
}

/// Writes to `out` the pages of `image` that differ from `parent` (same size), and
/// returns what it wrote with the sha256 of `image` (read once, for both).
pub fn write_diff(parent: &Path, image: &Path, out: &Path) -> io::Result<(DiffStats, String)> {
    let img = File::open(image)?;
    let par = File::open(parent)?;
    let size = img.metadata()?.len();
    if par.metadata()?.len() != size {
        return Err(io::Error::other(format!(
            "{} and {} differ in size",
            parent.display(),
            image.display()
        )));
    }
    let mut hash = Sha256::new();
    let mut pages = Vec::new();
    let (mut a, mut b) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
    let zeros = vec![0u8; CHUNK];
    let mut off = 0u64;
    while off < size {
        let len = usize::try_from((size - off).min(CHUNK as u64)).unwrap_or(CHUNK);
        // A chunk with no data in either file is zeros in both: nothing to read.
        let img_data = has_data(&img, off, len)?;
        let par_data = has_data(&par, off, len)?;
        if !img_data {
            hash.update(&zeros[..len]);
            if par_data {
                par.read_exact_at(&mut b[..len], off)?;
                push_differing(&mut pages, off, &zeros[..len], &b[..len]);
            }
        } else {
            img.read_exact_at(&mut a[..len], off)?;
            hash.update(&a[..len]);
            if par_data {
                par.read_exact_at(&mut b[..len], off)?;
                push_differing(&mut pages, off, &a[..len], &b[..len]);
            } else {
                push_differing(&mut pages, off, &a[..len], &zeros[..len]);
            }
        }
        off += len as u64;
    }
    let mut w = io::BufWriter::new(File::create(out)?);
    write_header(&mut w, size, pages.len() as u64)?;
    for p in &pages {
        w.write_all(&p.to_le_bytes())?;
    }
    let mut page = vec![0u8; PAGE];
    for p in &pages {
        read_page(&img, *p, size, &mut page)?;
        w.write_all(&page)?;
    }
    let f = w.into_inner().map_err(io::IntoInnerError::into_error)?;
    f.sync_all()?;
    let stats = DiffStats {
        pages: pages.len() as u64,
        bytes: f.metadata()?.len(),
        image_size: size,
    };
    Ok((stats, hex::encode(hash.finalize())))
}

/// A diff of no pages against an image of `size` bytes: an image that is its base as it
/// is (a sandbox brought from another host, whose RAM file is the very image it was
/// captured in).
pub fn empty(size: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN);
    write_header(&mut out, size, 0).expect("writes to a vector succeed");
    out
}

fn write_header(w: &mut impl Write, size: u64, pages: u64) -> io::Result<()> {
    w.write_all(MAGIC)?;
    w.write_all(&PAGE_U32.to_le_bytes())?;
    w.write_all(&0u32.to_le_bytes())?;
    w.write_all(&size.to_le_bytes())?;
    w.write_all(&pages.to_le_bytes())
}

/// Writes the image a link stands for into `out`: `parent`'s image with `diff`'s pages
/// over it. Holes of the parent stay holes. Returns the sha256 of the result.
pub fn materialize(parent: &Path, diff: &Path, out: &Path) -> io::Result<String> {
    let par = File::open(parent)?;
    let size = par.metadata()?.len();
    let dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(out)?;
    let written = dst
        .set_len(size)
        .and_then(|()| copy_data(&par, &dst, size))
        .and_then(|()| apply(diff, size, &mut |at, pages| dst.write_all_at(pages, at)))
        .and_then(|_| dst.sync_all());
    drop(dst);
    if let Err(e) = written {
        let _ = std::fs::remove_file(out);
        return Err(e);
    }
    sha256_sparse(out)
}

/// Hands `write` the pages of `diff`, made against an image of `size` bytes, as runs of
/// consecutive pages (at most [`CHUNK`] bytes each) with their byte offset, in order.
/// Returns how many pages it handed over. A diff whose header or length does not hold
/// together, or made against an image of another size, is refused before any write; one
/// cut short after its index fails at the point it ends. The file's digest is the
/// caller's to check (on another thread, at the same time: see `sha256_sparse`).
pub fn apply(
    diff: &Path,
    size: u64,
    write: &mut dyn FnMut(u64, &[u8]) -> io::Result<()>,
) -> io::Result<u64> {
    let mut d = io::BufReader::with_capacity(CHUNK, File::open(diff)?);
    let (image_size, count) = read_header(&mut d)?;
    // The header's count must be what the file holds: a diff from an archive is not
    // trusted to size an allocation.
    let expected = count
        .checked_mul(8 + PAGE as u64)
        .and_then(|b| b.checked_add(HEADER));
    if expected != Some(std::fs::metadata(diff)?.len()) {
        return Err(io::Error::other(format!(
            "{}: its header counts {count} pages, which is not what the file holds",
            diff.display()
        )));
    }
    if image_size != size {
        return Err(io::Error::other(format!(
            "{} was made against an image of {image_size} bytes, not {size}",
            diff.display()
        )));
    }
    let mut indices = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    for _ in 0..count {
        let mut b = [0u8; 8];
        d.read_exact(&mut b)?;
        let p = u64::from_le_bytes(b);
        if p.checked_add(1)
            .and_then(|n| n.checked_mul(PAGE as u64))
            .is_none_or(|end| end > size)
        {
            return Err(io::Error::other(format!(
                "{}: page {p} lies beyond the image",
                diff.display()
            )));
        }
        indices.push(p);
    }
    // Pages are read straight into a run of adjacent pages, written out as one.
    let mut run = vec![0u8; CHUNK];
    let (mut run_start, mut run_len) = (0u64, 0usize);
    for p in indices {
        let at = p * PAGE as u64;
        if run_len > 0 && (at != run_start + run_len as u64 || run_len == CHUNK) {
            write(run_start, &run[..run_len])?;
            run_len = 0;
        }
        if run_len == 0 {
            run_start = at;
        }
        d.read_exact(&mut run[run_len..run_len + PAGE])?;
        run_len += PAGE;
    }
    if run_len > 0 {
        write(run_start, &run[..run_len])?;
    }
    Ok(count)
}

/// Copies a (sparse) image: its data regions at the same offsets, holes left holes.
pub fn copy_sparse(src: &Path, out: &Path) -> io::Result<()> {
    let s = File::open(src)?;
    let size = s.metadata()?.len();
    let d = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(out)?;
    d.set_len(size)?;
    copy_data(&s, &d, size)?;
    d.sync_all()
}

/// The image size and page count a diff's header gives.
pub fn read_header(r: &mut impl Read) -> io::Result<(u64, u64)> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h)
        .map_err(|e| io::Error::other(format!("the memory diff is truncated ({e})")))?;
    if &h[..8] != MAGIC {
        return Err(io::Error::other("not a forkd memory diff"));
    }
    let page = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
    if page as usize != PAGE {
        return Err(io::Error::other(format!(
            "memory diff page size {page} is not {PAGE}"
        )));
    }
    let size = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
    let count = u64::from_le_bytes(h[24..32].try_into().expect("8 bytes"));
    Ok((size, count))
}

/// sha256 of a (sparse) file, holes hashed as zeros without reading them.
pub fn sha256_sparse(path: &Path) -> io::Result<String> {
    let f = File::open(path)?;
    let size = f.metadata()?.len();
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let zeros = vec![0u8; CHUNK];
    let mut off = 0u64;
    while off < size {
        let len = usize::try_from((size - off).min(CHUNK as u64)).unwrap_or(CHUNK);
        if has_data(&f, off, len)? {
            f.read_exact_at(&mut buf[..len], off)?;
            hash.update(&buf[..len]);
        } else {
            hash.update(&zeros[..len]);
        }
        off += len as u64;
    }
    Ok(hex::encode(hash.finalize()))
}

fn push_differing(pages: &mut Vec<u64>, off: u64, a: &[u8], b: &[u8]) {
    for (i, (pa, pb)) in a.chunks(PAGE).zip(b.chunks(PAGE)).enumerate() {
        if pa != pb {
            pages.push(off / PAGE as u64 + i as u64);
        }
    }
}

fn read_page(f: &File, index: u64, size: u64, page: &mut [u8]) -> io::Result<()> {
    let at = index * PAGE as u64;
    let len = usize::try_from((size - at).min(PAGE as u64)).unwrap_or(PAGE);
    page.fill(0);
    f.read_exact_at(&mut page[..len], at)
}

/// True if `f` has data (not only a hole) in `[off, off + len)`.
pub(crate) fn has_data(f: &File, off: u64, len: usize) -> io::Result<bool> {
    match next_data(f, off)? {
        Some(d) => Ok(d < off + len as u64),
        None => Ok(false),
    }
}

/// The offset of the first data at or after `off`, or None if only holes follow.
fn next_data(f: &File, off: u64) -> io::Result<Option<u64>> {
    use nix::unistd::{lseek, Whence};
    use std::os::fd::AsRawFd;
    let Ok(at) = i64::try_from(off) else {
        return Ok(None);
    };
    match lseek(f.as_raw_fd(), at, Whence::SeekData) {
        Ok(r) => Ok(u64::try_from(r).ok()),
        Err(nix::errno::Errno::ENXIO) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Copies the data regions of `src` into `dst` at the same offsets (holes stay holes).
fn copy_data(src: &File, dst: &File, size: u64) -> io::Result<()> {
    use nix::unistd::{lseek, Whence};
    use std::os::fd::AsRawFd;
    let mut off = 0u64;
    while let Some(start) = next_data(src, off)? {
        if start >= size {
            break;
        }
        let end = i64::try_from(start)
            .ok()
            .and_then(|start| lseek(src.as_raw_fd(), start, Whence::SeekHole).ok())
            .and_then(|e| u64::try_from(e).ok())
            .map_or(size, |e| e.min(size));
        let mut s = src.try_clone()?;
        s.seek(SeekFrom::Start(start))?;
        let mut d = dst.try_clone()?;
        d.seek(SeekFrom::Start(start))?;
        io::copy(&mut s.take(end - start), &mut d)?;
        off = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(path: &Path, pages: &[(u64, u8)], size: u64) {
        let f = File::create(path).unwrap();
        f.set_len(size).unwrap();
        for (p, byte) in pages {
            f.write_all_at(&vec![*byte; PAGE], p * PAGE as u64).unwrap();
        }
    }

    #[test]
    fn an_empty_diff_applies_nothing_and_is_refused_against_another_size() {
        let dir = tempfile::tempdir().unwrap();
        let (size, diff) = (64 * PAGE as u64, dir.path().join("d"));
        std::fs::write(&diff, empty(size)).unwrap();
        assert_eq!(std::fs::metadata(&diff).unwrap().len(), HEADER);
        let mut writes = 0;
        let applied = apply(&diff, size, &mut |_, _| {
            writes += 1;
            Ok(())
        });
        assert_eq!(applied.unwrap(), 0);
        assert_eq!(writes, 0);
        assert!(apply(&diff, size * 2, &mut |_, _| Ok(())).is_err());
    }

    #[test]
    fn a_diff_holds_only_changed_pages_and_rebuilds_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let size = 600 * PAGE as u64;
        let (parent, child) = (dir.path().join("p"), dir.path().join("c"));
        // Same page 3, page 10 changed, page 20 new, page 500 zeroed in the child.
        image(&parent, &[(3, 7), (10, 1), (500, 9)], size);
        image(&child, &[(3, 7), (10, 2), (20, 5)], size);
        let f = File::options().write(true).open(&child).unwrap();
        f.write_all_at(&vec![0u8; PAGE], 500 * PAGE as u64).unwrap();
        let diff = dir.path().join("d");
        let (stats, sha) = write_diff(&parent, &child, &diff).unwrap();
        assert_eq!(stats.pages, 3, "{stats:?}");
        assert_eq!(stats.bytes, HEADER + 3 * 8 + 3 * PAGE as u64);
        assert_eq!(sha, sha256_sparse(&child).unwrap());
        let out = dir.path().join("m");
        let rebuilt = materialize(&parent, &diff, &out).unwrap();
        assert_eq!(rebuilt, sha);
        assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&child).unwrap());
        // The rebuilt image is as sparse as the parent's.
        use std::os::unix::fs::MetadataExt;
        assert!(std::fs::metadata(&out).unwrap().blocks() * 512 < size / 10);
    }

    #[test]
    fn a_truncated_or_foreign_diff_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let size = 64 * PAGE as u64;
        let (parent, child) = (dir.path().join("p"), dir.path().join("c"));
        image(&parent, &[(1, 1)], size);
        image(&child, &[(1, 2)], size);
        let diff = dir.path().join("d");
        write_diff(&parent, &child, &diff).unwrap();
        let bytes = std::fs::read(&diff).unwrap();
        std::fs::write(&diff, &bytes[..bytes.len() - 100]).unwrap();
        assert!(materialize(&parent, &diff, &dir.path().join("m1")).is_err());
        std::fs::write(&diff, b"not a diff at all, really not one").unwrap();
        let e = materialize(&parent, &diff, &dir.path().join("m2")).unwrap_err();
        assert!(e.to_string().contains("not a forkd memory diff"), "{e}");
        let other = dir.path().join("o");
        image(&other, &[], size * 2);
        std::fs::write(&diff, &bytes).unwrap();
        assert!(materialize(&other, &diff, &dir.path().join("m3")).is_err());
        for m in ["m1", "m2", "m3"] {
            assert!(!dir.path().join(m).exists(), "{m} was left behind");
        }
    }

    #[test]
    fn applying_a_diff_hands_over_runs_of_pages() {
        let dir = tempfile::tempdir().unwrap();
        let size = 64 * PAGE as u64;
        let (parent, child) = (dir.path().join("p"), dir.path().join("c"));
        image(&parent, &[], size);
        image(&child, &[(4, 1), (5, 2), (6, 3), (9, 4)], size);
        let diff = dir.path().join("d");
        write_diff(&parent, &child, &diff).unwrap();
        let mut runs = Vec::new();
        let pages = apply(&diff, size, &mut |at, data| {
            runs.push((at / PAGE as u64, data.len() / PAGE, data[0]));
            Ok(())
        })
        .unwrap();
        assert_eq!(runs, [(4, 3, 1), (9, 1, 4)]);
        assert_eq!(pages, 4);
        let e = apply(&diff, size * 2, &mut |_, _| Ok(())).unwrap_err();
        assert!(e.to_string().contains("not"), "{e}");
    }
}
