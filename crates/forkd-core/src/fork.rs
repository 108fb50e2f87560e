//! Fork: restore children from a snapshot. Each child is its own QEMU process, started
//! with `-incoming defer`, mapping the snapshot's memory image privately (copy-on-write:
//! every child shares the pages it has not written), with its own qcow2 layer over the
//! frozen disk and its own agent socket. The snapshot is checked once per fork call
//! (its seal: one `stat` per part), never re-hashed.

use crate::agent::AgentClient;
use crate::error::SandboxError;
use crate::sandbox::{new_sandbox_dir, Launch, Sandbox, SandboxOptions};
use forkd_host::network::policy::EgressPolicy;
use forkd_host::network::NetworkConfig;
use forkd_hypervisor::{
    accel, Accel, AccelChoice, DiskFormat, DiskLayer, Hypervisor, MemoryBackend, Vm, VmConfig,
};
use forkd_image::Home;
use forkd_storage::snapshot::manifest::parts;
use forkd_storage::snapshot::Snapshot;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Most children one fork call makes.
pub const MAX_CHILDREN: usize = 256;

/// Largest warm pool a snapshot may have (children prepared ahead of forks).
pub const MAX_POOL: usize = MAX_CHILDREN;

/// How to fork.
#[derive(Debug, Clone)]
pub struct ForkOptions {
    /// How many children.
    pub count: usize,
    /// Children outlive the process that forked them (the CLI's children do; a test's
    /// or a library user's are stopped when their handles drop).
    pub detached: bool,
    /// Limits of each child's QEMU's cgroup, beyond the defaults for its shape.
    pub limits: forkd_host::cgroup::LimitOverrides,
    /// QEMU's seccomp filter.
    pub seccomp: bool,
    /// How long a child may take from its QEMU's start to its agent's first answer.
    pub ready_timeout: Duration,
    /// See [`SandboxOptions::agent_timeout`].
    pub agent_timeout: Duration,
    /// Most restores in flight at once (see [`default_parallel`]).
    pub parallel: usize,
    /// Stops the fork: children not started yet are not, started ones are discarded.
    pub cancel: CancellationToken,
    /// Variables every child's commands, background processes and code contexts get on
    /// top of what the snapshot's guest had (set by the resume hook).
    pub env: BTreeMap<String, String>,
    /// What each child may reach (for a snapshot whose guest has a NIC).
    pub egress: EgressPolicy,
    /// Keep the children that started when some fail (as E2B's fork does) instead of
    /// stopping them all.
    pub partial: bool,
}

/// Restores in flight at once by default: one per host CPU. Under TCG a restore and the
/// first instructions of its guest keep a core busy; more at once only make every child
/// answer later.
pub fn default_parallel() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

impl Default for ForkOptions {
    fn default() -> Self {
        ForkOptions {
            count: 1,
            detached: false,
            limits: Default::default(),
            seccomp: true,
            ready_timeout: Duration::from_secs(60),
            agent_timeout: Duration::from_secs(30),
            parallel: default_parallel(),
            cancel: CancellationToken::new(),
            env: BTreeMap::new(),
            egress: EgressPolicy::default(),
            partial: false,
        }
    }
}

/// A child that answers, as the fork reports it while the others are still being made
/// (see [`run`]): enough for the owner to show its progress and the child's process.
#[derive(Debug, Clone)]
pub struct ChildReady {
    /// The child's id.
    pub id: String,
    /// Its VM's process id.
    pub pid: u32,
    /// Its VM's process start time (clock ticks since boot), which tells a reused pid
    /// apart.
    pub start_time: u64,
}

/// A fork checked and planned: each child has its id and an empty runtime directory
/// (and, for children of a warm pool, a paused VM); nothing else of it exists. The owner
/// records [`ForkPlan::configs`] before it calls [`run`], so that a process killed at
/// any point of the fork leaves nothing its next start cannot find.
pub struct ForkPlan {
    units: Vec<Unit>,
}

impl ForkPlan {
    /// What each child's VM will be.
    pub fn configs(&self) -> impl Iterator<Item = &VmConfig> {
        self.units.iter().map(Unit::config)
    }

    /// The children's ids.
    pub fn ids(&self) -> Vec<String> {
        self.configs().map(|c| c.id.clone()).collect()
    }

    /// Gives the plan up before anything of it runs: prepared VMs end and every
    /// child's directory goes.
    pub async fn abandon(self) {
        for unit in self.units {
            if let Unit::Prepared(p) = unit {
                p.discard().await;
            }
        }
    }
}

