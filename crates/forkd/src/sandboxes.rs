//! `forkd fork`, `forkd exec`, `forkd run-code`, `forkd ls`, `forkd kill`: sandboxes of
//! the local catalog, which outlive the command that forked them.

use anyhow::{bail, Context, Result};
use forkd_core::agent::ExecOutput;
use forkd_core::fork::{fork, ForkOptions};
use forkd_core::snapshot::{Store, Tag};
use forkd_core::{Sandbox, SandboxOptions};
use forkd_image::Home;
use forkd_proto::context::{ContextEvent, RunCodeRequest};
use forkd_proto::exec::{Command, ExecRequest};
use std::io::Write;
use std::time::{Duration, Instant};

/// Arguments of `forkd fork`.
#[derive(clap::Args, Debug)]
pub struct ForkArgs {
    /// The snapshot to fork.
    #[arg(long, short)]
    tag: String,
    /// How many children (1 to 256).
    #[arg(short = 'n', long = "count", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=forkd_core::fork::MAX_CHILDREN as i64))]
    count: u16,
    /// Print the children as JSON.
    #[arg(long)]
    json: bool,
}

/// Arguments of `forkd exec`.
#[derive(clap::Args, Debug)]
pub struct ExecArgs {
    /// The sandbox.
    id: String,
    /// Run through /bin/sh -c (the words are joined with spaces).
    #[arg(long)]
    shell: bool,
    /// Kill the command after this many seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// Print the result as JSON (stdout, stderr, exit status) instead of streaming.
    #[arg(long)]
    json: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Arguments of `forkd run-code`.
#[derive(clap::Args, Debug)]
pub struct RunCodeArgs {
    /// The sandbox.
    id: String,
    /// The code (`-` reads it from stdin).
    code: String,
    /// The context to run in (default: the first one; a fresh one if there is none).
    #[arg(long)]
    context: Option<String>,
    /// Interrupt the code after this many seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// Print the whole execution as JSON instead of streaming.
    #[arg(long)]
    json: bool,
}

/// Arguments of `forkd kill`.
#[derive(clap::Args, Debug)]
pub struct KillArgs {
    /// Sandboxes to stop.
    ids: Vec<String>,
    /// Stop every sandbox of the catalog.
    #[arg(long, conflicts_with = "ids")]
    all: bool,
    /// Print what was stopped as JSON.
    #[arg(long)]
    json: bool,
}

fn attach_options() -> SandboxOptions {
    SandboxOptions {
        boot_timeout: Duration::from_secs(30),
        ..SandboxOptions::default()
    }
}

pub async fn fork_cmd(home: &Home, args: ForkArgs) -> Result<()> {
    let tag = Tag::parse(&args.tag)?;
    let t0 = Instant::now();
    let snap = Store::of_home(home).open(&tag)?;
    let opts = ForkOptions {
        count: usize::from(args.count),
        detached: true,
        ..ForkOptions::default()
    };
    let children = fork(home, &snap, &opts).await?;
    let total = t0.elapsed();
    let rows: Vec<serde_json::Value> = children
        .iter()
        .map(|c| {
            serde_json::json!({
                "id": c.id(),
                "snapshot": tag.as_str(),
                "pid": c.pid(),
                "ready_ms": c.timings().first_answer.as_secs_f64() * 1000.0,
            })
        })
        .collect();
    for c in children {
        c.release();
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        for r in &rows {
            println!("{}", r["id"].as_str().unwrap_or(""));
        }
        eprintln!(
            "forked {} of {tag} in {:.0} ms",
            rows.len(),
            total.as_secs_f64() * 1000.0
        );
    }
    Ok(())
}

pub async fn exec(home: &Home, args: ExecArgs) -> Result<i32> {
    let sb = Sandbox::attach(home, &args.id, &attach_options()).await?;
    let mut req = ExecRequest::new(if args.shell {
        Command::Shell(args.command.join(" "))
    } else {
        Command::Argv(args.command.clone())
    });
    if let Some(t) = args.timeout {
        if !(t > 0.0 && t.is_finite()) {
            bail!("--timeout must be a positive number of seconds");
        }
        req.timeout_ms = Some((t * 1000.0).ceil() as u64);
    }
    if args.json {
        let out = sb.exec(req, None).await?;
        let v = serde_json::json!({
            "stdout": String::from_utf8_lossy(&out.stdout),
            "stderr": String::from_utf8_lossy(&out.stderr),
            "exit": out.status,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        sb.release();
        return Ok(out.status.shell_code());
    }
    let mut stream = sb.exec_stream(req, None).await?;
    let mut code = None;
    while let Some(item) = stream.next().await? {
        match item {
            ExecOutput::Stdout(b) => {
                let mut o = std::io::stdout();
                o.write_all(&b)?;
                o.flush()?;
            }
            ExecOutput::Stderr(b) => std::io::stderr().write_all(&b)?,
            ExecOutput::Started(_) => {}
            ExecOutput::Exited(s) => code = Some(s.shell_code()),
        }
    }
    drop(stream);
    sb.release();
    code.context("the command's output ended without an exit status")
}

pub async fn run_code(home: &Home, args: RunCodeArgs) -> Result<i32> {
    let code = if args.code == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the code from stdin")?
    } else {
        args.code.clone()
    };
    let sb = Sandbox::attach(home, &args.id, &attach_options()).await?;
    let context = match args.context.clone() {
        Some(c) => c,
        None => {
            let list = sb.call(|a| async move { a.list_contexts().await }).await?;
            match list.first() {
                Some(c) => c.id.clone(),
                None => {
                    sb.call(|a| async move { a.create_context(&Default::default()).await })
                        .await?
                        .id
                }
            }
        }
    };
    let req = RunCodeRequest {
        code,
        timeout_ms: args.timeout.map(|t| (t * 1000.0).ceil() as u64),
    };
    let ctx = context.clone();
    let mut stream = sb
        .call(|a| async move { a.run_code_stream(&ctx, &req).await })
        .await?;
    let mut x = forkd_proto::context::Execution::default();
    while let Some(e) = stream.next().await? {
        if !args.json {
            match &e {
                ContextEvent::Stdout { text } => {
                    print!("{text}");
                    std::io::stdout().flush()?;
                }
                ContextEvent::Stderr { text } => eprint!("{text}"),
                ContextEvent::Result { text, png, .. } => match png {
                    Some(p) => println!("{text} [PNG, {} bytes base64]", p.len()),
                    None => println!("{text}"),
                },
                ContextEvent::Error { traceback, .. } => eprint!("{traceback}"),
                ContextEvent::Done { .. } => {}
            }
        }
        x.push(e);
    }
    sb.release();
    if args.json {
        let mut v = serde_json::to_value(&x)?;
        v["context"] = context.into();
        println!("{}", serde_json::to_string_pretty(&v)?);
    }
    Ok(if x.error.is_some() { 1 } else { 0 })
}

pub fn ls(home: &Home, json: bool) -> Result<()> {
    let entries = forkd_core::catalog::list(home);
    if json {
        let rows: Vec<_> = entries
            .iter()
            .map(|e| {
                serde_json::json!({
                    "id": e.record.id,
                    "snapshot": e.record.snapshot,
                    "status": e.status,
                    "pid": e.record.pid,
                    "created_at": e.record.created_at,
                    "vcpus": e.record.config.vcpus,
                    "memory_mib": e.record.config.memory_mib,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if entries.is_empty() {
        println!("no sandboxes (fork some: forkd fork --tag python -n 3)");
        return Ok(());
    }
    println!(
        "{:16} {:20} {:8} {:>8}  CREATED",
        "ID", "SNAPSHOT", "STATUS", "PID"
    );
    for e in entries {
        println!(
            "{:16} {:20} {:8} {:>8}  {}",
            e.record.id,
            e.record.snapshot.as_deref().unwrap_or("-"),
            e.status,
            e.record.pid,
            e.record.created_at
        );
    }
    Ok(())
}

pub async fn kill(home: &Home, args: KillArgs) -> Result<()> {
    let ids: Vec<String> = if args.all {
        forkd_core::catalog::list(home)
            .into_iter()
            .map(|e| e.record.id)
            .collect()
    } else {
        if args.ids.is_empty() {
            bail!("name the sandboxes to stop, or pass --all");
        }
        args.ids.clone()
    };
    let results = futures::future::join_all(ids.iter().map(|id| kill_one(home, id))).await;
    let mut rows = Vec::new();
    let mut failed = 0;
    for (id, r) in ids.iter().zip(results) {
        let (status, detail) = match r {
            Ok(s) => (s, String::new()),
            Err(e) => {
                failed += 1;
                ("error", format!("{e:#}"))
            }
        };
        if !args.json {
            match status {
                "error" => eprintln!("forkd: {id}: {detail}"),
                s => println!("{id} {s}"),
            }
        }
        rows.push(serde_json::json!({ "id": id, "status": status, "error": detail }));
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    if failed > 0 {
        bail!("{failed} of {} sandboxes could not be stopped", ids.len());
    }
    Ok(())
}

async fn kill_one(home: &Home, id: &str) -> Result<&'static str> {
    let record = forkd_core::catalog::Record::read(home, id)?;
    let hv = forkd_hypervisor::qemu::Qemu::from_env();
    use forkd_hypervisor::Hypervisor;
    match hv
        .adopt(&record.config, record.pid, record.start_time)
        .await
    {
        Ok(vm) => {
            vm.stop(Duration::from_secs(3)).await?;
            forkd_core::sandbox::remove_dir(&record.config.dir)?;
            Ok("stopped")
        }
        Err(forkd_hypervisor::HypervisorError::NotRunning { .. }) => {
            forkd_core::sandbox::remove_dir(&record.config.dir)?;
            Ok("gone")
        }
        Err(e) => Err(e.into()),
    }
}
