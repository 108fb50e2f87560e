//! BRANCH through the daemon: checks, one branch per sandbox at a time, and an operation
//! row (`running` → `succeeded` | `failed`) that outlives the daemon. A branch cut short
//! by a stop is marked `failed` at the next start, its staging files are removed and its
//! source is set running again (see [`Registry::recover_branches`]).

use crate::registry::{Registry, RegistryError};
use crate::state::{OperationEnd, OperationRow};
use forkd_core::lifecycle::SandboxState;
use forkd_core::SandboxError;
use forkd_hypervisor::BranchMode;
use forkd_storage::snapshot::{Snapshot, SnapshotError, Tag};
use serde::Serialize;
use std::sync::Arc;

/// What a branch made, as the API answers and its operation records.
#[derive(Debug, Clone, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct BranchOutcome {
    /// The new snapshot.
    pub snapshot: String,
    /// The snapshot it is a diff on.
    pub parent: String,
    /// The sandbox it was taken from.
    pub source: String,
    /// `pause` or `live`.
    pub mode: String,
    /// How long the source's vCPUs were stopped, ms.
    pub pause_ms: f64,
    /// From the start of the copy to the source running again, ms.
    pub copy_ms: f64,
    /// From the request to the snapshot's publication, ms.
    pub total_ms: f64,
    /// Bytes of the source's memory stream.
    pub transferred_bytes: u64,
    /// Memory pages that differ from the parent's.
    pub pages_changed: u64,
    /// Size of the stored memory diff.
    pub diff_bytes: u64,
    /// The operation that made it.
    pub operation: String,
}

/// A branch accepted to run: its operation, its source and what it builds on.
pub struct Accepted {
    /// The operation, recorded `running`.
    pub op: OperationRow,
    source: Source,
    base: Snapshot,
    tag: Tag,
    mode: BranchMode,
}

/// What a branch captures.
enum Source {
    /// A running sandbox, captured live (or stopped for the copy).
    Running(Arc<forkd_core::Sandbox>),
    /// A paused sandbox, branched from its pause image without running it.
    Paused(Box<crate::state::SandboxRow>),
}

impl Source {
    fn id(&self) -> &str {
        match self {
            Source::Running(s) => s.id(),
            Source::Paused(r) => &r.id,
        }
    }
}

impl Registry {
    /// Checks that sandbox `id` can be branched into `tag` now and records the
    /// operation. Refused: an unknown sandbox (404), one not running or already being
    /// branched (409), a tag that exists or is being written (409), a base snapshot
    /// that is gone.
    pub fn accept_branch(
        &self,
        id: &str,
        tag: Tag,
        mode: Option<BranchMode>,
    ) -> Result<Accepted, RegistryError> {
        let paused = self
            .slots()
            .paused
            .get(id)
            .filter(|r| r.state == SandboxState::Paused)
            .cloned();
        if let Some(row) = paused {
            return self.accept_paused_branch(row, tag);
        }
        let entry = self.get(id)?;
        if entry.row.state != SandboxState::Running {
            return Err(SandboxError::NotReady {
                id: id.to_owned(),
                state: entry.row.state,
            }
            .into());
        }
        // Live where the hypervisor copies a running guest faithfully, else pause.
        let mode = match (mode, entry.sandbox.can_branch(BranchMode::Live)) {
            (Some(BranchMode::Live), Err(detail)) => {
                return Err(SandboxError::Unbranchable {
                    id: id.to_owned(),
                    detail,
                }
                .into())
            }
            (None, Err(why)) => {
                tracing::info!("sandbox {id} is branched in pause mode: {why}");
                BranchMode::Pause
            }
            (Some(mode), _) => mode,
            (None, Ok(())) => BranchMode::Live,
        };
        let base = self.branch_base(&entry.row, &tag)?;
        self.record_branch(Source::Running(entry.sandbox), base, tag, mode)
    }

