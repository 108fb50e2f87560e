//! Forking children of a snapshot: the checks of a request, admission, and the fork run
//! in a task of its own.

use super::ApiError;
use crate::api::types::{CreateSandboxes, CreatedSandboxes, LimitsBody};
use crate::api::App;
use crate::registry::{CreateOutcome, CreateSpec, RegistryError};
use crate::state::OperationRow;
use forkd_host::cgroup::LimitOverrides;
use forkd_host::network::policy::EgressPolicy;
use forkd_storage::snapshot::{Snapshot, Tag};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Most labels on one sandbox, and the longest key or value.
const MAX_LABELS: usize = 32;
const MAX_LABEL_LEN: usize = 256;
/// Most bytes a sandbox's `env` may take as JSON: it travels in the resume hook, one
/// agent request.
const MAX_ENV_BYTES: usize = 64 << 10;

/// Longest timeout accepted: 30 days.
pub const MAX_TIMEOUT_S: u64 = 30 * 24 * 3600;

/// A fork as a front door asks for it.
#[derive(Debug, Default)]
pub struct ForkRequest {
    /// How many children.
    pub count: u32,
    /// Labels to find them by.
    pub labels: BTreeMap<String, String>,
    /// Variables for their commands and contexts.
    pub env: BTreeMap<String, String>,
    /// Seconds after which the daemon stops each child; none: it runs until deleted.
    pub timeout_s: Option<u64>,
    /// Keep the children that start when others fail.
    pub partial: bool,
    /// vCPUs and RAM asked for: a restored VM has its snapshot's, so only those pass.
    pub vcpus: Option<u32>,
    /// See `vcpus`.
    pub memory_mib: Option<u32>,
    /// Limits of each child's VM beyond the defaults, unchecked.
    pub limits: Option<LimitsBody>,
    /// What the children may reach; none: the snapshot's own policy.
    pub egress: Option<EgressPolicy>,
    /// What their deadline does (default: the snapshot's, else kill).
    pub on_timeout: Option<crate::state::OnTimeout>,
    /// Pause each after this many seconds without a request, exec or open stream
    /// (default: the snapshot's).
    pub auto_pause_after_s: Option<u64>,
    /// What those pauses keep (default: the whole machine).
    pub pause_keeps: forkd_core::pause::PauseKeeps,
    /// Resumed only when asked, not by any request that needs the VM.
    pub manual_resume: bool,
}

/// A fork under way, in a task of its own: a client that hangs up mid-fork must not
/// cancel it half way, leaving children that run with no record.
pub struct Fork {
    /// Its operation's id.
    pub op_id: String,
    task: tokio::task::JoinHandle<Result<CreateOutcome, RegistryError>>,
}

/// Starts the fork a `POST /v1/sandboxes` asks for, on this host.
pub fn start_request(app: &App, req: CreateSandboxes) -> Result<Fork, ApiError> {
    let egress = match req.network {
        None => None,
        Some(body) => Some(
            body.policy()
                .map_err(|e| ApiError::bad_request(format!("network: {e}")))?,
        ),
    };
    start(
        app,
        &req.snapshot,
        ForkRequest {
            count: req.n,
            labels: req.labels,
            env: req.env,
            timeout_s: req.timeout_s,
            partial: req.partial,
            vcpus: req.vcpus,
            memory_mib: req.memory_mib,
            limits: req.limits,
            egress,
            on_timeout: req.on_timeout,
            auto_pause_after_s: req.auto_pause_after_s,
            ..ForkRequest::default()
        },
    )
}

/// Forks what a `POST /v1/sandboxes` asks for on this host and waits for its children.
pub async fn create_here(app: &App, req: CreateSandboxes) -> Result<CreatedSandboxes, ApiError> {
    let fork = start_request(app, req)?;
    let operation = fork.op_id.clone();
    let outcome = fork.outcome().await?;
    let hv = app.registry.hypervisor();
    Ok(CreatedSandboxes {
        sandboxes: outcome
            .entries
            .into_iter()
            .map(|e| crate::api::sandboxes::info(&crate::registry::Listed::from(e), hv.as_ref()))
            .collect(),
        errors: outcome.failures.iter().map(|e| e.to_string()).collect(),
        operation,
    })
}

/// Checks `req`, then against the snapshot tagged `snapshot`, admits it (refused now
/// rather than in an operation nobody may look at) and starts it.
pub fn start(app: &App, snapshot: &str, req: ForkRequest) -> Result<Fork, ApiError> {
    let timeout_at = req.check()?;
    let snap = app.registry.store().open(&Tag::parse(snapshot)?)?;
    launch(app, snap, req, timeout_at)
}

