//! `forkd-agent`: the forkd guest agent.
//!
//! One static binary with three roles, picked at start:
//! - stage 1 (`/init` of the initramfs: PID 1 and `/forkd-initramfs` exists): load the
//!   virtio modules, mount the root disk, switch root and exec `forkd-agent pid1`;
//! - PID 1 (`forkd-agent pid1`, or PID 1 without the initramfs marker): init duties and
//!   the agent protocol on the virtio-serial port named `agent`;
//! - dev (`forkd-agent serve-unix PATH`): the agent protocol on a unix socket, for
//!   running the real agent on a host in tests. No init duties.

mod children;
mod cmdline;
mod contexts;
mod error;
mod exec;
mod files;
mod network;
mod pid1;
mod port;
mod processes;
mod pty;
mod resume;
mod server;
mod session;
mod stage1;
mod watch;

use server::{AppState, Mode};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

const USAGE: &str = "\
usage: forkd-agent [pid1 | serve-unix PATH | --version | --help]

  (no arguments, as PID 1)  stage 1 in a forkd initramfs, else PID 1 mode
  pid1                      init duties, then serve the agent protocol on the
                            virtio-serial port named \"agent\"
  serve-unix PATH           serve the agent protocol on a unix socket at PATH
                            (for tests on a host: no init duties; shutdown exits)
  --version                 print the agent and protocol versions
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let am_init = nix::unistd::getpid().as_raw() == 1;
    if am_init && stage1::is_stage1() {
        stage1::run();
    }
    match args.first().map(String::as_str) {
        Some("--version" | "-V") => {
            println!(
                "forkd-agent {} (protocol {})",
                forkd_proto::AGENT_VERSION,
                forkd_proto::PROTOCOL_VERSION
            );
            ExitCode::SUCCESS
        }
        Some("--help" | "-h") => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some("serve-unix") => match args.get(1) {
            Some(path) if args.len() == 2 => serve_unix(PathBuf::from(path)),
            _ => usage_error("serve-unix takes exactly one PATH"),
        },
        Some("pid1") => run_pid1(),
        // The kernel passes init the command line words it does not understand; as PID 1
        // those must not stop the guest.
        _ if am_init => run_pid1(),
        Some(other) => usage_error(&format!("unknown argument {other:?}")),
        None => usage_error("not PID 1: say what to do"),
    }
}

fn usage_error(msg: &str) -> ExitCode {
    eprint!("forkd-agent: {msg}\n{USAGE}");
    ExitCode::from(2)
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("forkd-agent")
        .build()
}

/// PID 1 mode. Never returns while it is PID 1: an init that exits panics the kernel.
fn run_pid1() -> ExitCode {
    pid1::setup();
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => pid1::die(&format!("cannot start the async runtime: {e}")),
    };
    rt.block_on(async {
        let children = children::Children::new();
        tokio::spawn(pid1::reaper(children.clone()));
        let state = AppState::new(Mode::Pid1, children);
        let port = loop {
            match port::PortIo::open().await {
                Ok(p) => break p,
                // Keep trying: the host may hot-plug the port, and stopping the guest
                // would lose whatever it holds.
                Err(e) => pid1::log(&format!("{e}; still waiting")),
            }
        };
        pid1::log(&format!(
            "agent {} serving on {}",
            forkd_proto::AGENT_VERSION,
            port.path().display()
        ));
        session::serve_channel(port, state, "port").await;
    });
    pid1::die("the agent port went away for good")
}

/// Dev mode: the protocol on a unix socket; each connection is served on its own.
fn serve_unix(path: PathBuf) -> ExitCode {
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("forkd-agent: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(listen(&path)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("forkd-agent: serving on {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}

async fn listen(path: &Path) -> std::io::Result<()> {
    // A socket left behind by an earlier run would make bind fail; anything else at
    // the path is not ours to remove.
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if meta.file_type().is_socket() {
            std::fs::remove_file(path)?;
        }
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    eprintln!(
        "forkd-agent: agent {} serving on unix socket {}",
        forkd_proto::AGENT_VERSION,
        path.display()
    );
    let state = AppState::new(Mode::Dev, children::Children::new());
    let mut n: u64 = 0;
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                n += 1;
                let state = state.clone();
                tokio::spawn(async move {
                    session::serve_channel(stream, state, &format!("connection {n}")).await;
                });
            }
            Err(e) => {
                // Out of descriptors and the like: wait instead of spinning.
                eprintln!("forkd-agent: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
