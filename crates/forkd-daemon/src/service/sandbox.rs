//! What is done to one sandbox as a whole: finding it running (resumed if it was
//! paused), removing it, changing its deadline and its egress policy.

use super::ApiError;
use crate::api::App;
use crate::registry::Entry;
use forkd_host::network::policy::EgressPolicy;

/// The sandbox `id`, running: one that is paused (or being paused) is resumed first,
/// transparently, for every request that needs its VM; requests that come while it
/// resumes wait for that one resume.
pub async fn running(app: &App, id: &str) -> Result<Entry, ApiError> {
    resume_if_paused(app, id).await?;
    Ok(app.registry.get(id)?)
}

/// Notes a request for the sandbox `id` (its idleness starts again) and, if it is
/// paused, being paused or resumed, waits until it runs. Every front door's requests
/// that need a VM come through here. A sandbox made with auto-resume off is refused
/// (409) while paused: only an explicit resume runs it again.
pub async fn resume_if_paused(app: &App, id: &str) -> Result<(), ApiError> {
    use forkd_core::lifecycle::SandboxState as S;
    app.registry.touch(id);
    if let Err(forkd_core::SandboxError::NotReady {
        state: state @ (S::Paused | S::Pausing | S::Resuming),
        ..
    }) = app.registry.get(id)
    {
        let manual = app
            .registry
            .describe(id)
            .is_ok_and(|l| l.row.lifecycle.manual_resume);
        if manual && state != S::Resuming {
            return Err(ApiError::conflict(format!(
                "the sandbox {id} was not found running: it is {state}, and it resumes only when asked to \
                 (POST /v1/sandboxes/{id}/resume, or E2B's connect), since it was made with auto-resume off"
            )));
        }
        super::pause::resume(app, id).await?;
    }
    Ok(())
}

/// Stops the sandbox `id` and removes its files and its record.
pub async fn delete(app: &App, id: &str) -> Result<(), ApiError> {
    // A link that brought a sandbox from another host goes with it (in a cluster only:
    // elsewhere no sandbox arrives so).
    let snapshot = app
        .cluster
        .as_ref()
        .and_then(|_| app.registry.describe(id).ok())
        .map(|l| l.row.snapshot);
    app.registry.delete(id).await?;
    if let Some(snapshot) = snapshot {
        super::moving::removed(app, id, &snapshot).await;
    }
    Ok(())
}

/// Sets (or with none, clears) the time `timeout_s` from now after which the daemon
/// stops the sandbox.
pub fn set_timeout(app: &App, id: &str, timeout_s: Option<u64>) -> Result<Entry, ApiError> {
    let at = super::fork::deadline(timeout_s)?;
    let entry = app.registry.set_timeout(id, at)?;
    Ok(app
        .registry
        .set_timeout_length(id, timeout_s)?
        .unwrap_or(entry))
}

/// Makes the sandbox live at least `timeout_s` more: a deadline sooner than that moves,
/// a later one (or none) stays.
pub fn keep_alive(app: &App, id: &str, timeout_s: u64) -> Result<(), ApiError> {
    let e = app.registry.describe(id)?;
    let at = super::fork::deadline_in(timeout_s)?;
    if e.row.timeout_at.is_some_and(|cur| cur < at) {
        app.registry.set_timeout(id, Some(at))?;
    }
    Ok(())
}

/// Replaces the running sandbox's egress policy (`off` takes its link down).
pub async fn set_egress(app: &App, id: &str, policy: EgressPolicy) -> Result<Entry, ApiError> {
    policy
        .check()
        .map_err(|e| ApiError::bad_request(format!("network: {e}")))?;
    Ok(app.registry.set_egress(id, policy).await?)
}
