//! The daemon's state in SQLite (WAL): the sandboxes it owns and its long-running
//! operations. Everything needed to find a sandbox again after a restart is here: the
//! QEMU pid and start time, and the VM's configuration (sockets, overlay, memory file).
//!
//! Snapshots are not duplicated here: each is a sealed directory of the store, which is
//! the one source of truth for what exists and whether it is intact.

use forkd_core::lifecycle::SandboxState;
use forkd_hypervisor::VmConfig;
use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

/// Schema migrations, in order. `PRAGMA user_version` records how many have run; a new
/// version of the daemon appends, never edits.
const MIGRATIONS: &[&str] = &[
    // 1: sandboxes and operations.
    "CREATE TABLE sandboxes (
        id          TEXT PRIMARY KEY,
        snapshot    TEXT NOT NULL,
        pid         INTEGER NOT NULL,
        start_time  INTEGER NOT NULL,
        config      TEXT NOT NULL,
        labels      TEXT NOT NULL,
        timeout_at  INTEGER,
        created_at  TEXT NOT NULL
    );
    CREATE INDEX sandboxes_snapshot ON sandboxes(snapshot);
    CREATE TABLE operations (
        id          TEXT PRIMARY KEY,
        kind        TEXT NOT NULL,
        target      TEXT NOT NULL,
        status      TEXT NOT NULL,
        error       TEXT,
        created_at  TEXT NOT NULL,
        finished_at TEXT
    );",
    // 2: a sandbox's lifecycle state (written before its VM starts) and why it failed;
    // progress of long operations.
    "ALTER TABLE sandboxes ADD COLUMN state TEXT NOT NULL DEFAULT 'running';
    ALTER TABLE sandboxes ADD COLUMN error TEXT;
    ALTER TABLE operations ADD COLUMN done INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE operations ADD COLUMN total INTEGER NOT NULL DEFAULT 0;",
    // 3: what an operation produced (a fork: its children and the errors of the others).
    "ALTER TABLE operations ADD COLUMN result TEXT;",
    // 4: warm pools: the size set through the API for a snapshot, and each member (a VM
    // prepared for a fork), recorded before its VM starts so that a restart removes it.
    "CREATE TABLE pool_sizes (
        snapshot    TEXT PRIMARY KEY,
        size        INTEGER NOT NULL
    );
    CREATE TABLE pool_members (
        id          TEXT PRIMARY KEY,
        snapshot    TEXT NOT NULL,
        pid         INTEGER NOT NULL,
        start_time  INTEGER NOT NULL,
        dir         TEXT NOT NULL,
        created_at  TEXT NOT NULL
    );",
    // 5: the head of the audit log's chain, as the daemon last wrote it (see
    // crate::audit): what the log must still hold.
    "CREATE TABLE audit_head (
        id          INTEGER PRIMARY KEY CHECK (id = 1),
        records     INTEGER NOT NULL,
        last_hash   TEXT NOT NULL
    );",
    // 6: what ends a sandbox's deadline and its idleness (a pause or a kill), as JSON
    // (NULL: kill at the deadline, never idle).
    "ALTER TABLE sandboxes ADD COLUMN lifecycle TEXT;",
    // 7: lifecycle events (see crate::events), the webhooks they go to and each
    // delivery's outcome.
    "CREATE TABLE events (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        at_ms       INTEGER NOT NULL,
        type        TEXT NOT NULL,
        sandbox     TEXT NOT NULL,
        labels      TEXT NOT NULL,
        reason      TEXT
    );
    CREATE INDEX events_at ON events (at_ms);
    CREATE TABLE webhooks (
        id          TEXT PRIMARY KEY,
        url         TEXT NOT NULL,
        types       TEXT NOT NULL,
        secret      TEXT NOT NULL,
        created_at  TEXT NOT NULL
    );
    CREATE TABLE deliveries (
        webhook     TEXT NOT NULL,
        event       INTEGER NOT NULL,
        status      TEXT NOT NULL,
        attempts    INTEGER NOT NULL,
        http_status INTEGER,
        error       TEXT,
        at_ms       INTEGER NOT NULL,
        PRIMARY KEY (webhook, event)
    );",
];

