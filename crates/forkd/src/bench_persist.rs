//! `forkd bench persist`: pause to disk and resume, end to end through the daemon's REST
//! API, on a daemon of its own (see `bench_scale::BenchDaemon`).
//!
//! - With the `python` template (512 MiB; a 1 GiB copy for sizes above 200 MiB), for
//!   each amount of memory a child dirties (a numpy array of random bytes): the guest's
//!   stall, the pause request until its VM is gone, the bytes stored against the bytes
//!   dirtied (less what an idle child's pause stores), the resume request until a first
//!   exec is answered against a cold boot measured in the same run, and the child's
//!   array checked after the resume.
//! - Density, with the `minimal` template: N sandboxes, each with a file and a
//!   background shell holding a value of its own in memory, all but a few paused; then
//!   every one resumed in turn (the others kept paused) and checked; the host's memory,
//!   the disk per paused sandbox and the wall time.
#![expect(
    clippy::cast_precision_loss,
    reason = "reports: byte counts and times become ratios and MiB shown to a few digits"
)]

use crate::bench::{median, ms};
use crate::bench_branch::{python_templates, template_for};
use crate::bench_scale::{cold_boots, delete_all, fork_and_exec, BenchDaemon, Mode};
use anyhow::{bail, Context, Result};
use forkd_daemon::client::Client;
use forkd_image::Home;
use hyper::Method;
use serde::Serialize;
use serde_json::{json, Value};
use std::time::Instant;

/// Arguments of `forkd bench persist`.
#[derive(clap::Args, Debug)]
pub struct PersistArgs {
    /// MiB a child dirties before each pause; sizes above 200 use a 1 GiB template.
    #[arg(long, value_delimiter = ',', default_value = "10,100,400",
          value_parser = clap::value_parser!(u32).range(1..=900))]
    dirty_mib: Vec<u32>,
    /// Cold boots to take the median of.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    runs: u32,
    /// Sandboxes of the density run (0: none).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=2000))]
    density: u32,
    /// Most sandboxes running at once in the density run.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=200))]
    running: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct PauseRow {
    dirty_mib: u32,
    template_mib: u32,
    /// The guest stopped for the copy's last pass.
    stall_ms: f64,
    /// From the pause request to its answer (the VM gone).
    pause_ms: f64,
    stored_bytes: u64,
    /// (stored - an idle child's stored) / dirtied.
    stored_over_dirtied: f64,
    /// The same child's fork: from the request to its answer, and to its first exec
    /// answered (a fresh restore, for comparison).
    fork_ms: f64,
    fork_to_exec_ms: f64,
    /// From the resume request to its answer (the agent answered the restored VM).
    resume_ms: f64,
    /// From the resume request to a first exec answered. Under TCG the first exec after
    /// any restore is slow: the guest's fork and exec paths are translated again.
    resume_to_exec_ms: f64,
    /// resume_to_exec_ms / the median cold boot.
    resume_to_cold_boot: f64,
    /// The dirtied array's checksum was the same after the resume.
    state_kept: bool,
}

#[derive(Debug, Serialize)]
struct DensityReport {
    sandboxes: u32,
    most_running: u32,
    /// Sandboxes found with their own file and in-memory value after their resume.
    kept: u32,
    /// Host memory available (MemAvailable) before the run and with everything paused
    /// but the last few running, MiB.
    mem_available_before_mib: u64,
    mem_available_paused_mib: u64,
    /// Bytes the pause images hold, per paused sandbox and in all.
    stored_per_paused_bytes: u64,
    stored_total_bytes: u64,
    /// Median pause and resume-to-exec, ms.
    median_pause_ms: f64,
    median_resume_to_exec_ms: f64,
    wall_s: f64,
}

#[derive(Debug, Serialize)]
struct PersistReport {
    accel: String,
    qemu: String,
    median_cold_boot_ms: f64,
    idle_stored_bytes: u64,
    pauses: Vec<PauseRow>,
    density: Option<DensityReport>,
}

