//! Pausing a running sandbox to disk, and resuming it.
//!
//! Each runs in a task of its own: a client that hangs up must not leave a sandbox
//! half paused or half resumed (the registry's state machine needs its end).

use super::ApiError;
use crate::api::App;
use crate::registry::{PauseOutcome, ResumeOutcome};

/// Writes the running sandbox `id` to disk and ends its VM.
pub async fn pause(app: &App, id: &str) -> Result<PauseOutcome, ApiError> {
    let (app, id) = (app.clone(), id.to_owned());
    let task = tokio::spawn(async move { app.registry.pause(&id).await });
    Ok(task
        .await
        .map_err(|e| ApiError::internal(format!("the pause task failed: {e}")))??)
}

/// Runs the paused sandbox `id` again (a running one is left as it is).
pub async fn resume(app: &App, id: &str) -> Result<ResumeOutcome, ApiError> {
    let (app, id) = (app.clone(), id.to_owned());
    let task = tokio::spawn(async move { app.registry.resume(&id).await });
    Ok(task
        .await
        .map_err(|e| ApiError::internal(format!("the resume task failed: {e}")))??)
}
