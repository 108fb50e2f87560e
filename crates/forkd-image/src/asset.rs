//! Built assets and their JSON manifests, and the reuse rule: an asset is current
//! when its manifest records the same inputs digest and its file still has the
//! recorded size. That check reads no asset data, so it is cheap enough for every
//! `forkd run`.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::fsutil;
use crate::timestamp;

/// One built file and what it was built from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Asset {
    pub path: PathBuf,
    /// Hex sha256 of the file's contents.
    pub sha256: String,
    pub size: u64,
    /// RFC 3339, UTC.
    pub built_at: String,
    pub build_seconds: f64,
    /// Digest of everything that determined the file (see each builder).
    pub inputs: String,
}

impl Asset {
    /// Records a file that has just been built (and published) at `path`.
    pub(crate) fn record(
        path: PathBuf,
        sha256: String,
        size: u64,
        started: Instant,
        inputs: String,
    ) -> Asset {
        Asset {
            path,
            sha256,
            size,
            built_at: timestamp::rfc3339_utc(SystemTime::now()),
            build_seconds: started.elapsed().as_secs_f64(),
            inputs,
        }
    }

    /// True when the file is still there with the recorded size. Deliberately no
    /// re-hash: that would cost seconds per rootfs on every run.
    pub(crate) fn file_intact(&self) -> bool {
        fs::metadata(&self.path)
            .map(|m| m.is_file() && m.len() == self.size)
            .unwrap_or(false)
    }

    /// Current for `inputs`: same digest, file intact.
    pub(crate) fn is_current(&self, inputs: &str) -> bool {
        self.inputs == inputs && self.file_intact()
    }
}

/// Reads a manifest; a missing or unreadable one means "not built" (it gets
/// rebuilt and overwritten), so this returns None rather than an error.
pub(crate) fn load_manifest<T: DeserializeOwned>(path: &Path) -> Option<T> {
    let text = match fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %path.display(), "cannot read manifest, rebuilding: {e}");
            return None;
        }
    };
    match serde_json::from_slice(&text) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!(path = %path.display(), "corrupt manifest, rebuilding: {e}");
            None
        }
    }
}

/// Loads an asset manifest whose file is expected at `file`. The recorded path is
/// replaced by `file`, so a data directory that was moved or copied stays usable.
pub(crate) fn load_asset(manifest: &Path, file: &Path) -> Option<Asset> {
    let mut asset: Asset = load_manifest(manifest)?;
    asset.path = file.to_path_buf();
    Some(asset)
}

pub(crate) fn store_manifest<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    // Serialising these plain structs cannot fail; an empty manifest would only
    // mean a rebuild, so no error path is needed for it.
    let mut text = serde_json::to_vec_pretty(value).unwrap_or_default();
    text.push(b'\n');
    fsutil::write_atomic(path, &text)
}

/// Removes a manifest before its file is replaced, so that no reader ever pairs
/// the old manifest with the new file (it sees "not built" and waits for the lock).
pub(crate) fn retract_manifest(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(crate::error::ImageError::io("remove", path, e)),
    }
}

/// `<name>.json` manifests of `dir` whose `<name>.<ext>` is intact.
pub(crate) fn list_manifests(dir: &Path, kind: &str, ext: &str) -> Vec<(String, Asset)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Asset)> = entries
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            if p.extension()? != "json" {
                return None;
            }
            let stem = p.file_stem()?.to_str()?.to_string();
            if stem.starts_with('.') {
                return None;
            }
            let a = load_asset(&p, &dir.join(format!("{stem}.{ext}")))?;
            a.file_intact().then(|| (format!("{kind}/{stem}"), a))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(dir: &Path, inputs: &str) -> (PathBuf, PathBuf) {
        let file = dir.join("thing.img");
        fs::write(&file, b"0123456789").unwrap();
        let (sha, size) = fsutil::sha256_file(&file).unwrap();
        let asset = Asset::record(file.clone(), sha, size, Instant::now(), inputs.into());
        let manifest = dir.join("thing.json");
        store_manifest(&manifest, &asset).unwrap();
        (file, manifest)
    }

    /// A builder that waited for another's lock reads the asset from its manifest and
    /// must get what the builder returned: every float round-trips exactly.
    #[test]
    fn a_stored_asset_reads_back_equal() {
        let asset = Asset {
            path: "/a/vmlinuz".into(),
            sha256: "00".into(),
            size: 1,
            built_at: "2026-12-04T04:10:10Z".into(),
            build_seconds: 1.2476219259999999,
            inputs: "i".into(),
        };
        let back: Asset = serde_json::from_str(&serde_json::to_string(&asset).unwrap()).unwrap();
        assert_eq!(back, asset);
    }

    #[test]
    fn reuse_only_with_same_inputs_and_size() {
        let dir = tempfile::tempdir().unwrap();
        let (file, manifest) = fake(dir.path(), "in-1");
        let a = load_asset(&manifest, &file).unwrap();
        assert!(a.is_current("in-1"));
        assert!(!a.is_current("in-2"));
        assert!(a.built_at.ends_with('Z'));

        // Same size, different bytes: still reused (no re-hash on the fast path).
        fs::write(&file, b"abcdefghij").unwrap();
        assert!(a.is_current("in-1"));
        // Truncated (a crash of something else, a user's edit): rebuilt.
        fs::write(&file, b"abc").unwrap();
        assert!(!a.is_current("in-1"));
        fs::remove_file(&file).unwrap();
        assert!(!a.is_current("in-1"));
    }

    #[test]
    fn missing_or_corrupt_manifest_is_not_built() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("x.json");
        assert!(load_asset(&m, &dir.path().join("x")).is_none());
        fs::write(&m, b"{ not json").unwrap();
        assert!(load_asset(&m, &dir.path().join("x")).is_none());
        retract_manifest(&m).unwrap();
        retract_manifest(&m).unwrap();
        assert!(!m.exists());
    }

    #[test]
    fn moved_home_keeps_working() {
        let dir = tempfile::tempdir().unwrap();
        let (file, manifest) = fake(dir.path(), "in");
        let moved = dir.path().join("moved");
        fs::create_dir(&moved).unwrap();
        fs::rename(&file, moved.join("thing.img")).unwrap();
        fs::rename(&manifest, moved.join("thing.json")).unwrap();
        let a = load_asset(&moved.join("thing.json"), &moved.join("thing.img")).unwrap();
        assert_eq!(a.path, moved.join("thing.img"));
        assert!(a.is_current("in"));
    }
}
