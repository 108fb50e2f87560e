//! Root file system images: a Debian minbase tree from debootstrap, customised
//! for a sandbox guest and packed into an ext4 image with `mkfs.ext4 -d`.

use std::fmt;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use crate::apt_sources::{debian_mirror, debian_suite};
use crate::asset::{self, Asset};
use crate::command::{DEBOOTSTRAP, MKFS_EXT4};
use crate::error::{ImageError, Result};
use crate::fsutil::{self, ScratchDir};
use crate::home::Home;
use crate::inputs::Inputs;
use crate::lock::BuildLock;
use crate::BuildOptions;

/// debootstrap variant: essential packages and apt only.
const VARIANT: &str = "minbase";
/// Bump when [`customise`] changes what it writes.
const CUSTOMISE_VERSION: &str = "2";
/// Free space a build needs: the tree, the image and debootstrap's downloads.
const MIN_FREE_BYTES: u64 = 2 << 30;
/// Room to write inside the guest, on top of the tree's own size.
const HEADROOM_BYTES: u64 = 512 << 20;
const MIB: u64 = 1 << 20;

/// The root file systems forkd ships.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RootfsImage {
    /// Debian minbase and nothing else.
    Minimal,
    /// minbase + Python 3 with pandas, numpy, matplotlib (figures come back from code
    /// cells as PNG) and pip.
    Python,
}

impl RootfsImage {
    pub const ALL: [RootfsImage; 2] = [RootfsImage::Minimal, RootfsImage::Python];

    pub fn name(&self) -> &'static str {
        match self {
            RootfsImage::Minimal => "minimal",
            RootfsImage::Python => "python",
        }
    }

    /// Packages installed on top of minbase.
    pub fn packages(&self) -> &[&str] {
        match self {
            RootfsImage::Minimal => &[],
            RootfsImage::Python => &[
                "python3",
                "python3-pandas",
                "python3-numpy",
                "python3-matplotlib",
                "python3-pip",
            ],
        }
    }
}

impl fmt::Display for RootfsImage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RootfsImage {
    type Err = ImageError;

    fn from_str(s: &str) -> Result<Self> {
        RootfsImage::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| ImageError::UnknownImage(s.to_string()))
    }
}

/// Builds (or reuses) `<home>/images/rootfs/<name>.ext4`.
pub fn ensure_rootfs(home: &Home, image: RootfsImage, opts: &BuildOptions) -> Result<Asset> {
    let suite = debian_suite(opts.suite.as_deref());
    let mirror = debian_mirror(opts.mirror.as_deref(), &suite)?;
    let inputs = Inputs::new("rootfs")
        .field("suite", &suite)
        .field("mirror", &mirror)
        .field("variant", VARIANT)
        .list("packages", image.packages())
        .field("customise", CUSTOMISE_VERSION)
        .digest();
    let name = image.name();
    let file = home.rootfs_dir().join(format!("{name}.ext4"));
    let manifest = home.rootfs_dir().join(format!("{name}.json"));
    let current = || asset::load_asset(&manifest, &file).filter(|a| a.is_current(&inputs));
    let _lock = match BuildLock::reuse_or_acquire(home, opts, current)? {
        Ok(asset) => return Ok(asset),
        Err(lock) => lock,
    };
    if !nix::unistd::geteuid().is_root() {
        return Err(ImageError::NeedRoot {
            what: format!("the {name} rootfs"),
        });
    }
    check_free_space(&home.images_dir())?;

    let started = Instant::now();
    fsutil::create_dir_all(&home.rootfs_dir())?;
    let scratch = ScratchDir::new(&home.tmp_dir(), &format!("rootfs-{name}-"))?;
    let target = scratch.path().join("root");
    // The tree's top directory becomes the image's "/": world-readable, unlike
    // the 0700 scratch directory around it.
    fs::DirBuilder::new()
        .mode(0o755)
        .create(&target)
        .map_err(|e| ImageError::io("create directory", &target, e))?;

    let step = opts
        .progress
        .step(format!("rootfs {name}: debootstrap ({suite})"));
    let mut cmd = DEBOOTSTRAP.command()?;
    cmd.arg(format!("--variant={VARIANT}"));
    if !image.packages().is_empty() {
        cmd.arg(format!("--include={}", image.packages().join(",")));
    }
    cmd.arg(&suite).arg(&target).arg(&mirror);
    DEBOOTSTRAP.run_logged(cmd, &step, &scratch.path().join("debootstrap.log"))?;
    step.finish();

    let step = opts.progress.step(format!("rootfs {name}: customising"));
    // debootstrap unmounts its /proc and /sys on exit; make sure, since mkfs -d
    // would otherwise copy the host's /proc into the image.
    fsutil::unmount_under(&target)?;
    customise(&target)?;
    step.finish();
    publish_tree(
        &target,
        scratch.path(),
        name,
        Published {
            file,
            manifest,
            started,
            inputs,
        },
        &opts.progress,
    )
}

