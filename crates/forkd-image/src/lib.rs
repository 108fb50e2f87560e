//! forkd's guest assets: the Debian cloud kernel, the initramfs that carries the
//! agent and the virtio modules, and the rootfs images. Each is built into the
//! data directory (see [`Home`]) with a JSON manifest recording its sha256 and a
//! digest of its inputs, and rebuilt only when those inputs change.
//!
//! ```text
//! <home>/images/
//!   .lock                         flock serialising builds across processes
//!   kernel/current.json           the kernel used when no .deb is given
//!   kernel/<release>/vmlinuz      + kernel.json, config, modules/{modules.dep,modules.builtin,kernel/...ko}
//!   initramfs/<key>.cpio          + <key>.json   (key = inputs digest prefix)
//!   rootfs/<name>.ext4            + <name>.json
//!   tmp/                          scratch of the build in progress
//! ```

mod agent;
mod apt_sources;
mod asset;
mod command;
pub mod custom_rootfs;
mod elf;
mod error;
mod fsutil;
mod home;
mod initramfs;
mod inputs;
mod kernel;
mod lock;
mod modules;
mod newc;
pub mod oci_rootfs;
pub mod packages;
mod progress;
mod rootfs;
pub mod timestamp;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use agent::find_agent_binary;
pub use apt_sources::{debian_mirror, debian_suite};
pub use asset::Asset;
pub use error::ImageError;
pub use fsutil::ScratchDir;
pub use home::Home;
pub use initramfs::{ensure_initramfs, INITRAMFS_MARKER};
pub use kernel::{ensure_kernel, KernelAsset, KERNEL_METAPACKAGE};
pub use modules::GUEST_MODULES;
pub use progress::Progress;
pub use rootfs::{ensure_rootfs, RootfsImage};

/// How to build. `Default` reuses what exists, resolves everything from the
/// host, and is silent.
#[derive(Debug, Clone, Default)]
pub struct BuildOptions {
    /// Rebuild even if a current asset exists (for the kernel: re-resolve the
    /// metapackage, picking up a newer kernel).
    pub force: bool,
    /// Use this kernel .deb instead of downloading `linux-image-cloud-amd64`'s.
    pub kernel_deb: Option<PathBuf>,
    /// Debian mirror URL for debootstrap (default: `$FORKD_DEBIAN_MIRROR`, then
    /// the host's apt sources).
    pub mirror: Option<String>,
    /// Debian suite (default: `$FORKD_DEBIAN_SUITE`, then the host's codename,
    /// then bookworm).
    pub suite: Option<String>,
    pub progress: Progress,
}

/// Everything needed to boot a guest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuestAssets {
    pub kernel: KernelAsset,
    pub initramfs: Asset,
    pub rootfs: Asset,
}

/// Kernel, initramfs (with `agent_binary` as /init) and the rootfs `image`,
/// each reused when current. Cheap when everything is built: no apt queries,
/// no hashing beyond the agent binary.
pub fn ensure_all(
    home: &Home,
    image: RootfsImage,
    agent_binary: &Path,
    opts: &BuildOptions,
) -> Result<GuestAssets, ImageError> {
    let kernel = ensure_kernel(home, opts)?;
    let initramfs = ensure_initramfs(home, &kernel, agent_binary, opts)?;
    let rootfs = ensure_rootfs(home, image, opts)?;
    Ok(GuestAssets {
        kernel,
        initramfs,
        rootfs,
    })
}

/// What is built, from the manifests: `kernel/<release>`, `initramfs/<key>` and
/// `rootfs/<name>` with their assets, sorted by name. Assets whose file is gone
/// or has the wrong size are left out.
pub fn list_assets(home: &Home) -> Vec<(String, Asset)> {
    let mut all = kernel::list(home);
    all.extend(initramfs::list(home));
    all.extend(rootfs::list(home));
    all
}
