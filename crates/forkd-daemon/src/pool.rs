//! Warm pools: per snapshot, children made ready ahead of forks. A member has its
//! directory, its disk layer and a restored VM, paused once its agent answered the
//! resume hook, with the connection to it kept open (see
//! [`forkd_core::fork::PlannedChild::prepare`]); a fork that takes it only starts the
//! vCPUs and runs the resume hook with the fork's variables.
//!
//! A pool's size is its recipe's `pool`, unless the API set another. Members are made
//! one at a time, in the background, and only while no fork runs (under TCG, preparing
//! a member takes CPU a fork would want). Members count against the sandbox limit; a
//! fork that would not fit reclaims idle members of other snapshots before it is
//! refused. Each member is recorded before its VM starts and its row removed when a
//! fork takes it (in the same transaction as the child's row), so a daemon killed at
//! any point leaves nothing its next start does not remove.

use crate::registry::{Registry, RegistryError};
use crate::state::PoolMemberRow;
use forkd_core::fork::{ForkOptions, PreparedChild};
use forkd_storage::snapshot::Snapshot;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a pool waits before it tries again after a member could not be prepared.
const RETRY_AFTER: Duration = Duration::from_secs(30);

/// How long after a fork ends the pools wait before they refill: the children it made
/// run their first commands then, and on a host with few cores starting a QEMU beside
/// them would slow them down.
pub const REFILL_AFTER: Duration = Duration::from_secs(1);

/// The pools, kept with the registry's slots (members count against its limit).
#[derive(Default)]
pub(crate) struct Pools {
    /// Sizes set through the API, by snapshot tag (else the recipe's).
    sizes: HashMap<String, usize>,
    /// Idle members by tag, oldest first.
    idle: HashMap<String, Vec<PreparedChild>>,
    /// Members being prepared, by tag.
    filling: HashMap<String, usize>,
    /// Pools that must not grow: their snapshot is being removed.
    closed: std::collections::HashSet<String>,
    /// Why the last member of a pool could not be prepared, and when to try again.
    failing: HashMap<String, (String, Instant)>,
    /// When the last fork ended.
    last_fork: Option<Instant>,
}

impl crate::registry::Slots {
    /// Whether a fork runs, or one ended less than [`REFILL_AFTER`] ago: its children
    /// have the CPU, pools wait.
    fn fork_busy(&self) -> bool {
        self.reserved > 0 || !self.pools.refill_wait().is_zero()
    }
}

impl Pools {
    /// Notes that a fork ended (see [`REFILL_AFTER`]).
    pub(crate) fn fork_ended(&mut self) {
        self.last_fork = Some(Instant::now());
    }

    /// How long the pools must still wait before they refill.
    pub(crate) fn refill_wait(&self) -> Duration {
        self.last_fork
            .map_or(Duration::ZERO, |t| REFILL_AFTER.saturating_sub(t.elapsed()))
    }

    /// The size of `snap`'s pool, and where it comes from (`api` or `recipe`).
    fn size_of(&self, snap: &Snapshot) -> (usize, &'static str) {
        match self.sizes.get(snap.tag.as_str()) {
            Some(n) => (*n, "api"),
            None => (snap.manifest.pool as usize, "recipe"),
        }
    }

    /// Whether `snap`'s pool is short of its size and may grow (it is open and not
    /// waiting to try again after a failure).
    fn wants_member(&self, snap: &Snapshot) -> bool {
        let tag = snap.tag.as_str();
        let have = self.idle_of(tag) + self.filling.get(tag).copied().unwrap_or(0);
        let waiting = self
            .failing
            .get(tag)
            .is_some_and(|(_, at)| *at > Instant::now());
        have < self.size_of(snap).0 && !self.closed.contains(tag) && !waiting
    }

    /// Members that hold (or are starting) a VM.
    pub(crate) fn held(&self) -> usize {
        self.idle_total() + self.filling.values().sum::<usize>()
    }

    /// Idle members of every pool.
    pub(crate) fn idle_total(&self) -> usize {
        self.idle.values().map(Vec::len).sum()
    }

    /// Idle members of `tag`.
    pub(crate) fn idle_of(&self, tag: &str) -> usize {
        self.idle.get(tag).map_or(0, Vec::len)
    }

    /// Takes up to `n` idle members of `tag`, oldest first, and the ones found dead.
    pub(crate) fn take(&mut self, tag: &str, n: usize) -> (Vec<PreparedChild>, Vec<PreparedChild>) {
        let Some(members) = self.idle.get_mut(tag) else {
            return (Vec::new(), Vec::new());
        };
        let (dead, live): (Vec<_>, Vec<_>) = members.drain(..).partition(|m| m.exited());
        let mut live = live.into_iter();
        let taken: Vec<_> = live.by_ref().take(n).collect();
        *members = live.collect();
        (taken, dead)
    }

    /// Takes every idle member of the pools other than `tag`'s.
    fn take_others(&mut self, tag: &str) -> Vec<PreparedChild> {
        self.idle
            .iter_mut()
            .filter(|(t, _)| t.as_str() != tag)
            .flat_map(|(_, m)| m.drain(..))
            .collect()
    }
}

