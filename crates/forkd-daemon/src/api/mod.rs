//! The REST API, v1: routes, the extractors that turn every bad request into a JSON
//! error, and the OpenAPI document generated from the handlers' annotations.

mod archive;
pub(crate) mod branch;
pub(crate) mod cluster;
mod distribution;
pub mod error;
pub(crate) mod events;
pub(crate) mod files;
mod images;
pub(crate) mod pause;
pub mod ports;
mod processes;
pub(crate) mod pty;
pub(crate) mod run;
pub(crate) mod sandboxes;
mod snapshots;
mod system;
pub mod types;

use crate::registry::Registry;
use crate::DaemonConfig;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::routing::{any, get, post, put};
use axum::Router;
pub use error::ApiError;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use utoipa::OpenApi;

/// What every handler shares.
pub struct AppState {
    /// The live sandboxes and the state database.
    pub registry: Registry,
    /// How the daemon runs.
    pub config: DaemonConfig,
    /// Metrics.
    pub metrics: crate::metrics::Metrics,
    /// The cluster this daemon is a host of, if any.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
}

/// Shared state, as handlers receive it.
pub type App = Arc<AppState>;

/// Largest JSON request body.
pub const MAX_JSON_BODY: usize = 1 << 20;

/// A JSON request body; malformed or oversized bodies answer 400 or 413 in the API's
/// error format.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| {
                if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::too_large(format!(
                        "the request body is larger than {MAX_JSON_BODY} bytes"
                    ))
                } else {
                    ApiError::bad_request(format!("reading the request body: {}", e.body_text()))
                }
            })?;
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| ApiError::bad_request(format!("the request body is not valid: {e}")))
    }
}

/// The body length a request declares (`Content-Length`), if it declares one: what an
/// upload is checked against before a byte of it is read.
pub fn declared_length(headers: &axum::http::HeaderMap) -> Option<u64> {
    headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// Path parameters; a bad one answers 400 in the API's error format.
pub struct PathParams<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for PathParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| PathParams(p.0))
            .map_err(|e| ApiError::bad_request(e.body_text()))
    }
}

/// Query parameters; a bad one answers 400 in the API's error format.
pub struct QueryParams<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for QueryParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| QueryParams(q.0))
            .map_err(|e| ApiError::bad_request(e.body_text()))
    }
}

/// The API's routes (without authentication: the listener adds it where needed).
pub fn router(app: App) -> Router {
    Router::new()
        .route("/v1/health", get(system::health))
        .route("/v1/version", get(system::version))
        .route("/v1/openapi.json", get(system::openapi))
        .route("/metrics", get(system::metrics))
        .route("/v1/snapshots", get(snapshots::list).post(snapshots::build))
        .route(
            "/v1/snapshots/{tag}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route("/v1/archives", post(archive::upload))
        .route("/v1/images", post(images::upload))
        .route("/v1/pull", post(distribution::pull))
        .route("/v1/snapshots/{tag}/push", post(distribution::push))
        .route("/v1/snapshots/{tag}/archive", get(archive::download))
        .route("/v1/snapshots/{tag}/verify", post(snapshots::verify))
        .route("/v1/snapshots/{tag}/compact", post(snapshots::compact))
        .route(
            "/v1/snapshots/{tag}/pool",
            get(snapshots::get_pool).put(snapshots::set_pool),
        )
        .route("/v1/cluster/hosts", get(cluster::hosts))
        .route(
            "/v1/cluster/hosts/{name}",
            axum::routing::delete(cluster::forget),
        )
        .route(
            "/v1/cluster/hosts/{name}/drain",
            post(cluster::drain).delete(cluster::undrain),
        )
        .route("/v1/cluster/sandboxes/{id}/take", post(cluster::take))
        .route("/v1/events", get(events::stream))
        .route("/v1/webhooks", get(events::list).post(events::register))
        .route("/v1/webhooks/{id}", get(events::get).delete(events::delete))
        .route("/v1/operations", get(snapshots::operations))
        .route(
            "/v1/operations/{id}",
            get(snapshots::operation).delete(snapshots::cancel_operation),
        )
        .route(
            "/v1/sandboxes",
            get(sandboxes::list).post(sandboxes::create),
        )
        .route(
            "/v1/sandboxes/{id}",
            get(sandboxes::get).delete(sandboxes::delete),
        )
        .route("/v1/sandboxes/{id}/timeout", put(sandboxes::set_timeout))
        .route("/v1/sandboxes/{id}/network", put(sandboxes::set_network))
        .route("/v1/sandboxes/{id}/ports/{port}", any(ports::root))
        .route("/v1/sandboxes/{id}/ports/{port}/", any(ports::root))
        .route("/v1/sandboxes/{id}/ports/{port}/{*path}", any(ports::proxy))
        .route("/v1/sandboxes/{id}/branch", post(branch::branch))
        .route("/v1/sandboxes/{id}/pause", post(pause::pause))
        .route("/v1/sandboxes/{id}/resume", post(pause::resume))
        .route("/v1/sandboxes/{id}/exec", post(run::exec))
        .route("/v1/sandboxes/{id}/pty", get(pty::pty))
        .route("/v1/sandboxes/{id}/code", post(run::run_code))
        .route(
            "/v1/sandboxes/{id}/processes",
            get(processes::list).post(processes::start),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{process}",
            get(processes::get).delete(processes::kill),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{process}/wait",
            post(processes::wait),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{process}/signal",
            post(processes::signal),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{process}/stdin",
            post(processes::stdin),
        )
        .route(
            "/v1/sandboxes/{id}/contexts",
            get(run::list_contexts).post(run::create_context),
        )
        .route(
            "/v1/sandboxes/{id}/contexts/{context}",
            axum::routing::delete(run::delete_context),
        )
        .route(
            "/v1/sandboxes/{id}/contexts/{context}/reset",
            post(run::reset_context),
        )
        .route(
            "/v1/sandboxes/{id}/files",
            get(files::read).put(files::write).delete(files::remove),
        )
        .route("/v1/sandboxes/{id}/files/list", get(files::list))
        .route("/v1/sandboxes/{id}/files/stat", get(files::stat))
        .route("/v1/sandboxes/{id}/files/mkdir", post(files::mkdir))
        .route("/v1/sandboxes/{id}/files/rename", post(files::rename))
        .route("/v1/sandboxes/{id}/files/watch", get(files::watch))
        .fallback(system::not_found)
        .method_not_allowed_fallback(system::method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_JSON_BODY))
        .with_state(app)
}

