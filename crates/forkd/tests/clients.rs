//! The clients agents use, each against the same real daemon and `python` template
//! (built once: a template build costs tens of seconds under TCG): the Python SDK's
//! pytest suite, the TypeScript SDK's node:test suite after `npm ci && npm run build`,
//! `forkd mcp` driven by the official MCP Python client over stdio, and the README's
//! Python example.

mod common;

use common::{build_snapshot, runtime, Daemon};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `program args` in `dir` with `env`; panics with its output unless it succeeds.
fn run(dir: &Path, program: &str, args: &[&str], env: &[(&str, String)]) -> String {
    let out = Command::new(program)
        .current_dir(dir)
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env_remove("FORKD_TOKEN")
        .output()
        .unwrap_or_else(|e| panic!("running {program} {args:?} (./dev test installs it): {e}"));
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{program} {args:?}:\n{report}");
    report
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

#[test]
fn the_sdks_and_the_mcp_server_work_against_a_real_daemon() {
    // The TypeScript SDK is built first: no VM waits on npm.
    let ts = repo("sdk/typescript");
    if !ts.join("node_modules").exists() {
        run(&ts, "npm", &["ci", "--no-audit", "--no-fund"], &[]);
    }
    run(&ts, "npm", &["run", "build"], &[]);

    let d = Daemon::start(&[]);
    runtime().block_on(async {
        // Tagged as `python` does it by default, so that the README's example runs as is.
        build_snapshot(&d.unix(), "python", "python").await;
    });
    let env = [
        ("FORKD_URL", format!("unix:{}", d.socket().display())),
        ("FORKD_TEST_SNAPSHOT", "python".to_owned()),
    ];
    let python = std::env::var("FORKD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());

    // Python: imported from its source tree.
    let py = repo("sdk/python");
    let mut py_env = env.to_vec();
    py_env.push(("PYTHONPATH", py.join("src").display().to_string()));
    py_env.push(("PYTHONDONTWRITEBYTECODE", "1".to_owned()));
    let report = run(
        &py,
        &python,
        &["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        &py_env,
    );
    assert!(
        report.contains(" passed") && !report.contains("skipped"),
        "{report}"
    );

    // The README's Python example, as a reader would run it.
    let readme = std::fs::read_to_string(repo("README.md")).unwrap();
    let example = readme
        .split("```python\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the README has a Python example");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("example.py"), example).unwrap();
    let report = run(dir.path(), &python, &["example.py"], &py_env);
    assert_eq!(report.lines().filter(|l| *l == "3").count(), 3, "{report}");

    // TypeScript.
    let report = run(&ts, "node", &["--test", "test/"], &env);
    assert!(
        report.contains("# pass 7") && report.contains("# skipped 0"),
        "{report}"
    );

    // MCP: the official client starts `forkd mcp` itself.
    let mut mcp_env = env.to_vec();
    mcp_env.push(("FORKD_BIN", env!("CARGO_BIN_EXE_forkd").to_owned()));
    let dir = repo("crates/forkd/tests/clients");
    let report = run(&dir, &python, &["mcp_client.py"], &mcp_env);
    assert!(report.lines().any(|l| l == "ok"), "{report}\n{}", d.log());
}
