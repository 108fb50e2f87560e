//! What a VM is made of, independent of the backend that runs it.

use crate::Accel;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Where the guest's RAM lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryBackend {
    /// Anonymous memory owned by the hypervisor process.
    Anonymous,
    /// A file mapped as guest RAM. With `shared` the mapping is `MAP_SHARED` (a template:
    /// once paused, the file *is* the RAM image); without, `MAP_PRIVATE` (a child: pages
    /// are shared with the file copy-on-write).
    File {
        /// The RAM file (on tmpfs or a disk-backed filesystem).
        path: PathBuf,
        /// `MAP_SHARED` when true.
        shared: bool,
    },
}

/// Everything a backend needs to start one VM. Serializable, so that whoever adopts a
/// detached VM later knows exactly what it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmConfig {
    /// Sandbox id (used in process names and logs).
    pub id: String,
    /// Per-VM runtime directory: sockets and logs go here.
    pub dir: PathBuf,
    /// Guest kernel (bzImage).
    pub kernel: PathBuf,
    /// Initramfs (newc cpio).
    pub initramfs: PathBuf,
    /// Kernel command line.
    pub cmdline: String,
    /// The guest's root disk: a qcow2 overlay only this VM writes.
    pub root_disk: PathBuf,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Guest RAM in MiB.
    pub memory_mib: u32,
    /// Where the RAM lives.
    pub memory: MemoryBackend,
    /// KVM or TCG.
    pub accel: Accel,
    /// The guest CPU model: a QEMU model name, which QEMU must provide whole
    /// (`enforce`); `host` or `max` (or empty, in records made before it was kept) take
    /// what the accelerator offers.
    #[serde(default)]
    pub cpu: String,
    /// How a TCG guest keeps time (records made before it are icount guests).
    #[serde(default)]
    pub clock: crate::GuestClock,
    /// The machine has the legacy PIT (see [`crate::GuestClock::needs_pit`]). A frozen
    /// guest restores only into the machine it was frozen in, so this is recorded with
    /// it; records made before it have a PIT.
    #[serde(default = "with_pit")]
    pub pit: bool,
    /// The limits of the VM's process (its own cgroup), if it gets any. Records made
    /// before limits existed have none.
    #[serde(default)]
    pub limits: Option<forkd_host::cgroup::ResourceLimits>,
    /// The VM's NIC and the namespace it is in; none for a VM without a NIC (records
    /// made before networks existed have none).
    #[serde(default)]
    pub network: Option<forkd_host::network::NetworkConfig>,
    /// Enable the hypervisor's syscall filter (QEMU `-sandbox on,...`).
    pub seccomp: bool,
    /// The VM outlives the handle that started it: it runs in its own session and is not
    /// killed when the handle (or the process holding it) goes away. Forked children are
    /// detached so that they keep running after the CLI that forked them exits.
    pub detached: bool,
}

fn with_pit() -> bool {
    true
}

impl VmConfig {
    /// Unix socket of the guest agent's port.
    pub fn agent_socket(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }

    /// Unix socket of QEMU's QMP monitor.
    pub fn qmp_socket(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }

    /// Unix socket on which QEMU serves the guest's serial console.
    pub fn console_socket(&self) -> PathBuf {
        self.dir.join("console.sock")
    }

    /// The guest's serial console as the host copied it (capped; the older half is in
    /// `console.log.1`).
    pub fn console_log(&self) -> PathBuf {
        self.dir.join("console.log")
    }

    /// The hypervisor's own stderr.
    pub fn hypervisor_log(&self) -> PathBuf {
        self.dir.join("qemu.log")
    }
}
