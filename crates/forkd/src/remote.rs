//! Talking to the daemon: finding it (`FORKD_URL`, `FORKD_TOKEN`, else the socket in
//! the data directory), starting one in the background for `forkd quickstart`, and
//! turning its error answers into messages.

use anyhow::{Context, Result};
use forkd_daemon::client::{Client, Endpoint};
use forkd_image::Home;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, Response};
use std::time::{Duration, Instant};

/// The daemon's client.
pub fn connect(home: &Home) -> Result<Client> {
    Client::from_env(home)
}

/// A client of a daemon that answers: the configured one, or, when none answers on the
/// default socket, a daemon started now in the background (its log in the data
/// directory). Returns whether one was started.
pub async fn ensure_daemon(home: &Home) -> Result<(Client, bool)> {
    let client = connect(home)?;
    if client.call(Method::GET, "/v1/health", None).await.is_ok() {
        return Ok((client, false));
    }
    // A daemon that owns the data directory but serves another socket (or is busy
    // starting): use it, never start a second one beside it.
    if let Some(owner) = forkd_daemon::owner::current_owner(home.root()) {
        let theirs = Client::new(Endpoint::Unix(owner.socket.clone()), None);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if theirs.call(Method::GET, "/v1/health", None).await.is_ok() {
                return Ok((theirs, false));
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "the forkd daemon (pid {}) owns {} but does not answer on {}; stop it or wait for it",
                    owner.pid,
                    home.root().display(),
                    owner.socket.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let Endpoint::Unix(socket) = client.endpoint().clone() else {
        anyhow::bail!("no forkd daemon answers at FORKD_URL; start it there first");
    };
    std::fs::create_dir_all(home.root())
        .with_context(|| format!("creating {}", home.root().display()))?;
    let log_path = home.root().join("daemon.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let exe = std::env::current_exe().context("locating the forkd binary")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("daemon")
        .arg("--socket")
        .arg(&socket)
        .env("FORKD_HOME", home.root())
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // Its own session: it outlives this command and its terminal.
    // SAFETY: runs in the forked child before exec and only calls setsid(2), which is
    // async-signal-safe.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            nix::unistd::setsid()
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
    let mut child = cmd.spawn().context("starting forkd daemon")?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if client.call(Method::GET, "/v1/health", None).await.is_ok() {
            return Ok((client, true));
        }
        if let Some(status) = child.try_wait()? {
            anyhow::bail!(
                "the daemon exited at start ({status}); see {}",
                log_path.display()
            );
        }
        if Instant::now() > deadline {
            anyhow::bail!(
                "the daemon did not answer within 120 s; see {}",
                log_path.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The error an unsuccessful response carries.
pub async fn fail(resp: Response<Incoming>) -> anyhow::Error {
    let status = resp.status();
    match resp.into_body().collect().await {
        Ok(b) => forkd_daemon::client::failure(status, &b.to_bytes()).into(),
        Err(e) => anyhow::anyhow!("the daemon answered {status}: {e}"),
    }
}

/// Prints a value as pretty JSON.
pub fn print_json(v: &serde_json::Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}
