//! Request and response bodies of the REST API. They are the API's own types (not the
//! guest protocol's): the REST surface can stay stable while the agent protocol moves,
//! and each carries its OpenAPI schema.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::ToSchema;

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxes {
    /// The snapshot to fork.
    #[schema(pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
    pub snapshot: String,
    /// How many children (1 to 256; at most the daemon's free capacity).
    #[serde(default = "one")]
    #[schema(minimum = 1, maximum = 256)]
    pub n: u32,
    /// vCPUs; a restored VM has its snapshot's, so only that number is accepted.
    #[serde(default)]
    pub vcpus: Option<u32>,
    /// Guest RAM in MiB; a restored VM has its snapshot's, so only that size is accepted.
    #[serde(default)]
    pub memory_mib: Option<u32>,
    /// Labels to find the sandboxes by.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Environment variables for each child: its commands, background processes and
    /// code contexts get them on top of the snapshot's (a context running Python sees
    /// them in `os.environ`). Children of a branch of this sandbox inherit them.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Seconds after which the daemon stops each child (none: it runs until deleted).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 2592000)]
    pub timeout_s: Option<u64>,
    /// What `timeout_s` does when it passes: `kill` (the default: stopped and removed)
    /// or `pause` (paused to disk; it stays until deleted and resumes on its next
    /// request).
    /// (Default: the snapshot's recipe's `on_timeout`, else `kill`.)
    #[serde(default)]
    #[schema(value_type = Option<String>, example = "pause")]
    pub on_timeout: Option<crate::state::OnTimeout>,
    /// Pause each child after this many seconds without an API request for it, an exec
    /// or an open stream (default: the snapshot's recipe's `auto_pause_after`, else
    /// never for idleness).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 2592000)]
    pub auto_pause_after_s: Option<u64>,
    /// Keep the children that start when others fail, and list each failure in
    /// `errors` (default: all or nothing).
    #[serde(default)]
    pub partial: bool,
    /// Answer when every child answers (201, the default), or at once with the fork's
    /// operation (202) to poll for progress and cancel.
    #[serde(default = "yes")]
    pub wait: bool,
    /// Limits of each child's QEMU beyond the defaults (memory: the guest's RAM plus
    /// 512 MiB for QEMU; one core per vCPU, weight 100, 256 processes).
    #[serde(default)]
    pub limits: Option<LimitsBody>,
    /// What each child may reach (for a snapshot whose guest has a NIC). By default
    /// nothing: egress `deny` with an empty allow-list.
    #[serde(default)]
    pub network: Option<NetworkBody>,
    /// On a host of a cluster: how the children are spread over its hosts (default:
    /// `pack`, this host first) and which hosts may take them (by label).
    #[serde(default)]
    pub placement: Option<crate::service::placement::Placement>,
}

/// A sandbox's egress policy. Destinations are `ADDRESS[/PREFIX][:PORT]` (IPv4; a port
/// means TCP and UDP). Private, loopback, link-local and multicast ranges, and with
/// them the host and other sandboxes, stay unreachable in every mode unless a
/// destination inside them is in `allow`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkBody {
    /// `deny` (only `allow` gets out), `allow` (all public destinations but `deny`),
    /// or `off` (the NIC's link is down).
    #[serde(default)]
    #[schema(value_type = String, example = "deny")]
    pub egress: forkd_host::network::policy::EgressMode,
    /// Destinations let out.
    #[serde(default)]
    #[schema(value_type = Vec<String>, example = json!(["203.0.113.0/24", "198.51.100.7:443"]))]
    pub allow: Vec<forkd_host::network::policy::Destination>,
    /// Destinations refused in `allow` mode.
    #[serde(default)]
    #[schema(value_type = Vec<String>)]
    pub deny: Vec<forkd_host::network::policy::Destination>,
}

impl NetworkBody {
    /// The policy it describes, checked as a whole.
    pub fn policy(self) -> Result<forkd_host::network::policy::EgressPolicy, String> {
        let p = forkd_host::network::policy::EgressPolicy {
            egress: self.egress,
            allow: self.allow,
            deny: self.deny,
        };
        p.check()?;
        Ok(p)
    }
}

