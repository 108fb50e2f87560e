//! Disk images through `qemu-img`.

use crate::HypervisorError;
use std::path::Path;

/// Creates a qcow2 overlay at `overlay` whose backing file is `base` (format
/// `base_format`: `raw` for an ext4 image, `qcow2` for a frozen layer). The VM writes only
/// to the overlay, so the base is never modified.
pub async fn create_overlay(
    base: &Path,
    base_format: &str,
    overlay: &Path,
) -> Result<(), HypervisorError> {
    let base = std::path::absolute(base)
        .map_err(|e| HypervisorError::io(format!("resolving {}", base.display()), e))?;
    qemu_img_create(&base, base_format, overlay).await
}

/// Creates a qcow2 overlay whose backing file is named relative to the overlay's own
/// directory: a directory holding both can be moved (a snapshot is written in a staging
/// directory and renamed into place) without breaking the chain.
pub async fn create_relative_overlay(
    base_name: &str,
    base_format: &str,
    overlay: &Path,
) -> Result<(), HypervisorError> {
    if base_name.contains('/') {
        return Err(HypervisorError::Config(format!(
            "relative backing file {base_name:?} must be a plain file name"
        )));
    }
    qemu_img_create(Path::new(base_name), base_format, overlay).await
}

async fn qemu_img_create(
    base: &Path,
    base_format: &str,
    overlay: &Path,
) -> Result<(), HypervisorError> {
    let out = tokio::process::Command::new("qemu-img")
        .arg("create")
        .arg("-q")
        .args(["-f", "qcow2", "-F", base_format, "-b"])
        .arg(base)
        .arg(overlay)
        .output()
        .await
        .map_err(|source| HypervisorError::Spawn {
            program: "qemu-img (apt-get install qemu-utils)".into(),
            source,
        })?;
    if !out.status.success() {
        return Err(HypervisorError::Config(format!(
            "qemu-img create of {} over {} failed: {}",
            overlay.display(),
            base.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn overlay_points_at_its_base() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.raw");
        std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
        let ov = dir.path().join("ov.qcow2");
        create_overlay(&base, "raw", &ov).await.unwrap();
        let info = std::process::Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(&ov)
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
        assert_eq!(v["format"], "qcow2");
        assert_eq!(v["backing-filename"], base.to_str().unwrap());
        let rel = dir.path().join("rel.qcow2");
        create_relative_overlay("base.raw", "raw", &rel)
            .await
            .unwrap();
        let info = std::process::Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(&rel)
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
        assert_eq!(v["backing-filename"], "base.raw");
        assert!(create_relative_overlay("../base.raw", "raw", &rel)
            .await
            .is_err());
        let err = create_overlay(&dir.path().join("missing"), "raw", &dir.path().join("x"))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("qemu-img create"), "{err}");
    }
}
