//! Running the daemon: open the state, adopt the sandboxes that survived, listen on the
//! unix socket (and TCP), authenticate, audit, and stop cleanly on a signal without
//! touching the sandboxes (they run on and are adopted by the next start).

use crate::api::{self, App, AppState};
use crate::audit::AuditLog;
use crate::config::DaemonConfig;
use crate::registry::Registry;
use crate::state::State;
use anyhow::{bail, Context, Result};
use axum::extract::Request;
use axum::Router;
use forkd_storage::snapshot::Store;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};

pub(crate) mod forward;
mod middleware;
use middleware::{
    append_failed_authentications, authenticate, observe, record_failed_authentications,
};
pub(crate) use middleware::{record_before, record_request, refused_authentication};

/// How long in-flight requests get to finish after a shutdown signal.
const DRAIN: Duration = Duration::from_secs(10);

/// How long a client gets for the TLS handshake and for a request's head.
const HANDSHAKE: Duration = Duration::from_secs(30);

/// Accepting failed (out of descriptors, most likely): say so and pause, rather than
/// spin on an error that will repeat at once.
async fn accept_failed(listener: &str, e: std::io::Error) {
    tracing::warn!("accepting on {listener}: {e}");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// How often the warm pools are checked when nothing wakes their filler.
const POOL_CHECK_EVERY: Duration = Duration::from_secs(5);

/// How often expired and dead sandboxes are reaped.
const REAP_EVERY: Duration = Duration::from_secs(1);

/// How often the host's routes are read again for the networks closed to sandboxes.
const CLOSED_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Who sent a request: set per connection by the listener.
#[derive(Debug, Clone)]
pub struct Principal(pub String);

/// The API error code of a response, for the metrics (set by [`ApiError`]).
#[derive(Debug, Clone, Copy)]
pub struct ErrorKind(pub &'static str);

/// Ids a response names that its path does not (the children a fork created): the
/// handler sets it, the audit record lists them after the path's.
#[derive(Debug, Clone, Default)]
pub struct AuditIds(pub Vec<String>);

/// Removes what the last daemon's stop left half made: layouts and build scratch,
/// the cgroups of VMs that exited while no daemon watched them, and the staging of
/// builds and branches it interrupted. Returns the sources of interrupted branches,
/// which the registry recovers.
fn clean_after_last_stop(
    config: &DaemonConfig,
    store: &Store,
    interrupted: &[crate::state::Interrupted],
) -> Vec<String> {
    forkd_storage::oci::layout::Layout::remove_leftovers(store);
    forkd_core::customise::remove_leftovers(&config.home);
    if let Ok(Some(cgroups)) = forkd_host::cgroup::for_vms() {
        cgroups.sweep(std::time::Duration::from_secs(60));
    }
    let mut branch_sources = Vec::new();
    for op in interrupted {
        let (kind, target) = (&op.kind, &op.target);
        // What a build or branch interrupted by the stop had written is of no use to
        // anyone. (An interrupted fork's children are the registry's: see adopt_all.)
        if kind == "build_snapshot" || kind == "branch" {
            if let Ok(tag) = forkd_storage::snapshot::Tag::parse(target) {
                store.remove_staging_of(&tag);
            }
        }
        if kind == "branch" {
            if let Some(source) = op.result.as_ref().and_then(|r| r["source"].as_str()) {
                branch_sources.push(source.to_owned());
            }
        }
        tracing::warn!(%kind, %target, "an operation was interrupted by the last stop");
    }
    branch_sources
}

/// The registry, with what the last daemon left taken over: interrupted branches'
/// sources recovered, running sandboxes adopted, warm pools opened, and directories no
/// row owns and no VM uses pruned.
async fn start_registry(
    config: &DaemonConfig,
    hypervisor: Arc<dyn forkd_hypervisor::Hypervisor>,
    store: Store,
    state: Arc<State>,
    branch_sources: &[String],
) -> Result<Registry> {
    let registry = Registry::new(
        hypervisor,
        config.home.clone(),
        store,
        state,
        config.max_sandboxes,
    )
    .with_max_paused(config.max_paused)
    .with_fork_parallelism(config.fork_parallelism)
    .with_memory_overcommit(config.memory_overcommit)
    .with_dns_upstream(config.dns_upstream);
    registry.recover_branches(branch_sources).await?;
    let (adopted, gone) = registry.adopt_all().await?;
    let leftovers = registry.open_pools().await?;
    if leftovers > 0 {
        tracing::info!("removed {leftovers} warm pool members the last daemon left");
    }
    // Directories that no row owns and no VM uses (a `forkd run` killed outright, a
    // daemon killed before it wrote a child's row): nothing will ever clean them
    // otherwise.
    let pruned = registry.prune_unowned();
    tracing::info!(
        "adopted {} running sandboxes; {} had stopped while the daemon was down and were removed; {} stale sandbox directories pruned",
        adopted.len(),
        gone.len(),
        pruned.len()
    );
    Ok(registry)
}

/// The daemon's listeners, bound.
struct Listeners {
    unix: UnixListener,
    tcp: Option<TcpListener>,
    e2b: Option<TcpListener>,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl Listeners {
    async fn bind(config: &DaemonConfig) -> Result<Listeners> {
        let unix = bind_unix(&config.socket, config.socket_group.as_deref()).await?;
        let tcp = match config.listen {
            Some(addr) => Some(
                TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("listening on {addr}"))?,
            ),
            None => None,
        };
        let e2b = match &config.e2b {
            Some(e) => Some(
                TcpListener::bind(e.listen)
                    .await
                    .with_context(|| format!("listening for E2B's SDKs on {}", e.listen))?,
            ),
            None => None,
        };
        let tls = match &config.tls {
            Some(files) => Some(crate::server::tls::acceptor(files)?),
            None => None,
        };
        Ok(Listeners {
            unix,
            tcp,
            e2b,
            tls,
        })
    }
}

/// Runs the daemon until `shutdown` resolves, with VMs of `hypervisor` (the binary picks
/// the backend; the daemon never names one). `ready` is called once every listener is
/// bound (with the TCP address actually bound, if any). `extra` is served beside the
/// API, behind the same authentication, audit and metrics (the MCP endpoint).
pub async fn run(
    config: DaemonConfig,
    hypervisor: Arc<dyn forkd_hypervisor::Hypervisor>,
    extra: Router,
    shutdown: impl Future<Output = ()> + Send,
    ready: impl FnOnce(Option<std::net::SocketAddr>),
) -> Result<()> {
    config.validate()?;
    // Everything the daemon and the programs it starts (QEMU, qemu-img, mkfs) create is
    // its owner's alone, whatever the caller's umask and --socket-group: guests' memory
    // images, disks and consoles are their secrets. (The socket is opened to its group
    // on purpose, below.)
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let root = config.home.root().to_owned();
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    // Before anything of the directory is read or touched: a second daemon must not
    // adopt (and so break) the first one's sandboxes.
    let _owner = crate::owner::OwnerLock::acquire(&root, &config.socket)?;
    tighten_data_directory(&config)?;
    let state = Arc::new(State::open(&config.database())?);
    let interrupted = state.interrupt_running_operations(&crate::now_rfc3339())?;
    let store = Store::of_home(&config.home);
    let branch_sources = clean_after_last_stop(&config, &store, &interrupted);
    let audit = Arc::new(open_audit_log(&config, &state)?);
    close_networks(&config, &audit).await?;
    let registry = start_registry(&config, hypervisor, store, state, &branch_sources).await?;
    let Listeners {
        unix,
        tcp,
        e2b: e2b_listener,
        tls,
    } = Listeners::bind(&config).await?;
    let tcp_addr = tcp.as_ref().and_then(|l| l.local_addr().ok());
    let cluster = match config.cluster.clone() {
        Some(c) => Some(Arc::new(crate::cluster::Cluster::connect(c).await?)),
        None => None,
    };

    let app: App = Arc::new(AppState {
        registry,
        config: config.clone(),
        metrics: crate::metrics::Metrics::new(),
        cluster: cluster.clone(),
    });
    let membership = cluster.map(|c| {
        (
            tokio::spawn(crate::cluster::membership::run(c.clone(), app.clone())),
            tokio::spawn(crate::cluster::ownership::run(c, app.clone())),
        )
    });
    let reaper = tokio::spawn(reap(app.clone()));
    let deliverer =
        crate::events::webhooks::spawn(app.registry.events().clone(), app.registry.state_arc());
    let filler = tokio::spawn(fill_pools(app.clone()));
    let closer = tokio::spawn(follow_host_networks());
    // The audit and metrics layer is the outermost one, so that every answer is
    // counted; a mutating request is also recorded before it runs, once it passed
    // authentication (the innermost layer). Refused authentications are counted into
    // aggregate records.
    let failures = Arc::new(crate::auth_failures::AuthFailures::default());
    let failed_auth = tokio::spawn(record_failed_authentications(
        failures.clone(),
        audit.clone(),
    ));
    let observed = axum::middleware::from_fn_with_state((app.clone(), audit.clone()), observe);
    let recorded = axum::middleware::from_fn_with_state(audit.clone(), record_request);
    // In a cluster, a request for another host's sandbox goes to that host (inside
    // authentication, so only an authenticated request is forwarded).
    let to_owner = axum::middleware::from_fn_with_state(app.clone(), forward::to_owner);
    let base = api::router(app.clone())
        .layer(to_owner.clone())
        .merge(extra.clone())
        .layer(recorded.clone())
        .layer(observed.clone());
    let tokens = Arc::new(config.named_tokens());
    let tcp_router = api::router(app.clone())
        .layer(to_owner)
        .merge(extra)
        .layer(recorded.clone())
        .layer(axum::middleware::from_fn_with_state(
            (tokens, failures.clone()),
            authenticate,
        ))
        .layer(observed.clone());

    // E2B's API authenticates by its own rules (see `e2b`); it shares the audit and
    // metrics layers.
    let e2b_router = config.e2b.clone().map(|e| {
        let key = config.token.clone().unwrap_or_default();
        crate::e2b::router(app.clone(), key, e, failures.clone(), audit.clone())
            .layer(observed.clone())
    });
    tracing::info!(socket = %config.socket.display(), "listening");
    if let Some(l) = &e2b_listener {
        if let Ok(a) = l.local_addr() {
            tracing::info!("serving E2B's API on {a}");
        }
    }
    if let Some(a) = tcp_addr {
        tracing::info!(
            "listening on {a}{}",
            if tls.is_some() { " (TLS)" } else { "" }
        );
    }
    ready(tcp_addr);

    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            conn = unix.accept() => match conn {
                Ok((stream, _)) => {
                    let who = stream
                        .peer_cred()
                        .map(|c| format!("unix:uid={}", c.uid()))
                        .unwrap_or_else(|_| "unix".into());
                    serve(&graceful, stream, base.clone(), Principal(who));
                }
                Err(e) => accept_failed("the unix socket", e).await,
            },
            conn = accept_tcp(tcp.as_ref()) => match conn {
                Ok((stream, peer)) => serve_tcp(&graceful, stream, peer, tcp_router.clone(), tls.clone()),
                Err(e) => accept_failed("TCP", e).await,
            },
            conn = accept_tcp(e2b_listener.as_ref()) => match (conn, &e2b_router) {
                (Ok((stream, peer)), Some(router)) => serve_tcp(&graceful, stream, peer, router.clone(), tls.clone()),
                (Ok(_), None) => {}
                (Err(e), _) => accept_failed("the E2B listener", e).await,
            },
        }
    }
    if config.pause_on_stop {
        tracing::info!("shutting down: no new connections; pausing the running sandboxes");
    } else {
        tracing::info!("shutting down: no new connections; sandboxes keep running");
    }
    drop(unix);
    let _ = std::fs::remove_file(&config.socket);
    if tokio::time::timeout(DRAIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still running after {DRAIN:?} were cut off");
    }
    reaper.abort();
    deliverer.abort();
    filler.abort();
    closer.abort();
    failed_auth.abort();
    if let Some((m, o)) = membership {
        m.abort();
        o.abort();
    }
    append_failed_authentications(&failures, &audit);
    app.registry.drain_all_pools().await;
    if config.pause_on_stop {
        let (paused, failed) = app.registry.pause_all().await;
        tracing::info!("paused {paused} sandboxes; {failed} could not be paused and run on");
    }
    Ok(())
}

