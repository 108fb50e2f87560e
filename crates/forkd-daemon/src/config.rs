//! How the daemon is run: where it listens, who may talk to it, how many sandboxes it
//! keeps. Checked before anything is opened, so a bad configuration fails at once with a
//! message that says what to change.

use forkd_image::Home;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Shortest bearer token accepted.
pub const MIN_TOKEN_LEN: usize = 32;

/// Default ceiling on live sandboxes.
pub const DEFAULT_MAX_SANDBOXES: usize = 64;

/// The default most sandboxes kept paused at once: a paused one holds only its memory
/// diff and disk layer on disk, so many more than run.
pub const DEFAULT_MAX_PAUSED: usize = 4096;

/// The daemon's configuration.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// The data directory (assets, snapshots, sandboxes, the state database).
    pub home: Home,
    /// The unix socket the API is served on.
    pub socket: PathBuf,
    /// Group given ownership of the socket (mode 0660); the daemon's own group if unset.
    pub socket_group: Option<String>,
    /// Also serve on TCP at this address.
    pub listen: Option<SocketAddr>,
    /// TLS for the TCP listener.
    pub tls: Option<TlsFiles>,
    /// Bearer token required on TCP (the unix socket is guarded by its file mode): the
    /// first of [`DaemonConfig::tokens`], which E2B's listener takes as its API key.
    pub token: Option<String>,
    /// Every token TCP clients may send, by name (`--token-file NAME=FILE`, repeatable):
    /// audit records name the one a request came with.
    pub tokens: Vec<(String, String)>,
    /// Serve TCP off loopback without TLS (every listener): said explicitly, never a
    /// default, since the token and everything the API carries would cross the network
    /// in clear.
    pub insecure_plaintext: bool,
    /// Most live sandboxes; creating more answers 503.
    pub max_sandboxes: usize,
    /// The most sandboxes kept paused at once.
    pub max_paused: usize,
    /// Most children a fork restores at once.
    pub fork_parallelism: usize,
    /// Forks are admitted while their children's estimated cost fits in the host's
    /// available memory times this.
    pub memory_overcommit: f64,
    /// Also serve E2B's API (for E2B's SDKs) on a listener of its own.
    pub e2b: Option<crate::e2b::E2bConfig>,
    /// How push and pull reach registries (plain HTTP ones, the auth file).
    pub registries: forkd_storage::oci::registry::RegistryOptions,
    /// The DNS server sandboxes' resolvers forward allowed names to (default: the
    /// host's first nameserver); none: sandboxes get no resolver.
    pub dns_upstream: Option<SocketAddr>,
    /// The directories under which a recipe sent through the API may name image
    /// archives and layouts on this host (`--import-dir`; none by default).
    pub import_dirs: crate::import_dirs::ImportDirs,
    /// Networks closed to sandboxes by default that the operator opened on purpose
    /// (`--egress-open`; see [`forkd_host::network::closed`]).
    pub egress_open: Vec<forkd_host::network::policy::Network>,
    /// Pause the running sandboxes when the daemon stops (they resume on their next
    /// request after it starts again), instead of leaving their VMs running.
    pub pause_on_stop: bool,
    /// Start a new audit chain when the log is found broken (`--audit-reset`), after
    /// moving the broken one aside; without it the daemon refuses to start.
    pub audit_reset: bool,
    /// How long lifecycle events are kept (`--events-retention`), for `GET /v1/events`
    /// to replay.
    pub events_retention: std::time::Duration,
    /// This daemon's place in a cluster of daemons (`--cluster`), if it has one.
    pub cluster: Option<crate::cluster::ClusterConfig>,
}

/// Lifecycle events are kept a week unless the operator says otherwise.
pub const DEFAULT_EVENTS_RETENTION: std::time::Duration =
    std::time::Duration::from_secs(7 * 24 * 3600);

/// PEM files of the TCP listener's certificate chain and private key.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain.
    pub cert: PathBuf,
    /// Private key.
    pub key: PathBuf,
}

