//! A backend for tests of everything above the hypervisor: each "VM" is a host process
//! running the real guest agent (`forkd-agent serve-unix <dir>/agent.sock`). There is no
//! guest kernel, so it starts in milliseconds, yet the sandbox layer and the daemon's
//! registry talk to a real agent over the real protocol and watch a real process that a
//! test can stop (`SIGSTOP`: an unresponsive guest), kill (a VM that died) or leave
//! behind (a daemon killed mid-fork). Disk layers and saved device state are empty files.
//!
//! Built with the `fake` feature; the crates above enable it for their tests only.

use crate::{DiskLayer, Hypervisor, HypervisorError, PreparedVm, Vm, VmConfig, VmStatus};
use async_trait::async_trait;
use nix::sys::signal::Signal;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long the agent process may take to open its socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// The fake backend.
#[derive(Debug, Clone)]
pub struct AgentProcesses {
    agent: PathBuf,
    /// How long a restore takes, so that tests can see restores overlap.
    restore_delay: Duration,
    /// Every n-th restore fails (0: none), so that tests can see a fork's failures.
    fail_every: usize,
    restores: Arc<InFlight>,
}

/// Restores in flight now, and the most there have been at once.
#[derive(Debug, Default)]
struct InFlight {
    now: AtomicUsize,
    most: AtomicUsize,
    started: AtomicUsize,
}

impl AgentProcesses {
    /// Runs `agent` (a `forkd-agent` binary) as each VM.
    pub fn new(agent: impl Into<PathBuf>) -> AgentProcesses {
        AgentProcesses {
            agent: agent.into(),
            restore_delay: Duration::ZERO,
            fail_every: 0,
            restores: Arc::default(),
        }
    }

    /// Makes every restore take at least `d`.
    pub fn with_restore_delay(mut self, d: Duration) -> AgentProcesses {
        self.restore_delay = d;
        self
    }

    /// Makes every `n`-th restore fail, as a restore whose state cannot be loaded does.
    pub fn with_failing_restores(mut self, n: usize) -> AgentProcesses {
        self.fail_every = n;
        self
    }

    /// The most restores that have been in flight at once.
    pub fn most_restores_in_flight(&self) -> usize {
        self.restores.most.load(Ordering::SeqCst)
    }

    /// The agent `./dev` builds (`$FORKD_AGENT_BIN`, else the static release build under
    /// the workspace's `target/`). Panics with what to run when there is none: a test
    /// that needs it must not pass without it.
    pub fn from_build(workspace: &Path) -> AgentProcesses {
        let candidates = [
            std::env::var_os("FORKD_AGENT_BIN").map(PathBuf::from),
            Some(workspace.join("target/x86_64-unknown-linux-gnu/release/forkd-agent")),
            Some(workspace.join("target/debug/forkd-agent")),
        ];
        match candidates.into_iter().flatten().find(|p| p.is_file()) {
            Some(agent) => AgentProcesses::new(agent),
            None => panic!(
                "no forkd-agent binary: run `./dev setup` (or `cargo build -p forkd-agent`) first"
            ),
        }
    }

