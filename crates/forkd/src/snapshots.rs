//! `forkd template build`, `forkd snapshots`, `forkd snapshot verify`, `forkd rmi`.

use crate::image::human_size;
use anyhow::{Context, Result};
use forkd_core::snapshot::{Snapshot, Store, Tag};
use forkd_core::template::{self, Recipe};
use forkd_image::Home;
use std::path::PathBuf;
use std::time::Instant;

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
    /// Accelerator: auto, kvm or tcg. Children run with the same.
    #[arg(long, default_value = "auto")]
    accel: forkd_hypervisor::AccelChoice,
    /// Print the snapshot's manifest as JSON.
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
    },
    /// Print a snapshot's manifest.
    Show {
        /// The snapshot's tag.
        tag: String,
    },
}

pub async fn template(home: &Home, cmd: TemplateCommand) -> Result<()> {
    match cmd {
        TemplateCommand::Ls => {
            for (name, text) in template::BUILTIN {
                let r = Recipe::parse(name, text)?;
                println!("{name:10} {}", r.description);
            }
            Ok(())
        }
        TemplateCommand::Build(args) => build(home, args).await.map(drop),
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

pub async fn build(home: &Home, args: BuildArgs) -> Result<Snapshot> {
    let recipe = find_recipe(&args.name)?;
    let tag = Tag::parse(args.tag.as_deref().unwrap_or(&recipe.name))?;
    let store = Store::of_home(home);
    if args.force && store.exists(&tag) {
        remove(home, &store, &tag)?;
    }
    if store.exists(&tag) {
        return Err(forkd_core::snapshot::SnapshotError::Exists {
            tag: tag.to_string(),
        }
        .into());
    }
    let t0 = Instant::now();
    let assets = crate::image::ensure_assets(home, recipe.rootfs_image(), false).await?;
    let opts = template::BuildOptions {
        accel: args.accel,
        ..Default::default()
    };
    let progress = |m: &str| eprintln!("[{:6.1}s] {m}", t0.elapsed().as_secs_f64());
    let snap = template::build(home, &store, &recipe, &tag, &assets, &opts, &progress)
        .await
        .with_context(|| format!("building template {}", recipe.name))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&snap.manifest)?);
    } else {
        println!(
            "{tag}: {} on disk, built in {:.1} s",
            human_size(snap.disk_usage()),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(snap)
}

pub async fn snapshot(home: &Home, cmd: SnapshotCommand) -> Result<()> {
    let store = Store::of_home(home);
    match cmd {
        SnapshotCommand::Verify { tag } => {
            let tag = Tag::parse(&tag)?;
            let t0 = Instant::now();
            let snap = tokio::task::spawn_blocking(move || store.verify(&tag)).await??;
            println!(
                "{}: every part matches its digest ({} hashed in {:.1} s)",
                snap.tag,
                human_size(snap.manifest.parts.values().map(|p| p.size).sum()),
                t0.elapsed().as_secs_f64()
            );
            Ok(())
        }
        SnapshotCommand::Show { tag } => {
            let snap = store.open(&Tag::parse(&tag)?)?;
            println!("{}", serde_json::to_string_pretty(&snap.manifest)?);
            Ok(())
        }
    }
}

/// `forkd snapshots`.
pub fn list(home: &Home, json: bool) -> Result<()> {
    let store = Store::of_home(home);
    let rows: Vec<serde_json::Value> = store
        .list()
        .into_iter()
        .map(|(tag, res)| match res {
            Ok(s) => serde_json::json!({
                "tag": tag,
                "template": s.manifest.template,
                "created_at": s.manifest.created_at,
                "memory_mib": s.manifest.machine.memory_mib,
                "vcpus": s.manifest.machine.vcpus,
                "accel": s.manifest.machine.accel,
                "parent": s.manifest.parent,
                "disk_bytes": s.disk_usage(),
                "children": forkd_core::catalog::children_of(home, &tag),
                "status": "ok",
            }),
            Err(e) => {
                serde_json::json!({ "tag": tag, "status": "damaged", "error": e.to_string() })
            }
        })
        .collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("no snapshots (build one: forkd template build python)");
        return Ok(());
    }
    println!(
        "{:24} {:10} {:>7} {:>10} {:>8}  CREATED",
        "TAG", "TEMPLATE", "MEMORY", "DISK", "CHILDREN"
    );
    for r in rows {
        if r["status"] == "ok" {
            println!(
                "{:24} {:10} {:>4}MiB {:>10} {:>8}  {}",
                r["tag"].as_str().unwrap_or(""),
                r["template"].as_str().unwrap_or(""),
                r["memory_mib"],
                human_size(r["disk_bytes"].as_u64().unwrap_or(0)),
                r["children"].as_array().map_or(0, Vec::len),
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
pub fn rmi(home: &Home, tag: &str) -> Result<()> {
    let tag = Tag::parse(tag)?;
    remove(home, &Store::of_home(home), &tag)?;
    println!("removed snapshot {tag}");
    Ok(())
}

fn remove(home: &Home, store: &Store, tag: &Tag) -> Result<()> {
    let users = forkd_core::catalog::children_of(home, tag.as_str());
    store.remove(tag, &users)?;
    Ok(())
}
