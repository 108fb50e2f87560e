//! The agent's HTTP router and the state its routes share.

use crate::children::Children;
use crate::contexts::Contexts;
use crate::error::ApiError;
use crate::processes::Processes;
use crate::{contexts, exec, files, pid1, processes, resume};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, Uri};
use axum::routing::{get, post};
use axum::{Json, Router};
use forkd_proto::{routes, PingResponse, ShutdownRequest, AGENT_VERSION, PROTOCOL_VERSION};
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// How the agent runs, which decides what shutdown and the resume hook may touch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// PID 1 of a guest: shutdown stops the VM.
    Pid1,
    /// A process on a host (`serve-unix`): shutdown only ends the process, and the
    /// resume hook leaves the host's clock and hostname alone (they are not the
    /// agent's to change there).
    Dev,
}

/// State shared by all routes of all sessions.
#[derive(Debug)]
pub struct AppState {
    /// PID 1 or dev.
    pub mode: Mode,
    /// Pids the agent spawned (see [`crate::children`]).
    pub children: Arc<Children>,
    /// Background processes.
    pub processes: Processes,
    /// Code contexts.
    pub contexts: Contexts,
    /// The environment every command starts from: [`default_env`], the image's `Env`,
    /// and what the host adds at a child's resume (the sandbox's own variables).
    env: std::sync::RwLock<BTreeMap<String, String>>,
    /// The image's working directory and user (see [`ImageDefaults`]).
    image: ImageDefaults,
}

use forkd_proto::image::{ImageDefaults, IMAGE_CONFIG_PATH as IMAGE_DEFAULTS};

/// [`ImageDefaults`] from the root filesystem (none when the file is absent or bad:
/// forkd's own images have none).
fn load_image_defaults() -> ImageDefaults {
    let Ok(text) = std::fs::read(IMAGE_DEFAULTS) else {
        return ImageDefaults::default();
    };
    serde_json::from_slice(&text).unwrap_or_else(|e| {
        crate::pid1::log(&format!("{IMAGE_DEFAULTS} is not valid, ignored: {e}"));
        ImageDefaults::default()
    })
}

impl AppState {
    /// State for `mode`, with the default environment.
    pub fn new(mode: Mode, children: Arc<Children>) -> Arc<Self> {
        // Only a guest's root has the image's defaults; the dev mode runs on a host.
        let image = match mode {
            Mode::Pid1 => load_image_defaults(),
            _ => ImageDefaults::default(),
        };
        let mut env = default_env();
        env.extend(
            image
                .env
                .iter()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned())),
        );
        Arc::new(AppState {
            mode,
            children,
            processes: Processes::default(),
            contexts: Contexts::default(),
            env: std::sync::RwLock::new(env),
            image,
        })
    }

    /// What a command starts with unless its request says otherwise.
    pub fn exec_defaults(&self) -> crate::exec::ExecDefaults {
        crate::exec::ExecDefaults {
            env: self.env(),
            cwd: self.image.working_dir.clone(),
            user: self.image.user.clone(),
        }
    }

    /// The environment a command starts from now.
    pub fn env(&self) -> BTreeMap<String, String> {
        self.env.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Adds `vars` to (or replaces them in) the environment commands start from.
    pub fn add_env(&self, vars: &BTreeMap<String, String>) {
        self.env
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .extend(vars.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
}

/// The environment commands get unless the request overrides it: what a login shell
/// on a Debian system would have, since the agent itself starts with next to nothing.
pub fn default_env() -> BTreeMap<String, String> {
    [
        (
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        ),
        ("HOME", "/root"),
        ("LANG", "C.UTF-8"),
        ("TERM", "xterm-256color"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// The router of the agent protocol.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route(routes::PING, get(ping))
        .route(routes::EXEC, post(exec::exec))
        .route(
            routes::PROCESSES,
            post(processes::start).get(processes::list),
        )
        .route(
            "/v1/processes/{id}",
            get(processes::get).delete(processes::delete),
        )
        .route("/v1/processes/{id}/wait", post(processes::wait))
        .route("/v1/processes/{id}/signal", post(processes::signal))
        .route(routes::SIGNAL, post(processes::signal_pid))
        .route("/v1/processes/{id}/stdin", post(processes::stdin))
        .route(routes::FILES, get(files::read).put(files::write))
        .route(routes::FILES_LIST, get(files::list))
        .route(routes::FILES_STAT, get(files::stat))
        .route(routes::FILES_MKDIR, post(files::mkdir))
        .route(routes::FILES_REMOVE, post(files::remove))
        .route(routes::FILES_RENAME, post(files::rename))
        .route(routes::FILES_WATCH, get(crate::watch::watch))
        .route(routes::CONTEXTS, post(contexts::create).get(contexts::list))
        .route(
            "/v1/contexts/{id}",
            get(contexts::get).delete(contexts::delete),
        )
        .route("/v1/contexts/{id}/run", post(contexts::run))
        .route("/v1/contexts/{id}/reset", post(contexts::reset))
        .route(routes::RESUME, post(resume::resume))
        .route(routes::SHUTDOWN, post(shutdown))
        .route(routes::SYNC, post(sync))
        .fallback(no_route)
        .method_not_allowed_fallback(no_route)
        .with_state(state)
}

/// Parses a JSON request body, answering 400 with the reason when it does not fit.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("malformed JSON body: {e}")))
}

/// Parses a query string, answering 400 with the reason when it does not fit.
pub fn parse_query<T: DeserializeOwned>(query: Option<&str>) -> Result<T, ApiError> {
    serde_urlencoded::from_str(query.unwrap_or(""))
        .map_err(|e| ApiError::invalid(format!("malformed query: {e}")))
}

async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::not_found(format!("no route for {method} {}", uri.path()))
}

async fn ping() -> Json<PingResponse> {
    let uptime_ms = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .map(|t| {
            let ms = t.tv_sec() * 1000 + t.tv_nsec() / 1_000_000;
            u64::try_from(ms).unwrap_or(0)
        })
        .unwrap_or(0);
    let hostname = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    Json(PingResponse {
        agent_version: AGENT_VERSION.to_string(),
        protocol: PROTOCOL_VERSION,
        uptime_ms,
        hostname,
    })
}

/// `POST /v1/shutdown`: answers first, then stops in the background, so the host gets
/// its answer before the channel goes away.
/// sync(2) in the agent's own process: a template build flushes the guest before the
/// freeze without running anything of the image (which may have no `sync`), and
/// without a process whose teardown the children would each pay for after the restore.
async fn sync() -> Result<Json<serde_json::Value>, ApiError> {
    tokio::task::spawn_blocking(nix::unistd::sync)
        .await
        .map_err(|e| ApiError::new(forkd_proto::ErrorCode::Internal, e.to_string()))?;
    Ok(Json(serde_json::json!({})))
}

async fn shutdown(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    // An empty body means the defaults.
    let req: ShutdownRequest = if body.is_empty() {
        ShutdownRequest::default()
    } else {
        parse_json(&body)?
    };
    let mode = state.mode;
    tokio::spawn(async move {
        // Time for the answer to leave through the port.
        tokio::time::sleep(Duration::from_millis(100)).await;
        match mode {
            Mode::Pid1 => pid1::shutdown(req.poweroff).await,
            Mode::Dev => {
                eprintln!("forkd-agent: shutdown requested; exiting");
                std::process::exit(0);
            }
        }
    });
    Ok(Json(serde_json::json!({})))
}
