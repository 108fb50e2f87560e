//! E2B compatibility: a listener of its own on which E2B's unmodified SDKs drive forkd.
//!
//! One listener serves three things, told apart per request:
//! - the control plane (`/v2/sandboxes`, `/sandboxes/{id}/...`: [`control`]), authenticated
//!   by `X-API-KEY`, which must be the daemon's token;
//! - "envd", E2B's in-sandbox daemon (port 49983): Connect RPCs for processes
//!   ([`process`]) and the filesystem ([`filesystem`]), and `/files` ([`files`]);
//! - the code interpreter (port 49999: [`interpreter`]).
//!
//! In-sandbox requests name their sandbox and port in the `E2b-Sandbox-Id` and
//! `E2b-Sandbox-Port` headers (what the SDKs send when `E2B_SANDBOX_URL` is set), or in
//! the host name, `<port>-<id>.<domain>` (what they do otherwise, over TLS with a
//! wildcard certificate). They carry the sandbox's access token, which the control
//! plane hands out with the sandbox: an HMAC of the sandbox's id under the daemon's
//! token, so nothing needs storing and no token opens another sandbox.
//!
//! Everything is translated onto forkd's agent; nothing of E2B runs in the guest.

mod cluster_wide;
pub mod connect;
mod control;
mod files;
mod filesystem;
mod interpreter;
mod network;
mod process;
mod watch;

use crate::api::App;
use crate::service::cluster::{locate, Asked, Located, FORWARDED_BY};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use base64::Engine as _;
use connect::{Code, RpcError};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::collections::BTreeMap;
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// The port of E2B's in-sandbox daemon.
pub const ENVD_PORT: u16 = 49983;
/// The port of E2B's code interpreter.
pub const INTERPRETER_PORT: u16 = 49999;
/// The envd version reported to the SDKs. They gate features on it; 0.6.4 unlocks every
/// feature of the current SDKs that forkd serves (see docs/e2b.md for what it does not).
pub const ENVD_VERSION: &str = "0.6.4";

/// The user commands and file calls run as when the SDK names none (E2B's default; the
/// guest images have it, see docs/e2b.md).
pub const DEFAULT_USER: &str = "user";

/// A guest path as E2B gives it: absolute, or relative to `user`'s home directory
/// (`/root` for root, `/home/<user>` for others); empty means the home itself.
pub(crate) fn resolve(user: &str, path: &str) -> Result<String, RpcError> {
    let full = if path.starts_with('/') {
        path.to_owned()
    } else {
        let home = if user == "root" {
            "/root".to_owned()
        } else {
            format!("/home/{user}")
        };
        if path.is_empty() {
            home
        } else {
            format!("{home}/{path}")
        }
    };
    crate::api::guest_path(&full)?;
    Ok(full)
}

/// The user a call runs as: `Authorization: Basic base64("<user>:")`, else `user`.
pub(crate) fn user_of(h: &HeaderMap) -> Result<String, RpcError> {
    let Some(v) = h.get(axum::http::header::AUTHORIZATION) else {
        return Ok(DEFAULT_USER.to_owned());
    };
    let decoded = v
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| {
            base64::engine::general_purpose::STANDARD
                .decode(b.trim())
                .ok()
        })
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| RpcError::new(Code::InvalidArgument, "Authorization is not Basic auth"))?;
    let user = decoded.split(':').next().unwrap_or_default();
    if user.is_empty() {
        return Ok(DEFAULT_USER.to_owned());
    }
    Ok(user.to_owned())
}

/// How the E2B listener runs.
#[derive(Debug, Clone)]
pub struct E2bConfig {
    /// Where it listens.
    pub listen: std::net::SocketAddr,
    /// E2B template names and the forkd snapshots they stand for (`base` and
    /// `code-interpreter-v1` are the SDKs' defaults).
    pub aliases: BTreeMap<String, String>,
    /// The domain handed to SDKs, for routing by host name (`<port>-<id>.<domain>`).
    pub domain: Option<String>,
}

impl E2bConfig {
    /// Listening on `listen`, the SDKs' default templates standing for `python`.
    pub fn new(listen: std::net::SocketAddr) -> E2bConfig {
        let aliases = [("base", "python"), ("code-interpreter-v1", "python")]
            .into_iter()
            .map(|(a, b)| (a.to_owned(), b.to_owned()))
            .collect();
        E2bConfig {
            listen,
            aliases,
            domain: None,
        }
    }
}

