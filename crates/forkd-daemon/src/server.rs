//! Running the daemon: open the state, adopt the sandboxes that survived, listen on the
//! unix socket (and TCP), authenticate, audit, and stop cleanly on a signal without
//! touching the sandboxes (they run on and are adopted by the next start).

use crate::api::{self, ApiError, App, AppState};
use crate::audit::{AuditLog, Record};
use crate::config::DaemonConfig;
use crate::registry::Registry;
use crate::state::State;
use anyhow::{bail, Context, Result};
use axum::extract::Request;
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use forkd_storage::snapshot::Store;
use futures::FutureExt as _;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};

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
    forkd_storage::oci::layout::Layout::remove_leftovers(&store);
    forkd_core::customise::remove_leftovers(&config.home);
    // Cgroups of VMs that exited while no daemon watched them.
    if let Ok(Some(cgroups)) = forkd_host::cgroup::for_vms() {
        cgroups.sweep(std::time::Duration::from_secs(60));
    }
    let mut branch_sources = Vec::new();
    for op in &interrupted {
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
    let audit = Arc::new(open_audit_log(&config, &state)?);
    close_networks(&config, &audit).await?;
    let registry = Registry::new(
        hypervisor,
        config.home.clone(),
        store,
        state,
        config.max_sandboxes,
    )
    .with_fork_parallelism(config.fork_parallelism)
    .with_memory_overcommit(config.memory_overcommit)
    .with_dns_upstream(config.dns_upstream);
    registry.recover_branches(&branch_sources).await?;
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

    let unix = bind_unix(&config.socket, config.socket_group.as_deref()).await?;
    let tcp = match config.listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("listening on {addr}"))?,
        ),
        None => None,
    };
    let e2b_listener = match &config.e2b {
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
    let tcp_addr = tcp.as_ref().and_then(|l| l.local_addr().ok());

    let app: App = Arc::new(AppState {
        registry,
        config: config.clone(),
        metrics: crate::metrics::Metrics::new(),
    });
    let reaper = tokio::spawn(reap(app.clone()));
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
    let base = api::router(app.clone())
        .merge(extra.clone())
        .layer(recorded.clone())
        .layer(observed.clone());
    let tokens = Arc::new(config.named_tokens());
    let tcp_router = api::router(app.clone())
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
    tracing::info!("shutting down: no new connections; sandboxes keep running");
    drop(unix);
    let _ = std::fs::remove_file(&config.socket);
    if tokio::time::timeout(DRAIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still running after {DRAIN:?} were cut off");
    }
    reaper.abort();
    filler.abort();
    closer.abort();
    failed_auth.abort();
    append_failed_authentications(&failures, &audit);
    app.registry.drain_all_pools().await;
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
    // Created 0600 (umask 177 while it is bound), then opened to its group: never more
    // open than it ends up. (Nothing else creates files at this point of the start.)
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(path);
    nix::sys::stat::umask(old);
    let listener = bound.with_context(|| format!("listening on {}", path.display()))?;
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
    Ok(listener)
}

/// The tokens TCP clients may send, by name.
type NamedTokens = Vec<(String, String)>;

