//! What a QEMU may do once it runs the guest: as root, as little as it needs.
//!
//! QEMU opens everything a VM needs (its disks, RAM file, sockets, `/dev/kvm`) while it
//! starts. Then, with `-run-with user=UID:GID,chroot=DIR`, it chroots into an empty
//! directory and drops to a user of its own: a guest that escapes into QEMU finds no
//! file to read, no capability, and no other VM's process to signal or trace, since each
//! VM's QEMU has a user id of its own. The few files QEMU is given later (a branch's next
//! disk layer, device-state streams) are opened by forkd and passed as descriptors.
//!
//! A child maps its snapshot's RAM file copy-on-write: with `readonly=on,rom=off` QEMU
//! opens that file read-only and maps it privately writable, so no child's QEMU can
//! change the template's memory, whatever runs in it.

use super::version::QemuVersion;
use forkd_host::enforcement::Enforcement;
use forkd_hypervisor::{HypervisorError, MemoryBackend, VmConfig};
use std::path::PathBuf;

/// The first QEMU with `-run-with user=` (9.0 had `chroot=` only, and `-runas`).
const RUN_WITH_USER: QemuVersion = QemuVersion(9, 1, 0);

/// The first QEMU whose file memory backend takes `readonly=on` with `rom=off`: a
/// read-only file mapped as writable, private RAM.
const READONLY_PRIVATE_RAM: QemuVersion = QemuVersion(8, 2, 0);

/// The first of the user ids forkd's QEMUs run as, far above any account or
/// user-namespace range a host hands out.
pub const FIRST_UID: u32 = 3_000_000_000;

/// How many user ids VMs are spread over.
const UIDS: u32 = 1 << 24;

/// Whether QEMUs are jailed (see [`Enforcement`]): `auto` jails them when forkd runs
/// as root and QEMU can.
pub const ENV: &str = "FORKD_JAIL";

/// Where one QEMU is confined once it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Jail {
    /// Its user and group id.
    pub uid: u32,
    /// An empty directory, its root once it runs.
    pub root: PathBuf,
}

/// What a QEMU is started with beyond its [`VmConfig`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hardening {
    /// The jail, if the QEMU is jailed.
    pub jail: Option<Jail>,
    /// Open a child's RAM file read-only.
    pub readonly_ram: bool,
}

/// Why QEMUs started by this process cannot be jailed with QEMU `version`, if they
/// cannot.
pub fn unjailable(version: QemuVersion) -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some(
            "forkd does not run as root, so its QEMUs run as its own user (they cannot \
             change user)"
                .into(),
        );
    }
    (version < RUN_WITH_USER)
        .then(|| format!("QEMU {version} has no -run-with user= (it came in {RUN_WITH_USER})"))
}

/// The hardening of the VM `config` describes, under this process's [`ENV`],
/// started by QEMU `version`. Makes the jail's empty root directory.
///
/// Every VM is jailed alike. One bound to the process that starts it (a template's
/// parent, a build VM, `forkd run`, a branch's receiver) is also tied to that process by
/// a [`Lifeline`](forkd_host::lifeline::Lifeline): the kernel clears the parent-death signal
/// when QEMU changes user.
pub fn hardening(config: &VmConfig, version: QemuVersion) -> Result<Hardening, HypervisorError> {
    let readonly_ram = matches!(config.memory, MemoryBackend::File { shared: false, .. })
        && version >= READONLY_PRIVATE_RAM;
    let policy = Enforcement::from_env(ENV).map_err(HypervisorError::Config)?;
    // A bound VM is jailed only where a lifeline can hold it.
    let why_not = |version| {
        unjailable(version).or_else(|| {
            (!config.detached)
                .then(forkd_host::lifeline::unavailable)
                .flatten()
                .map(|why| {
                    format!("a VM bound to the process that starts it needs a lifeline: {why}")
                })
        })
    };
    let jail = match (policy, why_not(version)) {
        (Enforcement::Off, _) | (Enforcement::Auto, Some(_)) => None,
        (Enforcement::Required, Some(why)) => {
            return Err(HypervisorError::Config(format!(
                "FORKD_JAIL=required, but QEMU cannot be jailed here: {why}"
            )))
        }
        (_, None) => Some(make_jail(config)?),
    };
    Ok(Hardening { jail, readonly_ram })
}

/// The user id of VM `id`'s QEMU: one of [`UIDS`] ids from [`FIRST_UID`], by a hash of
/// the id, so that VMs running side by side almost never share one.
pub fn uid_of(id: &str) -> u32 {
    // FNV-1a: stable across builds and platforms, unlike std's hasher.
    let hash = id.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    FIRST_UID + hash % UIDS
}

fn make_jail(config: &VmConfig) -> Result<Jail, HypervisorError> {
    use std::os::unix::fs::DirBuilderExt;
    let root = config.dir.join("jail");
    match std::fs::DirBuilder::new().mode(0o555).create(&root) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(HypervisorError::io(
                format!("making the jail {}", root.display()),
                e,
            ))
        }
    }
    Ok(Jail {
        uid: uid_of(&config.id),
        root,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_vm_gets_a_user_id_of_its_own_in_forkds_range() {
        let ids: Vec<u32> = (0..1000).map(|i| uid_of(&format!("sb-{i:012x}"))).collect();
        assert!(ids
            .iter()
            .all(|u| (FIRST_UID..FIRST_UID + UIDS).contains(u)));
        let mut distinct = ids.clone();
        distinct.sort_unstable();
        distinct.dedup();
        // 1000 ids over 16M user ids: a collision or two at most.
        assert!(distinct.len() >= 998, "{}", distinct.len());
        assert_eq!(uid_of("sb-1"), uid_of("sb-1"));
    }

    #[test]
    fn old_qemus_are_not_jailed_and_say_why() {
        if nix::unistd::geteuid().is_root() {
            let why = unjailable(QemuVersion(7, 2, 0)).unwrap();
            assert!(why.contains("9.1.0"), "{why}");
            assert_eq!(unjailable(QemuVersion(10, 0, 2)), None);
        } else {
            assert!(unjailable(QemuVersion(10, 0, 2)).is_some());
        }
    }
}
