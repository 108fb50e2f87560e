//! BRANCH through the daemon, on real `python` VMs: children of a branch have the
//! source's state at the branch instant (even pages a process rewrote all through a live
//! copy) and their own randomness; the source runs on and
//! sees none of their writes; bad requests change nothing; a daemon killed at the branch
//! instant leaves a failed operation, no snapshot and a source that runs.
//!
//! One daemon and one `python` template for the whole file (a template build costs tens
//! of seconds under TCG); the phases run in order in one test.

mod common;

use common::{b64, call, create as fork, exec, runtime, Daemon};
use forkd_daemon::client::Client;
use hyper::{Method, StatusCode};
use serde_json::{json, Value};

async fn sh(c: &Client, id: &str, script: &str) -> String {
    let v = exec(c, id, script).await;
    assert_eq!(v["exit_code"], 0, "exec in {id}: {script}: {v}");
    String::from_utf8(b64(&v["stdout_b64"]))
        .unwrap()
        .trim()
        .to_owned()
}

/// Runs `code` in the sandbox's warm context; returns the value's text.
async fn py(c: &Client, id: &str, code: &str) -> String {
    let (s, v) = call(
        c,
        Method::POST,
        &format!("/v1/sandboxes/{id}/code"),
        Some(json!({ "code": code })),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "code in {id}: {v}");
    assert!(v["error"].is_null(), "code in {id}: {code}: {v}");
    v["results"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

async fn branch(c: &Client, id: &str, body: Value) -> (StatusCode, Value) {
    call(
        c,
        Method::POST,
        &format!("/v1/sandboxes/{id}/branch"),
        Some(body),
    )
    .await
}

async fn kill(c: &Client, id: &str) {
    let (s, v) = call(c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
}

async fn snapshot_tags(c: &Client) -> Vec<String> {
    let (s, v) = call(c, Method::GET, "/v1/snapshots", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["tag"].as_str().unwrap().to_owned())
        .collect()
}

/// The source's state, branched live then paused; three children of the first and one
/// of the second each check all of it.
async fn children_have_the_state_of_the_branch_instant(c: &Client, source: &str) {
    let mut later_files = Vec::new();
    for (mode, tag, n) in [("live", "b-live", 3u32), ("pause", "b-pause", 1)] {
        let (s, b) = branch(c, source, json!({"tag": tag, "mode": mode})).await;
        assert_eq!(s, StatusCode::CREATED, "{b}");
        assert_eq!(b["snapshot"], tag);
        assert_eq!(b["mode"], mode);
        assert!(b["pause_ms"].as_f64().unwrap() > 0.0, "{b}");
        // The source runs on, and writes after the branch.
        assert_eq!(py(c, source, "x").await, "41");
        sh(c, source, &format!("echo after > /root/later-{mode}")).await;
        let children = fork(c, tag, n).await;
        let mut draws = Vec::new();
        for id in &children {
            assert_eq!(py(c, id, "x + 1").await, "42", "{id}");
            assert_eq!(sh(c, id, "cat /root/note").await, "written-before");
            assert_eq!(
                sh(c, id, "kill -0 $(cat /root/bg.pid) && echo alive").await,
                "alive"
            );
            let later = format!("test -e /root/later-{mode} && echo yes || echo no");
            assert_eq!(sh(c, id, &later).await, "no", "{id}");
            // What the source wrote before this branch (after the last one) is in it.
            for f in &later_files {
                assert_eq!(sh(c, id, &format!("cat {f}")).await, "after");
            }
            draws.push(
                py(
                    c,
                    id,
                    "import os, random\n(os.urandom(16).hex(), random.random(), float(np.random.rand()))",
                )
                .await,
            );
            sh(c, id, &format!("echo {id} > /root/child")).await;
            py(c, id, "x = 0").await;
        }
        later_files.push(format!("/root/later-{mode}"));
        let mut unique = draws.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), draws.len(), "the same draws: {draws:?}");
        assert_eq!(
            sh(c, source, "test -e /root/child && echo yes || echo no").await,
            "no"
        );
        assert_eq!(py(c, source, "x").await, "41");
        for id in &children {
            kill(c, id).await;
        }
    }
}

/// Rewrites 1024 pages of a tmpfs file in a loop, each with the number of its sweep, and
/// checks before each write that the page still holds the previous sweep's number; a page
/// that does not is written to /dev/shm/stale. Run in a source, it finds nothing; run on
/// in a child of a live branch, it finds every page the branch did not copy as it was.
const WRITER: &str = r#"
import mmap, os, struct
N = 1024
fd = os.open("/dev/shm/pages", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, N * 4096)
m = mmap.mmap(fd, N * 4096)
open("/dev/shm/writer.pid", "w").write(str(os.getpid()))
g = 0
while True:
    want, g = struct.pack("<Q", g), g + 1
    new = struct.pack("<Q", g)
    for i in range(N):
        o = i * 4096
        if m[o:o + 8] != want:
            with open("/dev/shm/stale", "a") as f:
                f.write("page %d: %d, not %d\n" % (i, struct.unpack("<Q", m[o:o + 8])[0], g - 1))
        m[o:o + 8] = new
"#;

/// Waits for the writer to finish two more sweeps (so that it checked every page once
/// since the caller's instant) and prints what it found stale, or `none`.
const WRITER_CHECK: &str = r#"
import struct, time
def sweep():
    try:
        with open("/dev/shm/pages", "rb") as f:
            return struct.unpack("<Q", f.read(8).ljust(8, b"\0"))[0]
    except FileNotFoundError:
        return -2
deadline = time.time() + 60
while sweep() < 0 and time.time() < deadline:
    time.sleep(0.01)
first = sweep()
while sweep() < first + 2 and time.time() < deadline:
    time.sleep(0.01)
try:
    print(open("/dev/shm/stale").read().strip() or "none")
except FileNotFoundError:
    print("none" if sweep() >= first + 2 else "the writer stopped")
"#;

/// A process that writes to memory all through a live branch's copy: its children have
/// every page as it was at the branch instant, and the writer runs on in them. (QEMU
/// before 9.0 under TCG failed this: stores through its software TLB escaped the dirty
/// tracking, and children got pages from earlier passes of the copy.)
async fn a_process_writing_through_a_live_branch_is_captured_at_one_instant(c: &Client) {
    let source = fork(c, "python", 1).await.remove(0);
    let start = format!(
        "cat > /root/writer.py <<'EOF'\n{WRITER}\nEOF\ncat > /root/check.py <<'EOF'\n{WRITER_CHECK}\nEOF\nsetsid -f python3 /root/writer.py </dev/null >/dev/null 2>&1"
    );
    sh(c, &source, &start).await;
    assert_eq!(sh(c, &source, "python3 /root/check.py").await, "none");
    let (s, b) = branch(c, &source, json!({"tag": "b-writer", "mode": "live"})).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    kill(c, &source).await;
    let child = fork(c, "b-writer", 1).await.remove(0);
    let writer_alive = "kill -0 $(cat /dev/shm/writer.pid) && echo alive || echo gone";
    assert_eq!(sh(c, &child, writer_alive).await, "alive");
    assert_eq!(sh(c, &child, "python3 /root/check.py").await, "none");
    kill(c, &child).await;
    let (s, v) = call(c, Method::DELETE, "/v1/snapshots/b-writer", None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
}

/// Refusals, each changing nothing on disk: a tag that exists, a bad tag, a bad mode,
/// an unknown sandbox, a sandbox already gone.
async fn bad_branches_are_refused_and_change_nothing(d: &Daemon, c: &Client, source: &str) {
    let before = d.disk_state();
    for (id, body, want) in [
        (source, json!({"tag": "python"}), StatusCode::CONFLICT),
        (source, json!({"tag": "../x"}), StatusCode::BAD_REQUEST),
        (source, json!({"mode": "fast"}), StatusCode::BAD_REQUEST),
        (source, json!({"colour": 1}), StatusCode::BAD_REQUEST),
        ("sb-000000000000", json!({}), StatusCode::NOT_FOUND),
    ] {
        let (s, v) = branch(c, id, body.clone()).await;
        assert_eq!(s, want, "{body}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
    }
    assert_eq!(d.disk_state(), before);
    // One being deleted: refused (409 while it stops, 404 once gone; a branch that got
    // in first fails with 409 when the delete ends its VM), and no snapshot is left.
    let doomed = fork(c, "python", 1).await.remove(0);
    let c2 = c.clone();
    let d2 = doomed.clone();
    let deleting = tokio::spawn(async move { kill(&c2, &d2).await });
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let (s, v) = branch(c, &doomed, json!({"tag": "doomed"})).await;
    deleting.await.unwrap();
    assert!(
        matches!(s, StatusCode::CONFLICT | StatusCode::NOT_FOUND),
        "{s}: {v}"
    );
    assert!(!snapshot_tags(c).await.contains(&"doomed".to_owned()));
    let (s, v) = branch(c, &doomed, json!({"tag": "doomed"})).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
}

#[test]
fn branch_through_the_daemon() {
    let mut d = Daemon::start(&[]);
    let rt = runtime();
    let c = d.unix();
    let source = rt.block_on(async {
        d.link_snapshot("python", "python");
        let source = fork(&c, "python", 1).await.remove(0);
        py(&c, &source, "x = 41").await;
        sh(&c, &source, "echo written-before > /root/note").await;
        sh(
            &c,
            &source,
            "nohup sh -c 'while true; do sleep 1; done' >/dev/null 2>&1 & echo $! > /root/bg.pid",
        )
        .await;
        children_have_the_state_of_the_branch_instant(&c, &source).await;
        a_process_writing_through_a_live_branch_is_captured_at_one_instant(&c).await;
        bad_branches_are_refused_and_change_nothing(&d, &c, &source).await;
        // A result past the agent's 16 MiB limit is the request's problem, not the
        // sandbox's: a 4xx naming the limit, and the sandbox runs on as it was.
        let (s, v) = call(
            &c,
            Method::POST,
            &format!("/v1/sandboxes/{source}/code"),
            Some(json!({ "code": "'x' * (17 << 20)" })),
        )
        .await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
        assert!(v.to_string().contains("16777216 bytes"), "{v}");
        assert_eq!(py(&c, &source, "x").await, "41");
        let (_, info) = call(&c, Method::GET, &format!("/v1/sandboxes/{source}"), None).await;
        assert_eq!(info["status"], "running", "{info}");
        source
    });
    // After a template build, forks and branches: nothing of the data directory is
    // open to other users (its group included, whatever --socket-group makes of its
    // top directory).
    let loose = common::loose_modes(d.home.path());
    assert!(loose.is_empty(), "open to others:\n{}", loose.join("\n"));

    // A daemon killed at the branch instant (the source stopped, its memory half sent).
    d.kill9();
    d.respawn_with_env(&[(forkd_host::failpoint::ENV, "branch.at_instant")]);
    let op = rt.block_on(async {
        let (s, op) = branch(
            &c,
            &source,
            json!({"tag": "cut", "mode": "pause", "wait": false}),
        )
        .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{op}");
        op["id"].as_str().unwrap().to_owned()
    });
    use std::os::unix::process::ExitStatusExt;
    let status = d.wait_exit(120);
    assert_eq!(
        status.signal(),
        Some(libc::SIGABRT),
        "{status}: {}",
        d.log()
    );
    d.respawn_with_env(&[]);
    rt.block_on(async {
        let (s, v) = call(&c, Method::GET, &format!("/v1/operations/{op}"), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["status"], "failed", "{v}");
        assert!(!snapshot_tags(&c).await.contains(&"cut".to_owned()));
        let staging = d.home.path().join("snapshots/.staging");
        let left: Vec<_> = std::fs::read_dir(&staging)
            .map(|r| r.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "staging left: {left:?}");
        let (s, v) = call(&c, Method::GET, &format!("/v1/sandboxes/{source}"), None).await;
        assert_eq!(
            (s, v["status"].as_str()),
            (StatusCode::OK, Some("running")),
            "{v}"
        );
        assert_eq!(py(&c, &source, "x").await, "41");
        // The layer made for the cut capture, never used, is gone: none of the
        // source's layers builds on the snapshot that was not written.
        let dir = d.home.path().join("run/sandboxes").join(&source);
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("root") && name.ends_with(".qcow2") {
                let base = forkd_qemu::qcow2::backing_name(&e.path()).unwrap();
                assert!(
                    !base.unwrap_or_default().contains("/cut/"),
                    "{name} builds on the cut branch"
                );
            }
        }
        // And it can be branched again.
        let (s, b) = branch(&c, &source, json!({"tag": "after-crash"})).await;
        assert_eq!(s, StatusCode::CREATED, "{b}");
        let child = fork(&c, "after-crash", 1).await.remove(0);
        assert_eq!(py(&c, &child, "x").await, "41");
        kill(&c, &child).await;
    });
    chains_are_shown_kept_removed_and_compacted(&d, &rt, &c, &source);
}

/// `forkd` aimed at the test's daemon; panics with its stderr unless it succeeds
/// (`ok`) or fails (`!ok`); returns its stdout and stderr.
fn cli(d: &Daemon, args: &[&str], ok: bool) -> (String, String) {
    let out = d.forkd().args(args).output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert_eq!(out.status.success(), ok, "forkd {args:?}: {stdout}{stderr}");
    (stdout, stderr)
}

/// A branch of a child of a branch of a child of a branch: depth 3 over the template.
fn chains_are_shown_kept_removed_and_compacted(
    d: &Daemon,
    rt: &tokio::runtime::Runtime,
    c: &Client,
    source: &str,
) {
    let mut base = "b-live".to_owned();
    let mut made = Vec::new();
    rt.block_on(async {
        for link in ["d2", "d3"] {
            let child = fork(c, &base, 1).await.remove(0);
            sh(c, &child, &format!("echo {link} > /root/{link}")).await;
            let (s, b) = branch(c, &child, json!({"tag": link})).await;
            assert_eq!(s, StatusCode::CREATED, "{b}");
            assert_eq!(b["parent"], base.as_str());
            made.push(child);
            base = link.to_owned();
        }
        let child = fork(c, "d3", 1).await.remove(0);
        assert_eq!(
            sh(c, &child, "cat /root/d2 /root/d3 /root/note").await,
            "d2\nd3\nwritten-before"
        );
        assert_eq!(py(c, &child, "x").await, "41");
        made.push(child);
        for id in &made {
            kill(c, id).await;
        }
    });
    let (show, _) = cli(d, &["snapshot", "show", "d3", "--json"], true);
    let v: Value = serde_json::from_str(&show).unwrap();
    assert_eq!(v["chain"]["depth"], 3, "{v}");
    assert_eq!(v["chain"]["ancestors"], json!(["d2", "b-live", "python"]));
    assert_eq!(v["parent"], "d2");
    // Little was dirtied in d3's source: it stores a small fraction of the RAM.
    let own = v["chain"]["own_bytes"].as_u64().unwrap();
    assert!(own < (512 << 20) / 10, "d3 stores {own} bytes of its own");
    assert!(v["chain"]["total_bytes"].as_u64().unwrap() > own);
    let (text, _) = cli(d, &["snapshot", "show", "d3"], true);
    assert!(
        text.contains("depth 3") && text.contains("ancestors: d2, b-live, python"),
        "{text}"
    );
    let (ok, _) = cli(d, &["snapshot", "verify", "d3"], true);
    assert!(ok.contains("its 3 ancestors"), "{ok}");
    archives_carry_a_chain_to_another_data_directory(d, rt);

    // A middle link is kept while others depend on it; --cascade takes them all.
    let (_, err) = cli(d, &["rmi", "d2"], false);
    assert!(err.contains("snapshot d3"), "{err}");
    let (_, err) = cli(d, &["rmi", "--cascade", "b-live"], false);
    assert!(
        err.contains(source),
        "the source builds on b-live's chain: {err}"
    );
    cli(d, &["snapshot", "compact", "d3", "--tag", "d3-flat"], true);
    rt.block_on(kill(c, source));
    cli(d, &["rmi", "--cascade", "b-live"], true);
    let tags = rt.block_on(snapshot_tags(c));
    for gone in ["b-live", "b-pause", "after-crash", "d2", "d3"] {
        assert!(!tags.contains(&gone.to_owned()), "{gone} left: {tags:?}");
    }
    cli(d, &["rmi", "python"], true);
    rt.block_on(async {
        let child = fork(c, "d3-flat", 1).await.remove(0);
        assert_eq!(
            sh(c, &child, "cat /root/d2 /root/d3 /root/note").await,
            "d2\nd3\nwritten-before"
        );
        assert_eq!(py(c, &child, "x + 1").await, "42");
    });
    let (show, _) = cli(d, &["snapshot", "show", "d3-flat", "--json"], true);
    let v: Value = serde_json::from_str(&show).unwrap();
    assert_eq!(
        (v["chain"]["depth"].as_u64(), v["parent"].is_null()),
        (Some(0), true),
        "{v}"
    );
}

/// `forkd pack` of d2 (depth 2: d2, b-live, python) piped into `forkd unpack` of a second
/// daemon's data directory: the chain arrives whole, its children have the branch's
/// state and the template's warm context; a cut archive installs nothing. (Through a
/// pipe, as between two hosts: no archive file takes this machine's disk twice.)
fn archives_carry_a_chain_to_another_data_directory(d: &Daemon, rt: &tokio::runtime::Runtime) {
    use std::io::Read;
    use std::process::Stdio;
    let pack = || {
        d.forkd()
            .args(["pack", "d2", "-o", "-"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let other = Daemon::start(&[]);
    let c2 = other.unix();
    // Cut short: refused, nothing installed.
    let mut cut_short = pack();
    let mut head = vec![0u8; 32 << 20];
    cut_short
        .stdout
        .take()
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    let _ = cut_short.wait();
    let cut = other.home.path().join("cut.tar");
    std::fs::write(&cut, &head).unwrap();
    let (_, err) = cli(&other, &["unpack", cut.to_str().unwrap()], false);
    assert!(
        err.contains("truncated") && err.contains("nothing was installed"),
        "{err}"
    );
    assert!(rt.block_on(snapshot_tags(&c2)).is_empty());
    std::fs::remove_file(&cut).unwrap();

    // The archive goes through a pipe to the other daemon's `unpack -` and, as it
    // passes, into a file the later unpacks read (packing again would only say again
    // what this pack said).
    let archive = other.home.path().join("d2.tar");
    let first_unpack = |args: &[&str]| {
        let mut packing = pack();
        let mut from_pack = packing.stdout.take().unwrap();
        let mut unpacking = other
            .forkd()
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut to_unpack = unpacking.stdin.take().unwrap();
        let mut kept = std::fs::File::create(&archive).unwrap();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = from_pack.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            std::io::Write::write_all(&mut kept, &buf[..n]).unwrap();
            std::io::Write::write_all(&mut to_unpack, &buf[..n]).unwrap();
        }
        drop(to_unpack);
        let packed = packing.wait_with_output().unwrap();
        let said = String::from_utf8_lossy(&packed.stderr).into_owned();
        assert!(packed.status.success(), "{said}");
        assert!(
            said.contains("wrote") && said.contains("python, b-live, d2"),
            "{said}"
        );
        unpacking.wait_with_output().unwrap()
    };
    let answer = |out: std::process::Output| {
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let unpack = |args: &[&str]| {
        let kept = std::fs::File::open(&archive).unwrap();
        answer(other.forkd().args(args).stdin(kept).output().unwrap())
    };
    let (ok, out, err) = answer(first_unpack(&["unpack", "-"]));
    assert!(
        ok && out.contains("installed python, b-live, d2"),
        "{out}{err}"
    );
    let (show, _) = cli(&other, &["snapshot", "show", "d2", "--json"], true);
    let v: Value = serde_json::from_str(&show).unwrap();
    assert_eq!(v["chain"]["ancestors"], json!(["b-live", "python"]), "{v}");
    cli(&other, &["snapshot", "verify", "d2"], true);
    let (out, _) = cli(&other, &["snapshot", "verify", "d2", "--json"], true);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["links"], 3, "{v}");
    let (ok, out, err) = unpack(&["unpack", "-"]);
    assert!(ok && out.contains("d2 is here already"), "{out}{err}");
    // The same answer as JSON; and `--json` cannot share standard output with the archive.
    let (ok, out, err) = unpack(&["unpack", "-", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}{err}"));
    assert!(ok, "{err}");
    assert_eq!(
        (&v["tag"], &v["installed"]),
        (&json!("d2"), &json!([])),
        "{v}"
    );
    let (_, err) = cli(d, &["pack", "d2", "-o", "-", "--json"], false);
    assert!(err.contains("--json cannot go with `-o -`"), "{err}");
    let (ok, _, err) = unpack(&["unpack", "-", "--tag", "python"]);
    assert!(!ok && err.contains("already exists"), "{err}");
    rt.block_on(async {
        let child = fork(&c2, "d2", 1).await.remove(0);
        assert_eq!(
            sh(&c2, &child, "cat /root/d2 /root/note").await,
            "d2\nwritten-before"
        );
        assert_eq!(py(&c2, &child, "x").await, "41");
        kill(&c2, &child).await;
        let child = fork(&c2, "python", 1).await.remove(0);
        assert_eq!(
            py(&c2, &child, "'pandas' in __import__('sys').modules").await,
            "True",
            "the template's warm context came along"
        );
        kill(&c2, &child).await;
    });

    // Through a registry: push from the first daemon, pull into the second after its d2
    // is removed. Only d2 is installed; its ancestors are here already.
    let reg = common::Registry::start();
    let reference = format!("{}/forkd/d2:v1", reg.addr);
    let (out, _) = cli(d, &["push", "d2", &reference], true);
    assert!(
        out.contains("pushed python, b-live, d2") && out.contains(", 0 the registry had"),
        "{out}"
    );
    let (out, _) = cli(d, &["push", "d2", &reference], true);
    assert!(out.contains("0 blobs uploaded"), "{out}");
    let (out, _) = cli(d, &["push", "d2", &reference, "--json"], true);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["snapshots"], json!(["python", "b-live", "d2"]), "{v}");
    assert_eq!(v["uploaded"], 0, "{v}");
    cli(&other, &["rmi", "d2"], true);
    let (out, _) = cli(&other, &["pull", &reference], true);
    assert_eq!(out.trim(), "installed d2 (on python, b-live, here already)");
    let (out, _) = cli(&other, &["pull", &reference, "--json"], true);
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(
        (&v["tag"], &v["installed"]),
        (&json!("d2"), &json!([])),
        "{v}"
    );
    let (_, err) = cli(
        &other,
        &["pull", &format!("{}/forkd/none:v1", reg.addr)],
        false,
    );
    assert!(err.contains("manifest unknown"), "{err}");
    rt.block_on(async {
        let child = fork(&c2, "d2", 1).await.remove(0);
        assert_eq!(sh(&c2, &child, "cat /root/d2").await, "d2");
        assert_eq!(py(&c2, &child, "x").await, "41");
        kill(&c2, &child).await;
    });
}