/// Serves a TCP connection, through TLS when the daemon has it.
fn serve_tcp(
    graceful: &hyper_util::server::graceful::GracefulShutdown,
    stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    router: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let who = Principal(format!("tcp:{peer}"));
    match tls {
        None => serve(graceful, stream, router, who),
        Some(acceptor) => {
            let watcher = graceful.watcher();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE, acceptor.accept(stream)).await {
                    Ok(Ok(s)) => serve_watched(watcher, s, router, who).await,
                    Ok(Err(e)) => tracing::debug!("TLS handshake with {peer}: {e}"),
                    Err(_) => tracing::debug!("TLS handshake with {peer} timed out"),
                }
            });
        }
    }
}

async fn accept_tcp(
    l: Option<&TcpListener>,
) -> std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)> {
    match l {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

fn serve<S>(
    graceful: &hyper_util::server::graceful::GracefulShutdown,
    stream: S,
    router: Router,
    who: Principal,
) where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let watcher = graceful.watcher();
    tokio::spawn(serve_watched(watcher, stream, router, who));
}

async fn serve_watched<S>(
    watcher: hyper_util::server::graceful::Watcher,
    stream: S,
    router: Router,
    who: Principal,
) where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let service = hyper::service::service_fn(move |mut req: Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(who.clone());
        tower::ServiceExt::oneshot(router.clone(), req)
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // A client that opens a connection and sends nothing must not hold it forever.
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HANDSHAKE);
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
    if let Err(e) = watcher.watch(conn.into_owned()).await {
        tracing::debug!("connection ended: {e}");
    }
}

