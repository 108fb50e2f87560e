//! `POST /v1/exec`: a foreground command whose stdin, stdout and stderr travel as frames
//! in the request and response bodies. Also the spawning shared with background
//! processes.

use crate::children::{Children, Tracked};
use crate::error::ApiError;
use crate::server::AppState;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use forkd_proto::exec::{ExecEvent, ExecRequest, ExitStatus};
use forkd_proto::frame::{self, Decoder, Tag};
use forkd_proto::ErrorCode;
use http_body_util::BodyExt;
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

/// Output is read and forwarded in chunks of at most this many bytes.
pub const CHUNK: usize = 64 * 1024;

/// Frames buffered between the output readers and the response body. Small, so a host
/// that reads slowly stalls the readers (and so the command's pipe) instead of making
/// the agent buffer without bound.
const CHANNEL_FRAMES: usize = 16;

/// After the agent killed a command's group, how long to wait for its output pipes to
/// close: a process that left the group (its own `setsid`) may hold them open forever.
const KILL_GRACE: Duration = Duration::from_secs(2);

/// Content type of framed bodies (informational; the host does not need it).
pub const FRAMES_CONTENT_TYPE: &str = "application/x-forkd-frames";

/// A spawned command.
pub struct Spawned {
    /// The child process (pipes per the caller's choice).
    pub child: Child,
    /// Keeps the pid in the agent's own set until the child is waited for.
    pub tracked: Tracked,
    /// What was run.
    pub argv: Vec<String>,
    /// When it was spawned.
    pub started: Instant,
}

/// Where a spawned command's stdin, stdout and stderr go.
pub enum Stdios {
    /// stdout and stderr are pipes; stdin as given.
    Pipes(Stdio),
    /// The three are the slave of a terminal ([`crate::pty::open`]), which becomes the
    /// command's controlling terminal.
    Terminal([Stdio; 3]),
}

/// Spawns `req` in its own session and process group, with the default environment plus
/// `req.env`, in `req.cwd` (or `/`). On a terminal, an empty argv is the user's login
/// shell.
pub fn spawn(
    children: &Arc<Children>,
    defaults: &ExecDefaults,
    req: &ExecRequest,
    stdios: Stdios,
) -> Result<Spawned, ApiError> {
    let user = match req.user.as_deref().or(defaults.user.as_deref()) {
        None => None,
        Some(name) => Some(account(name)?),
    };
    let mut argv = req.command.to_argv();
    let terminal = matches!(stdios, Stdios::Terminal(_));
    // A login shell: named with a leading '-', as login(1) and sshd start one.
    let mut arg0 = None;
    if argv.is_empty() && terminal {
        let shell = match &user {
            Some(a) => a.shell.clone(),
            None => account("root").map_or_else(|_| "/bin/sh".to_owned(), |a| a.shell),
        };
        let base = shell.rsplit('/').next().unwrap_or("sh").to_owned();
        arg0 = Some(format!("-{base}"));
        argv = vec![shell];
    }
    let Some(program) = argv.first() else {
        return Err(ApiError::invalid("the command's argv is empty"));
    };
    // The request's directory, else the image's WorkingDir, else the user's home.
    let cwd = req
        .cwd
        .as_deref()
        .or(defaults.cwd.as_deref())
        .or(user.as_ref().map(|u| u.dir.as_str()))
        .unwrap_or("/");
    let default_env = &defaults.env;
    // Checked beforehand because a failing chdir in the child surfaces as the same
    // ENOENT as a missing program, and the two need different answers.
    match std::fs::metadata(cwd) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(ApiError::new(
                ErrorCode::NotADirectory,
                format!("working directory is not a directory: {cwd}"),
            ))
        }
        Err(e) => {
            let err = ApiError::io(&e, cwd);
            return Err(ApiError::new(
                err.code,
                format!("working directory unusable: {}", err.message),
            ));
        }
    }
    let mut cmd = Command::new(program);
    cmd.args(&argv[1..]).env_clear().envs(default_env);
    if let Some(u) = &user {
        // std drops the supplementary groups when it changes the uid as root.
        cmd.uid(u.uid)
            .gid(u.gid)
            .env("HOME", &u.dir)
            .env("USER", &u.name)
            .env("LOGNAME", &u.name);
    }
    if let Some(a) = &arg0 {
        cmd.arg0(a);
    }
    if terminal {
        // What a terminal program needs to know; the request may say otherwise.
        cmd.env("TERM", "xterm-256color");
    }
    cmd.envs(&req.env)
        .current_dir(cwd)
        // The agent kills the whole process group itself, when it means to.
        .kill_on_drop(false);
    match stdios {
        Stdios::Pipes(stdin) => {
            cmd.stdin(stdin)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            // SAFETY: the closure runs in the forked child before exec; it only calls
            // setsid(2), which is async-signal-safe, and allocates nothing (errno
            // converts to io::Error without allocating).
            unsafe {
                cmd.pre_exec(|| {
                    nix::unistd::setsid().map_err(std::io::Error::from)?;
                    Ok(())
                });
            }
        }
        Stdios::Terminal([stdin, stdout, stderr]) => {
            cmd.stdin(stdin).stdout(stdout).stderr(stderr);
            // SAFETY: as above; make_controlling calls only setsid(2) and ioctl(2).
            unsafe {
                cmd.pre_exec(crate::pty::make_controlling);
            }
        }
    }
    let started = Instant::now();
    let (child, tracked) = children.spawn(&mut cmd).map_err(|e| {
        ApiError::new(
            ErrorCode::SpawnFailed,
            format!("cannot start {program}: {e}"),
        )
    })?;
    Ok(Spawned {
        child,
        tracked,
        argv,
        started,
    })
}

