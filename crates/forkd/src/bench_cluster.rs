//! `forkd bench cluster`: three daemons on this machine as one cluster, through the
//! REST API in one run.
//!
//! - An etcd member (Debian's `etcd-server`) and a registry (`docker-registry`) of the
//!   benchmark's own on loopback ports; three daemons (`a`, `b`, `c`) in the cluster,
//!   each with a data directory of its own; the `minimal` template built on `a` only.
//! - A fork of one on `b` and one on `c` brings the snapshot to them through the
//!   registry (timed apart: it pays for the pulls).
//! - A fork of N with `spread` across the three hosts against the same fork on `a`
//!   alone (placement restricted to its label), request to answer, interleaved.
//! - The latency a forwarded exec adds: a child on `b`, `exec true` sent to `b` itself
//!   and through `a`, interleaved; p50 of each and their ratio.
//!
//! - A drain: children on `c`, `c` drained (each paused, branched into a link, pushed
//!   and parked), then each child's next exec through `a`, which takes it (pull,
//!   install, resume) before running it, and the exec after that.
//!
//! The hosts share this machine's cores, so the cluster's fork measures what placing
//! and forwarding cost, not more cores.

use crate::bench_archive::LocalRegistry;
use crate::bench_scale::{delete_all, BenchDaemon};
use anyhow::{bail, Context, Result};
use forkd_daemon::client::Client;
use forkd_image::Home;
use hyper::Method;
use serde::Serialize;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Arguments of `forkd bench cluster`.
#[derive(clap::Args, Debug)]
pub struct ClusterArgs {
    /// Children of the measured forks.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(3..=200))]
    n: u32,
    /// Forks of each kind to take the median of.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    runs: u32,
    /// Execs of each kind to take the p50 of.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(5..=1000))]
    execs: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct ClusterReport {
    hosts: usize,
    n: u32,
    /// A fork of one on `b` and one on `c`, each pulling the snapshot, in all.
    first_forks_with_pull_ms: f64,
    /// Medians: a fork of `n` spread on the three hosts, and on `a` alone.
    cluster_fork_ms: f64,
    one_host_fork_ms: f64,
    cluster_over_one_host: f64,
    /// p50 of `exec true` on a child of `b`: sent to `b`, and through `a`.
    direct_exec_p50_ms: f64,
    forwarded_exec_p50_ms: f64,
    forwarded_over_direct: f64,
    /// Children on `c` moved by its drain, and the drain's request to answer.
    drained: u32,
    drain_ms: f64,
    /// Medians over the moved children: the first exec through `a` (taken: pulled,
    /// installed, resumed), and the next one.
    moved_first_exec_ms: f64,
    moved_next_exec_ms: f64,
}

/// An etcd member of the benchmark's own on loopback, stopped when dropped.
struct LocalEtcd {
    child: std::process::Child,
    addr: String,
}

impl LocalEtcd {
    fn start(dir: &std::path::Path) -> Result<LocalEtcd> {
        let port = |_| -> Result<u16> {
            Ok(std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port())
        };
        let (client, peer) = (port(())?, port(())?);
        let addr = format!("127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = std::process::Command::new("etcd")
            .args(["--name", "bench", "--data-dir"])
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", &format!("http://{addr}")])
            .args(["--advertise-client-urls", &format!("http://{addr}")])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("bench={peer_url}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting etcd (Debian's etcd-server)")?;
        let etcd = LocalEtcd { child, addr };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&etcd.addr).is_err() {
            if Instant::now() > deadline {
                bail!("etcd did not answer within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(etcd)
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The directory of the benchmark's etcd and registry data, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(home: &Home) -> Result<Scratch> {
        let dir = home
            .root()
            .join("bench")
            .join(format!("cluster-{}", forkd_host::ids::random_hex(6)));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Forks `body` through `c`; returns the children and how long the answer took.
async fn fork(c: &Client, body: &Value) -> Result<(Vec<String>, Duration)> {
    let t = Instant::now();
    let v: Value = c
        .json(Method::POST, "/v1/sandboxes", Some(body))
        .await
        .context("forking")?;
    let took = t.elapsed();
    let ids = v["sandboxes"]
        .as_array()
        .context("no sandboxes in the answer")?
        .iter()
        .filter_map(|s| s["id"].as_str().map(str::to_owned))
        .collect();
    Ok((ids, took))
}

async fn exec_true(c: &Client, id: &str) -> Result<Duration> {
    let t = Instant::now();
    let v: Value = c
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({ "cmd": ["true"] })),
        )
        .await?;
    if v["exit_code"] != 0 {
        bail!("exec in {id} answered {v}");
    }
    Ok(t.elapsed())
}

/// Waits until `c`'s daemon sees every host up and `a` holding `tag`.
async fn wait_cluster(c: &Client, tag: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(v) = c
            .json::<Value>(Method::GET, "/v1/cluster/hosts", None)
            .await
        {
            let hosts = v["hosts"].as_array().cloned().unwrap_or_default();
            let up = hosts.iter().filter(|h| h["state"] == "up").count();
            let holds = hosts
                .iter()
                .any(|h| h["name"] == "a" && h["live"]["snapshots"][tag].is_string());
            if up == 3 && holds {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("the cluster did not come up within a minute");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub async fn run(home: &Home, args: ClusterArgs) -> Result<()> {
    let say = |m: &str| {
        if !args.json {
            eprintln!("[forkd] {m}");
        }
    };
    let scratch = Scratch::new(home)?;
    let etcd = LocalEtcd::start(&scratch.0)?;
    let registry = LocalRegistry::start(&scratch.0)?;
    say(&format!(
        "etcd at {}, registry at {}",
        etcd.addr, registry.addr
    ));
    // Each host has room for the whole fork: the one-host fork runs on `a` alone.
    let slots = args.n as usize + 4;
    let mut hosts = Vec::new();
    for name in ["a", "b", "c"] {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let addr = format!("127.0.0.1:{port}");
        let extra: Vec<String> = [
            "--listen",
            &addr,
            "--cluster",
            &format!("etcd://{}", etcd.addr),
            "--advertise",
            &addr,
            "--host-name",
            name,
            "--label",
            &format!("host={name}"),
            "--lease-ttl",
            "6",
            "--registry",
            &format!("{}/forkd/bench", registry.addr),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        hosts.push(BenchDaemon::start_with(home, slots, &extra).await?);
    }
    let (a, b) = (&hosts[0].client, &hosts[1].client);
    say("building the minimal template on host a");
    let info = crate::snapshots::build_template(a, "minimal", Some("bench-cluster"), false).await?;
    let tag = info["tag"].as_str().context("no tag")?.to_owned();
    wait_cluster(a, &tag).await?;

    // The snapshot brought to b and c (a fork on each pulls it), timed apart.
    let on = |host: &str, n: u32| json!({"snapshot": tag, "n": n, "placement": {"labels": {"host": host}}});
    let mut first = Duration::ZERO;
    for host in ["b", "c"] {
        let (ids, t) = fork(a, &on(host, 1)).await?;
        first += t;
        delete_all(a, &ids).await?;
    }
    say(&format!(
        "a fork of 1 on b and on c, each pulling the snapshot: {:.0} ms in all",
        ms(first)
    ));
    // The hosts' records say what they hold and run (refreshed every 2 s here).
    let settle = || tokio::time::sleep(Duration::from_millis(2500));
    settle().await;
    let spread = |n: u32| json!({"snapshot": tag, "n": n, "placement": {"policy": "spread"}});

    let alone = on("a", args.n);
    let (mut cluster_ms, mut one_ms) = (Vec::new(), Vec::new());
    for run in 1..=args.runs {
        let (ids, t) = fork(a, &spread(args.n)).await?;
        delete_all(a, &ids).await?;
        cluster_ms.push(ms(t));
        settle().await;
        let (ids, t1) = fork(a, &alone).await?;
        delete_all(a, &ids).await?;
        one_ms.push(ms(t1));
        settle().await;
        say(&format!(
            "run {run}: {} children spread on 3 hosts {:.0} ms, on host a alone {:.0} ms",
            args.n,
            ms(t),
            ms(t1)
        ));
    }

    // A child of b, reached directly and through a.
    let (ids, _) = fork(a, &on("b", 1)).await?;
    let id = &ids[0];
    exec_true(b, id).await?;
    exec_true(a, id).await?;
    let (mut direct, mut forwarded) = (Vec::new(), Vec::new());
    for _ in 0..args.execs {
        direct.push(ms(exec_true(b, id).await?));
        forwarded.push(ms(exec_true(a, id).await?));
    }
    delete_all(a, &ids).await?;

    // A drain of c, and its children's next execs through a.
    let drained = 3;
    settle().await;
    let (ids, _) = fork(a, &on("c", drained)).await?;
    for id in &ids {
        exec_true(a, id).await?;
    }
    let t = Instant::now();
    let v: Value = a
        .json(Method::POST, "/v1/cluster/hosts/c/drain", None)
        .await?;
    let drain = t.elapsed();
    let moved = v["moved"].as_array().map_or(0, Vec::len);
    if moved != ids.len() {
        bail!("the drain moved {moved} of {} children: {v}", ids.len());
    }
    say(&format!(
        "c drained: {moved} children parked in {:.0} ms",
        ms(drain)
    ));
    let (mut moved_first, mut moved_next) = (Vec::new(), Vec::new());
    for id in &ids {
        moved_first.push(ms(exec_true(a, id).await?));
    }
    for id in &ids {
        moved_next.push(ms(exec_true(a, id).await?));
    }
    delete_all(a, &ids).await?;
    let _: Value = a
        .json(Method::DELETE, "/v1/cluster/hosts/c/drain", None)
        .await?;

    let report = ClusterReport {
        hosts: 3,
        n: args.n,
        first_forks_with_pull_ms: ms(first),
        cluster_fork_ms: median(cluster_ms),
        one_host_fork_ms: median(one_ms),
        cluster_over_one_host: 0.0,
        direct_exec_p50_ms: median(direct),
        forwarded_exec_p50_ms: median(forwarded),
        forwarded_over_direct: 0.0,
        drained,
        drain_ms: ms(drain),
        moved_first_exec_ms: median(moved_first),
        moved_next_exec_ms: median(moved_next),
    };
    let report = ClusterReport {
        cluster_over_one_host: report.cluster_fork_ms / report.one_host_fork_ms,
        forwarded_over_direct: report.forwarded_exec_p50_ms / report.direct_exec_p50_ms,
        ..report
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("cluster benchmark: 3 hosts on this machine, minimal template");
        println!(
            "fork of {}: spread on 3 hosts {:.0} ms, on one host {:.0} ms (median of {}): {:.2}x",
            report.n,
            report.cluster_fork_ms,
            report.one_host_fork_ms,
            args.runs,
            report.cluster_over_one_host
        );
        println!(
            "exec p50 ({} each, interleaved): direct {:.1} ms, forwarded through another host {:.1} ms: {:.2}x",
            args.execs, report.direct_exec_p50_ms, report.forwarded_exec_p50_ms, report.forwarded_over_direct
        );
        println!(
            "a fork of 1 on b and on c, each pulling the snapshot: {:.0} ms in all",
            report.first_forks_with_pull_ms
        );
        println!(
            "drain of a host with {} children: {:.0} ms; a moved child's first exec (taken: pulled, installed, resumed) {:.0} ms, its next {:.1} ms (medians)",
            report.drained, report.drain_ms, report.moved_first_exec_ms, report.moved_next_exec_ms
        );
    }
    drop(hosts);
    drop(registry);
    drop(etcd);
    drop(scratch);
    Ok(())
}
