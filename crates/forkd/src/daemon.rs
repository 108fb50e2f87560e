//! `forkd daemon` and `forkd audit verify`.

use anyhow::Result;
use forkd_daemon::config::TlsFiles;
use forkd_daemon::DaemonConfig;
use forkd_image::Home;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Arguments of `forkd daemon`.
#[derive(clap::Args, Debug)]
pub struct DaemonArgs {
    /// The unix socket to serve on (default: forkd.sock in the data directory).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Group that owns the socket (mode 0660).
    #[arg(long)]
    socket_group: Option<String>,
    /// Also serve on TCP at ADDR:PORT (a non-loopback address needs --token-file and
    /// TLS).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Serve TCP off loopback without TLS (this listener and the E2B one): the token
    /// and everything the API carries cross the network in clear.
    #[arg(long)]
    insecure_plaintext: bool,
    /// File holding a bearer token TCP clients may send (at least 32 bytes), as FILE or
    /// NAME=FILE (repeatable: each client its own token; audit records name the one a
    /// request came with, `default` when unnamed). The first is E2B's API key.
    #[arg(long, value_parser = parse_token_file)]
    token_file: Vec<(String, PathBuf)>,
    /// TLS certificate chain (PEM) for the TCP listener.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM) for the TCP listener.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Most sandboxes at once; more answer 503.
    #[arg(long, default_value_t = forkd_daemon::config::DEFAULT_MAX_SANDBOXES)]
    max_sandboxes: usize,
    /// Most sandboxes kept paused at once (they hold disk, not memory); a pause beyond
    /// it answers 503 and the sandbox runs on.
    #[arg(long, default_value_t = forkd_daemon::config::DEFAULT_MAX_PAUSED)]
    max_paused: usize,
    /// Most children a fork restores at once; the rest wait their turn (default: one per
    /// host CPU).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    fork_parallelism: Option<u32>,
    /// Admit forks while their children's cost (measured private memory of live
    /// children of the snapshot) fits in the host's available memory times this.
    #[arg(long, default_value_t = 1.0)]
    memory_overcommit: f64,
    /// Also serve E2B's API at ADDR:PORT, for E2B's SDKs (needs --token-file: the token
    /// is their API key; off loopback also TLS). See docs/e2b.md.
    #[arg(long)]
    e2b_listen: Option<SocketAddr>,
    /// An E2B template name and the snapshot it stands for, NAME=TAG (repeatable; `base`
    /// and `code-interpreter-v1` stand for `python` unless given).
    #[arg(long, value_parser = parse_alias, requires = "e2b_listen")]
    e2b_alias: Vec<(String, String)>,
    /// The domain E2B's SDKs reach sandboxes under, as `<port>-<id>.<domain>` (routing by
    /// host name, for SDKs not given E2B_SANDBOX_URL; needs a wildcard certificate).
    #[arg(long, requires = "e2b_listen")]
    e2b_domain: Option<String>,
    /// A registry (HOST[:PORT]) that push and pull reach over plain HTTP (repeatable;
    /// loopback registries always are).
    #[arg(long)]
    insecure_registry: Vec<String>,
    /// The DNS server (ADDRESS[:PORT]) that sandboxes' resolvers forward the names their
    /// egress policy allows to (default: the host's first nameserver in
    /// /etc/resolv.conf).
    #[arg(long, value_parser = forkd_daemon::resolver::parse_upstream)]
    dns_upstream: Option<SocketAddr>,
    /// A directory under which recipes sent through the API may name image archives and
    /// layouts (`from = "docker-archive:/DIR/x.tar"`) for the daemon to read (repeatable;
    /// by default none: clients send images instead).
    #[arg(long)]
    import_dir: Vec<PathBuf>,
    /// A network (CIDR) that sandboxes may reach although it is closed by default (a
    /// special-purpose range or one of the host's own networks, e.g. a proxy on a
    /// private address); their egress policy still decides (repeatable; recorded in the
    /// audit log).
    #[arg(long, value_parser = parse_open_network)]
    egress_open: Vec<forkd_host::network::policy::Network>,
    /// When the audit log is found broken (edited, cut short, emptied), move it aside
    /// and start a new chain whose first record says what was found, instead of
    /// refusing to start.
    #[arg(long)]
    audit_reset: bool,
    /// When stopped (SIGTERM, systemd), pause the running sandboxes to disk instead of
    /// leaving their VMs running: they resume on their next request once the daemon
    /// runs again, and survive a reboot of the host.
    #[arg(long)]
    pause_on_stop: bool,
    /// Seconds lifecycle events are kept for `GET /v1/events` (and `forkd events`) to
    /// replay.
    #[arg(long, value_name = "SECS", default_value_t = forkd_daemon::config::DEFAULT_EVENTS_RETENTION.as_secs())]
    events_retention: u64,
    /// Join a cluster of daemons coordinated through etcd, at
    /// etcd://HOST:PORT[,HOST:PORT...] (its members' client addresses; see
    /// docs/cluster.md). Needs --listen and --advertise.
    #[arg(long, value_name = "URL", value_parser = parse_cluster_url, requires = "advertise")]
    cluster: Option<EtcdEndpoints>,
    /// The HOST:PORT at which the other hosts of the cluster reach this daemon's TCP
    /// listener.
    #[arg(long, requires = "cluster")]
    advertise: Option<String>,
    /// This host's name in the cluster, unique in it (default: the machine's hostname).
    #[arg(long, requires = "cluster")]
    host_name: Option<String>,
    /// Seconds this host's registration in the cluster lasts without a refresh: a host
    /// that stops answering is shown unreachable after this long.
    #[arg(long, value_name = "SECS", requires = "cluster",
          default_value_t = forkd_daemon::cluster::config::DEFAULT_LEASE_TTL.as_secs())]
    lease_ttl: u64,
    /// A label of this host (KEY=VALUE, e.g. zone=eu-1; repeatable).
    #[arg(long, value_parser = parse_label, requires = "cluster")]
    label: Vec<(String, String)>,
    /// The CA certificate (PEM) that signed the etcd members' certificates: talk TLS to
    /// etcd.
    #[arg(long, requires = "cluster")]
    etcd_ca: Option<PathBuf>,
    /// A client certificate (PEM) for etcd members that ask for one.
    #[arg(long, requires_all = ["etcd_key", "etcd_ca"])]
    etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// etcd's user, when its authentication is on (with --etcd-password-file).
    #[arg(long, requires_all = ["etcd_password_file", "cluster"])]
    etcd_user: Option<String>,
    /// A file holding the etcd user's password.
    #[arg(long, requires = "etcd_user")]
    etcd_password_file: Option<PathBuf>,
    /// The CA certificate (PEM) that signed the other hosts' API certificates: requests
    /// forwarded to them go over TLS (without it, over plain HTTP).
    #[arg(long, requires = "cluster")]
    peer_ca: Option<PathBuf>,
    /// The cluster's OCI registry (HOST[:PORT]/REPO): a fork that places children on
    /// hosts lacking its snapshot pushes it there, and they pull it by digest.
    #[arg(long, requires = "cluster")]
    registry: Option<String>,
}

