//! `forkd cluster ...`: the cluster of daemons the one this CLI talks to is a host of.

use anyhow::Result;
use forkd_daemon::client::Client;
use hyper::Method;
use serde_json::Value;

/// `forkd cluster ...`.
#[derive(clap::Subcommand, Debug)]
pub enum ClusterCommand {
    /// List the cluster's hosts: whether each lives, its address, free slots, memory
    /// and snapshots.
    Hosts {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove a host that is gone for good (a retired machine) from the cluster. It
    /// must not be up; drain it first to move its sandboxes.
    Forget {
        /// The host's name.
        host: String,
        /// Forget it even if it still claims sandboxes (they are forgotten with it).
        #[arg(long)]
        force: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs a `forkd cluster` verb.
pub async fn run(client: &Client, cmd: ClusterCommand) -> Result<()> {
    match cmd {
        ClusterCommand::Hosts { json } => hosts(client, json).await,
        ClusterCommand::Forget { host, force, json } => {
            let path = format!("/v1/cluster/hosts/{host}?force={force}");
            let v: Value = client.json(Method::DELETE, &path, None).await?;
            if json {
                return crate::remote::print_json(&v);
            }
            let forgot = v["sandboxes"].as_array().map_or(0, Vec::len);
            println!("host {host} forgotten ({forgot} sandbox claim(s) with it)");
            Ok(())
        }
    }
}

async fn hosts(client: &Client, json: bool) -> Result<()> {
    let v: Value = client.json(Method::GET, "/v1/cluster/hosts", None).await?;
    if json {
        return crate::remote::print_json(&v);
    }
    let this = v["this_host"].as_str().unwrap_or("");
    println!(
        "{:20} {:12} {:22} {:5} {:>6} {:>11} {:>10}  SNAPSHOTS",
        "HOST", "STATE", "ADDRESS", "ACCEL", "CPUS", "SLOTS FREE", "MEM MiB"
    );
    for h in v["hosts"].as_array().cloned().unwrap_or_default() {
        let name = h["name"].as_str().unwrap_or("");
        let live = &h["live"];
        let dash = |x: &Value| match x {
            Value::Null => "-".to_owned(),
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let slots = match (live["max_sandboxes"].as_u64(), live["running"].as_u64()) {
            (Some(max), Some(running)) => max.saturating_sub(running).to_string(),
            _ => "-".to_owned(),
        };
        let snapshots = live["snapshots"]
            .as_object()
            .map(|m| m.keys().cloned().collect::<Vec<_>>().join(","))
            .unwrap_or_default();
        println!(
            "{:20} {:12} {:22} {:5} {:>6} {:>11} {:>10}  {}",
            if name == this {
                format!("{name} (this)")
            } else {
                name.to_owned()
            },
            if live["draining"] == Value::Bool(true) {
                "draining"
            } else {
                h["state"].as_str().unwrap_or("")
            },
            h["address"].as_str().unwrap_or(""),
            dash(&live["accel"]),
            dash(&live["cpus"]),
            slots,
            dash(&live["memory_available_mib"]),
            snapshots
        );
    }
    Ok(())
}

/// `forkd drain HOST`.
#[derive(clap::Args, Debug)]
pub struct DrainArgs {
    /// The host to drain (its name in `forkd cluster hosts`).
    pub host: String,
    /// End the host's drain instead: it takes new sandboxes again (those moved off it
    /// stay where they went).
    #[arg(long)]
    pub undo: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Drains a host (or ends its drain). Exits 1 if a sandbox could not be moved.
pub async fn drain(client: &Client, args: DrainArgs) -> Result<i32> {
    let path = format!("/v1/cluster/hosts/{}/drain", args.host);
    let method = if args.undo {
        Method::DELETE
    } else {
        Method::POST
    };
    if !args.undo && !args.json {
        // The answer comes once every sandbox moved: say what takes the time.
        eprintln!(
            "draining host {}: each of its sandboxes is paused, branched and pushed to the cluster's registry (seconds each)...",
            args.host
        );
    }
    let v: Value = client.json(method, &path, None).await?;
    let strings = |k: &str| -> Vec<Value> { v[k].as_array().cloned().unwrap_or_default() };
    let kept = strings("kept");
    if args.json {
        crate::remote::print_json(&v)?;
    } else if args.undo {
        println!("host {} takes new sandboxes again", args.host);
    } else {
        let moved = strings("moved");
        println!(
            "host {} is draining: {} sandbox(es) moved to the cluster's registry, {} kept",
            args.host,
            moved.len(),
            kept.len()
        );
        for id in &moved {
            println!("  moved {}", id.as_str().unwrap_or(""));
        }
        for k in &kept {
            println!(
                "  kept  {}: {}",
                k["id"].as_str().unwrap_or(""),
                k["reason"].as_str().unwrap_or("")
            );
        }
    }
    Ok(if kept.is_empty() { 0 } else { 1 })
}