/// A pool as the API shows it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct PoolStatus {
    /// The snapshot.
    pub snapshot: String,
    /// Members it keeps ready.
    pub size: usize,
    /// Where the size comes from: `recipe` or `api`.
    pub source: String,
    /// Members ready now.
    pub idle: usize,
    /// Members being prepared.
    pub filling: usize,
    /// Why the last member could not be prepared, while the pool waits to try again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Removes a member's recorded VM and files (see [`forkd_host::process::kill_vm`]).
fn remove_leftover(row: &PoolMemberRow) {
    forkd_host::process::kill_vm(row.pid, row.start_time, &row.dir);
    let _ = forkd_core::sandbox::remove_dir(&row.dir);
}

/// Gives a filling slot back however the preparation ends.
struct Filling<'a> {
    registry: &'a Registry,
    tag: String,
}

impl Drop for Filling<'_> {
    fn drop(&mut self) {
        let mut slots = self.registry.slots();
        if let Some(n) = slots.pools.filling.get_mut(&self.tag) {
            *n -= 1;
            if *n == 0 {
                slots.pools.filling.remove(&self.tag);
            }
        }
    }
}

impl Registry {
    /// Loads the pool sizes set through the API, and removes every pool member the last
    /// daemon left: a member is only ever this daemon's. Returns how many were removed.
    pub async fn open_pools(&self) -> Result<usize, RegistryError> {
        let sizes = self.state().pool_sizes()?;
        self.slots().pools.sizes = sizes.into_iter().collect();
        let rows = self.state().pool_members()?;
        let n = rows.len();
        for row in rows {
            let r = row.clone();
            let _ = tokio::task::spawn_blocking(move || remove_leftover(&r)).await;
            self.state().delete_pool_member(&row.id)?;
        }
        Ok(n)
    }

    /// The pool of `snap` as it stands.
    pub fn pool_status(&self, snap: &Snapshot) -> PoolStatus {
        let tag = snap.tag.as_str();
        let slots = self.slots();
        let p = &slots.pools;
        let (size, source) = p.size_of(snap);
        PoolStatus {
            snapshot: tag.to_owned(),
            size,
            source: source.into(),
            idle: p.idle_of(tag),
            filling: p.filling.get(tag).copied().unwrap_or(0),
            error: p.failing.get(tag).map(|(e, _)| e.clone()),
        }
    }

    /// How long the pools must still wait before they refill (see [`REFILL_AFTER`]).
    pub fn pool_refill_wait(&self) -> Duration {
        self.slots().pools.refill_wait()
    }

    /// Idle pool members by snapshot tag (for metrics).
    pub fn pool_idle(&self) -> Vec<(String, usize)> {
        let slots = self.slots();
        slots
            .pools
            .idle
            .iter()
            .map(|(t, m)| (t.clone(), m.len()))
            .collect()
    }

    /// Sets the pool size of `snap` (None: back to its recipe's). A smaller pool
    /// discards its extra idle members at once; a larger one fills in the background.
    pub async fn set_pool_size(
        &self,
        snap: &Snapshot,
        size: Option<usize>,
    ) -> Result<PoolStatus, RegistryError> {
        let tag = snap.tag.as_str();
        self.state().set_pool_size(tag, size)?;
        let extra = {
            let mut slots = self.slots();
            let p = &mut slots.pools;
            match size {
                Some(n) => p.sizes.insert(tag.to_owned(), n),
                None => p.sizes.remove(tag),
            };
            p.failing.remove(tag);
            let keep = p.size_of(snap).0;
            match p.idle.get_mut(tag) {
                Some(m) if m.len() > keep => m.split_off(keep),
                _ => Vec::new(),
            }
        };
        self.discard_members(extra).await;
        self.pool_wakeup.notify_one();
        Ok(self.pool_status(snap))
    }

