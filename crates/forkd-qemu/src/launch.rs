//! Starting a QEMU process: everything between a [`VmConfig`] and a running process
//! whose QMP socket answers.

use crate::vm::{Owner, QemuVm, Start, INCOMING_FD};
use crate::{cmdline, console, jail, qcow2, version, MAX_SOCKET_PATH};
use forkd_host::cgroup::Cgroups;
use forkd_hypervisor::startup::StepClock;
use forkd_hypervisor::{HypervisorError, Vm, VmConfig};
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;
use std::process::Stdio;
use tokio::sync::{mpsc, watch};

impl QemuVm {
    /// Starts a QEMU process for `config` as `start` says and connects to it: the
    /// sockets cleared, the disk chain opened, the network namespace and cgroup made,
    /// the process spawned into them, its exit watched.
    pub(crate) async fn start(
        binary: &Path,
        config: &VmConfig,
        start: Start,
    ) -> Result<QemuVm, HypervisorError> {
        let steps = StepClock::new();
        clear_sockets(config)?;
        let log_path = config.hypervisor_log();
        let log = std::fs::File::create(&log_path)
            .map_err(|e| HypervisorError::io(format!("creating {}", log_path.display()), e))?;
        let (disk, top_rw, top_ro) = open_disk_chain(config).await?;
        let version = version::current_version(binary).map_err(HypervisorError::Config)?;
        let hardening = jail::hardening(config, version)?;
        steps.end("disk chain and jail");
        // A receiver never runs its guest: its NIC needs no link behind it.
        let network = match (&config.network, &start) {
            (Some(net), Start::Boot | Start::Restore(_)) => {
                Some(forkd_host::network::create(&net.policy).await?)
            }
            _ => None,
        };
        let tap = network.is_some();
        steps.end("network");
        let (args, incoming) = match start {
            Start::Boot => (cmdline::build(config, &disk, &hardening, tap), None),
            Start::Restore(file) => (
                cmdline::build_restore(config, &disk, &hardening, tap),
                Some(file),
            ),
            Start::Receive => (cmdline::build_receiver(config, &disk, &hardening), None),
        };
        let mut inherited = vec![
            (top_rw.as_fd(), cmdline::DISK_RW_FD),
            (top_ro.as_fd(), cmdline::DISK_RO_FD),
        ];
        if let Some(file) = &incoming {
            inherited.push((file.as_fd(), INCOMING_FD));
        }
        if let Some(net) = &network {
            inherited.push((net.tap.as_fd(), cmdline::TAP_FD));
        }
        let inherited = Inherited::new(&inherited)
            .map_err(|e| HypervisorError::io("passing descriptors to QEMU", e))?;
        // A jailed QEMU loses its parent-death signal when it changes user: one bound
        // to this process is tied to it by a lifeline instead (which it is spawned
        // through, from a thread that ends at once: the signal would follow that thread).
        let lifeline = match (&hardening.jail, config.detached) {
            (Some(_), false) => Some(forkd_host::lifeline::Lifeline::new().map_err(|e| {
                HypervisorError::io(format!("making the PID namespace of VM {}", config.id), e)
            })?),
            _ => None,
        };
        if lifeline.is_some() {
            steps.end("lifeline");
        }
        let cgroup = make_cgroup(config)?;
        steps.end("cgroup");
        let mut cmd = command(binary, config, &args, log, lifeline.is_none());
        let keep = match hardening.jail {
            Some(_) => forkd_host::caps::JAILED,
            None => &[],
        };
        forkd_host::caps::restrict(&mut cmd, keep);
        let procs = join_cgroup_before_exec(&mut cmd, config, cgroup.as_ref())?;
        if let Some(net) = &network {
            enter_netns_before_exec(&mut cmd, net);
        }
        let moves = inherited.moves();
        // SAFETY: runs in the forked child before exec; `place` only calls dup2(2),
        // which is async-signal-safe, on descriptors `inherited` keeps open until spawn
        // returns.
        unsafe {
            cmd.pre_exec(move || Inherited::place(&moves));
        }
        tracing::debug!(id = %config.id, "starting {} {:?}", binary.display(), args);
        let spawned = match &lifeline {
            Some(lifeline) => lifeline.spawn(&mut cmd),
            None => cmd.spawn(),
        };
        drop((procs, inherited, top_rw, top_ro, network));
        let child = match spawned {
            Ok(child) => child,
            Err(source) => {
                if let Some(made) = &cgroup {
                    made.remove();
                }
                return Err(HypervisorError::Spawn {
                    program: binary.display().to_string(),
                    source,
                    install: "apt-get install qemu-system-x86",
                });
            }
        };
        drop(incoming);
        steps.end("spawn");
        let pid = child.id().unwrap_or(0);
        let placed = cgroup.and_then(|_| PlacedCgroup::of(config));
        let (console, console_done) = read_console(config);
        let (exit, kill) = watch_exit(child, lifeline, placed, console_done);
        let vm = QemuVm::connect(
            binary,
            config,
            pid,
            exit,
            Owner::Spawned(kill),
            console,
            steps,
        )
        .await?;
        vm.steps.end("QEMU up (control socket)");
        if tap
            && config.network.as_ref().map(|n| n.policy.egress)
                == Some(forkd_host::network::policy::EgressMode::Off)
        {
            if let Err(e) = vm.set_link(false).await {
                vm.kill();
                return Err(e);
            }
        }
        Ok(vm)
    }
}