impl From<&forkd_host::network::policy::EgressPolicy> for NetworkBody {
    fn from(p: &forkd_host::network::policy::EgressPolicy) -> Self {
        NetworkBody {
            egress: p.egress,
            allow: p.allow.clone(),
            deny: p.deny.clone(),
        }
    }
}

/// Limits a fork may choose for its children.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsBody {
    /// Memory its QEMU may use in MiB, guest RAM included (default: the RAM plus 512).
    /// Less than the guest's RAM is allowed: the kernel stops the child if its guest
    /// touches more than fits, and the child fails saying so.
    #[serde(default)]
    #[schema(minimum = 128, maximum = 1048576)]
    pub memory_mib: Option<u64>,
    /// CPU quota in cores (0.5: half a core); 0 for none.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 1024)]
    pub cpu_cores: Option<f64>,
    /// Share of CPU under contention, 1 to 10000 (100: as any other process).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 10000)]
    pub cpu_weight: Option<u32>,
    /// Processes and threads its QEMU may have.
    #[serde(default)]
    #[schema(minimum = 16, maximum = 65536)]
    pub pids: Option<u32>,
}

/// What a sandbox may use, and whether the host enforces it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxLimits {
    /// Memory its QEMU may use, guest RAM included.
    pub memory_bytes: u64,
    /// CPU quota in cores; null: none.
    pub cpu_cores: Option<f64>,
    /// CPU weight.
    pub cpu_weight: u32,
    /// Processes and threads its QEMU may have.
    pub pids: u32,
    /// The size of the guest's disk: it can write no more than this.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
    /// `cgroup v1` or `cgroup v2` when the limits are enforced by a cgroup of the
    /// sandbox's own; null when this host gives forkd no cgroups (`forkd doctor` says
    /// why).
    pub enforced_by: Option<String>,
    /// Memory its cgroup counts now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_used_bytes: Option<u64>,
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

/// The answer to a fork.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CreatedSandboxes {
    /// The children, running.
    pub sandboxes: Vec<SandboxInfo>,
    /// Why each child that did not start failed (only a `partial` fork keeps going).
    pub errors: Vec<String>,
    /// The fork's operation.
    pub operation: String,
}

/// A sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxInfo {
    /// Its id.
    pub id: String,
    /// The snapshot it was forked from.
    pub snapshot: String,
    /// `starting`, `running`, `unresponsive` (its VM runs but its agent does not
    /// answer: requests fail, the sandbox is kept), `stopping`, or `failed` (its VM
    /// exited or broke).
    pub status: String,
    /// Why it failed or is unresponsive.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// QEMU's pid on the host.
    pub pid: u32,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM, MiB.
    pub memory_mib: u32,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// RFC 3339.
    pub created_at: String,
    /// Unix time (seconds) at which the daemon stops it, if set.
    pub timeout_at: Option<i64>,
    /// Its limits (absent for a sandbox started before forkd had them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<SandboxLimits>,
    /// Its egress policy; null when its guest has no NIC.
    #[serde(default)]
    pub network: Option<NetworkBody>,
    /// The host of the cluster that owns it (only when the daemon is in a cluster).
    /// While that host is unreachable its status is `unknown`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

/// A list of sandboxes.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxList {
    /// The sandboxes, oldest first.
    pub sandboxes: Vec<SandboxInfo>,
}

/// `PUT /v1/sandboxes/{id}/timeout`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetTimeout {
    /// Seconds from now; null removes the deadline.
    #[schema(minimum = 1, maximum = 2592000)]
    pub timeout_s: Option<u64>,
}

/// `POST /v1/sandboxes/{id}/exec`: give `cmd` (an argv, no shell) or `shell` (run with
/// `/bin/sh -c`), not both.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    /// Program and arguments.
    #[serde(default)]
    #[schema(min_items = 1)]
    pub cmd: Option<Vec<String>>,
    /// A shell command line.
    #[serde(default)]
    pub shell: Option<String>,
    /// Environment variables added to the defaults.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory (absolute).
    #[serde(default)]
    #[schema(pattern = "^/")]
    pub cwd: Option<String>,
    /// Kill the command after this many seconds.
    #[serde(default)]
    #[schema(minimum = 0.001, maximum = 86400)]
    pub timeout_s: Option<f64>,
    /// Text given to the command on stdin, as UTF-8. For bytes that are not UTF-8 text
    /// use `stdin_b64`; give one or the other.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Bytes given to the command on stdin: base64 (RFC 4648 standard alphabet, with
    /// `=` padding) of the raw bytes.
    #[serde(default)]
    #[schema(content_encoding = "base64")]
    pub stdin_b64: Option<String>,
    /// Stream the output as NDJSON events instead of one JSON result.
    #[serde(default)]
    pub stream: bool,
}

