//! `forkd bench scale`: many children on one host, end to end through the daemon's REST
//! API, with and without the warm pool.
//!
//! The benchmark starts a daemon of its own on a private data directory beside the
//! guest assets (so the user's daemon, snapshots and sandboxes are never touched), has
//! it build the template, then for each fork size N and each mode:
//!
//! - wall time from the create request to every child having answered an exec (the
//!   median of `--wall-runs` forks, with their spread);
//! - after the children idle (2 minutes by default), how many are alive and answer;
//! - idle CPU per child: utime + stime of each child's QEMU over the end of the idle time;
//! - per child: the whole QEMU process's PSS and private memory (`smaps_rollup`), and
//!   the host's `MemAvailable` drop divided by N.
//!
//! Cold boot (what `forkd run` does: a fresh disk layer, QEMU, the kernel, the agent's
//! first answer) and single forks are measured in the same run, so that the report's
//! ratios compare figures taken on the same machine at the same time.
#![expect(
    clippy::cast_precision_loss,
    reason = "reports: byte counts, ticks and counts become ratios and MiB shown to a few digits"
)]

use crate::bench::{median, ms};
use anyhow::{bail, Context, Result};
use forkd_daemon::client::{Client, Endpoint};
use forkd_image::Home;
use hyper::Method;
use serde::Serialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How the children of a measured fork are made.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Every child restored from scratch (QEMU started by the fork).
    Fresh,
    /// Every child taken from a warm pool filled to N before the fork.
    Pool,
}

/// Arguments of `forkd bench scale`.
#[derive(clap::Args, Debug)]
pub struct ScaleArgs {
    /// The template to build and fork (a built-in name or a recipe file).
    #[arg(long, default_value = "python")]
    template: String,
    /// Fork sizes, in order.
    #[arg(long, value_delimiter = ',', default_value = "1,10,50,100",
          value_parser = clap::value_parser!(u32).range(1..=256))]
    counts: Vec<u32>,
    /// Modes to measure each size in.
    #[arg(long, value_delimiter = ',', default_value = "fresh,pool")]
    modes: Vec<Mode>,
    /// Seconds the children idle before they are checked again.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=3600))]
    idle_secs: u64,
    /// Seconds, at the end of the idle time, over which idle CPU is read.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=600))]
    cpu_window_secs: u64,
    /// Cold boots, and single forks in each mode, to take the median of.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=50))]
    runs: u32,
    /// Forks of each size and mode whose wall time is taken, to report the median of
    /// (this machine's figures drift by ~15 % between runs minutes apart); only the last
    /// one idles and is measured further.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=50))]
    wall_runs: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct ScaleReport {
    template: String,
    accel: String,
    host_cpus: usize,
    idle_secs: u64,
    cpu_window_secs: u64,
    cold_boot_ms: Vec<f64>,
    median_cold_boot_ms: f64,
    single_fork: Vec<SingleFork>,
    rows: Vec<ScaleRow>,
}

#[derive(Serialize)]
struct SingleFork {
    mode: Mode,
    /// Create request to its answer (the child's agent has answered), through the API.
    fork_runs_ms: Vec<f64>,
    median_fork_ms: f64,
    ratio_fork_to_cold_boot: f64,
    /// Create request to the child's first exec answered.
    fork_exec_runs_ms: Vec<f64>,
    median_fork_exec_ms: f64,
    ratio_fork_exec_to_cold_boot: f64,
}

#[derive(Serialize)]
struct ScaleRow {
    mode: Mode,
    count: u32,
    /// Create request to every child having answered an exec, each run.
    wall_runs_ms: Vec<f64>,
    /// Their median.
    wall_ms: f64,
    /// Children alive and answering an exec after the idle time.
    alive_after_idle: u32,
    /// Mean over the children, whole QEMU process.
    pss_mib: f64,
    private_mib: f64,
    /// MemAvailable before the fork (and before its pool was filled) minus after the
    /// idle time, divided by the count.
    host_mib: f64,
    /// Mean share of one core per child over the CPU window.
    idle_cpu_percent: f64,
    /// This row's wall time over the same mode's wall time for N = 10, when measured.
    ratio_to_n10: Option<f64>,
}

