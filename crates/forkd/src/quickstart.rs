//! `forkd quickstart`: the whole path in one command, through the daemon (started in
//! the background if none answers), with a timing for each step: guest assets, the
//! `python` template (built once, then reused), N children forked at once, a pandas
//! cell run in every child, teardown.

use crate::bench::ms;
use crate::image::human_size;
use anyhow::{Context, Result};
use forkd_daemon::client::Client;
use forkd_image::{Home, RootfsImage};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
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
    /// Rebuild the template even if the snapshot exists (refused while children use it).
    #[arg(long)]
    rebuild: bool,
}

/// The pandas cell every child runs: it uses the template's warm `pd` and `np`.
const CELL: &str = "df = pd.DataFrame({'x': np.arange(1000), 'y': np.random.rand(1000)})\n\
                    print(len(df), 'rows')\n\
                    round(float(df.x.sum() + 0 * df.y.mean()), 1)";

/// Runs the quickstart.
pub async fn run(home: &Home, args: QuickstartArgs) -> Result<()> {
    let t0 = Instant::now();
    let step = |name: &str, d: Duration| println!("  {name:<46} {:>9.0} ms", ms(d));
    println!("forkd quickstart: data in {}", home.root().display());

    let t = Instant::now();
    crate::image::ensure_assets(home, RootfsImage::Python, false).await?;
    step("guest assets (built once, then reused)", t.elapsed());

    let t = Instant::now();
    let (client, started) = crate::remote::ensure_daemon(home).await?;
    step(
        if started {
            "daemon started in the background"
        } else {
            "daemon already running"
        },
        t.elapsed(),
    );

    let t = Instant::now();
    let tag = forkd_storage::snapshot::Tag::parse(&args.tag)?;
    let (status, body) = client
        .call(Method::GET, &format!("/v1/snapshots/{tag}"), None)
        .await?;
    let usable = status == StatusCode::OK
        && serde_json::from_slice::<Value>(&body).is_ok_and(|v| v["status"] == "ok");
    let snap = if usable && !args.rebuild {
        let snap: Value = serde_json::from_slice(&body)?;
        step("python template (reused)", t.elapsed());
        snap
    } else {
        let snap = crate::snapshots::build_template(
            &client,
            "python",
            Some(tag.as_str()),
            status == StatusCode::OK,
        )
        .await?;
        step("python template: boot, import pandas, freeze", t.elapsed());
        snap
    };

    let t = Instant::now();
    let created: Value = client
        .json(
            Method::POST,
            "/v1/sandboxes",
            Some(
                &json!({"snapshot": tag.as_str(), "n": args.count, "labels": {"by": "quickstart"}}),
            ),
        )
        .await
        .context("forking")?;
    step(
        &format!("fork {} children, all answering", args.count),
        t.elapsed(),
    );
    let ids: Vec<String> = created["sandboxes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["id"].as_str())
        .map(|id| crate::sandboxes::path_id(id).map(str::to_owned))
        .collect::<Result<_>>()?;

    let t = Instant::now();
    let runs = futures::future::join_all(ids.iter().map(|id| run_cell(&client, id))).await;
    step(
        &format!("run a pandas cell in each of {}", ids.len()),
        t.elapsed(),
    );

    let t = Instant::now();
    for id in &ids {
        client.delete(&format!("/v1/sandboxes/{id}")).await?;
    }
    step("stop every child", t.elapsed());
    step("total", t0.elapsed());

    println!("children (cell output, time of the cell through the API):");
    let mut failed = 0;
    for (id, r) in ids.iter().zip(&runs) {
        match r {
            Ok((out, cell_ms)) => println!("  {id}  {cell_ms:>6.0} ms  {out}"),
            Err(e) => {
                failed += 1;
                println!("  {id}  FAILED: {e:#}");
            }
        }
    }
    anyhow::ensure!(failed == 0, "the cell failed in {failed} children");
    println!(
        "snapshot {tag} ({} on disk) stays for the next run; `forkd fork --tag {tag}` forks it",
        human_size(snap["disk_bytes"].as_u64().unwrap_or(0)),
    );
    if started {
        println!(
            "the daemon keeps running (log: {}/daemon.log)",
            home.root().display()
        );
    }
    Ok(())
}

/// Runs [`CELL`] in the child's warm context; its output on one line and its time.
async fn run_cell(client: &Client, id: &str) -> Result<(String, f64)> {
    let t = Instant::now();
    let x: Value = client
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{id}/code"),
            Some(&json!({ "code": CELL, "timeout_s": 120 })),
        )
        .await?;
    if !x["error"].is_null() {
        anyhow::bail!("{}: {}", x["error"]["name"], x["error"]["value"]);
    }
    let value = x["results"]
        .as_array()
        .and_then(|r| r.last())
        .and_then(|r| r["text"].as_str())
        .unwrap_or("(no value)");
    Ok((
        format!("{} -> {value}", x["stdout"].as_str().unwrap_or("").trim()),
        ms(t.elapsed()),
    ))
}
