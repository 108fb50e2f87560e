//! A paused sandbox brought from another host: it arrives as a chain link (the
//! snapshot its old host branched from its pause image and pushed to a registry), and
//! is made a paused sandbox of this host under its own id, so that the ordinary
//! [`crate::resume`] continues the same machine here.
//!
//! Its pause image is the link itself: its RAM file is the link's memory image (so its
//! memory diff has no pages), its device state the link's, and its disk a new layer
//! over the link's disk. Nothing is copied: the state is a hard link and the disk layer
//! starts empty. The network identity is the same on every host (each sandbox has the
//! guest address in a namespace of its own), so the guest finds its NIC as it was.

use crate::error::SandboxError;
use crate::pause::{self, PauseKeeps, PauseRecord};
use forkd_host::cgroup::ResourceLimits;
use forkd_host::network::NetworkConfig;
use forkd_hypervisor::{BranchMode, Hypervisor, VmConfig};
use forkd_image::Home;
use forkd_storage::snapshot::manifest::parts;
use forkd_storage::snapshot::{memory_diff, Snapshot};

/// What the sandbox was on its old host, beyond its machine (which is the link's).
#[derive(Debug, Clone)]
pub struct Arrival {
    /// Its id, kept.
    pub id: String,
    /// The limits of its VM.
    pub limits: Option<ResourceLimits>,
    /// Its NIC's policy.
    pub network: Option<NetworkConfig>,
    /// Its QEMU ran with the syscall filter.
    pub seccomp: bool,
    /// What was left of its timeout when it was paused.
    pub timeout_left_s: Option<u64>,
}

/// Makes `arrival` a paused sandbox of this host, from the link `snap`: its directory,
/// disk layer and pause image. Returns its VM's configuration (the one its resume
/// restores). Refused if a sandbox of that id has a directory here; a failure leaves
/// nothing behind.
pub async fn install(
    hv: &dyn Hypervisor,
    home: &Home,
    snap: &Snapshot,
    arrival: &Arrival,
) -> Result<VmConfig, SandboxError> {
    if !forkd_host::ids::is_sandbox_id(&arrival.id) {
        return Err(SandboxError::Io {
            context: "installing a sandbox brought from another host".into(),
            source: std::io::Error::other(format!("{:?} is not a sandbox id", arrival.id)),
        });
    }
    let (dir, mut guard) = crate::sandbox::sandbox_dir_for(home, &arrival.id)?;
    let mut config = crate::fork::child_config(snap, arrival.id.clone(), dir.clone());
    config.limits = arrival.limits;
    config.network = arrival
        .network
        .clone()
        .filter(|_| snap.manifest.machine.nic);
    config.seccomp = arrival.seccomp;
    config.detached = true;
    crate::fork::create_layer(hv, snap, &config).await?;
    let memory = snap.part(parts::MEMORY);
    let state = snap.part(parts::STATE);
    let io = |context: String| move |source| SandboxError::Io { context, source };
    let memory_size = std::fs::metadata(&memory)
        .map_err(io(format!("reading {}", memory.display())))?
        .len();
    let (state_sha256, state_bytes) = forkd_storage::snapshot::sha256_file(&state)?;
    let empty = memory_diff::empty(memory_size);
    let record = PauseRecord {
        format: pause::FORMAT,
        paused_at: forkd_image::timestamp::rfc3339_utc(std::time::SystemTime::now()),
        memory_base: memory,
        memory_size,
        memory_sha256: hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&empty)),
        state_sha256,
        disk_top: config.root_disk.clone(),
        mode: BranchMode::Pause,
        stall_ms: 0.0,
        transferred: 0,
        pages: 0,
        diff_bytes: empty.len() as u64,
        state_bytes,
        timeout_left_s: arrival.timeout_left_s,
        keeps: PauseKeeps::Memory,
    };
    pause::publish_image(&dir, &record, |partial| {
        std::fs::write(partial.join(pause::MEMORY_DIFF), &empty)?;
        std::fs::hard_link(&state, partial.join(pause::STATE))
    })
    .map_err(io(format!("writing {}", pause::image_dir(&dir).display())))?;
    // The sandbox owns its directory now; its claim is taken again by its resume.
    drop(guard.disarm());
    Ok(config)
}