/// [`start`] for a front door that has opened the snapshot already (to read its
/// manifest), so that it is not opened twice.
pub fn start_with(app: &App, snap: Snapshot, req: ForkRequest) -> Result<Fork, ApiError> {
    let timeout_at = req.check()?;
    launch(app, snap, req, timeout_at)
}

impl ForkRequest {
    /// The checks that need no snapshot; returns the deadline.
    fn check(&self) -> Result<Option<i64>, ApiError> {
        let max = u32::try_from(forkd_core::fork::MAX_CHILDREN).expect("a small limit");
        if self.count == 0 || self.count > max {
            return Err(ApiError::bad_request(format!(
                "n = {} is outside 1..={max}",
                self.count
            )));
        }
        check_labels_and_env(&self.labels, &self.env)?;
        if let Some(t) = self.auto_pause_after_s {
            if !(1..=MAX_TIMEOUT_S).contains(&t) {
                return Err(ApiError::bad_request(format!(
                    "auto_pause_after_s = {t} is outside 1..={MAX_TIMEOUT_S}"
                )));
            }
        }
        if let Some(p) = &self.egress {
            p.check()
                .map_err(|e| ApiError::bad_request(format!("network: {e}")))?;
        }
        deadline(self.timeout_s)
    }
}

/// Checks `req` against `snap`, admits it and runs it.
fn launch(
    app: &App,
    snap: Snapshot,
    req: ForkRequest,
    timeout_at: Option<i64>,
) -> Result<Fork, ApiError> {
    let tag = &snap.tag;
    let m = &snap.manifest.machine;
    // A restored VM has exactly its snapshot's vCPUs and RAM (the device state and the
    // memory image fix both): other numbers cannot be honoured.
    for (what, asked, has) in [
        ("vcpus", req.vcpus, m.vcpus),
        ("memory_mib", req.memory_mib, m.memory_mib),
    ] {
        if let Some(a) = asked.filter(|a| *a != has) {
            return Err(ApiError::bad_request(format!(
                "{what} = {a}: children of snapshot {tag} have {what} = {has} (the snapshot fixes it)"
            )));
        }
    }
    let limits = limit_overrides(req.limits.as_ref(), m.vcpus, m.memory_mib)?;
    let egress = match req.egress {
        None => snap.manifest.egress.clone().unwrap_or_default(),
        Some(_) if !m.nic => {
            return Err(ApiError::bad_request(format!(
                "network: children of snapshot {tag} have no NIC (its template was built with network = \"none\", or on a host without networking)"
            )))
        }
        Some(p) => p,
    };
    let spec = CreateSpec {
        labels: req.labels,
        limits,
        egress,
        env: req.env,
        timeout_at,
        lifecycle: crate::state::Lifecycle {
            on_timeout: req.on_timeout.unwrap_or(snap.manifest.lifecycle.on_timeout),
            auto_pause_after_s: req
                .auto_pause_after_s
                .or(snap.manifest.lifecycle.auto_pause_after_s),
            timeout_s: req.timeout_s,
            pause_keeps: req.pause_keeps,
            manual_resume: req.manual_resume,
        },
        partial: req.partial,
        ..CreateSpec::new(req.count as usize)
    };
    app.registry.admit(snap.tag.as_str(), spec.count)?;
    let op_id = spec.op_id.clone();
    let app = app.clone();
    let t = Instant::now();
    let task = tokio::spawn(async move {
        let r = app.registry.create(&snap, spec).await;
        if let Ok(o) = &r {
            app.metrics.forks.inc_by(o.entries.len() as u64);
            app.metrics.fork_seconds.observe(t.elapsed().as_secs_f64());
            claim(&app, o).await;
        }
        r
    });
    Ok(Fork { op_id, task })
}

/// On a host of a cluster, claims the fork's children before it answers, so that any
/// host finds them at once. Without etcd they are claimed by the reconciliation.
async fn claim(app: &App, outcome: &CreateOutcome) {
    let Some(cluster) = app.cluster.as_deref() else {
        return;
    };
    let records: Vec<_> = outcome
        .entries
        .iter()
        .map(|e| {
            let record = crate::cluster::ownership::record_of(cluster, &e.row);
            (e.row.id.clone(), record)
        })
        .collect();
    if let Err(e) = cluster.claim_all(&records).await {
        tracing::warn!("the fork's children are claimed in the cluster later: {e}");
    }
}

