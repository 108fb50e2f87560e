//! A cgroup of its own for each VM's QEMU, with memory, CPU and pids limits.
//!
//! QEMU joins its cgroup between fork and exec (it writes `0` to the cgroup's
//! `cgroup.procs`), so every page and thread it ever has is counted and bounded from its
//! first instruction. The cgroup is removed when QEMU exits.
//!
//! Hosts differ: cgroup v2 has one tree with every controller, cgroup v1 one hierarchy
//! per controller (or per group of them). [`Cgroups`] finds where forkd may make
//! cgroups on this host and hides which version it is; [`v1`] and [`v2`] write the
//! files each version names. forkd's cgroups nest under the cgroup the process that
//! starts QEMU runs in (a service manager's limits on forkd keep holding its VMs), in a
//! `forkd` directory: `<own cgroup>/forkd/<vm id>`.

mod v1;
mod v2;

use crate::enforcement::Enforcement;
use crate::mountinfo::Mount;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The period CPU quotas are counted over.
pub const CPU_PERIOD_US: u64 = 100_000;

/// What QEMU needs besides the guest's RAM: its own heap, device buffers and, under TCG,
/// the translated code. A child's memory limit is its guest RAM plus this.
pub const MEMORY_OVERHEAD: u64 = 512 << 20;

/// The smallest memory limit a VM may be given: QEMU's own needs, with room to spare.
pub const MIN_MEMORY: u64 = 128 << 20;

/// Threads a QEMU may have: its vCPUs, its main loop, RCU and the block layer's worker
/// pool (up to 64 threads) leave room to spare at this.
pub const DEFAULT_PIDS: u32 = 256;

/// The limits of one VM's QEMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceLimits {
    /// Memory QEMU may use, guest RAM included, in bytes. The kernel reclaims the VM's
    /// page cache first and kills QEMU (not the host's other processes) past it.
    pub memory_bytes: u64,
    /// CPU time per [`CPU_PERIOD_US`], in thousandths of a core (1000: one core); 0
    /// sets no quota.
    pub cpu_millicores: u32,
    /// Share of CPU under contention, 1..=10000 on cgroup v2's scale (100: the same as
    /// any other process).
    pub cpu_weight: u32,
    /// Processes and threads.
    pub pids: u32,
}

impl ResourceLimits {
    /// The defaults for a VM of `vcpus` vCPUs and `memory_mib` MiB of RAM: its RAM plus
    /// [`MEMORY_OVERHEAD`], one core per vCPU, the default weight, [`DEFAULT_PIDS`].
    pub fn for_vm(vcpus: u32, memory_mib: u32) -> ResourceLimits {
        ResourceLimits {
            memory_bytes: (u64::from(memory_mib) << 20) + MEMORY_OVERHEAD,
            cpu_millicores: vcpus.saturating_mul(1000),
            cpu_weight: 100,
            pids: DEFAULT_PIDS,
        }
    }

    /// Refuses values no cgroup takes (a weight outside 1..=10000, no pids at all, less
    /// memory than the guest's RAM) and CPU quotas below a hundredth of a core, which
    /// would leave the guest unable to answer.
    pub fn check(&self, guest_memory_mib: u32) -> Result<(), String> {
        if !(1..=10_000).contains(&self.cpu_weight) {
            return Err(format!(
                "cpu weight {} is outside 1..=10000",
                self.cpu_weight
            ));
        }
        if self.cpu_millicores != 0 && self.cpu_millicores < 10 {
            return Err(format!(
                "a cpu quota of {} thousandths of a core is too small (at least 0.01 cores)",
                self.cpu_millicores
            ));
        }
        if self.pids < 16 {
            return Err(format!(
                "a pids limit of {} is too small for QEMU's threads (at least 16)",
                self.pids
            ));
        }
        // Below the guest's RAM is allowed (a child rarely touches all of it), not below
        // what QEMU needs to run at all.
        if self.memory_bytes < MIN_MEMORY {
            return Err(format!(
                "a memory limit of {} MiB is too small for QEMU (at least {} MiB; the guest has {guest_memory_mib} MiB of RAM)",
                self.memory_bytes >> 20,
                MIN_MEMORY >> 20
            ));
        }
        Ok(())
    }
}