/// The etcd members of `--cluster` (one value to clap, whatever their number).
#[derive(Debug, Clone)]
struct EtcdEndpoints(Vec<String>);

fn parse_cluster_url(s: &str) -> Result<EtcdEndpoints, String> {
    forkd_daemon::cluster::config::parse_url(s)
        .map(EtcdEndpoints)
        .map_err(|e| e.to_string())
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    forkd_daemon::cluster::config::parse_label(s).map_err(|e| e.to_string())
}

/// The cluster options given, as the daemon's configuration takes them.
fn cluster_config(args: &mut DaemonArgs) -> Result<Option<forkd_daemon::cluster::ClusterConfig>> {
    use forkd_daemon::cluster::config::{ClusterConfig, EtcdTls};
    let Some(EtcdEndpoints(endpoints)) = args.cluster.take() else {
        return Ok(None);
    };
    let host_name = match args.host_name.take() {
        Some(n) => n,
        None => nix::unistd::gethostname()?.to_string_lossy().into_owned(),
    };
    let credentials = match (args.etcd_user.take(), &args.etcd_password_file) {
        (Some(user), Some(file)) => {
            let password = std::fs::read_to_string(file)
                .map_err(|e| anyhow::anyhow!("reading {}: {e}", file.display()))?;
            Some((user, password.trim_end_matches(['\r', '\n']).to_owned()))
        }
        _ => None,
    };
    Ok(Some(ClusterConfig {
        endpoints,
        host_name,
        advertise: args.advertise.take().unwrap_or_default(),
        lease_ttl: std::time::Duration::from_secs(args.lease_ttl),
        tls: args.etcd_ca.take().map(|ca| EtcdTls {
            ca,
            identity: args.etcd_cert.take().zip(args.etcd_key.take()),
        }),
        credentials,
        labels: args.label.drain(..).collect(),
        peer_ca: args.peer_ca.take(),
        registry: args.registry.take(),
    }))
}

fn parse_token_file(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, file)) => {
            let ok = !name.is_empty()
                && name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
            if !ok || file.is_empty() {
                return Err(format!(
                    "{s:?}: a token's name is 1 to 64 letters, digits, `.`, `_` or `-`, as NAME=FILE"
                ));
            }
            Ok((name.to_owned(), PathBuf::from(file)))
        }
        None => Ok(("default".to_owned(), PathBuf::from(s))),
    }
}

