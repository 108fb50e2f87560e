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

use crate::state::{SandboxRow, State, StateError};
use forkd_core::{Sandbox, SandboxError, SandboxOptions};
use forkd_host::network::policy::EgressPolicy;
use forkd_hypervisor::Hypervisor;
use forkd_image::Home;
use forkd_storage::snapshot::Store;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod capacity;
mod forks;
mod live;
mod operations;
mod pauses;
mod takeover;

pub use pauses::{PauseOutcome, ResumeOutcome};

/// Why the registry refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("at capacity: {live} sandboxes run or are starting and {asked} more were asked for; the limit is {max}")]
    AtCapacity {
        /// Running or being created.
        live: usize,
        /// Asked for.
        asked: usize,
        /// The limit.
        max: usize,
    },
    #[error(transparent)]
    Memory(#[from] crate::admission::InsufficientMemory),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("sandbox {id} has no NIC: its snapshot's template was built with network = \"none\" (or on a host without networking)")]
    NoNic { id: String },
    #[error("sandbox {id} cannot be branched: the snapshot its disk builds on ({base}) cannot be opened: {source}")]
    BaseUnavailable {
        id: String,
        base: String,
        source: Box<forkd_storage::snapshot::SnapshotError>,
    },
    #[error("sandbox {id} is being branched already (into {into})")]
    BranchingAlready { id: String, into: String },
    #[error("snapshot {tag} is being written by another branch")]
    TagBeingWritten { tag: String },
    #[error("sandbox {id} was stopped during the branch ({source})")]
    StoppedDuringBranch { id: String, source: SandboxError },
    #[error("sandbox {id} is being branched (into {into}); pause it once the branch is written")]
    PauseDuringBranch { id: String, into: String },
    #[error("{paused} sandboxes are paused, the most this daemon keeps (--max-paused); delete some or resume them")]
    PausedAtCapacity { paused: usize },
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

impl From<Entry> for Listed {
    fn from(e: Entry) -> Listed {
        Listed {
            row: e.row,
            sandbox: Some(e.sandbox),
        }
    }
}

/// The live sandboxes.
pub struct Registry {
    hv: Arc<dyn Hypervisor>,
    home: Home,
    store: Store,
    state: Arc<State>,
    max: usize,
    /// The most sandboxes kept paused at once.
    max_paused: usize,
    agent_timeout: Duration,
    fork_parallel: usize,
    memory_overcommit: f64,
    /// Where sandboxes' resolvers send the names they may resolve; none: no resolver.
    dns_upstream: Option<std::net::SocketAddr>,
    slots: Mutex<Slots>,
    /// Wakes the pool filler (a fork ended, a pool size changed).
    pub(crate) pool_wakeup: tokio::sync::Notify,
    /// Where what happens to the sandboxes is recorded and announced.
    events: Arc<crate::events::Events>,
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
    /// Without a VM: paused or resuming (their VM is on disk), or failed at a resume
    /// (their files kept until they are deleted).
    pub(crate) paused: HashMap<String, SandboxRow>,
    /// When each live sandbox last served a request (see [`Registry::touch`]).
    last_used: HashMap<String, Instant>,
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

impl Slots {
    /// The state of the sandbox `id` among those with a VM handle.
    pub(crate) fn live_state(&self, id: &str) -> Option<forkd_core::lifecycle::SandboxState> {
        self.live.get(id).map(|e| e.row.state)
    }
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
    /// Unix time after which the daemon stops (or pauses) each child.
    pub timeout_at: Option<i64>,
    /// What the children's deadline and idleness do.
    pub lifecycle: crate::state::Lifecycle,
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
            lifecycle: Default::default(),
            partial: false,
            limits: Default::default(),
            egress: Default::default(),
            op_id: new_operation_id(),
        }
    }
}

/// A fresh operation id.
pub fn new_operation_id() -> String {
    format!("op-{}", forkd_host::ids::random_hex(8))
}

/// What a fork made.
pub struct CreateOutcome {
    /// The children, running.
    pub entries: Vec<Entry>,
    /// Why each child that did not start failed (a partial fork only).
    pub failures: Vec<SandboxError>,
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
            max,
            max_paused: crate::config::DEFAULT_MAX_PAUSED,
            agent_timeout: SandboxOptions::default().agent_timeout,
            fork_parallel: forkd_core::fork::default_parallel(),
            memory_overcommit: 1.0,
            dns_upstream: None,
            slots: Mutex::new(Slots::default()),
            pool_wakeup: tokio::sync::Notify::new(),
            events: Arc::new(crate::events::Events::new(state.clone())),
            state,
        }
    }

    /// The most sandboxes kept paused at once (a pause beyond it is refused).
    pub fn with_max_paused(mut self, n: usize) -> Registry {
        self.max_paused = n;
        self
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

    /// Where the sandboxes' lifecycle events go.
    pub fn events(&self) -> &Arc<crate::events::Events> {
        &self.events
    }

    /// The state database.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// The state database, shared.
    pub fn state_arc(&self) -> Arc<State> {
        self.state.clone()
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
mod tests;
