//! The daemon, run as a real process (`forkd daemon`) with its own data directory, driven
//! over its unix socket and over TCP: the API round trip, authentication, restart with
//! re-adoption, bad input, the capacity limit, metrics and the audit chain.

mod common;

use forkd_daemon::client::Client;
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const TOKEN: &str = "0123456789abcdef0123456789abcdef-test-token";

use common::{call, create, exec, free_port, runtime, Daemon};

/// create -> exec -> write and read a file -> run code -> delete, on one client.
async fn round_trip(c: &Client, tag: &str) {
    let id = create(c, tag, 1).await.remove(0);
    let v = exec(c, &id, "echo out; echo err >&2; exit 7").await;
    assert_eq!(
        (
            common::b64(&v["stdout_b64"]),
            common::b64(&v["stderr_b64"]),
            v["exit_code"].as_i64()
        ),
        (b"out\n".to_vec(), b"err\n".to_vec(), Some(7))
    );

    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let resp = c
        .send(
            Method::PUT,
            &format!("/v1/sandboxes/{id}/files?path=/data/blob.bin"),
            Some(payload.clone()),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let resp = c
        .send(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/data/blob.bin"),
            None,
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    use http_body_util::BodyExt;
    let got = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(got == payload, "the file comes back byte for byte");
    let (s, v) = call(
        c,
        Method::GET,
        &format!("/v1/sandboxes/{id}/files/stat?path=/data/blob.bin"),
        None,
    )
    .await;
    assert_eq!((s, v["size"].as_u64()), (StatusCode::OK, Some(200_000)));
    // A directory, also behind a symlink (/lib), is refused with a status; a symlink to
    // a file is followed.
    for dir in ["/data", "/lib"] {
        let path = format!("/v1/sandboxes/{id}/files?path={dir}");
        let (s, v) = call(c, Method::GET, &path, None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{dir}: {v}");
    }
    let path = format!("/v1/sandboxes/{id}/files?path=/etc/os-release");
    let resp = c.send(Method::GET, &path, None).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&text).contains("Debian"));

    let (s, v) = call(
        c,
        Method::POST,
        &format!("/v1/sandboxes/{id}/code"),
        Some(json!({"code": "x = 20\nx + 22"})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["results"][0]["text"], "42", "{v}");
    let (s, v) = call(
        c,
        Method::POST,
        &format!("/v1/sandboxes/{id}/code"),
        Some(json!({"code": "int(pd.Series([x, 1]).sum())"})),
    )
    .await;
    assert_eq!(
        (s, v["results"][0]["text"].as_str()),
        (StatusCode::OK, Some("21")),
        "{v}"
    );

    let (s, _) = call(c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v) = call(c, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
}

#[test]
fn api_round_trip_over_unix_socket_and_tcp_with_a_token() {
    let port = free_port();
    let home_probe = tempfile::tempdir().unwrap();
    let token_file = home_probe.path().join("token");
    common::write_secret(&token_file, &format!("{TOKEN}\n"));
    let d = Daemon::start(&[
        "--listen",
        &port,
        "--token-file",
        token_file.to_str().unwrap(),
    ]);
    runtime().block_on(async {
        let unix = d.unix();
        d.link_snapshot("python", "python");
        round_trip(&unix, "python").await;
        round_trip(&d.tcp(Some(TOKEN)), "python").await;

        // TCP without the token, or with a wrong one: 401, and nothing is created.
        for token in [None, Some("x".repeat(TOKEN.len()))] {
            let c = d.tcp(token.as_deref());
            let (s, v) = call(
                &c,
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"snapshot": "python"})),
            )
            .await;
            assert_eq!(
                (s, v["error"]["code"].as_str()),
                (StatusCode::UNAUTHORIZED, Some("unauthorized")),
                "{v}"
            );
            let (s, _) = call(&c, Method::GET, "/v1/sandboxes", None).await;
            assert_eq!(s, StatusCode::UNAUTHORIZED);
        }
        let (_, v) = call(&unix, Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(v["sandboxes"].as_array().unwrap().len(), 0, "{v}");

        // The metrics count what happened: two forks, the 404s of the deleted
        // sandboxes, and the four refused authentications.
        let (s, bytes) = unix.call(Method::GET, "/metrics", None).await.unwrap();
        assert_eq!(s, StatusCode::OK);
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        let metric = |name: &str| -> f64 {
            text.lines()
                .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
                .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
                .rsplit(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        assert_eq!(metric("forkd_forks_total"), 2.0);
        assert_eq!(metric("forkd_sandboxes_running"), 0.0);
        assert_eq!(metric("forkd_fork_seconds_count"), 2.0);
        assert!(metric("forkd_exec_seconds_count") >= 2.0);
        assert!(
            text.contains("forkd_errors_total{kind=\"not_found\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("forkd_errors_total{kind=\"unauthorized\"} 4"),
            "{text}"
        );
        assert!(
            text.trim_end().ends_with("# EOF"),
            "OpenMetrics text ends with # EOF"
        );
    });

    // Every mutating request is in the audit chain; editing one line breaks it.
    let audit = d.home.path().join("audit.jsonl");
    let verify = |p: &Path| {
        Command::new(env!("CARGO_BIN_EXE_forkd"))
            .args(["audit", "verify"])
            .arg(p)
            .output()
            .unwrap()
    };
    let out = verify(&audit);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&audit).unwrap();
    assert!(text.lines().count() >= 8, "{text}");
    assert!(text.contains("\"principal\":\"unix:uid="), "{text}");
    assert!(text.contains("\"principal\":\"tcp:127.0.0.1:"), "{text}");
    // Each mutating request is recorded before it ran (status 0) and with its outcome;
    // the refused POSTs are counted into an aggregate, not recorded one by one.
    let outcomes = text
        .lines()
        .filter(|l| l.contains("\"status\":201"))
        .count();
    let requests = text
        .lines()
        .filter(|l| l.contains("\"method\":\"POST\"") && l.contains("\"status\":0,"))
        .count();
    assert!(outcomes >= 1 && requests >= outcomes, "{text}");
    let records: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        !records
            .iter()
            .any(|r| r["method"] == "POST" && r["status"] == 401),
        "{text}"
    );
    let edited = text.replacen("\"status\":201", "\"status\":200", 1);
    assert_ne!(edited, text);
    std::fs::write(&audit, edited).unwrap();
    let out = verify(&audit);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("edited"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_restarted_daemon_adopts_live_sandboxes_and_keeps_dead_ones_failed() {
    let mut d = Daemon::start(&[]);
    let ids = runtime().block_on(async {
        let c = d.unix();
        d.link_snapshot("minimal", "mini");
        let ids = create(&c, "mini", 3).await;
        for (i, id) in ids.iter().enumerate() {
            exec(&c, id, &format!("echo {i} > /state")).await;
        }
        ids
    });
    d.kill9();
    // One VM dies while the daemon is down.
    let dead_dir = d.home.path().join("run/sandboxes").join(&ids[2]);
    // Its QEMU, as the daemon recorded it.
    let db = rusqlite::Connection::open_with_flags(
        d.home.path().join("forkd.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let pid: i32 = db
        .query_row("SELECT pid FROM sandboxes WHERE id = ?1", [&ids[2]], |r| {
            r.get(0)
        })
        .unwrap();
    drop(db);
    assert!(
        forkd_host::process::find_inside(&dead_dir)
            .iter()
            .any(|(p, _)| i64::from(*p) == i64::from(pid)),
        "pid {pid} is the QEMU of {}",
        ids[2]
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    while forkd_host::process::is_alive(pid.unsigned_abs()) {
        std::thread::sleep(Duration::from_millis(20));
    }
    d.spawn();
    runtime().block_on(async {
        let c = d.unix();
        let (_, v) = call(&c, Method::GET, "/v1/sandboxes?label=test=yes", None).await;
        let listed: Vec<&str> = v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap())
            .collect();
        assert_eq!(listed.len(), 3, "{v}");
        for (i, id) in ids[..2].iter().enumerate() {
            assert!(listed.contains(&id.as_str()));
            let v = exec(&c, id, "cat /state").await;
            assert_eq!(
                common::b64(&v["stdout_b64"]),
                format!("{i}\n").as_bytes(),
                "{id} kept its state"
            );
        }
        // The one whose VM died is failed, saying why, its disk kept until it is deleted.
        let (s, v) = call(&c, Method::GET, &format!("/v1/sandboxes/{}", ids[2]), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["status"], "failed", "{v}");
        assert!(
            v["error"].as_str().unwrap().contains("no longer running"),
            "{v}"
        );
        assert!(dead_dir.join("root.qcow2").exists());
        let (s, _) = call(
            &c,
            Method::POST,
            &format!("/v1/sandboxes/{}/exec", ids[2]),
            Some(serde_json::json!({"shell": "true"})),
        )
        .await;
        assert_eq!(s, StatusCode::CONFLICT);
        let (s, v) = call(
            &c,
            Method::DELETE,
            &format!("/v1/sandboxes/{}", ids[2]),
            None,
        )
        .await;
        assert!(s.is_success(), "{v}");
    });
    assert!(
        !dead_dir.exists(),
        "the dead sandbox's files went with its deletion"
    );
}

#[test]
fn bad_input_gets_a_clear_4xx_and_changes_nothing() {
    let d = Daemon::start(&[]);
    runtime().block_on(async {
        let c = d.unix();
        d.link_snapshot("minimal", "mini");
        let before = d.disk_state();
        let long = "x".repeat(300);
        for bad in ["../x", "a/b", "", long.as_str()] {
            let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(json!({"snapshot": bad}))).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
            assert!(v["error"]["message"].as_str().unwrap().contains("invalid snapshot tag"), "{v}");
            let (s, v) = call(&c, Method::POST, "/v1/snapshots", Some(json!({"template": "minimal", "tag": bad}))).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {v}");
        }
        for bad in ["..%2Fx", "a%2Fb", long.as_str()] {
            for m in [Method::GET, Method::DELETE] {
                let (s, v) = call(&c, m.clone(), &format!("/v1/snapshots/{bad}"), None).await;
                assert_eq!(s, StatusCode::BAD_REQUEST, "{m} {bad}: {v}");
            }
        }
        for n in [0, 100_000] {
            let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(json!({"snapshot": "mini", "n": n}))).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
            assert!(v["error"]["message"].as_str().unwrap().contains(&format!("n = {n}")), "{v}");
        }
        let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(json!({"snapshot": "mini", "memory_mib": 4096}))).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("memory_mib = 512"), "{v}");
        let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(json!({"snapshot": "nosuch"}))).await;
        assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")), "{v}");

        // Malformed JSON, a wrong field, an unknown sandbox, an unknown route.
        let resp = c.send(Method::POST, "/v1/sandboxes", Some(b"{\"snapshot\": ".to_vec())).await.unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
        let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(json!({"snapshot": "mini", "bogus": 1}))).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert!(v["error"]["message"].as_str().unwrap().contains("bogus"), "{v}");
        let (s, v) = call(&c, Method::POST, "/v1/sandboxes/sb-0000/exec", Some(json!({"shell": "true"}))).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("sb-0000"), "{v}");
        let (s, v) = call(&c, Method::GET, "/v1/nothing-here", None).await;
        assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));

        // Too large: a JSON body over 1 MiB, an upload that declares more than the limit.
        let big = json!({"snapshot": "x".repeat(2 << 20)});
        let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(big)).await;
        assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("too_large")), "{v}");
        let head = raw_request(
            &d.socket(),
            "PUT /v1/sandboxes/sb-0000/files?path=/x HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n",
        );
        assert!(head.starts_with("HTTP/1.1 413"), "{head}");

        assert_eq!(d.disk_state(), before, "refused requests change nothing on disk");

        // Timeouts: a sandbox created with one is stopped and removed once it passes; a
        // deadline can be cleared.
        let (s, v) = call(&c, Method::POST, "/v1/sandboxes", Some(json!({"snapshot": "mini", "n": 2, "timeout_s": 2}))).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let ids: Vec<String> = v["sandboxes"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap().to_owned()).collect();
        assert!(v["sandboxes"][0]["timeout_at"].as_i64().is_some(), "{v}");
        let (s, v) = call(&c, Method::PUT, &format!("/v1/sandboxes/{}/timeout", ids[1]), Some(json!({"timeout_s": null}))).await;
        assert_eq!((s, &v["timeout_at"]), (StatusCode::OK, &Value::Null), "{v}");
        let (s, _) = call(&c, Method::PUT, &format!("/v1/sandboxes/{}/timeout", ids[1]), Some(json!({"timeout_s": 0}))).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (s, _) = call(&c, Method::GET, &format!("/v1/sandboxes/{}", ids[0]), None).await;
            if s == StatusCode::NOT_FOUND {
                break;
            }
            assert!(Instant::now() < deadline, "the timed-out sandbox is still there");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(!d.home.path().join("run/sandboxes").join(&ids[0]).exists());
        let (s, _) = call(&c, Method::GET, &format!("/v1/sandboxes/{}", ids[1]), None).await;
        assert_eq!(s, StatusCode::OK, "the sandbox whose deadline was cleared runs on");
    });
}