/// The schema version that has the audit log's head.
const AUDIT_HEAD_SCHEMA: i64 = 5;

fn read_audit_head(conn: &Connection) -> Result<Option<crate::audit::Anchor>, StateError> {
    use rusqlite::OptionalExtension;
    Ok(conn
        .query_row(
            "SELECT records, last_hash FROM audit_head WHERE id = 1",
            [],
            |r| {
                Ok(crate::audit::Anchor {
                    records: u64::try_from(r.get::<_, i64>(0)?).unwrap_or(0),
                    last: r.get(1)?,
                })
            },
        )
        .optional()?)
}

/// A state database error.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("the state database {path}: {source}")]
    Open {
        /// The database file.
        path: String,
        /// Why.
        source: rusqlite::Error,
    },
    #[error("the state database was written by a newer forkd (schema {found}, this one knows up to {known}); run that version or move the database aside")]
    TooNew {
        /// The database's schema version.
        found: i64,
        /// What this build knows.
        known: usize,
    },
    #[error("state database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("state database: a stored row is not valid: {0}")]
    Row(#[from] serde_json::Error),
    /// A child to be recorded running was not starting (or not recorded at all).
    #[error("sandbox {id} is not starting: it cannot be recorded running")]
    NotStarting {
        /// The sandbox.
        id: String,
    },
    /// A state change the lifecycle does not allow.
    #[error("sandbox {id} cannot go from {from} to {to}")]
    Transition {
        /// The sandbox.
        id: String,
        /// Its state.
        from: SandboxState,
        /// The state asked for.
        to: SandboxState,
    },
}

impl StateError {
    /// True when the database could not be written because its disk is full: nothing
    /// was changed (SQLite rolls the statement back), the caller can say 507.
    pub fn is_disk_full(&self) -> bool {
        matches!(
            self,
            StateError::Sql(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::DiskFull
        )
    }
}

/// One sandbox the daemon owns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRow {
    /// The sandbox id.
    pub id: String,
    /// The snapshot it was forked from.
    pub snapshot: String,
    /// QEMU's pid (0 until the VM runs).
    pub pid: u32,
    /// QEMU's start time (clock ticks since boot): with the pid, names the process.
    pub start_time: u64,
    /// The VM as it was (or is being) started.
    pub config: VmConfig,
    /// Where it is in its life.
    pub state: SandboxState,
    /// Why it failed or became unresponsive.
    pub error: Option<String>,
    /// The caller's labels.
    pub labels: BTreeMap<String, String>,
    /// Unix time (seconds) after which the daemon stops it, if set.
    pub timeout_at: Option<i64>,
    /// RFC 3339.
    pub created_at: String,
    /// What its deadline and its idleness do.
    pub lifecycle: Lifecycle,
}

pub use forkd_storage::snapshot::manifest::OnTimeout;

/// What ends a sandbox's deadline and its idleness.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    /// What its deadline does.
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// Pause it after this many seconds without a request, exec or open stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_pause_after_s: Option<u64>,
    /// The length of its timeout as last asked (at the fork or since): a sandbox paused
    /// by its deadline gets that much again when it resumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
    /// What its deadline's and idleness's pauses keep (E2B's `autoPauseMemory: false`:
    /// the disk only).
    #[serde(
        default,
        skip_serializing_if = "forkd_core::pause::PauseKeeps::is_memory"
    )]
    pub pause_keeps: forkd_core::pause::PauseKeeps,
    /// Resumed only when asked (`POST .../resume`, E2B's connect), not by any request
    /// that needs its VM (E2B's `autoResume: {enabled: false}`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub manual_resume: bool,
}

