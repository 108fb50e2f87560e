//! What one file mapping of a process costs in memory, read from `/proc/PID/smaps`.
//!
//! A forked child maps its snapshot's memory image privately: pages it has only read are
//! shared with every sibling (and the page cache), pages it wrote are its own. smaps
//! tells the two apart per mapping, which is what fork's memory figures are made of:
//! `Private_Dirty` is what the child copied on write, `Pss` splits each shared page
//! between the processes that map it.
//!
//! A few dozen lines of parsing; the `procfs` crate would bring a large API surface for
//! this one file.

use std::path::Path;

/// Memory of the mappings of one file in one process, in bytes, summed over every
/// mapping of that file (QEMU may map guest RAM in more than one piece).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MappingUsage {
    /// Mapped size.
    pub size: u64,
    /// Resident pages.
    pub rss: u64,
    /// Proportional set size: each resident page divided by the number of its mappers.
    pub pss: u64,
    /// Resident pages only this process maps, written (copied on write).
    pub private_dirty: u64,
    /// Resident pages only this process maps, not written.
    pub private_clean: u64,
    /// Resident pages that other processes map too.
    pub shared: u64,
}

/// The usage of every mapping of `file` in process `pid`; `None` when the process is gone
/// or maps no such file.
pub fn file_mapping_usage(pid: u32, file: &Path) -> Option<MappingUsage> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    // The kernel shows the path the file was opened with, made absolute and canonical.
    let file = std::fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
    parse(&text, &file.to_string_lossy())
}

/// The memory of the whole process `pid` (every mapping, from `smaps_rollup`, whose one
/// header names `[rollup]`); `None` when the process is gone. `size` is not given.
pub fn process_usage(pid: u32) -> Option<MappingUsage> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    parse(&text, "[rollup]")
}

/// Sums the fields of the mappings in `smaps` whose pathname is `path`.
fn parse(smaps: &str, path: &str) -> Option<MappingUsage> {
    let mut total: Option<MappingUsage> = None;
    let mut in_target = false;
    for line in smaps.lines() {
        if let Some(name) = mapping_header_path(line) {
            in_target = name == path;
            if in_target {
                total.get_or_insert_with(MappingUsage::default);
            }
            continue;
        }
        if !in_target {
            continue;
        }
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let Some(kib) = rest
            .trim()
            .strip_suffix(" kB")
            .and_then(|n| n.trim().parse::<u64>().ok())
        else {
            continue;
        };
        let t = total.as_mut().expect("set at the header");
        let bytes = kib * 1024;
        match key {
            "Size" => t.size += bytes,
            "Rss" => t.rss += bytes,
            "Pss" => t.pss += bytes,
            "Private_Dirty" => t.private_dirty += bytes,
            "Private_Clean" => t.private_clean += bytes,
            "Shared_Clean" | "Shared_Dirty" => t.shared += bytes,
            _ => {}
        }
    }
    total
}

/// For a mapping's header line (`start-end perms offset dev inode [path]`), its path
/// (empty for an anonymous mapping); `None` for a field line.
fn mapping_header_path(line: &str) -> Option<&str> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let (start, end) = range.split_once('-')?;
    if !start.chars().all(|c| c.is_ascii_hexdigit()) || !end.chars().all(|c| c.is_ascii_hexdigit())
    {
        return None;
    }
    let _perms = fields.next()?;
    let _offset = fields.next()?;
    let _dev = fields.next()?;
    let _inode = fields.next()?;
    Some(fields.next().unwrap_or("").trim_start())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0a00000-55d0c0b00000 r--p 00000000 fe:01 1234                       /usr/bin/qemu-system-x86_64
Size:               1024 kB
Rss:                 800 kB
Pss:                 400 kB
Private_Dirty:         0 kB
7f0000000000-7f0020000000 rw-p 00000000 fe:01 99                         /var/snap/memory.ram
Size:             524288 kB
KernelPageSize:        4 kB
Rss:               49152 kB
Pss:                5120 kB
Shared_Clean:      48640 kB
Shared_Dirty:          0 kB
Private_Clean:         0 kB
Private_Dirty:       512 kB
VmFlags: rd wr mr mw me ac sd
7f0020000000-7f0020001000 rw-p 00000000 00:00 0 
Rss:                   4 kB
Private_Dirty:         4 kB
";

    #[test]
    fn sums_only_the_named_file() {
        let u = parse(SMAPS, "/var/snap/memory.ram").unwrap();
        assert_eq!(u.size, 524_288 * 1024);
        assert_eq!(u.rss, 49_152 * 1024);
        assert_eq!(u.pss, 5_120 * 1024);
        assert_eq!(u.shared, 48_640 * 1024);
        assert_eq!(u.private_dirty, 512 * 1024);
        assert_eq!(u.private_clean, 0);
        assert_eq!(parse(SMAPS, "/elsewhere"), None);
    }

    #[test]
    fn reads_the_rollup_of_this_process() {
        let u = process_usage(std::process::id()).expect("this process has a rollup");
        assert!(u.rss > 0 && u.pss > 0 && u.private_dirty > 0, "{u:?}");
    }

    #[test]
    fn reads_this_process() {
        // This test binary maps itself.
        let exe = std::env::current_exe().unwrap();
        let u = file_mapping_usage(std::process::id(), &exe).expect("the test maps itself");
        assert!(u.size > 0 && u.rss > 0, "{u:?}");
    }
}