/// Closes the data directory to other users, whatever the umask made of it: it holds
/// templates' memory images, children's disks, logs and the database. Mode 0700, or
/// 0710 with the socket's group when the socket is inside it (so that the group can
/// reach the socket, and only the socket, whose own mode lets it in). Its state
/// database and audit log are 0600. A directory of another user is left as it is.
fn tighten_data_directory(config: &DaemonConfig) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let root = config.home.root();
    let owner = std::fs::metadata(root)
        .with_context(|| format!("reading {}", root.display()))?
        .uid();
    if owner != nix::unistd::geteuid().as_raw() {
        tracing::warn!(
            "{} belongs to uid {owner}: its mode is left as it is",
            root.display()
        );
        return Ok(());
    }
    let group = match config.socket_group.as_deref() {
        Some(g) if config.socket.starts_with(root) => Some(
            nix::unistd::Group::from_name(g)
                .with_context(|| format!("looking up group {g}"))?
                .with_context(|| format!("there is no group {g}"))?
                .gid,
        ),
        _ => None,
    };
    if let Some(gid) = group {
        nix::unistd::chown(root, None, Some(gid))
            .with_context(|| format!("giving {} to the socket's group", root.display()))?;
    }
    let mode = if group.is_some() { 0o710 } else { 0o700 };
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", root.display()))?;
    for file in [config.database(), config.audit_log()] {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&file)
            .with_context(|| format!("opening {}", file.display()))?;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("setting the mode of {}", file.display()))?;
    }
    Ok(())
}

