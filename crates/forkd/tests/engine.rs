//! The engine's promises, each shown on a real daemon (`forkd daemon` as a process) with
//! real VMs: one daemon per data directory; a daemon killed at any named failpoint leaves
//! a state its restart makes consistent; guests starved of CPU, or whose VM process is
//! stopped, are kept (shown unresponsive), never torn down; a full disk is refused with
//! 507 and corrupts nothing; each child runs jailed, in a cgroup of its own with its
//! limits.
//!
//! Building a template costs tens of seconds under TCG, so one `minimal` template is
//! built once for the whole file and hard-linked into each test's data directory: a
//! snapshot's seal names the inode, size and mtime of its parts, which a hard link keeps.
//! (The full-disk test builds its own: its data directory is another filesystem.)

mod common;

use common::{b64, call, runtime};
use forkd_daemon::client::{Client, Endpoint};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The shared template's tag.
const TAG: &str = "mini";

/// A tmpfs mounted for a test, unmounted when dropped, however the test ends.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mounting a tmpfs: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs(at.to_owned())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Detached: a VM being killed may still hold a file of it open for a moment.
        if let Err(e) = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH) {
            eprintln!("unmounting {}: {e}", self.0.display());
        }
    }
}

/// A data directory of its own that shares the built guest assets, and the daemon
/// running on it, if any. Dropping it stops the daemon, kills every process whose command
/// line names the directory (sandboxes outlive their daemon by design), and removes it.
struct Home {
    tmpfs: Option<Tmpfs>,
    dir: tempfile::TempDir,
    daemon: Option<Child>,
}

impl Home {
    /// A fresh data directory; on a tmpfs of `tmpfs_size` if given.
    fn new(tmpfs_size: Option<&str>) -> Home {
        let shared = forkd_image::Home::from_env();
        let tmp = shared.tmp_dir();
        std::fs::create_dir_all(&tmp).unwrap();
        let dir = tempfile::Builder::new()
            .prefix("engine-test-")
            .tempdir_in(&tmp)
            .unwrap();
        let tmpfs = tmpfs_size.map(|s| Tmpfs::mount(dir.path(), s));
        std::os::unix::fs::symlink(shared.images_dir(), dir.path().join("images")).unwrap();
        Home {
            tmpfs,
            dir,
            daemon: None,
        }
    }

    /// A fresh data directory holding the shared template as snapshot [`TAG`].
    fn with_template() -> Home {
        let h = Home::new(None);
        common::fixture::link_into(h.path(), "minimal", TAG);
        h
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn socket(&self) -> PathBuf {
        self.path().join("forkd.sock")
    }

    fn client(&self) -> Client {
        Client::new(Endpoint::Unix(self.socket()), None)
    }

    /// Runs the CLI against this directory's daemon and returns what it printed.
    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_forkd"))
            .args(args)
            .env("FORKD_HOME", self.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "forkd {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path().join("daemon.log")).unwrap_or_default()
    }

    /// Starts `forkd daemon` on the directory (armed with `failpoint` if given) without
    /// waiting for it.
    fn spawn(&mut self, failpoint: Option<&str>) {
        assert!(self.daemon.is_none(), "a daemon already runs");
        // Appended: the logs of every start of the directory, for failure messages.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path().join("daemon.log"))
            .unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_forkd"));
        cmd.arg("daemon")
            .env("FORKD_HOME", self.path())
            .env_remove(forkd_host::failpoint::ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(fp) = failpoint {
            cmd.env(forkd_host::failpoint::ENV, fp);
        }
        self.daemon = Some(cmd.spawn().unwrap());
    }

    /// Starts the daemon and waits until it answers on its socket.
    fn start(&mut self, failpoint: Option<&str>) {
        self.spawn(failpoint);
        let socket = self.socket();
        let daemon = self.daemon.as_mut().unwrap();
        if let Err(why) = common::wait_until_serving(&socket, daemon, 90) {
            if daemon.try_wait().unwrap().is_some() {
                self.daemon = None;
            }
            panic!("{why}: {}", self.log());
        }
    }

    fn pid(&self) -> u32 {
        self.daemon.as_ref().expect("a daemon runs").id()
    }

    /// Waits (at most `within`) for the daemon to exit on its own.
    fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let mut child = self.daemon.take().expect("a daemon runs");
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the daemon did not exit within {within:?}: {}", self.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the daemon to abort at `failpoint`.
    fn expect_abort(&mut self, failpoint: &str) {
        use std::os::unix::process::ExitStatusExt;
        let status = self.wait_exit(Duration::from_secs(120));
        assert_eq!(
            status.signal(),
            Some(libc::SIGABRT),
            "the daemon should have aborted at {failpoint}: {status}: {}",
            self.log()
        );
        assert!(
            self.log()
                .contains(&format!("failpoint {failpoint} reached")),
            "{}",
            self.log()
        );
    }

    /// SIGTERM, and waits for the daemon to exit (it leaves its sandboxes running).
    fn stop(&mut self) {
        terminate(self.pid());
        let status = self.wait_exit(Duration::from_secs(60));
        assert!(status.success(), "{status}: {}", self.log());
    }

    /// The QEMU processes whose command line names this directory.
    fn qemus(&self) -> Vec<u32> {
        processes_naming(self.path())
            .into_iter()
            .filter(|pid| {
                // QEMU names its process after the sandbox (`-name process=`): the
                // program is what tells.
                std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| {
                    exe.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("qemu"))
                })
            })
            .collect()
    }

