//! Foreground exec against the real agent.

mod common;

use common::{channel_body, full, read_exec, read_until_stdout, Agent};
use forkd_proto::exec::{Command, ExecEvent, ExecRequest};
use forkd_proto::frame::{self, Decoder, Tag};
use forkd_proto::{ErrorBody, ErrorCode, PingResponse};
use hyper::{Method, StatusCode};
use std::time::Duration;

fn shell(s: &str) -> ExecRequest {
    ExecRequest::new(Command::Shell(s.into()))
}

#[tokio::test]
async fn ping_answers() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let (status, ping): (_, PingResponse) = c.json(Method::GET, "/v1/ping", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ping.protocol, forkd_proto::PROTOCOL_VERSION);
    assert_eq!(ping.agent_version, forkd_proto::AGENT_VERSION);
    assert!(ping.uptime_ms > 0);
    assert!(!ping.hostname.is_empty());

    let (status, err): (_, ErrorBody) = c.json(Method::GET, "/v1/nope", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(err.error.code, ErrorCode::NotFound);
}

#[tokio::test]
async fn echo_hello() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let out = c
        .exec(
            &ExecRequest::new(Command::Argv(vec!["echo".into(), "hello".into()])),
            b"",
        )
        .await;
    assert!(out.pid.is_some());
    assert_eq!(out.stdout, b"hello\n");
    assert!(out.stderr.is_empty());
    let exit = out.exit();
    assert_eq!(exit.code, Some(0));
    assert!(exit.success());
    assert_eq!(out.after_last, 0);
}

#[tokio::test]
async fn exit_code_stderr_env_cwd_and_stdin() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let dir = agent.dir.path().canonicalize().expect("canonical dir");
    let mut req = shell("cat; echo oops >&2; echo \"$FOO $HOME\"; pwd; exit 3");
    req.env.insert("FOO".into(), "bar".into());
    req.cwd = Some(dir.to_string_lossy().into_owned());
    req.stdin = true;
    let out = c.exec(&req, b"line one\nline two\n").await;
    let expected = format!("line one\nline two\nbar /root\n{}\n", dir.display());
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    assert_eq!(out.stderr, b"oops\n");
    let exit = out.exit();
    assert_eq!(exit.code, Some(3));
    assert_eq!(exit.shell_code(), 3);
    assert!(!exit.timed_out);
}

#[tokio::test]
async fn stdin_streams_while_the_command_runs() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let mut req = shell("while read l; do echo \"got $l\"; done");
    req.stdin = true;
    let (tx, body) = channel_body();
    tx.send(frame::encode_json(&req).unwrap())
        .await
        .expect("send header");
    let resp = c.exec_start(body).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut dec = Decoder::new();
    let mut stdout = Vec::new();
    // Each line must come back before the next is sent: stdin is not buffered to the end.
    for i in 0..3 {
        tx.send(frame::encode(Tag::Stdin, format!("{i}\n").as_bytes()).unwrap())
            .await
            .expect("send stdin");
        let want = format!("got {i}\n");
        read_until_stdout(&mut body, &mut dec, &mut stdout, |s| {
            String::from_utf8_lossy(s).ends_with(&want)
        })
        .await;
    }
    drop(tx); // end of body: stdin closes, the loop ends
    let rest = read_exec(body).await;
    assert_eq!(rest.exit().code, Some(0));
}

#[tokio::test]
async fn ten_mib_of_output_arrives_complete_and_in_order() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let out = c.exec(&shell("seq 1 1600000; seq 1 20000 >&2"), b"").await;
    let expected: String = (1..=1_600_000).map(|i| format!("{i}\n")).collect();
    assert!(expected.len() > 10 << 20);
    assert_eq!(out.stdout.len(), expected.len());
    assert!(out.stdout == expected.as_bytes(), "stdout differs");
    let expected_err: String = (1..=20_000).map(|i| format!("{i}\n")).collect();
    assert!(out.stderr == expected_err.as_bytes(), "stderr differs");
    assert_eq!(out.exit().code, Some(0));
}