/// Binds the unix socket: refuses when another daemon answers on it or the path is not
/// a socket (never removing anything else), replaces a stale socket, and gives it mode
/// 0660 (and `group`), never more open than that on its way there.
async fn bind_unix(path: &Path, group: Option<&str>) -> Result<UnixListener> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileTypeExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            bail!(
                "{} exists and is not a socket; refusing to replace it (give --socket a path of its own)",
                path.display()
            );
        }
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            bail!(
                "another forkd daemon is already listening on {} (stop it first)",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing the stale socket {}", path.display()))?;
    }
    // Bound 0600 (umask 177 while it is bound), given its group and mode, and only then
    // listening: no client connects before the socket is as open as it ends up, and
    // none of its group is refused in between. (Nothing else creates files at this
    // point of the start.)
    use nix::sys::socket::{self as sock, AddressFamily, SockFlag, SockType, UnixAddr};
    let fd = sock::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .context("making the unix socket")?;
    let addr =
        UnixAddr::new(path).with_context(|| format!("the socket path {}", path.display()))?;
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = sock::bind(fd.as_raw_fd(), &addr);
    nix::sys::stat::umask(old);
    bound.with_context(|| format!("binding {}", path.display()))?;
    // The group first, then the mode that lets it in.
    if let Some(g) = group {
        let gid = nix::unistd::Group::from_name(g)
            .with_context(|| format!("looking up group {g}"))?
            .with_context(|| format!("there is no group {g}"))?
            .gid;
        nix::unistd::chown(path, None, Some(gid))
            .with_context(|| format!("giving {} to group {g}", path.display()))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("setting the mode of {}", path.display()))?;
    sock::listen(&fd, sock::Backlog::MAXCONN)
        .with_context(|| format!("listening on {}", path.display()))?;
    let listener = UnixListener::from_std(std::os::unix::net::UnixListener::from(fd))
        .with_context(|| format!("listening on {}", path.display()))?;
    Ok(listener)
}

/// The tokens TCP clients may send, by name.
type NamedTokens = Vec<(String, String)>;

