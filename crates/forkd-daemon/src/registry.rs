//! The sandboxes the daemon owns: the live handles, their rows in the state database,
//! and the ceiling on how many may run.
//!
//! A child's row is written (state `starting`) before anything of it exists on the host
//! and updated after every change (see [`forkd_core::lifecycle`]), so a daemon killed at
//! any point leaves nothing its next start cannot find: [`Registry::adopt_all`] adopts
//! the children that were handed out and removes the ones that were not. Every child is
//! forked detached, so it outlives the daemon. A sandbox leaves the registry when it is
//! deleted, when its timeout passes, or when its VM is gone or broken, never because its
//! agent or control socket is slow.

use crate::state::{OperationRow, SandboxRow, State, StateError};
use forkd_core::failpoint;
use forkd_core::fork::{fork_partial, fork_using, ForkObserver, ForkOptions, Forked};
use forkd_core::lifecycle::SandboxState;
use forkd_core::snapshot::{Snapshot, Store};
use forkd_core::{Sandbox, SandboxError, SandboxOptions};
use forkd_host::network::policy::EgressPolicy;
use forkd_hypervisor::{Hypervisor, VmConfig};
use forkd_image::Home;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Why the registry refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// at capacity: {live} sandboxes run and {asked} more were asked for; the limit is {max}
    #[error("at capacity: {live} sandboxes run or are starting and {asked} more were asked for; the limit is {max}")]
    AtCapacity {
        /// Running or being created.
        live: usize,
        /// Asked for.
        asked: usize,
        /// The limit.
        max: usize,
    },
    /// {0}
    #[error(transparent)]
    Memory(#[from] crate::admission::InsufficientMemory),
    /// {0}
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// {0}
    #[error(transparent)]
    State(#[from] StateError),
    /// {0}
    #[error("{0}")]
    Conflict(String),
}

/// A sandbox the daemon holds a handle on.
#[derive(Clone)]
pub struct Entry {
    /// Its row (its state as last persisted).
    pub row: SandboxRow,
    /// The live handle.
    pub sandbox: Arc<Sandbox>,
}

/// A sandbox as a listing shows it: every recorded one, with its handle when the daemon
/// holds one (not while it starts, nor while a restarted daemon cannot reach it yet).
#[derive(Clone)]
pub struct Listed {
    /// Its row.
    pub row: SandboxRow,
    /// The live handle, if any.
    pub sandbox: Option<Arc<Sandbox>>,
}

/// The live sandboxes.
pub struct Registry {
    hv: Arc<dyn Hypervisor>,
    home: Home,
    store: Store,
    state: Arc<State>,
    max: usize,
    agent_timeout: Duration,
    fork_parallel: usize,
    memory_overcommit: f64,
    /// Where sandboxes' resolvers send the names they may resolve; none: no resolver.
    dns_upstream: Option<std::net::SocketAddr>,
    slots: Mutex<Slots>,
    /// Wakes the pool filler (a fork ended, a pool size changed).
    pub(crate) pool_wakeup: tokio::sync::Notify,
}

/// A sandbox whose VM runs but that a restarted daemon could not take over (its QMP
/// socket or agent did not answer): kept, shown as unresponsive, retried.
#[derive(Clone)]
struct Unattached {
    row: SandboxRow,
    next_try: Instant,
}

/// How long a measured child cost stands for a snapshot's next forks.
const COST_TTL: Duration = Duration::from_secs(10);

/// How long to wait before trying again to take over an unattached sandbox.
const REATTACH_EVERY: Duration = Duration::from_secs(10);

/// Steps kept of one running operation.
pub const MAX_STEPS: usize = 200;

#[derive(Default)]
pub(crate) struct Slots {
    live: HashMap<String, Entry>,
    /// Recorded, VM being started: not handed out yet.
    starting: HashMap<String, SandboxRow>,
    /// Running, not taken over yet.
    unattached: HashMap<String, Unattached>,
    /// Cancellation of the forks in progress, by operation id.
    cancels: HashMap<String, tokio_util::sync::CancellationToken>,
    /// Children ready so far in the forks in progress, by operation id (kept in
    /// memory: written once, when the fork ends).
    progress: HashMap<String, u64>,
    /// The steps each running operation has begun, in words (kept in memory).
    steps: HashMap<String, Vec<String>>,
    /// The last measured cost of a child, by snapshot tag, and when it was measured.
    costs: HashMap<String, (u64, String, Instant)>,
    /// Slots promised to forks in progress.
    pub(crate) reserved: usize,
    /// Forks in progress, by snapshot tag: they use the snapshot as much as its
    /// children do.
    forking: HashMap<String, usize>,
    /// Warm pools (their members hold VMs too).
    pub(crate) pools: crate::pool::Pools,
    /// Branches in progress: the snapshot tag each source is being branched into.
    pub(crate) branching: HashMap<String, String>,
    /// The egress policy each running sandbox's resolver answers by; dropping one
    /// stops that resolver.
    resolvers: HashMap<String, tokio::sync::watch::Sender<EgressPolicy>>,
}

/// What a create request asks for.
#[derive(Debug, Clone)]
pub struct CreateSpec {
    /// How many children.
    pub count: usize,
    /// The caller's labels.
    pub labels: BTreeMap<String, String>,
    /// Variables for the children's commands and contexts (see `ForkOptions::env`).
    pub env: BTreeMap<String, String>,
    /// Unix time after which the daemon stops each child.
    pub timeout_at: Option<i64>,
    /// Keep the children that start when others fail (else all or nothing).
    pub partial: bool,
    /// Limits of the children's QEMUs beyond the defaults. Children with limits of
    /// their own are never taken from the warm pool, whose members have the defaults.
    pub limits: forkd_host::cgroup::LimitOverrides,
    /// What the children may reach. Pool members are made with the default policy and
    /// given this one once restored.
    pub egress: forkd_host::network::policy::EgressPolicy,
    /// The fork's operation id (`op-...`), chosen by the caller so that it can answer
    /// with it before the fork ends.
    pub op_id: String,
}

impl CreateSpec {
    /// A spec for `count` children, no labels, no deadline, all or nothing, with a
    /// fresh operation id.
    pub fn new(count: usize) -> CreateSpec {
        CreateSpec {
            count,
            labels: BTreeMap::new(),
            env: BTreeMap::new(),
            timeout_at: None,
            partial: false,
            limits: Default::default(),
            egress: Default::default(),
            op_id: new_operation_id(),
        }
    }
}

/// A fresh operation id.
pub fn new_operation_id() -> String {
    format!("op-{}", forkd_core::ids::random_hex(8))
}

/// What a fork made.
pub struct CreateOutcome {
    /// The children, running.
    pub entries: Vec<Entry>,
    /// Why each child that did not start failed (a partial fork only).
    pub failures: Vec<SandboxError>,
}

impl Slots {
    /// Sandboxes that hold a VM (pool members too) or have a slot promised to a fork
    /// under way.
    fn occupied(&self) -> usize {
        self.live.len() + self.unattached.len() + self.reserved + self.pools.held()
    }

    /// Whether `count` more sandboxes fit under `max`, counting every one that holds a
    /// VM (pool members too) or has a slot promised to a fork under way.
    pub(crate) fn fits(&self, count: usize, max: usize) -> Result<(), RegistryError> {
        let live = self.occupied();
        if live + count > max {
            return Err(RegistryError::AtCapacity {
                live,
                asked: count,
                max,
            });
        }
        Ok(())
    }
}

/// Returns reserved slots when a fork ends, however it ends.
struct Reservation<'a> {
    registry: &'a Registry,
    count: usize,
    tag: String,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut slots = self.registry.slots();
        slots.reserved -= self.count;
        if let Some(n) = slots.forking.get_mut(&self.tag) {
            *n -= 1;
            if *n == 0 {
                slots.forking.remove(&self.tag);
            }
        }
    }
}

