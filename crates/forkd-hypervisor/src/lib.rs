//! The hypervisor layer of forkd: the traits a backend implements ([`Hypervisor`],
//! [`PreparedVm`], [`Vm`]) and the neutral types they speak in.
//!
//! Nothing above this crate knows how a VM is started: the sandbox layer hands over a
//! [`VmConfig`] and gets back a [`Vm`] it can pause, resume, query and stop. The QEMU
//! backend lives in its own crate, which only the `forkd` binary (and tests) depend on:
//! the compiler keeps every other crate from reaching into it. A Firecracker backend
//! can implement the same traits on hosts that have it.

pub mod accel;
pub mod clock;
pub mod config;
pub mod error;
#[cfg(feature = "fake")]
pub mod fake;
pub mod startup;

pub use accel::{Accel, AccelChoice};
pub use clock::GuestClock;
pub use config::{MemoryBackend, VmConfig};
pub use error::HypervisorError;

use async_trait::async_trait;
use std::path::Path;
use std::time::Duration;

/// The error of a layer operation a backend does not provide.
fn unsupported(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        format!("this hypervisor backend cannot {what}"),
    )
}

/// What a disk layer's base is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskFormat {
    /// A raw image (an ext4 root filesystem).
    Raw,
    /// A layer the backend made with [`Hypervisor::create_disk_layer`] (qcow2 for QEMU).
    Layer,
}

/// A writable copy-on-write disk layer over a read-only base: the VM writes only to the
/// layer, so the base (a rootfs image, a snapshot's frozen disk) is never modified.
#[derive(Debug, Clone, Copy)]
pub struct DiskLayer<'a> {
    /// The layer to create.
    pub path: &'a Path,
    /// Its base.
    pub base: &'a Path,
    /// The base's format.
    pub base_format: DiskFormat,
    /// Name the base relative to the layer's directory (it must then be a plain file
    /// name in that directory): the two can be moved together, as a snapshot directory
    /// is when it is published.
    pub relative: bool,
    /// Name the base by this path instead (absolute): where a file with the base's
    /// contents will be. A branch names the layer a running VM moves onto after the
    /// branch's disk, which is published under its final path only later.
    pub named: Option<&'a Path>,
}

/// How a branch captures a running VM (see [`Vm::branch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BranchMode {
    /// Stop the vCPUs, copy everything, start them again: the pause lasts the whole copy.
    Pause,
    /// Copy memory while the VM runs, pages it writes meanwhile again, and stop it only
    /// for the last of them and the device state.
    Live,
}

impl std::fmt::Display for BranchMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BranchMode::Pause => "pause",
            BranchMode::Live => "live",
        })
    }
}

/// Where a branch puts what it captures.
#[derive(Debug, Clone)]
pub struct BranchPlan {
    /// The machine that receives the running VM: the source's own description with its
    /// own id, runtime directory and throwaway disk, and as memory a new shared RAM file,
    /// which becomes the branch's memory image.
    pub receiver: VmConfig,
    /// Where the device state (RAM left out) is written.
    pub state: std::path::PathBuf,
    /// A new, empty disk layer over the source's current top layer: at the branch
    /// instant the source goes on writing there, and the layer below is frozen as the
    /// branch's disk. Removed by the backend if the switch did not happen.
    ///
    /// None for a pause to disk: the source's disk is not switched (its top layer is
    /// frozen as it is) and, once the capture succeeded, the source stays stopped for
    /// its caller to end. If the capture fails, the source runs again.
    pub next_layer: Option<std::path::PathBuf>,
    /// Called at the branch instant, the source's vCPUs stopped (the crash tests abort
    /// there).
    pub at_instant: Option<fn()>,
}

/// What a branch did and cost.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BranchStats {
    /// The disk layer that was the VM's top at the branch instant, frozen since: the
    /// branch's disk.
    pub frozen_layer: std::path::PathBuf,
    /// How long the source's vCPUs were stopped.
    pub pause: Duration,
    /// From the start of the copy to the source running again.
    pub copy: Duration,
    /// Bytes of the stream (memory pages and device state).
    pub transferred: u64,
}

/// What a VM is doing, as the hypervisor sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmStatus {
    /// vCPUs are running.
    Running,
    /// Stopped by [`Vm::pause`] (or waiting for an incoming migration).
    Paused,
    /// The hypervisor process has exited.
    Exited,
    /// The guest kernel reported a panic (pvpanic) and the VM stopped.
    GuestPanicked,
    /// The guest shut down and the hypervisor kept the process.
    Shutdown,
    /// The hypervisor hit an internal error (an emulation failure, say).
    InternalError,
    /// Any other state the hypervisor reports (shutdown, internal error...).
    Other,
}

/// A hypervisor that can start VMs.
#[async_trait]
pub trait Hypervisor: Send + Sync {
    /// Short name of the backend (`qemu`).
    fn name(&self) -> &'static str;

