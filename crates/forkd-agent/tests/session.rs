//! Session handling: the handshake, garbage, reconnects and a stale session.

mod common;

use common::{handshake_on, nonce, read_ready, read_ready_with, Agent, Client};
use forkd_proto::context::{ResumeOutcome, ResumeRequest};
use forkd_proto::exec::{Command, ExecRequest};
use forkd_proto::handshake::{hello, hello_with};
use forkd_proto::io::Rewind;
use forkd_proto::PingResponse;
use hyper::{Method, StatusCode};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

/// The client preface of HTTP/2 and an empty SETTINGS frame.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

async fn ping(c: &mut Client) {
    let (status, p): (_, PingResponse) = c.json(Method::GET, "/v1/ping", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(p.protocol, forkd_proto::PROTOCOL_VERSION);
}

#[tokio::test]
async fn garbage_before_the_greeting_is_ignored() {
    let agent = Agent::start().await;
    let mut garbage =
        b"\x00\xffFORKD-HELLO short\nFORKD-HELLO zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz\n".to_vec();
    garbage.extend((0..20_000u32).map(|i| (i % 251) as u8));
    garbage.extend_from_slice(b"FORKD-HEL");
    let mut c = agent.connect_after(&garbage).await;
    ping(&mut c).await;
}

#[tokio::test]
async fn a_second_connection_after_the_first_closes() {
    let agent = Agent::start().await;
    let mut first = agent.connect().await;
    ping(&mut first).await;
    drop(first);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut second = agent.connect().await;
    ping(&mut second).await;
    // And connections run side by side.
    let mut third = agent.connect().await;
    ping(&mut third).await;
    ping(&mut second).await;
}

/// A new greeting read by a session as HTTP/2 ends it, and is answered.
#[tokio::test]
async fn a_greeting_inside_a_session_starts_a_new_one() {
    let agent = Agent::start().await;
    let mut s = UnixStream::connect(&agent.socket).await.expect("connect");
    let _ = handshake_on(&mut s).await;
    s.write_all(PREFACE).await.expect("preface");
    let n = nonce();
    s.write_all(&hello(&n)).await.expect("hello");
    let rest = read_ready(&mut s, &n).await;
    let mut c = Client::over(Rewind::new(rest, s)).await;
    ping(&mut c).await;
}

/// A greeting that lands inside a frame the old session is still reading is answered
/// once the line has gone quiet.
#[tokio::test]
async fn a_greeting_inside_a_partial_frame_is_answered() {
    for with_body in [false, true] {
        let agent = Agent::start().await;
        let mut s = UnixStream::connect(&agent.socket).await.expect("connect");
        let _ = handshake_on(&mut s).await;
        s.write_all(PREFACE).await.expect("preface");
        // A frame (of a type HTTP/2 ignores) promising 1000 bytes of payload, and only 3.
        s.write_all(b"\x00\x03\xe8\xfa\x00\x00\x00\x00\x00abc")
            .await
            .expect("partial");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let n = nonce();
        let greeting = match with_body {
            // A resume hook that only sets the clock, which a dev agent leaves alone.
            true => hello_with(
                &n,
                br#"{"wall_clock_ns":0,"entropy_hex":"","hostname":"","continuing":true}"#,
            ),
            false => hello(&n),
        };
        s.write_all(&greeting).await.expect("hello");
        let (body, rest) = read_ready_with(&mut s, &n).await;
        assert_eq!(body.is_some(), with_body);
        let mut c = Client::over(Rewind::new(rest, s)).await;
        ping(&mut c).await;
    }
}

#[tokio::test]
async fn shutdown_ends_a_dev_agent() {
    let mut agent = Agent::start().await;
    let mut c = agent.connect().await;
    let (status, body): (_, serde_json::Value) = c
        .json(
            Method::POST,
            "/v1/shutdown",
            Some(serde_json::json!({"poweroff": true})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, serde_json::json!({}));
    let st = agent
        .wait_exit(Duration::from_secs(5))
        .expect("agent exited");
    assert!(st.success());
}

/// A greeting that carries the resume hook: answered with the hook's outcome once it has
/// run (its variables then reach commands), split across writes and after garbage; and
/// HTTP/2 follows on the same connection.
#[tokio::test]
async fn a_greeting_carries_the_resume_hook_and_its_answer_the_outcome() {
    let agent = Agent::start().await;
    let mut s = UnixStream::connect(&agent.socket).await.expect("connect");
    let req = ResumeRequest {
        wall_clock_ns: 0,
        entropy_hex: "00112233".into(),
        hostname: String::new(),
        env: [("FROM_GREETING".to_owned(), "yes".to_owned())].into(),
        settle: false,
        continuing: false,
    };
    let n = nonce();
    let greeting = hello_with(&n, &serde_json::to_vec(&req).expect("json"));
    s.write_all(b"\x00stale FORKD-HELLO")
        .await
        .expect("garbage");
    let (a, b) = greeting.split_at(greeting.len() / 2);
    s.write_all(a).await.expect("first half");
    tokio::time::sleep(Duration::from_millis(50)).await;
    s.write_all(b).await.expect("second half");
    let (body, rest) = read_ready_with(&mut s, &n).await;
    let outcome: ResumeOutcome =
        serde_json::from_slice(&body.expect("the answer carries the outcome")).expect("json");
    assert!(matches!(outcome, ResumeOutcome::Resumed(_)), "{outcome:?}");
    let mut c = Client::over(Rewind::new(rest, s)).await;
    ping(&mut c).await;
    let out = c
        .exec(
            &ExecRequest::new(Command::Shell("printf %s \"$FROM_GREETING\"".into())),
            b"",
        )
        .await;
    assert_eq!(out.stdout, b"yes");
}

/// A greeting whose body is no resume request is answered with the error, and the
/// session goes on.
#[tokio::test]
async fn a_bad_resume_request_in_a_greeting_is_answered_with_its_error() {
    let agent = Agent::start().await;
    let mut s = UnixStream::connect(&agent.socket).await.expect("connect");
    let n = nonce();
    s.write_all(&hello_with(&n, br#"{"entropy_hex": 3}"#))
        .await
        .expect("greeting");
    let (body, rest) = read_ready_with(&mut s, &n).await;
    let outcome: ResumeOutcome =
        serde_json::from_slice(&body.expect("the answer carries the outcome")).expect("json");
    match outcome {
        ResumeOutcome::Failed(e) => {
            assert_eq!(
                e.error.code,
                forkd_proto::ErrorCode::InvalidArgument,
                "{e:?}"
            )
        }
        other => panic!("{other:?}"),
    }
    let mut c = Client::over(Rewind::new(rest, s)).await;
    ping(&mut c).await;
}
