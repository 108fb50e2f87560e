//! E2B's control plane: create, connect, list, get, kill, set a timeout, fork, pause
//! and resume. A sandbox's `templateID` names a forkd snapshot (or an alias of one); its
//! metadata are forkd labels; its timeout is forkd's; its pause is forkd's pause to
//! disk, and a paused sandbox is E2B's `paused`.

use super::{Shared, ENVD_VERSION};
use crate::api::ApiError;
use crate::registry::Listed;
use crate::service;
use crate::service::fork::{ForkRequest, MAX_TIMEOUT_S};
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use forkd_core::lifecycle::SandboxState;
use forkd_core::pause::PauseKeeps;
use forkd_storage::snapshot::Tag;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// What a sandbox lives for when the create call names no timeout (E2B's default).
const DEFAULT_TIMEOUT_S: u64 = 300;
/// Most sandboxes one list page holds.
const MAX_PAGE: usize = 100;

pub(super) fn routes() -> Router<Shared> {
    Router::new()
        .route("/v2/sandboxes", get(list).post(create))
        .route("/sandboxes", get(list).post(create))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/network", put(set_network))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
}

/// An error as E2B's API answers it: `{"code": <status>, "message"}`. Capacity errors
/// may be retried (the SDKs do, for 503); nothing else will go better on a retry.
pub(super) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let mut r = (
        status,
        Json(json!({"code": status.as_u16(), "message": message.into()})),
    )
        .into_response();
    if status != StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert("should-retry", HeaderValue::from_static("false"));
    }
    r
}

/// forkd's errors, in E2B's shape.
pub(super) struct E2bError(pub(super) ApiError);

/// An error of `status`, in E2B's shape.
pub(super) fn fail(status: StatusCode, message: impl Into<String>) -> E2bError {
    E2bError(ApiError::new(status, "e2b", message))
}

impl<E: Into<ApiError>> From<E> for E2bError {
    fn from(e: E) -> E2bError {
        E2bError(e.into())
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        error(self.0.status, self.0.message)
    }
}

fn bad(message: impl Into<String>) -> E2bError {
    E2bError(ApiError::bad_request(message))
}

/// The create call's body (E2B's `NewSandbox`; what forkd does not do is refused, not
/// ignored, where ignoring it would surprise).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    /// Pause (true) or kill (false) at the timeout.
    #[serde(default)]
    auto_pause: Option<bool>,
    /// Whether the pause at the timeout keeps the memory (false: the disk only).
    #[serde(default)]
    auto_pause_memory: Option<bool>,
    /// Whether any request resumes the sandbox once paused (the default), or only
    /// connect does.
    #[serde(default)]
    auto_resume: Option<AutoResume>,
    #[serde(
        default,
        rename = "allow_internet_access",
        alias = "allowInternetAccess"
    )]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    network: Option<super::network::NetworkConfig>,
}

/// `autoResume`: `{"enabled": bool}`.
#[derive(Debug, Deserialize)]
struct AutoResume {
    enabled: bool,
}

fn timeout_s(t: Option<u64>) -> Result<u64, E2bError> {
    let t = t.unwrap_or(DEFAULT_TIMEOUT_S);
    if !(1..=MAX_TIMEOUT_S).contains(&t) {
        return Err(bad(format!(
            "timeout = {t} is outside 1..={MAX_TIMEOUT_S} seconds"
        )));
    }
    Ok(t)
}

fn body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, E2bError> {
    serde_json::from_slice(if bytes.is_empty() { b"{}" } else { bytes })
        .map_err(|e| bad(format!("the request body is not valid: {e}")))
}

/// The snapshot an E2B template name stands for: an alias, else a snapshot's tag.
fn snapshot_of(
    e2b: &Shared,
    template: &str,
) -> Result<forkd_storage::snapshot::Snapshot, E2bError> {
    let name = e2b
        .config
        .aliases
        .get(template)
        .map_or(template, String::as_str);
    let tag = Tag::parse(name)?;
    Ok(e2b.app.registry.store().open(&tag)?)
}

