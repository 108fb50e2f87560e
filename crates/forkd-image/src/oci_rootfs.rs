//! Root file system images from OCI images: the image's layers applied in order onto an
//! empty tree (the image spec's changeset rules: whiteouts, opaque directories, files
//! replacing directories and back), made a sandbox guest's root as the Debian images are
//! (its own hostname, no host resolvers, the `user` account where the image has
//! accounts), and packed with `mkfs.ext4 -d` into
//! `<home>/images/rootfs/oci-<digest>.ext4`, cached by the image's manifest digest.
//!
//! The image's `Env`, `WorkingDir` and `User` are written to `/etc/forkd/image.json`,
//! where the guest agent takes them as the defaults of every command and code context.
//! `Entrypoint` and `Cmd` are recorded there too, and not run: a template's parent runs
//! the agent, and its warm-up steps say what else runs.
//!
//! Entries are unpacked with the tar crate's `unpack_in`, which refuses paths that climb
//! out of the tree and writes nothing through a symbolic link that points out of it.

use crate::asset::{self, Asset};
use crate::error::{ImageError, Result};
use crate::fsutil::{self, ScratchDir};
use crate::inputs::Inputs;
use crate::lock::BuildLock;
use crate::rootfs;
use crate::{BuildOptions, Home};
use std::fs;
use std::io::Read;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Component, Path, PathBuf};
use std::time::Instant;

/// Bump when what is added to an image's tree changes.
const CUSTOMISE_VERSION: &str = "1";
/// Where the image's defaults are written, in the tree.
fn image_config_path(root: &Path) -> PathBuf {
    root.join(forkd_proto::image::IMAGE_CONFIG_PATH.trim_start_matches('/'))
}

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// A plain tar.
    None,
    /// gzip (`...tar+gzip`, Docker's `...tar.gzip`).
    Gzip,
    /// zstd.
    Zstd,
}

impl Compression {
    /// From a layer's media type; None for one that is not a filesystem layer.
    pub fn of_media_type(media_type: &str) -> Option<Compression> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Some(Compression::None),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip" => Some(Compression::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd" => Some(Compression::Zstd),
            _ => None,
        }
    }
}

/// One layer to apply: its blob and how it is compressed.
#[derive(Debug, Clone)]
pub struct Layer {
    /// The blob (already checked against its digest).
    pub path: PathBuf,
    /// Its compression.
    pub compression: Compression,
}

pub use forkd_proto::image::ImageDefaults;

/// The file name of the rootfs made from the image with manifest digest `digest`.
pub fn rootfs_name(digest: &str) -> String {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    format!("oci-{}", &hex[..hex.len().min(16)])
}

/// Builds (or reuses) the rootfs image of an OCI image whose layers are `layers`.
pub fn ensure_oci_rootfs(
    home: &Home,
    defaults: &ImageDefaults,
    layers: &[Layer],
    opts: &BuildOptions,
) -> Result<Asset> {
    let a = build_oci_rootfs(home, defaults, layers, opts)?;
    record_image(home, defaults)?;
    Ok(a)
}

