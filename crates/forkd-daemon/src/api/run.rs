//! Running things in a sandbox: commands (`exec`), code cells (`code`) and the code
//! contexts they run in. Both run endpoints answer with one JSON result, or with NDJSON
//! lines as the output arrives when the request asks for `"stream": true`.

use super::error::ErrorBody;
use super::types::{
    CodeResult, ContextBody, CreateContextBody, ExecBody, ExecEventBody, ExecResultBody,
    RunCodeBody,
};
use super::{ApiError, App, JsonBody, PathParams};
use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use bytes::Bytes;
use forkd_core::agent::ExecOutput;
use forkd_core::Sandbox;
use forkd_proto::context::{ContextEvent, CreateContextRequest, RunCodeRequest};
use forkd_proto::exec::{Command, ExecRequest, ExitStatus};
use forkd_proto::frame::MAX_PAYLOAD;
use std::sync::Arc;

/// Most output a non-streaming run collects, per stream.
const MAX_COLLECTED: usize = 16 << 20;

/// Appends what fits under [`MAX_COLLECTED`]; true when something was cut.
fn push_capped(buf: &mut Vec<u8>, more: &[u8]) -> bool {
    let room = MAX_COLLECTED.saturating_sub(buf.len());
    buf.extend_from_slice(&more[..more.len().min(room)]);
    more.len() > room
}

/// Longest timeout a run accepts: one day.
const MAX_RUN_TIMEOUT_S: f64 = 86_400.0;

#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "a finite, range-checked number of seconds: its milliseconds fit"
)]
fn timeout_ms(t: Option<f64>) -> Result<Option<u64>, ApiError> {
    match t {
        None => Ok(None),
        Some(s) if s > 0.0 && s <= MAX_RUN_TIMEOUT_S => Ok(Some((s * 1000.0).ceil() as u64)),
        Some(s) => Err(ApiError::bad_request(format!(
            "timeout_s = {s} is outside (0, {MAX_RUN_TIMEOUT_S}]"
        ))),
    }
}

pub(super) fn exec_request(b: &ExecBody) -> Result<ExecRequest, ApiError> {
    let command = match (&b.cmd, &b.shell) {
        (Some(argv), None) if !argv.is_empty() && !argv[0].is_empty() => {
            Command::Argv(argv.clone())
        }
        (None, Some(line)) if !line.trim().is_empty() => Command::Shell(line.clone()),
        (Some(_), Some(_)) => return Err(ApiError::bad_request("give cmd or shell, not both")),
        _ => {
            return Err(ApiError::bad_request(
                "give cmd (a non-empty argv) or shell (a command line)",
            ))
        }
    };
    if let Some(cwd) = &b.cwd {
        super::guest_path(cwd)?;
    }
    if let Some(problem) = forkd_proto::exec::env_problem(&b.env) {
        return Err(ApiError::bad_request(problem));
    }
    let mut req = ExecRequest::new(command);
    req.env = b.env.clone();
    req.cwd = b.cwd.clone();
    req.timeout_ms = timeout_ms(b.timeout_s)?;
    // The agent takes the request as one frame. A body under the HTTP limit can still
    // encode larger (the agent's field names, escapes): refuse it here, with the limit.
    let encoded = serde_json::to_vec(&req)
        .map_err(|e| ApiError::internal(format!("encoding the agent request: {e}")))?
        .len();
    if encoded > MAX_PAYLOAD {
        return Err(ApiError::too_large(format!(
            "the command, env and cwd take {encoded} bytes as an agent request; the agent \
             protocol carries at most {MAX_PAYLOAD} bytes (1 MiB) per request: pass large \
             inputs on stdin (stdin_b64) or upload them as a file"
        )));
    }
    Ok(req)
}

/// The bytes for the command's stdin: `stdin` (UTF-8 text) or `stdin_b64` (any bytes).
fn stdin_bytes(b: &mut ExecBody) -> Result<Option<Vec<u8>>, ApiError> {
    text_or_base64(b.stdin.take(), b.stdin_b64.take(), "stdin")
}

/// Bytes given as `{field}` (UTF-8 text) or `{field}_b64` (base64 of any bytes), or
/// neither; never both.
pub(super) fn text_or_base64(
    text: Option<String>,
    b64: Option<String>,
    field: &str,
) -> Result<Option<Vec<u8>>, ApiError> {
    match (text, b64) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(format!(
            "give {field} (UTF-8 text) or {field}_b64 (base64 of bytes), not both"
        ))),
        (Some(text), None) => Ok(Some(text.into_bytes())),
        (None, Some(b64)) => BASE64.decode(b64.as_bytes()).map(Some).map_err(|e| {
            ApiError::bad_request(format!(
                "{field}_b64 is not base64 (RFC 4648 standard alphabet, with = padding): {e}"
            ))
        }),
        (None, None) => Ok(None),
    }
}

