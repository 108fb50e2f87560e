//! forkd as an MCP server, so that a model in an MCP client (Claude Desktop, Cursor, an
//! agent framework) drives sandboxes itself: on stdio (`forkd mcp`), and over
//! streamable HTTP at the daemon's `/mcp`. Each tool is one or two calls to the daemon's
//! REST API; the answers are text for the model, and a failure the daemon reports is a
//! tool error the model reads, not a protocol error.

use anyhow::Result;
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use forkd_daemon::client::Client;
use hyper::Method;
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, ServerCapabilities, ServerConfig};
use rmcp::{schemars, tool, tool_handler, tool_router, ErrorData, ServerHandler, ServiceExt};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// Most output bytes of one stream a tool hands the model.
const MAX_TEXT: usize = 64 << 10;

#[derive(Deserialize, schemars::JsonSchema)]
struct CreateSandbox {
    /// The snapshot to fork: a template's name (e.g. `python`) or a branch's tag.
    snapshot: String,
    /// How many sandboxes (1 by default).
    #[serde(default)]
    count: Option<u32>,
    /// End them after this many seconds.
    #[serde(default)]
    timeout_s: Option<u64>,
    /// What they may reach: `deny` (only `allow`; the snapshot's default otherwise,
    /// usually nothing), `allow` (every public destination but `deny`) or `off`.
    #[serde(default)]
    egress: Option<String>,
    /// Destinations let out: addresses, networks (`203.0.113.0/24`), `:PORT` suffixes,
    /// or DNS names (`pypi.org`, `*.pythonhosted.org`).
    #[serde(default)]
    allow: Option<Vec<String>>,
    /// Destinations refused with egress `allow`.
    #[serde(default)]
    deny: Option<Vec<String>>,
}

#[derive(Deserialize, schemars::JsonSchema)]
struct SandboxId {
    /// The sandbox's id (`sb-...`).
    id: String,
}

#[derive(Deserialize, schemars::JsonSchema)]
struct RunCommand {
    /// The sandbox's id.
    id: String,
    /// A shell command line, run with /bin/sh -c.
    command: String,
    /// Working directory (absolute).
    #[serde(default)]
    cwd: Option<String>,
    /// Environment variables to add.
    #[serde(default)]
    env: Option<BTreeMap<String, String>>,
    /// Kill it after this many seconds.
    #[serde(default)]
    timeout_s: Option<f64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
struct RunCode {
    /// The sandbox's id.
    id: String,
    /// Python code; the value of its last expression is returned.
    code: String,
    /// The code context to run in (default: the sandbox's first; state persists).
    #[serde(default)]
    context: Option<String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
struct FilePath {
    /// The sandbox's id.
    id: String,
    /// Absolute path in the sandbox.
    path: String,
}

#[derive(Deserialize, schemars::JsonSchema)]
struct WriteFile {
    /// The sandbox's id.
    id: String,
    /// Absolute path in the sandbox; parent directories are made.
    path: String,
    /// The file's new contents (UTF-8 text).
    content: String,
}

#[derive(Deserialize, schemars::JsonSchema)]
struct Branch {
    /// The running sandbox to snapshot; it runs on.
    id: String,
    /// The new snapshot's tag (default: a generated one).
    #[serde(default)]
    tag: Option<String>,
}

/// The MCP server: a client of one forkd daemon.
#[derive(Clone)]
pub struct ForkdMcp {
    client: Client,
    tool_router: ToolRouter<Self>,
}

fn text(s: impl Into<String>) -> Result<CallToolResult, ErrorData> {
    Ok(CallToolResult::success(vec![ContentBlock::text(s)]))
}

fn failed(e: anyhow::Error) -> Result<CallToolResult, ErrorData> {
    Ok(CallToolResult::error(vec![ContentBlock::text(format!(
        "{e:#}"
    ))]))
}

/// Output bytes as text for a model: UTF-8 (invalid bytes replaced), the tail kept.
fn output(b64: &Value) -> String {
    let bytes = BASE64
        .decode(b64.as_str().unwrap_or_default())
        .unwrap_or_default();
    let cut = bytes.len().saturating_sub(MAX_TEXT);
    let text = String::from_utf8_lossy(&bytes[cut..]).into_owned();
    if cut > 0 {
        format!("[... {cut} earlier bytes left out]\n{text}")
    } else {
        text
    }
}

fn query(pairs: &[(&str, &str)]) -> String {
    serde_urlencoded::to_string(pairs).unwrap_or_default()
}

#[tool_router]
impl ForkdMcp {
    fn new(client: Client) -> ForkdMcp {
        ForkdMcp {
            client,
            tool_router: Self::tool_router(),
        }
    }

