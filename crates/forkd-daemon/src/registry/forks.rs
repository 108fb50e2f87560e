//! A fork through the registry: admitted, recorded before anything of it runs (each
//! child's row as core plans it), handed out, and its operation ended. Core reports the
//! children that answer on a channel while the fork goes; what it does not return is
//! gone from the host, and its rows are forgotten.

use super::{CreateOutcome, CreateSpec, Entry, Registry, RegistryError};
use crate::state::{OperationRow, SandboxRow, StateError};
use forkd_core::fork::{ChildReady, ForkOptions, ForkPlan, Forked};
use forkd_core::lifecycle::SandboxState;
use forkd_core::{Sandbox, SandboxError};
use forkd_host::failpoint;
use forkd_storage::snapshot::Snapshot;
use std::sync::Arc;

impl Registry {
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
        let opts = ForkOptions {
            count: spec.count,
            detached: true,
            agent_timeout: self.agent_timeout,
            parallel: self.fork_parallel,
            cancel,
            env: spec.env.clone(),
            limits: spec.limits,
            egress: spec.egress.clone(),
            partial: spec.partial,
            ..ForkOptions::default()
        };
        let forked = self
            .fork_recorded(snap, &spec, &op.id, &opts, prepared)
            .await;
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
    pub(super) async fn hand_out(
        &self,
        children: Vec<Sandbox>,
    ) -> Result<Vec<Entry>, SandboxError> {
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
        let entries: Vec<Entry> = children
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
            .collect();
        drop(slots);
        self.events.emit_all(
            crate::events::EventKind::Started,
            entries.iter().map(|e| &e.row),
            None,
        );
        Ok(entries)
    }

    /// Records how a fork ended: its status, error and result (children and errors).
    pub(super) fn finish_fork(
        &self,
        op: &str,
        total: usize,
        outcome: &Result<CreateOutcome, SandboxError>,
    ) {
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
}

fn recording_failed(registry: &Registry, e: StateError) -> SandboxError {
    if e.is_disk_full() {
        let root = registry.home.root();
        return SandboxError::NoSpace(forkd_host::space::NoSpace {
            what: "recording sandboxes in the state database".into(),
            path: root.display().to_string(),
            needed_mib: forkd_host::space::RESERVE.div_ceil(1 << 20),
            available_mib: forkd_host::space::available(root).unwrap_or(0) >> 20,
        });
    }
    SandboxError::Io {
        context: "recording the sandbox in the state database".into(),
        source: std::io::Error::other(e.to_string()),
    }
}

impl Registry {
    /// Plans the fork, records each child `starting` (one write for all of them) before
    /// any of its VMs starts, runs it while counting the children that answer as the
    /// operation `op`'s progress, and forgets the rows of the children it did not
    /// return (their VMs are gone and their files removed).
    async fn fork_recorded(
        &self,
        snap: &Snapshot,
        spec: &CreateSpec,
        op: &str,
        opts: &ForkOptions,
        prepared: Vec<forkd_core::fork::PreparedChild>,
    ) -> Result<Forked, SandboxError> {
        let hv = self.hv.as_ref();
        let plan = forkd_core::fork::plan(hv, &self.home, snap, opts, prepared).await?;
        let ids = plan.ids();
        if let Err(e) = self.record_starting(snap, spec, &plan) {
            plan.abandon().await;
            return Err(e);
        }
        failpoint::hit("fork.after_row");
        let (ready_tx, mut ready_rx) = tokio::sync::mpsc::unbounded_channel::<ChildReady>();
        let run = async move {
            let forked = forkd_core::fork::run(hv, snap, opts, plan, Some(&ready_tx)).await;
            drop(ready_tx);
            forked
        };
        let track = async {
            let mut done = 0;
            while let Some(child) = ready_rx.recv().await {
                // Known in memory only: the row says `running` when the child is handed
                // out, in one write for the whole fork (a daemon killed before that
                // removes it).
                done += 1;
                let mut slots = self.slots();
                if let Some(row) = slots.starting.get_mut(&child.id) {
                    (row.pid, row.start_time) = (child.pid, child.start_time);
                }
                slots.progress.insert(op.to_owned(), done);
            }
        };
        let (forked, ()) = tokio::join!(run, track);
        let kept: std::collections::HashSet<&str> = match &forked {
            Ok(f) => f.children.iter().map(Sandbox::id).collect(),
            Err(_) => Default::default(),
        };
        for id in ids.iter().filter(|id| !kept.contains(id.as_str())) {
            self.forget_starting(id);
        }
        forked
    }

    /// Records the children of `plan` `starting`, before anything of them runs.
    fn record_starting(
        &self,
        snap: &Snapshot,
        spec: &CreateSpec,
        plan: &ForkPlan,
    ) -> Result<(), SandboxError> {
        let created_at = crate::now_rfc3339();
        let rows: Vec<SandboxRow> = plan
            .configs()
            .map(|config| SandboxRow {
                id: config.id.clone(),
                snapshot: snap.tag.to_string(),
                pid: 0,
                start_time: 0,
                config: config.clone(),
                labels: spec.labels.clone(),
                timeout_at: spec.timeout_at,
                lifecycle: spec.lifecycle,
                created_at: created_at.clone(),
                state: SandboxState::Starting,
                error: None,
            })
            .collect();
        self.state
            .insert_sandboxes(&rows)
            .map_err(|e| recording_failed(self, e))?;
        self.events
            .emit_all(crate::events::EventKind::Created, &rows, None);
        let mut slots = self.slots();
        for row in rows {
            slots.starting.insert(row.id.clone(), row);
        }
        Ok(())
    }

    /// Forgets a child of a fork that did not make it.
    fn forget_starting(&self, id: &str) {
        if let Err(e) = self.state.delete_sandbox(id) {
            tracing::warn!(%id, "forgetting a discarded child: {e}");
        }
        self.slots().starting.remove(id);
    }
}
