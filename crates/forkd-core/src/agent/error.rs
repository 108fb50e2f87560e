//! Errors talking to the guest agent.

use forkd_proto::ErrorCode;

/// A call to the guest agent failed.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot connect to the agent socket {path}: {source}")]
    Connect {
        /// The socket.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    #[error("the guest agent did not answer the handshake within {secs} s")]
    HandshakeTimeout {
        /// How long we waited.
        secs: u64,
    },
    #[error("the agent channel closed during the handshake (the VM probably exited)")]
    HandshakeClosed,
    #[error(
        "the guest agent's handshake answer claims a body of {len} bytes, more than the {max} \
         a guest may send"
    )]
    HandshakeTooLong {
        /// The length it claimed.
        len: usize,
        /// The most allowed.
        max: usize,
    },
    #[error(
        "the guest agent speaks protocol {guest}, this host speaks {host}: rebuild the guest \
         assets (forkd image build --force)"
    )]
    ProtocolMismatch {
        /// The guest's version.
        guest: u32,
        /// Ours.
        host: u32,
    },
    #[error("agent connection failed: {0}")]
    Http(String),
    #[error("{message}")]
    Agent {
        /// HTTP status.
        status: u16,
        /// Error class.
        code: ErrorCode,
        /// The agent's message.
        message: String,
    },
    #[error("malformed answer from the agent: {0}")]
    Malformed(String),
    #[error(
        "{what} from the agent is larger than {limit} bytes; refused unread (set {setting} to \
         raise the limit if this is expected)"
    )]
    TooLarge {
        /// What was being read.
        what: &'static str,
        /// The limit it exceeded.
        limit: u64,
        /// The setting that raises the limit.
        setting: &'static str,
    },
    #[error("the agent did not answer within {secs} s")]
    Timeout {
        /// How long we waited.
        secs: u64,
    },
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl AgentError {
    /// The agent's error code, when the agent itself refused the call.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            AgentError::Agent { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl From<hyper::Error> for AgentError {
    fn from(e: hyper::Error) -> Self {
        AgentError::Http(e.to_string())
    }
}