/// What a user may choose of a VM's limits; anything left unset takes the default for
/// the VM's shape ([`ResourceLimits::for_vm`]). Its memory limit always follows its RAM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitOverrides {
    /// Memory, guest RAM included: less than the guest's RAM is allowed, and then the
    /// kernel stops the VM if the guest touches more than fits.
    pub memory_bytes: Option<u64>,
    /// CPU quota in thousandths of a core; 0 for none.
    pub cpu_millicores: Option<u32>,
    /// CPU weight, 1..=10000.
    pub cpu_weight: Option<u32>,
    /// Processes and threads.
    pub pids: Option<u32>,
}

impl LimitOverrides {
    /// True when nothing is chosen.
    pub fn is_default(&self) -> bool {
        *self == LimitOverrides::default()
    }

    /// The limits of a VM of `vcpus` vCPUs and `memory_mib` MiB with these choices.
    pub fn resolve(&self, vcpus: u32, memory_mib: u32) -> ResourceLimits {
        let base = ResourceLimits::for_vm(vcpus, memory_mib);
        ResourceLimits {
            memory_bytes: self.memory_bytes.unwrap_or(base.memory_bytes),
            cpu_millicores: self.cpu_millicores.unwrap_or(base.cpu_millicores),
            cpu_weight: self.cpu_weight.unwrap_or(base.cpu_weight),
            pids: self.pids.unwrap_or(base.pids),
        }
    }
}

/// Which cgroup version a host's controllers live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupVersion {
    /// One hierarchy per controller.
    V1,
    /// One unified tree.
    V2,
}

impl CgroupVersion {
    /// `v1` or `v2`.
    pub fn as_str(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        }
    }
}

/// What one VM's cgroup counts now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CgroupUsage {
    /// Memory charged to it, page cache included.
    pub memory_bytes: u64,
    /// Processes and threads in it.
    pub pids: u64,
}

/// The controllers forkd limits.
pub const CONTROLLERS: [&str; 3] = ["memory", "cpu", "pids"];

/// Where forkd makes its VMs' cgroups on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroups {
    version: CgroupVersion,
    /// The `forkd` directories VM cgroups are made in: one for v2, one per hierarchy
    /// for v1 (memory, cpu, pids; fewer when controllers share a hierarchy).
    parents: Vec<PathBuf>,
}