    /// The sandbox directories under run/sandboxes, sorted.
    fn sandbox_dirs(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.path().join("run/sandboxes"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// (id, state) of every row of the state database's sandboxes table, sorted.
    fn db_rows(&self) -> Vec<(String, String)> {
        let db = rusqlite::Connection::open_with_flags(
            self.path().join("forkd.db"),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .unwrap();
        let mut q = db
            .prepare("SELECT id, state FROM sandboxes ORDER BY id")
            .unwrap();
        q.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        if let Some(mut c) = self.daemon.take() {
            terminate(c.id());
            let deadline = Instant::now() + Duration::from_secs(30);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = processes_naming(self.path());
            if left.is_empty() || Instant::now() > deadline {
                break;
            }
            for pid in left {
                let _ = common::signal(pid, nix::sys::signal::Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Before the directory itself goes (when `dir` is dropped, after this).
        drop(self.tmpfs.take());
    }
}

fn terminate(pid: u32) {
    let _ = common::signal(pid, nix::sys::signal::Signal::SIGTERM);
}

/// Processes (other than zombies) one of whose arguments names something inside `dir`.
fn processes_naming(dir: &Path) -> Vec<u32> {
    forkd_host::process::find_inside(dir)
        .into_iter()
        .map(|(pid, _)| pid)
        .filter(|pid| forkd_host::process::is_alive(*pid))
        .collect()
}

async fn list(c: &Client) -> Vec<Value> {
    let (s, v) = call(c, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["sandboxes"].as_array().unwrap().clone()
}

/// A sandbox list without what changes on its own (the memory a cgroup counts).
fn without_usage(list: &[Value]) -> Vec<Value> {
    let mut list = list.to_vec();
    for s in &mut list {
        if let Some(limits) = s["limits"].as_object_mut() {
            limits.remove("memory_used_bytes");
        }
    }
    list
}

fn ids_of(list: &[Value]) -> Vec<String> {
    let mut v: Vec<String> = list
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect();
    v.sort();
    v
}

async fn create(c: &Client, n: u32) -> Vec<Value> {
    let (s, v) = call(
        c,
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"snapshot": TAG, "n": n})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    v["sandboxes"].as_array().unwrap().clone()
}

async fn exec(c: &Client, id: &str, shell: &str) -> (StatusCode, Value) {
    call(
        c,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(json!({ "shell": shell })),
    )
    .await
}

/// Runs `shell` in `id`, which must answer; returns its stdout.
async fn exec_ok(c: &Client, id: &str, shell: &str) -> String {
    let (s, v) = exec(c, id, shell).await;
    assert_eq!(s, StatusCode::OK, "exec in {id}: {v}");
    assert_eq!(v["exit_code"], 0, "exec in {id}: {shell}: {v}");
    String::from_utf8(b64(&v["stdout_b64"])).unwrap()
}

async fn status_of(c: &Client, id: &str) -> String {
    let (s, v) = call(c, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["status"].as_str().unwrap().to_owned()
}

/// Polls `id` until its status is `want` (at most `within`).
async fn wait_status(c: &Client, id: &str, want: &str, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let st = status_of(c, id).await;
        if st == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{id} is still {st}, not {want}, after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn pid_of(s: &Value) -> u32 {
    u32::try_from(s["pid"].as_u64().unwrap()).unwrap()
}

fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    common::signal(pid, sig).unwrap();
}

#[test]
fn a_second_daemon_on_the_same_data_directory_refuses_to_start_and_harms_nothing() {
    let mut h = Home::with_template();
    h.start(None);
    let rt = runtime();
    let c = h.client();
    let before = rt.block_on(async {
        let kids = create(&c, 2).await;
        for k in &kids {
            let id = k["id"].as_str().unwrap();
            exec_ok(&c, id, &format!("echo {id} > /mark")).await;
        }
        list(&c).await
    });
    assert_eq!(before.len(), 2);

    // Another socket, so that the socket itself is no obstacle: only ownership is.
    let other = h.path().join("other.sock");
    let mut second = Command::new(env!("CARGO_BIN_EXE_forkd"))
        .arg("daemon")
        .arg("--socket")
        .arg(&other)
        .env("FORKD_HOME", h.path())
        .env_remove(forkd_host::failpoint::ENV)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = second.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = second.kill();
            let _ = second.wait();
            panic!("a second daemon on the same data directory kept running");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut second.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{status}: {stderr}");
    assert!(
        stderr.contains(&format!("pid {}", h.pid())),
        "the refusal names the first daemon's pid {}: {stderr}",
        h.pid()
    );
    assert!(
        stderr.contains(&h.socket().display().to_string()),
        "the refusal names the first daemon's socket {}: {stderr}",
        h.socket().display()
    );
    assert!(!other.exists(), "the second daemon bound its socket");
    // The lock file still names the first.
    let owner: Value =
        serde_json::from_slice(&std::fs::read(h.path().join("daemon.lock")).unwrap()).unwrap();
    assert_eq!(owner["pid"], h.pid(), "{owner}");

    rt.block_on(async {
        let after = list(&c).await;
        assert_eq!(
            without_usage(&after),
            without_usage(&before),
            "the first daemon's sandboxes changed"
        );
        for s in &after {
            let id = s["id"].as_str().unwrap();
            assert!(forkd_host::process::is_alive(pid_of(s)), "{id}'s QEMU died");
            assert_eq!(status_of(&c, id).await, "running");
            assert_eq!(exec_ok(&c, id, "cat /mark").await, format!("{id}\n"));
        }
    });
    h.stop();
}

/// What a restarted daemon must have made of its data directory: every QEMU of the
/// directory is a listed sandbox's (or gone), every sandbox directory is a listed
/// sandbox's, the database's rows are exactly the listed sandboxes in the listed states,
/// and /v1/health counts them once. Returns the list.
async fn assert_consistent(h: &Home, c: &Client, after: &str) -> Vec<Value> {
    // The restarted daemon kills what it does not adopt; give the kills time to land.
    let deadline = Instant::now() + Duration::from_secs(15);
    let listed = loop {
        let listed = list(c).await;
        let pids: Vec<u32> = listed.iter().map(pid_of).collect();
        let strays: Vec<u32> = h
            .qemus()
            .into_iter()
            .filter(|p| !pids.contains(p))
            .collect();
        if strays.is_empty() {
            break listed;
        }
        assert!(
            Instant::now() < deadline,
            "after {after}: QEMU processes {strays:?} of the data directory are not listed: {listed:?}\n{}",
            h.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let ids = ids_of(&listed);
    for s in &listed {
        assert!(
            forkd_host::process::is_alive(pid_of(s)),
            "after {after}: listed with a dead QEMU: {s}"
        );
    }
    assert_eq!(
        h.sandbox_dirs(),
        ids,
        "after {after}: sandbox directories against the listed sandboxes"
    );
    let mut api_rows: Vec<(String, String)> = listed
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap().to_owned(),
                s["status"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    api_rows.sort();
    assert_eq!(
        h.db_rows(),
        api_rows,
        "after {after}: the database's rows against the API's list"
    );
    let (s, health) = call(c, Method::GET, "/v1/health", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        health["sandboxes"].as_u64(),
        Some(listed.len() as u64),
        "after {after}: {health}"
    );
    listed
}

/// Operations of `kind` the database still says are running: none may be after a
/// restart, since nothing runs them any more.
fn running_operations(h: &Home, kind: &str) -> Vec<String> {
    let db = rusqlite::Connection::open_with_flags(
        h.path().join("forkd.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let mut q = db
        .prepare("SELECT id FROM operations WHERE kind = ?1 AND status = 'running'")
        .unwrap();
    q.query_map([kind], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

#[test]
fn a_daemon_killed_at_any_failpoint_leaves_what_its_restart_makes_consistent() {
    let mut h = Home::with_template();
    let rt = runtime();
    let c = h.client();

    // A fork killed at each of its steps. Before the first child is ready no child was
    // handed out: the restart must remove them all, VMs included.
    for fp in ["fork.after_row", "fork.after_vm_start", "fork.after_ready"] {
        h.start(Some(fp));
        rt.block_on(async {
            // The daemon dies under the request: no answer is expected.
            let _ = c
                .call(
                    Method::POST,
                    "/v1/sandboxes",
                    Some(&json!({"snapshot": TAG, "n": 2})),
                )
                .await;
        });
        h.expect_abort(fp);
        h.start(None);
        rt.block_on(async {
            let listed = assert_consistent(&h, &c, fp).await;
            assert_eq!(running_operations(&h, "fork"), Vec::<String>::new(), "{fp}");
            if fp == "fork.after_ready" {
                // A child recorded as running is adopted, and serves.
                assert!(!listed.is_empty(), "{fp}: the ready child was dropped");
                for s in &listed {
                    assert_eq!(s["status"], "running", "{s}");
                    exec_ok(&c, s["id"].as_str().unwrap(), "true").await;
                }
            } else {
                assert_eq!(listed, Vec::<Value>::new(), "{fp}");
            }
        });
        h.stop();
    }

    // A delete killed after it marked the row: the restart finishes it.
    let before = rt.block_on(async {
        h.start(None);
        let before = list(&c).await;
        h.stop();
        before
    });
    let victim = before[0].clone();
    let victim_id = victim["id"].as_str().unwrap().to_owned();
    h.start(Some("delete.after_mark"));
    rt.block_on(async {
        let _ = c
            .call(Method::DELETE, &format!("/v1/sandboxes/{victim_id}"), None)
            .await;
    });
    h.expect_abort("delete.after_mark");
    h.start(None);
    rt.block_on(async {
        let listed = assert_consistent(&h, &c, "delete.after_mark").await;
        let mut expected = ids_of(&before);
        expected.retain(|id| *id != victim_id);
        assert_eq!(ids_of(&listed), expected, "delete.after_mark");
        assert!(!forkd_host::process::is_alive(pid_of(&victim)));
        // Enough sandboxes for a restart that adopts several.
        create(&c, 2).await;
    });

    // A restart killed after adopting one of several: the next adopts them all.
    let before = rt.block_on(list(&c));
    assert!(before.len() >= 2, "{before:?}");
    h.stop();
    h.spawn(Some("adopt.after_first"));
    h.expect_abort("adopt.after_first");
    h.start(None);
    rt.block_on(async {
        let listed = assert_consistent(&h, &c, "adopt.after_first").await;
        assert_eq!(ids_of(&listed), ids_of(&before), "adopt.after_first");
        for s in &listed {
            assert_eq!(s["status"], "running", "{s}");
            exec_ok(&c, s["id"].as_str().unwrap(), "true").await;
        }
    });
    h.stop();

    // A template build killed once its parent VM booted: nothing of the build is left,
    // and the sandboxes are untouched.
    h.start(Some("build.after_boot"));
    let op = rt.block_on(async {
        let (s, op) = call(
            &c,
            Method::POST,
            "/v1/snapshots",
            Some(json!({"template": "minimal", "tag": "crashed-build"})),
        )
        .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{op}");
        op["id"].as_str().unwrap().to_owned()
    });
    h.expect_abort("build.after_boot");
    h.start(None);
    rt.block_on(async {
        let listed = assert_consistent(&h, &c, "build.after_boot").await;
        assert_eq!(ids_of(&listed), ids_of(&before), "build.after_boot");
        let (s, v) = call(&c, Method::GET, &format!("/v1/operations/{op}"), None).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["status"], "interrupted", "{v}");
        let (s, v) = call(&c, Method::GET, "/v1/snapshots", None).await;
        assert_eq!(s, StatusCode::OK);
        assert!(!v.to_string().contains("crashed-build"), "{v}");
        let staged: Vec<String> = std::fs::read_dir(h.path().join("snapshots/.staging"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(staged, Vec::<String>::new(), "the crashed build's staging");

        // Nothing of the data directory outlives its sandboxes.
        for s in &listed {
            let (st, v) = call(
                &c,
                Method::DELETE,
                &format!("/v1/sandboxes/{}", s["id"].as_str().unwrap()),
                None,
            )
            .await;
            assert_eq!(st, StatusCode::NO_CONTENT, "{v}");
        }
        let listed = assert_consistent(&h, &c, "deleting everything").await;
        assert_eq!(listed, Vec::<Value>::new());
    });
    h.stop();
    assert_eq!(h.qemus(), Vec::<u32>::new());
    let path = h.path().to_owned();
    drop(h);
    assert!(!path.exists());
    assert_eq!(processes_naming(&path), Vec::<u32>::new());
}

#[test]
fn a_sigterm_as_soon_as_the_socket_answers_stops_the_daemon_in_order() {
    // No VM needed: the race is between the socket's bind and the signal handlers.
    let mut h = Home::new(None);
    for _ in 0..10 {
        let _ = std::fs::remove_file(h.socket());
        h.spawn(None);
        // Without a pause between attempts: the signal must come right after the bind.
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::os::unix::net::UnixStream::connect(h.socket()).is_err() {
            assert!(Instant::now() < deadline, "no answer: {}", h.log());
        }
        // `stop` asserts a clean exit, not death by the signal's default action.
        h.stop();
    }
}

#[test]
fn starved_guests_are_kept_and_a_stopped_vm_is_unresponsive_until_it_runs_again() {
    let mut h = Home::with_template();
    h.start(None);
    let rt = runtime();
    let c = h.client();
    rt.block_on(async {
        let kids = create(&c, 6).await;
        let ids: Vec<String> = kids
            .iter()
            .map(|k| k["id"].as_str().unwrap().to_owned())
            .collect();
        let pids: Vec<u32> = kids.iter().map(pid_of).collect();
        // Every thread of all six VMs on one core.
        for pid in &pids {
            let out = Command::new("taskset")
                .args(["-a", "-cp", "0", &pid.to_string()])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "taskset: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // A CPU-bound loop for 60 s in three of them, in the background of the guest.
        let looping = Instant::now();
        for id in &ids[..3] {
            let pid = exec_ok(
                &c,
                id,
                "timeout 60 sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $!",
            )
            .await;
            // The loop outlives the exec that started it.
            exec_ok(&c, id, &format!("kill -0 {}", pid.trim())).await;
        }
        let mut seen = std::collections::BTreeSet::new();
        while looping.elapsed() < Duration::from_secs(62) {
            let listed = list(&c).await;
            assert_eq!(
                ids_of(&listed),
                {
                    let mut v = ids.clone();
                    v.sort();
                    v
                },
                "a starved sandbox was torn down: {}",
                h.log()
            );
            for s in &listed {
                seen.insert(s["status"].as_str().unwrap().to_owned());
            }
            for pid in &pids {
                assert!(forkd_host::process::is_alive(*pid), "QEMU {pid} died");
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        eprintln!("states seen under load: {seen:?}");
        for id in &ids {
            // A sandbox shown unresponsive under load comes back once the load is gone.
            wait_status(&c, id, "running", Duration::from_secs(60)).await;
            assert_eq!(exec_ok(&c, id, "echo ok").await, "ok\n");
        }
        for pid in &pids {
            assert!(forkd_host::process::is_alive(*pid), "QEMU {pid} died");
        }

        // The VM process of one stopped from the host: its agent and QMP go silent.
        let (id, pid) = (&ids[5], pids[5]);
        signal(pid, nix::sys::signal::Signal::SIGSTOP);
        wait_status(&c, id, "unresponsive", Duration::from_secs(60)).await;
        let (s, v) = exec(&c, id, "echo ok").await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
        assert_eq!(v["error"]["code"], "sandbox_unresponsive", "{v}");
        assert!(ids_of(&list(&c).await).contains(id), "{id} was dropped");
        assert!(forkd_host::process::is_alive(pid));
        signal(pid, nix::sys::signal::Signal::SIGCONT);
        wait_status(&c, id, "running", Duration::from_secs(60)).await;
        assert_eq!(exec_ok(&c, id, "echo ok").await, "ok\n");
        assert_eq!(ids_of(&list(&c).await).len(), 6);
    });
    h.stop();
}

/// Bytes free for an unprivileged writer on the filesystem holding `p`.
fn free_bytes(p: &Path) -> u64 {
    let s = nix::sys::statvfs::statvfs(p).unwrap();
    s.blocks_available() as u64 * s.fragment_size() as u64
}

/// Runs `shell` in `id` with streamed output (the request is audited when its answer
/// starts, before the command runs): its exit code and its stdout and stderr together.
async fn exec_streamed(c: &Client, id: &str, shell: &str) -> (i32, String) {
    use forkd_daemon::client::{ExecLine, Lines};
    let mut lines = Lines::new(common::start_streamed_exec(c, id, shell).await);
    let mut out = Vec::new();
    while let Some(line) = lines.next_exec().await.unwrap() {
        match line {
            ExecLine::Stdout(b) | ExecLine::Stderr(b) => out.extend(b),
            ExecLine::Exit(code) => return (code, String::from_utf8_lossy(&out).into_owned()),
            ExecLine::Error(e) => panic!("exec in {id} failed: {e}"),
        }
    }
    panic!("the exec stream of {id} ended without an exit");
}

#[test]
fn a_full_disk_refuses_forks_with_507_and_corrupts_nothing() {
    // The data directory on a tmpfs of its own: the snapshot copies the guest assets
    // (the minimal rootfs is ~700 MiB) and holds its memory image fully allocated (512
    // MiB), then the rest is filled.
    let mut h = Home::new(Some("1700m"));
    h.start(None);
    let rt = runtime();
    let c = h.client();
    let fill = h.path().join("fill");
    rt.block_on(async {
        common::build_snapshot(&c, "minimal", TAG).await;
        let id = create(&c, 1).await[0]["id"].as_str().unwrap().to_owned();
        assert_eq!(exec_ok(&c, id.as_str(), "echo ok").await, "ok\n");
        eprintln!(
            "free after the build and a fork: {} MiB",
            free_bytes(h.path()) >> 20
        );

        // Leave 1 MiB: room for the daemon's own small writes (audit lines, database
        // pages), none for a child's disk.
        let room = 1 << 20;
        let f = std::fs::File::create(&fill).unwrap();
        let len = free_bytes(h.path()) - room;
        nix::fcntl::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            nix::fcntl::FallocateFlags::empty(),
            0,
            i64::try_from(len).unwrap(),
        )
        .unwrap();
        drop(f);
        assert!(free_bytes(h.path()) <= 2 * room, "{}", free_bytes(h.path()));
        let listed = list(&c).await;
        let dirs = h.sandbox_dirs();
        let snapshots = std::fs::read_dir(h.path().join("snapshots"))
            .unwrap()
            .count();

        // A running sandbox keeps answering.
        assert_eq!(exec_ok(&c, &id, "echo ok").await, "ok\n");
        // A fork and a build are refused, saying why, and leave nothing behind.
        let (s, v) = call(
            &c,
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"snapshot": TAG, "n": 1})),
        )
        .await;
        assert_eq!(s, StatusCode::INSUFFICIENT_STORAGE, "{v}");
        assert_eq!(v["error"]["code"], "insufficient_storage", "{v}");
        eprintln!("fork refused: {v}");
        let (s, v) = call(
            &c,
            Method::POST,
            "/v1/snapshots",
            Some(json!({"template": "minimal", "tag": "no-room"})),
        )
        .await;
        assert_eq!(s, StatusCode::INSUFFICIENT_STORAGE, "{v}");
        assert_eq!(v["error"]["code"], "insufficient_storage", "{v}");
        assert_eq!(without_usage(&list(&c).await), without_usage(&listed));
        assert_eq!(h.sandbox_dirs(), dirs);
        assert_eq!(
            std::fs::read_dir(h.path().join("snapshots"))
                .unwrap()
                .count(),
            snapshots
        );

        // The guest writes more than the host has: the guest sees an error (its disk
        // reports errors rather than pausing the VM), and the sandbox is kept.
        let (code, out) =
            exec_streamed(&c, &id, "dd if=/dev/zero of=/big bs=1M count=64 conv=fsync").await;
        assert_ne!(code, 0, "{out}");
        assert!(
            out.contains("No space left") || out.contains("Input/output error"),
            "{out}"
        );
        // Requests that write nothing on the host (the host disk may now be full to
        // the last byte, and a mutating request must be audited) reach the guest.
        assert_eq!(status_of(&c, &id).await, "running");
        let (s, v) = call(
            &c,
            Method::GET,
            &format!("/v1/sandboxes/{id}/files/stat?path=/etc/hostname"),
            None,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        std::fs::remove_file(&fill).unwrap();
        assert_eq!(exec_ok(&c, &id, "echo ok").await, "ok\n");
        assert_eq!(status_of(&c, &id).await, "running");
    });
    h.stop();

    // Nothing is corrupted: the audit chain holds and so does the database.
    let out = Command::new(env!("CARGO_BIN_EXE_forkd"))
        .args(["audit", "verify"])
        .env("FORKD_HOME", h.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let db = rusqlite::Connection::open_with_flags(
        h.path().join("forkd.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let check: String = db
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(check, "ok");
}

/// Polls the pool of [`TAG`] until `idle` members are ready (at most `within`).
async fn wait_pool(c: &Client, idle: u64, within: Duration) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let (s, v) = call(c, Method::GET, &format!("/v1/snapshots/{TAG}/pool"), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        if v["idle"] == idle && v["filling"] == 0 {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "the pool never had {idle} ready: {v}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn a_warm_pool_serves_forks_refills_and_is_removed_by_the_next_daemon() {
    let mut h = Home::with_template();
    h.start(None);
    let rt = runtime();
    let c = h.client();
    let pool = format!("/v1/snapshots/{TAG}/pool");
    let (first_members, child) = rt.block_on(async {
        let (s, v) = call(&c, Method::PUT, &pool, Some(json!({"size": 257}))).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        let (s, v) = call(&c, Method::PUT, &pool, Some(json!({"size": "two"}))).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        let missing = "/v1/snapshots/no-such-snapshot/pool";
        let (s, v) = call(&c, Method::PUT, missing, Some(json!({"size": 1}))).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
        let (s, v) = call(&c, Method::GET, "/v1/snapshots/..%2Fx/pool", None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        let (s, v) = call(&c, Method::PUT, &pool, Some(json!({"size": 2}))).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(
            (v["size"].as_u64(), v["source"].as_str()),
            (Some(2), Some("api"))
        );
        wait_pool(&c, 2, Duration::from_secs(120)).await;
        let members = h.qemus();
        assert_eq!(members.len(), 2, "two members, each one QEMU");
        assert!(list(&c).await.is_empty(), "members are not sandboxes");
        let (_, metrics) = call(&c, Method::GET, "/metrics", None).await;
        let metrics = metrics.as_str().unwrap().to_owned();
        assert!(
            metrics.contains(&format!("forkd_pool_idle{{snapshot=\"{TAG}\"}} 2")),
            "{metrics}"
        );
        // The fork takes a member: its QEMU is one that was already running. Its resume
        // hook ran again with the fork's variables, and its hostname is its id.
        let body = json!({"snapshot": TAG, "env": {"FORKED_AS": "pooled"}});
        let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(body)).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let child = v["sandboxes"][0].clone();
        assert!(members.contains(&pid_of(&child)), "{child} is not a member");
        let id = child["id"].as_str().unwrap();
        assert_eq!(
            exec_ok(&c, id, "echo $FORKED_AS $(hostname)").await,
            format!("pooled {id}\n")
        );
        wait_pool(&c, 2, Duration::from_secs(120)).await;
        assert_eq!(h.qemus().len(), 3, "the pool refilled beside the child");
        let left: Vec<u32> = h
            .qemus()
            .into_iter()
            .filter(|p| *p != pid_of(&child))
            .collect();
        (left, child)
    });
    // A daemon killed outright leaves its members; the next one removes them and
    // makes its own, and keeps the child.
    signal(h.pid(), nix::sys::signal::Signal::SIGKILL);
    h.wait_exit(Duration::from_secs(30));
    h.start(None);
    rt.block_on(async {
        wait_pool(&c, 2, Duration::from_secs(120)).await;
        let now = h.qemus();
        assert_eq!(now.len(), 3, "{now:?}");
        assert!(
            first_members.iter().all(|p| !now.contains(p)),
            "old members were kept"
        );
        let id = child["id"].as_str().unwrap();
        assert_eq!(exec_ok(&c, id, "echo adopted").await, "adopted\n");
        // A process whose parent exits first is re-parented to the agent (PID 1), which
        // reaps it on its SIGCHLD: no zombie is left behind.
        let orphan = "sh -c 'sleep 0.2 >/dev/null 2>&1 &'; sleep 1; \
            for i in $(seq 50); do \
              grep -qs '^State:.*Z' /proc/[0-9]*/status || { echo reaped; exit 0; }; \
              sleep 0.1; \
            done; grep -ls '^State:.*Z' /proc/[0-9]*/status";
        assert_eq!(exec_ok(&c, id, orphan).await, "reaped\n");
        // Size 0 ends the members; a graceful stop ends them too.
        let (s, v) = call(&c, Method::PUT, &pool, Some(json!({"size": 0}))).await;
        assert_eq!((s, v["idle"].as_u64()), (StatusCode::OK, Some(0)), "{v}");
        assert_eq!(h.qemus(), vec![pid_of(&child)]);
        let (s, v) = call(&c, Method::PUT, &pool, Some(json!({"size": 1}))).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        wait_pool(&c, 1, Duration::from_secs(120)).await;
    });
    h.stop();
    assert_eq!(
        h.qemus(),
        vec![pid_of(&child)],
        "a stopping daemon ends its members"
    );
}

/// Checks that QEMU `pid` runs jailed and returns its user id.
fn jailed(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {status}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let uids = field("Uid:");
    assert!(uids.iter().all(|u| u == &uids[0]), "{uids:?}");
    let uid: u32 = uids[0].parse().unwrap();
    assert!(uid >= forkd_qemu::jail::FIRST_UID, "{uid}");
    assert_eq!(field("Gid:")[0], uids[0]);
    assert_eq!(field("CapEff:"), ["0000000000000000"]);
    assert_eq!(field("NoNewPrivs:"), ["1"]);
    let root = std::fs::read_link(format!("/proc/{pid}/root")).unwrap();
    assert!(root.ends_with("jail"), "{}", root.display());
    assert_eq!(
        std::fs::read_dir(&root).unwrap().count(),
        0,
        "the jail is not empty"
    );
    // The snapshot's RAM file: open, and read-only.
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap();
    let ram = fds
        .filter_map(Result::ok)
        .find(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.ends_with("memory.ram")))
        .expect("QEMU has its RAM file open");
    let info = std::fs::read_to_string(format!(
        "/proc/{pid}/fdinfo/{}",
        ram.file_name().to_string_lossy()
    ))
    .unwrap();
    let flags = info
        .lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .map(|f| u32::from_str_radix(f.trim(), 8).unwrap())
        .unwrap();
    assert_eq!(
        flags & libc::O_ACCMODE as u32,
        libc::O_RDONLY as u32,
        "{info}"
    );
    uid
}

/// The cgroup control file that holds `name`'s value for a VM cgroup in `dirs` (v1: the
/// hierarchy that has it; v2: the one directory).
fn control(dirs: &[PathBuf], name: &str) -> String {
    let path = dirs
        .iter()
        .map(|d| d.join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no {name} in {dirs:?}"));
    std::fs::read_to_string(path).unwrap().trim().to_owned()
}

#[test]
fn each_child_runs_jailed_in_a_cgroup_of_its_own_with_the_limits_it_was_forked_with() {
    let cgroups = forkd_host::cgroup::host()
        .as_ref()
        .expect("this project's test machines give root a cgroup hierarchy");
    let mut h = Home::with_template();
    h.start(None);
    let rt = runtime();
    let c = h.client();
    rt.block_on(async {
        // Limits no cgroup takes are refused before anything starts.
        for bad in [
            json!({"cpu_cores": -1}),
            json!({"cpu_cores": 0.001}),
            json!({"cpu_weight": 0}),
            json!({"pids": 3}),
            json!({"pids": 100000}),
            json!({"memory": 1}),
            json!({"memory_mib": 64}),
        ] {
            let body = json!({"snapshot": TAG, "n": 1, "limits": bad});
            let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(body)).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
        }
        assert!(list(&c).await.is_empty());

        // Variables too large for the greeting's resume hook go by HTTP/2 instead.
        let big = "b".repeat(forkd_proto::handshake::MAX_BODY + 1);
        let body = json!({"snapshot": TAG, "n": 1, "env": {"BIG": big, "SMALL": "s"},
                          "limits": {"cpu_cores": 0.5, "pids": 64, "cpu_weight": 50}});
        let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(body)).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let child = v["sandboxes"][0].clone();
        let id = child["id"].as_str().unwrap().to_owned();
        let limits = &child["limits"];
        let memory = child["memory_mib"].as_u64().unwrap() << 20;
        assert_eq!(
            limits["memory_bytes"].as_u64(),
            Some(memory + forkd_host::cgroup::MEMORY_OVERHEAD),
            "{child}"
        );
        assert_eq!(limits["cpu_cores"].as_f64(), Some(0.5), "{child}");
        assert_eq!(
            (limits["pids"].as_u64(), limits["cpu_weight"].as_u64()),
            (Some(64), Some(50))
        );
        assert!(limits["disk_bytes"].as_u64().unwrap() > 0, "{child}");
        let version = cgroups.version().as_str();
        assert_eq!(
            limits["enforced_by"].as_str(),
            Some(format!("cgroup {version}").as_str())
        );
        assert!(limits["memory_used_bytes"].as_u64().unwrap() > 0, "{child}");

        // The kernel holds those values, and QEMU (all of its threads) is in the cgroup.
        let dirs = cgroups.dirs(&id);
        let qemu = pid_of(&child).to_string();
        for dir in &dirs {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap();
            assert_eq!(procs.trim(), qemu, "{}", dir.display());
        }
        let memory_limit = if version == "v1" {
            assert_eq!(control(&dirs, "cpu.cfs_quota_us"), "50000");
            assert_eq!(control(&dirs, "cpu.shares"), "512");
            control(&dirs, "memory.limit_in_bytes")
        } else {
            assert_eq!(control(&dirs, "cpu.max"), "50000 100000");
            assert_eq!(control(&dirs, "cpu.weight"), "50");
            control(&dirs, "memory.max")
        };
        assert_eq!(
            memory_limit,
            limits["memory_bytes"].as_u64().unwrap().to_string()
        );
        assert_eq!(control(&dirs, "pids.max"), "64");

        assert_eq!(
            exec_ok(&c, &id, "echo ${#BIG} $SMALL").await,
            format!("{} s\n", big.len())
        );

        // A guest that spins is held to its half core: the kernel throttles its QEMU.
        exec_ok(&c, &id, "timeout 2 sh -c 'while :; do :; done'; true").await;
        let throttled: u64 = control(&dirs, "cpu.stat")
            .lines()
            .find_map(|l| l.strip_prefix("nr_throttled "))
            .and_then(|n| n.parse().ok())
            .unwrap();
        assert!(throttled > 0, "{}", control(&dirs, "cpu.stat"));

        // `forkd ls` and the metrics show them.
        let ls = h.cli(&["ls"]);
        let row = ls
            .lines()
            .find(|l| l.starts_with(&id))
            .unwrap_or_else(|| panic!("{ls}"));
        assert!(row.contains(" 0.5 "), "{ls}");
        let (_, metrics) = call(&c, Method::GET, "/metrics", None).await;
        let metrics = metrics.as_str().unwrap().to_owned();
        let limit_line = format!(
            "forkd_sandbox_memory_limit_bytes{{sandbox=\"{id}\"}} {}",
            limits["memory_bytes"]
        );
        assert!(metrics.contains(&limit_line), "{metrics}");
        assert!(
            metrics.contains(&format!(
                "forkd_sandbox_cpu_quota_millicores{{sandbox=\"{id}\"}} 500"
            )),
            "{metrics}"
        );

        // A child without limits of its own gets the defaults: a core per vCPU.
        let plain = create(&c, 1).await.remove(0);
        assert_eq!(
            plain["limits"]["cpu_cores"].as_f64(),
            plain["vcpus"].as_f64(),
            "{plain}"
        );

        // Each QEMU runs jailed: a user of its own, no capability, an empty root, and
        // the template's RAM file open read-only.
        let (a, b) = (jailed(pid_of(&child)), jailed(pid_of(&plain)));
        assert_ne!(a, b, "two children share a user id");

        // A child whose guest touches more than its memory limit is stopped by the
        // kernel, and fails saying so.
        let body = json!({"snapshot": TAG, "n": 1, "limits": {"memory_mib": 200}});
        let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(body)).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let small = v["sandboxes"][0]["id"].as_str().unwrap().to_owned();
        let fill =
            "mount -t tmpfs -o size=450m fill /mnt && dd if=/dev/zero of=/mnt/x bs=1M count=400";
        let _ = exec(&c, &small, fill).await;
        wait_status(&c, &small, "failed", Duration::from_secs(60)).await;
        let (_, failed) = call(&c, Method::GET, &format!("/v1/sandboxes/{small}"), None).await;
        let error = failed["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("reaching its memory limit of 200 MiB"),
            "{failed}"
        );

        // Its cgroup goes with it.
        let (s, v) = call(&c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while dirs.iter().any(|d| d.exists()) {
            assert!(Instant::now() < deadline, "{dirs:?} outlived the sandbox");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}
