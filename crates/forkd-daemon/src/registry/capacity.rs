//! How many sandboxes may run: the ceiling on VMs held (pool members and forks under
//! way count), the memory a fork would take, and the slots promised to forks in progress.

use super::{Registry, RegistryError, Slots, COST_TTL};
use forkd_core::lifecycle::SandboxState;
use forkd_storage::snapshot::Snapshot;
use std::collections::HashMap;
use std::time::Instant;

impl Registry {
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
    pub(super) async fn reserve(
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
pub(super) struct Reservation<'a> {
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
