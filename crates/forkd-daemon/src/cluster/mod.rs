//! Several daemons as one service: what they must agree on is kept in etcd, a
//! well-kept distributed store, never in a consensus of forkd's own.
//!
//! - [`config`]: `--cluster etcd://...`, the host's name, address, lease and labels.
//! - [`keys`]: the key layout and the records under it.
//! - [`membership`]: the host's registration under a lease, refreshed while it lives
//!   and made again when etcd comes back.
//! - [`ownership`]: which host owns which sandbox, claimed in transactions.
//! - [`tags`]: which snapshot a tag names, claimed in transactions.
//!
//! The client is `etcd-client` (tonic over HTTP/2): the maintained Rust client of
//! etcd's v3 API, with leases, transactions and TLS, on the tokio and rustls the daemon
//! already runs.
//!
//! When etcd cannot be reached (no quorum, no member answering), each daemon goes on
//! serving its own sandboxes; what needs the cluster answers 503
//! ([`ClusterError::Unavailable`]).

pub mod config;
pub mod keys;
pub mod membership;
pub mod ownership;
pub mod tags;

pub use config::ClusterConfig;

use etcd_client::{Certificate, Client, ConnectOptions, GetOptions, Identity, TlsOptions};
use keys::{HostLive, HostRecord};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// How long one request to etcd may take before the cluster counts as unreachable.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

/// Why a cluster operation could not be done.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// etcd did not answer (or answered an error).
    #[error("the cluster's store (etcd at {endpoints}) is unavailable: {detail}")]
    Unavailable {
        /// Its endpoints.
        endpoints: String,
        /// What failed.
        detail: String,
    },
    /// A record in etcd is not what forkd writes.
    #[error("the cluster's record {key} is not valid: {detail}")]
    Record {
        /// Its key.
        key: String,
        /// What is wrong.
        detail: String,
    },
    /// The daemon's TLS or credentials for etcd cannot be used.
    #[error("connecting to etcd: {0}")]
    Setup(String),
}

/// Whether a host of the cluster lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum HostState {
    /// Its lease is held: it refreshes its registration.
    Up,
    /// Its lease lapsed: its daemon or its host stopped answering. Its sandboxes are
    /// not dropped; they are shown `unknown` until it is back.
    Unreachable,
}

/// A host of the cluster, as etcd knows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct HostView {
    /// Its name.
    pub name: String,
    /// Where the other hosts reach its API.
    pub address: String,
    /// Whether it lives.
    pub state: HostState,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// When it last registered (RFC 3339).
    pub registered_at: String,
    /// What it said of itself last, while it lives.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live: Option<HostLive>,
}

/// This daemon's handle on the cluster.
pub struct Cluster {
    config: ClusterConfig,
    client: Client,
    /// Where other hosts' sandboxes were found: sandbox id to (host, address). An id
    /// names one sandbox for good, so an entry stays right until its host stops
    /// answering at that address (see [`Cluster::forget`]).
    located: std::sync::Mutex<std::collections::HashMap<String, Remote>>,
    /// Set by a drain: the host takes no new sandboxes.
    draining: std::sync::atomic::AtomicBool,
    /// Sandboxes moved off this host (or being moved): never claimed by it again, and
    /// requests still sent here for them are passed on to where they went.
    moved: std::sync::Mutex<std::collections::HashSet<String>>,
}

/// Another host, as a request for one of its sandboxes reaches it.
#[derive(Debug, Clone, PartialEq)]
pub struct Remote {
    /// Its name.
    pub host: String,
    /// Its REST API.
    pub address: String,
    /// Its E2B listener, if it serves one.
    pub e2b_address: Option<String>,
}

/// Most sandbox locations remembered; past it the memory starts over.
const MAX_LOCATED: usize = 100_000;

