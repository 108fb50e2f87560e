//! Pack and unpack of snapshots made of real parts (a qcow2 layer over a raw image, a
//! sparse memory image, a memory diff), without a VM: the round trip of a chain into
//! another store, and every way an archive can be bad.

use super::layout::Layout;
use super::{pack, unpack, ArchiveError};
use crate::snapshot::manifest::{parts, BuildTimes, Machine, Manifest, Versions};
use crate::snapshot::{chain, memory_diff, Store, Tag, MANIFEST};
use forkd_qemu::qcow2;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const MEMORY_MIB: u32 = 4;

fn manifest(tag: &str, parent: Option<(&str, String)>) -> Manifest {
    Manifest {
        format: crate::snapshot::manifest::FORMAT,
        tag: tag.into(),
        template: "test".into(),
        created_at: "2026-01-01T00:00:00Z".into(),
        parent: parent.as_ref().map(|p| p.0.to_owned()),
        parent_digest: parent.map(|p| p.1),
        branch: None,
        machine: Machine {
            vcpus: 1,
            memory_mib: MEMORY_MIB,
            accel: forkd_hypervisor::Accel::Tcg,
            cpu: "max".into(),
            cmdline: "console=ttyS0".into(),
            clock: Default::default(),
            pit: true,
            nic: false,
        },
        versions: Versions {
            kernel: "k".into(),
            rootfs: "r".into(),
            initramfs_sha256: "i".into(),
            forkd: "0".into(),
            agent_protocol: 4,
            hypervisor: "qemu".into(),
            hypervisor_version: "q".into(),
        },
        parts: Default::default(),
        contexts: Vec::new(),
        build: BuildTimes::default(),
        pool: 0,
        egress: None,
        lifecycle: Default::default(),
    }
}

fn memory(path: &Path, fill: u8) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(u64::from(MEMORY_MIB) << 20).unwrap();
    f.write_all_at(&[fill; 8192], 1 << 20).unwrap();
}

/// A root snapshot `base` and a link `link` on it, in `store`.
pub(super) fn chain_of_two(store: &Store) {
    let base = Tag::parse("base").unwrap();
    let st = store.stage(&base).unwrap();
    std::fs::write(st.part(parts::STATE), b"device state of base").unwrap();
    memory(&st.part(parts::MEMORY), 1);
    std::fs::write(st.part(parts::ROOTFS), vec![5u8; 1 << 20]).unwrap();
    qcow2::create_overlay(
        &st.part(parts::DISK),
        &st.part(parts::ROOTFS),
        parts::ROOTFS,
        qcow2::BaseFormat::Raw,
    )
    .unwrap();
    std::fs::write(st.part(parts::KERNEL), b"kernel").unwrap();
    std::fs::write(st.part(parts::INITRAMFS), b"initramfs").unwrap();
    let base = st.publish(manifest("base", None), &|_| {}).unwrap();

    let link = Tag::parse("link").unwrap();
    let mut st = store.stage(&link).unwrap();
    st.link_assets_from(&base).unwrap();
    std::fs::write(st.part(parts::STATE), b"device state of link").unwrap();
    memory(&st.part(parts::MEMORY), 2);
    memory_diff::write_diff(
        &base.part(parts::MEMORY),
        &st.part(parts::MEMORY),
        &st.part(parts::MEMORY_DIFF),
    )
    .unwrap();
    let base_disk = base.part(parts::DISK);
    qcow2::create_overlay(
        &st.part(parts::DISK),
        &base_disk,
        base_disk.to_str().unwrap(),
        qcow2::BaseFormat::Qcow2,
    )
    .unwrap();
    let digest = crate::snapshot::sha256_file(&base.dir.join(MANIFEST))
        .unwrap()
        .0;
    st.publish(manifest("link", Some(("base", digest))), &|_| {})
        .unwrap();
}

fn tar_of(layout: &Layout) -> Vec<u8> {
    let mut out = Vec::new();
    layout.write_tar(&mut out).unwrap();
    assert_eq!(out.len() as u64, layout.tar_size().unwrap());
    out
}

fn packed_chain() -> (tempfile::TempDir, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::at(dir.path().join("a"));
    chain_of_two(&store);
    let p = pack::pack(&store, &Tag::parse("link").unwrap(), &|_| {}).unwrap();
    assert_eq!(p.snapshots.len(), 2);
    let tar = tar_of(&p.layout);
    (dir, tar)
}

fn unpack_into(dir: &Path, tar: &[u8]) -> Result<unpack::Unpacked, ArchiveError> {
    let store = Store::at(dir.join("b"));
    unpack::unpack(
        &store,
        forkd_qemu::hypervisor().as_ref(),
        tar,
        None,
        &|_| {},
    )
}

