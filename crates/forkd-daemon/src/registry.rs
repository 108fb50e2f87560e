//! The sandboxes the daemon owns: the live handles, their rows in the state database,
//! and the ceiling on how many may run.
//!
//! Every child is forked detached, so it outlives the daemon: a restart finds it in the
//! database and adopts it again ([`Registry::adopt_all`]). A sandbox leaves the registry
//! when it is deleted, when its timeout passes, or when its VM dies.

use crate::state::{SandboxRow, State, StateError};
use forkd_core::fork::{fork, ForkOptions};
use forkd_core::snapshot::{Snapshot, Store};
use forkd_core::{Sandbox, SandboxError, SandboxOptions};
use forkd_image::Home;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    Sandbox(#[from] SandboxError),
    /// {0}
    #[error(transparent)]
    State(#[from] StateError),
}

/// A sandbox as the registry reports it.
#[derive(Clone)]
pub struct Entry {
    /// Its row.
    pub row: SandboxRow,
    /// The live handle.
    pub sandbox: Arc<Sandbox>,
}

/// The live sandboxes.
pub struct Registry {
    home: Home,
    store: Store,
    state: Arc<State>,
    max: usize,
    slots: Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    live: HashMap<String, Entry>,
    /// Slots promised to forks in progress.
    reserved: usize,
    /// Forks in progress, by snapshot tag: they use the snapshot as much as its
    /// children do.
    forking: HashMap<String, usize>,
}

/// What a create request asks for.
#[derive(Debug, Clone)]
pub struct CreateSpec {
    /// How many children.
    pub count: usize,
    /// The caller's labels.
    pub labels: BTreeMap<String, String>,
    /// Unix time after which the daemon stops each child.
    pub timeout_at: Option<i64>,
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
fn attach_options() -> SandboxOptions {
    SandboxOptions {
        boot_timeout: Duration::from_secs(30),
        ..SandboxOptions::default()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new(home: Home, store: Store, state: Arc<State>, max: usize) -> Registry {
        Registry {
            home,
            store,
            state,
            max,
            slots: Mutex::new(Slots::default()),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
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

    /// Sandboxes running now.
    pub fn running(&self) -> usize {
        self.slots().live.len()
    }

    /// Forks `spec.count` children of `snap` and records them. Refused at once, before
    /// anything starts, when they would not fit under the limit.
    pub async fn create(
        &self,
        snap: &Snapshot,
        spec: CreateSpec,
    ) -> Result<Vec<Entry>, RegistryError> {
        let _reservation = {
            let mut slots = self.slots();
            let live = slots.live.len() + slots.reserved;
            if live + spec.count > self.max {
                return Err(RegistryError::AtCapacity {
                    live,
                    asked: spec.count,
                    max: self.max,
                });
            }
            slots.reserved += spec.count;
            *slots.forking.entry(snap.tag.to_string()).or_default() += 1;
            Reservation {
                registry: self,
                count: spec.count,
                tag: snap.tag.to_string(),
            }
        };
        let opts = ForkOptions {
            count: spec.count,
            detached: true,
            ..ForkOptions::default()
        };
        let children = fork(&self.home, snap, &opts).await?;
        let mut out = Vec::with_capacity(children.len());
        let mut children = children.into_iter();
        while let Some(child) = children.next() {
            let row = SandboxRow {
                id: child.id().to_owned(),
                snapshot: snap.tag.to_string(),
                pid: child.pid().unwrap_or(0),
                start_time: child.vm().start_time().unwrap_or(0),
                config: child.config().clone(),
                labels: spec.labels.clone(),
                timeout_at: spec.timeout_at,
                created_at: forkd_image::timestamp::rfc3339_utc(std::time::SystemTime::now()),
            };
            if let Err(e) = self.state.insert_sandbox(&row) {
                // Not recorded means not owned: stop this one and the rest.
                let _ = child.stop().await;
                for c in children {
                    let _ = c.stop().await;
                }
                for e in &out {
                    let _ = self.remove(e).await;
                }
                return Err(e.into());
            }
            let entry = Entry {
                row,
                sandbox: Arc::new(child),
            };
            self.slots()
                .live
                .insert(entry.row.id.clone(), entry.clone());
            out.push(entry);
        }
        Ok(out)
    }

    /// The sandbox `id`.
    pub fn get(&self, id: &str) -> Result<Entry, SandboxError> {
        self.slots()
            .live
            .get(id)
            .cloned()
            .ok_or_else(|| SandboxError::NotFound { id: id.to_owned() })
    }

    /// Every live sandbox, oldest first.
    pub fn list(&self) -> Vec<Entry> {
        let mut v: Vec<Entry> = self.slots().live.values().cloned().collect();
        v.sort_by(|a, b| (&a.row.created_at, &a.row.id).cmp(&(&b.row.created_at, &b.row.id)));
        v
    }

    /// Live children of the snapshot `tag`.
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
        if let Some(n) = self.slots().forking.get(tag) {
            users.push(format!("{n} fork(s) in progress"));
        }
        users
    }

    /// Stops the sandbox `id` and forgets it.
    pub async fn delete(&self, id: &str) -> Result<(), RegistryError> {
        let entry = self.get(id)?;
        self.remove(&entry).await
    }

    /// Stops a sandbox, removes its files and its row, and only then forgets it: once
    /// the API answers 404 for it, nothing of it is left. (Two removals of one sandbox
    /// at once are harmless: stopping and removing are idempotent.)
    async fn remove(&self, entry: &Entry) -> Result<(), RegistryError> {
        let stopped = entry.sandbox.stop().await;
        if stopped.is_err() {
            // Whatever stop could not do, the directory still goes.
            let _ = forkd_core::sandbox::remove_dir(&entry.row.config.dir);
        }
        let forgotten = self.state.delete_sandbox(&entry.row.id);
        self.slots().live.remove(&entry.row.id);
        forgotten?;
        Ok(())
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

    /// Takes over every sandbox of the database whose VM still runs; forgets (and
    /// removes the files of) those whose VM died while the daemon was away. Returns
    /// (adopted, gone).
    pub async fn adopt_all(&self) -> Result<(Vec<String>, Vec<String>), RegistryError> {
        let rows = self.state.sandboxes()?;
        let opts = attach_options();
        let attached = futures::future::join_all(
            rows.iter()
                .map(|r| Sandbox::attach(&self.home, &r.id, &opts)),
        )
        .await;
        let (mut adopted, mut gone) = (Vec::new(), Vec::new());
        for (row, res) in rows.into_iter().zip(attached) {
            match res {
                Ok(sb) if sb.pid() == Some(row.pid) => {
                    adopted.push(row.id.clone());
                    let entry = Entry {
                        row,
                        sandbox: Arc::new(sb),
                    };
                    self.slots().live.insert(entry.row.id.clone(), entry);
                }
                other => {
                    if let Err(e) = &other {
                        tracing::warn!(id = %row.id, "not adopted: {e}");
                    }
                    if let Ok(sb) = other {
                        let _ = sb.stop().await;
                    }
                    // A VM that still runs but could not be taken over (its agent did
                    // not answer) must not outlive its record: nothing would ever stop it.
                    kill_if_same_process(row.pid, row.start_time);
                    let _ = forkd_core::sandbox::remove_dir(&row.config.dir);
                    self.state.delete_sandbox(&row.id)?;
                    gone.push(row.id);
                }
            }
        }
        Ok((adopted, gone))
    }

    /// Stops sandboxes whose deadline has passed and forgets those whose VM died.
    /// Returns the ids removed.
    pub async fn reap(&self, now: i64) -> Vec<String> {
        let mut doomed: Vec<Entry> = match self.state.expired(now) {
            Ok(ids) => ids.iter().filter_map(|id| self.get(id).ok()).collect(),
            Err(e) => {
                tracing::warn!("reading deadlines: {e}");
                Vec::new()
            }
        };
        let dead: Vec<Entry> = self
            .list()
            .into_iter()
            .filter(|e| e.sandbox.vm().exited() && !doomed.iter().any(|d| d.row.id == e.row.id))
            .collect();
        doomed.extend(dead);
        let mut removed = Vec::new();
        for e in doomed {
            match self.remove(&e).await {
                Ok(()) => removed.push(e.row.id),
                Err(err) => tracing::warn!(id = %e.row.id, "removing: {err}"),
            }
        }
        removed
    }
}

/// SIGKILLs `pid` if it is still the process that started at `start_time`.
fn kill_if_same_process(pid: u32, start_time: u64) {
    use forkd_hypervisor::process;
    if process::start_time(pid) == Some(start_time) {
        if let Ok(pid) = i32::try_from(pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}
