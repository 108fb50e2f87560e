//! An OCI image layout in a scratch directory of the store: `oci-layout`, `index.json`
//! and `blobs/sha256/<hex>`. Pack writes one and turns it into a tar; unpack receives a
//! tar into one, every blob checked against its name as it arrives; both read snapshot
//! manifests out of it with every descriptor checked. Removed when dropped.

use super::{hex_of, io, ArchiveError, MAX_DOCUMENT};
use crate::snapshot::manifest::parts;
use crate::snapshot::{Manifest, Store};
use oci_client::manifest::{ImageIndexEntry, OciDescriptor, OciImageIndex, OciImageManifest};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The `oci-layout` file's contents.
const LAYOUT_FILE: &str = "oci-layout";
const INDEX_FILE: &str = "index.json";
const LAYOUT_VERSION: &str = "1.0.0";
/// More blobs than any chain has: a bound on what an archive can make us track.
const MAX_BLOBS: usize = 4096;

/// A layout directory.
#[derive(Debug)]
pub struct Layout {
    pub(super) dir: PathBuf,
}

impl Drop for Layout {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One part of a snapshot as a blob of the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartBlob {
    /// Hex sha256 of the blob.
    pub hex: String,
    /// The blob's size.
    pub size: u64,
    /// Whether the layout holds it (a pull leaves out the parts of snapshots this
    /// host has; [`super::unpack::install`] refuses any other that is missing).
    pub present: bool,
    /// What the part takes unpacked, as its layer's annotation gives it (archives
    /// from elsewhere may lack it or lie: only a space estimate).
    pub stored: Option<u64>,
}

/// A snapshot's OCI manifest, read from a layout with everything it names checked: its
/// config is a forkd manifest, its layers are exactly the parts that snapshot stores,
/// each present with its descriptor's size.
#[derive(Debug, Clone)]
pub struct Artifact {
    /// `sha256:<hex>` of the OCI manifest.
    pub digest: String,
    /// The OCI manifest.
    pub oci: OciImageManifest,
    /// The snapshot's own manifest (the config blob).
    pub manifest: Manifest,
    /// Hex sha256 of the config blob (the digest children record of their parent).
    pub config_hex: String,
    /// The parts it carries, by part name.
    pub parts: BTreeMap<String, PartBlob>,
    /// For a chain link: the digest of its parent's OCI manifest.
    pub parent: Option<String>,
}

/// The parts a snapshot carries in an archive: what it stores (a link's memory image is
/// made from its parent's and its diff, so it travels as the diff alone).
pub fn carried_parts(m: &Manifest) -> Vec<&'static str> {
    m.part_names()
        .into_iter()
        .filter(|p| !(m.parent.is_some() && *p == parts::MEMORY))
        .collect()
}

impl Layout {
    /// A new, empty layout in the store's scratch area.
    pub fn new(store: &Store, what: &str) -> Result<Layout, ArchiveError> {
        let dir = store.scratch_path(what);
        std::fs::create_dir_all(dir.join("blobs/sha256"))
            .map_err(io(format!("creating {}", dir.display())))?;
        Ok(Layout { dir })
    }

    /// Removes the layouts a stopped process left in the store's scratch area (a pack,
    /// unpack, push or pull cut short by a crash). Only when no other is in progress:
    /// at the daemon's start.
    pub fn remove_leftovers(store: &Store) {
        let Ok(entries) = std::fs::read_dir(store.root().join(".staging")) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if ["pack-", "unpack-", "pull-"]
                .iter()
                .any(|p| name.starts_with(p))
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }

    /// Where the blob `hex` is (or would be).
    pub fn blob_path(&self, hex: &str) -> PathBuf {
        self.dir.join("blobs/sha256").join(hex)
    }

