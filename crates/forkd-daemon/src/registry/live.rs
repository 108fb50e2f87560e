//! The sandboxes the daemon holds: looking them up, listing them, changing their
//! egress and deadline, and removing them with their rows.

use super::{remove_cgroup, Entry, Listed, Registry, RegistryError, Slots};
use crate::state::{SandboxRow, StateError};
use forkd_core::lifecycle::SandboxState;
use forkd_core::SandboxError;
use forkd_host::failpoint;

impl Registry {
    /// Starts the resolver of a sandbox just handed out (or taken over), if it has a NIC.
    pub(super) fn start_resolver(&self, slots: &mut Slots, entry: &Entry) {
        let (Some(upstream), Some(net)) = (self.dns_upstream, &entry.row.config.network) else {
            return;
        };
        let (tx, rx) = tokio::sync::watch::channel(net.policy.clone());
        crate::resolver::spawn(entry.sandbox.clone(), upstream, rx);
        slots.resolvers.insert(entry.row.id.clone(), tx);
    }

    /// The sandbox `id`, if the daemon holds a handle on it. One that is starting, or
    /// that a restarted daemon has not taken over yet, is named with its state.
    pub fn get(&self, id: &str) -> Result<Entry, SandboxError> {
        let slots = self.slots();
        if let Some(e) = slots.live.get(id) {
            // One being paused takes no more requests: its VM is about to end.
            if e.row.state == SandboxState::Pausing {
                return Err(SandboxError::NotReady {
                    id: id.to_owned(),
                    state: e.row.state,
                });
            }
            return Ok(e.clone());
        }
        let state = if let Some(row) = slots.paused.get(id) {
            row.state
        } else if slots.starting.contains_key(id) {
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
            .chain(slots.paused.values().map(|r| Listed {
                row: r.clone(),
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

    /// Stops the sandbox `id` and forgets it. The sandbox is claimed `stopping` under
    /// the same lock that pause, resume and branch claim it under, so none of them can
    /// start on it once the delete has begun (nor the delete during theirs).
    pub async fn delete(&self, id: &str) -> Result<(), RegistryError> {
        enum Claimed {
            Row(SandboxRow),
            Live(Entry),
        }
        let claimed = {
            let mut slots = self.slots();
            let busy = |state| {
                Err(SandboxError::NotReady {
                    id: id.to_owned(),
                    state,
                })
            };
            if let Some(u) = slots.unattached.get(id) {
                Claimed::Row(u.row.clone())
            } else if let Some(r) = slots.paused.get_mut(id) {
                // A resume under way ends with the sandbox running or paused: delete it
                // then.
                if r.state == SandboxState::Resuming {
                    return busy(r.state)?;
                }
                r.state = SandboxState::Stopping;
                Claimed::Row(r.clone())
            } else if let Some(e) = slots.live.get_mut(id) {
                // One being paused is deleted once paused.
                if e.row.state == SandboxState::Pausing {
                    return busy(e.row.state)?;
                }
                e.row.state = SandboxState::Stopping;
                Claimed::Live(e.clone())
            } else {
                drop(slots);
                // Starting, or unknown: say which.
                self.get(id)?;
                return Err(SandboxError::NotFound { id: id.to_owned() }.into());
            }
        };
        let row = match &claimed {
            Claimed::Row(row) => row.clone(),
            Claimed::Live(entry) => entry.row.clone(),
        };
        match claimed {
            Claimed::Row(row) => self.remove_row(&row).await,
            Claimed::Live(entry) => self.remove(&entry).await,
        }?;
        self.events
            .emit(crate::events::EventKind::Killed, &row, None);
        Ok(())
    }

    /// Stops a sandbox, removes its files and its row, and only then forgets it: once
    /// the API answers 404 for it, nothing of it is left. The row says `stopping` first,
    /// so a daemon killed half way finishes the job at its next start. (Two removals of
    /// one sandbox at once are harmless: stopping and removing are idempotent.)
    pub(super) async fn remove(&self, entry: &Entry) -> Result<(), RegistryError> {
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
    pub(super) async fn remove_row(&self, row: &SandboxRow) -> Result<(), RegistryError> {
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
            slots.paused.remove(&row.id);
        }
        forgotten?;
        Ok(())
    }

    /// Persists a state change of a live sandbox and mirrors it in memory.
    pub(super) fn transition(
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
            return Err(RegistryError::NoNic { id: id.to_owned() });
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

    /// Records the length of a running sandbox's timeout (see
    /// [`Lifecycle::timeout_s`](crate::state::Lifecycle::timeout_s)).
    pub fn set_timeout_length(
        &self,
        id: &str,
        timeout_s: Option<u64>,
    ) -> Result<Option<Entry>, RegistryError> {
        let mut slots = self.slots();
        let Some(entry) = slots.live.get_mut(id) else {
            return Ok(None);
        };
        let mut lifecycle = entry.row.lifecycle;
        lifecycle.timeout_s = timeout_s;
        self.state.set_lifecycle(id, &lifecycle)?;
        entry.row.lifecycle = lifecycle;
        Ok(Some(entry.clone()))
    }

    /// Sets a sandbox's deadline (None: no deadline).
    pub fn set_timeout(&self, id: &str, timeout_at: Option<i64>) -> Result<Entry, RegistryError> {
        let mut slots = self.slots();
        if let Some(r) = slots.paused.get(id) {
            // No deadline runs while it is paused: it is set once it runs again.
            return Err(SandboxError::NotReady {
                id: id.to_owned(),
                state: r.state,
            }
            .into());
        }
        let entry = slots
            .live
            .get_mut(id)
            .ok_or_else(|| SandboxError::NotFound { id: id.to_owned() })?;
        self.state.set_timeout(id, timeout_at)?;
        entry.row.timeout_at = timeout_at;
        Ok(entry.clone())
    }
}