/// Restores `opts.count` children of `snap`, at most `opts.parallel` at a time, for a
/// caller that owns their handles and records nothing (tests, benchmarks): [`plan`] and
/// [`run`] in one.
pub async fn fork(
    hv: &dyn Hypervisor,
    home: &Home,
    snap: &Snapshot,
    opts: &ForkOptions,
) -> Result<Vec<Sandbox>, SandboxError> {
    let plan = plan(hv, home, snap, opts, Vec::new()).await?;
    Ok(run(hv, snap, opts, plan, None).await?.children)
}

/// What a fork made: the children that answer, and an error for each that did not
/// (always empty unless `opts.partial`).
pub struct Forked {
    /// The children, ready.
    pub children: Vec<Sandbox>,
    /// Why each of the others failed.
    pub failures: Vec<SandboxError>,
}

/// Checks a fork request and plans its children: `prepared` (children of `snap` made
/// ready ahead, at most `opts.count` of them) stand for the first ones, and only their
/// restore is left. Refused before anything starts; the prepared VMs of a refused fork
/// are ended (they are no one's any more).
pub async fn plan(
    hv: &dyn Hypervisor,
    home: &Home,
    snap: &Snapshot,
    opts: &ForkOptions,
    prepared: Vec<PreparedChild>,
) -> Result<ForkPlan, SandboxError> {
    // Prepared children were made with the default policy; they are recorded with the
    // fork's and get it once restored (see `fork_one`).
    let prepared: Vec<PreparedChild> = prepared
        .into_iter()
        .map(|mut p| {
            if let Some(net) = &mut p.config.network {
                net.policy = opts.egress.clone();
            }
            p
        })
        .collect();
    match plan_fresh(hv, home, snap, opts, prepared.len()) {
        Ok(fresh) => Ok(ForkPlan {
            units: prepared
                .into_iter()
                .map(Unit::Prepared)
                .chain(fresh.into_iter().map(Unit::Planned))
                .collect(),
        }),
        Err(e) => {
            for p in prepared {
                p.discard().await;
            }
            Err(e)
        }
    }
}

/// Restores the children of `plan` with at most `opts.parallel` restores in flight: the
/// rest wait their turn, so a fork of hundreds never starts hundreds of QEMUs at once on
/// a host with a few cores. Each child that answers is sent to `ready` as it does.
///
/// All or nothing unless `opts.partial`: if one child fails, the others are stopped and
/// the first error is returned. A partial fork keeps the children that started and
/// returns an error for each of the others. A cancelled fork keeps nothing (children
/// not started yet fail with [`SandboxError::Cancelled`]). Whatever is not returned is
/// gone from the host: its VM ended and its files removed.
pub async fn run(
    hv: &dyn Hypervisor,
    snap: &Snapshot,
    opts: &ForkOptions,
    plan: ForkPlan,
    ready: Option<&tokio::sync::mpsc::UnboundedSender<ChildReady>>,
) -> Result<Forked, SandboxError> {
    use futures::StreamExt;
    let results: Vec<Result<Sandbox, SandboxError>> = futures::stream::iter(plan.units)
        .map(|unit| async move {
            let child = fork_one(hv, snap, opts, unit).await?;
            if let Some(ready) = ready {
                // The owner may have stopped listening; the child is still returned.
                let _ = ready.send(ChildReady {
                    id: child.id().to_owned(),
                    pid: child.pid().unwrap_or(0),
                    start_time: child.vm().start_time().unwrap_or(0),
                });
            }
            Ok(child)
        })
        .buffer_unordered(opts.parallel.max(1))
        .collect()
        .await;
    let (mut children, mut failures) = (Vec::new(), Vec::new());
    for r in results {
        match r {
            Ok(c) => children.push(c),
            Err(e) => failures.push(e),
        }
    }
    if opts.cancel.is_cancelled() {
        discard(children).await;
        return Err(SandboxError::Cancelled);
    }
    if !opts.partial && !failures.is_empty() {
        discard(children).await;
        return Err(failures.swap_remove(0));
    }
    Ok(Forked { children, failures })
}

