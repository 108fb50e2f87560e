//! `forkd bench branch`: BRANCH end to end through the daemon's REST API.
//!
//! On a daemon of its own (see `bench_scale::BenchDaemon`), with the `python` template
//! (512 MiB) and a 1 GiB copy of it:
//!
//! - for each amount of memory the source has dirtied (a numpy array of random bytes
//!   held by a Python variable) and each mode, one branch of a fresh child: how long the source was
//!   stopped, the whole capture, the bytes stored, and the time from the branch request
//!   to the first child of the branch answering an exec;
//! - forks of one child (to its first exec) from chains of depth 0 to 3, each link a
//!   branch of a child of the link before.
//!
//! Every figure is taken in the same run, so the ratios compare like with like.
#![expect(
    clippy::cast_precision_loss,
    reason = "reports: byte counts, ticks and counts become ratios and MiB shown to a few digits"
)]

use crate::bench::{median, ms};
use crate::bench_scale::{delete_all, fork_and_exec, BenchDaemon, Mode};
use anyhow::{bail, Context, Result};
use forkd_daemon::client::Client;
use forkd_image::Home;
use hyper::Method;
use serde::Serialize;
use serde_json::{json, Value};
use std::time::Instant;

/// Arguments of `forkd bench branch`.
#[derive(clap::Args, Debug)]
pub struct BranchArgs {
    /// MiB the source dirties before each branch; sizes above 200 use the 1 GiB template.
    #[arg(long, value_delimiter = ',', default_value = "10,100,400",
          value_parser = clap::value_parser!(u32).range(1..=900))]
    dirty_mib: Vec<u32>,
    /// Forks from each chain depth to take the median of.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=50))]
    runs: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Above this many dirtied MiB the 1 GiB template is used.
pub(crate) const LARGE_DIRTY_MIB: u32 = 200;

#[derive(Debug, Serialize)]
struct BranchRow {
    dirty_mib: u32,
    template_mib: u32,
    mode: String,
    pause_ms: f64,
    copy_ms: f64,
    /// From the branch request to the snapshot published.
    branch_ms: f64,
    /// From the branch request to the first child of the branch answering an exec.
    to_first_child_ms: f64,
    stream_bytes: u64,
    pages_changed: u64,
    diff_bytes: u64,
    /// Bytes stored per byte dirtied.
    diff_per_dirtied: f64,
}

#[derive(Debug, Serialize)]
struct DepthRow {
    depth: u32,
    fork_exec_runs_ms: Vec<f64>,
    median_fork_exec_ms: f64,
    ratio_to_depth_0: f64,
}

#[derive(Debug, Serialize)]
struct BranchReport {
    accel: String,
    qemu: String,
    branches: Vec<BranchRow>,
    /// `live` pause over `pause` pause, per dirtied size.
    live_to_pause: Vec<(u32, f64)>,
    chain_forks: Vec<DepthRow>,
}

