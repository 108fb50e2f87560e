//! `forkd image pull`: a container image (from a registry or an OCI layout directory)
//! made into a guest root filesystem. The manifest (for an index, the linux/amd64 one),
//! the config and the layers are fetched into a blob cache under the data directory,
//! each checked against its digest and size; the layers are then applied in order and
//! packed into an ext4 image by `forkd_image::oci_rootfs`, cached by the manifest's
//! digest. Templates name the image with `from = "..."` in their recipe.

use super::registry::{self, RegistryOptions};
use super::{hex_of, io, ArchiveError};
use forkd_image::oci_rootfs::{self, Compression, ImageDefaults, Layer};
use forkd_image::{Asset, Home};
use oci_client::manifest::{OciDescriptor, OciImageManifest};
use oci_client::{Reference, RegistryOperation};
use sha2::Digest;
use std::path::{Path, PathBuf};

/// Where an image comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ImageSource {
    /// A registry: `REGISTRY/REPO:TAG` or `...@sha256:...`.
    Registry(String),
    /// An OCI image layout directory, and the tag (`org.opencontainers.image.ref.name`)
    /// of the image in it (the only one when not given).
    Layout {
        /// The directory.
        dir: PathBuf,
        /// The tag.
        tag: Option<String>,
    },
    /// An archive `docker save` writes, and the `REPO:TAG` of the image in it (the only
    /// one when not given).
    DockerArchive {
        /// The archive.
        file: PathBuf,
        /// The image's `REPO:TAG`.
        tag: Option<String>,
    },
    /// An image sent to the daemon (`upload:sha256:<hex>`, see [`super::upload`]), by
    /// the hex digest of its manifest.
    Upload(String),
}

impl ImageSource {
    /// `oci-layout:PATH[:TAG]`, `docker-archive:FILE[:REPO:TAG]`, else a registry
    /// reference.
    pub fn parse(s: &str) -> Result<ImageSource, ArchiveError> {
        if let Some(rest) = s.strip_prefix("oci-layout:") {
            let (dir, tag) = match rest.rsplit_once(':') {
                Some((d, t)) if !t.contains('/') => (d, Some(t.to_owned())),
                _ => (rest, None),
            };
            return Ok(ImageSource::Layout {
                dir: PathBuf::from(dir),
                tag,
            });
        }
        if let Some(rest) = s.strip_prefix("docker-archive:") {
            let (file, tag) = match rest.split_once(':') {
                Some((f, t)) => (f, Some(t.to_owned())),
                None => (rest, None),
            };
            return Ok(ImageSource::DockerArchive {
                file: PathBuf::from(file),
                tag,
            });
        }
        if let Some(rest) = s.strip_prefix(super::upload::SCHEME) {
            let hex = super::hex_of(rest).ok_or_else(|| {
                ArchiveError::Refused(format!(
                    "{s:?} is not an uploaded image's name ({}sha256:<64 hex digits>)",
                    super::upload::SCHEME
                ))
            })?;
            return Ok(ImageSource::Upload(hex.to_owned()));
        }
        registry::parse_reference(s)?;
        Ok(ImageSource::Registry(s.to_owned()))
    }

    /// The host file or directory it names, if any: what a daemon must not open for a
    /// client unless its operator allowed that directory.
    pub fn host_path(&self) -> Option<&Path> {
        match self {
            ImageSource::Layout { dir, .. } => Some(dir),
            ImageSource::DockerArchive { file, .. } => Some(file),
            ImageSource::Registry(_) | ImageSource::Upload(_) => None,
        }
    }
}

/// The blob cache: `<home>/images/oci/blobs/sha256/<hex>`.
fn blob_dir(home: &Home) -> PathBuf {
    home.images_dir().join("oci/blobs/sha256")
}