/// An account of the guest.
pub(crate) struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub dir: String,
    /// Its login shell.
    pub shell: String,
}

/// The guest's account `name`, read from `/etc/passwd` itself: the agent is linked
/// statically, and glibc's getpwnam would load the guest's NSS modules into it.
pub(crate) fn account(name: &str) -> Result<Account, ApiError> {
    // An image's `User` may be `uid[:gid]`: the account of that uid if there is one,
    // else the bare ids.
    if let Some((uid, gid)) = numeric_user(name) {
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
        let known = passwd
            .lines()
            .filter_map(|l| l.split(':').next())
            .find_map(|n| passwd_entry(&passwd, n).filter(|a| a.uid == uid));
        return Ok(match known {
            Some(mut a) => {
                a.gid = gid.unwrap_or(a.gid);
                a
            }
            None => Account {
                name: uid.to_string(),
                uid,
                gid: gid.unwrap_or(uid),
                dir: "/".into(),
                shell: "/bin/sh".into(),
            },
        });
    }
    let passwd = std::fs::read_to_string("/etc/passwd")
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("reading /etc/passwd: {e}")))?;
    passwd_entry(&passwd, name).ok_or_else(|| {
        ApiError::new(
            ErrorCode::NotFound,
            format!("there is no user {name:?} in the guest's /etc/passwd"),
        )
    })
}

/// `uid` or `uid:gid`, as numbers.
fn numeric_user(s: &str) -> Option<(u32, Option<u32>)> {
    let (u, g) = match s.split_once(':') {
        Some((u, g)) => (u, Some(g.parse().ok()?)),
        None => (s, None),
    };
    Some((u.parse().ok()?, g))
}

/// What commands start with unless the request says otherwise: the environment, and
/// from the image a template was built from, its working directory and user.
#[derive(Debug, Clone, Default)]
pub struct ExecDefaults {
    /// The environment.
    pub env: BTreeMap<String, String>,
    /// The image's `WorkingDir`.
    pub cwd: Option<String>,
    /// The image's `User`.
    pub user: Option<String>,
}

/// The entry of `name` in the text of a passwd file.
fn passwd_entry(passwd: &str, name: &str) -> Option<Account> {
    passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 || f[0] != name {
            return None;
        }
        Some(Account {
            name: f[0].to_owned(),
            uid: f[2].parse().ok()?,
            gid: f[3].parse().ok()?,
            dir: if f[5].is_empty() {
                "/".into()
            } else {
                f[5].to_owned()
            },
            shell: if f[6].is_empty() {
                "/bin/sh".into()
            } else {
                f[6].to_owned()
            },
        })
    })
}