/// Runs the benchmark.
pub async fn run(home: &Home, args: ScaleArgs) -> Result<()> {
    let say = |m: &str| {
        if !args.json {
            eprintln!("[forkd] {m}");
        }
    };
    let (recipe, assets, opts) =
        crate::bench::template_parts(home, &args.template, forkd_hypervisor::AccelChoice::Auto)
            .await?;
    let accel = forkd_hypervisor::accel::resolve(opts.accel)?;
    let cold = cold_boots(home, &assets, &opts, args.runs, &say).await?;
    let median_cold = median(cold.clone());

    let most = args.counts.iter().copied().max().unwrap_or(1) as usize;
    let daemon = BenchDaemon::start(home, most + 4).await?;
    let c = &daemon.client;
    say(&format!("building template {}", recipe.name));
    let info = crate::snapshots::build_template(c, &args.template, None, false).await?;
    let tag = info["tag"]
        .as_str()
        .context("the daemon named no tag")?
        .to_owned();

    let mut single_fork = Vec::new();
    for &mode in &args.modes {
        let (mut fork_runs_ms, mut fork_exec_runs_ms) = (Vec::new(), Vec::new());
        for _ in 0..args.runs {
            if mode == Mode::Pool {
                set_pool(c, &tag, 1).await?;
            }
            let t = Instant::now();
            let (ids, created) = fork_and_exec(c, &tag, 1, mode).await?;
            fork_exec_runs_ms.push(ms(t.elapsed()));
            fork_runs_ms.push(ms(created));
            if mode == Mode::Pool {
                wait_pool(c, &tag, 0).await?;
            }
            delete_all(c, &ids).await?;
        }
        let median_fork_ms = median(fork_runs_ms.clone());
        let median_fork_exec_ms = median(fork_exec_runs_ms.clone());
        say(&format!(
            "single fork ({mode:?}): median {median_fork_ms:.0} ms (1/{:.0} of a cold boot), {median_fork_exec_ms:.0} ms with its first exec",
            median_cold / median_fork_ms
        ));
        single_fork.push(SingleFork {
            mode,
            fork_runs_ms,
            median_fork_ms,
            ratio_fork_to_cold_boot: median_fork_ms / median_cold,
            fork_exec_runs_ms,
            median_fork_exec_ms,
            ratio_fork_exec_to_cold_boot: median_fork_exec_ms / median_cold,
        });
    }

    let mut rows: Vec<ScaleRow> = Vec::new();
    for &count in &args.counts {
        for &mode in &args.modes {
            say(&format!("N = {count}, {mode:?}"));
            let row = measure(c, &tag, count, mode, &args, &say).await?;
            rows.push(row);
        }
    }
    for i in 0..rows.len() {
        let base = rows
            .iter()
            .find(|r| r.count == 10 && r.mode == rows[i].mode)
            .map(|r| r.wall_ms);
        rows[i].ratio_to_n10 = base.map(|b| rows[i].wall_ms / b);
    }
    let _ = c.delete(&format!("/v1/snapshots/{tag}")).await;
    drop(daemon);

    let report = ScaleReport {
        template: recipe.name.clone(),
        accel: accel.to_string(),
        host_cpus: forkd_core::fork::default_parallel(),
        idle_secs: args.idle_secs,
        cpu_window_secs: args.cpu_window_secs,
        cold_boot_ms: cold,
        median_cold_boot_ms: median_cold,
        single_fork,
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

/// One fork of `count` in `mode`, its idle time, and its figures.
async fn measure(
    c: &Client,
    tag: &str,
    count: u32,
    mode: Mode,
    args: &ScaleArgs,
    say: &dyn Fn(&str),
) -> Result<ScaleRow> {
    let mut wall_runs_ms = Vec::new();
    for _ in 1..args.wall_runs {
        let (ids, wall) = timed_fork(c, tag, count, mode).await?;
        say(&format!("  {count} children answered in {wall:.0} ms"));
        wall_runs_ms.push(wall);
        delete_all(c, &ids).await?;
    }
    let before = forkd_daemon::admission::mem_available().unwrap_or(0);
    let (ids, wall) = timed_fork(c, tag, count, mode).await?;
    wall_runs_ms.push(wall);
    let wall_ms = median(wall_runs_ms.clone());
    say(&format!(
        "  {count} children answered in {wall:.0} ms (median of {}: {wall_ms:.0} ms); idling {} s",
        wall_runs_ms.len(),
        args.idle_secs
    ));
    let pids = pids_of(c, &ids).await?;
    let window = args.cpu_window_secs.min(args.idle_secs);
    tokio::time::sleep(Duration::from_secs(args.idle_secs - window)).await;
    let a = cpu_ticks(&pids);
    tokio::time::sleep(Duration::from_secs(window)).await;
    let b = cpu_ticks(&pids);
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    let shares: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(a, b)| 100.0 * b.saturating_sub(*a) as f64 / hz / window as f64)
        .collect();
    let usage: Vec<_> = pids
        .iter()
        .filter_map(|p| forkd_host::smaps::process_usage(*p))
        .collect();
    let mean_mib = |f: &dyn Fn(&forkd_host::smaps::MappingUsage) -> u64| {
        usage.iter().map(|u| f(u) as f64).sum::<f64>() / usage.len().max(1) as f64 / MIB
    };
    let pss_mib = mean_mib(&|u| u.pss);
    let private_mib = mean_mib(&|u| u.private_clean + u.private_dirty);
    let after = forkd_daemon::admission::mem_available().unwrap_or(0);
    let host_mib = before.saturating_sub(after) as f64 / f64::from(count) / MIB;
    let answers = futures::future::join_all(ids.iter().map(|id| exec_true(c, id))).await;
    let alive_after_idle = u32::try_from(answers.iter().filter(|r| r.is_ok()).count())?;
    delete_all(c, &ids).await?;
    let idle_cpu_percent = shares.iter().sum::<f64>() / shares.len().max(1) as f64;
    say(&format!(
        "  {alive_after_idle}/{count} answer after idling; {idle_cpu_percent:.2} % of a core, PSS {pss_mib:.1} MiB, private {private_mib:.1} MiB, host {host_mib:.1} MiB per child"
    ));
    Ok(ScaleRow {
        mode,
        count,
        wall_runs_ms,
        wall_ms,
        alive_after_idle,
        pss_mib,
        private_mib,
        host_mib,
        idle_cpu_percent,
        ratio_to_n10: None,
    })
}

const MIB: f64 = 1024.0 * 1024.0;

/// One fork of `count` in `mode` (its pool filled first), timed from the create request
/// to every child having answered an exec; returns the children and the time in ms.
async fn timed_fork(c: &Client, tag: &str, count: u32, mode: Mode) -> Result<(Vec<String>, f64)> {
    if mode == Mode::Pool {
        set_pool(c, tag, count).await?;
    }
    let t = Instant::now();
    let (ids, _) = fork_and_exec(c, tag, count, mode).await?;
    let wall = ms(t.elapsed());
    if mode == Mode::Pool {
        wait_pool(c, tag, 0).await?;
    }
    Ok((ids, wall))
}

/// Forks `count` children of `tag` through the API and runs `true` in each; returns
/// their ids once every one has answered, and how long the create request took. In pool
/// mode the pool is then set to 0 before
/// the execs: its refill is not the children's work, and must not be measured as such.
/// `runs` cold boots of `assets` one after the other, each from the call to the agent's
/// first answer (what `forkd run` does before its command: a disk layer, QEMU, the
/// agent), in ms.
pub(crate) async fn cold_boots(
    home: &Home,
    assets: &forkd_image::GuestAssets,
    opts: &forkd_core::SandboxOptions,
    runs: u32,
    say: &dyn Fn(&str),
) -> Result<Vec<f64>> {
    let hv = forkd_qemu::hypervisor();
    let mut cold = Vec::new();
    for i in 0..runs {
        let t = Instant::now();
        let sb = forkd_core::Sandbox::boot(hv.as_ref(), home, assets, opts)
            .await
            .with_context(|| format!("cold boot {}", i + 1))?;
        cold.push(ms(t.elapsed()));
        sb.destroy().await?;
        say(&format!(
            "cold boot {}/{runs}: {:.0} ms",
            i + 1,
            cold[cold.len() - 1]
        ));
    }
    Ok(cold)
}

pub(crate) async fn fork_and_exec(
    c: &Client,
    tag: &str,
    count: u32,
    mode: Mode,
) -> Result<(Vec<String>, Duration)> {
    let t = Instant::now();
    let v: Value = c
        .json(
            Method::POST,
            "/v1/sandboxes",
            Some(&json!({ "snapshot": tag, "n": count, "labels": {"bench": "scale"} })),
        )
        .await
        .with_context(|| format!("forking {count} children of {tag}"))?;
    let created = t.elapsed();
    let ids: Vec<String> = v["sandboxes"]
        .as_array()
        .context("no sandboxes in the answer")?
        .iter()
        .filter_map(|s| s["id"].as_str().map(str::to_owned))
        .collect();
    if mode == Mode::Pool {
        put_pool(c, tag, 0).await?;
    }
    for r in futures::future::join_all(ids.iter().map(|id| exec_true(c, id))).await {
        r?;
    }
    Ok((ids, created))
}

async fn exec_true(c: &Client, id: &str) -> Result<()> {
    let v: Value = c
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({ "cmd": ["true"] })),
        )
        .await
        .with_context(|| format!("exec in {id}"))?;
    if v["exit_code"] != 0 {
        bail!("exec in {id} answered {v}");
    }
    Ok(())
}