/// An image made into a rootfs.
#[derive(Debug, Clone)]
pub struct PulledImage {
    /// What it says about running it, and its digest.
    pub defaults: ImageDefaults,
    /// The rootfs image.
    pub rootfs: Asset,
}

/// Fetches the image `source` and makes (or reuses) its rootfs.
pub async fn pull_image(
    home: &Home,
    source: &str,
    opts: &RegistryOptions,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<PulledImage, ArchiveError> {
    let mut src = ImageSource::parse(source)?;
    // A docker archive is read through a layout made of it, kept until the blobs are in
    // the cache.
    let _converted = match &src {
        ImageSource::DockerArchive { file, tag } => {
            progress(&format!("{source}: reading the archive"));
            // Every file of it is copied out (the layers of any other image in it too).
            let input =
                std::fs::File::open(file).map_err(io(format!("opening {}", file.display())))?;
            let size = input
                .metadata()
                .map_err(io(format!("reading {}", file.display())))?
                .len();
            forkd_host::space::ensure_room(&home.tmp_dir(), size, &format!("reading {source}"))?;
            let scratch = forkd_image::ScratchDir::new(&home.tmp_dir(), "docker-archive-")
                .map_err(|e| io("making a scratch directory")(std::io::Error::other(e)))?;
            let (what, tag, dir) = (
                file.display().to_string(),
                tag.clone(),
                scratch.path().to_owned(),
            );
            tokio::task::spawn_blocking(move || {
                super::docker_archive::to_layout(input, &what, tag.as_deref(), &dir)
            })
            .await
            .map_err(|e| io("reading the archive")(std::io::Error::other(e)))??;
            src = ImageSource::Layout {
                dir: scratch.path().to_owned(),
                tag: None,
            };
            Some(scratch)
        }
        ImageSource::Upload(hex) => {
            src = ImageSource::Layout {
                dir: super::upload::layout_dir(home, hex)?,
                tag: None,
            };
            None
        }
        _ => None,
    };
    let fetched = fetch_image(home, &src, source, opts, progress).await?;
    let home2 = home.clone();
    let d2 = fetched.defaults.clone();
    let layers = fetched.layers;
    progress(&format!("{source}: making its root filesystem"));
    let rootfs = tokio::task::spawn_blocking(move || {
        oci_rootfs::ensure_oci_rootfs(&home2, &d2, &layers, &forkd_image::BuildOptions::default())
    })
    .await
    .map_err(|e| io("building the rootfs")(std::io::Error::other(e)))?
    .map_err(|e| ArchiveError::Refused(format!("{source}: {e}")))?;
    Ok(PulledImage {
        defaults: fetched.defaults,
        rootfs,
    })
}

/// An image whose manifest, config and layers are in the blob cache.
#[derive(Debug)]
pub struct FetchedImage {
    /// What it says about running it, and its digest.
    pub defaults: ImageDefaults,
    /// Its manifest, as served.
    pub manifest: Vec<u8>,
    /// Its layers in the cache, in order.
    pub layers: Vec<Layer>,
}

/// Fetches the manifest, config and layers of the image at `src` (a registry or a
/// layout: archives are read through a layout made of them) into the blob cache,
/// each checked against its digest and size. `source` names it in messages.
pub async fn fetch_image(
    home: &Home,
    src: &ImageSource,
    source: &str,
    opts: &RegistryOptions,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<FetchedImage, ArchiveError> {
    let blobs = blob_dir(home);
    std::fs::create_dir_all(&blobs).map_err(io(format!("creating {}", blobs.display())))?;
    let fetcher = Fetcher::new(src, opts, &blobs).await?;
    let (manifest_bytes, digest) = fetcher.manifest().await?;
    let manifest: OciImageManifest = serde_json::from_slice(&manifest_bytes)
        .map_err(|e| ArchiveError::Refused(format!("{source}: its manifest is not valid: {e}")))?;
    if manifest.config.media_type == super::CONFIG_MEDIA_TYPE {
        return Err(ArchiveError::Refused(format!(
            "{source} is a forkd snapshot, not a container image: fork it after `forkd pull {source}`"
        )));
    }
    progress(&format!("{source}: {digest}"));
    let config_path = fetcher.blob(&manifest.config).await?;
    let config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(&config_path).map_err(io("reading the image config"))?,
    )
    .map_err(|e| ArchiveError::Refused(format!("{source}: its config is not JSON: {e}")))?;
    if let Some(os) = config["os"].as_str().filter(|os| *os != "linux") {
        return Err(ArchiveError::Refused(format!("{source} is a {os} image")));
    }
    if let Some(arch) = config["architecture"].as_str().filter(|a| *a != ARCH) {
        return Err(ArchiveError::Refused(format!(
            "{source} is an image for {arch}; guests here are {ARCH}"
        )));
    }
    let mut layers = Vec::new();
    for (i, desc) in manifest.layers.iter().enumerate() {
        let compression = Compression::of_media_type(&desc.media_type).ok_or_else(|| {
            ArchiveError::Refused(format!(
                "{source}: layer {} has media type {:?}, not a filesystem layer",
                i + 1,
                desc.media_type
            ))
        })?;
        progress(&format!(
            "{source}: layer {} of {} ({} MiB)",
            i + 1,
            manifest.layers.len(),
            desc.size.max(0) >> 20
        ));
        layers.push(Layer {
            path: fetcher.blob(desc).await?,
            compression,
        });
    }
    let c = &config["config"];
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let nonempty = |v: &serde_json::Value| v.as_str().filter(|s| !s.is_empty()).map(str::to_owned);
    let defaults = ImageDefaults {
        reference: source.to_owned(),
        digest: digest.clone(),
        env: strings(&c["Env"]),
        working_dir: nonempty(&c["WorkingDir"]),
        user: nonempty(&c["User"]),
        entrypoint: strings(&c["Entrypoint"]),
        cmd: strings(&c["Cmd"]),
    };
    Ok(FetchedImage {
        defaults,
        manifest: manifest_bytes,
        layers,
    })
}

/// Reads an image's manifest and blobs from where it is, into the blob cache.
enum Fetcher<'a> {
    Registry {
        client: oci_client::Client,
        reference: Reference,
        auth: oci_client::secrets::RegistryAuth,
        cache: &'a Path,
    },
    Layout {
        dir: PathBuf,
        tag: Option<String>,
        cache: &'a Path,
    },
}

