//! Lifecycle events through the daemon: streamed by `GET /v1/events` and resumed after
//! a disconnect without a loss, and delivered to webhooks (local receivers) signed and
//! retried, while a receiver that never answers holds nothing up.

mod common;

use common::{call, create, events_of, runtime, Daemon};
use forkd_daemon::client::Lines;
use hmac::{Hmac, Mac};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use sha2::Sha256;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One request a receiver took: its headers (lower-cased names) and body.
#[derive(Debug, Clone)]
struct Received {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Received {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// An HTTP receiver on a loopback port: answers each request with the next status of
/// `answers` (the last one repeated), or, with `hang`, never answers. Stops with the
/// runtime.
async fn receiver(answers: Vec<u16>, hang: bool) -> (String, Arc<Mutex<Vec<Received>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let got = Arc::new(Mutex::new(Vec::new()));
    let seen = got.clone();
    tokio::spawn(async move {
        let mut n = 0usize;
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let status = answers[n.min(answers.len() - 1)];
            n += 1;
            let seen = seen.clone();
            tokio::spawn(async move {
                let Some(r) = read_request(&mut s).await else {
                    return;
                };
                seen.lock().unwrap().push(r);
                if hang {
                    tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
                }
                let answer = format!(
                    "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                );
                let _ = s.write_all(answer.as_bytes()).await;
            });
        }
    });
    (url, got)
}

async fn read_request(s: &mut tokio::net::TcpStream) -> Option<Received> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let headers: Vec<(String, String)> = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < len {
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some(Received { headers, body })
}

/// The `data` of the next event of an SSE stream.
async fn next_event(lines: &mut Lines) -> Value {
    let mut data = String::new();
    loop {
        let line = lines
            .next_text()
            .await
            .unwrap()
            .expect("the stream goes on");
        if let Some(d) = line.strip_prefix("data:") {
            data.push_str(d.trim_start());
        } else if line.is_empty() && !data.is_empty() {
            return serde_json::from_str(&data).unwrap();
        }
    }
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

#[test]
fn events_stream_resume_and_reach_signed_webhooks_without_holding_up_a_fork() {
    let d = Daemon::start(&[]);
    d.link_snapshot("minimal", "mini");
    let rt = runtime();
    let c = d.unix();
    rt.block_on(async {
        // A receiver that fails twice before it takes events, and one that never
        // answers.
        let (url, got) = receiver(vec![500, 500, 200], false).await;
        let (stuck_url, stuck) = receiver(vec![200], true).await;
        let (s, hook) = call(
            &c,
            Method::POST,
            "/v1/webhooks",
            Some(json!({"url": url, "types": ["created", "started", "killed"]})),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{hook}");
        let secret = hook["secret"].as_str().unwrap().to_owned();
        let (s, v) = call(
            &c,
            Method::POST,
            "/v1/webhooks",
            Some(json!({"url": stuck_url})),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        for bad in [
            json!({"url": "ftp://x/"}),
            json!({"url": url, "types": ["exploded"]}),
        ] {
            let (s, v) = call(&c, Method::POST, "/v1/webhooks", Some(bad)).await;
            assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
        }
        let (_, listed) = call(&c, Method::GET, "/v1/webhooks", None).await;
        assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");
        assert!(
            listed[0].get("secret").is_none(),
            "the secret is shown once: {listed}"
        );

        // A follower sees the fork's first event, then goes away.
        let resp = c.send(Method::GET, "/v1/events", None).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let mut follower = Lines::new(resp);
        // The fork answers while a receiver hangs on its events.
        let id = create(&c, "mini", 1).await.remove(0);
        let first = next_event(&mut follower).await;
        assert_eq!(
            (first["type"].as_str(), first["sandbox"].as_str()),
            (Some("created"), Some(id.as_str()))
        );
        assert_eq!(first["labels"]["test"], "yes");
        drop(follower);
        let (s, _) = call(&c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);

        // Resumed from the last event it saw: nothing lost, nothing twice; filters.
        let after = first["id"].as_i64().unwrap();
        let rest = events_of(&c, &format!("after={after}&sandbox={id}")).await;
        assert_eq!(types(&rest), ["started", "killed"], "{rest:?}");
        let all = events_of(&c, &format!("sandbox={id}")).await;
        assert_eq!(types(&all), ["created", "started", "killed"]);
        let killed = events_of(&c, "type=killed&label=test%3Dyes").await;
        assert!(types(&killed).iter().all(|t| *t == "killed") && !killed.is_empty());

        // The same with the header an EventSource sends, from curl.
        let out = std::process::Command::new("curl")
            .args(["-sS", "--unix-socket"])
            .arg(d.socket())
            .args(["-H", &format!("Last-Event-ID: {after}")])
            .arg(format!("http://forkd/v1/events?follow=false&sandbox={id}"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        assert!(
            text.contains("event: started")
                && text.contains("event: killed")
                && !text.contains("event: created"),
            "{text}"
        );

        // The webhook got the three events, retried through its failures, signed.
        let hook_id = hook["id"].as_str().unwrap();
        let mut delivered = Vec::new();
        for _ in 0..300 {
            let (_, v) = call(&c, Method::GET, &format!("/v1/webhooks/{hook_id}"), None).await;
            delivered = v["deliveries"].as_array().unwrap().clone();
            let mine: Vec<&Value> = delivered
                .iter()
                .filter(|d| d["status"] == "delivered")
                .collect();
            if mine.len() >= 3 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let done: Vec<&Value> = delivered
            .iter()
            .filter(|d| d["status"] == "delivered")
            .collect();
        assert!(done.len() >= 3, "{delivered:?}");
        assert!(
            delivered.iter().any(|d| d["attempts"].as_u64() > Some(1)),
            "{delivered:?}"
        );
        let received = got.lock().unwrap().clone();
        let mut seen = Vec::new();
        for r in &received {
            let sig = r.header("forkd-signature").expect("signed");
            let (t, v1) = sig
                .strip_prefix("t=")
                .and_then(|s| s.split_once(",v1="))
                .expect("t=..,v1=..");
            let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
            mac.update(format!("{t}.").as_bytes());
            mac.update(&r.body);
            assert_eq!(
                v1,
                hex_of(&mac.finalize().into_bytes()),
                "the signature checks"
            );
            let e: Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(
                r.header("forkd-event-id"),
                Some(e["id"].to_string().as_str())
            );
            if e["sandbox"] == id.as_str() && !seen.contains(&e["id"]) {
                seen.push(e["id"].clone());
            }
        }
        assert_eq!(seen.len(), 3, "{received:?}");
        assert!(
            !stuck.lock().unwrap().is_empty(),
            "the stuck receiver was tried"
        );

        let (s, _) = call(&c, Method::DELETE, &format!("/v1/webhooks/{hook_id}"), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
        let (s, _) = call(&c, Method::DELETE, &format!("/v1/webhooks/{hook_id}"), None).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        let (s, v) = call(&c, Method::GET, "/v1/events?type=exploded", None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    });
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The next line of an NDJSON stream.
async fn next_line(lines: &mut Lines) -> Value {
    let line = tokio::time::timeout(std::time::Duration::from_secs(60), lines.next_text())
        .await
        .expect("a line within a minute")
        .unwrap()
        .expect("the stream goes on");
    serde_json::from_str(&line).unwrap()
}

#[test]
fn a_watch_streams_changes_in_order_bounds_a_storm_and_ends_at_a_pause() {
    let d = Daemon::start(&[]);
    d.link_snapshot("minimal", "mini");
    let rt = runtime();
    let c = d.unix();
    rt.block_on(async {
        let id = create(&c, "mini", 1).await.remove(0);
        common::exec(&c, &id, "mkdir -p /tmp/w").await;
        let resp = c
            .send(
                Method::GET,
                &format!("/v1/sandboxes/{id}/files/watch?path=/tmp/w"),
                None,
            )
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let mut lines = Lines::new(resp);
        common::exec(&c, &id, "echo x > /tmp/w/a; rm /tmp/w/a").await;
        let mut seen = Vec::new();
        for _ in 0..3 {
            let e = next_line(&mut lines).await;
            seen.push((
                e["type"].as_str().unwrap().to_owned(),
                e["path"].as_str().unwrap().to_owned(),
            ));
        }
        let a = "/tmp/w/a".to_owned();
        assert_eq!(
            seen,
            [
                ("create".into(), a.clone()),
                ("write".into(), a.clone()),
                ("remove".into(), a)
            ]
        );
        // A storm of 10,000 new files while the client reads nothing: the guest drops
        // what waits beyond its bound and says so with an overflow line; the daemon
        // holds nothing for the client meanwhile (it reads the guest only as the client
        // reads it), so its memory stays where it was.
        let rss_before = common::rss_kib(d.pid());
        common::exec(&c, &id, "cd /tmp/w && seq 10000 | xargs touch").await;
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let rss_storm = common::rss_kib(d.pid());
        let mut read = 0;
        loop {
            let e = next_line(&mut lines).await;
            read += 1;
            if e["type"] == "overflow" {
                assert!(e["dropped"].as_u64().is_some_and(|n| n > 0), "{e}");
                break;
            }
            assert!(read < 100_000, "no overflow line in {read} lines");
        }
        let rss_after = common::rss_kib(d.pid());
        eprintln!("storm: overflow after {read} lines; daemon RSS {rss_before} -> {rss_storm} -> {rss_after} KiB");
        let grown = rss_storm.max(rss_after).saturating_sub(rss_before);
        assert!(
            grown <= 16 * 1024,
            "the daemon grew by {grown} KiB under the storm ({rss_before} -> {rss_storm} -> {rss_after} KiB)"
        );
        // A pause ends the watch with its reason.
        let (s, v) = call(&c, Method::POST, &format!("/v1/sandboxes/{id}/pause"), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        // After what the queue still held of the storm.
        let mut last = next_line(&mut lines).await;
        for _ in 0..2 * 1024 {
            if last["type"] == "error" {
                break;
            }
            last = next_line(&mut lines).await;
        }
        assert_eq!(last["type"], "error", "{last}");
        assert!(
            last["message"].as_str().unwrap().contains("paused"),
            "{last}"
        );
        // A missing directory: 404 (the watch resumes the sandbox first).
        let (s, v) = call(
            &c,
            Method::GET,
            &format!("/v1/sandboxes/{id}/files/watch?path=/nope"),
            None,
        )
        .await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    });
}
