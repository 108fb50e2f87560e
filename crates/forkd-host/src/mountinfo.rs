//! `/proc/self/mountinfo`, read once for every part of forkd that asks what is mounted
//! where (the cgroup hierarchies, the mounts left under an image build's scratch
//! directory).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

/// One line of a mountinfo text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount<'a> {
    /// The mount's root within its filesystem (field 4), as the kernel wrote it.
    pub root: &'a str,
    /// Where it is mounted (field 5), with the kernel's octal escapes undone.
    pub mount_point: PathBuf,
    /// The filesystem type (`cgroup2`, `ext4`).
    pub fstype: &'a str,
    /// The superblock options (a v1 cgroup hierarchy's controllers are among them).
    pub options: &'a str,
}

/// The mounts of a mountinfo text; a line that is not one (no ` - ` separator, too few
/// fields) is skipped.
pub fn parse(mountinfo: &str) -> Vec<Mount<'_>> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let mut fields = before.split(' ');
            let root = fields.nth(3)?;
            let mount_point = unescape(fields.next()?);
            let mut after = after.split(' ');
            let fstype = after.next()?;
            let _source = after.next()?;
            Some(Mount {
                root,
                mount_point,
                fstype,
                options: after.next().unwrap_or(""),
            })
        })
        .collect()
}

/// A path as mount tables write it: space, tab, newline and backslash escaped as three
/// octal digits. The bytes are kept as they are: a mount point need not be UTF-8.
pub fn unescape(s: &str) -> PathBuf {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let digits = bytes
            .get(i + 1..i + 4)
            .and_then(|d| std::str::from_utf8(d).ok());
        if bytes[i] == b'\\' {
            if let Some(v) = digits.and_then(|d| u8::from_str_radix(d, 8).ok()) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    PathBuf::from(OsString::from_vec(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_and_mount_points_unescaped() {
        let text = "22 1 8:1 / / rw - ext4 /dev/vda rw\n\
                    30 22 0:5 /sub /tmp/a\\040b/proc rw,nosuid - cgroup cgroup rw,memory\n\
                    not a mount line\n";
        let m = parse(text);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].root, m[0].fstype), ("/", "ext4"));
        assert_eq!(m[0].mount_point, PathBuf::from("/"));
        assert_eq!(m[1].mount_point, PathBuf::from("/tmp/a b/proc"));
        assert_eq!((m[1].root, m[1].options), ("/sub", "rw,memory"));
    }

    #[test]
    fn escapes_are_undone_and_broken_ones_kept() {
        assert_eq!(unescape(r"/mnt/a\040b"), PathBuf::from("/mnt/a b"));
        assert_eq!(unescape(r"/plain"), PathBuf::from("/plain"));
        assert_eq!(unescape(r"/odd\04"), PathBuf::from(r"/odd\04"));
        assert_eq!(unescape(r"/x\134y"), PathBuf::from(r"/x\y"));
        // Not UTF-8, kept byte for byte.
        assert_eq!(unescape(r"/\377").as_os_str().as_encoded_bytes(), b"/\xff");
    }
}
