//! One sandbox: a VM booted from the guest assets, its agent session, and the watchdog
//! that tears it down when the guest stops answering.

use crate::agent::{AgentClient, AgentError, ExecOutput, ExecResult, ExecStream};
use crate::error::SandboxError;
use forkd_hypervisor::{
    accel, AccelChoice, DiskFormat, DiskLayer, Hypervisor, MemoryBackend, Vm, VmConfig, VmStatus,
};
use forkd_image::{GuestAssets, Home};
use forkd_proto::exec::ExecRequest;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// The guest agent is declared unresponsive (requests to it fail, the sandbox is
    /// kept) when it has not answered a ping for this long.
    pub agent_timeout: Duration,
    /// Limits of its QEMU's cgroup, beyond the defaults for its shape.
    pub limits: forkd_host::cgroup::LimitOverrides,
    /// QEMU's seccomp filter.
    pub seccomp: bool,
    /// For a restored child: variables its commands, background processes and code
    /// contexts get on top of its snapshot's (given to the resume hook).
    pub env: std::collections::BTreeMap<String, String>,
}

impl Default for SandboxOptions {
    fn default() -> Self {
        SandboxOptions {
            vcpus: 1,
            memory_mib: 512,
            accel: AccelChoice::Auto,
            boot_timeout: Duration::from_secs(120),
            agent_timeout: Duration::from_secs(30),
            limits: Default::default(),
            seccomp: true,
            env: Default::default(),
        }
    }
}

/// Timings of a sandbox's start, measured from the hypervisor process's start.
#[derive(Debug, Clone)]
pub struct BootTimings {
    /// Until QEMU's control socket answered.
    pub hypervisor_ready: Duration,
    /// Until the guest agent's first answer: the handshake plus one ping for a boot, plus
    /// the resume hook for a restored child.
    pub first_answer: Duration,
    /// Each step until then, in order: the hypervisor's (for a VM this process started),
    /// then the agent's greeting and first answer.
    pub steps: Vec<forkd_hypervisor::startup::Step>,
}

/// A running sandbox. Dropping it kills the VM and removes its files; [`Sandbox::destroy`]
/// does the same but waits for QEMU to exit.
pub struct Sandbox {
    inner: Arc<Inner>,
}

struct Inner {
    id: String,
    /// The VM as it was started.
    config: VmConfig,
    vm: Box<dyn Vm>,
    agent: AgentClient,
    timings: BootTimings,
    agent_timeout: Duration,
    /// Fired when the sandbox fails or is destroyed; every pending call then returns.
    cancel: CancellationToken,
    failure: Mutex<Option<Failure>>,
    /// Set by the watchdog while the agent does not answer its pings.
    unresponsive: AtomicBool,
    /// Set while a branch captures the VM: its pause is no sign of trouble.
    branching: AtomicBool,
    watchdog: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Whether dropping the last handle stops the VM and removes its files.
    owned: bool,
    /// This process's claim on the directory (none for a sandbox it attached to);
    /// released when the sandbox is paused, for its resume to take.
    claim: Mutex<Option<crate::claim::Claim>>,
}

#[derive(Debug, Clone)]
enum Failure {
    Exited(String, String),
    Destroyed,
    /// Its VM was written to disk and ended: the sandbox lives on, paused.
    Paused,
}

/// Removes a sandbox directory on drop unless disarmed: nothing is left behind when a
/// boot fails halfway. Holds the directory's claim until the sandbox takes it over.
pub(crate) struct DirGuard {
    dir: Option<PathBuf>,
    claim: Option<crate::claim::Claim>,
}

impl DirGuard {
    /// A claim on an existing sandbox's directory that never removes it: a resume that
    /// fails leaves the sandbox's files as they were.
    pub(crate) fn keep(dir: &Path) -> Result<DirGuard, SandboxError> {
        Ok(DirGuard {
            dir: None,
            claim: Some(crate::claim::take(dir)?),
        })
    }

    /// Keeps the directory: the sandbox now owns it, and its claim.
    pub(crate) fn disarm(&mut self) -> Option<crate::claim::Claim> {
        self.dir = None;
        self.claim.take()
    }
}