/// How a command ended, with all of its output (the non-streaming form of exec). The
/// output is bytes, whatever they are: base64 (RFC 4648 standard alphabet, with `=`
/// padding) of exactly what the command wrote.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ExecResultBody {
    /// Standard output: base64 of the raw bytes.
    #[schema(content_encoding = "base64")]
    pub stdout_b64: String,
    /// Standard error: base64 of the raw bytes.
    #[schema(content_encoding = "base64")]
    pub stderr_b64: String,
    /// The exit code a shell would report (128 + signal for a signal).
    pub exit_code: i32,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
    /// True when the timeout killed it.
    pub timed_out: bool,
    /// Wall time in the guest, milliseconds.
    pub duration_ms: u64,
    /// True when the output passed the daemon's limit (16 MiB per stream) and was cut;
    /// use `stream` for more.
    pub truncated: bool,
}

/// One line of a streamed exec (NDJSON). Output comes in pieces as the command writes
/// it; a piece may end anywhere, even inside a multibyte character, so decode each
/// `data_b64` and concatenate the bytes of one stream before reading them as text.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecEventBody {
    /// Output on stdout.
    Stdout {
        /// Base64 (RFC 4648 standard alphabet, with `=` padding) of the raw bytes.
        #[schema(content_encoding = "base64")]
        data_b64: String,
    },
    /// Output on stderr.
    Stderr {
        /// Base64 (RFC 4648 standard alphabet, with `=` padding) of the raw bytes.
        #[schema(content_encoding = "base64")]
        data_b64: String,
    },
    /// The command ended; the last line.
    Exit {
        /// As in [`ExecResultBody`].
        exit_code: i32,
        /// The signal that ended it, if one did.
        signal: Option<i32>,
        /// True when the timeout killed it.
        timed_out: bool,
        /// Wall time in the guest, milliseconds.
        duration_ms: u64,
    },
    /// The sandbox failed mid-way; the last line.
    Error {
        /// What happened.
        message: String,
    },
}

/// `POST /v1/sandboxes/{id}/code`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCodeBody {
    /// The code: statements, optionally ending with an expression whose value is returned.
    pub code: String,
    /// The context to run in (default: the sandbox's first context; one is created if
    /// there is none).
    #[serde(default)]
    pub context: Option<String>,
    /// Interrupt the code after this many seconds.
    #[serde(default)]
    #[schema(minimum = 0.001, maximum = 86400)]
    pub timeout_s: Option<f64>,
    /// Stream the events as NDJSON instead of one JSON result.
    #[serde(default)]
    pub stream: bool,
    /// Variables set in `os.environ` for this run only, put back as they were after it.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// What a cell produced.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CodeResult {
    /// The context it ran in.
    pub context: String,
    /// All stdout.
    pub stdout: String,
    /// All stderr.
    pub stderr: String,
    /// Values: the last expression's, and figures left open.
    pub results: Vec<CodeValue>,
    /// The exception, if one was raised.
    pub error: Option<CodeError>,
    /// The context's cell counter after the run.
    pub execution_count: u64,
    /// True when the output passed the daemon's limit (16 MiB) and was cut; use
    /// `stream` for more.
    pub truncated: bool,
}

/// One value of a cell.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CodeValue {
    /// `repr()` of the value.
    pub text: String,
    /// HTML, for values that have it (a DataFrame).
    pub html: Option<String>,
    /// PNG, base64, for a matplotlib figure.
    pub png: Option<String>,
}

/// An exception raised by a cell.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CodeError {
    /// Class name.
    pub name: String,
    /// Message.
    pub value: String,
    /// Formatted traceback.
    pub traceback: String,
}

