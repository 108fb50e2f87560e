//! Image archives: what `docker save` (or `skopeo copy ... docker-archive:`) writes, and
//! a tar of an OCI image layout (`skopeo copy ... oci-archive:`), read in one pass and
//! turned into an OCI image layout holding that one image, so that an image from either
//! is made into a root filesystem exactly as one from a layout or a registry. Both
//! `docker-archive:FILE` sources and images uploaded through the API come this way.
//!
//! A `docker save` tar holds `manifest.json` (one entry per image: its config file, its
//! layer files in order, its `RepoTags`), the config and the layers (plain or compressed
//! tars, under any names; older Docker versions link repeated layers with symbolic
//! links). Every regular file is hashed as it is copied out, so each becomes a blob named
//! by its own digest; the OCI manifest written over them is the image's identity here.
//! A layout's tar has no `manifest.json`: its `blobs/sha256/<hex>` must hash to their
//! names, and its `index.json` is cut down to the image asked for.
//!
//! Error messages never quote what the tar reader could not parse: the input may be any
//! file, and its bytes are not the caller's to see.

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

/// Writes the image `tag` of the archive read from `input` (the only one when `tag` is
/// `None`) as an OCI image layout in `dir`, which must exist and be empty. `what` names
/// the input in errors.
pub fn to_layout(
    input: impl Read,
    what: &str,
    tag: Option<&str>,
    dir: &Path,
) -> Result<(), ArchiveError> {
    let refused = |m: String| ArchiveError::Refused(format!("{what}: {m}"));
    // The tar reader's own messages quote the header it could not parse: say where.
    let unreadable = |i: usize| {
        refused(format!(
            "entry {i} cannot be read: not a tar archive, or truncated or damaged"
        ))
    };
    let blobs_dir = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs_dir).map_err(io(format!("creating {}", blobs_dir.display())))?;
    let mut archive = tar::Archive::new(std::io::BufReader::new(input));
    let mut files: BTreeMap<String, Blob> = BTreeMap::new();
    let mut links: BTreeMap<String, String> = BTreeMap::new();
    let mut manifest: Option<Vec<u8>> = None;
    let entries = archive.entries().map_err(|_| unreadable(1))?;
    for (i, entry) in entries.enumerate() {
        let mut entry = entry.map_err(|_| unreadable(i + 1))?;
        let name = entry.path().map_err(|_| unreadable(i + 1))?.into_owned();
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
            .map_err(|e| refused(format!("copying {name} out: {}", e.kind())))?;
        files.insert(name, blob);
    }
    let Some(manifest) = manifest else {
        return oci_layout(&files, &blobs_dir, tag, dir).map_err(refused);
    };
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

