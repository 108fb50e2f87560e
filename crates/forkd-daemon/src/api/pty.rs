//! Terminals: `GET /v1/sandboxes/{id}/pty` upgraded to a WebSocket that carries one
//! command (by default the user's login shell) running on a pseudo-terminal of the guest.
//!
//! Binary messages are bytes: from the client, typed into the terminal; from the
//! daemon, what the terminal printed. Text messages are JSON ([`PtyClientMessage`],
//! [`PtyServerMessage`]). The command ends the socket when it exits (an `exit` message,
//! then a close with reason `exited`); a pause, removal or failure of the sandbox ends it
//! with a `closed` message and that reason (`paused`, `removed`, `failed`); the client
//! closing the socket kills the command's process group. Output is sent as fast as the
//! client reads it, no faster: a slow client holds the command back (the guest's
//! terminal fills and the command blocks in its writes), never the daemon's memory.

use super::error::ErrorBody;
use super::{ApiError, App, PathParams};
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use forkd_core::agent::{ExecOutput, TerminalInput};
use forkd_core::SandboxError;
use forkd_proto::exec::{Command, ExecRequest, ExitStatus, PtySize};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

/// Inputs queued for the guest before the socket's reads wait.
const INPUT_QUEUED: usize = 16;

/// The query of `GET /v1/sandboxes/{id}/pty`.
#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PtyParams {
    /// Columns of the terminal (80 by default).
    #[param(minimum = 1, maximum = 65535)]
    cols: Option<u16>,
    /// Rows of the terminal (24 by default).
    #[param(minimum = 1, maximum = 65535)]
    rows: Option<u16>,
    /// The program and its arguments, one `cmd` per word in order; none runs the user's
    /// login shell.
    #[serde(default)]
    cmd: Vec<String>,
    /// Variables for the command, each `NAME=value` (`TERM` is `xterm-256color` unless
    /// given).
    #[serde(default)]
    env: Vec<String>,
    /// Working directory (absolute; the user's home by default).
    cwd: Option<String>,
    /// The guest user to run as (root by default, or the template image's user).
    user: Option<String>,
}

impl PtyParams {
    /// The query, where `cmd` and `env` may repeat.
    fn parse(raw: Option<&str>) -> Result<PtyParams, ApiError> {
        let mut p = PtyParams::default();
        let number = |k: &str, v: &str| {
            v.parse::<u16>().ok().filter(|n| *n > 0).ok_or_else(|| {
                ApiError::bad_request(format!("{k} = {v:?} is not a number from 1 to 65535"))
            })
        };
        for (k, v) in form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
            match &*k {
                "cols" => p.cols = Some(number("cols", &v)?),
                "rows" => p.rows = Some(number("rows", &v)?),
                "cmd" => p.cmd.push(v.into_owned()),
                "env" => p.env.push(v.into_owned()),
                "cwd" => p.cwd = Some(v.into_owned()),
                "user" => p.user = Some(v.into_owned()),
                other => {
                    return Err(ApiError::bad_request(format!(
                        "unknown query parameter {other:?} (known: cols, rows, cmd, env, cwd, user)"
                    )))
                }
            }
        }
        Ok(p)
    }

    fn request(&self) -> Result<(ExecRequest, PtySize), ApiError> {
        if self.cmd.first().is_some_and(String::is_empty) {
            return Err(ApiError::bad_request(
                "cmd's first word (the program) is empty",
            ));
        }
        let mut req = ExecRequest::new(Command::Argv(self.cmd.clone()));
        for kv in &self.env {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| ApiError::bad_request(format!("env {kv:?} is not NAME=value")))?;
            req.env.insert(k.to_owned(), v.to_owned());
        }
        if let Some(problem) = forkd_proto::exec::env_problem(&req.env) {
            return Err(ApiError::bad_request(problem));
        }
        if let Some(cwd) = &self.cwd {
            super::guest_path(cwd)?;
        }
        req.cwd = self.cwd.clone();
        req.user = self.user.clone();
        let size = PtySize {
            cols: self.cols.unwrap_or(80),
            rows: self.rows.unwrap_or(24),
        };
        Ok((req, size))
    }
}

