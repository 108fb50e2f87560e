//! Errors as the API reports them: `{"error": {"code", "message"}}` with the HTTP status
//! that says which side must act (4xx: the request; 503: capacity; 500: the daemon).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use forkd_core::SandboxError;
use forkd_storage::snapshot::SnapshotError;
use serde::Serialize;

/// An error response.
#[derive(Debug)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// A stable, machine-readable code.
    pub code: &'static str,
    /// What went wrong and what to do, for a person.
    pub message: String,
}

/// The body of every error response.
#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What an error body says.
#[derive(Debug, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// Stable code: `bad_request`, `unauthorized`, `not_found`, `conflict`, `too_large`,
    /// `result_too_large`, `at_capacity`, `forbidden`, `sandbox_failed`, `internal`.
    pub code: String,
    /// Human-readable explanation.
    pub message: String,
}

impl ApiError {
    /// 400.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 409.
    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, "conflict", message)
    }

    /// 413.
    pub fn too_large(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", message)
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    /// Any status.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_owned(),
                message: self.message,
            },
        };
        let mut r = (self.status, axum::Json(body)).into_response();
        r.extensions_mut()
            .insert(crate::server::ErrorKind(self.code));
        r
    }
}

impl From<SnapshotError> for ApiError {
    fn from(e: SnapshotError) -> ApiError {
        let msg = e.to_string();
        match e {
            SnapshotError::InvalidTag { .. } => ApiError::bad_request(msg),
            SnapshotError::NotFound { .. } => ApiError::not_found(msg),
            SnapshotError::Exists { .. }
            | SnapshotError::InUse { .. }
            | SnapshotError::Damaged { .. }
            | SnapshotError::DigestMismatch { .. } => ApiError::conflict(msg),
            SnapshotError::Io { .. } => ApiError::internal(msg),
        }
    }
}

impl From<SandboxError> for ApiError {
    fn from(e: SandboxError) -> ApiError {
        let msg = e.to_string();
        match e {
            SandboxError::Snapshot(s) => s.into(),
            // Destroyed: deleted (or timed out) while this request was on its way.
            SandboxError::NotFound { .. }
            | SandboxError::Gone { .. }
            | SandboxError::Destroyed { .. } => ApiError::not_found(msg),
            SandboxError::Template { .. } => ApiError::bad_request(msg),
            // An answer past a limit (a code cell's result over 16 MiB): the request asked
            // for more than the API carries; the sandbox is fine and runs on.
            SandboxError::Agent(forkd_core::agent::AgentError::TooLarge { .. }) => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "result_too_large", msg)
            }
            // The guest said what was wrong with the request (a missing file, a bad
            // path, a program the sandbox does not have): the caller's to fix.
            SandboxError::Agent(a) => {
                use forkd_proto::ErrorCode as C;
                match a.code() {
                    Some(C::NotFound) => ApiError::not_found(msg),
                    Some(C::AlreadyExists | C::DirectoryNotEmpty | C::StdinClosed | C::Io) => {
                        ApiError::conflict(msg)
                    }
                    Some(
                        C::NotADirectory | C::IsADirectory | C::InvalidArgument | C::SpawnFailed,
                    ) => ApiError::bad_request(msg),
                    Some(C::PermissionDenied) => {
                        ApiError::new(StatusCode::FORBIDDEN, "forbidden", msg)
                    }
                    Some(C::Internal) | None => {
                        ApiError::new(StatusCode::BAD_GATEWAY, "sandbox_failed", msg)
                    }
                }
            }
            SandboxError::NotReady { .. }
            | SandboxError::Unbranchable { .. }
            | SandboxError::PauseImage { .. } => ApiError::conflict(msg),
            SandboxError::NoSpace(_) => ApiError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "insufficient_storage",
                msg,
            ),
            SandboxError::Unresponsive { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "sandbox_unresponsive", msg)
            }
            SandboxError::GuestExited { .. } | SandboxError::BootTimeout { .. } => {
                ApiError::new(StatusCode::BAD_GATEWAY, "sandbox_failed", msg)
            }
            _ => ApiError::internal(msg),
        }
    }
}

impl From<forkd_storage::oci::ArchiveError> for ApiError {
    fn from(e: forkd_storage::oci::ArchiveError) -> ApiError {
        use forkd_storage::oci::ArchiveError as A;
        match e {
            A::Snapshot(s) => s.into(),
            A::Space(s) => SandboxError::from(s).into(),
            A::Refused(_) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "archive_refused",
                e.to_string(),
            ),
            A::Io { .. } => ApiError::internal(e.to_string()),
        }
    }
}

impl From<forkd_host::space::SpaceError> for ApiError {
    fn from(e: forkd_host::space::SpaceError) -> ApiError {
        SandboxError::from(e).into()
    }
}

impl From<crate::state::StateError> for ApiError {
    fn from(e: crate::state::StateError) -> ApiError {
        if e.is_disk_full() {
            return ApiError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "insufficient_storage",
                format!("{e}; free some space in the data directory"),
            );
        }
        ApiError::internal(e.to_string())
    }
}
