//! The Connect protocol (connectrpc.com), server side, JSON codec only: what E2B's
//! in-sandbox daemon speaks and its SDKs expect.
//!
//! - Unary calls: `POST /<package>.<Service>/<Method>` with an `application/json` body;
//!   the answer is the message as JSON, or an error as `{"code", "message"}` with the
//!   HTTP status of its code.
//! - Server-streaming calls: the request is one *enveloped* message
//!   (`application/connect+json`); the answer is a stream of envelopes and ends with an
//!   end-of-stream envelope holding `{}` or `{"error": {...}}`. An envelope is one flag
//!   byte (bit 1: end of stream, bit 0: compressed), a 4-byte big-endian length and the
//!   payload.

use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Content type of unary calls.
pub const UNARY_JSON: &str = "application/json";
/// Content type of streaming calls.
pub const STREAM_JSON: &str = "application/connect+json";

/// Flag of the envelope that ends a stream.
const END_STREAM: u8 = 0b10;
/// Flag of a compressed envelope (never sent; refused when received).
const COMPRESSED: u8 = 0b01;

/// Largest request message accepted.
pub const MAX_MESSAGE: usize = 1 << 20;

/// A Connect error code (the protocol's fixed set, snake case on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// The call was cancelled.
    Canceled,
    /// Something unexpected.
    Unknown,
    /// The request is wrong.
    InvalidArgument,
    /// A deadline passed.
    DeadlineExceeded,
    /// What was named does not exist.
    NotFound,
    /// What was to be created exists.
    AlreadyExists,
    /// Not allowed.
    PermissionDenied,
    /// Out of a resource (disk, capacity).
    ResourceExhausted,
    /// The system is not in the state the call needs.
    FailedPrecondition,
    /// Not implemented by this server.
    Unimplemented,
    /// The server failed.
    Internal,
    /// Try again later.
    Unavailable,
    /// No or bad credentials.
    Unauthenticated,
}

impl Code {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status a unary error of this code answers with (Connect's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            // 499: the client closed the request (nginx's, as Connect uses it).
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::REQUEST_TIMEOUT),
            Code::Unknown | Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }

    /// The code that says what an HTTP status of forkd's API says.
    pub fn of_status(s: StatusCode) -> Code {
        match s.as_u16() {
            400 | 413 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            409 => Code::AlreadyExists,
            507 | 429 => Code::ResourceExhausted,
            503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => Code::Internal,
        }
    }
}

/// A Connect error: a code and a message for a person.
#[derive(Debug, Clone)]
pub struct RpcError {
    /// The code.
    pub code: Code,
    /// What went wrong.
    pub message: String,
}

impl RpcError {
    /// An error of `code`.
    pub fn new(code: Code, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }

    /// The error as JSON (`{"code", "message"}`).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }
}

impl From<crate::api::ApiError> for RpcError {
    fn from(e: crate::api::ApiError) -> RpcError {
        RpcError::new(Code::of_status(e.status), e.message)
    }
}

impl From<forkd_core::SandboxError> for RpcError {
    fn from(e: forkd_core::SandboxError) -> RpcError {
        use forkd_proto::ErrorCode as A;
        // The guest's own answer, where it gave one, says exactly what went wrong.
        let code = match &e {
            forkd_core::SandboxError::Agent(a) => match a.code() {
                Some(A::NotFound) => Some(Code::NotFound),
                Some(A::AlreadyExists) => Some(Code::AlreadyExists),
                Some(A::PermissionDenied) => Some(Code::PermissionDenied),
                Some(A::NotADirectory | A::IsADirectory | A::InvalidArgument | A::SpawnFailed) => {
                    Some(Code::InvalidArgument)
                }
                Some(A::DirectoryNotEmpty | A::StdinClosed) => Some(Code::FailedPrecondition),
                _ => None,
            },
            _ => None,
        };
        match code {
            Some(c) => RpcError::new(c, e.to_string()),
            None => crate::api::ApiError::from(e).into(),
        }
    }
}

/// For E2B's plain HTTP routes (`/files`, the interpreter): the status of the code, and
/// 502 for a sandbox that is not there, as envd's proxy answers.
impl From<RpcError> for crate::api::ApiError {
    fn from(e: RpcError) -> crate::api::ApiError {
        let status = match e.code {
            Code::Unavailable => StatusCode::BAD_GATEWAY,
            c => c.http_status(),
        };
        crate::api::ApiError::new(status, e.code.as_str(), e.message)
    }
}