impl OperationRow {
    /// A new operation of `kind` on `target`, `running` from now, with a fresh id.
    pub fn running(
        kind: &str,
        target: &str,
        total: u64,
        result: Option<serde_json::Value>,
    ) -> OperationRow {
        OperationRow {
            id: format!("op-{}", forkd_host::ids::random_hex(8)),
            kind: kind.into(),
            target: target.into(),
            status: "running".into(),
            error: None,
            created_at: crate::now_rfc3339(),
            finished_at: None,
            done: 0,
            total,
            result,
            steps: Vec::new(),
        }
    }
}

/// One long-running operation (a template build, a fork, a branch).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OperationRow {
    /// The operation id.
    pub id: String,
    /// What it does (`build_snapshot`).
    pub kind: String,
    /// What it works on (a snapshot tag).
    pub target: String,
    /// `running`, `succeeded`, `failed`, or `interrupted` (the daemon stopped under it).
    pub status: String,
    /// Why it failed.
    pub error: Option<String>,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339, once finished.
    pub finished_at: Option<String>,
    /// Steps done (children ready, for a fork).
    pub done: u64,
    /// Steps in all (0 while unknown).
    pub total: u64,
    /// What it produced, once finished (a fork: `{"sandboxes": [ids], "errors": [..]}`).
    #[schema(value_type = Option<Object>)]
    pub result: Option<serde_json::Value>,
    /// While it runs, the steps it has begun, in words, oldest first (a template
    /// build's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<String>,
}

/// The database. Calls are short (single-row reads and writes on a local file), so they
/// run inline under one connection's lock.
pub struct State {
    conn: Mutex<Connection>,
}