/// Bearer-token check for TCP listeners (constant-time comparison against each
/// token). Without a configured token (allowed on loopback only) every request passes.
/// A request that passes with a token is known by the token's name as well: its
/// principal becomes `tcp:ADDR token=NAME` for the audit log. A request without a valid
/// token is refused (see [`refused_authentication`]).
async fn authenticate(
    axum::extract::State((tokens, failures)): axum::extract::State<(
        Arc<NamedTokens>,
        Arc<crate::auth_failures::AuthFailures>,
    )>,
    mut req: Request,
    next: Next,
) -> Response {
    if tokens.is_empty() {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    // Every token is compared, whichever matches: the time taken says nothing.
    let matched = given.as_deref().and_then(|g| {
        tokens.iter().fold(None, |found, (name, secret)| {
            let same = bool::from(g.as_bytes().ct_eq(secret.as_bytes()));
            found.or(same.then_some(name))
        })
    });
    if let Some(name) = matched {
        let peer = req
            .extensions()
            .get::<Principal>()
            .map(|p| p.0.clone())
            .unwrap_or_default();
        let named = Principal(format!("{peer} token={name}"));
        req.extensions_mut().insert(named.clone());
        let mut response = next.run(req).await;
        response.extensions_mut().insert(named);
        return response;
    }
    let refusal = match given {
        Some(_) => unauthorized("the bearer token is not valid"),
        None => unauthorized("this listener requires `Authorization: Bearer <token>`"),
    };
    refused_authentication(&failures, &req, refusal)
}

/// Counts a failed authentication of `req`: into its peer address's budget (see
/// [`crate::auth_failures`]) and the audit log's aggregates (see
/// [`crate::failed_auth_log`]). Answers `refusal`, or 429 once the address's budget is
/// spent; neither is audited one by one. Every TCP listener's authentication goes
/// through this.
pub(crate) fn refused_authentication(
    failures: &crate::auth_failures::AuthFailures,
    req: &Request,
    refusal: Response,
) -> Response {
    let mut r = rate_limited(failures, req).unwrap_or(refusal);
    r.extensions_mut().insert(Unaudited);
    r
}

fn rate_limited(failures: &crate::auth_failures::AuthFailures, req: &Request) -> Option<Response> {
    let now = Instant::now();
    let ip = req
        .extensions()
        .get::<Principal>()
        .and_then(|p| crate::auth_failures::peer_ip(&p.0))?;
    failures.audit.note(ip);
    if failures.is_blocked(ip, now) {
        let mut r = ApiError::new(
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            "rate_limited",
            "too many failed authentications from this address; wait, and send valid credentials",
        )
        .into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return Some(r);
    }
    failures.failed(ip, now);
    None
}

/// Marks a response the audit log does not record one by one (a refused
/// authentication, counted into the aggregates instead).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unaudited;

fn unauthorized(msg: &str) -> Response {
    let mut r =
        ApiError::new(axum::http::StatusCode::UNAUTHORIZED, "unauthorized", msg).into_response();
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    r
}

/// The longest request path an audit record keeps (the rest is counted, not kept).
const AUDITED_PATH: usize = 256;

/// Counts errors by kind and appends an audit record for every mutating request
/// (rate-limited refusals aside).
async fn observe(
    axum::extract::State((app, audit)): axum::extract::State<(App, Arc<AuditLog>)>,
    req: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let method = req.method().clone();
    let path = bounded(req.uri().path(), AUDITED_PATH);
    let principal = req
        .extensions()
        .get::<Principal>()
        .map(|p| p.0.clone())
        .unwrap_or_else(|| "unknown".into());
    // A handler that panics would take the connection down before anything is
    // recorded: answer 500 instead, so that the request is still audited and counted.
    let response = match AssertUnwindSafe(next.run(req)).catch_unwind().await {
        Ok(r) => r,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(%method, %path, "a request handler panicked: {what}");
            ApiError::internal(
                "the daemon failed while handling this request (a bug: its log has the details)",
            )
            .into_response()
        }
    };
    if let Some(kind) = response.extensions().get::<ErrorKind>() {
        app.metrics.error(kind.0);
    }
    if mutating(&method) && response.extensions().get::<Unaudited>().is_none() {
        // Authentication may have named the client further (its token).
        let principal = response
            .extensions()
            .get::<Principal>()
            .map_or(principal, |p| p.0.clone());
        let mut ids = named_ids(&path);
        if let Some(more) = response.extensions().get::<AuditIds>() {
            ids.extend(more.0.iter().cloned());
        }
        let mut record = Record::event(&principal, method.as_str(), &path, ids);
        record.status = response.status().as_u16();
        record.latency_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        if let Err(e) = audit.append(record) {
            // The request was recorded before it ran (see `record_request`): its answer
            // stands, or the caller could not tell that it ran and might run it twice.
            tracing::error!("recording the outcome of a {method} request: {e}");
        }
    }
    response
}

/// Whether a request changes something, and so is audited.
fn mutating(method: &Method) -> bool {
    matches!(
        *method,
        Method::POST | Method::PUT | Method::DELETE | Method::PATCH
    )
}

