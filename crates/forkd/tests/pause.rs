//! Pause to disk and resume, through the daemon: a paused sandbox has no VM, keeps its
//! files, processes and memory, survives a restart of the daemon, and comes back in
//! place; a damaged pause image is refused and kept.

mod common;

use common::{call, create, exec, runtime, Daemon};
use forkd_daemon::client::Client;
use hyper::{Method, StatusCode};
use serde_json::json;
use std::path::Path;

async fn sandbox(c: &Client, id: &str) -> serde_json::Value {
    let (s, v) = call(c, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

async fn verb(c: &Client, id: &str, verb: &str) -> (StatusCode, serde_json::Value) {
    call(c, Method::POST, &format!("/v1/sandboxes/{id}/{verb}"), None).await
}

fn stdout(v: &serde_json::Value) -> String {
    String::from_utf8(common::b64(&v["stdout_b64"])).unwrap()
}

/// The sandbox's state: a file, and a background shell holding a value in its memory
/// only, which it writes out when told (through a fifo).
const SET_UP: &str = "echo kept > /root/file; mkfifo /tmp/go; \
    (v=mine-$$-$RANDOM; read x < /tmp/go; echo \"$v $x\" > /tmp/out) >/dev/null 2>&1 & \
    sleep 0.2; echo started";

/// Has the background shell write its value out, and reads it.
const READ_BACK: &str = "echo now > /tmp/go; for i in 1 2 3 4 5 6 7 8 9 10; do \
    [ -s /tmp/out ] && break; sleep 0.2; done; cat /tmp/out";

#[test]
fn a_paused_sandbox_has_no_vm_survives_a_restart_and_resumes_as_it_was() {
    let mut d = Daemon::start(&["--max-paused", "1"]);
    d.link_snapshot("minimal", "mini");
    let (ids, pid, dir) = runtime().block_on(async {
        let c = d.unix();
        let ids = create(&c, "mini", 2).await;
        let (a, b) = (&ids[0], &ids[1]);
        let (s, v) = call(
            &c,
            Method::PUT,
            &format!("/v1/sandboxes/{a}/timeout"),
            Some(json!({ "timeout_s": 3600 })),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(stdout(&exec(&c, a, SET_UP).await), "started\n");
        exec(&c, b, "echo other > /root/file").await;
        let pid = sandbox(&c, a).await["pid"].as_u64().unwrap();

        let (s, p) = verb(&c, a, "pause").await;
        assert_eq!(s, StatusCode::OK, "{p}");
        assert!(p["stored_bytes"].as_u64().unwrap() > 0, "{p}");
        assert!(p["pages"].as_u64().unwrap() > 0, "{p}");
        let v = sandbox(&c, a).await;
        assert_eq!(v["status"], "paused", "{v}");
        assert_eq!(v["pid"], 0, "{v}");
        assert!(
            v["timeout_at"].is_null(),
            "no deadline runs while paused: {v}"
        );
        assert!(
            !forkd_host::process::is_alive(u32::try_from(pid).unwrap()),
            "its QEMU (pid {pid}) is gone"
        );
        // It is not paused twice.
        let (s, v) = verb(&c, a, "pause").await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("paused"),
            "{v}"
        );
        // Branched while paused, without running: the branch's child starts where it
        // was paused.
        let (s, v) = call(
            &c,
            Method::POST,
            &format!("/v1/sandboxes/{a}/branch"),
            Some(json!({ "tag": "from-paused" })),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        assert_eq!(v["parent"], "mini", "{v}");
        assert_eq!(sandbox(&c, a).await["status"], "paused");
        let child = create(&c, "from-paused", 1).await.remove(0);
        assert_eq!(stdout(&exec(&c, &child, "cat /root/file").await), "kept\n");
        let out = stdout(&exec(&c, &child, READ_BACK).await);
        assert!(
            out.starts_with("mine-") && out.ends_with(" now\n"),
            "{out:?}"
        );
        let (s, v) = call(&c, Method::DELETE, &format!("/v1/sandboxes/{child}"), None).await;
        assert!(s.is_success(), "{v}");
        let (s, v) = call(&c, Method::DELETE, "/v1/snapshots/from-paused", None).await;
        assert!(s.is_success(), "{v}");
        let (_, metrics) = call(&c, Method::GET, "/metrics", None).await;
        let metrics = metrics.as_str().unwrap().to_owned();
        assert!(
            metrics.contains("forkd_sandboxes{state=\"paused\"} 1"),
            "{metrics}"
        );
        let dir = d.home.path().join("run/sandboxes").join(a);
        assert!(dir.join("paused").is_dir());
        // One paused is the most this daemon keeps: the other runs on.
        let (s, v) = verb(&c, b, "pause").await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--max-paused"),
            "{v}"
        );
        assert_eq!(sandbox(&c, b).await["status"], "running");
        (ids, pid, dir)
    });

    // The daemon stops and comes back: the paused sandbox is still there, paused.
    d.kill9();
    d.spawn();
    runtime().block_on(async {
        let c = d.unix();
        let (a, b) = (&ids[0], &ids[1]);
        assert_eq!(sandbox(&c, a).await["status"], "paused");

        let (s, r) = verb(&c, a, "resume").await;
        assert_eq!(s, StatusCode::OK, "{r}");
        assert!(r["total_ms"].as_f64().unwrap() > 0.0, "{r}");
        let v = sandbox(&c, a).await;
        assert_eq!(v["status"], "running", "{v}");
        assert_ne!(v["pid"].as_u64().unwrap(), pid, "a new QEMU");
        let left =
            v["timeout_at"].as_i64().expect("its deadline runs again") - forkd_daemon::unix_now();
        assert!((3000..=3600).contains(&left), "{left} s left of 3600");
        // The image goes once resumed, off the answer's path.
        let gone_by = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while dir.join("paused").exists() {
            assert!(
                std::time::Instant::now() < gone_by,
                "the image stays after the resume"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        // Its file, and the value only its background shell's memory held.
        assert_eq!(stdout(&exec(&c, a, "cat /root/file").await), "kept\n");
        let out = stdout(&exec(&c, a, READ_BACK).await);
        assert!(
            out.starts_with("mine-") && out.ends_with(" now\n"),
            "{out:?}"
        );
        // A request that needs the VM resumes a paused sandbox on its own; requests
        // that come together wait for one resume.
        // (Branched first: its disk then builds on the branch, which cannot be removed
        // while it is paused.)
        let (s, v) = call(
            &c,
            Method::POST,
            &format!("/v1/sandboxes/{b}/branch"),
            Some(json!({ "tag": "b-branch" })),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let (s, v) = verb(&c, b, "pause").await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let (s, v) = call(&c, Method::DELETE, "/v1/snapshots/b-branch", None).await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(b.as_str()),
            "{v}"
        );
        let (x, y) = tokio::join!(exec(&c, b, "cat /root/file"), exec(&c, b, "echo two"));
        assert_eq!(stdout(&x), "other\n");
        assert_eq!(stdout(&y), "two\n");
        assert_eq!(sandbox(&c, b).await["status"], "running");
        // A resume of a running sandbox leaves it be.
        let (s, r) = verb(&c, a, "resume").await;
        assert_eq!(s, StatusCode::OK, "{r}");
        assert_eq!(r["total_ms"], 0.0, "{r}");
    });

    // The CLI, and a damaged image: refused at resume, the sandbox failed and its
    // files kept until it is deleted.
    let a = &ids[0];
    let out = d.forkd().args(["pause", a]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("paused") && stderr.contains("MiB stored"),
        "{stderr}"
    );
    let ls = d.forkd().args(["ls"]).output().unwrap();
    let ls = String::from_utf8_lossy(&ls.stdout);
    assert!(
        ls.lines()
            .any(|l| l.starts_with(a.as_str()) && l.contains("paused")),
        "{ls}"
    );
    damage(&dir.join("paused/memory.diff"));
    runtime().block_on(async {
        let c = d.unix();
        let (s, v) = verb(&c, a, "resume").await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("digest"),
            "{v}"
        );
        let v = sandbox(&c, a).await;
        assert_eq!(v["status"], "failed", "{v}");
        assert!(
            dir.join("paused/memory.diff").exists(),
            "its files are kept"
        );
        let (s, v) = call(&c, Method::DELETE, &format!("/v1/sandboxes/{a}"), None).await;
        assert!(s.is_success(), "{v}");
        assert!(!dir.exists());
    });
    let out = d.forkd().args(["resume", &ids[1]]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.contains("running already"),
        "{stderr}"
    );
}

/// Flips a byte in the last page of a memory diff.
fn damage(diff: &Path) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(diff)
        .unwrap();
    let at = f.metadata().unwrap().len() - 10;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0xff], at).unwrap();
}