fn parse_open_network(s: &str) -> Result<forkd_host::network::policy::Network, String> {
    use forkd_host::network::policy::Destination;
    match s.parse::<Destination>()? {
        Destination::Net(n) if n.port.is_none() => Ok(n),
        _ => Err(format!(
            "{s:?} is not a network: write ADDRESS/PREFIX, e.g. 10.8.0.0/24"
        )),
    }
}

fn parse_alias(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((a, t)) if !a.is_empty() && !t.is_empty() => Ok((a.to_owned(), t.to_owned())),
        _ => Err(format!("{s:?} is not NAME=TAG")),
    }
}

/// `forkd audit ...`.
#[derive(clap::Subcommand, Debug)]
pub enum AuditCommand {
    /// Check every record's hash and its link to the one before.
    Verify {
        /// The log (default: audit.jsonl in the data directory).
        path: Option<PathBuf>,
    },
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(home: &Home, mut args: DaemonArgs) -> Result<()> {
    let mut config = DaemonConfig::new(home.clone());
    config.cluster = cluster_config(&mut args)?;
    if let Some(s) = args.socket {
        config.socket = s;
    }
    config.socket_group = args.socket_group;
    config.listen = args.listen;
    config.insecure_plaintext = args.insecure_plaintext;
    config.max_sandboxes = args.max_sandboxes;
    config.max_paused = args.max_paused;
    config.memory_overcommit = args.memory_overcommit;
    config.registries.insecure = args.insecure_registry;
    if let Some(up) = args.dns_upstream {
        config.dns_upstream = Some(up);
    }
    config.import_dirs = forkd_daemon::import_dirs::ImportDirs::new(&args.import_dir)?;
    config.egress_open = args.egress_open;
    config.audit_reset = args.audit_reset;
    config.pause_on_stop = args.pause_on_stop;
    config.events_retention = std::time::Duration::from_secs(args.events_retention.max(1));
    if let Some(k) = args.fork_parallelism {
        config.fork_parallelism = k as usize;
    }
    for (name, file) in &args.token_file {
        if config.tokens.iter().any(|(n, _)| n == name) {
            anyhow::bail!("--token-file: two tokens are named {name}");
        }
        config.add_token(name, DaemonConfig::read_token(file)?);
    }
    if let Some(addr) = args.e2b_listen {
        let mut e2b = forkd_daemon::e2b::E2bConfig::new(addr);
        e2b.aliases.extend(args.e2b_alias);
        e2b.domain = args.e2b_domain;
        config.e2b = Some(e2b);
    }
    if let (Some(cert), Some(key)) = (args.tls_cert, args.tls_key) {
        config.tls = Some(TlsFiles { cert, key });
    }
    let socket = config.socket.clone();
    // The MCP tools call the REST API on the daemon's own socket.
    let mcp = crate::mcp::http_router(
        forkd_daemon::client::Client::new(
            forkd_daemon::client::Endpoint::Unix(socket.clone()),
            None,
        ),
        config.token.is_some(),
    );
    let hypervisor = forkd_qemu::hypervisor();
    forkd_daemon::server::run(config, hypervisor, mcp, shutdown_signal(), |tcp| {
        eprintln!("forkd daemon: listening on {}", socket.display());
        if let Some(a) = tcp {
            eprintln!("forkd daemon: listening on tcp {a}");
        }
    })
    .await
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is called, not
/// when the future is first polled: the server polls it only once its accept loop runs,
/// and a SIGTERM sent as soon as the socket answers used to find no handler yet and kill
/// the daemon outright (without its orderly stop).
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let streams = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    );
    async move {
        let (Ok(mut term), Ok(mut int)) = streams else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
    }
}

/// `forkd audit verify`.
pub fn audit(home: &Home, cmd: AuditCommand) -> Result<()> {
    match cmd {
        AuditCommand::Verify { path } => {
            let path = path.unwrap_or_else(|| DaemonConfig::new(home.clone()).audit_log());
            // The key and the head live in the data directory the log is in.
            let dir = path.parent().unwrap_or(std::path::Path::new("."));
            let beside = DaemonConfig::new(Home::new(dir));
            let key = forkd_daemon::audit::AuditKey::load(&beside.audit_key())?;
            let db = beside.database();
            let anchor = match db.exists() {
                true => forkd_daemon::state::State::audit_head_of(&db)?,
                false => None,
            };
            let v = forkd_daemon::audit::verify(&path, key.as_ref(), anchor.as_ref())?;
            println!(
                "{}: {} records, chain intact (last hash {}){}{}",
                path.display(),
                v.records,
                &v.last[..16],
                match &key {
                    Some(_) => format!(", {} marked with its key", v.keyed),
                    None => ", no key found beside it: an edit hashed again through the chain would not be seen".into(),
                },
                match &anchor {
                    Some(a) => format!(", ends where the daemon's database says ({} records)", a.records),
                    None => ", no head in a database beside it: records cut off its end would not be seen".into(),
                }
            );
            Ok(())
        }
    }
}