/// A unary error answers with its status and JSON body.
impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        (
            self.code.http_status(),
            [(header::CONTENT_TYPE, UNARY_JSON)],
            self.to_json().to_string(),
        )
            .into_response()
    }
}

/// Decodes a unary request's message.
pub fn unary_request<T: DeserializeOwned>(body: &[u8]) -> Result<T, RpcError> {
    serde_json::from_slice(if body.is_empty() { b"{}" } else { body })
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("the request message: {e}")))
}

/// A unary answer.
pub fn unary_response<T: Serialize>(msg: &T) -> Response {
    (
        [(header::CONTENT_TYPE, UNARY_JSON)],
        serde_json::to_vec(msg).unwrap_or_default(),
    )
        .into_response()
}

/// Runs a unary call and answers its message or its error.
pub async fn unary(
    f: impl std::future::Future<Output = Result<serde_json::Value, RpcError>>,
) -> Response {
    match f.await {
        Ok(v) => unary_response(&v),
        Err(e) => e.into_response(),
    }
}

/// Decodes the one enveloped message of a server-streaming request.
pub fn stream_request<T: DeserializeOwned>(body: &[u8]) -> Result<T, RpcError> {
    let bad = |m: &str| RpcError::new(Code::InvalidArgument, m.to_owned());
    if body.len() < 5 {
        return Err(bad("the request is not an enveloped Connect message"));
    }
    let flags = body[0];
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if flags & COMPRESSED != 0 {
        return Err(RpcError::new(
            Code::Unimplemented,
            "compressed messages are not supported; send them uncompressed",
        ));
    }
    if body.len() != 5 + len {
        return Err(bad("the request envelope's length does not match its body"));
    }
    unary_request(&body[5..])
}

/// One message of a stream, enveloped.
pub fn envelope<T: Serialize>(msg: &T) -> Bytes {
    frame(0, &serde_json::to_vec(msg).unwrap_or_default())
}

/// The envelope that ends a stream, with its error if it failed.
pub fn end_of_stream(error: Option<&RpcError>) -> Bytes {
    let body = match error {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({ "error": e.to_json() }),
    };
    frame(END_STREAM, body.to_string().as_bytes())
}

fn frame(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flags);
    // Connect frames carry at most a message the server limits to far below 4 GiB.
    b.put_u32(u32::try_from(payload.len()).expect("a bounded message"));
    b.put_slice(payload);
    b.freeze()
}

/// A streaming answer whose envelopes come from `envelopes` (the last must be
/// [`end_of_stream`]).
pub fn stream_response(envelopes: impl futures::Stream<Item = Bytes> + Send + 'static) -> Response {
    use futures::StreamExt;
    (
        [(header::CONTENT_TYPE, STREAM_JSON)],
        Body::from_stream(envelopes.map(Ok::<_, std::convert::Infallible>)),
    )
        .into_response()
}

/// A streaming call that failed before its first message: Connect still answers 200,
/// with the error in the end-of-stream envelope.
pub fn stream_error(e: RpcError) -> Response {
    stream_response(futures::stream::once(
        async move { end_of_stream(Some(&e)) },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip() {
        let e = envelope(&serde_json::json!({"a": 1}));
        assert_eq!(e[0], 0);
        assert_eq!(
            u32::from_be_bytes([e[1], e[2], e[3], e[4]]) as usize,
            e.len() - 5
        );
        let v: serde_json::Value = stream_request(&e).unwrap();
        assert_eq!(v["a"], 1);
        let end = end_of_stream(Some(&RpcError::new(Code::NotFound, "gone")));
        assert_eq!(end[0], END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&end[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
    }

    #[test]
    fn bad_envelopes_are_refused() {
        assert!(stream_request::<serde_json::Value>(b"{}").is_err());
        let mut e = envelope(&serde_json::json!({})).to_vec();
        e.push(b' ');
        assert!(stream_request::<serde_json::Value>(&e).is_err());
        e.pop();
        e[0] = COMPRESSED;
        assert_eq!(
            stream_request::<serde_json::Value>(&e).unwrap_err().code,
            Code::Unimplemented
        );
    }
}