/// The configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("refusing to listen on {addr} without a token: anyone who can reach it could run code; pass --token-file (or listen on a loopback address)")]
    NoToken {
        /// The address.
        addr: SocketAddr,
    },
    #[error("the token in {path} is {len} bytes; at least {MIN_TOKEN_LEN} are required (e.g. `openssl rand -hex 32 > {path}`)")]
    ShortToken {
        /// The token file.
        path: String,
        /// Its length after trimming.
        len: usize,
    },
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    #[error("--max-sandboxes must be at least 1")]
    NoCapacity,
    /// The E2B listener needs the token: it is the API key.
    #[error("--e2b-listen needs --token-file: the token is the API key E2B's SDKs send")]
    E2bNoToken,
    /// Off loopback the E2B listener needs TLS.
    #[error("refusing to serve E2B's API on {addr} without TLS: its API key and access tokens would cross the network in clear; pass --tls-cert and --tls-key (or listen on a loopback address, or say --insecure-plaintext)")]
    E2bNoTls {
        /// The address.
        addr: SocketAddr,
    },
    /// Off loopback the API needs TLS.
    #[error("refusing to serve the API on {addr} without TLS: the token and everything the API carries would cross the network in clear; pass --tls-cert and --tls-key (or listen on a loopback address, or say --insecure-plaintext)")]
    NoTls {
        /// The address.
        addr: SocketAddr,
    },
    /// A token file others can read.
    #[error("refusing the token file {path}: its mode {mode:04o} lets other users read it; `chmod 600 {path}`")]
    TokenReadable {
        /// The token file.
        path: String,
        /// Its mode.
        mode: u32,
    },
    /// The overcommit must be a positive number.
    #[error("--memory-overcommit must be a number above 0 (1 admits what fits in the available memory), not {0}")]
    Overcommit(f64),
    /// A cluster member is reached by the others over TCP.
    #[error("--cluster needs --listen: the other hosts reach this one's API over TCP, at its --advertise address")]
    ClusterNoListen,
    /// The cluster options cannot be used.
    #[error(transparent)]
    Cluster(#[from] crate::cluster::config::ClusterConfigError),
}

impl DaemonConfig {
    /// The defaults for `home`: its socket, no TCP, no token.
    pub fn new(home: Home) -> DaemonConfig {
        DaemonConfig {
            socket: default_socket(&home),
            home,
            socket_group: None,
            listen: None,
            tls: None,
            token: None,
            tokens: Vec::new(),
            insecure_plaintext: false,
            max_sandboxes: DEFAULT_MAX_SANDBOXES,
            max_paused: DEFAULT_MAX_PAUSED,
            fork_parallelism: forkd_core::fork::default_parallel(),
            memory_overcommit: 1.0,
            e2b: None,
            registries: Default::default(),
            dns_upstream: crate::resolver::default_upstream(),
            import_dirs: Default::default(),
            egress_open: Vec::new(),
            pause_on_stop: false,
            audit_reset: false,
            events_retention: DEFAULT_EVENTS_RETENTION,
            cluster: None,
        }
    }

    /// Reads a token file: its content, trimmed of surrounding white space. A file that
    /// its group or other users may read is refused: the token is the key to the API.
    pub fn read_token(path: &Path) -> Result<String, ConfigError> {
        use std::os::unix::fs::PermissionsExt;
        let read = |source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        };
        let mode = std::fs::metadata(path).map_err(read)?.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(ConfigError::TokenReadable {
                path: path.display().to_string(),
                mode,
            });
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        let token = text.trim().to_owned();
        if token.len() < MIN_TOKEN_LEN {
            return Err(ConfigError::ShortToken {
                path: path.display().to_string(),
                len: token.len(),
            });
        }
        Ok(token)
    }

    /// Adds the token `secret` named `name`; the first one added is also
    /// [`DaemonConfig::token`].
    pub fn add_token(&mut self, name: &str, secret: String) {
        if self.token.is_none() {
            self.token = Some(secret.clone());
        }
        self.tokens.push((name.to_owned(), secret));
    }

    /// Every token TCP clients may send, by name: [`DaemonConfig::tokens`], or
    /// [`DaemonConfig::token`] as `default` when only it is set.
    pub fn named_tokens(&self) -> Vec<(String, String)> {
        match (&self.token, self.tokens.is_empty()) {
            (Some(t), true) => vec![("default".to_owned(), t.clone())],
            _ => self.tokens.clone(),
        }
    }

    /// Refuses what would be unsafe or cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_sandboxes == 0 {
            return Err(ConfigError::NoCapacity);
        }
        if !(self.memory_overcommit.is_finite() && self.memory_overcommit > 0.0) {
            return Err(ConfigError::Overcommit(self.memory_overcommit));
        }
        if let Some(addr) = self.listen {
            if !addr.ip().is_loopback() && self.token.is_none() {
                return Err(ConfigError::NoToken { addr });
            }
            if !addr.ip().is_loopback() && self.tls.is_none() && !self.insecure_plaintext {
                return Err(ConfigError::NoTls { addr });
            }
        }
        if let Some(cluster) = &self.cluster {
            if self.listen.is_none() {
                return Err(ConfigError::ClusterNoListen);
            }
            cluster.validate()?;
        }
        if let Some(e2b) = &self.e2b {
            if self.token.is_none() {
                return Err(ConfigError::E2bNoToken);
            }
            if !e2b.listen.ip().is_loopback() && self.tls.is_none() && !self.insecure_plaintext {
                return Err(ConfigError::E2bNoTls { addr: e2b.listen });
            }
        }
        Ok(())
    }

    /// The state database.
    pub fn database(&self) -> PathBuf {
        self.home.root().join("forkd.db")
    }

    /// The audit log.
    pub fn audit_log(&self) -> PathBuf {
        self.home.root().join("audit.jsonl")
    }

    /// The key the audit log's chain is marked with.
    pub fn audit_key(&self) -> PathBuf {
        self.home.root().join("audit.key")
    }
}