/// Waits (up to a minute) until sandbox `id` is paused.
async fn until_paused(c: &Client, id: &str) {
    for _ in 0..300 {
        if sandbox(c, id).await["status"] == "paused" {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    panic!("{id} was not paused: {}", sandbox(c, id).await);
}

#[test]
fn a_timeout_idleness_or_a_stop_pauses_a_sandbox_that_asks_for_it() {
    let d = Daemon::start(&[]);
    d.link_snapshot("minimal", "mini");
    runtime().block_on(async {
        let c = d.unix();
        let mut ids = Vec::new();
        for body in [
            json!({ "snapshot": "mini", "timeout_s": 3, "on_timeout": "pause" }),
            json!({ "snapshot": "mini", "auto_pause_after_s": 3 }),
        ] {
            let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(body)).await;
            assert_eq!(s, StatusCode::CREATED, "{v}");
            ids.push(v["sandboxes"][0]["id"].as_str().unwrap().to_owned());
        }
        let (timed, idle) = (&ids[0], &ids[1]);
        for id in &ids {
            exec(&c, id, "echo mine > /root/file").await;
        }
        // A template whose recipe says so pauses its children at their timeout when
        // their fork does not say.
        let recipe = "image = \"minimal\"\nmemory_mib = 512\non_timeout = \"pause\"";
        let (s, op) = common::build_recipe(&c, "mini-pausing", recipe).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{op}");
        common::wait_operation(&c, op["id"].as_str().unwrap()).await;
        let (s, v) = call(
            &c,
            Method::POST,
            "/v1/sandboxes",
            Some(json!({ "snapshot": "mini-pausing", "timeout_s": 2 })),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let by_recipe = v["sandboxes"][0]["id"].as_str().unwrap().to_owned();
        until_paused(&c, &by_recipe).await;
        until_paused(&c, timed).await;
        until_paused(&c, idle).await;
        // Resumed by the next request, with what they had; the one paused by its
        // deadline has its timeout's length again.
        for id in &ids {
            assert_eq!(stdout(&exec(&c, id, "cat /root/file").await), "mine\n");
            assert_eq!(sandbox(&c, id).await["status"], "running");
        }
        // What a pause keeps must be one it knows; the sandbox runs on.
        let (s, v) = call(
            &c,
            Method::POST,
            &format!("/v1/sandboxes/{timed}/pause"),
            Some(json!({"keep": "sideways"})),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(sandbox(&c, timed).await["status"], "running");
        // Each pause and resume is an event of the sandbox's.
        let kinds: Vec<String> = common::events_of(&c, &format!("sandbox={timed}"))
            .await
            .iter()
            .map(|e| e["type"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(kinds, ["created", "started", "paused", "resumed"]);
        let left =
            sandbox(&c, timed).await["timeout_at"].as_i64().unwrap() - forkd_daemon::unix_now();
        assert!((0..=3).contains(&left), "{left}");
        // Requests keep the idle one running; left alone, it pauses again.
        for _ in 0..4 {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            exec(&c, idle, "true").await;
            assert_eq!(sandbox(&c, idle).await["status"], "running");
        }
        until_paused(&c, idle).await;
        // A bad idle time is refused.
        let (s, v) = call(
            &c,
            Method::POST,
            "/v1/sandboxes",
            Some(json!({ "snapshot": "mini", "auto_pause_after_s": 0 })),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    });
    // A daemon stopped with --pause-on-stop pauses what runs; it resumes after.
    let mut d = d;
    d.restart(&["--pause-on-stop"]);
    let id = runtime().block_on(async {
        let c = d.unix();
        let id = create(&c, "mini", 1).await.remove(0);
        exec(&c, &id, "echo before-the-stop > /root/file").await;
        id
    });
    d.stop();
    let dir = d.home.path().join("run/sandboxes").join(&id);
    assert_eq!(
        forkd_host::process::find_inside(&dir).len(),
        0,
        "no VM left"
    );
    d.start_again(&[]);
    runtime().block_on(async {
        let c = d.unix();
        assert_eq!(sandbox(&c, &id).await["status"], "paused");
        let out = stdout(&exec(&c, &id, "cat /root/file").await);
        assert_eq!(out, "before-the-stop\n");
    });
}

/// The QEMU processes running for the sandbox directory `dir`.
fn vms_in(dir: &Path) -> usize {
    forkd_host::process::find_inside(dir).len()
}

#[test]
fn a_daemon_killed_at_any_point_of_a_pause_or_resume_leaves_the_sandbox_whole() {
    use std::os::unix::process::ExitStatusExt;
    let mut d = Daemon::start(&[]);
    d.link_snapshot("minimal", "mini");
    let rt = runtime();
    let c = d.unix();
    let id = rt.block_on(async {
        let id = create(&c, "mini", 1).await.remove(0);
        assert_eq!(stdout(&exec(&c, &id, SET_UP).await), "started\n");
        id
    });
    let dir = d.home.path().join("run/sandboxes").join(&id);
    // Each crash point, with the verb that reaches it and what the sandbox is after.
    for (failpoint, verb_reaching_it, then) in [
        ("pause.at_instant", "pause", "running"),
        ("pause.after_image", "pause", "paused"),
        ("resume.after_memory", "resume", "paused"),
        ("resume.after_vm_start", "resume", "running"),
    ] {
        if verb_reaching_it == "resume" {
            rt.block_on(async {
                let (s, v) = verb(&c, &id, "pause").await;
                assert_eq!(s, StatusCode::OK, "{v}");
            });
        }
        d.kill9();
        d.respawn_with_env(&[(forkd_host::failpoint::ENV, failpoint)]);
        rt.block_on(async {
            // The daemon aborts before it answers.
            let path = format!("/v1/sandboxes/{id}/{verb_reaching_it}");
            assert!(c.call(Method::POST, &path, None).await.is_err());
        });
        let status = d.wait_exit(120);
        assert_eq!(
            status.signal(),
            Some(libc::SIGABRT),
            "{failpoint}: {}",
            d.log()
        );
        d.respawn_with_env(&[]);
        rt.block_on(async {
            let v = sandbox(&c, &id).await;
            assert_eq!(v["status"], then, "after {failpoint}: {v}");
            let vms = vms_in(&dir);
            assert_eq!(vms, usize::from(then == "running"), "after {failpoint}");
            // Whole: its file, and the value its background shell holds (read once,
            // at the end, since reading it ends that shell).
            assert_eq!(stdout(&exec(&c, &id, "cat /root/file").await), "kept\n");
            assert_eq!(sandbox(&c, &id).await["status"], "running");
        });
    }
    rt.block_on(async {
        let out = stdout(&exec(&c, &id, READ_BACK).await);
        assert!(
            out.starts_with("mine-") && out.ends_with(" now\n"),
            "{out:?}"
        );
    });
}
