//! `forkd fork`, `forkd exec`, `forkd run-code`, `forkd ls`, `forkd kill`: sandboxes of
//! the daemon, through its API.

use crate::remote::{fail, print_json};
use anyhow::{bail, Context, Result};
use base64::Engine;
use forkd_daemon::client::{Client, ExecLine, Lines};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use std::io::{IsTerminal, Read, Write};
use std::time::Instant;

/// Arguments of `forkd fork`.
/// What a child's timeout does.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum OnTimeout {
    /// Stop it and remove its files.
    Kill,
    /// Pause it to disk.
    Pause,
}

#[derive(clap::Args, Debug)]
pub struct ForkArgs {
    /// The snapshot to fork.
    #[arg(long, short)]
    tag: String,
    /// How many children (1 to 256; the API's `n`).
    #[arg(short = 'n', long = "count", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=forkd_core::fork::MAX_CHILDREN as i64))]
    count: u16,
    /// A label KEY=VALUE (repeatable), to find the children by.
    #[arg(long = "label", value_parser = crate::parse_key_val)]
    labels: Vec<(String, String)>,
    /// Seconds after which the daemon stops each child (or pauses it: --on-timeout).
    #[arg(long)]
    timeout: Option<u64>,
    /// What --timeout does: kill (stop and remove the child) or pause (write it to
    /// disk; it resumes on its next request and stays until killed). Default: the
    /// template's recipe's `on_timeout`, else kill.
    #[arg(long, value_enum)]
    on_timeout: Option<OnTimeout>,
    /// Pause each child after this many seconds without a request, exec or open
    /// stream; its next request resumes it.
    #[arg(long, value_name = "SECS")]
    auto_pause_after: Option<u64>,
    /// Keep the children that start when others fail (each failure is printed, and the
    /// exit status is 1); by default a fork is all or nothing.
    #[arg(long)]
    partial: bool,
    /// Memory each child's QEMU may use, in MiB, guest RAM included (default: its RAM
    /// plus 512). Less than its RAM is allowed: a child whose guest touches more is
    /// stopped by the kernel and fails saying so.
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(128..=1_048_576))]
    memory_limit: Option<u64>,
    /// CPU quota of each child's QEMU, in cores (0.5: half a core; 0: none). Default:
    /// one core per vCPU.
    #[arg(long, value_name = "CORES")]
    cpus: Option<f64>,
    /// Share of CPU under contention, 1 to 10000 (default 100).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    cpu_weight: Option<u32>,
    /// Processes and threads each child's QEMU may have (default 256).
    #[arg(long, value_parser = clap::value_parser!(u32).range(16..=65_536))]
    pids: Option<u32>,
    #[command(flatten)]
    egress: EgressArgs,
    /// On a daemon in a cluster: spread the children over its hosts (`spread`: each to
    /// the host with the most free slots) or fill one host before the next (`pack`, the
    /// default). The fork is then answered whole, without progress. Without it (and
    /// --host-label) the fork is made on the host this command talks to.
    #[arg(long, value_parser = ["pack", "spread"])]
    placement: Option<String>,
    /// On a daemon in a cluster: only hosts with this label KEY=VALUE (repeatable).
    #[arg(long = "host-label", value_parser = crate::parse_key_val)]
    host_labels: Vec<(String, String)>,
    /// Print the children as JSON.
    #[arg(long)]
    json: bool,
}

/// An egress policy on the command line (`forkd fork`, `forkd network`).
#[derive(clap::Args, Debug, Default)]
pub struct EgressArgs {
    /// What the sandbox may reach: `deny` (only what --allow lists), `allow` (every
    /// public destination but what --deny lists) or `off` (its link is down). Default
    /// for a fork: deny. Private ranges, the host and other sandboxes stay unreachable
    /// unless a destination inside them is allowed.
    #[arg(long, value_parser = ["deny", "allow", "off"])]
    egress: Option<String>,
    /// A destination let out (repeatable): ADDRESS[/PREFIX][:PORT], or NAME[:PORT]
    /// where NAME is a DNS name (pypi.org) or every name under one (*.pythonhosted.org).
    #[arg(long = "allow", value_name = "DEST")]
    allow: Vec<String>,
    /// A destination refused with --egress allow (repeatable), written as for --allow.
    #[arg(long = "deny", value_name = "DEST")]
    deny: Vec<String>,
}

