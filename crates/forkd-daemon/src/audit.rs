//! The audit log: one JSON line per mutating request, appended and fsynced before the
//! next is written. Each record carries the hash of the one before it, so an edited,
//! removed or reordered line breaks the chain, and `forkd audit verify` says where.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The `prev` of the first record.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// One audited request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// RFC 3339 with milliseconds.
    pub time: String,
    /// Who asked: `unix:uid=N` on the socket, `tcp:ADDR` on TCP.
    pub principal: String,
    /// HTTP method.
    pub method: String,
    /// Request path (without the query).
    pub path: String,
    /// Response status.
    pub status: u16,
    /// Sandbox ids and snapshot tags the request named.
    pub ids: Vec<String>,
    /// Microseconds from request to response head (an integer: a float might not
    /// survive a JSON round trip bit for bit, and the hash covers it).
    pub latency_us: u64,
    /// Hash of the previous record.
    pub prev: String,
    /// sha256 of this record's other fields and `prev`.
    pub hash: String,
}

impl Record {
    /// The hash this record must carry.
    fn digest(&self) -> String {
        let mut unsigned = self.clone();
        unsigned.hash = String::new();
        let bytes = serde_json::to_vec(&unsigned).expect("records serialize");
        hex::encode(Sha256::digest(&bytes))
    }
}

/// An audit log error.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// audit log {path}: {source}
    #[error("audit log {path}: {source}")]
    Io {
        /// The log.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// audit log line {line}: {detail}
    #[error("audit log line {line}: {detail}")]
    Broken {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        detail: String,
    },
}

/// The open log.
pub struct AuditLog {
    path: PathBuf,
    /// The file and the hash of the last record written.
    inner: Mutex<(std::fs::File, String)>,
}

impl AuditLog {
    /// Opens (creating) the log at `path`, after checking the chain that is there.
    pub fn open(path: &Path) -> Result<AuditLog, AuditError> {
        let last = match verify(path) {
            Ok((_, last)) => last,
            Err(AuditError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                GENESIS.to_owned()
            }
            Err(e) => return Err(e),
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| AuditError::Io {
                path: path.display().to_string(),
                source,
            })?;
        Ok(AuditLog {
            path: path.to_owned(),
            inner: Mutex::new((file, last)),
        })
    }

    /// Appends a record (filling in `prev` and `hash`) and fsyncs it.
    pub fn append(&self, mut record: Record) -> Result<(), AuditError> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        record.prev = inner.1.clone();
        record.hash = record.digest();
        let mut line = serde_json::to_vec(&record).expect("records serialize");
        line.push(b'\n');
        let io = |source| AuditError::Io {
            path: self.path.display().to_string(),
            source,
        };
        let before = inner.0.metadata().map_err(io)?.len();
        let written = inner.0.write_all(&line).and_then(|()| inner.0.sync_data());
        if let Err(e) = written {
            // A torn or unsynced line would break the chain for every later record:
            // cut the file back to where this record began.
            let _ = inner.0.set_len(before);
            return Err(io(e));
        }
        inner.1 = record.hash;
        Ok(())
    }
}

/// Checks every record's hash and link; returns the number of records and the last hash.
pub fn verify(path: &Path) -> Result<(usize, String), AuditError> {
    let io = |source| AuditError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut prev = GENESIS.to_owned();
    let mut n = 0;
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(io)?;
        let broken = |detail: String| AuditError::Broken {
            line: i + 1,
            detail,
        };
        let r: Record =
            serde_json::from_str(&line).map_err(|e| broken(format!("not a record: {e}")))?;
        if r.prev != prev {
            return Err(broken(format!(
                "links to {} but the record before it has hash {prev} (a record was removed, reordered or edited)",
                r.prev
            )));
        }
        if r.digest() != r.hash {
            return Err(broken(
                "its hash does not match its contents (the line was edited)".into(),
            ));
        }
        prev = r.hash;
        n += 1;
    }
    Ok((n, prev))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(path: &str) -> Record {
        Record {
            time: "2026-01-01T00:00:00.000Z".into(),
            principal: "unix:uid=0".into(),
            method: "POST".into(),
            path: path.into(),
            status: 201,
            ids: vec![],
            latency_us: 1500,
            prev: String::new(),
            hash: String::new(),
        }
    }

    #[test]
    fn the_chain_verifies_survives_reopening_and_breaks_on_edit() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.jsonl");
        let log = AuditLog::open(&p).unwrap();
        log.append(record("/v1/sandboxes")).unwrap();
        log.append(record("/v1/sandboxes/sb-1/exec")).unwrap();
        drop(log);
        let log = AuditLog::open(&p).unwrap();
        log.append(record("/v1/snapshots")).unwrap();
        assert_eq!(verify(&p).unwrap().0, 3);

        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, text.replacen("sb-1", "sb-2", 1)).unwrap();
        let e = verify(&p).unwrap_err().to_string();
        assert!(
            e.starts_with("audit log line 2:") && e.contains("edited"),
            "{e}"
        );
        assert!(
            AuditLog::open(&p).is_err(),
            "a broken log is not appended to"
        );

        let lines: Vec<&str> = text.lines().collect();
        std::fs::write(&p, format!("{}\n{}\n", lines[0], lines[2])).unwrap();
        let e = verify(&p).unwrap_err().to_string();
        assert!(
            e.starts_with("audit log line 2:") && e.contains("removed"),
            "{e}"
        );
    }
}