/// Records a mutating request (that passed authentication) before it runs, with
/// status 0; `observe` records its outcome after. A request that cannot be recorded is
/// not run: 507, so that nothing is ever done unrecorded.
pub(crate) async fn record_request(
    axum::extract::State(audit): axum::extract::State<Arc<AuditLog>>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(refused) = record_before(&audit, &req) {
        return refused;
    }
    next.run(req).await
}

/// Records the mutating request `req` before it runs; the answer to send instead when
/// it cannot be (507: it must not run).
pub(crate) fn record_before(audit: &AuditLog, req: &Request) -> Option<Response> {
    if mutating(req.method()) {
        let path = bounded(req.uri().path(), AUDITED_PATH);
        let principal = req
            .extensions()
            .get::<Principal>()
            .map_or_else(|| "unknown".into(), |p| p.0.clone());
        let record = Record::event(&principal, req.method().as_str(), &path, named_ids(&path));
        if let Err(e) = audit.append(record) {
            tracing::error!("{e}");
            let mut r = ApiError::new(
                axum::http::StatusCode::INSUFFICIENT_STORAGE,
                "insufficient_storage",
                format!("the audit log cannot be written, so the request was not run: {e}"),
            )
            .into_response();
            r.extensions_mut().insert(Unaudited);
            return Some(r);
        }
    }
    None
}

/// Every [`crate::failed_auth_log::WINDOW`]: the failed authentications counted, as
/// aggregate records.
async fn record_failed_authentications(
    failures: Arc<crate::auth_failures::AuthFailures>,
    audit: Arc<AuditLog>,
) {
    let mut tick = tokio::time::interval(crate::failed_auth_log::WINDOW);
    tick.tick().await;
    loop {
        tick.tick().await;
        append_failed_authentications(&failures, &audit);
    }
}

fn append_failed_authentications(failures: &crate::auth_failures::AuthFailures, audit: &AuditLog) {
    for record in failures.audit.drain() {
        if let Err(e) = audit.append(record) {
            tracing::error!("recording failed authentications: {e}");
        }
    }
}

/// `s` cut to at most `max` bytes (on a character boundary), saying how long it was.
fn bounded(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...[{} bytes]", &s[..end], s.len())
}

/// The sandbox ids and snapshot tags a path names (`/v1/sandboxes/{id}/...`,
/// `/v1/snapshots/{tag}`).
fn named_ids(path: &str) -> Vec<String> {
    let parts: Vec<&str> = path.split('/').collect();
    match parts.as_slice() {
        ["", "v1", "sandboxes" | "snapshots", id, ..] => vec![(*id).to_owned()],
        _ => Vec::new(),
    }
}

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

/// The networks closed to sandboxes: the operator's `--egress-open` (recorded in the
/// audit log, since it opens what is closed by default) and the host's routes now.
async fn close_networks(config: &DaemonConfig, audit: &AuditLog) -> Result<()> {
    use forkd_host::network::{closed, refresh_closed};
    closed::open(config.egress_open.clone());
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
    loop {
        tick.tick().await;
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

pub mod tls {
    //! The TCP listener's TLS (rustls with the ring provider).

    use crate::config::TlsFiles;
    use anyhow::{Context, Result};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use std::sync::Arc;

    /// A TLS acceptor from PEM certificate-chain and key files.
    pub fn acceptor(files: &TlsFiles) -> Result<tokio_rustls::TlsAcceptor> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
            .with_context(|| format!("reading {}", files.cert.display()))?
            .collect::<Result<_, _>>()
            .with_context(|| format!("{} is not a PEM certificate chain", files.cert.display()))?;
        if certs.is_empty() {
            anyhow::bail!("{} holds no certificate", files.cert.display());
        }
        let key = PrivateKeyDer::from_pem_file(&files.key)
            .with_context(|| format!("{} is not a PEM private key", files.key.display()))?;
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("the TLS certificate and key do not make a usable pair")?;
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_named_by_paths() {
        assert_eq!(super::named_ids("/v1/sandboxes/sb-12/exec"), vec!["sb-12"]);
        assert_eq!(super::named_ids("/v1/snapshots/python"), vec!["python"]);
        assert!(super::named_ids("/v1/sandboxes").is_empty());
        assert!(super::named_ids("/metrics").is_empty());
    }
}
