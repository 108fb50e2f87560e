//! The QEMU backend: one `qemu-system-x86_64` process per VM, driven over QMP.

mod branch;
pub mod cmdline;
pub mod console;
pub mod jail;
pub mod qcow2;
pub mod qmp;
pub mod version;

use async_trait::async_trait;
use forkd_host::cgroup::Cgroups;
use forkd_hypervisor::{HypervisorError, Vm, VmConfig, VmStatus};
use qmp::Qmp;
use serde_json::json;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// How long QEMU may take to bring up its QMP socket.
const QMP_TIMEOUT: Duration = Duration::from_secs(20);

/// Longest unix socket path the kernel accepts (`sun_path` minus the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The QEMU backend as the hypervisor the rest of forkd holds, as an
/// `Arc<dyn Hypervisor>` that never names a backend: `$FORKD_QEMU`, else
/// `qemu-system-x86_64` from `PATH`, under KVM or TCG as each [`VmConfig`] says.
pub fn hypervisor() -> std::sync::Arc<dyn forkd_hypervisor::Hypervisor> {
    std::sync::Arc::new(Qemu::from_env())
}

/// The QEMU backend.
#[derive(Debug, Clone)]
pub struct Qemu {
    binary: PathBuf,
}

impl Qemu {
    /// Uses `$FORKD_QEMU`, else `qemu-system-x86_64` from `PATH`.
    pub fn from_env() -> Qemu {
        let binary = std::env::var_os("FORKD_QEMU")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("qemu-system-x86_64"));
        Qemu { binary }
    }

    /// The QEMU program this backend starts.
    pub fn binary(&self) -> &Path {
        &self.binary
    }
}

