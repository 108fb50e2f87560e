//! `forkd mcp` driven by the official MCP Python client (the `mcp` package) over stdio,
//! against a real daemon with the `python` template: tools listed, sandboxes created,
//! commands and code run, files written and read, a branch forked, errors reported as
//! tool errors.

mod common;

use common::{build_snapshot, runtime, Daemon};
use std::process::Command;

#[test]
fn an_mcp_client_drives_sandboxes_through_forkd_mcp() {
    let d = Daemon::start(&[]);
    runtime().block_on(async {
        build_snapshot(&d.unix(), "python", "py").await;
    });
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mcp/client.py");
    let python = std::env::var("FORKD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .arg(&script)
        .env("FORKD_BIN", env!("CARGO_BIN_EXE_forkd"))
        .env("FORKD_URL", format!("unix:{}", d.socket().display()))
        .env("FORKD_TEST_SNAPSHOT", "py")
        .env_remove("FORKD_TOKEN")
        .output()
        .unwrap_or_else(|e| panic!("running {python} (./dev test installs the mcp package): {e}"));
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && report.lines().any(|l| l == "ok"),
        "{report}\n{}",
        d.log()
    );
}
