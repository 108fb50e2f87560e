//! `forkd bench`: measurements taken in one run, reported as medians (and, where two
//! things are compared, as ratios), never as pass/fail thresholds.

use anyhow::{Context, Result};
use forkd_core::Sandbox;
use forkd_image::{Home, RootfsImage};
use serde::Serialize;
use std::time::{Duration, Instant};

/// `forkd bench ...`
#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// Cold boots (QEMU start to the guest agent's first answer) and image build times.
    Boot(BootArgs),
}

/// Arguments of `forkd bench boot`.
#[derive(clap::Args, Debug)]
pub struct BootArgs {
    #[command(flatten)]
    vm: crate::VmArgs,
    /// Number of cold boots.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    /// Rebuild every image first and time the builds (otherwise the build times recorded
    /// when the images were built are reported).
    #[arg(long)]
    rebuild_images: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct BootReport {
    accel: String,
    image: String,
    runs: Vec<BootRun>,
    median_first_answer_ms: f64,
    median_hypervisor_ready_ms: f64,
    image_builds: Vec<BuildTime>,
}

#[derive(Serialize)]
struct BootRun {
    hypervisor_ready_ms: f64,
    first_answer_ms: f64,
}

#[derive(Serialize)]
struct BuildTime {
    asset: String,
    seconds: f64,
    /// `measured` in this run, or `recorded` when the asset was built.
    source: &'static str,
}

/// Runs a benchmark.
pub async fn run(home: &Home, cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Boot(args) => boot(home, args).await,
    }
}

async fn boot(home: &Home, args: BootArgs) -> Result<()> {
    let mut image_builds = Vec::new();
    if args.rebuild_images {
        for image in [RootfsImage::Minimal, RootfsImage::Python] {
            let t = Instant::now();
            // Forcing the first build rebuilds kernel and initramfs too; the second reuses them.
            crate::image::ensure_assets(home, image, true).await?;
            image_builds.push(BuildTime {
                asset: format!("kernel+initramfs+rootfs {image}"),
                seconds: t.elapsed().as_secs_f64(),
                source: "measured",
            });
        }
    }
    let assets = crate::image::ensure_assets(home, args.vm.image, false).await?;
    if !args.rebuild_images {
        for (name, a) in forkd_image::list_assets(home) {
            image_builds.push(BuildTime {
                asset: name,
                seconds: a.build_seconds,
                source: "recorded",
            });
        }
    }
    let opts = args.vm.options();
    let accel = forkd_hypervisor::accel::resolve(opts.accel)?;
    let mut runs = Vec::new();
    for i in 0..args.runs {
        let sb = Sandbox::boot(home, &assets, &opts)
            .await
            .with_context(|| format!("cold boot {}", i + 1))?;
        let t = sb.timings();
        runs.push(BootRun {
            hypervisor_ready_ms: ms(t.hypervisor_ready),
            first_answer_ms: ms(t.first_answer),
        });
        sb.destroy().await?;
        if !args.json {
            eprintln!(
                "[forkd] cold boot {}/{}: first agent answer after {:.0} ms",
                i + 1,
                args.runs,
                ms(t.first_answer)
            );
        }
    }
    let report = BootReport {
        accel: accel.to_string(),
        image: args.vm.image.to_string(),
        median_first_answer_ms: median(runs.iter().map(|r| r.first_answer_ms).collect()),
        median_hypervisor_ready_ms: median(runs.iter().map(|r| r.hypervisor_ready_ms).collect()),
        runs,
        image_builds,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "cold boot, image {}, accel {}, {} runs",
        report.image,
        report.accel,
        report.runs.len()
    );
    println!(
        "  median QEMU start -> QMP ready        {:>8.0} ms",
        report.median_hypervisor_ready_ms
    );
    println!(
        "  median QEMU start -> first agent answer {:>6.0} ms",
        report.median_first_answer_ms
    );
    println!("image builds:");
    for b in &report.image_builds {
        println!("  {:<40} {:>8.1} s  ({})", b.asset, b.seconds, b.source);
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    #[test]
    fn medians() {
        assert_eq!(super::median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(super::median(vec![]), 0.0);
    }
}
