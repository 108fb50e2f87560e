//! E2B's list and create on a host of a cluster.
//!
//! - **List**: this host's sandboxes, every other living host's as that host's E2B
//!   listener lists them (the request's own key sent along, marked forwarded so that
//!   each lists only its own), and the parked ones (moved off a host, waiting for one:
//!   E2B's `paused`, since a connect resumes them). The sandboxes of a host that does
//!   not answer are left out: E2B has no state for them.
//! - **Create**: made here when this host holds the template's snapshot and has a free
//!   slot; else handed, as it came, to the living host that holds it with the most free
//!   slots. Its answer is that host's; the sandbox's later requests reach it through
//!   any host's front door.

use super::E2b;
use crate::api::ApiError;
use crate::cluster::HostState;
use crate::service::cluster::{peer, FORWARDED_BY};
use axum::http::{HeaderMap, HeaderValue, Method};
use http_body_util::BodyExt;
use serde_json::{json, Value};

/// The headers a host's list request is sent with: the caller's credentials.
const CREDENTIALS: [&str; 2] = ["x-api-key", "authorization"];

/// Most pages read from one host (each of at most the listener's page size).
const MAX_PAGES: usize = 1000;

/// The sandboxes of the cluster beyond this host's, as E2B lists them, filtered by
/// the request's `filter`.
pub(super) async fn elsewhere(
    e2b: &E2b,
    headers: &HeaderMap,
    filter: &super::control::ListFilter,
) -> Result<Vec<Value>, ApiError> {
    let Some(cluster) = e2b.app.cluster.as_deref() else {
        return Ok(Vec::new());
    };
    let me = cluster.host_name();
    let hosts = cluster.hosts().await?;
    let query = form_urlencoded::Serializer::new(String::new())
        .extend_pairs(&filter.pairs)
        .finish();
    let lists = hosts
        .iter()
        .filter(|h| h.name != me && h.state == HostState::Up)
        .filter_map(|h| Some((h, h.live.as_ref()?.e2b_address.clone()?)))
        .map(|(h, address)| {
            let query = query.clone();
            async move {
                let listed = host_list(e2b, &address, headers, &query).await;
                listed.inspect_err(|e| tracing::warn!(host = %h.name, "its E2B list: {e:#}"))
            }
        });
    let mut all = Vec::new();
    for listed in futures::future::join_all(lists).await {
        // A host that fails to answer is left out, as one that is down.
        all.extend(listed.unwrap_or_default());
    }
    let parked = cluster.parked().await?;
    all.extend(
        parked
            .into_iter()
            .filter(|(_, r)| filter.allows(&r.labels, "paused"))
            .map(|(id, r)| {
                json!({
                    "templateID": r.snapshot,
                    "sandboxID": id,
                    "clientID": "forkd",
                    "startedAt": r.created_at,
                    "endAt": r.created_at,
                    "cpuCount": 0,
                    "memoryMB": 0,
                    "diskSizeMB": 0,
                    "state": "paused",
                    "envdVersion": super::ENVD_VERSION,
                    "metadata": r.labels,
                })
            }),
    );
    Ok(all)
}

/// Every page of the E2B list of the host whose listener is at `address`.
async fn host_list(
    e2b: &E2b,
    address: &str,
    headers: &HeaderMap,
    query: &str,
) -> anyhow::Result<Vec<Value>> {
    let cluster = e2b.app.cluster.as_deref().expect("listed in a cluster");
    let client = peer(&e2b.app, cluster, address, false);
    let mut out = Vec::new();
    let mut next: Option<String> = None;
    for _ in 0..MAX_PAGES {
        let mut path = format!("/v2/sandboxes?{query}");
        if let Some(t) = &next {
            path.push_str(&format!("&nextToken={t}"));
        }
        let req = request(cluster, Method::GET, &path, headers, bytes::Bytes::new())?;
        let answer = client.relay(req).await?;
        let status = answer.status();
        next = answer
            .headers()
            .get("x-next-token")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = answer.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            anyhow::bail!("{status}: {}", String::from_utf8_lossy(&body));
        }
        let page: Vec<Value> = serde_json::from_slice(&body)?;
        out.extend(page);
        if next.is_none() {
            return Ok(out);
        }
    }
    anyhow::bail!("more than {MAX_PAGES} pages")
}

/// A request to another host's E2B listener on behalf of a client: its credentials,
/// marked forwarded by this host.
fn request(
    cluster: &crate::cluster::Cluster,
    method: Method,
    path: &str,
    headers: &HeaderMap,
    body: bytes::Bytes,
) -> anyhow::Result<http::Request<http_body_util::Full<bytes::Bytes>>> {
    let mut req = http::Request::builder().method(method).uri(path);
    for name in CREDENTIALS.iter().chain(&["content-type"]) {
        if let Some(v) = headers.get(*name) {
            req = req.header(*name, v);
        }
    }
    Ok(req
        .header(FORWARDED_BY, HeaderValue::from_str(cluster.host_name())?)
        .body(http_body_util::Full::new(body))?)
}

/// The host a create of snapshot `tag` is handed to when this one cannot make it (it
/// lacks the snapshot or a free slot): the living, undrained host that holds it with
/// the most free slots, and its E2B listener. None: made here (or refused here).
pub(super) async fn create_elsewhere(
    e2b: &E2b,
    headers: &HeaderMap,
    tag: &str,
) -> Result<Option<(String, String)>, ApiError> {
    let Some(cluster) = e2b.app.cluster.as_deref() else {
        return Ok(None);
    };
    if headers.contains_key(FORWARDED_BY) {
        return Ok(None);
    }
    let here = e2b
        .app
        .registry
        .store()
        .exists(&forkd_storage::snapshot::Tag::parse(tag)?);
    if here && !cluster.is_draining() && crate::service::placement::free_here(&e2b.app) > 0 {
        return Ok(None);
    }
    let hosts = match cluster.hosts().await {
        Ok(h) => h,
        // Without etcd, what this host can do it does.
        Err(e) if here => {
            tracing::warn!("an E2B create made here alone: {e}");
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    };
    let holds = |l: &crate::cluster::keys::HostLive| {
        l.e2b_address.is_some() && l.snapshots.contains_key(tag)
    };
    Ok(
        crate::service::placement::roomiest_other(cluster, &hosts, holds)
            .and_then(|(h, l)| Some((h.name.clone(), l.e2b_address.clone()?))),
    )
}

/// Sends the create `body` to host `name`'s E2B listener at `address` and answers with
/// its answer.
pub(super) async fn hand_create(
    e2b: &E2b,
    name: &str,
    address: &str,
    path: &str,
    headers: &HeaderMap,
    body: bytes::Bytes,
) -> Result<axum::response::Response, ApiError> {
    let cluster = e2b.app.cluster.as_deref().expect("handed in a cluster");
    let failed = |e: anyhow::Error| {
        ApiError::new(
            axum::http::StatusCode::BAD_GATEWAY,
            "host_failed",
            format!("host {name}, which the create was handed to: {e:#}"),
        )
    };
    let req = request(cluster, Method::POST, path, headers, body).map_err(failed)?;
    tracing::info!(host = %name, "an E2B create handed to the host that holds its template");
    let answer = peer(&e2b.app, cluster, address, false)
        .relay(req)
        .await
        .map_err(failed)?;
    let (parts, body) = answer.into_parts();
    Ok(axum::response::Response::from_parts(
        parts,
        axum::body::Body::new(body),
    ))
}