    /// Empties the pool of `tag` and keeps it from growing until
    /// [`Registry::reopen_pool`]: its snapshot is about to be removed.
    pub async fn drain_pool(&self, tag: &str) {
        let members = {
            let mut slots = self.slots();
            slots.pools.closed.insert(tag.to_owned());
            slots.pools.idle.remove(tag).unwrap_or_default()
        };
        self.discard_members(members).await;
        // A member being prepared now is discarded when it is ready (the pool is
        // closed); wait for it, so that nothing of the snapshot is in use.
        while self.slots().pools.filling.contains_key(tag) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Ends every pool member (the daemon is stopping: a member is of no use to the
    /// next one, which would remove it).
    pub async fn drain_all_pools(&self) {
        let tags: Vec<String> = {
            let slots = self.slots();
            let p = &slots.pools;
            p.idle.keys().chain(p.filling.keys()).cloned().collect()
        };
        for tag in tags {
            self.drain_pool(&tag).await;
        }
    }

    /// Lets the pool of `tag` grow again (its snapshot was not removed after all), or
    /// forgets its size (it was).
    pub fn reopen_pool(&self, tag: &str, removed: bool) {
        let mut slots = self.slots();
        slots.pools.closed.remove(tag);
        if removed {
            slots.pools.sizes.remove(tag);
            slots.pools.failing.remove(tag);
            drop(slots);
            if let Err(e) = self.state().set_pool_size(tag, None) {
                tracing::warn!(%tag, "forgetting the pool size of a removed snapshot: {e}");
            }
        } else {
            drop(slots);
            self.pool_wakeup.notify_one();
        }
    }

    /// Ends members' VMs and forgets them.
    pub(crate) async fn discard_members(&self, members: Vec<PreparedChild>) {
        for m in members {
            let id = m.config().id.clone();
            m.discard().await;
            if let Err(e) = self.state().delete_pool_member(&id) {
                tracing::warn!(%id, "forgetting a pool member: {e}");
            }
        }
    }

    /// Takes idle members of the pools of snapshots other than `tag` and ends them:
    /// what a fork that would not fit frees before it is refused. Returns how many.
    pub(crate) async fn reclaim_pools(&self, tag: &str) -> usize {
        let members = self.slots().pools.take_others(tag);
        let n = members.len();
        if n > 0 {
            tracing::info!("reclaiming {n} idle pool member(s) for a fork of {tag}");
        }
        self.discard_members(members).await;
        n
    }

    /// Forgets idle members whose VM died.
    pub(crate) async fn reap_pools(&self) {
        let dead: Vec<PreparedChild> = {
            let mut slots = self.slots();
            slots
                .pools
                .idle
                .values_mut()
                .flat_map(|m| {
                    let (dead, live): (Vec<_>, Vec<_>) = m.drain(..).partition(|c| c.exited());
                    *m = live;
                    dead
                })
                .collect()
        };
        for m in &dead {
            tracing::warn!(id = %m.config().id, "a pool member's VM exited; it is replaced");
        }
        self.discard_members(dead).await;
    }

    /// Prepares members until every pool has its size, one at a time, while no fork
    /// runs and the host has room (sandbox limit and memory). Returns how many it made.
    pub async fn fill_pools(&self) -> usize {
        let mut made = 0;
        while let Some(snap) = self.next_to_fill() {
            match self.add_member(&snap).await {
                Ok(()) => made += 1,
                Err(e) => {
                    tracing::warn!(tag = %snap.tag, "preparing a pool member: {e}");
                    self.slots().pools.failing.insert(
                        snap.tag.to_string(),
                        (e.to_string(), Instant::now() + RETRY_AFTER),
                    );
                }
            }
        }
        made
    }

    /// A snapshot whose pool is short of its size and may grow now; its filling slot is
    /// counted.
    fn next_to_fill(&self) -> Option<Snapshot> {
        if self.slots().fork_busy() {
            return None;
        }
        let snap = self
            .store()
            .list()
            .into_iter()
            .filter_map(|(_, res)| res.ok())
            .find(|snap| self.slots().pools.wants_member(snap))?;
        let tag = snap.tag.to_string();
        let (per_child, basis) = self.child_cost(&tag);
        let available = crate::admission::mem_available().unwrap_or(u64::MAX);
        let mut slots = self.slots();
        let room = slots.fits(1, self.capacity()).is_ok()
            && crate::admission::admit(1, per_child, &basis, available, self.memory_overcommit())
                .is_ok();
        // Checked again under the lock: a fork may have started meanwhile.
        if !room || slots.fork_busy() || !slots.pools.wants_member(&snap) {
            return None;
        }
        *slots.pools.filling.entry(tag).or_default() += 1;
        Some(snap)
    }

    /// Prepares one member of `snap`'s pool (a filling slot is already counted).
    async fn add_member(&self, snap: &Snapshot) -> Result<(), RegistryError> {
        let tag = snap.tag.to_string();
        let _filling = Filling {
            registry: self,
            tag: tag.clone(),
        };
        let opts = ForkOptions {
            detached: true,
            ..ForkOptions::default()
        };
        let planned = forkd_core::fork::plan_child(self.home(), snap, &opts)?;
        let mut row = PoolMemberRow {
            id: planned.config().id.clone(),
            snapshot: tag.clone(),
            pid: 0,
            start_time: 0,
            dir: planned.config().dir.clone(),
            created_at: crate::now_rfc3339(),
        };
        self.state().put_pool_member(&row)?;
        let prepared = planned.prepare(self.hypervisor().as_ref(), snap, opts.ready_timeout);
        let member = match prepared.await {
            Ok(m) => m,
            Err(e) => {
                let _ = self.state().delete_pool_member(&row.id);
                return Err(e.into());
            }
        };
        (row.pid, row.start_time) = member.process().unwrap_or((0, 0));
        if let Err(e) = self.state().put_pool_member(&row) {
            self.discard_members(vec![member]).await;
            return Err(e.into());
        }
        let unwanted = {
            let mut slots = self.slots();
            let p = &mut slots.pools;
            if p.closed.contains(&tag) || p.idle_of(&tag) >= p.size_of(snap).0 {
                Some(member)
            } else {
                p.failing.remove(&tag);
                p.idle.entry(tag).or_default().push(member);
                None
            }
        };
        if let Some(m) = unwanted {
            self.discard_members(vec![m]).await;
        }
        Ok(())
    }
}
