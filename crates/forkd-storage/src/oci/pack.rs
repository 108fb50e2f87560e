//! `forkd pack`: a snapshot and its ancestors as OCI artifacts in a layout, which
//! [`Layout::write_tar`] turns into the archive (and push sends to a registry).

use super::layout::{carried_parts, Layout};
use super::{blob, digest_of, io, ArchiveError};
use crate::snapshot::{chain, Snapshot, SnapshotError, Store, Tag, MANIFEST};
use oci_client::manifest::{ImageIndexEntry, OciDescriptor, OciImageManifest};
use std::collections::BTreeMap;

/// A packed chain.
#[derive(Debug)]
pub struct Packed {
    /// The layout holding it.
    pub layout: Layout,
    /// The snapshots, root first, with the digest of each one's OCI manifest.
    pub snapshots: Vec<(String, String)>,
    /// The bytes of every blob.
    pub blob_bytes: u64,
}

/// Packs `tag` and its ancestors into a new layout in the store's scratch area. Every
/// part is hashed as it is compressed and refused if it no longer matches its manifest.
pub fn pack(store: &Store, tag: &Tag, progress: &dyn Fn(&str)) -> Result<Packed, ArchiveError> {
    let head = store.open(tag)?;
    let mut snaps = chain::ancestors(store, &head)?;
    snaps.reverse();
    snaps.push(head);
    let needed = space_needed(&snaps);
    forkd_host::space::ensure_room(store.root(), needed, &format!("packing snapshot {tag}"))?;
    let layout = Layout::new(store, &format!("pack-{tag}"))?;
    // Part digest -> its blob: the guest assets a chain shares are compressed once.
    let mut done: BTreeMap<String, OciDescriptor> = BTreeMap::new();
    let mut entries = Vec::new();
    let mut snapshots = Vec::new();
    let mut parent_digest = None::<String>;
    for snap in &snaps {
        let mut layers = Vec::new();
        for name in carried_parts(&snap.manifest) {
            let want = &snap.manifest.parts[name];
            let desc = match done.get(&want.sha256) {
                Some(d) => d.clone(),
                None => {
                    progress(&format!(
                        "compressing {} of {} ({} MiB)",
                        name,
                        snap.tag,
                        want.size >> 20
                    ));
                    let d = compress_part(&layout, snap, name)?;
                    done.insert(want.sha256.clone(), d.clone());
                    d
                }
            };
            let mut d = desc;
            d.annotations
                .get_or_insert_with(BTreeMap::new)
                .insert(super::TITLE.to_owned(), name.to_owned());
            layers.push(d);
        }
        let config = std::fs::read(snap.dir.join(MANIFEST))
            .map_err(io(format!("reading {}'s manifest", snap.tag)))?;
        let config_hex = layout.add_bytes(&config)?;
        let mut annotations = BTreeMap::from([
            (super::TAG_ANNOTATION.to_owned(), snap.tag.to_string()),
            (super::CREATED.to_owned(), snap.manifest.created_at.clone()),
        ]);
        if let Some(p) = &parent_digest {
            annotations.insert(super::PARENT_ANNOTATION.to_owned(), p.clone());
        }
        let manifest = OciImageManifest {
            schema_version: 2,
            media_type: Some(super::MANIFEST_MEDIA_TYPE.to_owned()),
            config: OciDescriptor {
                media_type: super::CONFIG_MEDIA_TYPE.to_owned(),
                digest: digest_of(&config_hex),
                size: i64::try_from(config.len()).expect("a buffer's length fits an i64"),
                urls: None,
                annotations: None,
                artifact_type: None,
            },
            layers,
            subject: None,
            artifact_type: Some(super::ARTIFACT_TYPE.to_owned()),
            annotations: Some(annotations),
        };
        let json = serde_json::to_vec_pretty(&manifest).expect("manifests serialize");
        let digest = digest_of(&layout.add_bytes(&json)?);
        entries.push(ImageIndexEntry {
            media_type: super::MANIFEST_MEDIA_TYPE.to_owned(),
            digest: digest.clone(),
            size: i64::try_from(json.len()).expect("a buffer's length fits an i64"),
            platform: None,
            annotations: Some(BTreeMap::from([(
                super::REF_NAME.to_owned(),
                snap.tag.to_string(),
            )])),
            artifact_type: Some(super::ARTIFACT_TYPE.to_owned()),
        });
        snapshots.push((snap.tag.to_string(), digest.clone()));
        parent_digest = Some(digest);
    }
    layout.write_index(entries)?;
    let blob_bytes = layout.blobs()?.iter().map(|(_, s)| s).sum();
    Ok(Packed {
        layout,
        snapshots,
        blob_bytes,
    })
}

/// Compresses one part of `snap` into the layout, checking it against its digest.
/// What the blobs of `snaps` may take: each distinct part once (a chain's links share
/// its guest assets), at most what it takes on disk (holes compress to nothing).
fn space_needed(snaps: &[Snapshot]) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::BTreeSet::new();
    let mut needed = 0;
    for snap in snaps {
        for name in carried_parts(&snap.manifest) {
            if seen.insert(&snap.manifest.parts[name].sha256) {
                needed += std::fs::metadata(snap.part(name)).map_or(0, |m| m.blocks() * 512);
            }
        }
    }
    needed
}

fn compress_part(
    layout: &Layout,
    snap: &Snapshot,
    name: &str,
) -> Result<OciDescriptor, ArchiveError> {
    let want = &snap.manifest.parts[name];
    let tmp = layout.temp_path(name);
    let c = blob::compress(&snap.part(name), &tmp)
        .map_err(io(format!("compressing {name} of {}", snap.tag)))?;
    if c.part_sha256 != want.sha256 || c.part_size != want.size {
        let _ = std::fs::remove_file(&tmp);
        return Err(SnapshotError::DigestMismatch {
            tag: snap.tag.to_string(),
            part: name.to_owned(),
            expected: want.sha256.clone(),
            actual: c.part_sha256,
        }
        .into());
    }
    layout.adopt(&tmp, &c.blob_sha256)?;
    Ok(OciDescriptor {
        media_type: super::PART_MEDIA_TYPE.to_owned(),
        digest: digest_of(&c.blob_sha256),
        size: i64::try_from(c.blob_size).expect("a file's size fits an i64 (off_t)"),
        urls: None,
        annotations: Some(BTreeMap::from([(
            super::STORED_ANNOTATION.to_owned(),
            c.stored.to_string(),
        )])),
        artifact_type: None,
    })
}
