//! The manifest of a snapshot (`manifest.json`) and its seal (`seal.json`).
//!
//! The manifest says what the snapshot is: its parts with their sha256 digests, the
//! machine that was frozen and the versions of everything that made it. The digests are
//! checked when a snapshot is written or verified, never per fork: hashing hundreds of
//! MiB on every fork would cost more than the fork. What a fork checks instead is the
//! seal: the size, inode and modification time each part had when it was hashed. Any
//! write to a part (or to the manifest) changes its modification time, so a part changed
//! since its digest was taken is refused at the cost of one `stat`.

use forkd_hypervisor::Accel;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Version of the manifest format.
pub const FORMAT: u32 = 1;

/// Part names and the files they are stored in.
pub mod parts {
    /// Device state (CPU registers, devices), as QEMU's migration stream.
    pub const STATE: &str = "state.bin";
    /// The guest RAM image (sparse).
    pub const MEMORY: &str = "memory.ram";
    /// The frozen top layer of the root disk (qcow2 over [`ROOTFS`]).
    pub const DISK: &str = "disk.qcow2";
    /// The root filesystem image the disk layer is based on.
    pub const ROOTFS: &str = "rootfs.ext4";
    /// The guest kernel.
    pub const KERNEL: &str = "vmlinuz";
    /// The initramfs (with the agent as /init).
    pub const INITRAMFS: &str = "initramfs.cpio";
    /// Every part, in the order they are listed.
    pub const ALL: [&str; 6] = [STATE, MEMORY, DISK, ROOTFS, KERNEL, INITRAMFS];
    /// A chain link's own memory: the pages that differ from its parent's image (see
    /// `memory_diff`). The link's [`MEMORY`] is made from it and the parent's once.
    pub const MEMORY_DIFF: &str = "memory.diff";
}

/// `manifest.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The tag it was written under.
    pub tag: String,
    /// The template recipe it was built from.
    pub template: String,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// The tag of the snapshot this one is a diff on, if any (as it was when this one was
    /// written: informative, since tags are names users may change).
    #[serde(default)]
    pub parent: Option<String>,
    /// What names the parent: the sha256 of its `manifest.json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_digest: Option<String>,
    /// For a branch: the sandbox it was taken from, and how.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<BranchInfo>,
    /// The frozen machine: a child must be started with exactly this.
    pub machine: Machine,
    /// What made it.
    pub versions: Versions,
    /// The parts, by file name.
    pub parts: BTreeMap<String, Part>,
    /// Code contexts that were running (warm) when the snapshot was taken.
    #[serde(default)]
    pub contexts: Vec<forkd_proto::context::ContextInfo>,
    /// How long the build took.
    pub build: BuildTimes,
    /// The warm pool its recipe asked for (see the recipe's `pool`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pool: u32,
    /// What its children may reach when a fork does not say (its recipe's `[egress]`);
    /// none: nothing (egress `deny`, empty allow-list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<forkd_host::network::policy::EgressPolicy>,
    /// What its children's deadline and idleness do when a fork does not say (its
    /// recipe's `on_timeout` and `auto_pause_after`).
    #[serde(default, skip_serializing_if = "ChildLifecycle::is_default")]
    pub lifecycle: ChildLifecycle,
}

/// What a sandbox's deadline does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnTimeout {
    /// Stop it and remove its files.
    #[default]
    Kill,
    /// Pause it to disk (it stays until deleted, and resumes on its next request).
    Pause,
}

/// What a snapshot's children's deadline and idleness do, unless their fork says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChildLifecycle {
    /// What a child's deadline does.
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// Pause a child after this many seconds without a request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_pause_after_s: Option<u64>,
}

impl ChildLifecycle {
    fn is_default(&self) -> bool {
        *self == ChildLifecycle::default()
    }
}

impl Manifest {
    /// The parts this snapshot is made of: every snapshot's, and a link's memory diff.
    pub fn part_names(&self) -> Vec<&'static str> {
        let mut v = parts::ALL.to_vec();
        if self.parent.is_some() {
            v.push(parts::MEMORY_DIFF);
        }
        v
    }
}