pub(crate) async fn pids_of(c: &Client, ids: &[String]) -> Result<Vec<u32>> {
    let mut pids = Vec::new();
    for id in ids {
        let v: Value = c
            .json(Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await?;
        pids.push(u32::try_from(v["pid"].as_u64().context("no pid")?)?);
    }
    Ok(pids)
}

pub(crate) async fn delete_all(c: &Client, ids: &[String]) -> Result<()> {
    let deletes = ids
        .iter()
        .map(|id| async move { c.delete(&format!("/v1/sandboxes/{id}")).await });
    for r in futures::future::join_all(deletes).await {
        r?;
    }
    Ok(())
}

/// Sets the pool of `tag` to `size` and waits until it holds exactly that many ready.
async fn set_pool(c: &Client, tag: &str, size: u32) -> Result<()> {
    put_pool(c, tag, size).await?;
    wait_pool(c, tag, size).await
}

async fn put_pool(c: &Client, tag: &str, size: u32) -> Result<()> {
    let path = format!("/v1/snapshots/{tag}/pool");
    let _: Value = c
        .json(Method::PUT, &path, Some(&json!({ "size": size })))
        .await?;
    Ok(())
}

/// Waits until the pool of `tag` holds exactly `size` members ready.
async fn wait_pool(c: &Client, tag: &str, size: u32) -> Result<()> {
    let path = format!("/v1/snapshots/{tag}/pool");
    // Members are made one at a time: allow each a generous minute.
    let deadline = Instant::now() + Duration::from_secs(60 + 60 * u64::from(size));
    loop {
        let v: Value = c.json(Method::GET, &path, None).await?;
        if v["idle"] == size && v["filling"] == 0 {
            return Ok(());
        }
        if let Some(e) = v["error"].as_str() {
            bail!("the pool of {tag} could not be filled: {e}");
        }
        if Instant::now() > deadline {
            bail!("the pool of {tag} did not reach {size} members: {v}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// utime + stime of each process, in clock ticks (0 for one that is gone).
fn cpu_ticks(pids: &[u32]) -> Vec<u64> {
    pids.iter()
        .map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // Fields after the command name (which may hold spaces): state is the
            // first, utime the 12th, stime the 13th.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let f: Vec<&str> = rest.split_whitespace().collect();
            let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            get(11) + get(12)
        })
        .collect()
}

/// A daemon of the benchmark's own, on a private data directory, stopped (with every
/// VM of the directory) when dropped.
pub(crate) struct BenchDaemon {
    /// Its data directory.
    pub(crate) dir: PathBuf,
    process: std::process::Child,
    /// A client on its socket.
    pub(crate) client: Client,
}

impl BenchDaemon {
    pub(crate) async fn start(home: &Home, max_sandboxes: usize) -> Result<BenchDaemon> {
        BenchDaemon::start_with(home, max_sandboxes, &[]).await
    }

    /// A daemon started with `extra` arguments too.
    pub(crate) async fn start_with(
        home: &Home,
        max_sandboxes: usize,
        extra: &[String],
    ) -> Result<BenchDaemon> {
        // Beside the assets: one filesystem, so that the snapshot hard-links them.
        let parent = home.root().join("bench");
        std::fs::create_dir_all(&parent)
            .with_context(|| format!("creating {}", parent.display()))?;
        let dir = parent.join(format!("scale-{}", forkd_host::ids::random_hex(6)));
        std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        std::os::unix::fs::symlink(home.images_dir(), dir.join("images"))?;
        let socket = dir.join("forkd.sock");
        let log = std::fs::File::create(dir.join("daemon.log"))?;
        let process = std::process::Command::new(std::env::current_exe()?)
            .arg("daemon")
            .arg("--socket")
            .arg(&socket)
            .arg("--max-sandboxes")
            .arg(max_sandboxes.to_string())
            .args(extra)
            .env("FORKD_HOME", &dir)
            .env_remove("FORKD_URL")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting the benchmark's daemon")?;
        let client = Client::new(Endpoint::Unix(socket), None);
        let mut d = BenchDaemon {
            dir,
            process,
            client,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while d
            .client
            .call(Method::GET, "/v1/health", None)
            .await
            .is_err()
        {
            if let Some(status) = d.process.try_wait()? {
                bail!(
                    "the benchmark's daemon exited ({status}): {}",
                    std::fs::read_to_string(d.dir.join("daemon.log")).unwrap_or_default()
                );
            }
            if Instant::now() > deadline {
                bail!("the benchmark's daemon did not answer within a minute");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(d)
    }
}

impl Drop for BenchDaemon {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.process.id()).expect("a pid")),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.process.wait();
        // Children outlive their daemon by design: end whatever the directory still runs.
        forkd_host::process::kill_vm(0, 0, &self.dir);
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("[forkd] removing {}: {e}", self.dir.display());
        }
    }
}

fn print_report(r: &ScaleReport) {
    println!(
        "scale benchmark: template {}, accel {}, {} host CPUs, idle {} s (CPU over the last {} s)",
        r.template, r.accel, r.host_cpus, r.idle_secs, r.cpu_window_secs
    );
    println!(
        "  cold boot (forkd run to the first answer), median {:.0} ms",
        r.median_cold_boot_ms
    );
    for s in &r.single_fork {
        println!(
            "  one fork through the API ({:?}), median {:.0} ms = 1/{:.0} of a cold boot; with its first exec {:.0} ms = 1/{:.0}",
            s.mode,
            s.median_fork_ms,
            1.0 / s.ratio_fork_to_cold_boot,
            s.median_fork_exec_ms,
            1.0 / s.ratio_fork_exec_to_cold_boot
        );
    }
    println!(
        "  {:>5} {:>5} {:>10} {:>13} {:>7} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "mode",
        "N",
        "wall ms",
        "(min-max)",
        "alive",
        "PSS MiB",
        "priv MiB",
        "host MiB",
        "idle CPU",
        "vs N=10"
    );
    for row in &r.rows {
        let low = row
            .wall_runs_ms
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min);
        let high = row.wall_runs_ms.iter().copied().fold(0.0, f64::max);
        println!(
            "  {:>5} {:>5} {:>10.0} {:>13} {:>3}/{:<3} {:>9.1} {:>9.1} {:>9.1} {:>8.2}% {:>8}",
            format!("{:?}", row.mode).to_lowercase(),
            row.count,
            row.wall_ms,
            format!("({low:.0}-{high:.0})"),
            row.alive_after_idle,
            row.count,
            row.pss_mib,
            row.private_mib,
            row.host_mib,
            row.idle_cpu_percent,
            row.ratio_to_n10.map_or("-".into(), |x| format!("{x:.2}"))
        );
    }
}