impl Drop for DirGuard {
    fn drop(&mut self) {
        if let Some(dir) = self.dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// How [`Sandbox::launch`] brings the VM up.
pub enum Launch {
    /// Boot the kernel.
    Boot,
    /// Restore device state saved from a template, then run the agent's resume hook.
    Restore {
        /// The device-state file.
        state: PathBuf,
        /// The snapshot's tag.
        tag: String,
        /// The agent protocol of the snapshot's guest (its manifest's): from
        /// [`forkd_proto::handshake::RESUME_IN_GREETING`] on, the resume hook rides in
        /// the greeting.
        agent_protocol: u32,
    },
    /// A VM restored from the sandbox's own pause image, its vCPUs running: the agent
    /// only gets the host's clock (it is the same machine continuing).
    Resumed {
        /// The VM.
        vm: Box<dyn Vm>,
    },
    /// Start the vCPUs of a VM restored ahead and paused once its agent had answered
    /// the resume hook (a warm pool's member, see
    /// [`PlannedChild::prepare`](crate::fork::PlannedChild::prepare)), then run the
    /// resume hook again, with this child's variables, on the connection kept open.
    Warmed {
        /// The VM, paused.
        vm: Box<dyn Vm>,
        /// Its agent's connection.
        agent: AgentClient,
        /// The snapshot's tag.
        tag: String,
    },
}

impl Sandbox {
    /// Boots a sandbox from `assets` on `hv` and waits for its agent.
    pub async fn boot(
        hv: &dyn Hypervisor,
        home: &Home,
        assets: &GuestAssets,
        opts: &SandboxOptions,
    ) -> Result<Sandbox, SandboxError> {
        let (id, dir, guard) = new_sandbox_dir(home)?;
        let overlay = dir.join("root.qcow2");
        hv.create_disk_layer(DiskLayer {
            path: &overlay,
            base: &assets.rootfs.path,
            base_format: DiskFormat::Raw,
            relative: false,
            named: None,
        })
        .await?;
        let accel = accel::resolve(opts.accel)?;
        let clock = clock_for(accel);
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
            accel,
            cpu: accel.default_cpu_model().to_owned(),
            clock,
            pit: clock.needs_pit(accel),
            limits: Some(opts.limits.resolve(opts.vcpus, opts.memory_mib)),
            network: None,
            seccomp: opts.seccomp,
            detached: false,
        };
        Sandbox::launch(hv, config, Launch::Boot, opts, guard).await
    }

    /// Starts the VM `config` describes (its directory already made and guarded by
    /// `guard`), connects to its agent and, for a restore, runs the resume hook.
    pub(crate) async fn launch(
        hv: &dyn Hypervisor,
        config: VmConfig,
        how: Launch,
        opts: &SandboxOptions,
        mut guard: DirGuard,
    ) -> Result<Sandbox, SandboxError> {
        let id = config.id.clone();
        let started = Instant::now();
        let snapshot = match &how {
            Launch::Boot | Launch::Resumed { .. } => None,
            Launch::Restore { tag, .. } | Launch::Warmed { tag, .. } => Some(tag.clone()),
        };
        let continuing = matches!(how, Launch::Resumed { .. });
        let greeting_resume = matches!(how, Launch::Restore { agent_protocol, .. }
            if resume_in_greeting(agent_protocol));
        let (vm, warmed) = match how {
            Launch::Boot => (hv.boot(&config).await?, None),
            Launch::Restore { state, .. } => (hv.restore(&config, &state).await?, None),
            Launch::Resumed { vm } => (vm, None),
            Launch::Warmed { vm, agent, .. } => {
                if let Err(e) = vm.resume().await {
                    vm.kill();
                    return Err(e.into());
                }
                (vm, Some(agent))
            }
        };
        let mut steps = match warmed {
            // Its start-up steps were taken before it waited in the pool.
            Some(_) => vec![forkd_hypervisor::startup::Step {
                name: "vCPUs resumed",
                took: started.elapsed(),
            }],
            None => vm.startup_steps(),
        };
        forkd_host::failpoint::hit(match (&snapshot, continuing) {
            (_, true) => "resume.after_vm_start",
            (None, false) => "build.after_boot",
            (Some(_), false) => "fork.after_vm_start",
        });
        let hypervisor_ready = started.elapsed();
        let agent_socket = config.agent_socket();
        let first = match (&snapshot, continuing) {
            (_, true) => FirstCall::Continuing,
            (Some(_), false) => FirstCall::NewChild {
                id: &id,
                env: &opts.env,
                settle: false,
            },
            (None, false) => FirstCall::Ping,
        };
        let agent_steps = forkd_hypervisor::startup::StepClock::new();
        let agent = tokio::select! {
            res = ready_agent(&agent_socket, warmed, opts.boot_timeout, first, greeting_resume, &agent_steps) => match res {
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
        steps.extend(agent_steps.steps());
        let claim = guard.disarm();
        let sandbox = Sandbox::assemble(
            config,
            vm,
            agent,
            BootTimings {
                hypervisor_ready,
                first_answer,
                steps,
            },
            opts.agent_timeout,
            claim,
        );
        tracing::info!(id = %sandbox.id(), "sandbox up in {first_answer:?} (VM running after {hypervisor_ready:?})");
        Ok(sandbox)
    }

    /// Reattaches to a sandbox another process started detached (the daemon before a
    /// restart), from what that process recorded: the VM `config`, and its process as
    /// `pid` and `start_time`. Fails with [`SandboxError::Gone`] when that process has
    /// died (its files are left to the caller).
    pub async fn attach(
        hv: &dyn Hypervisor,
        config: VmConfig,
        pid: u32,
        start_time: u64,
        opts: &SandboxOptions,
    ) -> Result<Sandbox, SandboxError> {
        let id = config.id.clone();
        let vm = match hv.adopt(&config, pid, start_time).await {
            Ok(vm) => vm,
            Err(forkd_hypervisor::HypervisorError::NotRunning { .. }) => {
                return Err(SandboxError::Gone { id });
            }
            Err(e) => return Err(e.into()),
        };
        let started = Instant::now();
        let socket = config.agent_socket();
        let steps = forkd_hypervisor::startup::StepClock::new();
        let agent = tokio::select! {
            res = ready_agent(&socket, None, opts.boot_timeout, FirstCall::Ping, false, &steps) => res?,
            _ = vm.wait_exit() => {
                return Err(SandboxError::Gone { id });
            }
        };
        let t = started.elapsed();
        Ok(Sandbox::assemble(
            config,
            vm,
            agent,
            BootTimings {
                hypervisor_ready: Duration::ZERO,
                first_answer: t,
                steps: steps.steps(),
            },
            opts.agent_timeout,
            None,
        ))
    }

    /// A handle on a running VM whose agent answered. `claim` is this process's claim
    /// on its directory when it launched the sandbox (then dropping the last handle of
    /// a sandbox that is not detached stops it); none when it attached to it.
    fn assemble(
        config: VmConfig,
        vm: Box<dyn Vm>,
        agent: AgentClient,
        timings: BootTimings,
        agent_timeout: Duration,
        claim: Option<crate::claim::Claim>,
    ) -> Sandbox {
        let inner = Arc::new(Inner {
            id: config.id.clone(),
            config: config.clone(),
            vm,
            agent,
            timings,
            agent_timeout,
            cancel: CancellationToken::new(),
            failure: Mutex::new(None),
            unresponsive: AtomicBool::new(false),
            branching: AtomicBool::new(false),
            watchdog: Mutex::new(None),
            owned: claim.is_some() && !config.detached,
            claim: Mutex::new(claim),
        });
        let watchdog = tokio::spawn(watch(Arc::downgrade(&inner)));
        *lock(&inner.watchdog) = Some(watchdog);
        Sandbox { inner }
    }

    /// Closes the agent session, stops the watchdog, and saves the paused VM's device
    /// state to `state` (see [`Vm::save_state`]). The VM stays paused: this is the last
    /// thing a template does before it is stopped.
    pub(crate) async fn freeze(&self, state: &Path) -> Result<(), SandboxError> {
        // Dirty pages and an open journal transaction left in the parent would be
        // written back by every child, into its own disk layer, in its first seconds.
        self.call(|agent| async move { agent.sync().await }).await?;
        if let Some(w) = lock(&self.inner.watchdog).take() {
            w.abort();
        }
        // No request may be in flight at the freeze: every child would resume it with a
        // host that never sent it. So the session is closed, and a greeting answered on
        // a fresh connection shows that the agent has left it: every child then starts
        // with an agent that takes the next greeting at once.
        self.inner.agent.close();
        let socket = self.inner.config.agent_socket();
        let _quiet = crate::agent::quiesce(&socket, QUIESCE_TIMEOUT).await?;
        self.inner.vm.save_state(state).await?;
        Ok(())
    }

    /// Captures the running VM for a branch (see [`Vm::branch`]); the watchdog does not
    /// count its pause against the agent.
    /// Whether a branch in `mode` would capture this sandbox faithfully; if not, why.
    pub fn can_branch(&self, mode: forkd_hypervisor::BranchMode) -> Result<(), String> {
        self.inner.vm.can_branch(mode)
    }

    pub(crate) async fn branch_vm(
        &self,
        mode: forkd_hypervisor::BranchMode,
        plan: &forkd_hypervisor::BranchPlan,
    ) -> Result<forkd_hypervisor::BranchStats, SandboxError> {
        self.inner.branching.store(true, Ordering::SeqCst);
        let r = self.inner.vm.branch(mode, plan).await;
        self.inner.branching.store(false, Ordering::SeqCst);
        Ok(r?)
    }

    /// Ends the VM of a sandbox whose pause image is written: every pending and later
    /// call fails (the sandbox is paused), the watchdog stops, QEMU quits and the
    /// directory's claim is released. The directory and its files stay: they are the
    /// sandbox.
    pub(crate) async fn end_paused(&self) -> Result<(), SandboxError> {
        self.inner.set_failure(Failure::Paused);
        if let Some(w) = lock(&self.inner.watchdog).take() {
            w.abort();
        }
        self.inner.agent.close();
        let stopped = self.inner.vm.stop(Duration::from_secs(10)).await;
        lock(&self.inner.claim).take();
        Ok(stopped?)
    }

    /// True while a branch captures this sandbox.
    pub fn is_branching(&self) -> bool {
        self.inner.branching.load(Ordering::SeqCst)
    }

    /// The sandbox id.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The VM as it was started.
    pub fn config(&self) -> &VmConfig {
        &self.inner.config
    }

    /// Why the sandbox stopped working (its VM exited or broke, it was destroyed), or
    /// `None` while it lives.
    pub fn failure(&self) -> Option<SandboxError> {
        self.inner.failure_error()
    }

    /// True while the guest agent does not answer the watchdog's pings. The sandbox is
    /// kept; it answers requests again once the agent does.
    pub fn is_unresponsive(&self) -> bool {
        self.inner.unresponsive.load(Ordering::SeqCst)
    }

    /// The sandbox's runtime directory (sockets, overlay, logs).
    pub fn dir(&self) -> &Path {
        &self.inner.config.dir
    }

    /// QEMU's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.inner.vm.pid()
    }

    /// What the VM's guest RAM costs the host: the QEMU process's mappings of the RAM
    /// file. `None` for anonymous guest RAM or once QEMU is gone.
    pub fn guest_ram_usage(&self) -> Option<forkd_host::smaps::MappingUsage> {
        match &self.inner.config.memory {
            MemoryBackend::File { path, .. } => {
                forkd_host::smaps::file_mapping_usage(self.pid()?, path)
            }
            MemoryBackend::Anonymous => None,
        }
    }

    /// How long the start took.
    pub fn timings(&self) -> BootTimings {
        self.inner.timings.clone()
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
        if self.is_unresponsive() {
            return Err(SandboxError::Unresponsive {
                id: self.inner.id.clone(),
                secs: self.inner.agent_timeout.as_secs_f64(),
            });
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

    /// Starts a command on a terminal of `size`, fed from `input` (see
    /// [`crate::agent::AgentClient::exec_on_terminal`]); watched like
    /// [`Sandbox::exec_stream`].
    pub async fn exec_on_terminal(
        &self,
        req: ExecRequest,
        size: forkd_proto::exec::PtySize,
        input: tokio::sync::mpsc::Receiver<crate::agent::TerminalInput>,
    ) -> Result<WatchedExec, SandboxError> {
        let stream = self
            .call(|a| async move { a.exec_on_terminal(req, size, input).await })
            .await?;
        Ok(WatchedExec {
            stream,
            inner: self.inner.clone(),
        })
    }

    /// Watches the guest directory `path` (recursively, if asked): its events until the
    /// caller drops the watch, the directory goes, or the sandbox ends or pauses (which
    /// the watch reports as the sandbox's failure).
    pub async fn watch(&self, path: &str, recursive: bool) -> Result<WatchedFiles, SandboxError> {
        let path = path.to_owned();
        let stream = self
            .call(|a| async move { a.watch(&path, recursive).await })
            .await?;
        let inner = self.inner.clone();
        let stream = Arc::new(tokio::sync::Mutex::new(stream));
        // Read as fast as the guest sends, into a bounded queue (see crate::watch_queue).
        let queue = crate::watch_queue::WatchQueue::start(move || {
            let (inner, stream) = (inner.clone(), stream.clone());
            async move {
                let mut stream = stream.lock().await;
                tokio::select! {
                    r = stream.next() => match r {
                        Ok(v) => Ok(v),
                        Err(e) => Err(inner.explain(e).await),
                    },
                    _ = inner.cancel.cancelled() => Err(inner.failure_error().unwrap_or(SandboxError::Destroyed { id: inner.id.clone() })),
                }
            }
        });
        Ok(WatchedFiles { queue })
    }

    /// Stops the VM (QMP `quit`, then SIGKILL after a grace period), waits for QEMU to
    /// exit and removes the sandbox's files.
    pub async fn destroy(self) -> Result<(), SandboxError> {
        self.stop().await
    }

    /// [`Sandbox::destroy`] for a sandbox that is shared (held in an `Arc`): every other
    /// holder's calls then fail with [`SandboxError::Destroyed`].
    pub async fn stop(&self) -> Result<(), SandboxError> {
        self.inner.set_failure(Failure::Destroyed);
        if let Some(w) = lock(&self.inner.watchdog).take() {
            w.abort();
        }
        self.inner.vm.stop(Duration::from_secs(3)).await?;
        remove_dir(&self.inner.config.dir)
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        // The watchdog holds the sandbox while it waits on the VM: stop it, and kill the
        // VM and remove the files here rather than when the last reference goes.
        if !self.inner.owned || self.inner.is_paused() {
            return;
        }
        self.inner.set_failure(Failure::Destroyed);
        if let Some(w) = lock(&self.inner.watchdog).take() {
            w.abort();
        }
        self.inner.vm.kill();
        let _ = std::fs::remove_dir_all(&self.inner.config.dir);
    }
}

/// Output stream of a command started with [`Sandbox::exec_stream`].
pub struct WatchedExec {
    stream: ExecStream,
    inner: Arc<Inner>,
}

/// Events of a watched guest directory ([`Sandbox::watch`]).
pub struct WatchedFiles {
    queue: crate::watch_queue::WatchQueue,
}

impl WatchedFiles {
    /// The next event (`None` once the directory is gone), an overflow for events the
    /// reader was too slow for, or the sandbox's failure.
    pub async fn next(&mut self) -> Result<Option<forkd_proto::files::WatchEvent>, SandboxError> {
        self.queue.next().await
    }
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
    fn is_paused(&self) -> bool {
        matches!(*lock(&self.failure), Some(Failure::Paused))
    }

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
            Failure::Exited(reason, console) => SandboxError::GuestExited {
                id,
                reason,
                console,
            },
            Failure::Destroyed => SandboxError::Destroyed { id },
            Failure::Paused => SandboxError::NotReady {
                id,
                state: crate::lifecycle::SandboxState::Paused,
            },
        })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.owned || self.is_paused() {
            return;
        }
        self.vm.kill();
        let _ = std::fs::remove_dir_all(&self.config.dir);
    }
}

/// Pings the agent every third of the agent timeout. A ping unanswered for two thirds of
/// it makes the sandbox unresponsive (requests fail, the VM is kept) until one is
/// answered again. The sandbox fails only on proof that its VM is gone or broken: QEMU
/// exited, or QMP reports the guest panicked, shut down or hit an internal error. A busy
/// or unreachable control socket proves nothing. Holds only a weak reference so that
/// dropping the sandbox ends it.
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
                    // Ended on purpose (destroyed, or paused: its files are the sandbox).
                    if i.cancel.is_cancelled() {
                        return;
                    }
                    // Clean up before reporting, so a caller that sees the failure finds
                    // nothing left behind; a detached sandbox's files are its owner's
                    // to keep (the daemon keeps a failed sandbox's disk until deleted).
                    if i.owned {
                        let _ = std::fs::remove_dir_all(&i.config.dir);
                    }
                    i.set_failure(Failure::Exited(reason, console));
                }
                return;
            }
        }
        let answered = matches!(
            tokio::time::timeout(period * 2, agent.ping()).await,
            Ok(Ok(_))
        );
        let Some(i) = inner.upgrade() else { return };
        if i.cancel.is_cancelled() {
            return;
        }
        if !answered && i.branching.load(Ordering::SeqCst) {
            // A branch stops the vCPUs (for its whole copy, in pause mode).
            continue;
        }
        if answered {
            if i.unresponsive.swap(false, Ordering::SeqCst) {
                tracing::info!(id = %i.id, "guest agent answers again");
            }
            continue;
        }
        // No answer: is the VM broken, or only slow? Ask the hypervisor, briefly: a
        // stopped or overloaded QEMU does not answer QMP either, which proves nothing.
        let status = tokio::time::timeout(period, i.vm.status()).await;
        if let Ok(Ok(
            st @ (VmStatus::GuestPanicked | VmStatus::Shutdown | VmStatus::InternalError),
        )) = status
        {
            tracing::warn!(id = %i.id, "the VM is {st:?}; ending the sandbox");
            let console = i.vm.console_tail(30);
            i.vm.kill();
            i.vm.wait_exit().await;
            if i.owned {
                let _ = std::fs::remove_dir_all(&i.config.dir);
            }
            i.set_failure(Failure::Exited(format!("the guest is {st:?}"), console));
            return;
        }
        if !i.unresponsive.swap(true, Ordering::SeqCst) {
            tracing::warn!(id = %i.id, "guest agent unresponsive (VM status: {status:?}); keeping the sandbox");
        }
    }
}

