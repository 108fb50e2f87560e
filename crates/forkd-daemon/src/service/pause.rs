//! Pausing a running sandbox to disk, and resuming it.
//!
//! Each runs in a task of its own: a client that hangs up must not leave a sandbox
//! half paused or half resumed (the registry's state machine needs its end).

use super::ApiError;
use crate::api::App;
use crate::registry::{PauseOutcome, ResumeOutcome};
use forkd_core::pause::PauseKeeps;
use forkd_core::resume::ResumeHow;

/// Writes the running sandbox `id` to disk (what `keeps` says of it) and ends its VM.
pub async fn pause(app: &App, id: &str, keeps: PauseKeeps) -> Result<PauseOutcome, ApiError> {
    let (app, id) = (app.clone(), id.to_owned());
    let task = tokio::spawn(async move { app.registry.pause(&id, keeps).await });
    Ok(task
        .await
        .map_err(|e| ApiError::internal(format!("the pause task failed: {e}")))??)
}

/// Runs the paused sandbox `id` again (a running one is left as it is).
pub async fn resume(app: &App, id: &str) -> Result<ResumeOutcome, ApiError> {
    resume_as(app, id, ResumeHow::Restore).await
}

/// [`resume`], `how` asked for.
pub async fn resume_as(app: &App, id: &str, how: ResumeHow) -> Result<ResumeOutcome, ApiError> {
    let (app, id) = (app.clone(), id.to_owned());
    let task = tokio::spawn(async move { app.registry.resume(&id, how).await });
    Ok(task
        .await
        .map_err(|e| ApiError::internal(format!("the resume task failed: {e}")))??)
}
