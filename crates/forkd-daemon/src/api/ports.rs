//! Ports in: a TCP port of a sandbox's guest reached through the daemon, for agents that
//! start web servers.
//!
//! - `/v1/sandboxes/{id}/ports/{port}/{path}`: an HTTP request passed to the guest's
//!   server as `/{path}` (any method, body and answer streamed). The caller's
//!   `Authorization` header, the daemon's token, is not passed on.
//! - `/v1/sandboxes/{id}/ports/{port}` with `Upgrade: tcp`: answered `101`, after which
//!   the connection is a byte stream to the port (what `forkd port-forward` uses).
//!
//! The daemon connects from inside the sandbox's network namespace, so a port is
//! reachable this way whatever the sandbox's egress policy (but not with its link off).

use super::error::ErrorBody;
use super::{ApiError, App, PathParams};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use hyper_util::rt::TokioIo;

use crate::client::TUNNEL_PROTOCOL;

/// Connects to `port` of sandbox `id`'s guest. The connection comes with the sandbox's
/// handle, which whoever carries the connection holds as long as it is open: an open
/// connection keeps the sandbox from counting as idle (see `--auto-pause-after`).
async fn connect(
    app: &App,
    id: &str,
    port: u16,
) -> Result<(tokio::net::TcpStream, crate::registry::Entry), ApiError> {
    if port == 0 {
        return Err(ApiError::bad_request("port 0 is not a port"));
    }
    let entry = crate::service::sandbox::running(app, id).await?;
    if entry.row.config.network.is_none() {
        return Err(ApiError::conflict(format!(
            "sandbox {id} has no NIC (its snapshot's template was built with network = \"none\"), so it has no ports to reach"
        )));
    }
    let guest = forkd_host::network::connect_guest(entry.row.pid, port)
        .await
        .map_err(|e| {
            let why = match e.kind() {
                std::io::ErrorKind::ConnectionRefused => {
                    format!("nothing listens on port {port} in sandbox {id}")
                }
                _ => format!("connecting to port {port} of sandbox {id}: {e}"),
            };
            ApiError::new(StatusCode::BAD_GATEWAY, "port_unreachable", why)
        })?;
    Ok((guest, entry))
}

/// An HTTP request to a port of the sandbox, at the path after the port, in any method:
/// the guest server answers it.
#[utoipa::path(method(get, post, put, patch, delete, head, options), path = "/v1/sandboxes/{id}/ports/{port}/{path}", operation_id = "port_proxy",
    params(("id" = String, Path), ("port" = u16, Path), ("path" = String, Path)),
    responses((status = 200, description = "the guest server's answer, whatever it is"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn proxy(
    State(app): State<App>,
    PathParams((id, port, path)): PathParams<(String, u16, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    forward(&app, &id, port, &path, req).await
}

/// The root of a port: `Upgrade: tcp` makes the connection a tunnel to it, anything
/// else is an HTTP request for `/`, in any method.
#[utoipa::path(method(get, post, put, patch, delete, head, options), path = "/v1/sandboxes/{id}/ports/{port}", operation_id = "port_root",
    params(("id" = String, Path), ("port" = u16, Path)),
    responses((status = 101, description = "with `Upgrade: tcp`: the connection is now the port's"),
        (status = 200, description = "without: the guest server's answer to `/`"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 502, body = ErrorBody)))]
pub async fn root(
    State(app): State<App>,
    PathParams((id, port)): PathParams<(String, u16)>,
    mut req: Request,
) -> Result<Response, ApiError> {
    let wants_tunnel = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(TUNNEL_PROTOCOL));
    if !wants_tunnel {
        return forward(&app, &id, port, "", req).await;
    }
    // Connected first, so that a port nobody listens on is an HTTP error.
    let (mut guest, entry) = connect(&app, &id, port).await?;
    let upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let _in_use = entry;
        match upgrade.await {
            Ok(upgraded) => {
                let mut caller = TokioIo::new(upgraded);
                if let Err(e) = tokio::io::copy_bidirectional(&mut caller, &mut guest).await {
                    tracing::debug!("tunnel to port {port}: {e}");
                }
            }
            Err(e) => tracing::debug!("tunnel to port {port}: the upgrade failed: {e}"),
        }
    });
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    resp.headers_mut()
        .insert(header::UPGRADE, HeaderValue::from_static(TUNNEL_PROTOCOL));
    Ok(resp)
}

/// Sends `req` to the guest's server as a request for `/{path}` (with its query).
async fn forward(
    app: &App,
    id: &str,
    port: u16,
    path: &str,
    mut req: Request,
) -> Result<Response, ApiError> {
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    *req.uri_mut() = format!("/{path}{query}")
        .parse()
        .map_err(|e| ApiError::bad_request(format!("the path {path:?}: {e}")))?;
    forward_as_is(app, id, port, req).await
}

/// Sends `req`, whose URI is already the guest server's path and query, to `port` of
/// sandbox `id`.
pub async fn forward_as_is(
    app: &App,
    id: &str,
    port: u16,
    req: Request,
) -> Result<Response, ApiError> {
    let (guest, entry) = connect(app, id, port).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(guest))
        .await
        .map_err(|e| bad_gateway(id, port, e))?;
    tokio::spawn(async move {
        let _in_use = entry;
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("proxied connection to port {port}: {e}");
        }
    });
    let (mut parts, body) = req.into_parts();
    if let Some(pq) = parts.uri.path_and_query().cloned() {
        parts.uri = pq.into();
    }
    // Credentials for forkd, not for the guest's server.
    for name in [
        header::AUTHORIZATION.as_str(),
        "x-access-token",
        "e2b-traffic-access-token",
    ] {
        parts.headers.remove(name);
    }
    parts.headers.insert(
        header::HOST,
        HeaderValue::from_str(&format!("localhost:{port}")).expect("a valid header value"),
    );
    let resp = sender
        .send_request(Request::from_parts(parts, body))
        .await
        .map_err(|e| bad_gateway(id, port, e))?;
    Ok(resp.map(Body::new))
}

fn bad_gateway(id: &str, port: u16, e: hyper::Error) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "port_unreachable",
        format!("port {port} of sandbox {id} did not answer over HTTP: {e}"),
    )
}
