//! The clients agents use, each against the same real daemon and `python` template
//! (built once: a template build costs tens of seconds under TCG): the Python SDK's
//! pytest suite, the TypeScript SDK's node:test suite after `npm ci && npm run build`,
//! `forkd mcp` driven by the official MCP Python client over stdio, the examples of the
//! README, the SDKs' READMEs and docs/mcp.md, run as a reader would, and E2B's own
//! SDKs (Python and JavaScript) against the daemon's E2B listener, by URL and by host
//! name over TLS.

mod common;

use common::Daemon;
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
    // The status too: a client that printed its last line and still failed (a signal,
    // an error at interpreter exit) says nothing else.
    assert!(
        out.status.success(),
        "{program} {args:?} ({}):\n{report}",
        out.status
    );
    report
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

/// The fenced code blocks of the markdown file `doc` in language `lang`, in order.
fn code_blocks(doc: &str, lang: &str) -> Vec<String> {
    let text = std::fs::read_to_string(repo(doc)).unwrap();
    let fence = format!("```{lang}\n");
    let blocks: Vec<String> = text
        .split(&fence)
        .skip(1)
        .map(|rest| rest.split("```").next().unwrap().to_owned())
        .collect();
    assert!(!blocks.is_empty(), "{doc} has no {lang} example");
    blocks
}

/// Runs each Python example of `doc`; returns their output.
fn run_python_examples(doc: &str, python: &str, env: &[(&str, String)]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    code_blocks(doc, "python")
        .iter()
        .enumerate()
        .map(|(i, code)| {
            let file = format!("example{i}.py");
            std::fs::write(dir.path().join(&file), code).unwrap();
            run(dir.path(), python, &[&file], env)
        })
        .collect()
}

