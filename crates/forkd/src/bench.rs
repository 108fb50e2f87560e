//! `forkd bench`: measurements taken in one run, reported as medians (and, where two
//! things are compared, as ratios), never as pass/fail thresholds.
#![expect(
    clippy::cast_precision_loss,
    reason = "reports: byte counts, ticks and counts become ratios and MiB shown to a few digits"
)]

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
    /// Fork against cold boot: template build, one child, N children at once, and what
    /// each child's guest memory costs.
    Fork(ForkArgs),
    /// Many children through the daemon's API, with and without the warm pool: wall
    /// time, children alive after idling, idle CPU and memory per child.
    Scale(crate::bench_scale::ScaleArgs),
    /// BRANCH through the daemon's API: the source's pause in each mode against the
    /// memory it dirtied, bytes stored, branch to first child, forks from chain depths.
    Branch(crate::bench_branch::BranchArgs),
    /// Moving a snapshot through the daemon's API: archive size against RAM and disk,
    /// pack, unpack, push and pull times, forks of an unpacked snapshot against the
    /// original.
    Archive(crate::bench_archive::ArchiveArgs),
    /// A network of its own against none, through the daemon's API: single forks, a fork
    /// of N, and memory per child, for one template built both ways.
    Network(crate::bench_network::NetworkArgs),
    /// Pause to disk and resume through the daemon's API: the guest's stall, bytes
    /// stored against memory dirtied, resume to first exec against a cold boot, the
    /// state after the resume; with --density, N sandboxes mostly paused, each resumed
    /// in turn and checked.
    Persist(crate::bench_persist::PersistArgs),
    /// Three daemons on this machine as one cluster (an etcd and a registry of its own):
    /// a fork of N spread over the three hosts against the same fork on one, and the
    /// latency a forwarded exec adds (p50 through another host against direct).
    Cluster(crate::bench_cluster::ClusterArgs),
}

