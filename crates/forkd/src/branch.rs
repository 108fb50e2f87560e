//! `forkd branch`: a snapshot of a running sandbox, which goes on running.

use crate::remote::print_json;
use anyhow::{bail, Result};
use forkd_daemon::client::Client;
use hyper::Method;
use serde_json::{json, Value};

/// How the source is captured.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum Mode {
    /// Copy memory while the sandbox runs; it stops only for the last pages (ms).
    Live,
    /// Stop the sandbox for the whole copy.
    Pause,
}

/// Arguments of `forkd branch`.
#[derive(clap::Args, Debug)]
pub struct BranchArgs {
    /// The running sandbox.
    id: String,
    /// The new snapshot's tag (default: `br-` and 8 random hex digits).
    #[arg(long, short)]
    tag: Option<String>,
    /// How the sandbox is captured (default: live where the hypervisor copies a running
    /// guest faithfully, i.e. KVM or QEMU 9.0 and newer under TCG, else pause).
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Print the branch's operation and return at once (poll it with the API's
    /// /v1/operations/ID).
    #[arg(long)]
    no_wait: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub async fn branch(client: &Client, args: BranchArgs) -> Result<()> {
    if let Some(t) = &args.tag {
        forkd_storage::snapshot::Tag::parse(t)?;
    }
    let mut body = json!({ "wait": !args.no_wait });
    if let Some(mode) = args.mode {
        body["mode"] = match mode {
            Mode::Live => "live",
            Mode::Pause => "pause",
        }
        .into();
    }
    if let Some(t) = &args.tag {
        body["tag"] = t.clone().into();
    }
    let v: Value = client
        .json(
            Method::POST,
            &format!("/v1/sandboxes/{}/branch", args.id),
            Some(&body),
        )
        .await?;
    if args.json {
        return print_json(&v);
    }
    if args.no_wait {
        println!("{}", v["id"].as_str().unwrap_or_default());
        eprintln!(
            "branching {} into {} (operation {})",
            args.id,
            v["target"].as_str().unwrap_or("?"),
            v["id"].as_str().unwrap_or("?")
        );
        return Ok(());
    }
    let Some(tag) = v["snapshot"].as_str() else {
        bail!("the daemon answered a branch without a snapshot: {v}");
    };
    println!("{tag}");
    eprintln!(
        "branched {} into {tag} (a diff on {}): paused {:.1} ms ({}), {} pages differ ({:.1} MiB stored), written in {:.0} ms",
        args.id,
        v["parent"].as_str().unwrap_or("?"),
        v["pause_ms"].as_f64().unwrap_or(0.0),
        v["mode"].as_str().unwrap_or("?"),
        v["pages_changed"].as_u64().unwrap_or(0),
        v["diff_bytes"].as_f64().unwrap_or(0.0) / f64::from(1u32 << 20),
        v["total_ms"].as_f64().unwrap_or(0.0),
    );
    Ok(())
}