/// How long the agent of a template being frozen may take to answer the greeting that
/// shows it has left its session.
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(30);

/// What a VM's agent is asked first, once connected.
pub(crate) enum FirstCall<'a> {
    /// A ping: a booted VM, or one taken over.
    Ping,
    /// The resume hook of a child restored from a snapshot: its id and its own
    /// variables, so that nothing reaches it before its clock, RNG, hostname and
    /// environment are its own. `settle`: see
    /// [`ResumeRequest::settle`](forkd_proto::context::ResumeRequest::settle).
    NewChild {
        id: &'a str,
        env: &'a std::collections::BTreeMap<String, String>,
        settle: bool,
    },
    /// The resume hook of a sandbox continuing after a pause: only its clock is set.
    Continuing,
}

/// The agent of a VM whose vCPUs run, once it has answered `first`. `warmed` is a
/// connection already made (a warm pool member's); else one is made, whose greeting
/// carries the resume hook when `greeting_resume` (its agent takes it there).
pub(crate) async fn ready_agent(
    socket: &Path,
    warmed: Option<AgentClient>,
    timeout: Duration,
    first: FirstCall<'_>,
    greeting_resume: bool,
    steps: &forkd_hypervisor::startup::StepClock,
) -> Result<AgentClient, AgentError> {
    let req = resume_request(first);
    let (agent, resumed) = match warmed {
        Some(agent) => (agent, None),
        None => {
            let in_greeting = req.as_ref().filter(|_| greeting_resume);
            let (agent, resumed) = AgentClient::connect_with(socket, timeout, in_greeting).await?;
            steps.end(match resumed {
                Some(_) => "agent greeting with the resume hook",
                None => "agent greeting",
            });
            (agent, resumed)
        }
    };
    match req {
        Some(_) if resumed.is_some() => {}
        Some(mut req) => {
            // The clock as the request leaves, not as the greeting did.
            req.wall_clock_ns = wall_clock_ns();
            tokio::time::timeout(timeout, agent.resume(&req))
                .await
                .map_err(|_| AgentError::HandshakeTimeout {
                    secs: timeout.as_secs(),
                })??;
            steps.end("resume hook");
        }
        None => {
            agent.ping().await?;
            steps.end("first answer");
        }
    }
    // (The handshake checked the protocol; the resume hook's answer is the first one.)
    Ok(agent)
}

