//! Empty qcow2 overlays written in-process: every fork gives each child a layer over the
//! snapshot's frozen disk, and starting a `qemu-img` process per child costs more than
//! the four clusters the layer holds. The layout is the one `qemu-img create -f qcow2
//! -b BASE -F FMT` makes (version 3, 64 KiB clusters, 16-bit refcounts), from QEMU's
//! qcow2 specification (docs/interop/qcow2.txt):
//!
//! ```text
//! cluster 0: header, header extensions (backing format, end), backing file name
//! cluster 1: refcount table (one entry: cluster 2)
//! cluster 2: refcount block (clusters 0..=2 and the L1 table's: refcount 1)
//! cluster 3..: L1 table, all zero (nothing allocated: every read goes to the base)
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: u32 = 0x5146_49fb;
const VERSION: u32 = 3;
const CLUSTER_BITS: u32 = 16;
const CLUSTER: u64 = 1 << CLUSTER_BITS;
const CLUSTER_LEN: usize = 1 << CLUSTER_BITS;
/// Length of the version 3 header without the optional compression-type field.
const HEADER_LEN: u32 = 104;
/// 16-bit refcounts (refcount_order 4), as qemu-img makes them.
const REFCOUNT_ORDER: u32 = 4;
/// Header extension: the backing file's format name.
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
/// Longest backing file name QEMU accepts.
const MAX_BACKING_NAME: usize = 1023;

/// The base format, as named in the backing-format extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BaseFormat {
    /// A raw image.
    Raw,
    /// A qcow2 image.
    Qcow2,
}

impl BaseFormat {
    fn name(self) -> &'static str {
        match self {
            BaseFormat::Raw => "raw",
            BaseFormat::Qcow2 => "qcow2",
        }
    }
}

/// The virtual size of `base`: a raw image's length, or a qcow2 image's size field.
pub fn virtual_size(base: &Path, format: BaseFormat) -> std::io::Result<u64> {
    match format {
        BaseFormat::Raw => Ok(std::fs::metadata(base)?.len()),
        BaseFormat::Qcow2 => {
            use std::io::Read;
            let mut head = [0u8; 32];
            std::fs::File::open(base)?.read_exact(&mut head)?;
            if u32::from_be_bytes([head[0], head[1], head[2], head[3]]) != MAGIC {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} is not a qcow2 image", base.display()),
                ));
            }
            let mut size = [0u8; 8];
            size.copy_from_slice(&head[24..32]);
            Ok(u64::from_be_bytes(size))
        }
    }
}