/// What the store holds, staging aside.
fn installed(dir: &Path) -> Vec<String> {
    let store = Store::at(dir.join("b"));
    store.list().into_iter().map(|(t, _)| t).collect()
}

#[test]
fn a_chain_round_trips_into_another_store() {
    let (dir, tar) = packed_chain();
    let got = unpack_into(dir.path(), &tar).unwrap();
    assert_eq!(got.tag, "link");
    assert_eq!(got.installed, ["base", "link"]);
    let store = Store::at(dir.path().join("b"));
    let verified = chain::verify(&store, &Tag::parse("link").unwrap()).unwrap();
    assert_eq!(verified.len(), 2);
    let link = store.open(&Tag::parse("link").unwrap()).unwrap();
    let base_disk = store.path(&Tag::parse("base").unwrap()).join(parts::DISK);
    assert_eq!(
        qcow2::backing_name(&link.part(parts::DISK))
            .unwrap()
            .as_deref(),
        base_disk.to_str(),
        "the link's layer names its parent where it is now"
    );
    // The guest assets the chain shares are written once.
    use std::os::unix::fs::MetadataExt;
    let inode = |p: PathBuf| std::fs::metadata(p).unwrap().ino();
    assert_eq!(
        inode(link.part(parts::ROOTFS)),
        inode(base_disk.with_file_name(parts::ROOTFS))
    );
    // The memory image was made again from the parent's and the diff.
    let want = crate::snapshot::sha256_file(&dir.path().join("a/link/memory.ram")).unwrap();
    assert_eq!(
        crate::snapshot::sha256_file(&link.part(parts::MEMORY)).unwrap(),
        want
    );

    // Again: everything is here already.
    let again = unpack_into(dir.path(), &tar).unwrap();
    assert!(again.installed.is_empty());
    assert_eq!(again.present, ["base", "link"]);
    // Under another name the head is installed again, on the base that is here.
    let store = Store::at(dir.path().join("b"));
    let other = Tag::parse("other").unwrap();
    let got = unpack::unpack(
        &store,
        forkd_qemu::hypervisor().as_ref(),
        &tar[..],
        Some(&other),
        &|_| {},
    )
    .unwrap();
    assert_eq!(
        (got.installed, got.present),
        (vec!["other".to_owned()], vec!["base".to_owned()])
    );
    chain::verify(&store, &other).unwrap();
}

/// Rewrites the tar entry by entry: `f` gets each name and its data and returns the
/// entries to write instead (name bytes, data, type).
fn rewrite(
    tar: &[u8],
    mut f: impl FnMut(&str, Vec<u8>) -> Vec<(Vec<u8>, Vec<u8>, tar::EntryType)>,
) -> Vec<u8> {
    let mut out = tar::Builder::new(Vec::new());
    let mut a = tar::Archive::new(tar);
    for e in a.entries().unwrap() {
        let mut e = e.unwrap();
        let name = e.path().unwrap().to_string_lossy().into_owned();
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut e, &mut data).unwrap();
        for (n, d, kind) in f(&name, data) {
            let mut h = tar::Header::new_ustar();
            h.as_old_mut().name[..n.len()].copy_from_slice(&n);
            h.set_entry_type(kind);
            if kind == tar::EntryType::Symlink {
                h.set_link_name("/etc/passwd").unwrap();
            }
            h.set_size(d.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            out.append(&h, &d[..]).unwrap();
        }
    }
    out.into_inner().unwrap()
}

fn keep(name: &str, data: Vec<u8>) -> Vec<(Vec<u8>, Vec<u8>, tar::EntryType)> {
    vec![(name.as_bytes().to_vec(), data, tar::EntryType::Regular)]
}

fn refused(dir: &Path, tar: &[u8], expect: &str) {
    let e = unpack_into(dir, tar).unwrap_err().to_string();
    assert!(e.contains(expect), "{e:?} does not say {expect:?}");
    assert!(installed(dir).is_empty(), "nothing installed after {e}");
    let staging = dir.join("b/.staging");
    let left: Vec<_> = std::fs::read_dir(&staging)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left in staging: {left:?}");
}

/// The largest blob's name: a part, not a manifest.
fn largest_blob(tar: &[u8]) -> String {
    let mut a = tar::Archive::new(tar);
    let mut best = (0, String::new());
    for e in a.entries().unwrap() {
        let e = e.unwrap();
        let name = e.path().unwrap().to_string_lossy().into_owned();
        if e.size() > best.0 && name.starts_with("blobs/") {
            best = (e.size(), name);
        }
    }
    best.1
}

#[test]
fn a_flipped_byte_in_a_blob_is_refused() {
    let (dir, tar) = packed_chain();
    let victim = largest_blob(&tar);
    let bad = rewrite(&tar, |name, mut data| {
        if name == victim {
            data[10] ^= 0x40;
        }
        keep(name, data)
    });
    refused(dir.path(), &bad, "does not match its digest");
}

