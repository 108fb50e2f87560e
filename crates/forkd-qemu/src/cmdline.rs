//! The QEMU command line for a forkd microVM.
//!
//! `-M microvm` with ACPI on: Debian's cloud kernel finds virtio-mmio devices only through
//! ACPI (it is built without `virtio_mmio.device=` support). `-nodefaults` and
//! `-no-user-config` keep QEMU from adding devices nobody asked for; `-no-reboot` turns a
//! guest reboot (and a panic, with `panic=-1`) into QEMU exiting.

use super::jail::Hardening;
use forkd_hypervisor::{Accel, GuestClock, MemoryBackend, VmConfig};
use std::ffi::OsString;

/// QEMU's seccomp filter: deny obsolete syscalls, privilege changes, spawning processes and
/// resource-control calls. Measured to work with TCG.
pub const SECCOMP: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// The filter of a jailed QEMU: the same, but QEMU's own drop to its jail's user (after
/// the filter is in place) needs setuid(2) and setgid(2). Once dropped it has no
/// capability and `no_new_privs`, so those calls can only lower what it has.
pub const SECCOMP_JAILED: &str =
    "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny";

/// The descriptor set the root disk's top layer is handed over in: QEMU opens
/// `/dev/fdset/1`, and whenever it reopens the layer (read-only while the disk is
/// inactive, read-write again after) it takes the set's descriptor of that mode instead
/// of opening a path, which a jailed QEMU could not.
pub const DISK_FDSET: u32 = 1;

/// The descriptors QEMU inherits with the top layer opened read-write and read-only.
pub const DISK_RW_FD: i32 = 4;
/// See [`DISK_RW_FD`].
pub const DISK_RO_FD: i32 = 5;

/// The descriptor QEMU inherits the guest's tap device as.
pub const TAP_FD: i32 = 6;

/// Id of the guest's NIC (QMP's `set_link` names it).
pub const NIC_ID: &str = "nic0";

/// Id of the guest-RAM memory backend object.
pub const MEMORY_ID: &str = "mem";

/// The environment variable that caps TCG's translation buffer, in MiB (QEMU's
/// `tb-size`). Unset, QEMU's default applies: the buffer grows with the code the guest
/// has run, ~26 MiB per python child after its first exec, over half of what a child
/// costs the host. A cap trades that memory for CPU: the buffer is emptied when full and
/// the code translated again (measured, 10 python children under TCG: 16 MiB cut host
/// memory per child from ~50 to ~32 MiB and made a first exec cost 10-15 % more CPU;
/// 8 MiB cost 2.4 times the CPU).
pub const TB_MIB_ENV: &str = "FORKD_TCG_TB_MIB";

/// The translation buffer cap [`TB_MIB_ENV`] asks for, read once per process; an error
/// for a value that is not a whole number of MiB from 1 to 4096. `forkd` checks it at
/// start and refuses to run with a bad one, so a VM never starts without the cap its
/// owner asked for.
pub fn tcg_tb_mib() -> Result<Option<u32>, String> {
    static CAP: std::sync::OnceLock<Result<Option<u32>, String>> = std::sync::OnceLock::new();
    CAP.get_or_init(|| {
        let Ok(value) = std::env::var(TB_MIB_ENV) else {
            return Ok(None);
        };
        match value.trim().parse::<u32>() {
            Ok(mib) if (1..=4096).contains(&mib) => Ok(Some(mib)),
            _ => Err(format!(
                "{TB_MIB_ENV}={value:?}: must be a whole number of MiB from 1 to 4096"
            )),
        }
    })
    .clone()
}

/// The value of `-accel`: under TCG, with the translation buffer cap if there is one.
fn accel_arg(accel: Accel, tb_mib: Option<u32>) -> String {
    match (accel, tb_mib) {
        (Accel::Tcg, Some(mib)) => format!("{},tb-size={mib}", accel.as_str()),
        _ => accel.as_str().to_owned(),
    }
}

