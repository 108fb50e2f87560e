//! A writer for the "newc" (SVR4, no CRC) cpio format: the format the kernel
//! unpacks an initramfs from. Entries carry fixed metadata (uid 0, mtime 0), so
//! the same inputs give a byte-identical archive.

use std::io::{self, Read, Write};

const MAGIC: &str = "070701";
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFCHR: u32 = 0o020000;
const TRAILER: &str = "TRAILER!!!";

/// Streams a newc archive into `W`. Names are given without a leading `/`.
pub(crate) struct NewcWriter<W: Write> {
    out: W,
    /// Bytes written so far, for the 4-byte alignment the format requires.
    offset: u64,
    next_ino: u32,
}

impl<W: Write> NewcWriter<W> {
    pub(crate) fn new(out: W) -> Self {
        NewcWriter {
            out,
            offset: 0,
            // Inode 0 is avoided; some readers treat it as "no inode".
            next_ino: 1,
        }
    }

    pub(crate) fn dir(&mut self, name: &str, perm: u32) -> io::Result<()> {
        self.header(name, S_IFDIR | (perm & 0o7777), 2, 0, (0, 0))
    }

    pub(crate) fn char_device(
        &mut self,
        name: &str,
        perm: u32,
        major: u32,
        minor: u32,
    ) -> io::Result<()> {
        self.header(name, S_IFCHR | (perm & 0o7777), 1, 0, (major, minor))
    }

    pub(crate) fn file(&mut self, name: &str, perm: u32, data: &[u8]) -> io::Result<()> {
        self.file_from(name, perm, data.len() as u64, &mut &data[..])
    }

    /// A regular file of exactly `size` bytes read from `data`.
    pub(crate) fn file_from(
        &mut self,
        name: &str,
        perm: u32,
        size: u64,
        data: &mut dyn Read,
    ) -> io::Result<()> {
        let size32 = u32::try_from(size).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name} is over 4 GiB, too large for cpio"),
            )
        })?;
        self.header(name, S_IFREG | (perm & 0o7777), 1, size32, (0, 0))?;
        let copied = io::copy(&mut data.take(size), &mut self.out)?;
        if copied != size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{name} shrank while being archived ({copied} of {size} bytes)"),
            ));
        }
        self.offset += size;
        self.pad()
    }

    /// Writes the trailer entry and returns the inner writer.
    pub(crate) fn finish(mut self) -> io::Result<W> {
        self.next_ino = 0;
        self.header(TRAILER, 0, 1, 0, (0, 0))?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn header(
        &mut self,
        name: &str,
        mode: u32,
        nlink: u32,
        size: u32,
        rdev: (u32, u32),
    ) -> io::Result<()> {
        if name.starts_with('/') || name.contains('\0') || name.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bad cpio entry name {name:?}"),
            ));
        }
        let ino = if name == TRAILER { 0 } else { self.next_ino };
        self.next_ino = self.next_ino.wrapping_add(1);
        let namesize = name.len() + 1;
        let fields: [u32; 13] = [
            ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime: fixed, for reproducible archives
            size,
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            u32::try_from(namesize)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name too long"))?,
            0, // check (only used by the crc variant)
        ];
        let mut h = String::with_capacity(110 + namesize);
        h.push_str(MAGIC);
        for f in fields {
            h.push_str(&format!("{f:08x}"));
        }
        h.push_str(name);
        h.push('\0');
        self.out.write_all(h.as_bytes())?;
        self.offset += h.len() as u64;
        self.pad()
    }

    fn pad(&mut self) -> io::Result<()> {
        let pad = (4 - (self.offset % 4)) % 4;
        self.out.write_all(&[0u8; 3][..pad as usize])?;
        self.offset += pad;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    fn sample() -> Vec<u8> {
        let mut w = NewcWriter::new(Vec::new());
        w.dir("dev", 0o755).unwrap();
        w.char_device("dev/console", 0o600, 5, 1).unwrap();
        w.dir("modules", 0o755).unwrap();
        w.file("init", 0o755, b"#!hello\n").unwrap();
        w.file("forkd-initramfs", 0o644, b"").unwrap();
        w.file("modules/00-a.ko", 0o644, b"abcde").unwrap();
        w.finish().unwrap()
    }

    fn cpio(args: &[&str], input: &[u8]) -> String {
        let mut child = Command::new("cpio")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cpio is installed on build hosts");
        child.stdin.take().unwrap().write_all(input).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "cpio: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn cpio_lists_entries() {
        let a = sample();
        assert_eq!(a.len() % 4, 0);
        let list = cpio(&["-it", "--quiet"], &a);
        assert_eq!(
            list.lines().collect::<Vec<_>>(),
            [
                "dev",
                "dev/console",
                "modules",
                "init",
                "forkd-initramfs",
                "modules/00-a.ko"
            ]
        );
        let long = cpio(&["-itv", "--quiet"], &a);
        let console = long.lines().find(|l| l.ends_with("dev/console")).unwrap();
        assert!(console.starts_with("crw-------"), "{console}");
        assert!(console.contains("5,"), "{console}");
        let init = long.lines().find(|l| l.ends_with(" init")).unwrap();
        assert!(init.starts_with("-rwxr-xr-x"), "{init}");
    }

    #[test]
    fn cpio_extracts_contents() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new("cpio")
            .args([
                "-id",
                "--quiet",
                "--no-absolute-filenames",
                "init",
                "modules/00-a.ko",
            ])
            .current_dir(dir.path())
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(&sample()).unwrap();
        assert!(child.wait().unwrap().success());
        assert_eq!(
            std::fs::read(dir.path().join("init")).unwrap(),
            b"#!hello\n"
        );
        assert_eq!(
            std::fs::read(dir.path().join("modules/00-a.ko")).unwrap(),
            b"abcde"
        );
    }

    #[test]
    fn reproducible_and_rejects_bad_names() {
        assert_eq!(sample(), sample());
        let mut w = NewcWriter::new(Vec::new());
        assert!(w.dir("/abs", 0o755).is_err());
        let mut short: &[u8] = b"ab";
        assert!(w.file_from("f", 0o644, 5, &mut short).is_err());
    }
}