/// Where a packed tree goes and what it is recorded with.
pub(crate) struct Published {
    /// The image file.
    pub file: PathBuf,
    /// Its manifest.
    pub manifest: PathBuf,
    /// When the build started.
    pub started: Instant,
    /// The digest of the build's inputs.
    pub inputs: String,
}

/// Packs the finished tree `target` into an ext4 image sized for it (`mkfs.ext4 -d`, in
/// `scratch`), hashes it, publishes it and its manifest.
pub(crate) fn publish_tree(
    target: &Path,
    scratch: &Path,
    name: &str,
    to: Published,
    progress: &crate::Progress,
) -> Result<Asset> {
    let used = fsutil::tree_usage(target)?;
    let size_mib = image_size_mib(used);
    let step = progress.step(format!(
        "rootfs {name}: mkfs.ext4 ({size_mib} MiB for {} MiB of files)",
        used.div_ceil(MIB)
    ));
    let tmp_image = scratch.join(format!("{name}.ext4"));
    let mut cmd = MKFS_EXT4.command()?;
    cmd.args(["-F", "-q", "-L", "forkd-root", "-d"])
        .arg(target)
        .arg(&tmp_image)
        .arg(format!("{size_mib}M"));
    MKFS_EXT4.run_logged(cmd, &step, &scratch.join("mkfs.log"))?;
    step.message("hashing");
    let (sha256, size) = fsutil::sha256_file(&tmp_image)?;
    asset::retract_manifest(&to.manifest)?;
    fsutil::publish(&tmp_image, &to.file)?;
    let a = Asset::record(to.file, sha256, size, to.started, to.inputs);
    asset::store_manifest(&to.manifest, &a)?;
    step.finish();
    Ok(a)
}

fn check_free_space(dir: &Path) -> Result<()> {
    let free = fsutil::free_bytes(dir)?;
    if free < MIN_FREE_BYTES {
        return Err(ImageError::LowDiskSpace {
            path: dir.to_path_buf(),
            free_mib: free / MIB,
            need_mib: MIN_FREE_BYTES / MIB,
        });
    }
    Ok(())
}

/// The tree's size plus a quarter (ext4 metadata, journal, slack) plus headroom
/// for the guest to write, in whole MiB.
fn image_size_mib(used: u64) -> u64 {
    (used + used / 4 + HEADROOM_BYTES).div_ceil(MIB)
}

/// Turns debootstrap's tree into a sandbox guest's root: its own identity instead
/// of the host's (debootstrap copies the host's hostname and resolv.conf), no
/// package caches, and the mount points the agent needs.
fn customise(root: &Path) -> Result<()> {
    customise_identity(root)?;
    empty_dir_files(&root.join("var/cache/apt/archives"), |n| {
        n.ends_with(".deb")
    })?;
    empty_dir_files(&root.join("var/cache/apt"), |n| n.ends_with(".bin"))?;
    empty_dir_files(&root.join("var/lib/apt/lists"), |n| n != "lock")?;
    add_user(root)?;
    Ok(())
}