/// The OpenAPI document of API v1.
#[derive(OpenApi)]
#[openapi(
    info(title = "forkd", description = "microVM sandboxes forked from warm snapshots"),
    paths(
        system::health,
        system::version,
        snapshots::list,
        snapshots::get,
        snapshots::delete,
        snapshots::build,
        snapshots::verify,
        snapshots::compact,
        archive::download,
        archive::upload,
        images::upload,
        distribution::push,
        distribution::pull,
        snapshots::get_pool,
        snapshots::set_pool,
        snapshots::operations,
        snapshots::operation,
        snapshots::cancel_operation,
        sandboxes::create,
        sandboxes::list,
        sandboxes::get,
        sandboxes::delete,
        sandboxes::set_timeout,
        sandboxes::set_network,
        ports::root,
        ports::proxy,
        branch::branch,
        pause::pause,
        pause::resume,
        run::exec,
        run::run_code,
        run::list_contexts,
        run::create_context,
        run::reset_context,
        run::delete_context,
        processes::start,
        processes::list,
        processes::get,
        processes::wait,
        processes::signal,
        processes::stdin,
        processes::kill,
        files::read,
        files::write,
        files::remove,
        files::list,
        files::stat,
        files::mkdir,
        files::rename,
        files::watch,
        pty::pty,
        events::stream,
        events::register,
        events::list,
        events::get,
        events::delete,
        cluster::hosts,
        cluster::forget,
        cluster::drain,
        cluster::undrain,
        cluster::take,
    ),
    // The NDJSON line of a streamed exec: no path returns it as its body, but clients
    // (the SDKs) need its schema.
    components(schemas(
        types::ExecEventBody,
        crate::state::EventRow,
        pty::PtyClientMessage,
        pty::PtyServerMessage
    )),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

/// Declares the bearer token scheme (required on TCP listeners).
struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// A guest path given by a client: absolute, no NUL, bounded.
pub fn guest_path(p: &str) -> Result<&str, ApiError> {
    if !p.starts_with('/') || p.contains('\0') || p.len() > 4096 {
        return Err(ApiError::bad_request(format!(
            "{:?} is not an absolute guest path",
            p.chars().take(80).collect::<String>()
        )));
    }
    Ok(p)
}

/// `application/x-www-form-urlencoded` pairs, decoded.
pub(crate) fn form_pairs(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let escaped = (b[i] == b'%')
            .then(|| s.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (b[i], escaped) {
            (_, Some(v)) => {
                out.push(v);
                i += 3;
            }
            (b'+', None) => {
                out.push(b' ');
                i += 1;
            }
            (c, None) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