/// The backing file a qcow2 image's header names (as written: absolute, or relative to
/// the image's directory), or None if it has none.
pub fn backing_name(image: &Path) -> std::io::Result<Option<String>> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(image)?;
    let mut head = [0u8; 20];
    f.read_exact_at(&mut head, 0)?;
    if u32::from_be_bytes([head[0], head[1], head[2], head[3]]) != MAGIC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is not a qcow2 image", image.display()),
        ));
    }
    let offset = u64::from_be_bytes(head[8..16].try_into().expect("8 bytes"));
    let len = u32::from_be_bytes(head[16..20].try_into().expect("4 bytes"));
    if offset == 0 || len == 0 {
        return Ok(None);
    }
    if len > 1023 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: a backing file name of {len} bytes", image.display()),
        ));
    }
    let mut name = vec![0u8; len as usize];
    f.read_exact_at(&mut name, offset)?;
    String::from_utf8(name)
        .map(Some)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Checks that a qcow2 image from elsewhere (an unpacked snapshot's disk layer) keeps
/// its data in itself: not marked corrupt, no external data file (which would name a
/// file of this host), no incompatible feature this code does not know.
pub fn check_foreign(image: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let f = std::fs::File::open(image)?;
    let mut head = [0u8; 80];
    f.read_exact_at(&mut head, 0)?;
    if u32::from_be_bytes([head[0], head[1], head[2], head[3]]) != MAGIC {
        return Err(invalid(format!("{} is not a qcow2 image", image.display())));
    }
    let version = u32::from_be_bytes(head[4..8].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(invalid(format!("qcow2 version {version}, not {VERSION}")));
    }
    let incompatible = u64::from_be_bytes(head[72..80].try_into().expect("8 bytes"));
    // Bit 0 (dirty) is what an image QEMU had open looks like; 3 and 4 (compression
    // type, extended L2) change only how the image's own clusters are read.
    const CORRUPT: u64 = 1 << 1;
    const EXTERNAL_DATA: u64 = 1 << 2;
    if incompatible & CORRUPT != 0 {
        return Err(invalid("the image is marked corrupt".into()));
    }
    if incompatible & EXTERNAL_DATA != 0 {
        return Err(invalid(
            "the image keeps its data in an external file".into(),
        ));
    }
    if incompatible >> 5 != 0 {
        return Err(invalid(format!(
            "unknown incompatible qcow2 features {incompatible:#x}"
        )));
    }
    Ok(())
}

/// Renames the backing file an image's header names (`qemu-img rebase -u`: the data is
/// not touched, the new base must hold what the old one held). QEMU keeps the name last
/// in the header cluster, after the header extensions, so the new name goes where the
/// old one was; it must fit in that cluster. Used when an unpacked chain link is
/// installed: its layer named its parent's disk where that lay on the host it came from.
pub fn set_backing_name(image: &Path, name: &str) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)?;
    let mut head = [0u8; 24];
    f.read_exact_at(&mut head, 0)?;
    if u32::from_be_bytes([head[0], head[1], head[2], head[3]]) != MAGIC {
        return Err(invalid(format!("{} is not a qcow2 image", image.display())));
    }
    let offset = u64::from_be_bytes(head[8..16].try_into().expect("8 bytes"));
    let old_len = u64::from(u32::from_be_bytes(
        head[16..20].try_into().expect("4 bytes"),
    ));
    let cluster_bits = u32::from_be_bytes(head[20..24].try_into().expect("4 bytes"));
    if offset == 0 {
        return Err(invalid(format!("{} has no backing file", image.display())));
    }
    if !(9..=21).contains(&cluster_bits) {
        return Err(invalid(format!(
            "{}: cluster bits {cluster_bits}",
            image.display()
        )));
    }
    if name.is_empty() || name.len() > MAX_BACKING_NAME {
        return Err(invalid(format!(
            "a backing file name must be 1 to {MAX_BACKING_NAME} bytes"
        )));
    }
    let end = offset + name.len() as u64;
    if end > 1 << cluster_bits {
        return Err(invalid(format!(
            "{}: the backing file name {name:?} does not fit in its header cluster",
            image.display()
        )));
    }
    let mut bytes = name.as_bytes().to_vec();
    // Clear what is left of a longer old name.
    bytes.resize(name.len().max(usize::try_from(old_len).unwrap_or(0)), 0);
    f.write_all_at(&bytes, offset)?;
    // Shorter than its header cluster (checked above).
    let name_len = u32::try_from(name.len()).expect("a name within one cluster");
    f.write_all_at(&name_len.to_be_bytes(), 16)?;
    f.sync_data()
}

/// The most layers a disk chain may have below its top: far beyond any chain forkd
/// makes, and a bound on a loop of backing files.
const MAX_CHAIN: usize = 256;

/// The images below `top` in its backing chain, top-most first: each qcow2 image names
/// the next; the walk ends at an image without a backing file or at one that is not
/// qcow2 (the raw rootfs at the bottom). Names are resolved as QEMU does: relative to
/// the directory of the image that names them.
pub fn backing_chain(top: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut image = top.to_path_buf();
    let mut chain = Vec::new();
    while is_qcow2(&image)? {
        let Some(name) = backing_name(&image)? else {
            break;
        };
        if chain.len() == MAX_CHAIN {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: more than {MAX_CHAIN} backing layers", top.display()),
            ));
        }
        image = match image.parent() {
            Some(dir) => dir.join(name),
            None => name.into(),
        };
        chain.push(image.clone());
    }
    Ok(chain)
}