/// The daemon's socket in `home`, where clients look for it by default.
pub fn default_socket(home: &Home) -> PathBuf {
    home.root().join("forkd.sock")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> DaemonConfig {
        DaemonConfig::new(Home::new("/nonexistent"))
    }

    #[test]
    fn a_public_address_needs_a_token() {
        let mut c = config();
        c.listen = Some("0.0.0.0:7070".parse().unwrap());
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("refusing to listen on 0.0.0.0:7070 without a token"),
            "{e}"
        );
        c.token = Some("x".repeat(32));
        // And TLS, unless plain text is asked for by name.
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("without TLS") && e.contains("--insecure-plaintext"),
            "{e}"
        );
        c.insecure_plaintext = true;
        c.validate().unwrap();
        c.insecure_plaintext = false;
        c.tls = Some(TlsFiles {
            cert: "cert.pem".into(),
            key: "key.pem".into(),
        });
        c.validate().unwrap();
        c.tls = None;
        c.token = None;
        c.listen = Some("127.0.0.1:7070".parse().unwrap());
        c.validate().unwrap();
        c.listen = Some("[::1]:7070".parse().unwrap());
        c.validate().unwrap();
    }

    #[test]
    fn the_e2b_listener_needs_a_token_and_off_loopback_tls() {
        let mut c = config();
        c.e2b = Some(crate::e2b::E2bConfig::new(
            "127.0.0.1:3000".parse().unwrap(),
        ));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("--e2b-listen needs --token-file"), "{e}");
        c.token = Some("x".repeat(32));
        c.validate().unwrap();
        c.e2b = Some(crate::e2b::E2bConfig::new("0.0.0.0:443".parse().unwrap()));
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("without TLS"), "{e}");
        c.insecure_plaintext = true;
        c.validate().unwrap();
        c.insecure_plaintext = false;
        c.tls = Some(TlsFiles {
            cert: "cert.pem".into(),
            key: "key.pem".into(),
        });
        c.validate().unwrap();
    }

    #[test]
    fn short_tokens_and_tokens_others_can_read_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token");
        std::fs::write(&p, format!("{}\n", "a".repeat(40))).unwrap();
        for mode in [0o644, 0o640, 0o604] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = DaemonConfig::read_token(&p).unwrap_err().to_string();
            assert!(
                e.contains("lets other users read it") && e.contains("chmod 600"),
                "{e}"
            );
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&p, "short\n").unwrap();
        let e = DaemonConfig::read_token(&p).unwrap_err().to_string();
        assert!(e.contains("is 5 bytes; at least 32"), "{e}");
        std::fs::write(&p, format!("{}\n", "a".repeat(40))).unwrap();
        assert_eq!(DaemonConfig::read_token(&p).unwrap(), "a".repeat(40));
        let e = DaemonConfig::read_token(&dir.path().join("none")).unwrap_err();
        assert!(e.to_string().starts_with("cannot read"), "{e}");
    }
}