#[test]
fn the_sdks_and_the_mcp_server_work_against_a_real_daemon() {
    // The TypeScript SDK is built first: no VM waits on npm.
    let ts = repo("sdk/typescript");
    if !ts.join("node_modules").exists() {
        run(&ts, "npm", &["ci", "--no-audit", "--no-fund"], &[]);
    }
    run(&ts, "npm", &["run", "build"], &[]);

    // On TCP too, with a token, for MCP over streamable HTTP.
    let token = "mcp-test-token-0123456789abcdef0123456789";
    let token_dir = tempfile::tempdir().unwrap();
    let token_file = token_dir.path().join("token");
    common::write_secret(&token_file, token);
    let port = common::free_port();
    let e2b_port = common::free_port();
    let mut d = Daemon::start(&[
        "--listen",
        &port,
        "--token-file",
        token_file.to_str().unwrap(),
        "--e2b-listen",
        &e2b_port,
    ]);
    // Tagged as `python` does it by default, so that the README's example runs as is.
    d.link_snapshot("python", "python");
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

    // The examples, as a reader would run them.
    let readme = run_python_examples("README.md", &python, &py_env);
    assert_eq!(
        readme[0].lines().filter(|l| *l == "3").count(),
        3,
        "{readme:?}"
    );
    let sdk = run_python_examples("sdk/python/README.md", &python, &py_env);
    assert!(sdk[0].contains("<table"), "{sdk:?}");
    assert!(sdk[0].lines().filter(|l| *l == "2").count() == 3, "{sdk:?}");
    // sum(range(i)) for the ten rollouts.
    assert!(
        sdk[1].contains("'0', '0', '1', '3'") && sdk[1].contains("'36']"),
        "{sdk:?}"
    );
    assert_eq!(sdk[2], "hello ada\nhello alan\n", "{sdk:?}");

    // TypeScript: the README's examples type-checked against the built package (which
    // they import by its name) and run.
    let examples = tempfile::Builder::new()
        .prefix(".doc-examples")
        .tempdir_in(&ts)
        .unwrap();
    let blocks = code_blocks("sdk/typescript/README.md", "ts");
    for (i, code) in blocks.iter().enumerate() {
        std::fs::write(examples.path().join(format!("example{i}.ts")), code).unwrap();
    }
    std::fs::write(
        examples.path().join("tsconfig.json"),
        r#"{"extends": "../tsconfig.json", "compilerOptions": {"rootDir": ".", "outDir": "out", "declaration": false}, "include": ["*.ts"]}"#,
    )
    .unwrap();
    let tsc = ts.join("node_modules/typescript/bin/tsc");
    run(
        examples.path(),
        "node",
        &[tsc.to_str().unwrap(), "-p", "."],
        &[],
    );
    for i in 0..blocks.len() {
        let report = run(
            examples.path(),
            "node",
            &[&format!("out/example{i}.js")],
            &env,
        );
        assert!(report.contains("<table"), "{report}");
    }

    let report = run(&ts, "node", &["--test", "test/"], &env);
    assert!(
        report.contains("# pass 11") && report.contains("# skipped 0"),
        "{report}"
    );

    // MCP: the official client starts `forkd mcp` itself, from the first configuration
    // docs/mcp.md gives (`forkd` found on PATH). The second, for a daemon on TCP, needs
    // a host and token of the reader's; it names the same server.
    let configs = code_blocks("docs/mcp.md", "json");
    let tcp: serde_json::Value = serde_json::from_str(&configs[1]).unwrap();
    assert_eq!(tcp["mcpServers"]["forkd"]["args"][0], "mcp");
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_forkd")).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut mcp_env = env.to_vec();
    mcp_env.push(("FORKD_MCP_CONFIG", configs[0].clone()));
    mcp_env.push(("PATH", path));
    mcp_env.push(("FORKD_MCP_HTTP_URL", format!("http://{port}/mcp")));
    mcp_env.push(("FORKD_MCP_TOKEN", token.to_owned()));
    let dir = repo("crates/forkd/tests/clients");
    let report = run(&dir, &python, &["mcp_client.py"], &mcp_env);
    assert!(report.lines().any(|l| l == "ok"), "{report}\n{}", d.log());

    // E2B's own SDKs, pointed at the daemon's E2B listener by their variables alone;
    // the API key is the daemon's token.
    let e2b_url = format!("http://{e2b_port}");
    let mut e2b_env = env.to_vec();
    e2b_env.push(("E2B_API_URL", e2b_url.clone()));
    e2b_env.push(("E2B_SANDBOX_URL", e2b_url));
    e2b_env.push(("E2B_API_KEY", token.to_owned()));
    // faulthandler: a crash at the interpreter's exit (seen once, SIGABRT after `ok`)
    // says where it happened.
    let report = run(
        &dir,
        &python,
        &["-X", "faulthandler", "e2b_flow.py"],
        &e2b_env,
    );
    assert!(report.lines().any(|l| l == "ok"), "{report}\n{}", d.log());
    // The JavaScript SDKs honour the same variables.
    let js = dir.join("e2b-js");
    run(&js, "npm", &["ci", "--no-audit", "--no-fund"], &[]);
    let report = run(&js, "node", &["flow.mjs"], &e2b_env);
    assert!(report.lines().any(|l| l == "ok"), "{report}\n{}", d.log());

    // Without E2B_SANDBOX_URL the SDKs reach https://<port>-<id>.<domain>: the daemon
    // restarted with a wildcard certificate and a domain, its E2B listener on port 443
    // of a loopback address of its own. The names resolve through a hosts file that the
    // flow extends as sandboxes are made, bind-mounted over /etc/hosts in a mount
    // namespace of the flow's own.
    let tls = tempfile::tempdir().unwrap();
    let (domain, addr) = ("e2b.test", "127.0.0.2");
    let certified =
        rcgen::generate_simple_self_signed(vec![domain.to_owned(), format!("*.{domain}")]).unwrap();
    let (cert, key, hosts) = (
        tls.path().join("cert.pem"),
        tls.path().join("key.pem"),
        tls.path().join("hosts"),
    );
    std::fs::write(&cert, certified.cert.pem()).unwrap();
    std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
    std::fs::write(&hosts, format!("127.0.0.1 localhost\n{addr} {domain}\n")).unwrap();
    let listen = format!("{addr}:443");
    d.restart(&[
        "--token-file",
        token_file.to_str().unwrap(),
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
        "--e2b-listen",
        &listen,
        "--e2b-domain",
        domain,
    ]);
    let tls_env = [
        ("E2B_API_URL", format!("https://{domain}")),
        ("E2B_API_KEY", token.to_owned()),
        ("NODE_EXTRA_CA_CERTS", cert.display().to_string()),
        ("FORKD_HOSTS", hosts.display().to_string()),
        ("FORKD_E2B_ADDR", addr.to_owned()),
        ("FORKD_E2B_DOMAIN", domain.to_owned()),
        ("FORKD_TEST_SNAPSHOT", "python".to_owned()),
    ];
    let report = run(
        &js,
        "unshare",
        &[
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            r#"mount --bind "$FORKD_HOSTS" /etc/hosts && exec node flow_tls.mjs"#,
        ],
        &tls_env,
    );
    assert!(report.lines().any(|l| l == "ok"), "{report}\n{}", d.log());
}