/// The layout whose files were copied out into `blobs_dir` as `files`: each
/// `blobs/sha256/<hex>` must hash to its name, and `index.json` is written with the one
/// image tagged `tag` (`org.opencontainers.image.ref.name`), or the only one.
fn oci_layout(
    files: &BTreeMap<String, Blob>,
    blobs_dir: &Path,
    tag: Option<&str>,
    dir: &Path,
) -> Result<(), String> {
    let (Some(index), Some(_)) = (files.get("index.json"), files.get("oci-layout")) else {
        return Err(
            "it has neither manifest.json nor index.json and oci-layout: not an image archive (`docker save` or an OCI layout)"
                .into(),
        );
    };
    for (name, blob) in files {
        if let Some(hex) = name.strip_prefix("blobs/sha256/") {
            if *hex != blob.hex {
                return Err(format!(
                    "{name} does not match its digest: the archive is damaged"
                ));
            }
        }
    }
    if index.size > super::MAX_DOCUMENT {
        return Err("its index.json is too big".into());
    }
    let bytes = std::fs::read(blobs_dir.join(&index.hex))
        .map_err(|e| format!("reading index.json: {}", e.kind()))?;
    let mut index: oci_client::manifest::OciImageIndex =
        serde_json::from_slice(&bytes).map_err(|e| format!("its index.json is not valid: {e}"))?;
    let named = |e: &oci_client::manifest::ImageIndexEntry| {
        e.annotations
            .as_ref()
            .and_then(|a| a.get(super::REF_NAME))
            .cloned()
    };
    let mut hits = index
        .manifests
        .iter()
        .filter(|e| tag.is_none() || named(e).as_deref() == tag);
    let (Some(entry), None) = (hits.next(), hits.next()) else {
        let names: Vec<String> = index.manifests.iter().filter_map(named).collect();
        return Err(match tag {
            Some(t) => format!("no image tagged {t} in it (it has: {})", names.join(", ")),
            None => format!(
                "it holds {} images: name one (it has: {})",
                index.manifests.len(),
                names.join(", ")
            ),
        });
    };
    index.manifests = vec![entry.clone()];
    let text = serde_json::to_vec(&index).map_err(|e| format!("writing index.json: {e}"))?;
    std::fs::write(dir.join("index.json"), text)
        .map_err(|e| format!("writing index.json: {}", e.kind()))?;
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)
        .map_err(|e| format!("writing oci-layout: {}", e.kind()))
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

    /// Appends a regular file `name` holding `data` to `b`.
    fn add_file<W: std::io::Write>(b: &mut tar::Builder<W>, name: &str, data: &[u8]) {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data).unwrap();
    }

    /// A `docker save`-style archive of two images, one layer linked from the other.
    fn archive(dir: &Path) -> PathBuf {
        let path = dir.join("images.tar");
        let mut b = tar::Builder::new(std::fs::File::create(&path).unwrap());
        let mut add = |name: &str, data: &[u8]| add_file(&mut b, name, data);
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
        let e = convert(&file, None, &dir.path().join("x"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("holds 2 images") && e.contains("app:1, app:2"),
            "{e}"
        );
        let e = convert(&file, Some("app:3"), &dir.path().join("y"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no image tagged app:3"), "{e}");

        let out = dir.path().join("layout");
        convert(&file, Some("app:2"), &out).unwrap();
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
        let e = convert(&bad, None, &dir.path().join("z"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("neither manifest.json nor index.json"), "{e}");
    }

    fn convert(file: &Path, tag: Option<&str>, dir: &Path) -> Result<(), ArchiveError> {
        let input = std::fs::File::open(file).unwrap();
        to_layout(input, "the archive", tag, dir)
    }

    #[test]
    fn errors_never_quote_the_input() {
        let dir = tempfile::tempdir().unwrap();
        // Text where a tar header would be: the tar reader's own error quotes it.
        let secret = "root:*:20228:0:99999:7:::\ndaemon:*:20228:0:99999:7:::\n".repeat(20);
        let file = dir.path().join("shadow");
        std::fs::write(&file, &secret).unwrap();
        let e = convert(&file, None, &dir.path().join("x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot be read"), "{e}");
        assert!(!e.contains("root") && !e.contains("20228"), "{e}");
    }

    /// A tar of an OCI layout with two images, tagged `a` and `b`.
    fn layout_tar(dir: &Path, damage: bool) -> PathBuf {
        let path = dir.join("layout.tar");
        let mut b = tar::Builder::new(std::fs::File::create(&path).unwrap());
        let mut add = |name: &str, data: &[u8]| add_file(&mut b, name, data);
        let mut entries = Vec::new();
        for t in ["a", "b"] {
            let m = format!(r#"{{"schemaVersion":2,"tag":"{t}"}}"#);
            let hex = hex::encode(Sha256::digest(m.as_bytes()));
            let body = if damage {
                b"other".to_vec()
            } else {
                m.clone().into_bytes()
            };
            add(&format!("blobs/sha256/{hex}"), &body);
            entries.push(serde_json::json!({
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": format!("sha256:{hex}"), "size": m.len(),
                "annotations": {"org.opencontainers.image.ref.name": t},
            }));
        }
        let index = serde_json::json!({"schemaVersion": 2, "manifests": entries});
        add("index.json", index.to_string().as_bytes());
        add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
        b.finish().unwrap();
        path
    }

    #[test]
    fn a_layout_tar_becomes_a_layout_of_the_image_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = layout_tar(dir.path(), false);
        let e = convert(&file, None, &dir.path().join("x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds 2 images") && e.contains("a, b"), "{e}");
        let out = dir.path().join("layout");
        convert(&file, Some("b"), &out).unwrap();
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("index.json")).unwrap()).unwrap();
        let entries = index["manifests"].as_array().unwrap();
        assert_eq!(entries.len(), 1);
        let hex = &entries[0]["digest"].as_str().unwrap()[7..];
        let m = std::fs::read(out.join("blobs/sha256").join(hex)).unwrap();
        assert!(String::from_utf8_lossy(&m).contains(r#""tag":"b""#));

        let dir = tempfile::tempdir().unwrap();
        let file = layout_tar(dir.path(), true);
        let e = convert(&file, Some("a"), &dir.path().join("x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not match its digest"), "{e}");
    }
}
