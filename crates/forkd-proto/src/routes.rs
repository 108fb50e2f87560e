//! HTTP/2 routes the agent serves. All are under `/v1`.

/// `GET`: [`crate::PingResponse`].
pub const PING: &str = "/v1/ping";
/// `POST`: run a command in the foreground. The request body is a stream of
/// [`crate::frame`]s: one `Json` frame with an [`crate::exec::ExecRequest`], then `Stdin`
/// frames; the end of the body closes the command's stdin. The response body streams
/// `Stdout`/`Stderr` frames and `Json` frames carrying [`crate::exec::ExecEvent`]s; the
/// last frame is always an `Exited` or `Error` event.
pub const EXEC: &str = "/v1/exec";
/// `POST`: start a background process ([`crate::exec::ExecRequest`] as JSON) →
/// [`crate::exec::ProcessInfo`]; `GET`: list them → `Vec<ProcessInfo>`.
pub const PROCESSES: &str = "/v1/processes";
/// `POST` [`crate::exec::PidSignalRequest`]: a signal to a guest process by pid
/// (protocol 6) → `{}`.
pub const SIGNAL: &str = "/v1/signal";
/// `PUT` (body: raw bytes, streamed) writes a file, answering [`crate::files::FileStat`];
/// `GET` streams a file's bytes. Query: [`crate::files::PathQuery`] /
/// [`crate::files::WriteQuery`].
pub const FILES: &str = "/v1/files";
/// `GET` with [`crate::files::PathQuery`] → `Vec<FileStat>` of a directory's entries.
pub const FILES_LIST: &str = "/v1/files/list";
/// `GET` with [`crate::files::PathQuery`] → [`crate::files::FileStat`].
pub const FILES_STAT: &str = "/v1/files/stat";
/// `POST` [`crate::files::MkdirRequest`] → `FileStat` (creates parents, like `mkdir -p`).
pub const FILES_MKDIR: &str = "/v1/files/mkdir";
/// `POST` [`crate::files::RemoveRequest`] → 204.
pub const FILES_REMOVE: &str = "/v1/files/remove";
/// `POST` [`crate::files::RenameRequest`] → `FileStat` of the new path.
pub const FILES_RENAME: &str = "/v1/files/rename";
/// `GET` ([`crate::files::WatchQuery`]): changes under a directory as NDJSON lines of
/// [`crate::files::WatchEvent`], until the caller hangs up (protocol 6).
pub const FILES_WATCH: &str = "/v1/files/watch";
/// `POST` [`crate::ShutdownRequest`]: sync the disks and stop the guest.
pub const SHUTDOWN: &str = "/v1/shutdown";
/// `POST`: flush every filesystem's dirty data (sync(2)) in the agent's own process;
/// answered once done. What a template build does before the freeze.
pub const SYNC: &str = "/v1/sync";

/// `POST /v1/processes/{id}/wait?timeout_ms=N` → `ProcessInfo` (once it exited, or
/// after the timeout with `exit: null`).
pub fn process_wait(id: u64) -> String {
    format!("{PROCESSES}/{id}/wait")
}

/// `POST /v1/processes/{id}/stdin[?close=true]` (body: raw bytes, at most
/// [`crate::exec::STDIN_WRITE_LIMIT`]) writes to the stdin of a process started with
/// `stdin: true`, then closes it if asked → `ProcessInfo`.
pub fn process_stdin(id: u64) -> String {
    format!("{PROCESSES}/{id}/stdin")
}

/// `POST /v1/processes/{id}/signal` with [`crate::exec::SignalRequest`] → `ProcessInfo`.
pub fn process_signal(id: u64) -> String {
    format!("{PROCESSES}/{id}/signal")
}

/// `GET` → `ProcessInfo`; `DELETE` kills the process (SIGKILL to its process group),
/// reaps it and forgets it → `ProcessInfo`.
pub fn process(id: u64) -> String {
    format!("{PROCESSES}/{id}")
}

/// `POST` [`crate::context::CreateContextRequest`] → [`crate::context::ContextInfo`];
/// `GET` → `Vec<ContextInfo>`.
pub const CONTEXTS: &str = "/v1/contexts";
/// `POST` [`crate::context::ResumeRequest`] → [`crate::context::ResumeResponse`]: the
/// resume hook of a child restored from a snapshot.
pub const RESUME: &str = "/v1/resume";

/// `GET` → `ContextInfo`; `DELETE` ends the interpreter → `ContextInfo`.
pub fn context(id: &str) -> String {
    format!("{CONTEXTS}/{id}")
}

/// `POST` [`crate::context::RunCodeRequest`] → NDJSON stream of
/// [`crate::context::ContextEvent`]s. Runs of one context are queued, one at a time.
pub fn context_run(id: &str) -> String {
    format!("{CONTEXTS}/{id}/run")
}

/// `POST` → `ContextInfo`: restarts the interpreter with empty state.
pub fn context_reset(id: &str) -> String {
    format!("{CONTEXTS}/{id}/reset")
}
