//! A recipe's own root filesystems (`rootfs/custom-<hex>.ext4`): a base image with the
//! recipe's packages, files and build steps applied. forkd-core makes them in a build
//! VM; this module names them by the digest of everything that went in, finds a current
//! one, and publishes a new one.

use std::path::Path;
use std::time::Instant;

use crate::asset::{self, Asset};
use crate::error::Result;
use crate::fsutil::{self, ScratchDir};
use crate::home::Home;

/// The prefix of a customisation's scratch directory in the images' scratch area.
pub const SCRATCH_PREFIX: &str = "customising-";

/// The name of the image made from `inputs` (a hex digest).
pub fn name(inputs: &str) -> String {
    format!("custom-{}", &inputs[..inputs.len().min(16)])
}

/// The image made from `inputs`, if it is built and intact.
pub fn current(home: &Home, inputs: &str) -> Option<Asset> {
    let name = name(inputs);
    let dir = home.rootfs_dir();
    asset::load_asset(
        &dir.join(format!("{name}.json")),
        &dir.join(format!("{name}.ext4")),
    )
    .filter(|a| a.is_current(inputs))
}

/// A scratch directory for making it (removed when dropped; a crashed build's by the
/// next daemon's start).
pub fn scratch(home: &Home, inputs: &str) -> Result<ScratchDir> {
    ScratchDir::new(
        &home.tmp_dir(),
        &format!("{SCRATCH_PREFIX}{}-", name(inputs)),
    )
}

/// Publishes the finished image file `image` as the image of `inputs`.
pub fn publish(home: &Home, inputs: &str, image: &Path, started: Instant) -> Result<Asset> {
    let name = name(inputs);
    let dir = home.rootfs_dir();
    fsutil::create_dir_all(&dir)?;
    let (file, manifest) = (
        dir.join(format!("{name}.ext4")),
        dir.join(format!("{name}.json")),
    );
    let (sha256, size) = fsutil::sha256_file(image)?;
    asset::retract_manifest(&manifest)?;
    fsutil::publish(image, &file)?;
    let a = Asset::record(file, sha256, size, started, inputs.to_owned());
    asset::store_manifest(&manifest, &a)?;
    Ok(a)
}