/// A sandbox as create, connect and fork answer it.
fn created(e2b: &Shared, id: &str, template: &str) -> Value {
    let token = e2b.access_token(id);
    json!({
        "templateID": template,
        "sandboxID": id,
        "clientID": "forkd",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "trafficAccessToken": token,
        "domain": e2b.config.domain,
    })
}

fn rfc3339(unix: i64) -> String {
    let t =
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(u64::try_from(unix).unwrap_or(0));
    forkd_image::timestamp::rfc3339_utc(t)
}

/// E2B's state of a sandbox: `running`, or `paused` for one without a VM (paused,
/// being paused or resumed, or failed at a resume with its files kept).
fn e2b_state(state: SandboxState) -> &'static str {
    if state.holds_a_vm() && !matches!(state, SandboxState::Pausing | SandboxState::Resuming) {
        "running"
    } else {
        "paused"
    }
}

/// A sandbox as list and get answer it.
fn listed(hv: &dyn forkd_hypervisor::Hypervisor, e: &Listed) -> Value {
    let r = &e.row;
    let disk_mb = hv.disk_size(&r.config.root_disk).map_or(0, |b| b >> 20);
    let started = r.created_at.clone();
    json!({
        "templateID": r.snapshot,
        "sandboxID": r.id,
        "clientID": "forkd",
        "startedAt": started,
        "endAt": r.timeout_at.map_or(started.clone(), rfc3339),
        "cpuCount": r.config.vcpus,
        "memoryMB": r.config.memory_mib,
        "diskSizeMB": disk_mb,
        "state": e2b_state(r.state),
        "envdVersion": ENVD_VERSION,
        "metadata": r.labels,
    })
}

async fn create(
    State(e2b): State<Shared>,
    uri: axum::http::Uri,
    headers: axum::http::HeaderMap,
    bytes: axum::body::Bytes,
) -> Result<Response, E2bError> {
    let req: NewSandbox = body(&bytes)?;
    // On a host of a cluster that lacks the template or room, another host makes it.
    let tag = e2b
        .config
        .aliases
        .get(&req.template_id)
        .map_or(req.template_id.as_str(), String::as_str);
    if let Some((name, address)) =
        super::cluster_wide::create_elsewhere(&e2b, &headers, tag).await?
    {
        return Ok(super::cluster_wide::hand_create(
            &e2b,
            &name,
            &address,
            uri.path(),
            &headers,
            bytes,
        )
        .await?);
    }
    let on_timeout = req.auto_pause.map(|pause| {
        if pause {
            crate::state::OnTimeout::Pause
        } else {
            crate::state::OnTimeout::Kill
        }
    });
    let snap = snapshot_of(&e2b, &req.template_id)?;
    let network = req.network.unwrap_or_default();
    let egress = if snap.manifest.machine.nic {
        super::network::policy(req.allow_internet_access, &network).map_err(bad)?
    } else if network.is_default() {
        // A template built without a NIC has no internet to allow.
        Default::default()
    } else {
        return Err(bad(format!(
            "template {} has no network (its recipe says network = \"none\"): network settings cannot apply",
            req.template_id
        )));
    };
    let timeout_s = timeout_s(req.timeout)?;
    let nic = snap.manifest.machine.nic;
    let fork = service::fork::start_with(
        &e2b.app,
        snap,
        ForkRequest {
            count: 1,
            labels: req.metadata.unwrap_or_default(),
            env: req.env_vars.unwrap_or_default(),
            timeout_s: Some(timeout_s),
            egress: nic.then_some(egress),
            on_timeout,
            pause_keeps: keeps(req.auto_pause_memory),
            manual_resume: req.auto_resume.is_some_and(|a| !a.enabled),
            ..ForkRequest::default()
        },
    )?;
    let mut outcome = fork.outcome().await?;
    let Some(child) = outcome.entries.pop() else {
        return Err(E2bError(ApiError::internal("the fork made no sandbox")));
    };
    let body = created(&e2b, &child.row.id, &req.template_id);
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

#[derive(Debug, Deserialize)]
struct TimeoutBody {
    timeout: Option<u64>,
}

/// The body of connect and resume: the sandbox's new timeout, and whether its memory is
/// restored (`false`: E2B's reboot from the disk).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConnectBody {
    timeout: Option<u64>,
    #[serde(default)]
    memory: Option<bool>,
    /// The legacy resume's, deprecated by E2B: ignored.
    #[serde(default)]
    #[allow(dead_code)]
    auto_pause: Option<bool>,
}