#[async_trait]
impl forkd_hypervisor::Hypervisor for Qemu {
    fn name(&self) -> &'static str {
        "qemu"
    }

    fn version(&self) -> Result<String, HypervisorError> {
        version::current_version(&self.binary)
            .map(|v| v.to_string())
            .map_err(HypervisorError::Config)
    }

    async fn create_disk_layer(
        &self,
        layer: forkd_hypervisor::DiskLayer<'_>,
    ) -> Result<(), HypervisorError> {
        let format = match layer.base_format {
            forkd_hypervisor::DiskFormat::Raw => qcow2::BaseFormat::Raw,
            forkd_hypervisor::DiskFormat::Layer => qcow2::BaseFormat::Qcow2,
        };
        let (base, name) = if let Some(named) = layer.named {
            let name = named.to_str().map(str::to_owned).ok_or_else(|| {
                HypervisorError::Config(format!("{} is not UTF-8", named.display()))
            })?;
            (layer.base.to_owned(), name)
        } else if layer.relative {
            // Named relative to the layer's directory, so that the two move together.
            let name = layer
                .base
                .to_str()
                .filter(|n| !n.contains('/'))
                .ok_or_else(|| {
                    HypervisorError::Config(format!(
                        "relative backing file {} must be a plain UTF-8 file name",
                        layer.base.display()
                    ))
                })?;
            let dir = layer.path.parent().unwrap_or(Path::new("."));
            (dir.join(name), name.to_owned())
        } else {
            let abs = std::path::absolute(layer.base).map_err(|e| {
                HypervisorError::io(format!("resolving {}", layer.base.display()), e)
            })?;
            let name = abs.to_str().map(str::to_owned).ok_or_else(|| {
                HypervisorError::Config(format!("{} is not UTF-8", abs.display()))
            })?;
            (abs, name)
        };
        let (path, base2) = (layer.path.to_owned(), base.clone());
        // A few small writes and an fsync: off the async threads.
        tokio::task::spawn_blocking(move || qcow2::create_overlay(&path, &base2, &name, format))
            .await
            .map_err(|e| HypervisorError::io("creating a disk layer", std::io::Error::other(e)))?
            .map_err(|e| {
                HypervisorError::io(
                    format!(
                        "creating the disk layer {} over {}",
                        layer.path.display(),
                        base.display()
                    ),
                    e,
                )
            })
    }

    fn layer_base(&self, layer: &Path) -> Result<Option<PathBuf>, HypervisorError> {
        let name = qcow2::backing_name(layer)
            .map_err(|e| HypervisorError::io(format!("reading {}", layer.display()), e))?;
        Ok(name.map(|n| layer.parent().unwrap_or(Path::new("/")).join(n)))
    }

    fn layer_base_name(&self, layer: &Path) -> std::io::Result<Option<String>> {
        qcow2::backing_name(layer)
    }

    fn set_layer_base_name(&self, layer: &Path, name: &str) -> std::io::Result<()> {
        qcow2::set_backing_name(layer, name)
    }

    fn check_foreign_layer(&self, layer: &Path) -> std::io::Result<()> {
        qcow2::check_foreign(layer)
    }

    async fn layer_to_raw(&self, top: &Path, out: &Path) -> Result<(), HypervisorError> {
        qcow2::to_raw(top, out).await
    }

    fn restore_refusal(&self, made: &str) -> Option<String> {
        version::release_refusal(made, &self.version().ok()?)
    }

    fn disk_size(&self, layer: &Path) -> Option<u64> {
        qcow2::virtual_size(layer, qcow2::BaseFormat::Qcow2).ok()
    }

    async fn flatten_disk(
        &self,
        top: &Path,
        base: &Path,
        out: &Path,
    ) -> Result<(), HypervisorError> {
        qcow2::flatten(top, base, out).await
    }

    async fn boot(&self, config: &VmConfig) -> Result<Box<dyn Vm>, HypervisorError> {
        Ok(Box::new(
            QemuVm::start(&self.binary, config, Start::Boot).await?,
        ))
    }

    async fn prepare_restore(
        &self,
        config: &VmConfig,
        state: &Path,
    ) -> Result<Box<dyn forkd_hypervisor::PreparedVm>, HypervisorError> {
        let file = std::fs::File::open(state)
            .map_err(|e| HypervisorError::io(format!("opening {}", state.display()), e))?;
        let vm = QemuVm::start(&self.binary, config, Start::Restore(file)).await?;
        // Set now, so that finishing is only the migration and `cont`.
        if let Err(e) = vm.set_ignore_shared().await {
            vm.kill();
            vm.wait_exit().await;
            return Err(vm.explain_exit(e));
        }
        Ok(Box::new(PreparedQemu(vm)))
    }

    async fn adopt(
        &self,
        config: &VmConfig,
        pid: u32,
        start_time: u64,
    ) -> Result<Box<dyn Vm>, HypervisorError> {
        Ok(Box::new(
            QemuVm::adopt(&self.binary, config, pid, start_time).await?,
        ))
    }
}

/// How a QEMU process starts.
enum Start {
    /// Boots the guest.
    Boot,
    /// Waits for device state from this file (see [`INCOMING_FD`]).
    Restore(std::fs::File),
    /// Waits, never to run, for a whole VM over a migration stream (a branch's receiver).
    Receive,
}

/// The descriptor number a restored QEMU reads its incoming device state from.
const INCOMING_FD: i32 = 3;

/// How long a migration (save or restore of device state) may take.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(120);

/// Who may end the QEMU process.
enum Owner {
    /// We spawned it: the wait task holds the child and kills it on request.
    Spawned(mpsc::UnboundedSender<()>),
    /// Another process started it; we know it by pid and start time.
    Adopted { start_time: u64 },
}

/// One QEMU process and its QMP session.
pub struct QemuVm {
    /// The QEMU program (a branch starts a second QEMU of the same build).
    binary: PathBuf,
    config: VmConfig,
    pid: u32,
    qmp: Qmp,
    exit: watch::Receiver<Option<String>>,
    owner: Owner,
    /// Copies the console to its capped log while this handle lives.
    _console: console::Reader,
}

