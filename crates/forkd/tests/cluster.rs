//! Several daemons as one cluster, coordinated through a real 3-member etcd cluster
//! that serves its clients over TLS with client certificates: hosts register under a
//! lease, one killed is shown unreachable and comes back, and losing etcd's quorum
//! makes cluster operations answer 503 while each host still serves its own API. Forks
//! are placed on the hosts with room, any host is a front door, and a drained host's
//! sandboxes move.

mod common;

use common::etcd::Etcd;
use common::{call, free_port, runtime, Daemon};
use forkd_daemon::client::Client;
use hyper::{Method, StatusCode};
use serde_json::Value;
use std::time::{Duration, Instant};

/// The cluster's shared token (the hosts forward with it; E2B's API key).
const TOKEN: &str = "cluster-test-token-cluster-test-token-0123";

/// A host's daemon in the cluster of `etcd`, named `name`, with a 3 s lease.
fn host_args(etcd: &Etcd, name: &str, port: &str, zone: &str) -> Vec<String> {
    let tls = etcd.client_tls();
    let listen = format!("127.0.0.1:{port}");
    [
        "--listen",
        &listen,
        "--cluster",
        &etcd.url(),
        "--advertise",
        &listen,
        "--host-name",
        name,
        "--lease-ttl",
        "3",
        "--label",
        &format!("zone={zone}"),
        "--etcd-ca",
        tls.ca.to_str().unwrap(),
        "--etcd-cert",
        tls.cert.to_str().unwrap(),
        "--etcd-key",
        tls.key.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The cluster's registry, on loopback, and the repository its snapshots go to.
fn registry() -> (common::Registry, String) {
    let registry = common::Registry::start();
    let repo = format!("{}/forkd/snapshots", registry.addr);
    (registry, repo)
}

/// A host's daemon (see [`host_args`]) with `extra` arguments.
fn start_host(etcd: &Etcd, name: &str, zone: &str, extra: &[&str]) -> Daemon {
    let port = free_port().rsplit_once(':').unwrap().1.to_owned();
    let mut args = host_args(etcd, name, &port, zone);
    args.extend(extra.iter().map(|s| s.to_string()));
    Daemon::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The digest of snapshot `tag` in the first host's record, once it names it (records
/// are refreshed every second with 3 s leases); at most 20 s.
async fn advertised(c: &Client, tag: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, v) = hosts(c).await;
        if let Some(d) = v["hosts"][0]["live"]["snapshots"][tag].as_str() {
            return d.to_owned();
        }
        assert!(Instant::now() < deadline, "{tag} never advertised: {v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits (at most 20 s) until every host's record names snapshot `tag` with `digest`.
async fn hold_all(c: &Client, tag: &str, digest: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, v) = hosts(c).await;
        let hosts = v["hosts"].as_array().cloned().unwrap_or_default();
        let held: Vec<Option<&str>> = hosts
            .iter()
            .map(|h| h["live"]["snapshots"][tag].as_str())
            .collect();
        if !held.is_empty() && held.iter().all(|d| *d == Some(digest)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the hosts hold {held:?}, not {digest}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `GET /v1/cluster/hosts` through `c`.
async fn hosts(c: &Client) -> (StatusCode, Value) {
    call(c, Method::GET, "/v1/cluster/hosts", None).await
}

/// Each host's state, by name, as `c`'s daemon sees the cluster.
fn states(v: &Value) -> Vec<(String, String)> {
    v["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["name"].as_str().unwrap().to_owned(),
                h["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Waits (at most `secs`) until `c`'s view of the cluster is `want`.
async fn wait_for(c: &Client, want: &[(&str, &str)], secs: u64) -> Value {
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(n, s)| (n.to_string(), s.to_string()))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let (s, v) = hosts(c).await;
        if s == StatusCode::OK && states(&v) == want {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "the cluster never looked like {want:?}; last {s}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A cluster's whole life on one machine: a 3-member etcd cluster serving clients over
/// TLS with client certificates, a registry on loopback, three daemons with 5 slots
/// and 3 s leases, the `minimal` snapshot on host A only.
/// - All three register and see each other `up`, with their labels and live fields
///   (API, CLI table and `--json`).
/// - A fork of 12 asked of A lands on all three; B and C pull the snapshot and hold
///   A's digest. Every child answers an exec through C's front door.
/// - `kill -9` of B's daemon: once its lease lapsed, B is `unreachable`, its sandboxes
///   are listed `unknown` and a request for one answers 503 naming B; new forks go to
///   A and C. B restarted: its sandboxes are back, `running`, and answer through C.
/// - One etcd member stopped changes nothing; two stopped make cluster operations
///   answer 503 naming etcd while each host still serves its own sandboxes.
#[test]
fn a_cluster_places_forwards_and_survives_losing_a_host_and_etcd_members() {
    let mut etcd = Etcd::start(3);
    let (_registry, repo) = registry();
    let start = |name: &str, zone: &str| {
        start_host(
            &etcd,
            name,
            zone,
            &["--max-sandboxes", "5", "--registry", &repo],
        )
    };
    let (a, mut b, c) = (start("a", "z1"), start("b", "z2"), start("c", "z1"));
    a.link_snapshot("minimal", "mini");
    let rt = runtime();
    rt.block_on(async {
        let all_up = [("a", "up"), ("b", "up"), ("c", "up")];
        let v = wait_for(&a.unix(), &all_up, 30).await;
        assert_eq!(v["this_host"], "a");
        let b_view = &v["hosts"][1];
        assert_eq!(b_view["labels"]["zone"], "z2", "{v}");
        assert_eq!(b_view["address"], b_view["live"]["address"], "{v}");
        assert!(b_view["live"]["cpus"].as_u64().unwrap() >= 1, "{v}");
        assert_eq!(b_view["live"]["max_sandboxes"], 5, "{v}");
        assert!(
            ["kvm", "tcg"].contains(&b_view["live"]["accel"].as_str().unwrap()),
            "{v}"
        );
        // Every host sees the same cluster.
        wait_for(&c.unix(), &all_up, 10).await;

        // The CLI prints it, and as JSON.
        let out = a.forkd().args(["cluster", "hosts"]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        for name in ["a (this) ", "b ", "c "] {
            assert!(
                text.lines()
                    .any(|l| l.starts_with(name) && l.contains(" up ")),
                "{text}"
            );
        }
        let out = a
            .forkd()
            .args(["cluster", "hosts", "--json"])
            .output()
            .unwrap();
        let json: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(states(&json).len(), 3);

        // A fork of 12 on hosts of 5 slots: all three take children, B and C pulling
        // the snapshot from the registry.
        let digest = advertised(&a.unix(), "mini").await;
        let (s, v) = call(
            &a.unix(),
            Method::POST,
            "/v1/sandboxes",
            Some(serde_json::json!({"snapshot": "mini", "n": 12})),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let made: Vec<(String, String)> = v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                let field = |k: &str| s[k].as_str().unwrap().to_owned();
                (field("id"), field("host"))
            })
            .collect();
        assert_eq!(made.len(), 12, "{v}");
        for host in ["a", "b", "c"] {
            assert!(made.iter().any(|(_, h)| h == host), "none on {host}: {v}");
        }
        hold_all(&a.unix(), "mini", &digest).await;
        // Every child answers through C's front door.
        for (id, _) in &made {
            let v = common::exec(&c.unix(), id, "hostname").await;
            assert_eq!(stdout(&v).trim(), id);
        }

        // B's daemon is killed: once its lease lapses it is unreachable, not gone, and
        // so are its sandboxes.
        b.kill9();
        let b_down = [("a", "up"), ("b", "unreachable"), ("c", "up")];
        wait_for(&a.unix(), &b_down, 20).await;
        let on_b: Vec<&String> = made
            .iter()
            .filter(|(_, h)| h == "b")
            .map(|(id, _)| id)
            .collect();
        let listed_now = listed(&c.unix()).await;
        for id in &on_b {
            assert!(
                listed_now.contains(&((*id).clone(), "b".into(), "unknown".into())),
                "{listed_now:?}"
            );
        }
        let (s, v) = call(
            &c.unix(),
            Method::POST,
            &format!("/v1/sandboxes/{}/exec", on_b[0]),
            Some(serde_json::json!({"argv": ["true"]})),
        )
        .await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
        assert_eq!(v["error"]["code"], "host_unreachable", "{v}");
        // New forks go to A and C: with two of A's children removed, the cluster's
        // room is A's 2 slots and C's.
        for (id, _) in made.iter().filter(|(_, h)| h == "a").take(2) {
            remove(&c.unix(), id).await;
        }
        let c_free = 5 - made.iter().filter(|(_, h)| h == "c").count();
        let v = fork_when_room(
            &c.unix(),
            serde_json::json!({
                "snapshot": "mini", "n": 2 + c_free, "placement": {"policy": "spread"}
            }),
        )
        .await;
        let mut placed: Vec<&str> = v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["host"].as_str().unwrap())
            .collect();
        placed.sort();
        let mut want = vec!["a", "a"];
        want.extend(std::iter::repeat_n("c", c_free));
        assert_eq!(placed, want, "{v}");

        // B back: its sandboxes are back and answer through C.
        b.spawn();
        wait_for(&a.unix(), &all_up, 20).await;
        for id in &on_b {
            let v = common::exec(&c.unix(), id, "hostname").await;
            assert_eq!(stdout(&v).trim(), id.as_str());
        }
        let listed_now = listed(&a.unix()).await;
        for id in &on_b {
            assert!(
                listed_now.contains(&((*id).clone(), "b".into(), "running".into())),
                "{listed_now:?}"
            );
        }

        // One etcd member stopped: nothing changes.
        etcd.stop_member(0);
        tokio::time::sleep(Duration::from_secs(4)).await;
        wait_for(&c.unix(), &all_up, 20).await;
        let v = common::exec(&c.unix(), on_b[0], "hostname").await;
        assert_eq!(stdout(&v).trim(), on_b[0].as_str());

        // Two stopped: no quorum. Cluster operations (the hosts, the cluster's list of
        // sandboxes) answer 503 naming etcd; each host still serves its own sandboxes.
        etcd.stop_member(1);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (s, v) = hosts(&a.unix()).await;
            if s == StatusCode::SERVICE_UNAVAILABLE {
                assert_eq!(v["error"]["code"], "cluster_unavailable", "{v}");
                assert!(
                    v["error"]["message"].as_str().unwrap().contains("etcd"),
                    "{v}"
                );
                break;
            }
            assert!(Instant::now() < deadline, "still {s} without quorum: {v}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let (s, v) = call(&a.unix(), Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(
            s,
            StatusCode::SERVICE_UNAVAILABLE,
            "the cluster's list: {v}"
        );
        for (d, name) in [(&a, "a"), (&b, "b"), (&c, "c")] {
            let (s, v) = call(&d.unix(), Method::GET, "/v1/sandboxes?scope=host", None).await;
            assert_eq!(s, StatusCode::OK, "{v}");
            let own = v["sandboxes"].as_array().unwrap();
            assert!(!own.is_empty(), "{name}: {v}");
            for sb in own {
                let id = sb["id"].as_str().unwrap();
                let v = common::exec(&d.unix(), id, "hostname").await;
                assert_eq!(stdout(&v).trim(), id, "{name}");
            }
        }

        // The quorum back: every host registers again.
        etcd.start_member(1);
        wait_for(&a.unix(), &all_up, 30).await;
    });
}

/// `--cluster` without a TCP listener is refused at start, saying what to add.
#[test]
fn a_cluster_member_needs_a_listener() {
    let home = common::data_dir("cluster-config-");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_forkd"))
        .env("FORKD_HOME", home.path())
        .args([
            "daemon",
            "--cluster",
            "etcd://127.0.0.1:1",
            "--advertise",
            "127.0.0.1:2",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--cluster needs --listen"), "{err}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_forkd"))
        .env("FORKD_HOME", home.path())
        .args(["daemon", "--cluster", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("etcd://HOST:PORT"), "{err}");
}

/// Removes sandbox `id` through `c`.
async fn remove(c: &Client, id: &str) {
    let (s, v) = call(c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert!(s.is_success(), "{s} {v}");
}

/// Forks `body` through `c` until it is created (the hosts' free slots are refreshed
/// with their records, a second or so after a removal); at most 20 s.
async fn fork_when_room(c: &Client, body: Value) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (s, v) = call(c, Method::POST, "/v1/sandboxes", Some(body.clone())).await;
        if s == StatusCode::CREATED || Instant::now() > deadline {
            assert_eq!(s, StatusCode::CREATED, "{v}");
            return v;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn stdout(v: &Value) -> String {
    String::from_utf8(common::b64(&v["stdout_b64"])).unwrap()
}

/// The sandboxes `c`'s daemon lists, as (id, host, status).
async fn listed(c: &Client) -> Vec<(String, String, String)> {
    let (s, v) = call(c, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap().to_owned(),
                s["host"].as_str().unwrap_or("").to_owned(),
                s["status"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Waits (at most `secs`) until `c`'s daemon lists `want` (sorted by id).
async fn wait_listed(c: &Client, want: &[(String, String, String)], secs: u64) {
    let mut want = want.to_vec();
    want.sort();
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let mut got = listed(c).await;
        got.sort();
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "listed {got:?}, not {want:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Any host is a front door: a sandbox of host B is listed, run, streamed, typed into
/// and removed through host A; B killed, its sandbox is `unknown` and a request for it
/// answers 503 naming B; B back, the sandbox answers again.
#[test]
fn any_host_is_a_front_door_to_every_sandbox() {
    let etcd = Etcd::start(1);
    // Both hosts serve E2B's API too, with the cluster's shared token as its key.
    let secrets = tempfile::tempdir().unwrap();
    let token_file = secrets.path().join("token");
    common::write_secret(&token_file, TOKEN);
    let with_e2b = |name: &str| {
        let e2b = free_port();
        let token = token_file.to_str().unwrap();
        let extra = ["--e2b-listen", &e2b, "--token-file", token];
        (start_host(&etcd, name, "z1", &extra), e2b)
    };
    let ((a, a_e2b), (mut b, _)) = (with_e2b("a"), with_e2b("b"));
    b.link_snapshot("minimal", "mini");
    let rt = runtime();
    rt.block_on(async {
        wait_for(&a.unix(), &[("a", "up"), ("b", "up")], 30).await;
        let ids = common::create(&b.unix(), "mini", 2).await;
        // Claimed before the fork answered: A finds them at once.
        for id in &ids {
            let (s, v) = call(&a.unix(), Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
            assert_eq!((s, v["host"].as_str()), (StatusCode::OK, Some("b")), "{v}");
        }
        let row = |id: &String, status: &str| (id.clone(), "b".to_owned(), status.to_owned());
        let running: Vec<_> = ids.iter().map(|id| row(id, "running")).collect();
        // Both hosts list the cluster's sandboxes, each with its host.
        wait_listed(&a.unix(), &running, 20).await;
        wait_listed(&b.unix(), &running, 5).await;
        let (s, v) = call(&a.unix(), Method::GET, "/v1/sandboxes?scope=host", None).await;
        assert_eq!(
            (s, v["sandboxes"].as_array().unwrap().len()),
            (StatusCode::OK, 0)
        );
        let out = a.forkd().args(["ls"]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("HOST") && text.contains(&ids[0]), "{text}");

        // Through A: one sandbox's record, an exec, a streamed exec, a file both ways.
        let (id, ac) = (&ids[0], a.unix());
        let (s, v) = call(&ac, Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(
            (s, v["id"].as_str()),
            (StatusCode::OK, Some(id.as_str())),
            "{v}"
        );
        let v = common::exec(&ac, id, "echo via-a-$(hostname)").await;
        assert_eq!(stdout(&v).trim(), format!("via-a-{id}"));
        let (s, body) = ac
            .call(
                Method::POST,
                &format!("/v1/sandboxes/{id}/exec"),
                Some(&serde_json::json!({"shell": "echo one; echo two", "stream": true})),
            )
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&body);
        assert_eq!(s, StatusCode::OK, "{text}");
        assert!(text.lines().any(|l| l.contains("\"exit\"")), "{text}");
        let file = format!("/v1/sandboxes/{id}/files?path=/root/f");
        let resp = ac
            .send(Method::PUT, &file, Some(b"written-through-a".to_vec()))
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{}", resp.status());
        let v = common::exec(&b.unix(), id, "cat /root/f").await;
        assert_eq!(stdout(&v), "written-through-a");
        let (s, body) = ac.call(Method::GET, &file, None).await.unwrap();
        assert_eq!((s, &body[..]), (StatusCode::OK, &b"written-through-a"[..]));

        // A terminal through A: the upgrade is joined end to end.
        use futures::StreamExt;
        use tokio_tungstenite::tungstenite::Message;
        let mut ws = ac
            .websocket(&format!(
                "/v1/sandboxes/{id}/pty?cmd=sh&cmd=-c&cmd=echo+pty-$((6*7))"
            ))
            .await
            .unwrap();
        let mut seen = String::new();
        while let Some(Ok(m)) = ws.next().await {
            match m {
                Message::Binary(b) => seen.push_str(&String::from_utf8_lossy(&b)),
                Message::Text(t) if t.contains("\"exit\"") => break,
                _ => {}
            }
        }
        assert!(seen.contains("pty-42"), "{seen:?}");
        let _ = ws.close(None).await;

        // E2B's API through A: the control plane and envd's file route for B's sandbox.
        let e2b = Client::new(forkd_daemon::client::Endpoint::Tcp(a_e2b.clone()), None);
        let send = |req: hyper::Request<http_body_util::Full<hyper::body::Bytes>>| {
            let e2b = e2b.clone();
            async move {
                use http_body_util::BodyExt;
                let r = e2b.relay(req).await.unwrap();
                let status = r.status();
                (status, r.into_body().collect().await.unwrap().to_bytes())
            }
        };
        let empty = http_body_util::Full::new(hyper::body::Bytes::new());
        let (s, body) = send(
            hyper::Request::get(format!("/sandboxes/{id}"))
                .header("x-api-key", TOKEN)
                .body(empty.clone())
                .unwrap(),
        )
        .await;
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            (s, v["sandboxID"].as_str()),
            (StatusCode::OK, Some(id.as_str())),
            "{v}"
        );
        let access = v["envdAccessToken"].as_str().unwrap().to_owned();
        let (s, body) = send(
            hyper::Request::get("/files?path=/root/f")
                .header("e2b-sandbox-id", id.as_str())
                .header("e2b-sandbox-port", "49983")
                .header("x-access-token", &access)
                .header("authorization", "Basic cm9vdDo=")
                .body(empty)
                .unwrap(),
        )
        .await;
        assert_eq!((s, &body[..]), (StatusCode::OK, &b"written-through-a"[..]));

        // E2B's own SDK through A: its list is the cluster's, and a create through A,
        // which lacks the template, is made on B and reached through A.
        let python = std::env::var("FORKD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let a_url = format!("http://{a_e2b}");
        let out = std::process::Command::new(&python)
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients"))
            .arg("e2b_cluster.py")
            .env("E2B_API_URL", &a_url)
            .env("E2B_SANDBOX_URL", &a_url)
            .env("E2B_API_KEY", TOKEN)
            .env("FORKD_TEST_SNAPSHOT", "mini")
            .env("FORKD_OTHER_SANDBOXES", ids.join(","))
            .output()
            .unwrap_or_else(|e| panic!("{python} (./dev test installs the e2b SDK): {e}"));
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && report.lines().any(|l| l == "ok"),
            "{report}\n{}",
            a.log()
        );

        // Removed through A: gone from both.
        let (s, v) = call(
            &ac,
            Method::DELETE,
            &format!("/v1/sandboxes/{}", ids[1]),
            None,
        )
        .await;
        assert!(s.is_success(), "{s} {v}");
        wait_listed(&a.unix(), &running[..1], 10).await;

        // B killed: its sandbox is unknown, and requests for it answer 503 naming B.
        b.kill9();
        wait_listed(&a.unix(), &[row(id, "unknown")], 20).await;
        let (s, v) = call(
            &ac,
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(serde_json::json!({"shell": "true"})),
        )
        .await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
        assert_eq!(v["error"]["code"], "host_unreachable", "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("host b"),
            "{v}"
        );

        // B back: its sandbox is running and answers through A again.
        b.spawn();
        wait_listed(&a.unix(), &running[..1], 30).await;
        let v = common::exec(&ac, id, "cat /root/f").await;
        assert_eq!(stdout(&v), "written-through-a");
    });
}

/// A fork placed on the cluster: the snapshot is on host A only; a fork of 6 asked of
/// host C (which lacks it) with 2 slots per host lands on all three, B and C pulling
/// the snapshot from the cluster's registry and checking its digest; every child
/// answers through C; a fork restricted to a zone lands in it; what does not fit, or
/// asks for labels no host has, is refused.
#[test]
fn a_fork_is_placed_across_the_hosts_that_have_room() {
    let etcd = Etcd::start(1);
    let (_registry, repo) = registry();
    let start = |name: &str, zone: &str| {
        start_host(
            &etcd,
            name,
            zone,
            &["--max-sandboxes", "2", "--registry", &repo],
        )
    };
    let (a, b, c) = (start("a", "z1"), start("b", "z2"), start("c", "z2"));
    a.link_snapshot("minimal", "mini");
    let rt = runtime();
    rt.block_on(async {
        let all_up = [("a", "up"), ("b", "up"), ("c", "up")];
        wait_for(&c.unix(), &all_up, 30).await;
        let digest = advertised(&c.unix(), "mini").await;

        let fork = |body: Value| {
            let c = c.unix();
            async move { call(&c, Method::POST, "/v1/sandboxes", Some(body)).await }
        };
        let (s, v) = fork(serde_json::json!({
            "snapshot": "mini", "n": 6, "placement": {"policy": "spread"}
        }))
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let made = v["sandboxes"].as_array().unwrap();
        let mut per_host = std::collections::BTreeMap::new();
        for s in made {
            *per_host
                .entry(s["host"].as_str().unwrap().to_owned())
                .or_insert(0) += 1;
        }
        assert_eq!(
            per_host,
            [("a", 2), ("b", 2), ("c", 2)]
                .map(|(h, n)| (h.to_owned(), n))
                .into(),
            "{v}"
        );
        // B and C hold the snapshot now, with A's digest.
        for d in [&b, &c] {
            let (s, v) = call(&d.unix(), Method::GET, "/v1/snapshots/mini", None).await;
            assert_eq!(s, StatusCode::OK, "{v}");
        }
        hold_all(&a.unix(), "mini", &digest).await;
        // Every child answers through C's front door.
        for s in made {
            let id = s["id"].as_str().unwrap();
            let v = common::exec(&c.unix(), id, "hostname").await;
            assert_eq!(stdout(&v).trim(), id);
        }

        // The cluster is full: a 7th child is refused, saying how much room there is.
        let (s, v) = fork(serde_json::json!({"snapshot": "mini", "n": 1})).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
        assert_eq!(v["error"]["code"], "at_capacity", "{v}");

        // Room again on A and B: a pack fork restricted to zone z1 goes to A only.
        for s in made.iter().filter(|s| s["host"] != "c") {
            let id = s["id"].as_str().unwrap();
            remove(&c.unix(), id).await;
        }
        let v = fork_when_room(
            &c.unix(),
            serde_json::json!({
                "snapshot": "mini", "n": 2, "placement": {"labels": {"zone": "z1"}}
            }),
        )
        .await;
        let hosts: Vec<&str> = v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["host"].as_str().unwrap())
            .collect();
        assert_eq!(hosts, ["a", "a"], "{v}");
        let (s, v) = fork(serde_json::json!({
            "snapshot": "mini", "n": 1, "placement": {"labels": {"zone": "nowhere"}}
        }))
        .await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
        // The CLI asks for the same.
        let out = c
            .forkd()
            .args(["fork", "--tag", "mini", "--host-label", "zone=nowhere"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("at_capacity"),
            "{err}"
        );
    });
}

/// A daemon in no cluster says so to cluster requests, rather than ignoring them.
#[test]
fn a_daemon_in_no_cluster_refuses_cluster_requests() {
    let d = Daemon::start(&[]);
    runtime().block_on(async {
        let (s, v) = hosts(&d.unix()).await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--cluster"),
            "{v}"
        );
        let (s, v) = call(
            &d.unix(),
            Method::POST,
            "/v1/sandboxes",
            Some(serde_json::json!({"snapshot": "mini", "placement": {"policy": "spread"}})),
        )
        .await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("not part of one"),
            "{v}"
        );
    });
}

/// A drained host's sandboxes move: `forkd drain a` pauses A's sandbox and parks it
/// in the cluster's registry (A keeps nothing, takes no new fork); the next request
/// for it, through B's front door (which had found it on A before), has B take it and
/// resume it: the same machine, with its file and the value only a background
/// process's memory held. A parked sandbox removed is not brought to a host first. A
/// retired host is forgotten once it is down.
#[test]
fn a_drained_hosts_sandbox_resumes_on_another_host_at_its_next_use() {
    let etcd = Etcd::start(1);
    let (_registry, repo) = registry();
    let start = |name: &str| start_host(&etcd, name, "z1", &["--registry", &repo]);
    let (mut a, b) = (start("a"), start("b"));
    a.link_snapshot("minimal", "mini");
    let rt = runtime();
    rt.block_on(async {
        wait_for(&b.unix(), &[("a", "up"), ("b", "up")], 30).await;
        let mut ids = common::create(&a.unix(), "mini", 2).await;
        let (id, other) = (ids.remove(0), ids.remove(0));
        let branch = |d: &Daemon, id: &str| {
            let c = d.unix();
            let path = format!("/v1/sandboxes/{id}/branch");
            let body = serde_json::json!({"tag": "kept"});
            async move { call(&c, Method::POST, &path, Some(body)).await }
        };
        // The tag `kept` names A's branch of one sandbox in the cluster from now on.
        let (s, v) = branch(&a, &other).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let set_up = "echo kept > /root/file; mkfifo /tmp/go; \
            (v=held-in-memory; read x < /tmp/go; echo \"$v $x\" > /tmp/out) >/dev/null 2>&1 & \
            sleep 0.2; echo started";
        // Through B: B learns the sandbox is on A.
        let v = common::exec(&b.unix(), &id, set_up).await;
        assert_eq!(stdout(&v).trim(), "started", "{v}");

        // Bad input: a host the cluster does not know, a take of a sandbox that is not
        // parked.
        let out = b.forkd().args(["drain", "nosuch"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("no host nosuch"),
            "{err}"
        );
        let take = format!("/v1/cluster/sandboxes/{id}/take");
        let (s, v) = call(&b.unix(), Method::POST, &take, None).await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        let out = b.forkd().args(["drain", "a", "--json"]).output().unwrap();
        let report: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        assert!(out.status.success(), "{report}");
        let mut moved: Vec<String> =
            serde_json::from_value(report["moved"].clone()).unwrap_or_default();
        moved.sort();
        let mut both = [id.clone(), other.clone()];
        both.sort();
        assert_eq!(moved, both, "{report}");
        assert_eq!(report["kept"], serde_json::json!([]), "{report}");
        // A holds nothing; the cluster lists the sandboxes paused, on no host yet.
        let (s, v) = call(&a.unix(), Method::GET, "/v1/sandboxes?scope=host", None).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(v["sandboxes"], serde_json::json!([]), "{v}");
        let parked = |id: &str| (id.to_owned(), String::new(), "paused".to_owned());
        wait_listed(&b.unix(), &[parked(&id), parked(&other)], 5).await;
        // One removed while it waits: no host takes it for that.
        remove(&b.unix(), &other).await;
        wait_listed(&b.unix(), &[parked(&id)], 5).await;
        let (s, _) = call(
            &b.unix(),
            Method::GET,
            &format!("/v1/sandboxes/{other}"),
            None,
        )
        .await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        let (_, v) = hosts(&b.unix()).await;
        assert_eq!(v["hosts"][0]["live"]["draining"], true, "{v}");
        // A drained host takes no fork: one asked of A lands on B.
        let (s, v) = call(
            &a.unix(),
            Method::POST,
            "/v1/sandboxes",
            Some(serde_json::json!({"snapshot": "mini", "n": 1, "placement": {}})),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        assert_eq!(v["sandboxes"][0]["host"], "b", "{v}");
        // A tag names one snapshot in the cluster: B's branch into `kept` is refused,
        // and B keeps no such snapshot.
        let on_b = v["sandboxes"][0]["id"].as_str().unwrap().to_owned();
        let (s, v) = branch(&b, &on_b).await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("names a snapshot of the cluster already"),
            "{v}"
        );
        let (s, _) = call(&b.unix(), Method::GET, "/v1/snapshots/kept", None).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        remove(&b.unix(), &on_b).await;

        // Its next use, through B, which remembered it on A.
        let v = common::exec(&b.unix(), &id, "cat /root/file; hostname").await;
        assert_eq!(stdout(&v), format!("kept\n{id}\n"), "{v}");
        let v = common::exec(
            &b.unix(),
            &id,
            "echo now > /tmp/go; for i in 1 2 3 4 5 6 7 8 9 10; do \
             [ -s /tmp/out ] && break; sleep 0.2; done; cat /tmp/out",
        )
        .await;
        assert_eq!(stdout(&v).trim(), "held-in-memory now", "{v}");
        let (s, v) = call(&b.unix(), Method::GET, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["status"], "running", "{v}");
        // A, asked, sends it on to B.
        let v = common::exec(&a.unix(), &id, "cat /root/file").await;
        assert_eq!(stdout(&v), "kept\n", "{v}");

        // The drain ends: A takes forks again.
        let out = b.forkd().args(["drain", "a", "--undo"]).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (_, v) = hosts(&b.unix()).await;
            if v["hosts"][0]["live"]["draining"].is_null() {
                break;
            }
            assert!(Instant::now() < deadline, "A still draining: {v}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        remove(&b.unix(), &id).await;
        // The link that brought it went with it; A kept none either (only its branch).
        for (d, want) in [(&a, &["kept", "mini"][..]), (&b, &["mini"][..])] {
            let (s, v) = call(&d.unix(), Method::GET, "/v1/snapshots", None).await;
            assert_eq!(s, StatusCode::OK);
            let tags: Vec<&str> = v["snapshots"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["tag"].as_str().unwrap())
                .collect();
            assert_eq!(tags, want, "{v}");
        }

        // A retired: a host that is up cannot be forgotten; once A is gone it can, and
        // the cluster no longer lists it.
        let (s, v) = call(&b.unix(), Method::DELETE, "/v1/cluster/hosts/a", None).await;
        assert_eq!(s, StatusCode::CONFLICT, "{v}");
        a.kill9();
        wait_for(&b.unix(), &[("a", "unreachable"), ("b", "up")], 20).await;
        let out = b
            .forkd()
            .args(["cluster", "forget", "a", "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["sandboxes"], serde_json::json!([]), "{v}");
        wait_for(&b.unix(), &[("b", "up")], 5).await;
    });
}