/// Arguments of `forkd bench fork`.
#[derive(clap::Args, Debug)]
pub struct ForkArgs {
    /// The template to build and fork (a built-in name or a recipe file).
    #[arg(long, default_value = "minimal")]
    template: String,
    /// Accelerator: auto, kvm or tcg (cold boots, the template and its children).
    #[arg(long, default_value = "auto")]
    accel: forkd_hypervisor::AccelChoice,
    /// Cold boots and single forks to take the median of.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    /// Children forked at once.
    #[arg(short = 'n', long = "count", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=256))]
    count: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
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
        BenchCommand::Fork(args) => fork(home, args).await,
        BenchCommand::Scale(args) => crate::bench_scale::run(home, args).await,
        BenchCommand::Branch(args) => crate::bench_branch::run(home, args).await,
        BenchCommand::Persist(args) => crate::bench_persist::run(home, args).await,
        BenchCommand::Cluster(args) => crate::bench_cluster::run(home, args).await,
        BenchCommand::Archive(args) => crate::bench_archive::run(home, args).await,
        BenchCommand::Network(args) => crate::bench_network::run(home, args).await,
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
    let runs = cold_boots(home, &assets, &opts, args.runs, args.json).await?;
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

/// `runs` cold boots of `assets`, one after the other.
async fn cold_boots(
    home: &Home,
    assets: &forkd_image::GuestAssets,
    opts: &forkd_core::SandboxOptions,
    runs: u32,
    quiet: bool,
) -> Result<Vec<BootRun>> {
    let mut out = Vec::new();
    let hv = forkd_qemu::hypervisor();
    for i in 0..runs {
        let sb = Sandbox::boot(hv.as_ref(), home, assets, opts)
            .await
            .with_context(|| format!("cold boot {}", i + 1))?;
        let t = sb.timings();
        out.push(BootRun {
            hypervisor_ready_ms: ms(t.hypervisor_ready),
            first_answer_ms: ms(t.first_answer),
        });
        sb.destroy().await?;
        if !quiet {
            eprintln!(
                "[forkd] cold boot {}/{runs}: first agent answer after {:.0} ms",
                i + 1,
                ms(t.first_answer)
            );
        }
    }
    Ok(out)
}

#[derive(Serialize)]
struct ForkReport {
    accel: String,
    template: String,
    memory_mib: u32,
    median_cold_boot_ms: f64,
    template_build_ms: f64,
    /// The build's own breakdown (boot, warm-up, freeze).
    template_build: forkd_storage::snapshot::manifest::BuildTimes,
    median_fork_one_ms: f64,
    fork_one_runs_ms: Vec<f64>,
    /// Where a single fork's time went: the median of each step over the runs.
    fork_one_steps: Vec<StepMedian>,
    /// Each single fork's first command (`true`), from its request to its exit status.
    median_first_exec_after_fork_ms: f64,
    count: u32,
    /// From the fork call to the moment every child had answered.
    fork_n_all_answered_ms: f64,
    /// Each child's first answer, from its own QEMU's start.
    fork_n_first_answer_ms: Vec<f64>,
    /// Guest-RAM mapping of each child, after one exec, with all N alive.
    children_memory: Vec<ChildMemory>,
    /// What the template had resident when frozen (the RAM file's allocated bytes).
    template_resident_bytes: u64,
    ratio_fork_one_to_cold_boot: f64,
    ratio_fork_n_to_fork_one: f64,
    ratio_sum_pss_to_template_resident: f64,
}

#[derive(Serialize)]
struct StepMedian {
    step: &'static str,
    median_ms: f64,
}

/// The median of each step over `runs` (steps in the order of the first run).
fn step_medians(runs: &[Vec<forkd_hypervisor::startup::Step>]) -> Vec<StepMedian> {
    let Some(first) = runs.first() else {
        return Vec::new();
    };
    first
        .iter()
        .map(|step| StepMedian {
            step: step.name,
            median_ms: median(
                runs.iter()
                    .flat_map(|r| r.iter().filter(|s| s.name == step.name))
                    .map(|s| ms(s.took))
                    .collect(),
            ),
        })
        .collect()
}

#[derive(Serialize)]
struct ChildMemory {
    id: String,
    #[serde(flatten)]
    usage: forkd_host::smaps::MappingUsage,
}

async fn fork(home: &Home, args: ForkArgs) -> Result<()> {
    use forkd_storage::snapshot::{manifest::parts, Store, Tag};
    use std::os::unix::fs::MetadataExt;

    let say = |m: &str| {
        if !args.json {
            eprintln!("[forkd] {m}");
        }
    };
    let (recipe, assets, opts) = template_parts(home, &args.template, args.accel).await?;
    let accel = forkd_hypervisor::accel::resolve(args.accel)?;
    say(&format!(
        "cold boots of {} ({} MiB, {accel})",
        recipe.base_name(),
        recipe.memory_mib
    ));
    let cold = cold_boots(home, &assets, &opts, args.runs, args.json).await?;

    // A tag of its own, removed at the end: the benchmark never touches the user's.
    let store = Store::of_home(home);
    let tag = Tag::parse(&format!(
        "bench-{}-{}",
        recipe.name,
        forkd_host::ids::random_hex(4)
    ))?;
    say(&format!("building template {} as {tag}", recipe.name));
    let build_opts = forkd_core::template::BuildOptions {
        accel: args.accel,
        ..Default::default()
    };
    let t = Instant::now();
    let snap = forkd_core::template::build(
        forkd_qemu::hypervisor().as_ref(),
        home,
        &store,
        &recipe,
        &tag,
        &assets,
        &build_opts,
        &|m: &str| say(m),
    )
    .await?;
    let template_build_ms = ms(t.elapsed());
    let memory_file = snap.part(parts::MEMORY);
    let template_resident_bytes = std::fs::metadata(&memory_file)
        .with_context(|| format!("reading {}", memory_file.display()))?
        .blocks()
        * 512;
    let result = fork_measurements(home, &snap, &args, &say).await;
    let removed = store.remove(&tag, &[]);
    let (one, one_steps, first_exec, n_wall, n_first, memory) = result?;
    removed?;

    let median_cold_boot_ms = median(cold.iter().map(|r| r.first_answer_ms).collect());
    let median_fork_one_ms = median(one.clone());
    let pss_sum: u64 = memory.iter().map(|m| m.usage.pss).sum();
    let report = ForkReport {
        accel: accel.to_string(),
        template: recipe.name.clone(),
        memory_mib: recipe.memory_mib,
        median_cold_boot_ms,
        template_build_ms,
        template_build: snap.manifest.build.clone(),
        median_fork_one_ms,
        fork_one_runs_ms: one,
        fork_one_steps: step_medians(&one_steps),
        median_first_exec_after_fork_ms: median(first_exec),
        count: args.count,
        fork_n_all_answered_ms: n_wall,
        fork_n_first_answer_ms: n_first,
        ratio_fork_one_to_cold_boot: median_fork_one_ms / median_cold_boot_ms,
        ratio_fork_n_to_fork_one: n_wall / median_fork_one_ms,
        ratio_sum_pss_to_template_resident: pss_sum as f64 / template_resident_bytes as f64,
        children_memory: memory,
        template_resident_bytes,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_fork_report(&report);
    Ok(())
}

type ForkFigures = (
    Vec<f64>,
    Vec<Vec<forkd_hypervisor::startup::Step>>,
    Vec<f64>,
    f64,
    Vec<f64>,
    Vec<ChildMemory>,
);

/// Single forks (each destroyed before the next), then N at once with their memory.
async fn fork_measurements(
    home: &Home,
    snap: &forkd_storage::snapshot::Snapshot,
    args: &ForkArgs,
    say: &dyn Fn(&str),
) -> Result<ForkFigures> {
    use forkd_core::fork::{fork, ForkOptions};
    let hv = forkd_qemu::hypervisor();
    // As the daemon does: namespaces made ahead for forks (the first fork makes its own).
    forkd_host::network::spares::keep(2);
    let (mut one, mut one_steps, mut first_exec) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..args.runs {
        let opts = ForkOptions {
            count: 1,
            ..Default::default()
        };
        let child = fork(hv.as_ref(), home, snap, &opts)
            .await
            .with_context(|| format!("fork {}", i + 1))?
            .remove(0);
        let t = ms(child.timings().first_answer);
        say(&format!(
            "fork {}/{}: first agent answer after {t:.0} ms",
            i + 1,
            args.runs
        ));
        one.push(t);
        one_steps.push(child.timings().steps);
        // What a user who forks to run something waits for next: the first command.
        let t = Instant::now();
        run_true(&child).await?;
        first_exec.push(ms(t.elapsed()));
        child.destroy().await?;
    }
    say(&format!("forking {} children at once", args.count));
    let opts = ForkOptions {
        count: args.count as usize,
        ..Default::default()
    };
    let t = Instant::now();
    let children = fork(hv.as_ref(), home, snap, &opts).await?;
    let n_wall = ms(t.elapsed());
    let n_first = children
        .iter()
        .map(|c| ms(c.timings().first_answer))
        .collect();
    for c in &children {
        run_true(c).await?;
    }
    let memory = children
        .iter()
        .map(|c| ChildMemory {
            id: c.id().to_owned(),
            usage: c.guest_ram_usage().unwrap_or_default(),
        })
        .collect();
    for c in children {
        c.destroy().await?;
    }
    Ok((one, one_steps, first_exec, n_wall, n_first, memory))
}

/// Runs `true` in `child`; fails unless it exits 0.
async fn run_true(child: &Sandbox) -> Result<()> {
    let out = child
        .exec(
            forkd_proto::exec::ExecRequest::new(forkd_proto::exec::Command::Argv(vec![
                "true".into()
            ])),
            None,
        )
        .await?;
    anyhow::ensure!(out.status.success(), "exec in {} failed", child.id());
    Ok(())
}

fn print_fork_report(r: &ForkReport) {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "fork benchmark: template {} ({} MiB), accel {}",
        r.template, r.memory_mib, r.accel
    );
    println!(
        "  cold boot to first answer (median)      {:>9.0} ms",
        r.median_cold_boot_ms
    );
    println!(
        "  template build                          {:>9.0} ms  (boot {} ms, warm-up {} ms, freeze {} ms)",
        r.template_build_ms, r.template_build.boot_ms, r.template_build.warmup_ms, r.template_build.freeze_ms
    );
    println!(
        "  fork of one child to first answer (median) {:>6.0} ms",
        r.median_fork_one_ms
    );
    for step in &r.fork_one_steps {
        println!("    {:36} {:>9.1} ms", step.step, step.median_ms);
    }
    println!(
        "  then its first exec (`true`, median)    {:>9.0} ms",
        r.median_first_exec_after_fork_ms
    );
    println!(
        "  fork of {} children until all answered  {:>7.0} ms",
        r.count, r.fork_n_all_answered_ms
    );
    println!("  guest RAM per child ({} alive, after one exec):", r.count);
    for c in &r.children_memory {
        println!(
            "    {:20} rss {:>7.1} MiB  pss {:>6.1} MiB  private {:>5.2} MiB",
            c.id,
            mib(c.usage.rss),
            mib(c.usage.pss),
            mib(c.usage.private_dirty + c.usage.private_clean)
        );
    }
    println!(
        "  template resident when frozen            {:>7.1} MiB",
        mib(r.template_resident_bytes)
    );
    println!("ratios (same run):");
    println!(
        "  fork one / cold boot        {:>7.3}   (target <= {:.3})",
        r.ratio_fork_one_to_cold_boot,
        1.0 / 20.0
    );
    println!(
        "  fork {} / fork one          {:>7.2}   (target <= 6)",
        r.count, r.ratio_fork_n_to_fork_one
    );
    println!(
        "  sum of children's PSS / template resident {:>5.2}",
        r.ratio_sum_pss_to_template_resident
    );
}

/// The recipe of `template` (a built-in name or a recipe file), its guest assets (built
/// if missing), and the options a cold boot of its image takes to match its parent.
pub(crate) async fn template_parts(
    home: &Home,
    template: &str,
    accel: forkd_hypervisor::AccelChoice,
) -> Result<(
    forkd_core::template::Recipe,
    forkd_image::GuestAssets,
    forkd_core::SandboxOptions,
)> {
    let recipe = crate::snapshots::find_recipe(template)?;
    let image = recipe
        .rootfs_image()
        .context("the benchmarks build on the built-in images (minimal, python), not on `from`")?;
    let assets = crate::image::ensure_assets(home, image, false).await?;
    let opts = forkd_core::SandboxOptions {
        vcpus: recipe.vcpus,
        memory_mib: recipe.memory_mib,
        accel,
        ..Default::default()
    };
    Ok((recipe, assets, opts))
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
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

pub(crate) fn ms(d: Duration) -> f64 {
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
