//! The audit log: one JSON line per mutating request, appended and fsynced before the
//! next is written. Each record carries the hash of the one before it, so an edited,
//! removed or reordered line breaks the chain, and `forkd audit verify` says where.
//!
//! The chain is also keyed and anchored, so that a writer of the log who can read
//! neither the key nor the database cannot cover an edit:
//! - each record's `mac` is HMAC-SHA256 of its hash under a key kept in the data
//!   directory (`audit.key`, 0600): a line edited and the chain re-hashed from there on
//!   no longer carries valid marks;
//! - the daemon keeps the chain's head (how many records, the last hash) in its
//!   database after every append: the last records removed, or the file emptied, no
//!   longer reach the head.
//!
//! Records written before the key existed (an older forkd) have no `mac`; once one has,
//! every later one must.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The path of the record each start of the daemon writes, whose ids are the networks
/// it opened to sandboxes (`--egress-open`).
pub const EGRESS_OPEN: &str = "egress-open";

/// The networks the daemon's last start opened to sandboxes, from the log at `path`
/// (`None` if it has no start record).
pub fn last_egress_open(path: &Path) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<Record>(l).ok())
        .find(|r| r.method == "START" && r.path == EGRESS_OPEN)
        .map(|r| r.ids)
}

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
    /// HMAC-SHA256 of `hash` under the log's key (absent in records of an older forkd).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mac: String,
}

impl Record {
    /// A record of now: `principal` did `method` on `path`, naming `ids` (a request,
    /// or something the daemon did or was told at start); status and latency 0 until
    /// set.
    pub fn event(principal: &str, method: &str, path: &str, ids: Vec<String>) -> Record {
        Record {
            time: crate::now_rfc3339(),
            principal: principal.to_owned(),
            method: method.to_owned(),
            path: path.to_owned(),
            status: 0,
            ids,
            latency_us: 0,
            prev: String::new(),
            hash: String::new(),
            mac: String::new(),
        }
    }

    /// The hash this record must carry.
    fn digest(&self) -> String {
        let mut unsigned = self.clone();
        unsigned.hash = String::new();
        unsigned.mac = String::new();
        let bytes = serde_json::to_vec(&unsigned).expect("records serialize");
        hex::encode(Sha256::digest(&bytes))
    }
}

/// An audit log error.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("audit log {path}: {source}")]
    Io {
        /// The log.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    #[error("audit log line {line}: {detail}")]
    Broken {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        detail: String,
    },
}

/// The key the chain is marked with: 32 random bytes, hex in `audit.key`.
#[derive(Clone)]
pub struct AuditKey([u8; 32]);

impl std::fmt::Debug for AuditKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuditKey(..)")
    }
}

impl AuditKey {
    /// The key at `path`, made (0600) if there is none.
    pub fn load_or_create(path: &Path) -> Result<AuditKey, AuditError> {
        if let Some(k) = AuditKey::load(path)? {
            return Ok(k);
        }
        let key: [u8; 32] = rand::random();
        // Written aside and renamed: a stop half way leaves no empty key behind.
        forkd_host::atomic_file::write(path, hex::encode(key).as_bytes()).map_err(|source| {
            AuditError::Io {
                path: path.display().to_string(),
                source,
            }
        })?;
        Ok(AuditKey(key))
    }

    /// The key at `path`, if there is one.
    pub fn load(path: &Path) -> Result<Option<AuditKey>, AuditError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(AuditError::Io {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        let bytes = hex::decode(text.trim())
            .ok()
            .and_then(|b| <[u8; 32]>::try_from(b).ok());
        match bytes {
            Some(b) => Ok(Some(AuditKey(b))),
            None => Err(AuditError::Io {
                path: path.display().to_string(),
                source: std::io::Error::other("not a key: 64 hex digits expected"),
            }),
        }
    }

    fn mac(&self, hash: &str) -> String {
        use hmac::Mac;
        let mut m = hmac::Hmac::<Sha256>::new_from_slice(&self.0).expect("any key length");
        m.update(hash.as_bytes());
        hex::encode(m.finalize().into_bytes())
    }
}

/// The head of the chain as the daemon last wrote it (kept in its database).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Anchor {
    /// Records in the log.
    pub records: u64,
    /// The last record's hash.
    pub last: String,
}