impl CodeResult {
    /// From the agent's collected execution.
    pub fn from_execution(context: String, x: forkd_proto::context::Execution) -> CodeResult {
        CodeResult {
            context,
            stdout: x.stdout,
            stderr: x.stderr,
            results: x
                .results
                .into_iter()
                .map(|r| CodeValue {
                    text: r.text,
                    html: r.html,
                    png: r.png,
                })
                .collect(),
            error: x.error.map(|e| CodeError {
                name: e.name,
                value: e.value,
                traceback: e.traceback,
            }),
            execution_count: x.execution_count,
            truncated: false,
        }
    }
}

/// `POST /v1/sandboxes/{id}/contexts`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateContextBody {
    /// Working directory of the interpreter.
    #[serde(default)]
    #[schema(pattern = "^/")]
    pub cwd: Option<String>,
    /// Environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// A code context.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ContextBody {
    /// Its id in the sandbox.
    pub id: String,
    /// `python`.
    pub language: String,
    /// The interpreter's pid in the guest.
    pub pid: u32,
    /// Cells run since it started or was reset.
    pub execution_count: u64,
}

impl From<forkd_proto::context::ContextInfo> for ContextBody {
    fn from(c: forkd_proto::context::ContextInfo) -> ContextBody {
        ContextBody {
            id: c.id,
            language: "python".into(),
            pid: c.pid,
            execution_count: c.execution_count,
        }
    }
}

/// A file or directory in a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FileInfo {
    /// Absolute path.
    pub path: String,
    /// Last component.
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    pub kind: String,
    /// Bytes.
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// Modification time, ms since the Unix epoch.
    pub mtime_ms: i64,
}

impl From<forkd_proto::files::FileStat> for FileInfo {
    fn from(s: forkd_proto::files::FileStat) -> FileInfo {
        let kind = serde_json::to_value(s.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(|| "other".into());
        FileInfo {
            path: s.path,
            name: s.name,
            kind,
            size: s.size,
            mode: s.mode,
            mtime_ms: s.mtime_ms,
        }
    }
}

/// A directory listing.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FileList {
    /// The entries, by name.
    pub entries: Vec<FileInfo>,
}

/// `POST /v1/sandboxes/{id}/files/mkdir`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PathBody {
    /// Absolute path in the guest.
    #[schema(pattern = "^/")]
    pub path: String,
}

/// `POST /v1/sandboxes/{id}/files/rename`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RenameBody {
    /// Current absolute path.
    #[schema(pattern = "^/")]
    pub from: String,
    /// New absolute path.
    #[schema(pattern = "^/")]
    pub to: String,
}

/// A snapshot.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SnapshotInfo {
    /// Its tag.
    pub tag: String,
    /// `ok`, or `damaged` (it will not be forked; see `error`).
    pub status: String,
    /// Why it is damaged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The template it was built from.
    pub template: Option<String>,
    /// RFC 3339.
    pub created_at: Option<String>,
    /// The snapshot it is a diff on, if any.
    pub parent: Option<String>,
    /// vCPUs of every child.
    pub vcpus: Option<u32>,
    /// Guest RAM of every child, MiB.
    pub memory_mib: Option<u32>,
    /// `kvm` or `tcg`.
    pub accel: Option<String>,
    /// Sum of the parts' sizes, bytes.
    pub size_bytes: Option<u64>,
    /// Bytes the parts take on disk (the memory image is sparse).
    pub disk_bytes: Option<u64>,
    /// Snapshots that depend on it.
    pub dependents: Vec<String>,
    /// Live sandboxes forked from it.
    pub children: Vec<String>,
    /// Its warm pool (children prepared ahead of forks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<crate::pool::PoolStatus>,
    /// Where it stands in its chain and what it stores.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chain: Option<ChainBody>,
    /// For a branch: the sandbox it was taken from and what the capture cost.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub branch: Option<forkd_storage::snapshot::manifest::BranchInfo>,
}

/// A snapshot's place in its chain.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChainBody {
    /// Links above a standalone snapshot (0 for a template's).
    pub depth: u32,
    /// Its ancestors' tags, nearest first.
    pub ancestors: Vec<String>,
    /// Bytes on disk that are its own (a link's device state, memory diff and disk layer).
    pub own_bytes: u64,
    /// Bytes on disk of the memory image its children map (a link's is made from the
    /// chain once, when it is written).
    pub memory_image_bytes: u64,
    /// Bytes on disk of the whole chain up to it.
    pub total_bytes: u64,
}