/// What makes any tree a guest's own root: its hostname and hosts, no machine id and
/// no resolvers of the host, and the mount points the agent needs.
pub(crate) fn customise_identity(root: &Path) -> Result<()> {
    ensure_dir(&root.join("etc"), 0o755)?;
    write_fresh(&root.join("etc/hostname"), b"forkd\n")?;
    write_fresh(
        &root.join("etc/hosts"),
        b"127.0.0.1\tlocalhost\n127.0.1.1\tforkd\n::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n",
    )?;
    // Empty: every sandbox (and every fork) must not share one fixed id.
    write_fresh(&root.join("etc/machine-id"), b"")?;
    // The host's resolvers mean nothing inside the guest's network; the guest's
    // network configuration writes its own.
    write_fresh(&root.join("etc/resolv.conf"), b"")?;
    ensure_dir(&root.join("run"), 0o755)?;
    ensure_dir(&root.join("tmp"), 0o1777)?;
    Ok(())
}

/// The unprivileged user commands may run as (E2B's SDKs run theirs as `user`).
pub const GUEST_USER: &str = "user";
const GUEST_UID: u32 = 1000;

/// Adds [`GUEST_USER`] (uid and gid 1000, home `/home/user`, shell bash, no password)
/// by editing the account files, as `useradd` would, without running anything of the
/// tree on the host.
pub(crate) fn add_user(root: &Path) -> Result<()> {
    let (name, id) = (GUEST_USER, GUEST_UID);
    let add = |file: &str, line: String| -> Result<()> {
        let path = root.join("etc").join(file);
        // An image without the file (no shadow passwords) keeps going without it.
        if file != "passwd" && !path.exists() {
            return Ok(());
        }
        let text = fs::read_to_string(&path).map_err(|e| ImageError::io("read", &path, e))?;
        if text.lines().any(|l| l.split(':').next() == Some(name)) {
            return Ok(());
        }
        let mut text = text;
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&line);
        text.push('\n');
        let mode = fs::metadata(&path)
            .map_err(|e| ImageError::io("stat", &path, e))?
            .permissions();
        write_fresh(&path, text.as_bytes())?;
        fs::set_permissions(&path, mode).map_err(|e| ImageError::io("set permissions of", &path, e))
    };
    add(
        "passwd",
        format!("{name}:x:{id}:{id}::/home/{name}:/bin/bash"),
    )?;
    add("group", format!("{name}:x:{id}:"))?;
    add("shadow", format!("{name}:*:19000:0:99999:7:::"))?;
    let home = root.join("home").join(name);
    ensure_dir(&home, 0o750)?;
    nix::unistd::chown(&home, Some(id.into()), Some(id.into()))
        .map_err(|e| ImageError::io("chown", &home, e.into()))
}

/// Replaces `path` with a new regular file. An existing entry is removed first,
/// never written through: a symlink in the tree points at a path that would
/// resolve on the host.
fn write_fresh(path: &Path, contents: &[u8]) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            fs::remove_dir_all(path).map_err(|e| ImageError::io("remove", path, e))?
        }
        Ok(_) => fs::remove_file(path).map_err(|e| ImageError::io("remove", path, e))?,
        Err(_) => {}
    }
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(path)
        .map_err(|e| ImageError::io("create", path, e))?;
    f.write_all(contents)
        .map_err(|e| ImageError::io("write", path, e))
}

/// Removes the regular files (and symlinks) directly in `dir` whose names match.
fn empty_dir_files(dir: &Path, matches: impl Fn(&str) -> bool) -> Result<()> {
    // Not a real directory (absent, or a symlink out of the tree): nothing of ours.
    if !fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
        return Ok(());
    }
    for entry in fs::read_dir(dir).map_err(|e| ImageError::io("list", dir, e))? {
        let entry = entry.map_err(|e| ImageError::io("list", dir, e))?;
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        let name = entry.file_name();
        if !is_dir && matches(&name.to_string_lossy()) {
            let p = entry.path();
            fs::remove_file(&p).map_err(|e| ImageError::io("remove", &p, e))?;
        }
    }
    Ok(())
}