/// What a check of the log found intact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Records in the log.
    pub records: u64,
    /// The last record's hash ([`GENESIS`] for an empty log).
    pub last: String,
    /// Records that carry the key's mark.
    pub keyed: u64,
}

/// Checks every record's hash and link; with `key`, every mark (and that none is
/// missing after the first); with `anchor`, that the log still holds the record the
/// daemon last wrote, at its place.
pub fn verify(
    path: &Path,
    key: Option<&AuditKey>,
    anchor: Option<&Anchor>,
) -> Result<Verified, AuditError> {
    let io = |source| AuditError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut prev = GENESIS.to_owned();
    let (mut n, mut keyed) = (0u64, 0u64);
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
        if let Some(key) = key {
            if r.mac.is_empty() && keyed > 0 {
                return Err(broken(
                    "it has no mark of the log's key, though earlier records have (the line was forged)".into(),
                ));
            }
            if !r.mac.is_empty() && key.mac(&r.hash) != r.mac {
                return Err(broken(
                    "its mark does not match the log's key (the line was edited and the chain hashed again)".into(),
                ));
            }
        }
        keyed += u64::from(!r.mac.is_empty());
        prev = r.hash;
        n += 1;
        if anchor.is_some_and(|a| a.records == n && a.last != prev) {
            return Err(broken(
                "it is not the record the daemon wrote at this place (its database has another hash)".into(),
            ));
        }
    }
    if let Some(a) = anchor.filter(|a| a.records > n) {
        return Err(AuditError::Broken {
            line: usize::try_from(n + 1).unwrap_or(usize::MAX),
            detail: format!(
                "the log ends after {n} records, but the daemon wrote {}: the last {} were removed (or the file was emptied)",
                a.records,
                a.records - n
            ),
        });
    }
    Ok(Verified {
        records: n,
        last: prev,
        keyed,
    })
}

/// Where the head goes after every append (the daemon's database).
pub type AnchorSink = Box<dyn Fn(&Anchor) -> Result<(), String> + Send + Sync>;

/// The open log.
pub struct AuditLog {
    path: PathBuf,
    key: AuditKey,
    sink: AnchorSink,
    /// The file and the head of the chain.
    inner: Mutex<(std::fs::File, Anchor)>,
}