/// The platform an index's entry is picked for.
const ARCH: &str = "amd64";

impl<'a> Fetcher<'a> {
    async fn new(
        src: &ImageSource,
        opts: &RegistryOptions,
        cache: &'a Path,
    ) -> Result<Fetcher<'a>, ArchiveError> {
        Ok(match src {
            ImageSource::Registry(r) => {
                let reference = registry::parse_reference(r)?;
                let (client, auth) =
                    registry::connect(&reference, opts, RegistryOperation::Pull).await?;
                Fetcher::Registry {
                    client,
                    reference,
                    auth,
                    cache,
                }
            }
            ImageSource::Layout { dir, tag } => Fetcher::Layout {
                dir: dir.clone(),
                tag: tag.clone(),
                cache,
            },
            ImageSource::DockerArchive { .. } | ImageSource::Upload(_) => {
                unreachable!("read through the layout made of it")
            }
        })
    }

    /// The image manifest (through an index, the linux/amd64 one) and its digest.
    async fn manifest(&self) -> Result<(Vec<u8>, String), ArchiveError> {
        let (bytes, digest) = self.top_manifest().await?;
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| ArchiveError::Refused(format!("the manifest is not JSON: {e}")))?;
        if v["manifests"].is_array() {
            let pick = v["manifests"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|m| m["platform"]["os"] == "linux" && m["platform"]["architecture"] == ARCH)
                .and_then(|m| m["digest"].as_str())
                .ok_or_else(|| {
                    ArchiveError::Refused(format!(
                        "the image index {digest} has no linux/{ARCH} image"
                    ))
                })?
                .to_owned();
            return self.manifest_by_digest(&pick).await.map(|b| (b, pick));
        }
        Ok((bytes, digest))
    }

    async fn top_manifest(&self) -> Result<(Vec<u8>, String), ArchiveError> {
        match self {
            Fetcher::Registry {
                client,
                reference,
                auth,
                ..
            } => {
                let (bytes, digest) = client
                    .pull_manifest_raw(reference, auth, &registry::MANIFEST_TYPES)
                    .await
                    .map_err(|e| {
                        registry::registry_error(&format!("fetching {}", reference.whole()), e)
                    })?;
                let have = super::digest_of(&hex::encode(sha2::Sha256::digest(&bytes)));
                if have != digest || reference.digest().is_some_and(|d| d != have) {
                    return Err(ArchiveError::Refused(format!(
                        "{}: the manifest served does not match its digest",
                        reference.whole()
                    )));
                }
                Ok((bytes.to_vec(), digest))
            }
            Fetcher::Layout { dir, tag, .. } => {
                let index: oci_client::manifest::OciImageIndex = serde_json::from_slice(
                    &std::fs::read(dir.join("index.json"))
                        .map_err(io(format!("reading {}/index.json", dir.display())))?,
                )
                .map_err(|e| ArchiveError::Refused(format!("{}/index.json: {e}", dir.display())))?;
                let named = |e: &&oci_client::manifest::ImageIndexEntry| {
                    let name = e.annotations.as_ref().and_then(|a| a.get(super::REF_NAME));
                    match tag {
                        None => true,
                        Some(t) => name == Some(t),
                    }
                };
                let mut hits = index.manifests.iter().filter(named);
                let (Some(entry), None) = (hits.next(), hits.next()) else {
                    return Err(ArchiveError::Refused(format!(
                        "{} does not name one image{}",
                        dir.display(),
                        tag.as_ref()
                            .map(|t| format!(" tagged {t}"))
                            .unwrap_or_default()
                    )));
                };
                let bytes = self.manifest_by_digest(&entry.digest).await?;
                Ok((bytes, entry.digest.clone()))
            }
        }
    }

    async fn manifest_by_digest(&self, digest: &str) -> Result<Vec<u8>, ArchiveError> {
        let desc = OciDescriptor {
            media_type: oci_client::manifest::OCI_IMAGE_MEDIA_TYPE.into(),
            digest: digest.to_owned(),
            size: -1,
            urls: None,
            annotations: None,
            artifact_type: None,
        };
        match self {
            Fetcher::Registry {
                client,
                reference,
                auth,
                ..
            } => {
                let at = reference.clone_with_digest(digest.to_owned());
                let (bytes, _) = client
                    .pull_manifest_raw(
                        &at,
                        auth,
                        &[
                            oci_client::manifest::OCI_IMAGE_MEDIA_TYPE,
                            oci_client::manifest::IMAGE_MANIFEST_MEDIA_TYPE,
                        ],
                    )
                    .await
                    .map_err(|e| registry::registry_error(&format!("fetching {digest}"), e))?;
                check_digest(&bytes, digest)?;
                Ok(bytes.to_vec())
            }
            Fetcher::Layout { .. } => {
                let path = self.local_blob(&desc)?;
                let bytes = std::fs::read(&path).map_err(io(format!("reading {digest}")))?;
                check_digest(&bytes, digest)?;
                Ok(bytes)
            }
        }
    }

    /// A layout's blob file, by descriptor.
    fn local_blob(&self, desc: &OciDescriptor) -> Result<PathBuf, ArchiveError> {
        let Fetcher::Layout { dir, .. } = self else {
            unreachable!("only for layouts");
        };
        let hex = hex_of(&desc.digest).ok_or_else(|| {
            ArchiveError::Refused(format!("{:?} is not a sha256 digest", desc.digest))
        })?;
        Ok(dir.join("blobs/sha256").join(hex))
    }

    /// The blob in the cache, fetched (and checked) if it is not there yet.
    async fn blob(&self, desc: &OciDescriptor) -> Result<PathBuf, ArchiveError> {
        let hex = hex_of(&desc.digest).ok_or_else(|| {
            ArchiveError::Refused(format!("{:?} is not a sha256 digest", desc.digest))
        })?;
        let cache = match self {
            Fetcher::Registry { cache, .. } | Fetcher::Layout { cache, .. } => cache,
        };
        let dest = cache.join(hex);
        if std::fs::metadata(&dest).is_ok_and(|m| i64::try_from(m.len()).ok() == Some(desc.size)) {
            return Ok(dest);
        }
        match self {
            Fetcher::Registry {
                client, reference, ..
            } => registry::fetch_blob_to(client, reference, desc, &dest).await?,
            Fetcher::Layout { .. } => {
                let src = self.local_blob(desc)?;
                let (dest2, want) = (dest.clone(), desc.clone());
                tokio::task::spawn_blocking(move || copy_checked(&src, &dest2, &want))
                    .await
                    .map_err(|e| io("copying a blob")(std::io::Error::other(e)))??;
            }
        }
        Ok(dest)
    }
}