/// The OpenAPI document says what each route takes: a method it lists is routed (never
/// 405, never "no such route"), and every other method answers 405. Ids are made up:
/// the handlers refuse them after routing, which is all this needs.
#[test]
fn the_openapi_document_lists_the_methods_each_route_takes() {
    let d = Daemon::start(&[]);
    runtime().block_on(async {
        let c = d.unix();
        let (s, doc) = call(&c, Method::GET, "/v1/openapi.json", None).await;
        assert_eq!(s, StatusCode::OK);
        let paths = doc["paths"].as_object().expect("paths");
        assert!(paths.len() > 30, "{}", paths.len());
        for (path, item) in paths {
            let concrete = path
                .replace("{id}", "sb-0000")
                .replace("{tag}", "nosuch")
                .replace("{port}", "8080")
                .replace("{process}", "1")
                .replace("{context}", "nosuch")
                .replace("{path}", "x")
                .replace("{name}", "nosuch");
            assert!(!concrete.contains('{'), "a parameter left in {path}");
            // The event stream would stay open: asked to end after the kept events.
            let concrete = if concrete == "/v1/events" {
                "/v1/events?follow=false".to_owned()
            } else {
                concrete
            };
            for m in [
                Method::GET,
                Method::POST,
                Method::PUT,
                Method::PATCH,
                Method::DELETE,
            ] {
                let listed = item.get(m.as_str().to_lowercase()).is_some();
                let (s, v) = call(&c, m.clone(), &concrete, None).await;
                let unrouted = s == StatusCode::METHOD_NOT_ALLOWED
                    || v["error"]["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("no such route"));
                assert_eq!(
                    listed, !unrouted,
                    "{m} {path}: listed {listed}, answered {s} {v}"
                );
            }
        }
    });
}

/// Sends a raw HTTP request head and returns what comes back first.
fn raw_request(socket: &Path, head: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn thirty_concurrent_creates_with_a_limit_of_ten() {
    let d = Daemon::start(&["--max-sandboxes", "10"]);
    runtime().block_on(async {
        let c = d.unix();
        d.link_snapshot("minimal", "mini");
        let results = futures::future::join_all((0..30).map(|_| {
            let c = c.clone();
            async move {
                call(
                    &c,
                    Method::POST,
                    "/v1/sandboxes",
                    Some(json!({"snapshot": "mini"})),
                )
                .await
            }
        }))
        .await;
        let created = results
            .iter()
            .filter(|(s, _)| *s == StatusCode::CREATED)
            .count();
        let refused: Vec<_> = results
            .iter()
            .filter(|(s, _)| *s == StatusCode::SERVICE_UNAVAILABLE)
            .collect();
        assert_eq!((created, refused.len()), (10, 20), "{results:?}");
        assert!(refused
            .iter()
            .all(|(_, v)| v["error"]["code"] == "at_capacity"
                && v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("limit is 10")));
        let (_, v) = call(&c, Method::GET, "/v1/sandboxes", None).await;
        let ids: Vec<String> = v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(ids.len(), 10);
        let (_, h) = call(&c, Method::GET, "/v1/health", None).await;
        assert_eq!(
            (h["sandboxes"].as_u64(), h["capacity"].as_u64()),
            (Some(10), Some(10))
        );
        for id in &ids {
            let (s, _) = call(&c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
            assert_eq!(s, StatusCode::NO_CONTENT);
        }
    });
    // Nothing leaked: no sandbox directory, and room for ten again.
    let left: Vec<_> = std::fs::read_dir(d.home.path().join("run/sandboxes"))
        .unwrap()
        .flatten()
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_public_address_without_a_token_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_forkd"))
        .args(["daemon", "--listen", "0.0.0.0:0", "--socket"])
        .arg(tempfile::tempdir().unwrap().path().join("s.sock"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to listen on 0.0.0.0:0 without a token"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    // Off loopback, a token is not enough: TLS too, unless plain text is asked for.
    let token = dir.path().join("token");
    common::write_secret(&token, TOKEN);
    let daemon = |args: &[&str], file: &std::path::Path| {
        let out = Command::new(env!("CARGO_BIN_EXE_forkd"))
            .arg("daemon")
            .args(args)
            .arg("--token-file")
            .arg(file)
            .arg("--socket")
            .arg(dir.path().join("s.sock"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = daemon(&["--listen", "0.0.0.0:0"], &token);
    assert!(
        err.contains("without TLS") && err.contains("--insecure-plaintext"),
        "{err}"
    );
    // A token file others can read is refused, whatever else is asked.
    let shared = dir.path().join("shared-token");
    std::fs::write(&shared, TOKEN).unwrap();
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let err = daemon(&["--listen", "127.0.0.1:0"], &shared);
    assert!(err.contains("lets other users read it"), "{err}");

    let short = dir.path().join("short-token");
    common::write_secret(&short, "too-short");
    let out = Command::new(env!("CARGO_BIN_EXE_forkd"))
        .args(["daemon", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(&short)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 32"));
}

/// schemathesis (from PyPI; `./dev test` installs it and names the Python that has it in
/// `FORKD_TEST_PYTHON`) fuzzes every operation of
/// /v1/openapi.json against a daemon that has a snapshot and a live sandbox: no answer
/// may be a 5xx or differ from the document (status, content type, headers, schema).
#[test]
fn schemathesis_finds_no_server_error_and_no_schema_violation() {
    let port = free_port();
    let d = Daemon::start(&["--listen", &port, "--max-sandboxes", "4"]);
    let id = runtime().block_on(async {
        let c = d.unix();
        d.link_snapshot("minimal", "mini");
        create(&c, "mini", 1).await.remove(0)
    });
    let dir = tempfile::tempdir().unwrap();
    // The fixtures must survive the run: their deletion is left out, and the ids that
    // path parameters take are the real ones. Creating sandboxes and building
    // snapshots are left out too: they start real VMs (creating answers 503 past the
    // limit by design, tested above); so is setting a timeout, which would stop the
    // fixture a second later (tested above). The port routes answer with whatever the
    // guest's server says (502 when nothing listens), which no document can describe
    // (tests/network.rs covers them). A watch that succeeds is a stream without an end,
    // which a checker waits on until it times out (tests/events.rs covers it).
    std::fs::write(
        dir.path().join("schemathesis.toml"),
        format!("[parameters]\n\"path.id\" = \"{id}\"\n\"path.tag\" = \"mini\"\n"),
    )
    .unwrap();
    // Through the interpreter, not a `schemathesis` script: pip's scripts directory is
    // not on every PATH (a pyenv shim appears only after a rehash).
    let python = std::env::var("FORKD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .current_dir(dir.path())
        .args(["-m", "schemathesis.cli", "run", &format!("http://{port}/v1/openapi.json")])
        .args([
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance",
            "--exclude-method",
            "DELETE",
            "--exclude-operation-id",
            "create",
            "--exclude-operation-id",
            "build",
            "--exclude-operation-id",
            "set_timeout",
            "--exclude-operation-id",
            "port_proxy",
            "--exclude-operation-id",
            "port_root",
            "--exclude-operation-id",
            "watch",
            "--max-examples",
            "15",
            "--workers",
            "1",
            "--seed",
            "1",
        ])
        .output()
        .unwrap_or_else(|e| panic!("running {python} -m schemathesis.cli (./dev test installs it): {e}"));
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{report}");
    assert!(
        report.contains("25 passed") || report.contains("passed"),
        "{report}"
    );
    // The sandbox was exercised, not only refused: some calls on it succeeded.
    let audit = std::fs::read_to_string(d.home.path().join("audit.jsonl")).unwrap();
    let ok_on_sandbox = audit
        .lines()
        .filter(|l| l.contains(&id) && l.contains("\"status\":20"))
        .count();
    assert!(ok_on_sandbox > 0, "no successful call on {id}:\n{report}");
}

/// TCP with TLS and a token: the CLI reaches the daemon through FORKD_URL, FORKD_CA and
/// FORKD_TOKEN; a client that does not trust the certificate gets no answer.
#[test]
fn tls_listener_with_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert, key, token) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("token"),
    );
    std::fs::write(&cert, certified.cert.pem()).unwrap();
    std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
    common::write_secret(&token, TOKEN);
    let port = free_port().rsplit_once(':').unwrap().1.to_owned();
    let listen = format!("127.0.0.1:{port}");
    let d = Daemon::start(&[
        "--listen",
        &listen,
        "--token-file",
        token.to_str().unwrap(),
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    let url = format!("https://localhost:{port}");
    let forkd = |token: &str, ca: &Path| {
        let out = d
            .forkd()
            .env("FORKD_URL", &url)
            .env("FORKD_CA", ca)
            .env("FORKD_TOKEN", token)
            .args(["snapshots", "--json"])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = forkd(TOKEN, &cert);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.trim(), "[]");
    let (code, _, err) = forkd("wrong-token-wrong-token-wrong-token", &cert);
    assert_eq!(code, Some(1));
    assert!(err.contains("401") && err.contains("not valid"), "{err}");
    // A CA that did not sign the daemon's certificate: the handshake fails.
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let other_ca = dir.path().join("other.pem");
    std::fs::write(&other_ca, other.cert.pem()).unwrap();
    let (code, _, err) = forkd(TOKEN, &other_ca);
    assert_eq!(code, Some(1));
    assert!(err.contains("TLS"), "{err}");
    // Plain HTTP on the TLS port gets nothing it could mistake for an answer.
    let plain = runtime().block_on(async {
        Client::new(
            forkd_daemon::client::Endpoint::Tcp(listen.clone()),
            Some(TOKEN.into()),
        )
        .call(Method::GET, "/v1/health", None)
        .await
    });
    assert!(plain.is_err(), "{plain:?}");
}

/// The README's main job from a data directory that holds only the cached guest
/// assets: no daemon, no snapshot. quickstart starts the daemon, builds the python
/// template through it, forks, runs pandas in every child and prints the timings.
#[test]
fn quickstart_from_an_empty_data_directory() {
    let shared = forkd_image::Home::from_env();
    let home = tempfile::Builder::new()
        .prefix("quickstart-test-")
        .tempdir_in(shared.tmp_dir())
        .unwrap();
    std::os::unix::fs::symlink(shared.images_dir(), home.path().join("images")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_forkd"))
        .env("FORKD_HOME", home.path())
        .env_remove("FORKD_URL")
        .args(["quickstart", "-n", "3"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    // Whatever happened, stop the daemon it started and every VM of this directory.
    let daemon = Daemon::adopt(home);
    assert!(out.status.success(), "{stdout}\n{stderr}\n{}", daemon.log());
    for step in [
        "daemon started in the background",
        "python template: boot, import pandas, freeze",
        "fork 3 children, all answering",
        "run a pandas cell in each of 3",
        "total",
    ] {
        assert!(stdout.contains(step), "missing {step:?} in:\n{stdout}");
    }
    assert_eq!(
        stdout.matches("1000 rows -> 499500.0").count(),
        3,
        "{stdout}"
    );
    assert!(stderr.contains("froze the parent"), "{stderr}");
}

/// A field of `/proc/PID/status` in KiB (`VmRSS`, `VmHWM`).
fn proc_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in {status}"))
}

fn console_bytes(dir: &Path) -> u64 {
    ["console.log", "console.log.1"]
        .iter()
        .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
        .map(|m| m.len())
        .sum()
}

#[test]
fn a_guest_flooding_console_and_stdout_leaves_the_daemon_small() {
    const CONSOLE_CAP: u64 = 64 << 10;
    const STDOUT: u64 = 256 << 20;
    const CONSOLE: u64 = 2 << 20;
    let mut d = Daemon::start_with_env(&[], &[("FORKD_CONSOLE_CAP", "64K")]);
    let (id, dir) = runtime().block_on(async {
        let c = d.unix();
        d.link_snapshot("minimal", "mini");
        let id = create(&c, "mini", 1).await.remove(0);
        (id.clone(), d.home.path().join("run/sandboxes").join(&id))
    });
    let before = proc_kib(d.pid(), "VmRSS");
    let pid = d.pid();
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(before));
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        std::thread::spawn(move || {
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak.fetch_max(proc_kib(pid, "VmRSS"), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let streamed = runtime().block_on(async {
        let c = d.unix();
        // The console flood runs alongside the stdout flood; both end before the exit.
        let shell = format!(
            "head -c {CONSOLE} /dev/urandom | base64 > /dev/ttyS0 & \
             head -c {STDOUT} /dev/zero; wait; echo flood-ended > /dev/ttyS0"
        );
        let resp = common::start_streamed_exec(&c, &id, &shell).await;
        // Read and drop: the daemon must pass the output on, not hold it.
        let mut body = resp.into_body();
        let mut n = 0u64;
        while let Some(f) = http_body_util::BodyExt::frame(&mut body).await {
            if let Ok(data) = f.unwrap().into_data() {
                n += data.len() as u64;
            }
        }
        n
    });
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    sampler.join().unwrap();
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    assert!(streamed > STDOUT, "only {streamed} bytes streamed");
    eprintln!(
        "daemon VmRSS {before} KiB before, {peak} KiB at most while {streamed} bytes streamed"
    );
    // The daemon's resident memory grew by far less than what passed through it.
    let grown = peak.saturating_sub(before) * 1024;
    assert!(
        grown < STDOUT / 4,
        "the daemon grew by {grown} bytes (from {before} KiB to {peak} KiB)"
    );
    // The console files stay within their cap, and the end of the flood is in them.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(dir.join("console.log"))
        .unwrap_or_default()
        .contains("flood-ended")
    {
        assert!(Instant::now() < deadline, "the console marker never landed");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        console_bytes(&dir) <= CONSOLE_CAP,
        "{}",
        console_bytes(&dir)
    );

    // A restarted daemon re-adopts the VM and reads its console again.
    d.kill9();
    d.spawn();
    runtime().block_on(async {
        let c = d.unix();
        exec(&c, &id, "echo after-restart > /dev/ttyS0").await;
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(dir.join("console.log"))
        .unwrap_or_default()
        .contains("after-restart")
    {
        assert!(
            Instant::now() < deadline,
            "the console is not read after the restart"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        console_bytes(&dir) <= CONSOLE_CAP,
        "{}",
        console_bytes(&dir)
    );
}

/// `cmd` run as the unprivileged user `nobody`: whether it succeeded, and its stderr.
fn as_nobody(cmd: &[&str]) -> (bool, String) {
    let out = Command::new("runuser")
        .args(["-u", "nobody", "--"])
        .args(cmd)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The data directory is closed to other users whatever modes it had (its database and
/// audit log 0600, the socket 0660), `--socket` never replaces what is not a socket, and
/// a TCP client whose tokens keep failing is answered 429 without filling the audit log.
#[test]
fn the_data_directory_is_closed_to_others_and_failed_tokens_are_rate_limited() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let home = tempfile::tempdir().unwrap();
    let root = home.path().to_owned();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
    let set =
        |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    // As a permissive umask would have left them.
    set(&root, 0o755);
    for f in ["forkd.db", "audit.jsonl"] {
        std::fs::write(root.join(f), b"").unwrap();
        set(&root.join(f), 0o644);
    }
    let root_user = nix::unistd::geteuid().is_root();
    if root_user {
        // The probe below can succeed: another user reads the database as it was.
        let (ok, err) = as_nobody(&["cat", root.join("forkd.db").to_str().unwrap()]);
        assert!(ok, "{err}");
    }

    // A --socket that names a regular file is refused and the file kept.
    let precious = root.join("notes.txt");
    std::fs::write(&precious, "keep me").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_forkd"))
        .args(["daemon", "--socket"])
        .arg(&precious)
        .env("FORKD_HOME", &root)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is not a socket; refusing to replace it"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "keep me");

    let token = root.join("token");
    common::write_secret(&token, TOKEN);
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_forkd"))
        .args(["daemon", "--listen", &port, "--token-file"])
        .arg(&token)
        .env("FORKD_HOME", &root)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let socket = root.join("forkd.sock");
    common::wait_until_serving(&socket, &mut child, 60).unwrap();
    assert_eq!(mode(&root), 0o700);
    assert_eq!(mode(&root.join("forkd.db")), 0o600);
    assert_eq!(mode(&root.join("audit.jsonl")), 0o600);
    assert_eq!(mode(&socket), 0o660);
    if root_user {
        let (ok, err) = as_nobody(&["cat", root.join("forkd.db").to_str().unwrap()]);
        assert!(!ok && err.contains("Permission denied"), "{err}");
        let connect = format!(
            "import socket; socket.socket(socket.AF_UNIX).connect({:?})",
            socket.to_str().unwrap()
        );
        let (ok, err) = as_nobody(&["python3", "-c", &connect]);
        assert!(!ok && err.contains("PermissionError"), "{err}");
    } else {
        eprintln!("not root: the probes as another user are left out");
    }

    runtime().block_on(async {
        let tcp = |t: &str| {
            Client::new(
                forkd_daemon::client::Endpoint::Tcp(port.clone()),
                Some(t.to_owned()),
            )
        };
        let audit_before = std::fs::metadata(root.join("audit.jsonl")).unwrap().len();
        let long = format!("/v1/sandboxes/{}", "x".repeat(60_000));
        let mut statuses = Vec::new();
        for _ in 0..40 {
            let (s, _) = call(
                &tcp("wrong-token-wrong-token-wrong-token"),
                Method::POST,
                &long,
                None,
            )
            .await;
            statuses.push(s.as_u16());
        }
        let refused = statuses.iter().filter(|s| **s == 401).count();
        let limited = statuses.iter().filter(|s| **s == 429).count();
        assert_eq!(refused + limited, 40, "{statuses:?}");
        // A burst of 20 failures, then 429s (the bucket refills 2 a second meanwhile).
        assert!(refused >= 20 && limited >= 10, "{statuses:?}");
        // No refusal is recorded one by one (they are counted into aggregates, written
        // each minute and at the stop).
        let text = std::fs::read_to_string(root.join("audit.jsonl")).unwrap();
        let after: Vec<Value> = text[usize::try_from(audit_before).unwrap()..]
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert!(
            !after
                .iter()
                .any(|r| r["status"] == 401 || r["status"] == 429),
            "a refusal was recorded one by one: {after:?}"
        );
        // A request that passes has its path cut short in its records.
        let (s, _) = call(&tcp(TOKEN), Method::POST, &long, None).await;
        assert!(s.is_client_error(), "{s}");
        let records: Vec<Value> = std::fs::read_to_string(root.join("audit.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let path = records.last().unwrap()["path"].as_str().unwrap();
        assert!(
            path.ends_with("...[60014 bytes]") && path.len() < 300,
            "{path}"
        );
        // While the address is blocked, a wrong token is turned away unseen; the right
        // one is let in.
        let mut blocked = false;
        for _ in 0..50 {
            let (s, _) = call(
                &tcp("wrong-token-wrong-token-wrong-token"),
                Method::POST,
                "/v1/sandboxes",
                None,
            )
            .await;
            if s == StatusCode::TOO_MANY_REQUESTS {
                blocked = true;
                break;
            }
        }
        assert!(blocked);
        let (s, v) = call(&tcp(TOKEN), Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
    });
    let _ = common::signal(child.id(), nix::sys::signal::Signal::SIGTERM);
    let _ = child.wait();
}