/// What the E2B handlers share.
pub struct E2b {
    app: App,
    key: String,
    config: E2bConfig,
    /// Failed authentications by address, shared with the daemon's own TCP listener.
    failures: Arc<crate::auth_failures::AuthFailures>,
    processes: process::Table,
    /// Polled directory watchers.
    watchers: watch::Watchers,
    /// Where what passes is recorded before it runs.
    audit: Arc<crate::audit::AuditLog>,
}

type Shared = Arc<E2b>;

impl E2b {
    /// The running sandbox an in-sandbox request is for. One that is not there is
    /// `unavailable` ("... was not found"), which the SDKs read as a sandbox no longer
    /// running, not as a missing file or process.
    /// A paused sandbox is resumed first (see [`crate::service::sandbox::running`]).
    async fn sandbox(&self, id: &str) -> Result<Arc<forkd_core::Sandbox>, RpcError> {
        use forkd_core::SandboxError as E;
        crate::service::sandbox::resume_if_paused(&self.app, id)
            .await
            .map_err(|e| RpcError::new(Code::Unavailable, e.message))?;
        match self.app.registry.get(id) {
            Ok(e) => Ok(e.sandbox),
            Err(E::NotFound { .. } | E::Gone { .. } | E::Destroyed { .. }) => Err(RpcError::new(
                Code::Unavailable,
                format!("the sandbox {id} was not found"),
            )),
            Err(e) => Err(e.into()),
        }
    }

    /// The access token of sandbox `id`.
    fn access_token(&self, id: &str) -> String {
        // HMAC accepts keys of any length: this cannot fail.
        let mut mac = Hmac::<Sha256>::new_from_slice(self.key.as_bytes()).expect("any key");
        mac.update(b"forkd e2b access token\0");
        mac.update(id.as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }
}

/// The sandbox an in-sandbox request is for.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The sandbox's id.
    pub id: String,
    /// The port asked for.
    pub port: u16,
}

/// The E2B listener's routes. `key` is the API key SDKs must send (the daemon's token);
/// what passes is recorded in `audit` before it runs.
pub fn router(
    app: App,
    key: String,
    config: E2bConfig,
    failures: Arc<crate::auth_failures::AuthFailures>,
    audit: Arc<crate::audit::AuditLog>,
) -> Router {
    let shared = Arc::new(E2b {
        app,
        key,
        config,
        failures,
        processes: process::Table::default(),
        watchers: watch::Watchers::default(),
        audit: audit.clone(),
    });
    // Bodies are read whole, except uploads, which stream to the guest.
    let limit = axum::extract::DefaultBodyLimit::max(connect::MAX_MESSAGE);
    let routes = Router::new()
        .merge(control::routes().layer(limit))
        .nest(
            "/_envd",
            process::routes()
                .merge(filesystem::routes())
                .layer(limit)
                .merge(files::routes().layer(axum::extract::DefaultBodyLimit::disable())),
        )
        .nest("/_interpreter", interpreter::routes().layer(limit))
        .fallback(not_found)
        .with_state(shared.clone())
        // Inside `route`, which authenticates: what passed is recorded before it runs.
        .layer(axum::middleware::from_fn_with_state(
            audit,
            crate::server::record_request,
        ));
    // The middleware rewrites in-sandbox paths, so it runs before the routes do: the
    // routes are the service of an outer router's fallback, under its layer.
    Router::new()
        .fallback_service(routes)
        .layer(axum::middleware::from_fn_with_state(shared, route))
}

async fn not_found(uri: Uri) -> Response {
    control::error(
        StatusCode::NOT_FOUND,
        format!("{} is not a route of forkd's E2B API", uri.path()),
    )
}