fn build_oci_rootfs(
    home: &Home,
    defaults: &ImageDefaults,
    layers: &[Layer],
    opts: &BuildOptions,
) -> Result<Asset> {
    let inputs = Inputs::new("oci-rootfs")
        .field("digest", &defaults.digest)
        .field("customise", CUSTOMISE_VERSION)
        .digest();
    let name = rootfs_name(&defaults.digest);
    let file = home.rootfs_dir().join(format!("{name}.ext4"));
    let manifest = home.rootfs_dir().join(format!("{name}.json"));
    let current = || asset::load_asset(&manifest, &file).filter(|a| a.is_current(&inputs));
    let _lock = match BuildLock::reuse_or_acquire(home, opts, current)? {
        Ok(asset) => return Ok(asset),
        Err(lock) => lock,
    };
    if !nix::unistd::geteuid().is_root() {
        return Err(ImageError::NeedRoot {
            what: format!("the rootfs of {}", defaults.reference),
        });
    }
    let started = Instant::now();
    fsutil::create_dir_all(&home.rootfs_dir())?;
    let scratch = ScratchDir::new(&home.tmp_dir(), &format!("{name}-"))?;
    let target = scratch.path().join("root");
    fs::DirBuilder::new()
        .mode(0o755)
        .create(&target)
        .map_err(|e| ImageError::io("create directory", &target, e))?;
    for (i, layer) in layers.iter().enumerate() {
        let step = opts.progress.step(format!(
            "rootfs {name}: layer {} of {}",
            i + 1,
            layers.len()
        ));
        apply_layer(&target, layer)?;
        step.finish();
    }
    let step = opts.progress.step(format!("rootfs {name}: customising"));
    customise(&target, defaults)?;
    step.finish();
    rootfs::publish_tree(
        &target,
        scratch.path(),
        &name,
        rootfs::Published {
            file,
            manifest,
            started,
            inputs,
        },
        &opts.progress,
    )
}

/// Records beside the rootfs what `forkd image ls` says of it: the reference it was
/// last pulled as, and its digest.
fn record_image(home: &Home, defaults: &ImageDefaults) -> Result<()> {
    let name = rootfs_name(&defaults.digest);
    let json = serde_json::to_vec_pretty(defaults).expect("defaults serialize");
    fsutil::write_atomic(&home.rootfs_dir().join(format!("{name}.image")), &json)
}

/// What was recorded of the image a rootfs (`oci-...`) was made from.
pub fn image_of(home: &Home, name: &str) -> Option<ImageDefaults> {
    let text = fs::read(home.rootfs_dir().join(format!("{name}.image"))).ok()?;
    serde_json::from_slice(&text).ok()
}

fn bad_layer(path: &Path, detail: impl Into<String>) -> ImageError {
    ImageError::BadLayer {
        path: path.to_owned(),
        detail: detail.into(),
    }
}

/// Applies one layer onto `root`.
pub fn apply_layer(root: &Path, layer: &Layer) -> Result<()> {
    let f = fs::File::open(&layer.path).map_err(|e| ImageError::io("open", &layer.path, e))?;
    let reader: Box<dyn Read> = match layer.compression {
        Compression::None => Box::new(std::io::BufReader::new(f)),
        Compression::Gzip => Box::new(flate2::read::GzDecoder::new(std::io::BufReader::new(f))),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::new(f)
                .map_err(|e| ImageError::io("read", &layer.path, e))?,
        ),
    };
    apply_tar(root, reader).map_err(|e| match e {
        ImageError::BadLayer { detail, .. } => bad_layer(&layer.path, detail),
        other => other,
    })
}