impl State {
    /// Opens (creating if needed) the database at `path` and brings its schema up to date.
    pub fn open(path: &Path) -> Result<State, StateError> {
        let open_err = |source| StateError::Open {
            path: path.display().to_string(),
            source,
        };
        let mut conn = Connection::open(path).map_err(open_err)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(open_err)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(open_err)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(open_err)?;
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .map_err(open_err)?;
        // A negative version is no version this code wrote: newer than any it knows.
        let applied = usize::try_from(version).unwrap_or(usize::MAX);
        if applied > MIGRATIONS.len() {
            return Err(StateError::TooNew {
                found: version,
                known: MIGRATIONS.len(),
            });
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(applied) {
            let tx = conn.transaction()?;
            tx.execute_batch(sql)?;
            tx.pragma_update(None, "user_version", i + 1)?;
            tx.commit()?;
        }
        Ok(State {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The audit log's head, if one was recorded.
    pub fn audit_head(&self) -> Result<Option<crate::audit::Anchor>, StateError> {
        read_audit_head(&self.conn())
    }

    /// The audit log's head recorded in the database at `path`, read without changing
    /// it (a running daemon's, for `forkd audit verify`); `None` if none was recorded.
    pub fn audit_head_of(path: &Path) -> Result<Option<crate::audit::Anchor>, StateError> {
        let conn = Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .map_err(|source| StateError::Open {
                path: path.display().to_string(),
                source,
            })?;
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version < AUDIT_HEAD_SCHEMA {
            return Ok(None);
        }
        read_audit_head(&conn)
    }

    /// Records the audit log's head.
    pub fn set_audit_head(&self, head: &crate::audit::Anchor) -> Result<(), StateError> {
        self.conn().execute(
            "INSERT INTO audit_head (id, records, last_hash) VALUES (1, ?1, ?2)
             ON CONFLICT(id) DO UPDATE SET records = ?1, last_hash = ?2",
            rusqlite::params![i64::try_from(head.records).unwrap_or(i64::MAX), head.last],
        )?;
        Ok(())
    }

    /// Records a sandbox.
    pub fn insert_sandbox(&self, row: &SandboxRow) -> Result<(), StateError> {
        self.insert_sandboxes(std::slice::from_ref(row))
    }

    /// Records the children of a fork, all in one transaction. A child that was a warm
    /// pool's member keeps its id: its member row goes in the same transaction.
    pub fn insert_sandboxes(&self, rows: &[SandboxRow]) -> Result<(), StateError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        {
            let mut claim = tx.prepare("DELETE FROM pool_members WHERE id = ?1")?;
            for row in rows {
                claim.execute(params![row.id])?;
            }
            let mut stmt = tx.prepare(
                "INSERT INTO sandboxes (id, snapshot, pid, start_time, config, labels, timeout_at, created_at, state, error, lifecycle)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
            )?;
            for row in rows {
                stmt.execute(params![
                    row.id,
                    row.snapshot,
                    row.pid,
                    row.start_time,
                    serde_json::to_string(&row.config)?,
                    serde_json::to_string(&row.labels)?,
                    row.timeout_at,
                    row.created_at,
                    row.state.as_str(),
                    row.error,
                    serde_json::to_string(&row.lifecycle)?,
                ])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// Records forked children `running` with their VM processes (id, pid, start time),
    /// all in one transaction; each must be `starting`.
    pub fn mark_running(&self, children: &[(String, u32, u64)]) -> Result<(), StateError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        for (id, pid, start_time) in children {
            let changed = tx.execute(
                "UPDATE sandboxes SET state = 'running', pid = ?2, start_time = ?3
                 WHERE id = ?1 AND state = 'starting'",
                params![id, pid, *start_time],
            )?;
            if changed != 1 {
                return Err(StateError::NotStarting { id: id.clone() });
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// Moves a sandbox to `to` (with `error`, and its VM process once known), checked
    /// against the lifecycle in the same transaction as the write. False if there is no
    /// such sandbox.
    pub fn set_state(
        &self,
        id: &str,
        to: SandboxState,
        error: Option<&str>,
        process: Option<(u32, u64)>,
    ) -> Result<bool, StateError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let from: Option<String> = tx
            .query_row(
                "SELECT state FROM sandboxes WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()?;
        let Some(from) = from else {
            return Ok(false);
        };
        let from = SandboxState::parse(&from).ok_or_else(|| bad_state(&from))?;
        if !from.can_become(to) {
            return Err(StateError::Transition {
                id: id.to_owned(),
                from,
                to,
            });
        }
        tx.execute(
            "UPDATE sandboxes SET state = ?2, error = ?3 WHERE id = ?1",
            params![id, to.as_str(), error],
        )?;
        if let Some((pid, start_time)) = process {
            tx.execute(
                "UPDATE sandboxes SET pid = ?2, start_time = ?3 WHERE id = ?1",
                params![id, pid, start_time],
            )?;
        }
        tx.commit()?;
        Ok(true)
    }

    /// Forgets a sandbox; true if there was such a row.
    pub fn delete_sandbox(&self, id: &str) -> Result<bool, StateError> {
        Ok(self
            .conn()
            .execute("DELETE FROM sandboxes WHERE id = ?1", params![id])?
            > 0)
    }

    /// Sets (or clears) a sandbox's deadline; false if there is no such sandbox.
    pub fn set_timeout(&self, id: &str, timeout_at: Option<i64>) -> Result<bool, StateError> {
        Ok(self.conn().execute(
            "UPDATE sandboxes SET timeout_at = ?2 WHERE id = ?1",
            params![id, timeout_at],
        )? > 0)
    }

    /// Replaces what a sandbox's deadline and idleness do.
    pub fn set_lifecycle(&self, id: &str, lifecycle: &Lifecycle) -> Result<bool, StateError> {
        Ok(self.conn().execute(
            "UPDATE sandboxes SET lifecycle = ?2 WHERE id = ?1",
            params![id, serde_json::to_string(lifecycle)?],
        )? > 0)
    }

    /// Replaces a sandbox's launch description (its egress policy changed).
    pub fn set_config(&self, id: &str, config: &VmConfig) -> Result<bool, StateError> {
        Ok(self.conn().execute(
            "UPDATE sandboxes SET config = ?2 WHERE id = ?1",
            params![id, serde_json::to_string(config)?],
        )? > 0)
    }

    /// One sandbox.
    pub fn sandbox(&self, id: &str) -> Result<Option<SandboxRow>, StateError> {
        let conn = self.conn();
        let raw = conn
            .query_row(
                &format!("SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE id = ?1"),
                params![id],
                raw_sandbox,
            )
            .optional()?;
        raw.map(RawSandbox::decode).transpose()
    }

    /// Every sandbox, oldest first.
    pub fn sandboxes(&self) -> Result<Vec<SandboxRow>, StateError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes ORDER BY created_at, id"
        ))?;
        let raws = stmt
            .query_map([], raw_sandbox)?
            .collect::<Result<Vec<_>, _>>()?;
        raws.into_iter().map(RawSandbox::decode).collect()
    }

    /// Sets the warm pool size of the snapshot `tag` (None: back to its recipe's).
    pub fn set_pool_size(&self, tag: &str, size: Option<usize>) -> Result<(), StateError> {
        let conn = self.conn();
        match size {
            Some(n) => conn.execute(
                "INSERT INTO pool_sizes (snapshot, size) VALUES (?1, ?2)
                 ON CONFLICT(snapshot) DO UPDATE SET size = ?2",
                params![tag, n],
            )?,
            None => conn.execute("DELETE FROM pool_sizes WHERE snapshot = ?1", params![tag])?,
        };
        Ok(())
    }

    /// Pool sizes set through the API, by snapshot tag.
    pub fn pool_sizes(&self) -> Result<Vec<(String, usize)>, StateError> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT snapshot, size FROM pool_sizes")?;
        let sizes = stmt
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, usize>(1)?)))?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(sizes)
    }

    /// Records a pool member, before its VM starts (pid 0) or once it runs.
    pub fn put_pool_member(&self, m: &PoolMemberRow) -> Result<(), StateError> {
        self.conn().execute(
            "INSERT INTO pool_members (id, snapshot, pid, start_time, dir, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT(id) DO UPDATE SET pid = ?3, start_time = ?4",
            params![
                m.id,
                m.snapshot,
                m.pid,
                m.start_time,
                m.dir.to_string_lossy(),
                m.created_at
            ],
        )?;
        Ok(())
    }

    /// Forgets a pool member.
    pub fn delete_pool_member(&self, id: &str) -> Result<(), StateError> {
        self.conn()
            .execute("DELETE FROM pool_members WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// Every recorded pool member.
    pub fn pool_members(&self) -> Result<Vec<PoolMemberRow>, StateError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT id, snapshot, pid, start_time, dir, created_at FROM pool_members ORDER BY created_at, id",
        )?;
        let rows = stmt
            .query_map([], |r| {
                Ok(PoolMemberRow {
                    id: r.get(0)?,
                    snapshot: r.get(1)?,
                    pid: r.get(2)?,
                    start_time: r.get::<_, u64>(3)?,
                    dir: r.get::<_, String>(4)?.into(),
                    created_at: r.get(5)?,
                })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// Sandboxes whose deadline is at or before `now` (Unix seconds).
    pub fn expired(&self, now: i64) -> Result<Vec<String>, StateError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT id FROM sandboxes WHERE timeout_at IS NOT NULL AND timeout_at <= ?1",
        )?;
        let ids = stmt
            .query_map(params![now], |r| r.get(0))?
            .collect::<Result<Vec<String>, _>>()?;
        Ok(ids)
    }

    /// Records a new running operation.
    pub fn insert_operation(&self, op: &OperationRow) -> Result<(), StateError> {
        self.conn().execute(
            "INSERT INTO operations (id, kind, target, status, error, created_at, finished_at, done, total, result)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
            params![
                op.id,
                op.kind,
                op.target,
                op.status,
                op.error,
                op.created_at,
                op.finished_at,
                op.done,
                op.total,
                op.result.as_ref().map(|r| r.to_string())
            ],
        )?;
        Ok(())
    }

    /// Marks an operation finished (`status`, with `error` when it failed).
    pub fn finish_operation(
        &self,
        id: &str,
        status: &str,
        error: Option<&str>,
        finished_at: &str,
    ) -> Result<(), StateError> {
        self.conn().execute(
            "UPDATE operations SET status = ?2, error = ?3, finished_at = ?4 WHERE id = ?1",
            params![id, status, error, finished_at],
        )?;
        Ok(())
    }

    /// Sets what an operation has to do in all, once that is known.
    pub fn set_operation_total(&self, id: &str, total: u64) -> Result<(), StateError> {
        self.conn().execute(
            "UPDATE operations SET total = ?2 WHERE id = ?1",
            params![id, total],
        )?;
        Ok(())
    }

    /// Records how an operation ended, in one write: its status and error, its progress
    /// (`done` of `total`: children for a fork) and its result.
    pub fn finish_with_result(&self, id: &str, end: &OperationEnd<'_>) -> Result<(), StateError> {
        self.conn().execute(
            "UPDATE operations SET status = ?2, error = ?3, finished_at = ?4, done = ?5,
                total = ?6, result = ?7
             WHERE id = ?1",
            params![
                id,
                end.status,
                end.error,
                end.finished_at,
                end.done,
                end.total,
                serde_json::to_string(end.result)?
            ],
        )?;
        Ok(())
    }

    /// One operation.
    pub fn operation(&self, id: &str) -> Result<Option<OperationRow>, StateError> {
        Ok(self
            .conn()
            .query_row(
                &format!("SELECT {OPERATION_COLUMNS} FROM operations WHERE id = ?1"),
                params![id],
                operation_row,
            )
            .optional()?)
    }

    /// The latest `limit` operations (of `kind`, if given), newest first.
    pub fn operations(
        &self,
        kind: Option<&str>,
        limit: u32,
    ) -> Result<Vec<OperationRow>, StateError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(&format!(
            "SELECT {OPERATION_COLUMNS} FROM operations
             WHERE ?1 IS NULL OR kind = ?1
             ORDER BY created_at DESC, rowid DESC LIMIT ?2"
        ))?;
        let rows = stmt.query_map(params![kind, limit], operation_row)?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }

    /// The running operation on `target`, if any.
    pub fn running_operation_on(&self, target: &str) -> Result<Option<OperationRow>, StateError> {
        let id: Option<String> = self
            .conn()
            .query_row(
                "SELECT id FROM operations WHERE target = ?1 AND status = 'running' LIMIT 1",
                params![target],
                |r| r.get(0),
            )
            .optional()?;
        match id {
            Some(id) => self.operation(&id),
            None => Ok(None),
        }
    }

    /// Operations left `running` by a daemon that stopped are marked `interrupted`, and
    /// branches `failed` (a branch is never resumed: what it had written is removed);
    /// returns them as they were.
    pub fn interrupt_running_operations(&self, now: &str) -> Result<Vec<Interrupted>, StateError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let ops = {
            let mut stmt =
                tx.prepare("SELECT kind, target, result FROM operations WHERE status = 'running'")?;
            let rows = stmt.query_map([], |r| {
                Ok(Interrupted {
                    kind: r.get(0)?,
                    target: r.get(1)?,
                    result: r
                        .get::<_, Option<String>>(2)?
                        .and_then(|s| serde_json::from_str(&s).ok()),
                })
            })?;
            rows.collect::<Result<Vec<Interrupted>, _>>()?
        };
        tx.execute(
            "UPDATE operations SET status = 'failed', finished_at = ?1,
                 error = 'the daemon stopped during the branch; what it had written was removed'
             WHERE status = 'running' AND kind = 'branch'",
            params![now],
        )?;
        tx.execute(
            "UPDATE operations SET status = 'interrupted', finished_at = ?1,
                 error = 'the daemon stopped while it ran'
             WHERE status = 'running'",
            params![now],
        )?;
        tx.commit()?;
        Ok(ops)
    }
}

