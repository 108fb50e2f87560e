//! Bounds on what the host reads from a guest.
//!
//! A guest is untrusted: whatever it prints or answers, the host keeps at most a bounded
//! number of bytes of it in memory or on disk. Every such bound is a field of [`Limits`],
//! with a named default; the daemon and the CLI read overrides from the environment once
//! ([`init`]) and every layer reads them through [`get`].
//!
//! A process-wide value rather than a parameter of every constructor: the limits apply to
//! every VM and agent session of a process alike, and threading them through the sandbox,
//! fork, template and daemon constructors would touch every call site for a value that
//! never differs between them.

use std::sync::OnceLock;

/// Bytes of serial console kept on disk per VM (two files, each up to half of it).
/// 1 MiB holds a full kernel boot log and the last screens of a crash, the console's
/// purpose; a guest printing without pause (~300 KB/s under TCG) cannot grow it further.
pub const DEFAULT_CONSOLE_CAP: u64 = 1 << 20;

/// Largest JSON answer accepted from the agent. The largest legitimate ones are directory
/// listings and process tables: 16 MiB is about 100,000 directory entries.
pub const DEFAULT_AGENT_JSON_LIMIT: u64 = 16 << 20;

/// Largest error body accepted from the agent. Error bodies carry one message; a larger
/// one is not an error report, and it is refused rather than read.
pub const AGENT_ERROR_BODY_LIMIT: usize = 64 << 10;

/// Longest code-context event line accepted from the agent. The driver sends output in
/// small pieces; the largest single events are rich results (a PNG figure, base64) of a
/// few MiB.
pub const DEFAULT_EVENT_LINE_LIMIT: u64 = 16 << 20;

/// Bytes of each warm-up step's stdout and of its stderr kept for the error message when
/// the step fails: the end of a failing build's log, where the cause is, without holding
/// what a verbose step (a package install) prints.
pub const DEFAULT_WARMUP_OUTPUT_CAP: u64 = 16 << 10;

/// The bounds in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Serial console bytes kept on disk per VM (`FORKD_CONSOLE_CAP`).
    pub console_cap: u64,
    /// Largest JSON answer from the agent (`FORKD_AGENT_JSON_LIMIT`).
    pub agent_json: u64,
    /// Longest code-context event line from the agent (`FORKD_EVENT_LINE_LIMIT`).
    pub event_line: u64,
    /// Bytes of each warm-up stream kept for errors (`FORKD_WARMUP_OUTPUT_CAP`).
    pub warmup_output: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            console_cap: DEFAULT_CONSOLE_CAP,
            agent_json: DEFAULT_AGENT_JSON_LIMIT,
            event_line: DEFAULT_EVENT_LINE_LIMIT,
            warmup_output: DEFAULT_WARMUP_OUTPUT_CAP,
        }
    }
}

/// The field of [`Limits`] an environment variable sets.
type Field = fn(&mut Limits) -> &mut u64;

/// The environment variables, with the field each sets and its smallest accepted value.
const VARS: [(&str, Field, u64); 4] = [
    // Two files of at least 2 KiB each: room for a kernel panic's last lines.
    ("FORKD_CONSOLE_CAP", |l| &mut l.console_cap, 4 << 10),
    ("FORKD_AGENT_JSON_LIMIT", |l| &mut l.agent_json, 4 << 10),
    ("FORKD_EVENT_LINE_LIMIT", |l| &mut l.event_line, 4 << 10),
    ("FORKD_WARMUP_OUTPUT_CAP", |l| &mut l.warmup_output, 256),
];

/// A limit set in the environment that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{var}={value:?}: {reason}")]
pub struct LimitError {
    /// The variable.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

impl Limits {
    /// The defaults, overridden by the `FORKD_*` variables that are set.
    pub fn from_env() -> Result<Limits, LimitError> {
        Limits::from_vars(|k| std::env::var(k).ok())
    }

    /// [`Limits::from_env`] over any lookup (for tests).
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Limits, LimitError> {
        let mut limits = Limits::default();
        for (var, field, min) in VARS {
            let Some(value) = lookup(var) else { continue };
            let bad = |reason: String| LimitError {
                var,
                value: value.clone(),
                reason,
            };
            let n = parse_size(&value).map_err(bad)?;
            if n < min {
                return Err(bad(format!("must be at least {min} bytes")));
            }
            *field(&mut limits) = n;
        }
        Ok(limits)
    }
}

/// A byte count: digits with an optional binary suffix (`64K`, `16M`, `1G`, also `KiB`...).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    let shift = match suffix.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        _ => return Err("expected a byte count such as 65536, 64K, 16M or 1G".into()),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| "expected a byte count such as 65536, 64K, 16M or 1G".to_string())?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| "too large".to_string())
}

static LIMITS: OnceLock<Limits> = OnceLock::new();

/// Reads the limits from the environment and fixes them for this process; call it once
/// at start-up so that a bad value is reported before anything runs. Later calls return
/// what the first one fixed.
pub fn init() -> Result<&'static Limits, LimitError> {
    if let Some(l) = LIMITS.get() {
        return Ok(l);
    }
    let l = Limits::from_env()?;
    Ok(LIMITS.get_or_init(|| l))
}

/// The limits in force: those [`init`] fixed, else the environment's, else (a value
/// [`init`] would have refused) the defaults.
pub fn get() -> &'static Limits {
    LIMITS.get_or_init(|| Limits::from_env().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn defaults_unless_set() {
        assert_eq!(Limits::from_vars(vars(&[])).unwrap(), Limits::default());
        let l = Limits::from_vars(vars(&[
            ("FORKD_CONSOLE_CAP", "64K"),
            ("FORKD_WARMUP_OUTPUT_CAP", "4096"),
            ("FORKD_EVENT_LINE_LIMIT", "2MiB"),
        ]))
        .unwrap();
        assert_eq!(l.console_cap, 64 << 10);
        assert_eq!(l.warmup_output, 4096);
        assert_eq!(l.event_line, 2 << 20);
        assert_eq!(l.agent_json, DEFAULT_AGENT_JSON_LIMIT);
    }

    #[test]
    fn bad_values_name_the_variable() {
        let e = Limits::from_vars(vars(&[("FORKD_AGENT_JSON_LIMIT", "lots")]))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("FORKD_AGENT_JSON_LIMIT=\"lots\""), "{e}");
        let e = Limits::from_vars(vars(&[("FORKD_CONSOLE_CAP", "100")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 4096"), "{e}");
        assert!(parse_size("99999999999G").is_err());
        assert_eq!(parse_size("1g"), Ok(1 << 30));
    }
}
