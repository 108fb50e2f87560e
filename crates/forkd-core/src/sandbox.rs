//! One sandbox: a VM booted from the guest assets, its agent session, and the watchdog
//! that tears it down when the guest stops answering.

use crate::agent::{AgentClient, AgentError, ExecOutput, ExecResult, ExecStream};
use crate::error::SandboxError;
use forkd_hypervisor::qemu::{disk, Qemu};
use forkd_hypervisor::{accel, AccelChoice, Hypervisor, MemoryBackend, Vm, VmConfig};
use forkd_image::{GuestAssets, Home};
use forkd_proto::exec::ExecRequest;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How a sandbox is made.
#[derive(Debug, Clone)]
pub struct SandboxOptions {
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM in MiB.
    pub memory_mib: u32,
    /// `auto`, `kvm` or `tcg`.
    pub accel: AccelChoice,
    /// How long the guest may take from QEMU's start to the agent's first answer.
    pub boot_timeout: Duration,
    /// The guest agent is declared unresponsive (and the sandbox torn down) when it has
    /// not answered a ping for this long.
    pub agent_timeout: Duration,
    /// QEMU's seccomp filter.
    pub seccomp: bool,
}

impl Default for SandboxOptions {
    fn default() -> Self {
        SandboxOptions {
            vcpus: 1,
            memory_mib: 512,
            accel: AccelChoice::Auto,
            boot_timeout: Duration::from_secs(120),
            agent_timeout: Duration::from_secs(30),
            seccomp: true,
        }
    }
}

/// Timings of a sandbox's start, measured from the hypervisor process's start.
#[derive(Debug, Clone, Copy)]
pub struct BootTimings {
    /// Until QEMU's control socket answered.
    pub hypervisor_ready: Duration,
    /// Until the guest agent's first answer (handshake plus one ping).
    pub first_answer: Duration,
}

/// A running sandbox. Dropping it kills the VM and removes its files; [`Sandbox::destroy`]
/// does the same but waits for QEMU to exit.
pub struct Sandbox {
    inner: Arc<Inner>,
}

struct Inner {
    id: String,
    dir: PathBuf,
    vm: Box<dyn Vm>,
    agent: AgentClient,
    timings: BootTimings,
    agent_timeout: Duration,
    /// Fired when the sandbox fails or is destroyed; every pending call then returns.
    cancel: CancellationToken,
    failure: Mutex<Option<Failure>>,
    watchdog: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

#[derive(Debug, Clone)]
enum Failure {
    Unresponsive,
    Exited(String, String),
    Destroyed,
}

/// Removes a sandbox directory on drop unless disarmed: nothing is left behind when a
/// boot fails halfway.
struct DirGuard(Option<PathBuf>);

impl Drop for DirGuard {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Sandbox {
    /// Boots a sandbox from `assets` and waits for its agent.
    pub async fn boot(
        home: &Home,
        assets: &GuestAssets,
        opts: &SandboxOptions,
    ) -> Result<Sandbox, SandboxError> {
        let id = crate::ids::sandbox_id();
        let dir = sandboxes_dir(home).join(&id);
        std::fs::create_dir_all(&dir).map_err(|source| SandboxError::Io {
            context: format!("creating {}", dir.display()),
            source,
        })?;
        let mut guard = DirGuard(Some(dir.clone()));
        let overlay = dir.join("root.qcow2");
        disk::create_overlay(&assets.rootfs.path, "raw", &overlay).await?;
        let config = VmConfig {
            id: id.clone(),
            dir: dir.clone(),
            kernel: assets.kernel.vmlinuz.path.clone(),
            initramfs: assets.initramfs.path.clone(),
            cmdline: kernel_cmdline(&id),
            root_disk: overlay,
            vcpus: opts.vcpus,
            memory_mib: opts.memory_mib,
            memory: MemoryBackend::Anonymous,
            accel: accel::resolve(opts.accel)?,
            seccomp: opts.seccomp,
        };
        let started = Instant::now();
        let vm = Qemu::from_env().boot(&config).await?;
        let hypervisor_ready = started.elapsed();
        let agent_socket = config.agent_socket();
        let agent = tokio::select! {
            res = connect_agent(&agent_socket, opts.boot_timeout) => match res {
                Ok(a) => a,
                Err(AgentError::HandshakeTimeout { .. }) => {
                    vm.kill();
                    return Err(SandboxError::BootTimeout {
                        id,
                        secs: opts.boot_timeout.as_secs(),
                        console: vm.console_tail(30),
                    });
                }
                Err(e) => {
                    vm.kill();
                    return Err(e.into());
                }
            },
            reason = vm.wait_exit() => {
                return Err(SandboxError::GuestExited { id, reason, console: vm.console_tail(30) });
            }
        };
        let first_answer = started.elapsed();
        guard.0 = None;
        let inner = Arc::new(Inner {
            id,
            dir,
            vm,
            agent,
            timings: BootTimings {
                hypervisor_ready,
                first_answer,
            },
            agent_timeout: opts.agent_timeout,
            cancel: CancellationToken::new(),
            failure: Mutex::new(None),
            watchdog: Mutex::new(None),
        });
        let watchdog = tokio::spawn(watch(Arc::downgrade(&inner)));
        *lock(&inner.watchdog) = Some(watchdog);
        tracing::info!(id = %inner.id, "sandbox up in {:?}", first_answer);
        Ok(Sandbox { inner })
    }

