//! After a restart: taking over the VMs a previous daemon started, retrying those that
//! do not answer yet, and reaping sandboxes whose VM died or whose deadline passed.

use super::{
    attach_options, remove_cgroup, Entry, Registry, RegistryError, Unattached, REATTACH_EVERY,
};
use crate::state::SandboxRow;
use forkd_core::lifecycle::SandboxState;
use forkd_core::{Sandbox, SandboxError};
use forkd_host::failpoint;
use std::sync::Arc;
use std::time::Instant;

/// How long a sandbox whose pause at its deadline failed (no room on disk, the paused
/// cap reached) runs on before the pause is tried again.
const PAUSE_RETRY_S: i64 = 60;

impl Registry {
    /// Takes over every sandbox of the database whose VM still runs; removes the ones
    /// that were never handed out (`starting`), those a stop was interrupted on
    /// (`stopping`), and those whose VM died while the daemon was away. A VM that runs
    /// but does not answer is kept (unresponsive) and tried again later: it is killed
    /// only on proof that it is gone. Returns (adopted, removed).
    pub async fn adopt_all(&self) -> Result<(Vec<String>, Vec<String>), RegistryError> {
        let rows = self.recover_pauses(self.state.sandboxes()?).await?;
        let opts = attach_options(self.agent_timeout);
        let (mut adopted, mut gone) = (Vec::new(), Vec::new());
        let (keep, drop): (Vec<SandboxRow>, Vec<SandboxRow>) = rows.into_iter().partition(|r| {
            matches!(r.state, SandboxState::Running | SandboxState::Unresponsive)
                && forkd_host::process::is_running(r.pid, r.start_time)
        });
        let (died, drop): (Vec<SandboxRow>, Vec<SandboxRow>) = drop.into_iter().partition(|r| {
            matches!(
                r.state,
                SandboxState::Running | SandboxState::Unresponsive | SandboxState::Failed
            )
        });
        for row in died {
            // Handed out, its VM gone while the daemon was away (a crash, a reboot):
            // shown failed, its disk kept until it is deleted.
            let why = row.error.clone().unwrap_or_else(|| {
                "its VM was no longer running when the daemon started (a crash or a reboot of the host?)".into()
            });
            tracing::info!(id = %row.id, "a sandbox the last daemon ran is failed: {why}");
            let _ = tokio::task::spawn_blocking({
                let (pid, start, dir) = (row.pid, row.start_time, row.config.dir.clone());
                move || forkd_host::process::kill_vm(pid, start, &dir)
            })
            .await;
            self.keep_failed(&row, why)?;
            gone.push(row.id);
        }
        for row in drop {
            tracing::info!(id = %row.id, state = %row.state, "removing a sandbox the last daemon left");
            self.remove_row(&row).await?;
            gone.push(row.id);
        }
        let attached = futures::future::join_all(keep.iter().map(|r| {
            Sandbox::attach(
                self.hv.as_ref(),
                r.config.clone(),
                r.pid,
                r.start_time,
                &opts,
            )
        }))
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
                Err(e) if !forkd_host::process::is_running(row.pid, row.start_time) => {
                    let id = row.id.clone();
                    self.keep_failed(
                        &row,
                        format!("its VM exited as the daemon took it over: {e}"),
                    )?;
                    gone.push(id);
                }
                Err(e) => self.unattached(row, &e)?,
            }
        }
        Ok((adopted, gone))
    }

    /// Records the sandbox of `row`, whose VM is gone, `failed` with `why` and keeps it,
    /// with its files, among the sandboxes without a VM until it is deleted.
    pub(super) fn keep_failed(&self, row: &SandboxRow, why: String) -> Result<(), RegistryError> {
        if row.state != SandboxState::Failed {
            self.state
                .set_state(&row.id, SandboxState::Failed, Some(&why), Some((0, 0)))?;
        }
        remove_cgroup(&row.id);
        let mut row = row.clone();
        row.state = SandboxState::Failed;
        self.events
            .emit(crate::events::EventKind::Failed, &row, Some(&why));
        row.error = Some(why);
        row.pid = 0;
        row.start_time = 0;
        let mut slots = self.slots();
        slots.live.remove(&row.id);
        slots.resolvers.remove(&row.id);
        slots.unattached.remove(&row.id);
        slots.paused.insert(row.id.clone(), row);
        Ok(())
    }

    pub(super) fn adopted(&self, mut row: SandboxRow, sb: Sandbox) -> Result<(), RegistryError> {
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

    pub(super) fn unattached(
        &self,
        mut row: SandboxRow,
        e: &SandboxError,
    ) -> Result<(), RegistryError> {
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

    /// Removes directories of the sandbox tree that no row owns, no process claims (a
    /// `forkd run` of another process, see [`forkd_core::claim`]) and no process uses:
    /// what a daemon killed before it wrote a row, or a build killed with it, left
    /// behind.
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
            let path = e.path();
            if forkd_core::claim::is_claimed(&path)
                || !forkd_host::process::find_inside(&path).is_empty()
            {
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
                    let pause_at_deadline = l.row.lifecycle.on_timeout
                        == crate::state::OnTimeout::Pause
                        && l.row.state == SandboxState::Running;
                    if l.row.state == SandboxState::Pausing {
                        // Its pause ends it, or leaves it running.
                        Ok(false)
                    } else if expired.contains(&id) && pause_at_deadline && !sb.vm().exited() {
                        tracing::info!(%id, "its timeout passed: pausing it");
                        if let Err(e) = self.pause(&id, l.row.lifecycle.pause_keeps).await {
                            // It runs on (nothing is lost), and is tried again later,
                            // not at every tick: its deadline moves by that much.
                            let next = now + PAUSE_RETRY_S;
                            tracing::warn!(
                                %id,
                                "pausing at its timeout failed, tried again in {PAUSE_RETRY_S} s: {e}"
                            );
                            if let Err(e) = self.set_timeout(&id, Some(next)) {
                                tracing::warn!(%id, "moving its deadline: {e}");
                            }
                        }
                        Ok(false)
                    } else if expired.contains(&id) {
                        self.remove(&entry).await.map(|()| {
                            self.events
                                .emit(crate::events::EventKind::TimedOut, &entry.row, None);
                            true
                        })
                    } else if sb.vm().exited() || sb.failure().is_some() {
                        let why = sb
                            .failure()
                            .map_or_else(|| "its VM exited".to_owned(), |f| f.to_string());
                        tracing::info!(%id, "sandbox failed (its files are kept until it is deleted): {why}");
                        self.keep_failed(&entry.row, why).map(|()| false)
                    } else {
                        self.sync_health(&entry).map(|()| false)
                    }
                }
                None if l.row.state == SandboxState::Starting => Ok(false),
                // A failed sandbox kept with its files goes at its deadline.
                None if l.row.state == SandboxState::Failed && expired.contains(&id) => {
                    self.remove_row(&l.row).await.map(|()| {
                        self.events
                            .emit(crate::events::EventKind::TimedOut, &l.row, None);
                        true
                    })
                }
                // On disk, without a VM: no deadline runs while paused.
                None if matches!(
                    l.row.state,
                    SandboxState::Paused | SandboxState::Resuming | SandboxState::Failed
                ) =>
                {
                    Ok(false)
                }
                None => self.retry_unattached(&l.row, expired.contains(&id)).await,
            };
            match result {
                Ok(true) => removed.push(id),
                Ok(false) => {}
                Err(e) => tracing::warn!(%id, "{e}"),
            }
        }
        for (id, keeps) in self.idle() {
            tracing::info!(%id, "idle for its auto-pause time: pausing it");
            if let Err(e) = self.pause(&id, keeps).await {
                // Tried again once it has been idle for its time again.
                tracing::warn!(%id, "pausing an idle sandbox failed: {e}");
                self.touch(&id);
            }
        }
        removed
    }

    /// Notes that the sandbox `id` serves a request now (its idleness starts again).
    pub fn touch(&self, id: &str) {
        self.slots().last_used.insert(id.to_owned(), Instant::now());
    }

    /// Running sandboxes with an auto-pause time that have served no request for that
    /// long and hold no request or stream now. The registry holds one handle on each,
    /// its resolver another: any more is a request in flight or an open stream.
    fn idle(&self) -> Vec<(String, forkd_core::pause::PauseKeeps)> {
        let now = Instant::now();
        let mut slots = self.slots();
        let slots = &mut *slots;
        slots.last_used.retain(|id, _| slots.live.contains_key(id));
        let mut idle = Vec::new();
        for (id, e) in &slots.live {
            let Some(after) = e.row.lifecycle.auto_pause_after_s else {
                continue;
            };
            let since = *slots.last_used.entry(id.clone()).or_insert(now);
            let held = 1 + usize::from(slots.resolvers.contains_key(id));
            if e.row.state == SandboxState::Running
                && std::sync::Arc::strong_count(&e.sandbox) <= held
                && now.duration_since(since) >= std::time::Duration::from_secs(after)
            {
                idle.push((id.clone(), e.row.lifecycle.pause_keeps));
            }
        }
        idle
    }

    /// Persists what the watchdog sees: `unresponsive` while the agent is silent,
    /// `running` once it answers again.
    pub(super) fn sync_health(&self, e: &Entry) -> Result<(), RegistryError> {
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
    pub(super) async fn retry_unattached(
        &self,
        row: &SandboxRow,
        expired: bool,
    ) -> Result<bool, RegistryError> {
        let alive = forkd_host::process::is_running(row.pid, row.start_time);
        if expired {
            self.remove_row(row).await?;
            return Ok(true);
        }
        if !alive {
            self.keep_failed(
                row,
                "its VM exited before the daemon could take it over".into(),
            )?;
            return Ok(false);
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
            row.config.clone(),
            row.pid,
            row.start_time,
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
