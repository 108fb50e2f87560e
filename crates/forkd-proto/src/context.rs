//! Code contexts: persistent interpreters in the guest that keep their state between
//! calls, like notebook kernels.
//!
//! A run's response body is newline-delimited JSON: one [`ContextEvent`] per line, in the
//! order the code produced them, always ending with [`ContextEvent::Done`].

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The interpreter a context runs.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Language {
    /// CPython (`python3` in the guest's `PATH`).
    #[default]
    Python,
}

/// Body of `POST /v1/contexts`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CreateContextRequest {
    /// The interpreter.
    #[serde(default)]
    pub language: Language,
    /// Working directory of the interpreter; `/` by default.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Variables added to the agent's default environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// A context as the agent reports it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ContextInfo {
    /// The context's id (`ctx-N`), unique within the sandbox.
    pub id: String,
    /// Its interpreter.
    pub language: Language,
    /// The interpreter's pid in the guest.
    pub pid: u32,
    /// Cells run since the context started (or was last reset).
    pub execution_count: u64,
    /// The working directory it was created with (`/` when none was given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// Body of `POST /v1/contexts/{id}/run`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RunCodeRequest {
    /// The code: statements, optionally ending with an expression whose value is returned.
    pub code: String,
    /// Interrupt the code (KeyboardInterrupt) after this many milliseconds.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Variables set for this run only (`os.environ`), put back as they were after it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

/// The agent protocol from which a run takes its own variables ([`RunCodeRequest::env`]).
pub const RUN_ENV: u32 = 6;

/// One line of a run's output.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContextEvent {
    /// Text the code wrote to stdout.
    Stdout {
        /// The text.
        text: String,
    },
    /// Text the code wrote to stderr.
    Stderr {
        /// The text.
        text: String,
    },
    /// A value: the last expression of the cell, or a figure the cell left open.
    Result {
        /// `repr()` of the value.
        text: String,
        /// HTML rendering, where the value has one (a pandas DataFrame does).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        html: Option<String>,
        /// PNG image, base64, for a matplotlib figure.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        png: Option<String>,
    },
    /// The code raised an exception.
    Error {
        /// The exception's class name.
        name: String,
        /// `str()` of the exception.
        value: String,
        /// The formatted traceback, starting at the cell's own frames.
        traceback: String,
    },
    /// The run is over; nothing follows.
    Done {
        /// The context's cell counter after this run.
        execution_count: u64,
    },
}

/// Everything one run produced, collected.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Execution {
    /// All stdout text.
    pub stdout: String,
    /// All stderr text.
    pub stderr: String,
    /// Values, in order (the last expression's value, figures).
    pub results: Vec<ExecutionResult>,
    /// The exception, if the code raised one.
    pub error: Option<ExecutionError>,
    /// The context's cell counter after the run.
    pub execution_count: u64,
}

/// One value of an [`Execution`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExecutionResult {
    /// `repr()` of the value.
    pub text: String,
    /// HTML rendering, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub html: Option<String>,
    /// PNG, base64, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub png: Option<String>,
}

/// The exception of an [`Execution`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExecutionError {
    /// Class name.
    pub name: String,
    /// Message.
    pub value: String,
    /// Formatted traceback.
    pub traceback: String,
}

impl Execution {
    /// Adds one event to the collection. Returns true once the run is done.
    pub fn push(&mut self, event: ContextEvent) -> bool {
        match event {
            ContextEvent::Stdout { text } => self.stdout.push_str(&text),
            ContextEvent::Stderr { text } => self.stderr.push_str(&text),
            ContextEvent::Result { text, html, png } => {
                self.results.push(ExecutionResult { text, html, png })
            }
            ContextEvent::Error {
                name,
                value,
                traceback,
            } => {
                self.error = Some(ExecutionError {
                    name,
                    value,
                    traceback,
                })
            }
            ContextEvent::Done { execution_count } => {
                self.execution_count = execution_count;
                return true;
            }
        }
        false
    }

    /// The text of the last value, if the cell produced one.
    pub fn text(&self) -> Option<&str> {
        self.results.last().map(|r| r.text.as_str())
    }
}

/// Body of `POST /v1/resume`, sent by the host to a child restored from a snapshot before
/// it is handed out.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ResumeRequest {
    /// The host's wall clock, nanoseconds since the Unix epoch: the guest's clock is set
    /// to it (the snapshot's clock is the template's, from when it was frozen).
    pub wall_clock_ns: u64,
    /// Fresh random bytes, hex: mixed into the guest kernel's RNG, which is then
    /// reseeded, so that children of one snapshot do not share randomness.
    pub entropy_hex: String,
    /// The child's hostname (its sandbox id).
    pub hostname: String,
    /// Variables the child's commands, background processes and code contexts get on
    /// top of the environment it inherited (its sandbox's own `env`).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Answer only once every context's reseed has run. A warm pool's member is paused
    /// right after its first resume hook: a reseed still running then would hold its
    /// context, and delay the next hook, until the member runs again.
    #[serde(default)]
    pub settle: bool,
    /// The same machine continuing after a pause to disk, not a new child: only its
    /// clock is set (from the host's); its RNG, hostname, variables and contexts are left
    /// as they were (`entropy_hex` may then be empty).
    #[serde(default)]
    pub continuing: bool,
}

/// Answer to `POST /v1/resume`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ResumeResponse {
    /// How far the guest's clock was moved, in milliseconds (positive: forward).
    pub clock_step_ms: i64,
    /// Code contexts whose random generators are reseeded (queued ahead of any code
    /// sent to them later; the answer waits for them only when `settle` was asked).
    pub contexts_reseeded: u32,
}

/// What a greeting that carried a [`ResumeRequest`] answers with (see
/// [`crate::handshake`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ResumeOutcome {
    /// The hook ran.
    Resumed(ResumeResponse),
    /// It did not: what `POST /v1/resume` would have answered.
    Failed(crate::ErrorBody),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_tagged_by_type() {
        let e: ContextEvent =
            serde_json::from_str(r#"{"type":"result","text":"42","html":"<b>42</b>"}"#).unwrap();
        assert_eq!(
            e,
            ContextEvent::Result {
                text: "42".into(),
                html: Some("<b>42</b>".into()),
                png: None
            }
        );
        let j = serde_json::to_string(&ContextEvent::Done { execution_count: 3 }).unwrap();
        assert_eq!(j, r#"{"type":"done","execution_count":3}"#);
    }

    #[test]
    fn executions_collect_until_done() {
        let mut x = Execution::default();
        assert!(!x.push(ContextEvent::Stdout { text: "a".into() }));
        assert!(!x.push(ContextEvent::Stdout { text: "b".into() }));
        assert!(!x.push(ContextEvent::Result {
            text: "1".into(),
            html: None,
            png: None
        }));
        assert!(x.push(ContextEvent::Done { execution_count: 1 }));
        assert_eq!(x.stdout, "ab");
        assert_eq!(x.text(), Some("1"));
        assert_eq!(x.execution_count, 1);
    }
}