impl QemuVm {
    async fn start(
        binary: &Path,
        config: &VmConfig,
        start: Start,
    ) -> Result<QemuVm, HypervisorError> {
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
        let log_path = config.hypervisor_log();
        let log = std::fs::File::create(&log_path)
            .map_err(|e| HypervisorError::io(format!("creating {}", log_path.display()), e))?;
        let top = config.root_disk.clone();
        let (disk, top_rw, top_ro) = tokio::task::spawn_blocking(move || open_disk(&top))
            .await
            .map_err(|e| HypervisorError::io("reading the disk chain", std::io::Error::other(e)))?
            .map_err(|e| {
                HypervisorError::io(
                    format!("reading the disk chain of {}", config.root_disk.display()),
                    e,
                )
            })?;
        let version = version::current_version(binary).map_err(HypervisorError::Config)?;
        let hardening = jail::hardening(config, version)?;
        // A receiver never runs its guest: its NIC needs no link behind it.
        let network = match (&config.network, &start) {
            (Some(net), Start::Boot | Start::Restore(_)) => {
                Some(forkd_host::network::create(&net.policy).await?)
            }
            _ => None,
        };
        let tap = network.is_some();
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
        let cgroup = make_cgroup(config)?;
        let mut cmd = tokio::process::Command::new(binary);
        cmd.args(&args)
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
        if !config.detached && lifeline.is_none() {
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
        let keep = match hardening.jail {
            Some(_) => forkd_host::caps::JAILED,
            None => &[],
        };
        forkd_host::caps::restrict(&mut cmd, keep);
        // Opened here, written by the child before exec: QEMU's first allocation is
        // already counted and bounded.
        let procs = match &cgroup {
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
        if let Some(net) = &network {
            let netns = net.netns.as_raw_fd();
            // Before the descriptors are placed, which may reuse this one's number.
            // SAFETY: runs in the forked child before exec and only calls setns(2) on a
            // descriptor `network` keeps open until spawn returns.
            unsafe {
                cmd.pre_exec(move || {
                    let fd = std::os::fd::BorrowedFd::borrow_raw(netns);
                    nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(std::io::Error::from)
                });
            }
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
        let mut child = match spawned {
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
        let pid = child.id().unwrap_or(0);
        let placed = cgroup.and_then(|_| PlacedCgroup::of(config));
        let (console, console_done) = read_console(config);
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
        let vm =
            QemuVm::connect(binary, config, pid, exit, Owner::Spawned(kill_tx), console).await?;
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

    /// Takes over a QEMU another process started (a detached VM, or one a restarted
    /// daemon finds): checks that `pid` is still the process that started at
    /// `start_time`, then connects to its QMP socket.
    async fn adopt(
        binary: &Path,
        config: &VmConfig,
        pid: u32,
        start_time: u64,
    ) -> Result<QemuVm, HypervisorError> {
        let gone = || HypervisorError::NotRunning {
            id: config.id.clone(),
            pid,
        };
        let pidfd = forkd_host::process::PidFd::open_checked(pid, start_time).ok_or_else(gone)?;
        // The cgroup its starter made goes when it exits.
        let placed = PlacedCgroup::of(config);
        // QEMU went on listening for a console reader when the one before went away.
        let (console, console_done) = read_console(config);
        let (exit_tx, exit) = watch::channel(None);
        tokio::spawn(async move {
            let desc = match pidfd.exited().await {
                Ok(()) => "exited".to_string(),
                Err(e) => format!("watching the process failed: {e}"),
            };
            let _ = tokio::time::timeout(console::DRAIN_TIMEOUT, console_done).await;
            let desc = PlacedCgroup::release(placed, desc).await;
            let _ = exit_tx.send(Some(desc));
        });
        QemuVm::connect(
            binary,
            config,
            pid,
            exit,
            Owner::Adopted { start_time },
            console,
        )
        .await
    }

    async fn connect(
        binary: &Path,
        config: &VmConfig,
        pid: u32,
        exit: watch::Receiver<Option<String>>,
        owner: Owner,
        console: console::Reader,
    ) -> Result<QemuVm, HypervisorError> {
        let log_path = config.hypervisor_log();
        let exit_probe = exit.clone();
        let qmp = Qmp::connect(&config.qmp_socket(), QMP_TIMEOUT, || {
            match exit_probe.borrow().clone() {
                None => Ok(()),
                Some(status) => Err(HypervisorError::EarlyExit {
                    program: "QEMU",
                    status,
                    stderr: forkd_host::capped_log::tail(&log_path, 20),
                }),
            }
        })
        .await;
        let qmp = qmp.map_err(|e| cpu_model_error(config, e));
        match qmp {
            Ok(qmp) => Ok(QemuVm {
                binary: binary.to_owned(),
                config: config.clone(),
                pid,
                qmp,
                exit,
                owner,
                _console: console,
            }),
            Err(e) => {
                if let Owner::Spawned(kill) = &owner {
                    let _ = kill.send(());
                    let mut exit = exit.clone();
                    let _ = exit.wait_for(|s| s.is_some()).await;
                }
                let status = exit.borrow().clone();
                Err(match (e, status) {
                    // QEMU may have died between the last probe and here: say why.
                    (
                        HypervisorError::ControlClosed(_) | HypervisorError::ControlTimeout { .. },
                        Some(status),
                    ) => cpu_model_error(
                        config,
                        HypervisorError::EarlyExit {
                            program: "QEMU",
                            status,
                            stderr: forkd_host::capped_log::tail(&log_path, 20),
                        },
                    ),
                    (other, _) => other,
                })
            }
        }
    }

    /// Sets the guest's NIC's link state, as the guest sees it (carrier).
    async fn set_link(&self, up: bool) -> Result<(), HypervisorError> {
        self.qmp
            .execute(
                "set_link",
                Some(json!({ "name": cmdline::NIC_ID, "up": up })),
            )
            .await
            .map(drop)
    }

    /// Reads the device state from [`INCOMING_FD`] and starts the vCPUs. RAM is not in
    /// the stream (`x-ignore-shared`, set when the VM was prepared): it is the file the
    /// memory backend maps.
    async fn incoming(&self) -> Result<(), HypervisorError> {
        // Subscribed before the migration starts: its MIGRATION events end the wait
        // (no polling loop on the fork path).
        let events = self.qmp.events();
        self.qmp
            .execute(
                "migrate-incoming",
                Some(json!({ "uri": format!("fd:{INCOMING_FD}") })),
            )
            .await?;
        let status = self.migration_end(events).await?;
        if status != "completed" {
            return Err(self.migration_failed("incoming state", &status).await);
        }
        self.qmp.execute("cont", None).await.map(drop)
    }

    /// Waits for the migration under way to end and returns its final status
    /// (`completed`, `failed` or `cancelled`), from QEMU's MIGRATION events; if events
    /// were missed (a lagging subscriber), `query-migrate` says where it stands.
    async fn migration_end(
        &self,
        events: tokio::sync::broadcast::Receiver<serde_json::Value>,
    ) -> Result<String, HypervisorError> {
        self.migration_reaches(events, &[]).await
    }

    /// Like [`QemuVm::migration_end`], also returning when the migration reaches one of
    /// `stops` (such as `pre-switchover`).
    async fn migration_reaches(
        &self,
        mut events: tokio::sync::broadcast::Receiver<serde_json::Value>,
        stops: &[&str],
    ) -> Result<String, HypervisorError> {
        use tokio::sync::broadcast::error::RecvError;
        let ended =
            |s: &str| matches!(s, "completed" | "failed" | "cancelled") || stops.contains(&s);
        let wait = async {
            // It may have got there before the subscription saw it.
            let now = self.qmp.execute("query-migrate", None).await?;
            if let Some(s) = now["status"].as_str().filter(|s| ended(s)) {
                return Ok(s.to_owned());
            }
            loop {
                match events.recv().await {
                    Ok(ev) if ev["event"] == "MIGRATION" => {
                        if let Some(s) = ev["data"]["status"].as_str().filter(|s| ended(s)) {
                            return Ok(s.to_owned());
                        }
                    }
                    Ok(_) => {}
                    Err(RecvError::Lagged(_)) => {
                        let now = self.qmp.execute("query-migrate", None).await?;
                        if let Some(s) = now["status"].as_str().filter(|s| ended(s)) {
                            return Ok(s.to_owned());
                        }
                    }
                    Err(RecvError::Closed) => {
                        return Err(HypervisorError::ControlClosed(
                            "QEMU closed its QMP socket during a migration".into(),
                        ))
                    }
                }
            }
        };
        tokio::time::timeout(MIGRATION_TIMEOUT, wait)
            .await
            .map_err(|_| HypervisorError::MigrationTimeout {
                secs: MIGRATION_TIMEOUT.as_secs(),
            })?
    }

    /// The error of a migration that ended as `status`, with QEMU's reason.
    async fn migration_failed(&self, what: &str, status: &str) -> HypervisorError {
        let detail = match self.qmp.execute("query-migrate", None).await {
            Ok(m) => m["error-desc"].as_str().unwrap_or("no detail").to_owned(),
            Err(e) => e.to_string(),
        };
        HypervisorError::Migration(format!("{what} ended as {status}: {detail}"))
    }

    /// For a save or restore of device state: RAM in a shared file is left out.
    async fn set_ignore_shared(&self) -> Result<(), HypervisorError> {
        self.set_capabilities(true, false).await
    }

    /// Sets the migration capabilities forkd uses, MIGRATION events always: the end of
    /// a migration is waited for, not polled.
    async fn set_capabilities(
        &self,
        ignore_shared: bool,
        pause_before_switchover: bool,
    ) -> Result<(), HypervisorError> {
        self.qmp
            .execute(
                "migrate-set-capabilities",
                Some(json!({ "capabilities": [
                    { "capability": "x-ignore-shared", "state": ignore_shared },
                    { "capability": "pause-before-switchover", "state": pause_before_switchover },
                    { "capability": "events", "state": true }
                ]})),
            )
            .await
            .map(drop)
    }

    /// A failure during start-up, explained by QEMU's exit when it exited.
    fn explain_exit(&self, e: HypervisorError) -> HypervisorError {
        match self.exit.borrow().clone() {
            Some(status) => HypervisorError::EarlyExit {
                program: "QEMU",
                status,
                stderr: format!(
                    "{e}; {}",
                    forkd_host::capped_log::tail(&self.config.hypervisor_log(), 20)
                ),
            },
            None => e,
        }
    }

    /// The QMP session, for backend-specific operations (migration, snapshots).
    pub fn qmp(&self) -> &Qmp {
        &self.qmp
    }
}

#[async_trait]
impl Vm for QemuVm {
    async fn set_egress(
        &self,
        policy: &forkd_host::network::policy::EgressPolicy,
    ) -> Result<(), HypervisorError> {
        if self.config.network.is_none() {
            return Err(HypervisorError::Network(
                "the sandbox has no NIC (its template was built with network = \"none\")".into(),
            ));
        }
        if self.exited() {
            return Err(HypervisorError::NotRunning {
                id: self.config.id.clone(),
                pid: self.pid,
            });
        }
        forkd_host::network::set_egress(self.pid, policy).await?;
        self.set_link(policy.egress != forkd_host::network::policy::EgressMode::Off)
            .await
    }

    fn exited(&self) -> bool {
        self.exit.borrow().is_some()
    }

    fn pid(&self) -> Option<u32> {
        (!self.exited()).then_some(self.pid)
    }

    async fn pause(&self) -> Result<(), HypervisorError> {
        self.qmp.execute("stop", None).await.map(drop)
    }

    fn can_branch(&self, mode: forkd_hypervisor::BranchMode) -> Result<(), String> {
        // The receiver is started from the installed program, which an upgrade may have
        // replaced since this VM started: a migration stream is only read by its release.
        let installed = version::current_version(&self.binary).ok();
        if let (Some(running), Some(installed)) = (self.qmp.version(), installed) {
            if (running.0, running.1) != (installed.0, installed.1) {
                return Err(format!(
                    "it runs QEMU {running} and the installed QEMU is {installed}, which cannot receive its state; fork a new sandbox to branch from"
                ));
            }
        }
        match mode {
            forkd_hypervisor::BranchMode::Live => {
                branch::live_copy_is_faithful(self.config.accel, self.qmp.version())
            }
            forkd_hypervisor::BranchMode::Pause => Ok(()),
        }
    }

    async fn branch(
        &self,
        mode: forkd_hypervisor::BranchMode,
        plan: &forkd_hypervisor::BranchPlan,
    ) -> Result<forkd_hypervisor::BranchStats, HypervisorError> {
        self.can_branch(mode).map_err(HypervisorError::Config)?;
        self.branch_into(mode, plan).await
    }

    async fn abandon_branch(&self) -> Result<Option<PathBuf>, HypervisorError> {
        self.abandon_migration().await?;
        self.disk_top().await.map(Some)
    }

    async fn resume(&self) -> Result<(), HypervisorError> {
        self.qmp.execute("cont", None).await.map(drop)
    }

    async fn status(&self) -> Result<VmStatus, HypervisorError> {
        if self.exited() {
            return Ok(VmStatus::Exited);
        }
        let v = match self.qmp.execute("query-status", None).await {
            Ok(v) => v,
            Err(_) if self.exited() => return Ok(VmStatus::Exited),
            Err(e) => return Err(e),
        };
        Ok(match v["status"].as_str().unwrap_or("") {
            "running" => VmStatus::Running,
            "paused" | "inmigrate" | "postmigrate" | "prelaunch" => VmStatus::Paused,
            "guest-panicked" => VmStatus::GuestPanicked,
            "shutdown" => VmStatus::Shutdown,
            "internal-error" => VmStatus::InternalError,
            _ => VmStatus::Other,
        })
    }

    async fn wait_exit(&self) -> String {
        forkd_host::process::wait_for_exit(&self.exit).await
    }

    async fn stop(&self, grace: Duration) -> Result<(), HypervisorError> {
        if self.exited() {
            return Ok(());
        }
        // `quit` may race with QEMU exiting on its own; either way we wait for the exit.
        let _ = tokio::time::timeout(grace, self.qmp.execute("quit", None)).await;
        if tokio::time::timeout(grace, self.wait_exit()).await.is_err() {
            tracing::warn!(id = %self.config.id, "QEMU did not quit within {grace:?}; killing it");
            self.kill();
            self.wait_exit().await;
        }
        Ok(())
    }

    fn start_time(&self) -> Option<u64> {
        match self.owner {
            Owner::Adopted { start_time } => Some(start_time),
            Owner::Spawned(_) => forkd_host::process::start_time(self.pid),
        }
    }

    async fn save_state(&self, out: &Path) -> Result<(), HypervisorError> {
        let file = std::fs::File::create(out)
            .map_err(|e| HypervisorError::io(format!("creating {}", out.display()), e))?;
        self.qmp.execute("stop", None).await?;
        self.set_ignore_shared().await?;
        self.qmp
            .execute_with_fd(
                "getfd",
                Some(json!({ "fdname": STATE_FD_NAME })),
                file.as_fd(),
            )
            .await?;
        let events = self.qmp.events();
        self.qmp
            .execute(
                "migrate",
                Some(json!({ "uri": format!("fd:{STATE_FD_NAME}") })),
            )
            .await?;
        let status = self.migration_end(events).await?;
        if status != "completed" {
            return Err(self
                .migration_failed("saving the device state", &status)
                .await);
        }
        file.sync_all()
            .map_err(|e| HypervisorError::io(format!("syncing {}", out.display()), e))
    }

    fn kill(&self) {
        match &self.owner {
            Owner::Spawned(kill) => {
                let _ = kill.send(());
            }
            Owner::Adopted { start_time } => {
                if !self.exited() {
                    forkd_host::process::signal(
                        self.pid,
                        *start_time,
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
    }

    fn console_tail(&self, lines: usize) -> String {
        forkd_host::capped_log::tail(&self.config.console_log(), lines)
    }

    fn cgroup(
        &self,
    ) -> Option<(
        forkd_host::cgroup::CgroupVersion,
        forkd_host::cgroup::CgroupUsage,
    )> {
        let cgroups = vm_cgroups(&self.config)?;
        Some((cgroups.version(), cgroups.usage(&self.config.id)?))
    }
}

/// A QEMU started with `-incoming defer` and its device state open as [`INCOMING_FD`].
pub struct PreparedQemu(QemuVm);

#[async_trait]
impl forkd_hypervisor::PreparedVm for PreparedQemu {
    fn pid(&self) -> Option<u32> {
        self.0.pid()
    }

    fn start_time(&self) -> Option<u64> {
        self.0.start_time()
    }

    fn exited(&self) -> bool {
        self.0.exited()
    }

    async fn finish(self: Box<Self>) -> Result<Box<dyn Vm>, HypervisorError> {
        let vm = self.0;
        if let Err(e) = vm.incoming().await {
            vm.kill();
            vm.wait_exit().await;
            return Err(vm.explain_exit(e));
        }
        Ok(Box::new(vm))
    }

    async fn discard(self: Box<Self>) {
        self.0.kill();
        self.0.wait_exit().await;
    }
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        // A detached or adopted VM belongs to whoever holds its record, not this handle.
        if !self.config.detached && matches!(self.owner, Owner::Spawned(_)) {
            self.kill();
        }
    }
}

/// The name under which the device-state file is handed to QEMU (`getfd`).
const STATE_FD_NAME: &str = "forkd-state";

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
struct PlacedCgroup {
    cgroups: &'static Cgroups,
    id: String,
    limit: u64,
}

impl PlacedCgroup {
    fn of(config: &VmConfig) -> Option<PlacedCgroup> {
        Some(PlacedCgroup {
            cgroups: vm_cgroups(config)?,
            id: config.id.clone(),
            limit: config.limits?.memory_bytes,
        })
    }

    /// Once QEMU has exited: `desc` (how it exited), with the reason when the kernel
    /// stopped it for its memory limit (the cgroup's OOM-kill counter, read first), and
    /// the cgroup removed.
    async fn release(placed: Option<PlacedCgroup>, desc: String) -> String {
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
fn vm_cgroups(config: &VmConfig) -> Option<&'static Cgroups> {
    config.limits?;
    forkd_host::cgroup::for_vms().ok().flatten()
}

/// Starts copying `config`'s console into its capped log, within the limit in force.
fn read_console(config: &VmConfig) -> (console::Reader, tokio::task::JoinHandle<()>) {
    console::spawn(
        config.console_socket(),
        config.console_log(),
        forkd_proto::limits::get().console_cap,
    )
}

/// QEMU refusing to start because the host cannot provide the guest's (enforced) CPU
/// model, said as such: the usual reason a snapshot from another host does not fork.
fn cpu_model_error(config: &VmConfig, e: HypervisorError) -> HypervisorError {
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
