//! `forkd push` and `forkd pull`: a snapshot chain to and from an OCI registry, over the
//! distribution protocol (oci-client), with the manifests and blobs `forkd pack` makes.
//!
//! Push uploads every blob the registry does not have yet (so a chain's base goes up
//! once, and a push cut short resumes with the blobs it had not finished), then the
//! manifests root first: the ancestors by digest, the head under the reference's tag.
//! Pull follows the head's parent annotations down to the root, checks every blob
//! against its digest and size as it arrives, and installs the chain like an unpack.

use super::layout::{Artifact, Layout};
use super::unpack::{self, Unpacked};
use super::{hex_of, io, pack, ArchiveError};
use crate::snapshot::{Store, Tag};
use futures::StreamExt;
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};
use std::path::PathBuf;
use tokio::io::AsyncWriteExt;

/// How registries are reached.
#[derive(Debug, Clone, Default)]
pub struct RegistryOptions {
    /// Registries (`host[:port]`) spoken to over plain HTTP. Loopback registries always
    /// are, as with Docker.
    pub insecure: Vec<String>,
    /// The docker-style auth file to read credentials from (else `REGISTRY_AUTH_FILE`,
    /// else `~/.docker/config.json`).
    pub auth_file: Option<PathBuf>,
}

/// What a push or pull reports as it goes: bytes done of bytes in all, and the step.
pub type Progress<'a> = &'a (dyn Fn(u64, u64, &str) + Sync);

/// What a push did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Pushed {
    /// The reference pushed to.
    pub reference: String,
    /// The digest of the head's manifest.
    pub digest: String,
    /// The snapshots pushed, root first.
    pub snapshots: Vec<String>,
    /// Blobs uploaded.
    pub uploaded: usize,
    /// Blobs the registry had already.
    pub skipped: usize,
    /// Bytes uploaded.
    pub uploaded_bytes: u64,
}

fn refused(m: String) -> ArchiveError {
    ArchiveError::Refused(m)
}

pub(crate) fn registry_error(
    what: &str,
    e: oci_client::errors::OciDistributionError,
) -> ArchiveError {
    ArchiveError::Io {
        context: what.to_owned(),
        source: std::io::Error::other(e.to_string()),
    }
}

/// Parses a registry reference (`host[:port]/repo[:tag|@sha256:...]`).
pub fn parse_reference(s: &str) -> Result<Reference, ArchiveError> {
    s.parse::<Reference>()
        .map_err(|e| refused(format!("{s:?} is not a registry reference ({e})")))
}