    /// The backend's version (recorded in snapshot manifests), or why it is unknown.
    fn version(&self) -> Result<String, HypervisorError>;

    /// Creates a disk layer as `layer` describes.
    async fn create_disk_layer(&self, layer: DiskLayer<'_>) -> Result<(), HypervisorError>;

    /// The base a disk layer made by [`Hypervisor::create_disk_layer`] names, resolved
    /// against the layer's directory.
    fn layer_base(&self, layer: &Path) -> Result<Option<std::path::PathBuf>, HypervisorError> {
        let _ = layer;
        Ok(None)
    }

    /// The base a disk layer names, as it is written in the layer: absolute, or relative
    /// to the layer's directory. None when the layer has no base.
    fn layer_base_name(&self, layer: &Path) -> std::io::Result<Option<String>> {
        let _ = layer;
        Err(unsupported("read a disk layer's base"))
    }

    /// Makes a disk layer name `name` as its base, its data left as it is: the new base
    /// must hold what the old one held. An unpacked chain link's layer named its
    /// parent's disk where that lay on the host it came from.
    fn set_layer_base_name(&self, layer: &Path, name: &str) -> std::io::Result<()> {
        let _ = (layer, name);
        Err(unsupported("rename a disk layer's base"))
    }

    /// Checks that a disk layer from elsewhere (an unpacked snapshot's) keeps its data in
    /// itself: it names no file of this host other than its base, and uses nothing of
    /// its format this backend does not know.
    fn check_foreign_layer(&self, layer: &Path) -> std::io::Result<()> {
        let _ = layer;
        Err(unsupported("check a disk layer from elsewhere"))
    }

    /// Writes `out`, a raw image (sparse where the disk reads zeros) with the contents
    /// of the layered disk `top`: a build VM's disk turned into a root filesystem image.
    async fn layer_to_raw(&self, top: &Path, out: &Path) -> Result<(), HypervisorError> {
        let _ = (top, out);
        Err(HypervisorError::Config(
            "this hypervisor backend cannot turn a disk layer into an image".into(),
        ))
    }

    /// Why device state saved by version `made` of this backend (as [`Hypervisor::version`]
    /// said then) cannot be restored by this one, if it cannot. A version either side
    /// cannot read is left for the restore itself to judge.
    fn restore_refusal(&self, made: &str) -> Option<String> {
        let _ = made;
        None
    }

    /// The size of the disk a layer made by [`Hypervisor::create_disk_layer`] gives its
    /// guest (the guest can write no more than that), if the backend knows it.
    fn disk_size(&self, layer: &Path) -> Option<u64> {
        let _ = layer;
        None
    }

    /// Writes at `out` one layer with the contents of the layered disk `top` over the raw
    /// image `base`, which it names (relative to `out`'s directory): the chain under
    /// `top` down to `base` is no longer needed.
    async fn flatten_disk(
        &self,
        top: &Path,
        base: &Path,
        out: &Path,
    ) -> Result<(), HypervisorError> {
        let _ = (top, base, out);
        Err(HypervisorError::Config(
            "this hypervisor backend cannot flatten a disk".into(),
        ))
    }

    /// Starts a VM as `config` describes and returns once its control channel answers.
    /// The guest is booting when this returns; waiting for its agent is the caller's job.
    async fn boot(&self, config: &VmConfig) -> Result<Box<dyn Vm>, HypervisorError>;

    /// Starts a VM from device state saved by [`Vm::save_state`] and returns once its
    /// vCPUs run. `config` must describe the same machine as the saved one; its memory is
    /// the saved VM's RAM file, mapped privately so that the VM's writes stay its own.
    async fn restore(
        &self,
        config: &VmConfig,
        state: &Path,
    ) -> Result<Box<dyn Vm>, HypervisorError> {
        self.prepare_restore(config, state).await?.finish().await
    }

    /// The first half of [`Hypervisor::restore`]: starts the hypervisor process for
    /// `config`, with `state` open and its control channel answering, and stops there.
    /// [`PreparedVm::finish`] reads the state and starts the vCPUs.
    async fn prepare_restore(
        &self,
        config: &VmConfig,
        state: &Path,
    ) -> Result<Box<dyn PreparedVm>, HypervisorError>;

    /// Takes over a running VM that another process started, known by the pid and start
    /// time of its hypervisor process. Fails with [`HypervisorError::NotRunning`] when
    /// that process is gone.
    async fn adopt(
        &self,
        config: &VmConfig,
        pid: u32,
        start_time: u64,
    ) -> Result<Box<dyn Vm>, HypervisorError>;
}

/// A VM whose hypervisor process runs but whose restore has not happened yet: its
/// vCPUs have never run (see [`Hypervisor::prepare_restore`]).
#[async_trait]
pub trait PreparedVm: Send + Sync {
    /// The hypervisor process's pid, while it runs.
    fn pid(&self) -> Option<u32>;

