//! Process output is bytes, not text: what a command writes reaches the API's client and
//! the CLI's stdout byte for byte (random bytes, multibyte characters cut anywhere by the
//! stream), background processes keep their output as bytes, requests too large for the
//! agent protocol are refused with a 4xx and stay on record, and the record of a fork
//! names its children. One daemon, one `minimal` template and one child for the whole
//! file: VMs are slow under TCG.

mod common;

use common::{b64, call, runtime, Daemon};
use forkd_daemon::client::{Client, ExecLine, Lines};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

fn sha256_hex(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

async fn exec(c: &Client, id: &str, body: Value) -> Value {
    let (s, v) = call(
        c,
        Method::POST,
        &format!("/v1/sandboxes/{id}/exec"),
        Some(body),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

/// A streamed exec: the pieces of stdout and of stderr as they came, and the exit code.
async fn exec_streamed(c: &Client, id: &str, mut body: Value) -> (Vec<Vec<u8>>, Vec<Vec<u8>>, i32) {
    body["stream"] = true.into();
    let resp = c
        .send(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(serde_json::to_vec(&body).unwrap()),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut lines = Lines::new(resp);
    let (mut out, mut err) = (Vec::new(), Vec::new());
    while let Some(line) = lines.next_exec().await.unwrap() {
        match line {
            ExecLine::Stdout(b) => out.push(b),
            ExecLine::Stderr(b) => err.push(b),
            ExecLine::Exit(code) => {
                assert!(
                    lines.next().await.unwrap().is_none(),
                    "exit is the last line"
                );
                return (out, err, code);
            }
            ExecLine::Error(m) => panic!("the streamed exec failed: {m}"),
        }
    }
    panic!("the stream ended without an exit line")
}

async fn process(
    c: &Client,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    call(c, method, path, body).await
}

/// Background processes through the API: output kept as bytes, the exit code and signal
/// of how each ended, waits that time out while it runs, signals, kills, and a 4xx for
/// each bad request.
async fn background_processes_keep_bytes_exits_and_signals(c: &Client, id: &str) {
    let base = format!("/v1/sandboxes/{id}/processes");
    let (s, p) = process(
        c,
        Method::POST,
        &base,
        Some(json!({"shell": "printf '\\377\\000ok'; echo err >&2; exit 3"})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{p}");
    let n = p["id"].as_u64().unwrap();
    let (s, done) = process(c, Method::POST, &format!("{base}/{n}/wait"), None).await;
    assert_eq!(s, StatusCode::OK, "{done}");
    assert_eq!(
        (&done["running"], &done["exit_code"], &done["signal"]),
        (&json!(false), &json!(3), &json!(null)),
        "{done}"
    );
    assert_eq!(b64(&done["stdout_b64"]), b"\xff\0ok");
    assert_eq!(b64(&done["stderr_b64"]), b"err\n");

    // A long one: a wait that times out finds it running; SIGTERM ends it.
    let (s, p) = process(
        c,
        Method::POST,
        &base,
        Some(json!({"cmd": ["sleep", "600"]})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{p}");
    let n = p["id"].as_u64().unwrap();
    let (_, list) = process(c, Method::GET, &base, None).await;
    assert!(
        list.as_array()
            .unwrap()
            .iter()
            .any(|p| p["id"] == n && p["running"] == true),
        "{list}"
    );
    let (s, still) = process(
        c,
        Method::POST,
        &format!("{base}/{n}/wait?timeout_s=0.2"),
        None,
    )
    .await;
    assert_eq!(
        (s, &still["running"]),
        (StatusCode::OK, &json!(true)),
        "{still}"
    );
    let (s, v) = process(
        c,
        Method::POST,
        &format!("{base}/{n}/signal"),
        Some(json!({"signal": 15})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (_, ended) = process(c, Method::POST, &format!("{base}/{n}/wait"), None).await;
    assert_eq!(
        (&ended["running"], &ended["signal"], &ended["exit_code"]),
        (&json!(false), &json!(15), &json!(143)),
        "{ended}"
    );

    // Killed and forgotten.
    let (_, p) = process(
        c,
        Method::POST,
        &base,
        Some(json!({"cmd": ["sleep", "600"]})),
    )
    .await;
    let n = p["id"].as_u64().unwrap();
    let (s, killed) = process(c, Method::DELETE, &format!("{base}/{n}"), None).await;
    assert_eq!(
        (s, &killed["running"]),
        (StatusCode::OK, &json!(false)),
        "{killed}"
    );
    let (s, v) = process(c, Method::GET, &format!("{base}/{n}"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");

    for (method, path, body, want) in [
        (
            Method::POST,
            base.clone(),
            Some(json!({})),
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            base.clone(),
            Some(json!({"cmd": ["true"], "stdin": "x"})),
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::GET,
            format!("{base}/abc"),
            None,
            StatusCode::NOT_FOUND,
        ),
        (
            Method::GET,
            format!("{base}/999999"),
            None,
            StatusCode::NOT_FOUND,
        ),
        (
            Method::POST,
            format!("{base}/1/signal"),
            Some(json!({"signal": 0})),
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::POST,
            format!("{base}/1/wait?timeout_s=-1"),
            None,
            StatusCode::BAD_REQUEST,
        ),
        (
            Method::GET,
            "/v1/sandboxes/sb-000000000000/processes".to_owned(),
            None,
            StatusCode::NOT_FOUND,
        ),
    ] {
        let (s, v) = process(c, method, &path, body.clone()).await;
        assert_eq!(s, want, "{path} {body:?}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
    }
}

#[test]
fn exec_output_is_bytes_and_oversized_requests_are_refused_on_record() {
    let d = Daemon::start(&[]);
    let rt = runtime();
    let (id, want) = rt.block_on(async {
        let c = d.unix();
        d.link_snapshot("minimal", "mini");

        // A fork's record names the child it made (its path names none).
        let (s, v) = call(
            &c,
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"snapshot": "mini"})),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let id = v["sandboxes"][0]["id"].as_str().unwrap().to_owned();
        let records = d.audit_records();
        let fork = records
            .iter()
            .rev()
            .find(|r| r["method"] == "POST" && r["path"] == "/v1/sandboxes")
            .expect("the fork is audited");
        assert_eq!(
            (&fork["status"], &fork["ids"]),
            (&json!(201), &json!([id])),
            "{fork}"
        );

        // 5 MB of random bytes, hashed in the guest.
        let v = exec(
            &c,
            &id,
            json!({"shell": "head -c 5000000 /dev/urandom > /tmp/r && sha256sum /tmp/r"}),
        )
        .await;
        let line = String::from_utf8(b64(&v["stdout_b64"])).unwrap();
        let want = line.split_whitespace().next().unwrap().to_owned();
        assert_eq!(want.len(), 64, "{line}");

        // One JSON result: the bytes, exactly.
        let v = exec(&c, &id, json!({"cmd": ["cat", "/tmp/r"]})).await;
        assert_eq!(
            (&v["exit_code"], &v["truncated"]),
            (&json!(0), &json!(false))
        );
        let got = b64(&v["stdout_b64"]);
        assert_eq!((got.len(), sha256_hex(&got)), (5_000_000, want.clone()));
        assert!(b64(&v["stderr_b64"]).is_empty());

        // The same on stderr, with the exit code.
        let v = exec(&c, &id, json!({"shell": "cat /tmp/r >&2; exit 3"})).await;
        assert_eq!(v["exit_code"], 3);
        assert_eq!(sha256_hex(&b64(&v["stderr_b64"])), want);
        assert!(b64(&v["stdout_b64"]).is_empty());

        // Streamed: the pieces joined are the bytes.
        let (out, err, code) = exec_streamed(&c, &id, json!({"cmd": ["cat", "/tmp/r"]})).await;
        assert_eq!((code, err.len()), (0, 0));
        assert!(out.len() > 1, "5 MB come in more than one piece");
        assert_eq!(sha256_hex(&out.concat()), want);

        // Multibyte characters (3 and 4 bytes) cut anywhere by the stream come back whole.
        let unit = "€😀";
        let v = exec(
            &c,
            &id,
            json!({"shell": "printf '\\342\\202\\254\\360\\237\\230\\200' > /tmp/u && \
                for i in $(seq 19); do cat /tmp/u /tmp/u > /tmp/v && mv /tmp/v /tmp/u; done"}),
        )
        .await;
        assert_eq!(v["exit_code"], 0, "{v}");
        let (out, _, code) = exec_streamed(&c, &id, json!({"cmd": ["cat", "/tmp/u"]})).await;
        assert_eq!(code, 0);
        // Pieces are cut at the guest's read sizes (powers of two) and the unit is 7
        // bytes: some piece ends inside a character, so per-piece text decoding would
        // have damaged it.
        assert!(
            out.iter().any(|p| std::str::from_utf8(p).is_err()),
            "no piece was cut inside a character: the test proves nothing"
        );
        let joined = String::from_utf8(out.concat()).expect("the joined stream is UTF-8");
        assert!(
            joined == unit.repeat(1 << 19),
            "the characters came back changed"
        );

        // A command line over the agent protocol's frame limit, in a body under the HTTP
        // limit: 413 naming the limit, and the sandbox is unharmed.
        let max_body = forkd_daemon::api::MAX_JSON_BODY;
        let limit = forkd_proto::frame::MAX_PAYLOAD;
        let shell = format!("true {}", "x".repeat(max_body - 64));
        let bodies = [
            json!({ "shell": shell }),
            json!({ "cmd": ["true"], "env": { "BIG": "y".repeat(max_body - 64) } }),
        ];
        for body in bodies {
            assert!(serde_json::to_vec(&body).unwrap().len() <= max_body);
            let (s, v) = call(
                &c,
                Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(body),
            )
            .await;
            assert_eq!(
                (s, v["error"]["code"].as_str()),
                (StatusCode::PAYLOAD_TOO_LARGE, Some("too_large")),
                "{v}"
            );
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(
                msg.contains(&limit.to_string()) && msg.contains("agent protocol"),
                "{msg}"
            );
        }
        let refused: Vec<Value> = d
            .audit_records()
            .into_iter()
            .filter(|r| r["path"] == format!("/v1/sandboxes/{id}/exec") && r["status"] == 413)
            .collect();
        assert_eq!(refused.len(), 2, "both refusals are on record: {refused:?}");
        assert!(refused
            .iter()
            .all(|r| r["ids"] == json!([id]) && r["method"] == "POST"));
        let v = exec(&c, &id, json!({"cmd": ["echo", "still here"]})).await;
        assert_eq!(b64(&v["stdout_b64"]), b"still here\n");

        // Bytes in: stdin_b64 reaches the command as given; stdin is UTF-8 text.
        let v = exec(
            &c,
            &id,
            json!({"cmd": ["sha256sum"], "stdin_b64": v["stdout_b64"]}),
        )
        .await;
        let line = String::from_utf8(b64(&v["stdout_b64"])).unwrap();
        assert!(line.starts_with(&sha256_hex(b"still here\n")), "{line}");
        let v = exec(&c, &id, json!({"cmd": ["od", "-An", "-tx1"], "stdin": "é"})).await;
        assert_eq!(
            String::from_utf8(b64(&v["stdout_b64"])).unwrap().trim(),
            "c3 a9"
        );
        let (s, v) = call(
            &c,
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": ["cat"], "stdin_b64": "not base64!"})),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("stdin_b64"),
            "{v}"
        );
        background_processes_keep_bytes_exits_and_signals(&c, &id).await;

        (id, want)
    });

    // The CLI writes the command's bytes to its own stdout and stderr and exits with its
    // code.
    let url = format!("unix:{}", d.socket().display());
    let out = d
        .forkd()
        .env("FORKD_URL", &url)
        .args(["exec", &id, "--", "cat", "/tmp/r"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        (out.stdout.len(), sha256_hex(&out.stdout)),
        (5_000_000, want.clone())
    );
    let out = d
        .forkd()
        .env("FORKD_URL", &url)
        .args(["exec", &id, "--shell", "--", "cat /tmp/r >&2; exit 3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(out.stdout.is_empty());
    assert_eq!(sha256_hex(&out.stderr), want);

    // What is piped into `forkd exec` is the command's stdin, byte for byte; with
    // --no-stdin the command reads /dev/null; more than exec passes on is refused.
    let piped = |args: &[&str], input: Vec<u8>| {
        use std::io::Write;
        let mut child = d
            .forkd()
            .env("FORKD_URL", &url)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        // Written from a thread: a refused input is not read to its end.
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(&input);
        });
        let out = child.wait_with_output().unwrap();
        writer.join().unwrap();
        out
    };
    let input: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let out = piped(&["exec", &id, "--", "sha256sum"], input.clone());
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(&sha256_hex(&input)));
    let out = piped(&["exec", &id, "--no-stdin", "--", "wc", "-c"], input);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0");
    let out = piped(&["exec", &id, "--", "wc", "-c"], vec![b'x'; 800 << 10]);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--no-stdin"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