/// Applies a layer's (uncompressed) tar stream onto `root`.
pub fn apply_tar(root: &Path, tar: impl Read) -> Result<()> {
    let bad = |d: String| bad_layer(root, d);
    let mut archive = tar::Archive::new(tar);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_preserve_mtime(true);
    archive.set_unpack_xattrs(true);
    archive.set_overwrite(true);
    // Paths this layer made: an opaque directory hides what lower layers put there,
    // not what this one adds.
    let mut made: std::collections::HashSet<PathBuf> = Default::default();
    let mut opaque: Vec<PathBuf> = Vec::new();
    for entry in archive
        .entries()
        .map_err(|e| bad(format!("not a tar: {e}")))?
    {
        let mut entry = entry.map_err(|e| bad(format!("the tar is damaged: {e}")))?;
        let raw = entry
            .path()
            .map_err(|e| bad(format!("an entry's name: {e}")))?
            .into_owned();
        let rel =
            normalise(&raw).ok_or_else(|| bad(format!("entry {raw:?} climbs out of the tree")))?;
        let Some(name) = rel.file_name().and_then(|n| n.to_str()).map(str::to_owned) else {
            continue; // the tree's top itself
        };
        let parent = rel.parent().unwrap_or(Path::new("")).to_owned();
        if name == ".wh..wh..opq" {
            opaque.push(parent);
            continue;
        }
        if let Some(hidden) = name.strip_prefix(".wh.") {
            remove_inside(root, &parent.join(hidden))?;
            continue;
        }
        let kind = entry.header().entry_type();
        // A directory replaces a file and a file a directory: the lower one goes.
        let dest = root.join(&rel);
        if let Ok(m) = fs::symlink_metadata(&dest) {
            if m.is_dir() != kind.is_dir() {
                remove_inside(root, &rel)?;
            }
        }
        if kind.is_hard_link() {
            // The link's target is a path in the tree, as the entry's name is.
            let target = entry
                .link_name()
                .ok()
                .flatten()
                .and_then(|t| normalise(&t))
                .ok_or_else(|| bad(format!("hard link {raw:?} names a target outside the tree")))?;
            if fs::symlink_metadata(&dest).is_ok() {
                remove_inside(root, &rel)?;
            }
            if !root.join(&target).exists() {
                return Err(bad(format!(
                    "hard link {raw:?} names {target:?}, which is not in the tree"
                )));
            }
        }
        entry
            .unpack_in(root)
            .map_err(|e| bad(format!("{raw:?}: {e}")))?;
        made.insert(rel);
    }
    for dir in opaque {
        let abs = root.join(&dir);
        let Ok(children) = fs::read_dir(&abs) else {
            continue;
        };
        for c in children.flatten() {
            let rel = dir.join(c.file_name());
            if !made.contains(&rel) {
                remove_inside(root, &rel)?;
            }
        }
    }
    Ok(())
}

