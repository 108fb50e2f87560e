//! PAUSE and RESUME through the daemon: one at a time per sandbox, each state change
//! recorded before the step it announces, so that a daemon killed at any point finds the
//! sandbox running or paused at its next start (see [`Registry::recover_pauses`]).
//!
//! - pause: `running` → `pausing` (requests refused from here) → image written, VM
//!   ended → `paused` (its row keeps no process; its deadline stops). A pause that fails
//!   leaves the VM running and the sandbox `running`.
//! - resume: `paused` → `resuming` (a running slot reserved) → VM restored, agent
//!   answering → `running` with its new process, then the image is removed. A resume
//!   that fails leaves the sandbox `paused` with its image, or `failed` with its files
//!   kept when the image is damaged.

use super::{Entry, Registry, RegistryError};
use crate::state::SandboxRow;
use forkd_core::lifecycle::SandboxState;
use forkd_core::pause::PauseKeeps;
use forkd_core::resume::ResumeHow;
use forkd_core::{SandboxError, SandboxOptions};
use forkd_storage::snapshot::Tag;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// What a pause did, as the API answers.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct PauseOutcome {
    /// The sandbox.
    pub id: String,
    /// How long the guest was stopped before its image was complete (the copy's last
    /// pass), ms.
    pub stall_ms: f64,
    /// From the request to its VM's end, ms.
    pub total_ms: f64,
    /// Memory pages that differ from its snapshot's and were stored.
    pub pages: u64,
    /// Bytes the pause image holds (memory diff and device state).
    pub stored_bytes: u64,
    /// What was kept: `memory` (the whole machine) or `disk` (its disk only; a resume
    /// boots it).
    #[schema(value_type = String)]
    pub keeps: PauseKeeps,
}

/// What a resume did, as the API answers.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ResumeOutcome {
    /// The sandbox.
    pub id: String,
    /// From the request to its agent's first answer, ms. 0: it was running already.
    pub total_ms: f64,
}

/// How long a resume waits for another one of the same sandbox under way.
const RESUME_WAIT: Duration = Duration::from_secs(300);

