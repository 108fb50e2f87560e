//! The Python SDK (sdk/python) against a real daemon: one daemon and one `python`
//! template, then its pytest suite with `FORKD_URL` aimed at the daemon's socket.

mod common;

use common::{build_snapshot, runtime, Daemon};
use std::process::Command;

#[test]
fn the_python_sdk_passes_its_tests_against_a_real_daemon() {
    let d = Daemon::start(&[]);
    runtime().block_on(async {
        build_snapshot(&d.unix(), "python", "py").await;
    });
    let sdk = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sdk/python");
    // Through the interpreter the other tests use (./dev test installs httpx and pytest
    // for it); the package is imported from its source tree.
    let python = std::env::var("FORKD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .current_dir(&sdk)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"])
        .env("PYTHONPATH", sdk.join("src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("FORKD_URL", format!("unix:{}", d.socket().display()))
        .env("FORKD_TEST_SNAPSHOT", "py")
        .env_remove("FORKD_TOKEN")
        .output()
        .unwrap_or_else(|e| panic!("running {python} -m pytest (./dev test installs it): {e}"));
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{report}\n{}", d.log());
    assert!(
        report.contains(" passed") && !report.contains("skipped"),
        "{report}"
    );
}
