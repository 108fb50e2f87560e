//! `forkd run`: a throwaway sandbox for one command.

use crate::VmArgs;
use anyhow::{bail, Context, Result};
use forkd_core::agent::ExecOutput;
use forkd_core::Sandbox;
use forkd_image::Home;
use forkd_proto::exec::{Command, ExecRequest};
use std::io::{IsTerminal, Write};
use std::time::Instant;

/// Arguments of `forkd run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    vm: VmArgs,
    /// Environment variable for the command (repeatable): KEY=VALUE.
    #[arg(short, long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Working directory in the guest.
    #[arg(long)]
    cwd: Option<String>,
    /// Kill the command after this many seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// Run the command through /bin/sh -c (the words are joined with spaces).
    #[arg(long)]
    shell: bool,
    /// Print how long each step took (to stderr).
    #[arg(long)]
    timings: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Runs the command; returns the exit code to exit with.
pub async fn run(home: &Home, args: RunArgs) -> Result<i32> {
    let t0 = Instant::now();
    let mut req = ExecRequest::new(if args.shell {
        Command::Shell(args.command.join(" "))
    } else {
        Command::Argv(args.command.clone())
    });
    for kv in &args.env {
        let Some((k, v)) = kv.split_once('=') else {
            bail!("--env {kv:?} is not KEY=VALUE");
        };
        if k.is_empty() {
            bail!("--env {kv:?} has an empty name");
        }
        req.env.insert(k.to_owned(), v.to_owned());
    }
    req.cwd = args.cwd.clone();
    if let Some(t) = args.timeout {
        if !(t > 0.0 && t.is_finite()) {
            bail!("--timeout must be a positive number of seconds");
        }
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a finite, positive number of seconds; `as` saturates past u64::MAX ms"
        )]
        let ms = (t * 1000.0).ceil() as u64;
        req.timeout_ms = Some(ms);
    }

    let assets = crate::image::ensure_assets(home, args.vm.image, false).await?;
    let t_assets = t0.elapsed();
    let sandbox = Sandbox::boot(
        forkd_qemu::hypervisor().as_ref(),
        home,
        &assets,
        &args.vm.options(),
    )
    .await
    .context("booting the sandbox")?;
    let boot = sandbox.timings();

    let stdin = if std::io::stdin().is_terminal() {
        None
    } else {
        Some(Box::new(tokio::io::stdin()) as forkd_core::agent::Stdin)
    };
    let t_exec = Instant::now();
    let result = tokio::select! {
        r = stream_command(&sandbox, req, stdin) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    let exec_time = t_exec.elapsed();
    let t_down = Instant::now();
    let destroyed = sandbox.destroy().await;
    let down = t_down.elapsed();
    if args.timings {
        eprintln!(
            "[forkd] assets {:.0} ms | QEMU up {:.0} ms | boot to first agent answer {:.0} ms | command {:.0} ms | teardown {:.0} ms | total {:.0} ms",
            ms(t_assets),
            ms(boot.hypervisor_ready),
            ms(boot.first_answer),
            ms(exec_time),
            ms(down),
            ms(t0.elapsed())
        );
    }
    let code = result?;
    destroyed.context("tearing the sandbox down")?;
    Ok(code)
}

async fn stream_command(
    sandbox: &Sandbox,
    req: ExecRequest,
    stdin: Option<forkd_core::agent::Stdin>,
) -> Result<i32> {
    let mut stream = sandbox.exec_stream(req, stdin).await?;
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    while let Some(item) = stream.next().await? {
        match item {
            ExecOutput::Stdout(b) => {
                out.write_all(&b)?;
                out.flush()?;
            }
            ExecOutput::Stderr(b) => {
                err.write_all(&b)?;
            }
            ExecOutput::Started(_) => {}
            ExecOutput::Exited(status) => {
                if status.timed_out {
                    eprintln!("forkd: the command timed out and was killed");
                }
                return Ok(status.shell_code());
            }
        }
    }
    bail!("the command's output ended without an exit status")
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
