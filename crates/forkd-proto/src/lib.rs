//! Wire types shared by the forkd host and the guest agent.
//!
//! The agent channel is a single byte stream (a virtio-serial port in the guest, a unix
//! socket on the host) that is cut at every snapshot and restore. Each time the host
//! connects it performs a [`handshake`], after which both sides speak HTTP/2 over the
//! stream: every agent call is one HTTP/2 request, so many run at once over the one
//! stream. Routes are in [`routes`]; request and response bodies are the JSON types of
//! this crate, except for streamed bodies, which use the [`frame`] codec.
//!
//! Everything here is versioned by [`PROTOCOL_VERSION`]; the host refuses an agent that
//! speaks a version outside [`MIN_PROTOCOL_VERSION`] to [`PROTOCOL_VERSION`].

pub mod context;
pub mod exec;
pub mod files;
pub mod frame;
pub mod handshake;
pub mod image;
pub mod io;
pub mod limits;
pub mod routes;

use serde::{Deserialize, Serialize};

/// Version of the agent protocol. Bump on any change to this crate.
pub const PROTOCOL_VERSION: u32 = 7;

/// The oldest agent protocol this host still speaks: version 5 added the resume hook in
/// the greeting ([`handshake::RESUME_IN_GREETING`]) and version 6 a code run's own
/// variables ([`context::RUN_ENV`]) and version 7 terminals ([`exec::PTY`]), which the
/// host uses only with agents that have them; everything else is as in version 4.
pub const MIN_PROTOCOL_VERSION: u32 = 4;

/// Name of the virtio-serial port the agent listens on (`/sys/class/virtio-ports/*/name`).
pub const AGENT_PORT_NAME: &str = "agent";

/// The version of the agent binary (and of this crate, which is built with it).
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Answer to `GET /v1/ping`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PingResponse {
    /// Version of the forkd-agent binary.
    pub agent_version: String,
    /// Agent protocol version ([`PROTOCOL_VERSION`] of the agent's build).
    pub protocol: u32,
    /// Milliseconds since the guest kernel booted (CLOCK_BOOTTIME).
    pub uptime_ms: u64,
    /// The guest's hostname.
    pub hostname: String,
}

/// Error codes the agent returns in [`ErrorBody`].
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The path or process does not exist.
    NotFound,
    /// The target already exists.
    AlreadyExists,
    /// A path component is not a directory.
    NotADirectory,
    /// The path is a directory where a file was expected.
    IsADirectory,
    /// The directory is not empty (use a recursive remove).
    DirectoryNotEmpty,
    /// The guest refused the operation.
    PermissionDenied,
    /// The request was malformed.
    InvalidArgument,
    /// The program to execute could not be started.
    SpawnFailed,
    /// A background process's stdin is closed, or was not kept open.
    StdinClosed,
    /// An I/O error in the guest.
    Io,
    /// A bug in the agent.
    Internal,
}

impl ErrorCode {
    /// The HTTP status the agent answers with for this code.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::NotFound => 404,
            ErrorCode::AlreadyExists | ErrorCode::DirectoryNotEmpty | ErrorCode::StdinClosed => 409,
            ErrorCode::NotADirectory | ErrorCode::IsADirectory | ErrorCode::InvalidArgument => 400,
            ErrorCode::PermissionDenied => 403,
            ErrorCode::SpawnFailed => 422,
            ErrorCode::Io | ErrorCode::Internal => 500,
        }
    }

    /// Classifies an I/O error from the guest's kernel.
    pub fn from_io(err: &std::io::Error) -> ErrorCode {
        use std::io::ErrorKind as K;
        match err.kind() {
            K::NotFound => ErrorCode::NotFound,
            K::AlreadyExists => ErrorCode::AlreadyExists,
            K::PermissionDenied => ErrorCode::PermissionDenied,
            K::InvalidInput | K::InvalidData => ErrorCode::InvalidArgument,
            _ => match err.raw_os_error() {
                Some(20) => ErrorCode::NotADirectory,     // ENOTDIR
                Some(21) => ErrorCode::IsADirectory,      // EISDIR
                Some(39) => ErrorCode::DirectoryNotEmpty, // ENOTEMPTY
                _ => ErrorCode::Io,
            },
        }
    }
}

/// An error as the agent reports it: `{"error": {"code": ..., "message": ...}}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorBody {
    /// The error itself.
    pub error: ErrorDetail,
}

/// Code and human-readable message of an [`ErrorBody`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorDetail {
    /// Machine-readable class of the error.
    pub code: ErrorCode,
    /// What failed, in words meant for the user.
    pub message: String,
}

impl ErrorBody {
    /// Builds an error body.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                code,
                message: message.into(),
            },
        }
    }
}

/// Body of `POST /v1/shutdown`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ShutdownRequest {
    /// Power off instead of rebooting (with QEMU's `-no-reboot` both end the VM).
    #[serde(default)]
    pub poweroff: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_shape_is_stable() {
        let body = ErrorBody::new(ErrorCode::NotFound, "no such file: /x");
        let json = serde_json::to_string(&body).unwrap();
        assert_eq!(
            json,
            r#"{"error":{"code":"not_found","message":"no such file: /x"}}"#
        );
        let back: ErrorBody = serde_json::from_str(&json).unwrap();
        assert_eq!(back, body);
    }

    #[test]
    fn io_errors_map_to_codes() {
        let e = std::io::Error::from_raw_os_error(39);
        assert_eq!(ErrorCode::from_io(&e), ErrorCode::DirectoryNotEmpty);
        let e = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert_eq!(ErrorCode::from_io(&e), ErrorCode::NotFound);
        assert_eq!(ErrorCode::NotFound.http_status(), 404);
    }
}
