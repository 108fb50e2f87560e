//! Requests for a sandbox that another host of the cluster owns are forwarded to it,
//! whole: method, path, query, headers and body as they come (streamed both ways), and
//! an upgrade (a terminal's WebSocket, a port-forward's tunnel) joined end to end. The
//! client never knows. Which host owns a sandbox is the service layer's one lookup
//! ([`crate::service::cluster::locate`]).

use crate::api::{ApiError, App};
use crate::service::cluster::{locate, unreachable, Asked, Located, FORWARDED_BY};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

/// The sandbox a path names, if it is one of `/v1/sandboxes/{id}[/...]`.
fn sandbox_of(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/sandboxes/")?;
    let id = rest.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// Serves the request here, or forwards it to the host that owns its sandbox.
pub async fn to_owner(State(app): State<App>, req: Request, next: Next) -> Response {
    if app.cluster.is_none() {
        return next.run(req).await;
    }
    let Some(id) = sandbox_of(req.uri().path()).map(str::to_owned) else {
        return next.run(req).await;
    };
    let asked = Asked {
        forwarded: req.headers().contains_key(FORWARDED_BY),
        removal: req.method() == axum::http::Method::DELETE
            && req.uri().path().trim_end_matches('/') == format!("/v1/sandboxes/{id}"),
    };
    match locate(&app, &id, asked).await {
        Ok(Located::Here) => next.run(req).await,
        Ok(Located::Remote(r)) => forward(&app, &id, &r.host, Hop::Rest(&r.address), req).await,
        Ok(Located::Removed) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

/// How a request reaches the owner.
pub enum Hop<'a> {
    /// Its REST API at this address, with the cluster's token.
    Rest(&'a str),
    /// Its E2B listener at this address, the request as it came (its host name and
    /// tokens are the owner's to check).
    E2b(&'a str),
}

/// Sends `req` (for sandbox `id`) to its owner `host` and answers with what it answers.
pub async fn forward(app: &App, id: &str, host: &str, hop: Hop<'_>, mut req: Request) -> Response {
    let cluster = app
        .cluster
        .as_deref()
        .expect("forwarding happens in a cluster");
    let upgrade = req
        .headers()
        .contains_key(axum::http::header::UPGRADE)
        .then(|| hyper::upgrade::on(&mut req));
    if let Ok(me) = HeaderValue::from_str(cluster.host_name()) {
        req.headers_mut().insert(FORWARDED_BY, me);
    }
    let (address, sent) = match hop {
        Hop::Rest(a) => (
            a,
            crate::service::cluster::peer(app, cluster, a, true)
                .forward(req)
                .await,
        ),
        Hop::E2b(a) => (
            a,
            crate::service::cluster::peer(app, cluster, a, false)
                .relay(req)
                .await,
        ),
    };
    let mut answer = match sent {
        Ok(a) => a,
        Err(e) => {
            // Looked up again next time: the host may be back at another address.
            cluster.forget(id);
            return unreachable(id, host, &format!("{address} does not answer: {e:#}"))
                .into_response();
        }
    };
    if answer.status() == StatusCode::SWITCHING_PROTOCOLS {
        match upgrade {
            Some(ours) => {
                let theirs = hyper::upgrade::on(&mut answer);
                tokio::spawn(async move {
                    let (Ok(ours), Ok(theirs)) = (ours.await, theirs.await) else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(
                        &mut TokioIo::new(ours),
                        &mut TokioIo::new(theirs),
                    )
                    .await;
                });
            }
            None => {
                return ApiError::internal(format!("host {host} switched protocols unasked"))
                    .into_response()
            }
        }
    }
    let (parts, body) = answer.into_parts();
    Response::from_parts(parts, Body::new(body))
}

#[cfg(test)]
mod tests {
    use super::sandbox_of;

    #[test]
    fn sandbox_paths_name_their_sandbox() {
        assert_eq!(sandbox_of("/v1/sandboxes/sb-1"), Some("sb-1"));
        assert_eq!(sandbox_of("/v1/sandboxes/sb-1/exec"), Some("sb-1"));
        assert_eq!(sandbox_of("/v1/sandboxes"), None);
        assert_eq!(sandbox_of("/v1/sandboxes/"), None);
        assert_eq!(sandbox_of("/v1/snapshots/x"), None);
    }
}
