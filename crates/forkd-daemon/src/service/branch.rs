//! Branching a running sandbox into a new snapshot, as an operation of its own.

use super::ApiError;
use crate::api::App;
use crate::branch::BranchOutcome;
use crate::state::OperationRow;
use forkd_hypervisor::BranchMode;
use forkd_storage::snapshot::Tag;

/// A branch under way, in a task of its own: a client that hangs up must not cut it
/// short.
pub struct Branch {
    /// Its operation.
    pub op: OperationRow,
    /// The snapshot it writes.
    pub tag: Tag,
    task: tokio::task::JoinHandle<Result<BranchOutcome, ApiError>>,
}

/// Checks that the sandbox `id` can be branched into `tag` (default: `br-` and 8 random
/// hex digits) in `mode` (default: the best the hypervisor captures faithfully) and
/// starts the branch. In a cluster, a tag that names a snapshot there already is
/// refused first.
pub async fn start(
    app: &App,
    id: &str,
    tag: Option<&str>,
    mode: Option<BranchMode>,
) -> Result<Branch, ApiError> {
    let tag = match tag {
        Some(t) => Tag::parse(t)?,
        None => Tag::parse(&format!("br-{}", forkd_host::ids::random_hex(4)))?,
    };
    super::tags::check_free(app, &tag).await?;
    let accepted = app.registry.accept_branch(id, tag.clone(), mode)?;
    let op = accepted.op.clone();
    let app = app.clone();
    let task = tokio::spawn(async move {
        let o = app.registry.run_branch(accepted).await?;
        app.metrics.branched(&o);
        // In a cluster, its tag must name no other snapshot.
        if let Err(e) = super::tags::claim_made(&app, std::slice::from_ref(&o.snapshot)).await {
            let failed = app.registry.state().finish_operation(
                &o.operation,
                "failed",
                Some(&e.message),
                &crate::now_rfc3339(),
            );
            if let Err(f) = failed {
                tracing::warn!(op = %o.operation, "recording the branch failed: {f}");
            }
            return Err(e);
        }
        Ok(o)
    });
    Ok(Branch { op, tag, task })
}

impl Branch {
    /// Waits for the snapshot to be written.
    pub async fn outcome(self) -> Result<BranchOutcome, ApiError> {
        self.task
            .await
            .map_err(|e| ApiError::internal(format!("the branch task failed: {e}")))?
    }
}