impl Fork {
    /// Waits for the fork to end. A partial fork in which no child started fails with
    /// its first failure.
    pub async fn outcome(self) -> Result<CreateOutcome, ApiError> {
        let mut outcome = self
            .task
            .await
            .map_err(|e| ApiError::internal(format!("the fork task failed: {e}")))??;
        if outcome.entries.is_empty() && !outcome.failures.is_empty() {
            return Err(outcome.failures.swap_remove(0).into());
        }
        Ok(outcome)
    }

    /// The fork's operation row, once the fork has written it (at its start): what a
    /// front door answers when the client polls instead of waiting.
    pub async fn operation(self, app: &App) -> Result<OperationRow, ApiError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(op) = app.registry.state().operation(&self.op_id)? {
                return Ok(op);
            }
            if self.task.is_finished() || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.outcome().await?;
        Err(ApiError::internal(
            "the fork ended before its operation was recorded",
        ))
    }
}

/// The limits a fork asks for, checked.
fn limit_overrides(
    asked: Option<&LimitsBody>,
    vcpus: u32,
    memory_mib: u32,
) -> Result<LimitOverrides, ApiError> {
    let Some(asked) = asked else {
        return Ok(LimitOverrides::default());
    };
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "at most 1024 cores, checked: their millicores fit"
    )]
    let cpu_millicores = match asked.cpu_cores {
        None => None,
        Some(c) if c.is_finite() && (0.0..=1024.0).contains(&c) => Some((c * 1000.0).ceil() as u32),
        Some(c) => {
            return Err(ApiError::bad_request(format!(
                "limits.cpu_cores = {c} is outside 0..=1024"
            )))
        }
    };
    if asked.memory_mib.is_some_and(|m| m > 1 << 20) {
        return Err(ApiError::bad_request(
            "limits.memory_mib is more than 1048576".to_string(),
        ));
    }
    if asked.pids.is_some_and(|p| p > 65_536) {
        return Err(ApiError::bad_request(
            "limits.pids is more than 65536".to_string(),
        ));
    }
    let chosen = LimitOverrides {
        memory_bytes: asked.memory_mib.map(|m| m << 20),
        cpu_millicores,
        cpu_weight: asked.cpu_weight,
        pids: asked.pids,
    };
    chosen
        .resolve(vcpus, memory_mib)
        .check(memory_mib)
        .map_err(|e| ApiError::bad_request(format!("limits: {e}")))?;
    Ok(chosen)
}

/// The Unix time `timeout_s` from now (none: no deadline), checked against
/// [`MAX_TIMEOUT_S`].
pub fn deadline(timeout_s: Option<u64>) -> Result<Option<i64>, ApiError> {
    timeout_s.map(deadline_in).transpose()
}

/// The Unix time `t` seconds from now, checked against [`MAX_TIMEOUT_S`].
pub fn deadline_in(t: u64) -> Result<i64, ApiError> {
    if !(1..=MAX_TIMEOUT_S).contains(&t) {
        return Err(ApiError::bad_request(format!(
            "timeout_s = {t} is outside 1..={MAX_TIMEOUT_S}"
        )));
    }
    // At most MAX_TIMEOUT_S (checked above): it fits an i64.
    Ok(crate::unix_now() + i64::try_from(t).expect("a checked timeout"))
}

/// Refuses labels and an environment a sandbox cannot take.
fn check_labels_and_env(
    labels: &BTreeMap<String, String>,
    env: &BTreeMap<String, String>,
) -> Result<(), ApiError> {
    if labels.len() > MAX_LABELS
        || labels
            .iter()
            .any(|(k, v)| k.is_empty() || k.len() > MAX_LABEL_LEN || v.len() > MAX_LABEL_LEN)
    {
        return Err(ApiError::bad_request(format!(
            "labels: at most {MAX_LABELS}, keys of 1 to {MAX_LABEL_LEN} bytes, values of at most {MAX_LABEL_LEN}"
        )));
    }
    if let Some(problem) = forkd_proto::exec::env_problem(env) {
        return Err(ApiError::bad_request(problem));
    }
    if serde_json::to_vec(env).map_or(0, |v| v.len()) > MAX_ENV_BYTES {
        return Err(ApiError::bad_request(format!(
            "env takes more than {MAX_ENV_BYTES} bytes as JSON"
        )));
    }
    Ok(())
}