impl Cluster {
    /// A client for the cluster's etcd. Nothing is sent yet: a daemon starts (and
    /// serves its own sandboxes) whether etcd answers or not.
    pub async fn connect(config: ClusterConfig) -> Result<Cluster, ClusterError> {
        let mut options = ConnectOptions::new()
            .with_timeout(REQUEST_TIMEOUT)
            .with_connect_timeout(Duration::from_secs(2))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3));
        if let Some(tls) = &config.tls {
            let read = |p: &std::path::Path| {
                std::fs::read(p).map_err(|e| ClusterError::Setup(format!("{}: {e}", p.display())))
            };
            let mut t = TlsOptions::new().ca_certificate(Certificate::from_pem(read(&tls.ca)?));
            if let Some((cert, key)) = &tls.identity {
                t = t.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            options = options.with_tls(t);
        }
        if let Some((user, password)) = &config.credentials {
            options = options.with_user(user, password);
        }
        // With credentials the client asks for a token at once; etcd may be down now,
        // so that request is retried by the membership task, not made a start failure.
        let client = Client::connect(&config.endpoints, Some(options))
            .await
            .map_err(|e| ClusterError::Setup(e.to_string()))?;
        Ok(Cluster {
            config,
            client,
            located: Default::default(),
            draining: Default::default(),
            moved: Default::default(),
        })
    }

    /// True while this host is drained.
    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Drains this host (it takes no new sandboxes), or stops draining it.
    pub fn set_draining(&self, on: bool) {
        self.draining
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Notes that sandbox `id` leaves this host (`true`), or stays after all (`false`).
    pub fn set_moved(&self, id: &str, moved: bool) {
        let mut m = self.moved.lock().expect("not poisoned");
        if moved {
            m.insert(id.to_owned());
        } else {
            m.remove(id);
        }
    }

    /// True if sandbox `id` was moved off this host.
    pub fn was_moved(&self, id: &str) -> bool {
        self.moved.lock().expect("not poisoned").contains(id)
    }

    /// The host sandbox `id` was found on, if remembered.
    pub fn remembered(&self, id: &str) -> Option<Remote> {
        self.located.lock().expect("not poisoned").get(id).cloned()
    }

    /// Remembers that sandbox `id` is on `remote`.
    pub fn remember(&self, id: &str, remote: &Remote) {
        let mut located = self.located.lock().expect("not poisoned");
        if located.len() >= MAX_LOCATED {
            located.clear();
        }
        located.insert(id.to_owned(), remote.clone());
    }

    /// Forgets where sandbox `id` was (its host did not answer there).
    pub fn forget(&self, id: &str) {
        self.located.lock().expect("not poisoned").remove(id);
    }

    /// How this daemon joined.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// This host's name.
    pub fn host_name(&self) -> &str {
        &self.config.host_name
    }

    /// A client to send requests with (cheap: clones share one channel).
    fn client(&self) -> Client {
        self.client.clone()
    }

    /// Runs the request `op` makes, again on another member when one could not be
    /// reached: the client's channel balances over the members and does not drop a
    /// stopped one, so a request can land on it. A request that timed out (no quorum)
    /// is not sent again: that would only multiply the wait.
    async fn request<T, F, Fut>(&self, op: F) -> Result<T, ClusterError>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let mut tries = self.config.endpoints.len() + 1;
        loop {
            match op(self.client()).await {
                Ok(v) => return Ok(v),
                Err(etcd_client::Error::GRpcStatus(s))
                    if s.code() == tonic::Code::Unavailable && tries > 1 =>
                {
                    tries -= 1;
                }
                Err(e) => return Err(self.unavailable(e)),
            }
        }
    }

    /// Runs the transaction `txn`.
    pub(crate) async fn txn(
        &self,
        txn: etcd_client::Txn,
    ) -> Result<etcd_client::TxnResponse, ClusterError> {
        self.request(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
    }

    /// The records of type `T` under `prefix` (or at the key `prefix` alone, if not
    /// `with_prefix`), by what follows `under` in their keys.
    pub(crate) async fn records<T: serde::de::DeserializeOwned>(
        &self,
        prefix: &str,
        under: &str,
        with_prefix: bool,
    ) -> Result<BTreeMap<String, T>, ClusterError> {
        let options = || with_prefix.then(|| GetOptions::new().with_prefix());
        let answer = self
            .request(|mut c| async move { c.get(prefix, options()).await })
            .await?;
        let mut out = BTreeMap::new();
        for kv in answer.kvs() {
            let (name, record) = decode::<T>(kv, under)?;
            out.insert(name, record);
        }
        Ok(out)
    }

    /// An error of a request to etcd.
    fn unavailable(&self, e: impl std::fmt::Display) -> ClusterError {
        ClusterError::Unavailable {
            endpoints: self.config.endpoints.join(","),
            detail: e.to_string(),
        }
    }

    /// What host `name` says of itself, if it lives.
    pub async fn live(&self, name: &str) -> Result<Option<HostLive>, ClusterError> {
        let key = keys::alive(name);
        Ok(self.records(&key, keys::ALIVE, false).await?.remove(name))
    }

    /// Every host that ever registered, with whether it lives now.
    pub async fn hosts(&self) -> Result<Vec<HostView>, ClusterError> {
        // One read of the records and one of the leases; a host that registers in
        // between is shown unreachable until the next read, never missing.
        let records: BTreeMap<String, HostRecord> =
            self.records(keys::HOSTS, keys::HOSTS, true).await?;
        let mut live: BTreeMap<String, HostLive> =
            self.records(keys::ALIVE, keys::ALIVE, true).await?;
        let mut hosts = Vec::new();
        for (name, record) in records {
            let live = live.remove(&name);
            hosts.push(HostView {
                state: if live.is_some() {
                    HostState::Up
                } else {
                    HostState::Unreachable
                },
                address: live.as_ref().map_or(record.address, |l| l.address.clone()),
                labels: record.labels,
                registered_at: record.registered_at,
                name,
                live,
            });
        }
        Ok(hosts)
    }
}

