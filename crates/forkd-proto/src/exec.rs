//! Running commands in the guest.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What to run: an argv vector (no shell) or a string for `/bin/sh -c`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Command {
    /// `argv[0]` is looked up in `PATH`.
    Argv(Vec<String>),
    /// Run through `/bin/sh -c`.
    Shell(String),
}

impl Command {
    /// The argv the guest executes.
    pub fn to_argv(&self) -> Vec<String> {
        match self {
            Command::Argv(v) => v.clone(),
            Command::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        }
    }
}

/// A command to run, foreground (`/v1/exec`) or background (`/v1/processes`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExecRequest {
    /// The program and its arguments.
    pub command: Command,
    /// Variables added to (or replacing those of) the agent's default environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; `/` by default.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Kill the command (its whole process group) after this many milliseconds.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Foreground: the request body carries stdin. Background: stdin is a pipe kept open
    /// for [`crate::routes::process_stdin`]. When false stdin is `/dev/null`.
    #[serde(default)]
    pub stdin: bool,
    /// Run as this user of the guest (its uid, gid, `HOME`, `USER` and `LOGNAME`; its
    /// home directory when no `cwd` is given) instead of root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Run on a pseudo-terminal of this size (protocol 7): the command's stdin, stdout
    /// and stderr are the terminal, which is its controlling terminal; its output comes
    /// as `Stdout` frames only, and `Resize` frames of the request change its size. An
    /// empty argv then runs the user's login shell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
}

/// The agent protocol from which a command may run on a terminal ([`ExecRequest::pty`]).
pub const PTY: u32 = 7;

/// A terminal's size in character cells, the payload of a `Resize` frame (as JSON).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct PtySize {
    /// Columns.
    pub cols: u16,
    /// Rows.
    pub rows: u16,
}

impl PtySize {
    /// Why this size cannot be a terminal's (a zero side), or None if it can.
    pub fn problem(&self) -> Option<&'static str> {
        (self.cols == 0 || self.rows == 0)
            .then_some("a terminal needs at least one column and one row")
    }
}

impl ExecRequest {
    /// A request for `command` with no env, cwd, timeout or stdin.
    pub fn new(command: Command) -> Self {
        ExecRequest {
            command,
            env: BTreeMap::new(),
            cwd: None,
            timeout_ms: None,
            stdin: false,
            user: None,
            pty: None,
        }
    }
}

/// Why `env` cannot be a process environment (a name empty or holding `=` or NUL, a
/// value holding NUL), or None if it can. Checked by the host on every request that
/// carries variables, and by the agent on the resume hook, which keeps them.
pub fn env_problem(env: &BTreeMap<String, String>) -> Option<&'static str> {
    let bad_name = |k: &String| k.is_empty() || k.contains('=') || k.contains('\0');
    (env.keys().any(bad_name) || env.values().any(|v| v.contains('\0')))
        .then_some("env keys must be non-empty and hold no '=' or NUL, and values no NUL")
}

/// How a command ended.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExitStatus {
    /// Exit code, when the process exited normally.
    pub code: Option<i32>,
    /// Signal number, when a signal ended it.
    pub signal: Option<i32>,
    /// True when the agent killed it because `timeout_ms` passed.
    pub timed_out: bool,
    /// Wall time from spawn to exit, in milliseconds.
    pub duration_ms: u64,
}

impl ExitStatus {
    /// The exit code a shell would report: the code, or 128 + signal.
    pub fn shell_code(&self) -> i32 {
        match (self.code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => 255,
        }
    }

    /// True for exit code 0 without a timeout.
    pub fn success(&self) -> bool {
        self.code == Some(0) && !self.timed_out
    }
}

/// Events in an exec response stream, carried in `Json` frames.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ExecEvent {
    /// The process was spawned.
    Started {
        /// Its pid in the guest.
        pid: u32,
    },
    /// The process ended; no frame follows.
    Exited(ExitStatus),
    /// The command could not run (or the agent failed); no frame follows.
    Error(crate::ErrorDetail),
}