/// Options used to reattach to a sandbox after a restart.
fn attach_options(agent_timeout: Duration) -> SandboxOptions {
    SandboxOptions {
        boot_timeout: Duration::from_secs(30).min(agent_timeout * 2),
        agent_timeout,
        ..SandboxOptions::default()
    }
}

impl Registry {
    /// An empty registry whose VMs run on `hv`.
    pub fn new(
        hv: Arc<dyn Hypervisor>,
        home: Home,
        store: Store,
        state: Arc<State>,
        max: usize,
    ) -> Registry {
        Registry {
            hv,
            home,
            store,
            state,
            max,
            agent_timeout: SandboxOptions::default().agent_timeout,
            fork_parallel: forkd_core::fork::default_parallel(),
            memory_overcommit: 1.0,
            dns_upstream: None,
            slots: Mutex::new(Slots::default()),
            pool_wakeup: tokio::sync::Notify::new(),
        }
    }

    /// Most restores in flight at once in a fork (see [`ForkOptions::parallel`]).
    pub fn with_fork_parallelism(mut self, k: usize) -> Registry {
        self.fork_parallel = k.max(1);
        self
    }

    /// Serves each sandbox with a NIC a resolver that forwards to `upstream`.
    pub fn with_dns_upstream(mut self, upstream: Option<std::net::SocketAddr>) -> Registry {
        self.dns_upstream = upstream;
        self
    }

    /// Starts the resolver of a sandbox just handed out (or taken over), if it has a NIC.
    fn start_resolver(&self, slots: &mut Slots, entry: &Entry) {
        let (Some(upstream), Some(net)) = (self.dns_upstream, &entry.row.config.network) else {
            return;
        };
        let (tx, rx) = tokio::sync::watch::channel(net.policy.clone());
        crate::resolver::spawn(entry.sandbox.clone(), upstream, rx);
        slots.resolvers.insert(entry.row.id.clone(), tx);
    }

    /// How far forks may overcommit the host's available memory (see
    /// [`crate::admission`]).
    pub fn with_memory_overcommit(mut self, ratio: f64) -> Registry {
        self.memory_overcommit = ratio;
        self
    }

    /// How long a sandbox's agent may stay silent before it is shown unresponsive (see
    /// [`SandboxOptions::agent_timeout`]).
    pub fn with_agent_timeout(mut self, t: Duration) -> Registry {
        self.agent_timeout = t;
        self
    }

    pub(crate) fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The data directory.
    pub fn home(&self) -> &Home {
        &self.home
    }

    /// How far forks may overcommit the host's available memory.
    pub fn memory_overcommit(&self) -> f64 {
        self.memory_overcommit
    }

    /// The hypervisor the VMs run on.
    pub fn hypervisor(&self) -> &Arc<dyn Hypervisor> {
        &self.hv
    }

    /// The snapshot store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The state database.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// The most sandboxes this daemon runs.
    pub fn capacity(&self) -> usize {
        self.max
    }

    /// Sandboxes that hold a VM (or are starting one).
    pub fn running(&self) -> usize {
        let slots = self.slots();
        slots.live.len() + slots.starting.len() + slots.unattached.len()
    }

    /// How many sandboxes are in each state.
    pub fn count_by_state(&self) -> HashMap<SandboxState, usize> {
        let mut counts = HashMap::new();
        for l in self.list() {
            *counts.entry(l.row.state).or_default() += 1;
        }
        counts
    }

    /// What a child of `tag` costs the host (see [`crate::admission`]). Measuring reads
    /// each sampled child's smaps_rollup, which walks its page tables: the estimate is
    /// kept for [`COST_TTL`] so that a burst of forks does not pay it every time.
    pub(crate) fn child_cost(&self, tag: &str) -> (u64, String) {
        if let Some((cost, basis, at)) = self.slots().costs.get(tag) {
            if at.elapsed() < COST_TTL {
                return (*cost, basis.clone());
            }
        }
        let pids: Vec<u32> = self
            .list()
            .iter()
            .filter(|l| l.row.snapshot == tag && l.row.pid != 0)
            .map(|l| l.row.pid)
            .collect();
        let (cost, basis) = crate::admission::estimate_child_cost(&pids);
        if !pids.is_empty() {
            self.slots()
                .costs
                .insert(tag.to_owned(), (cost, basis.clone(), Instant::now()));
        }
        (cost, basis)
    }

    /// Refuses at once a fork of `count` children of `tag` that would not fit under the
    /// limit now, even with every idle pool member reclaimed (a fork that answers before
    /// it ends checks here; [`Registry::create`] reserves).
    pub fn admit(&self, tag: &str, count: usize) -> Result<(), RegistryError> {
        let slots = self.slots();
        // The fork takes the snapshot's idle members; those of other pools would be
        // reclaimed for it.
        let here = slots.pools.idle_of(tag);
        let live = slots.occupied() - (slots.pools.idle_total() - here);
        let asked = count - here.min(count);
        if live + asked > self.max {
            return Err(RegistryError::AtCapacity {
                live,
                asked,
                max: self.max,
            });
        }
        Ok(())
    }