/// Checks that the VM's sockets fit in a socket address, and removes what an earlier
/// QEMU of the same directory left there.
fn clear_sockets(config: &VmConfig) -> Result<(), HypervisorError> {
    for sock in [
        config.agent_socket(),
        config.qmp_socket(),
        config.console_socket(),
    ] {
        if sock.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(HypervisorError::Config(format!(
                "socket path {} is longer than {MAX_SOCKET_PATH} bytes; use a shorter FORKD_HOME",
                sock.display()
            )));
        }
        let _ = std::fs::remove_file(&sock);
    }
    Ok(())
}

/// [`open_disk`] off the async threads.
async fn open_disk_chain(
    config: &VmConfig,
) -> Result<(cmdline::Disk, std::fs::File, std::fs::File), HypervisorError> {
    let top = config.root_disk.clone();
    tokio::task::spawn_blocking(move || open_disk(&top))
        .await
        .map_err(|e| HypervisorError::io("reading the disk chain", std::io::Error::other(e)))?
        .map_err(|e| {
            HypervisorError::io(
                format!("reading the disk chain of {}", config.root_disk.display()),
                e,
            )
        })
}

/// The QEMU command: its arguments, stderr to `log`, its session or process group,
/// its scheduling, and (`pdeathsig`) death with this process when it owns the VM.
fn command(
    binary: &Path,
    config: &VmConfig,
    args: &[std::ffi::OsString],
    log: std::fs::File,
    pdeathsig: bool,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(binary);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(!config.detached);
    if config.detached {
        forkd_host::process::start_detached(&mut cmd);
    } else {
        // Own process group: a Ctrl-C meant for the CLI must not reach the VM
        // directly; the CLI tears it down itself.
        cmd.process_group(0);
    }
    if !config.detached && pdeathsig {
        // A VM this process owns dies with it even when it is killed outright
        // (kill -9 of `forkd run`, or of a daemon in the middle of a template
        // build), instead of running on with nobody to stop it. The signal follows
        // the spawning *thread*: spawns come from the runtime's threads, which live
        // as long as the process does.
        // SAFETY: runs in the forked child before exec and only calls prctl(2),
        // which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                    .map_err(std::io::Error::from)
            });
        }
    }
    forkd_host::sched::schedule(&mut cmd, config.accel == forkd_hypervisor::Accel::Tcg);
    cmd
}