fn check_digest(bytes: &[u8], digest: &str) -> Result<(), ArchiveError> {
    let have = super::digest_of(&hex::encode(sha2::Sha256::digest(bytes)));
    if have != digest {
        return Err(ArchiveError::Refused(format!(
            "the manifest {digest} does not match its digest"
        )));
    }
    Ok(())
}

/// Copies a layout's blob into the cache, checking its size and digest on the way.
fn copy_checked(src: &Path, dest: &Path, desc: &OciDescriptor) -> Result<(), ArchiveError> {
    let mut input = std::fs::File::open(src).map_err(io(format!("reading {}", src.display())))?;
    let mut tmp = dest.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    let mut sink = super::blob::Hashing::create(&tmp).map_err(io("writing a blob"))?;
    std::io::copy(&mut input, &mut sink).map_err(io(format!("copying {}", src.display())))?;
    let (hex, n) = sink.sync().map_err(io("writing a blob"))?;
    if i64::try_from(n).ok() != Some(desc.size) || super::digest_of(&hex) != desc.digest {
        let _ = std::fs::remove_file(&tmp);
        return Err(ArchiveError::Refused(format!(
            "blob {} does not match its digest and size",
            desc.digest
        )));
    }
    std::fs::rename(&tmp, dest).map_err(io("storing a blob"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_registries_or_layouts() {
        assert_eq!(
            ImageSource::parse("oci-layout:/srv/img:v1").unwrap(),
            ImageSource::Layout {
                dir: "/srv/img".into(),
                tag: Some("v1".into())
            }
        );
        assert_eq!(
            ImageSource::parse("oci-layout:/srv/img").unwrap(),
            ImageSource::Layout {
                dir: "/srv/img".into(),
                tag: None
            }
        );
        assert_eq!(
            ImageSource::parse("127.0.0.1:5000/team/app:1").unwrap(),
            ImageSource::Registry("127.0.0.1:5000/team/app:1".into())
        );
        assert_eq!(
            ImageSource::parse("docker-archive:/tmp/x.tar:team/app:1").unwrap(),
            ImageSource::DockerArchive {
                file: "/tmp/x.tar".into(),
                tag: Some("team/app:1".into())
            }
        );
        assert_eq!(
            ImageSource::parse("docker-archive:x.tar").unwrap(),
            ImageSource::DockerArchive {
                file: "x.tar".into(),
                tag: None
            }
        );
        assert!(ImageSource::parse("Not A Reference").is_err());
    }
}