    /// Reserves room for a fork of `count` children of `snap`: takes up to `count` idle
    /// members of its pool, checks the sandbox limit and the host's memory, and when
    /// they refuse, reclaims idle members of other pools and checks once more.
    async fn reserve(
        &self,
        snap: &Snapshot,
        count: usize,
        from_pool: bool,
    ) -> Result<(Reservation<'_>, Vec<forkd_core::fork::PreparedChild>), RegistryError> {
        let tag = snap.tag.to_string();
        let (per_child, basis) = self.child_cost(&tag);
        let mut reclaimed = false;
        loop {
            let available = crate::admission::mem_available().unwrap_or(u64::MAX);
            let (checked, dead) = {
                let mut slots = self.slots();
                // Idle members of this snapshot become children: they are counted
                // already.
                let pooled = if from_pool { count } else { 0 };
                let fresh = count - slots.pools.idle_of(&tag).min(pooled);
                // Children of forks still under way have not taken their memory yet:
                // count them with this one.
                let checked = slots.fits(fresh, self.max).and_then(|()| {
                    crate::admission::admit(
                        count + slots.reserved,
                        per_child,
                        &basis,
                        available,
                        self.memory_overcommit,
                    )
                    .map_err(RegistryError::from)
                });
                match checked {
                    Ok(()) => {
                        let (taken, dead) = slots.pools.take(&tag, pooled);
                        slots.reserved += count;
                        *slots.forking.entry(tag.clone()).or_default() += 1;
                        (Ok(taken), dead)
                    }
                    Err(e) => (Err(e), Vec::new()),
                }
            };
            self.discard_members(dead).await;
            match checked {
                Ok(taken) => {
                    let reservation = Reservation {
                        registry: self,
                        count,
                        tag,
                    };
                    return Ok((reservation, taken));
                }
                Err(e) if reclaimed => return Err(e),
                Err(e) => {
                    reclaimed = true;
                    if self.reclaim_pools(&tag).await == 0 {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Forks `spec.count` children of `snap` and records them: each child's row is
    /// written before its VM starts and says `running` once it answers. Refused at once,
    /// before anything starts, when they would not fit under the limit. At most the
    /// registry's fork parallelism restore at once. The fork is the operation
    /// `spec.op_id` (kind `fork`) whose progress counts the children ready; it can be
    /// cancelled with [`Registry::cancel`].
    pub async fn create(
        &self,
        snap: &Snapshot,
        spec: CreateSpec,
    ) -> Result<CreateOutcome, RegistryError> {
        let from_pool = spec.limits.is_default();
        let (_reservation, prepared) = self.reserve(snap, spec.count, from_pool).await?;
        let op = OperationRow {
            id: spec.op_id.clone(),
            kind: "fork".into(),
            target: snap.tag.to_string(),
            status: "running".into(),
            error: None,
            created_at: crate::now_rfc3339(),
            finished_at: None,
            done: 0,
            total: spec.count as u64,
            result: None,
            steps: Vec::new(),
        };
        self.state.insert_operation(&op)?;
        let cancel = tokio_util::sync::CancellationToken::new();
        self.slots().cancels.insert(op.id.clone(), cancel.clone());
        let recorder = Recorder {
            registry: self,
            spec: &spec,
            tag: snap.tag.to_string(),
            op: op.id.clone(),
            done: AtomicU64::new(0),
        };
        let opts = ForkOptions {
            count: spec.count,
            detached: true,
            agent_timeout: self.agent_timeout,
            parallel: self.fork_parallel,
            cancel,
            env: spec.env.clone(),
            limits: spec.limits,
            egress: spec.egress.clone(),
            ..ForkOptions::default()
        };
        let hv = self.hv.as_ref();
        let forked = if spec.partial {
            fork_partial(hv, &self.home, snap, &opts, &recorder, prepared).await
        } else {
            fork_using(hv, &self.home, snap, &opts, &recorder, prepared)
                .await
                .map(|children| Forked {
                    children,
                    failures: Vec::new(),
                })
        };
        let outcome = match forked {
            Ok(f) => self
                .hand_out(f.children)
                .await
                .map(|entries| CreateOutcome {
                    entries,
                    failures: f.failures,
                }),
            Err(e) => Err(e),
        };
        {
            let mut slots = self.slots();
            slots.cancels.remove(&op.id);
            slots.progress.remove(&op.id);
            slots.pools.fork_ended();
        }
        self.finish_fork(&op.id, spec.count, &outcome);
        self.pool_wakeup.notify_one();
        Ok(outcome?)
    }

    /// Records the forked children `running` (one write for all of them) and moves them
    /// from `starting` to the live handles. Children that cannot be recorded are not
    /// owned: they are stopped, and the error says why.
    async fn hand_out(&self, children: Vec<Sandbox>) -> Result<Vec<Entry>, SandboxError> {
        let processes: Vec<(String, u32, u64)> = children
            .iter()
            .map(|c| {
                (
                    c.id().to_owned(),
                    c.pid().unwrap_or(0),
                    c.vm().start_time().unwrap_or(0),
                )
            })
            .collect();
        if let Err(e) = self.state.mark_running(&processes) {
            for c in children {
                let id = c.id().to_owned();
                let _ = c.destroy().await;
                let _ = self.state.delete_sandbox(&id);
                self.slots().starting.remove(&id);
            }
            return Err(recording_failed(self, e));
        }
        failpoint::hit("fork.after_ready");
        let mut slots = self.slots();
        Ok(children
            .into_iter()
            .filter_map(|child| {
                let mut row = slots.starting.remove(child.id())?;
                row.state = SandboxState::Running;
                row.pid = child.pid().unwrap_or(0);
                row.start_time = child.vm().start_time().unwrap_or(0);
                let entry = Entry {
                    row,
                    sandbox: Arc::new(child),
                };
                slots.live.insert(entry.row.id.clone(), entry.clone());
                self.start_resolver(&mut slots, &entry);
                Some(entry)
            })
            .collect())
    }

    /// Children ready so far in the running fork `op`, if it runs.
    pub fn progress(&self, op: &str) -> Option<u64> {
        self.slots().progress.get(op).copied()
    }

    /// Records a running operation's progress (kept in memory, like a fork's).
    pub fn set_progress(&self, op: &str, done: u64) {
        self.slots().progress.insert(op.to_owned(), done);
    }

    /// Forgets a finished operation's progress (its row has the final figures).
    pub fn clear_progress(&self, op: &str) {
        let mut slots = self.slots();
        slots.progress.remove(op);
        slots.steps.remove(op);
    }

    /// Records the step a running operation begins (the first [`MAX_STEPS`] are kept).
    pub fn add_step(&self, op: &str, step: &str) {
        let mut slots = self.slots();
        let steps = slots.steps.entry(op.to_owned()).or_default();
        if steps.len() < MAX_STEPS {
            steps.push(step.to_owned());
        }
    }

    /// The steps the running operation `op` has begun, oldest first.
    pub fn steps(&self, op: &str) -> Vec<String> {
        self.slots().steps.get(op).cloned().unwrap_or_default()
    }

    /// Records how a fork ended: its status, error and result (children and errors).
    fn finish_fork(&self, op: &str, total: usize, outcome: &Result<CreateOutcome, SandboxError>) {
        let (status, error, result) = match outcome {
            Ok(o) => (
                "succeeded",
                None,
                serde_json::json!({
                    "sandboxes": o.entries.iter().map(|e| e.row.id.clone()).collect::<Vec<_>>(),
                    "errors": o.failures.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
                }),
            ),
            Err(SandboxError::Cancelled) => (
                "cancelled",
                Some(SandboxError::Cancelled.to_string()),
                serde_json::json!({"sandboxes": [], "errors": []}),
            ),
            Err(e) => (
                "failed",
                Some(e.to_string()),
                serde_json::json!({"sandboxes": [], "errors": [e.to_string()]}),
            ),
        };
        let done = outcome.as_ref().map_or(0, |o| o.entries.len() as u64);
        let recorded = self.state.finish_with_result(
            op,
            &crate::state::OperationEnd {
                status,
                error: error.as_deref(),
                finished_at: &crate::now_rfc3339(),
                done,
                total: total as u64,
                result: &result,
            },
        );
        if let Err(e) = recorded {
            tracing::warn!(%op, "recording the end of the fork: {e}");
        }
    }

    /// Cancels the running fork `op`: children not started yet are not, started ones
    /// are stopped and removed. False if no such fork runs.
    pub fn cancel(&self, op: &str) -> bool {
        match self.slots().cancels.get(op) {
            Some(c) => {
                c.cancel();
                true
            }
            None => false,
        }
    }

    /// The sandbox `id`, if the daemon holds a handle on it. One that is starting, or
    /// that a restarted daemon has not taken over yet, is named with its state.
    pub fn get(&self, id: &str) -> Result<Entry, SandboxError> {
        let slots = self.slots();
        if let Some(e) = slots.live.get(id) {
            return Ok(e.clone());
        }
        let state = if slots.starting.contains_key(id) {
            SandboxState::Starting
        } else if slots.unattached.contains_key(id) {
            SandboxState::Unresponsive
        } else {
            return Err(SandboxError::NotFound { id: id.to_owned() });
        };
        Err(SandboxError::NotReady {
            id: id.to_owned(),
            state,
        })
    }

    /// The sandbox `id` as a listing shows it.
    pub fn describe(&self, id: &str) -> Result<Listed, SandboxError> {
        self.list()
            .into_iter()
            .find(|l| l.row.id == id)
            .ok_or_else(|| SandboxError::NotFound { id: id.to_owned() })
    }

    /// Every recorded sandbox, oldest first.
    pub fn list(&self) -> Vec<Listed> {
        let slots = self.slots();
        let mut v: Vec<Listed> = slots
            .live
            .values()
            .map(|e| Listed {
                row: e.row.clone(),
                sandbox: Some(e.sandbox.clone()),
            })
            .chain(slots.starting.values().map(|r| Listed {
                row: r.clone(),
                sandbox: None,
            }))
            .chain(slots.unattached.values().map(|u| Listed {
                row: u.row.clone(),
                sandbox: None,
            }))
            .collect();
        v.sort_by(|a, b| (&a.row.created_at, &a.row.id).cmp(&(&b.row.created_at, &b.row.id)));
        v
    }

    /// Recorded children of the snapshot `tag`.
    pub fn children_of(&self, tag: &str) -> Vec<String> {
        self.list()
            .into_iter()
            .filter(|e| e.row.snapshot == tag)
            .map(|e| e.row.id)
            .collect()
    }

    /// What keeps the snapshot `tag` in use: its live children, and forks of it in
    /// progress (named as such).
    pub fn users_of(&self, tag: &str) -> Vec<String> {
        let mut users = self.children_of(tag);
        users.extend(self.branch_users_of(tag));
        if let Some(n) = self.slots().forking.get(tag) {
            users.push(format!("{n} fork(s) in progress"));
        }
        users
    }

    /// Stops the sandbox `id` and forgets it.
    pub async fn delete(&self, id: &str) -> Result<(), RegistryError> {
        let unattached = self.slots().unattached.get(id).cloned();
        if let Some(u) = unattached {
            return self.remove_row(&u.row).await;
        }
        let entry = self.get(id)?;
        self.remove(&entry).await
    }

    /// Stops a sandbox, removes its files and its row, and only then forgets it: once
    /// the API answers 404 for it, nothing of it is left. The row says `stopping` first,
    /// so a daemon killed half way finishes the job at its next start. (Two removals of
    /// one sandbox at once are harmless: stopping and removing are idempotent.)
    async fn remove(&self, entry: &Entry) -> Result<(), RegistryError> {
        if let Err(e) = self.transition(&entry.row.id, SandboxState::Stopping, None) {
            // On a full disk the mark may not be writable; the stop must still happen
            // (it frees space). A daemon killed before the row is deleted finds a row
            // whose VM is gone, and removes it.
            tracing::warn!(id = %entry.row.id, "marking the sandbox stopping: {e}");
        }
        failpoint::hit("delete.after_mark");
        let stopped = entry.sandbox.stop().await;
        if stopped.is_err() {
            // Whatever stop could not do, the VM and the directory still go.
            forkd_host::process::kill(entry.row.pid, entry.row.start_time);
            let _ = forkd_core::sandbox::remove_dir(&entry.row.config.dir);
        }
        let forgotten = self.state.delete_sandbox(&entry.row.id);
        {
            let mut slots = self.slots();
            slots.live.remove(&entry.row.id);
            slots.resolvers.remove(&entry.row.id);
        }
        forgotten?;
        Ok(())
    }

    /// Removes a sandbox the daemon holds no handle on: its VM (through a pidfd, and
    /// any process that names its directory), its files and its row.
    async fn remove_row(&self, row: &SandboxRow) -> Result<(), RegistryError> {
        if row.state.can_become(SandboxState::Stopping) {
            let _ = self
                .state
                .set_state(&row.id, SandboxState::Stopping, None, None);
        }
        let row2 = row.clone();
        tokio::task::spawn_blocking(move || {
            forkd_host::process::kill_vm(row2.pid, row2.start_time, &row2.config.dir)
        })
        .await
        .map_err(|e| StateError::Row(serde::de::Error::custom(e.to_string())))?;
        let _ = forkd_core::sandbox::remove_dir(&row.config.dir);
        // Its QEMU is gone: its cgroup goes with it, not at some later start.
        remove_cgroup(&row.id);
        let forgotten = self.state.delete_sandbox(&row.id);
        {
            let mut slots = self.slots();
            slots.unattached.remove(&row.id);
            slots.starting.remove(&row.id);
        }
        forgotten?;
        Ok(())
    }

    /// Persists a state change of a live sandbox and mirrors it in memory.
    fn transition(
        &self,
        id: &str,
        to: SandboxState,
        error: Option<String>,
    ) -> Result<(), RegistryError> {
        self.state.set_state(id, to, error.as_deref(), None)?;
        if let Some(e) = self.slots().live.get_mut(id) {
            e.row.state = to;
            e.row.error = error;
        }
        Ok(())
    }

    /// Replaces a running sandbox's egress policy, in its namespace and its record.
    pub async fn set_egress(
        &self,
        id: &str,
        policy: forkd_host::network::policy::EgressPolicy,
    ) -> Result<Entry, RegistryError> {
        let entry = self.get(id)?;
        if entry.row.config.network.is_none() {
            return Err(RegistryError::Conflict(format!(
                "sandbox {id} has no NIC: its snapshot's template was built with network = \"none\" (or on a host without networking)"
            )));
        }
        entry
            .sandbox
            .vm()
            .set_egress(&policy)
            .await
            .map_err(SandboxError::from)?;
        let mut slots = self.slots();
        let entry = slots
            .live
            .get_mut(id)
            .ok_or_else(|| SandboxError::NotFound { id: id.to_owned() })?;
        let mut config = entry.row.config.clone();
        config.network = Some(forkd_host::network::NetworkConfig {
            policy: policy.clone(),
        });
        self.state.set_config(id, &config)?;
        entry.row.config = config;
        let entry = entry.clone();
        if let Some(resolver) = slots.resolvers.get(id) {
            resolver.send_replace(policy);
        }
        Ok(entry)
    }

    /// Sets a sandbox's deadline (None: no deadline).
    pub fn set_timeout(&self, id: &str, timeout_at: Option<i64>) -> Result<Entry, RegistryError> {
        let mut slots = self.slots();
        let entry = slots
            .live
            .get_mut(id)
            .ok_or_else(|| SandboxError::NotFound { id: id.to_owned() })?;
        self.state.set_timeout(id, timeout_at)?;
        entry.row.timeout_at = timeout_at;
        Ok(entry.clone())
    }

    /// Takes over every sandbox of the database whose VM still runs; removes the ones
    /// that were never handed out (`starting`), those a stop was interrupted on
    /// (`stopping`), and those whose VM died while the daemon was away. A VM that runs
    /// but does not answer is kept (unresponsive) and tried again later: it is killed
    /// only on proof that it is gone. Returns (adopted, removed).
    pub async fn adopt_all(&self) -> Result<(Vec<String>, Vec<String>), RegistryError> {
        let rows = self.state.sandboxes()?;
        let opts = attach_options(self.agent_timeout);
        let (mut adopted, mut gone) = (Vec::new(), Vec::new());
        let (keep, drop): (Vec<SandboxRow>, Vec<SandboxRow>) = rows.into_iter().partition(|r| {
            matches!(r.state, SandboxState::Running | SandboxState::Unresponsive)
                && forkd_host::process::is_running(r.pid, r.start_time)
        });
        for row in drop {
            tracing::info!(id = %row.id, state = %row.state, "removing a sandbox the last daemon left");
            self.remove_row(&row).await?;
            gone.push(row.id);
        }
        let attached = futures::future::join_all(
            keep.iter()
                .map(|r| Sandbox::attach(self.hv.as_ref(), &self.home, &r.id, &opts)),
        )
        .await;
        for (row, res) in keep.into_iter().zip(attached) {
            match res {
                Ok(sb) => {
                    let id = row.id.clone();
                    self.adopted(row, sb)?;
                    failpoint::hit("adopt.after_first");
                    adopted.push(id);
                }
                // Proof that it is gone: its process no longer runs.
                Err(_) if !forkd_host::process::is_running(row.pid, row.start_time) => {
                    self.remove_row(&row).await?;
                    gone.push(row.id);
                }
                Err(e) => self.unattached(row, &e)?,
            }
        }
        Ok((adopted, gone))
    }

    fn adopted(&self, mut row: SandboxRow, sb: Sandbox) -> Result<(), RegistryError> {
        if row.state != SandboxState::Running {
            self.state
                .set_state(&row.id, SandboxState::Running, None, None)?;
            row.state = SandboxState::Running;
            row.error = None;
        }
        let mut slots = self.slots();
        slots.unattached.remove(&row.id);
        let entry = Entry {
            row,
            sandbox: Arc::new(sb),
        };
        self.start_resolver(&mut slots, &entry);
        slots.live.insert(entry.row.id.clone(), entry);
        Ok(())
    }

    fn unattached(&self, mut row: SandboxRow, e: &SandboxError) -> Result<(), RegistryError> {
        tracing::warn!(id = %row.id, "running but not taken over (kept, retried): {e}");
        let error = format!("not reachable since the daemon restarted: {e}");
        self.state
            .set_state(&row.id, SandboxState::Unresponsive, Some(&error), None)?;
        row.state = SandboxState::Unresponsive;
        row.error = Some(error);
        self.slots().unattached.insert(
            row.id.clone(),
            Unattached {
                row,
                next_try: Instant::now() + REATTACH_EVERY,
            },
        );
        Ok(())
    }

    /// Removes directories of the sandbox tree that no row owns, no live record names
    /// (a `forkd run` of another process) and no process uses: what a daemon killed
    /// before it wrote a row, or a build killed with it, left behind.
    pub fn prune_unowned(&self) -> Vec<String> {
        let owned: std::collections::HashSet<String> =
            self.list().into_iter().map(|l| l.row.id).collect();
        let dir = forkd_core::sandbox::sandboxes_dir(&self.home);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Vec::new();
        };
        let mut pruned = Vec::new();
        for e in entries.filter_map(Result::ok) {
            let Some(id) = e.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if owned.contains(&id) {
                continue;
            }
            if forkd_core::catalog::Record::read(&self.home, &id).is_ok_and(|r| r.alive()) {
                continue;
            }
            let path = e.path();
            if !forkd_host::process::find_inside(&path).is_empty() {
                continue;
            }
            if forkd_core::sandbox::remove_dir(&path).is_ok() {
                remove_cgroup(&id);
                pruned.push(id);
            }
        }
        pruned
    }

    /// Stops sandboxes whose deadline has passed, forgets those whose VM is gone or
    /// broken, persists each sandbox's state as its watchdog sees it (running or
    /// unresponsive), and tries again to take over unattached ones. Returns the ids
    /// removed.
    pub async fn reap(&self, now: i64) -> Vec<String> {
        self.reap_pools().await;
        let expired: Vec<String> = match self.state.expired(now) {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!("reading deadlines: {e}");
                Vec::new()
            }
        };
        let mut removed = Vec::new();
        for l in self.list() {
            let id = l.row.id.clone();
            let result = match &l.sandbox {
                Some(sb) => {
                    let entry = Entry {
                        row: l.row.clone(),
                        sandbox: sb.clone(),
                    };
                    if expired.contains(&id) || sb.vm().exited() || sb.failure().is_some() {
                        if let Some(f) = sb.failure() {
                            tracing::info!(%id, "sandbox failed: {f}");
                        }
                        self.remove(&entry).await.map(|()| true)
                    } else {
                        self.sync_health(&entry).map(|()| false)
                    }
                }
                None if l.row.state == SandboxState::Starting => Ok(false),
                None => self.retry_unattached(&l.row, expired.contains(&id)).await,
            };
            match result {
                Ok(true) => removed.push(id),
                Ok(false) => {}
                Err(e) => tracing::warn!(%id, "{e}"),
            }
        }
        removed
    }

    /// Persists what the watchdog sees: `unresponsive` while the agent is silent,
    /// `running` once it answers again.
    fn sync_health(&self, e: &Entry) -> Result<(), RegistryError> {
        let seen = if e.sandbox.is_unresponsive() {
            SandboxState::Unresponsive
        } else {
            SandboxState::Running
        };
        if seen == e.row.state || !e.row.state.can_become(seen) {
            return Ok(());
        }
        let error = (seen == SandboxState::Unresponsive)
            .then(|| "the guest agent does not answer its pings; the sandbox is kept".to_string());
        tracing::info!(id = %e.row.id, "sandbox is {seen}");
        self.transition(&e.row.id, seen, error)
    }

    /// An unattached sandbox: removed when its VM is gone or its deadline passed, taken
    /// over when it answers. Returns whether it was removed.
    async fn retry_unattached(
        &self,
        row: &SandboxRow,
        expired: bool,
    ) -> Result<bool, RegistryError> {
        let alive = forkd_host::process::is_running(row.pid, row.start_time);
        if expired || !alive {
            self.remove_row(row).await?;
            return Ok(true);
        }
        let due = self
            .slots()
            .unattached
            .get(&row.id)
            .is_some_and(|u| u.next_try <= Instant::now());
        if !due {
            return Ok(false);
        }
        if let Some(u) = self.slots().unattached.get_mut(&row.id) {
            u.next_try = Instant::now() + REATTACH_EVERY;
        }
        if let Ok(sb) = Sandbox::attach(
            self.hv.as_ref(),
            &self.home,
            &row.id,
            &attach_options(self.agent_timeout),
        )
        .await
        {
            tracing::info!(id = %row.id, "taken over");
            self.adopted(row.clone(), sb)?;
        }
        Ok(false)
    }
}

/// Records each child of a fork as it goes (see [`ForkObserver`]).
struct Recorder<'a> {
    registry: &'a Registry,
    spec: &'a CreateSpec,
    tag: String,
    op: String,
    done: AtomicU64,
}

fn recording_failed(registry: &Registry, e: StateError) -> SandboxError {
    if e.is_disk_full() {
        let root = registry.home.root();
        return SandboxError::NoSpace {
            what: "recording sandboxes in the state database".into(),
            path: root.display().to_string(),
            needed_mib: forkd_core::space::RESERVE.div_ceil(1 << 20),
            available_mib: forkd_core::space::available(root).unwrap_or(0) >> 20,
        };
    }
    SandboxError::Io {
        context: "recording the sandbox in the state database".into(),
        source: std::io::Error::other(e.to_string()),
    }
}

impl ForkObserver for Recorder<'_> {
    fn planned(&self, configs: &[VmConfig]) -> Result<(), SandboxError> {
        let created_at = crate::now_rfc3339();
        let rows: Vec<SandboxRow> = configs
            .iter()
            .map(|config| SandboxRow {
                id: config.id.clone(),
                snapshot: self.tag.clone(),
                pid: 0,
                start_time: 0,
                config: config.clone(),
                labels: self.spec.labels.clone(),
                timeout_at: self.spec.timeout_at,
                created_at: created_at.clone(),
                state: SandboxState::Starting,
                error: None,
            })
            .collect();
        self.registry
            .state
            .insert_sandboxes(&rows)
            .map_err(|e| recording_failed(self.registry, e))?;
        let mut slots = self.registry.slots();
        for row in rows {
            slots.starting.insert(row.id.clone(), row);
        }
        drop(slots);
        failpoint::hit("fork.after_row");
        Ok(())
    }

    fn ready(&self, child: &Sandbox) -> Result<(), SandboxError> {
        // Known in memory only: the row says `running` when the child is handed out,
        // in one write for the whole fork (a daemon killed before that removes it).
        let process = (
            child.pid().unwrap_or(0),
            child.vm().start_time().unwrap_or(0),
        );
        let mut slots = self.registry.slots();
        if let Some(row) = slots.starting.get_mut(child.id()) {
            (row.pid, row.start_time) = process;
        }
        let done = self.done.fetch_add(1, Ordering::SeqCst) + 1;
        slots.progress.insert(self.op.clone(), done);
        Ok(())
    }

    fn discarded(&self, id: &str) {
        if let Err(e) = self.registry.state.delete_sandbox(id) {
            tracing::warn!(%id, "forgetting a discarded child: {e}");
        }
        self.registry.slots().starting.remove(id);
    }
}

/// Removes the cgroup of the VM of sandbox `id`, whose QEMU is gone (nothing if VMs get
/// no cgroups here, or it has none left).
fn remove_cgroup(id: &str) {
    if let Ok(Some(cgroups)) = forkd_host::cgroup::for_vms() {
        cgroups.remove(id);
    }
}

#[cfg(test)]
mod tests {
    //! The registry's rules on the fake backend (agent processes for VMs): capacity,
    //! state transitions, reaping and adoption after a crash, in milliseconds.