/// Whether `image` starts with the qcow2 magic.
fn is_qcow2(image: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::FileExt;
    let mut magic = [0u8; 4];
    match std::fs::File::open(image)?.read_exact_at(&mut magic, 0) {
        Ok(()) => Ok(u32::from_be_bytes(magic) == MAGIC),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// The bytes of an empty overlay of `size` bytes whose backing file is `backing_name`
/// (as QEMU will open it: absolute, or relative to the overlay's directory).
pub fn overlay_image(
    backing_name: &str,
    format: BaseFormat,
    size: u64,
) -> std::io::Result<Vec<u8>> {
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    if backing_name.is_empty() || backing_name.len() > MAX_BACKING_NAME {
        return Err(invalid(format!(
            "a backing file name must be 1 to {MAX_BACKING_NAME} bytes"
        )));
    }
    // One L2 table (a cluster of 8-byte entries) maps CLUSTER / 8 clusters.
    let per_l2 = (CLUSTER / 8) * CLUSTER;
    let l1_entries = size.div_ceil(per_l2).max(1);
    let l1_clusters = (l1_entries * 8).div_ceil(CLUSTER);
    let total_clusters = 3 + l1_clusters;
    // One refcount block (CLUSTER / 2 sixteen-bit entries) covers them all up to
    // 2 TiB of L1-mapped disk, far beyond any guest disk forkd makes.
    if total_clusters > CLUSTER / 2 {
        return Err(invalid(format!(
            "a {size}-byte disk is too large for one refcount block"
        )));
    }
    let mut img = vec![
        0u8;
        usize::try_from(total_clusters * CLUSTER)
            .map_err(|_| invalid("too large".into()))?
    ];

    // Header extensions, then the backing file name, right after the header.
    let mut ext = Vec::new();
    let fmt = format.name().as_bytes();
    ext.extend_from_slice(&EXT_BACKING_FORMAT.to_be_bytes());
    let fmt_len = u32::try_from(fmt.len()).expect("a format name of a few bytes");
    ext.extend_from_slice(&fmt_len.to_be_bytes());
    ext.extend_from_slice(fmt);
    ext.resize(ext.len().next_multiple_of(8), 0);
    ext.extend_from_slice(&[0u8; 8]); // end of the extensions
    let name_offset = HEADER_LEN as usize + ext.len();
    img[HEADER_LEN as usize..name_offset].copy_from_slice(&ext);
    img[name_offset..name_offset + backing_name.len()].copy_from_slice(backing_name.as_bytes());

    let mut h = Vec::with_capacity(HEADER_LEN as usize);
    h.extend_from_slice(&MAGIC.to_be_bytes());
    h.extend_from_slice(&VERSION.to_be_bytes());
    h.extend_from_slice(&(name_offset as u64).to_be_bytes());
    let name_len =
        u32::try_from(backing_name.len()).map_err(|_| invalid("too long a name".into()))?;
    h.extend_from_slice(&name_len.to_be_bytes());
    h.extend_from_slice(&CLUSTER_BITS.to_be_bytes());
    h.extend_from_slice(&size.to_be_bytes());
    h.extend_from_slice(&0u32.to_be_bytes()); // no encryption
    let l1_entries = u32::try_from(l1_entries).map_err(|_| invalid("too large".into()))?;
    h.extend_from_slice(&l1_entries.to_be_bytes());
    h.extend_from_slice(&(3 * CLUSTER).to_be_bytes()); // L1 table
    h.extend_from_slice(&CLUSTER.to_be_bytes()); // refcount table
    h.extend_from_slice(&1u32.to_be_bytes()); // refcount table clusters
    h.extend_from_slice(&0u32.to_be_bytes()); // snapshots
    h.extend_from_slice(&0u64.to_be_bytes()); // snapshots offset
    h.extend_from_slice(&0u64.to_be_bytes()); // incompatible features
    h.extend_from_slice(&0u64.to_be_bytes()); // compatible features
    h.extend_from_slice(&0u64.to_be_bytes()); // autoclear features
    h.extend_from_slice(&REFCOUNT_ORDER.to_be_bytes());
    h.extend_from_slice(&HEADER_LEN.to_be_bytes());
    debug_assert_eq!(h.len(), HEADER_LEN as usize);
    img[..h.len()].copy_from_slice(&h);

    // Refcount table: its one entry points at the refcount block in cluster 2.
    let rt = CLUSTER_LEN;
    img[rt..rt + 8].copy_from_slice(&(2 * CLUSTER).to_be_bytes());
    // Refcount block: every cluster of the image is used once.
    let rb = 2 * CLUSTER_LEN;
    let total_clusters =
        usize::try_from(total_clusters).map_err(|_| invalid("too large".into()))?;
    for c in 0..total_clusters {
        img[rb + 2 * c..rb + 2 * c + 2].copy_from_slice(&1u16.to_be_bytes());
    }
    Ok(img)
}

/// Writes an empty overlay at `path` over `base` (named `backing_name` in the image),
/// created exclusively and synced.
pub fn create_overlay(
    path: &Path,
    base: &Path,
    backing_name: &str,
    format: BaseFormat,
) -> std::io::Result<()> {
    let size = virtual_size(base, format)?;
    let img = overlay_image(backing_name, format, size)?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    f.write_all(&img)?;
    f.sync_data()
}

/// Writes `out`, a raw image (sparse where the disk reads zeros) with the contents of
/// the layered disk `top`: a build VM's disk turned into a root filesystem image of its
/// own, by `qemu-img convert`.
pub async fn to_raw(top: &Path, out: &Path) -> Result<(), forkd_hypervisor::HypervisorError> {
    let mut cmd = qemu_img();
    cmd.args(["convert", "-q", "-f", "qcow2", "-O", "raw", "-S", "4k"])
        .arg(top)
        .arg(out);
    run_into(
        cmd,
        out,
        &format!("converting {} into {}", top.display(), out.display()),
    )
    .await
}

/// `qemu-img`: `$FORKD_QEMU_IMG`, else from `PATH`.
fn qemu_img() -> tokio::process::Command {
    tokio::process::Command::new(
        std::env::var_os("FORKD_QEMU_IMG").unwrap_or_else(|| "qemu-img".into()),
    )
}

/// Runs `cmd`, which writes `out`: on failure `out` is removed and the error carries
/// what the tool said; on success `out` is synced.
async fn run_into(
    mut cmd: tokio::process::Command,
    out: &Path,
    what: &str,
) -> Result<(), forkd_hypervisor::HypervisorError> {
    let program = cmd.as_std().get_program().to_string_lossy().into_owned();
    let output = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|source| forkd_hypervisor::HypervisorError::Spawn {
            program,
            source,
            install: "apt-get install qemu-utils",
        })?;
    if !output.status.success() {
        let _ = std::fs::remove_file(out);
        return Err(forkd_hypervisor::HypervisorError::Io {
            context: what.to_owned(),
            source: std::io::Error::other(
                String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            ),
        });
    }
    std::fs::File::open(out)
        .and_then(|f| f.sync_all())
        .map_err(|e| forkd_hypervisor::HypervisorError::io(format!("syncing {}", out.display()), e))
}

/// Writes `out`, a qcow2 layer over the raw image `base` (named relative to `out`'s
/// directory) with the contents of the layered disk `top`: a copy of `top` that
/// `qemu-img rebase` (`$FORKD_QEMU_IMG`, else from `PATH`) fills with what the layers
/// between held. A rare operation (compacting a snapshot chain), for which QEMU's own
/// tool is the reference. (`qemu-img convert -B` would not do: it copies only the top
/// layer, taking the new base for the old chain.)
pub async fn flatten(
    top: &Path,
    base: &Path,
    out: &Path,
) -> Result<(), forkd_hypervisor::HypervisorError> {
    let io = |what: String| move |e: std::io::Error| forkd_hypervisor::HypervisorError::io(what, e);
    std::fs::copy(top, out).map_err(io(format!("copying {}", top.display())))?;
    let mut cmd = qemu_img();
    cmd.current_dir(out.parent().unwrap_or(Path::new(".")))
        .args(["rebase", "-q", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(base)
        .arg(out);
    run_into(
        cmd,
        out,
        &format!("flattening {} into {}", top.display(), out.display()),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn qemu_img(args: &[&str]) -> (bool, String) {
        let out = Command::new("qemu-img").args(args).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    }

    #[test]
    fn qemu_img_reads_our_overlays_as_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("base.raw");
        let mut data = vec![0u8; 3 << 20];
        for (i, b) in data.iter_mut().enumerate() {
            *b = u8::try_from(i % 251).unwrap();
        }
        std::fs::write(&raw, &data).unwrap();
        // A layer over the raw base, named relatively (as in a snapshot directory).
        let mid = dir.path().join("mid.qcow2");
        create_overlay(&mid, &raw, "base.raw", BaseFormat::Raw).unwrap();
        // And a layer over that layer, named absolutely (as a child's is).
        let top = dir.path().join("top.qcow2");
        create_overlay(&top, &mid, mid.to_str().unwrap(), BaseFormat::Qcow2).unwrap();
        for img in [&mid, &top] {
            let (ok, out) = qemu_img(&["check", img.to_str().unwrap()]);
            assert!(ok && out.contains("No errors"), "{out}");
        }
        let (ok, info) = qemu_img(&["info", "--output=json", top.to_str().unwrap()]);
        assert!(ok, "{info}");
        assert_eq!(backing_name(&top).unwrap().as_deref(), mid.to_str());
        assert_eq!(backing_name(&mid).unwrap().as_deref(), Some("base.raw"));
        assert!(backing_name(&raw).is_err(), "not a qcow2 image");
        assert_eq!(backing_chain(&top).unwrap().len(), 2);
        assert_eq!(backing_chain(&mid).unwrap().len(), 1);
        assert_eq!(backing_chain(&raw).unwrap().len(), 0);
        assert_eq!(backing_chain(&top).unwrap()[0], mid);
        let v: serde_json::Value = serde_json::from_str(&info).unwrap();
        assert_eq!(v["format"], "qcow2");
        assert_eq!(v["virtual-size"], 3 << 20);
        assert_eq!(v["backing-filename"], mid.to_str().unwrap());
        assert_eq!(v["backing-filename-format"], "qcow2");
        // Reads go through both layers to the base.
        let (ok, out) = qemu_img(&["compare", top.to_str().unwrap(), raw.to_str().unwrap()]);
        assert!(ok, "{out}");
        assert_eq!(std::fs::read(&raw).unwrap(), data);
        assert!(
            create_overlay(&top, &mid, "x", BaseFormat::Qcow2).is_err(),
            "never overwrites"
        );
        assert!(overlay_image("", BaseFormat::Raw, 1).is_err());
    }

    #[test]
    fn a_renamed_backing_file_is_what_qemu_img_follows() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("base.raw");
        std::fs::write(&raw, vec![9u8; 1 << 20]).unwrap();
        let mid = dir.path().join("mid.qcow2");
        create_overlay(&mid, &raw, raw.to_str().unwrap(), BaseFormat::Raw).unwrap();
        // A layer as QEMU lays it out (its header extensions before the name).
        let top = dir.path().join("top.qcow2");
        let long = dir.path().join("a-long-directory-name-that-moves");
        std::fs::create_dir(&long).unwrap();
        let (ok, out) = qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            mid.to_str().unwrap(),
            "-F",
            "qcow2",
            top.to_str().unwrap(),
        ]);
        assert!(ok, "{out}");
        // The base moves somewhere with a longer name, then back to a shorter one.
        let moved = long.join("mid.qcow2");
        std::fs::rename(&mid, &moved).unwrap();
        set_backing_name(&top, moved.to_str().unwrap()).unwrap();
        assert_eq!(backing_name(&top).unwrap().as_deref(), moved.to_str());
        let (ok, out) = qemu_img(&["compare", top.to_str().unwrap(), raw.to_str().unwrap()]);
        assert!(ok, "{out}");
        std::fs::rename(&moved, &mid).unwrap();
        set_backing_name(&top, "mid.qcow2").unwrap();
        let (ok, info) = qemu_img(&["info", "--output=json", top.to_str().unwrap()]);
        assert!(ok, "{info}");
        let v: serde_json::Value = serde_json::from_str(&info).unwrap();
        assert_eq!(v["backing-filename"], "mid.qcow2");
        let (ok, out) = qemu_img(&["check", top.to_str().unwrap()]);
        assert!(ok && out.contains("No errors"), "{out}");
        assert!(set_backing_name(&top, &"x".repeat(70_000)).is_err());
        assert!(set_backing_name(&raw, "mid.qcow2").is_err(), "not qcow2");
        check_foreign(&top).unwrap();
        check_foreign(&mid).unwrap();
        assert!(check_foreign(&raw).is_err());
        let data = dir.path().join("data.raw");
        let ext = dir.path().join("ext.qcow2");
        let (ok, out) = qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            &format!("data_file={}", data.display()),
            ext.to_str().unwrap(),
            "1M",
        ]);
        assert!(ok, "{out}");
        let e = check_foreign(&ext).unwrap_err().to_string();
        assert!(e.contains("external file"), "{e}");
    }

    #[tokio::test]
    async fn a_flattened_chain_reads_the_same_over_its_base_alone() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("rootfs.ext4");
        std::fs::write(&raw, vec![7u8; 4 << 20]).unwrap();
        let mid = dir.path().join("mid.qcow2");
        create_overlay(&mid, &raw, "rootfs.ext4", BaseFormat::Raw).unwrap();
        let top = dir.path().join("top.qcow2");
        create_overlay(&top, &mid, mid.to_str().unwrap(), BaseFormat::Qcow2).unwrap();
        for (img, cmd) in [
            (&mid, "write -P 0x55 0 64k"),
            (&top, "write -P 0x66 1M 64k"),
        ] {
            let out = Command::new("qemu-io")
                .args(["-c", cmd])
                .arg(img)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let out_dir = dir.path().join("flat");
        std::fs::create_dir(&out_dir).unwrap();
        std::fs::hard_link(&raw, out_dir.join("rootfs.ext4")).unwrap();
        let flat = out_dir.join("disk.qcow2");
        flatten(&top, Path::new("rootfs.ext4"), &flat)
            .await
            .unwrap();
        std::fs::remove_file(&mid).unwrap();
        let (ok, info) = qemu_img(&["info", "--output=json", flat.to_str().unwrap()]);
        assert!(ok, "{info}");
        let v: serde_json::Value = serde_json::from_str(&info).unwrap();
        assert_eq!(v["backing-filename"], "rootfs.ext4");
        // Both layers' writes, over the base: compared with a fresh overlay written alike.
        let check = dir.path().join("check.qcow2");
        create_overlay(&check, &raw, raw.to_str().unwrap(), BaseFormat::Raw).unwrap();
        for cmd in ["write -P 0x55 0 64k", "write -P 0x66 1M 64k"] {
            assert!(Command::new("qemu-io")
                .args(["-c", cmd])
                .arg(&check)
                .status()
                .unwrap()
                .success());
        }
        let (ok, out) = qemu_img(&["compare", flat.to_str().unwrap(), check.to_str().unwrap()]);
        assert!(ok, "{out}");
        let again = out_dir.join("again.qcow2");
        assert!(
            flatten(&top, Path::new("rootfs.ext4"), &again)
                .await
                .is_err(),
            "the missing middle layer is an error"
        );
    }
}
