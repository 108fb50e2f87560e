//! cgroup v2: one tree. A VM's cgroup is one directory, and the controllers must be
//! delegated down to it: each ancestor's `cgroup.subtree_control` names them.

use super::{read_number, write_control, CgroupUsage, ResourceLimits, CONTROLLERS, CPU_PERIOD_US};
use std::path::Path;

/// Delegates forkd's controllers from the cgroup forkd runs in to `parent` (its
/// `forkd` directory), and from `parent` to the VM cgroups below it.
///
/// cgroup v2 lets a cgroup hand controllers to its children only while it holds no
/// process itself (the root excepted): when forkd runs in a cgroup with other
/// processes, this fails and says so.
pub(super) fn delegate(parent: &Path) -> Result<(), String> {
    let own = parent
        .parent()
        .ok_or_else(|| format!("{} has no parent cgroup", parent.display()))?;
    let offered = std::fs::read_to_string(own.join("cgroup.controllers"))
        .map_err(|e| format!("reading {}: {e}", own.join("cgroup.controllers").display()))?;
    let missing: Vec<&str> = CONTROLLERS
        .into_iter()
        .filter(|c| !offered.split_whitespace().any(|o| o == *c))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "the cgroup {} is not given the {} controller{} (it has: {})",
            own.display(),
            missing.join(", "),
            if missing.len() == 1 { "" } else { "s" },
            offered.trim()
        ));
    }
    for dir in [own, parent] {
        enable_controllers(dir).map_err(|e| {
            if e.raw_os_error() == Some(libc::EBUSY) {
                format!(
                    "cannot delegate controllers from the cgroup {}: it holds processes \
                     (cgroup v2 delegates only from a cgroup without any); run forkd in a \
                     cgroup of its own, e.g. a systemd service with Delegate=yes",
                    dir.display()
                )
            } else {
                e.to_string()
            }
        })?;
    }
    Ok(())
}

/// Names every controller forkd uses in `dir`'s `cgroup.subtree_control` (those already
/// named are left alone: writing them again would fail in a cgroup with processes).
fn enable_controllers(dir: &Path) -> std::io::Result<()> {
    let enabled = std::fs::read_to_string(dir.join("cgroup.subtree_control"))?;
    let wanted: Vec<String> = CONTROLLERS
        .into_iter()
        .filter(|c| !enabled.split_whitespace().any(|e| e == *c))
        .map(|c| format!("+{c}"))
        .collect();
    if wanted.is_empty() {
        return Ok(());
    }
    write_control(dir, "cgroup.subtree_control", &wanted.join(" "))
}

/// Writes `limits` into the VM's cgroup `dir`.
pub(super) fn apply(dir: &Path, limits: &ResourceLimits) -> std::io::Result<()> {
    write_control(dir, "memory.max", &limits.memory_bytes.to_string())?;
    write_control(dir, "cpu.max", &cpu_max(limits))?;
    write_control(dir, "cpu.weight", &limits.cpu_weight.to_string())?;
    write_control(dir, "pids.max", &limits.pids.to_string())
}

/// What the VM's cgroup counts now, None if it has no directory.
pub(super) fn usage(dir: &Path) -> Option<CgroupUsage> {
    if !dir.is_dir() {
        return None;
    }
    Some(CgroupUsage {
        memory_bytes: read_number(dir, "memory.current").unwrap_or(0),
        pids: read_number(dir, "pids.current").unwrap_or(0),
    })
}

/// `cpu.max`: "QUOTA PERIOD", or "max PERIOD" for no quota.
fn cpu_max(limits: &ResourceLimits) -> String {
    if limits.cpu_millicores == 0 {
        return format!("max {CPU_PERIOD_US}");
    }
    let quota = (u64::from(limits.cpu_millicores) * CPU_PERIOD_US / 1000).max(1000);
    format!("{quota} {CPU_PERIOD_US}")
}
