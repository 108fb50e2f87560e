//! Container images and snapshot archives: a `docker save` tar or a layout's tar read
//! into a layout, a snapshot archive received and its manifests checked, an image
//! layer (tar with whiteouts, plain, gzip or zstd) applied onto a tree, and a part's
//! zstd blob decompressed with its bounds. Each call works in a directory of its own,
//! and checks that nothing was written outside the place the decoder was given.

use arbitrary::{Arbitrary, Unstructured};
use forkd_image::oci_rootfs::{apply_layer, Compression, Layer};
use forkd_storage::oci::{blob, docker_archive, layout::Layout};
use forkd_storage::snapshot::Store;
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;

/// The names in directory `dir`.
fn names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|it| {
            it.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Asserts that `dir` holds exactly `expected`.
fn holds_only(dir: &Path, expected: &[&str], what: &str) {
    let have = names(dir);
    let want: BTreeSet<String> = expected.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(
        have, want,
        "{what} wrote outside the directory it was given"
    );
}

/// A directory for one call, in memory where the system has a tmpfs at `/dev/shm`: the
/// decoders sync what they write, as they must in production, and on a disk those syncs
/// would be most of the fuzzing's time.
fn scratch() -> tempfile::TempDir {
    static SHM: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let shm = Path::new("/dev/shm");
    let in_memory = *SHM.get_or_init(|| tempfile::tempdir_in(shm).is_ok());
    if in_memory {
        tempfile::tempdir_in(shm).expect("a scratch directory")
    } else {
        tempfile::tempdir().expect("a scratch directory")
    }
}

/// `forkd_storage::oci::docker_archive::to_layout`: the first byte picks the tag asked for
/// (none, short or long form), the rest is the archive.
pub fn docker_archive(data: &[u8]) {
    let Some((&which, archive)) = data.split_first() else {
        return;
    };
    let tag = match which % 3 {
        0 => None,
        1 => Some("app:1"),
        _ => Some("docker.io/library/app:1"),
    };
    let dir = scratch();
    let out = dir.path().join("layout");
    std::fs::create_dir(&out).expect("the layout directory");
    let result = docker_archive::to_layout(archive, "the input", tag, &out);
    holds_only(dir.path(), &["layout"], "an image archive");
    if result.is_ok() {
        // A layout of one image, every blob named by its digest (the index may name a
        // manifest the archive lacks: the layout's reader refuses that, as it would in
        // any layout).
        let index = std::fs::read(out.join("index.json")).expect("index.json is written");
        let index: serde_json::Value = serde_json::from_slice(&index).expect("index.json is JSON");
        let manifests = index["manifests"].as_array().map(Vec::len);
        assert_eq!(manifests, Some(1), "the layout holds one image");
        for name in names(&out.join("blobs/sha256")) {
            let blob = std::fs::read(out.join("blobs/sha256").join(&name)).expect("a blob");
            assert_eq!(name, hex_sha256(&blob), "a blob does not match its name");
        }
        assert!(out.join("oci-layout").is_file());
    }
}

fn hex_sha256(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// `Layout::receive` of a snapshot archive, then its chain read and checked, as
/// `forkd unpack` does before it installs anything.
pub fn oci_layout(data: &[u8]) {
    let dir = scratch();
    let store = Store::at(dir.path().join("store"));
    if let Ok(layout) = Layout::receive(&store, data, &|_| {}) {
        if let Ok(chain) = layout.index_chain() {
            assert!(!chain.is_empty(), "an empty chain was accepted");
            for link in &chain {
                for (name, part) in &link.parts {
                    assert!(
                        forkd_storage::oci::hex_of(&format!("sha256:{}", part.hex)).is_some(),
                        "part {name} has a bad digest"
                    );
                }
            }
        }
    }
    // The layout is the store's scratch, removed when dropped: nothing stays.
    holds_only(dir.path(), &["store"], "receiving an archive");
    holds_only(
        &dir.path().join("store"),
        &[".staging"],
        "receiving an archive",
    );
    holds_only(
        &dir.path().join("store/.staging"),
        &[],
        "a dropped layout left files behind:",
    );
}

/// Applies `layer` (compressed as `compression`) onto an empty tree, next to a
/// directory it must not touch.
fn apply(layer: &[u8], compression: Compression) {
    let dir = scratch();
    let blob = dir.path().join("layer");
    std::fs::write(&blob, layer).expect("writing the layer");
    let root = dir.path().join("root");
    std::fs::create_dir(&root).expect("the tree");
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).expect("the neighbour");
    std::fs::write(outside.join("keep"), b"keep").expect("the neighbour's file");
    let _ = apply_layer(
        &root,
        &Layer {
            path: blob,
            compression,
        },
    );
    holds_only(dir.path(), &["layer", "root", "outside"], "a layer");
    holds_only(&outside, &["keep"], "a layer");
    assert_eq!(
        std::fs::read(outside.join("keep")).ok().as_deref(),
        Some(&b"keep"[..]),
        "a layer wrote through to a file outside its tree"
    );
}

fn compression(which: u8) -> Compression {
    match which % 3 {
        0 => Compression::None,
        1 => Compression::Gzip,
        _ => Compression::Zstd,
    }
}

/// An image layer as it comes: the first byte picks its compression (none, gzip,
/// zstd), the rest is the blob.
pub fn oci_layer(data: &[u8]) {
    let Some((&which, layer)) = data.split_first() else {
        return;
    };
    apply(layer, compression(which));
}

/// One component of a path in a generated layer: a few names, so that entries meet
/// (a file where a directory was, a whiteout of what a link points through).
#[derive(Debug, Arbitrary)]
enum Part {
    Name(u8),
    Dot,
    DotDot,
    Whiteout(u8),
    Opaque,
}

impl Part {
    fn push(&self, s: &mut String) {
        if !s.is_empty() && !s.ends_with('/') {
            s.push('/');
        }
        let name = |n: u8| ["a", "b", "c", "etc", "x"][usize::from(n % 5)];
        match self {
            Part::Name(n) => s.push_str(name(*n)),
            Part::Dot => s.push('.'),
            Part::DotDot => s.push_str(".."),
            Part::Whiteout(n) => {
                s.push_str(".wh.");
                s.push_str(name(*n));
            }
            Part::Opaque => s.push_str(".wh..wh..opq"),
        }
    }
}

/// What a generated entry is.
#[derive(Debug, Arbitrary)]
enum Kind {
    File(Vec<u8>),
    Dir,
    Symlink { absolute: bool, to: Vec<Part> },
    HardLink(Vec<Part>),
    Fifo,
}

/// One generated entry.
#[derive(Debug, Arbitrary)]
struct Entry {
    leading_slash: bool,
    path: Vec<Part>,
    kind: Kind,
    mode: u16,
}

fn path_of(parts: &[Part], absolute: bool) -> String {
    let mut s = String::from(if absolute { "/" } else { "" });
    for p in parts.iter().take(6) {
        p.push(&mut s);
    }
    s
}

/// Writes `text` into a header field (names and link targets as they are: `..`
/// included, which the tar crate's builder would refuse); false if it does not fit.
fn put(field: &mut [u8], text: &str) -> bool {
    if text.len() >= field.len() {
        return false;
    }
    field[..text.len()].copy_from_slice(text.as_bytes());
    true
}

/// A tar of (at most 16 of) `entries`.
fn tar_of(entries: &[Entry]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries.iter().take(16) {
        let name = path_of(&e.path, e.leading_slash);
        let mut h = tar::Header::new_gnu();
        if name.is_empty() || !put(&mut h.as_old_mut().name, &name) {
            continue;
        }
        h.set_mode(u32::from(e.mode & 0o7777));
        h.set_mtime(1_700_000_000);
        let mut body: &[u8] = b"";
        let (kind, link) = match &e.kind {
            Kind::File(data) => {
                body = &data[..data.len().min(64)];
                (tar::EntryType::Regular, None)
            }
            Kind::Dir => (tar::EntryType::Directory, None),
            Kind::Fifo => (tar::EntryType::Fifo, None),
            Kind::Symlink { absolute, to } => {
                (tar::EntryType::Symlink, Some(path_of(to, *absolute)))
            }
            Kind::HardLink(to) => (tar::EntryType::Link, Some(path_of(to, false))),
        };
        h.set_entry_type(kind);
        if let Some(target) = link {
            if !put(&mut h.as_old_mut().linkname, &target) {
                continue;
            }
        }
        h.set_size(body.len() as u64);
        h.set_cksum();
        if b.append(&h, body).is_err() {
            return Vec::new();
        }
    }
    b.into_inner().unwrap_or_default()
}

/// Layers made from the input's structure rather than its bytes: each is a valid tar of
/// a few entries over a few names (files, directories, links out and in, whiteouts,
/// opaque markers, `..`), so that the fuzzer spends its time on how layers stack, not
/// on tar checksums. Two layers are applied onto one tree, as an image's are.
pub fn oci_layer_tree(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok((lower, upper, which)) = <(Vec<Entry>, Vec<Entry>, u8)>::arbitrary(&mut u) else {
        return;
    };
    let dir = scratch();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).expect("the tree");
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).expect("the neighbour");
    std::fs::write(outside.join("keep"), b"keep").expect("the neighbour's file");
    for (i, entries) in [lower, upper].iter().enumerate() {
        let tar = tar_of(entries);
        let blob = dir.path().join(format!("layer{i}"));
        let c = compression(which >> (2 * i));
        let bytes = match c {
            Compression::None => tar,
            Compression::Gzip => {
                let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                gz.write_all(&tar).expect("gzip into memory");
                gz.finish().expect("gzip into memory")
            }
            Compression::Zstd => zstd::encode_all(&tar[..], 1).expect("zstd into memory"),
        };
        std::fs::write(&blob, bytes).expect("writing the layer");
        let _ = apply_layer(
            &root,
            &Layer {
                path: blob,
                compression: c,
            },
        );
    }
    holds_only(
        dir.path(),
        &["layer0", "layer1", "root", "outside"],
        "a layer",
    );
    holds_only(&outside, &["keep"], "a layer");
    assert_eq!(
        std::fs::read(outside.join("keep")).ok().as_deref(),
        Some(&b"keep"[..]),
        "a layer wrote through to a file outside its tree"
    );
}

