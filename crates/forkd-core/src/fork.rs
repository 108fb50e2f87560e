//! Fork: restore children from a snapshot. Each child is its own QEMU process, started
//! with `-incoming defer`, mapping the snapshot's memory image privately (copy-on-write:
//! every child shares the pages it has not written), with its own qcow2 layer over the
//! frozen disk and its own agent socket. The snapshot is checked once per fork call
//! (its seal: one `stat` per part), never re-hashed.

use crate::error::SandboxError;
use crate::sandbox::{new_sandbox_dir, Launch, Sandbox, SandboxOptions};
use crate::snapshot::manifest::parts;
use crate::snapshot::Snapshot;
use forkd_hypervisor::qemu::disk;
use forkd_hypervisor::{accel, Accel, AccelChoice, MemoryBackend, VmConfig};
use forkd_image::Home;
use std::time::Duration;

/// Most children one fork call makes.
pub const MAX_CHILDREN: usize = 256;

/// How to fork.
#[derive(Debug, Clone)]
pub struct ForkOptions {
    /// How many children.
    pub count: usize,
    /// Children outlive the process that forked them (the CLI's children do; a test's
    /// or a library user's are stopped when their handles drop).
    pub detached: bool,
    /// QEMU's seccomp filter.
    pub seccomp: bool,
    /// How long a child may take from its QEMU's start to its agent's first answer.
    pub ready_timeout: Duration,
    /// See [`SandboxOptions::agent_timeout`].
    pub agent_timeout: Duration,
}

impl Default for ForkOptions {
    fn default() -> Self {
        ForkOptions {
            count: 1,
            detached: false,
            seccomp: true,
            ready_timeout: Duration::from_secs(60),
            agent_timeout: Duration::from_secs(30),
        }
    }
}

/// Restores `opts.count` children of `snap` in parallel. All or nothing: if one fails,
/// the others are stopped and the first error is returned.
pub async fn fork(
    home: &Home,
    snap: &Snapshot,
    opts: &ForkOptions,
) -> Result<Vec<Sandbox>, SandboxError> {
    if opts.count == 0 || opts.count > MAX_CHILDREN {
        return Err(SandboxError::Template {
            name: snap.tag.to_string(),
            detail: format!(
                "cannot fork {} children: the count must be 1 to {MAX_CHILDREN}",
                opts.count
            ),
        });
    }
    if snap.manifest.machine.accel == Accel::Kvm {
        // A KVM snapshot cannot run under TCG (and the other way round).
        accel::resolve(AccelChoice::Kvm)?;
    }
    let results =
        futures::future::join_all((0..opts.count).map(|_| fork_one(home, snap, opts))).await;
    let mut children = Vec::with_capacity(results.len());
    let mut first_err = None;
    for r in results {
        match r {
            Ok(c) => children.push(c),
            Err(e) if first_err.is_none() => first_err = Some(e),
            Err(_) => {}
        }
    }
    match first_err {
        None => Ok(children),
        Some(e) => {
            for c in children {
                let _ = c.destroy().await;
            }
            Err(e)
        }
    }
}

async fn fork_one(
    home: &Home,
    snap: &Snapshot,
    opts: &ForkOptions,
) -> Result<Sandbox, SandboxError> {
    let m = &snap.manifest.machine;
    let (id, dir, guard) = new_sandbox_dir(home)?;
    let overlay = dir.join("root.qcow2");
    disk::create_overlay(&snap.part(parts::DISK), "qcow2", &overlay).await?;
    let config = VmConfig {
        id,
        dir,
        kernel: snap.part(parts::KERNEL),
        initramfs: snap.part(parts::INITRAMFS),
        cmdline: m.cmdline.clone(),
        root_disk: overlay,
        vcpus: m.vcpus,
        memory_mib: m.memory_mib,
        memory: MemoryBackend::File {
            path: snap.part(parts::MEMORY),
            shared: false,
        },
        accel: m.accel,
        seccomp: opts.seccomp,
        detached: opts.detached,
    };
    let sopts = SandboxOptions {
        vcpus: m.vcpus,
        memory_mib: m.memory_mib,
        accel: AccelChoice::Auto,
        boot_timeout: opts.ready_timeout,
        agent_timeout: opts.agent_timeout,
        seccomp: opts.seccomp,
    };
    Sandbox::launch(
        config,
        Launch::Restore {
            state: snap.part(parts::STATE),
            tag: snap.tag.to_string(),
        },
        &sopts,
        guard,
    )
    .await
}
