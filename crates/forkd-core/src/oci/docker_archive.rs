//! `docker-archive:FILE[:REPO:TAG]` sources: what `docker save` (or `skopeo copy ...
//! docker-archive:`) writes, turned into an OCI image layout so that an image from one
//! is made into a root filesystem exactly as one from a layout or a registry.
//!
//! Such a tar holds `manifest.json` (one entry per image: its config file, its layer
//! files in order, its `RepoTags`), the config and the layers (plain or compressed tars,
//! under any names; older Docker versions link repeated layers with symbolic links).
//! Every regular file is hashed as it is copied out, so each becomes a blob named by its
//! own digest; the OCI manifest written over them is the image's identity here.

use super::{io, ArchiveError};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

/// The largest `manifest.json` read.
const MAX_MANIFEST: u64 = 1 << 20;

/// One image of `manifest.json`.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Entry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// A file of the archive copied out as a blob.
#[derive(Debug, Clone)]
struct Blob {
    hex: String,
    size: u64,
}

/// Writes the image `tag` of the archive `file` (the only one when `tag` is `None`) as
/// an OCI image layout in `dir`, which must exist and be empty.
pub fn to_layout(file: &Path, tag: Option<&str>, dir: &Path) -> Result<(), ArchiveError> {
    let refused = |m: String| ArchiveError::Refused(format!("{}: {m}", file.display()));
    let blobs_dir = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs_dir).map_err(io(format!("creating {}", blobs_dir.display())))?;
    let input = std::fs::File::open(file).map_err(io(format!("opening {}", file.display())))?;
    let mut archive = tar::Archive::new(std::io::BufReader::new(input));
    let mut files: BTreeMap<String, Blob> = BTreeMap::new();
    let mut links: BTreeMap<String, String> = BTreeMap::new();
    let mut manifest: Option<Vec<u8>> = None;
    let entries = archive
        .entries()
        .map_err(|e| refused(format!("not a tar archive: {e}")))?;
    for (i, entry) in entries.enumerate() {
        let mut entry = entry.map_err(|e| refused(format!("entry {}: {e}", i + 1)))?;
        let name = entry
            .path()
            .map_err(|e| refused(format!("entry {}: {e}", i + 1)))?
            .into_owned();
        let name = clean(&name).ok_or_else(|| {
            refused(format!(
                "entry {} names {:?}, outside the archive",
                i + 1,
                name.display()
            ))
        })?;
        match entry.header().entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => {}
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name()
                    .ok()
                    .flatten()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                let base = Path::new(&name).parent().unwrap_or(Path::new(""));
                if let Some(t) = clean(&base.join(target)) {
                    links.insert(name, t);
                }
                continue;
            }
            _ => continue,
        }
        if name == "manifest.json" {
            let mut bytes = Vec::new();
            (&mut entry)
                .take(MAX_MANIFEST + 1)
                .read_to_end(&mut bytes)
                .map_err(|e| refused(format!("reading manifest.json: {e}")))?;
            if bytes.len() as u64 > MAX_MANIFEST {
                return Err(refused("its manifest.json is too big".into()));
            }
            manifest = Some(bytes);
            continue;
        }
        let blob = copy_out(&mut entry, &blobs_dir)
            .map_err(|e| refused(format!("copying {name} out: {e}")))?;
        files.insert(name, blob);
    }
    let manifest = manifest.ok_or_else(|| {
        refused("it has no manifest.json: not an archive `docker save` writes".into())
    })?;
    let images: Vec<Entry> = serde_json::from_slice(&manifest)
        .map_err(|e| refused(format!("its manifest.json is not valid: {e}")))?;
    let tagged = |e: &&Entry| match tag {
        None => true,
        Some(t) => e
            .repo_tags
            .iter()
            .flatten()
            .any(|r| familiar(r) == familiar(t)),
    };
    let mut hits = images.iter().filter(tagged);
    let (Some(image), None) = (hits.next(), hits.next()) else {
        let tags: Vec<&str> = images
            .iter()
            .flat_map(|e| e.repo_tags.iter().flatten())
            .map(String::as_str)
            .collect();
        return Err(refused(match tag {
            Some(t) => format!("no image tagged {t} in it (it has: {})", tags.join(", ")),
            None => format!(
                "it holds {} images: name one as docker-archive:FILE:REPO:TAG (it has: {})",
                images.len(),
                tags.join(", ")
            ),
        }));
    };
    let find = |name: &str| -> Result<Blob, ArchiveError> {
        let mut at = name.to_owned();
        for _ in 0..8 {
            if let Some(b) = files.get(&at) {
                return Ok(b.clone());
            }
            match links.get(&at) {
                Some(next) => at = next.clone(),
                None => break,
            }
        }
        Err(refused(format!(
            "its manifest.json names {name}, which it does not hold"
        )))
    };
    let config = find(&image.config)?;
    let mut layers = Vec::new();
    for l in &image.layers {
        let b = find(l)?;
        let media_type =
            layer_media_type(&blobs_dir.join(&b.hex)).map_err(io(format!("reading layer {l}")))?;
        layers.push(serde_json::json!({
            "mediaType": media_type,
            "digest": format!("sha256:{}", b.hex),
            "size": b.size,
        }));
    }
    let oci = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": oci_client::manifest::OCI_IMAGE_MEDIA_TYPE,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{}", config.hex),
            "size": config.size,
        },
        "layers": layers,
    });
    let bytes = oci.to_string().into_bytes();
    let hex = hex::encode(Sha256::digest(&bytes));
    std::fs::write(blobs_dir.join(&hex), &bytes).map_err(io("writing the image manifest"))?;
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": oci_client::manifest::OCI_IMAGE_MEDIA_TYPE,
            "digest": format!("sha256:{hex}"),
            "size": bytes.len(),
        }],
    });
    std::fs::write(dir.join("index.json"), index.to_string()).map_err(io("writing index.json"))?;
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)
        .map_err(io("writing oci-layout"))?;
    Ok(())
}