pub async fn run(home: &Home, args: BranchArgs) -> Result<()> {
    let say = |m: &str| {
        if !args.json {
            eprintln!("[forkd] {m}");
        }
    };
    let daemon = BenchDaemon::start(home, 16).await?;
    let c = &daemon.client;
    let tags = python_templates(&daemon, &args.dirty_mib, &say).await?;
    let info: Value = c
        .json(Method::GET, &format!("/v1/snapshots/{}", tags[0].1), None)
        .await?;
    let accel = info["accel"].as_str().unwrap_or("?").to_owned();

    let mut rows = Vec::new();
    for &dirty in &args.dirty_mib {
        let (mib, tag) = template_for(&tags, dirty)?;
        for mode in ["pause", "live"] {
            let row = branch_once(c, &tag, mib, dirty, mode).await?;
            say(&format!(
                "{dirty} MiB dirtied ({mib} MiB template), {mode}: paused {:.1} ms, captured in {:.0} ms, {:.1} MiB stored, first child after {:.0} ms",
                row.pause_ms,
                row.copy_ms,
                row.diff_bytes as f64 / f64::from(1u32 << 20),
                row.to_first_child_ms
            ));
            rows.push(row);
        }
    }
    let live_to_pause = args
        .dirty_mib
        .iter()
        .filter_map(|&d| {
            let p = rows
                .iter()
                .find(|r| r.dirty_mib == d && r.mode == "pause")?;
            let l = rows.iter().find(|r| r.dirty_mib == d && r.mode == "live")?;
            Some((d, l.pause_ms / p.pause_ms))
        })
        .collect();

    say("chains of depth 0 to 3");
    let chain_forks = chain_depths(c, &tags[0].1, args.runs, &say).await?;
    drop(daemon);
    let report = BranchReport {
        accel,
        qemu: forkd_core::template::hypervisor_version(forkd_qemu::hypervisor().as_ref()),
        branches: rows,
        live_to_pause,
        chain_forks,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

/// Builds the python template (512 MiB) as `bench-512` and, when a size of `dirty_mib`
/// is above [`LARGE_DIRTY_MIB`], a 1 GiB copy of it as `bench-1024`. Returns (MiB, tag)
/// of each.
pub(crate) async fn python_templates(
    daemon: &BenchDaemon,
    dirty_mib: &[u32],
    say: &dyn Fn(&str),
) -> Result<Vec<(u32, String)>> {
    let mut templates = vec![(512u32, "python".to_owned())];
    if dirty_mib.iter().any(|&d| d > LARGE_DIRTY_MIB) {
        let text = forkd_core::template::BUILTIN
            .iter()
            .find(|(n, _)| *n == "python")
            .map(|(_, t)| *t)
            .context("the python recipe")?
            .replace("memory_mib = 512", "memory_mib = 1024");
        let path = daemon.dir.join("python-1g.toml");
        std::fs::write(&path, text)?;
        templates.push((1024, path.to_string_lossy().into_owned()));
    }
    let mut tags = Vec::new();
    for (mib, t) in &templates {
        say(&format!("building the {mib} MiB template"));
        let info = crate::snapshots::build_template(
            &daemon.client,
            t,
            Some(&format!("bench-{mib}")),
            false,
        )
        .await?;
        tags.push((*mib, info["tag"].as_str().context("no tag")?.to_owned()));
    }
    Ok(tags)
}

/// The template of `tags` (see [`python_templates`]) a child dirtying `dirty` MiB uses.
pub(crate) fn template_for(tags: &[(u32, String)], dirty: u32) -> Result<(u32, String)> {
    tags.iter()
        .find(|(m, _)| (dirty > LARGE_DIRTY_MIB) == (*m > 512))
        .cloned()
        .context("a template for the size")
}

/// A fresh child of `tag` dirties `dirty` MiB, is branched in `mode`, and the branch's
/// first child answers.
async fn branch_once(c: &Client, tag: &str, mib: u32, dirty: u32, mode: &str) -> Result<BranchRow> {
    let (ids, _) = fork_and_exec(c, tag, 1, Mode::Fresh).await?;
    let source = ids[0].clone();
    // Random bytes generated in place: exactly `dirty` MiB of new, incompressible pages
    // (`bytearray(os.urandom(n))` would dirty twice as much, the bytes and their copy).
    let code = format!(
        "import numpy as np\n_bench_dirty = np.random.randint(0, 256, size={dirty} << 20, dtype=np.uint8)\n_bench_dirty.nbytes"
    );
    let v: Value = c
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{source}/code"),
            Some(&json!({ "code": code, "timeout_s": 600 })),
        )
        .await
        .context("dirtying the source's memory")?;
    if !v["error"].is_null() {
        bail!("dirtying the source's memory: {}", v["error"]);
    }
    let branch_tag = format!("bench-br-{}", forkd_host::ids::random_hex(3));
    let t = Instant::now();
    let b: Value = c
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{source}/branch"),
            Some(&json!({ "tag": branch_tag, "mode": mode })),
        )
        .await
        .with_context(|| format!("branching {source} ({mode})"))?;
    let branch_ms = ms(t.elapsed());
    let (children, _) = fork_and_exec(c, &branch_tag, 1, Mode::Fresh).await?;
    let to_first_child_ms = ms(t.elapsed());
    delete_all(c, &children).await?;
    delete_all(c, &[source]).await?;
    c.delete(&format!("/v1/snapshots/{branch_tag}")).await?;
    let f = |k: &str| b[k].as_f64().unwrap_or(0.0);
    let u = |k: &str| b[k].as_u64().unwrap_or(0);
    Ok(BranchRow {
        dirty_mib: dirty,
        template_mib: mib,
        mode: mode.to_owned(),
        pause_ms: f("pause_ms"),
        copy_ms: f("copy_ms"),
        branch_ms,
        to_first_child_ms,
        stream_bytes: u("transferred_bytes"),
        pages_changed: u("pages_changed"),
        diff_bytes: u("diff_bytes"),
        diff_per_dirtied: u("diff_bytes") as f64 / f64::from(dirty << 20),
    })
}

