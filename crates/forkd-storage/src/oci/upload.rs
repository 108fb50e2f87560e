//! Container images sent to the daemon (`POST /v1/images`) instead of named by a host
//! path: a client may not make the daemon open files of the host, so `forkd template
//! build` sends the archive or layout its recipe names, and the recipe given to the
//! daemon says `from = "upload:sha256:<hex>"`.
//!
//! The body (a `docker save` tar or a tar of an OCI layout) is read once into a scratch
//! layout ([`super::docker_archive::to_layout`]), its manifest, config and layers go into
//! the image blob cache, checked as a pull checks them, and a small layout is kept under
//! `images/oci/uploads/<hex>`: `oci-layout`, `index.json` and the manifest. A build from
//! it finds the config and layers in the cache and copies nothing.

use super::image::{fetch_image, ImageSource};
use super::{digest_of, io, ArchiveError};
use forkd_image::{Home, ScratchDir};
use std::io::Read;
use std::path::{Path, PathBuf};

/// How a recipe names an uploaded image: `upload:sha256:<hex>`.
pub const SCHEME: &str = "upload:";

/// The prefix of an upload's scratch directory (removed at the daemon's start if a
/// stopped one left it).
pub const SCRATCH_PREFIX: &str = "image-upload-";

/// What an upload made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uploaded {
    /// What a recipe's `from` says to build on it.
    pub from: String,
    /// The digest of its manifest.
    pub digest: String,
    /// How many layers it has.
    pub layers: usize,
}

fn uploads_root(home: &Home) -> PathBuf {
    home.images_dir().join("oci/uploads")
}

/// The layout kept for the uploaded image `hex`; refused when there is none.
pub fn layout_dir(home: &Home, hex: &str) -> Result<PathBuf, ArchiveError> {
    let dir = uploads_root(home).join(hex);
    if !dir.join("index.json").is_file() {
        return Err(ArchiveError::Refused(format!(
            "no image {} was uploaded to this daemon: send it first (POST /v1/images; `forkd template build` does it for a recipe's docker-archive: or oci-layout: source)",
            digest_of(hex)
        )));
    }
    Ok(dir)
}

/// Reads an image archive from `input` into a scratch layout holding the image `tag`
/// (the only one when `None`). Blocking.
pub fn receive(
    home: &Home,
    input: impl Read,
    tag: Option<&str>,
) -> Result<ScratchDir, ArchiveError> {
    let scratch = ScratchDir::new(&home.tmp_dir(), SCRATCH_PREFIX)
        .map_err(|e| io("making a scratch directory")(std::io::Error::other(e)))?;
    super::docker_archive::to_layout(input, "the image archive", tag, scratch.path())?;
    Ok(scratch)
}

/// Moves the image of the scratch layout `dir` into the blob cache and keeps its
/// layout; answers what a recipe names it by.
pub async fn install(
    home: &Home,
    dir: &Path,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Uploaded, ArchiveError> {
    let src = ImageSource::Layout {
        dir: dir.to_owned(),
        tag: None,
    };
    let opts = super::registry::RegistryOptions::default();
    let fetched = fetch_image(home, &src, "the uploaded image", &opts, progress).await?;
    let digest = fetched.defaults.digest.clone();
    let hex = super::hex_of(&digest)
        .ok_or_else(|| ArchiveError::Refused(format!("{digest:?} is not a sha256 digest")))?
        .to_owned();
    let root = uploads_root(home);
    let dest = root.join(&hex);
    if !dest.join("index.json").is_file() {
        // Written aside (a directory of this upload's own: two uploads of one image may
        // run at once) and renamed: a kept layout is whole or absent.
        std::fs::create_dir_all(&root).map_err(io(format!("creating {}", root.display())))?;
        let aside = tempfile::Builder::new()
            .prefix(".partial-")
            .tempdir_in(&root)
            .map_err(io("making a directory for the upload"))?;
        let tmp = aside.path().to_owned();
        let blobs = tmp.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).map_err(io(format!("creating {}", blobs.display())))?;
        std::fs::write(blobs.join(&hex), &fetched.manifest).map_err(io("writing the manifest"))?;
        std::fs::copy(dir.join("oci-layout"), tmp.join("oci-layout"))
            .map_err(io("writing oci-layout"))?;
        let index = serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": super::MANIFEST_MEDIA_TYPE,
                "digest": digest,
                "size": fetched.manifest.len(),
            }],
        });
        std::fs::write(tmp.join("index.json"), index.to_string())
            .map_err(io("writing index.json"))?;
        match std::fs::rename(&tmp, &dest) {
            Ok(()) => {}
            // The same image, kept by an upload that finished first.
            Err(_) if dest.join("index.json").is_file() => {}
            Err(e) => return Err(io(format!("storing {}", dest.display()))(e)),
        }
    }
    Ok(Uploaded {
        from: format!("{SCHEME}{digest}"),
        digest,
        layers: fetched.layers.len(),
    })
}
