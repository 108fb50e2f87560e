//! A part as a blob: zstd-compressed, hashed on both sides, and back.
//!
//! Compression reads a sparse part's holes as zeros without reading the disk (zstd turns
//! them into a few bytes). Decompression writes zero pages as holes, so an unpacked
//! memory image or root filesystem takes the space its data takes, and it stops at the
//! size the snapshot's manifest gives: a blob that inflates past it is refused before it
//! fills the disk.

use crate::snapshot::memory_diff::{has_data, PAGE};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Bytes handled per step.
const CHUNK: usize = 1 << 20;
/// zstd's level: fast, and most of what a memory image gives is had by then.
const LEVEL: i32 = 3;

/// What [`compress`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compressed {
    /// Hex sha256 of the part (uncompressed).
    pub part_sha256: String,
    /// The part's size.
    pub part_size: u64,
    /// Bytes of its non-zero pages: what [`decompress`] writes back (the rest are
    /// holes), so what unpacking it takes on disk.
    pub stored: u64,
    /// Hex sha256 of the blob.
    pub blob_sha256: String,
    /// The blob's size.
    pub blob_size: u64,
}

/// A writer that hashes and counts what passes through (the blob files of packs,
/// archives received, docker archives read and image layouts copied).
pub(crate) struct Hashing<W> {
    inner: W,
    hash: Sha256,
    len: u64,
}

impl<W: Write> Hashing<W> {
    /// Hashes what is written to `inner`.
    pub(crate) fn new(inner: W) -> Hashing<W> {
        Hashing {
            inner,
            hash: Sha256::new(),
            len: 0,
        }
    }

    /// The writer back, the hex sha256 and the length of what was written.
    pub(crate) fn finish(self) -> (W, String, u64) {
        (self.inner, hex::encode(self.hash.finalize()), self.len)
    }
}

impl Hashing<io::BufWriter<File>> {
    /// Writes to the new file `path`, buffered.
    pub(crate) fn create(path: &Path) -> io::Result<Self> {
        Ok(Hashing::new(io::BufWriter::with_capacity(
            CHUNK,
            File::create(path)?,
        )))
    }

    /// Flushes and syncs the file; returns the hex sha256 and the length.
    pub(crate) fn sync(self) -> io::Result<(String, u64)> {
        let (out, hex, len) = self.finish();
        out.into_inner()
            .map_err(io::IntoInnerError::into_error)?
            .sync_all()?;
        Ok((hex, len))
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Compresses the part `src` into the new file `dst`.
pub fn compress(src: &Path, dst: &Path) -> io::Result<Compressed> {
    let input = File::open(src)?;
    let size = input.metadata()?.len();
    let out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)?;
    let sink = Hashing::new(io::BufWriter::with_capacity(CHUNK, out));
    let mut enc = zstd::stream::write::Encoder::new(sink, LEVEL)?;
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    enc.multithread(u32::try_from(workers).unwrap_or(1))?;
    enc.include_checksum(true)?;
    let mut part_hash = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let zeros = vec![0u8; CHUNK];
    let mut off = 0u64;
    let mut stored = 0u64;
    while off < size {
        let len = usize::try_from((size - off).min(CHUNK as u64)).unwrap_or(CHUNK);
        let chunk = if has_data(&input, off, len)? {
            input.read_exact_at(&mut buf[..len], off)?;
            stored += non_zero_pages(&buf[..len]);
            &buf[..len]
        } else {
            &zeros[..len]
        };
        part_hash.update(chunk);
        enc.write_all(chunk)?;
        off += len as u64;
    }
    let (blob_sha256, blob_size) = enc.finish()?.sync()?;
    Ok(Compressed {
        part_sha256: hex::encode(part_hash.finalize()),
        part_size: size,
        stored,
        blob_sha256,
        blob_size,
    })
}

/// Why a blob could not be turned back into its part.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// It decompresses to more than the part's size.
    #[error("it decompresses to more than the {0} bytes its manifest gives")]
    TooLong(u64),
    /// It ends early.
    #[error("it decompresses to {got} bytes, not the {want} its manifest gives")]
    TooShort {
        /// Bytes it gave.
        got: u64,
        /// Bytes expected.
        want: u64,
    },
    /// It has more data than its layer said (see [`super::STORED_ANNOTATION`]).
    #[error("it holds more than the {0} bytes of data its layer said (refused before it could fill the disk)")]
    MoreThanStated(u64),
    /// It is not valid zstd, or reading or writing failed.
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Decompresses `blob` into the new file `dst`, which must come out `size` bytes long;
/// zero pages are left as holes. Returns the hex sha256 of what was written.
pub fn decompress(blob: &Path, dst: &Path, size: u64) -> Result<String, DecodeError> {
    decompress_bounded(blob, dst, size, None)
}

/// [`decompress`], also refusing more than `stored` bytes of non-zero pages (what the
/// free space was checked against).
pub fn decompress_bounded(
    blob: &Path,
    dst: &Path,
    size: u64,
    stored: Option<u64>,
) -> Result<String, DecodeError> {
    let mut dec = zstd::stream::read::Decoder::new(File::open(blob)?)?;
    let out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dst)?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0u64;
    let mut written = 0u64;
    loop {
        let n = read_full(&mut dec, &mut buf)?;
        if n == 0 {
            break;
        }
        if off + n as u64 > size {
            return Err(DecodeError::TooLong(size));
        }
        hash.update(&buf[..n]);
        if let Some(limit) = stored {
            written += non_zero_pages(&buf[..n]);
            if written > limit {
                return Err(DecodeError::MoreThanStated(limit));
            }
        }
        write_sparse(&out, &buf[..n], off)?;
        off += n as u64;
    }
    if off != size {
        return Err(DecodeError::TooShort {
            got: off,
            want: size,
        });
    }
    out.set_len(size)?;
    out.sync_all()?;
    Ok(hex::encode(hash.finalize()))
}

