//! One QEMU process as a [`Vm`]: its QMP session, pause and resume, device state saved
//! and restored, and its end.

use crate::launch::{cpu_model_error, read_console, vm_cgroups, PlacedCgroup};
use crate::qmp::Qmp;
use crate::{branch, cmdline, console, version, QMP_TIMEOUT};
use async_trait::async_trait;
use forkd_hypervisor::startup::{Step, StepClock};
use forkd_hypervisor::{HypervisorError, Vm, VmConfig, VmStatus};
use serde_json::json;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// How a QEMU process starts.
pub(crate) enum Start {
    /// Boots the guest.
    Boot,
    /// Waits for device state from this file (see [`INCOMING_FD`]).
    Restore(std::fs::File),
    /// Waits, never to run, for a whole VM over a migration stream (a branch's receiver).
    Receive,
}

/// The descriptor number a restored QEMU reads its incoming device state from.
pub(crate) const INCOMING_FD: i32 = 3;

/// How long a migration (save or restore of device state) may take.
pub(crate) const MIGRATION_TIMEOUT: Duration = Duration::from_secs(120);

/// Who may end the QEMU process.
pub(crate) enum Owner {
    /// We spawned it: the wait task holds the child and kills it on request.
    Spawned(mpsc::UnboundedSender<()>),
    /// Another process started it; we know it by pid and start time.
    Adopted { start_time: u64 },
}

/// One QEMU process and its QMP session.
pub struct QemuVm {
    /// The QEMU program (a branch starts a second QEMU of the same build).
    pub(crate) binary: PathBuf,
    pub(crate) config: VmConfig,
    pub(crate) pid: u32,
    pub(crate) qmp: Qmp,
    pub(crate) exit: watch::Receiver<Option<String>>,
    pub(crate) owner: Owner,
    /// How long each step of its start took (empty for an adopted QEMU).
    pub(crate) steps: StepClock,
    /// Copies the console to its capped log while this handle lives.
    _console: console::Reader,
}

impl QemuVm {
    /// Takes over a QEMU another process started (a detached VM, or one a restarted
    /// daemon finds): checks that `pid` is still the process that started at
    /// `start_time`, then connects to its QMP socket.
    pub(crate) async fn adopt(
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
            StepClock::new(),
        )
        .await
    }

    pub(crate) async fn connect(
        binary: &Path,
        config: &VmConfig,
        pid: u32,
        exit: watch::Receiver<Option<String>>,
        owner: Owner,
        console: console::Reader,
        steps: StepClock,
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
                steps,
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
    pub(crate) async fn set_link(&self, up: bool) -> Result<(), HypervisorError> {
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
    pub(crate) async fn incoming(&self) -> Result<(), HypervisorError> {
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
        self.steps.end("device state");
        self.qmp.execute("cont", None).await?;
        self.steps.end("vCPUs started");
        Ok(())
    }

    /// Waits for the migration under way to end and returns its final status
    /// (`completed`, `failed` or `cancelled`), from QEMU's MIGRATION events; if events
    /// were missed (a lagging subscriber), `query-migrate` says where it stands.
    pub(crate) async fn migration_end(
        &self,
        events: tokio::sync::broadcast::Receiver<serde_json::Value>,
    ) -> Result<String, HypervisorError> {
        self.migration_reaches(events, &[]).await
    }

    /// Like [`QemuVm::migration_end`], also returning when the migration reaches one of
    /// `stops` (such as `pre-switchover`).
    pub(crate) async fn migration_reaches(
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
    pub(crate) async fn migration_failed(&self, what: &str, status: &str) -> HypervisorError {
        let detail = match self.qmp.execute("query-migrate", None).await {
            Ok(m) => m["error-desc"].as_str().unwrap_or("no detail").to_owned(),
            Err(e) => e.to_string(),
        };
        HypervisorError::Migration(format!("{what} ended as {status}: {detail}"))
    }

    /// For a save or restore of device state: RAM in a shared file is left out.
    pub(crate) async fn set_ignore_shared(&self) -> Result<(), HypervisorError> {
        self.set_capabilities(true, false).await
    }

    /// Sets the migration capabilities forkd uses, MIGRATION events always: the end of
    /// a migration is waited for, not polled.
    pub(crate) async fn set_capabilities(
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
    pub(crate) fn explain_exit(&self, e: HypervisorError) -> HypervisorError {
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

    fn startup_steps(&self) -> Vec<Step> {
        self.steps.steps()
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
pub struct PreparedQemu(pub(crate) QemuVm);

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

    fn ram_writer(&self) -> Result<Box<dyn forkd_hypervisor::RamWriter>, HypervisorError> {
        let config = &self.0.config;
        let forkd_hypervisor::MemoryBackend::File {
            path,
            shared: false,
        } = &config.memory
        else {
            return Err(HypervisorError::Config(format!(
                "VM {} does not map a RAM file privately, so its RAM cannot be written before it runs",
                config.id
            )));
        };
        let pid = self.pid().ok_or_else(|| HypervisorError::NotRunning {
            id: config.id.clone(),
            pid: self.0.pid,
        })?;
        let ram = crate::ram::ProcessRam::find(pid, path, u64::from(config.memory_mib) << 20)
            .map_err(|e| HypervisorError::io(format!("finding VM {}'s RAM", config.id), e))?;
        Ok(Box::new(ram))
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
pub(crate) const STATE_FD_NAME: &str = "forkd-state";