    /// [`Registry::accept_branch`] of a paused sandbox: branched from its pause image,
    /// in the mode its pause copied it.
    fn accept_paused_branch(
        &self,
        row: crate::state::SandboxRow,
        tag: Tag,
    ) -> Result<Accepted, RegistryError> {
        let record = forkd_core::pause::read_record(&row.config.dir)?.ok_or_else(|| {
            SandboxError::PauseImage {
                id: row.id.clone(),
                detail: "it has no pause image".into(),
            }
        })?;
        if record.keeps == forkd_core::pause::PauseKeeps::Disk {
            return Err(SandboxError::Unbranchable {
                id: row.id.clone(),
                detail: "it was paused with its disk only, so there is no machine to branch: resume it first".into(),
            }
            .into());
        }
        let base = self.branch_base(&row, &tag)?;
        self.record_branch(Source::Paused(Box::new(row)), base, tag, record.mode)
    }

    /// The snapshot a branch of the sandbox `row` into `tag` builds on; refused if `tag`
    /// exists.
    fn branch_base(
        &self,
        row: &crate::state::SandboxRow,
        tag: &Tag,
    ) -> Result<Snapshot, RegistryError> {
        if self.store().exists(tag) {
            return Err(SandboxError::from(SnapshotError::Exists {
                tag: tag.to_string(),
            })
            .into());
        }
        let base_tag = forkd_core::branch::base_of(&row.config.dir, &row.snapshot);
        Tag::parse(&base_tag)
            .and_then(|t| self.store().open(&t))
            .map_err(|source| RegistryError::BaseUnavailable {
                id: row.id.clone(),
                base: base_tag.clone(),
                source: Box::new(source),
            })
    }

    /// Claims the source for the branch and records its operation.
    fn record_branch(
        &self,
        source: Source,
        base: Snapshot,
        tag: Tag,
        mode: BranchMode,
    ) -> Result<Accepted, RegistryError> {
        let id = source.id().to_owned();
        let id = id.as_str();
        let op = OperationRow::running(
            "branch",
            tag.as_str(),
            1,
            Some(serde_json::json!({ "source": id, "mode": mode })),
        );
        {
            let mut slots = self.slots();
            // The source's state is checked again under the lock the claim is taken
            // under: a pause, a resume or a delete may have begun since it was read.
            let (state, wanted) = match &source {
                Source::Running(_) => (slots.live_state(id), SandboxState::Running),
                Source::Paused(_) => (slots.paused.get(id).map(|r| r.state), SandboxState::Paused),
            };
            match state {
                None => return Err(SandboxError::NotFound { id: id.to_owned() }.into()),
                Some(state) if state != wanted => {
                    return Err(SandboxError::NotReady {
                        id: id.to_owned(),
                        state,
                    }
                    .into())
                }
                Some(_) => {}
            }
            if let Some(t) = slots.branching.get(id) {
                return Err(RegistryError::BranchingAlready {
                    id: id.to_owned(),
                    into: t.clone(),
                });
            }
            if slots.branching.values().any(|t| t == tag.as_str()) {
                return Err(RegistryError::TagBeingWritten {
                    tag: tag.to_string(),
                });
            }
            slots.branching.insert(id.to_owned(), tag.to_string());
        }
        if let Err(e) = self.state().insert_operation(&op) {
            self.slots().branching.remove(id);
            return Err(e.into());
        }
        Ok(Accepted {
            op,
            source,
            base,
            tag,
            mode,
        })
    }