/// Tells control-plane requests from in-sandbox ones, checks their credentials and
/// sends in-sandbox requests to their port's routes.
async fn route(State(e2b): State<Shared>, mut req: Request, next: Next) -> Response {
    let authority = req.uri().authority().map(|a| a.as_str().to_owned());
    let target = match target_of(
        req.headers(),
        authority.as_deref(),
        e2b.config.domain.as_deref(),
    ) {
        Ok(t) => t,
        Err(m) => return control::error(StatusCode::BAD_REQUEST, m),
    };
    let Some(target) = target else {
        if req.uri().path().starts_with("/_") {
            return not_found(req.uri().clone()).await;
        }
        return match api_key_ok(&e2b, req.headers()) {
            Ok(()) => match control_sandbox(req.uri().path()).map(str::to_owned) {
                Some(id) => to_owner(&e2b, &id, req, next).await,
                None => next.run(req).await,
            },
            Err(m) => crate::server::refused_authentication(
                &e2b.failures,
                &req,
                control::error(StatusCode::UNAUTHORIZED, m),
            ),
        };
    };
    if let Err(m) = access_ok(&e2b, &target, req.headers()) {
        let refusal = (StatusCode::UNAUTHORIZED, m).into_response();
        return crate::server::refused_authentication(&e2b.failures, &req, refusal);
    }
    match served_at(&e2b, &target.id, req.headers(), false).await {
        Ok(Located::Here | Located::Removed) => {}
        Ok(Located::Remote(r)) => return forward_e2b(&e2b, &target.id, r, req).await,
        Err(e) => return e.into_response(),
    }
    let prefix = match target.port {
        ENVD_PORT => "/_envd",
        INTERPRETER_PORT => "/_interpreter",
        // Any other port is the guest's own (a server the sandbox runs): passed on as
        // it came, through the sandbox's network namespace.
        port => {
            if let Some(refused) = crate::server::record_before(&e2b.audit, &req) {
                return refused;
            }
            let id = target.id.clone();
            return crate::api::ports::forward_as_is(&e2b.app, &id, port, req)
                .await
                .unwrap_or_else(|e| e.into_response());
        }
    };
    let path_and_query = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let Ok(uri) = format!("{prefix}{path_and_query}").parse::<Uri>() else {
        return (StatusCode::BAD_REQUEST, "a bad request path").into_response();
    };
    *req.uri_mut() = uri;
    req.extensions_mut().insert(target);
    next.run(req).await
}

/// The sandbox a control-plane path names (`/sandboxes/{id}[/...]`,
/// `/v2/sandboxes/{id}/...`).
fn control_sandbox(path: &str) -> Option<&str> {
    let rest = path
        .strip_prefix("/v2/sandboxes/")
        .or_else(|| path.strip_prefix("/sandboxes/"))?;
    rest.split('/').next().filter(|id| !id.is_empty())
}

/// Where a request for sandbox `id` is served ([`locate`]): here outside a cluster.
async fn served_at(
    e2b: &E2b,
    id: &str,
    headers: &HeaderMap,
    removal: bool,
) -> Result<Located, crate::api::ApiError> {
    if e2b.app.cluster.is_none() {
        return Ok(Located::Here);
    }
    let asked = Asked {
        forwarded: headers.contains_key(FORWARDED_BY),
        removal,
    };
    locate(&e2b.app, id, asked).await
}

/// Serves a control-plane request for sandbox `id` here, or at its owner's.
async fn to_owner(e2b: &E2b, id: &str, req: Request, next: Next) -> Response {
    // A kill (`DELETE /sandboxes/{id}`) of a parked sandbox needs no host.
    let removal = req.method() == axum::http::Method::DELETE
        && req.uri().path().trim_end_matches('/') == format!("/sandboxes/{id}");
    match served_at(e2b, id, req.headers(), removal).await {
        Ok(Located::Here) => next.run(req).await,
        Ok(Located::Remote(r)) => forward_e2b(e2b, id, r, req).await,
        Ok(Located::Removed) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => control::error(e.status, e.message),
    }
}

/// Forwards an E2B request for sandbox `id` as it came to the E2B listener of its
/// owner `r`.
async fn forward_e2b(e2b: &E2b, id: &str, r: crate::cluster::Remote, req: Request) -> Response {
    use crate::server::forward::{forward, Hop};
    match &r.e2b_address {
        Some(a) => forward(&e2b.app, id, &r.host, Hop::E2b(a), req).await,
        None => control::error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the sandbox {id} is on host {}, which serves no E2B API (start it with --e2b-listen)",
                r.host
            ),
        ),
    }
}

