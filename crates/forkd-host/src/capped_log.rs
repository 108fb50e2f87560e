//! A log capped in size over two files, and the last lines of one: where a VM's serial
//! console and its hypervisor's stderr are kept, whatever the backend.
//!
//! On disk: `NAME` up to half of the cap, then renamed to `NAME.1` (the older half is
//! dropped), so the two files never hold more than the cap; error messages read the
//! last lines back without reading a whole log.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Most bytes read from the end of a log to find its last lines: error messages quote
/// a few dozen lines, never a whole log.
pub const TAIL_BYTES: u64 = 64 << 10;

/// An append-only log capped at `cap` bytes over two files: `path` holds up to `cap / 2`
/// bytes, then becomes `path.1` and a new `path` starts.
pub struct CappedLog {
    path: PathBuf,
    older: PathBuf,
    file: File,
    len: u64,
    half: u64,
}

impl CappedLog {
    /// Opens `path` for appending (it may hold what an earlier reader wrote).
    pub fn open(path: &Path, cap: u64) -> std::io::Result<CappedLog> {
        let half = (cap / 2).max(1);
        let older = rotated(path);
        // Files over half the cap were written under a larger one: they would break the
        // bound, so they go.
        for p in [path, older.as_path()] {
            if std::fs::metadata(p).is_ok_and(|m| m.len() > half) {
                std::fs::remove_file(p)?;
            }
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let len = file.metadata()?.len();
        Ok(CappedLog {
            path: path.to_owned(),
            older,
            file,
            len,
            half,
        })
    }

    /// Appends `data`, rotating whenever the current file is full.
    pub fn write(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        // Of a write larger than both files, only its end can stay.
        if let Some(over) = usize::try_from(2 * self.half)
            .ok()
            .and_then(|keep| data.len().checked_sub(keep))
        {
            data = &data[over..];
        }
        while !data.is_empty() {
            if self.len >= self.half {
                self.rotate()?;
            }
            let room = usize::try_from(self.half - self.len).unwrap_or(usize::MAX);
            let (now, rest) = data.split_at(room.min(data.len()));
            self.file.write_all(now)?;
            self.len += now.len() as u64;
            data = rest;
        }
        Ok(())
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        std::fs::rename(&self.path, &self.older)?;
        self.file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        self.len = 0;
        Ok(())
    }
}

/// `console.log` → `console.log.1`.
pub fn rotated(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".1");
    PathBuf::from(p)
}

/// The last `lines` lines of the log at `path` (and of its rotated part, when the current
/// file is shorter than that), read from at most [`TAIL_BYTES`] at the end, lossily
/// decoded. Missing files read as empty.
pub fn tail(path: &Path, lines: usize) -> String {
    let mut data = last_bytes(path, TAIL_BYTES);
    let missing = TAIL_BYTES - data.len() as u64;
    if missing > 0 {
        let mut older = last_bytes(&rotated(path), missing);
        older.append(&mut data);
        data = older;
    }
    let text = String::from_utf8_lossy(&data);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Up to `max` bytes from the end of `path`; empty when it cannot be read.
fn last_bytes(path: &Path, max: u64) -> Vec<u8> {
    let Ok(mut f) = File::open(path) else {
        return Vec::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(max);
    if f.seek(SeekFrom::Start(start)).is_err() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let _ = f.take(max).read_to_end(&mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_disk(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum()
    }

    #[test]
    fn the_log_never_exceeds_its_cap_and_keeps_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let mut log = CappedLog::open(&path, 1000).unwrap();
        let mut written = Vec::new();
        for i in 0..2000 {
            let line = format!("line {i}\n");
            log.write(line.as_bytes()).unwrap();
            written.extend_from_slice(line.as_bytes());
            assert!(on_disk(dir.path()) <= 1000);
        }
        assert!(on_disk(dir.path()) > 500, "the older half is kept");
        let mut kept = std::fs::read(rotated(&path)).unwrap();
        kept.extend(std::fs::read(&path).unwrap());
        assert!(
            written.ends_with(&kept),
            "the files hold the last bytes, in order"
        );
        assert_eq!(tail(&path, 2), "line 1998\nline 1999");

        // One write far larger than the cap keeps its end.
        log.write(&[b'x'; 10_000]).unwrap();
        log.write(b"\nend\n").unwrap();
        assert!(on_disk(dir.path()) <= 1000);
        assert_eq!(tail(&path, 1), "end");
    }

    #[test]
    fn a_reopened_log_appends_within_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        CappedLog::open(&path, 100)
            .unwrap()
            .write(&[b'a'; 40])
            .unwrap();
        let mut log = CappedLog::open(&path, 100).unwrap();
        log.write(&[b'b'; 20]).unwrap();
        // 40 + 20 > 50: the first file was rotated when it filled.
        assert_eq!(std::fs::read(rotated(&path)).unwrap().len(), 50);
        assert!(on_disk(dir.path()) <= 100);

        // Reopened with a smaller cap: files over the new half do not survive.
        std::fs::write(&path, [b'c'; 80]).unwrap();
        let mut log = CappedLog::open(&path, 20).unwrap();
        log.write(b"d").unwrap();
        assert!(on_disk(dir.path()) <= 20, "{}", on_disk(dir.path()));
    }

    #[test]
    fn the_tail_reads_only_the_end_of_a_large_log() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.log");
        let mut f = File::create(&path).unwrap();
        // A 4 MiB line without end, then three lines.
        f.write_all(&vec![b'z'; 4 << 20]).unwrap();
        f.write_all(b"\none\ntwo\nthree\n").unwrap();
        drop(f);
        assert_eq!(tail(&path, 2), "two\nthree");
        let all = tail(&path, 100);
        assert!(all.len() as u64 <= TAIL_BYTES, "{}", all.len());
        assert!(all.ends_with("one\ntwo\nthree"));
        assert_eq!(tail(&dir.path().join("missing"), 5), "");
    }

    #[test]
    fn the_tail_spans_the_rotated_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        std::fs::write(rotated(&path), "old 1\nold 2\n").unwrap();
        std::fs::write(&path, "new 1\n").unwrap();
        assert_eq!(tail(&path, 2), "old 2\nnew 1");
    }
}
