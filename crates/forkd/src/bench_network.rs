//! `forkd bench network`: what a network of its own costs a child, end to end through
//! the daemon's REST API.
//!
//! On a daemon of its own (see `bench_scale::BenchDaemon`), one template is built twice
//! from the same recipe, with `network = "nat"` and with `network = "none"`. For each,
//! in the same run: single forks (the create request to the child answering an exec,
//! median of `--runs`), then a fork of N at once, with each child's whole-QEMU PSS and
//! private memory and the host's `MemAvailable` drop per child. The ratios nat/none
//! compare figures taken on the same machine at the same time.
#![expect(
    clippy::cast_precision_loss,
    reason = "reports: byte counts, ticks and counts become ratios and MiB shown to a few digits"
)]

use crate::bench::{median, ms};
use crate::bench_scale::{delete_all, fork_and_exec, pids_of, BenchDaemon, Mode};
use anyhow::{Context, Result};
use forkd_image::Home;
use serde::Serialize;
use std::time::Instant;

/// Arguments of `forkd bench network`.
#[derive(clap::Args, Debug)]
pub struct NetworkArgs {
    /// The template to build and fork (a built-in name).
    #[arg(long, default_value = "minimal")]
    template: String,
    /// Single forks to take the median of, per variant.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    /// Children forked at once, per variant.
    #[arg(short = 'n', long = "count", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=256))]
    count: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Variant {
    network: &'static str,
    single_fork_runs_ms: Vec<f64>,
    median_single_fork_ms: f64,
    /// The fork of N: the create request to every child answering an exec.
    fork_n_ms: f64,
    pss_mib: f64,
    private_mib: f64,
    host_mib: f64,
}

#[derive(Debug, Serialize)]
struct NetworkReport {
    template: String,
    count: u32,
    variants: Vec<Variant>,
    /// nat over none: median single fork, fork of N, PSS per child.
    single_fork_ratio: f64,
    fork_n_ratio: f64,
    pss_ratio: f64,
}

const MIB: f64 = 1024.0 * 1024.0;

pub async fn run(home: &Home, args: NetworkArgs) -> Result<()> {
    let say = |m: &str| {
        if !args.json {
            eprintln!("[forkd] {m}");
        }
    };
    if let Some(why) = forkd_host::network::unavailable() {
        anyhow::bail!("this host cannot give sandboxes networks: {why}");
    }
    let recipe = forkd_core::template::BUILTIN
        .iter()
        .find(|(n, _)| *n == args.template)
        .map(|(_, t)| *t)
        .with_context(|| format!("no built-in template {}", args.template))?;
    let daemon = BenchDaemon::start(home, (args.count as usize + 4).max(16)).await?;
    let c = &daemon.client;
    let mut variants = Vec::new();
    for network in ["nat", "none"] {
        // Top-level keys go before the recipe's tables.
        let path = daemon.dir.join(format!("{}-{network}.toml", args.template));
        std::fs::write(&path, format!("network = \"{network}\"\n{recipe}"))?;
        say(&format!(
            "building {} with network = \"{network}\"",
            args.template
        ));
        let tag = format!("bench-{network}");
        crate::snapshots::build_template(c, &path.to_string_lossy(), Some(&tag), false).await?;

        let mut runs = Vec::new();
        for _ in 0..args.runs {
            let t = Instant::now();
            let (ids, _) = fork_and_exec(c, &tag, 1, Mode::Fresh).await?;
            runs.push(ms(t.elapsed()));
            delete_all(c, &ids).await?;
        }
        let median_single = median(runs.clone());
        say(&format!(
            "  one fork: {median_single:.0} ms (median of {})",
            args.runs
        ));

        let before = forkd_daemon::admission::mem_available().unwrap_or(0);
        let t = Instant::now();
        let (ids, _) = fork_and_exec(c, &tag, args.count, Mode::Fresh).await?;
        let fork_n_ms = ms(t.elapsed());
        let after = forkd_daemon::admission::mem_available().unwrap_or(0);
        let usage: Vec<_> = pids_of(c, &ids)
            .await?
            .into_iter()
            .filter_map(forkd_host::smaps::process_usage)
            .collect();
        delete_all(c, &ids).await?;
        let mean = |f: &dyn Fn(&forkd_host::smaps::MappingUsage) -> u64| {
            usage.iter().map(|u| f(u) as f64).sum::<f64>() / usage.len().max(1) as f64 / MIB
        };
        let v = Variant {
            network,
            single_fork_runs_ms: runs,
            median_single_fork_ms: median_single,
            fork_n_ms,
            pss_mib: mean(&|u| u.pss),
            private_mib: mean(&|u| u.private_clean + u.private_dirty),
            host_mib: before.saturating_sub(after) as f64 / f64::from(args.count) / MIB,
        };
        say(&format!(
            "  {} children: {fork_n_ms:.0} ms; PSS {:.1} MiB, private {:.1} MiB, host {:.1} MiB per child",
            args.count, v.pss_mib, v.private_mib, v.host_mib
        ));
        variants.push(v);
    }
    drop(daemon);
    let ratio = |f: &dyn Fn(&Variant) -> f64| f(&variants[0]) / f(&variants[1]).max(f64::EPSILON);
    let report = NetworkReport {
        template: args.template.clone(),
        count: args.count,
        single_fork_ratio: ratio(&|v| v.median_single_fork_ms),
        fork_n_ratio: ratio(&|v| v.fork_n_ms),
        pss_ratio: ratio(&|v| v.pss_mib),
        variants,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{:<8} {:>14} {:>12} {:>10} {:>12} {:>10}",
        "network",
        "one fork ms",
        format!("{} at once", report.count),
        "PSS MiB",
        "private MiB",
        "host MiB"
    );
    for v in &report.variants {
        println!(
            "{:<8} {:>14.0} {:>12.0} {:>10.1} {:>12.1} {:>10.1}",
            v.network, v.median_single_fork_ms, v.fork_n_ms, v.pss_mib, v.private_mib, v.host_mib
        );
    }
    println!(
        "nat / none: one fork {:.2}x, {} at once {:.2}x, PSS {:.2}x",
        report.single_fork_ratio, report.count, report.fork_n_ratio, report.pss_ratio
    );
    Ok(())
}