pub async fn run(home: &Home, args: PersistArgs) -> Result<()> {
    let say = |m: &str| {
        if !args.json {
            eprintln!("[forkd] {m}");
        }
    };
    let (_, assets, opts) =
        crate::bench::template_parts(home, "python", forkd_hypervisor::AccelChoice::Auto).await?;
    let accel = forkd_hypervisor::accel::resolve(opts.accel)?;
    let hv = forkd_qemu::hypervisor();
    let cold = cold_boots(home, &assets, &opts, args.runs, &say).await?;
    let median_cold_boot_ms = median(cold);
    say(&format!("median cold boot: {median_cold_boot_ms:.0} ms"));

    let daemon = BenchDaemon::start(home, args.running as usize + 8).await?;
    let c = &daemon.client;
    let tags = python_templates(&daemon, &args.dirty_mib, &say).await?;

    // What a child that dirtied nothing stores: its share of the runtime's own pages.
    let (ids, _) = fork_and_exec(c, &tags[0].1, 1, Mode::Fresh).await?;
    let idle: Value = post(c, &ids[0], "pause").await?;
    let idle_stored_bytes = idle["stored_bytes"].as_u64().unwrap_or(0);
    delete_all(c, &ids).await?;
    say(&format!(
        "an idle child's pause stores {:.1} MiB",
        idle_stored_bytes as f64 / f64::from(1u32 << 20)
    ));

    let mut pauses = Vec::new();
    for &dirty in &args.dirty_mib {
        let (mib, tag) = template_for(&tags, dirty)?;
        let row = pause_once(c, &tag, mib, dirty, idle_stored_bytes, median_cold_boot_ms).await?;
        say(&format!(
            "{dirty} MiB dirtied: stall {:.1} ms, pause {:.0} ms, {:.1} MiB stored ({:.2} x dirtied beyond idle), resume {:.0} ms, to exec {:.0} ms ({:.3} x cold boot; its fork {:.0} ms, to exec {:.0} ms), state kept: {}",
            row.stall_ms,
            row.pause_ms,
            row.stored_bytes as f64 / f64::from(1u32 << 20),
            row.stored_over_dirtied,
            row.resume_ms,
            row.resume_to_exec_ms,
            row.resume_to_cold_boot,
            row.fork_ms,
            row.fork_to_exec_ms,
            row.state_kept
        ));
        pauses.push(row);
    }
    let density = if args.density > 0 {
        let tag = build(c, "minimal", "bench-mini", &say).await?;
        Some(density(c, &tag, args.density, args.running, &say).await?)
    } else {
        None
    };
    drop(daemon);
    let report = PersistReport {
        accel: accel.to_string(),
        qemu: forkd_core::template::hypervisor_version(hv.as_ref()),
        median_cold_boot_ms,
        idle_stored_bytes,
        pauses,
        density,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

async fn build(c: &Client, template: &str, tag: &str, say: &dyn Fn(&str)) -> Result<String> {
    say(&format!("building {template} as {tag}"));
    let info = crate::snapshots::build_template(c, template, Some(tag), false).await?;
    Ok(info["tag"].as_str().context("no tag")?.to_owned())
}

async fn post(c: &Client, id: &str, verb: &str) -> Result<Value> {
    c.json(Method::POST, &format!("/v1/sandboxes/{id}/{verb}"), None)
        .await
        .with_context(|| format!("{verb} of {id}"))
}

async fn run_code(c: &Client, id: &str, code: &str) -> Result<String> {
    let v: Value = c
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{id}/code"),
            Some(&json!({ "code": code, "timeout_s": 600 })),
        )
        .await?;
    if !v["error"].is_null() {
        bail!("code in {id}: {}", v["error"]);
    }
    Ok(v["results"][0]["text"]
        .as_str()
        .with_context(|| format!("code in {id} gave no value: {v}"))?
        .to_owned())
}

async fn shell(c: &Client, id: &str, script: &str) -> Result<String> {
    let v: Value = c
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(&json!({ "shell": script })),
        )
        .await
        .with_context(|| format!("exec in {id}"))?;
    if v["exit_code"] != 0 {
        bail!("exec in {id} answered {v}");
    }
    let out = v["stdout_b64"].as_str().unwrap_or_default();
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD.decode(out)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// A fresh child of `tag` dirties `dirty` MiB, is paused and resumed.
async fn pause_once(
    c: &Client,
    tag: &str,
    mib: u32,
    dirty: u32,
    idle_stored: u64,
    cold_ms: f64,
) -> Result<PauseRow> {
    let t = Instant::now();
    let (ids, created) = fork_and_exec(c, tag, 1, Mode::Fresh).await?;
    let (fork_ms, fork_to_exec_ms) = (ms(created), ms(t.elapsed()));
    let id = &ids[0];
    // Random bytes generated in place: `dirty` MiB of new, incompressible pages.
    let sum = run_code(
        c,
        id,
        &format!(
            "import numpy as np\n_bench_dirty = np.random.randint(0, 256, size={dirty} << 20, dtype=np.uint8)\nint(_bench_dirty.sum())"
        ),
    )
    .await
    .context("dirtying the child's memory")?;
    let t = Instant::now();
    let p = post(c, id, "pause").await?;
    let pause_ms = ms(t.elapsed());
    let t = Instant::now();
    post(c, id, "resume").await?;
    let resume_ms = ms(t.elapsed());
    shell(c, id, "true").await?;
    let resume_to_exec_ms = ms(t.elapsed());
    let after = run_code(c, id, "int(_bench_dirty.sum())").await?;
    delete_all(c, &ids).await?;
    let stored_bytes = p["stored_bytes"].as_u64().unwrap_or(0);
    Ok(PauseRow {
        dirty_mib: dirty,
        template_mib: mib,
        stall_ms: p["stall_ms"].as_f64().unwrap_or(0.0),
        pause_ms,
        stored_bytes,
        stored_over_dirtied: stored_bytes.saturating_sub(idle_stored) as f64
            / f64::from(dirty << 20),
        fork_ms,
        fork_to_exec_ms,
        resume_ms,
        resume_to_exec_ms,
        resume_to_cold_boot: resume_to_exec_ms / cold_ms,
        state_kept: !sum.is_empty() && after == sum,
    })
}

/// Sets up a sandbox of the density run: a file and a background shell holding a value
/// of its own, in memory only, which it writes out when told.
const SET_UP: &str = "echo \"$(hostname)\" > /root/mine; mkfifo /tmp/go; \
    (v=\"$(hostname)-$$\"; read x < /tmp/go; echo \"$v\" > /tmp/out) >/dev/null 2>&1 & \
    sleep 0.1; echo ok";

/// Has the background shell write its value out and prints the file and the value.
const CHECK: &str = "echo go > /tmp/go; for i in $(seq 50); do [ -s /tmp/out ] && break; \
    sleep 0.1; done; echo \"$(cat /root/mine) $(cat /tmp/out)\"";

fn mem_available_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))?
                .split_whitespace()
                .nth(1)?
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib >> 10)
}

