//! The host side of the agent protocol.
//!
//! [`AgentClient::connect`] opens the agent's unix socket, performs the
//! [`forkd_proto::handshake`] and starts an HTTP/2 client over the stream; every call is one
//! HTTP/2 request, so calls run concurrently over the single channel. The client is cheap to
//! clone.

mod contexts;
mod error;
mod exec;
mod files;
mod lines;
mod watch;

pub use contexts::RunStream;
pub use error::AgentError;
pub use exec::{ExecOutput, ExecResult, ExecStream, Stdin, TerminalInput};
pub use files::WriteOptions;
pub use watch::WatchStream;

use bytes::Bytes;
use forkd_proto::context::{ResumeOutcome, ResumeRequest, ResumeResponse};
use forkd_proto::{handshake, ErrorBody, PingResponse, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};
use http::{Method, Request, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// Body type of requests to the agent.
pub type ReqBody = BoxBody<Bytes, std::io::Error>;

/// A connected agent session.
#[derive(Clone)]
pub struct AgentClient {
    sender: hyper::client::conn::http2::SendRequest<ReqBody>,
    /// The protocol the agent answered the handshake with.
    protocol: u32,
    /// Aborts the connection task when the last clone goes.
    _conn: Arc<ConnTask>,
}

struct ConnTask(tokio::task::JoinHandle<()>);

impl Drop for ConnTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Connects to the agent behind `socket`, sends a greeting and waits up to `timeout` for
/// the answer that carries its nonce. Returns the stream, the guest's protocol and the
/// bytes read past the answer (the start of what the guest sent next).
/// What a greeting's answer said: the channel, the agent's protocol, what it carried,
/// and the bytes read past it.
type Greeted = (UnixStream, u32, Option<Vec<u8>>, Vec<u8>);

async fn greet(
    socket: &Path,
    timeout: Duration,
    body: Option<&[u8]>,
) -> Result<Greeted, AgentError> {
    let mut stream = UnixStream::connect(socket)
        .await
        .map_err(|source| AgentError::Connect {
            path: socket.display().to_string(),
            source,
        })?;
    let nonce = forkd_host::ids::random_hex(handshake::NONCE_LEN / 2);
    let greeting = match body {
        Some(body) => handshake::hello_with(&nonce, body),
        None => handshake::hello(&nonce),
    };
    // The greeting is sent once: a guest that already answered it is speaking HTTP/2,
    // and a second greeting would be garbage to it. If no answer comes, the caller
    // reconnects, which gives the guest a clean EOF and a new nonce.
    stream
        .write_all(&greeting)
        .await
        .map_err(|source| AgentError::Io {
            context: "sending the handshake".into(),
            source,
        })?;
    let read_ready = async {
        let mut buf = Vec::with_capacity(256);
        let mut chunk = [0u8; 4096];
        loop {
            let n = stream
                .read(&mut chunk)
                .await
                .map_err(|source| AgentError::Io {
                    context: "reading the handshake".into(),
                    source,
                })?;
            if n == 0 {
                return Err(AgentError::HandshakeClosed);
            }
            buf.extend_from_slice(&chunk[..n]);
            match handshake::find_ready(&buf, &nonce) {
                handshake::ReadyScan::Found {
                    protocol,
                    body,
                    end,
                } => return Ok((protocol, body, buf.split_off(end))),
                handshake::ReadyScan::TooLong { len } => {
                    return Err(AgentError::HandshakeTooLong {
                        len,
                        max: handshake::MAX_BODY,
                    })
                }
                handshake::ReadyScan::Pending => {}
            }
            // Bytes before our answer are leftovers of an older session: drop them,
            // keeping a tail that may hold the start of the answer (with its body).
            if buf.len() > 2 * handshake::MAX_BODY {
                buf.drain(..buf.len() - handshake::MAX_BODY - 256);
            }
        }
    };
    let (protocol, body, leftover) =
        tokio::time::timeout(timeout, read_ready)
            .await
            .map_err(|_| AgentError::HandshakeTimeout {
                secs: timeout.as_secs(),
            })??;
    Ok((stream, protocol, body, leftover))
}

/// The resume request as a greeting's body, unless it is too large for one or holds
/// what a guest would take for the start of a greeting.
fn greeting_body(req: &ResumeRequest) -> Option<Vec<u8>> {
    let body = serde_json::to_vec(req).ok()?;
    let holds_prefix = body
        .windows(handshake::HELLO_PREFIX.len())
        .any(|w| w == handshake::HELLO_PREFIX);
    (body.len() <= handshake::MAX_BODY && !holds_prefix).then_some(body)
}

/// The resume hook's outcome, from the JSON a greeting's answer carried.
fn resume_outcome(answer: &[u8]) -> Result<ResumeResponse, AgentError> {
    match serde_json::from_slice(answer) {
        Ok(ResumeOutcome::Resumed(r)) => Ok(r),
        Ok(ResumeOutcome::Failed(ErrorBody { error })) => Err(AgentError::Agent {
            status: error.code.http_status(),
            code: error.code,
            message: error.message,
        }),
        Err(e) => Err(AgentError::Malformed(format!(
            "the resume hook's outcome in the greeting's answer: {e}"
        ))),
    }
}

/// Makes sure the agent has left every session and answers greetings: greets it on a
/// fresh connection and waits for its answer. The agent then waits for HTTP/2 on that
/// connection; a child restored from this moment greets it anew, which ends that wait at
/// once. Returns the connection, to be kept open until the VM is paused.
pub async fn quiesce(socket: &Path, timeout: Duration) -> Result<UnixStream, AgentError> {
    let (stream, _, _, _) = greet(socket, timeout, None).await?;
    Ok(stream)
}

impl AgentClient {
    /// Connects to the agent behind `socket` and completes the handshake, waiting up to
    /// `timeout` for the guest to answer (a booting guest answers once its agent is up).
    pub async fn connect(socket: &Path, timeout: Duration) -> Result<AgentClient, AgentError> {
        Ok(AgentClient::connect_with(socket, timeout, None).await?.0)
    }

    /// Connects as [`AgentClient::connect`] does; with `resume`, the greeting carries the
    /// resume hook's request and the answer its outcome (an agent of protocol
    /// [`handshake::RESUME_IN_GREETING`] or later: the caller knows its snapshot's). The
    /// outcome is `None` when the request could not ride in the greeting (too large): it
    /// is then the caller's to send.
    pub async fn connect_with(
        socket: &Path,
        timeout: Duration,
        resume: Option<&ResumeRequest>,
    ) -> Result<(AgentClient, Option<ResumeResponse>), AgentError> {
        let body = resume.and_then(greeting_body);
        let (stream, protocol, answer, leftover) = greet(socket, timeout, body.as_deref()).await?;
        if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&protocol) {
            return Err(AgentError::ProtocolMismatch {
                guest: protocol,
                host: PROTOCOL_VERSION,
            });
        }
        let resumed = match (&body, answer) {
            (None, _) => None,
            (Some(_), None) => return Err(AgentError::Malformed(
                "the agent answered a greeting that carried the resume hook without its outcome"
                    .into(),
            )),
            (Some(_), Some(answer)) => Some(resume_outcome(&answer)?),
        };
        let io = TokioIo::new(forkd_proto::io::Rewind::new(leftover, stream));
        let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(4 << 20)
            .initial_connection_window_size(16 << 20)
            .max_frame_size(1 << 20)
            .handshake(io)
            .await?;
        let task = tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("agent connection ended: {e}");
            }
        });
        let client = AgentClient {
            sender,
            protocol,
            _conn: Arc::new(ConnTask(task)),
        };
        Ok((client, resumed))
    }

    /// The protocol version the agent speaks (what it can be asked for).
    pub fn protocol(&self) -> u32 {
        self.protocol
    }

    /// Refuses (as a bad request) what an agent older than `protocol` cannot `do_what`,
    /// rather than sending it a request it would misread or ignore.
    pub(crate) fn needs(&self, protocol: u32, do_what: &str) -> Result<(), AgentError> {
        if self.protocol >= protocol {
            return Ok(());
        }
        Err(AgentError::Agent {
            status: 400,
            code: forkd_proto::ErrorCode::InvalidArgument,
            message: format!(
                "this sandbox's guest agent (protocol {}) cannot {do_what}; rebuild its \
                 template with this forkd",
                self.protocol
            ),
        })
    }

    /// Ends the session for every clone: the connection task stops and the socket
    /// closes, which the guest sees as a hang-up.
    pub fn close(&self) {
        self._conn.0.abort();
    }

    /// True once the underlying connection has closed.
    pub fn is_closed(&self) -> bool {
        self.sender.is_closed()
    }

    /// `GET /v1/ping`.
    pub async fn ping(&self) -> Result<PingResponse, AgentError> {
        self.get_json(forkd_proto::routes::PING).await
    }

    /// Has the guest flush its filesystems (`POST /v1/sync`), answered once done.
    pub async fn sync(&self) -> Result<(), AgentError> {
        let _: serde_json::Value = self
            .post_json(forkd_proto::routes::SYNC, &serde_json::json!({}))
            .await?;
        Ok(())
    }

    /// Asks the guest to sync its disks and stop (`POST /v1/shutdown`).
    pub async fn shutdown(&self, poweroff: bool) -> Result<(), AgentError> {
        let _: serde_json::Value = self
            .post_json(
                forkd_proto::routes::SHUTDOWN,
                &forkd_proto::ShutdownRequest { poweroff },
            )
            .await?;
        Ok(())
    }

    /// Sends one request and returns the response if its status is a success; an error
    /// response is decoded into [`AgentError::Agent`].
    pub(crate) async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        body: ReqBody,
    ) -> Result<hyper::Response<Incoming>, AgentError> {
        let req = Request::builder()
            .method(method)
            .uri(format!("http://agent{path_and_query}"))
            .body(body)
            .map_err(|e| AgentError::Malformed(format!("bad request for {path_and_query}: {e}")))?;
        let mut sender = self.sender.clone();
        sender.ready().await?;
        let resp = sender.send_request(req).await?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let limit = forkd_proto::limits::AGENT_ERROR_BODY_LIMIT;
        let bytes = match Limited::new(resp.into_body(), limit).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) if e.is::<LengthLimitError>() => {
                return Err(AgentError::Malformed(format!(
                    "{status} from {path_and_query} with an error body over {limit} bytes"
                )))
            }
            Err(e) => return Err(AgentError::Http(e.to_string())),
        };
        Err(match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(body) => AgentError::Agent {
                status: status.as_u16(),
                code: body.error.code,
                message: body.error.message,
            },
            Err(_) => AgentError::Malformed(format!(
                "{status} from {path_and_query}: {}",
                String::from_utf8_lossy(&bytes)
            )),
        })
    }

    pub(crate) async fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, AgentError> {
        let resp = self.send(Method::GET, path, empty()).await?;
        read_json(resp).await
    }

    pub(crate) async fn post_json<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, AgentError> {
        let resp = self.send(Method::POST, path, json_body(body)).await?;
        read_json(resp).await
    }

    pub(crate) async fn request_json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
    ) -> Result<T, AgentError> {
        let resp = self.send(method, path, empty()).await?;
        read_json(resp).await
    }
}