/// `POST /v1/snapshots/{tag}/compact`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompactBody {
    /// The standalone snapshot's tag.
    #[schema(pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
    pub tag: String,
}

/// `PUT /v1/snapshots/{tag}/pool`: how many children to keep prepared for forks of it.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetPoolBody {
    /// Members to keep ready (0 to 256); null goes back to the size its recipe set.
    pub size: Option<u32>,
}

/// A list of snapshots.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SnapshotList {
    /// By tag.
    pub snapshots: Vec<SnapshotInfo>,
}

/// `POST /v1/snapshots`: build a template into a snapshot.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BuildSnapshotBody {
    /// A built-in template (`minimal`, `python`) or one in the daemon's `templates/`.
    #[schema(pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
    pub template: String,
    /// The recipe itself (TOML), for a template the daemon does not have; `template`
    /// then names it.
    #[serde(default)]
    pub recipe: Option<String>,
    /// The tag (default: the template's name).
    #[serde(default)]
    #[schema(pattern = "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
    pub tag: Option<String>,
    /// With `recipe`: the contents of its `files`, base64, by their `src` (the daemon
    /// may be on another host than the recipe's directory).
    #[serde(default)]
    pub files: std::collections::BTreeMap<String, String>,
}

/// `POST /v1/snapshots/{tag}/verify`: every part re-hashed against its digest.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Verified {
    /// The tag.
    pub tag: String,
    /// Snapshots checked: it and its ancestors.
    pub links: u32,
    /// Bytes hashed.
    pub bytes: u64,
    /// How long it took, milliseconds.
    pub millis: u64,
}

/// `POST /v1/archives`: what an archive installed.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Unpacked {
    /// The tag of the archive's snapshot (the head of its chain).
    pub tag: String,
    /// Snapshots written, root first.
    pub installed: Vec<String>,
    /// Snapshots of its chain that were here already.
    pub present: Vec<String>,
}

/// `POST /v1/images`: the image kept.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct UploadedImage {
    /// What a recipe's `from` says to build on it: `upload:sha256:<hex>`.
    pub from: String,
    /// The digest of its manifest.
    pub digest: String,
    /// How many layers it has.
    pub layers: usize,
}

/// `?name=`: which image of the archive.
#[derive(Debug, Clone, Deserialize, utoipa::IntoParams)]
pub struct ImageUploadQuery {
    /// The image to keep when the archive holds several: a `docker save` archive's
    /// `REPO:TAG`, or an OCI layout's `org.opencontainers.image.ref.name`.
    pub name: Option<String>,
}

/// `?tag=`: the tag to install an archive's snapshot under.
#[derive(Debug, Clone, Deserialize, utoipa::IntoParams)]
pub struct UnpackQuery {
    /// Install the archive's snapshot under this tag instead of the one it was packed
    /// with (its ancestors keep theirs).
    pub tag: Option<String>,
}

/// `GET /v1/health`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// `ok`.
    pub status: String,
    /// Sandboxes running.
    pub sandboxes: usize,
    /// The most the daemon runs.
    pub capacity: usize,
}

/// `GET /v1/version`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Version {
    /// forkd's version.
    pub forkd: String,
    /// The guest agent protocol version.
    pub agent_protocol: u32,
    /// The hypervisor backend the daemon runs VMs with (`qemu`).
    pub hypervisor: String,
    /// That backend's version. The field is named for the first backend, and kept so
    /// for the clients that read it.
    pub qemu: String,
}

/// `GET /v1/operations`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct OperationList {
    /// Newest first.
    pub operations: Vec<crate::state::OperationRow>,
}

/// What a background process runs: a command as for exec, without stdin or streaming.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ProcessStartBody {
    /// Program and arguments.
    #[serde(default)]
    #[schema(min_items = 1)]
    pub cmd: Option<Vec<String>>,
    /// A shell command line.
    #[serde(default)]
    pub shell: Option<String>,
    /// Environment variables added to the defaults.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory (absolute).
    #[serde(default)]
    #[schema(pattern = "^/")]
    pub cwd: Option<String>,
    /// Kill the process after this many seconds.
    #[serde(default)]
    #[schema(minimum = 0.001, maximum = 86400)]
    pub timeout_s: Option<f64>,
    /// Keep its stdin open, a pipe written through
    /// `POST /v1/sandboxes/{id}/processes/{process}/stdin`; otherwise it reads end of
    /// file at once.
    #[serde(default)]
    pub stdin: bool,
}