    /// A path for a file being written into the layout (moved into place by
    /// [`Layout::adopt`]).
    pub fn temp_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("tmp-{name}"))
    }

    /// Moves `tmp`, whose contents hash to `hex`, into place as that blob.
    pub fn adopt(&self, tmp: &Path, hex: &str) -> Result<(), ArchiveError> {
        std::fs::rename(tmp, self.blob_path(hex)).map_err(io("storing a blob"))
    }

    /// Stores `bytes` as a blob; returns its hex digest.
    pub fn add_bytes(&self, bytes: &[u8]) -> Result<String, ArchiveError> {
        let hex = hex::encode(Sha256::digest(bytes));
        std::fs::write(self.blob_path(&hex), bytes).map_err(io("writing a blob"))?;
        Ok(hex)
    }

    /// The size of blob `hex`, if the layout has it.
    pub fn blob_size(&self, hex: &str) -> Option<u64> {
        std::fs::metadata(self.blob_path(hex)).ok().map(|m| m.len())
    }

    /// Every blob, as (hex, size), in name order.
    pub fn blobs(&self) -> Result<Vec<(String, u64)>, ArchiveError> {
        let dir = self.dir.join("blobs/sha256");
        let mut out = Vec::new();
        for e in std::fs::read_dir(&dir).map_err(io(format!("listing {}", dir.display())))? {
            let e = e.map_err(io("listing blobs"))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let size = e.metadata().map_err(io("listing blobs"))?.len();
            out.push((name, size));
        }
        out.sort();
        Ok(out)
    }

    /// Writes `index.json` (naming `manifests`) and `oci-layout`.
    pub fn write_index(&self, manifests: Vec<ImageIndexEntry>) -> Result<(), ArchiveError> {
        let index = OciImageIndex {
            schema_version: 2,
            media_type: Some(super::INDEX_MEDIA_TYPE.to_owned()),
            manifests,
            artifact_type: None,
            annotations: None,
        };
        let json = serde_json::to_vec_pretty(&index).expect("indexes serialize");
        std::fs::write(self.dir.join(INDEX_FILE), json).map_err(io("writing index.json"))?;
        std::fs::write(
            self.dir.join(LAYOUT_FILE),
            format!("{{\"imageLayoutVersion\":\"{LAYOUT_VERSION}\"}}"),
        )
        .map_err(io("writing oci-layout"))
    }

    /// The entries of the tar [`Layout::write_tar`] writes: blobs first, then the index
    /// and `oci-layout`, so that an archive cut short lacks its index.
    fn tar_entries(&self) -> Result<Vec<(String, PathBuf, u64)>, ArchiveError> {
        let mut v: Vec<(String, PathBuf, u64)> = self
            .blobs()?
            .into_iter()
            .map(|(hex, size)| (format!("blobs/sha256/{hex}"), self.blob_path(&hex), size))
            .collect();
        for name in [INDEX_FILE, LAYOUT_FILE] {
            let path = self.dir.join(name);
            let size = std::fs::metadata(&path)
                .map_err(io(format!("reading {name}")))?
                .len();
            v.push((name.to_owned(), path, size));
        }
        Ok(v)
    }

    /// The exact length of the tar [`Layout::write_tar`] writes.
    pub fn tar_size(&self) -> Result<u64, ArchiveError> {
        // Each entry: a 512-byte header and its data padded to 512; then two zero blocks.
        Ok(self
            .tar_entries()?
            .iter()
            .map(|(_, _, size)| 512 + size.div_ceil(512) * 512)
            .sum::<u64>()
            + 1024)
    }

    /// Writes the layout as a tar to `w`.
    pub fn write_tar(&self, w: impl Write) -> Result<(), ArchiveError> {
        let mut tar = tar::Builder::new(w);
        for (name, path, size) in self.tar_entries()? {
            let mut h = tar::Header::new_ustar();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(size);
            h.set_mode(0o644);
            h.set_mtime(0);
            h.set_uid(0);
            h.set_gid(0);
            let f = std::fs::File::open(&path).map_err(io(format!("reading {name}")))?;
            tar.append_data(&mut h, &name, f)
                .map_err(io(format!("writing {name} into the archive")))?;
        }
        tar.into_inner()
            .and_then(|mut w| w.flush())
            .map_err(io("finishing the archive"))
    }

    /// Reads a tar of a layout from `r` into a new layout, refusing anything an OCI
    /// layout does not hold (links, devices, paths outside it, duplicates) and every
    /// blob whose contents do not hash to its name. `progress` hears of each blob.
    pub fn receive(
        store: &Store,
        r: impl Read,
        progress: &dyn Fn(&str),
    ) -> Result<Layout, ArchiveError> {
        let layout = Layout::new(store, "unpack")?;
        let refused = |m: String| ArchiveError::Refused(m);
        let mut seen = BTreeSet::new();
        let mut received = 0u64;
        let mut archive = tar::Archive::new(r);
        let entries = archive
            .entries()
            .map_err(|e| refused(format!("the archive cannot be read: {e}")))?;
        for entry in entries {
            let mut entry =
                entry.map_err(|e| refused(format!("the archive is truncated or damaged ({e})")))?;
            let raw = entry.path_bytes().into_owned();
            let shown = String::from_utf8_lossy(&raw).into_owned();
            let name = entry_name(&raw)
                .ok_or_else(|| refused(format!("entry {shown:?} lies outside the layout")))?;
            let kind = entry.header().entry_type();
            if kind.is_dir() {
                if matches!(name.as_str(), "blobs" | "blobs/sha256") {
                    continue;
                }
                return Err(refused(format!("unexpected directory {shown:?}")));
            }
            if !(kind.is_file() || kind == tar::EntryType::Continuous) {
                return Err(refused(format!(
                    "entry {shown:?} is a {}, and an archive holds only files",
                    kind_name(kind)
                )));
            }
            if !seen.insert(name.clone()) {
                return Err(refused(format!("entry {shown:?} appears twice")));
            }
            if seen.len() > MAX_BLOBS {
                return Err(refused(format!("more than {MAX_BLOBS} entries")));
            }
            let size = entry.size();
            let truncated = |e: std::io::Error| {
                refused(format!(
                    "entry {shown:?} cannot be read ({e}): the archive is truncated or damaged"
                ))
            };
            if name == INDEX_FILE || name == LAYOUT_FILE {
                if size > MAX_DOCUMENT {
                    return Err(refused(format!("{name} is {size} bytes")));
                }
                let mut bytes = Vec::new();
                entry.read_to_end(&mut bytes).map_err(truncated)?;
                if bytes.len() as u64 != size {
                    return Err(refused(format!(
                        "{name} ends after {} of its {size} bytes: the archive is truncated",
                        bytes.len()
                    )));
                }
                std::fs::write(layout.dir.join(&name), bytes)
                    .map_err(io(format!("writing {name}")))?;
                continue;
            }
            let Some(hex) = name
                .strip_prefix("blobs/sha256/")
                .filter(|h| hex_of(&format!("sha256:{h}")).is_some())
            else {
                return Err(refused(format!("unexpected entry {shown:?} (a layout holds oci-layout, index.json and blobs/sha256/<digest>)")));
            };
            forkd_host::space::ensure_room(store.root(), size, "unpacking a snapshot archive")?;
            let tmp = layout.temp_path(hex);
            let mut sink = super::blob::Hashing::create(&tmp).map_err(io("writing a blob"))?;
            let copied = std::io::copy(&mut entry, &mut sink).map_err(truncated)?;
            if copied != size {
                return Err(refused(format!(
                    "entry {shown:?} ends after {copied} of its {size} bytes: the archive is truncated"
                )));
            }
            let (actual, _) = sink.sync().map_err(io("writing a blob"))?;
            if actual != hex {
                return Err(refused(format!(
                    "blob sha256:{hex} does not match its digest (its contents hash to sha256:{actual}): the archive is damaged"
                )));
            }
            layout.adopt(&tmp, hex)?;
            received += size;
            progress(&format!(
                "received {} blobs, {} MiB",
                seen.len(),
                received >> 20
            ));
        }
        let layout_file = std::fs::read(layout.dir.join(LAYOUT_FILE)).map_err(|_| {
            refused("the archive has no oci-layout file (truncated, or not an OCI layout)".into())
        })?;
        let v: serde_json::Value = serde_json::from_slice(&layout_file)
            .map_err(|e| refused(format!("oci-layout is not valid: {e}")))?;
        if v["imageLayoutVersion"] != LAYOUT_VERSION {
            return Err(refused(format!(
                "oci-layout names version {}, not {LAYOUT_VERSION}",
                v["imageLayoutVersion"]
            )));
        }
        if !layout.dir.join(INDEX_FILE).exists() {
            return Err(refused(
                "the archive has no index.json (truncated, or not an OCI layout)".into(),
            ));
        }
        Ok(layout)
    }

    /// The index's manifests.
    pub fn index(&self) -> Result<OciImageIndex, ArchiveError> {
        let bytes = std::fs::read(self.dir.join(INDEX_FILE)).map_err(io("reading index.json"))?;
        let index: OciImageIndex = serde_json::from_slice(&bytes)
            .map_err(|e| ArchiveError::Refused(format!("index.json is not valid: {e}")))?;
        if index.schema_version != 2 {
            return Err(ArchiveError::Refused(format!(
                "index.json has schema version {}",
                index.schema_version
            )));
        }
        Ok(index)
    }

    /// Reads a JSON document blob (a manifest or config) named by `digest`; `size`, if
    /// given, is what its descriptor says.
    fn document(&self, digest: &str, size: Option<i64>) -> Result<Vec<u8>, ArchiveError> {
        let refused = |m: String| ArchiveError::Refused(m);
        let hex =
            hex_of(digest).ok_or_else(|| refused(format!("{digest:?} is not a sha256 digest")))?;
        let have = self
            .blob_size(hex)
            .ok_or_else(|| refused(format!("blob {digest} is missing")))?;
        if size.is_some_and(|s| u64::try_from(s).ok() != Some(have)) {
            return Err(refused(format!(
                "blob {digest} is {have} bytes, its descriptor says {}",
                size.unwrap_or(0)
            )));
        }
        if have > MAX_DOCUMENT {
            return Err(refused(format!(
                "blob {digest} is {have} bytes, too big for a manifest"
            )));
        }
        std::fs::read(self.blob_path(hex)).map_err(io(format!("reading {digest}")))
    }

    /// Reads the config blob `config` as a forkd snapshot manifest.
    pub fn snapshot_manifest(&self, config: &OciDescriptor) -> Result<Manifest, ArchiveError> {
        let bytes = self.document(&config.digest, Some(config.size))?;
        let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
            ArchiveError::Refused(format!("its config is not a forkd snapshot manifest: {e}"))
        })?;
        if manifest.format != crate::snapshot::manifest::FORMAT {
            return Err(ArchiveError::Refused(format!(
                "snapshot manifest format {} is not the supported {}",
                manifest.format,
                crate::snapshot::manifest::FORMAT
            )));
        }
        Ok(manifest)
    }

    /// Reads and checks the snapshot manifest `digest` (see [`Artifact`]).
    pub fn artifact(&self, digest: &str, size: Option<i64>) -> Result<Artifact, ArchiveError> {
        let refused = |m: String| ArchiveError::Refused(format!("manifest {digest}: {m}"));
        let bytes = self.document(digest, size)?;
        let oci: OciImageManifest = serde_json::from_slice(&bytes)
            .map_err(|e| refused(format!("not an OCI image manifest: {e}")))?;
        let config_media = oci.config.media_type.as_str();
        if oci.schema_version != 2 || config_media != super::CONFIG_MEDIA_TYPE {
            return Err(ArchiveError::Refused(format!(
                "{digest} is not a forkd snapshot (its config is {config_media:?}; a container image is pulled with `forkd image pull`)"
            )));
        }
        let manifest = self.snapshot_manifest(&oci.config).map_err(|e| match e {
            ArchiveError::Refused(m) => refused(m),
            e => e,
        })?;
        let expected = carried_parts(&manifest);
        let mut parts = BTreeMap::new();
        for layer in &oci.layers {
            let title = layer
                .annotations
                .as_ref()
                .and_then(|a| a.get(super::TITLE))
                .map(String::as_str)
                .unwrap_or_default();
            let Some(name) = expected.iter().find(|p| **p == title) else {
                return Err(refused(format!(
                    "a layer names {title:?}, which is not a part it stores"
                )));
            };
            if layer.media_type != super::PART_MEDIA_TYPE {
                return Err(refused(format!(
                    "part {name} has media type {:?}",
                    layer.media_type
                )));
            }
            let hex = hex_of(&layer.digest).ok_or_else(|| {
                refused(format!(
                    "part {name}'s digest {:?} is not sha256",
                    layer.digest
                ))
            })?;
            let size = u64::try_from(layer.size)
                .map_err(|_| refused(format!("part {name}'s size {} is negative", layer.size)))?;
            let have = self.blob_size(hex);
            if have.is_some_and(|have| have != size) {
                return Err(refused(format!(
                    "part {name}'s blob is {} bytes, its descriptor says {size}",
                    have.unwrap_or_default()
                )));
            }
            if !manifest.parts.contains_key(*name) {
                return Err(refused(format!("its config does not list part {name}")));
            }
            let stored = layer
                .annotations
                .as_ref()
                .and_then(|a| a.get(super::STORED_ANNOTATION))
                .and_then(|v| v.parse().ok());
            let blob = PartBlob {
                hex: hex.to_owned(),
                size,
                present: have.is_some(),
                stored,
            };
            if parts.insert((*name).to_owned(), blob).is_some() {
                return Err(refused(format!("part {name} appears twice")));
            }
        }
        if let Some(missing) = expected.iter().find(|p| !parts.contains_key(**p)) {
            return Err(refused(format!("part {missing} is missing")));
        }
        let parent = oci
            .annotations
            .as_ref()
            .and_then(|a| a.get(super::PARENT_ANNOTATION))
            .cloned();
        if parent.is_some() != manifest.parent.is_some() {
            return Err(refused(
                "its parent annotation and its config disagree".into(),
            ));
        }
        Ok(Artifact {
            digest: digest.to_owned(),
            config_hex: hex_of(&oci.config.digest).unwrap_or_default().to_owned(),
            oci,
            manifest,
            parts,
            parent,
        })
    }

    /// The chain ending at `head`, root first, each parent checked against the digest
    /// its child recorded.
    pub fn chain(&self, head: Artifact) -> Result<Vec<Artifact>, ArchiveError> {
        let mut chain = vec![head];
        while let Some(parent) = chain.last().and_then(|a| a.parent.clone()) {
            if chain.len() > crate::snapshot::chain::MAX_DEPTH {
                return Err(ArchiveError::Refused(format!(
                    "its chain is deeper than {}",
                    crate::snapshot::chain::MAX_DEPTH
                )));
            }
            let p = self.artifact(&parent, None)?;
            let child = chain.last().expect("not empty");
            if child.manifest.parent_digest.as_deref() != Some(p.config_hex.as_str()) {
                return Err(ArchiveError::Refused(format!(
                    "snapshot {} does not name {} as the parent it was made from",
                    child.manifest.tag, p.manifest.tag
                )));
            }
            chain.push(p);
        }
        chain.reverse();
        Ok(chain)
    }

    /// The one chain the index describes: the manifest no other names as its parent,
    /// and its ancestors, root first.
    pub fn index_chain(&self) -> Result<Vec<Artifact>, ArchiveError> {
        let index = self.index()?;
        let mut all = Vec::new();
        for entry in &index.manifests {
            if entry.media_type != super::MANIFEST_MEDIA_TYPE {
                return Err(ArchiveError::Refused(format!(
                    "index.json names a {:?}, not a forkd snapshot",
                    entry.media_type
                )));
            }
            all.push(self.artifact(&entry.digest, Some(entry.size))?);
        }
        let parents: BTreeSet<&str> = all.iter().filter_map(|a| a.parent.as_deref()).collect();
        let mut heads = all.iter().filter(|a| !parents.contains(a.digest.as_str()));
        let (Some(head), None) = (heads.next(), heads.next()) else {
            return Err(ArchiveError::Refused(
                "index.json must name one snapshot and its ancestors".into(),
            ));
        };
        let chain = self.chain(head.clone())?;
        if chain.len() != all.len() {
            return Err(ArchiveError::Refused(
                "index.json names snapshots outside the chain".into(),
            ));
        }
        Ok(chain)
    }
}