/// Connecting to a sandbox: a paused one is resumed (201), a running one is there
/// (200); either lives at least `timeout` more.
async fn connect(
    State(e2b): State<Shared>,
    Path(id): Path<String>,
    bytes: axum::body::Bytes,
) -> Result<Response, E2bError> {
    run_again(&e2b, &id, &bytes, false).await
}

/// E2B's legacy resume: a paused sandbox runs again (201); a running one is a conflict.
async fn resume(
    State(e2b): State<Shared>,
    Path(id): Path<String>,
    bytes: axum::body::Bytes,
) -> Result<Response, E2bError> {
    run_again(&e2b, &id, &bytes, true).await
}

/// Resumes sandbox `id` if it is paused (else, with `paused_only`, refuses it), extends
/// its timeout as the body asks, and answers with it: 201 when it was resumed.
async fn run_again(
    e2b: &Shared,
    id: &str,
    bytes: &[u8],
    paused_only: bool,
) -> Result<Response, E2bError> {
    let req: ConnectBody = body(bytes)?;
    // `memory: false` (the SDKs' `on_resume="reboot"`) boots a paused sandbox from its
    // disk.
    let how = if req.memory == Some(false) {
        forkd_core::resume::ResumeHow::Reboot
    } else {
        forkd_core::resume::ResumeHow::Restore
    };
    let was_paused = e2b_state(e2b.app.registry.describe(id)?.row.state) == "paused";
    if paused_only && !was_paused {
        return Err(fail(
            StatusCode::CONFLICT,
            format!("sandbox {id} is running, not paused"),
        ));
    }
    if was_paused {
        service::pause::resume_as(&e2b.app, id, how).await?;
    }
    if let Some(t) = req.timeout {
        service::sandbox::keep_alive(&e2b.app, id, timeout_s(Some(t))?)?;
    }
    let e = e2b.app.registry.describe(id)?;
    let status = if was_paused {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(created(e2b, id, &e.row.snapshot))).into_response())
}

async fn detail(State(e2b): State<Shared>, Path(id): Path<String>) -> Result<Response, E2bError> {
    let e = e2b.app.registry.describe(&id)?;
    let mut v = listed(e2b.app.registry.hypervisor().as_ref(), &e);
    v["lifecycle"] = json!({
        "onTimeout": e.row.lifecycle.on_timeout,
        "autoResume": !e.row.lifecycle.manual_resume,
    });
    v["envdAccessToken"] = json!(e2b.access_token(&id));
    v["domain"] = json!(e2b.config.domain);
    Ok(Json(v).into_response())
}

