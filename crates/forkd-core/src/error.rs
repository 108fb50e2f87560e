//! Errors of the sandbox layer.

use crate::agent::AgentError;
use forkd_hypervisor::HypervisorError;
use forkd_image::ImageError;

/// A sandbox could not be created, or failed while in use.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Hypervisor(#[from] HypervisorError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("sandbox {id}: the VM exited ({reason}); last console lines:\n{console}")]
    GuestExited {
        /// The sandbox.
        id: String,
        /// How QEMU ended.
        reason: String,
        /// The tail of the guest's serial console.
        console: String,
    },
    #[error("sandbox {id}: the guest agent did not come up within {secs} s; last console lines:\n{console}")]
    BootTimeout {
        /// The sandbox.
        id: String,
        /// The boot timeout.
        secs: u64,
        /// The tail of the guest's serial console.
        console: String,
    },
    /// The agent does not answer; the sandbox is kept.
    #[error(
        "sandbox {id} is unresponsive: its guest agent has not answered a ping within {secs} s \
         (a busy guest or host); the sandbox is kept: retry later, or delete it"
    )]
    Unresponsive {
        /// The sandbox.
        id: String,
        /// The agent timeout.
        secs: f64,
    },
    #[error("sandbox {id} has been destroyed")]
    Destroyed {
        /// The sandbox.
        id: String,
    },
    /// Not enough disk space for the work asked for; nothing was started.
    #[error(transparent)]
    NoSpace(forkd_host::space::NoSpace),
    /// The fork was cancelled; nothing of it is kept.
    #[error("the fork was cancelled; the children it had started were stopped and removed")]
    Cancelled,
    /// The sandbox exists but is not in a state that serves requests.
    #[error("sandbox {id} is {state}: it does not take requests now")]
    NotReady {
        /// The sandbox.
        id: String,
        /// Its state.
        state: crate::lifecycle::SandboxState,
    },
    #[error("sandbox {id} cannot be branched: {detail}")]
    Unbranchable {
        /// The sandbox.
        id: String,
        /// Why.
        detail: String,
    },
    #[error(transparent)]
    Snapshot(#[from] forkd_storage::snapshot::SnapshotError),
    #[error("no sandbox {id} (see `forkd ls`)")]
    NotFound {
        /// The id asked for.
        id: String,
    },
    #[error("sandbox {id} is gone: its VM is no longer running")]
    Gone {
        /// The sandbox.
        id: String,
    },
    /// A pause image that cannot be resumed (missing, damaged, or made against a RAM
    /// file that changed); its files are kept.
    #[error("sandbox {id}: its pause image cannot be resumed: {detail}; its files are kept")]
    PauseImage {
        /// The sandbox.
        id: String,
        /// What is wrong with the image.
        detail: String,
    },
    #[error("template {name}: {detail}")]
    Template {
        /// The template.
        name: String,
        /// What went wrong.
        detail: String,
    },
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl From<forkd_host::space::SpaceError> for SandboxError {
    fn from(e: forkd_host::space::SpaceError) -> Self {
        match e {
            forkd_host::space::SpaceError::NoSpace(n) => SandboxError::NoSpace(n),
            forkd_host::space::SpaceError::Io { context, source } => {
                SandboxError::Io { context, source }
            }
        }
    }
}
