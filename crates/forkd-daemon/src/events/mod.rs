//! Lifecycle events: what happened to each sandbox (created, started, paused, resumed,
//! branched, failed, killed, timed out), when and why.
//!
//! The registry emits them from the use cases themselves, so REST, E2B and MCP requests,
//! the reaper and the daemon's own stop all produce the same events. Each is written to
//! the database first (numbered there, kept for `--events-retention`), then handed to
//! whoever listens: `GET /v1/events` streams ([`crate::api::events`]) and the webhook
//! deliverer ([`webhooks`]). Emitting never waits on a listener: a listener that falls
//! behind reads what it missed from the database.

pub mod webhooks;

use crate::state::{EventRow, SandboxRow, State};
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast;

/// What happened to a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// Recorded by a fork, its VM about to start.
    Created,
    /// Running and answering.
    Started,
    /// Written to disk, its VM ended.
    Paused,
    /// Running again after a pause.
    Resumed,
    /// Captured into a new snapshot (the reason names it).
    Branched,
    /// Its VM died or its resume failed; its files are kept.
    Failed,
    /// Removed on request.
    Killed,
    /// Removed at its deadline.
    TimedOut,
}

impl EventKind {
    /// Every kind.
    pub const ALL: [EventKind; 8] = [
        EventKind::Created,
        EventKind::Started,
        EventKind::Paused,
        EventKind::Resumed,
        EventKind::Branched,
        EventKind::Failed,
        EventKind::Killed,
        EventKind::TimedOut,
    ];

    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Created => "created",
            EventKind::Started => "started",
            EventKind::Paused => "paused",
            EventKind::Resumed => "resumed",
            EventKind::Branched => "branched",
            EventKind::Failed => "failed",
            EventKind::Killed => "killed",
            EventKind::TimedOut => "timed_out",
        }
    }

    /// The kind named `s`.
    pub fn parse(s: &str) -> Option<EventKind> {
        EventKind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// How many events a listener may lag behind before it reads from the database.
const CHANNEL: usize = 1024;

/// Where events are written and announced.
pub struct Events {
    state: Arc<State>,
    tx: broadcast::Sender<EventRow>,
    /// Held across the write and the announcement, so that listeners see events in
    /// their numbers' order.
    order: Mutex<()>,
}

impl Events {
    /// Events written to `state`.
    pub fn new(state: Arc<State>) -> Events {
        let (tx, _) = broadcast::channel(CHANNEL);
        Events {
            state,
            tx,
            order: Mutex::new(()),
        }
    }

    /// Records that `kind` happened to the sandbox of `row`. A failure to record is
    /// logged, never passed on: the operation it describes has happened.
    pub fn emit(&self, kind: EventKind, row: &SandboxRow, reason: Option<&str>) {
        self.emit_all(kind, std::iter::once(row), reason);
    }

    /// [`Events::emit`] for several sandboxes at once (a fork's children), written in
    /// one transaction.
    pub fn emit_all<'a>(
        &self,
        kind: EventKind,
        rows: impl IntoIterator<Item = &'a SandboxRow>,
        reason: Option<&str>,
    ) {
        let at_ms = now_ms();
        let events: Vec<EventRow> = rows
            .into_iter()
            .map(|row| EventRow {
                id: 0,
                at_ms,
                kind: kind.as_str().to_owned(),
                sandbox: row.id.clone(),
                labels: row.labels.clone(),
                reason: reason.map(str::to_owned),
            })
            .collect();
        if events.is_empty() {
            return;
        }
        let _order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        match self.state.insert_events(events) {
            Ok(written) => {
                for e in written {
                    // No listener is no error.
                    let _ = self.tx.send(e);
                }
            }
            Err(e) => tracing::warn!("recording {} events: {e}", kind.as_str()),
        }
    }

    /// Events from now on (those before are in [`Events::after`]).
    pub fn subscribe(&self) -> broadcast::Receiver<EventRow> {
        self.tx.subscribe()
    }

    /// Kept events after number `after`, oldest first, at most `limit`.
    pub fn after(
        &self,
        after: i64,
        limit: usize,
    ) -> Result<Vec<EventRow>, crate::state::StateError> {
        self.state.events_after(after, limit)
    }

    /// Removes events older than `keep`.
    pub fn prune(&self, keep: std::time::Duration) {
        let before = now_ms() - i64::try_from(keep.as_millis()).unwrap_or(i64::MAX / 2);
        match self.state.prune_events(before) {
            Ok(0) => {}
            Ok(n) => tracing::debug!("removed {n} events older than {keep:?}"),
            Err(e) => tracing::warn!("removing old events: {e}"),
        }
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// What a listener asked to see: events of one sandbox, with a label, of some types.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this sandbox's.
    pub sandbox: Option<String>,
    /// Only those whose sandbox had this label (key, value).
    pub label: Option<(String, String)>,
    /// Only these types (empty: all).
    pub types: Vec<EventKind>,
}

impl Filter {
    /// Whether `e` passes.
    pub fn matches(&self, e: &EventRow) -> bool {
        self.sandbox.as_ref().is_none_or(|s| *s == e.sandbox)
            && self
                .label
                .as_ref()
                .is_none_or(|(k, v)| e.labels.get(k) == Some(v))
            && (self.types.is_empty() || self.types.iter().any(|t| t.as_str() == e.kind))
    }
}
