//! The TypeScript SDK (sdk/typescript) against a real daemon: one daemon and one
//! `python` template, then its node:test suite with `FORKD_URL` aimed at the daemon's
//! socket. The SDK is built with its pinned TypeScript (`npm ci`, which ./dev test runs).

mod common;

use common::{build_snapshot, runtime, Daemon};
use std::path::Path;
use std::process::Command;

fn run(dir: &Path, program: &str, args: &[&str], env: &[(&str, String)]) -> String {
    let out = Command::new(program)
        .current_dir(dir)
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env_remove("FORKD_TOKEN")
        .output()
        .unwrap_or_else(|e| {
            panic!("running {program} {args:?} (./dev test installs Node and npm): {e}")
        });
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{program} {args:?}:\n{report}");
    report
}

#[test]
fn the_typescript_sdk_passes_its_tests_against_a_real_daemon() {
    let sdk = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sdk/typescript");
    if !sdk.join("node_modules").exists() {
        run(&sdk, "npm", &["ci", "--no-audit", "--no-fund"], &[]);
    }
    run(&sdk, "npm", &["run", "build"], &[]);
    let d = Daemon::start(&[]);
    runtime().block_on(async {
        build_snapshot(&d.unix(), "python", "py").await;
    });
    let report = run(
        &sdk,
        "node",
        &["--test", "test/"],
        &[
            ("FORKD_URL", format!("unix:{}", d.socket().display())),
            ("FORKD_TEST_SNAPSHOT", "py".to_owned()),
        ],
    );
    assert!(
        report.contains("# pass 6") && report.contains("# skipped 0"),
        "{report}\n{}",
        d.log()
    );
}