    /// The sandbox id.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The sandbox's runtime directory (sockets, overlay, logs).
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// QEMU's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.inner.vm.pid()
    }

    /// How long the start took.
    pub fn timings(&self) -> BootTimings {
        self.inner.timings
    }

    /// The VM, for pausing and status queries.
    pub fn vm(&self) -> &dyn Vm {
        self.inner.vm.as_ref()
    }

    /// The agent client. Calls made on it directly are not watched; prefer
    /// [`Sandbox::call`], which returns as soon as the sandbox fails.
    pub fn agent(&self) -> &AgentClient {
        &self.inner.agent
    }

    /// Runs one agent call, ending it early with the sandbox's failure if the watchdog
    /// declares the guest unresponsive or the VM exits meanwhile.
    pub async fn call<T, F, Fut>(&self, f: F) -> Result<T, SandboxError>
    where
        F: FnOnce(AgentClient) -> Fut,
        Fut: Future<Output = Result<T, AgentError>>,
    {
        if let Some(e) = self.inner.failure_error() {
            return Err(e);
        }
        let fut = f(self.inner.agent.clone());
        tokio::select! {
            r = fut => match r {
                Ok(v) => Ok(v),
                Err(e) => Err(self.inner.explain(e).await),
            },
            _ = self.inner.cancel.cancelled() => Err(self.inner.failure_error().unwrap_or(SandboxError::Destroyed { id: self.inner.id.clone() })),
        }
    }

    /// Runs a command to completion.
    pub async fn exec(
        &self,
        req: ExecRequest,
        stdin: Option<Vec<u8>>,
    ) -> Result<ExecResult, SandboxError> {
        self.call(|a| async move { a.exec_output(req, stdin).await })
            .await
    }

    /// Starts a command and returns its output stream (watched like [`Sandbox::call`]).
    pub async fn exec_stream(
        &self,
        req: ExecRequest,
        stdin: Option<crate::agent::Stdin>,
    ) -> Result<WatchedExec, SandboxError> {
        let stream = self
            .call(|a| async move { a.exec(req, stdin).await })
            .await?;
        Ok(WatchedExec {
            stream,
            inner: self.inner.clone(),
        })
    }

    /// Stops the VM (QMP `quit`, then SIGKILL after a grace period), waits for QEMU to
    /// exit and removes the sandbox's files.
    pub async fn destroy(self) -> Result<(), SandboxError> {
        self.inner.set_failure(Failure::Destroyed);
        if let Some(w) = lock(&self.inner.watchdog).take() {
            w.abort();
        }
        self.inner.vm.stop(Duration::from_secs(3)).await?;
        remove_dir(&self.inner.dir)
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        // The watchdog holds the sandbox while it waits on the VM: stop it, and kill the
        // VM and remove the files here rather than when the last reference goes.
        self.inner.set_failure(Failure::Destroyed);
        if let Some(w) = lock(&self.inner.watchdog).take() {
            w.abort();
        }
        self.inner.vm.kill();
        let _ = std::fs::remove_dir_all(&self.inner.dir);
    }
}

/// Output stream of a command started with [`Sandbox::exec_stream`].
pub struct WatchedExec {
    stream: ExecStream,
    inner: Arc<Inner>,
}

impl WatchedExec {
    /// The next piece of output, or the sandbox's failure.
    pub async fn next(&mut self) -> Result<Option<ExecOutput>, SandboxError> {
        tokio::select! {
            r = self.stream.next() => match r {
                Ok(v) => Ok(v),
                Err(e) => Err(self.inner.explain(e).await),
            },
            _ = self.inner.cancel.cancelled() => Err(self.inner.failure_error().unwrap_or(SandboxError::Destroyed { id: self.inner.id.clone() })),
        }
    }
}

impl Inner {
    fn set_failure(&self, f: Failure) {
        let mut slot = lock(&self.failure);
        if slot.is_none() {
            *slot = Some(f);
        }
        drop(slot);
        self.cancel.cancel();
    }

