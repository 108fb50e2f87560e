//! `forkd template build`, `forkd snapshots`, `forkd snapshot verify|show`, `forkd rmi`:
//! snapshots of the daemon, through its API.

use crate::image::human_size;
use crate::remote::print_json;
use anyhow::{Context, Result};
use forkd_core::template::{self, Recipe};
use forkd_daemon::client::{ApiFailure, Client};
use forkd_storage::snapshot::Tag;
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// `forkd template ...`.
#[derive(clap::Subcommand, Debug)]
pub enum TemplateCommand {
    /// Boot a template's parent, warm it, and freeze it into a snapshot.
    Build(BuildArgs),
    /// List the built-in templates.
    Ls,
}

/// Arguments of `forkd template build`.
#[derive(clap::Args, Debug)]
pub struct BuildArgs {
    /// Template name (`./templates/NAME.toml`, else built in: minimal, python) or the
    /// path of a recipe file.
    name: String,
    /// Snapshot tag (default: the template's name).
    #[arg(long)]
    tag: Option<String>,
    /// Replace an existing snapshot of that tag (refused while children use it).
    #[arg(long)]
    force: bool,
    /// Print the snapshot as JSON.
    #[arg(long)]
    json: bool,
}

/// `forkd snapshot ...`.
#[derive(clap::Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Re-hash every part of a snapshot against its manifest.
    Verify {
        /// The snapshot's tag.
        tag: String,
        /// Print the result as JSON (links, bytes, millis).
        #[arg(long)]
        json: bool,
    },
    /// Print what the daemon knows of a snapshot: its chain (depth, ancestors,
    /// dependents), its own and total size, its children.
    Show {
        /// The snapshot's tag.
        tag: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write a standalone copy of a chain link (memory image, device state, flattened
    /// disk; no parent): it forks after its ancestors are removed.
    Compact {
        /// The chain link.
        tag: String,
        /// The new snapshot's tag.
        #[arg(long = "tag", short = 't')]
        new_tag: String,
    },
    /// Show or set a snapshot's warm pool: children the daemon keeps prepared (QEMU
    /// started, disk layer made) so that a fork only restores them.
    Pool {
        /// The snapshot's tag.
        tag: String,
        /// Members to keep ready (0 to 256); without it, the pool is shown.
        size: Option<u32>,
        /// Go back to the size the snapshot's recipe set (`pool = N`).
        #[arg(long, conflicts_with = "size")]
        reset: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

pub async fn template(client: &Client, cmd: TemplateCommand) -> Result<()> {
    match cmd {
        TemplateCommand::Ls => {
            for (name, text) in template::BUILTIN {
                let r = Recipe::parse(name, text)?;
                println!("{name:10} {}", r.description);
            }
            Ok(())
        }
        TemplateCommand::Build(args) => build(client, args).await,
    }
}

/// Resolves a template name or recipe path.
pub fn find_recipe(name: &str) -> Result<Recipe> {
    let p = PathBuf::from(name);
    if name.ends_with(".toml") || name.contains('/') {
        return Ok(Recipe::load(&p)?);
    }
    Ok(Recipe::find(name, &[PathBuf::from("templates")])?)
}

pub async fn build(client: &Client, args: BuildArgs) -> Result<()> {
    let t0 = Instant::now();
    let info = build_template(client, &args.name, args.tag.as_deref(), args.force).await?;
    if args.json {
        return print_json(&info);
    }
    println!(
        "{}: {} on disk, built in {:.1} s",
        info["tag"].as_str().unwrap_or(""),
        human_size(info["disk_bytes"].as_u64().unwrap_or(0)),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Has the daemon build template `name` (a built-in name or a recipe file, which is
/// sent along: the daemon may run on another host) as snapshot `tag`, showing progress
/// while it runs; returns the snapshot as the daemon describes it. With `replace`, an
/// existing snapshot of that tag is removed first (refused while children use it).
pub async fn build_template(
    client: &Client,
    name: &str,
    tag: Option<&str>,
    replace: bool,
) -> Result<Value> {
    let t0 = Instant::now();
    let mut body = if name.ends_with(".toml") || name.contains('/') {
        use base64::Engine;
        let recipe = Recipe::load(&PathBuf::from(name))?;
        let mut text = std::fs::read_to_string(name).with_context(|| format!("reading {name}"))?;
        // An image on this host is sent: the daemon opens no host path for a client.
        if let Some(from) = &recipe.from {
            if let Some(sent) = crate::send_image::send_local_image(client, &text, from).await? {
                text = sent;
            }
        }
        // Its files go along: the daemon may be on another host.
        let files: serde_json::Map<String, Value> = recipe
            .read_files()?
            .into_iter()
            .map(|(src, bytes)| {
                let text = base64::engine::general_purpose::STANDARD.encode(bytes);
                (src, Value::String(text))
            })
            .collect();
        json!({ "template": recipe.name, "recipe": text, "files": files })
    } else {
        json!({ "template": name })
    };
    let tag = tag
        .map(str::to_owned)
        .unwrap_or_else(|| body["template"].as_str().unwrap_or_default().to_owned());
    body["tag"] = tag.clone().into();
    if replace {
        // Refused (409, naming them) while children run from it.
        match client
            .delete(&format!("/v1/snapshots/{}", path_tag(&tag)?))
            .await
        {
            Ok(()) => {}
            // Nothing to replace.
            Err(e)
                if e.downcast_ref::<ApiFailure>()
                    .is_some_and(|f| f.status == StatusCode::NOT_FOUND) => {}
            Err(e) => return Err(e),
        }
    }
    let op: Value = client
        .json(Method::POST, "/v1/snapshots", Some(&body))
        .await?;
    let id = crate::sandboxes::path_id(op["id"].as_str().unwrap_or_default())?.to_owned();
    let say = |m: &str| eprintln!("[{:6.1}s] {m}", t0.elapsed().as_secs_f64());
    say(&format!(
        "building template {} as {tag} (operation {id})",
        body["template"].as_str().unwrap_or("")
    ));
    // Each step the daemon reports is shown once.
    let mut shown = 0;
    let op = loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let op: Value = client
            .json(Method::GET, &format!("/v1/operations/{id}"), None)
            .await?;
        if op["status"] != "running" {
            break op;
        }
        let steps = op["steps"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        for step in steps.iter().skip(shown).filter_map(Value::as_str) {
            say(step);
        }
        shown = shown.max(steps.len());
    };
    if op["status"] != "succeeded" {
        anyhow::bail!(
            "building {tag}: {}",
            op["error"]
                .as_str()
                .unwrap_or("the operation did not succeed")
        );
    }
    say(&format!("froze the parent into snapshot {tag}"));
    client
        .json(
            Method::GET,
            &format!("/v1/snapshots/{}", path_tag(&tag)?),
            None,
        )
        .await
}

/// A tag as a URL path component. Tags are checked by the daemon; this only keeps
/// what cannot be a tag out of the path.
fn path_tag(tag: &str) -> Result<String> {
    Ok(Tag::parse(tag)?.to_string())
}

pub async fn snapshot(client: &Client, cmd: SnapshotCommand) -> Result<()> {
    match cmd {
        SnapshotCommand::Verify { tag, json } => {
            let path = format!("/v1/snapshots/{}/verify", path_tag(&tag)?);
            let v: Value = client.json(Method::POST, &path, None).await?;
            if json {
                return print_json(&v);
            }
            let links = v["links"].as_u64().unwrap_or(1);
            println!(
                "{tag}: every part matches its digest{} ({} hashed in {:.1} s)",
                if links > 1 {
                    format!(
                        ", and so do its {} ancestors and each link's memory diff",
                        links - 1
                    )
                } else {
                    String::new()
                },
                human_size(v["bytes"].as_u64().unwrap_or(0)),
                v["millis"].as_f64().unwrap_or(0.0) / 1000.0
            );
            Ok(())
        }
        SnapshotCommand::Show { tag, json } => {
            let path = format!("/v1/snapshots/{}", path_tag(&tag)?);
            let v: Value = client.json(Method::GET, &path, None).await?;
            if json {
                return print_json(&v);
            }
            print_show(&v);
            Ok(())
        }
        SnapshotCommand::Compact { tag, new_tag } => {
            forkd_storage::snapshot::Tag::parse(&new_tag)?;
            let path = format!("/v1/snapshots/{}/compact", path_tag(&tag)?);
            let body = serde_json::json!({ "tag": new_tag });
            let v: Value = client.json(Method::POST, &path, Some(&body)).await?;
            println!(
                "wrote {new_tag}, a standalone copy of {tag} ({} on disk)",
                human_size(v["chain"]["own_bytes"].as_u64().unwrap_or(0))
            );
            Ok(())
        }
        SnapshotCommand::Pool {
            tag,
            size,
            reset,
            json,
        } => {
            let path = format!("/v1/snapshots/{}/pool", path_tag(&tag)?);
            let v: Value = if size.is_some() || reset {
                let body = serde_json::json!({ "size": size });
                client.json(Method::PUT, &path, Some(&body)).await?
            } else {
                client.json(Method::GET, &path, None).await?
            };
            if json {
                return print_json(&v);
            }
            println!(
                "{tag}: pool of {} (from the {}), {} ready, {} being prepared",
                v["size"],
                v["source"].as_str().unwrap_or("?"),
                v["idle"],
                v["filling"]
            );
            if let Some(e) = v["error"].as_str() {
                println!("  the last member could not be prepared: {e}");
            }
            Ok(())
        }
    }
}

/// `forkd snapshots`.
pub async fn list(client: &Client, json: bool) -> Result<()> {
    let v: Value = client.json(Method::GET, "/v1/snapshots", None).await?;
    let rows = v["snapshots"].as_array().cloned().unwrap_or_default();
    if json {
        return print_json(&Value::Array(rows));
    }
    if rows.is_empty() {
        println!("no snapshots (build one: forkd template build python)");
        return Ok(());
    }
    println!(
        "{:24} {:10} {:>7} {:>10} {:>8} {:>9}  CREATED",
        "TAG", "TEMPLATE", "MEMORY", "DISK", "CHILDREN", "POOL"
    );
    for r in rows {
        if r["status"] == "ok" {
            // Warm pool: members ready of its size.
            let pool = &r["pool"];
            let pool = match pool["size"].as_u64() {
                Some(0) | None => "-".to_owned(),
                Some(size) => format!("{}/{size}", pool["idle"].as_u64().unwrap_or(0)),
            };
            println!(
                "{:24} {:10} {:>4}MiB {:>10} {:>8} {:>9}  {}",
                r["tag"].as_str().unwrap_or(""),
                r["template"].as_str().unwrap_or(""),
                r["memory_mib"],
                human_size(r["disk_bytes"].as_u64().unwrap_or(0)),
                r["children"].as_array().map_or(0, Vec::len),
                pool,
                r["created_at"].as_str().unwrap_or("")
            );
        } else {
            println!(
                "{:24} DAMAGED: {}",
                r["tag"].as_str().unwrap_or(""),
                r["error"].as_str().unwrap_or("")
            );
        }
    }
    Ok(())
}

/// `forkd rmi TAG`.
pub async fn rmi(client: &Client, tag: &str, force: bool, cascade: bool) -> Result<()> {
    let mut dependents = Vec::new();
    if cascade {
        let v: Value = client
            .json(
                Method::GET,
                &format!("/v1/snapshots/{}", path_tag(tag)?),
                None,
            )
            .await?;
        dependents = v["dependents"].as_array().cloned().unwrap_or_default();
    }
    let path = format!(
        "/v1/snapshots/{}?force={force}&cascade={cascade}",
        path_tag(tag)?,
    );
    client.delete(&path).await?;
    if dependents.is_empty() {
        println!("removed snapshot {tag}");
    } else {
        println!("removed snapshot {tag} and the snapshots that depended on it");
    }
    Ok(())
}

/// `forkd snapshot show` for people.
fn print_show(v: &Value) {
    let s = |k: &str| v[k].as_str().unwrap_or("-").to_owned();
    let list = |x: &Value| {
        let items: Vec<&str> = x
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        if items.is_empty() {
            "none".to_owned()
        } else {
            items.join(", ")
        }
    };
    println!(
        "{}  ({}, template {})",
        s("tag"),
        s("status"),
        s("template")
    );
    if let Some(e) = v["error"].as_str() {
        println!("  error:       {e}");
    }
    println!("  created:     {}", s("created_at"));
    println!(
        "  machine:     {} vCPU, {} MiB, {}",
        v["vcpus"],
        v["memory_mib"],
        s("accel")
    );
    let c = &v["chain"];
    if c.is_object() {
        println!(
            "  chain:       depth {}; ancestors: {}",
            c["depth"],
            list(&c["ancestors"])
        );
        println!(
            "  size:        {} its own, {} memory image, {} the whole chain",
            human_size(c["own_bytes"].as_u64().unwrap_or(0)),
            human_size(c["memory_image_bytes"].as_u64().unwrap_or(0)),
            human_size(c["total_bytes"].as_u64().unwrap_or(0))
        );
    }
    if let Some(b) = v["branch"].as_object() {
        println!(
            "  branch of:   {} ({}, paused {:.1} ms, {} pages differ from its parent)",
            b["source"].as_str().unwrap_or("?"),
            b["mode"].as_str().unwrap_or("?"),
            b["pause_ms"].as_f64().unwrap_or(0.0),
            b["pages_changed"]
        );
    }
    println!("  dependents:  {}", list(&v["dependents"]));
    println!("  children:    {}", list(&v["children"]));
}