async fn kill(State(e2b): State<Shared>, Path(id): Path<String>) -> Result<StatusCode, E2bError> {
    service::sandbox::delete(&e2b.app, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn set_timeout(
    State(e2b): State<Shared>,
    Path(id): Path<String>,
    bytes: axum::body::Bytes,
) -> Result<StatusCode, E2bError> {
    let req: TimeoutBody = body(&bytes)?;
    let t = req.timeout.ok_or_else(|| bad("give timeout, in seconds"))?;
    service::sandbox::set_timeout(&e2b.app, &id, Some(timeout_s(Some(t))?))?;
    Ok(StatusCode::NO_CONTENT)
}

/// `PUT /sandboxes/{id}/network`: replaces the running sandbox's egress rules (omitted
/// fields clear them: back to E2B's open default).
async fn set_network(
    State(e2b): State<Shared>,
    Path(id): Path<String>,
    bytes: axum::body::Bytes,
) -> Result<StatusCode, E2bError> {
    let req: super::network::NetworkConfig = body(&bytes)?;
    let policy = super::network::policy(None, &req).map_err(bad)?;
    service::sandbox::set_egress(&e2b.app, &id, policy).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// What a pause keeps, from E2B's `memory` (`mode="filesystem"` sends false: the disk
/// only, booted again at the resume).
fn keeps(memory: Option<bool>) -> PauseKeeps {
    if memory == Some(false) {
        PauseKeeps::Disk
    } else {
        PauseKeeps::Memory
    }
}

/// The pause call's body: whether the memory is kept (E2B's `mode="full"`, the default;
/// `mode="filesystem"` keeps the disk only) and whether the guest must be healthy
/// (forkd pauses only a running sandbox anyway).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PauseBody {
    #[serde(default)]
    memory: Option<bool>,
    #[serde(default)]
    #[allow(dead_code)]
    require_healthy_guest: Option<bool>,
}

/// `POST /sandboxes/{id}/pause`: forkd's pause to disk (204); one paused already is a
/// conflict (409), which the SDKs answer with `false`.
async fn pause(
    State(e2b): State<Shared>,
    Path(id): Path<String>,
    bytes: axum::body::Bytes,
) -> Result<StatusCode, E2bError> {
    let req: PauseBody = body(&bytes)?;
    let keeps = keeps(req.memory);
    service::pause::pause(&e2b.app, &id, keeps).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v2/sandboxes`: filters `metadata` (`k=v&...`, each part percent-encoded, as the
/// SDKs send it) and `state`; pages by `limit` and `nextToken` (an offset).
///
/// On a host of a cluster it lists the cluster's (see [`super::cluster_wide`]), unless
/// another host asked it for its own.
async fn list(
    State(e2b): State<Shared>,
    headers: axum::http::HeaderMap,
    RawQuery(q): RawQuery,
) -> Result<Response, E2bError> {
    let mut filter = ListFilter::default();
    let (mut limit, mut offset) = (MAX_PAGE, 0usize);
    for (k, v) in crate::api::form_pairs(q.as_deref().unwrap_or("")) {
        match k.as_str() {
            "metadata" | "state" => filter.add(k, v),
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_PAGE).contains(n))
                    .ok_or_else(|| bad(format!("limit {v:?} is outside 1..={MAX_PAGE}")))?
            }
            "nextToken" => {
                offset = v
                    .parse()
                    .map_err(|_| bad(format!("nextToken {v:?} is not one this API gave")))?
            }
            _ => {}
        }
    }
    let matching: Vec<Listed> = e2b
        .app
        .registry
        .list()
        .into_iter()
        .filter(|e| filter.allows(&e.row.labels, e2b_state(e.row.state)))
        .collect();
    let cluster_wide =
        e2b.app.cluster.is_some() && !headers.contains_key(crate::service::cluster::FORWARDED_BY);
    let elsewhere = if cluster_wide {
        super::cluster_wide::elsewhere(&e2b, &headers, &filter).await?
    } else {
        Vec::new()
    };
    // Each item reads its disk's size from its layer's header: off the runtime. (Alone,
    // only the page's items are read.)
    let total = matching.len() + elsewhere.len();
    let mut matching = matching;
    if !cluster_wide {
        matching = matching.into_iter().skip(offset).take(limit).collect();
    }
    let hv = e2b.app.registry.hypervisor().clone();
    let mut items = tokio::task::spawn_blocking(move || {
        matching
            .iter()
            .map(|e| listed(hv.as_ref(), e))
            .collect::<Vec<_>>()
    })
    .await
    .map_err(|e| E2bError(ApiError::internal(format!("listing sandboxes: {e}"))))?;
    if cluster_wide {
        items.extend(elsewhere);
        let key = |v: &Value| (v["startedAt"].to_string(), v["sandboxID"].to_string());
        items.sort_by_key(key);
        items = items.into_iter().skip(offset).take(limit).collect();
    }
    let mut r = Json(Value::Array(items)).into_response();
    let next = offset.saturating_add(limit);
    if next < total {
        if let Ok(v) = HeaderValue::from_str(&next.to_string()) {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(r)
}

/// A list's `metadata` and `state` filters, with the query pairs they came as (passed
/// on to the other hosts of a cluster).
#[derive(Default)]
pub(super) struct ListFilter {
    metadata: Vec<(String, String)>,
    states: Option<Vec<String>>,
    /// The query pairs, as they came.
    pub(super) pairs: Vec<(String, String)>,
}

impl ListFilter {
    /// Takes the query pair `k=v` (`metadata` or `state`).
    fn add(&mut self, k: String, v: String) {
        match k.as_str() {
            "metadata" => self.metadata = metadata_filter(&v),
            _ => self.states = Some(v.split(',').map(str::to_owned).collect()),
        }
        self.pairs.push((k, v));
    }

    /// Whether a sandbox with `labels`, in E2B's `state`, is listed.
    pub(super) fn allows(&self, labels: &BTreeMap<String, String>, state: &str) -> bool {
        self.metadata
            .iter()
            .all(|(k, v)| labels.get(k).is_some_and(|have| have == v))
            && self
                .states
                .as_ref()
                .is_none_or(|s| s.iter().any(|s| s == state))
    }
}

/// The metadata filter: the SDKs quote each key and value, join them as a query string
/// and send that as one query value, so each part is decoded once more here.
fn metadata_filter(v: &str) -> Vec<(String, String)> {
    crate::api::form_pairs(v)
        .into_iter()
        .map(|(k, v)| {
            (
                crate::api::percent_decode(&k),
                crate::api::percent_decode(&v),
            )
        })
        .collect()
}

#[derive(Debug, Deserialize)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u32>,
}

/// Most children one fork call makes.
const MAX_FORK: u32 = 64;

/// `POST /sandboxes/{id}/fork`: a live BRANCH of the sandbox, then `count` children of
/// it. Answers one item per child: `{"sandbox"}` or `{"error"}`. The branch's snapshot
/// stays (forkd's snapshots outlive their children); `forkd rm` removes it once unused.
async fn fork(
    State(e2b): State<Shared>,
    Path(id): Path<String>,
    bytes: axum::body::Bytes,
) -> Result<Response, E2bError> {
    let req: ForkBody = body(&bytes)?;
    let count = req.count.unwrap_or(1);
    if !(1..=MAX_FORK).contains(&count) {
        return Err(bad(format!("count = {count} is outside 1..={MAX_FORK}")));
    }
    let timeout_s = timeout_s(req.timeout)?;
    let source = e2b.app.registry.describe(&id)?;
    let branch = service::branch::start(&e2b.app, &id, None, None).await?;
    let tag = branch.tag.clone();
    branch.outcome().await?;
    let fork = service::fork::start(
        &e2b.app,
        tag.as_str(),
        ForkRequest {
            count,
            labels: source.row.labels.clone(),
            timeout_s: Some(timeout_s),
            partial: true,
            // Children of the branch keep the source's policy.
            egress: source.row.config.network.as_ref().map(|n| n.policy.clone()),
            ..ForkRequest::default()
        },
    )?;
    let outcome = fork.outcome().await?;
    let mut items: Vec<Value> = outcome
        .entries
        .iter()
        .map(|c| json!({"sandbox": created(&e2b, &c.row.id, tag.as_str())}))
        .collect();
    items.extend(outcome.failures.into_iter().map(|f| {
        let a = ApiError::from(f);
        json!({"error": {"code": a.status.as_u16(), "message": a.message}})
    }));
    Ok((StatusCode::CREATED, Json(Value::Array(items))).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filters_decode_as_the_sdks_encode_them() {
        // {"a b": "c&d", "k": "v"}: each part quoted, joined as a query, then the whole
        // sent as one query value.
        let q = "metadata=a%252520b%3Dc%252526d%26k%3Dv&limit=5";
        let outer = crate::api::form_pairs(q);
        assert_eq!(outer[0].0, "metadata");
        let inner = metadata_filter(&outer[0].1);
        assert_eq!(
            inner,
            vec![("a b".into(), "c&d".into()), ("k".into(), "v".into())]
        );
        assert_eq!(outer[1], ("limit".into(), "5".into()));
    }

    #[test]
    fn bad_escapes_stay_as_they_are() {
        assert_eq!(crate::api::percent_decode("100%"), "100%");
        assert_eq!(crate::api::percent_decode("%zz"), "%zz");
        assert_eq!(crate::api::percent_decode("%41+b"), "A b");
    }
}