/// The resume hook's request for `first` (none for a ping): the host's clock, and for a
/// new child fresh entropy, its hostname and variables.
pub(crate) fn resume_request(first: FirstCall<'_>) -> Option<forkd_proto::context::ResumeRequest> {
    let wall_clock_ns = wall_clock_ns();
    match first {
        FirstCall::Ping => None,
        FirstCall::NewChild { id, env, settle } => Some(forkd_proto::context::ResumeRequest {
            wall_clock_ns,
            entropy_hex: forkd_host::ids::random_hex(64),
            hostname: id.to_owned(),
            env: env.clone(),
            settle,
            continuing: false,
        }),
        FirstCall::Continuing => Some(forkd_proto::context::ResumeRequest {
            wall_clock_ns,
            // Unused by an agent that knows `continuing`; one from before it reseeds
            // with these bytes rather than refuse the hook.
            entropy_hex: forkd_host::ids::random_hex(64),
            hostname: String::new(),
            env: Default::default(),
            settle: false,
            continuing: true,
        }),
    }
}

/// The host's wall clock, nanoseconds since the Unix epoch.
fn wall_clock_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Whether a guest whose agent speaks `agent_protocol` takes the resume hook in its
/// greeting.
pub(crate) fn resume_in_greeting(agent_protocol: u32) -> bool {
    agent_protocol >= forkd_proto::handshake::RESUME_IN_GREETING
}

