//! The QEMU command line for a forkd microVM.
//!
//! `-M microvm` with ACPI on: Debian's cloud kernel finds virtio-mmio devices only through
//! ACPI (it is built without `virtio_mmio.device=` support). `-nodefaults` and
//! `-no-user-config` keep QEMU from adding devices nobody asked for; `-no-reboot` turns a
//! guest reboot (and a panic, with `panic=-1`) into QEMU exiting.

use crate::{Accel, GuestClock, MemoryBackend, VmConfig};
use std::ffi::OsString;

/// QEMU's seccomp filter: deny obsolete syscalls, privilege changes, spawning processes and
/// resource-control calls. Measured to work with TCG.
pub const SECCOMP: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// Id of the guest-RAM memory backend object.
pub const MEMORY_ID: &str = "mem";

/// The value of `-cpu`: a named model with `enforce` (QEMU refuses to start rather
/// than leave a feature out), else what the accelerator offers.
pub fn cpu_arg(config: &VmConfig) -> String {
    match config.cpu.as_str() {
        "" => config.accel.unpinned_cpu_model().to_owned(),
        "host" | "max" => config.cpu.clone(),
        named => format!("{named},enforce"),
    }
}

/// Builds the argument vector (without the program name). `backing_levels` is how many
/// images lie below the root disk's top layer (see [`super::qcow2::backing_depth`]).
pub fn build(config: &VmConfig, backing_levels: usize) -> Vec<OsString> {
    let mut args = Args::default();
    let mut machine = String::from("microvm,acpi=on,pit=on,pic=on,rtc=on");
    if !matches!(config.memory, MemoryBackend::Anonymous) {
        machine.push_str(",memory-backend=");
        machine.push_str(MEMORY_ID);
    }
    args.push("-M").push(machine);
    args.push("-accel").push(config.accel.qemu_name());
    args.push("-cpu").push(cpu_arg(config));
    // Under TCG the 6.1 cloud kernel on microvm cannot calibrate against the PIT (jiffies
    // stuck at zero): either QEMU counts instructions, or the kernel is told the TSC rate
    // (see `clock.rs`; the latter costs half the idle CPU).
    if config.accel == Accel::Tcg && config.clock == GuestClock::Icount {
        args.push("-icount").push("shift=auto");
    }
    args.push("-m").push(format!("{}M", config.memory_mib));
    args.push("-smp").push(config.vcpus.to_string());
    if let MemoryBackend::File { path, shared } = &config.memory {
        let mut obj = OsString::from(format!(
            "memory-backend-file,id={MEMORY_ID},size={}M,share={},mem-path=",
            config.memory_mib,
            if *shared { "on" } else { "off" }
        ));
        obj.push(escape(path.as_os_str()));
        args.push("-object").push(obj);
    }
    args.push("-nodefaults")
        .push("-no-user-config")
        .push("-display")
        .push("none")
        .push("-no-reboot");
    args.push("-name")
        .push(format!("forkd-{},process=forkd-{}", config.id, config.id));
    // The console goes to a socket that the host reads into a capped log (see
    // `console.rs`): with nobody connected, QEMU drops it.
    let mut console = OsString::from("socket,id=console0,server=on,wait=off,path=");
    console.push(escape(config.console_socket().as_os_str()));
    args.push("-chardev").push(console);
    args.push("-serial").push("chardev:console0");
    args.push("-kernel").push(config.kernel.as_os_str());
    args.push("-initrd").push(config.initramfs.as_os_str());
    let mut append = config.cmdline.clone();
    if let (Accel::Tcg, GuestClock::HostTsc { khz }) = (config.accel, config.clock) {
        append.push_str(&format!(" tsc_early_khz={khz}"));
    }
    // The guest kernel's speculation mitigations protect the guest's kernel from the
    // guest's own processes, which in a sandbox run as root anyway; the host's side is
    // the host kernel's and QEMU's business. Under TCG they cost a lot: a named Intel
    // model (Westmere) makes the guest turn on page table isolation, a TLB flush at
    // every kernel entry, which TCG pays for dearly (measured: a fork of 10 minimal
    // children all answering took 1.4-1.8 s against 1.1 s without it). Under KVM the
    // guest keeps its defaults.
    if config.accel == Accel::Tcg {
        append.push_str(" mitigations=off");
    }
    args.push("-append").push(append);

    let mut drive = OsString::from(
        "id=root,format=qcow2,if=none,cache=unsafe,werror=report,rerror=report,file=",
    );
    // cache=unsafe: the overlay is a throwaway per-sandbox layer; its durability is the
    // snapshot layer's business, and skipping flushes keeps guest fsyncs cheap.
    // werror/rerror=report: a host disk that fills up (or fails) is an I/O error the
    // guest sees (ENOSPC, EIO), not a VM that QEMU pauses and nobody resumes.
    drive.push(escape(config.root_disk.as_os_str()));
    drive.push(keep_page_cache(backing_levels));
    args.push("-drive").push(drive);
    args.push("-device").push("virtio-blk-device,drive=root");

    args.push("-device")
        .push("virtio-serial-device,max_ports=2");
    let mut chardev = OsString::from("socket,id=agent0,server=on,wait=off,path=");
    chardev.push(escape(config.agent_socket().as_os_str()));
    args.push("-chardev").push(chardev);
    args.push("-device").push(format!(
        "virtserialport,chardev=agent0,name={}",
        forkd_proto::AGENT_PORT_NAME
    ));

    let mut qmp = OsString::from("unix:");
    qmp.push(escape(config.qmp_socket().as_os_str()));
    qmp.push(",server=on,wait=off");
    args.push("-qmp").push(qmp);
    if config.seccomp {
        args.push("-sandbox").push(SECCOMP);
    }
    args.0
}