impl EgressArgs {
    /// The API's `network` body, if anything was given.
    fn body(&self) -> Option<Value> {
        if self.egress.is_none() && self.allow.is_empty() && self.deny.is_empty() {
            return None;
        }
        let egress = self.egress.clone().unwrap_or_else(|| {
            if self.deny.is_empty() {
                "deny"
            } else {
                "allow"
            }
            .to_owned()
        });
        Some(json!({ "egress": egress, "allow": self.allow, "deny": self.deny }))
    }
}

/// Arguments of `forkd network`.
#[derive(clap::Args, Debug)]
pub struct NetworkArgs {
    /// The sandbox.
    id: String,
    #[command(flatten)]
    egress: EgressArgs,
    /// Print the sandbox as JSON.
    #[arg(long)]
    json: bool,
}

/// Shows a sandbox's egress policy, or replaces it.
pub async fn network(client: &Client, args: NetworkArgs) -> Result<()> {
    let id = path_id(&args.id)?;
    let path = format!("/v1/sandboxes/{id}");
    let info: Value = match args.egress.body() {
        None => client.json(Method::GET, &path, None).await?,
        Some(body) => {
            client
                .json(Method::PUT, &format!("{path}/network"), Some(&body))
                .await?
        }
    };
    if args.json {
        return print_json(&info);
    }
    let net = &info["network"];
    if net.is_null() {
        println!("{id}: no NIC (its template was built without network)");
        return Ok(());
    }
    let list = |k: &str| {
        net[k]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()
    };
    println!("egress: {}", net["egress"].as_str().unwrap_or("?"));
    println!("allow:  {}", list("allow"));
    println!("deny:   {}", list("deny"));
    Ok(())
}

/// Arguments of `forkd port-forward`.
#[derive(clap::Args, Debug)]
pub struct PortForwardArgs {
    /// The sandbox.
    id: String,
    /// The TCP port in the sandbox.
    port: u16,
    /// The local port to listen on (default: the same number; 0 picks a free one).
    #[arg(long)]
    local_port: Option<u16>,
    /// The local address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    address: std::net::IpAddr,
}