/// The audit log, checked against its key and the head the database kept; a broken
/// one refuses the start unless `--audit-reset` starts a new chain.
fn open_audit_log(config: &DaemonConfig, state: &Arc<State>) -> Result<AuditLog> {
    use crate::audit::{AuditKey, AuditLog};
    let key = AuditKey::load_or_create(&config.audit_key())?;
    let sink = |state: Arc<State>| -> crate::audit::AnchorSink {
        Box::new(move |head| state.set_audit_head(head).map_err(|e| e.to_string()))
    };
    let path = config.audit_log();
    let anchor = state.audit_head()?;
    match AuditLog::open(&path, key.clone(), anchor.as_ref(), sink(state.clone())) {
        Ok(log) => Ok(log),
        Err(e @ crate::audit::AuditError::Broken { .. }) if config.audit_reset => {
            tracing::warn!("the audit log is broken ({e}): starting a new chain");
            Ok(AuditLog::reset(&path, key, &e.to_string(), sink(state.clone()))?)
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!(
            "the audit log {} is broken; `forkd audit verify` says where; start with --audit-reset to move it aside and begin a new chain whose first record says what was found",
            path.display()
        ))),
    }
}

/// Sandbox network namespaces kept made ahead of forks (see
/// [`forkd_host::network::spares`]): two, one per restore a 2-core host runs at once.
const SPARE_NETWORKS: usize = 2;

/// The networks closed to sandboxes: the operator's `--egress-open` (recorded in the
/// audit log, since it opens what is closed by default) and the host's routes now.
async fn close_networks(config: &DaemonConfig, audit: &AuditLog) -> Result<()> {
    use forkd_host::network::{closed, refresh_closed};
    closed::open(config.egress_open.clone()).with_context(|| {
        format!(
            "recording --egress-open for the host's other daemons in {}",
            closed::OPENINGS_DIR
        )
    })?;
    let opened: Vec<String> = config.egress_open.iter().map(|n| n.to_string()).collect();
    if !opened.is_empty() {
        tracing::warn!("networks opened to sandboxes: {}", opened.join(", "));
    }
    // Every start says what it opened (`forkd doctor` reads the last one).
    audit
        .append(crate::audit::Record::event(
            "daemon",
            "START",
            crate::audit::EGRESS_OPEN,
            opened,
        ))
        .context("recording --egress-open in the audit log")?;
    refresh_closed()
        .await
        .context("reading the host's routes (/proc/net/route)")?;
    forkd_host::network::apply_host_rules()
        .await
        .context("putting the host's network rules in place")?;
    let host: Vec<String> = closed::current()
        .host()
        .iter()
        .map(|n| n.to_string())
        .collect();
    tracing::info!("host networks closed to sandboxes: {}", host.join(", "));
    // A fork the warm pool cannot serve then finds its network made.
    forkd_host::network::spares::keep(SPARE_NETWORKS);
    Ok(())
}

/// Every few seconds: the host's routes, so that a network the host joins is closed to
/// sandboxes from then on (the host's rules are applied again).
async fn follow_host_networks() {
    let mut tick = tokio::time::interval(CLOSED_CHECK_EVERY);
    loop {
        tick.tick().await;
        match forkd_host::network::refresh_closed().await {
            Ok(false) => {}
            Ok(true) => {
                let host = forkd_host::network::closed::current();
                let host: Vec<String> = host.host().iter().map(|n| n.to_string()).collect();
                tracing::info!("host networks closed to sandboxes now: {}", host.join(", "));
            }
            Err(e) => tracing::warn!("following the host's routes: {e}"),
        }
    }
}

/// Every second: stop sandboxes past their timeout, forget those whose VM died.
async fn reap(app: App) {
    let mut tick = tokio::time::interval(REAP_EVERY);
    let mut ticks = 0u64;
    loop {
        tick.tick().await;
        // Old events go once a minute or so.
        if ticks.is_multiple_of(60) {
            app.registry.events().prune(app.config.events_retention);
        }
        ticks += 1;
        for id in app.registry.reap(crate::unix_now()).await {
            tracing::info!(%id, "sandbox removed (timed out or its VM exited)");
        }
    }
}

/// Keeps the warm pools at their sizes: after every fork, every change of a size, and
/// every few seconds (a member that died, room that came back).
async fn fill_pools(app: App) {
    loop {
        app.registry.fill_pools().await;
        let _ = tokio::time::timeout(POOL_CHECK_EVERY, app.registry.pool_wakeup.notified()).await;
        // After a fork, the pools wait until its children have had their start.
        tokio::time::sleep(app.registry.pool_refill_wait()).await;
    }
}

pub mod tls;

#[cfg(test)]
mod tests {
    #[test]
    fn ids_named_by_paths() {
        assert_eq!(
            super::middleware::named_ids("/v1/sandboxes/sb-12/exec"),
            vec!["sb-12"]
        );
        assert_eq!(
            super::middleware::named_ids("/v1/snapshots/python"),
            vec!["python"]
        );
        assert!(super::middleware::named_ids("/v1/sandboxes").is_empty());
        assert!(super::middleware::named_ids("/metrics").is_empty());
    }
}