impl AuditLog {
    /// Opens (creating) the log at `path`, after checking the chain that is there
    /// against `key` and `anchor`; each append then hands the new head to `sink`.
    pub fn open(
        path: &Path,
        key: AuditKey,
        anchor: Option<&Anchor>,
        sink: AnchorSink,
    ) -> Result<AuditLog, AuditError> {
        let head = match verify(path, Some(&key), anchor) {
            Ok(v) => Anchor {
                records: v.records,
                last: v.last,
            },
            Err(AuditError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                if let Some(a) = anchor.filter(|a| a.records > 0) {
                    return Err(AuditError::Broken {
                        line: 1,
                        detail: format!(
                            "the log is gone, but the daemon wrote {} records to it",
                            a.records
                        ),
                    });
                }
                Anchor {
                    records: 0,
                    last: GENESIS.to_owned(),
                }
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
        let log = AuditLog {
            path: path.to_owned(),
            key,
            sink,
            inner: Mutex::new((file, head.clone())),
        };
        // A log ahead of its head (a stop between the append and the database's
        // update) is anchored where it ends.
        if anchor != Some(&head) {
            (log.sink)(&head).map_err(|e| AuditError::Io {
                path: path.display().to_string(),
                source: std::io::Error::other(e),
            })?;
        }
        Ok(log)
    }

    /// Moves the broken log at `path` aside (to `<path>.broken-<time>`) and starts a new
    /// chain whose first record says what was `found` and where the old log went.
    pub fn reset(
        path: &Path,
        key: AuditKey,
        found: &str,
        sink: AnchorSink,
    ) -> Result<AuditLog, AuditError> {
        let io = |source| AuditError::Io {
            path: path.display().to_string(),
            source,
        };
        let stamp = crate::now_rfc3339().replace(':', "");
        let aside = (0..)
            .map(|n| {
                let mut p = path.as_os_str().to_owned();
                p.push(format!(".broken-{stamp}"));
                if n > 0 {
                    p.push(format!("-{n}"));
                }
                PathBuf::from(p)
            })
            .find(|p| !p.exists())
            .expect("a free name");
        match std::fs::rename(path, &aside) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
        }
        let log = AuditLog::open(path, key, None, sink)?;
        log.append(Record::event(
            "daemon",
            "AUDIT-RESET",
            "audit.jsonl",
            vec![
                format!("found: {found}"),
                format!("the old log is {}", aside.display()),
            ],
        ))?;
        Ok(log)
    }

    /// Appends a record (filling in `prev`, `hash` and `mac`), fsyncs it, and hands
    /// the new head to the sink. A sink that fails fails the append: the record is in
    /// the file (the next start anchors the log where it ends), but while the head lags
    /// records cut off the end would go unseen, so the caller must not act on it.
    pub fn append(&self, mut record: Record) -> Result<(), AuditError> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        record.prev = inner.1.last.clone();
        record.hash = record.digest();
        record.mac = self.key.mac(&record.hash);
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
        inner.1 = Anchor {
            records: inner.1.records + 1,
            last: record.hash,
        };
        (self.sink)(&inner.1).map_err(|e| AuditError::Io {
            path: self.path.display().to_string(),
            source: std::io::Error::other(format!("recording the log's head: {e}")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

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
            mac: String::new(),
        }
    }

    /// A log with its key and a head kept as the database would keep it.
    struct Fixture {
        _dir: tempfile::TempDir,
        path: PathBuf,
        key: AuditKey,
        head: Arc<Mutex<Option<Anchor>>>,
    }

    impl Fixture {
        fn new() -> Fixture {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("audit.jsonl");
            let key = AuditKey::load_or_create(&dir.path().join("audit.key")).unwrap();
            Fixture {
                _dir: dir,
                path,
                key,
                head: Arc::default(),
            }
        }

        fn open(&self) -> Result<AuditLog, AuditError> {
            let head = self.head.clone();
            let anchor = self.head.lock().unwrap().clone();
            AuditLog::open(
                &self.path,
                self.key.clone(),
                anchor.as_ref(),
                Box::new(move |a| {
                    *head.lock().unwrap() = Some(a.clone());
                    Ok(())
                }),
            )
        }

        fn verify(&self) -> Result<Verified, AuditError> {
            let anchor = self.head.lock().unwrap().clone();
            verify(&self.path, Some(&self.key), anchor.as_ref())
        }

        /// Three records, written over two openings.
        fn written(&self) -> String {
            let log = self.open().unwrap();
            log.append(record("/v1/sandboxes")).unwrap();
            log.append(record("/v1/sandboxes/sb-1/exec")).unwrap();
            drop(log);
            self.open()
                .unwrap()
                .append(record("/v1/snapshots"))
                .unwrap();
            std::fs::read_to_string(&self.path).unwrap()
        }
    }

    /// The log's lines with `line` (0-based) replaced by `r`, and every later record
    /// hashed again onto it, as a writer who knows the format but not the key would.
    fn rehashed(text: &str, line: usize, r: Record) -> String {
        let mut records: Vec<Record> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        // The marks are copied over: the writer cannot make new ones.
        let mac = std::mem::take(&mut records[line].mac);
        records[line] = Record { mac, ..r };
        let mut prev = if line == 0 {
            GENESIS.to_owned()
        } else {
            records[line - 1].hash.clone()
        };
        let mut out = String::new();
        for (i, r) in records.iter_mut().enumerate() {
            if i >= line {
                r.prev = prev.clone();
                r.hash = r.digest();
            }
            prev = r.hash.clone();
            out.push_str(&serde_json::to_string(r).unwrap());
            out.push('\n');
        }
        out
    }

    #[test]
    fn the_chain_verifies_survives_reopening_and_every_tampering_is_found() {
        let f = Fixture::new();
        let text = f.written();
        assert_eq!(
            f.verify().unwrap(),
            Verified {
                records: 3,
                last: f.head.lock().unwrap().clone().unwrap().last,
                keyed: 3
            }
        );
        let lines: Vec<&str> = text.lines().collect();
        let tamperings = [
            ("edited", text.replacen("sb-1", "sb-2", 1), "was edited"),
            (
                "reordered",
                format!("{}\n{}\n{}\n", lines[1], lines[0], lines[2]),
                "removed, reordered or edited",
            ),
            (
                "middle removed",
                format!("{}\n{}\n", lines[0], lines[2]),
                "removed, reordered or edited",
            ),
            (
                "last removed",
                format!("{}\n{}\n", lines[0], lines[1]),
                "the last 1 were removed",
            ),
            ("emptied", String::new(), "the last 3 were removed"),
            (
                "edited and hashed again",
                rehashed(&text, 1, record("/v1/sandboxes/sb-9/exec")),
                "does not match the log's key",
            ),
            (
                "forged without a mark",
                {
                    let mut r = record("/v1/forged");
                    r.prev = serde_json::from_str::<Record>(lines[2]).unwrap().hash;
                    r.hash = r.digest();
                    format!("{text}{}\n", serde_json::to_string(&r).unwrap())
                },
                "no mark of the log's key",
            ),
        ];
        for (what, tampered, says) in tamperings {
            std::fs::write(&f.path, &tampered).unwrap();
            let e = f.verify().unwrap_err().to_string();
            assert!(e.contains(says), "{what}: {e}");
            assert!(f.open().is_err(), "{what}: a broken log is not appended to");
        }
        std::fs::remove_file(&f.path).unwrap();
        assert!(f
            .open()
            .err()
            .unwrap()
            .to_string()
            .contains("the log is gone"));
        std::fs::write(&f.path, &text).unwrap();
        assert_eq!(f.verify().unwrap().records, 3);
    }

    #[test]
    fn a_log_ahead_of_its_head_is_anchored_where_it_ends_and_a_reset_says_what_it_found() {
        let f = Fixture::new();
        f.written();
        // A stop between an append and the database's update.
        let behind = Anchor {
            records: 2,
            last: serde_json::from_str::<Record>(
                std::fs::read_to_string(&f.path)
                    .unwrap()
                    .lines()
                    .nth(1)
                    .unwrap(),
            )
            .unwrap()
            .hash,
        };
        *f.head.lock().unwrap() = Some(behind);
        f.open().unwrap();
        assert_eq!(f.head.lock().unwrap().as_ref().unwrap().records, 3);

        std::fs::write(&f.path, "").unwrap();
        let found = f.open().err().unwrap().to_string();
        let head = f.head.clone();
        let log = AuditLog::reset(
            &f.path,
            f.key.clone(),
            &found,
            Box::new(move |a| {
                *head.lock().unwrap() = Some(a.clone());
                Ok(())
            }),
        )
        .unwrap();
        drop(log);
        let v = f.verify().unwrap();
        assert_eq!(v.records, 1);
        let first: Record =
            serde_json::from_str(std::fs::read_to_string(&f.path).unwrap().trim()).unwrap();
        assert_eq!(first.method, "AUDIT-RESET");
        assert!(
            first.ids[0].contains("the last 3 were removed"),
            "{first:?}"
        );
        let aside: Vec<_> = std::fs::read_dir(f.path.parent().unwrap())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().contains(".broken-"))
            .collect();
        assert_eq!(aside.len(), 1);
    }
}