impl Registry {
    /// Writes the running sandbox `id` to disk (the whole machine, or its disk only as
    /// `keeps` says) and ends its VM.
    pub async fn pause(&self, id: &str, keeps: PauseKeeps) -> Result<PauseOutcome, RegistryError> {
        let entry = {
            let mut slots = self.slots();
            if let Some(into) = slots.branching.get(id) {
                return Err(RegistryError::PauseDuringBranch {
                    id: id.to_owned(),
                    into: into.clone(),
                });
            }
            let Some(e) = slots.live.get(id) else {
                drop(slots);
                // Not live: say what it is (paused, starting...), or that it is unknown.
                return Err(match self.get(id) {
                    Err(e) => e.into(),
                    Ok(_) => SandboxError::NotFound { id: id.to_owned() }.into(),
                });
            };
            if e.row.state != SandboxState::Running {
                return Err(SandboxError::NotReady {
                    id: id.to_owned(),
                    state: e.row.state,
                }
                .into());
            }
            // Those being paused count: each will be paused in a moment. (Failed ones
            // kept with their files do not.)
            let pausing = slots
                .live
                .values()
                .filter(|e| e.row.state == SandboxState::Pausing)
                .count();
            let paused = slots
                .paused
                .values()
                .filter(|r| r.state != SandboxState::Failed)
                .count();
            if paused + pausing >= self.max_paused {
                return Err(RegistryError::PausedAtCapacity { paused });
            }
            let Some(e) = slots.live.get_mut(id) else {
                return Err(SandboxError::NotFound { id: id.to_owned() }.into());
            };
            // Claimed in memory first: a second pause, a branch or a request sees it now.
            e.row.state = SandboxState::Pausing;
            e.clone()
        };
        if let Err(e) = self.state.set_state(id, SandboxState::Pausing, None, None) {
            self.set_live_state(id, SandboxState::Running);
            return Err(e.into());
        }
        let timeout_left_s = entry
            .row
            .timeout_at
            .map(|at| u64::try_from(at - crate::unix_now()).unwrap_or(0));
        let paused = match keeps {
            PauseKeeps::Memory => {
                forkd_core::pause::pause(
                    self.hv.as_ref(),
                    &self.home,
                    &entry.sandbox,
                    timeout_left_s,
                    &|m| tracing::info!(%id, "{m}"),
                )
                .await
            }
            PauseKeeps::Disk => forkd_core::pause::pause_disk(&entry.sandbox, timeout_left_s).await,
        };
        let paused = match paused {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(%id, "pause failed, the sandbox runs on: {e}");
                if let Err(e) = self.transition(id, SandboxState::Running, None) {
                    tracing::warn!(%id, "recording the sandbox running again: {e}");
                }
                return Err(e.into());
            }
        };
        let mut row = entry.row.clone();
        // Paused whatever the database says now: a restart finds a `pausing` row with a
        // complete image paused too.
        let recorded = self
            .state
            .set_state(id, SandboxState::Paused, None, Some((0, 0)))
            .and_then(|_| self.state.set_timeout(id, None));
        if let Err(e) = recorded {
            tracing::warn!(%id, "recording the sandbox paused: {e}");
        }
        row.state = SandboxState::Paused;
        row.pid = 0;
        row.start_time = 0;
        row.timeout_at = None;
        {
            let mut slots = self.slots();
            slots.live.remove(id);
            slots.resolvers.remove(id);
            slots.paused.insert(id.to_owned(), row.clone());
        }
        super::remove_cgroup(id);
        let r = &paused.record;
        let reason = (r.keeps == PauseKeeps::Disk).then_some("its disk only was kept");
        self.events
            .emit(crate::events::EventKind::Paused, &row, reason);
        tracing::info!(
            %id,
            stall_ms = r.stall_ms,
            pages = r.pages,
            stored = r.stored_bytes(),
            "sandbox paused in {:?}",
            paused.total
        );
        Ok(PauseOutcome {
            id: id.to_owned(),
            stall_ms: r.stall_ms,
            total_ms: paused.total.as_secs_f64() * 1000.0,
            pages: r.pages,
            stored_bytes: r.stored_bytes(),
            keeps: r.keeps,
        })
    }

    /// Runs the paused sandbox `id` again from its pause image, as `how` says. A running
    /// one is left as it is; a resume of one already resuming waits for that one.
    pub async fn resume(&self, id: &str, how: ResumeHow) -> Result<ResumeOutcome, RegistryError> {
        let deadline = tokio::time::Instant::now() + RESUME_WAIT;
        let row = loop {
            let claimed = {
                let mut slots = self.slots();
                let branching = slots.branching.contains_key(id);
                match slots.paused.get_mut(id) {
                    // A branch reads its pause image: resumed once it is written.
                    Some(r) if r.state == SandboxState::Paused && branching => None,
                    Some(r) if r.state == SandboxState::Paused => {
                        r.state = SandboxState::Resuming;
                        Some(Ok(r.clone()))
                    }
                    Some(r) if r.state == SandboxState::Resuming => None,
                    Some(r) => Some(Err(SandboxError::NotReady {
                        id: id.to_owned(),
                        state: r.state,
                    })),
                    None => match slots.live.get(id) {
                        Some(e) if e.row.state == SandboxState::Pausing => None,
                        Some(_) => {
                            return Ok(ResumeOutcome {
                                id: id.to_owned(),
                                total_ms: 0.0,
                            })
                        }
                        None => Some(Err(SandboxError::NotFound { id: id.to_owned() })),
                    },
                }
            };
            match claimed {
                Some(r) => break r?,
                None if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                None => {
                    return Err(SandboxError::NotReady {
                        id: id.to_owned(),
                        state: SandboxState::Resuming,
                    }
                    .into())
                }
            }
        };
        let resumed = self.resume_claimed(&row, how).await;
        if let Err(e) = &resumed {
            // A damaged image is not retried: the sandbox is failed, its files kept.
            let damaged = matches!(e, RegistryError::Sandbox(SandboxError::PauseImage { .. }));
            let to = if damaged {
                SandboxState::Failed
            } else {
                SandboxState::Paused
            };
            let error = damaged.then(|| e.to_string());
            tracing::warn!(%id, "resume failed, the sandbox is {to}: {e}");
            if let Err(e) = self.state.set_state(id, to, error.as_deref(), None) {
                tracing::warn!(%id, "recording the failed resume: {e}");
            }
            let row = self.slots().paused.get_mut(id).map(|r| {
                r.state = to;
                r.error = error.clone();
                r.clone()
            });
            if let (Some(row), true) = (row, damaged) {
                self.events
                    .emit(crate::events::EventKind::Failed, &row, error.as_deref());
            }
        }
        resumed
    }

    /// Restores a sandbox claimed `resuming` and moves it to the live ones.
    async fn resume_claimed(
        &self,
        row: &SandboxRow,
        how: ResumeHow,
    ) -> Result<ResumeOutcome, RegistryError> {
        let id = row.id.as_str();
        self.state
            .set_state(id, SandboxState::Resuming, None, None)?;
        // Its RAM file is its snapshot's image: the snapshot must still be there (a
        // paused sandbox keeps it from being removed).
        let snap = Tag::parse(&row.snapshot)
            .and_then(|t| self.store.open(&t))
            .map_err(SandboxError::from)?;
        let (_reservation, _) = self.reserve(&snap, 1, false).await?;
        let opts = SandboxOptions {
            vcpus: row.config.vcpus,
            memory_mib: row.config.memory_mib,
            agent_timeout: self.agent_timeout,
            seccomp: row.config.seccomp,
            ..SandboxOptions::default()
        };
        let resumed = forkd_core::resume::resume(self.hv.as_ref(), &row.config, &opts, how).await?;
        let sandbox = resumed.sandbox;
        let Some(process) = sandbox.vm().pid().zip(sandbox.vm().start_time()) else {
            // A detached VM outlives its handle: it must not run beside the image.
            sandbox.vm().kill();
            return Err(SandboxError::Gone { id: id.to_owned() }.into());
        };
        let mut row = row.clone();
        row.config = sandbox.config().clone();
        row.state = SandboxState::Running;
        row.error = None;
        row.pid = process.0;
        row.start_time = process.1;
        // What was left of its timeout; one paused by its deadline gets its length again.
        let left = match resumed.record.timeout_left_s {
            Some(0) => row.lifecycle.timeout_s,
            left => left,
        };
        row.timeout_at = left.map(|s| crate::unix_now() + i64::try_from(s).unwrap_or(i64::MAX / 2));
        let recorded = self
            .state
            .set_config(id, &row.config)
            .and_then(|_| self.state.set_timeout(id, row.timeout_at))
            .and_then(|_| {
                self.state
                    .set_state(id, SandboxState::Running, None, Some(process))
            });
        if !matches!(recorded, Ok(true)) {
            // Not recorded running (or its row is gone): the VM must not outlive this,
            // or it would run beside the image a next resume restores.
            sandbox.vm().kill();
            return Err(match recorded {
                Err(e) => e.into(),
                _ => SandboxError::NotFound { id: id.to_owned() }.into(),
            });
        }
        let entry = Entry {
            row,
            sandbox: Arc::new(sandbox),
        };
        {
            let mut slots = self.slots();
            slots.paused.remove(id);
            self.start_resolver(&mut slots, &entry);
            slots.live.insert(id.to_owned(), entry.clone());
        }
        let reason = (how == ResumeHow::Reboot || resumed.record.keeps == PauseKeeps::Disk)
            .then_some("booted from its disk");
        self.events
            .emit(crate::events::EventKind::Resumed, &entry.row, reason);
        // Off the answer's path: unlinking a large memory diff takes a while. An image
        // left by a daemon stopped meanwhile is removed by the next pause.
        let dir = entry.row.config.dir.clone();
        tokio::task::spawn_blocking(move || forkd_core::pause::discard_image(&dir));
        tracing::info!(%id, "sandbox resumed in {:?}", resumed.total);
        Ok(ResumeOutcome {
            id: id.to_owned(),
            total_ms: resumed.total.as_secs_f64() * 1000.0,
        })
    }

    /// Pauses every running sandbox, a few at a time (a daemon stopping with
    /// `--pause-on-stop`). Returns how many were paused and how many could not be.
    pub async fn pause_all(&self) -> (usize, usize) {
        use futures::StreamExt;
        let ids: Vec<String> = self
            .list()
            .into_iter()
            .filter(|l| l.row.state == SandboxState::Running)
            .map(|l| l.row.id)
            .collect();
        let results: Vec<bool> = futures::stream::iter(ids)
            .map(|id| async move {
                match self.pause(&id, PauseKeeps::Memory).await {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::warn!(%id, "not paused at the stop: {e}");
                        false
                    }
                }
            })
            .buffer_unordered(self.fork_parallel.max(1))
            .collect()
            .await;
        let paused = results.iter().filter(|ok| **ok).count();
        (paused, results.len() - paused)
    }

    /// Records `row`, a sandbox brought from another host whose pause image is installed
    /// in its directory: paused here, as if it had been paused here.
    pub fn insert_arrived(&self, row: SandboxRow) -> Result<(), RegistryError> {
        self.state.insert_sandbox(&row)?;
        self.events.emit(
            crate::events::EventKind::Paused,
            &row,
            Some("brought from another host"),
        );
        self.slots().paused.insert(row.id.clone(), row);
        Ok(())
    }

    /// Bytes the pause images of the sandboxes without a VM hold.
    pub fn paused_bytes(&self) -> u64 {
        let dirs: Vec<_> = self
            .slots()
            .paused
            .values()
            .map(|r| r.config.dir.clone())
            .collect();
        dirs.iter()
            .filter_map(|d| forkd_core::pause::read_record(d).ok().flatten())
            .map(|r| r.stored_bytes())
            .sum()
    }

    /// Sets the in-memory state of a live sandbox (a claim undone).
    fn set_live_state(&self, id: &str, to: SandboxState) {
        if let Some(e) = self.slots().live.get_mut(id) {
            e.row.state = to;
        }
    }

    /// A resume the last daemon did not record, whose VM had started: the guest may have
    /// written to its disk since its image was made, so the image is no longer the
    /// sandbox. A VM that still runs is recorded running, to be taken over; one that is
    /// gone leaves the sandbox failed, its files kept.
    async fn recover_started_resume(
        &self,
        row: &mut SandboxRow,
        started: forkd_core::resume::Started,
    ) -> Result<(), RegistryError> {
        let id = row.id.clone();
        if forkd_host::process::is_running(started.pid, started.start_time) {
            let process = (started.pid, started.start_time);
            self.state.set_config(&id, &started.config)?;
            self.state
                .set_state(&id, SandboxState::Running, None, Some(process))?;
            row.config = started.config;
            (row.pid, row.start_time) = process;
            row.state = SandboxState::Running;
            forkd_core::pause::discard_image(&row.config.dir);
            tracing::info!(%id, "an interrupted resume had started the VM: it is taken over");
            return Ok(());
        }
        let why = "the daemon stopped while the sandbox resumed, and its resumed VM is gone; \
                   its disk may have moved past its pause image"
            .to_owned();
        let dir = row.config.dir.clone();
        let _ = tokio::task::spawn_blocking(move || forkd_host::process::kill_vm(0, 0, &dir)).await;
        super::remove_cgroup(&id);
        self.state
            .set_state(&id, SandboxState::Failed, Some(&why), Some((0, 0)))?;
        tracing::warn!(%id, "{why}");
        row.state = SandboxState::Failed;
        row.error = Some(why);
        (row.pid, row.start_time) = (0, 0);
        Ok(())
    }

    /// After a restart, before the running sandboxes are adopted: sandboxes the last
    /// daemon left paused (or failed at a resume) are kept as they are; a pause it did
    /// not finish ends paused if its image was complete (its stopped VM is killed) and
    /// running otherwise (its VM is set running again); a resume it did not finish ends
    /// paused if the resumed VM's vCPUs had not started (that VM is killed), and running
    /// (taken over) if they had. Returns the rows left for adoption.
    pub async fn recover_pauses(
        &self,
        rows: Vec<SandboxRow>,
    ) -> Result<Vec<SandboxRow>, RegistryError> {
        let mut left = Vec::new();
        let mut resumed_sources = Vec::new();
        for mut row in rows {
            let has_image = matches!(forkd_core::pause::read_record(&row.config.dir), Ok(Some(_)));
            if row.state == SandboxState::Resuming {
                if let Some(started) = forkd_core::resume::read_started(&row.config.dir) {
                    // Its guest has run past its image: it goes on as it is.
                    self.recover_started_resume(&mut row, started).await?;
                    if row.state == SandboxState::Running {
                        left.push(row);
                    } else {
                        self.slots().paused.insert(row.id.clone(), row);
                    }
                    continue;
                }
            }
            let to = match row.state {
                SandboxState::Paused => Some(SandboxState::Paused),
                SandboxState::Failed if has_image => Some(SandboxState::Failed),
                SandboxState::Resuming => Some(SandboxState::Paused),
                SandboxState::Pausing if has_image => Some(SandboxState::Paused),
                SandboxState::Pausing => {
                    forkd_core::pause::discard_partial(&row.config.dir);
                    self.state
                        .set_state(&row.id, SandboxState::Running, None, None)?;
                    row.state = SandboxState::Running;
                    resumed_sources.push(row.id.clone());
                    None
                }
                _ => None,
            };
            let Some(to) = to else {
                left.push(row);
                continue;
            };
            if matches!(row.state, SandboxState::Resuming | SandboxState::Pausing) {
                // A VM started by the resume, or stopped by the pause: the image is what
                // the sandbox is now.
                let (pid, start, dir) = (row.pid, row.start_time, row.config.dir.clone());
                let _ = tokio::task::spawn_blocking(move || {
                    forkd_host::process::kill_vm(pid, start, &dir)
                })
                .await;
                super::remove_cgroup(&row.id);
                self.state.set_state(&row.id, to, None, Some((0, 0)))?;
                row.pid = 0;
                row.start_time = 0;
                tracing::info!(id = %row.id, "an interrupted {} ended with the sandbox paused", row.state);
            }
            row.state = to;
            self.slots().paused.insert(row.id.clone(), row);
        }
        self.recover_branches(&resumed_sources).await?;
        Ok(left)
    }
}
