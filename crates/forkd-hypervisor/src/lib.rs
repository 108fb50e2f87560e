//! The hypervisor layer of forkd: a small trait ([`Hypervisor`], [`Vm`]) and the QEMU
//! backend behind it ([`qemu::Qemu`]).
//!
//! Nothing above this crate knows how a VM is started: the sandbox layer hands over a
//! [`VmConfig`] and gets back a [`Vm`] it can pause, resume, query and stop. A
//! Firecracker backend can implement the same trait on hosts that have it.

pub mod accel;
pub mod config;
pub mod error;
pub mod process;
pub mod qemu;

pub use accel::{Accel, AccelChoice};
pub use config::{MemoryBackend, VmConfig};
pub use error::HypervisorError;

use async_trait::async_trait;
use std::time::Duration;

/// What a VM is doing, as the hypervisor sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmStatus {
    /// vCPUs are running.
    Running,
    /// Stopped by [`Vm::pause`] (or waiting for an incoming migration).
    Paused,
    /// The hypervisor process has exited.
    Exited,
    /// Any other state the hypervisor reports (shutdown, internal error...).
    Other,
}

/// A hypervisor that can start VMs.
#[async_trait]
pub trait Hypervisor: Send + Sync {
    /// Short name of the backend (`qemu`).
    fn name(&self) -> &'static str;

    /// Starts a VM as `config` describes and returns once its control channel answers.
    /// The guest is booting when this returns; waiting for its agent is the caller's job.
    async fn boot(&self, config: &VmConfig) -> Result<Box<dyn Vm>, HypervisorError>;
}

/// One running VM.
#[async_trait]
pub trait Vm: Send + Sync {
    /// The hypervisor process's pid, while it runs.
    fn pid(&self) -> Option<u32>;

    /// Stops the vCPUs.
    async fn pause(&self) -> Result<(), HypervisorError>;

    /// Starts the vCPUs again.
    async fn resume(&self) -> Result<(), HypervisorError>;

    /// Asks the hypervisor what the VM is doing.
    async fn status(&self) -> Result<VmStatus, HypervisorError>;

    /// Resolves when the hypervisor process has exited, with a description of how.
    async fn wait_exit(&self) -> String;

    /// Ends the VM: asks the hypervisor to quit, waits up to `grace`, then kills it.
    /// Idempotent.
    async fn stop(&self, grace: Duration) -> Result<(), HypervisorError>;

    /// Kills the hypervisor process at once and reaps it. Idempotent; usable from `Drop`.
    fn kill(&self);

    /// The last lines the guest printed on its serial console (for error messages).
    fn console_tail(&self, lines: usize) -> String;
}