/// An empty request body.
pub(crate) fn empty() -> ReqBody {
    Full::new(Bytes::new())
        .map_err(|never| match never {})
        .boxed()
}

/// A JSON request body.
pub(crate) fn json_body<B: Serialize>(body: &B) -> ReqBody {
    let bytes = serde_json::to_vec(body).expect("request types always serialize");
    Full::new(Bytes::from(bytes))
        .map_err(|never| match never {})
        .boxed()
}

async fn read_json<T: DeserializeOwned>(resp: hyper::Response<Incoming>) -> Result<T, AgentError> {
    let status = resp.status();
    let limit = forkd_proto::limits::get().agent_json;
    let bytes = collect_limited(resp.into_body(), limit)
        .await
        .map_err(|e| match e {
            Some(e) => e,
            None => AgentError::TooLarge {
                what: "a JSON answer",
                limit,
                setting: "FORKD_AGENT_JSON_LIMIT",
            },
        })?;
    if status == StatusCode::NO_CONTENT && bytes.is_empty() {
        return serde_json::from_slice(b"null").map_err(|e| AgentError::Malformed(e.to_string()));
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        AgentError::Malformed(format!(
            "{e}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        ))
    })
}

/// The whole body, unless it is longer than `limit` bytes (`Err(None)`: nothing more is
/// read once the limit is passed).
async fn collect_limited(body: Incoming, limit: u64) -> Result<Bytes, Option<AgentError>> {
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    match Limited::new(body, limit).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(None),
        Err(e) => Err(Some(AgentError::Http(e.to_string()))),
    }
}

/// `path?query` with the query urlencoded from `query`.
pub(crate) fn with_query<Q: Serialize>(path: &str, query: &Q) -> String {
    let q = serde_urlencoded::to_string(query).expect("query types always encode");
    if q.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{q}")
    }
}
