//! The layers every request passes: authentication of TCP clients (bearer tokens,
//! rate-limited failures), the audit record written before a mutating request runs,
//! and the metrics and outcome record of every answer.

use super::{AuditIds, ErrorKind, NamedTokens, Principal};
use crate::api::{ApiError, App};
use crate::audit::{AuditLog, Record};
use axum::extract::Request;
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::FutureExt as _;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;
use subtle::ConstantTimeEq;

/// Bearer-token check for TCP listeners (constant-time comparison against each
/// token). Without a configured token (allowed on loopback only) every request passes.
/// A request that passes with a token is known by the token's name as well: its
/// principal becomes `tcp:ADDR token=NAME` for the audit log. A request without a valid
/// token is refused (see [`refused_authentication`]).
pub(super) async fn authenticate(
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
pub(super) async fn observe(
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
pub(super) async fn record_failed_authentications(
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

pub(super) fn append_failed_authentications(
    failures: &crate::auth_failures::AuthFailures,
    audit: &AuditLog,
) {
    for record in failures.audit.drain() {
        if let Err(e) = audit.append(record) {
            tracing::error!("recording failed authentications: {e}");
        }
    }
}

/// `s` cut to at most `max` bytes (on a character boundary), saying how long it was.
pub(super) fn bounded(s: &str, max: usize) -> String {
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
pub(super) fn named_ids(path: &str) -> Vec<String> {
    let parts: Vec<&str> = path.split('/').collect();
    match parts.as_slice() {
        ["", "v1", "sandboxes" | "snapshots", id, ..] => vec![(*id).to_owned()],
        _ => Vec::new(),
    }
}
