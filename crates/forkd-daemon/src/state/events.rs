//! The database's side of lifecycle events and webhooks (see [`crate::events`]).

use super::{State, StateError};
use rusqlite::params;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One lifecycle event as it is kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EventRow {
    /// Its number: increasing, never reused (the SSE `id`, for `Last-Event-ID`).
    pub id: i64,
    /// When it happened, milliseconds since the Unix epoch.
    pub at_ms: i64,
    /// What happened: `created`, `started`, `paused`, `resumed`, `branched`, `failed`,
    /// `killed` or `timed_out`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The sandbox.
    pub sandbox: String,
    /// Its labels when it happened.
    pub labels: BTreeMap<String, String>,
    /// Why, when there is more to say (a failure's error, a branch's snapshot).
    pub reason: Option<String>,
}

/// A registered webhook.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WebhookRow {
    /// Its id.
    pub id: String,
    /// Where events are POSTed.
    pub url: String,
    /// The event types it gets (empty: all).
    pub types: Vec<String>,
    /// The key of its deliveries' signatures (never shown again after registration).
    #[serde(skip_serializing)]
    pub secret: String,
    /// When it was registered (RFC 3339).
    pub created_at: String,
}

/// How one event's delivery to one webhook went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Delivery {
    /// The event.
    pub event: i64,
    /// `delivered`, `retrying` or `failed` (given up).
    pub status: String,
    /// Attempts so far.
    pub attempts: u32,
    /// The receiver's last HTTP status, if it answered.
    pub http_status: Option<u16>,
    /// The last error, if any.
    pub error: Option<String>,
    /// When this was last updated, milliseconds since the Unix epoch.
    pub at_ms: i64,
}

fn event_row(
    r: &rusqlite::Row<'_>,
) -> rusqlite::Result<(i64, i64, String, String, String, Option<String>)> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
    ))
}

impl State {
    /// Records events (their `id`s are ignored) in one transaction: a fork of N children
    /// writes its N events with one sync, not N. Returns them with their numbers.
    pub fn insert_events(&self, events: Vec<EventRow>) -> Result<Vec<EventRow>, StateError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let mut out = Vec::with_capacity(events.len());
        for mut e in events {
            tx.execute(
                "INSERT INTO events (at_ms, type, sandbox, labels, reason) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![e.at_ms, e.kind, e.sandbox, serde_json::to_string(&e.labels)?, e.reason],
            )?;
            e.id = tx.last_insert_rowid();
            out.push(e);
        }
        tx.commit()?;
        Ok(out)
    }

    /// Events after number `after`, oldest first, at most `limit`.
    pub fn events_after(&self, after: i64, limit: usize) -> Result<Vec<EventRow>, StateError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT id, at_ms, type, sandbox, labels, reason FROM events WHERE id > ?1 ORDER BY id LIMIT ?2",
        )?;
        let rows = stmt
            .query_map(
                params![after, i64::try_from(limit).unwrap_or(i64::MAX)],
                event_row,
            )?
            .collect::<Result<Vec<_>, _>>()?;
        rows.into_iter()
            .map(|(id, at_ms, kind, sandbox, labels, reason)| {
                Ok(EventRow {
                    id,
                    at_ms,
                    kind,
                    sandbox,
                    labels: serde_json::from_str(&labels)?,
                    reason,
                })
            })
            .collect()
    }

    /// Removes events older than `before_ms` (and their deliveries); returns how many.
    pub fn prune_events(&self, before_ms: i64) -> Result<usize, StateError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        tx.execute(
            "DELETE FROM deliveries WHERE event IN (SELECT id FROM events WHERE at_ms < ?1)",
            params![before_ms],
        )?;
        let n = tx.execute("DELETE FROM events WHERE at_ms < ?1", params![before_ms])?;
        tx.commit()?;
        Ok(n)
    }

    /// Registers a webhook.
    pub fn insert_webhook(&self, w: &WebhookRow) -> Result<(), StateError> {
        self.conn().execute(
            "INSERT INTO webhooks (id, url, types, secret, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                w.id,
                w.url,
                serde_json::to_string(&w.types)?,
                w.secret,
                w.created_at
            ],
        )?;
        Ok(())
    }

    /// Every registered webhook, oldest first.
    pub fn webhooks(&self) -> Result<Vec<WebhookRow>, StateError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT id, url, types, secret, created_at FROM webhooks ORDER BY created_at, id",
        )?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get::<_, String>(2)?,
                    r.get(3)?,
                    r.get(4)?,
                ))
            })?
            .collect::<Result<Vec<(String, String, String, String, String)>, _>>()?;
        rows.into_iter()
            .map(|(id, url, types, secret, created_at)| {
                Ok(WebhookRow {
                    id,
                    url,
                    types: serde_json::from_str(&types)?,
                    secret,
                    created_at,
                })
            })
            .collect()
    }

    /// Removes a webhook and its deliveries; false if there was none.
    pub fn delete_webhook(&self, id: &str) -> Result<bool, StateError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        tx.execute("DELETE FROM deliveries WHERE webhook = ?1", params![id])?;
        let n = tx.execute("DELETE FROM webhooks WHERE id = ?1", params![id])?;
        tx.commit()?;
        Ok(n > 0)
    }

    /// Records how an event's delivery to a webhook went so far.
    pub fn record_delivery(&self, webhook: &str, d: &Delivery) -> Result<(), StateError> {
        self.conn().execute(
            "INSERT INTO deliveries (webhook, event, status, attempts, http_status, error, at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT (webhook, event) DO UPDATE SET status = ?3, attempts = ?4,
                 http_status = ?5, error = ?6, at_ms = ?7",
            params![
                webhook,
                d.event,
                d.status,
                d.attempts,
                d.http_status,
                d.error,
                d.at_ms
            ],
        )?;
        Ok(())
    }

    /// A webhook's last `limit` deliveries, newest first.
    pub fn deliveries(&self, webhook: &str, limit: usize) -> Result<Vec<Delivery>, StateError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT event, status, attempts, http_status, error, at_ms FROM deliveries
             WHERE webhook = ?1 ORDER BY event DESC LIMIT ?2",
        )?;
        let rows = stmt
            .query_map(
                params![webhook, i64::try_from(limit).unwrap_or(i64::MAX)],
                |r| {
                    Ok(Delivery {
                        event: r.get(0)?,
                        status: r.get(1)?,
                        attempts: r.get(2)?,
                        http_status: r.get(3)?,
                        error: r.get(4)?,
                        at_ms: r.get(5)?,
                    })
                },
            )?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }
}
