//! The `forkd` command line.

mod archive;
mod bench;
mod bench_archive;
mod bench_branch;
mod bench_cluster;
mod bench_network;
mod bench_persist;
mod bench_scale;
mod branch;
mod cluster;
mod daemon;
mod doctor;
mod events;
mod image;
mod mcp;
mod pause;
mod processes;
mod quickstart;
mod registry;
mod remote;
mod run;
mod sandboxes;
mod send_image;
mod snapshots;
mod terminal;

use anyhow::Result;
use clap::{Parser, Subcommand};
use forkd_image::Home;
use std::path::PathBuf;

/// forkd: microVM sandboxes for AI agents.
#[derive(Parser)]
#[command(name = "forkd", version, about, propagate_version = true)]
struct Cli {
    /// Data directory (guest assets, sandboxes). Default: /var/lib/forkd as root.
    #[arg(long, global = true, env = "FORKD_HOME")]
    home: Option<PathBuf>,
    /// Log more (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a throwaway sandbox, run one command in it, stream its output and exit with
    /// its exit code. Everything the sandbox made is removed afterwards. It has no
    /// network (fork a template's child for one).
    Run(run::RunArgs),
    /// Build or list the guest assets (kernel, initramfs, rootfs images).
    #[command(subcommand)]
    Image(image::ImageCommand),
    /// Check that this host can run forkd, and say how to fix what is missing.
    Doctor(doctor::DoctorArgs),
    /// Measure forkd (ratios and medians taken in one run).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Build templates: warm parents frozen into snapshots.
    #[command(subcommand)]
    Template(snapshots::TemplateCommand),
    /// Inspect or verify one snapshot.
    #[command(subcommand)]
    Snapshot(snapshots::SnapshotCommand),
    /// List the snapshots.
    Snapshots {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove a snapshot (refused while children of it run, unless --force, or while
    /// other snapshots depend on it, unless --cascade).
    Rmi {
        /// The snapshot's tag.
        tag: String,
        /// Stop the snapshot's children first.
        #[arg(long)]
        force: bool,
        /// Remove the snapshots that depend on it (branches of it) too.
        #[arg(long)]
        cascade: bool,
    },
    /// Write a snapshot (with its ancestors, for a branch) into an archive file: an OCI
    /// image layout in a tar, each part zstd-compressed.
    Pack(archive::PackArgs),
    /// Install the snapshots of an archive written by `forkd pack`; every digest is
    /// checked before anything is installed.
    Unpack(archive::UnpackArgs),
    /// Push a snapshot (with its ancestors, for a branch) to an OCI registry; blobs the
    /// registry has already are not sent again.
    Push(registry::PushArgs),
    /// Pull a snapshot (and its ancestors) from an OCI registry and install it.
    Pull(registry::PullArgs),
    /// Store credentials for a registry in the docker-style auth file push and pull
    /// read ($REGISTRY_AUTH_FILE, else ~/.docker/config.json).
    Login(registry::LoginArgs),
    /// Restore N children of a snapshot; prints their ids. They keep running after
    /// this command exits, until `forkd kill`.
    Fork(sandboxes::ForkArgs),
    /// Snapshot a running sandbox into a new snapshot (a diff on the one it builds on)
    /// and let it run on; fork the snapshot like any other. Prints the new tag.
    Branch(branch::BranchArgs),
    /// Write running sandboxes to disk and end their VMs: they keep their id, memory,
    /// processes and files, and cost no memory until resumed.
    Pause(pause::PauseArgs),
    /// Run paused sandboxes again, in place, as they were when paused.
    Resume(pause::PauseArgs),
    /// Run a command in a sandbox, streaming its output; exits with its exit code.
    Exec(sandboxes::ExecArgs),
    /// An interactive terminal in a sandbox: its user's login shell (or the command
    /// after `--`) on a terminal sized as this one; exits with the command's code.
    Shell(terminal::ShellArgs),
    /// Run code in one of a sandbox's code contexts (state persists between calls).
    RunCode(sandboxes::RunCodeArgs),
    /// A sandbox's background processes: start, ls, signal, kill.
    #[command(subcommand)]
    Process(processes::ProcessCommand),
    /// List the sandboxes.
    Ls(sandboxes::LsArgs),
    /// Show the sandboxes' lifecycle events (created, started, paused, resumed,
    /// branched, failed, killed, timed out); --follow waits for new ones.
    Events(events::EventsArgs),
    /// Stop sandboxes and remove their files.
    Kill(sandboxes::KillArgs),
    /// Show a sandbox's egress policy, or change it while it runs (--egress, --allow,
    /// --deny).
    Network(sandboxes::NetworkArgs),
    /// Forward a local TCP port to a port in a sandbox, through the daemon (for a web
    /// server an agent started in it).
    PortForward(sandboxes::PortForwardArgs),
    /// Build the assets and the python template (once), fork children, run a pandas
    /// cell in each and print the time of every step.
    Quickstart(quickstart::QuickstartArgs),
    /// Run the daemon: the REST API on a unix socket (and TCP when asked). Sandboxes
    /// keep running when it stops and are adopted again when it starts.
    Daemon(Box<daemon::DaemonArgs>),
    /// The daemon's audit log.
    #[command(subcommand)]
    Audit(daemon::AuditCommand),
    /// The cluster of daemons this one is a host of (`forkd daemon --cluster`).
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Drain a host of the cluster: it takes no new sandboxes, and each of its
    /// sandboxes is paused and moved to the cluster's registry, to be resumed on
    /// another host at its next use.
    Drain(cluster::DrainArgs),
    /// Serve MCP on stdin/stdout: tools for an MCP client's model to list snapshots,
    /// create, branch and kill sandboxes, run commands and code, and read and write
    /// files in them, through the daemon.
    Mcp,
}

fn main() {
    let cli = Cli::parse();
    init_tracing(cli.verbose);
    // Fixed once, before any guest is read from: a bad value is refused here, not
    // replaced by a default later.
    if let Err(e) = forkd_proto::limits::init() {
        eprintln!("forkd: {e}");
        std::process::exit(2);
    }
    let env_checks = [
        forkd_qemu::cmdline::tcg_tb_mib().map(drop),
        forkd_host::sched::tcg_sched().map(drop),
    ];
    if let Some(Err(e)) = env_checks.into_iter().find(Result::is_err) {
        eprintln!("forkd: {e}");
        std::process::exit(2);
    }
    let home = cli.home.map(Home::new).unwrap_or_else(Home::from_env);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("forkd: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result: Result<i32> = runtime.block_on(async move {
        match cli.command {
            Command::Run(args) => run::run(&home, args).await,
            Command::Image(cmd) => image::run(&home, cmd).await.map(|()| 0),
            Command::Doctor(args) => doctor::run(&home, args),
            Command::Bench(cmd) => bench::run(&home, cmd).await.map(|()| 0),
            Command::Template(cmd) => snapshots::template(&remote::connect(&home)?, cmd)
                .await
                .map(|()| 0),
            Command::Snapshot(cmd) => snapshots::snapshot(&remote::connect(&home)?, cmd)
                .await
                .map(|()| 0),
            Command::Pack(args) => archive::pack(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::Unpack(args) => archive::unpack(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::Push(args) => registry::push(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::Pull(args) => registry::pull(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::Login(args) => registry::login(args).map(|()| 0),
            Command::Snapshots { json } => snapshots::list(&remote::connect(&home)?, json)
                .await
                .map(|()| 0),
            Command::Rmi {
                tag,
                force,
                cascade,
            } => snapshots::rmi(&remote::connect(&home)?, &tag, force, cascade)
                .await
                .map(|()| 0),
            Command::Fork(args) => sandboxes::fork_cmd(&remote::connect(&home)?, args).await,
            Command::Branch(args) => branch::branch(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::Pause(args) => pause::pause(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::Resume(args) => pause::resume(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::Exec(args) => sandboxes::exec(&remote::connect(&home)?, args).await,
            Command::Shell(args) => terminal::run(&remote::connect(&home)?, args).await,
            Command::RunCode(args) => sandboxes::run_code(&remote::connect(&home)?, args).await,
            Command::Events(args) => events::run(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::Process(cmd) => processes::run(&remote::connect(&home)?, cmd)
                .await
                .map(|()| 0),
            Command::Ls(args) => sandboxes::ls(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::Network(args) => sandboxes::network(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::PortForward(args) => sandboxes::port_forward(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::Kill(args) => sandboxes::kill(&remote::connect(&home)?, args)
                .await
                .map(|()| 0),
            Command::Quickstart(args) => quickstart::run(&home, args).await.map(|()| 0),
            Command::Daemon(args) => daemon::run(&home, *args).await.map(|()| 0),
            Command::Audit(cmd) => daemon::audit(&home, cmd).map(|()| 0),
            Command::Cluster(cmd) => cluster::run(&remote::connect(&home)?, cmd)
                .await
                .map(|()| 0),
            Command::Drain(args) => cluster::drain(&remote::connect(&home)?, args).await,
            Command::Mcp => mcp::serve(remote::connect(&home)?).await.map(|()| 0),
        }
    });
    // Shut the runtime down before exiting so that sandboxes' teardown tasks finish.
    drop(runtime);
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("forkd: {e:#}");
            std::process::exit(1);
        }
    }
}

/// A `KEY=VALUE` argument.
fn parse_key_val(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

fn init_tracing(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info,forkd=info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

/// Arguments shared by every verb that boots a sandbox.
#[derive(clap::Args, Debug, Clone)]
pub struct VmArgs {
    /// Root filesystem image.
    #[arg(long, default_value = "minimal")]
    image: forkd_image::RootfsImage,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    vcpus: u32,
    /// Guest memory in MiB.
    #[arg(long = "memory", default_value_t = 512, value_parser = clap::value_parser!(u32).range(64..=65536))]
    memory_mib: u32,
    /// Accelerator: auto (KVM only where the CPU has vmx/svm), kvm or tcg.
    #[arg(long, default_value = "auto")]
    accel: forkd_hypervisor::AccelChoice,
    /// Seconds the guest may take to boot until its agent answers.
    #[arg(long, default_value_t = 120)]
    boot_timeout: u64,
    /// Seconds without an answer to a ping after which the guest is declared unresponsive.
    #[arg(long, default_value_t = 30)]
    agent_timeout: u64,
}

impl VmArgs {
    fn options(&self) -> forkd_core::SandboxOptions {
        forkd_core::SandboxOptions {
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            accel: self.accel,
            boot_timeout: std::time::Duration::from_secs(self.boot_timeout),
            agent_timeout: std::time::Duration::from_secs(self.agent_timeout.max(1)),
            limits: Default::default(),
            seccomp: true,
            env: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;

    /// Verbs that print no data a script would parse: they act, stream a command's own
    /// output, serve, or write a file. Every other verb takes `--json`, as the README
    /// says; a new verb must land in one group or the other.
    const PRINTS_NO_DATA: &[&str] = &[
        "run",              // streams the command's own output
        "exec",             // streams the command's own output (--json too, for the result)
        "run-code",         // the cell's own output
        "image build",      // progress only; `image ls --json` lists what it made
        "image rm",         // acts
        "template ls",      // the built-in recipes' names
        "rmi",              // acts
        "kill",             // acts
        "login",            // writes the auth file
        "port-forward",     // serves a local port
        "shell",            // an interactive terminal
        "quickstart",       // a walk-through
        "daemon",           // serves
        "mcp",              // serves MCP on stdio
        "audit verify",     // a verdict and the exit status
        "snapshot compact", // acts, prints the new tag
    ];

    fn leaves(cmd: &clap::Command, prefix: &str, out: &mut Vec<(String, clap::Command)>) {
        for sub in cmd.get_subcommands() {
            let name = format!("{prefix}{}", sub.get_name());
            if sub.has_subcommands() {
                leaves(sub, &format!("{name} "), out);
            } else {
                out.push((name, sub.clone()));
            }
        }
    }

    #[test]
    fn the_command_line_is_consistent() {
        // clap's own checks: conflicting names, bad defaults, missing value names.
        Cli::command().debug_assert();
    }

    #[test]
    fn every_verb_that_prints_data_takes_json() {
        let mut all = Vec::new();
        leaves(&Cli::command(), "", &mut all);
        let mut missing = Vec::new();
        for (name, cmd) in &all {
            let json = cmd.get_arguments().any(|a| a.get_long() == Some("json"));
            let listed = PRINTS_NO_DATA.contains(&name.as_str());
            if !json && !listed && !name.starts_with("bench ") {
                missing.push(name.clone());
            }
        }
        assert!(missing.is_empty(), "verbs without --json: {missing:?}");
        // The list names only verbs that exist.
        for name in PRINTS_NO_DATA {
            assert!(all.iter().any(|(n, _)| n == name), "{name} is not a verb");
        }
    }

    #[test]
    fn destinations_in_the_help_are_what_the_policy_takes() {
        let mut all = Vec::new();
        leaves(&Cli::command(), "", &mut all);
        let fork = &all.iter().find(|(n, _)| n == "fork").unwrap().1;
        let allow = fork
            .get_arguments()
            .find(|a| a.get_long() == Some("allow"))
            .unwrap();
        let help = allow.get_help().unwrap().to_string();
        // Each example the help gives is a destination the API accepts.
        for example in ["pypi.org", "*.pythonhosted.org"] {
            assert!(help.contains(example), "{help}");
            let body = serde_json::json!({ "egress": "deny", "allow": [example] });
            serde_json::from_value::<forkd_host::network::policy::EgressPolicy>(body)
                .unwrap_or_else(|e| panic!("{example}: {e}"));
        }
    }
}
