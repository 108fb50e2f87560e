//! A real daemon for the tests: `forkd daemon` as a process, with a data directory of
//! its own that shares the built guest assets.
#![allow(dead_code)]

pub mod etcd;
pub mod fixture;

use forkd_daemon::client::{Client, Endpoint};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A data directory of a test's own that shares the built guest assets (on their
/// filesystem, so that snapshots hard-link them): test processes run side by side, and
/// each sees only the sandboxes it made.
pub fn data_dir(prefix: &str) -> tempfile::TempDir {
    let shared = forkd_image::Home::from_env();
    let tmp = shared.tmp_dir();
    std::fs::create_dir_all(&tmp).unwrap();
    let home = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(&tmp)
        .unwrap();
    std::os::unix::fs::symlink(shared.images_dir(), home.path().join("images")).unwrap();
    home
}

/// A daemon with a data directory of its own that shares the built guest assets.
pub struct Daemon {
    pub home: tempfile::TempDir,
    child: Option<Child>,
    args: Vec<String>,
    env: Vec<(String, String)>,
    tcp: Option<String>,
}

impl Daemon {
    pub fn start(extra: &[&str]) -> Daemon {
        Daemon::start_with_env(extra, &[])
    }

    /// A daemon started with `extra` arguments and `env` added to its environment.
    pub fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let home = data_dir("daemon-test-");
        let mut d = Daemon {
            home,
            child: None,
            args: extra.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            tcp: None,
        };
        if let Some(i) = d.args.iter().position(|a| a == "--listen") {
            d.tcp = Some(d.args[i + 1].clone());
        }
        d.spawn();
        d
    }

    pub fn spawn(&mut self) {
        let child = Command::new(env!("CARGO_BIN_EXE_forkd"))
            .arg("daemon")
            .args(&self.args)
            .env("FORKD_HOME", self.home.path())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.home.path().join("daemon.log")).unwrap())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let socket = self.socket();
        if let Err(why) = wait_until_serving(&socket, self.child.as_mut().unwrap(), 60) {
            panic!("{why}: {}", self.log());
        }
    }

    /// Starts the daemon again (after [`Daemon::kill9`]) with `env` as its added
    /// environment.
    pub fn respawn_with_env(&mut self, env: &[(&str, &str)]) {
        self.env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.spawn();
    }

    /// Waits (at most `secs`) for the daemon to exit on its own; returns how it ended.
    pub fn wait_exit(&mut self, secs: u64) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("the daemon runs");
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "the daemon did not exit");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The daemon process's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the daemon runs").id()
    }

    pub fn socket(&self) -> PathBuf {
        self.home.path().join("forkd.sock")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.home.path().join("daemon.log")).unwrap_or_default()
    }

    pub fn unix(&self) -> Client {
        Client::new(Endpoint::Unix(self.socket()), None)
    }

    pub fn tcp(&self, token: Option<&str>) -> Client {
        Client::new(
            Endpoint::Tcp(self.tcp.clone().expect("listening on TCP")),
            token.map(str::to_owned),
        )
    }

    /// Stops the daemon (SIGTERM: its sandboxes keep running) and starts it again on the
    /// same data directory with `extra` as its arguments.
    pub fn restart(&mut self, extra: &[&str]) {
        self.stop();
        self.start_again(extra);
    }

    /// Stops the daemon (SIGTERM) and waits for it to exit.
    pub fn stop(&mut self) {
        let c = self.child.as_ref().expect("the daemon runs");
        signal(c.id(), nix::sys::signal::Signal::SIGTERM).unwrap();
        assert!(self.wait_exit(30).success(), "{}", self.log());
    }

    /// Starts the stopped daemon again with `extra` as its arguments.
    pub fn start_again(&mut self, extra: &[&str]) {
        self.args = extra.iter().map(|s| s.to_string()).collect();
        self.tcp = None;
        self.spawn();
    }

    pub fn kill9(&mut self) {
        let mut c = self.child.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// What the data directory holds (snapshots and sandbox directories), to check that
    /// refused requests change nothing.
    pub fn disk_state(&self) -> Vec<String> {
        let mut out = Vec::new();
        for sub in ["snapshots", "run/sandboxes"] {
            if let Ok(d) = std::fs::read_dir(self.home.path().join(sub)) {
                out.extend(
                    d.flatten()
                        .map(|e| format!("{sub}/{}", e.file_name().to_string_lossy())),
                );
            }
        }
        out.sort();
        out
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGTERM: the daemon stops and ends what it owns in-process (a template
            // build's parent VM).
            let _ = signal(c.id(), nix::sys::signal::Signal::SIGTERM);
            let _ = c.wait();
        }
        // Sandboxes outlive the daemon by design: stop every VM of this data directory.
        let home = self.home.path().to_string_lossy().into_owned();
        if let Ok(procs) = std::fs::read_dir("/proc") {
            for p in procs.flatten() {
                let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
                    continue;
                };
                let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
                if String::from_utf8_lossy(&cmdline).contains(&home) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
    }
}

/// Waits up to `secs` for a daemon just started as `child` to accept on `socket`; says
/// why not (it exited, or it did not come up in time).
pub fn wait_until_serving(socket: &Path, child: &mut Child, secs: u64) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if std::os::unix::net::UnixStream::connect(socket).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait().unwrap() {
            return Err(format!("the daemon exited ({status})"));
        }
        if Instant::now() > deadline {
            return Err(format!("the daemon did not come up within {secs} s"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `sig` to the process `pid`.
pub fn signal(pid: u32, sig: nix::sys::signal::Signal) -> nix::Result<()> {
    let pid = i32::try_from(pid).map_err(|_| nix::errno::Errno::ESRCH)?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig)
}

pub fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

impl Daemon {
    /// Takes charge of a data directory where something else (`forkd quickstart`)
    /// started a daemon: dropping the result stops it and every VM of the directory.
    pub fn adopt(home: tempfile::TempDir) -> Daemon {
        Daemon {
            home,
            child: None,
            args: Vec::new(),
            env: Vec::new(),
            tcp: None,
        }
    }

    /// Gives this daemon the shared snapshot `tag` of the built-in `template` (see
    /// [`fixture`]), for tests that fork from it and do not test how it is built.
    pub fn link_snapshot(&self, template: &str, tag: &str) {
        fixture::link_into(self.home.path(), template, tag);
    }

    /// A `forkd` command aimed at this daemon (its data directory, so its socket).
    pub fn forkd(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_forkd"));
        c.env("FORKD_HOME", self.home.path());
        c
    }
}

/// A request through `c`: the status and the body as JSON (a non-JSON body as a string).
pub async fn call(
    c: &Client,
    m: hyper::Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> (hyper::StatusCode, serde_json::Value) {
    let (status, bytes) = c.call(m, path, body.as_ref()).await.unwrap();
    let v = if bytes.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&bytes).into()))
    };
    (status, v)
}