/// The value of `-cpu`: a named model with `enforce` (QEMU refuses to start rather
/// than leave a feature out), else what the accelerator offers.
pub fn cpu_arg(config: &VmConfig) -> String {
    match config.cpu.as_str() {
        "" => config.accel.unpinned_cpu_model().to_owned(),
        "host" | "max" => config.cpu.clone(),
        named => format!("{named},enforce"),
    }
}

/// The root disk as QEMU gets it: its top layer's descriptors (see [`DISK_FDSET`]) and
/// the chain below.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Disk {
    /// How many images lie below the top layer (see [`super::qcow2::backing_chain`]).
    pub backing_levels: usize,
    /// The top layer's base, absolute: the name its header gives is resolved against the
    /// layer's own directory, which `/dev/fdset/1` is not.
    pub base: Option<std::path::PathBuf>,
}

/// How a VM's guest comes to run: booted from its kernel, or restored from saved state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    Boot,
    Restore,
}

/// Builds the argument vector of a VM that boots its kernel (without the program name).
/// With `tap`, the NIC (if the VM has one) is backed by the tap device at [`TAP_FD`];
/// without, it has no peer.
pub fn build(config: &VmConfig, disk: &Disk, hardening: &Hardening, tap: bool) -> Vec<OsString> {
    assemble(config, disk, hardening, tap, Start::Boot)
}

fn assemble(
    config: &VmConfig,
    disk: &Disk,
    hardening: &Hardening,
    tap: bool,
    start: Start,
) -> Vec<OsString> {
    let backing_levels = disk.backing_levels;
    let mut args = Args::default();
    let mut machine = format!(
        "microvm,acpi=on,pit={},pic=on,rtc=on",
        if config.pit { "on" } else { "off" }
    );
    if !matches!(config.memory, MemoryBackend::Anonymous) {
        machine.push_str(",memory-backend=");
        machine.push_str(MEMORY_ID);
    }
    args.push("-M").push(machine);
    args.push("-accel")
        .push(accel_arg(config.accel, tcg_tb_mib().unwrap_or_default()));
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
        if hardening.readonly_ram && !*shared {
            obj.push(",readonly=on,rom=off");
        }
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
    if start == Start::Boot {
        push_kernel(&mut args, config);
    }
    for fd in [DISK_RW_FD, DISK_RO_FD] {
        let mut add = OsString::from(format!("fd={fd},set={DISK_FDSET},opaque="));
        add.push(escape(config.root_disk.as_os_str()));
        args.push("-add-fd").push(add);
    }
    let mut drive = OsString::from(format!(
        "id=root,format=qcow2,if=none,cache=unsafe,werror=report,rerror=report,file=/dev/fdset/{DISK_FDSET}"
    ));
    // cache=unsafe: the overlay is a throwaway per-sandbox layer; its durability is the
    // snapshot layer's business, and skipping flushes keeps guest fsyncs cheap.
    // werror/rerror=report: a host disk that fills up (or fails) is an I/O error the
    // guest sees (ENOSPC, EIO), not a VM that QEMU pauses and nobody resumes.
    // locking=off on the top layer: QEMU's image locks are OFD locks, held by an open
    // file description, and the set keeps the description QEMU locked through open after
    // QEMU moves to the other one; the two would then conflict with each other. forkd
    // gives each layer to one VM itself.
    drive.push(",file.locking=off");
    drive.push(keep_page_cache(backing_levels));
    if let Some(base) = &disk.base {
        drive.push(",backing.file.filename=");
        drive.push(escape(base.as_os_str()));
    }
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

    if config.network.is_some() {
        // guest_announce=off: after every restore QEMU would have the guest send
        // gratuitous ARPs, rounds of them, for switches to learn where it moved; a child's
        // link is a tap of its own that no switch stands behind.
        let mut nic = format!(
            "virtio-net-device,id={NIC_ID},mac={},guest_announce=off",
            forkd_host::network::guest_mac()
        );
        if tap {
            args.push("-netdev")
                .push(format!("tap,id=net0,fd={TAP_FD}"));
            nic.push_str(",netdev=net0");
        }
        args.push("-device").push(nic);
    }

    let mut qmp = OsString::from("unix:");
    qmp.push(escape(config.qmp_socket().as_os_str()));
    qmp.push(",server=on,wait=off");
    args.push("-qmp").push(qmp);
    if config.seccomp {
        let filter = if hardening.jail.is_some() {
            SECCOMP_JAILED
        } else {
            SECCOMP
        };
        args.push("-sandbox").push(filter);
    }
    if let Some(jail) = &hardening.jail {
        let mut run_with = OsString::from(format!("user={}:{},chroot=", jail.uid, jail.uid));
        run_with.push(escape(jail.root.as_os_str()));
        args.push("-run-with").push(run_with);
    }
    args.0
}