    /// Runs an accepted branch to its end and records the end in its operation.
    pub async fn run_branch(&self, a: Accepted) -> Result<BranchOutcome, RegistryError> {
        let id = a.source.id().to_owned();
        let progress = |m: &str| tracing::info!(op = %a.op.id, "{m}");
        let r = match &a.source {
            Source::Running(sandbox) => {
                forkd_core::branch::branch(
                    self.hypervisor().as_ref(),
                    self.home(),
                    self.store(),
                    sandbox,
                    &a.base,
                    &a.tag,
                    a.mode,
                    &progress,
                )
                .await
            }
            Source::Paused(row) => {
                forkd_core::branch::branch_paused(
                    self.store(),
                    self.hypervisor().as_ref(),
                    &row.config.dir,
                    &row.id,
                    &a.base,
                    &a.tag,
                    &progress,
                )
                .await
            }
        };
        self.slots().branching.remove(&id);
        // A source deleted (or failed) under the branch: say so, not how QEMU went.
        let r = r.map_err(|e| match self.get(&id) {
            Ok(entry)
                if entry.row.state == SandboxState::Running
                    && entry.sandbox.failure().is_none() =>
            {
                RegistryError::from(e)
            }
            Err(SandboxError::NotReady {
                state: SandboxState::Paused,
                ..
            }) if matches!(a.source, Source::Paused(_)) => RegistryError::from(e),
            _ => RegistryError::StoppedDuringBranch {
                id: id.clone(),
                source: e,
            },
        });
        let outcome = r.map(|b| BranchOutcome {
            snapshot: b.snapshot.tag.to_string(),
            parent: a.base.tag.to_string(),
            source: id.clone(),
            mode: a.mode.to_string(),
            pause_ms: b.stats.pause.as_secs_f64() * 1000.0,
            copy_ms: b.stats.copy.as_secs_f64() * 1000.0,
            total_ms: b.total.as_secs_f64() * 1000.0,
            transferred_bytes: b.stats.transferred,
            pages_changed: b.diff.pages,
            diff_bytes: b.diff.bytes,
            operation: a.op.id.clone(),
        });
        let (status, error, result) = match &outcome {
            Ok(o) => (
                "succeeded",
                None,
                serde_json::to_value(o).unwrap_or_default(),
            ),
            Err(e) => (
                "failed",
                Some(e.to_string()),
                a.op.result.clone().unwrap_or_default(),
            ),
        };
        tracing::info!(op = %a.op.id, source = %id, tag = %a.tag, "branch {status}");
        if let (Ok(o), Ok(source)) = (&outcome, self.describe(&id)) {
            let reason = format!("into snapshot {}", o.snapshot);
            self.events().emit(
                crate::events::EventKind::Branched,
                &source.row,
                Some(&reason),
            );
        }
        let recorded = self.state().finish_with_result(
            &a.op.id,
            &OperationEnd {
                status,
                error: error.as_deref(),
                finished_at: &crate::now_rfc3339(),
                done: u64::from(outcome.is_ok()),
                total: 1,
                result: &result,
            },
        );
        if let Err(e) = recorded {
            tracing::warn!(op = %a.op.id, "recording the end of the branch: {e}");
        }
        outcome
    }

    /// After a restart, before the sandboxes are adopted: the sources of branches the
    /// last daemon did not finish are set running again (a migration still under way is
    /// cancelled, stopped vCPUs are started), so that they answer when adopted. Their
    /// operations were marked failed and their staging files removed already.
    pub async fn recover_branches(&self, sources: &[String]) -> Result<(), RegistryError> {
        let rows = self.state().sandboxes()?;
        for row in rows.iter().filter(|r| sources.contains(&r.id)) {
            let vm = match self
                .hypervisor()
                .adopt(&row.config, row.pid, row.start_time)
                .await
            {
                Ok(vm) => vm,
                // Gone: adoption removes it.
                Err(_) => continue,
            };
            match vm.abandon_branch().await {
                Ok(top) => {
                    if let Some(top) = top {
                        forkd_core::branch::remove_unused_layers(&row.config.dir, &top);
                    }
                    tracing::info!(id = %row.id, "the source of an interrupted branch runs again")
                }
                Err(e) => tracing::warn!(
                    id = %row.id,
                    "setting the source of an interrupted branch running: {e}"
                ),
            }
        }
        Ok(())
    }

    /// Running sandboxes whose disk builds on snapshot `tag` since they were branched
    /// into it, and branches in progress that read it.
    pub(crate) fn branch_users_of(&self, tag: &str) -> Vec<String> {
        let mut users = Vec::new();
        // Every recorded sandbox: a paused one's disk builds on its branch as well.
        for l in self.list() {
            if l.row.snapshot != tag
                && forkd_core::branch::base_of(&l.row.config.dir, &l.row.snapshot) == tag
            {
                users.push(format!("{} (branched into it)", l.row.id));
            }
        }
        users
    }
}