    /// Turns a failed agent call into the sandbox's failure when that is the cause: a
    /// connection that breaks is usually the VM dying, which the watchdog notices a moment
    /// later. Errors the agent itself returned are passed through.
    async fn explain(&self, e: AgentError) -> SandboxError {
        if e.code().is_none() {
            let _ = tokio::time::timeout(Duration::from_secs(2), self.cancel.cancelled()).await;
        }
        self.failure_error().unwrap_or(e.into())
    }

    fn failure_error(&self) -> Option<SandboxError> {
        let id = self.id.clone();
        lock(&self.failure).clone().map(|f| match f {
            Failure::Unresponsive => SandboxError::Unresponsive {
                id,
                secs: self.agent_timeout.as_secs_f64(),
            },
            Failure::Exited(reason, console) => SandboxError::GuestExited {
                id,
                reason,
                console,
            },
            Failure::Destroyed => SandboxError::Destroyed { id },
        })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.vm.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Pings the agent every third of the agent timeout; a ping unanswered for two thirds of
/// it, or QEMU exiting, fails the sandbox and tears it down. Holds only a weak reference
/// so that dropping the sandbox ends it.
async fn watch(inner: std::sync::Weak<Inner>) {
    let Some(strong) = inner.upgrade() else {
        return;
    };
    let period = strong.agent_timeout / 3;
    let agent = strong.agent.clone();
    let cancel = strong.cancel.clone();
    drop(strong);
    loop {
        let exit = async {
            match inner.upgrade() {
                Some(i) => {
                    // Hold the Arc only while waiting on this VM's exit.
                    let reason = i.vm.wait_exit().await;
                    Some((reason, i.vm.console_tail(30)))
                }
                None => None,
            }
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
            exited = exit => {
                if let (Some((reason, console)), Some(i)) = (exited, inner.upgrade()) {
                    // Clean up before reporting, so a caller that sees the failure finds
                    // nothing left behind.
                    let _ = std::fs::remove_dir_all(&i.dir);
                    i.set_failure(Failure::Exited(reason, console));
                }
                return;
            }
        }
        let ok = matches!(
            tokio::time::timeout(period * 2, agent.ping()).await,
            Ok(Ok(_))
        );
        if !ok {
            let Some(i) = inner.upgrade() else { return };
            if i.cancel.is_cancelled() {
                return;
            }
            tracing::warn!(id = %i.id, "guest agent unresponsive; tearing the sandbox down");
            i.vm.kill();
            i.vm.wait_exit().await;
            let _ = std::fs::remove_dir_all(&i.dir);
            i.set_failure(Failure::Unresponsive);
            return;
        }
    }
}

async fn connect_agent(socket: &Path, timeout: Duration) -> Result<AgentClient, AgentError> {
    let agent = AgentClient::connect(socket, timeout).await?;
    agent.ping().await?;
    Ok(agent)
}

/// Where sandbox runtime directories live.
pub fn sandboxes_dir(home: &Home) -> PathBuf {
    home.run_dir().join("sandboxes")
}

/// The guest kernel's command line. `reboot=t`: microvm has no keyboard controller, so a
/// triple fault is the reboot that works; with `-no-reboot` it ends QEMU. `panic=-1`
/// reboots (so exits) at once on a panic.
fn kernel_cmdline(id: &str) -> String {
    format!(
        "console=ttyS0 reboot=t panic=-1 pci=off quiet loglevel=4 forkd.root=/dev/vda forkd.hostname={id}"
    )
}

fn remove_dir(dir: &Path) -> Result<(), SandboxError> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(SandboxError::Io {
            context: format!("removing {}", dir.display()),
            source,
        }),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