/// Sends `sig` to the process group `pgid` (a child's pid, as every child is a session
/// leader). A group that is already gone is not an error.
pub fn kill_group(pgid: u32, sig: Signal) {
    // pid 0 would mean the agent's own group: never.
    let Ok(raw) = i32::try_from(pgid) else { return };
    if raw <= 0 {
        return;
    }
    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(raw), sig);
}

/// The wire form of a child's exit status.
pub fn exit_status(
    status: std::process::ExitStatus,
    timed_out: bool,
    started: Instant,
) -> ExitStatus {
    use std::os::unix::process::ExitStatusExt;
    ExitStatus {
        code: status.code(),
        signal: status.signal(),
        timed_out,
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    }
}

/// Reads the first frame of an exec request body: the JSON header.
async fn read_header(body: &mut Body, dec: &mut Decoder) -> Result<ExecRequest, ApiError> {
    loop {
        match dec.next_frame() {
            Err(e) => return Err(ApiError::invalid(format!("malformed exec request: {e}"))),
            Ok(Some(f)) if f.tag == Tag::Json => {
                return serde_json::from_slice(&f.payload)
                    .map_err(|e| ApiError::invalid(format!("malformed exec request header: {e}")))
            }
            Ok(Some(f)) => {
                return Err(ApiError::invalid(format!(
                    "the first frame of an exec request must be a JSON ExecRequest, not {:?}",
                    f.tag
                )))
            }
            Ok(None) => {}
        }
        match body.frame().await {
            None => {
                return Err(ApiError::invalid(
                    "exec request body ended before its JSON header",
                ))
            }
            Some(Err(e)) => {
                return Err(ApiError::invalid(format!(
                    "reading the exec request failed: {e}"
                )))
            }
            Some(Ok(f)) => {
                if let Ok(data) = f.into_data() {
                    dec.push(&data);
                }
            }
        }
    }
}

/// `POST /v1/exec`.
pub async fn exec(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let mut body = req.into_body();
    let mut dec = Decoder::new();
    let header = match read_header(&mut body, &mut dec).await {
        Ok(h) => h,
        Err(e) => return e.into_response(),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(CHANNEL_FRAMES);
    tokio::spawn(run(state, header, body, dec, tx));
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, FRAMES_CONTENT_TYPE)],
        Body::from_stream(stream),
    )
        .into_response()
}

