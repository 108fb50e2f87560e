//! How a guest keeps time under TCG.
//!
//! Debian's 6.1 cloud kernel on `-M microvm` cannot calibrate its clock against the PIT
//! under QEMU 7.2's TCG (jiffies stay at zero and it hangs), so it needs help. Two ways
//! were measured on the development machine (see the QEMU notes): `-icount shift=auto`
//! (instruction counting: an idle guest costs 4.2–4.8 % of a host core, 6.7 s to the
//! first answer) or telling the kernel the TSC rate with `tsc_early_khz=` (2.1–2.3 %,
//! 4.7 s). Under TCG without icount a guest's TSC *is* the host's (QEMU reads the host
//! counter), so the rate to give is the host's, measured here. A wrong rate hangs the
//! boot, so where it cannot be measured with confidence, icount stays.
//!
//! Under KVM the guest has its own clocks and neither applies.

use serde::{Deserialize, Serialize};
use std::sync::OnceLock;

/// The environment variable that can force instruction counting (`icount`).
pub const CLOCK_ENV: &str = "FORKD_GUEST_CLOCK";

/// The value of [`CLOCK_ENV`] that forces instruction counting.
const ICOUNT: &str = "icount";

/// How the guest's clock is driven (TCG only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum GuestClock {
    /// QEMU counts instructions (`-icount shift=auto`). What VMs and snapshots made
    /// before the host TSC was used were started with.
    #[default]
    Icount,
    /// The kernel is given the host's TSC rate (`tsc_early_khz=`), no icount.
    HostTsc {
        /// The host's TSC rate when the VM was started.
        khz: u32,
    },
}

impl GuestClock {
    /// The best clock for a TCG guest on this host: the host TSC when its rate can be
    /// measured, else icount.
    /// `FORKD_GUEST_CLOCK=icount` keeps instruction counting (an escape hatch for a
    /// host whose TSC misleads the measurement).
    pub fn for_tcg() -> GuestClock {
        if std::env::var(CLOCK_ENV).is_ok_and(|v| v == ICOUNT) {
            return GuestClock::Icount;
        }
        match host_tsc_khz() {
            Some(khz) => GuestClock::HostTsc { khz },
            None => GuestClock::Icount,
        }
    }

    /// Whether a guest with this clock needs the legacy PIT (i8254). A TCG kernel told
    /// the host's TSC rate calibrates nothing against it, and QEMU's PIT, left counting
    /// in its reset mode by a kernel that never reprograms it (Debian's 6.1), wakes
    /// QEMU's main loop and the vCPU ~36 times a second. An instruction-counting kernel
    /// calibrates against it, and under KVM it stays as it was (not measured without).
    pub fn needs_pit(self, accel: crate::Accel) -> bool {
        !(accel == crate::Accel::Tcg && matches!(self, GuestClock::HostTsc { .. }))
    }

    /// Whether a guest frozen with this clock can be restored on this host: a host TSC
    /// guest keeps the rate it calibrated at boot, so this host's must match it.
    pub fn check_restorable(self) -> Result<(), String> {
        let GuestClock::HostTsc { khz } = self else {
            return Ok(());
        };
        match host_tsc_khz() {
            Some(here) if same_rate(khz, here) => Ok(()),
            Some(here) => Err(format!(
                "the snapshot's guest was booted on a host whose TSC runs at {khz} kHz; this host's runs at {here} kHz, so its clock would run wrong: rebuild the template on this host"
            )),
            None => Err(format!(
                "the snapshot's guest keeps time by a {khz} kHz host TSC, and this host has no constant, measurable TSC: rebuild the template on this host"
            )),
        }
    }
}

/// Rates within 0.5 % are the same rate measured twice.
fn same_rate(a: u32, b: u32) -> bool {
    u64::from(a.abs_diff(b)) * 200 <= u64::from(a.max(b))
}

/// The host's TSC rate in kHz, measured once per process; `None` when the CPU does not
/// promise a constant, non-stop TSC or the measurement is not stable.
pub fn host_tsc_khz() -> Option<u32> {
    static RATE: OnceLock<Option<u32>> = OnceLock::new();
    *RATE.get_or_init(measure)
}