    /// Start time of the hypervisor process (see [`Vm::start_time`]).
    fn start_time(&self) -> Option<u64>;

    /// True once the hypervisor process has exited.
    fn exited(&self) -> bool;

    /// Reads the device state and starts the vCPUs. On failure the process is gone.
    async fn finish(self: Box<Self>) -> Result<Box<dyn Vm>, HypervisorError>;

    /// Write access to the guest's RAM before its vCPUs first run: a resumed pause
    /// image's pages that differ from the RAM file the VM maps privately. Only the
    /// pages written become the VM's own; the rest stay shared with the file.
    fn ram_writer(&self) -> Result<Box<dyn RamWriter>, HypervisorError> {
        Err(HypervisorError::Config(
            "this hypervisor backend cannot write into a restored VM's RAM".into(),
        ))
    }

    /// Kills the hypervisor process and waits for it to exit.
    async fn discard(self: Box<Self>);
}

/// Writes into a prepared VM's guest RAM (see [`PreparedVm::ram_writer`]).
pub trait RamWriter: Send {
    /// Writes `data` at byte `offset` of the guest's RAM (the offset in its RAM file).
    fn write_at(&mut self, offset: u64, data: &[u8]) -> std::io::Result<()>;
}

/// One running VM.
#[async_trait]
pub trait Vm: Send + Sync {
    /// The hypervisor process's pid, while it runs.
    fn pid(&self) -> Option<u32>;

    /// Start time of the hypervisor process (clock ticks since boot): with the pid, it
    /// names the process uniquely.
    fn start_time(&self) -> Option<u64>;

    /// Pauses the VM and writes its device state to `out`, fsynced. RAM held in a shared
    /// file backend is left out: the file itself is the RAM image. The VM stays paused.
    async fn save_state(&self, out: &Path) -> Result<(), HypervisorError>;

    /// Captures the running VM at one instant, as `plan` says: memory into the
    /// receiver's RAM file, device state into `plan.state`, and its disk by moving the VM
    /// onto `plan.next_layer`. The VM runs again when this returns, whatever happened,
    /// except after a successful capture without a next layer (a pause to disk).
    async fn branch(
        &self,
        mode: BranchMode,
        plan: &BranchPlan,
    ) -> Result<BranchStats, HypervisorError> {
        let _ = (mode, plan);
        Err(HypervisorError::Config(
            "this hypervisor backend cannot branch a running VM".into(),
        ))
    }

    /// Whether a branch in `mode` captures this VM faithfully; if not, why. A backend
    /// whose live copy can miss guest writes says so here, and [`Vm::branch`] refuses it.
    fn can_branch(&self, mode: BranchMode) -> Result<(), String> {
        let _ = mode;
        Ok(())
    }

    /// After a branch that was interrupted (its caller died): cancels a migration still
    /// under way and starts the vCPUs if they are stopped. Returns the file of the
    /// disk's top layer, if the backend knows it.
    async fn abandon_branch(&self) -> Result<Option<std::path::PathBuf>, HypervisorError> {
        Ok(None)
    }

    /// Stops the vCPUs.
    async fn pause(&self) -> Result<(), HypervisorError>;

    /// Starts the vCPUs again.
    async fn resume(&self) -> Result<(), HypervisorError>;

    /// Asks the hypervisor what the VM is doing.
    async fn status(&self) -> Result<VmStatus, HypervisorError>;

    /// True once the hypervisor process has exited.
    fn exited(&self) -> bool;

    /// Resolves when the hypervisor process has exited, with a description of how.
    async fn wait_exit(&self) -> String;

    /// Ends the VM: asks the hypervisor to quit, waits up to `grace`, then kills it.
    /// Idempotent.
    async fn stop(&self, grace: Duration) -> Result<(), HypervisorError>;

    /// Kills the hypervisor process at once and reaps it. Idempotent; usable from `Drop`.
    fn kill(&self);

    /// The last lines the guest printed on its serial console (for error messages).
    fn console_tail(&self, lines: usize) -> String;

    /// How long each step of this VM's start took, for a VM this process started.
    fn startup_steps(&self) -> Vec<startup::Step> {
        Vec::new()
    }

    /// The cgroup version and what the VM's own cgroup counts now, if it runs in one.
    fn cgroup(
        &self,
    ) -> Option<(
        forkd_host::cgroup::CgroupVersion,
        forkd_host::cgroup::CgroupUsage,
    )> {
        None
    }

    /// Replaces the egress policy of the VM's network; `off` also takes its link down
    /// (and another mode brings it up again).
    async fn set_egress(
        &self,
        _policy: &forkd_host::network::policy::EgressPolicy,
    ) -> Result<(), HypervisorError> {
        Err(HypervisorError::Network(
            "this backend gives its VMs no network".into(),
        ))
    }
}