#[test]
fn a_truncated_archive_is_refused() {
    let (dir, tar) = packed_chain();
    for cut in [tar.len() / 2, tar.len() - 2048, 700] {
        let e = unpack_into(dir.path(), &tar[..cut])
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated"), "cut at {cut}: {e}");
        assert!(installed(dir.path()).is_empty());
    }
}

#[test]
fn entries_outside_the_layout_links_and_duplicates_are_refused() {
    let (dir, tar) = packed_chain();
    let add = |extra: (Vec<u8>, Vec<u8>, tar::EntryType)| {
        let mut extra = Some(extra);
        rewrite(&tar, move |name, data| {
            let mut v = keep(name, data);
            if let Some(x) = extra.take() {
                v.insert(0, x);
            }
            v
        })
    };
    let bad = add((
        b"../escape".to_vec(),
        b"x".to_vec(),
        tar::EntryType::Regular,
    ));
    refused(dir.path(), &bad, "lies outside the layout");
    let bad = add((
        b"/etc/cron.d/x".to_vec(),
        b"x".to_vec(),
        tar::EntryType::Regular,
    ));
    refused(dir.path(), &bad, "lies outside the layout");
    let bad = add((
        b"blobs/sha256/link".to_vec(),
        Vec::new(),
        tar::EntryType::Symlink,
    ));
    refused(dir.path(), &bad, "symbolic link");
    let bad = add((
        b"blobs/sha256/hard".to_vec(),
        Vec::new(),
        tar::EntryType::Link,
    ));
    refused(dir.path(), &bad, "hard link");
    let bad = add((
        b"notes.txt".to_vec(),
        b"x".to_vec(),
        tar::EntryType::Regular,
    ));
    refused(dir.path(), &bad, "unexpected entry");
    let first = largest_blob(&tar);
    let bad = rewrite(&tar, |name, data| {
        let mut v = keep(name, data.clone());
        if name == first {
            v.push((name.as_bytes().to_vec(), data, tar::EntryType::Regular));
        }
        v
    });
    refused(dir.path(), &bad, "appears twice");
}

#[test]
fn a_manifest_naming_a_missing_blob_is_refused() {
    let (dir, tar) = packed_chain();
    let victim = largest_blob(&tar);
    let bad = rewrite(&tar, |name, data| {
        if name == victim {
            Vec::new()
        } else {
            keep(name, data)
        }
    });
    refused(dir.path(), &bad, "is missing");
}

#[test]
fn a_blob_that_inflates_past_its_part_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::at(dir.path().join("a"));
    chain_of_two(&store);
    let p = pack::pack(&store, &Tag::parse("base").unwrap(), &|_| {}).unwrap();
    // 1 GiB of zeros in a few KiB, in place of the 1 MiB root filesystem.
    let mut bomb = zstd::stream::write::Encoder::new(Vec::new(), 19).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..1024 {
        std::io::Write::write_all(&mut bomb, &zeros).unwrap();
    }
    let bomb = bomb.finish().unwrap();
    assert!(bomb.len() < 1 << 20);
    let layout = &p.layout;
    let index = layout.index().unwrap();
    let entry = &index.manifests[0];
    let old = layout.artifact(&entry.digest, Some(entry.size)).unwrap();
    let mut oci = old.oci.clone();
    let bomb_hex = layout.add_bytes(&bomb).unwrap();
    for l in &mut oci.layers {
        if l.annotations.as_ref().unwrap()[super::TITLE] == parts::ROOTFS {
            l.digest = super::digest_of(&bomb_hex);
            l.size = i64::try_from(bomb.len()).unwrap();
        }
    }
    let json = serde_json::to_vec(&oci).unwrap();
    let hex = layout.add_bytes(&json).unwrap();
    let mut e = index.manifests[0].clone();
    e.digest = super::digest_of(&hex);
    e.size = i64::try_from(json.len()).unwrap();
    layout.write_index(vec![e]).unwrap();
    let tar = tar_of(layout);
    refused(dir.path(), &tar, "decompresses to more than");
}

#[test]
fn a_container_image_is_not_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let layout = Layout::new(&Store::at(dir.path()), "image").unwrap();
    let config = layout
        .add_bytes(br#"{"architecture":"amd64","os":"linux"}"#)
        .unwrap();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": super::MANIFEST_MEDIA_TYPE,
        "config": {
            "mediaType": oci_client::manifest::IMAGE_CONFIG_MEDIA_TYPE,
            "digest": super::digest_of(&config),
            "size": 37,
        },
        "layers": [],
    });
    let hex = layout.add_bytes(manifest.to_string().as_bytes()).unwrap();
    let e = layout
        .artifact(&super::digest_of(&hex), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("is not a forkd snapshot"), "{e}");
}
