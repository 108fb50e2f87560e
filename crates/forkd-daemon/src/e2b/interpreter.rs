//! E2B's code interpreter (port 49999) on forkd's code contexts: `POST /execute`
//! streams one JSON object per line as the cell runs; `/contexts` creates, lists,
//! restarts and removes contexts. forkd's contexts run Python.

use super::control::{fail, E2bError};
use super::{Shared, Target};
use crate::api::run::line;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Extension, Json, Router};
use forkd_proto::context::{ContextEvent, CreateContextRequest, Language, RunCodeRequest};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;

/// A quiet cell sends a line this often, so that clients waiting for output (the SDK
/// times out after 300 s without a byte) do not give up on a long computation.
const KEEPALIVE: Duration = Duration::from_secs(30);

/// The working directory of a context created without one (the agent's interpreters
/// start in `/`).
const DEFAULT_CWD: &str = "/";

pub(super) fn routes() -> Router<Shared> {
    Router::new()
        .route("/execute", post(execute))
        .route("/contexts", get(list).post(create))
        .route("/contexts/{context}", delete(remove))
        .route("/contexts/{context}/restart", post(restart))
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
}

/// The languages forkd's contexts run.
fn check_language(l: Option<&str>) -> Result<(), E2bError> {
    match l {
        None | Some("python" | "python3" | "") => Ok(()),
        Some(other) => Err(fail(
            StatusCode::BAD_REQUEST,
            format!("forkd's code contexts run Python, not {other}"),
        )),
    }
}

#[derive(Debug, Deserialize)]
struct ExecuteRequest {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<BTreeMap<String, String>>,
}

fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// A context event as the interpreter's line. A result with a PNG is a figure the
/// cell left open; the cell's own value is the main result.
fn event_line(e: ContextEvent) -> Vec<Value> {
    match e {
        ContextEvent::Stdout { text } => {
            vec![json!({"type": "stdout", "text": text, "timestamp": now_ns()})]
        }
        ContextEvent::Stderr { text } => {
            vec![json!({"type": "stderr", "text": text, "timestamp": now_ns()})]
        }
        ContextEvent::Result { text, html, png } => {
            let mut v = json!({"type": "result", "text": text, "is_main_result": png.is_none()});
            if let Some(h) = html {
                v["html"] = json!(h);
            }
            if let Some(p) = png {
                v["png"] = json!(p);
            }
            vec![v]
        }
        ContextEvent::Error {
            name,
            value,
            traceback,
        } => vec![json!({"type": "error", "name": name, "value": value, "traceback": traceback})],
        ContextEvent::Done { execution_count } => vec![
            json!({"type": "number_of_executions", "execution_count": execution_count}),
            json!({"type": "end_of_execution"}),
        ],
    }
}

async fn execute(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let req: ExecuteRequest = serde_json::from_slice(&body)
        .map_err(|e| fail(StatusCode::BAD_REQUEST, format!("the request body: {e}")))?;
    check_language(req.language.as_deref())?;
    let sandbox = e2b.sandbox(&t.id).await?;
    let context = crate::api::run::pick_context(&sandbox, req.context_id).await?;
    let run = RunCodeRequest {
        code: req.code,
        timeout_ms: None,
        env: req.env_vars.unwrap_or_default(),
    };
    let stream = sandbox
        .call(|a| async move { a.run_code_stream(&context, &run).await })
        .await?;
    let ticker = tokio::time::interval_at(tokio::time::Instant::now() + KEEPALIVE, KEEPALIVE);
    let lines = futures::stream::unfold(Some((stream, ticker)), |state| async move {
        let (mut stream, mut ticker) = state?;
        let lines = tokio::select! {
            e = stream.next() => match e {
                Ok(Some(e)) => event_line(e),
                Ok(None) => return None,
                Err(e) => {
                    let v = json!({"type": "error", "name": "SandboxError", "value": e.to_string(), "traceback": ""});
                    return Some((line(&v), None));
                }
            },
            _ = ticker.tick() => vec![json!({"type": "keepalive"})],
        };
        let bytes: Vec<u8> = lines.iter().flat_map(|v| line(v).to_vec()).collect();
        Some((Bytes::from(bytes), Some((stream, ticker))))
    });
    Ok(crate::api::run::ndjson(lines))
}

#[derive(Debug, Default, Deserialize)]
struct CreateRequest {
    language: Option<String>,
    cwd: Option<String>,
}

fn context_json(id: &str, cwd: &str) -> Value {
    json!({"id": id, "language": "python", "cwd": cwd})
}

async fn create(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let req: CreateRequest = if body.is_empty() {
        CreateRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| fail(StatusCode::BAD_REQUEST, format!("the request body: {e}")))?
    };
    check_language(req.language.as_deref())?;
    let sandbox = e2b.sandbox(&t.id).await?;
    let spec = CreateContextRequest {
        language: Language::Python,
        cwd: req.cwd.clone(),
        env: BTreeMap::new(),
    };
    let c = sandbox
        .call(|a| async move { a.create_context(&spec).await })
        .await?;
    Ok(Json(context_json(&c.id, c.cwd.as_deref().unwrap_or(DEFAULT_CWD))).into_response())
}

async fn list(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
) -> Result<Response, E2bError> {
    let sandbox = e2b.sandbox(&t.id).await?;
    let list = sandbox
        .call(|a| async move { a.list_contexts().await })
        .await?;
    let v: Vec<Value> = list
        .iter()
        .map(|c| context_json(&c.id, c.cwd.as_deref().unwrap_or(DEFAULT_CWD)))
        .collect();
    Ok(Json(v).into_response())
}

/// What a `/contexts/{id}` call does to the context.
enum ContextCall {
    Restart,
    Remove,
}

async fn context_call(
    e2b: &Shared,
    t: &Target,
    context: &str,
    call: ContextCall,
) -> Result<StatusCode, E2bError> {
    let context = crate::api::run::context_id(context)?.to_owned();
    let sandbox = e2b.sandbox(&t.id).await?;
    sandbox
        .call(|a| async move {
            match call {
                ContextCall::Restart => a.reset_context(&context).await,
                ContextCall::Remove => a.delete_context(&context).await,
            }
        })
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn restart(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    Path(context): Path<String>,
) -> Result<StatusCode, E2bError> {
    context_call(&e2b, &t, &context, ContextCall::Restart).await
}

async fn remove(
    State(e2b): State<Shared>,
    Extension(t): Extension<Target>,
    Path(context): Path<String>,
) -> Result<StatusCode, E2bError> {
    context_call(&e2b, &t, &context, ContextCall::Remove).await
}
