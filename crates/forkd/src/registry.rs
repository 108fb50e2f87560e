//! `forkd push`, `forkd pull` and `forkd login`: snapshots to and from OCI registries.
//! Push and pull run in the daemon as operations; this follows them with a progress bar.
//! Login stores credentials in the docker-style auth file the daemon reads.

use crate::image::human_size;
use anyhow::{bail, Context, Result};
use forkd_daemon::client::Client;
use forkd_storage::snapshot::Tag;
use hyper::Method;
use serde_json::{json, Value};
use std::io::BufRead;
use std::time::Duration;

/// `forkd push`.
#[derive(clap::Args)]
pub struct PushArgs {
    /// The snapshot; a branch is pushed with its ancestors.
    pub tag: String,
    /// Where to: REGISTRY/REPO:TAG.
    pub reference: String,
    /// Print what was pushed as JSON (snapshots, reference, digest, blobs uploaded).
    #[arg(long)]
    pub json: bool,
}

/// `forkd pull`.
#[derive(clap::Args)]
pub struct PullArgs {
    /// What: REGISTRY/REPO:TAG or REGISTRY/REPO@sha256:DIGEST.
    pub reference: String,
    /// Install it under this tag (its ancestors keep theirs).
    #[arg(long)]
    pub tag: Option<String>,
    /// Print what was installed as JSON (tag, installed, present).
    #[arg(long)]
    pub json: bool,
}

/// `forkd login`.
#[derive(clap::Args)]
pub struct LoginArgs {
    /// The registry, HOST[:PORT].
    pub registry: String,
    /// The user name.
    #[arg(short, long)]
    pub username: String,
    /// Read the password from standard input (the only way to give it: never as an
    /// argument, where other users can see it).
    #[arg(long, required = true)]
    pub password_stdin: bool,
}

/// Pushes and follows the operation.
pub async fn push(client: &Client, args: PushArgs) -> Result<()> {
    let tag = Tag::parse(&args.tag)?;
    let body = json!({ "reference": args.reference });
    let op: Value = client
        .json(
            Method::POST,
            &format!("/v1/snapshots/{tag}/push"),
            Some(&body),
        )
        .await?;
    let v = follow(client, &op, "pushing").await?;
    let r = &v["result"];
    if args.json {
        return crate::remote::print_json(r);
    }
    let names: Vec<&str> = r["snapshots"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    println!(
        "pushed {} to {} ({})",
        names.join(", "),
        r["reference"].as_str().unwrap_or(&args.reference),
        r["digest"].as_str().unwrap_or("?")
    );
    println!(
        "{} blobs uploaded ({}), {} the registry had already",
        r["uploaded"],
        human_size(r["uploaded_bytes"].as_u64().unwrap_or(0)),
        r["skipped"]
    );
    Ok(())
}

/// Pulls and follows the operation.
pub async fn pull(client: &Client, args: PullArgs) -> Result<()> {
    let tag = args.tag.as_deref().map(Tag::parse).transpose()?;
    let body = json!({ "reference": args.reference, "tag": tag.map(|t| t.to_string()) });
    let op: Value = client.json(Method::POST, "/v1/pull", Some(&body)).await?;
    let v = follow(client, &op, "pulling").await?;
    if args.json {
        return crate::remote::print_json(&v["result"]);
    }
    crate::archive::print_installed(&v["result"]);
    Ok(())
}

/// Polls the operation until it ends; its final row on success, its error otherwise.
pub(crate) async fn follow(client: &Client, op: &Value, what: &str) -> Result<Value> {
    let id = op["id"]
        .as_str()
        .context("the daemon answered without an operation")?;
    let bar = crate::archive::bar(Some(0), what);
    let path = format!("/v1/operations/{id}");
    loop {
        let v: Value = client.json(Method::GET, &path, None).await?;
        bar.set_length(v["total"].as_u64().unwrap_or(0));
        bar.set_position(v["done"].as_u64().unwrap_or(0));
        match v["status"].as_str() {
            Some("running") => tokio::time::sleep(Duration::from_millis(200)).await,
            Some("succeeded") => {
                bar.finish_and_clear();
                return Ok(v);
            }
            _ => {
                bar.finish_and_clear();
                bail!(
                    "{what} failed: {}",
                    v["error"].as_str().unwrap_or("(no reason given)")
                );
            }
        }
    }
}

/// Stores the credentials read from standard input.
pub fn login(args: LoginArgs) -> Result<()> {
    if args.registry.is_empty() || args.registry.contains('/') {
        bail!("{:?} is not a registry (HOST[:PORT])", args.registry);
    }
    let mut password = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut password)
        .context("reading the password from standard input")?;
    let password = password.trim_end_matches(['\r', '\n']);
    if password.is_empty() {
        bail!("no password on standard input");
    }
    let path = forkd_storage::oci::auth::auth_file(None).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").unwrap_or_default();
        std::path::PathBuf::from(home).join(".docker/config.json")
    });
    forkd_storage::oci::auth::store(&path, &args.registry, &args.username, password)?;
    println!(
        "stored the credentials for {} in {} (they are checked on the next push or pull)",
        args.registry,
        path.display()
    );
    Ok(())
}