/// Listens on a local port and carries each connection to the sandbox's port through
/// the daemon, until interrupted.
pub async fn port_forward(client: &Client, args: PortForwardArgs) -> Result<()> {
    let id = path_id(&args.id)?.to_owned();
    if args.port == 0 {
        bail!("port 0 is not a port");
    }
    let path = format!("/v1/sandboxes/{id}/ports/{}", args.port);
    // One tunnel first: a sandbox without a NIC, or a port nobody listens on, is an
    // error now rather than at the first connection.
    drop(
        client
            .upgrade(&path, forkd_daemon::client::TUNNEL_PROTOCOL)
            .await?,
    );
    let local = args.local_port.unwrap_or(args.port);
    let listener = tokio::net::TcpListener::bind((args.address, local))
        .await
        .with_context(|| format!("listening on {}:{local}", args.address))?;
    eprintln!(
        "forwarding {} to port {} of {id} (Ctrl-C stops)",
        listener.local_addr()?,
        args.port
    );
    loop {
        let (mut conn, peer) = tokio::select! {
            accepted = listener.accept() => accepted?,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        let (client, path) = (client.clone(), path.clone());
        tokio::spawn(async move {
            match client
                .upgrade(&path, forkd_daemon::client::TUNNEL_PROTOCOL)
                .await
            {
                Ok(tunnel) => {
                    let mut tunnel = hyper_util::rt::TokioIo::new(tunnel);
                    let _ = tokio::io::copy_bidirectional(&mut conn, &mut tunnel).await;
                }
                Err(e) => eprintln!("{peer}: {e:#}"),
            }
        });
    }
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
    /// Print the API's result as JSON instead of streaming: `stdout_b64` and `stderr_b64`
    /// (base64 of the raw bytes), exit code, signal, timeout.
    #[arg(long)]
    json: bool,
    /// Give the command /dev/null as stdin. Without it, what is piped into `forkd exec`
    /// (up to 700 KiB, read before the command starts) is the command's stdin; a
    /// terminal is never read.
    #[arg(long)]
    no_stdin: bool,
    /// Run the command on a terminal, joined to this one (as `forkd shell`): raw keys in,
    /// the screen out, resizes followed.
    #[arg(short = 't', long = "tty", conflicts_with_all = ["json", "no_stdin", "timeout"])]
    tty: bool,
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

/// Arguments of `forkd ls`.
#[derive(clap::Args, Debug)]
pub struct LsArgs {
    /// Only children of this snapshot.
    #[arg(long)]
    snapshot: Option<String>,
    /// Only sandboxes with this label (KEY=VALUE).
    #[arg(long)]
    label: Option<String>,
    /// In a cluster: only the sandboxes of this host (`forkd cluster hosts` names them).
    #[arg(long)]
    host: Option<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Arguments of `forkd kill`.
#[derive(clap::Args, Debug)]
pub struct KillArgs {
    /// Sandboxes to stop.
    ids: Vec<String>,
    /// Stop every sandbox.
    #[arg(long, conflicts_with = "ids")]
    all: bool,
    /// Print what was stopped as JSON.
    #[arg(long)]
    json: bool,
}

/// An id (of a sandbox or an operation) about to go into a URL path: anything but an
/// id's characters is refused here, whoever supplied it.
pub(crate) fn path_id(id: &str) -> Result<&str> {
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        bail!("no sandbox {id} (see `forkd ls`)");
    }
    Ok(id)
}

/// Forks children through the daemon: the fork runs as an operation whose progress is
/// shown while it runs; Ctrl-C cancels it (the children it started are removed). Returns
/// the exit code: 1 when a partial fork lost children.
pub async fn fork_cmd(client: &Client, args: ForkArgs) -> Result<i32> {
    let t0 = Instant::now();
    forkd_storage::snapshot::Tag::parse(&args.tag)?;
    let labels: serde_json::Map<String, Value> = args
        .labels
        .into_iter()
        .map(|(k, v)| (k, Value::String(v)))
        .collect();
    let mut body = json!({
        "snapshot": args.tag,
        "n": args.count,
        "labels": labels,
        "partial": args.partial,
        "wait": false,
    });
    if let Some(t) = args.timeout {
        body["timeout_s"] = t.into();
    }
    if let Some(t) = args.on_timeout {
        body["on_timeout"] = match t {
            OnTimeout::Kill => "kill",
            OnTimeout::Pause => "pause",
        }
        .into();
    }
    if let Some(t) = args.auto_pause_after {
        body["auto_pause_after_s"] = t.into();
    }
    let mut limits = serde_json::Map::new();
    if let Some(m) = args.memory_limit {
        limits.insert("memory_mib".into(), m.into());
    }
    if let Some(c) = args.cpus {
        limits.insert("cpu_cores".into(), c.into());
    }
    if let Some(w) = args.cpu_weight {
        limits.insert("cpu_weight".into(), w.into());
    }
    if let Some(p) = args.pids {
        limits.insert("pids".into(), p.into());
    }
    if !limits.is_empty() {
        body["limits"] = Value::Object(limits);
    }
    if let Some(network) = args.egress.body() {
        body["network"] = network;
    }
    let placed = args.placement.is_some() || !args.host_labels.is_empty();
    let result = if placed {
        // A fork placed on a cluster's hosts is answered whole, not as an operation.
        let labels: serde_json::Map<String, Value> = args
            .host_labels
            .into_iter()
            .map(|(k, v)| (k, Value::String(v)))
            .collect();
        body["placement"] = json!({
            "policy": args.placement.as_deref().unwrap_or("pack"),
            "labels": labels,
        });
        body["wait"] = true.into();
        let created: Value = client
            .json(Method::POST, "/v1/sandboxes", Some(&body))
            .await?;
        let ids: Vec<Value> = created["sandboxes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| s["id"].clone())
            .collect();
        json!({ "sandboxes": ids, "errors": created["errors"] })
    } else {
        let op: Value = client
            .json(Method::POST, "/v1/sandboxes", Some(&body))
            .await?;
        let op_id = op["id"].as_str().unwrap_or_default().to_owned();
        let op = follow_fork(client, &op_id, u64::from(args.count)).await?;
        match op["status"].as_str() {
            Some("succeeded") => {}
            Some(status) => bail!(
                "the fork {status}: {}",
                op["error"].as_str().unwrap_or("no detail")
            ),
            None => bail!("the daemon answered an operation without a status: {op}"),
        }
        op["result"].clone()
    };
    let ids: Vec<String> = result["sandboxes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    let errors: Vec<String> = result["errors"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    if args.json {
        let mut infos = Vec::with_capacity(ids.len());
        for id in &ids {
            let v: Value = client
                .json(Method::GET, &format!("/v1/sandboxes/{id}"), None)
                .await?;
            infos.push(v);
        }
        print_json(&Value::Array(infos))?;
    } else {
        for id in &ids {
            println!("{id}");
        }
    }
    for e in &errors {
        eprintln!("forkd: a child did not start: {e}");
    }
    eprintln!(
        "forked {} of {} ({} asked) in {:.0} ms",
        ids.len(),
        args.tag,
        args.count,
        t0.elapsed().as_secs_f64() * 1000.0
    );
    Ok(if errors.is_empty() { 0 } else { 1 })
}

/// Polls the fork operation `op_id` until it ends, showing children ready out of
/// `total` on a terminal; Ctrl-C asks the daemon to cancel it and waits for the end.
async fn follow_fork(client: &Client, op_id: &str, total: u64) -> Result<Value> {
    let bar = if std::io::IsTerminal::is_terminal(&std::io::stderr()) && total > 1 {
        indicatif::ProgressBar::new(total)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("forking {bar:30} {pos}/{len} ready ({elapsed})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let path = format!("/v1/operations/{op_id}");
    let mut interrupted = std::pin::pin!(tokio::signal::ctrl_c());
    let mut cancelled = false;
    // A fork of one from a warm pool ends in about a tenth of a second: look often at
    // first, then less and less often, up to every 100 ms.
    let mut pause = std::time::Duration::from_millis(5);
    loop {
        let op: Value = client.json(Method::GET, &path, None).await?;
        bar.set_position(op["done"].as_u64().unwrap_or(0));
        if op["status"] != "running" {
            bar.finish_and_clear();
            return Ok(op);
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {
                pause = (pause + std::time::Duration::from_millis(5))
                    .min(std::time::Duration::from_millis(100));
            }
            _ = &mut interrupted, if !cancelled => {
                cancelled = true;
                bar.println("cancelling the fork (its children are removed)...");
                let _ = client.call(Method::DELETE, &path, None).await;
            }
        }
    }
}

/// Runs a command, streaming its output; returns its exit code.
pub async fn exec(client: &Client, args: ExecArgs) -> Result<i32> {
    if args.tty {
        let command = if args.shell {
            vec![
                "/bin/sh".to_owned(),
                "-c".to_owned(),
                args.command.join(" "),
            ]
        } else {
            args.command
        };
        let shell = crate::terminal::ShellArgs::for_exec(args.id, command);
        return crate::terminal::run(client, shell).await;
    }
    let id = path_id(&args.id)?;
    let mut body = if args.shell {
        json!({ "shell": args.command.join(" ") })
    } else {
        json!({ "cmd": args.command })
    };
    if let Some(t) = args.timeout {
        if !(t > 0.0 && t.is_finite()) {
            bail!("--timeout must be a positive number of seconds");
        }
        body["timeout_s"] = t.into();
    }
    if !args.no_stdin && !std::io::stdin().is_terminal() {
        let input = read_stdin(EXEC_STDIN_MAX)?;
        if !input.is_empty() {
            body["stdin_b64"] = base64::engine::general_purpose::STANDARD
                .encode(&input)
                .into();
        }
    }
    let path = format!("/v1/sandboxes/{id}/exec");
    if args.json {
        let v: Value = client.json(Method::POST, &path, Some(&body)).await?;
        print_json(&v)?;
        return Ok(v["exit_code"]
            .as_i64()
            .and_then(|c| i32::try_from(c).ok())
            .unwrap_or(255));
    }
    body["stream"] = true.into();
    let mut lines = stream(client, &path, &body).await?;
    // The command's bytes, exactly: no text decoding on the way.
    let (mut out, mut err) = (std::io::stdout().lock(), std::io::stderr().lock());
    while let Some(e) = lines.next_exec().await? {
        match e {
            ExecLine::Stdout(b) => {
                out.write_all(&b).context("writing the command's stdout")?;
                out.flush().context("writing the command's stdout")?;
            }
            ExecLine::Stderr(b) => {
                err.write_all(&b).context("writing the command's stderr")?;
                err.flush().context("writing the command's stderr")?;
            }
            ExecLine::Exit(code) => return Ok(code),
            ExecLine::Error(message) => bail!("{message}"),
        }
    }
    bail!("the command's output ended without an exit status")
}

/// Most stdin `forkd exec` passes on: it travels base64 in the request, whose body the
/// API takes up to 1 MiB.
const EXEC_STDIN_MAX: u64 = 700 << 10;

/// All of standard input, refused beyond `max` bytes.
fn read_stdin(max: u64) -> Result<Vec<u8>> {
    let mut input = Vec::new();
    std::io::stdin()
        .lock()
        .take(max + 1)
        .read_to_end(&mut input)
        .context("reading standard input")?;
    if input.len() as u64 > max {
        bail!(
            "standard input is larger than the {} KiB `forkd exec` passes on: write it to a file in the sandbox and redirect from it, or give --no-stdin",
            max >> 10
        );
    }
    Ok(input)
}

async fn stream(client: &Client, path: &str, body: &Value) -> Result<Lines> {
    let resp = client
        .send(Method::POST, path, Some(serde_json::to_vec(body)?))
        .await?;
    if resp.status() != StatusCode::OK {
        return Err(fail(resp).await);
    }
    Ok(Lines::new(resp))
}

/// Runs a code cell, streaming what it prints; exits 1 when the cell raised.
pub async fn run_code(client: &Client, args: RunCodeArgs) -> Result<i32> {
    let id = path_id(&args.id)?;
    let code = if args.code == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the code from stdin")?
    } else {
        args.code.clone()
    };
    let mut body = json!({ "code": code, "context": args.context });
    if let Some(t) = args.timeout {
        body["timeout_s"] = t.into();
    }
    let path = format!("/v1/sandboxes/{id}/code");
    if args.json {
        let v: Value = client.json(Method::POST, &path, Some(&body)).await?;
        print_json(&v)?;
        return Ok(if v["error"].is_null() { 0 } else { 1 });
    }
    body["stream"] = true.into();
    let mut lines = stream(client, &path, &body).await?;
    let mut failed = false;
    while let Some(e) = lines.next().await? {
        let text = e["text"].as_str().unwrap_or("");
        match e["type"].as_str() {
            Some("stdout") => {
                print!("{text}");
                std::io::stdout().flush()?;
            }
            Some("stderr") => eprint!("{text}"),
            Some("result") => match e["png"].as_str() {
                Some(p) => println!("{text} [PNG, {} bytes base64]", p.len()),
                None => println!("{text}"),
            },
            Some("error") => {
                failed = true;
                let tb = e["traceback"].as_str().unwrap_or("");
                if tb.is_empty() {
                    eprintln!(
                        "{}: {}",
                        e["name"].as_str().unwrap_or(""),
                        e["value"].as_str().unwrap_or("")
                    );
                } else {
                    eprint!("{tb}");
                }
            }
            _ => {}
        }
    }
    Ok(i32::from(failed))
}

/// Lists the daemon's sandboxes.
pub async fn ls(client: &Client, args: LsArgs) -> Result<()> {
    let q: Vec<(&str, &str)> = [("snapshot", &args.snapshot), ("label", &args.label)]
        .into_iter()
        .filter_map(|(k, v)| v.as_deref().map(|v| (k, v)))
        .collect();
    let path = match serde_urlencoded::to_string(&q)? {
        q if q.is_empty() => "/v1/sandboxes".to_owned(),
        q => format!("/v1/sandboxes?{q}"),
    };
    let v: Value = client.json(Method::GET, &path, None).await?;
    let list: Vec<Value> = v["sandboxes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|s| args.host.as_deref().is_none_or(|h| s["host"] == h))
        .collect();
    if args.json {
        return print_json(&Value::Array(list));
    }
    if list.is_empty() {
        println!("no sandboxes (fork some: forkd fork --tag python -n 3)");
        return Ok(());
    }
    // A daemon in a cluster names each sandbox's host.
    let hosts = list.iter().any(|s| s["host"].is_string());
    let host = |s: &Value| match (hosts, s["host"].as_str()) {
        (false, _) => String::new(),
        (true, h) => format!("{:12} ", h.unwrap_or("")),
    };
    println!(
        "{}{:16} {:20} {:8} {:>8} {:>6} {:>15} {:9}  CREATED",
        if hosts {
            format!("{:12} ", "HOST")
        } else {
            String::new()
        },
        "ID",
        "SNAPSHOT",
        "STATUS",
        "PID",
        "CPUS",
        "MEMORY",
        "EGRESS"
    );
    for s in list {
        println!(
            "{}{:16} {:20} {:8} {:>8} {:>6} {:>15} {:9}  {}",
            host(&s),
            s["id"].as_str().unwrap_or(""),
            s["snapshot"].as_str().unwrap_or(""),
            s["status"].as_str().unwrap_or(""),
            s["pid"],
            cpus_column(&s["limits"]),
            memory_column(&s["limits"]),
            egress_column(&s["network"]),
            s["created_at"].as_str().unwrap_or("")
        );
    }
    Ok(())
}

/// A sandbox's egress policy for `forkd ls`: its mode, with how many destinations its
/// list holds (`deny+2`: two allowed; `allow-1`: one denied), or `-` without a NIC.
fn egress_column(network: &Value) -> String {
    let count = |k: &str| network[k].as_array().map_or(0, Vec::len);
    match network["egress"].as_str() {
        None => "-".into(),
        Some("deny") if count("allow") > 0 => format!("deny+{}", count("allow")),
        Some("allow") if count("deny") > 0 => format!("allow-{}", count("deny")),
        Some(mode) => mode.to_owned(),
    }
}

/// A sandbox's CPU quota for `forkd ls`: cores, `-` for none, `?` when unknown.
fn cpus_column(limits: &Value) -> String {
    match (limits.is_object(), limits["cpu_cores"].as_f64()) {
        (false, _) => "?".into(),
        (true, None) => "-".into(),
        (true, Some(c)) => format!("{c}"),
    }
}

/// A sandbox's memory for `forkd ls`: what its cgroup counts of its limit, in MiB
/// (`USED/LIMIT`), or only the limit when the host enforces none (`LIMIT*`).
fn memory_column(limits: &Value) -> String {
    let mib = |v: &Value| v.as_u64().map(|b| b >> 20);
    match (
        mib(&limits["memory_used_bytes"]),
        mib(&limits["memory_bytes"]),
    ) {
        (Some(used), Some(limit)) => format!("{used}/{limit}M"),
        (None, Some(limit)) if limits["enforced_by"].is_null() => format!("{limit}M*"),
        (None, Some(limit)) => format!("{limit}M"),
        _ => "?".into(),
    }
}

/// Stops sandboxes.
pub async fn kill(client: &Client, args: KillArgs) -> Result<()> {
    let ids: Vec<String> = if args.all {
        let v: Value = client.json(Method::GET, "/v1/sandboxes", None).await?;
        v["sandboxes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["id"].as_str().map(str::to_owned))
            .collect()
    } else {
        if args.ids.is_empty() {
            bail!("name the sandboxes to stop, or pass --all");
        }
        args.ids.clone()
    };
    let results = futures::future::join_all(ids.iter().map(|id| async move {
        client
            .delete(&format!("/v1/sandboxes/{}", path_id(id)?))
            .await
    }))
    .await;
    let mut rows = Vec::new();
    let mut failed = 0;
    for (id, r) in ids.iter().zip(results) {
        let (status, detail) = match r {
            Ok(()) => ("stopped", String::new()),
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
        rows.push(json!({ "id": id, "status": status, "error": detail }));
    }
    if args.json {
        print_json(&Value::Array(rows))?;
    }
    if failed > 0 {
        bail!("{failed} of {} sandboxes could not be stopped", ids.len());
    }
    Ok(())
}