/// A text message from the client.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum PtyClientMessage {
    /// Text typed into the terminal (binary messages carry any bytes).
    Input {
        /// The text.
        data: String,
    },
    /// The terminal's window changed size; the command gets SIGWINCH.
    Resize {
        /// Columns.
        cols: u16,
        /// Rows.
        rows: u16,
    },
}

/// A text message from the daemon.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum PtyServerMessage {
    /// The command runs; first message of every terminal.
    Started {
        /// Its pid in the guest (signals may go to it through the processes API).
        pid: u32,
    },
    /// The command ended; the socket closes after it with reason `exited`.
    Exit {
        /// Its exit code (128 + the signal when a signal ended it).
        exit_code: i32,
        /// The signal that ended it, if one did.
        signal: Option<i32>,
    },
    /// The terminal ended without the command's exit: the socket closes after it.
    Closed {
        /// `paused`, `removed` or `failed`.
        reason: String,
        /// Why, for a person.
        message: String,
    },
}

/// Opens a terminal in the sandbox, as a WebSocket.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/pty", params(("id" = String, Path), PtyParams),
    responses(
        (status = 101, description = "A WebSocket: binary messages are the terminal's bytes both ways; \
            text messages are JSON: PtyClientMessage from the client, PtyServerMessage from the daemon"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn pty(
    State(app): State<App>,
    PathParams(id): PathParams<String>,
    RawQuery(query): RawQuery,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let (req, size) = PtyParams::parse(query.as_deref())?.request()?;
    let sandbox = crate::service::sandbox::running(&app, &id).await?.sandbox;
    let upgrade = upgrade.map_err(|e| {
        ApiError::bad_request(format!(
            "a terminal is a WebSocket: ask with Connection: upgrade and Upgrade: websocket ({e})"
        ))
    })?;
    // The command starts before the upgrade: a bad cwd or user is the request's error.
    let (input, rx) = mpsc::channel(INPUT_QUEUED);
    let mut output = sandbox.exec_on_terminal(req, size, rx).await?;
    let pid = match output.next().await? {
        Some(ExecOutput::Started(pid)) => pid,
        _ => {
            return Err(ApiError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                "sandbox_failed",
                "the agent did not report the terminal's command starting",
            ))
        }
    };
    Ok(upgrade
        .on_upgrade(move |socket| async move {
            // The socket holds the sandbox: an open terminal keeps it from being idle.
            let _held = sandbox;
            serve(socket, pid, output, input).await;
        })
        .into_response())
}

fn text(m: &PtyServerMessage) -> Message {
    Message::Text(serde_json::to_string(m).unwrap_or_default().into())
}

fn close(reason: &'static str) -> Message {
    Message::Close(Some(CloseFrame {
        // 1000: normal; 1001: going away (the sandbox paused or went).
        code: if reason == "exited" { 1000 } else { 1001 },
        reason: reason.into(),
    }))
}

/// Why a terminal ended without its command's exit.
fn ended(e: &SandboxError) -> (&'static str, String) {
    use forkd_core::lifecycle::SandboxState as S;
    let reason = match e {
        SandboxError::NotReady {
            state: S::Paused | S::Pausing,
            ..
        } => "paused",
        SandboxError::Destroyed { .. } => "removed",
        _ => "failed",
    };
    (reason, e.to_string())
}

async fn serve(
    mut socket: WebSocket,
    pid: u32,
    mut output: forkd_core::sandbox::WatchedExec,
    input: mpsc::Sender<TerminalInput>,
) {
    if socket
        .send(text(&PtyServerMessage::Started { pid }))
        .await
        .is_err()
    {
        return;
    }
    loop {
        tokio::select! {
            out = output.next() => {
                let last = match out {
                    Ok(Some(ExecOutput::Stdout(b) | ExecOutput::Stderr(b))) => {
                        if socket.send(Message::Binary(b)).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    Ok(Some(ExecOutput::Started(_))) => continue,
                    Ok(Some(ExecOutput::Exited(s))) => exit(&s),
                    Ok(None) => closed("failed", "the terminal's output ended without an exit status".into()),
                    Err(e) => {
                        let (reason, message) = ended(&e);
                        closed(reason, message)
                    }
                };
                finish(socket, last).await;
                return;
            }
            msg = socket.recv() => {
                let item = match msg {
                    // The client went: dropping the output kills the command.
                    None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return,
                    Some(Ok(Message::Binary(b))) => TerminalInput::Typed(b),
                    Some(Ok(Message::Text(t))) => match serde_json::from_str::<PtyClientMessage>(&t) {
                        Ok(PtyClientMessage::Input { data }) => TerminalInput::Typed(data.into()),
                        Ok(PtyClientMessage::Resize { cols, rows }) => {
                            let size = PtySize { cols, rows };
                            if size.problem().is_some() {
                                continue;
                            }
                            TerminalInput::Resize(size)
                        }
                        Err(e) => {
                            let m = closed("failed", format!("a message the terminal does not understand: {e}"));
                            finish(socket, m).await;
                            return;
                        }
                    },
                    Some(Ok(_)) => continue, // pings are answered by the library
                };
                // The guest takes input as fast as the command reads it.
                if input.send(item).await.is_err() {
                    continue;
                }
            }
        }
    }
}

/// Sends the last messages (the last a close) and waits a moment for the client's close
/// in answer before the connection goes: a client whose socket is shut before it
/// answered may drop what came just before the close.
async fn finish(mut socket: WebSocket, last: [Message; 2]) {
    for m in last {
        if socket.send(m).await.is_err() {
            return;
        }
    }
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while let Some(Ok(m)) = socket.recv().await {
            if matches!(m, Message::Close(_)) {
                return;
            }
        }
    })
    .await;
}