/// `p` without `.` and leading `/`, or None if it has `..`.
fn normalise(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Removes `rel` (a file, link or whole directory) from the tree, after checking that
/// its parent resolves inside the tree (a symbolic link in a lower layer must not make a
/// whiteout remove something of the host).
fn remove_inside(root: &Path, rel: &Path) -> Result<()> {
    let path = root.join(rel);
    let Ok(meta) = fs::symlink_metadata(&path) else {
        return Ok(());
    };
    let parent = path.parent().unwrap_or(root);
    let real_parent = parent
        .canonicalize()
        .map_err(|e| ImageError::io("resolve", parent, e))?;
    let real_root = root
        .canonicalize()
        .map_err(|e| ImageError::io("resolve", root, e))?;
    if !real_parent.starts_with(&real_root) {
        return Err(bad_layer(
            root,
            format!("{} lies behind a link out of the tree", rel.display()),
        ));
    }
    let r = if meta.is_dir() {
        fs::remove_dir_all(&path)
    } else {
        fs::remove_file(&path)
    };
    r.map_err(|e| ImageError::io("remove", &path, e))
}

/// What every guest root needs, on top of the image: its own identity, the mount points,
/// the `user` account where the image keeps accounts, and the image's defaults.
fn customise(root: &Path, defaults: &ImageDefaults) -> Result<()> {
    rootfs::customise_identity(root)?;
    if root.join("etc/passwd").is_file() {
        rootfs::add_user(root)?;
    }
    let path = image_config_path(root);
    fsutil::create_dir_all(path.parent().unwrap_or(root))?;
    let json = serde_json::to_vec_pretty(defaults).expect("defaults serialize");
    fs::write(&path, json).map_err(|e| ImageError::io("write", &path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// A tar of `entries`: (name, kind, data or link target, mode, uid). Names are
    /// written as given, `..` included (the tar crate's builder would refuse them).
    fn tar_of(entries: &[(&str, tar::EntryType, &str, u32, u64)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (name, kind, data, mode, uid) in entries {
            let mut h = tar::Header::new_gnu();
            h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
            h.set_entry_type(*kind);
            h.set_mode(*mode);
            h.set_uid(*uid);
            h.set_gid(*uid);
            h.set_mtime(1_700_000_000);
            let body: &[u8] = if kind.is_symlink() || kind.is_hard_link() {
                h.set_link_name(data).unwrap();
                b""
            } else {
                data.as_bytes()
            };
            h.set_size(body.len() as u64);
            h.set_cksum();
            b.append(&h, body).unwrap();
        }
        b.into_inner().unwrap()
    }

    use tar::EntryType as E;

    #[test]
    fn layers_apply_with_whiteouts_opaque_directories_links_and_owners() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        fs::create_dir(&root).unwrap();
        let lower = tar_of(&[
            ("etc/", E::Directory, "", 0o755, 0),
            ("etc/gone.conf", E::Regular, "old", 0o644, 0),
            ("etc/kept.conf", E::Regular, "kept", 0o600, 1000),
            ("data/", E::Directory, "", 0o755, 0),
            ("data/a", E::Regular, "a", 0o644, 0),
            ("data/b", E::Regular, "b", 0o644, 0),
            ("bin/", E::Directory, "", 0o755, 0),
            ("bin/tool", E::Regular, "#!/bin/sh\n", 0o755, 0),
            ("bin/alias", E::Symlink, "tool", 0o777, 0),
            ("bin/same", E::Link, "bin/tool", 0o755, 0),
            ("was-dir/", E::Directory, "", 0o755, 0),
            ("was-dir/x", E::Regular, "x", 0o644, 0),
        ]);
        let upper = tar_of(&[
            ("etc/.wh.gone.conf", E::Regular, "", 0o644, 0),
            ("data/.wh..wh..opq", E::Regular, "", 0o644, 0),
            ("data/c", E::Regular, "c", 0o640, 0),
            ("was-dir", E::Regular, "now a file", 0o644, 0),
        ]);
        apply_tar(&root, &lower[..]).unwrap();
        apply_tar(&root, &upper[..]).unwrap();
        assert!(!root.join("etc/gone.conf").exists(), "whited out");
        assert!(
            !root.join("etc/.wh.gone.conf").exists(),
            "whiteouts are not files"
        );
        let kept = fs::metadata(root.join("etc/kept.conf")).unwrap();
        assert_eq!(
            (kept.permissions().mode() & 0o777, kept.uid()),
            (0o600, 1000)
        );
        let mut data: Vec<_> = fs::read_dir(root.join("data"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        data.sort();
        assert_eq!(
            data,
            ["c"],
            "the opaque directory hides the lower layer's files"
        );
        assert_eq!(
            fs::read_link(root.join("bin/alias")).unwrap(),
            Path::new("tool")
        );
        assert_eq!(
            fs::metadata(root.join("bin/same")).unwrap().ino(),
            fs::metadata(root.join("bin/tool")).unwrap().ino(),
            "a hard link"
        );
        assert_eq!(
            fs::read_to_string(root.join("was-dir")).unwrap(),
            "now a file"
        );
    }

    #[test]
    fn nothing_is_written_or_removed_outside_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        fs::create_dir(&root).unwrap();
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("victim"), "keep me").unwrap();
        let escape = tar_of(&[("../outside/victim", E::Regular, "owned", 0o644, 0)]);
        assert!(apply_tar(&root, &escape[..]).is_err());
        // A link to the outside, then a file and a whiteout through it.
        let link = tar_of(&[("out", E::Symlink, outside.to_str().unwrap(), 0o777, 0)]);
        apply_tar(&root, &link[..]).unwrap();
        let through = tar_of(&[("out/victim", E::Regular, "owned", 0o644, 0)]);
        assert!(apply_tar(&root, &through[..]).is_err());
        let whiteout = tar_of(&[("out/.wh.victim", E::Regular, "", 0o644, 0)]);
        assert!(apply_tar(&root, &whiteout[..]).is_err());
        assert_eq!(
            fs::read_to_string(outside.join("victim")).unwrap(),
            "keep me"
        );
    }
}
