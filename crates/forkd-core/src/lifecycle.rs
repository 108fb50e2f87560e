//! The states a sandbox goes through and the transitions each allows.
//!
//! The owner of a sandbox (the daemon) persists its state before the VM starts and after
//! every change, and checks each change against [`SandboxState::can_become`] first, so a
//! sandbox can never go from `stopping` back to `running`, say. A sandbox ends only when
//! its VM process is gone, its guest halted or panicked, its timeout expired or a user
//! asked: a slow or silent agent makes it `unresponsive`, never ends it.
//!
//! ```text
//!   starting ──▶ running ◀──▶ unresponsive
//!      │          │  ▲ ▲           │
//!      │          │  │ └─ resuming ◀─┐
//!      │          ▼  │       │       │
//!      │         pausing ──▶ paused ─┘   (a failed pause runs on; a failed resume
//!      │            │          │          stays paused)
//!      │            ▼          ▼
//!      ├───────▶ failed ◀──────┤   (from every state but stopping)
//!      ▼            ▼          ▼
//!   stopping ◀──────┴──────────┘   (from every state; then the row is deleted)
//! ```
//!
//! A `paused` sandbox has no VM: its memory, devices and disk are on disk (see
//! [`crate::pause`]) and it holds no running slot.

use serde::{Deserialize, Serialize};

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// Recorded; its VM is being started (or restored) and its agent connected.
    Starting,
    /// Its agent answers.
    Running,
    /// Its VM runs but its agent has not answered for a while (a guest busy on a loaded
    /// host, a stopped VM process). Requests fail with a clear error; the sandbox is
    /// kept, and becomes `running` again when the agent answers.
    Unresponsive,
    /// Being stopped at a user's request or because its timeout passed.
    Stopping,
    /// Its VM exited, its guest halted or panicked, or it never came up.
    Failed,
    /// Its VM is being captured to disk; it stops when the capture is written.
    Pausing,
    /// Its VM is on disk, not running: nothing of it is resident.
    Paused,
    /// Its VM is being restored from disk.
    Resuming,
}

impl SandboxState {
    /// Every state, for tests and metrics.
    pub const ALL: [SandboxState; 8] = [
        SandboxState::Starting,
        SandboxState::Running,
        SandboxState::Unresponsive,
        SandboxState::Stopping,
        SandboxState::Failed,
        SandboxState::Pausing,
        SandboxState::Paused,
        SandboxState::Resuming,
    ];

    /// The state's name, as stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Unresponsive => "unresponsive",
            SandboxState::Stopping => "stopping",
            SandboxState::Failed => "failed",
            SandboxState::Pausing => "pausing",
            SandboxState::Paused => "paused",
            SandboxState::Resuming => "resuming",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<SandboxState> {
        SandboxState::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Whether a sandbox in this state may move to `next`. Staying put is always allowed.
    pub fn can_become(self, next: SandboxState) -> bool {
        use SandboxState::*;
        self == next
            || matches!(
                (self, next),
                (Starting, Running | Failed | Stopping)
                    | (Running, Unresponsive | Failed | Stopping | Pausing)
                    | (Unresponsive, Running | Failed | Stopping)
                    | (Failed, Stopping)
                    | (Pausing, Running | Paused | Failed | Stopping)
                    | (Paused, Resuming | Failed | Stopping)
                    | (Resuming, Running | Paused | Failed | Stopping)
            )
    }

    /// Whether requests are passed to the sandbox's agent.
    pub fn serves_requests(self) -> bool {
        self == SandboxState::Running
    }

    /// Whether a VM may exist for a sandbox in this state (it holds a slot of the
    /// daemon's capacity).
    pub fn holds_a_vm(self) -> bool {
        !matches!(self, SandboxState::Failed | SandboxState::Paused)
    }
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::SandboxState::{self, *};

    #[test]
    fn names_round_trip() {
        for s in SandboxState::ALL {
            assert_eq!(SandboxState::parse(s.as_str()), Some(s));
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.as_str())
            );
        }
        assert_eq!(SandboxState::parse("asleep"), None);
    }

    #[test]
    fn the_allowed_transitions_and_no_others() {
        let allowed = [
            (Starting, Running),
            (Starting, Failed),
            (Starting, Stopping),
            (Running, Unresponsive),
            (Running, Failed),
            (Running, Stopping),
            (Unresponsive, Running),
            (Unresponsive, Failed),
            (Unresponsive, Stopping),
            (Failed, Stopping),
            (Running, Pausing),
            (Pausing, Running),
            (Pausing, Paused),
            (Pausing, Failed),
            (Pausing, Stopping),
            (Paused, Resuming),
            (Paused, Failed),
            (Paused, Stopping),
            (Resuming, Running),
            (Resuming, Paused),
            (Resuming, Failed),
            (Resuming, Stopping),
        ];
        for from in SandboxState::ALL {
            for to in SandboxState::ALL {
                let expected = from == to || allowed.contains(&(from, to));
                assert_eq!(from.can_become(to), expected, "{from} -> {to}");
            }
        }
        // Nothing comes back from stopping, and a failed sandbox never serves again.
        assert!(!Stopping.can_become(Running));
        assert!(!Failed.can_become(Running));
        assert!(Running.serves_requests());
        assert!(!Unresponsive.serves_requests());
        assert!(!Failed.holds_a_vm());
        // A paused sandbox is on disk only, and comes back only through a resume.
        assert!(!Paused.holds_a_vm());
        assert!(!Paused.serves_requests());
        assert!(!Paused.can_become(Running));
    }
}
