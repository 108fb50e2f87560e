//! forkd's sandbox layer: boots a VM through the hypervisor trait, connects to its guest
//! agent and keeps watch over it until it is torn down.
//!
//! - [`agent`]: the host side of the agent protocol (handshake, HTTP/2 client, calls).
//! - [`sandbox`]: one sandbox's lifecycle: [`sandbox::Sandbox::boot`], calls guarded by the
//!   liveness watchdog, [`sandbox::Sandbox::destroy`].

pub mod agent;
pub mod arrival;
pub mod branch;
pub mod claim;
pub mod compact;
pub mod customise;
pub mod error;
pub mod fork;
pub mod lifecycle;
pub mod output_tail;
pub mod pause;
pub mod resume;
pub mod sandbox;
pub mod template;
pub mod watch_queue;

pub use agent::AgentClient;
pub use error::SandboxError;
pub use sandbox::{Sandbox, SandboxOptions, WatchedFiles};
