//! Memory admission for forks: a fork of N is admitted when N times what a child of that
//! snapshot really costs fits in the host's available memory (times a configurable
//! overcommit), not when N times the nominal guest RAM does. A child maps its snapshot's
//! memory copy-on-write, so what it costs the host is its QEMU process's *private*
//! memory: the guest pages it wrote and QEMU's own (heap, translation buffer). That is
//! measured on the live children of the snapshot (`/proc/PID/smaps_rollup`); before a
//! snapshot has any, a conservative default stands in.

use std::path::Path;

/// What one child is assumed to cost before any child of its snapshot can be measured:
/// about 1.5 times the ~41 MiB measured per idle child on the development machine.
pub const DEFAULT_CHILD_COST: u64 = 64 << 20;

/// At most this many live children are measured for an estimate (one smaps_rollup read
/// each).
const SAMPLE: usize = 8;

/// Why a fork was not admitted.
#[derive(Debug, thiserror::Error)]
#[error("not enough memory for {count} children: about {per_child_mib} MiB each ({basis}), {needed_mib} MiB in all, and the host has {available_mib} MiB available (x {overcommit} overcommit); stop some sandboxes, fork fewer, or raise --memory-overcommit")]
pub struct InsufficientMemory {
    /// Children asked for.
    pub count: usize,
    /// Estimated cost of one, MiB.
    pub per_child_mib: u64,
    /// How the estimate was made.
    pub basis: String,
    /// count × per child, MiB.
    pub needed_mib: u64,
    /// MemAvailable, MiB.
    pub available_mib: u64,
    /// The configured overcommit.
    pub overcommit: f64,
}

/// Private memory (Private_Clean + Private_Dirty) of the whole process `pid`, in bytes.
pub fn private_memory(pid: u32) -> Option<u64> {
    forkd_host::smaps::process_usage(pid).map(|u| u.private_clean + u.private_dirty)
}

/// `MemAvailable` from a `/proc/meminfo` text, in bytes.
fn mem_available_in(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line["MemAvailable:".len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// The host's `MemAvailable`, in bytes.
pub fn mem_available() -> Option<u64> {
    mem_available_in(&std::fs::read_to_string(Path::new("/proc/meminfo")).ok()?)
}

/// The estimated cost of one more child, from the pids of live children of the same
/// snapshot: their mean private memory, or [`DEFAULT_CHILD_COST`] when none can be
/// measured. Returns the estimate and how it was made.
pub fn estimate_child_cost(pids: &[u32]) -> (u64, String) {
    let measured: Vec<u64> = pids
        .iter()
        .take(SAMPLE)
        .filter_map(|&p| private_memory(p))
        .collect();
    if measured.is_empty() {
        return (
            DEFAULT_CHILD_COST,
            "no live child of this snapshot to measure yet: the default".into(),
        );
    }
    let mean = measured.iter().sum::<u64>() / measured.len() as u64;
    (
        mean,
        format!(
            "measured on {} live children of this snapshot",
            measured.len()
        ),
    )
}

/// Admits a fork of `count` children costing `per_child` each (estimated as `basis`
/// says) against `available` bytes times `overcommit`.
pub fn admit(
    count: usize,
    per_child: u64,
    basis: &str,
    available: u64,
    overcommit: f64,
) -> Result<(), InsufficientMemory> {
    let needed = per_child.saturating_mul(count as u64);
    #[expect(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a memory budget: a float's precision is plenty, and `as` saturates"
    )]
    let budget = (available as f64 * overcommit) as u64;
    if needed > budget {
        return Err(InsufficientMemory {
            count,
            per_child_mib: per_child.div_ceil(1 << 20),
            basis: basis.to_owned(),
            needed_mib: needed.div_ceil(1 << 20),
            available_mib: available >> 20,
            overcommit,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fork_fits_by_what_children_cost_not_their_nominal_ram() {
        // 100 children of 45 MiB each fit in 24 GiB; 100 x 512 MiB would not.
        let available = 24u64 << 30;
        admit(100, 45 << 20, "measured", available, 1.0).unwrap();
        let e = admit(100, 512 << 20, "nominal", available, 1.0).unwrap_err();
        assert_eq!((e.needed_mib, e.available_mib), (51200, 24576));
        let msg = e.to_string();
        assert!(
            msg.contains("100 children") && msg.contains("--memory-overcommit"),
            "{msg}"
        );
        // Overcommit stretches the budget.
        admit(100, 512 << 20, "nominal", available, 2.5).unwrap();
    }

    #[test]
    fn costs_are_read_from_proc() {
        let me = std::process::id();
        let own = private_memory(me).unwrap();
        assert!(own > 0);
        let (cost, basis) = estimate_child_cost(&[me, u32::MAX - 1]);
        assert!(cost > 0 && basis.contains("1 live"), "{cost} {basis}");
        let (cost, basis) = estimate_child_cost(&[]);
        assert_eq!(cost, DEFAULT_CHILD_COST, "{basis}");
        assert!(mem_available().unwrap() > 0);
        assert_eq!(
            mem_available_in("MemTotal: 10 kB\nMemAvailable:    2048 kB\n"),
            Some(2 << 20)
        );
        assert_eq!(mem_available_in("MemTotal: 10 kB\n"), None);
    }
}
