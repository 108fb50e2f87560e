//! Background processes in a sandbox: started, listed, waited for, signalled and killed
//! through the guest agent, which keeps each one's exit and the tail of its output.

use super::error::ErrorBody;
use super::run::{exec_request, text_or_base64};
use super::types::{ExecBody, ProcessBody, ProcessStartBody, SignalBody, StdinBody};
use super::{ApiError, App, JsonBody, PathParams, QueryParams};
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use forkd_core::agent::{AgentClient, AgentError};
use forkd_proto::exec::ProcessInfo;
use serde::Deserialize;

/// Longest wait one request may ask for: an hour (the process runs on after it).
const MAX_WAIT_S: f64 = 3600.0;

/// `?timeout_s=...`
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WaitParams {
    /// Answer after this many seconds even if the process still runs (default: wait
    /// until it ends, at most an hour).
    #[serde(default)]
    #[param(minimum = 0, maximum = 3600)]
    timeout_s: Option<f64>,
}

/// A process id from the path; anything else names no process.
fn process_id(raw: &str) -> Result<u64, ApiError> {
    raw.parse()
        .map_err(|_| ApiError::not_found(format!("no background process with id {raw}")))
}

/// Runs one agent call on process `process` of sandbox `id` and answers with the process.
async fn on_process<F, Fut>(
    app: &App,
    id: &str,
    process: &str,
    f: F,
) -> Result<Json<ProcessBody>, ApiError>
where
    F: FnOnce(AgentClient, u64) -> Fut,
    Fut: std::future::Future<Output = Result<ProcessInfo, AgentError>>,
{
    let sandbox = crate::service::sandbox::running(app, id).await?.sandbox;
    let n = process_id(process)?;
    let p = sandbox.call(|a| f(a, n)).await?;
    Ok(Json(p.into()))
}

/// Starts a background process; it runs on after this answers (201).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes", params(("id" = String, Path)),
    request_body = ProcessStartBody,
    responses((status = 201, body = ProcessBody), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 413, body = ErrorBody),
        (status = 502, body = ErrorBody)))]
pub async fn start(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    JsonBody(b): JsonBody<ProcessStartBody>,
) -> Result<(StatusCode, Json<ProcessBody>), ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let mut req = exec_request(&ExecBody {
        cmd: b.cmd,
        shell: b.shell,
        env: b.env,
        cwd: b.cwd,
        timeout_s: b.timeout_s,
        stdin: None,
        stdin_b64: None,
        stream: false,
    })?;
    req.stdin = b.stdin;
    let p = sandbox
        .call(|a| async move { a.spawn_process(&req).await })
        .await?;
    Ok((StatusCode::CREATED, Json(p.into())))
}

/// The sandbox's background processes, running and ended, oldest first.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes", params(("id" = String, Path)),
    responses((status = 200, body = Vec<ProcessBody>), (status = 404, body = ErrorBody),
        (status = 502, body = ErrorBody)))]
pub async fn list(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<Json<Vec<ProcessBody>>, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let list = sandbox
        .call(|a| async move { a.list_processes().await })
        .await?;
    Ok(Json(list.into_iter().map(ProcessBody::from).collect()))
}

/// One background process.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{process}",
    params(("id" = String, Path), ("process" = u64, Path)),
    responses((status = 200, body = ProcessBody), (status = 404, body = ErrorBody),
        (status = 502, body = ErrorBody)))]
pub async fn get(
    State(app): State<App>,
    PathParams((id, process)): PathParams<(String, String)>,
) -> Result<Json<ProcessBody>, ApiError> {
    on_process(
        &app,
        &id,
        &process,
        |a, n| async move { a.get_process(n).await },
    )
    .await
}

/// Waits for a background process to end (or for `timeout_s`) and answers with it.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/wait",
    params(("id" = String, Path), ("process" = u64, Path), WaitParams),
    responses((status = 200, body = ProcessBody), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn wait(
    State(app): State<App>,
    PathParams((id, process)): PathParams<(String, String)>,
    QueryParams(q): QueryParams<WaitParams>,
) -> Result<Json<ProcessBody>, ApiError> {
    let secs = q.timeout_s.unwrap_or(MAX_WAIT_S);
    if !(0.0..=MAX_WAIT_S).contains(&secs) {
        return Err(ApiError::bad_request(format!(
            "timeout_s = {secs} is outside [0, {MAX_WAIT_S}]"
        )));
    }
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a finite, range-checked number of seconds: its milliseconds fit"
    )]
    let ms = (secs * 1000.0).ceil() as u64;
    on_process(&app, &id, &process, |a, n| async move {
        a.wait_process(n, Some(ms)).await
    })
    .await
}

/// Writes to the stdin of a background process started with `stdin: true`, in the order
/// requests arrive; `close` ends it (the process reads end of file). 409 once it is
/// closed or the process no longer reads it.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/stdin",
    params(("id" = String, Path), ("process" = u64, Path)), request_body = StdinBody,
    responses((status = 200, body = ProcessBody), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn stdin(
    State(app): State<App>,
    PathParams((id, process)): PathParams<(String, String)>,
    JsonBody(b): JsonBody<StdinBody>,
) -> Result<Json<ProcessBody>, ApiError> {
    // The JSON body limit (1 MiB) keeps one write under the agent's STDIN_WRITE_LIMIT.
    let data = bytes::Bytes::from(text_or_base64(b.data, b.data_b64, "data")?.unwrap_or_default());
    on_process(&app, &id, &process, |a, n| async move {
        a.write_process_stdin(n, data, b.close).await
    })
    .await
}

/// Sends a signal (by name or number) to a background process's group, or with
/// `group: false` to the process alone.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/signal",
    params(("id" = String, Path), ("process" = u64, Path)), request_body = SignalBody,
    responses((status = 200, body = ProcessBody), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn signal(
    State(app): State<App>,
    PathParams((id, process)): PathParams<(String, String)>,
    JsonBody(b): JsonBody<SignalBody>,
) -> Result<Json<ProcessBody>, ApiError> {
    let signal = b.signal.number().map_err(ApiError::bad_request)?;
    on_process(&app, &id, &process, |a, n| async move {
        a.signal_process(n, signal, !b.group).await
    })
    .await
}

/// Kills a background process (SIGKILL to its group) and forgets it; answers with how
/// it ended.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/processes/{process}",
    params(("id" = String, Path), ("process" = u64, Path)),
    responses((status = 200, body = ProcessBody), (status = 404, body = ErrorBody),
        (status = 502, body = ErrorBody)))]
pub async fn kill(
    State(app): State<App>,
    PathParams((id, process)): PathParams<(String, String)>,
) -> Result<Json<ProcessBody>, ApiError> {
    on_process(&app, &id, &process, |a, n| async move {
        a.kill_process(n).await
    })
    .await
}