/// The kernel, initramfs and command line of a VM that boots. A restored VM gets none of
/// them: its guest is past booting, and QEMU would read the whole kernel into its own
/// memory and keep it there for the firmware interface (`fw_cfg`) to hand out at a boot
/// that never comes, 13.5 MiB per child for Debian's cloud kernel. The device state
/// loads without them: `fw_cfg` saves only its read position, not its files.
fn push_kernel(args: &mut Args, config: &VmConfig) {
    args.push("-kernel").push(config.kernel.as_os_str());
    args.push("-initrd").push(config.initramfs.as_os_str());
    let mut append = config.cmdline.clone();
    if let (Accel::Tcg, GuestClock::HostTsc { khz }) = (config.accel, config.clock) {
        // Told the rate, the kernel need not watch the TSC against another clock (there
        // is none without the PIT): the watchdog woke the guest twice a second.
        append.push_str(&format!(" tsc_early_khz={khz} tsc=reliable"));
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
        // Each wakeup of an idle guest costs the host real CPU under TCG: the lockup
        // detectors and pressure-stall averaging wake it every few seconds for nothing
        // a sandbox reads (measured with the other idle fixes: 0.37 % of a host core
        // idle with them, 0.33 % without).
        append.push_str(" nowatchdog psi=0");
    }
    args.push("-append").push(append);
}

/// The command line of a VM restored from saved device state: QEMU starts with
/// `-incoming defer` and waits, paused, for `migrate-incoming` over QMP. (Giving the
/// source on the command line does not work with `x-ignore-shared`: the capability must
/// be set before the stream is read, and in QEMU 7.2 only QMP can set it in time.)
pub fn build_restore(
    config: &VmConfig,
    disk: &Disk,
    hardening: &Hardening,
    tap: bool,
) -> Vec<OsString> {
    let mut args = assemble(config, disk, hardening, tap, Start::Restore);
    args.push("-incoming".into());
    args.push("defer".into());
    args
}