/// What names a snapshot's contents across the hosts: the sha256 of its manifest
/// (parts with their digests, machine...) as canonical JSON, without its tag and its
/// build times, and those of its ancestors after it in the same way. A host that
/// pulled a snapshot holds the same manifest in substance, not byte for byte (an
/// install records its own publish time, and a chain link the digest of the parent's
/// manifest file there), so the file's own digest would differ. None if a parent of
/// the chain is missing.
pub fn snapshot_digest(
    store: &forkd_storage::snapshot::Store,
    snapshot: &forkd_storage::snapshot::Snapshot,
) -> Option<String> {
    use sha2::Digest;
    // The manifest in substance: no tag, no build times, no file digest of its parent;
    // and for a chain link, not its disk layer's bytes, which name the parent's disk by
    // its path on the host (rewritten by an install; the pull checked the layer against
    // the registry's digest).
    let canonical = |m: &forkd_storage::snapshot::Manifest| {
        let mut m = m.clone();
        m.tag = String::new();
        m.build = Default::default();
        m.parent_digest = None;
        if m.parent.is_some() {
            m.parts
                .remove(forkd_storage::snapshot::manifest::parts::DISK);
        }
        serde_json::to_vec(&m).expect("manifests serialize")
    };
    // The snapshot's, then each ancestor's down to the root.
    let mut hash = sha2::Sha256::new();
    hash.update(canonical(&snapshot.manifest));
    let mut parent = snapshot.manifest.parent.clone();
    for _ in 0..forkd_storage::snapshot::chain::MAX_DEPTH {
        let Some(tag) = parent else {
            return Some(format!("sha256:{}", hex::encode(hash.finalize())));
        };
        let p = forkd_storage::snapshot::Tag::parse(&tag)
            .and_then(|t| store.open(&t))
            .ok()?;
        hash.update(canonical(&p.manifest));
        parent = p.manifest.parent.clone();
    }
    None
}

/// The name after `prefix` in `kv`'s key and its JSON value.
pub(crate) fn decode<T: serde::de::DeserializeOwned>(
    kv: &etcd_client::KeyValue,
    prefix: &str,
) -> Result<(String, T), ClusterError> {
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    let bad = |detail: String| ClusterError::Record {
        key: key.clone(),
        detail,
    };
    let name = key
        .strip_prefix(prefix)
        .ok_or_else(|| bad(format!("it is not under {prefix}")))?
        .to_owned();
    let value = serde_json::from_slice(kv.value()).map_err(|e| bad(e.to_string()))?;
    Ok((name, value))
}