/// Builds `template` as snapshot `tag` through the API and waits for the operation.
pub async fn build_snapshot(c: &Client, template: &str, tag: &str) {
    let (s, op) = call(
        c,
        hyper::Method::POST,
        "/v1/snapshots",
        Some(serde_json::json!({"template": template, "tag": tag})),
    )
    .await;
    assert_eq!(s, hyper::StatusCode::ACCEPTED, "{op}");
    wait_operation(c, op["id"].as_str().unwrap()).await;
}

/// Waits (at most 10 minutes) for the operation `id` to succeed; panics if it fails.
pub async fn wait_operation(c: &Client, id: &str) {
    let op = finish_operation(c, id).await;
    assert_eq!(op["status"], "succeeded", "operation {id}: {op}");
}

/// Waits (at most 10 minutes) for the operation `id` to end; returns it.
pub async fn finish_operation(c: &Client, id: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let (s, op) = call(c, hyper::Method::GET, &format!("/v1/operations/{id}"), None).await;
        assert_eq!(s, hyper::StatusCode::OK);
        if op["status"] != "running" {
            return op;
        }
        assert!(Instant::now() < deadline, "operation {id} did not finish");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Starts building the template `name` from the recipe text `recipe` as snapshot `name`;
/// returns the answer (202 and the operation when the recipe is accepted).
pub async fn build_recipe(
    c: &Client,
    name: &str,
    recipe: &str,
) -> (hyper::StatusCode, serde_json::Value) {
    call(
        c,
        hyper::Method::POST,
        "/v1/snapshots",
        Some(serde_json::json!({ "template": name, "recipe": recipe })),
    )
    .await
}

impl Daemon {
    /// The records of the audit log, oldest first.
    pub fn audit_records(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.home.path().join("audit.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

/// Base64 of the API (RFC 4648 standard alphabet, padded) decoded; panics on anything
/// else, naming the field.
pub fn b64(v: &serde_json::Value) -> Vec<u8> {
    use base64::Engine as _;
    let s = v
        .as_str()
        .unwrap_or_else(|| panic!("not a base64 string: {v}"));
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .unwrap_or_else(|e| panic!("not base64 ({e}): {s:.80}"))
}

/// Starts `shell` in the sandbox `id` with streamed output and returns the response once
/// its status is 200 (the NDJSON lines are the caller's to read).
pub async fn start_streamed_exec(
    c: &Client,
    id: &str,
    shell: &str,
) -> hyper::Response<hyper::body::Incoming> {
    let body = serde_json::to_vec(&serde_json::json!({"shell": shell, "stream": true})).unwrap();
    let resp = c
        .send(
            hyper::Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(body),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), hyper::StatusCode::OK);
    resp
}

/// Forks `n` children of `snapshot` (labelled `test=yes`); returns their ids.
pub async fn create(c: &Client, snapshot: &str, n: u32) -> Vec<String> {
    let (s, v) = call(
        c,
        hyper::Method::POST,
        "/v1/sandboxes",
        Some(serde_json::json!({"snapshot": snapshot, "n": n, "labels": {"test": "yes"}})),
    )
    .await;
    assert_eq!(s, hyper::StatusCode::CREATED, "{v}");
    v["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Runs `shell` in sandbox `id`, which must answer 200; returns the result.
pub async fn exec(c: &Client, id: &str, shell: &str) -> serde_json::Value {
    let (s, v) = call(
        c,
        hyper::Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(serde_json::json!({ "shell": shell })),
    )
    .await;
    assert_eq!(s, hyper::StatusCode::OK, "exec in {id}: {v}");
    v
}

/// A registry (Debian's `docker-registry`) on a loopback port of its own, with its
/// storage in a temporary directory; stopped when dropped.
pub struct Registry {
    child: Child,
    pub addr: String,
    _dir: tempfile::TempDir,
}

impl Registry {
    /// Starts a registry on a free loopback port. The port is free when it is picked but
    /// not reserved: a test process running beside this one may pick it too, and then
    /// one of the two registries cannot listen. So this waits until its own process
    /// holds the listening socket, and starts over on another port if it exited.
    pub fn start() -> Registry {
        for _ in 0..5 {
            if let Some(registry) = Registry::try_start() {
                return registry;
            }
        }
        panic!("the registry did not start: every port it was given was taken");
    }

    fn try_start() -> Option<Registry> {
        let dir = tempfile::tempdir().unwrap();
        let addr = free_port();
        let config = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            dir.path().join("data").display()
        );
        let cfg = dir.path().join("config.yml");
        std::fs::write(&cfg, config).unwrap();
        let mut child = Command::new("docker-registry")
            .arg("serve")
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("docker-registry is installed");
        let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
        let started = Instant::now();
        while !listens_on(child.id(), port) {
            if child.try_wait().unwrap().is_some() {
                return None;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the registry did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(Registry {
            child,
            addr,
            _dir: dir,
        })
    }
}

/// Whether the process `pid` holds a socket listening on TCP port `port`: the inodes
/// of the listening sockets in /proc/net/tcp{,6} against its open files.
fn listens_on(pid: u32, port: u16) -> bool {
    const LISTEN: &str = "0A";
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = f.get(1).and_then(|a| a.rsplit(':').next());
            if local_port.and_then(|p| u16::from_str_radix(p, 16).ok()) == Some(port)
                && f.get(3) == Some(&LISTEN)
            {
                inodes.extend(f.get(9).map(|i| format!("socket:[{i}]")));
            }
        }
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
    })
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes a secret (a token file) as the daemon wants it: readable by its owner only.
pub fn write_secret(path: &std::path::Path, contents: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, contents).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// Every file or directory under the data directory `root` that its group or other
/// users may use (symbolic links are not followed: a test's `images` link points to
/// assets `forkd image build` made), but the socket, which is opened to its group on
/// purpose, jails' empty roots, which a jailed QEMU enters, and the test's own log.
pub fn loose_modes(root: &Path) -> Vec<String> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let mut loose = Vec::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            let kind = meta.file_type();
            if kind.is_symlink() || kind.is_socket() {
                continue;
            }
            let name = e.file_name();
            if kind.is_dir() && name != "jail" {
                dirs.push(e.path());
            }
            let exempt = (kind.is_dir() && name == "jail") || name == "daemon.log";
            let mode = meta.permissions().mode() & 0o7777;
            if !exempt && mode & 0o077 != 0 {
                loose.push(format!("{:o} {}", mode, e.path().display()));
            }
        }
    }
    loose
}

/// The kept lifecycle events `GET /v1/events?follow=false&{query}` streams.
#[allow(dead_code)]
pub async fn events_of(c: &Client, query: &str) -> Vec<serde_json::Value> {
    let resp = c
        .send(
            hyper::Method::GET,
            &format!("/v1/events?follow=false&{query}"),
            None,
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), hyper::StatusCode::OK);
    let mut lines = forkd_daemon::client::Lines::new(resp);
    let mut out = Vec::new();
    while let Some(line) = lines.next_text().await.unwrap() {
        if let Some(d) = line.strip_prefix("data:") {
            out.push(serde_json::from_str(d.trim_start()).unwrap());
        }
    }
    out
}

/// The resident memory of process `pid`, in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}