    async fn start(&self, config: &VmConfig) -> Result<Box<dyn Vm>, HypervisorError> {
        let socket = config.agent_socket();
        let _ = std::fs::remove_file(&socket);
        let log = std::fs::File::create(config.hypervisor_log()).map_err(|e| {
            HypervisorError::io(format!("creating {}", config.hypervisor_log().display()), e)
        })?;
        let mut cmd = tokio::process::Command::new(&self.agent);
        cmd.arg("serve-unix")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(false);
        if config.detached {
            forkd_host::process::start_detached(&mut cmd);
        }
        let mut child = cmd.spawn().map_err(|source| HypervisorError::Spawn {
            program: self.agent.display().to_string(),
            source,
            install: "build the agent: ./dev setup",
        })?;
        let pid = child.id().unwrap_or(0);
        let start_time = forkd_host::process::start_time(pid).unwrap_or(0);
        let (exit_tx, exit) = watch::channel(None);
        tokio::spawn(async move {
            let desc = match child.wait().await {
                Ok(s) => s.to_string(),
                Err(e) => format!("wait failed: {e}"),
            };
            let _ = exit_tx.send(Some(desc));
        });
        let vm = FakeVm {
            config: config.clone(),
            pid,
            start_time,
            exit,
        };
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        while tokio::net::UnixStream::connect(&socket).await.is_err() {
            if vm.exited() || tokio::time::Instant::now() > deadline {
                vm.kill();
                return Err(HypervisorError::EarlyExit {
                    program: "the fake VM's agent",
                    status: vm
                        .exit
                        .borrow()
                        .clone()
                        .unwrap_or_else(|| "no socket".into()),
                    stderr: forkd_host::capped_log::tail(&config.hypervisor_log(), 20),
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(Box::new(vm))
    }
}

#[async_trait]
impl Hypervisor for AgentProcesses {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn version(&self) -> Result<String, HypervisorError> {
        Ok(format!("fake-{}", env!("CARGO_PKG_VERSION")))
    }

    async fn create_disk_layer(&self, layer: DiskLayer<'_>) -> Result<(), HypervisorError> {
        let base = match (layer.relative, layer.path.parent()) {
            (true, Some(dir)) => dir.join(layer.base),
            _ => layer.base.to_owned(),
        };
        if !base.exists() {
            return Err(HypervisorError::Config(format!(
                "the base {} of disk layer {} does not exist",
                base.display(),
                layer.path.display()
            )));
        }
        std::fs::write(layer.path, b"")
            .map_err(|e| HypervisorError::io(format!("creating {}", layer.path.display()), e))
    }

    async fn boot(&self, config: &VmConfig) -> Result<Box<dyn Vm>, HypervisorError> {
        self.start(config).await
    }

    async fn prepare_restore(
        &self,
        config: &VmConfig,
        state: &Path,
    ) -> Result<Box<dyn PreparedVm>, HypervisorError> {
        std::fs::metadata(state)
            .map_err(|e| HypervisorError::io(format!("opening {}", state.display()), e))?;
        let vm = self.start(config).await?;
        Ok(Box::new(FakePrepared {
            vm,
            backend: self.clone(),
        }))
    }

    async fn adopt(
        &self,
        config: &VmConfig,
        pid: u32,
        start_time: u64,
    ) -> Result<Box<dyn Vm>, HypervisorError> {
        let gone = || HypervisorError::NotRunning {
            id: config.id.clone(),
            pid,
        };
        let pidfd = forkd_host::process::PidFd::open_checked(pid, start_time).ok_or_else(gone)?;
        let (exit_tx, exit) = watch::channel(None);
        tokio::spawn(async move {
            let _ = pidfd.exited().await;
            let _ = exit_tx.send(Some("exited".into()));
        });
        Ok(Box::new(FakeVm {
            config: config.clone(),
            pid,
            start_time,
            exit,
        }))
    }
}

/// An agent process that stands for a VM whose restore is still to come. The restore's
/// delay, failures and count in flight belong to [`PreparedVm::finish`].
pub struct FakePrepared {
    vm: Box<dyn Vm>,
    backend: AgentProcesses,
}

#[async_trait]
impl PreparedVm for FakePrepared {
    fn pid(&self) -> Option<u32> {
        self.vm.pid()
    }

    fn start_time(&self) -> Option<u64> {
        self.vm.start_time()
    }

    fn exited(&self) -> bool {
        self.vm.exited()
    }

    async fn finish(self: Box<Self>) -> Result<Box<dyn Vm>, HypervisorError> {
        let restores = &self.backend.restores;
        let now = restores.now.fetch_add(1, Ordering::SeqCst) + 1;
        restores.most.fetch_max(now, Ordering::SeqCst);
        let nth = restores.started.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(self.backend.restore_delay).await;
        restores.now.fetch_sub(1, Ordering::SeqCst);
        let every = self.backend.fail_every;
        if every != 0 && nth.is_multiple_of(every) {
            self.vm.kill();
            self.vm.wait_exit().await;
            return Err(HypervisorError::Migration(format!(
                "restore {nth} failed (the fake backend fails every {every}th)"
            )));
        }
        Ok(self.vm)
    }

    async fn discard(self: Box<Self>) {
        self.vm.kill();
        self.vm.wait_exit().await;
    }
}

/// One agent process standing in for a VM.
pub struct FakeVm {
    config: VmConfig,
    pid: u32,
    start_time: u64,
    exit: watch::Receiver<Option<String>>,
}

impl FakeVm {
    fn signal(&self, sig: Signal) -> Result<(), HypervisorError> {
        if forkd_host::process::signal(self.pid, self.start_time, sig) {
            Ok(())
        } else {
            Err(HypervisorError::NotRunning {
                id: self.config.id.clone(),
                pid: self.pid,
            })
        }
    }
}

#[async_trait]
impl Vm for FakeVm {
    fn pid(&self) -> Option<u32> {
        (!self.exited()).then_some(self.pid)
    }

    fn start_time(&self) -> Option<u64> {
        Some(self.start_time)
    }

    async fn save_state(&self, out: &Path) -> Result<(), HypervisorError> {
        self.signal(Signal::SIGSTOP)?;
        std::fs::write(out, b"fake device state")
            .map_err(|e| HypervisorError::io(format!("writing {}", out.display()), e))
    }

    async fn pause(&self) -> Result<(), HypervisorError> {
        self.signal(Signal::SIGSTOP)
    }

    async fn resume(&self) -> Result<(), HypervisorError> {
        self.signal(Signal::SIGCONT)
    }

    async fn status(&self) -> Result<VmStatus, HypervisorError> {
        if self.exited() {
            return Ok(VmStatus::Exited);
        }
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
            .map_err(|e| HypervisorError::io("reading the process state", e))?;
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("");
        Ok(match state {
            "T" | "t" => VmStatus::Paused,
            "Z" | "X" => VmStatus::Exited,
            _ => VmStatus::Running,
        })
    }

    fn exited(&self) -> bool {
        self.exit.borrow().is_some()
    }

    async fn wait_exit(&self) -> String {
        forkd_host::process::wait_for_exit(&self.exit).await
    }

    async fn stop(&self, grace: Duration) -> Result<(), HypervisorError> {
        if self.exited() {
            return Ok(());
        }
        // A stopped process does not act on SIGTERM until it is continued.
        let _ = self.signal(Signal::SIGCONT);
        let _ = self.signal(Signal::SIGTERM);
        if tokio::time::timeout(grace, self.wait_exit()).await.is_err() {
            self.kill();
            self.wait_exit().await;
        }
        Ok(())
    }

    fn kill(&self) {
        let _ = self.signal(Signal::SIGKILL);
    }

    fn console_tail(&self, lines: usize) -> String {
        forkd_host::capped_log::tail(&self.config.hypervisor_log(), lines)
    }
}
