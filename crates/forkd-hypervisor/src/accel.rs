//! Choosing the accelerator: KVM where the CPU really has hardware virtualisation, TCG
//! (QEMU's software emulation) everywhere else.
//!
//! `/dev/kvm` existing is not enough: some hosts expose a software KVM (kvm_pvm) that
//! cannot run a Linux guest. So `auto` takes KVM only when `/proc/cpuinfo` reports vmx or
//! svm *and* `/dev/kvm` opens read-write.

use crate::HypervisorError;
use std::fmt;
use std::str::FromStr;

/// The accelerator a VM runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualisation through /dev/kvm.
    Kvm,
    /// QEMU's software emulation.
    Tcg,
}

impl Accel {
    /// The guest CPU model a new template is pinned to. A named model, so that a
    /// snapshot's guest sees the same CPU features wherever it is restored (`host` and
    /// `max` follow the machine); the newest the accelerator provides whole, checked by
    /// QEMU (`enforce`) at every start. Under TCG, Westmere: QEMU 7.2 and 10.0 emulate
    /// all of it (Sandy Bridge and later ask for the TSC deadline timer and PCID, which
    /// TCG lacks). Under KVM, Sandy Bridge: AVX, AES and the TSC deadline timer (which
    /// KVM provides on any host), without the PCID and INVPCID that Haswell asks for
    /// and some AMD hosts and nested hypervisors lack.
    pub fn default_cpu_model(self) -> &'static str {
        match self {
            Accel::Kvm => "SandyBridge-v1",
            Accel::Tcg => "Westmere-v1",
        }
    }

    /// The model of guests that take whatever CPU the accelerator offers.
    pub fn unpinned_cpu_model(self) -> &'static str {
        match self {
            Accel::Kvm => "host",
            Accel::Tcg => "max",
        }
    }

    /// Its name (`kvm`, `tcg`): also the value of QEMU's `-accel`.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the user asked for (`--accel auto|kvm|tcg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AccelChoice {
    /// KVM where usable, else TCG.
    #[default]
    Auto,
    /// KVM or fail.
    Kvm,
    /// TCG always.
    Tcg,
}

impl FromStr for AccelChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(AccelChoice::Auto),
            "kvm" => Ok(AccelChoice::Kvm),
            "tcg" => Ok(AccelChoice::Tcg),
            other => Err(format!(
                "unknown accelerator {other:?}: use auto, kvm or tcg"
            )),
        }
    }
}

impl fmt::Display for AccelChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AccelChoice::Auto => "auto",
            AccelChoice::Kvm => "kvm",
            AccelChoice::Tcg => "tcg",
        })
    }
}

/// Whether KVM can run a guest here, and why (not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvmProbe {
    /// True when KVM is usable.
    pub usable: bool,
    /// One line saying why.
    pub reason: String,
}

/// Checks the CPU flags and /dev/kvm.
pub fn probe_kvm() -> KvmProbe {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    probe_kvm_from(&cpuinfo, || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .map(|_| ())
    })
}

fn probe_kvm_from(cpuinfo: &str, open_kvm: impl FnOnce() -> std::io::Result<()>) -> KvmProbe {
    let has_flag = cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .flat_map(|l| l.split_whitespace())
        .any(|f| f == "vmx" || f == "svm");
    if !has_flag {
        return KvmProbe {
            usable: false,
            reason: "the CPU reports neither vmx nor svm in /proc/cpuinfo (no hardware \
                     virtualisation, or it is not passed through to this machine)"
                .into(),
        };
    }
    match open_kvm() {
        Ok(()) => KvmProbe {
            usable: true,
            reason: "the CPU has hardware virtualisation and /dev/kvm opens".into(),
        },
        Err(e) => KvmProbe {
            usable: false,
            reason: format!(
                "the CPU has hardware virtualisation but /dev/kvm cannot be opened: {e}"
            ),
        },
    }
}

/// Turns the user's choice into the accelerator to use.
pub fn resolve(choice: AccelChoice) -> Result<Accel, HypervisorError> {
    match choice {
        AccelChoice::Tcg => Ok(Accel::Tcg),
        AccelChoice::Auto => Ok(if probe_kvm().usable {
            Accel::Kvm
        } else {
            Accel::Tcg
        }),
        AccelChoice::Kvm => {
            let p = probe_kvm();
            if p.usable {
                Ok(Accel::Kvm)
            } else {
                Err(HypervisorError::KvmUnavailable(p.reason))
            }
        }
    }
}

/// Whether `s` can be a CPU model name (`Westmere-v1`, `host`, as QEMU names them): letters, digits,
/// `.`, `_` and `-`, so that nothing else reaches `-cpu`.
pub fn is_cpu_model_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_needs_the_cpu_flag_and_the_device() {
        let no_flag = "processor\t: 0\nflags\t\t: fpu sse2 hypervisor\n";
        let with_flag = "flags\t\t: fpu vmx sse2\n";
        assert!(!probe_kvm_from(no_flag, || Ok(())).usable);
        assert!(probe_kvm_from(with_flag, || Ok(())).usable);
        let p = probe_kvm_from(with_flag, || {
            Err(std::io::ErrorKind::PermissionDenied.into())
        });
        assert!(!p.usable);
        assert!(p.reason.contains("/dev/kvm"));
    }

    #[test]
    fn choices_parse() {
        assert_eq!("auto".parse::<AccelChoice>(), Ok(AccelChoice::Auto));
        assert!("hvf"
            .parse::<AccelChoice>()
            .unwrap_err()
            .contains("auto, kvm or tcg"));
        assert_eq!(resolve(AccelChoice::Tcg).unwrap(), Accel::Tcg);
    }
}