/// Builds a chain of depth 3 over `tag` (each link a live branch of a child of the one
/// before, which wrote a little) and times forks of one child from each depth.
async fn chain_depths(
    c: &Client,
    tag: &str,
    runs: u32,
    say: &dyn Fn(&str),
) -> Result<Vec<DepthRow>> {
    let mut links = vec![tag.to_owned()];
    for depth in 1..=3 {
        let (ids, _) = fork_and_exec(c, &links[depth - 1], 1, Mode::Fresh).await?;
        let v: Value = c
            .json(
                Method::POST,
                &format!("/v1/sandboxes/{}/code", ids[0]),
                Some(&json!({ "code": format!("link_{depth} = list(range(100000))") })),
            )
            .await?;
        if !v["error"].is_null() {
            bail!("writing in the link's source: {}", v["error"]);
        }
        let link = format!("bench-chain-{depth}-{}", forkd_host::ids::random_hex(2));
        c.json::<Value>(
            Method::POST,
            &format!("/v1/sandboxes/{}/branch", ids[0]),
            Some(&json!({ "tag": link })),
        )
        .await
        .with_context(|| format!("branching chain link {depth}"))?;
        delete_all(c, &ids).await?;
        links.push(link);
    }
    let mut rows: Vec<DepthRow> = Vec::new();
    // Interleaved, so that a slow moment of the host does not land on one depth only.
    let mut runs_ms = vec![Vec::new(); links.len()];
    for _ in 0..runs {
        for (depth, link) in links.iter().enumerate() {
            let t = Instant::now();
            let (ids, _) = fork_and_exec(c, link, 1, Mode::Fresh).await?;
            runs_ms[depth].push(ms(t.elapsed()));
            delete_all(c, &ids).await?;
        }
    }
    for (depth, r) in runs_ms.into_iter().enumerate() {
        let m = median(r.clone());
        let base = rows.first().map_or(m, |d| d.median_fork_exec_ms);
        say(&format!(
            "depth {depth}: median fork to first exec {m:.0} ms"
        ));
        rows.push(DepthRow {
            depth: u32::try_from(depth)?,
            fork_exec_runs_ms: r,
            median_fork_exec_ms: m,
            ratio_to_depth_0: m / base,
        });
    }
    for link in links.iter().skip(1).rev() {
        c.delete(&format!("/v1/snapshots/{link}")).await?;
    }
    Ok(rows)
}

fn print_report(r: &BranchReport) {
    println!("branch benchmark: accel {}, {}", r.accel, r.qemu);
    println!(
        "{:>6} {:>5} {:>6} {:>9} {:>9} {:>10} {:>12} {:>10} {:>9}",
        "dirty",
        "RAM",
        "mode",
        "pause ms",
        "copy ms",
        "branch ms",
        "1st child ms",
        "stored MiB",
        "stored/dirtied"
    );
    for b in &r.branches {
        println!(
            "{:>6} {:>5} {:>6} {:>9.1} {:>9.0} {:>10.0} {:>12.0} {:>10.1} {:>9.2}",
            b.dirty_mib,
            b.template_mib,
            b.mode,
            b.pause_ms,
            b.copy_ms,
            b.branch_ms,
            b.to_first_child_ms,
            b.diff_bytes as f64 / f64::from(1u32 << 20),
            b.diff_per_dirtied
        );
    }
    for (d, ratio) in &r.live_to_pause {
        println!("{d} MiB dirtied: live pause = {ratio:.3} x pause pause");
    }
    for d in &r.chain_forks {
        println!(
            "chain depth {}: fork + first exec median {:.0} ms ({:.2} x depth 0)",
            d.depth, d.median_fork_exec_ms, d.ratio_to_depth_0
        );
    }
}
