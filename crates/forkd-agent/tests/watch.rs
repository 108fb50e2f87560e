//! File watches against the real agent: events in order, directories made later
//! watched too, and a storm that ends in an overflow event with bounded memory.

mod common;

use common::Agent;
use forkd_proto::files::{WatchEvent, WatchKind};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, StatusCode};
use std::time::Duration;

/// NDJSON lines of a watch's body.
struct Events {
    body: Incoming,
    buf: Vec<u8>,
}

impl Events {
    async fn next(&mut self) -> WatchEvent {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return serde_json::from_slice(&line).expect("an event");
            }
            let frame = tokio::time::timeout(Duration::from_secs(20), self.body.frame())
                .await
                .expect("an event within 20 s")
                .expect("the stream goes on")
                .expect("a frame");
            if let Ok(data) = frame.into_data() {
                self.buf.extend_from_slice(&data);
            }
        }
    }
}

async fn watch(c: &mut common::Client, dir: &std::path::Path, recursive: bool) -> Events {
    let path = format!("/v1/files/watch?{}&recursive={recursive}", common::q(dir));
    let resp = c.send(Method::GET, &path, common::empty()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    Events {
        body: resp.into_body(),
        buf: Vec::new(),
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

#[tokio::test]
async fn changes_come_in_order_and_new_directories_are_watched() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let dir = agent.dir.path().join("watched");
    std::fs::create_dir(&dir).unwrap();
    let mut events = watch(&mut c, &dir, true).await;
    let a = dir.join("a.txt");
    std::fs::write(&a, "one").unwrap();
    let b = dir.join("b.txt");
    std::fs::rename(&a, &b).unwrap();
    std::fs::remove_file(&b).unwrap();
    let sub = dir.join("sub");
    std::fs::create_dir(&sub).unwrap();
    // A directory made while watched is watched too (once its creation is seen).
    let mut got = Vec::new();
    while got.last() != Some(&(WatchKind::Create, sub.clone())) {
        let e = events.next().await;
        got.push((e.kind, std::path::PathBuf::from(e.path)));
    }
    assert_eq!(
        got,
        vec![
            (WatchKind::Create, a.clone()),
            (WatchKind::Write, a.clone()),
            (WatchKind::Rename, a.clone()),
            (WatchKind::Create, b.clone()),
            (WatchKind::Remove, b.clone()),
            (WatchKind::Create, sub.clone()),
        ]
    );
    let deep = sub.join("deep.txt");
    std::fs::write(&deep, "x").unwrap();
    let e = events.next().await;
    assert_eq!(
        (e.kind, e.path.as_str()),
        (WatchKind::Create, deep.to_str().unwrap())
    );

    // A path that is not there, or not a directory: refused before any stream.
    for (path, want) in [
        (dir.join("nope"), StatusCode::NOT_FOUND),
        (deep.clone(), StatusCode::BAD_REQUEST),
    ] {
        let p = format!("/v1/files/watch?{}", common::q(&path));
        let (status, _) = c.call(Method::GET, &p, common::empty()).await;
        assert_eq!(status, want, "{}", path.display());
    }
}

#[tokio::test]
async fn a_storm_ends_in_an_overflow_event_with_bounded_memory() {
    let agent = Agent::start().await;
    let mut c = agent.connect().await;
    let dir = agent.dir.path().join("storm");
    std::fs::create_dir(&dir).unwrap();
    let before = rss_kib(agent.pid());
    let mut events = watch(&mut c, &dir, false).await;
    // Nobody reads while 10,000 files are made.
    for i in 0..10_000 {
        std::fs::write(dir.join(format!("f{i}")), "x").unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown = rss_kib(agent.pid()).saturating_sub(before);
    assert!(grown <= 16 * 1024, "the agent grew {grown} KiB");
    let mut overflow = None;
    for _ in 0..20_000 {
        let e = events.next().await;
        if e.kind == WatchKind::Overflow {
            overflow = Some(e);
            break;
        }
    }
    let overflow = overflow.expect("an overflow event");
    assert!(overflow.dropped.unwrap_or(1) > 0, "{overflow:?}");
    // After it, events are exact again.
    let last = dir.join("after-the-storm");
    std::fs::write(&last, "y").unwrap();
    loop {
        let e = events.next().await;
        if e.path == last.to_str().unwrap() {
            assert_eq!(e.kind, WatchKind::Create);
            break;
        }
    }
}
