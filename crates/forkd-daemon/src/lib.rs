//! The forkd daemon: one per host. It owns every snapshot and sandbox, keeps what it
//! needs to find them again in SQLite, and serves the REST API (v1) on a unix socket
//! and, when asked, on TCP with a bearer token and TLS.
//!
//! - [`config`]: how it runs, checked before anything starts.
//! - [`import_dirs`]: the host paths a client's recipe may name (none by default).
//! - [`admission`]: what a fork's children really cost, checked against the host's memory.
//! - [`owner`]: the lock that makes a daemon the one owner of its data directory.
//! - [`state`]: the SQLite database (sandboxes, operations).
//! - [`registry`]: the live sandboxes, the capacity limit, operations in memory,
//!   takeover after a restart (one file each under `registry/`).
//! - [`pool`]: warm pools, children prepared ahead of forks.
//! - [`branch`]: BRANCH of a running sandbox, as an operation.
//! - [`service`]: the use cases (fork, branch, delete, egress, timeout), one function
//!   each, which the REST and E2B front doors call.
//! - [`api`]: routes, errors, the OpenAPI document.
//! - [`server`]: listeners, authentication, the audit and metrics middleware.
//! - [`metrics`], [`audit`]: Prometheus metrics and the hash-chained audit log;
//!   [`failed_auth_log`]: failed authentications in it, aggregated.
//! - [`e2b`]: E2B's control plane, envd and code interpreter, for E2B's SDKs.
//! - [`cluster`]: several daemons as one service, coordinated through etcd.
//! - [`client`]: a small HTTP client over the unix socket or TCP (the CLI and the tests).

pub mod admission;
pub mod api;
pub mod audit;
pub mod auth_failures;
pub mod branch;
pub mod client;
pub mod cluster;
pub mod config;
pub mod e2b;
pub mod events;
pub mod failed_auth_log;
pub mod import_dirs;
pub mod metrics;
pub mod owner;
pub mod pool;
pub mod registry;
pub mod resolver;
pub mod server;
pub mod service;
pub mod state;

pub use config::DaemonConfig;

/// Seconds since the Unix epoch.
pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Now, RFC 3339 (UTC, seconds).
pub fn now_rfc3339() -> String {
    forkd_image::timestamp::rfc3339_utc(std::time::SystemTime::now())
}

/// The hypervisor's version string, read once.
pub fn hypervisor_version(hv: &dyn forkd_hypervisor::Hypervisor) -> String {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION
        .get_or_init(|| forkd_core::template::hypervisor_version(hv))
        .clone()
}
