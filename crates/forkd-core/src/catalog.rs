//! The local catalog: one `sandbox.json` per sandbox in its runtime directory, so that a
//! sandbox started by one forkd process can be found, used and stopped by another.
//!
//! A record names the QEMU process by pid *and* start time: a pid alone may have been
//! reused by the time someone reads the record.

use crate::error::SandboxError;
use crate::sandbox::sandboxes_dir;
use forkd_hypervisor::VmConfig;
use forkd_image::Home;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// File name of a record inside a sandbox's directory.
pub const RECORD: &str = "sandbox.json";

/// What the catalog knows about one sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// The sandbox id.
    pub id: String,
    /// The snapshot it was forked from (none for a booted sandbox).
    pub snapshot: Option<String>,
    /// QEMU's pid.
    pub pid: u32,
    /// QEMU's start time, clock ticks since boot.
    pub start_time: u64,
    /// RFC 3339, UTC.
    pub created_at: String,
    /// The VM, as it was started.
    pub config: VmConfig,
}

/// A record and whether its VM still runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    /// The record.
    #[serde(flatten)]
    pub record: Record,
    /// `running`, or `gone` when the QEMU process named by the record has exited.
    pub status: String,
}

impl Record {
    fn path(dir: &Path) -> PathBuf {
        dir.join(RECORD)
    }

    /// Writes the record into the sandbox's directory (atomically: temp file, rename).
    pub fn write(&self) -> Result<(), SandboxError> {
        let path = Record::path(&self.config.dir);
        let tmp = self.config.dir.join(format!(".{RECORD}.tmp"));
        let json = serde_json::to_vec_pretty(self).expect("records serialize");
        std::fs::write(&tmp, json)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|source| SandboxError::Io {
                context: format!("writing {}", path.display()),
                source,
            })
    }

    /// Reads the record of sandbox `id`.
    pub fn read(home: &Home, id: &str) -> Result<Record, SandboxError> {
        if !valid_id(id) {
            return Err(SandboxError::NotFound { id: id.to_owned() });
        }
        let path = Record::path(&sandboxes_dir(home).join(id));
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(SandboxError::NotFound { id: id.to_owned() })
            }
            Err(source) => {
                return Err(SandboxError::Io {
                    context: format!("reading {}", path.display()),
                    source,
                })
            }
        };
        serde_json::from_slice(&bytes).map_err(|e| SandboxError::Io {
            context: format!("reading {}", path.display()),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        })
    }

    /// True while the QEMU process the record names runs.
    pub fn alive(&self) -> bool {
        forkd_host::process::is_alive(self.pid)
            && forkd_host::process::start_time(self.pid) == Some(self.start_time)
    }
}

/// A sandbox id as forkd makes them (`sb-` and hex): anything else cannot name a
/// directory of the catalog, whatever it contains.
pub fn valid_id(id: &str) -> bool {
    id.len() <= 64
        && id.starts_with("sb-")
        && id.len() > 3
        && id[3..].chars().all(|c| c.is_ascii_hexdigit())
}

/// Every sandbox in the catalog, sorted by creation time.
pub fn list(home: &Home) -> Vec<Entry> {
    let Ok(dirs) = std::fs::read_dir(sandboxes_dir(home)) else {
        return Vec::new();
    };
    let mut out: Vec<Entry> = dirs
        .filter_map(Result::ok)
        .filter_map(|d| d.file_name().into_string().ok())
        .filter_map(|id| Record::read(home, &id).ok())
        .map(|record| Entry {
            status: if record.alive() { "running" } else { "gone" }.into(),
            record,
        })
        .collect();
    out.sort_by(|a, b| {
        (&a.record.created_at, &a.record.id).cmp(&(&b.record.created_at, &b.record.id))
    });
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_that_could_escape_are_not_ids() {
        assert!(super::valid_id("sb-0123abcd"));
        for bad in [
            "",
            "sb-",
            "../x",
            "sb-../../etc",
            "sb-12/..",
            "x-12",
            "sb-zz",
        ] {
            assert!(!super::valid_id(bad), "{bad}");
        }
    }
}