/// How a branch was taken.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BranchInfo {
    /// The sandbox it was taken from.
    pub source: String,
    /// `pause` or `live`.
    pub mode: forkd_hypervisor::BranchMode,
    /// How long the source's vCPUs were stopped, ms.
    pub pause_ms: f64,
    /// Bytes the source's memory stream carried.
    pub transferred: u64,
    /// Pages of memory that differ from the parent's.
    pub pages_changed: u64,
}

fn with_pit() -> bool {
    true
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The frozen machine.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Machine {
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM, MiB.
    pub memory_mib: u32,
    /// The accelerator (a TCG snapshot restores only under TCG, and KVM only under KVM).
    pub accel: Accel,
    /// The CPU model QEMU was given.
    pub cpu: String,
    /// The kernel command line.
    pub cmdline: String,
    /// How the guest keeps time under TCG; a host-TSC snapshot restores only on a host
    /// whose TSC runs at the same rate (snapshots without it are icount guests).
    #[serde(default)]
    pub clock: forkd_hypervisor::GuestClock,
    /// The machine has the legacy PIT; a child's must match (snapshots without it had
    /// one).
    #[serde(default = "with_pit")]
    pub pit: bool,
    /// The guest has a NIC: each child gets a network namespace of its own.
    #[serde(default)]
    pub nic: bool,
}

/// Versions of what made the snapshot.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Versions {
    /// Guest kernel release (`6.1.0-57-cloud-amd64`).
    pub kernel: String,
    /// The rootfs image name (`python`).
    pub rootfs: String,
    /// sha256 of the initramfs, which carries the agent binary.
    pub initramfs_sha256: String,
    /// The forkd (and agent) version.
    pub forkd: String,
    /// The agent protocol version.
    pub agent_protocol: u32,
    /// The hypervisor backend that made it ([`forkd_hypervisor::Hypervisor::name`]).
    /// Manifests written before it was recorded were all QEMU's.
    #[serde(default = "first_backend")]
    pub hypervisor: String,
    /// That backend's version ([`forkd_hypervisor::Hypervisor::version`]); written
    /// `qemu` by forkd before 0.2, and read under either name.
    #[serde(alias = "qemu")]
    pub hypervisor_version: String,
}

/// The backend of manifests that do not name one.
fn first_backend() -> String {
    "qemu".to_owned()
}

/// One part.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Part {
    /// Size in bytes (apparent size: the memory image is sparse).
    pub size: u64,
    /// Hex sha256 of the contents.
    pub sha256: String,
}

/// Milliseconds spent in each step of the build.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct BuildTimes {
    /// Boot of the parent to its agent's first answer.
    pub boot_ms: u64,
    /// Warm-up commands and contexts.
    pub warmup_ms: u64,
    /// Pause and save of the device state.
    pub freeze_ms: u64,
    /// Hashing the parts (fsync and rename come after the manifest is written).
    pub publish_ms: u64,
    /// Everything up to and including the hashing.
    pub total_ms: u64,
}

/// `seal.json`: what each file looked like when its digest was taken.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Seal {
    /// By file name (the parts and `manifest.json`).
    pub files: BTreeMap<String, FileStamp>,
}

/// Size, inode and modification time of a file.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct FileStamp {
    /// Size in bytes.
    pub size: u64,
    /// Inode number.
    pub ino: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
}

impl FileStamp {
    /// Stamps the file at `path`.
    pub fn of(path: &Path) -> std::io::Result<FileStamp> {
        let m = std::fs::metadata(path)?;
        Ok(FileStamp {
            size: m.len(),
            ino: m.ino(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_written_before_the_backend_was_named_are_qemu_s() {
        let old = r#"{"kernel": "6.1.0-57-cloud-amd64", "rootfs": "python",
            "initramfs_sha256": "ab", "forkd": "0.1.0", "agent_protocol": 3,
            "qemu": "10.0.2"}"#;
        let v: Versions = serde_json::from_str(old).unwrap();
        assert_eq!(
            (v.hypervisor.as_str(), v.hypervisor_version.as_str()),
            ("qemu", "10.0.2")
        );
        // Written under the new names, and read back the same.
        let new = serde_json::to_value(&v).unwrap();
        assert_eq!(new["hypervisor"], "qemu");
        assert_eq!(new["hypervisor_version"], "10.0.2");
        assert_eq!(serde_json::from_value::<Versions>(new).unwrap(), v);
    }
}
