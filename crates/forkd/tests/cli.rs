//! The `forkd` command line, run as a user would run it.

mod common;

use std::process::Command;

fn forkd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_forkd"))
}

fn sandboxes_left(home: &std::path::Path) -> Vec<String> {
    match std::fs::read_dir(home.join("run/sandboxes")) {
        Ok(d) => d
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    }
}

#[test]
fn run_streams_output_and_exits_with_the_commands_code() {
    // A data directory of its own: what other test processes run is not counted.
    let home = common::data_dir("cli-test-");
    let forkd = || {
        let mut c = forkd();
        c.env("FORKD_HOME", home.path());
        c
    };
    let before = sandboxes_left(home.path());

    let out = forkd()
        .args(["run", "--image", "minimal", "--", "sh", "-c", "exit 3"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Under a translation buffer cap (TCG) the guest boots and answers all the same.
    let out = forkd()
        .env("FORKD_TCG_TB_MIB", "16")
        .args([
            "run",
            "--image",
            "minimal",
            "--env",
            "WHO=forkd",
            "--",
            "sh",
            "-c",
            "echo hello $WHO; echo oops >&2",
        ])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, b"hello forkd\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains("oops"));

    a_killed_run_takes_its_vm_along(home.path());

    // Nothing of any sandbox is left behind.
    assert_eq!(sandboxes_left(home.path()), before);
}

/// The real user id of process `pid`.
fn uid_of(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// `forkd run` killed outright takes its VM with it, jailed or not: a jailed QEMU has
/// changed user, which clears the parent-death signal, and is held by its PID
/// namespace's lifeline instead. (Run by the test of `forkd run`: both watch the
/// sandboxes that appear.)
fn a_killed_run_takes_its_vm_along(home: &std::path::Path) {
    use std::time::{Duration, Instant};
    let before = sandboxes_left(home);
    let qemu = forkd_qemu::Qemu::from_env();
    let jailed = forkd_qemu::version::current_version(qemu.binary())
        .ok()
        .is_some_and(|v| forkd_qemu::jail::unjailable(v).is_none());
    let mut run = forkd()
        .env("FORKD_HOME", home)
        .args(["run", "--image", "minimal", "--", "sleep", "600"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Its VM, once it runs the guest (as its own user, when jailed).
    let deadline = Instant::now() + Duration::from_secs(180);
    let (dir, qemu_pid) = loop {
        let found = sandboxes_left(home)
            .into_iter()
            .filter(|s| !before.contains(s))
            .map(|s| home.join("run/sandboxes").join(s))
            .find_map(|dir| {
                let pids = forkd_host::process::find_inside(&dir);
                let (pid, _) = pids.into_iter().next()?;
                let settled =
                    !jailed || uid_of(pid).is_some_and(|u| u >= forkd_qemu::jail::FIRST_UID);
                settled.then_some((dir, pid))
            });
        if let Some(found) = found {
            break found;
        }
        assert!(
            run.try_wait().unwrap().is_none(),
            "forkd run ended before its VM ran"
        );
        assert!(Instant::now() < deadline, "no VM of forkd run appeared");
        std::thread::sleep(Duration::from_millis(100));
    };
    if jailed {
        let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/pid")).unwrap();
        assert_ne!(
            ns(&qemu_pid.to_string()),
            ns("self"),
            "not in a PID namespace of its own"
        );
    }
    run.kill().unwrap();
    run.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while forkd_host::process::is_alive(qemu_pid) {
        assert!(
            Instant::now() < deadline,
            "the VM of a killed forkd run outlived it (jailed: {jailed})"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // What a killed run leaves: its directory (its cgroup goes with the next daemon's
    // sweep).
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_arguments_are_refused_clearly() {
    let out = forkd()
        .args(["run", "--env", "NOEQUALS", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not KEY=VALUE"));

    let out = forkd()
        .args(["run", "--image", "nosuch", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nosuch"));

    let out = forkd()
        .args(["run", "--accel", "hvf", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("auto, kvm or tcg"));

    // Environment knobs with a bad value: refused at start, before anything runs.
    for (var, refusal) in [
        ("FORKD_TCG_TB_MIB", "FORKD_TCG_TB_MIB=\"lots\": must be"),
        (
            "FORKD_VM_SCHED",
            "FORKD_VM_SCHED=\"lots\": must be batch or normal",
        ),
    ] {
        let out = forkd()
            .env(var, "lots")
            .args(["run", "--", "true"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}: {stderr}");
        assert!(stderr.contains(refusal), "{stderr}");
    }
}

#[test]
fn doctor_reports_every_check() {
    let out = forkd().args(["doctor", "--json"]).output().unwrap();
    let checks: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("doctor --json prints JSON");
    let names: Vec<&str> = checks
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    for n in [
        "qemu",
        "accel",
        "debootstrap",
        "mkfs.ext4",
        "cgroups",
        "data dir",
        "isolation",
        "disk",
    ] {
        assert!(names.contains(&n), "missing check {n}: {names:?}");
    }
    // On this kind of host (no vmx/svm) KVM must not be chosen, and doctor says why.
    let accel = checks
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "accel")
        .unwrap();
    let cpu_has_vt = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap()
        .split_whitespace()
        .any(|f| f == "vmx" || f == "svm");
    if !cpu_has_vt {
        assert_eq!(accel["level"], "warn");
        assert!(accel["detail"].as_str().unwrap().contains("vmx"));
    }
}

/// Runs `cmd` with `args`; returns (exit code, stdout, stderr).
fn run_in(mut cmd: Command, args: &[&str]) -> (Option<i32>, String, String) {
    let out = cmd.args(args).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

/// The whole workflow through a daemon: build a template, fork children, use them from
/// other forkd processes, and remove the snapshot only once they are gone.
#[test]
fn template_fork_exec_ls_kill_rmi() {
    let d = common::Daemon::start(&[]);
    let run = |args: &[&str]| run_in(d.forkd(), args);
    let tag = "cli-mini";
    let (code, _, err) = run(&["template", "build", "minimal", "--tag", tag]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("froze the parent"), "progress is shown: {err}");

    let (code, out, _) = run(&["snapshots", "--json"]);
    assert_eq!(code, Some(0));
    let snaps = json(&out);
    let mine = snaps
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["tag"] == tag)
        .expect("the new snapshot is listed");
    assert_eq!(mine["status"], "ok");

    // Building the same tag again is refused, and names the tag.
    let (code, _, err) = run(&["template", "build", "minimal", "--tag", tag]);
    assert_eq!(code, Some(1));
    assert!(err.contains(tag) && err.contains("409"), "{err}");

    let (code, out, err) = run(&[
        "fork", "--tag", tag, "-n", "2", "--label", "who=cli", "--json",
    ]);
    assert_eq!(code, Some(0), "{err}");
    let ids: Vec<String> = json(&out)
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), 2);

    // The children outlived `forkd fork`; each answers from a new process, with the
    // command's output streamed and its exit code passed on.
    for (i, id) in ids.iter().enumerate() {
        let (code, out, err) = run(&[
            "exec",
            id,
            "--shell",
            "--",
            &format!("echo {i} > /f; cat /f; exit 4"),
        ]);
        assert_eq!(code, Some(4), "{err}");
        assert_eq!(out.trim(), i.to_string());
    }
    let (code, out, _) = run(&["exec", &ids[0], "--json", "--", "cat", "/f"]);
    assert_eq!(code, Some(0));
    // --json prints the API's result: the output as base64 of its bytes.
    assert_eq!(json(&out)["stdout_b64"], "MAo=");

    let (code, out, _) = run(&["ls", "--json", "--label", "who=cli"]);
    assert_eq!(code, Some(0));
    let listed = json(&out);
    assert_eq!(listed.as_array().unwrap().len(), 2, "{out}");
    for id in &ids {
        let row = listed
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["id"] == id.as_str())
            .unwrap_or_else(|| panic!("{id} is listed: {out}"));
        assert_eq!(row["status"], "running");
        assert_eq!(row["snapshot"], tag);
    }

    // The fork's events, as JSON lines.
    let (code, out, err) = run(&["events", "--json", "--sandbox", &ids[0]]);
    assert_eq!(code, Some(0), "{err}");
    let kinds: Vec<String> = out
        .lines()
        .map(|l| json(l)["type"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kinds, ["created", "started"], "{out}");

    // A background process, listed, and ended by a signal given by name.
    let (code, out, err) = run(&["process", "start", &ids[1], "--", "sleep", "600"]);
    assert_eq!(code, Some(0), "{err}");
    let n = out.trim().to_owned();
    let number: u64 = n.parse().expect("a process number");
    let (code, out, _) = run(&["process", "ls", &ids[1]]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("running") && out.contains("sleep 600"),
        "{out}"
    );
    let (code, _, err) = run(&["process", "signal", &ids[1], &n, "SIGNOPE"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("SIGNOPE") && err.contains("400"), "{err}");
    let (code, _, err) = run(&["process", "signal", &ids[1], &n, "int", "--process-only"]);
    assert_eq!(code, Some(0), "{err}");
    let ended = (0..100).find_map(|_| {
        let (_, out, _) = run(&["process", "ls", &ids[1], "--json"]);
        let v = json(&out);
        let p = v.as_array()?.iter().find(|p| p["id"] == number)?.clone();
        if p["running"] == false {
            return Some(p);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        None
    });
    assert_eq!(ended.expect("the process ended")["signal"], 2);

    // The snapshot is in use: rmi is refused and names a child.
    let (code, _, err) = run(&["rmi", tag]);
    assert_eq!(code, Some(1));
    assert!(err.contains("in use") && err.contains(&ids[0]), "{err}");

    let (code, out, err) = run(&["kill", &ids[0], &ids[1], "--json"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        json(&out)
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["status"] == "stopped"),
        "{out}"
    );
    let (code, _, err) = run(&["exec", &ids[0], "--", "true"]);
    assert_eq!(code, Some(1));
    assert!(err.contains(&ids[0]), "{err}");

    // A damaged snapshot (a truncated part) is refused before any child starts.
    let state = d.home.path().join("snapshots").join(tag).join("state.bin");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&state)
        .unwrap()
        .set_len(100)
        .unwrap();
    let (code, _, err) = run(&["fork", "--tag", tag]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("damaged") && err.contains("state.bin is 100 bytes"),
        "{err}"
    );
    let (_, out, _) = run(&["ls", "--json"]);
    assert_eq!(
        json(&out).as_array().unwrap().len(),
        0,
        "no child of the damaged snapshot: {out}"
    );
    let (code, _, err) = run(&["snapshot", "verify", tag]);
    assert_eq!(code, Some(1));
    assert!(err.contains("state.bin"), "{err}");

    let (code, _, err) = run(&["rmi", tag]);
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = run(&["fork", "--tag", tag]);
    assert_eq!(code, Some(1));
    assert!(err.contains(&format!("no snapshot {tag}")), "{err}");
}

#[test]
fn bad_tags_and_ids_are_refused_clearly() {
    let d = common::Daemon::start(&[]);
    let run = |args: &[&str]| run_in(d.forkd(), args);
    for bad in ["../x", "a/b", ""] {
        let (code, _, err) = run(&["fork", "--tag", bad]);
        assert_eq!(code, Some(1), "{bad}: {err}");
        assert!(err.contains("invalid snapshot tag"), "{bad}: {err}");
    }
    let long = "x".repeat(300);
    let (code, _, err) = run(&["rmi", &long]);
    assert_eq!(code, Some(1));
    assert!(err.contains("invalid snapshot tag"), "{err}");
    let (code, _, err) = run(&["exec", "sb-../../etc", "--", "true"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no sandbox"), "{err}");
    let (code, _, err) = run(&["fork", "--tag", "nosuchtag"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no snapshot nosuchtag"), "{err}");
    for n in ["0", "100000"] {
        let (code, _, err) = run(&["fork", "--tag", "nosuchtag", "-n", n]);
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains(n) && err.contains("1..=256"), "{err}");
    }
    // With no daemon at all, the message says how to start one.
    let (code, _, err) = run_in(
        {
            let mut c = Command::new(env!("CARGO_BIN_EXE_forkd"));
            c.env("FORKD_HOME", d.home.path().join("elsewhere"));
            c
        },
        &["ls"],
    );
    assert_eq!(code, Some(1));
    assert!(
        err.contains("no forkd daemon answers") && err.contains("forkd daemon"),
        "{err}"
    );
}
