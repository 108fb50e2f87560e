//! The QEMU backend: one `qemu-system-x86_64` process per VM, driven over QMP.

pub mod cmdline;
pub mod disk;
pub mod qmp;
pub mod version;

use crate::{HypervisorError, Vm, VmConfig, VmStatus};
use async_trait::async_trait;
use qmp::Qmp;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// How long QEMU may take to bring up its QMP socket.
const QMP_TIMEOUT: Duration = Duration::from_secs(20);

/// Longest unix socket path the kernel accepts (`sun_path` minus the NUL).
const MAX_SOCKET_PATH: usize = 107;

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
    pub fn binary(&self) -> &std::path::Path {
        &self.binary
    }
}

#[async_trait]
impl crate::Hypervisor for Qemu {
    fn name(&self) -> &'static str {
        "qemu"
    }

    async fn boot(&self, config: &VmConfig) -> Result<Box<dyn Vm>, HypervisorError> {
        Ok(Box::new(QemuVm::start(&self.binary, config).await?))
    }
}

/// One QEMU process and its QMP session.
pub struct QemuVm {
    config: VmConfig,
    pid: u32,
    qmp: Qmp,
    exit: watch::Receiver<Option<String>>,
    kill_tx: mpsc::UnboundedSender<()>,
}

impl QemuVm {
    async fn start(binary: &std::path::Path, config: &VmConfig) -> Result<QemuVm, HypervisorError> {
        for sock in [config.agent_socket(), config.qmp_socket()] {
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
        let mut cmd = tokio::process::Command::new(binary);
        cmd.args(cmdline::build(config))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            // Own process group: a Ctrl-C meant for the CLI must not reach the VM directly;
            // the CLI tears it down itself.
            .process_group(0)
            .kill_on_drop(true);
        tracing::debug!(id = %config.id, "starting {} {:?}", binary.display(), cmdline::build(config));
        let mut child = cmd.spawn().map_err(|source| HypervisorError::Spawn {
            program: binary.display().to_string(),
            source,
        })?;
        let pid = child.id().unwrap_or(0);
        let (exit_tx, exit) = watch::channel(None);
        let (kill_tx, mut kill_rx) = mpsc::unbounded_channel::<()>();
        tokio::spawn(async move {
            let status = tokio::select! {
                s = child.wait() => s,
                _ = kill_rx.recv() => {
                    let _ = child.start_kill();
                    child.wait().await
                }
            };
            let desc = match status {
                Ok(s) => s.to_string(),
                Err(e) => format!("wait failed: {e}"),
            };
            let _ = exit_tx.send(Some(desc));
        });
        let exit_probe = exit.clone();
        let qmp = Qmp::connect(&config.qmp_socket(), QMP_TIMEOUT, || {
            match exit_probe.borrow().clone() {
                None => Ok(()),
                Some(status) => Err(HypervisorError::EarlyExit {
                    status,
                    stderr: tail(&log_path, 20),
                }),
            }
        })
        .await;
        let qmp = match qmp {
            Ok(q) => q,
            Err(e) => {
                let _ = kill_tx.send(());
                let mut exit = exit.clone();
                let _ = exit.wait_for(|s| s.is_some()).await;
                // QEMU may have died between the last probe and here: say why.
                return Err(match e {
                    HypervisorError::QmpClosed(_) | HypervisorError::QmpTimeout { .. } => {
                        HypervisorError::EarlyExit {
                            status: exit.borrow().clone().unwrap_or_default(),
                            stderr: tail(&log_path, 20),
                        }
                    }
                    other => other,
                });
            }
        };
        Ok(QemuVm {
            config: config.clone(),
            pid,
            qmp,
            exit,
            kill_tx,
        })
    }

    /// The QMP session, for backend-specific operations (migration, snapshots).
    pub fn qmp(&self) -> &Qmp {
        &self.qmp
    }

    fn exited(&self) -> bool {
        self.exit.borrow().is_some()
    }
}

#[async_trait]
impl Vm for QemuVm {
    fn pid(&self) -> Option<u32> {
        (!self.exited()).then_some(self.pid)
    }

    async fn pause(&self) -> Result<(), HypervisorError> {
        self.qmp.execute("stop", None).await.map(drop)
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
            _ => VmStatus::Other,
        })
    }

    async fn wait_exit(&self) -> String {
        let mut exit = self.exit.clone();
        let desc = match exit.wait_for(|s| s.is_some()).await {
            Ok(s) => s.clone().unwrap_or_default(),
            Err(_) => "exited".into(),
        };
        desc
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

    fn kill(&self) {
        let _ = self.kill_tx.send(());
    }

    fn console_tail(&self, lines: usize) -> String {
        tail(&self.config.console_log(), lines)
    }
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last `lines` lines of a log file, lossily decoded.
pub fn tail(path: &std::path::Path, lines: usize) -> String {
    let Ok(data) = std::fs::read(path) else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&data);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