/// A fresh sandbox id and its runtime directory, created and guarded: if the guard is
/// dropped before the sandbox is launched, the directory goes with it.
pub(crate) fn new_sandbox_dir(home: &Home) -> Result<(String, PathBuf, DirGuard), SandboxError> {
    let id = forkd_host::ids::sandbox_id();
    let (dir, guard) = sandbox_dir_for(home, &id)?;
    Ok((id, dir, guard))
}

/// Makes the runtime directory of sandbox `id`, which must not have one yet (a sandbox
/// brought from another host keeps its id).
pub(crate) fn sandbox_dir_for(home: &Home, id: &str) -> Result<(PathBuf, DirGuard), SandboxError> {
    let parent = sandboxes_dir(home);
    let dir = parent.join(id);
    std::fs::create_dir_all(&parent)
        .and_then(|()| std::fs::create_dir(&dir))
        .map_err(|source| SandboxError::Io {
            context: format!("creating {}", dir.display()),
            source,
        })?;
    let mut guard = DirGuard {
        dir: Some(dir.clone()),
        claim: None,
    };
    guard.claim = Some(crate::claim::take(&dir)?);
    Ok((dir, guard))
}

/// Where sandbox runtime directories live.
pub fn sandboxes_dir(home: &Home) -> PathBuf {
    home.run_dir().join("sandboxes")
}

/// How a new guest keeps time: the host TSC under TCG where it can be measured (half the
/// idle CPU of instruction counting), its own clocks under KVM.
pub(crate) fn clock_for(accel: forkd_hypervisor::Accel) -> forkd_hypervisor::GuestClock {
    match accel {
        forkd_hypervisor::Accel::Tcg => forkd_hypervisor::GuestClock::for_tcg(),
        forkd_hypervisor::Accel::Kvm => forkd_hypervisor::GuestClock::Icount,
    }
}

/// The guest kernel's command line. `reboot=t`: microvm has no keyboard controller, so a
/// triple fault is the reboot that works; with `-no-reboot` it ends QEMU. `panic=-1`
/// reboots (so exits) at once on a panic.
pub(crate) fn kernel_cmdline(id: &str) -> String {
    format!(
        "console=ttyS0 reboot=t panic=-1 pci=off quiet loglevel=4 forkd.root=/dev/vda forkd.hostname={id}"
    )
}

pub fn remove_dir(dir: &Path) -> Result<(), SandboxError> {
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