/// Has the child join `cgroup` before exec, so that QEMU's first allocation is already
/// counted and bounded. Returns the cgroup's files, opened here, which must stay open
/// until the spawn returns.
fn join_cgroup_before_exec(
    cmd: &mut tokio::process::Command,
    config: &VmConfig,
    cgroup: Option<&forkd_host::cgroup::VmCgroup>,
) -> Result<Vec<std::fs::File>, HypervisorError> {
    let procs = match cgroup {
        Some(made) => made.procs_files().map_err(|e| {
            made.remove();
            HypervisorError::io(format!("joining the cgroup of VM {}", config.id), e)
        })?,
        None => Vec::new(),
    };
    if !procs.is_empty() {
        let fds: Vec<std::os::fd::RawFd> = procs.iter().map(|f| f.as_raw_fd()).collect();
        // SAFETY: runs in the forked child before exec; `join` only calls write(2) on
        // descriptors `procs` keeps open until spawn returns.
        unsafe {
            cmd.pre_exec(move || forkd_host::cgroup::join(&fds));
        }
    }
    Ok(procs)
}

/// Has the child enter the sandbox's network namespace before exec (and before the
/// descriptors are placed, which may reuse this one's number).
fn enter_netns_before_exec(
    cmd: &mut tokio::process::Command,
    net: &forkd_host::network::SandboxNetwork,
) {
    let netns = net.netns.as_raw_fd();
    // SAFETY: runs in the forked child before exec and only calls setns(2) on a
    // descriptor `net` keeps open until spawn returns.
    unsafe {
        cmd.pre_exec(move || {
            let fd = std::os::fd::BorrowedFd::borrow_raw(netns);
            nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(std::io::Error::from)
        });
    }
}

/// Waits for the QEMU process in a task of its own: its exit (with the console's last
/// bytes copied and its cgroup released) is published on the returned channel, and a
/// message on the returned sender kills it.
fn watch_exit(
    mut child: tokio::process::Child,
    lifeline: Option<forkd_host::lifeline::Lifeline>,
    placed: Option<PlacedCgroup>,
    console_done: tokio::task::JoinHandle<()>,
) -> (watch::Receiver<Option<String>>, mpsc::UnboundedSender<()>) {
    let (exit_tx, exit) = watch::channel(None);
    let (kill_tx, mut kill_rx) = mpsc::unbounded_channel::<()>();
    tokio::spawn(async move {
        let status = tokio::select! {
            s = child.wait() => s,
            // Only an explicit request kills: the sender is also dropped when the
            // handle goes away, which must leave a detached VM running.
            Some(()) = kill_rx.recv() => {
                let _ = child.start_kill();
                child.wait().await
            }
        };
        drop(lifeline);
        let desc = match status {
            Ok(s) => s.to_string(),
            Err(e) => format!("wait failed: {e}"),
        };
        // Whoever hears of the exit may quote the console: let its last bytes land.
        let _ = tokio::time::timeout(console::DRAIN_TIMEOUT, console_done).await;
        let desc = PlacedCgroup::release(placed, desc).await;
        let _ = exit_tx.send(Some(desc));
    });
    (exit, kill_tx)
}

/// Reads the root disk's chain and opens its top layer read-write and read-only (see
/// [`cmdline::DISK_FDSET`]).
fn open_disk(top: &Path) -> std::io::Result<(cmdline::Disk, std::fs::File, std::fs::File)> {
    let chain = qcow2::backing_chain(top)?;
    let (backing_levels, base) = (chain.len(), chain.into_iter().next());
    let rw = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(top)?;
    let ro = std::fs::File::open(top)?;
    let disk = cmdline::Disk {
        backing_levels,
        base,
    };
    Ok((disk, rw, ro))
}

/// Descriptors a QEMU inherits at fixed numbers. Each is first duplicated above every
/// target number (close-on-exec, so nothing else inherits it): moving one to its
/// number in the child can then never overwrite another still to be moved.
struct Inherited(Vec<(std::os::fd::OwnedFd, i32)>);

impl Inherited {
    /// Lowest number the duplicates take.
    const ABOVE: i32 = 64;