fn is_loopback(registry: &str) -> bool {
    let host = registry
        .rsplit_once(':')
        .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
        .map_or(registry, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

pub(crate) fn client(reference: &Reference, opts: &RegistryOptions) -> Client {
    // reqwest's rustls takes the process's provider: the workspace's is ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let registry = reference.resolve_registry().to_owned();
    let plain = is_loopback(&registry) || opts.insecure.contains(&registry);
    let protocol = if plain {
        oci_client::client::ClientProtocol::Http
    } else {
        oci_client::client::ClientProtocol::Https
    };
    Client::new(oci_client::client::ClientConfig {
        protocol,
        // A registry that does not answer fails the operation instead of holding it.
        connect_timeout: Some(std::time::Duration::from_secs(30)),
        read_timeout: Some(std::time::Duration::from_secs(120)),
        ..Default::default()
    })
}

/// A client of `reference`'s registry, authenticated for `operation` with the auth
/// file's credentials (a token fetched where the registry asks for one).
pub(crate) async fn connect(
    reference: &Reference,
    opts: &RegistryOptions,
    operation: RegistryOperation,
) -> Result<(Client, RegistryAuth), ArchiveError> {
    let client = client(reference, opts);
    let auth = credentials(reference.resolve_registry(), opts)?;
    client
        .auth(reference, &auth, operation)
        .await
        .map_err(|e| {
            registry_error(
                &format!("authenticating with {}", reference.resolve_registry()),
                e,
            )
        })?;
    Ok((client, auth))
}

/// What a pull accepts as a manifest: OCI and Docker image manifests and indexes.
pub(crate) const MANIFEST_TYPES: [&str; 4] = [
    oci_client::manifest::OCI_IMAGE_MEDIA_TYPE,
    oci_client::manifest::OCI_IMAGE_INDEX_MEDIA_TYPE,
    oci_client::manifest::IMAGE_MANIFEST_MEDIA_TYPE,
    oci_client::manifest::IMAGE_MANIFEST_LIST_MEDIA_TYPE,
];

/// The credentials for `registry` in the docker-style auth file, else anonymous.
pub fn credentials(registry: &str, opts: &RegistryOptions) -> Result<RegistryAuth, ArchiveError> {
    let Some(path) = super::auth::auth_file(opts.auth_file.as_deref()) else {
        return Ok(RegistryAuth::Anonymous);
    };
    match super::auth::lookup(&path, registry)? {
        Some((user, password)) => Ok(RegistryAuth::Basic(user, password)),
        None => Ok(RegistryAuth::Anonymous),
    }
}

/// Pushes `tag` and its ancestors to `reference` (whose tag names the head).
pub async fn push(
    store: &Store,
    tag: &Tag,
    reference: &str,
    opts: &RegistryOptions,
    progress: Progress<'_>,
) -> Result<Pushed, ArchiveError> {
    let target = parse_reference(reference)?;
    if target.digest().is_some() {
        return Err(refused(format!(
            "{reference} names a digest; push to a tag (REGISTRY/REPO:TAG)"
        )));
    }
    let (store2, tag2) = (store.clone(), tag.clone());
    progress(0, 0, &format!("compressing the parts of {tag}"));
    let packed = tokio::task::spawn_blocking(move || pack::pack(&store2, &tag2, &|_| {}))
        .await
        .map_err(|e| io("packing")(std::io::Error::other(e)))??;
    let layout = &packed.layout;
    let chain: Vec<Artifact> = packed
        .snapshots
        .iter()
        .map(|(_, digest)| layout.artifact(digest, None))
        .collect::<Result<_, _>>()?;
    let (client, _) = connect(&target, opts, RegistryOperation::Push).await?;
    let total = packed.blob_bytes;
    let mut report = Pushed {
        reference: target.whole(),
        digest: String::new(),
        snapshots: packed.snapshots.iter().map(|(t, _)| t.clone()).collect(),
        uploaded: 0,
        skipped: 0,
        uploaded_bytes: 0,
    };
    let mut done = 0u64;
    let mut sent = std::collections::BTreeSet::new();
    for (i, a) in chain.iter().enumerate() {
        let blobs = std::iter::once((a.config_hex.clone(), "config")).chain(
            a.parts
                .iter()
                .map(|(name, b)| (b.hex.clone(), name.as_str())),
        );
        for (hex, name) in blobs {
            if !sent.insert(hex.clone()) {
                continue;
            }
            let digest = super::digest_of(&hex);
            let size = layout.blob_size(&hex).unwrap_or(0);
            let have = client
                .blob_exists(&target, &digest)
                .await
                .map_err(|e| registry_error(&format!("asking the registry for {digest}"), e))?;
            if have {
                report.skipped += 1;
            } else {
                progress(
                    done,
                    total,
                    &format!("uploading {name} of {}", a.manifest.tag),
                );
                let file = tokio::fs::File::open(layout.blob_path(&hex))
                    .await
                    .map_err(io(format!("reading blob {digest}")))?;
                let stream = tokio_util::io::ReaderStream::with_capacity(file, 4 << 20)
                    .map(|r| r.map_err(oci_client::errors::OciDistributionError::from));
                client
                    .push_blob_stream(&target, stream, &digest, Some(size))
                    .await
                    .map_err(|e| {
                        registry_error(&format!("uploading {name} of {}", a.manifest.tag), e)
                    })?;
                report.uploaded += 1;
                report.uploaded_bytes += size;
                forkd_host::failpoint::hit("push.after_blob");
            }
            done += size;
            progress(
                done,
                total,
                &format!("{name} of {} is in the registry", a.manifest.tag),
            );
        }
        let hex = hex_of(&a.digest).unwrap_or_default();
        let body = std::fs::read(layout.blob_path(hex)).map_err(io("reading a manifest"))?;
        let head = i + 1 == chain.len();
        let at = if head {
            target.clone()
        } else {
            target.clone_with_digest(a.digest.clone())
        };
        client
            .push_manifest_raw(
                &at,
                body,
                oci_client::manifest::OCI_IMAGE_MEDIA_TYPE
                    .parse()
                    .expect("a valid header value"),
            )
            .await
            .map_err(|e| {
                registry_error(&format!("uploading the manifest of {}", a.manifest.tag), e)
            })?;
        report.digest = a.digest.clone();
    }
    progress(total, total, "pushed");
    Ok(report)
}

/// One snapshot of a chain being pulled: its OCI manifest, where it was found, and
/// whether this host has it already.
struct Pulled {
    at: Reference,
    digest: String,
    oci: oci_client::manifest::OciImageManifest,
    snapshot: crate::snapshot::Manifest,
    here: bool,
}

/// Pulls the snapshot at `reference` (and its ancestors) and installs it, under
/// `rename` if given. Only what this host lacks is downloaded: no part of a snapshot
/// it has, and no part a snapshot shares with its parent (a chain's guest assets),
/// which is linked from the parent when installed.
pub async fn pull(
    store: &Store,
    hv: std::sync::Arc<dyn forkd_hypervisor::Hypervisor>,
    reference: &str,
    rename: Option<&Tag>,
    opts: &RegistryOptions,
    progress: Progress<'_>,
) -> Result<Unpacked, ArchiveError> {
    let source = parse_reference(reference)?;
    let (client, auth) = connect(&source, opts, RegistryOperation::Pull).await?;
    let layout = Layout::new(store, "pull")?;
    // The manifests and configs first (small), head to root.
    let mut chain: Vec<Pulled> = Vec::new();
    let mut at = source.clone();
    loop {
        if chain.len() > crate::snapshot::chain::MAX_DEPTH {
            return Err(refused(format!("{reference}: its chain is too deep")));
        }
        let (oci, digest) = fetch_snapshot_manifest(&client, &auth, &at, &layout).await?;
        fetch_blob(&client, &at, &oci.config, &layout).await?;
        let snapshot = layout.snapshot_manifest(&oci.config)?;
        let tag = match rename.filter(|_| chain.is_empty()) {
            Some(t) => Some(t.clone()),
            None => Tag::parse(&snapshot.tag).ok(),
        };
        let here = tag.is_some_and(|t| unpack::is_here(store, &t, &snapshot));
        let parent = oci
            .annotations
            .as_ref()
            .and_then(|a| a.get(super::PARENT_ANNOTATION))
            .cloned();
        chain.push(Pulled {
            at: at.clone(),
            digest,
            oci,
            snapshot,
            here,
        });
        match parent {
            Some(p) => at = source.clone_with_digest(p),
            None => break,
        }
    }
    // Then the parts still needed.
    let mut wanted: Vec<(&Reference, &OciDescriptor, u64)> = Vec::new();
    for (i, p) in chain.iter().enumerate().filter(|(_, p)| !p.here) {
        let parent = chain.get(i + 1).map(|p| &p.snapshot);
        for desc in &p.oci.layers {
            let title = desc.annotations.as_ref().and_then(|a| a.get(super::TITLE));
            let shared = title.is_some_and(|t| unpack::linked_from_parent(t, &p.snapshot, parent));
            let Some(hex) = hex_of(&desc.digest) else {
                return Err(refused(format!(
                    "{}: a blob digest {:?} is not sha256",
                    p.at.whole(),
                    desc.digest
                )));
            };
            let size = u64::try_from(desc.size)
                .map_err(|_| refused(format!("{}: a negative size", p.at.whole())))?;
            let listed = wanted.iter().any(|(_, d, _)| d.digest == desc.digest);
            if !shared && !listed && layout.blob_size(hex).is_none() {
                wanted.push((&p.at, desc, size));
            }
        }
    }
    let total = wanted.iter().map(|(_, _, size)| size).sum::<u64>();
    forkd_host::space::ensure_room(store.root(), total, &format!("pulling {reference}"))?;
    let mut done = 0;
    for (at, desc, size) in wanted {
        let title = desc
            .annotations
            .as_ref()
            .and_then(|a| a.get(super::TITLE))
            .map_or("a part", String::as_str);
        progress(done, total, &format!("downloading {title}"));
        fetch_blob(&client, at, desc, &layout).await?;
        done += size;
    }
    let head = layout.artifact(&chain[0].digest, None)?;
    let chain = layout.chain(head)?;
    progress(total, total, "installing");
    let store = store.clone();
    let rename = rename.cloned();
    tokio::task::spawn_blocking(move || {
        unpack::install(
            &store,
            hv.as_ref(),
            &layout,
            &chain,
            rename.as_ref(),
            &|_| {},
        )
    })
    .await
    .map_err(|e| io("installing")(std::io::Error::other(e)))?
}

/// Fetches the OCI manifest at `at` into the layout, checks it against its digest
/// and that it is a forkd snapshot's, and returns it with its digest.
async fn fetch_snapshot_manifest(
    client: &Client,
    auth: &RegistryAuth,
    at: &Reference,
    layout: &Layout,
) -> Result<(oci_client::manifest::OciImageManifest, String), ArchiveError> {
    let (body, digest) = client
        .pull_manifest_raw(at, auth, &MANIFEST_TYPES)
        .await
        .map_err(|e| registry_error(&format!("fetching the manifest of {}", at.whole()), e))?;
    if body.len() as u64 > super::MAX_DOCUMENT {
        return Err(refused(format!(
            "{}: its manifest is {} bytes",
            at.whole(),
            body.len()
        )));
    }
    let hex = layout.add_bytes(&body)?;
    let computed = super::digest_of(&hex);
    if digest != computed || at.digest().is_some_and(|d| d != computed) {
        return Err(refused(format!(
            "{}: the manifest served does not match its digest",
            at.whole()
        )));
    }
    let manifest: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| refused(format!("{}: its manifest is not JSON: {e}", at.whole())))?;
    if manifest["config"]["mediaType"] != super::CONFIG_MEDIA_TYPE {
        return Err(refused(format!(
            "{} is not a forkd snapshot (a container image is pulled with `forkd image pull` and built on with `from` in a recipe)",
            at.whole()
        )));
    }
    let oci: oci_client::manifest::OciImageManifest =
        serde_json::from_value(manifest).map_err(|e| refused(format!("{}: {e}", at.whole())))?;
    if u64::try_from(oci.config.size).map_or(true, |size| size > super::MAX_DOCUMENT) {
        return Err(refused(format!(
            "{}: its config is {} bytes",
            at.whole(),
            oci.config.size
        )));
    }
    Ok((oci, computed))
}

/// Downloads one blob into the layout (see [`fetch_blob_to`]).
async fn fetch_blob(
    client: &Client,
    at: &Reference,
    desc: &oci_client::manifest::OciDescriptor,
    layout: &Layout,
) -> Result<(), ArchiveError> {
    let hex = hex_of(&desc.digest).unwrap_or_default().to_owned();
    fetch_blob_to(client, at, desc, &layout.blob_path(&hex)).await
}

/// Downloads one blob to `dest` (through a temporary file beside it, renamed when
/// whole), refusing more bytes than its descriptor gives and contents that do not hash
/// to its digest.
pub(crate) async fn fetch_blob_to(
    client: &Client,
    at: &Reference,
    desc: &oci_client::manifest::OciDescriptor,
    dest: &std::path::Path,
) -> Result<(), ArchiveError> {
    use sha2::Digest;
    let hex = hex_of(&desc.digest)
        .ok_or_else(|| refused(format!("{:?} is not a sha256 digest", desc.digest)))?
        .to_owned();
    let size = u64::try_from(desc.size)
        .map_err(|_| refused(format!("blob {} has a negative size", desc.digest)))?;
    let mut stream = client
        .pull_blob_stream(at, desc)
        .await
        .map_err(|e| registry_error(&format!("downloading {}", desc.digest), e))?
        .stream;
    let mut tmp = dest.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    let mut file = tokio::fs::File::create(&tmp)
        .await
        .map_err(io("writing a blob"))?;
    let mut hash = sha2::Sha256::new();
    let mut got = 0u64;
    let result = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(io(format!("downloading {}", desc.digest)))?;
            got += chunk.len() as u64;
            if got > size {
                return Err(refused(format!(
                    "blob {} is longer than the {size} bytes its descriptor gives",
                    desc.digest
                )));
            }
            hash.update(&chunk);
            file.write_all(&chunk).await.map_err(io("writing a blob"))?;
        }
        file.sync_all().await.map_err(io("writing a blob"))?;
        if got != size || hex::encode(hash.finalize()) != hex {
            return Err(refused(format!(
                "blob {} does not match its digest and size",
                desc.digest
            )));
        }
        std::fs::rename(&tmp, dest).map_err(io("storing a blob"))
    }
    .await;
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