/// `blob::decompress_bounded`: the first two bytes are the part's size (big endian),
/// the third its stated data (0: none stated, n: (n - 1) pages of 4 KiB), the rest the
/// blob.
pub fn zstd_blob(data: &[u8]) {
    let [a, b, s, rest @ ..] = data else {
        return;
    };
    let size = u64::from(u16::from_be_bytes([*a, *b]));
    let stored = (*s != 0).then(|| u64::from(*s - 1) * 4096);
    let dir = scratch();
    let blob_path = dir.path().join("blob");
    std::fs::write(&blob_path, rest).expect("writing the blob");
    let part = dir.path().join("part");
    let Ok(hex) = blob::decompress_bounded(&blob_path, &part, size, stored) else {
        return;
    };
    let got = std::fs::read(&part).expect("the part was written");
    assert_eq!(got.len() as u64, size, "the part is not the size asked for");
    assert_eq!(
        hex,
        hex_sha256(&got),
        "the digest is not of what was written"
    );
    let whole = zstd::decode_all(rest).expect("a blob that decompressed decodes");
    assert_eq!(whole, got, "the part is not what the blob holds");
    if let Some(limit) = stored {
        let data_pages: u64 = got
            .chunks(4096)
            .filter(|p| p.iter().any(|b| *b != 0))
            .map(|p| p.len() as u64)
            .sum();
        assert!(
            data_pages <= limit,
            "{data_pages} bytes of data past a limit of {limit}"
        );
    }
}