/// The command line of a branch's receiver: a VM that takes in a running VM's memory
/// and devices over a migration stream and never runs (`-S`: without it QEMU would start
/// the vCPUs once the stream ends, since the source was running, and change the RAM it
/// received).
pub fn build_receiver(config: &VmConfig, disk: &Disk, hardening: &Hardening) -> Vec<OsString> {
    let mut args = build_restore(config, disk, hardening, false);
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
            pit: true,
            limits: None,
            network: None,
            seccomp: true,
            detached: false,
        }
    }

    #[test]
    fn a_nic_has_the_fixed_mac_and_a_tap_only_when_one_is_passed() {
        let mut c = config();
        assert!(!joined(&c).contains("virtio-net"));
        c.network = Some(Default::default());
        let with_tap = build(&c, &Disk::default(), &Hardening::default(), true)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            with_tap.contains(&format!("-netdev tap,id=net0,fd={TAP_FD} -device virtio-net-device,id=nic0,mac=02:66:6b:00:00:02,guest_announce=off,netdev=net0")),
            "{with_tap}"
        );
        let receiver = build_receiver(&c, &Disk::default(), &Hardening::default())
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            receiver.contains(
                "-device virtio-net-device,id=nic0,mac=02:66:6b:00:00:02,guest_announce=off "
            ) && !receiver.contains("-netdev"),
            "{receiver}"
        );
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
        joined_with(c, &Hardening::default())
    }

    fn joined_with(c: &VmConfig, h: &Hardening) -> String {
        build(c, &Disk::default(), h, false)
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
        let disk = Disk {
            backing_levels: 1,
            base: Some("/snap/a,b/disk.qcow2".into()),
        };
        let s = build(&config(), &disk, &Hardening::default(), false)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .find(|a| a.starts_with("id=root"))
            .unwrap();
        assert!(
            s.ends_with(
                "file=/dev/fdset/1,file.locking=off,file.drop-cache=off,backing.file.drop-cache=off,backing.file.filename=/snap/a,,b/disk.qcow2"
            ),
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
        // The top layer comes as a descriptor set named after its file; commas in
        // paths are doubled so QEMU does not split on them.
        assert!(
            s.contains("-add-fd fd=4,set=1,opaque=/run/x,,y/root.qcow2 -add-fd fd=5,set=1,opaque=/run/x,,y/root.qcow2 "),
            "{s}"
        );
        assert!(
            s.contains("file=/dev/fdset/1,file.locking=off,file.drop-cache=off "),
            "{s}"
        );
        assert!(s.contains("werror=report,rerror=report"), "{s}");
        assert!(!s.contains("memory-backend"), "{s}");
        assert!(!s.contains("tsc_early_khz"), "{s}");
    }

    #[test]
    fn a_translation_buffer_cap_applies_to_tcg_only() {
        assert_eq!(accel_arg(Accel::Tcg, None), "tcg");
        assert_eq!(accel_arg(Accel::Tcg, Some(16)), "tcg,tb-size=16");
        assert_eq!(accel_arg(Accel::Kvm, Some(16)), "kvm");
    }

    #[test]
    fn a_host_tsc_guest_runs_without_icount() {
        let mut c = config();
        c.clock = GuestClock::HostTsc { khz: 2_445_426 };
        c.pit = c.clock.needs_pit(c.accel);
        let s = joined(&c);
        assert!(!s.contains("-icount"), "{s}");
        assert!(s.starts_with("-M microvm,acpi=on,pit=off,"), "{s}");
        assert!(
            s.contains("-append console=ttyS0 tsc_early_khz=2445426 tsc=reliable mitigations=off nowatchdog psi=0"),
            "{s}"
        );
        assert!(
            GuestClock::Icount.needs_pit(Accel::Tcg),
            "an instruction-counting kernel calibrates against the PIT"
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
    fn only_a_booting_vm_is_given_its_kernel() {
        let c = config();
        let boot = joined(&c);
        assert!(
            boot.contains("-kernel /k -initrd /i -append console=ttyS0"),
            "{boot}"
        );
        let restore = build_restore(&c, &Disk::default(), &Hardening::default(), false)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>();
        for flag in ["-kernel", "-initrd", "-append"] {
            assert!(!restore.iter().any(|a| a == flag), "{restore:?}");
        }
        assert!(restore.ends_with(&["-incoming".into(), "defer".into()]));
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

    #[test]
    fn a_jailed_child_drops_to_its_user_in_an_empty_root_and_maps_its_ram_read_only() {
        let mut c = config();
        c.memory = MemoryBackend::File {
            path: "/snap/memory.ram".into(),
            shared: false,
        };
        let h = Hardening {
            jail: Some(super::super::jail::Jail {
                uid: 3_000_000_042,
                root: "/run/x,y/jail".into(),
            }),
            readonly_ram: true,
        };
        let s = joined_with(&c, &h);
        assert!(
            s.contains("mem-path=/snap/memory.ram,readonly=on,rom=off "),
            "{s}"
        );
        assert!(s.contains(&format!("-sandbox {SECCOMP_JAILED}")), "{s}");
        assert!(
            s.ends_with("-run-with user=3000000042:3000000042,chroot=/run/x,,y/jail"),
            "{s}"
        );
        // A template's RAM is the file itself: it stays shared and writable.
        c.memory = MemoryBackend::File {
            path: "/snap/memory.ram".into(),
            shared: true,
        };
        assert!(!joined_with(&c, &h).contains("readonly"));
    }
}
