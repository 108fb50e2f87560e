//! Background processes against the real agent.

mod common;

use common::Agent;
use forkd_proto::exec::{Command, ExecRequest, ProcessInfo};
use forkd_proto::{ErrorBody, ErrorCode};
use hyper::{Method, StatusCode};
use serde_json::json;

fn shell(s: &str) -> serde_json::Value {
    serde_json::to_value(ExecRequest::new(Command::Shell(s.into()))).expect("json")
}

#[tokio::test]
async fn start_list_wait_signal_and_kill() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;

    let (status, quick): (_, ProcessInfo) = c
        .json(
            Method::POST,
            "/v1/processes",
            Some(shell("echo out; echo err >&2")),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, done): (_, ProcessInfo) = c
        .json(
            Method::POST,
            &format!("/v1/processes/{}/wait", quick.id),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(done.exit.map(|e| e.code), Some(Some(0)));
    assert_eq!(done.stdout, b"out\n");
    assert_eq!(done.stderr, b"err\n");

    let (_, sleeper): (_, ProcessInfo) = c
        .json(
            Method::POST,
            "/v1/processes",
            Some(shell("echo started; exec sleep 30")),
        )
        .await;
    assert_eq!(sleeper.argv[0], "/bin/sh");
    assert!(sleeper.exit.is_none());

    // A wait that times out leaves it running.
    let (status, waited): (_, ProcessInfo) = c
        .json(
            Method::POST,
            &format!("/v1/processes/{}/wait?timeout_ms=100", sleeper.id),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(waited.exit.is_none());

    let (_, all): (_, Vec<ProcessInfo>) = c.json(Method::GET, "/v1/processes", None).await;
    let ids: Vec<u64> = all.iter().map(|p| p.id).collect();
    assert_eq!(ids, vec![quick.id, sleeper.id]);

    let (status, _): (_, ProcessInfo) = c
        .json(
            Method::POST,
            &format!("/v1/processes/{}/signal", sleeper.id),
            Some(json!({"signal": 15})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (_, ended): (_, ProcessInfo) = c
        .json(
            Method::POST,
            &format!("/v1/processes/{}/wait", sleeper.id),
            None,
        )
        .await;
    let exit = ended.exit.expect("ended");
    assert_eq!(exit.signal, Some(15));
    assert_eq!(ended.stdout, b"started\n");

    let (_, victim): (_, ProcessInfo) = c
        .json(Method::POST, "/v1/processes", Some(shell("sleep 30")))
        .await;
    let (status, killed): (_, ProcessInfo) = c
        .json(
            Method::DELETE,
            &format!("/v1/processes/{}", victim.id),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(killed.exit.and_then(|e| e.signal), Some(9));
    let (status, err): (_, ErrorBody) = c
        .json(Method::GET, &format!("/v1/processes/{}", victim.id), None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(err.error.code, ErrorCode::NotFound);

    let (status, _): (_, ErrorBody) = c.json(Method::POST, "/v1/processes/999/wait", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _): (_, ErrorBody) = c.json(Method::DELETE, "/v1/processes/abc", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, err): (_, ErrorBody) = c
        .json(
            Method::POST,
            &format!("/v1/processes/{}/signal", quick.id),
            Some(json!({"signal": 1000})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(err.error.code, ErrorCode::InvalidArgument);
}

#[tokio::test]
async fn output_keeps_the_tail_and_timeouts_apply() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    // 1.5 MiB of output: only the last 1 MiB is kept.
    let (_, p): (_, ProcessInfo) = c
        .json(
            Method::POST,
            "/v1/processes",
            Some(shell("head -c 1572864 /dev/zero | tr '\\0' a; printf END")),
        )
        .await;
    let (_, p): (_, ProcessInfo) = c
        .json(Method::POST, &format!("/v1/processes/{}/wait", p.id), None)
        .await;
    assert_eq!(p.stdout.len(), forkd_proto::exec::BACKGROUND_OUTPUT_LIMIT);
    assert!(p.stdout.ends_with(b"aaaEND"));

    let mut req = ExecRequest::new(Command::Argv(vec!["sleep".into(), "30".into()]));
    req.timeout_ms = Some(200);
    let (_, p): (_, ProcessInfo) = c
        .json(
            Method::POST,
            "/v1/processes",
            Some(serde_json::to_value(req).expect("json")),
        )
        .await;
    let (_, p): (_, ProcessInfo) = c
        .json(Method::POST, &format!("/v1/processes/{}/wait", p.id), None)
        .await;
    let exit = p.exit.expect("ended");
    assert!(exit.timed_out);
    assert_eq!(exit.signal, Some(9));

    // A program that does not exist is refused up front.
    let (status, err): (_, ErrorBody) = c
        .json(
            Method::POST,
            "/v1/processes",
            Some(json!({"command": {"argv": ["/nonexistent/prog"]}})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(err.error.code, ErrorCode::SpawnFailed);
    let (status, _): (_, ErrorBody) = c
        .json(Method::POST, "/v1/processes", Some(json!({"nope": 1})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn stdin_kept_open_is_written_in_order_and_closed() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let mut req = ExecRequest::new(Command::Shell(
        "while read -r line; do echo \"got $line\"; done; echo eof".into(),
    ));
    req.stdin = true;
    let (status, p): (_, ProcessInfo) = c
        .json(
            Method::POST,
            "/v1/processes",
            Some(serde_json::to_value(req).expect("json")),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(p.stdin_open);
    let stdin = format!("/v1/processes/{}/stdin", p.id);

    let (status, body) = c.call(Method::POST, &stdin, common::full("a\n")).await;
    assert_eq!(status, StatusCode::OK, "{body:?}");
    let (status, _) = c
        .call(Method::POST, &stdin, common::full(&b"b\xff\n"[..]))
        .await;
    assert_eq!(status, StatusCode::OK);
    // The last write closes it: the loop sees end of file and the process ends.
    let (status, body) = c
        .call(
            Method::POST,
            &format!("{stdin}?close=true"),
            common::full("c\n"),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let after: ProcessInfo = serde_json::from_slice(&body).expect("json");
    assert!(!after.stdin_open);
    let (_, done): (_, ProcessInfo) = c
        .json(Method::POST, &format!("/v1/processes/{}/wait", p.id), None)
        .await;
    assert_eq!(done.exit.map(|e| e.code), Some(Some(0)));
    assert_eq!(done.stdout, b"got a\ngot b\xff\ngot c\neof\n");

    // Closed stays closed; a process started without stdin has none to write.
    let (status, err): (_, ErrorBody) = c.json(Method::POST, &stdin, None).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(err.error.code, ErrorCode::StdinClosed);
    let (_, plain): (_, ProcessInfo) = c
        .json(Method::POST, "/v1/processes", Some(shell("sleep 30")))
        .await;
    assert!(!plain.stdin_open);
    let (status, err): (_, ErrorBody) = c
        .json(
            Method::POST,
            &format!("/v1/processes/{}/stdin", plain.id),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(
        err.error.message.contains("stdin: true"),
        "{}",
        err.error.message
    );
    let (status, _): (_, ErrorBody) = c.json(Method::POST, "/v1/processes/999/stdin", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn signals_by_pid_reach_a_process_or_its_group_and_never_pid_1() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let start = |cmd: &'static str| shell(cmd);
    let (_, alone): (_, ProcessInfo) = c
        .json(Method::POST, "/v1/processes", Some(start("exec sleep 30")))
        .await;
    let (_, group): (_, ProcessInfo) = c
        .json(
            Method::POST,
            "/v1/processes",
            Some(start("sleep 30; echo not reached")),
        )
        .await;
    for (p, signal, by_group) in [(&alone, 2, false), (&group, 15, true)] {
        let (status, _): (_, serde_json::Value) = c
            .json(
                Method::POST,
                "/v1/signal",
                Some(json!({"pid": p.pid, "signal": signal, "group": by_group})),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        let (_, ended): (_, ProcessInfo) = c
            .json(Method::POST, &format!("/v1/processes/{}/wait", p.id), None)
            .await;
        assert_eq!(ended.exit.and_then(|e| e.signal), Some(signal), "{ended:?}");
        assert!(ended.stdout.is_empty());
    }
    for (pid, want) in [
        (1, StatusCode::BAD_REQUEST),
        (0, StatusCode::BAD_REQUEST),
        (4_194_305, StatusCode::NOT_FOUND),
    ] {
        let (status, _): (_, ErrorBody) = c
            .json(
                Method::POST,
                "/v1/signal",
                Some(json!({"pid": pid, "signal": 15, "group": false})),
            )
            .await;
        assert_eq!(status, want, "pid {pid}");
    }
    let (status, _): (_, ErrorBody) = c
        .json(
            Method::POST,
            "/v1/signal",
            Some(json!({"pid": alone.pid, "signal": 1000})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}
