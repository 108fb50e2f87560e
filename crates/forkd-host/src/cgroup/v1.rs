//! cgroup v1: one hierarchy per controller, so a VM's cgroup is a directory in each, and
//! each directory holds the files of its own controller only.

use super::{read_number, write_control, CgroupUsage, ResourceLimits, CPU_PERIOD_US};
use std::path::{Path, PathBuf};

/// Writes `limits` into whichever of `dirs` has each controller's files.
pub(super) fn apply(dirs: &[PathBuf], limits: &ResourceLimits) -> std::io::Result<()> {
    for dir in dirs {
        if has(dir, "memory.limit_in_bytes") {
            write_control(
                dir,
                "memory.limit_in_bytes",
                &limits.memory_bytes.to_string(),
            )?;
            // With swap accounting on, memory and swap together get the same bound, so
            // a VM cannot move past its limit into swap. The combined limit may only be
            // set once the memory limit is (it must not be below it).
            if has(dir, "memory.memsw.limit_in_bytes") {
                write_control(
                    dir,
                    "memory.memsw.limit_in_bytes",
                    &limits.memory_bytes.to_string(),
                )?;
            }
        }
        if has(dir, "cpu.cfs_quota_us") {
            write_control(dir, "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())?;
            write_control(dir, "cpu.cfs_quota_us", &quota_us(limits).to_string())?;
            write_control(dir, "cpu.shares", &shares(limits.cpu_weight).to_string())?;
        }
        if has(dir, "pids.max") {
            write_control(dir, "pids.max", &limits.pids.to_string())?;
        }
    }
    Ok(())
}

/// What the VM's cgroup counts now, None if it has no directory.
pub(super) fn usage(dirs: &[PathBuf]) -> Option<CgroupUsage> {
    if !dirs.iter().any(|d| d.is_dir()) {
        return None;
    }
    let mut usage = CgroupUsage::default();
    for dir in dirs {
        if let Some(bytes) = read_number(dir, "memory.usage_in_bytes") {
            usage.memory_bytes = bytes;
        }
        if let Some(pids) = read_number(dir, "pids.current") {
            usage.pids = pids;
        }
    }
    Some(usage)
}

/// `cpu.cfs_quota_us`: the quota per period, or -1 for none.
fn quota_us(limits: &ResourceLimits) -> i64 {
    if limits.cpu_millicores == 0 {
        return -1;
    }
    // 1000 thousandths of a core are one whole period per period.
    let quota = u64::from(limits.cpu_millicores) * CPU_PERIOD_US / 1000;
    // The kernel refuses quotas below 1 ms.
    i64::try_from(quota.max(1000)).unwrap_or(i64::MAX)
}

/// v1's `cpu.shares` for a v2 weight: the defaults (1024 and 100) correspond, and the
/// kernel takes at least 2.
fn shares(weight: u32) -> u64 {
    (u64::from(weight) * 1024 / 100).max(2)
}

fn has(dir: &Path, file: &str) -> bool {
    dir.join(file).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_and_shares_follow_the_v2_scale() {
        let mut limits = ResourceLimits::for_vm(2, 512);
        assert_eq!(quota_us(&limits), 200_000);
        limits.cpu_millicores = 0;
        assert_eq!(quota_us(&limits), -1);
        limits.cpu_millicores = 5;
        assert_eq!(quota_us(&limits), 1000);
        assert_eq!(shares(100), 1024);
        assert_eq!(shares(1), 10);
        assert_eq!(shares(10_000), 102_400);
    }
}
