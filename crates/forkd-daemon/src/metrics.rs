//! Prometheus metrics (`GET /metrics`, OpenMetrics text): what runs now, what the daemon
//! has done, and how long forks and execs take.

use crate::registry::Registry as Sandboxes;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of the error counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// The error code the API answered with.
    pub kind: String,
}

/// Labels of the build info gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    snapshot: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SandboxLabels {
    sandbox: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
    agent_protocol: String,
}

/// The daemon's metrics.
pub struct Metrics {
    registry: Registry,
    running: Gauge,
    by_state: Family<StateLabels, Gauge>,
    capacity: Gauge,
    snapshot_bytes: Gauge,
    paused_bytes: Gauge,
    pool_idle: Family<PoolLabels, Gauge>,
    memory_limit: Family<SandboxLabels, Gauge>,
    memory_used: Family<SandboxLabels, Gauge>,
    cpu_quota: Family<SandboxLabels, Gauge>,
    /// Children forked.
    pub forks: Counter,
    /// Seconds from a create request to every child answering.
    pub fork_seconds: Histogram,
    /// Seconds an exec took, end to end.
    pub exec_seconds: Histogram,
    /// Error responses, by code.
    pub errors: Family<ErrorLabels, Counter>,
    branches: Counter,
    branch_pause_seconds: Histogram,
    branch_written_bytes: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("forkd");
        let running = Gauge::default();
        let by_state = Family::<StateLabels, Gauge>::default();
        let capacity = Gauge::default();
        let snapshot_bytes = Gauge::default();
        let paused_bytes = Gauge::default();
        let forks = Counter::default();
        let fork_seconds = Histogram::new(exponential_buckets(0.01, 2.0, 14));
        let exec_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 18));
        let errors = Family::<ErrorLabels, Counter>::default();
        let build = Family::<BuildLabels, Gauge>::default();
        build
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION").into(),
                agent_protocol: forkd_proto::PROTOCOL_VERSION.to_string(),
            })
            .set(1);
        registry.register(
            "sandboxes_running",
            "Sandboxes running now",
            running.clone(),
        );
        registry.register(
            "sandboxes",
            "Sandboxes by lifecycle state (starting, running, unresponsive, stopping, failed)",
            by_state.clone(),
        );
        registry.register(
            "sandboxes_capacity",
            "Most sandboxes the daemon runs",
            capacity.clone(),
        );
        registry.register(
            "snapshot_bytes",
            "Bytes the snapshots take on disk",
            snapshot_bytes.clone(),
        );
        registry.register(
            "paused_bytes",
            "Bytes the pause images of paused sandboxes hold on disk",
            paused_bytes.clone(),
        );
        registry.register("forks", "Children forked", forks.clone());
        registry.register(
            "fork_seconds",
            "Time from a create request until every child answered",
            fork_seconds.clone(),
        );
        registry.register(
            "exec_seconds",
            "Time an exec took, end to end",
            exec_seconds.clone(),
        );
        registry.register("errors", "Error responses by code", errors.clone());
        let pool_idle = Family::<PoolLabels, Gauge>::default();
        registry.register(
            "pool_idle",
            "Warm pool members ready for a fork, by snapshot",
            pool_idle.clone(),
        );
        let memory_limit = Family::<SandboxLabels, Gauge>::default();
        registry.register(
            "sandbox_memory_limit_bytes",
            "Memory a sandbox's QEMU may use, guest RAM included (its cgroup's limit)",
            memory_limit.clone(),
        );
        let memory_used = Family::<SandboxLabels, Gauge>::default();
        registry.register(
            "sandbox_memory_used_bytes",
            "Memory a sandbox's cgroup counts now",
            memory_used.clone(),
        );
        let cpu_quota = Family::<SandboxLabels, Gauge>::default();
        registry.register(
            "sandbox_cpu_quota_millicores",
            "A sandbox's CPU quota in thousandths of a core (absent: none)",
            cpu_quota.clone(),
        );
        let branches = Counter::default();
        registry.register("branches", "Branches written", branches.clone());
        let branch_pause_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "branch_pause_seconds",
            "How long a branch stopped its source's vCPUs",
            branch_pause_seconds.clone(),
        );
        let branch_written_bytes = Counter::default();
        registry.register(
            "branch_written_bytes",
            "Bytes of memory diffs branches stored",
            branch_written_bytes.clone(),
        );
        registry.register("build_info", "The daemon's version", build);
        Metrics {
            registry,
            running,
            by_state,
            capacity,
            snapshot_bytes,
            paused_bytes,
            pool_idle,
            memory_limit,
            memory_used,
            cpu_quota,
            forks,
            fork_seconds,
            exec_seconds,
            errors,
            branches,
            branch_pause_seconds,
            branch_written_bytes,
        }
    }

    /// Each sandbox's limits and what its cgroup counts, for the sandboxes there are now.
    fn render_limits(&self, sandboxes: &Sandboxes) {
        self.memory_limit.clear();
        self.memory_used.clear();
        self.cpu_quota.clear();
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for e in sandboxes.list() {
            let Some(limits) = e.row.config.limits else {
                continue;
            };
            let labels = SandboxLabels {
                sandbox: e.row.id.clone(),
            };
            self.memory_limit
                .get_or_create(&labels)
                .set(gauge(limits.memory_bytes));
            if limits.cpu_millicores != 0 {
                self.cpu_quota
                    .get_or_create(&labels)
                    .set(i64::from(limits.cpu_millicores));
            }
            if let Some((_, usage)) = e.sandbox.as_ref().and_then(|s| s.vm().cgroup()) {
                self.memory_used
                    .get_or_create(&labels)
                    .set(gauge(usage.memory_bytes));
            }
        }
    }

    /// Counts a branch that was written.
    pub fn branched(&self, o: &crate::branch::BranchOutcome) {
        self.branches.inc();
        self.branch_pause_seconds.observe(o.pause_ms / 1000.0);
        self.branch_written_bytes.inc_by(o.diff_bytes);
    }

    /// Counts one error response.
    pub fn error(&self, kind: &str) {
        self.errors
            .get_or_create(&ErrorLabels { kind: kind.into() })
            .inc();
    }

    /// The text exposition, with the gauges read now.
    pub fn render(&self, sandboxes: &Sandboxes) -> String {
        self.running.set(gauge(sandboxes.running()));
        let counts = sandboxes.count_by_state();
        for state in forkd_core::lifecycle::SandboxState::ALL {
            self.by_state
                .get_or_create(&StateLabels {
                    state: state.as_str().into(),
                })
                .set(gauge(counts.get(&state).copied().unwrap_or(0)));
        }
        self.capacity.set(gauge(sandboxes.capacity()));
        // A pool that emptied (or went away) reads 0, not its last value.
        self.pool_idle.clear();
        for (snapshot, n) in sandboxes.pool_idle() {
            self.pool_idle
                .get_or_create(&PoolLabels { snapshot })
                .set(gauge(n));
        }
        self.render_limits(sandboxes);
        let bytes: u64 = sandboxes
            .store()
            .list()
            .into_iter()
            .filter_map(|(_, s)| s.ok())
            .map(|s| s.disk_usage())
            .sum();
        self.snapshot_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        self.paused_bytes
            .set(i64::try_from(sandboxes.paused_bytes()).unwrap_or(i64::MAX));
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!("encoding the metrics: {e}");
        }
        out
    }
}

/// A count as a gauge's value (a count past i64::MAX cannot happen; it would show as
/// the largest value).
fn gauge(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