    use super::*;
    use forkd_core::snapshot::manifest::{parts, BuildTimes, Machine, Manifest, Versions};
    use forkd_core::snapshot::Tag;
    use forkd_hypervisor::fake::AgentProcesses;
    use forkd_hypervisor::Accel;
    use forkd_proto::exec::{Command, ExecRequest};

    struct World {
        _dir: tempfile::TempDir,
        home: Home,
        state: Arc<State>,
        snap: Snapshot,
    }

    fn world() -> World {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::new(dir.path());
        let snap = fake_snapshot(&home, "fake");
        let state = Arc::new(State::open(&dir.path().join("forkd.db")).unwrap());
        World {
            _dir: dir,
            home,
            state,
            snap,
        }
    }

    /// A snapshot `tag` whose parts are placeholder files (the fake backend reads none).
    fn fake_snapshot(home: &Home, tag: &str) -> Snapshot {
        let store = Store::of_home(home);
        let tag = Tag::parse(tag).unwrap();
        let staging = store.stage(&tag).unwrap();
        for p in parts::ALL {
            std::fs::write(staging.part(p), p.as_bytes()).unwrap();
        }
        let manifest = Manifest {
            format: forkd_core::snapshot::manifest::FORMAT,
            tag: tag.to_string(),
            template: "fake".into(),
            created_at: "2026-01-01T00:00:00Z".into(),
            parent: None,
            parent_digest: None,
            branch: None,
            machine: Machine {
                vcpus: 1,
                memory_mib: 128,
                accel: Accel::Tcg,
                cpu: "max".into(),
                cmdline: String::new(),
                clock: Default::default(),
                pit: true,
                nic: false,
            },
            versions: Versions {
                kernel: "none".into(),
                rootfs: "none".into(),
                initramfs_sha256: String::new(),
                forkd: "test".into(),
                agent_protocol: forkd_proto::PROTOCOL_VERSION,
                hypervisor: "fake".into(),
                hypervisor_version: "fake".into(),
            },
            parts: Default::default(),
            contexts: Vec::new(),
            build: BuildTimes::default(),
            pool: 0,
            egress: None,
        };
        staging.publish(manifest, &|_| {}).unwrap()
    }