/// Checks a fork request and plans the `opts.count - prepared` children no warm pool
/// member stands for.
fn plan_fresh(
    hv: &dyn Hypervisor,
    home: &Home,
    snap: &Snapshot,
    opts: &ForkOptions,
    prepared: usize,
) -> Result<Vec<PlannedChild>, SandboxError> {
    if opts.count == 0 || opts.count > MAX_CHILDREN || prepared > opts.count {
        return Err(SandboxError::Template {
            name: snap.tag.to_string(),
            detail: format!(
                "cannot fork {} children: the count must be 1 to {MAX_CHILDREN}",
                opts.count
            ),
        });
    }
    same_release(hv, snap)?;
    if snap.manifest.machine.accel == Accel::Kvm {
        // A KVM snapshot cannot run under TCG (and the other way round).
        accel::resolve(AccelChoice::Kvm)?;
    }
    if m_accel_is_tcg(snap) {
        snap.manifest
            .machine
            .clock
            .check_restorable()
            .map_err(|detail| SandboxError::Template {
                name: snap.tag.to_string(),
                detail,
            })?;
    }
    let fresh = opts.count - prepared;
    let per_child = forkd_host::space::PER_CHILD + forkd_proto::limits::get().console_cap;
    forkd_host::space::ensure_room(
        &crate::sandbox::sandboxes_dir(home),
        per_child.saturating_mul(fresh as u64),
        &format!("forking {} children of {}", opts.count, snap.tag),
    )?;
    (0..fresh).map(|_| plan_child(home, snap, opts)).collect()
}

/// Refuses a snapshot made by another backend, or by a release of this one whose device
/// state it cannot read (the backend judges: QEMU's migration format of the `microvm`
/// machine has no versioned machine types to keep it loadable by later releases).
fn same_release(hv: &dyn Hypervisor, snap: &Snapshot) -> Result<(), SandboxError> {
    let made = &snap.manifest.versions;
    let detail = if made.hypervisor != hv.name() {
        Some(format!(
            "it was made by the {} hypervisor backend and this host runs {}; build it again here",
            made.hypervisor,
            hv.name()
        ))
    } else {
        hv.restore_refusal(&made.hypervisor_version)
    };
    match detail {
        None => Ok(()),
        Some(detail) => Err(SandboxError::Template {
            name: snap.tag.to_string(),
            detail,
        }),
    }
}

fn m_accel_is_tcg(snap: &Snapshot) -> bool {
    snap.manifest.machine.accel == Accel::Tcg
}

/// Stops children that will not be handed out.
async fn discard(children: Vec<Sandbox>) {
    for c in children {
        let _ = c.destroy().await;
    }
}

/// A child's id, runtime directory (guarded: removed unless the child launches) and
/// launch description, before anything of it runs.
pub struct PlannedChild {
    config: VmConfig,
    guard: crate::sandbox::DirGuard,
}

impl PlannedChild {
    /// What the child's VM will be.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// Makes the child's disk layer, restores its VM, waits until its agent has answered
    /// the resume hook once, and pauses it: what a warm pool keeps. A fork that takes it
    /// only starts its vCPUs again and runs the resume hook with its own variables, on a
    /// connection already open and on code the guest (and, under TCG, QEMU's translator)
    /// has already run once in that VM. A paused member costs no CPU.
    pub async fn prepare(
        self,
        hv: &dyn Hypervisor,
        snap: &Snapshot,
        ready_timeout: Duration,
    ) -> Result<PreparedChild, SandboxError> {
        same_release(hv, snap)?;
        create_layer(hv, snap, &self.config).await?;
        let vm = hv.restore(&self.config, &snap.part(parts::STATE)).await?;
        let no_env = BTreeMap::new();
        let socket = self.config.agent_socket();
        let unmeasured = forkd_hypervisor::startup::StepClock::new();
        let warm = async {
            let agent = tokio::select! {
                res = crate::sandbox::ready_agent(
                    &socket,
                    None,
                    ready_timeout,
                    crate::sandbox::FirstCall::NewChild {
                        id: &self.config.id,
                        env: &no_env,
                        settle: true,
                    },
                    crate::sandbox::resume_in_greeting(snap.manifest.versions.agent_protocol),
                    &unmeasured,
                ) => res?,
                reason = vm.wait_exit() => {
                    return Err(SandboxError::GuestExited {
                        id: self.config.id.clone(),
                        reason,
                        console: vm.console_tail(30),
                    });
                }
            };
            if self.config.accel == Accel::Tcg {
                warm_launch_path(&agent, ready_timeout).await;
            }
            vm.pause().await?;
            Ok(agent)
        };
        match warm.await {
            Ok(agent) => Ok(PreparedChild {
                config: self.config,
                guard: self.guard,
                vm,
                agent,
            }),
            Err(e) => {
                vm.kill();
                Err(e)
            }
        }
    }
}