/// The sandbox and port an in-sandbox request names: by header, else by host name under
/// the configured domain (the `Host` header, or HTTP/2's authority). None for a
/// control-plane request.
fn target_of(
    h: &HeaderMap,
    authority: Option<&str>,
    domain: Option<&str>,
) -> Result<Option<Target>, String> {
    let text = |name: &str| h.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(id) = text("e2b-sandbox-id") {
        let port = match text("e2b-sandbox-port") {
            Some(p) => p
                .parse()
                .map_err(|_| format!("E2b-Sandbox-Port {p:?} is not a port"))?,
            None => ENVD_PORT,
        };
        return Ok(Some(Target {
            id: id.to_owned(),
            port,
        }));
    }
    let (Some(domain), Some(host)) = (domain, text(header::HOST.as_str()).or(authority)) else {
        return Ok(None);
    };
    // Host names are case-insensitive; sandbox ids are lower case.
    let host = host.split(':').next().unwrap_or(host).to_ascii_lowercase();
    let domain = domain.to_ascii_lowercase();
    let Some(label) = host
        .strip_suffix(domain.as_str())
        .and_then(|l| l.strip_suffix('.'))
    else {
        return Ok(None);
    };
    let Some((port, id)) = label.split_once('-') else {
        return Ok(None);
    };
    let Ok(port) = port.parse() else {
        return Ok(None);
    };
    Ok(Some(Target {
        id: id.to_owned(),
        port,
    }))
}

fn api_key_ok(e2b: &E2b, h: &HeaderMap) -> Result<(), String> {
    let given = h.get("x-api-key").and_then(|v| v.to_str().ok());
    match given {
        Some(k) if bool::from(k.trim().as_bytes().ct_eq(e2b.key.as_bytes())) => Ok(()),
        Some(_) => Err("the API key is not valid (it is the forkd daemon's token)".into()),
        None => Err("send the API key (the forkd daemon's token) in X-API-KEY".into()),
    }
}

/// In-sandbox requests carry the sandbox's access token: envd's as `X-Access-Token`; the
/// code interpreter's SDK sends that header only on `/execute`, and its traffic token
/// (`E2B-Traffic-Access-Token`, the same value) on every call.
fn access_ok(e2b: &E2b, t: &Target, h: &HeaderMap) -> Result<(), String> {
    let want = e2b.access_token(&t.id);
    let matches = |name: &str| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| bool::from(v.trim().as_bytes().ct_eq(want.as_bytes())))
    };
    if matches("x-access-token") || matches("e2b-traffic-access-token") {
        return Ok(());
    }
    Err(format!(
        "requests to sandbox {} need its access token (X-Access-Token), which the create call returned",
        t.id
    ))
}

#[cfg(test)]
mod tests {
    //! Who gets through the E2B listener, and where requests go. No sandbox runs: these
    //! are the checks made before one is reached.

    use super::*;
    use crate::api::AppState;
    use crate::registry::Registry;
    use crate::state::State as Db;
    use axum::body::Body;
    use forkd_image::Home;
    use forkd_storage::snapshot::Store;
    use tower::ServiceExt;

    const KEY: &str = "e2b-unit-test-key-0123456789abcdef0123";

    fn listener(dir: &std::path::Path) -> (Router, Arc<E2b>) {
        let home = Home::new(dir);
        let state = Arc::new(Db::open(&dir.join("forkd.db")).unwrap());
        let registry = Registry::new(
            Arc::new(forkd_hypervisor::fake::AgentProcesses::new("/nonexistent")),
            home.clone(),
            Store::of_home(&home),
            state,
            4,
        );
        let app = Arc::new(AppState {
            registry,
            config: crate::DaemonConfig::new(home),
            metrics: crate::metrics::Metrics::new(),
            cluster: None,
        });
        let mut config = E2bConfig::new("127.0.0.1:0".parse().unwrap());
        config.domain = Some("e2b.test".into());
        let audit = Arc::new(
            crate::audit::AuditLog::open(
                &dir.join("audit.jsonl"),
                crate::audit::AuditKey::load_or_create(&dir.join("audit.key")).unwrap(),
                None,
                Box::new(|_| Ok(())),
            )
            .unwrap(),
        );
        let shared = Arc::new(E2b {
            app: app.clone(),
            key: KEY.into(),
            config: config.clone(),
            failures: Default::default(),
            processes: process::Table::default(),
            watchers: watch::Watchers::default(),
            audit: audit.clone(),
        });
        let r = router(app, KEY.into(), config, Default::default(), audit);
        (r, shared)
    }