/// Runs one foreground command and streams its events into `tx`.
async fn run(
    state: Arc<AppState>,
    req: ExecRequest,
    body: Body,
    dec: Decoder,
    tx: mpsc::Sender<Bytes>,
) {
    let (stdios, terminal) = match req.pty {
        None if req.stdin => (Stdios::Pipes(Stdio::piped()), None),
        None => (Stdios::Pipes(Stdio::null()), None),
        Some(size) => {
            let opened = match size.problem() {
                Some(p) => Err(ApiError::invalid(p)),
                None => crate::pty::open(size).map_err(|e| {
                    ApiError::new(ErrorCode::Internal, format!("opening a terminal: {e}"))
                }),
            };
            match opened {
                Ok((master, slave)) => (Stdios::Terminal(slave), Some(Arc::new(master))),
                Err(e) => {
                    let _ = tx.send(event_frame(ExecEvent::Error(e.detail()))).await;
                    return;
                }
            }
        }
    };
    let mut sp = match spawn(&state.children, &state.exec_defaults(), &req, stdios) {
        Ok(sp) => sp,
        Err(e) => {
            let _ = tx.send(event_frame(ExecEvent::Error(e.detail()))).await;
            return;
        }
    };
    let pgid = sp.tracked.pid();
    // If the host is already gone there is no one to run this for.
    if tx
        .send(event_frame(ExecEvent::Started { pid: pgid }))
        .await
        .is_err()
    {
        kill_group(pgid, Signal::SIGKILL);
        let _ = sp.child.wait().await;
        return;
    }

    let mut pumps = Pumps::default();
    let stdin_task = match &terminal {
        Some(master) => {
            pumps.spawn(pump_terminal(master.clone(), tx.clone()));
            Some(tokio::spawn(forward_terminal_input(
                body,
                dec,
                master.clone(),
            )))
        }
        None => sp
            .child
            .stdin
            .take()
            .map(|w| tokio::spawn(forward_stdin(body, dec, w))),
    };
    if let Some(r) = sp.child.stdout.take() {
        pumps.spawn(pump(r, Tag::Stdout, tx.clone()));
    }
    if let Some(r) = sp.child.stderr.take() {
        pumps.spawn(pump(r, Tag::Stderr, tx.clone()));
    }

    let deadline = req
        .timeout_ms
        .map(|ms| Instant::now() + Duration::from_millis(ms));
    let timer = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d.into()).await,
            None => std::future::pending().await,
        }
    };

    enum Outcome {
        Done(std::io::Result<std::process::ExitStatus>),
        TimedOut,
        HostGone,
    }
    let outcome = tokio::select! {
        // The exit is reported only once both pipes hit EOF, so no output is lost. A
        // terminal reads as ended once no process holds it; a job the command left
        // running may hold it for ever, so its output is awaited a grace period only.
        r = async {
            let status = sp.child.wait().await;
            if terminal.is_some() {
                let _ = tokio::time::timeout(KILL_GRACE, pumps.join()).await;
            } else {
                pumps.join().await;
            }
            status
        } => Outcome::Done(r),
        () = timer => Outcome::TimedOut,
        () = tx.closed() => Outcome::HostGone,
    };
    if let Some(t) = stdin_task {
        t.abort();
    }

    let event = match outcome {
        Outcome::Done(Ok(status)) => ExecEvent::Exited(exit_status(status, false, sp.started)),
        Outcome::Done(Err(e)) => ExecEvent::Error(
            ApiError::new(
                ErrorCode::Internal,
                format!("waiting for {} failed: {e}", sp.argv[0]),
            )
            .detail(),
        ),
        Outcome::TimedOut => {
            kill_group(pgid, Signal::SIGKILL);
            let status = sp.child.wait().await;
            // The group is dead; give what it wrote last a moment to drain.
            let _ = tokio::time::timeout(KILL_GRACE, pumps.join()).await;
            match status {
                Ok(s) => ExecEvent::Exited(exit_status(s, true, sp.started)),
                Err(e) => ExecEvent::Error(
                    ApiError::new(
                        ErrorCode::Internal,
                        format!("waiting for {} failed: {e}", sp.argv[0]),
                    )
                    .detail(),
                ),
            }
        }
        Outcome::HostGone => {
            kill_group(pgid, Signal::SIGKILL);
            let _ = sp.child.wait().await;
            return;
        }
    };
    drop(pumps);
    let _ = tx.send(event_frame(event)).await;
    drop(sp.tracked);
}

/// An event as a frame. Only an error can outgrow a frame (its message may quote a
/// request of nearly a frame's size): its message is then cut, so that the host still
/// learns why the command did not run.
fn event_frame(event: ExecEvent) -> Bytes {
    match frame::encode_json(&event) {
        Ok(f) => f,
        Err(e) => {
            let (code, message) = match event {
                ExecEvent::Error(d) => (d.code, d.message),
                other => (ErrorCode::Internal, format!("{other:?}")),
            };
            let cut: String = message.chars().take(4096).collect();
            let detail = forkd_proto::ErrorDetail {
                code,
                message: format!("{cut}... (cut: {e})"),
            };
            // 4096 characters always fit; if they did not, the host would report an
            // output that ended without an exit status.
            frame::encode_json(&ExecEvent::Error(detail)).unwrap_or_default()
        }
    }
}

/// The tasks copying a child's output. Dropping them aborts those still running.
#[derive(Debug, Default)]
pub struct Pumps(Vec<Option<tokio::task::JoinHandle<()>>>);

impl Pumps {
    /// Starts one.
    pub fn spawn(&mut self, f: impl std::future::Future<Output = ()> + Send + 'static) {
        self.0.push(Some(tokio::spawn(f)));
    }