/// Bytes for a background process's stdin, and whether to close it after them.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StdinBody {
    /// UTF-8 text to write. For bytes that are not UTF-8 use `data_b64`; give one or
    /// neither (to only close).
    #[serde(default)]
    pub data: Option<String>,
    /// Bytes to write: base64 (RFC 4648 standard alphabet, with `=` padding). A JSON
    /// body is at most 1 MiB, so about 768 KiB of bytes per request.
    #[serde(default)]
    #[schema(content_encoding = "base64")]
    pub data_b64: Option<String>,
    /// Close the stdin after writing: the process reads end of file.
    #[serde(default)]
    pub close: bool,
}

/// A background process: running, or how it ended, with the last 1 MiB of each output
/// stream as base64 (RFC 4648 standard alphabet, with `=` padding) of the raw bytes.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ProcessBody {
    /// The sandbox's id for it (not its pid, which the guest may reuse).
    pub id: u64,
    /// Its pid in the guest.
    pub pid: u32,
    /// What runs.
    pub argv: Vec<String>,
    /// When it started: milliseconds since the Unix epoch, guest clock.
    pub started_at_ms: u64,
    /// False once it has ended.
    pub running: bool,
    /// Whether its stdin is open for writes (started with `stdin`, not closed, running).
    pub stdin_open: bool,
    /// Once ended: the exit code a shell would report (128 + signal for a signal).
    pub exit_code: Option<i32>,
    /// Once ended by a signal: its number.
    pub signal: Option<i32>,
    /// True when its timeout killed it.
    pub timed_out: bool,
    /// Once ended: wall time in the guest, milliseconds.
    pub duration_ms: Option<u64>,
    /// The last 1 MiB of its standard output: base64 of the raw bytes.
    #[schema(content_encoding = "base64")]
    pub stdout_b64: String,
    /// The last 1 MiB of its standard error: base64 of the raw bytes.
    #[schema(content_encoding = "base64")]
    pub stderr_b64: String,
}

impl From<forkd_proto::exec::ProcessInfo> for ProcessBody {
    fn from(p: forkd_proto::exec::ProcessInfo) -> ProcessBody {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD;
        ProcessBody {
            id: p.id,
            pid: p.pid,
            argv: p.argv,
            started_at_ms: p.started_at_ms,
            running: p.exit.is_none(),
            stdin_open: p.stdin_open,
            exit_code: p.exit.map(|e| e.shell_code()),
            signal: p.exit.and_then(|e| e.signal),
            timed_out: p.exit.is_some_and(|e| e.timed_out),
            duration_ms: p.exit.map(|e| e.duration_ms),
            stdout_b64: b64.encode(&p.stdout),
            stderr_b64: b64.encode(&p.stderr),
        }
    }
}

/// A signal for a background process, or its group.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalBody {
    /// Its name (`SIGINT` or `INT`) or number (2).
    pub signal: SignalSpec,
    /// To the process's whole group (the default), or to the process alone.
    #[serde(default = "yes")]
    pub group: bool,
}

/// A signal by name or number.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum SignalSpec {
    /// Its number (15 for SIGTERM, 9 for SIGKILL...).
    Number(i32),
    /// Its name, with or without `SIG` (`SIGTERM`, `term`).
    Name(String),
}

impl SignalSpec {
    /// The signal's number, if it names one of Linux's standard signals.
    pub fn number(&self) -> Result<i32, String> {
        let sig = match self {
            SignalSpec::Number(n) => nix::sys::signal::Signal::try_from(*n).ok(),
            SignalSpec::Name(name) => {
                let upper = name.trim().to_ascii_uppercase();
                let full = if upper.starts_with("SIG") {
                    upper
                } else {
                    format!("SIG{upper}")
                };
                full.parse::<nix::sys::signal::Signal>().ok()
            }
        };
        sig.map(|s| s as i32).ok_or_else(|| match self {
            SignalSpec::Number(n) => format!("{n} is not a signal number"),
            SignalSpec::Name(n) => format!("{n:?} is not a signal's name"),
        })
    }
}
