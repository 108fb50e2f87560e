//! Several daemons as one cluster, coordinated through a real 3-member etcd cluster
//! that serves its clients over TLS with client certificates: hosts register under a
//! lease, one killed is shown unreachable and comes back, and losing etcd's quorum
//! makes cluster operations answer 503 while each host still serves its own API.

mod common;

use common::etcd::Etcd;
use common::{call, free_port, runtime, Daemon};
use forkd_daemon::client::Client;
use hyper::{Method, StatusCode};
use serde_json::Value;
use std::time::{Duration, Instant};

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

fn start_host(etcd: &Etcd, name: &str, zone: &str) -> Daemon {
    let port = free_port().rsplit_once(':').unwrap().1.to_owned();
    let args = host_args(etcd, name, &port, zone);
    Daemon::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
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

#[test]
fn hosts_register_lapse_return_and_survive_losing_etcd() {
    let mut etcd = Etcd::start(3);
    let a = start_host(&etcd, "a", "z1");
    let mut b = start_host(&etcd, "b", "z2");
    let c = start_host(&etcd, "c", "z1");
    let rt = runtime();
    rt.block_on(async {
        let all_up = [("a", "up"), ("b", "up"), ("c", "up")];
        let v = wait_for(&a.unix(), &all_up, 30).await;
        assert_eq!(v["this_host"], "a");
        let b_view = &v["hosts"][1];
        assert_eq!(b_view["labels"]["zone"], "z2", "{v}");
        assert_eq!(b_view["address"], b_view["live"]["address"], "{v}");
        assert!(b_view["live"]["cpus"].as_u64().unwrap() >= 1, "{v}");
        assert_eq!(b_view["live"]["running"], 0, "{v}");
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

        // B's daemon is killed: once its lease lapses it is unreachable, not gone.
        b.kill9();
        wait_for(
            &a.unix(),
            &[("a", "up"), ("b", "unreachable"), ("c", "up")],
            20,
        )
        .await;
        b.spawn();
        wait_for(&a.unix(), &all_up, 20).await;

        // One etcd member stopped: nothing changes.
        etcd.stop_member(0);
        tokio::time::sleep(Duration::from_secs(4)).await;
        wait_for(&c.unix(), &all_up, 20).await;

        // Two stopped: no quorum. Cluster operations answer 503 naming etcd; each host
        // still serves its own API.
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
        for d in [&a, &b, &c] {
            let (s, v) = call(&d.unix(), Method::GET, "/v1/sandboxes", None).await;
            assert_eq!(s, StatusCode::OK, "{v}");
            let (s, _) = call(&d.unix(), Method::GET, "/v1/health", None).await;
            assert_eq!(s, StatusCode::OK);
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