impl Cgroups {
    /// Finds this host's cgroup layout from the process's mount table and cgroup
    /// membership, and makes forkd's parent cgroups. Errs with why VMs cannot be given
    /// cgroups here (no controllers, no permission, a v2 tree whose controllers cannot
    /// be delegated).
    pub fn detect() -> Result<Cgroups, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("reading /proc/self/mountinfo: {e}"))?;
        let membership = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("reading /proc/self/cgroup: {e}"))?;
        let cgroups = Cgroups::locate(&mountinfo, &membership)?;
        cgroups.make_parents()?;
        Ok(cgroups)
    }

    /// Where forkd's cgroups go given a mount table (`/proc/self/mountinfo`) and a
    /// membership list (`/proc/self/cgroup`): cgroup v1 when every one of memory, cpu
    /// and pids has a v1 hierarchy, else cgroup v2 when a v2 tree is mounted.
    pub fn locate(mountinfo: &str, membership: &str) -> Result<Cgroups, String> {
        let mounts = parse_mounts(mountinfo);
        let mut v1_parents = Vec::new();
        let mut missing = Vec::new();
        for controller in CONTROLLERS {
            let found = mounts
                .iter()
                .find(|m| m.fstype == "cgroup" && m.options.split(',').any(|o| o == controller));
            match found {
                Some(m) => {
                    let own = membership_path(membership, |ctrls| {
                        ctrls.split(',').any(|c| c == controller)
                    })
                    .ok_or_else(|| format!("/proc/self/cgroup names no {controller} cgroup"))?;
                    let parent = inside(m, own).join("forkd");
                    if !v1_parents.contains(&parent) {
                        v1_parents.push(parent);
                    }
                }
                None => missing.push(controller),
            }
        }
        if missing.is_empty() {
            return Ok(Cgroups {
                version: CgroupVersion::V1,
                parents: v1_parents,
            });
        }
        let unified = mounts.iter().find(|m| m.fstype == "cgroup2");
        match unified {
            Some(m) if missing.len() == CONTROLLERS.len() => {
                let own = membership_path(membership, str::is_empty)
                    .ok_or("/proc/self/cgroup names no cgroup v2 membership")?;
                Ok(Cgroups {
                    version: CgroupVersion::V2,
                    parents: vec![inside(m, own).join("forkd")],
                })
            }
            _ => Err(format!(
                "no cgroup hierarchy with the {} controller{} is mounted",
                missing.join(", "),
                if missing.len() == 1 { "" } else { "s" }
            )),
        }
    }

    /// A layout rooted in `parents` (for tests against a tree of their own).
    pub fn at(version: CgroupVersion, parents: Vec<PathBuf>) -> Cgroups {
        Cgroups { version, parents }
    }

    /// The cgroup version.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The `forkd` directories VM cgroups are made in.
    pub fn parents(&self) -> &[PathBuf] {
        &self.parents
    }

    /// Makes the parent directories and, for v2, delegates the controllers to them.
    fn make_parents(&self) -> Result<(), String> {
        for parent in &self.parents {
            match std::fs::create_dir(parent) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(format!("cannot make the cgroup {}: {e}", parent.display())),
            }
        }
        match self.version {
            CgroupVersion::V1 => Ok(()),
            CgroupVersion::V2 => v2::delegate(&self.parents[0]),
        }
    }

    /// The cgroup directories of the VM `id`.
    pub fn dirs(&self, id: &str) -> Vec<PathBuf> {
        self.parents.iter().map(|p| p.join(id)).collect()
    }

    /// Makes the cgroup of VM `id` with `limits` and returns it, ready for QEMU to join.
    /// A cgroup left by an earlier VM of the same id is reused (its limits rewritten).
    pub fn create(&self, id: &str, limits: &ResourceLimits) -> std::io::Result<VmCgroup> {
        if id.is_empty() || id.contains('/') || id.starts_with('.') {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{id:?} cannot name a cgroup"),
            ));
        }
        let dirs = self.dirs(id);
        let made = VmCgroup { dirs: dirs.clone() };
        let written = (|| {
            for dir in &dirs {
                match std::fs::create_dir(dir) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(with_path(e, dir)),
                }
            }
            match self.version {
                CgroupVersion::V1 => v1::apply(&dirs, limits),
                CgroupVersion::V2 => v2::apply(&dirs[0], limits),
            }
        })();
        match written {
            Ok(()) => Ok(made),
            Err(e) => {
                made.remove();
                Err(e)
            }
        }
    }

    /// What VM `id`'s cgroup counts now; None if it has none.
    pub fn usage(&self, id: &str) -> Option<CgroupUsage> {
        let dirs = self.dirs(id);
        match self.version {
            CgroupVersion::V1 => v1::usage(&dirs),
            CgroupVersion::V2 => v2::usage(&dirs[0]),
        }
    }

    /// How many times the kernel killed a process of VM `id`'s cgroup for reaching its
    /// memory limit; None if the cgroup or the counter is not there.
    pub fn oom_kills(&self, id: &str) -> Option<u64> {
        let dirs = self.dirs(id);
        let (dir, file) = match self.version {
            CgroupVersion::V1 => (
                dirs.iter()
                    .find(|d| d.join("memory.oom_control").exists())?,
                "memory.oom_control",
            ),
            CgroupVersion::V2 => (&dirs[0], "memory.events"),
        };
        let text = std::fs::read_to_string(dir.join(file)).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
    }

    /// Removes VM `id`'s cgroup once QEMU has left it.
    pub fn remove(&self, id: &str) {
        VmCgroup {
            dirs: self.dirs(id),
        }
        .remove();
    }

    /// Removes cgroups that VMs left behind (a process that started them died before
    /// they exited): every empty cgroup under forkd's parents last changed more than
    /// `min_age` ago. A cgroup just made for a QEMU about to join it is younger; one
    /// with a process in it cannot be removed.
    pub fn sweep(&self, min_age: Duration) -> usize {
        let mut removed = 0;
        for parent in &self.parents {
            let Ok(entries) = std::fs::read_dir(parent) else {
                continue;
            };
            for entry in entries.filter_map(Result::ok) {
                let old = entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age >= min_age);
                if old && entry.file_type().is_ok_and(|t| t.is_dir()) {
                    removed += usize::from(std::fs::remove_dir(entry.path()).is_ok());
                }
            }
        }
        removed
    }
}