/// Runs a throwaway command in a pool member before it is paused. The agent's spawn
/// path and the guest kernel's fork, exec and exit then run in that VM, so under TCG a
/// fork's first command finds that code already translated: with 10 children of the
/// python template, a first `ls /` cost 0.11 core-seconds instead of 0.25, and a first
/// `python3 -c pass` 0.53 instead of 0.67. Twice, since a second request still takes
/// agent and kernel paths the first did not (`true` in a fresh child: 0.16, 0.04, then
/// 0.01 core-seconds): with two, the fork's own resume hook cost 0.023 core-seconds per
/// child instead of 0.037 (10 and 100 children). The command leaves nothing behind (a
/// foreground exec is not listed among the guest's processes). Best effort: a template
/// without `/bin/sh` only misses the gain. Under KVM there is nothing to translate.
async fn warm_launch_path(agent: &AgentClient, timeout: Duration) {
    let timeout = timeout.min(Duration::from_secs(10));
    let mut req =
        forkd_proto::exec::ExecRequest::new(forkd_proto::exec::Command::Shell("exit".into()));
    req.timeout_ms = u64::try_from(timeout.as_millis()).ok();
    for _ in 0..2 {
        let failure =
            match tokio::time::timeout(timeout, agent.exec_output(req.clone(), None)).await {
                Ok(Ok(r)) if r.status.success() => continue,
                Ok(Ok(r)) => format!("{:?}", r.status),
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer in {timeout:?}"),
            };
        tracing::debug!("warming a pool member's launch path: {failure}");
        return;
    }
}

/// A child made ready ahead of a fork (see [`PlannedChild::prepare`]): its directory,
/// disk layer and a paused VM whose agent has answered. Dropping it removes the
/// directory; [`PreparedChild::discard`] also ends the VM.
pub struct PreparedChild {
    config: VmConfig,
    guard: crate::sandbox::DirGuard,
    vm: Box<dyn Vm>,
    agent: AgentClient,
}

impl PreparedChild {
    /// What the child's VM is.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// The VM's process, while it runs: pid and start time.
    pub fn process(&self) -> Option<(u32, u64)> {
        Some((self.vm.pid()?, self.vm.start_time()?))
    }

    /// True once the VM's process has exited (it cannot serve a fork any more).
    pub fn exited(&self) -> bool {
        self.vm.exited()
    }

    /// A member whose VM died while it waited, as a child to make afresh in the same
    /// directory: its disk layer may have been written, so it goes.
    fn replan(self) -> PlannedChild {
        self.agent.close();
        let _ = std::fs::remove_file(&self.config.root_disk);
        PlannedChild {
            config: self.config,
            guard: self.guard,
        }
    }

    /// Ends the VM, waits (up to 10 s) until its process is gone, and removes the
    /// child's files: a pool that shrinks or a snapshot about to be removed then has no
    /// QEMU of the member left holding its files.
    pub async fn discard(self) {
        self.agent.close();
        self.vm.kill();
        if tokio::time::timeout(Duration::from_secs(10), self.vm.wait_exit())
            .await
            .is_err()
        {
            tracing::warn!(id = %self.config.id, "a discarded pool member's QEMU did not exit within 10 s of SIGKILL");
        }
        drop(self.guard);
    }
}

/// One child of a fork, as it enters the queue of restores.
enum Unit {
    Planned(PlannedChild),
    Prepared(PreparedChild),
}

impl Unit {
    fn config(&self) -> &VmConfig {
        match self {
            Unit::Planned(p) => &p.config,
            Unit::Prepared(p) => &p.config,
        }
    }
}

/// Plans a child of `snap` (see [`PlannedChild`]).
pub fn plan_child(
    home: &Home,
    snap: &Snapshot,
    opts: &ForkOptions,
) -> Result<PlannedChild, SandboxError> {
    let m = &snap.manifest.machine;
    if !m.nic && opts.egress != EgressPolicy::default() {
        return Err(SandboxError::Hypervisor(forkd_hypervisor::HypervisorError::Network(format!(
            "snapshot {} has no NIC (its template was built with network = \"none\" or on a host without networking), so its children have no egress to set",
            snap.tag
        ))));
    }
    let (id, dir, guard) = new_sandbox_dir(home)?;
    let mut config = child_config(snap, id, dir);
    config.limits = Some(opts.limits.resolve(m.vcpus, m.memory_mib));
    config.network = m.nic.then(|| NetworkConfig {
        policy: opts.egress.clone(),
    });
    config.seccomp = opts.seccomp;
    config.detached = opts.detached;
    Ok(PlannedChild { config, guard })
}