/// An NDJSON response whose lines come from `lines`.
pub(crate) fn ndjson(lines: impl futures::Stream<Item = Bytes> + Send + 'static) -> Response {
    use futures::StreamExt;
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines.map(Ok::<_, std::convert::Infallible>)),
    )
        .into_response()
}

/// `v` as one NDJSON line.
pub(crate) fn line<T: serde::Serialize>(v: &T) -> Bytes {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    Bytes::from(b)
}

fn exit_event(s: ExitStatus) -> ExecEventBody {
    ExecEventBody::Exit {
        exit_code: s.shell_code(),
        signal: s.signal,
        timed_out: s.timed_out,
        duration_ms: s.duration_ms,
    }
}

/// Runs a command in the sandbox.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", params(("id" = String, Path)),
    request_body = ExecBody,
    responses(
        (status = 200,
         description = "The command's result; with `stream`, NDJSON lines of ExecEventBody",
         content((ExecResultBody = "application/json"), ("application/x-ndjson"))),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn exec(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    JsonBody(mut body): JsonBody<ExecBody>,
) -> Result<Response, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let req = exec_request(&body)?;
    let stdin = stdin_bytes(&mut body)?
        .map(|b| Box::new(std::io::Cursor::new(b)) as forkd_core::agent::Stdin);
    let started = std::time::Instant::now();
    let mut stream = sandbox.exec_stream(req, stdin).await?;
    if !body.stream {
        // Collected up to a limit: one command's output must not exhaust the daemon.
        let (mut stdout, mut stderr, mut truncated) = (Vec::new(), Vec::new(), false);
        let mut status = None;
        while let Some(item) = stream.next().await? {
            match item {
                ExecOutput::Stdout(b) => truncated |= push_capped(&mut stdout, &b),
                ExecOutput::Stderr(b) => truncated |= push_capped(&mut stderr, &b),
                ExecOutput::Started(_) => {}
                ExecOutput::Exited(s) => status = Some(s),
            }
        }
        let s = status.ok_or_else(|| {
            ApiError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                "sandbox_failed",
                "the command's output ended without an exit status",
            )
        })?;
        app.metrics
            .exec_seconds
            .observe(started.elapsed().as_secs_f64());
        return Ok(Json(ExecResultBody {
            stdout_b64: BASE64.encode(&stdout),
            stderr_b64: BASE64.encode(&stderr),
            exit_code: s.shell_code(),
            signal: s.signal,
            timed_out: s.timed_out,
            duration_ms: s.duration_ms,
            truncated,
        })
        .into_response());
    }
    let app2 = app.clone();
    let lines = futures::stream::unfold(Some(stream), move |state| {
        let app = app2.clone();
        async move {
            let mut stream = state?;
            loop {
                let event = match stream.next().await {
                    // Bytes as they came, never decoded as text here: a piece may end
                    // inside a multibyte character, which only the joined stream holds.
                    Ok(Some(ExecOutput::Stdout(b))) => ExecEventBody::Stdout {
                        data_b64: BASE64.encode(&b),
                    },
                    Ok(Some(ExecOutput::Stderr(b))) => ExecEventBody::Stderr {
                        data_b64: BASE64.encode(&b),
                    },
                    Ok(Some(ExecOutput::Started(_))) => continue,
                    Ok(Some(ExecOutput::Exited(s))) => {
                        app.metrics
                            .exec_seconds
                            .observe(started.elapsed().as_secs_f64());
                        return Some((line(&exit_event(s)), None));
                    }
                    Ok(None) => return None,
                    Err(e) => {
                        return Some((
                            line(&ExecEventBody::Error {
                                message: e.to_string(),
                            }),
                            None,
                        ))
                    }
                };
                return Some((line(&event), Some(stream)));
            }
        }
    });
    Ok(ndjson(lines))
}

/// A context id given by a client: the agent's ids are short and plain, and anything
/// else cannot name one (nor go into the agent's request line).
pub(crate) fn context_id(c: &str) -> Result<&str, ApiError> {
    if c.is_empty()
        || c.len() > 64
        || !c
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '_')
    {
        return Err(ApiError::not_found(format!(
            "no context {:?}",
            c.chars().take(80).collect::<String>()
        )));
    }
    Ok(c)
}

/// The context a cell runs in: the one named, else the sandbox's first, else a new one.
pub(crate) async fn pick_context(
    sandbox: &Sandbox,
    named: Option<String>,
) -> Result<String, ApiError> {
    if let Some(c) = named {
        return Ok(context_id(&c)?.to_owned());
    }
    let list = sandbox
        .call(|a| async move { a.list_contexts().await })
        .await?;
    if let Some(c) = list.first() {
        return Ok(c.id.clone());
    }
    let c = sandbox
        .call(|a| async move { a.create_context(&CreateContextRequest::default()).await })
        .await?;
    Ok(c.id)
}

