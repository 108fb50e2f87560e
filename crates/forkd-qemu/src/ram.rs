//! Writing into a restored VM's guest RAM from outside, before its vCPUs first run.
//!
//! A resumed pause image is the RAM file the sandbox mapped privately plus the pages that
//! differed from it. QEMU maps the file privately again (every unwritten page stays
//! shared with the file and with every other sandbox mapping it) and the differing pages
//! are written into its mapping through `process_vm_writev(2)`: each becomes a private
//! copy of that QEMU, exactly as when the guest wrote it. QEMU itself offers no way to
//! load only some pages over a file mapping: a migration stream carries every non-zero
//! page, which would make the whole of the guest's RAM private again.
//!
//! The mapping is found in `/proc/PID/maps` by the RAM file's device and inode, not by
//! its path: a jailed QEMU sees the file under another name.

use forkd_hypervisor::RamWriter;
use nix::sys::uio::{process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The guest RAM of QEMU process `pid`: where its mapping of the RAM file starts.
pub struct ProcessRam {
    pid: Pid,
    base: usize,
    len: u64,
}

/// One line of `/proc/PID/maps`, as far as finding a file's mapping needs it.
#[derive(Debug, PartialEq)]
struct Mapping {
    start: usize,
    end: usize,
    /// Offset in the file of the mapping's first byte.
    offset: u64,
    /// The file's device, as (major, minor).
    dev: (u64, u64),
    inode: u64,
}

fn parse_map_line(line: &str) -> Option<Mapping> {
    let mut f = line.split_whitespace();
    let (start, end) = f.next()?.split_once('-')?;
    let _perms = f.next()?;
    let offset = u64::from_str_radix(f.next()?, 16).ok()?;
    let (major, minor) = f.next()?.split_once(':')?;
    Some(Mapping {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        offset,
        dev: (
            u64::from_str_radix(major, 16).ok()?,
            u64::from_str_radix(minor, 16).ok()?,
        ),
        inode: f.next()?.parse().ok()?,
    })
}

/// The start and length of the mapping of the file (`dev`, `ino`) from its offset 0 in
/// a maps listing, if there is exactly one: by its inode, and by its device too when
/// the inode alone names several. The device `stat` gives is not always the one maps
/// shows (a btrfs subvolume, a file under overlayfs), so it only breaks a tie.
fn find_mapping(maps: &str, dev: (u64, u64), ino: u64) -> Option<(usize, u64)> {
    let by_inode: Vec<Mapping> = maps
        .lines()
        .filter_map(parse_map_line)
        .filter(|m| m.offset == 0 && m.inode == ino)
        .collect();
    let m = match by_inode.as_slice() {
        [one] => one,
        _ => {
            let mut same_dev = by_inode.iter().filter(|m| m.dev == dev);
            let m = same_dev.next()?;
            if same_dev.next().is_some() {
                return None;
            }
            m
        }
    };
    Some((m.start, u64::try_from(m.end - m.start).ok()?))
}

impl ProcessRam {
    /// The mapping of `ram_file` in QEMU process `pid`, which must cover `size` bytes.
    pub fn find(pid: u32, ram_file: &Path, size: u64) -> io::Result<ProcessRam> {
        let meta = std::fs::metadata(ram_file)?;
        let dev = (
            nix::sys::stat::major(meta.dev()),
            nix::sys::stat::minor(meta.dev()),
        );
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
        let (base, len) = find_mapping(&maps, dev, meta.ino()).ok_or_else(|| {
            io::Error::other(format!(
                "QEMU (pid {pid}) has no single mapping of its RAM file {}",
                ram_file.display()
            ))
        })?;
        if len < size {
            return Err(io::Error::other(format!(
                "QEMU (pid {pid}) maps {len} bytes of its RAM file, not the {size} of the guest's RAM"
            )));
        }
        let pid = i32::try_from(pid)
            .map(Pid::from_raw)
            .map_err(|_| io::Error::other(format!("pid {pid} is out of range")))?;
        Ok(ProcessRam { pid, base, len })
    }
}

impl RamWriter for ProcessRam {
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        let end = offset.checked_add(data.len() as u64);
        if end.is_none_or(|e| e > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} bytes at offset {offset} fall outside the guest's RAM ({} bytes)",
                    data.len(),
                    self.len
                ),
            ));
        }
        let mut done = 0usize;
        while done < data.len() {
            let at = usize::try_from(offset)
                .ok()
                .and_then(|o| self.base.checked_add(o)?.checked_add(done))
                .ok_or_else(|| io::Error::other("guest RAM offset out of range"))?;
            let rest = &data[done..];
            let n = process_vm_writev(
                self.pid,
                &[io::IoSlice::new(rest)],
                &[RemoteIoVec {
                    base: at,
                    len: rest.len(),
                }],
            )
            .map_err(io::Error::from)?;
            if n == 0 {
                return Err(io::Error::other("QEMU's RAM took no bytes"));
            }
            done += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0000000-55d0c0100000 r-xp 00000000 08:01 1234 /usr/bin/qemu-system-x86_64
7f0000000000-7f0020000000 rw-p 00000000 00:2a 777 /snap/memory.ram
7f0020000000-7f0020001000 rw-p 00000000 00:00 0
7f0030000000-7f0030001000 r--p 00001000 00:2a 777 /snap/memory.ram
";

    #[test]
    fn the_ram_mapping_is_found_by_device_and_inode_from_offset_zero() {
        assert_eq!(
            find_mapping(MAPS, (0, 0x2a), 777),
            Some((0x7f00_0000_0000, 0x2000_0000))
        );
        assert_eq!(find_mapping(MAPS, (0, 0x2a), 778), None);
        // A device number maps shows otherwise than stat (btrfs, overlayfs).
        assert_eq!(
            find_mapping(MAPS, (8, 1), 777),
            Some((0x7f00_0000_0000, 0x2000_0000))
        );
        // The same inode number on two devices: the device decides.
        let other = format!("{MAPS}7f0040000000-7f0040001000 rw-p 00000000 00:2b 777 /y\n");
        assert_eq!(
            find_mapping(&other, (0, 0x2a), 777),
            Some((0x7f00_0000_0000, 0x2000_0000))
        );
        let twice = format!("{MAPS}7f0040000000-7f0040001000 rw-p 00000000 00:2a 777 /x\n");
        assert_eq!(find_mapping(&twice, (0, 0x2a), 777), None, "ambiguous");
    }

    #[test]
    fn writes_land_in_the_process_memory_and_never_outside_it() {
        // This process's own memory stands for QEMU's.
        let mut target = vec![0u8; 8192];
        let mut ram = ProcessRam {
            pid: nix::unistd::getpid(),
            base: target.as_mut_ptr() as usize,
            len: target.len() as u64,
        };
        ram.write_at(4096, b"forkd").unwrap();
        assert!(ram.write_at(8190, b"abc").is_err());
        assert!(ram.write_at(u64::MAX, b"a").is_err());
        // The write went through the kernel, behind the compiler's back.
        let seen = std::hint::black_box(&target)[4096..4101].to_vec();
        assert_eq!(&seen, b"forkd");
    }
}