async fn density(
    c: &Client,
    tag: &str,
    n: u32,
    running: u32,
    say: &dyn Fn(&str),
) -> Result<DensityReport> {
    let t0 = Instant::now();
    let mem_before = mem_available_mib();
    let mut ids: Vec<String> = Vec::new();
    let mut pause_ms = Vec::new();
    let mut stored = 0u64;
    // Made in batches of at most `running`, each paused before the next is made: all
    // but the last batch end paused.
    while ids.len() < n as usize {
        for id in &ids[pause_ms.len()..] {
            let t = Instant::now();
            let p = post(c, id, "pause").await?;
            pause_ms.push(ms(t.elapsed()));
            stored += p["stored_bytes"].as_u64().unwrap_or(0);
        }
        let batch = running.min(n - u32::try_from(ids.len())?);
        let (made, _) = fork_and_exec(c, tag, batch, Mode::Fresh).await?;
        for r in futures::future::join_all(made.iter().map(|id| shell(c, id, SET_UP))).await {
            r?;
        }
        ids.extend(made);
        say(&format!(
            "{} of {n} made, {} paused",
            ids.len(),
            pause_ms.len()
        ));
    }
    let mem_paused = mem_available_mib();
    let paused = u64::try_from(pause_ms.len())?.max(1);
    // Every one resumed in turn and checked; the one before it paused again, so that
    // at most `running` (plus one) run at once.
    let mut kept = 0u32;
    let mut resume_ms = Vec::new();
    let mut previous: Option<String> = None;
    for (i, id) in ids.iter().enumerate() {
        let v: Value = c
            .json(Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await?;
        let was_paused = v["status"] == "paused";
        let t = Instant::now();
        let out = shell(c, id, CHECK).await?;
        if was_paused {
            resume_ms.push(ms(t.elapsed()));
        }
        let mut words = out.split_whitespace();
        if let (Some(file), Some(value)) = (words.next(), words.next()) {
            if file == id && value.starts_with(&format!("{id}-")) {
                kept += 1;
            }
        }
        if let Some(p) = previous.take() {
            post(c, &p, "pause").await?;
        }
        if was_paused {
            previous = Some(id.clone());
        }
        if (i + 1) % 50 == 0 {
            say(&format!(
                "{} of {n} resumed and checked, {kept} whole",
                i + 1
            ));
        }
    }
    delete_all(c, &ids).await?;
    Ok(DensityReport {
        sandboxes: n,
        most_running: running,
        kept,
        mem_available_before_mib: mem_before,
        mem_available_paused_mib: mem_paused,
        stored_per_paused_bytes: stored / paused,
        stored_total_bytes: stored,
        median_pause_ms: median(pause_ms),
        median_resume_to_exec_ms: median(resume_ms),
        wall_s: t0.elapsed().as_secs_f64(),
    })
}

fn print_report(r: &PersistReport) {
    println!("persist benchmark: accel {}, {}", r.accel, r.qemu);
    println!(
        "median cold boot {:.0} ms; an idle child's pause stores {:.1} MiB",
        r.median_cold_boot_ms,
        r.idle_stored_bytes as f64 / f64::from(1u32 << 20)
    );
    println!(
        "{:>6} {:>5} {:>9} {:>9} {:>11} {:>15} {:>10} {:>13} {:>11} {:>5}",
        "dirty",
        "RAM",
        "stall ms",
        "pause ms",
        "stored MiB",
        "beyond idle/d.",
        "resume",
        "resume+exec",
        "/cold boot",
        "kept"
    );
    for p in &r.pauses {
        println!(
            "{:>6} {:>5} {:>9.1} {:>9.0} {:>11.1} {:>15.2} {:>7.0} ms {:>10.0} ms {:>11.3} {:>5}",
            p.dirty_mib,
            p.template_mib,
            p.stall_ms,
            p.pause_ms,
            p.stored_bytes as f64 / f64::from(1u32 << 20),
            p.stored_over_dirtied,
            p.resume_ms,
            p.resume_to_exec_ms,
            p.resume_to_cold_boot,
            p.state_kept
        );
    }
    if let Some(d) = &r.density {
        println!(
            "density: {} sandboxes, at most {} running: {} of {} whole after their resume",
            d.sandboxes, d.most_running, d.kept, d.sandboxes
        );
        println!(
            "  host memory available {} MiB before, {} MiB with all but {} paused",
            d.mem_available_before_mib, d.mem_available_paused_mib, d.most_running
        );
        println!(
            "  pause images: {:.1} MiB per paused sandbox, {:.1} MiB in all",
            d.stored_per_paused_bytes as f64 / f64::from(1u32 << 20),
            d.stored_total_bytes as f64 / f64::from(1u32 << 20)
        );
        println!(
            "  median pause {:.0} ms, median resume to exec {:.0} ms; wall time {:.0} s",
            d.median_pause_ms, d.median_resume_to_exec_ms, d.wall_s
        );
    }
}