/// Runs a code cell in one of the sandbox's contexts (state persists between cells).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/code", params(("id" = String, Path)),
    request_body = RunCodeBody,
    responses(
        (status = 200,
         description = "What the cell produced; with `stream`, NDJSON lines (stdout, stderr, result, error, done)",
         content((CodeResult = "application/json"), ("application/x-ndjson"))),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 413, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn run_code(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    JsonBody(body): JsonBody<RunCodeBody>,
) -> Result<Response, ApiError> {
    let sandbox: Arc<Sandbox> = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let req = RunCodeRequest {
        code: body.code,
        timeout_ms: timeout_ms(body.timeout_s)?,
        env: body.env,
    };
    let context = pick_context(&sandbox, body.context).await?;
    let ctx = context.clone();
    let mut stream = sandbox
        .call(|a| async move { a.run_code_stream(&ctx, &req).await })
        .await?;
    if !body.stream {
        // Collected up to a limit, like exec.
        let mut x = forkd_proto::context::Execution::default();
        let mut kept = 0usize;
        let mut truncated = false;
        while let Some(e) = stream
            .next()
            .await
            .map_err(forkd_core::SandboxError::from)?
        {
            let size = match &e {
                ContextEvent::Stdout { text } | ContextEvent::Stderr { text } => text.len(),
                ContextEvent::Result { text, html, png } => {
                    text.len()
                        + html.as_ref().map_or(0, String::len)
                        + png.as_ref().map_or(0, String::len)
                }
                _ => 0,
            };
            if kept + size > MAX_COLLECTED {
                truncated = true;
                continue;
            }
            kept += size;
            x.push(e);
        }
        let mut result = CodeResult::from_execution(context, x);
        result.truncated = truncated;
        return Ok(Json(result).into_response());
    }
    let lines = futures::stream::unfold(Some(stream), |state| async move {
        let mut stream = state?;
        match stream.next().await {
            Ok(Some(e)) => Some((line(&e), Some(stream))),
            Ok(None) => None,
            Err(e) => Some((
                line(&serde_json::json!({"type": "error", "name": "SandboxError",
                    "value": e.to_string(), "traceback": ""})),
                None,
            )),
        }
    });
    Ok(ndjson(lines))
}

/// The sandbox's code contexts.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/contexts", params(("id" = String, Path)),
    responses((status = 200, body = Vec<ContextBody>), (status = 404, body = ErrorBody),
        (status = 502, body = ErrorBody)))]
pub async fn list_contexts(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
) -> Result<Json<Vec<ContextBody>>, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let list = sandbox
        .call(|a| async move { a.list_contexts().await })
        .await?;
    Ok(Json(list.into_iter().map(ContextBody::from).collect()))
}

/// Starts a new Python context.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/contexts", params(("id" = String, Path)),
    request_body = CreateContextBody,
    responses((status = 201, body = ContextBody), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 413, body = ErrorBody),
        (status = 502, body = ErrorBody)))]
pub async fn create_context(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    JsonBody(body): JsonBody<CreateContextBody>,
) -> Result<(axum::http::StatusCode, Json<ContextBody>), ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    if let Some(cwd) = &body.cwd {
        super::guest_path(cwd)?;
    }
    let req = CreateContextRequest {
        cwd: body.cwd,
        env: body.env,
        ..Default::default()
    };
    let c = sandbox
        .call(|a| async move { a.create_context(&req).await })
        .await?;
    Ok((axum::http::StatusCode::CREATED, Json(c.into())))
}

/// Restarts a context's interpreter with empty state.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/contexts/{context}/reset",
    params(("id" = String, Path), ("context" = String, Path)),
    responses((status = 200, body = ContextBody), (status = 404, body = ErrorBody),
        (status = 502, body = ErrorBody)))]
pub async fn reset_context(
    State(app): State<App>,
    PathParams((id, context)): PathParams<(String, String)>,
) -> Result<Json<ContextBody>, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    context_id(&context)?;
    let c = sandbox
        .call(|a| async move { a.reset_context(&context).await })
        .await?;
    Ok(Json(c.into()))
}

/// Ends a context.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/contexts/{context}",
    params(("id" = String, Path), ("context" = String, Path)),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn delete_context(
    State(app): State<App>,
    PathParams((id, context)): PathParams<(String, String)>,
) -> Result<axum::http::StatusCode, ApiError> {
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    context_id(&context)?;
    sandbox
        .call(|a| async move { a.delete_context(&context).await })
        .await?;
    Ok(axum::http::StatusCode::NO_CONTENT)
}