    /// Waits for all to finish. Cancel-safe: a task that finished is not awaited again
    /// (a JoinHandle must not be polled after it completed).
    pub async fn join(&mut self) {
        for slot in &mut self.0 {
            if let Some(h) = slot {
                let _ = h.await;
                *slot = None;
            }
        }
    }
}

impl Drop for Pumps {
    fn drop(&mut self) {
        for h in self.0.iter().flatten() {
            h.abort();
        }
    }
}

/// Forwards a stream of the command's output as frames of `tag`, in order.
async fn pump(mut r: impl AsyncRead + Unpin, tag: Tag, tx: mpsc::Sender<Bytes>) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                // CHUNK is far below the frame limit: every read fits one frame.
                for f in frame::encode_chunked(tag, &buf[..n]) {
                    if tx.send(f).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// Forwards what a command wrote to its terminal as `Stdout` frames.
async fn pump_terminal(master: Arc<crate::pty::Master>, tx: mpsc::Sender<Bytes>) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        match master.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                for f in frame::encode_chunked(Tag::Stdout, &buf[..n]) {
                    if tx.send(f).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// The frames of an exec request's body after its header, as they arrive.
struct InputFrames {
    body: Body,
    dec: Decoder,
}

impl InputFrames {
    /// The next frame; `None` at the end of the body or at a malformed frame.
    async fn next(&mut self) -> Option<frame::Frame> {
        loop {
            match self.dec.next_frame() {
                Ok(Some(f)) => return Some(f),
                Ok(None) => {}
                Err(_) => return None,
            }
            match self.body.frame().await {
                None | Some(Err(_)) => return None,
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.dec.push(&data);
                    }
                }
            }
        }
    }
}

/// Types `Stdin` frames from the request body into the command's terminal and applies
/// `Resize` frames to it. The end of the body ends nothing: a terminal has no end of
/// input but the one its user types (^D).
async fn forward_terminal_input(body: Body, dec: Decoder, master: Arc<crate::pty::Master>) {
    let mut frames = InputFrames { body, dec };
    while let Some(f) = frames.next().await {
        if f.tag == Tag::Stdin && master.write_all(&f.payload).await.is_err() {
            return;
        }
        if f.tag == Tag::Resize {
            // A size that does not parse or is zero is ignored, as a terminal
            // emulator ignores a bad escape.
            if let Ok(size) = serde_json::from_slice::<forkd_proto::exec::PtySize>(&f.payload) {
                if size.problem().is_none() {
                    let _ = master.resize(size);
                }
            }
        }
    }
}

/// Copies `Stdin` frames from the request body to the child; the end of the body (or a
/// malformed frame) closes the child's stdin.
async fn forward_stdin(body: Body, dec: Decoder, mut w: ChildStdin) {
    let mut frames = InputFrames { body, dec };
    while let Some(f) = frames.next().await {
        // Other tags carry nothing for stdin. A child that closed its stdin is not an
        // error: it just wants no more.
        if f.tag == Tag::Stdin && w.write_all(&f.payload).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{numeric_user, passwd_entry};

    #[test]
    fn an_image_user_may_be_numeric() {
        assert_eq!(numeric_user("1000"), Some((1000, None)));
        assert_eq!(numeric_user("1000:50"), Some((1000, Some(50))));
        assert_eq!(numeric_user("app"), None);
        assert_eq!(numeric_user("app:50"), None);
        assert_eq!(numeric_user("1000:staff"), None);
    }

    #[test]
    fn passwd_entries_are_found_by_name() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nbad:x:y:1::/:/bin/sh\nshort:x:1\n";
        let u = passwd_entry(passwd, "user").unwrap();
        assert_eq!(
            (u.name.as_str(), u.uid, u.gid, u.dir.as_str()),
            ("user", 1000, 1000, "/home/user")
        );
        assert_eq!(passwd_entry(passwd, "root").unwrap().uid, 0);
        assert!(passwd_entry(passwd, "bad").is_none());
        assert!(passwd_entry(passwd, "short").is_none());
        assert!(passwd_entry(passwd, "nobody").is_none());
    }
}
