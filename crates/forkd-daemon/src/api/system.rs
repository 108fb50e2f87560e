//! Health, version, the OpenAPI document, metrics, and the answers to unknown routes.

use super::types::{Health, Version};
use super::{ApiDoc, ApiError, App};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use utoipa::OpenApi;

/// Whether the daemon answers, and how full it is.
#[utoipa::path(get, path = "/v1/health", responses((status = 200, body = Health)))]
pub async fn health(State(app): State<App>) -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        sandboxes: app.registry.running(),
        capacity: app.registry.capacity(),
    })
}

/// Versions of forkd, the agent protocol and the hypervisor backend.
#[utoipa::path(get, path = "/v1/version", responses((status = 200, body = Version)))]
pub async fn version(State(app): State<App>) -> Json<Version> {
    Json(Version {
        forkd: env!("CARGO_PKG_VERSION").into(),
        agent_protocol: forkd_proto::PROTOCOL_VERSION,
        hypervisor: app.registry.hypervisor().name().to_owned(),
        qemu: crate::hypervisor_version(app.registry.hypervisor().as_ref()),
    })
}

/// The OpenAPI document of this API.
pub async fn openapi() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        ApiDoc::openapi().to_pretty_json().unwrap_or_default(),
    )
}

/// Prometheus text format.
pub async fn metrics(State(app): State<App>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.render(&app.registry),
    )
}

/// Any route that does not exist.
pub async fn not_found() -> ApiError {
    ApiError::not_found("no such route (see /v1/openapi.json)")
}

/// A route that exists, with a method it does not take.
pub async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not take that method (see /v1/openapi.json)",
    )
}
