//! Errors of the agent: [`ApiError`] is what a route answers with (an
//! [`forkd_proto::ErrorBody`] and its HTTP status); [`InitError`] is what stops stage 1 or
//! PID 1 set-up.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use forkd_proto::{ErrorBody, ErrorCode, ErrorDetail};
use std::path::PathBuf;

/// An error a route reports to the host.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// Class of the error; it also picks the HTTP status.
    pub code: ErrorCode,
    /// What failed, for the user.
    pub message: String,
}

impl ApiError {
    /// An error of class `code`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
        }
    }

    /// A malformed request.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }

    /// Something that does not exist.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    /// An I/O error on `path`, classified by [`ErrorCode::from_io`]. The message reads
    /// like `no such file or directory: /nope/x` so the user sees the cause and the path.
    pub fn io(err: &std::io::Error, path: &str) -> Self {
        let code = ErrorCode::from_io(err);
        ApiError::new(code, format!("{}: {path}", describe_io(code, err)))
    }

    /// The detail carried in an [`forkd_proto::exec::ExecEvent::Error`].
    pub fn detail(&self) -> ErrorDetail {
        ErrorDetail {
            code: self.code,
            message: self.message.clone(),
        }
    }
}

/// A short lowercase phrase for an I/O error. Rust's own `Display` ("No such file or
/// directory (os error 2)") is fine for logs but clumsy in a message built around a path.
pub fn describe_io(code: ErrorCode, err: &std::io::Error) -> String {
    match code {
        ErrorCode::NotFound => "no such file or directory".into(),
        ErrorCode::AlreadyExists => "already exists".into(),
        ErrorCode::NotADirectory => "not a directory".into(),
        ErrorCode::IsADirectory => "is a directory".into(),
        ErrorCode::DirectoryNotEmpty => "directory not empty".into(),
        ErrorCode::PermissionDenied => "permission denied".into(),
        _ => err.to_string(),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = ErrorBody::new(self.code, self.message);
        (status, axum::Json(body)).into_response()
    }
}

/// A failure while preparing the guest (stage 1 or PID 1 set-up).
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("mounting {what} on {target} failed: {source}")]
    Mount {
        /// What was mounted (a filesystem type or device).
        what: String,
        /// Where.
        target: PathBuf,
        /// The kernel's answer.
        source: nix::Error,
    },
    #[error("{action} {path} failed: {source}")]
    Io {
        /// What was being done ("creating", "copying"...).
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    #[error("{action} failed: {source}")]
    Sys {
        /// The system call and its arguments, in words.
        action: String,
        /// The kernel's answer.
        source: nix::Error,
    },
    #[error(
        "the root device {0} did not appear within 10 s (block devices present: {1}); \
         check forkd.root= on the kernel command line and that the virtio_blk module loaded"
    )]
    NoRootDevice(String, String),
    /// no virtio-serial port named "agent" appeared within 10 s
    #[error(
        "no virtio-serial port named \"{0}\" appeared within 10 s; start QEMU with \
         -device virtio-serial-device -device virtserialport,name={0},... and load virtio_console"
    )]
    NoAgentPort(&'static str),
}