fn ensure_dir(path: &Path, mode: u32) -> Result<()> {
    if !fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        let _ = fs::remove_file(path);
        fsutil::create_dir_all(path)?;
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| ImageError::io("set permissions of", path, e))
}

/// Every rootfs image built under `home`, for listing.
pub(crate) fn list(home: &Home) -> Vec<(String, Asset)> {
    asset::list_manifests(&home.rootfs_dir(), "rootfs", "ext4")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, MetadataExt};

    #[test]
    fn names_round_trip() {
        for i in RootfsImage::ALL {
            assert_eq!(i.to_string().parse::<RootfsImage>().unwrap(), i);
        }
        let err = "ubuntu".parse::<RootfsImage>().unwrap_err().to_string();
        assert!(err.contains("minimal, python"), "{err}");
        assert!(RootfsImage::Minimal.packages().is_empty());
        assert!(RootfsImage::Python.packages().contains(&"python3-pandas"));
    }

    #[test]
    fn size_rule() {
        assert_eq!(image_size_mib(0), 512);
        // 400 MiB of files -> 500 + 512
        assert_eq!(image_size_mib(400 * MIB), 1012);
        assert_eq!(image_size_mib(1), 513);
    }

    #[test]
    fn customise_never_writes_through_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::create_dir_all(root.join("var/cache/apt/archives/partial")).unwrap();
        fs::create_dir_all(root.join("var/lib/apt/lists/partial")).unwrap();
        fs::write(&outside, b"host file").unwrap();
        symlink(&outside, root.join("etc/resolv.conf")).unwrap();
        fs::write(root.join("etc/hostname"), b"buildhost\n").unwrap();
        fs::write(root.join("var/cache/apt/archives/a_1_amd64.deb"), b"x").unwrap();
        fs::write(root.join("var/cache/apt/pkgcache.bin"), b"x").unwrap();
        fs::write(root.join("var/lib/apt/lists/x_Packages"), b"x").unwrap();
        fs::write(
            root.join("etc/passwd"),
            b"root:x:0:0:root:/root:/bin/bash\n",
        )
        .unwrap();
        fs::write(root.join("etc/group"), b"root:x:0:\n").unwrap();
        fs::write(root.join("etc/shadow"), b"root:*:19000:0:99999:7:::").unwrap();
        fs::set_permissions(root.join("etc/shadow"), fs::Permissions::from_mode(0o640)).unwrap();

        customise(&root).unwrap();
        // Twice: the user is added once.
        customise(&root).unwrap();

        assert_eq!(fs::read(&outside).unwrap(), b"host file");
        assert_eq!(fs::read(root.join("etc/resolv.conf")).unwrap(), b"");
        assert_eq!(fs::read(root.join("etc/hostname")).unwrap(), b"forkd\n");
        assert!(fs::read_to_string(root.join("etc/hosts"))
            .unwrap()
            .contains("localhost"));
        assert_eq!(fs::read(root.join("etc/machine-id")).unwrap(), b"");
        assert!(!root.join("var/cache/apt/archives/a_1_amd64.deb").exists());
        assert!(!root.join("var/cache/apt/pkgcache.bin").exists());
        assert!(!root.join("var/lib/apt/lists/x_Packages").exists());
        assert!(root.join("var/lib/apt/lists/partial").is_dir());
        let tmp_mode = fs::metadata(root.join("tmp")).unwrap().permissions().mode();
        assert_eq!(tmp_mode & 0o7777, 0o1777);
        assert!(root.join("run").is_dir());
        let passwd = fs::read_to_string(root.join("etc/passwd")).unwrap();
        assert_eq!(
            passwd,
            "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n"
        );
        let shadow = fs::read_to_string(root.join("etc/shadow")).unwrap();
        assert_eq!(shadow.lines().count(), 2);
        let shadow_mode = fs::metadata(root.join("etc/shadow"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(shadow_mode & 0o777, 0o640);
        let home = fs::metadata(root.join("home/user")).unwrap();
        assert_eq!((home.uid(), home.gid()), (1000, 1000));
    }
}