/// Whether VMs get cgroups (see [`Enforcement`]).
pub const ENV: &str = "FORKD_CGROUPS";

/// This host's cgroups as this process found them (once: the detection makes forkd's
/// parent directories).
pub fn host() -> &'static Result<Cgroups, String> {
    static HOST: std::sync::OnceLock<Result<Cgroups, String>> = std::sync::OnceLock::new();
    HOST.get_or_init(Cgroups::detect)
}

/// The cgroups VMs with limits are placed in under the process's [`ENV`]:
/// None when the policy is off, or is auto and the host has none for forkd (said once
/// in the log); an error when they are required and missing.
pub fn for_vms() -> Result<Option<&'static Cgroups>, String> {
    static WARNED: std::sync::Once = std::sync::Once::new();
    match (Enforcement::from_env(ENV)?, host()) {
        (Enforcement::Off, _) => Ok(None),
        (_, Ok(cgroups)) => Ok(Some(cgroups)),
        (Enforcement::Required, Err(why)) => Err(format!(
            "FORKD_CGROUPS=required, but VMs cannot get cgroups here: {why}"
        )),
        (Enforcement::Auto, Err(why)) => {
            WARNED.call_once(|| {
                tracing::warn!("VMs run without cgroup limits: {why}");
            });
            Ok(None)
        }
    }
}

/// One VM's cgroup, made and not yet joined.
#[derive(Debug)]
pub struct VmCgroup {
    dirs: Vec<PathBuf>,
}

impl VmCgroup {
    /// Opens each of its `cgroup.procs` for the process about to become QEMU, which
    /// joins with [`join`] between fork and exec.
    pub fn procs_files(&self) -> std::io::Result<Vec<std::fs::File>> {
        self.dirs
            .iter()
            .map(|dir| {
                let path = dir.join("cgroup.procs");
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|e| with_path(e, &path))
            })
            .collect()
    }

    /// Removes its directories, waiting briefly for the kernel to let go of a process
    /// that has just exited.
    pub fn remove(&self) {
        for dir in &self.dirs {
            for _ in 0..50 {
                match std::fs::remove_dir(dir) {
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    _ => break,
                }
            }
        }
    }
}

/// Moves the calling process into the cgroups whose `cgroup.procs` are open as `fds`.
/// Meant for the child between fork and exec: it only calls write(2), which is
/// async-signal-safe, on descriptors the parent opened.
pub fn join(fds: &[std::os::fd::RawFd]) -> std::io::Result<()> {
    for &fd in fds {
        // SAFETY: `fd` is open (the parent keeps its File until spawn returns) and the
        // buffer is a static byte string.
        let n = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
        if n != 1 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Writes `value` to the control file `name` in `dir`, naming the file in the error.
fn write_control(dir: &Path, name: &str, value: &str) -> std::io::Result<()> {
    let path = dir.join(name);
    // Truncating is what a shell's `>` does: cgroupfs ignores it, a plain file (a test's
    // fake tree) needs it.
    std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .map_err(|e| with_path(e, &path))
}

/// Reads the number in control file `name` of `dir`.
fn read_number(dir: &Path, name: &str) -> Option<u64> {
    std::fs::read_to_string(dir.join(name))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn with_path(e: std::io::Error, path: &Path) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// Where the cgroup `own` (a path from /proc/self/cgroup) is under the mount `m`.
fn inside(m: &Mount<'_>, own: &str) -> PathBuf {
    let relative = own
        .strip_prefix(m.root)
        .unwrap_or(own)
        .trim_start_matches('/');
    if relative.is_empty() {
        m.mount_point.clone()
    } else {
        m.mount_point.join(relative)
    }
}

/// The cgroup mounts of a `/proc/self/mountinfo` text.
fn parse_mounts(mountinfo: &str) -> Vec<Mount<'_>> {
    crate::mountinfo::parse(mountinfo)
        .into_iter()
        .filter(|m| m.fstype == "cgroup" || m.fstype == "cgroup2")
        .collect()
}

/// The path of the first line of a `/proc/self/cgroup` text whose controller list
/// `matches`.
fn membership_path(membership: &str, matches: impl Fn(&str) -> bool) -> Option<&str> {
    membership.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let _id = parts.next()?;
        let controllers = parts.next()?;
        let path = parts.next()?;
        matches(controllers).then_some(path)
    })
}

#[cfg(test)]
mod tests;