/// The command line of a VM restored from saved device state: QEMU starts with
/// `-incoming defer` and waits, paused, for `migrate-incoming` over QMP. (Giving the
/// source on the command line does not work with `x-ignore-shared`: the capability must
/// be set before the stream is read, and in QEMU 7.2 only QMP can set it in time.)
pub fn build_restore(config: &VmConfig, backing_levels: usize) -> Vec<OsString> {
    let mut args = build(config, backing_levels);
    args.push("-incoming".into());
    args.push("defer".into());
    args
}

/// The command line of a branch's receiver: a VM that takes in a running VM's memory
/// and devices over a migration stream and never runs (`-S`: without it QEMU would start
/// the vCPUs once the stream ends, since the source was running, and change the RAM it
/// received).
pub fn build_receiver(config: &VmConfig, backing_levels: usize) -> Vec<OsString> {
    let mut args = build_restore(config, backing_levels);
    args.push("-S".into());
    args
}

/// `drop-cache=off` for the file under every layer of the root disk, down its backing
/// chain: `file.drop-cache=off,backing.file.drop-cache=off,backing.backing.file...`.
///
/// Why: a migration hands the disks over to its destination, and `cont` on the source
/// takes them back; by default QEMU then drops the host's page cache of every image in
/// the chain (`POSIX_FADV_DONTNEED`), in case the destination wrote them through shared
/// storage. A branch's destination writes none of them, so that drop only made the
/// source's resume read each layer's header from the disk again (measured here: 20-30 ms
/// per evicted layer, most of a live branch's pause) and evicted the template's rootfs
/// from the cache that all its children read through.
pub fn keep_page_cache(backing_levels: usize) -> String {
    (0..=backing_levels)
        .map(|level| format!(",{}file.drop-cache=off", "backing.".repeat(level)))
        .collect()
}

/// QEMU option values use `,` as a separator; a literal comma is written twice.
fn escape(s: &std::ffi::OsStr) -> OsString {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let mut out = Vec::with_capacity(s.len());
    for &b in s.as_bytes() {
        out.push(b);
        if b == b',' {
            out.push(b',');
        }
    }
    OsString::from_vec(out)
}

#[derive(Default)]
struct Args(Vec<OsString>);