    fn new(fds: &[(std::os::fd::BorrowedFd<'_>, i32)]) -> std::io::Result<Inherited> {
        fds.iter()
            .map(|(fd, target)| {
                let dup = nix::fcntl::fcntl(
                    fd.as_raw_fd(),
                    nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(Self::ABOVE),
                )
                .map_err(std::io::Error::from)?;
                // SAFETY: fcntl just returned this new descriptor; nothing else owns it.
                let owned =
                    unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(dup) };
                Ok((owned, *target))
            })
            .collect::<std::io::Result<Vec<_>>>()
            .map(Inherited)
    }

    /// (source, target) pairs for [`Inherited::place`].
    fn moves(&self) -> Vec<(i32, i32)> {
        self.0.iter().map(|(fd, t)| (fd.as_raw_fd(), *t)).collect()
    }

    /// In the child: puts each descriptor at its number, without close-on-exec.
    fn place(moves: &[(i32, i32)]) -> std::io::Result<()> {
        for &(from, to) in moves {
            // SAFETY: dup2 on descriptors open in this process; `from` is never a
            // target (see `ABOVE`).
            if unsafe { libc::dup2(from, to) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// Makes the cgroup of a VM with limits, when VMs get cgroups here.
fn make_cgroup(config: &VmConfig) -> Result<Option<forkd_host::cgroup::VmCgroup>, HypervisorError> {
    let Some(limits) = &config.limits else {
        return Ok(None);
    };
    let Some(cgroups) = forkd_host::cgroup::for_vms().map_err(HypervisorError::Config)? else {
        return Ok(None);
    };
    limits
        .check(config.memory_mib)
        .map_err(HypervisorError::Config)?;
    let made = cgroups
        .create(&config.id, limits)
        .map_err(|e| HypervisorError::io(format!("making the cgroup of VM {}", config.id), e))?;
    Ok(Some(made))
}

/// The cgroup a VM's QEMU runs in, as its exit watcher knows it.
pub(crate) struct PlacedCgroup {
    cgroups: &'static Cgroups,
    id: String,
    limit: u64,
}

impl PlacedCgroup {
    pub(crate) fn of(config: &VmConfig) -> Option<PlacedCgroup> {
        Some(PlacedCgroup {
            cgroups: vm_cgroups(config)?,
            id: config.id.clone(),
            limit: config.limits?.memory_bytes,
        })
    }

    /// Once QEMU has exited: `desc` (how it exited), with the reason when the kernel
    /// stopped it for its memory limit (the cgroup's OOM-kill counter, read first), and
    /// the cgroup removed.
    pub(crate) async fn release(placed: Option<PlacedCgroup>, desc: String) -> String {
        let Some(p) = placed else {
            return desc;
        };
        let released = tokio::task::spawn_blocking(move || {
            let kills = p.cgroups.oom_kills(&p.id).unwrap_or(0);
            p.cgroups.remove(&p.id);
            (kills, p.limit)
        })
        .await;
        match released {
            Ok((kills, limit)) if kills > 0 => format!(
                "{desc}: the kernel stopped it for reaching its memory limit of {} MiB",
                limit >> 20
            ),
            _ => desc,
        }
    }
}

/// The cgroups a VM with limits was placed in, if VMs get cgroups here.
pub(crate) fn vm_cgroups(config: &VmConfig) -> Option<&'static Cgroups> {
    config.limits?;
    forkd_host::cgroup::for_vms().ok().flatten()
}

/// Starts copying `config`'s console into its capped log, within the limit in force.
pub(crate) fn read_console(config: &VmConfig) -> (console::Reader, tokio::task::JoinHandle<()>) {
    console::spawn(
        config.console_socket(),
        config.console_log(),
        forkd_proto::limits::get().console_cap,
    )
}

/// QEMU refusing to start because the host cannot provide the guest's (enforced) CPU
/// model, said as such: the usual reason a snapshot from another host does not fork.
pub(crate) fn cpu_model_error(config: &VmConfig, e: HypervisorError) -> HypervisorError {
    let HypervisorError::EarlyExit { stderr, .. } = &e else {
        return e;
    };
    let refused = stderr.contains("doesn't support requested feature")
        || stderr.contains("unable to find CPU model");
    if !refused || matches!(config.cpu.as_str(), "" | "host" | "max") {
        return e;
    }
    let features: Vec<&str> = stderr
        .lines()
        .filter_map(|l| l.split_once("requested feature: ").map(|(_, f)| f.trim()))
        .collect();
    let missing = if features.is_empty() {
        "QEMU does not know it".to_owned()
    } else {
        format!("missing {}", features.join(", "))
    };
    HypervisorError::CpuModel {
        model: config.cpu.clone(),
        accel: config.accel,
        missing,
    }
}