fn exit(s: &ExitStatus) -> [Message; 2] {
    [
        text(&PtyServerMessage::Exit {
            exit_code: s.shell_code(),
            signal: s.signal,
        }),
        close("exited"),
    ]
}

fn closed(reason: &'static str, message: String) -> [Message; 2] {
    [
        text(&PtyServerMessage::Closed {
            reason: reason.into(),
            message,
        }),
        close(reason),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_takes_repeated_words_and_variables() {
        let p = PtyParams::parse(Some(
            "cols=100&rows=30&cmd=bash&cmd=-c&cmd=echo%20hi&env=A%3Db%3Dc&cwd=%2Ftmp",
        ))
        .unwrap();
        let (req, size) = p.request().unwrap();
        assert_eq!(
            size,
            PtySize {
                cols: 100,
                rows: 30
            }
        );
        assert_eq!(
            req.command,
            Command::Argv(vec!["bash".into(), "-c".into(), "echo hi".into()])
        );
        assert_eq!(req.env.get("A").map(String::as_str), Some("b=c"));
        assert_eq!(req.cwd.as_deref(), Some("/tmp"));
        let (req, size) = PtyParams::parse(None).unwrap().request().unwrap();
        assert_eq!(size, PtySize { cols: 80, rows: 24 });
        assert_eq!(req.command, Command::Argv(Vec::new()));
        for bad in [
            "cols=0",
            "rows=x",
            "colour=1",
            "env=NOEQUALS",
            "cwd=rel",
            "cmd=",
        ] {
            let r = PtyParams::parse(Some(bad)).and_then(|p| p.request().map(|_| ()));
            assert!(r.is_err(), "{bad} was taken");
        }
    }
}
