//! `forkd bench archive`: what moving a snapshot costs, end to end through the daemon's
//! API, on a daemon of its own (see `bench_scale::BenchDaemon`):
//!
//! - pack: the archive's size against the template's RAM and disk, and its time;
//! - unpack of that archive under another tag, and its time;
//! - push to a registry on loopback (Debian's `docker-registry`, started here when no
//!   `--registry` is given), a second push (every blob there already), and a pull under
//!   a third tag;
//! - forks of one child (to its first exec) of the unpacked snapshot against the
//!   original, interleaved, medians compared.
#![expect(
    clippy::cast_precision_loss,
    reason = "reports: byte counts, ticks and counts become ratios and MiB shown to a few digits"
)]

use crate::bench::{median, ms};
use crate::bench_scale::{delete_all, fork_and_exec, BenchDaemon, Mode};
use anyhow::{Context, Result};
use forkd_image::Home;
use forkd_storage::snapshot::Tag;
use hyper::Method;
use serde::Serialize;
use serde_json::{json, Value};
use std::os::unix::fs::MetadataExt;
use std::time::Instant;

/// Arguments of `forkd bench archive`.
#[derive(clap::Args, Debug)]
pub struct ArchiveArgs {
    /// The template to build and move (a built-in name or a recipe file).
    #[arg(long, default_value = "python")]
    template: String,
    /// A registry (HOST:PORT) to push to and pull from; by default one is started on a
    /// loopback port if `docker-registry` is installed.
    #[arg(long)]
    registry: Option<String>,
    /// Forks of each snapshot to take the median of.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=50))]
    runs: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Sizes {
    /// Guest RAM.
    ram_bytes: u64,
    /// What the memory image takes on disk (sparse).
    memory_allocated: u64,
    /// The root filesystem and the disk layer, apparent.
    disk_bytes: u64,
    /// The same, allocated.
    disk_allocated: u64,
    archive_bytes: u64,
}

#[derive(Debug, Serialize)]
struct Registry {
    reference: String,
    push_ms: f64,
    second_push_ms: f64,
    second_push_uploaded: u64,
    pull_ms: f64,
}

#[derive(Debug, Serialize)]
struct ArchiveReport {
    template: String,
    sizes: Sizes,
    archive_per_ram: f64,
    archive_per_allocated: f64,
    pack_ms: f64,
    unpack_ms: f64,
    registry: Option<Registry>,
    original_fork_ms: Vec<f64>,
    unpacked_fork_ms: Vec<f64>,
    median_original_fork_ms: f64,
    median_unpacked_fork_ms: f64,
    unpacked_to_original: f64,
}

/// A registry process of the benchmark's own, stopped when dropped.
pub(crate) struct LocalRegistry {
    child: std::process::Child,
    pub(crate) addr: String,
}

impl LocalRegistry {
    pub(crate) fn start(dir: &std::path::Path) -> Result<LocalRegistry> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let addr = format!("127.0.0.1:{port}");
        let config = dir.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
                dir.join("registry").display()
            ),
        )?;
        let child = std::process::Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting docker-registry")?;
        let reg = LocalRegistry { child, addr };
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        while std::net::TcpStream::connect(&reg.addr).is_err() {
            if Instant::now() > deadline {
                anyhow::bail!("docker-registry did not answer within 30 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Ok(reg)
    }
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sizes_of(dir: &std::path::Path, archive_bytes: u64) -> Result<Sizes> {
    let m = |name: &str| std::fs::metadata(dir.join(name)).with_context(|| name.to_owned());
    let (mem, rootfs, disk) = (m("memory.ram")?, m("rootfs.ext4")?, m("disk.qcow2")?);
    Ok(Sizes {
        ram_bytes: mem.len(),
        memory_allocated: mem.blocks() * 512,
        disk_bytes: rootfs.len() + disk.len(),
        disk_allocated: (rootfs.blocks() + disk.blocks()) * 512,
        archive_bytes,
    })
}

pub async fn run(home: &Home, args: ArchiveArgs) -> Result<()> {
    let say = |m: &str| {
        if !args.json {
            eprintln!("[forkd] {m}");
        }
    };
    let daemon = BenchDaemon::start(home, 8).await?;
    let c = &daemon.client;
    say(&format!("building the {} template", args.template));
    let info =
        crate::snapshots::build_template(c, &args.template, Some("bench-orig"), false).await?;
    let orig = Tag::parse(info["tag"].as_str().context("no tag")?)?;

    say("pack");
    let file = daemon.dir.join("bench.tar");
    let t = Instant::now();
    let (archive_bytes, _) = crate::archive::download(c, &orig, &file).await?;
    let pack_ms = ms(t.elapsed());
    let sizes = sizes_of(
        &daemon.dir.join("snapshots").join(orig.as_str()),
        archive_bytes,
    )?;

    say("unpack");
    let unpacked = Tag::parse("bench-unpacked")?;
    let t = Instant::now();
    crate::archive::upload(c, &file, Some(&unpacked)).await?;
    let unpack_ms = ms(t.elapsed());
    std::fs::remove_file(&file)?;

    let local;
    let registry_addr = match &args.registry {
        Some(r) => Some(r.clone()),
        None if which("docker-registry") => {
            local = LocalRegistry::start(&daemon.dir)?;
            Some(local.addr.clone())
        }
        None => {
            say("no registry (give --registry, or install docker-registry): push and pull skipped");
            None
        }
    };
    let registry = match registry_addr {
        None => None,
        Some(addr) => {
            let reference = format!(
                "{addr}/forkd-bench/{}:{}",
                orig,
                forkd_host::ids::random_hex(3)
            );
            say(&format!("push to {reference}"));
            let push = || async {
                let op: Value = c
                    .json(
                        Method::POST,
                        &format!("/v1/snapshots/{orig}/push"),
                        Some(&json!({ "reference": reference })),
                    )
                    .await?;
                crate::registry::follow(c, &op, "pushing").await
            };
            let t = Instant::now();
            push().await?;
            let push_ms = ms(t.elapsed());
            let t = Instant::now();
            let again = push().await?;
            let second_push_ms = ms(t.elapsed());
            say("pull");
            let t = Instant::now();
            let op: Value = c
                .json(
                    Method::POST,
                    "/v1/pull",
                    Some(&json!({ "reference": reference, "tag": "bench-pulled" })),
                )
                .await?;
            crate::registry::follow(c, &op, "pulling").await?;
            let pull_ms = ms(t.elapsed());
            Some(Registry {
                reference,
                push_ms,
                second_push_ms,
                second_push_uploaded: again["result"]["uploaded"].as_u64().unwrap_or(0),
                pull_ms,
            })
        }
    };

    say("forks of the original and of the unpacked snapshot, interleaved");
    let (mut original_fork_ms, mut unpacked_fork_ms) = (Vec::new(), Vec::new());
    for _ in 0..args.runs {
        for (tag, out) in [
            (&orig, &mut original_fork_ms),
            (&unpacked, &mut unpacked_fork_ms),
        ] {
            let t = Instant::now();
            let (ids, _) = fork_and_exec(c, tag.as_str(), 1, Mode::Fresh).await?;
            out.push(ms(t.elapsed()));
            delete_all(c, &ids).await?;
        }
    }
    drop(daemon);
    let (mo, mu) = (
        median(original_fork_ms.clone()),
        median(unpacked_fork_ms.clone()),
    );
    let report = ArchiveReport {
        template: args.template.clone(),
        archive_per_ram: archive_bytes as f64 / sizes.ram_bytes as f64,
        archive_per_allocated: archive_bytes as f64
            / (sizes.memory_allocated + sizes.disk_allocated) as f64,
        sizes,
        pack_ms,
        unpack_ms,
        registry,
        original_fork_ms,
        unpacked_fork_ms,
        median_original_fork_ms: mo,
        median_unpacked_fork_ms: mu,
        unpacked_to_original: mu / mo,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

fn which(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|d| d.join(program).is_file()))
}

fn print_report(r: &ArchiveReport) {
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    let s = &r.sizes;
    println!("archive benchmark: template {}", r.template);
    println!(
        "  template: RAM {:.0} MiB ({:.0} MiB allocated), disk {:.0} MiB ({:.0} MiB allocated)",
        mib(s.ram_bytes),
        mib(s.memory_allocated),
        mib(s.disk_bytes),
        mib(s.disk_allocated)
    );
    println!(
        "  archive {:.0} MiB = {:.2} x its RAM, {:.2} x what its memory and disk take on disk",
        mib(s.archive_bytes),
        r.archive_per_ram,
        r.archive_per_allocated
    );
    println!(
        "  pack {:.1} s, unpack {:.1} s",
        r.pack_ms / 1000.0,
        r.unpack_ms / 1000.0
    );
    if let Some(g) = &r.registry {
        println!(
            "  push {:.1} s, again {:.1} s ({} blobs uploaded), pull {:.1} s ({})",
            g.push_ms / 1000.0,
            g.second_push_ms / 1000.0,
            g.second_push_uploaded,
            g.pull_ms / 1000.0,
            g.reference
        );
    }
    println!(
        "  fork + first exec, median of {}: original {:.0} ms, unpacked {:.0} ms ({:.2} x)",
        r.original_fork_ms.len(),
        r.median_original_fork_ms,
        r.median_unpacked_fork_ms,
        r.unpacked_to_original
    );
}