    fn fake() -> AgentProcesses {
        AgentProcesses::from_build(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
    }

    impl World {
        fn registry(&self, max: usize) -> Registry {
            self.registry_on(fake(), max)
        }

        fn registry_on(&self, hv: AgentProcesses, max: usize) -> Registry {
            Registry::new(
                Arc::new(hv),
                self.home.clone(),
                Store::of_home(&self.home),
                self.state.clone(),
                max,
            )
            .with_agent_timeout(Duration::from_millis(600))
        }
    }

    use std::path::Path;

    fn spec(count: usize) -> CreateSpec {
        CreateSpec::new(count)
    }

    fn signal(row: &SandboxRow, sig: nix::sys::signal::Signal) {
        assert!(forkd_host::process::signal(row.pid, row.start_time, sig));
    }

    async fn echo(e: &Entry) -> Result<forkd_core::agent::ExecResult, SandboxError> {
        e.sandbox
            .exec(
                ExecRequest::new(Command::Argv(vec!["echo".into(), "hi".into()])),
                None,
            )
            .await
    }

    /// Runs the reaper until `done` holds (the watchdog works on its own clock).
    async fn reap_until(r: &Registry, done: impl Fn(&Registry) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done(r) {
            assert!(Instant::now() < deadline, "condition not reached");
            r.reap(crate::unix_now()).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn db_state(w: &World, id: &str) -> Option<SandboxState> {
        w.state.sandbox(id).unwrap().map(|r| r.state)
    }

    #[tokio::test]
    async fn children_get_the_env_they_were_created_with() {
        let w = world();
        let r = w.registry(2);
        let spec = CreateSpec {
            env: [("FORKD_T".to_owned(), "a b=c".to_owned())].into(),
            ..spec(1)
        };
        let e = r.create(&w.snap, spec).await.unwrap().entries.remove(0);
        let mut req = ExecRequest::new(Command::Shell("echo \"$FORKD_T|$HOME\"".into()));
        let out = e.sandbox.exec(req.clone(), None).await.unwrap();
        assert_eq!(out.stdout, b"a b=c|/root\n");
        // A request's own env still wins.
        req.env.insert("FORKD_T".into(), "mine".into());
        let out = e.sandbox.exec(req, None).await.unwrap();
        assert_eq!(out.stdout, b"mine|/root\n");
    }

    #[tokio::test]
    async fn capacity_counts_every_recorded_sandbox_and_rows_say_running() {
        let w = world();
        let r = w.registry(3);
        let two = r.create(&w.snap, spec(2)).await.unwrap().entries;
        assert_eq!(r.running(), 2);
        for e in &two {
            assert_eq!(db_state(&w, &e.row.id), Some(SandboxState::Running));
            let row = w.state.sandbox(&e.row.id).unwrap().unwrap();
            assert_eq!(row.pid, e.sandbox.pid().unwrap());
            assert_ne!(row.start_time, 0);
            assert_eq!(echo(e).await.unwrap().stdout, b"hi\n");
        }
        let Err(e) = r.create(&w.snap, spec(2)).await else {
            panic!("a fork over capacity was accepted");
        };
        assert!(
            matches!(
                e,
                RegistryError::AtCapacity {
                    live: 2,
                    asked: 2,
                    max: 3
                }
            ),
            "{e}"
        );
        let op_rows = w.state.sandboxes().unwrap();
        assert_eq!(op_rows.len(), 2, "a refused fork records nothing");
        for e in &two {
            r.delete(&e.row.id).await.unwrap();
            assert!(!e.row.config.dir.exists());
            assert_eq!(db_state(&w, &e.row.id), None);
        }
        assert_eq!(r.running(), 0);
    }

    #[tokio::test]
    async fn a_silent_agent_makes_a_sandbox_unresponsive_until_it_answers() {
        let w = world();
        let r = w.registry(4);
        let e = r.create(&w.snap, spec(1)).await.unwrap().entries.remove(0);
        let id = e.row.id.clone();
        signal(&e.row, nix::sys::signal::Signal::SIGSTOP);
        reap_until(&r, |r| {
            r.describe(&id).unwrap().row.state == SandboxState::Unresponsive
        })
        .await;
        assert_eq!(db_state(&w, &id), Some(SandboxState::Unresponsive));
        let err = echo(&e).await.unwrap_err();
        assert!(matches!(err, SandboxError::Unresponsive { .. }), "{err}");
        assert!(err.to_string().contains("kept"), "{err}");
        assert!(e.sandbox.failure().is_none());
        assert!(forkd_host::process::is_alive(e.row.pid), "the VM is kept");
        signal(&e.row, nix::sys::signal::Signal::SIGCONT);
        reap_until(&r, |r| {
            r.describe(&id).unwrap().row.state == SandboxState::Running
        })
        .await;
        assert_eq!(db_state(&w, &id), Some(SandboxState::Running));
        assert_eq!(echo(&e).await.unwrap().stdout, b"hi\n");
        r.delete(&id).await.unwrap();
    }

    #[tokio::test]
    async fn a_vm_that_dies_is_reaped_and_a_deadline_ends_a_sandbox() {
        let w = world();
        let r = w.registry(4);
        let mut two = r.create(&w.snap, spec(2)).await.unwrap().entries;
        let (a, b) = (two.remove(0), two.remove(0));
        forkd_host::process::kill(a.row.pid, a.row.start_time);
        reap_until(&r, |r| r.get(&a.row.id).is_err()).await;
        assert_eq!(db_state(&w, &a.row.id), None);
        assert!(!a.row.config.dir.exists());
        r.set_timeout(&b.row.id, Some(crate::unix_now() - 1))
            .unwrap();
        let removed = r.reap(crate::unix_now()).await;
        assert_eq!(removed, vec![b.row.id.clone()]);
        assert!(!forkd_host::process::is_alive(b.row.pid));
        assert_eq!(r.running(), 0);
    }

    #[tokio::test]
    async fn a_restart_adopts_live_children_and_removes_what_a_crash_left() {
        let w = world();
        let first = w.registry(8);
        let mut kids = first.create(&w.snap, spec(3)).await.unwrap().entries;
        // The daemon "dies": its handles go, its detached VMs run on.
        drop(first);
        let (live, dead, stopping) = (kids.remove(0), kids.remove(0), kids.remove(0));
        forkd_host::process::kill(dead.row.pid, dead.row.start_time);
        // A delete was interrupted after it marked the row.
        w.state
            .set_state(&stopping.row.id, SandboxState::Stopping, None, None)
            .unwrap();
        // A fork was interrupted after the row of a child and its VM's start, before its
        // pid was recorded: found by its directory on a command line.
        let orphan_dir = forkd_core::sandbox::sandboxes_dir(&w.home).join("sb-0badc0ffee");
        std::fs::create_dir_all(&orphan_dir).unwrap();
        let mut orphan_cfg = live.row.config.clone();
        orphan_cfg.id = "sb-0badc0ffee".into();
        orphan_cfg.dir = orphan_dir.clone();
        w.state
            .insert_sandbox(&SandboxRow {
                id: "sb-0badc0ffee".into(),
                pid: 0,
                start_time: 0,
                config: orphan_cfg,
                state: SandboxState::Starting,
                ..live.row.clone()
            })
            .unwrap();
        let mut orphan = std::process::Command::new("sh")
            .args(["-c", "sleep 60; true"])
            .arg(orphan_dir.join("qmp.sock"))
            .spawn()
            .unwrap();
        // A directory nobody owns, left by a fork killed before its row.
        let stray = forkd_core::sandbox::sandboxes_dir(&w.home).join("sb-5ca7");
        std::fs::create_dir_all(&stray).unwrap();

        let second = w.registry(8);
        let (adopted, gone) = second.adopt_all().await.unwrap();
        assert_eq!(adopted, vec![live.row.id.clone()]);
        let mut gone = gone;
        gone.sort();
        let mut expected = vec![
            dead.row.id.clone(),
            stopping.row.id.clone(),
            "sb-0badc0ffee".to_string(),
        ];
        expected.sort();
        assert_eq!(gone, expected);
        assert!(!forkd_host::process::is_alive(stopping.row.pid));
        assert!(!forkd_host::process::is_alive(orphan.id()));
        assert!(!orphan.wait().unwrap().success(), "killed, not ended");
        assert!(!orphan_dir.exists() && !dead.row.config.dir.exists());
        assert_eq!(second.prune_unowned(), vec!["sb-5ca7".to_string()]);
        assert!(live.row.config.dir.exists());
        assert_eq!(second.running(), 1);
        let e = second.get(&live.row.id).unwrap();
        assert_eq!(echo(&e).await.unwrap().stdout, b"hi\n");
        assert_eq!(
            w.state.sandboxes().unwrap().len(),
            1,
            "nothing double-counted"
        );
        second.delete(&live.row.id).await.unwrap();
    }

    #[tokio::test]
    async fn a_live_vm_that_cannot_be_reached_is_kept_not_killed() {
        let w = world();
        let first = w.registry(8);
        let e = first
            .create(&w.snap, spec(1))
            .await
            .unwrap()
            .entries
            .remove(0);
        drop(first);
        // Its agent does not answer the restarted daemon (stopped), yet it runs.
        signal(&e.row, nix::sys::signal::Signal::SIGSTOP);
        let second = w.registry(8);
        let (adopted, gone) = second.adopt_all().await.unwrap();
        assert!(
            adopted.is_empty() && gone.is_empty(),
            "{adopted:?} {gone:?}"
        );
        let listed = second.describe(&e.row.id).unwrap();
        assert_eq!(listed.row.state, SandboxState::Unresponsive);
        assert!(listed.sandbox.is_none());
        assert!(matches!(
            second.get(&e.row.id),
            Err(SandboxError::NotReady { .. })
        ));
        assert!(forkd_host::process::is_alive(e.row.pid));
        assert_eq!(second.running(), 1);
        // Once it answers, the reaper takes it over.
        signal(&e.row, nix::sys::signal::Signal::SIGCONT);
        if let Some(u) = second.slots().unattached.get_mut(&e.row.id) {
            u.next_try = Instant::now();
        }
        reap_until(&second, |r| r.get(&e.row.id).is_ok()).await;
        assert_eq!(db_state(&w, &e.row.id), Some(SandboxState::Running));
        second.delete(&e.row.id).await.unwrap();
        assert!(!forkd_host::process::is_alive(e.row.pid));
    }

    /// Every process whose command line names a sandbox directory of this world.
    fn vms_of(w: &World) -> Vec<(u32, u64)> {
        let dir = forkd_core::sandbox::sandboxes_dir(&w.home);
        forkd_host::process::find_inside(&dir)
    }

    #[tokio::test]
    async fn a_fork_of_twelve_with_k_3_never_restores_more_than_3_at_once() {
        let w = world();
        let hv = fake().with_restore_delay(Duration::from_millis(50));
        let r = w.registry_on(hv.clone(), 16).with_fork_parallelism(3);
        let out = r.create(&w.snap, spec(12)).await.unwrap();
        assert_eq!(out.entries.len(), 12);
        // The restores overlap (3 at a time), and never more: without pacing all 12
        // would be in flight together.
        assert_eq!(hv.most_restores_in_flight(), 3);
        let op = w.state.operation(&out_op(&w)).unwrap().unwrap();
        assert_eq!(
            (op.status.as_str(), op.done, op.total),
            ("succeeded", 12, 12)
        );
        for e in out.entries {
            r.delete(&e.row.id).await.unwrap();
        }
        assert!(vms_of(&w).is_empty());
    }

    /// The id of the one fork operation of a world.
    fn out_op(w: &World) -> String {
        let conn = rusqlite::Connection::open(w._dir.path().join("forkd.db")).unwrap();
        conn.query_row("SELECT id FROM operations WHERE kind = 'fork'", [], |r| {
            r.get(0)
        })
        .unwrap()
    }

    #[tokio::test]
    async fn a_partial_fork_keeps_the_started_children_and_lists_the_errors() {
        let w = world();
        let r = w
            .registry_on(fake().with_failing_restores(3), 16)
            .with_fork_parallelism(2);
        let out = r
            .create(
                &w.snap,
                CreateSpec {
                    partial: true,
                    ..spec(6)
                },
            )
            .await
            .unwrap();
        assert_eq!((out.entries.len(), out.failures.len()), (4, 2));
        for f in &out.failures {
            assert!(f.to_string().contains("fake backend fails"), "{f}");
        }
        assert_eq!(
            w.state.sandboxes().unwrap().len(),
            4,
            "failed children leave no row"
        );
        assert_eq!(vms_of(&w).len(), 4);
        let op = w.state.operation(&out_op(&w)).unwrap().unwrap();
        let result = op.result.unwrap();
        assert_eq!(result["sandboxes"].as_array().unwrap().len(), 4);
        assert_eq!(result["errors"].as_array().unwrap().len(), 2);
        for e in out.entries {
            r.delete(&e.row.id).await.unwrap();
        }

        // All or nothing (the default): one failure and nothing is kept.
        let r = w
            .registry_on(fake().with_failing_restores(3), 16)
            .with_fork_parallelism(2);
        let Err(e) = r.create(&w.snap, spec(6)).await else {
            panic!("an all-or-nothing fork with a failed child succeeded");
        };
        assert!(e.to_string().contains("fake backend fails"), "{e}");
        assert!(w.state.sandboxes().unwrap().is_empty());
        assert!(vms_of(&w).is_empty());
        assert_eq!(r.running(), 0);
    }

    #[tokio::test]
    async fn a_cancelled_fork_leaves_nothing() {
        let w = world();
        let r = w
            .registry_on(fake().with_restore_delay(Duration::from_millis(100)), 16)
            .with_fork_parallelism(1);
        let s = CreateSpec {
            partial: true,
            ..spec(12)
        };
        let op = s.op_id.clone();
        let fork = r.create(&w.snap, s);
        let cancel = async {
            // Cancel once a few children are up.
            loop {
                if r.progress(&op).unwrap_or(0) >= 2 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(r.cancel(&op));
        };
        let (res, ()) = tokio::join!(fork, cancel);
        let Err(e) = res else {
            panic!("a cancelled fork succeeded");
        };
        assert!(
            matches!(e, RegistryError::Sandbox(SandboxError::Cancelled)),
            "{e}"
        );
        assert!(w.state.sandboxes().unwrap().is_empty());
        assert!(vms_of(&w).is_empty(), "{:?}", vms_of(&w));
        assert_eq!(r.running(), 0);
        let row = w.state.operation(&op).unwrap().unwrap();
        assert_eq!(row.status, "cancelled");
        assert!(!r.cancel(&op), "a finished fork cannot be cancelled");
        let left = std::fs::read_dir(forkd_core::sandbox::sandboxes_dir(&w.home))
            .map(|d| d.count())
            .unwrap_or(0);
        assert_eq!(left, 0, "no sandbox directory is left");
    }

    #[tokio::test]
    async fn a_fork_that_would_not_fit_in_memory_is_refused_before_anything_starts() {
        let w = world();
        let r = w.registry(16).with_memory_overcommit(1e-12);
        let Err(e) = r.create(&w.snap, spec(2)).await else {
            panic!("a fork past the memory budget was admitted");
        };
        assert!(matches!(e, RegistryError::Memory(_)), "{e}");
        assert!(e.to_string().contains("the default"), "{e}");
        assert!(w.state.sandboxes().unwrap().is_empty());
        assert!(vms_of(&w).is_empty());
        // With a child alive, the estimate is measured on it.
        let r = w.registry(16);
        let one = r.create(&w.snap, spec(1)).await.unwrap().entries;
        let r2 = w.registry(16).with_memory_overcommit(1e-12);
        r2.adopt_all().await.unwrap();
        let Err(e) = r2.create(&w.snap, spec(1)).await else {
            panic!("a fork past the memory budget was admitted");
        };
        assert!(e.to_string().contains("measured on 1 live"), "{e}");
        drop(r);
        r2.delete(&one[0].row.id).await.unwrap();
    }

    /// Ids of the pool members recorded in the database.
    fn member_rows(w: &World) -> Vec<String> {
        w.state
            .pool_members()
            .unwrap()
            .into_iter()
            .map(|m| m.id)
            .collect()
    }

    #[tokio::test]
    async fn a_pool_of_3_serves_3_forks_and_refills() {
        let w = world();
        let r = w.registry(8);
        let status = r.set_pool_size(&w.snap, Some(3)).await.unwrap();
        assert_eq!((status.size, status.source.as_str()), (3, "api"));
        assert_eq!(r.fill_pools().await, 3);
        assert_eq!(r.fill_pools().await, 0, "a full pool makes no more");
        let members = member_rows(&w);
        assert_eq!(members.len(), 3);
        assert_eq!(vms_of(&w).len(), 3, "each member's VM runs");
        assert!(r.list().is_empty(), "members are not sandboxes");
        for (i, _) in members.iter().enumerate() {
            let child = r.create(&w.snap, spec(1)).await.unwrap().entries.remove(0);
            assert!(
                members.contains(&child.row.id),
                "fork {i} made {} instead of taking a member",
                child.row.id
            );
            assert_eq!(db_state(&w, &child.row.id), Some(SandboxState::Running));
            assert_eq!(echo(&child).await.unwrap().stdout, b"hi\n");
            assert_eq!(r.pool_status(&w.snap).idle, 2 - i);
            assert!(!member_rows(&w).contains(&child.row.id));
        }
        assert_eq!(
            r.fill_pools().await,
            0,
            "the pool waits for the children's start"
        );
        tokio::time::sleep(crate::pool::REFILL_AFTER).await;
        assert_eq!(r.fill_pools().await, 3, "the pool refills");
        let refilled = member_rows(&w);
        assert!(refilled.iter().all(|id| !members.contains(id)));
        assert_eq!(vms_of(&w).len(), 6);

        // A daemon's members are its own: the next one removes them, VMs and files.
        let dirs: Vec<_> = w
            .state
            .pool_members()
            .unwrap()
            .into_iter()
            .map(|m| m.dir)
            .collect();
        drop(r);
        let r = w.registry(8);
        assert_eq!(r.open_pools().await.unwrap(), 3);
        assert!(member_rows(&w).is_empty());
        assert!(dirs.iter().all(|d| !d.exists()));
        r.adopt_all().await.unwrap();
        assert_eq!(vms_of(&w).len(), 3, "only the three children are left");
        assert_eq!(r.pool_status(&w.snap).size, 3, "the size set is kept");
        for l in r.list() {
            r.delete(&l.row.id).await.unwrap();
        }
        r.drain_pool("fake").await;
        assert!(vms_of(&w).is_empty());
    }

    #[tokio::test]
    async fn idle_members_are_reclaimed_before_a_fork_is_refused() {
        let w = world();
        let other = fake_snapshot(&w.home, "other");
        let r = w.registry(4);
        r.set_pool_size(&other, Some(3)).await.unwrap();
        assert_eq!(r.fill_pools().await, 3);
        // 3 members of `other` + 2 children of `fake` exceed 4: the members go.
        let two = r.create(&w.snap, spec(2)).await.unwrap().entries;
        assert_eq!(two.len(), 2);
        assert_eq!(r.pool_status(&other).idle, 0);
        assert!(member_rows(&w).is_empty());
        assert_eq!(vms_of(&w).len(), 2);
        // A pool refills only where there is room.
        tokio::time::sleep(crate::pool::REFILL_AFTER).await;
        assert_eq!(r.fill_pools().await, 2);
        let Err(e) = r.create(&w.snap, spec(3)).await else {
            panic!("a fork over capacity was accepted");
        };
        assert!(matches!(e, RegistryError::AtCapacity { .. }), "{e}");
        for e in two {
            r.delete(&e.row.id).await.unwrap();
        }
        r.drain_pool("other").await;
        assert!(vms_of(&w).is_empty());
    }

    #[tokio::test]
    async fn a_member_whose_vm_died_is_replaced_by_a_fresh_restore() {
        let w = world();
        let r = w.registry(8);
        r.set_pool_size(&w.snap, Some(2)).await.unwrap();
        assert_eq!(r.fill_pools().await, 2);
        let members = member_rows(&w);
        // One member's VM dies while it waits.
        let (pid, _) = vms_of(&w)[0];
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        while vms_of(&w).len() > 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let two = r.create(&w.snap, spec(2)).await.unwrap().entries;
        assert_eq!(two.len(), 2, "the fork does not fail for a dead member");
        assert!(two.iter().any(|e| members.contains(&e.row.id)));
        for e in &two {
            assert_eq!(echo(e).await.unwrap().stdout, b"hi\n");
        }
        assert_eq!(vms_of(&w).len(), 2, "one VM per child");
        for e in two {
            r.delete(&e.row.id).await.unwrap();
        }
        r.set_pool_size(&w.snap, Some(0)).await.unwrap();
        assert!(vms_of(&w).is_empty());
    }
}
