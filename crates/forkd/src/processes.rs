//! `forkd process ...`: a sandbox's background processes, started, listed, signalled
//! and killed through the daemon.

use crate::sandboxes::path_id;
use anyhow::{bail, Result};
use forkd_daemon::client::Client;
use hyper::Method;
use serde_json::{json, Value};

/// `forkd process`.
#[derive(clap::Subcommand, Debug)]
pub enum ProcessCommand {
    /// Start a command in the background; prints its process number.
    Start {
        /// The sandbox.
        id: String,
        /// Run through /bin/sh -c (the words are joined with spaces).
        #[arg(long)]
        shell: bool,
        /// Print the process as JSON.
        #[arg(long)]
        json: bool,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// List a sandbox's background processes.
    Ls {
        /// The sandbox.
        id: String,
        /// Print them as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Send a signal to a background process's group (or to the process alone).
    Signal {
        /// The sandbox.
        id: String,
        /// The process's number (`forkd process ls`).
        process: u64,
        /// The signal: a name (SIGINT, INT, term) or a number (2).
        signal: String,
        /// To the process alone, not to its group.
        #[arg(long)]
        process_only: bool,
        /// Print the process as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Kill a background process's group and forget it.
    Kill {
        /// The sandbox.
        id: String,
        /// The process's number.
        process: u64,
        /// Print how it ended as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs a `forkd process` command.
pub async fn run(client: &Client, cmd: ProcessCommand) -> Result<()> {
    match cmd {
        ProcessCommand::Start {
            id,
            shell,
            json,
            command,
        } => {
            let body = if shell {
                json!({ "shell": command.join(" ") })
            } else {
                json!({ "cmd": command })
            };
            let path = format!("/v1/sandboxes/{}/processes", path_id(&id)?);
            let v: Value = client.json(Method::POST, &path, Some(&body)).await?;
            print(&v, json, || v["id"].to_string());
        }
        ProcessCommand::Ls { id, json } => {
            let path = format!("/v1/sandboxes/{}/processes", path_id(&id)?);
            let v: Value = client.json(Method::GET, &path, None).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            println!("{:>6}  {:>7}  {:<12}  COMMAND", "NUMBER", "PID", "STATE");
            for p in v.as_array().into_iter().flatten() {
                println!(
                    "{:>6}  {:>7}  {:<12}  {}",
                    p["id"],
                    p["pid"],
                    state(p),
                    argv(p)
                );
            }
        }
        ProcessCommand::Signal {
            id,
            process,
            signal,
            process_only,
            json,
        } => {
            // A number is sent as one, anything else as a name: the daemon checks both.
            let signal = signal
                .parse::<i32>()
                .map_or_else(|_| json!(signal), |n| json!(n));
            let path = format!("/v1/sandboxes/{}/processes/{process}/signal", path_id(&id)?);
            let body = json!({ "signal": signal, "group": !process_only });
            let v: Value = client.json(Method::POST, &path, Some(&body)).await?;
            print(&v, json, || format!("{process}: {}", state(&v)));
        }
        ProcessCommand::Kill { id, process, json } => {
            let path = format!("/v1/sandboxes/{}/processes/{process}", path_id(&id)?);
            let v: Value = client.json(Method::DELETE, &path, None).await?;
            if v["running"] == true {
                bail!("process {process} still runs");
            }
            print(&v, json, || format!("{process}: {}", state(&v)));
        }
    }
    Ok(())
}

/// `v` as JSON, or as `line` says.
fn print(v: &Value, json: bool, line: impl FnOnce() -> String) {
    if json {
        println!("{v}");
    } else {
        println!("{}", line());
    }
}

/// `running`, or how it ended.
fn state(p: &Value) -> String {
    if p["running"] == true {
        return "running".into();
    }
    match (p["signal"].as_i64(), p["exit_code"].as_i64()) {
        (Some(sig), _) => format!("signal {sig}"),
        (None, Some(code)) => format!("exit {code}"),
        (None, None) => "ended".into(),
    }
}

fn argv(p: &Value) -> String {
    p["argv"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect::<Vec<_>>()
        .join(" ")
}
