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
    /// File holding the bearer token TCP clients must send (at least 32 bytes).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// TLS certificate chain (PEM) for the TCP listener.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM) for the TCP listener.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Most sandboxes at once; more answer 503.
    #[arg(long, default_value_t = forkd_daemon::config::DEFAULT_MAX_SANDBOXES)]
    max_sandboxes: usize,
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
pub async fn run(home: &Home, args: DaemonArgs) -> Result<()> {
    let mut config = DaemonConfig::new(home.clone());
    if let Some(s) = args.socket {
        config.socket = s;
    }
    config.socket_group = args.socket_group;
    config.listen = args.listen;
    config.insecure_plaintext = args.insecure_plaintext;
    config.max_sandboxes = args.max_sandboxes;
    config.memory_overcommit = args.memory_overcommit;
    config.registries.insecure = args.insecure_registry;
    if let Some(up) = args.dns_upstream {
        config.dns_upstream = Some(up);
    }
    config.import_dirs = forkd_daemon::import_dirs::ImportDirs::new(&args.import_dir)?;
    if let Some(k) = args.fork_parallelism {
        config.fork_parallelism = k as usize;
    }
    if let Some(t) = &args.token_file {
        config.token = Some(DaemonConfig::read_token(t)?);
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
    forkd_daemon::server::run(config, mcp, shutdown_signal(), |tcp| {
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
            let (n, last) = forkd_daemon::audit::verify(&path)?;
            println!(
                "{}: {n} records, chain intact (last hash {})",
                path.display(),
                &last[..16]
            );
            Ok(())
        }
    }
}