#[tokio::test]
async fn timeout_kills_the_group() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let mut req = shell("sleep 30 & sleep 30; echo never");
    req.timeout_ms = Some(300);
    let started = std::time::Instant::now();
    let out = c.exec(&req, b"").await;
    let exit = out.exit();
    assert!(exit.timed_out);
    assert_eq!(exit.signal, Some(9));
    assert_eq!(exit.code, None);
    assert!(out.stdout.is_empty());
    // The background sleep held stdout too: the exit came because the group died.
    assert!(started.elapsed() < Duration::from_secs(20));

    // stdout already closed when the timeout strikes, stderr still open.
    let mut req = shell("exec >/dev/null; sleep 30");
    req.timeout_ms = Some(200);
    let exit = c.exec(&req, b"").await.exit();
    assert!(exit.timed_out);
    assert_eq!(exit.signal, Some(9));
}

#[tokio::test]
async fn spawn_failures_are_error_events() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;

    let out = c
        .exec(
            &ExecRequest::new(Command::Argv(vec!["/nonexistent/prog".into()])),
            b"",
        )
        .await;
    match out.last {
        Some(ExecEvent::Error(d)) => {
            assert_eq!(d.code, ErrorCode::SpawnFailed);
            assert!(d.message.contains("/nonexistent/prog"), "{}", d.message);
        }
        other => panic!("expected an error event, got {other:?}"),
    }
    assert_eq!(out.pid, None);

    let mut req = shell("true");
    req.cwd = Some("/nonexistent/dir".into());
    match c.exec(&req, b"").await.last {
        Some(ExecEvent::Error(d)) => {
            assert_eq!(d.code, ErrorCode::NotFound);
            assert!(d.message.contains("/nonexistent/dir"), "{}", d.message);
        }
        other => panic!("expected an error event, got {other:?}"),
    }

    let out = c.exec(&ExecRequest::new(Command::Argv(vec![])), b"").await;
    assert!(
        matches!(out.last, Some(ExecEvent::Error(ref d)) if d.code == ErrorCode::InvalidArgument)
    );
}

#[tokio::test]
async fn malformed_headers_are_400() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    for body in [
        frame::encode(Tag::Json, b"{not json").unwrap().to_vec(),
        frame::encode(Tag::Stdin, b"hi").unwrap().to_vec(),
        vec![9, 0, 0, 0, 0],
        Vec::new(),
    ] {
        let (status, bytes) = c.call(Method::POST, "/v1/exec", full(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let err: ErrorBody = serde_json::from_slice(&bytes).expect("error body");
        assert_eq!(err.error.code, ErrorCode::InvalidArgument);
    }
}

#[tokio::test]
async fn a_host_that_goes_away_kills_the_command() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let (tx, body) = channel_body();
    tx.send(frame::encode_json(&shell("sleep 1000 & echo $!; wait")).unwrap())
        .await
        .expect("header");
    let resp = c.exec_start(body).await;
    let mut body = resp.into_body();
    let mut dec = Decoder::new();
    let mut stdout = Vec::new();
    read_until_stdout(&mut body, &mut dec, &mut stdout, |s| s.ends_with(b"\n")).await;
    let pid: i32 = String::from_utf8_lossy(&stdout)
        .trim()
        .parse()
        .expect("pid");
    assert!(alive(pid));
    drop(body);
    drop(tx);
    drop(c);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        assert!(
            std::time::Instant::now() < deadline,
            "sleep {pid} survived its host"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// True while `pid` runs (a zombie counts as dead).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// A command run as a user gets its uid, gid and environment; a user the system lacks
/// is refused before anything runs. (The agent reads the host's /etc/passwd here, which
/// has `nobody` everywhere.)
#[tokio::test]
async fn commands_run_as_the_user_asked() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let mut req = shell("echo $(id -u) $(id -G) $USER $LOGNAME $HOME; pwd");
    req.user = Some("nobody".into());
    req.cwd = Some("/".into());
    let out = c.exec(&req, b"").await;
    assert_eq!(
        out.exit().code,
        Some(0),
        "{:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "65534 65534 nobody nobody /nonexistent\n/\n"
    );

    // Without a cwd, the home directory (which `nobody` lacks).
    req.cwd = None;
    match c.exec(&req, b"").await.last {
        Some(ExecEvent::Error(d)) => {
            assert_eq!(d.code, ErrorCode::NotFound);
            assert!(d.message.contains("/nonexistent"), "{}", d.message);
        }
        other => panic!("expected an error event, got {other:?}"),
    }

    req.user = Some("no-such-user-here".into());
    match c.exec(&req, b"").await.last {
        Some(ExecEvent::Error(d)) => {
            assert_eq!(d.code, ErrorCode::NotFound);
            assert!(d.message.contains("no-such-user-here"), "{}", d.message);
        }
        other => panic!("expected an error event, got {other:?}"),
    }
}