/// A background process as the agent tracks it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProcessInfo {
    /// The agent's id for it (not the pid: pids are reused).
    pub id: u64,
    /// Its pid in the guest.
    pub pid: u32,
    /// What was run.
    pub argv: Vec<String>,
    /// Milliseconds since the Unix epoch (guest clock) when it started.
    pub started_at_ms: u64,
    /// Set once it has ended.
    pub exit: Option<ExitStatus>,
    /// Whether its stdin is a pipe still open for writes.
    #[serde(default)]
    pub stdin_open: bool,
    /// Output captured so far: the last [`BACKGROUND_OUTPUT_LIMIT`] bytes, exactly as
    /// written (base64 on the wire).
    #[serde(default, rename = "stdout_b64", with = "base64_bytes")]
    pub stdout: Vec<u8>,
    /// Like `stdout`.
    #[serde(default, rename = "stderr_b64", with = "base64_bytes")]
    pub stderr: Vec<u8>,
}

/// Bytes as base64 (RFC 4648, standard alphabet, padded) in JSON.
mod base64_bytes {
    use base64::engine::general_purpose::STANDARD;
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        STANDARD.decode(text).map_err(serde::de::Error::custom)
    }
}

/// How many bytes of a background process's stdout and of its stderr the agent keeps.
pub const BACKGROUND_OUTPUT_LIMIT: usize = 1 << 20;

/// The agent protocol from which signals go by pid ([`crate::routes::SIGNAL`]) and to a
/// process alone ([`SignalRequest::process_only`]).
pub const SIGNALS: u32 = 6;

/// Body of `POST /v1/processes/{id}/signal`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct SignalRequest {
    /// Signal number (e.g. 15 for SIGTERM), sent to the process group.
    pub signal: i32,
    /// To the process alone, not its group (protocol 6; older agents signal the group).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub process_only: bool,
}

/// Body of [`crate::routes::SIGNAL`] (protocol 6): a signal to any process of the guest
/// but the agent, by its pid (the foreground commands' pids come in their `Started`
/// event).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct PidSignalRequest {
    /// The process.
    pub pid: u32,
    /// Signal number.
    pub signal: i32,
    /// To its process group rather than to it alone.
    #[serde(default)]
    pub group: bool,
}

/// Query of `POST /v1/processes/{id}/stdin`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct StdinQuery {
    /// Close the process's stdin after writing the body (end of file for its reads).
    #[serde(default)]
    pub close: bool,
}

/// The most bytes one `POST /v1/processes/{id}/stdin` may carry.
pub const STDIN_WRITE_LIMIT: usize = 1 << 20;

/// Query of `POST /v1/processes/{id}/wait`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct WaitQuery {
    /// Give up waiting after this many milliseconds (the process keeps running).
    pub timeout_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_request_round_trips() {
        let mut r = ExecRequest::new(Command::Shell("echo hi".into()));
        r.env.insert("A".into(), "b".into());
        r.timeout_ms = Some(5);
        let j = serde_json::to_string(&r).unwrap();
        assert!(j.contains(r#""command":{"shell":"echo hi"}"#), "{j}");
        assert_eq!(serde_json::from_str::<ExecRequest>(&j).unwrap(), r);
        let minimal: ExecRequest = serde_json::from_str(r#"{"command":{"argv":["ls"]}}"#).unwrap();
        assert_eq!(minimal, ExecRequest::new(Command::Argv(vec!["ls".into()])));
    }

    #[test]
    fn env_names_and_values_are_checked() {
        let env = |k: &str, v: &str| BTreeMap::from([(k.to_owned(), v.to_owned())]);
        assert!(env_problem(&env("A_1", "x=y z")).is_none());
        for (k, v) in [("", "x"), ("A=B", "x"), ("A\0", "x"), ("A", "x\0")] {
            assert!(env_problem(&env(k, v)).is_some(), "{k:?}={v:?}");
        }
    }

    #[test]
    fn exit_codes() {
        let s = ExitStatus {
            code: None,
            signal: Some(9),
            timed_out: true,
            duration_ms: 1,
        };
        assert_eq!(s.shell_code(), 137);
        assert!(!s.success());
        let e = ExecEvent::Exited(s);
        let j = serde_json::to_string(&e).unwrap();
        assert!(j.starts_with(r#"{"event":"exited""#), "{j}");
        assert_eq!(serde_json::from_str::<ExecEvent>(&j).unwrap(), e);
    }
}
