//! Push and pull as operations: `POST /v1/snapshots/{tag}/push` and `POST /v1/pull`
//! answer at once with an operation whose `done`/`total` count the blob bytes moved;
//! its `result` says what was pushed or installed.

use super::error::ErrorBody;
use super::{ApiError, App, JsonBody, PathParams};
use crate::state::{OperationEnd, OperationRow};
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use forkd_storage::oci::registry;
use forkd_storage::snapshot::{SnapshotError, Tag};
use serde::Deserialize;

/// `POST /v1/snapshots/{tag}/push`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct PushBody {
    /// Where to: `REGISTRY/REPO:TAG`.
    pub reference: String,
}

/// `POST /v1/pull`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct PullBody {
    /// What: `REGISTRY/REPO:TAG` or `REGISTRY/REPO@sha256:...`.
    pub reference: String,
    /// Install the snapshot under this tag (its ancestors keep theirs).
    pub tag: Option<String>,
}

/// Pushes a snapshot and its ancestors to a registry, as an operation.
#[utoipa::path(post, path = "/v1/snapshots/{tag}/push", params(("tag" = String, Path)),
    request_body = PushBody,
    responses((status = 202, body = OperationRow), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 413, body = ErrorBody),
        (status = 422, body = ErrorBody)))]
pub async fn push(
    State(app): State<App>,
    PathParams(tag): PathParams<String>,
    JsonBody(b): JsonBody<PushBody>,
) -> Result<(StatusCode, Json<OperationRow>), ApiError> {
    let tag = Tag::parse(&tag)?;
    if !app.registry.store().exists(&tag) {
        return Err(SnapshotError::NotFound {
            tag: tag.to_string(),
        }
        .into());
    }
    registry::parse_reference(&b.reference)?;
    let op = start(&app, "push", tag.as_str())?;
    let id = op.id.clone();
    tokio::spawn(async move {
        let known = std::sync::atomic::AtomicU64::new(0);
        let report = |done, total, step: &str| progress(&app, &id, &known, done, total, step);
        let r = registry::push(
            app.registry.store(),
            &tag,
            &b.reference,
            &app.config.registries,
            &report,
        )
        .await
        .map(|p| serde_json::to_value(p).unwrap_or_default());
        finish(&app, &id, &known, r);
    });
    Ok((StatusCode::ACCEPTED, Json(op)))
}

/// Pulls a snapshot (and its ancestors) from a registry and installs it, as an
/// operation.
#[utoipa::path(post, path = "/v1/pull", request_body = PullBody,
    responses((status = 202, body = OperationRow), (status = 400, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 413, body = ErrorBody),
        (status = 422, body = ErrorBody)))]
pub async fn pull(
    State(app): State<App>,
    JsonBody(b): JsonBody<PullBody>,
) -> Result<(StatusCode, Json<OperationRow>), ApiError> {
    registry::parse_reference(&b.reference)?;
    let rename = b.tag.as_deref().map(Tag::parse).transpose()?;
    if let Some(t) = rename.as_ref().filter(|t| app.registry.store().exists(t)) {
        return Err(SnapshotError::Exists { tag: t.to_string() }.into());
    }
    let op = start(&app, "pull", &b.reference)?;
    let id = op.id.clone();
    tokio::spawn(async move {
        let known = std::sync::atomic::AtomicU64::new(0);
        let report = |done, total, step: &str| progress(&app, &id, &known, done, total, step);
        let r = registry::pull(
            app.registry.store(),
            app.registry.hypervisor().clone(),
            &b.reference,
            rename.as_ref(),
            &app.config.registries,
            &report,
        )
        .await;
        let r = match r {
            Ok(u) => {
                for t in &u.installed {
                    app.registry.reopen_pool(t, false);
                }
                match crate::service::tags::claim_made(&app, &u.installed).await {
                    Ok(()) => Ok(serde_json::to_value(u).unwrap_or_default()),
                    Err(e) => Err(e.message),
                }
            }
            Err(e) => Err(e.to_string()),
        };
        finish(&app, &id, &known, r);
    });
    Ok((StatusCode::ACCEPTED, Json(op)))
}

fn start(app: &App, kind: &str, target: &str) -> Result<OperationRow, ApiError> {
    let op = OperationRow::running(kind, target, 0, None);
    app.registry.state().insert_operation(&op)?;
    tracing::info!(op = %op.id, %kind, %target, "started");
    Ok(op)
}

/// Records a report: bytes done in memory; the total, which is known after packing (a
/// push) or grows as ancestors are found (a pull), written when it changes.
fn progress(
    app: &App,
    id: &str,
    known: &std::sync::atomic::AtomicU64,
    done: u64,
    total: u64,
    step: &str,
) {
    tracing::debug!(op = %id, done, total, "{step}");
    if known.swap(total, std::sync::atomic::Ordering::SeqCst) != total {
        if let Err(e) = app.registry.state().set_operation_total(id, total) {
            tracing::warn!(op = %id, "recording the operation's size: {e}");
        }
    }
    app.registry.set_progress(id, done);
}

/// Records how the operation ended: on success everything was done; the total is the
/// last one [`progress`] heard.
fn finish(
    app: &App,
    id: &str,
    known: &std::sync::atomic::AtomicU64,
    r: Result<serde_json::Value, impl std::fmt::Display>,
) {
    let done = app.registry.progress(id).unwrap_or(0);
    let (status, error, result) = match &r {
        Ok(v) => ("succeeded", None, v.clone()),
        Err(e) => ("failed", Some(e.to_string()), serde_json::Value::Null),
    };
    tracing::info!(op = %id, "{status}{}", error.as_deref().map(|e| format!(": {e}")).unwrap_or_default());
    let total = known.load(std::sync::atomic::Ordering::SeqCst).max(done);
    let end = OperationEnd {
        status,
        error: error.as_deref(),
        finished_at: &crate::now_rfc3339(),
        done: if r.is_ok() { total } else { done },
        total,
        result: &result,
    };
    if let Err(e) = app.registry.state().finish_with_result(id, &end) {
        tracing::warn!(op = %id, "recording the end of the operation: {e}");
    }
    app.registry.clear_progress(id);
}