/// The name of a tar entry inside the layout (`./` and trailing `/` dropped), or None if
/// it is absolute or climbs out.
fn entry_name(raw: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(raw).ok()?;
    if s.starts_with('/') {
        return None;
    }
    let mut parts = Vec::new();
    for c in s.split('/') {
        match c {
            "" | "." => {}
            ".." => return None,
            c => parts.push(c),
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

fn kind_name(kind: tar::EntryType) -> &'static str {
    match kind {
        tar::EntryType::Symlink => "symbolic link",
        tar::EntryType::Link => "hard link",
        tar::EntryType::Char | tar::EntryType::Block => "device",
        tar::EntryType::Fifo => "fifo",
        _ => "special entry",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_names_stay_inside_the_layout() {
        assert_eq!(
            entry_name(b"./blobs/sha256/ab").as_deref(),
            Some("blobs/sha256/ab")
        );
        assert_eq!(entry_name(b"blobs/").as_deref(), Some("blobs"));
        assert_eq!(entry_name(b"index.json").as_deref(), Some("index.json"));
        assert_eq!(entry_name(b"../index.json"), None);
        assert_eq!(entry_name(b"blobs/../../x"), None);
        assert_eq!(entry_name(b"/etc/passwd"), None);
        assert_eq!(entry_name(b"./"), None);
    }
}