/// An operation a stop interrupted.
#[derive(Debug, Clone, PartialEq)]
pub struct Interrupted {
    /// Its kind (`build_snapshot`, `fork`, `branch`).
    pub kind: String,
    /// What it worked on.
    pub target: String,
    /// What it had recorded (a branch: its source).
    pub result: Option<serde_json::Value>,
}

/// How an operation ended (see [`State::finish_fork`]).
#[derive(Debug)]
pub struct OperationEnd<'a> {
    /// `succeeded`, `failed` or `cancelled`.
    pub status: &'a str,
    /// Why it failed.
    pub error: Option<&'a str>,
    /// RFC 3339.
    pub finished_at: &'a str,
    /// Children made.
    pub done: u64,
    /// Children asked for.
    pub total: u64,
    /// What it produced.
    pub result: &'a serde_json::Value,
}

/// A warm pool's member as recorded: enough to find and end its VM after a restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolMemberRow {
    /// Its id (the sandbox id it will have once a fork takes it).
    pub id: String,
    /// The snapshot it was prepared from.
    pub snapshot: String,
    /// Its VM's process (0 until it runs).
    pub pid: u32,
    /// That process's start time.
    pub start_time: u64,
    /// Its runtime directory.
    pub dir: std::path::PathBuf,
    /// RFC 3339.
    pub created_at: String,
}