/// A reference in Docker's familiar form: `docker.io/library/x:1` and `x:1` are one
/// image (Docker writes the short form, skopeo the long one).
fn familiar(r: &str) -> &str {
    let r = r.strip_prefix("docker.io/").unwrap_or(r);
    r.strip_prefix("library/").unwrap_or(r)
}

/// `name` as a relative path inside the archive (`./` and `..` resolved), or `None`
/// when it leaves it.
fn clean(name: &Path) -> Option<String> {
    let mut parts: Vec<&std::ffi::OsStr> = Vec::new();
    for c in name.components() {
        match c {
            Component::Normal(p) => parts.push(p),
            Component::CurDir => {}
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    let p: PathBuf = parts.iter().collect();
    let s = p.to_str()?.to_owned();
    (!s.is_empty()).then_some(s)
}

/// Copies one entry into `blobs` under its own digest.
fn copy_out(entry: &mut impl Read, blobs: &Path) -> std::io::Result<Blob> {
    // The scratch layout is this conversion's own: one file in the making at a time.
    let tmp = blobs.join(".partial");
    let mut sink = super::blob::Hashing::create(&tmp)?;
    std::io::copy(entry, &mut sink)?;
    let (hex, size) = sink.sync()?;
    std::fs::rename(&tmp, blobs.join(&hex))?;
    Ok(Blob { hex, size })
}

/// A layer's media type, from its first bytes: gzip, zstd, else a plain tar.
fn layer_media_type(path: &Path) -> std::io::Result<&'static str> {
    let mut magic = [0u8; 4];
    let mut f = std::fs::File::open(path)?;
    let n = f.read(&mut magic)?;
    Ok(match &magic[..n] {
        [0x1f, 0x8b, ..] => "application/vnd.oci.image.layer.v1.tar+gzip",
        [0x28, 0xb5, 0x2f, 0xfd] => "application/vnd.oci.image.layer.v1.tar+zstd",
        _ => "application/vnd.oci.image.layer.v1.tar",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_inside_the_archive() {
        assert_eq!(
            clean(Path::new("./a/../b/layer.tar")).as_deref(),
            Some("b/layer.tar")
        );
        assert_eq!(clean(Path::new("../x")), None);
        assert_eq!(clean(Path::new("/etc/passwd")), None);
        assert_eq!(
            familiar("docker.io/library/debian:12"),
            familiar("debian:12")
        );
        assert_eq!(familiar("docker.io/team/app:1"), "team/app:1");
    }

    /// A `docker save`-style archive of two images, one layer linked from the other.
    fn archive(dir: &Path) -> PathBuf {
        let path = dir.join("images.tar");
        let mut b = tar::Builder::new(std::fs::File::create(&path).unwrap());
        let mut add = |name: &str, data: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, name, data).unwrap();
        };
        let mut layer = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_mode(0o644);
        h.set_cksum();
        layer.append_data(&mut h, "hi.txt", &b"hi"[..]).unwrap();
        let layer = layer.into_inner().unwrap();
        add("aaa/layer.tar", &layer);
        add("cfg-a.json", br#"{"architecture":"amd64","os":"linux"}"#);
        add(
            "cfg-b.json",
            br#"{"architecture":"amd64","os":"linux","config":{}}"#,
        );
        add(
            "manifest.json",
            br#"[{"Config":"cfg-a.json","RepoTags":["app:1"],"Layers":["aaa/layer.tar"]},
                 {"Config":"cfg-b.json","RepoTags":["app:2"],"Layers":["bbb/layer.tar"]}]"#,
        );
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_cksum();
        b.append_link(&mut h, "bbb/layer.tar", "../aaa/layer.tar")
            .unwrap();
        b.finish().unwrap();
        path
    }

    #[test]
    fn an_archive_becomes_a_layout_of_the_image_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = archive(dir.path());
        let e = to_layout(&file, None, &dir.path().join("x"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("holds 2 images") && e.contains("app:1, app:2"),
            "{e}"
        );
        let e = to_layout(&file, Some("app:3"), &dir.path().join("y"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no image tagged app:3"), "{e}");

        let out = dir.path().join("layout");
        to_layout(&file, Some("app:2"), &out).unwrap();
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("index.json")).unwrap()).unwrap();
        let digest = index["manifests"][0]["digest"].as_str().unwrap();
        let m: serde_json::Value = serde_json::from_slice(
            &std::fs::read(out.join("blobs/sha256").join(&digest[7..])).unwrap(),
        )
        .unwrap();
        // The linked layer is the first image's, a plain tar, named by its digest.
        let layer = &m["layers"][0];
        assert_eq!(layer["mediaType"], "application/vnd.oci.image.layer.v1.tar");
        let hex = &layer["digest"].as_str().unwrap()[7..];
        let bytes = std::fs::read(out.join("blobs/sha256").join(hex)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&bytes)), hex);
        assert_eq!(m["config"]["size"], 49);

        // Not an archive `docker save` writes.
        let bad = dir.path().join("bad.tar");
        std::fs::write(&bad, vec![0u8; 2048]).unwrap();
        let e = to_layout(&bad, None, &dir.path().join("z"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no manifest.json"), "{e}");
    }
}
