//! The `forkd` command line, run as a user would run it.

use std::process::Command;

fn forkd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_forkd"))
}

fn sandboxes_left() -> Vec<String> {
    let home = forkd_image::Home::from_env();
    match std::fs::read_dir(home.run_dir().join("sandboxes")) {
        Ok(d) => d
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    }
}

#[test]
fn run_streams_output_and_exits_with_the_commands_code() {
    let before = sandboxes_left();

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

    let out = forkd()
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

    // Nothing of either sandbox is left behind.
    assert_eq!(sandboxes_left(), before);
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
