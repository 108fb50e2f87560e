//! The engine's promises, each shown on a real daemon (`forkd daemon` as a process) with
//! real VMs: one daemon per data directory; a daemon killed at any named failpoint leaves
//! a state its restart makes consistent; guests starved of CPU, or whose VM process is
//! stopped, are kept (shown unresponsive), never torn down; a full disk is refused with
//! 507 and corrupts nothing.
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
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The shared template's tag.
const TAG: &str = "engine";

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
        let from = template().join("snapshots").join(TAG);
        let h = Home::new(None);
        let to = h.path().join("snapshots").join(TAG);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(&from).unwrap() {
            let e = e.unwrap();
            assert!(e.file_type().unwrap().is_file(), "{:?}", e.path());
            std::fs::hard_link(e.path(), to.join(e.file_name())).unwrap();
        }
        std::fs::set_permissions(&to, std::fs::metadata(&from).unwrap().permissions()).unwrap();
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
            .env_remove(forkd_core::failpoint::ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(fp) = failpoint {
            cmd.env(forkd_core::failpoint::ENV, fp);
        }
        self.daemon = Some(cmd.spawn().unwrap());
    }

    /// Starts the daemon and waits until it answers on its socket.
    fn start(&mut self, failpoint: Option<&str>) {
        self.spawn(failpoint);
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            if std::os::unix::net::UnixStream::connect(self.socket()).is_ok() {
                return;
            }
            if let Some(status) = self.daemon.as_mut().unwrap().try_wait().unwrap() {
                self.daemon = None;
                panic!("the daemon exited ({status}): {}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "the daemon did not come up: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
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

    /// SIGTERM, and waits for the daemon to exit (it leaves its sandboxes running).
    fn stop(&mut self) {
        terminate(self.pid());
        let status = self.wait_exit(Duration::from_secs(60));
        assert!(status.success(), "{status}: {}", self.log());
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
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Before the directory itself goes (when `dir` is dropped, after this).
        drop(self.tmpfs.take());
    }
}

fn terminate(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
}

/// Processes (other than zombies) one of whose arguments names something inside `dir`.
fn processes_naming(dir: &Path) -> Vec<u32> {
    let inside = format!("{}/", dir.display());
    forkd_hypervisor::process::find_by_argument(&inside)
        .into_iter()
        .map(|(pid, _)| pid)
        .filter(|pid| forkd_hypervisor::process::is_alive(*pid))
        .collect()
}

/// The data directory holding the shared template, built on first use. It is removed
/// when the test process exits (see [`remove_template`]).
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let mut h = Home::new(None);
        h.start(None);
        runtime().block_on(common::build_snapshot(&h.client(), "minimal", TAG));
        h.stop();
        let path = h.path().to_owned();
        *TEMPLATE_HOME.lock().unwrap() = Some(h);
        // SAFETY: registers a plain function, run once by exit().
        unsafe { libc::atexit(remove_template) };
        path
    })
}

static TEMPLATE_HOME: Mutex<Option<Home>> = Mutex::new(None);

/// The test harness has no hook after the last test; exit() runs this.
extern "C" fn remove_template() {
    if let Ok(mut h) = TEMPLATE_HOME.lock() {
        drop(h.take());
    }
}

async fn list(c: &Client) -> Vec<Value> {
    let (s, v) = call(c, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["sandboxes"].as_array().unwrap().clone()
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

fn pid_of(s: &Value) -> u32 {
    s["pid"].as_u64().unwrap() as u32
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
        .env_remove(forkd_core::failpoint::ENV)
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
        assert_eq!(after, before, "the first daemon's sandboxes changed");
        for s in &after {
            let id = s["id"].as_str().unwrap();
            assert!(
                forkd_hypervisor::process::is_alive(pid_of(s)),
                "{id}'s QEMU died"
            );
            assert_eq!(status_of(&c, id).await, "running");
            assert_eq!(exec_ok(&c, id, "cat /mark").await, format!("{id}\n"));
        }
    });
    h.stop();
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
