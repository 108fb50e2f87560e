//! Snapshots as OCI artifacts: the one format forkd's snapshots travel in, as an archive
//! (`forkd pack`/`unpack`: an OCI image layout in a tar) and, with the same manifests
//! and blobs, through registries.
//!
//! Each snapshot of a chain is one OCI image manifest with forkd's artifact type:
//!
//! ```text
//! config    its manifest.json, as written (so the digest a chain link records of its
//!           parent's manifest is the parent's config digest)
//! layers    its parts (state, memory, disk layer, rootfs, kernel, initramfs; a link's
//!           memory diff instead of its memory), each zstd-compressed, named by the
//!           `org.opencontainers.image.title` annotation
//! annotations  its tag, and for a link the digest of its parent's OCI manifest
//! ```
//!
//! Parts shared along a chain (the guest assets) are one blob. Sparse images stay cheap:
//! holes compress to almost nothing and are written back as holes.
//!
//! - [`blob`]: compressing a part into a blob and back, bounded and sparse.
//! - [`layout`]: an OCI image layout directory: received blobs, checked manifests.
//! - [`pack`]: a snapshot chain into a layout, and the layout into a tar.
//! - [`unpack`]: a tar into a layout, checked, then installed into the store.
//! - [`registry`]: push and pull over the OCI distribution protocol.
//! - [`auth`]: registry credentials in a docker-style auth file.
//! - [`image`]: container images pulled to make a template's root filesystem.
//! - [`docker_archive`]: an image archive (`docker save`'s, or a layout's tar) read.
//! - [`upload`]: container images sent to the daemon instead of named by a host path.

pub mod auth;
pub mod blob;
pub mod docker_archive;
pub mod image;
pub mod layout;
pub mod pack;
pub mod registry;
pub mod unpack;
pub mod upload;

use crate::snapshot::SnapshotError;

/// The artifact type of a forkd snapshot.
pub const ARTIFACT_TYPE: &str = "application/vnd.forkd.snapshot.v1";
/// The media type of its config blob: the snapshot's `manifest.json`.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.forkd.snapshot.manifest.v1+json";
/// The media type of a part's blob.
pub const PART_MEDIA_TYPE: &str = "application/vnd.forkd.snapshot.part.v1+zstd";
/// The OCI image manifest media type.
pub const MANIFEST_MEDIA_TYPE: &str = oci_client::manifest::OCI_IMAGE_MEDIA_TYPE;
/// The OCI image index media type.
pub const INDEX_MEDIA_TYPE: &str = oci_client::manifest::OCI_IMAGE_INDEX_MEDIA_TYPE;

/// Annotation naming a part (the standard title annotation).
pub const TITLE: &str = "org.opencontainers.image.title";
/// Annotation on an index entry: the reference (tag) it is known by.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// Annotation on a snapshot's manifest: its tag where it was packed.
pub const TAG_ANNOTATION: &str = "dev.forkd.snapshot.tag";
/// Annotation on a chain link's manifest: the digest of its parent's OCI manifest.
pub const PARENT_ANNOTATION: &str = "dev.forkd.snapshot.parent";
/// Annotation on a part's layer: the bytes of its non-zero pages, which is what
/// unpacking it writes (the rest stay holes). Only a space estimate: what is written is
/// bounded by the part's size whatever it says.
pub const STORED_ANNOTATION: &str = "dev.forkd.snapshot.part.stored";
/// Annotation: when the snapshot was made.
pub const CREATED: &str = "org.opencontainers.image.created";

/// The largest manifest, config or index read into memory.
pub const MAX_DOCUMENT: u64 = 1 << 20;

/// What can go wrong packing, unpacking, pushing or pulling.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Space(#[from] forkd_host::space::SpaceError),
    /// The archive (or what a registry served) is not a valid forkd snapshot; nothing
    /// was installed.
    #[error("refused: {0}; nothing was installed")]
    Refused(String),
    /// An I/O error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
}

pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ArchiveError {
    let context = context.into();
    move |source| ArchiveError::Io { context, source }
}

/// `sha256:<hex>` for a hex digest.
pub fn digest_of(hex: &str) -> String {
    format!("sha256:{hex}")
}

/// The hex of a `sha256:<hex>` digest, or None if it is not one.
pub fn hex_of(digest: &str) -> Option<&str> {
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then_some(hex)
}

#[cfg(test)]
mod archive_tests;
#[cfg(test)]
mod registry_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_lowercase_sha256_digests_name_blobs() {
        let hex = "a".repeat(64);
        assert_eq!(hex_of(&digest_of(&hex)), Some(hex.as_str()));
        assert_eq!(hex_of(&format!("sha512:{hex}")), None);
        assert_eq!(hex_of(&format!("sha256:{}", "A".repeat(64))), None);
        assert_eq!(hex_of("sha256:../../etc/passwd"), None);
        assert_eq!(hex_of(&format!("sha256:{}", "a".repeat(63))), None);
    }
}