/// The VM of a sandbox `id` (in `dir`) restored from `snap`: its machine, its RAM file
/// mapped privately, its own disk layer. No limits, network, filter, or detachment:
/// the caller's to set.
pub(crate) fn child_config(snap: &Snapshot, id: String, dir: std::path::PathBuf) -> VmConfig {
    let m = &snap.manifest.machine;
    VmConfig {
        id,
        root_disk: dir.join("root.qcow2"),
        dir,
        kernel: snap.part(parts::KERNEL),
        initramfs: snap.part(parts::INITRAMFS),
        cmdline: m.cmdline.clone(),
        vcpus: m.vcpus,
        memory_mib: m.memory_mib,
        memory: MemoryBackend::File {
            path: snap.part(parts::MEMORY),
            shared: false,
        },
        accel: m.accel,
        cpu: m.cpu.clone(),
        clock: m.clock,
        pit: m.pit,
        limits: None,
        network: None,
        seccomp: false,
        detached: false,
    }
}

pub(crate) async fn create_layer(
    hv: &dyn Hypervisor,
    snap: &Snapshot,
    config: &VmConfig,
) -> Result<(), SandboxError> {
    hv.create_disk_layer(DiskLayer {
        path: &config.root_disk,
        base: &snap.part(parts::DISK),
        base_format: DiskFormat::Layer,
        relative: false,
        named: None,
    })
    .await?;
    Ok(())
}

/// Makes one child: its disk layer and VM (or the restore of a prepared one), its
/// agent. A child that fails leaves nothing on the host.
async fn fork_one(
    hv: &dyn Hypervisor,
    snap: &Snapshot,
    opts: &ForkOptions,
    unit: Unit,
) -> Result<Sandbox, SandboxError> {
    if opts.cancel.is_cancelled() {
        if let Unit::Prepared(p) = unit {
            p.discard().await;
        }
        return Err(SandboxError::Cancelled);
    }
    let unit = match unit {
        Unit::Prepared(p) if p.exited() => {
            tracing::warn!(id = %p.config.id, "a warm pool member's VM had exited; restoring the child afresh");
            Unit::Planned(p.replan())
        }
        unit => unit,
    };
    let (config, guard, how) = match unit {
        Unit::Planned(p) => {
            create_layer(hv, snap, &p.config).await?;
            let how = Launch::Restore {
                state: snap.part(parts::STATE),
                tag: snap.tag.to_string(),
                agent_protocol: snap.manifest.versions.agent_protocol,
            };
            (p.config, p.guard, how)
        }
        Unit::Prepared(p) => {
            let how = Launch::Warmed {
                vm: p.vm,
                agent: p.agent,
                tag: snap.tag.to_string(),
            };
            (p.config, p.guard, how)
        }
    };
    let prepared = matches!(how, Launch::Warmed { .. });
    let child = launch_child(snap, hv, opts, config, guard, how).await?;
    if prepared && child.config().network.is_some() && opts.egress != EgressPolicy::default() {
        // Until now it had the pool's policy, which lets nothing out.
        if let Err(e) = child.vm().set_egress(&opts.egress).await {
            let _ = child.destroy().await;
            return Err(e.into());
        }
    }
    Ok(child)
}

async fn launch_child(
    snap: &Snapshot,
    hv: &dyn Hypervisor,
    opts: &ForkOptions,
    config: VmConfig,
    guard: crate::sandbox::DirGuard,
    how: Launch,
) -> Result<Sandbox, SandboxError> {
    let m = &snap.manifest.machine;
    let sopts = SandboxOptions {
        vcpus: m.vcpus,
        memory_mib: m.memory_mib,
        accel: AccelChoice::Auto,
        boot_timeout: opts.ready_timeout,
        agent_timeout: opts.agent_timeout,
        limits: opts.limits,
        seccomp: opts.seccomp,
        env: opts.env.clone(),
    };
    Sandbox::launch(hv, config, how, &sopts, guard).await
}
