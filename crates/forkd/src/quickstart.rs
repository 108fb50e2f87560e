//! `forkd quickstart`: the whole path in one command, with a timing for each step:
//! guest assets, the `python` template (built once, reused while its inputs are
//! unchanged), N children forked at once, a pandas cell run in every child, teardown.

use crate::bench::ms;
use crate::image::human_size;
use anyhow::{Context, Result};
use forkd_core::fork::{fork, ForkOptions};
use forkd_core::snapshot::manifest::parts;
use forkd_core::snapshot::{Snapshot, SnapshotError, Store, Tag};
use forkd_core::template::{self, Recipe};
use forkd_core::Sandbox;
use forkd_image::{GuestAssets, Home};
use forkd_proto::context::RunCodeRequest;
use std::time::{Duration, Instant};

/// Arguments of `forkd quickstart`.
#[derive(clap::Args, Debug)]
pub struct QuickstartArgs {
    /// Children to fork.
    #[arg(short = 'n', long = "count", default_value_t = 10,
          value_parser = clap::value_parser!(u16).range(1..=forkd_core::fork::MAX_CHILDREN as i64))]
    count: u16,
    /// The snapshot tag of the python template.
    #[arg(long, default_value = "python")]
    tag: String,
    /// Accelerator: auto, kvm or tcg.
    #[arg(long, default_value = "auto")]
    accel: forkd_hypervisor::AccelChoice,
}

/// The pandas cell every child runs: it uses the template's warm `pd` and `np`.
const CELL: &str = "df = pd.DataFrame({'x': np.arange(1000), 'y': np.random.rand(1000)})\n\
                    print(len(df), 'rows')\n\
                    round(float(df.x.sum() + 0 * df.y.mean()), 1)";

/// Runs the quickstart.
pub async fn run(home: &Home, args: QuickstartArgs) -> Result<()> {
    let t0 = Instant::now();
    let step = |name: &str, d: Duration| println!("  {name:<44} {:>9.0} ms", ms(d));

    println!("forkd quickstart: data in {}", home.root().display());
    let t = Instant::now();
    let recipe = Recipe::find("python", &[])?;
    let assets = crate::image::ensure_assets(home, recipe.rootfs_image(), false).await?;
    step("guest assets (built once, then reused)", t.elapsed());

    let t = Instant::now();
    let (snap, built) = python_template(home, &recipe, &args, &assets).await?;
    step(
        if built {
            "python template: boot, import pandas, freeze"
        } else {
            "python template (reused: inputs unchanged)"
        },
        t.elapsed(),
    );

    let t = Instant::now();
    let opts = ForkOptions {
        count: usize::from(args.count),
        ..Default::default()
    };
    let children = fork(home, &snap, &opts).await.context("forking")?;
    step(
        &format!("fork {} children, all answering", args.count),
        t.elapsed(),
    );
    let firsts: Vec<f64> = children
        .iter()
        .map(|c| ms(c.timings().first_answer))
        .collect();

    let t = Instant::now();
    let runs = futures::future::join_all(children.iter().map(run_cell)).await;
    step(
        &format!("run a pandas cell in each of {}", args.count),
        t.elapsed(),
    );

    let t = Instant::now();
    let mut outputs = Vec::new();
    for (c, r) in children.iter().zip(runs) {
        outputs.push((c.id().to_owned(), r));
    }
    for c in children {
        c.destroy().await?;
    }
    step("stop every child", t.elapsed());
    step("total", t0.elapsed());

    println!("children (first answer after its QEMU started; cell output):");
    let mut failed = 0;
    for ((id, r), first) in outputs.iter().zip(&firsts) {
        match r {
            Ok((out, cell_ms)) => {
                println!("  {id}  {first:>6.0} ms  cell {cell_ms:>6.0} ms  {out}")
            }
            Err(e) => {
                failed += 1;
                println!("  {id}  {first:>6.0} ms  FAILED: {e:#}");
            }
        }
    }
    anyhow::ensure!(failed == 0, "the cell failed in {failed} children");
    println!(
        "snapshot {} ({} on disk) stays for the next run; `forkd fork --tag {}` forks it",
        snap.tag,
        human_size(snap.disk_usage()),
        snap.tag
    );
    Ok(())
}

/// The python template's snapshot: the existing one if it was made from the current
/// assets, else a fresh build (replacing a stale or damaged one).
async fn python_template(
    home: &Home,
    recipe: &Recipe,
    args: &QuickstartArgs,
    assets: &GuestAssets,
) -> Result<(Snapshot, bool)> {
    let store = Store::of_home(home);
    let tag = Tag::parse(&args.tag)?;
    match store.open(&tag) {
        Ok(snap) if made_from(&snap, assets) => return Ok((snap, false)),
        Ok(_) => println!("  snapshot {tag} was made from older guest assets: rebuilding it"),
        Err(SnapshotError::NotFound { .. }) => {}
        Err(e) => println!("  {e}: rebuilding it"),
    }
    if store.path(&tag).exists() {
        let users = forkd_core::catalog::children_of(home, tag.as_str());
        store.remove(&tag, &users)?;
    }
    let opts = template::BuildOptions {
        accel: args.accel,
        ..Default::default()
    };
    let t0 = Instant::now();
    let progress = |m: &str| eprintln!("    [{:5.1}s] {m}", t0.elapsed().as_secs_f64());
    let snap = template::build(home, &store, recipe, &tag, assets, &opts, &progress).await?;
    Ok((snap, true))
}

/// True when `snap` was built from exactly these kernel, initramfs and rootfs.
fn made_from(snap: &Snapshot, assets: &GuestAssets) -> bool {
    let part = |name: &str| snap.manifest.parts.get(name).map(|p| p.sha256.as_str());
    part(parts::INITRAMFS) == Some(assets.initramfs.sha256.as_str())
        && part(parts::ROOTFS) == Some(assets.rootfs.sha256.as_str())
        && snap.manifest.versions.kernel == assets.kernel.release
}

/// Runs [`CELL`] in the child's warm context; returns its output on one line and the
/// time it took.
async fn run_cell(child: &Sandbox) -> Result<(String, f64)> {
    let t = Instant::now();
    let x = child
        .call(|a| async move {
            let ctx = a.list_contexts().await?;
            let Some(ctx) = ctx.first() else {
                return Err(forkd_core::agent::AgentError::Malformed(
                    "the child has no warm code context".into(),
                ));
            };
            a.run_code(
                &ctx.id,
                &RunCodeRequest {
                    code: CELL.into(),
                    timeout_ms: Some(120_000),
                },
            )
            .await
        })
        .await?;
    if let Some(e) = x.error {
        anyhow::bail!("{}: {}", e.name, e.value);
    }
    let out = format!(
        "{} -> {}",
        x.stdout.trim(),
        x.text().unwrap_or("(no value)")
    );
    Ok((out, ms(t.elapsed())))
}
