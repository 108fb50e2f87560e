//! `forkd pause` and `forkd resume`: a sandbox written to disk, its VM ended, and run
//! again from there.

use crate::remote::print_json;
use anyhow::Result;
use forkd_daemon::client::Client;
use hyper::Method;
use serde_json::Value;

/// Arguments of `forkd pause` and `forkd resume`.
#[derive(clap::Args, Debug)]
pub struct PauseArgs {
    /// The sandboxes.
    #[arg(required = true)]
    ids: Vec<String>,
    /// Print JSON (one object per sandbox).
    #[arg(long)]
    json: bool,
}

/// Pauses each sandbox in turn; stops at the first that fails.
pub async fn pause(client: &Client, args: PauseArgs) -> Result<()> {
    for id in &args.ids {
        let v = call(client, id, "pause").await?;
        if args.json {
            print_json(&v)?;
            continue;
        }
        println!("{id}");
        eprintln!(
            "paused {id}: stopped {:.1} ms for the last copy, {} pages differ from its snapshot ({:.1} MiB stored), VM ended after {:.0} ms",
            v["stall_ms"].as_f64().unwrap_or(0.0),
            v["pages"].as_u64().unwrap_or(0),
            v["stored_bytes"].as_f64().unwrap_or(0.0) / f64::from(1 << 20),
            v["total_ms"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(())
}

/// Resumes each sandbox in turn; stops at the first that fails.
pub async fn resume(client: &Client, args: PauseArgs) -> Result<()> {
    for id in &args.ids {
        let v = call(client, id, "resume").await?;
        if args.json {
            print_json(&v)?;
            continue;
        }
        println!("{id}");
        match v["total_ms"].as_f64().unwrap_or(0.0) {
            t if t > 0.0 => eprintln!("resumed {id}: answering after {t:.0} ms"),
            _ => eprintln!("{id} was running already"),
        }
    }
    Ok(())
}

async fn call(client: &Client, id: &str, verb: &str) -> Result<Value> {
    client
        .json(Method::POST, &format!("/v1/sandboxes/{id}/{verb}"), None)
        .await
}