impl Args {
    fn push(&mut self, a: impl Into<OsString>) -> &mut Self {
        self.0.push(a.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn config() -> VmConfig {
        VmConfig {
            id: "sb-1".into(),
            dir: PathBuf::from("/run/x,y"),
            kernel: "/k".into(),
            initramfs: "/i".into(),
            cmdline: "console=ttyS0".into(),
            root_disk: "/run/x,y/root.qcow2".into(),
            vcpus: 2,
            memory_mib: 512,
            memory: MemoryBackend::Anonymous,
            accel: Accel::Tcg,
            cpu: String::new(),
            clock: GuestClock::Icount,
            limits: None,
            seccomp: true,
            detached: false,
        }
    }

    #[test]
    fn a_named_cpu_model_is_enforced_and_an_old_record_takes_the_accelerator_s() {
        let mut c = config();
        assert!(joined(&c).contains("-accel tcg -cpu max -icount shift=auto"));
        c.cpu = "Westmere-v1".into();
        assert!(
            joined(&c).contains("-cpu Westmere-v1,enforce"),
            "{}",
            joined(&c)
        );
        c.accel = Accel::Kvm;
        c.cpu = "host".into();
        let args = joined(&c);
        assert!(
            args.contains("-accel kvm -cpu host") && !args.contains("icount"),
            "{args}"
        );
    }

    fn joined(c: &VmConfig) -> String {
        build(c, 0)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn every_layer_keeps_its_page_cache() {
        assert_eq!(
            keep_page_cache(2),
            ",file.drop-cache=off,backing.file.drop-cache=off,backing.backing.file.drop-cache=off"
        );
        let s = build(&config(), 1)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .find(|a| a.starts_with("id=root"))
            .unwrap();
        assert!(
            s.ends_with("root.qcow2,file.drop-cache=off,backing.file.drop-cache=off"),
            "{s}"
        );
    }

    #[test]
    fn microvm_with_acpi_and_the_agent_port() {
        let s = joined(&config());
        assert!(s.starts_with("-M microvm,acpi=on"), "{s}");
        assert!(
            s.contains("-accel tcg -cpu max -icount shift=auto -m 512M -smp 2"),
            "{s}"
        );
        assert!(s.contains("-nodefaults -no-user-config"), "{s}");
        assert!(
            s.contains("virtserialport,chardev=agent0,name=agent"),
            "{s}"
        );
        assert!(s.contains(&format!("-sandbox {SECCOMP}")), "{s}");
        assert!(
            s.contains("-chardev socket,id=console0,server=on,wait=off,path=/run/x,,y/console.sock -serial chardev:console0"),
            "{s}"
        );
        // Commas in paths are doubled so QEMU does not split on them.
        assert!(
            s.contains("file=/run/x,,y/root.qcow2,file.drop-cache=off "),
            "{s}"
        );
        assert!(s.contains("werror=report,rerror=report"), "{s}");
        assert!(!s.contains("memory-backend"), "{s}");
        assert!(!s.contains("tsc_early_khz"), "{s}");
    }

    #[test]
    fn a_host_tsc_guest_runs_without_icount() {
        let mut c = config();
        c.clock = GuestClock::HostTsc { khz: 2_445_426 };
        let s = joined(&c);
        assert!(!s.contains("-icount"), "{s}");
        assert!(
            s.contains("-append console=ttyS0 tsc_early_khz=2445426 mitigations=off"),
            "{s}"
        );
        c.accel = Accel::Kvm;
        let s = joined(&c);
        assert!(
            !s.contains("tsc_early_khz"),
            "KVM guests have their own clock"
        );
        assert!(!s.contains("mitigations"), "{s}");
    }

    #[test]
    fn file_backed_memory() {
        let mut c = config();
        c.accel = Accel::Kvm;
        c.seccomp = false;
        c.memory = MemoryBackend::File {
            path: "/dev/shm/ram".into(),
            shared: false,
        };
        let s = joined(&c);
        assert!(s.contains("memory-backend=mem"), "{s}");
        assert!(s.contains("-accel kvm -cpu host"), "{s}");
        assert!(
            s.contains("memory-backend-file,id=mem,size=512M,share=off,mem-path=/dev/shm/ram"),
            "{s}"
        );
        assert!(!s.contains("-sandbox"), "{s}");
    }
}