/// Fills `buf` unless the stream ends first; returns how much was read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Bytes of the pages of `data` that are not all zeros.
fn non_zero_pages(data: &[u8]) -> u64 {
    data.chunks(PAGE)
        .filter(|page| page.iter().any(|b| *b != 0))
        .map(|page| page.len() as u64)
        .sum()
}

/// Writes the runs of non-zero pages of `data` at `off`; zero pages are skipped.
fn write_sparse(f: &File, data: &[u8], off: u64) -> io::Result<()> {
    let mut run: Option<usize> = None;
    for (i, page) in data.chunks(PAGE).enumerate() {
        let zero = page.iter().all(|b| *b == 0);
        match (zero, run) {
            (false, None) => run = Some(i * PAGE),
            (true, Some(start)) => {
                f.write_all_at(&data[start..i * PAGE], off + start as u64)?;
                run = None;
            }
            _ => {}
        }
    }
    if let Some(start) = run {
        f.write_all_at(&data[start..], off + start as u64)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_sparse_part_round_trips_with_its_holes() {
        let dir = tempfile::tempdir().unwrap();
        let part = dir.path().join("memory.ram");
        let f = File::create(&part).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&[7u8; 10_000], 5 << 20).unwrap();
        f.write_all_at(b"end", (64 << 20) - 3).unwrap();
        drop(f);
        let blob = dir.path().join("blob");
        let c = compress(&part, &blob).unwrap();
        assert_eq!(c.part_size, 64 << 20);
        assert_eq!(
            c.stored,
            4 * PAGE as u64,
            "three pages of 7s and the last one"
        );
        assert!(
            c.blob_size < 64 << 10,
            "holes cost nothing: {}",
            c.blob_size
        );
        let (sha, _) = crate::snapshot::sha256_file(&part).unwrap();
        assert_eq!(c.part_sha256, sha);
        assert_eq!(
            c.blob_sha256,
            crate::snapshot::sha256_file(&blob).unwrap().0
        );

        let back = dir.path().join("back");
        assert_eq!(decompress(&blob, &back, 64 << 20).unwrap(), sha);
        assert_eq!(std::fs::read(&back).unwrap(), std::fs::read(&part).unwrap());
        let allocated = std::fs::metadata(&back).unwrap().blocks() * 512;
        assert!(allocated < 1 << 20, "written sparse: {allocated}");
    }

    #[test]
    fn a_blob_longer_or_shorter_than_its_part_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let part = dir.path().join("part");
        std::fs::write(&part, vec![1u8; 3 << 20]).unwrap();
        let blob = dir.path().join("blob");
        compress(&part, &blob).unwrap();
        let e = decompress(&blob, &dir.path().join("a"), 1 << 20).unwrap_err();
        assert!(matches!(e, DecodeError::TooLong(_)), "{e}");
        let e = decompress(&blob, &dir.path().join("b"), 4 << 20).unwrap_err();
        assert!(matches!(e, DecodeError::TooShort { .. }), "{e}");
        let e =
            decompress_bounded(&blob, &dir.path().join("d"), 3 << 20, Some(1 << 20)).unwrap_err();
        assert!(matches!(e, DecodeError::MoreThanStated(_)), "{e}");
        std::fs::write(&blob, b"not zstd at all").unwrap();
        assert!(decompress(&blob, &dir.path().join("c"), 3 << 20).is_err());
    }
}
