//! What the cluster keeps in etcd, and under which keys. etcd holds only who is there
//! and who owns what; each host's own database stays the one record of its sandboxes.
//!
//! ```text
//! /forkd/hosts/NAME    HostRecord  a host as it registered; kept when its lease lapses,
//!                                  so that the cluster shows it unreachable, not gone
//! /forkd/alive/NAME    HostLive    under the host's lease: present while it lives,
//!                                  refreshed with its free slots, memory and snapshots
//! /forkd/sandboxes/ID  OwnerRecord which host owns the sandbox (claimed in a transaction
//!                                  that fails if any host holds the id)
//! /forkd/owned/NAME/ID OwnerRecord the same, indexed by host: what it claimed
//! /forkd/snapshots/TAG TagRecord   the digest of the snapshot the tag names in the
//!                                  cluster (claimed in a transaction that fails if
//!                                  the tag names another)
//! /forkd/parked/ID     OwnerRecord a paused sandbox moved off its host (its record in
//!                                  /forkd/sandboxes/ID says where it waits), until a
//!                                  host takes it
//! ```

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Every key forkd writes starts with this.
pub const PREFIX: &str = "/forkd/";

/// The permanent records of the hosts.
pub const HOSTS: &str = "/forkd/hosts/";

/// The leased records of the hosts that live.
pub const ALIVE: &str = "/forkd/alive/";

/// Sandbox ownership, by id.
pub const SANDBOXES: &str = "/forkd/sandboxes/";

/// The key of sandbox `id`'s owner.
pub fn sandbox(id: &str) -> String {
    format!("{SANDBOXES}{id}")
}

/// The key of host `host`'s claim on sandbox `id` (with `id` empty: the prefix of all
/// its claims).
pub fn owned(host: &str, id: &str) -> String {
    format!("/forkd/owned/{host}/{id}")
}

/// Snapshot tags, by tag.
pub const SNAPSHOTS: &str = "/forkd/snapshots/";

/// The key of snapshot tag `tag`.
pub fn snapshot(tag: &str) -> String {
    format!("{SNAPSHOTS}{tag}")
}

/// Paused sandboxes that wait in the cluster's registry for a host, by id.
pub const PARKED: &str = "/forkd/parked/";

/// The key of parked sandbox `id`.
pub fn parked(id: &str) -> String {
    format!("{PARKED}{id}")
}

/// The key of host `name`'s permanent record.
pub fn host(name: &str) -> String {
    format!("{HOSTS}{name}")
}

/// The key of host `name`'s leased record.
pub fn alive(name: &str) -> String {
    format!("{ALIVE}{name}")
}

/// A host as it registered.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostRecord {
    /// Where the other hosts reach its API (`HOST:PORT`).
    pub address: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// When it last registered (RFC 3339).
    pub registered_at: String,
}

/// What a living host says of itself, under its lease.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct HostLive {
    /// Where the other hosts reach its API (`HOST:PORT`).
    pub address: String,
    /// Where they reach its E2B listener, if it serves one (`HOST:PORT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2b_address: Option<String>,
    /// Its accelerator (`kvm`, `tcg`).
    pub accel: String,
    /// Its CPUs.
    pub cpus: u32,
    /// The memory its kernel says is available, MiB.
    pub memory_available_mib: u64,
    /// Its most live sandboxes.
    pub max_sandboxes: usize,
    /// Its live sandboxes.
    pub running: usize,
    /// Its snapshots: tag to the digest of its contents
    /// ([`super::snapshot_digest`]).
    pub snapshots: BTreeMap<String, String>,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// It is being drained: it takes no new sandboxes (see `forkd drain`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
    /// Its forkd version.
    pub version: String,
    /// When it wrote this (RFC 3339).
    pub updated_at: String,
}

impl HostLive {
    /// Its free slots, as it last said.
    pub fn free_slots(&self) -> usize {
        self.max_sandboxes.saturating_sub(self.running)
    }
}