const OPERATION_COLUMNS: &str =
    "id, kind, target, status, error, created_at, finished_at, done, total, result";

fn operation_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<OperationRow> {
    Ok(OperationRow {
        id: r.get(0)?,
        kind: r.get(1)?,
        target: r.get(2)?,
        status: r.get(3)?,
        error: r.get(4)?,
        created_at: r.get(5)?,
        finished_at: r.get(6)?,
        done: r.get::<_, u64>(7)?,
        total: r.get::<_, u64>(8)?,
        result: r
            .get::<_, Option<String>>(9)?
            .and_then(|t| serde_json::from_str(&t).ok()),
        steps: Vec::new(),
    })
}

const SANDBOX_COLUMNS: &str =
    "id, snapshot, pid, start_time, config, labels, timeout_at, created_at, state, error, lifecycle";

fn bad_state(s: &str) -> StateError {
    StateError::Row(serde::de::Error::custom(format!(
        "unknown sandbox state {s:?}"
    )))
}

/// A row as stored, before its JSON columns are decoded.
struct RawSandbox {
    id: String,
    snapshot: String,
    pid: u32,
    start_time: u64,
    config: String,
    labels: String,
    timeout_at: Option<i64>,
    created_at: String,
    state: String,
    error: Option<String>,
    lifecycle: Option<String>,
}

fn raw_sandbox(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawSandbox> {
    Ok(RawSandbox {
        id: r.get(0)?,
        snapshot: r.get(1)?,
        pid: r.get(2)?,
        start_time: r.get(3)?,
        config: r.get(4)?,
        labels: r.get(5)?,
        timeout_at: r.get(6)?,
        created_at: r.get(7)?,
        state: r.get(8)?,
        error: r.get(9)?,
        lifecycle: r.get(10)?,
    })
}

impl RawSandbox {
    fn decode(self) -> Result<SandboxRow, StateError> {
        Ok(SandboxRow {
            id: self.id,
            snapshot: self.snapshot,
            pid: self.pid,
            start_time: self.start_time,
            config: serde_json::from_str(&self.config)?,
            labels: serde_json::from_str(&self.labels)?,
            timeout_at: self.timeout_at,
            created_at: self.created_at,
            state: SandboxState::parse(&self.state).ok_or_else(|| bad_state(&self.state))?,
            error: self.error,
            lifecycle: match self.lifecycle {
                Some(l) => serde_json::from_str(&l)?,
                None => Lifecycle::default(),
            },
        })
    }
}

mod events;
pub use events::{Delivery, EventRow, WebhookRow};

#[cfg(test)]
mod tests;