    async fn api(&self, method: Method, path: &str, body: Option<Value>) -> Result<Value> {
        self.client.json(method, path, body.as_ref()).await
    }

    #[tool(
        description = "List the snapshots sandboxes can be forked from (templates and branches)."
    )]
    async fn list_snapshots(&self) -> Result<CallToolResult, ErrorData> {
        match self.api(Method::GET, "/v1/snapshots", None).await {
            Ok(v) => {
                let lines: Vec<String> = v["snapshots"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|s| {
                        format!(
                            "{} ({}{})",
                            s["tag"].as_str().unwrap_or("?"),
                            s["status"].as_str().unwrap_or("?"),
                            s["parent"]
                                .as_str()
                                .map(|p| format!(", branch of {p}"))
                                .unwrap_or_default()
                        )
                    })
                    .collect();
                text(if lines.is_empty() {
                    "no snapshots (build one with `forkd template build python`)".to_owned()
                } else {
                    lines.join("\n")
                })
            }
            Err(e) => failed(e),
        }
    }

    #[tool(
        description = "Start sandboxes forked from a snapshot: each is a VM with the snapshot's state, ready in well under a second. Returns their ids."
    )]
    async fn create_sandbox(
        &self,
        Parameters(p): Parameters<CreateSandbox>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut body = json!({ "snapshot": p.snapshot, "n": p.count.unwrap_or(1) });
        if let Some(t) = p.timeout_s {
            body["timeout_s"] = t.into();
        }
        if p.egress.is_some() || p.allow.is_some() || p.deny.is_some() {
            let mut network = json!({
                "allow": p.allow.unwrap_or_default(),
                "deny": p.deny.unwrap_or_default(),
            });
            if let Some(e) = p.egress {
                network["egress"] = e.into();
            }
            body["network"] = network;
        }
        match self.api(Method::POST, "/v1/sandboxes", Some(body)).await {
            Ok(v) => text(
                v["sandboxes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s["id"].as_str())
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
            Err(e) => failed(e),
        }
    }

    #[tool(description = "List the running sandboxes with their snapshot and status.")]
    async fn list_sandboxes(&self) -> Result<CallToolResult, ErrorData> {
        match self.api(Method::GET, "/v1/sandboxes", None).await {
            Ok(v) => {
                let lines: Vec<String> = v["sandboxes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|s| {
                        format!(
                            "{} {} (from {})",
                            s["id"].as_str().unwrap_or("?"),
                            s["status"].as_str().unwrap_or("?"),
                            s["snapshot"].as_str().unwrap_or("?")
                        )
                    })
                    .collect();
                text(if lines.is_empty() {
                    "no sandboxes".to_owned()
                } else {
                    lines.join("\n")
                })
            }
            Err(e) => failed(e),
        }
    }

    #[tool(description = "Stop a sandbox and remove everything it made.")]
    async fn kill_sandbox(
        &self,
        Parameters(p): Parameters<SandboxId>,
    ) -> Result<CallToolResult, ErrorData> {
        match self.client.delete(&format!("/v1/sandboxes/{}", p.id)).await {
            Ok(()) => text(format!("{} stopped", p.id)),
            Err(e) => failed(e),
        }
    }

    #[tool(
        description = "Pause a running sandbox to disk: it keeps its files, processes and Python state and costs no memory until resumed. Any later call on it (run_command, run_code, files) resumes it."
    )]
    async fn pause_sandbox(
        &self,
        Parameters(p): Parameters<SandboxId>,
    ) -> Result<CallToolResult, ErrorData> {
        let path = format!("/v1/sandboxes/{}/pause", p.id);
        match self.api(Method::POST, &path, None).await {
            Ok(v) => text(format!(
                "{} paused ({:.1} MiB stored)",
                p.id,
                v["stored_bytes"].as_f64().unwrap_or(0.0) / f64::from(1 << 20)
            )),
            Err(e) => failed(e),
        }
    }

    #[tool(description = "Resume a paused sandbox, as it was when paused.")]
    async fn resume_sandbox(
        &self,
        Parameters(p): Parameters<SandboxId>,
    ) -> Result<CallToolResult, ErrorData> {
        let path = format!("/v1/sandboxes/{}/resume", p.id);
        match self.api(Method::POST, &path, None).await {
            Ok(_) => text(format!("{} runs", p.id)),
            Err(e) => failed(e),
        }
    }

    #[tool(
        description = "Run a shell command in a sandbox and wait for it. Returns its exit code, stdout and stderr."
    )]
    async fn run_command(
        &self,
        Parameters(p): Parameters<RunCommand>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut body = json!({ "shell": p.command });
        if let Some(cwd) = p.cwd {
            body["cwd"] = cwd.into();
        }
        if let Some(env) = p.env {
            body["env"] = json!(env);
        }
        if let Some(t) = p.timeout_s {
            body["timeout_s"] = t.into();
        }
        let path = format!("/v1/sandboxes/{}/exec", p.id);
        match self.api(Method::POST, &path, Some(body)).await {
            Ok(v) => {
                let mut s = format!("exit code {}", v["exit_code"]);
                if v["timed_out"] == true {
                    s.push_str(" (killed by its timeout)");
                }
                s.push_str(&format!(
                    "\n--- stdout\n{}\n--- stderr\n{}",
                    output(&v["stdout_b64"]),
                    output(&v["stderr_b64"])
                ));
                text(s)
            }
            Err(e) => failed(e),
        }
    }

    #[tool(
        description = "Run Python code in a sandbox's persistent interpreter (variables survive between calls; pandas is warm in the python template). Returns printed output, the last expression's value and any exception with its traceback."
    )]
    async fn run_code(
        &self,
        Parameters(p): Parameters<RunCode>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut body = json!({ "code": p.code });
        if let Some(c) = p.context {
            body["context"] = c.into();
        }
        let path = format!("/v1/sandboxes/{}/code", p.id);
        match self.api(Method::POST, &path, Some(body)).await {
            Ok(v) => {
                let mut parts = Vec::new();
                for (key, label) in [("stdout", "stdout"), ("stderr", "stderr")] {
                    if let Some(s) = v[key].as_str().filter(|s| !s.is_empty()) {
                        parts.push(format!("--- {label}\n{s}"));
                    }
                }
                // Figures go to the model as images (PNG, base64 as the API gives them).
                let mut images = Vec::new();
                for r in v["results"].as_array().into_iter().flatten() {
                    parts.push(format!("--- value\n{}", r["text"].as_str().unwrap_or("")));
                    if let Some(png) = r["png"].as_str() {
                        images.push(ContentBlock::image(png, "image/png"));
                    }
                }
                let raised = v["error"].as_object().map(|e| {
                    parts.push(format!(
                        "--- exception\n{}",
                        e.get("traceback").and_then(Value::as_str).unwrap_or("")
                    ));
                });
                if parts.is_empty() {
                    parts.push("(no output)".to_owned());
                }
                let mut content = vec![ContentBlock::text(parts.join("\n"))];
                content.extend(images);
                Ok(match raised {
                    Some(()) => CallToolResult::error(content),
                    None => CallToolResult::success(content),
                })
            }
            Err(e) => failed(e),
        }
    }

    #[tool(description = "Read a text file from a sandbox.")]
    async fn read_file(
        &self,
        Parameters(p): Parameters<FilePath>,
    ) -> Result<CallToolResult, ErrorData> {
        let path = format!(
            "/v1/sandboxes/{}/files?{}",
            p.id,
            query(&[("path", &p.path)])
        );
        match self.client.call(Method::GET, &path, None).await {
            Ok((status, body)) if status.is_success() => match String::from_utf8(body.to_vec()) {
                Ok(s) => text(s),
                Err(_) => text(format!(
                    "{} is not UTF-8 text ({} bytes); read it with run_command (e.g. xxd)",
                    p.path,
                    body.len()
                )),
            },
            Ok((status, body)) => failed(anyhow::anyhow!(
                "{}",
                forkd_daemon::client::failure(status, &body)
            )),
            Err(e) => failed(e),
        }
    }

    #[tool(description = "Write a text file in a sandbox (replacing it).")]
    async fn write_file(
        &self,
        Parameters(p): Parameters<WriteFile>,
    ) -> Result<CallToolResult, ErrorData> {
        let path = format!(
            "/v1/sandboxes/{}/files?{}",
            p.id,
            query(&[("path", &p.path)])
        );
        let len = p.content.len();
        match self
            .client
            .send(Method::PUT, &path, Some(p.content.into_bytes()))
            .await
        {
            Ok(resp) if resp.status().is_success() => {
                text(format!("wrote {len} bytes to {}", p.path))
            }
            Ok(resp) => {
                let status = resp.status();
                let body = http_body_util::BodyExt::collect(resp.into_body())
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                failed(anyhow::anyhow!(
                    "{}",
                    forkd_daemon::client::failure(status, &body)
                ))
            }
            Err(e) => failed(e),
        }
    }

    #[tool(description = "List a directory in a sandbox.")]
    async fn list_files(
        &self,
        Parameters(p): Parameters<FilePath>,
    ) -> Result<CallToolResult, ErrorData> {
        let path = format!(
            "/v1/sandboxes/{}/files/list?{}",
            p.id,
            query(&[("path", &p.path)])
        );
        match self.api(Method::GET, &path, None).await {
            Ok(v) => text(
                v["entries"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| {
                        format!(
                            "{}{} {}",
                            e["name"].as_str().unwrap_or("?"),
                            if e["kind"] == "dir" { "/" } else { "" },
                            e["size"]
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
            Err(e) => failed(e),
        }
    }

    #[tool(
        description = "Snapshot a running sandbox (memory, processes, files, Python state) while it runs on. Fork the snapshot with create_sandbox to try several next steps from the same state. Returns the snapshot's tag."
    )]
    async fn branch_sandbox(
        &self,
        Parameters(p): Parameters<Branch>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut body = json!({});
        if let Some(t) = p.tag {
            body["tag"] = t.into();
        }
        let path = format!("/v1/sandboxes/{}/branch", p.id);
        match self.api(Method::POST, &path, Some(body)).await {
            Ok(v) => text(v["snapshot"].as_str().unwrap_or("?")),
            Err(e) => failed(e),
        }
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for ForkdMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(rmcp::model::Implementation::new(
                "forkd",
                env!("CARGO_PKG_VERSION"),
            ))
            .with_instructions(
                "forkd runs code in microVM sandboxes forked from warm snapshots. \
                 list_snapshots, then create_sandbox from one (python has pandas warm); \
                 run_command and run_code in it; branch_sandbox to snapshot a state and \
                 fork it again; pause_sandbox to keep one for later at no memory cost \
                 (any call resumes it); kill_sandbox when done.",
            )
    }
}

/// MCP over streamable HTTP at `/mcp`, for the daemon to serve beside its REST API (and
/// behind the same bearer token on TCP). Each MCP session is a server whose tools call
/// the daemon through `client`. Without a token, only loopback `Host` names are
/// accepted (a browser page on another site cannot reach it through DNS rebinding);
/// with one, a request must carry the token, which such a page cannot.
pub fn http_router(client: Client, token_required: bool) -> axum::Router {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let mut config = StreamableHttpServerConfig::default();
    if token_required {
        config = config.disable_allowed_hosts();
    }
    let service = StreamableHttpService::new(
        move || Ok(ForkdMcp::new(client.clone())),
        std::sync::Arc::new(LocalSessionManager::default()),
        config,
    );
    axum::Router::new().nest_service("/mcp", service)
}

/// Serves MCP on stdin/stdout until the client closes them.
pub async fn serve(client: Client) -> Result<()> {
    let service = ForkdMcp::new(client)
        .serve(rmcp::transport::stdio())
        .await?;
    service.waiting().await?;
    Ok(())
}