    async fn send(r: &Router, req: axum::http::Request<Body>) -> (StatusCode, serde_json::Value) {
        let resp = r.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        let v = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&bytes).into()));
        (status, v)
    }

    fn get(path: &str) -> axum::http::request::Builder {
        axum::http::Request::get(path)
    }

    #[tokio::test]
    async fn an_address_that_keeps_failing_is_refused_with_429() {
        let dir = tempfile::tempdir().unwrap();
        let (r, _) = listener(dir.path());
        let from = |ip: &str, key: &str| {
            let mut req = get("/v2/sandboxes")
                .header("x-api-key", key)
                .body(Body::empty())
                .unwrap();
            req.extensions_mut()
                .insert(crate::server::Principal(format!("tcp:{ip}:40000")));
            req
        };
        let burst = crate::auth_failures::BURST_FAILURES;
        for _ in 0..burst {
            let (s, v) = send(&r, from("192.0.2.7", "e2b_wrong")).await;
            assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
        }
        let (s, v) = send(&r, from("192.0.2.7", "e2b_wrong")).await;
        assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
        // In-sandbox requests with a wrong token count against the same budget.
        let mut req = from("192.0.2.7", "e2b_wrong");
        req.headers_mut()
            .insert("e2b-sandbox-id", "sb-000000000000".parse().unwrap());
        assert_eq!(send(&r, req).await.0, StatusCode::TOO_MANY_REQUESTS);
        // Another address, and the valid key, still get through.
        assert_eq!(
            send(&r, from("192.0.2.8", "e2b_wrong")).await.0,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(send(&r, from("192.0.2.8", KEY)).await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn every_pause_and_resume_mode_is_taken_and_a_missing_sandbox_is_404() {
        let dir = tempfile::tempdir().unwrap();
        let (r, _) = listener(dir.path());
        let post = |path: &str, body: &str| {
            axum::http::Request::post(path)
                .header("x-api-key", KEY)
                .header("content-type", "application/json")
                .body(Body::from(body.to_owned()))
                .unwrap()
        };
        // Full and filesystem pauses, restoring and rebooting connects, and a create
        // with auto-resume off and a filesystem pause at its timeout all reach the
        // sandbox (or template), which is not there: 404, which the SDKs raise as not
        // found.
        for (path, body) in [
            ("/sandboxes/sb-000000000001/pause", "{}"),
            ("/sandboxes/sb-000000000001/pause", r#"{"memory": true}"#),
            ("/sandboxes/sb-000000000001/pause", r#"{"memory": false}"#),
            (
                "/v2/sandboxes/sb-000000000001/connect",
                r#"{"timeout": 30}"#,
            ),
            (
                "/v2/sandboxes/sb-000000000001/connect",
                r#"{"memory": false}"#,
            ),
            (
                "/v2/sandboxes",
                r#"{"templateID": "python", "autoPause": true, "autoPauseMemory": false, "autoResume": {"enabled": false}}"#,
            ),
        ] {
            let (s, v) = send(&r, post(path, body)).await;
            assert_eq!(s, StatusCode::NOT_FOUND, "{path} {body}: {v}");
        }
        let (s, v) = send(
            &r,
            post("/sandboxes/sb-000000000001/pause", r#"{"memory": 1}"#),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    }

    #[tokio::test]
    async fn the_control_plane_needs_the_api_key() {
        let dir = tempfile::tempdir().unwrap();
        let (r, _) = listener(dir.path());
        let (s, v) = send(&r, get("/v2/sandboxes").body(Body::empty()).unwrap()).await;
        assert_eq!(
            (s, v["code"].as_u64()),
            (StatusCode::UNAUTHORIZED, Some(401)),
            "{v}"
        );
        let req = get("/v2/sandboxes")
            .header("x-api-key", "e2b_wrong")
            .body(Body::empty());
        let (s, v) = send(&r, req.unwrap()).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        assert!(v["message"].as_str().unwrap().contains("not valid"), "{v}");
        let req = get("/v2/sandboxes")
            .header("x-api-key", KEY)
            .body(Body::empty());
        assert_eq!(
            send(&r, req.unwrap()).await,
            (StatusCode::OK, serde_json::json!([]))
        );
        // A template that names no snapshot.
        let req = axum::http::Request::post("/v2/sandboxes")
            .header("x-api-key", KEY)
            .header("content-type", "application/json")
            .body(Body::from(r#"{"templateID": "nothing-here"}"#));
        let (s, v) = send(&r, req.unwrap()).await;
        assert_eq!(
            (s, v["code"].as_u64()),
            (StatusCode::NOT_FOUND, Some(404)),
            "{v}"
        );
        // The in-sandbox routes are not reachable as control-plane paths.
        let req = get("/_envd/health")
            .header("x-api-key", KEY)
            .body(Body::empty());
        assert_eq!(send(&r, req.unwrap()).await.0, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn sandbox_requests_need_that_sandbox_s_token() {
        let dir = tempfile::tempdir().unwrap();
        let (r, e2b) = listener(dir.path());
        let stat = |token: Option<String>, id: &str, port: &str| {
            let mut b = axum::http::Request::post("/filesystem.Filesystem/Stat")
                .header("e2b-sandbox-id", id)
                .header("e2b-sandbox-port", port)
                .header("content-type", "application/json");
            if let Some(t) = token {
                b = b.header("x-access-token", t);
            }
            b.body(Body::from(r#"{"path": "/"}"#)).unwrap()
        };
        let (s, _) = send(&r, stat(None, "sb-000000000001", "49983")).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        // Another sandbox's token opens nothing here.
        let other = e2b.access_token("sb-000000000002");
        let (s, _) = send(&r, stat(Some(other), "sb-000000000001", "49983")).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
        // The right token gets through, to a sandbox that does not exist: `unavailable`
        // with "was not found", which the SDKs read as a sandbox no longer running.
        let token = e2b.access_token("sb-000000000001");
        let (s, v) = send(&r, stat(Some(token.clone()), "sb-000000000001", "49983")).await;
        assert_eq!(
            (s, v["code"].as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, Some("unavailable")),
            "{v}"
        );
        assert!(
            v["message"].as_str().unwrap().contains("was not found"),
            "{v}"
        );
        // Another port is the guest's own: a sandbox that is not there is not found.
        let (s, _) = send(&r, stat(Some(token), "sb-000000000001", "8080")).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        // And the token is checked first.
        let (s, _) = send(&r, stat(None, "sb-000000000001", "8080")).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
    }

    #[tokio::test]
    async fn an_upload_declaring_more_than_the_limit_is_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let (r, e2b) = listener(dir.path());
        let id = "sb-000000000001";
        let req = axum::http::Request::post("/files?path=/root/big")
            .header("e2b-sandbox-id", id)
            .header("e2b-sandbox-port", "49983")
            .header("x-access-token", e2b.access_token(id))
            .header("content-type", "application/octet-stream")
            .header("content-length", (5u64 << 30).to_string())
            .body(Body::empty())
            .unwrap();
        // Refused before the sandbox is even looked for (there is none).
        let (s, v) = send(&r, req).await;
        assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
        assert!(v.to_string().contains("5368709120"), "{v}");
    }

    #[test]
    fn targets_come_from_headers_or_host_names() {
        let mut h = HeaderMap::new();
        assert!(target_of(&h, None, Some("e2b.test")).unwrap().is_none());
        h.insert(
            header::HOST,
            "49999-sb-0123456789ab.e2b.test".parse().unwrap(),
        );
        let t = target_of(&h, None, Some("e2b.test")).unwrap().unwrap();
        assert_eq!(
            (t.id.as_str(), t.port),
            ("sb-0123456789ab", INTERPRETER_PORT)
        );
        // Another domain, or none configured: the control plane.
        assert!(target_of(&h, None, Some("other.test")).unwrap().is_none());
        assert!(target_of(&h, None, None).unwrap().is_none());
        h.insert(
            header::HOST,
            "49983-SB-0123456789AB.E2B.test".parse().unwrap(),
        );
        let t = target_of(&h, None, Some("e2b.test")).unwrap().unwrap();
        assert_eq!((t.id.as_str(), t.port), ("sb-0123456789ab", ENVD_PORT));
        h.remove(header::HOST);
        let t = target_of(&h, Some("49983-sb-1.e2b.test:443"), Some("e2b.test")).unwrap();
        assert_eq!(t.unwrap().id, "sb-1");
        h.insert(header::HOST, "e2b.test:443".parse().unwrap());
        assert!(target_of(&h, None, Some("e2b.test")).unwrap().is_none());
        // Headers win, and a bad port is refused.
        h.insert("e2b-sandbox-id", "sb-1".parse().unwrap());
        assert_eq!(target_of(&h, None, None).unwrap().unwrap().port, ENVD_PORT);
        h.insert("e2b-sandbox-port", "nope".parse().unwrap());
        assert!(target_of(&h, None, None).is_err());
    }

    #[test]
    fn relative_paths_are_in_the_user_s_home() {
        assert_eq!(resolve("user", "").unwrap(), "/home/user");
        assert_eq!(resolve("user", "a/b").unwrap(), "/home/user/a/b");
        assert_eq!(resolve("root", "x").unwrap(), "/root/x");
        assert_eq!(resolve("user", "/etc/hosts").unwrap(), "/etc/hosts");
        assert!(resolve("user", "a\0b").is_err());
    }
}