#[cfg(target_arch = "x86_64")]
fn measure() -> Option<u32> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags"))?;
    let has = |f: &str| flags.split_whitespace().any(|x| x == f);
    if !(has("constant_tsc") && has("nonstop_tsc")) {
        return None;
    }
    // Three windows of 20 ms against CLOCK_MONOTONIC_RAW; they must agree.
    let rates: Vec<u32> = (0..3).filter_map(|_| window(20)).collect();
    let (lo, hi) = (*rates.iter().min()?, *rates.iter().max()?);
    (rates.len() == 3 && same_rate(lo, hi)).then(|| rates[1])
}

/// One reading of both clocks: CLOCK_MONOTONIC_RAW (ns) and the TSC at its midpoint,
/// with the TSC ticks the reading took. A reading interrupted (preempted) between its
/// parts shows as a wide bracket and is taken again.
#[cfg(target_arch = "x86_64")]
fn reading() -> Option<(i128, u64, u64)> {
    use nix::time::{clock_gettime, ClockId};
    let mut best: Option<(i128, u64, u64)> = None;
    for _ in 0..8 {
        // SAFETY: rdtsc reads a counter; it has no memory effects. Every x86_64 CPU has it.
        let before = unsafe { core::arch::x86_64::_rdtsc() };
        let t = clock_gettime(ClockId::CLOCK_MONOTONIC_RAW).ok()?;
        // SAFETY: as above.
        let after = unsafe { core::arch::x86_64::_rdtsc() };
        let bracket = after.checked_sub(before)?;
        let ns = i128::from(t.tv_sec()) * 1_000_000_000 + i128::from(t.tv_nsec());
        let r = (ns, before + bracket / 2, bracket);
        if best.is_none_or(|b| bracket < b.2) {
            best = Some(r);
        }
    }
    best
}

/// The TSC rate in kHz over a window of `ms`, or `None` when a reading was too loose to
/// trust (its bracket over 1/4000 of the window: an error over 0.025 %).
#[cfg(target_arch = "x86_64")]
fn window(ms: u64) -> Option<u32> {
    let (t0, c0, b0) = reading()?;
    std::thread::sleep(std::time::Duration::from_millis(ms));
    let (t1, c1, b1) = reading()?;
    let elapsed_ns = t1 - t0;
    let ticks = c1.checked_sub(c0)?;
    if elapsed_ns <= 0 || (b0 + b1) * 4000 > ticks {
        return None;
    }
    u32::try_from(i128::from(ticks) * 1_000_000 / elapsed_ns)
        .ok()
        .filter(|&k| k > 100_000)
}

#[cfg(not(target_arch = "x86_64"))]
fn measure() -> Option<u32> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_compare_within_half_a_percent() {
        assert!(same_rate(2_100_000, 2_100_000));
        assert!(same_rate(2_100_000, 2_109_000));
        assert!(!same_rate(2_100_000, 2_200_000));
        assert!(GuestClock::Icount.check_restorable().is_ok());
        let e = GuestClock::HostTsc { khz: 1_000 }
            .check_restorable()
            .unwrap_err();
        assert!(e.contains("rebuild the template"), "{e}");
    }

    #[test]
    fn the_measured_rate_is_stable() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap();
        let constant = cpuinfo.contains(" constant_tsc") && cpuinfo.contains(" nonstop_tsc");
        // A CPU that promises a constant TSC gets it measured, the same way twice.
        assert_eq!(host_tsc_khz().is_some(), constant);
        if let Some(a) = host_tsc_khz() {
            eprintln!("host TSC: {a} kHz");
            let b = measure().expect("measured once, measurable again");
            assert!(same_rate(a, b), "{a} vs {b}");
            assert!(GuestClock::HostTsc { khz: a }.check_restorable().is_ok());
            assert_eq!(GuestClock::for_tcg(), GuestClock::HostTsc { khz: a });
        }
        // Old records without a clock are icount guests.
        let c: GuestClock = serde_json::from_str(r#"{"kind":"icount"}"#).unwrap();
        assert_eq!(c, GuestClock::Icount);
    }
}
