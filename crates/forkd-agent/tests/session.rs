//! Session handling: the handshake, garbage, reconnects and a stale session.

mod common;

use common::{handshake_on, nonce, read_ready, Agent, Client};
use forkd_proto::handshake::hello;
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
    s.write_all(&hello(&n)).await.expect("hello");
    let rest = read_ready(&mut s, &n).await;
    let mut c = Client::over(Rewind::new(rest, s)).await;
    ping(&mut c).await;
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
