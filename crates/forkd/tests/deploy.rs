//! The deployment files under `deploy/`: the Kubernetes manifests parse as YAML (with
//! PyYAML, from `FORKD_TEST_PYTHON`) into the objects they should be, and every flag
//! they and the systemd unit give `forkd daemon` is one `forkd daemon --help` names.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The long options `forkd daemon --help` lists.
fn daemon_flags() -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_forkd"))
        .args(["daemon", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("--"))
        .map(|w| {
            w.trim_end_matches([',', '.'])
                .split(['=', ' '])
                .next()
                .unwrap()
                .to_owned()
        })
        .filter(|w| !w.is_empty())
        .collect()
}

/// The `--flag` names among `args`.
fn flags_of<'a>(args: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    args.into_iter()
        .filter_map(|a| a.strip_prefix("--"))
        .map(|a| a.split('=').next().unwrap().to_owned())
        .collect()
}

/// The `key` of every item of the array `v` (the items themselves with no `key`).
fn strings<'a>(v: &'a serde_json::Value, key: Option<&str>) -> Vec<&'a str> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| key.map_or(x, |k| &x[k]).as_str().unwrap())
        .collect()
}

fn assert_known(flags: &[String], known: &[String], file: &str) {
    assert!(!flags.is_empty(), "{file} gives forkd daemon no flags");
    for f in flags {
        assert!(
            known.contains(f),
            "{file}: --{f} is not an option of forkd daemon"
        );
    }
}

#[test]
fn the_kubernetes_manifests_parse_and_name_real_flags() {
    let python = std::env::var("FORKD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let file = repo().join("deploy/kubernetes/forkd.yaml");
    let out = Command::new(&python)
        .args([
            "-c",
            "import json, sys, yaml\nprint(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let docs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["Namespace", "ConfigMap", "DaemonSet"]);
    for d in &docs {
        assert!(
            d["apiVersion"].is_string() && d["metadata"]["name"] == "forkd",
            "{d}"
        );
    }
    let ds = &docs[2];
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(
        ds["spec"]["selector"]["matchLabels"],
        ds["spec"]["template"]["metadata"]["labels"]
    );
    let c = &pod["containers"][0];
    assert_eq!(c["securityContext"]["privileged"], true);
    let mounts = strings(&c["volumeMounts"], Some("name"));
    let volumes = strings(&pod["volumes"], Some("name"));
    assert!(
        mounts.iter().all(|m| volumes.contains(m)),
        "{mounts:?} {volumes:?}"
    );
    let kvm = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "kvm")
        .unwrap();
    assert_eq!(kvm["hostPath"]["path"], "/dev/kvm");
    // The env the arguments expand is defined.
    let env = strings(&c["env"], Some("name"));
    let args = strings(&c["args"], None);
    assert_eq!(args[0], "daemon");
    for a in &args {
        for var in a.split("$(").skip(1) {
            let var = var.split(')').next().unwrap();
            assert!(
                env.contains(&var),
                "{a} uses $({var}), which the container does not define"
            );
        }
    }
    assert_known(
        &flags_of(args),
        &daemon_flags(),
        "deploy/kubernetes/forkd.yaml",
    );
}

#[test]
fn the_systemd_unit_names_real_flags() {
    let unit = std::fs::read_to_string(repo().join("deploy/systemd/forkd.service")).unwrap();
    let exec = unit.replace("\\\n", " ");
    let line = exec
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("an ExecStart line");
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(&words[1], &"daemon", "{line}");
    assert_known(
        &flags_of(words),
        &daemon_flags(),
        "deploy/systemd/forkd.service",
    );
    // Every variable it expands is in the example environment file.
    let env = std::fs::read_to_string(repo().join("deploy/systemd/forkd.env.example")).unwrap();
    for var in line.split("${").skip(1) {
        let var = var.split('}').next().unwrap();
        assert!(
            env.lines().any(|l| l.starts_with(&format!("{var}="))),
            "forkd.service uses ${{{var}}}, which forkd.env.example does not set"
        );
    }
}
