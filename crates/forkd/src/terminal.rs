//! `forkd shell` and `forkd exec -t`: this terminal joined to a terminal in a sandbox
//! through the daemon's WebSocket (`/v1/sandboxes/{id}/pty`). The local terminal is put
//! in raw mode (every key goes to the sandbox, ^C included) and put back on the way out;
//! its size goes along at the start and on every SIGWINCH; the exit code is the remote
//! command's.

use anyhow::{bail, Context, Result};
use forkd_daemon::client::Client;
use futures::{SinkExt, StreamExt};
use nix::sys::termios::{self, SetArg, Termios};
use serde_json::{json, Value};
use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;
use tokio::signal::unix::{signal, SignalKind};
use tokio_tungstenite::tungstenite::Message;

/// Arguments of `forkd shell`.
#[derive(clap::Args, Debug)]
pub struct ShellArgs {
    /// The sandbox.
    id: String,
    /// Working directory in the guest (the user's home by default).
    #[arg(long)]
    cwd: Option<String>,
    /// Run as this guest user.
    #[arg(long)]
    user: Option<String>,
    /// A variable for the command, `NAME=value` (repeat for more).
    #[arg(long = "env", short = 'e')]
    env: Vec<String>,
    /// The command and its arguments (the user's login shell if none).
    #[arg(last = true)]
    command: Vec<String>,
}

impl ShellArgs {
    /// `forkd exec -t ID -- COMMAND`.
    pub fn for_exec(id: String, command: Vec<String>) -> ShellArgs {
        ShellArgs {
            id,
            cwd: None,
            user: None,
            env: Vec::new(),
            command,
        }
    }
}

/// The local terminal in raw mode until dropped.
struct RawMode {
    saved: Termios,
}

impl RawMode {
    fn enter() -> Result<Option<RawMode>> {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return Ok(None);
        }
        let saved = termios::tcgetattr(stdin.as_fd()).context("reading the terminal's mode")?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw)
            .context("putting the terminal in raw mode")?;
        Ok(Some(RawMode { saved }))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSANOW, &self.saved);
    }
}

/// The local terminal's size as (cols, rows), if stdout (or stdin) is a terminal.
fn local_size() -> Option<(u16, u16)> {
    let mut ws = nix::pty::Winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    for fd in [1, 0] {
        // SAFETY: TIOCGWINSZ writes one winsize into the pointer, valid for the call.
        if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } == 0 && ws.ws_col > 0 {
            return Some((ws.ws_col, ws.ws_row));
        }
    }
    None
}

/// The terminal's query string.
fn query(args: &ShellArgs, size: (u16, u16)) -> String {
    let mut q = vec![
        ("cols".to_owned(), size.0.to_string()),
        ("rows".to_owned(), size.1.to_string()),
    ];
    q.extend(args.command.iter().map(|w| ("cmd".to_owned(), w.clone())));
    q.extend(args.env.iter().map(|e| ("env".to_owned(), e.clone())));
    q.extend(args.cwd.iter().map(|c| ("cwd".to_owned(), c.clone())));
    q.extend(args.user.iter().map(|u| ("user".to_owned(), u.clone())));
    serde_urlencoded::to_string(&q).unwrap_or_default()
}

/// Runs the terminal; its command's exit code.
pub async fn run(client: &Client, args: ShellArgs) -> Result<i32> {
    let id = crate::sandboxes::path_id(&args.id)?;
    for e in &args.env {
        if !e.contains('=') {
            bail!("--env {e:?} is not NAME=value");
        }
    }
    let size = local_size().unwrap_or((80, 24));
    let path = format!("/v1/sandboxes/{id}/pty?{}", query(&args, size));
    let ws = client.websocket(&path).await?;
    let (mut tx, mut rx) = ws.split();
    let raw = RawMode::enter()?;

    // stdin on a thread of its own: a read blocked on a terminal cannot be cancelled,
    // and the process exits without waiting for it.
    let (typed_tx, mut typed) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = [0u8; 4096];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if typed_tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    let mut winch = signal(SignalKind::window_change()).context("watching the window size")?;
    let mut stdin_open = true;
    let mut exit_code = None;
    let mut ended: Option<String> = None;
    loop {
        tokio::select! {
            msg = rx.next() => match msg {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break,
                Some(Ok(Message::Binary(b))) => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&b)?;
                    out.flush()?;
                }
                Some(Ok(Message::Text(t))) => {
                    let v: Value = serde_json::from_str(&t).unwrap_or_default();
                    match v["type"].as_str() {
                        Some("exit") => exit_code = v["exit_code"].as_i64().and_then(|c| i32::try_from(c).ok()),
                        Some("closed") => {
                            ended = Some(format!(
                                "{} ({})",
                                v["reason"].as_str().unwrap_or("ended"),
                                v["message"].as_str().unwrap_or_default()
                            ));
                        }
                        _ => {}
                    }
                }
                Some(Ok(_)) => {}
            },
            keys = typed.recv(), if stdin_open => match keys {
                Some(k) => tx.send(Message::Binary(k.into())).await?,
                // Piped input ran out; the remote command still runs to its end.
                None => stdin_open = false,
            },
            _ = winch.recv() => {
                if let Some((cols, rows)) = local_size() {
                    let m = json!({"type": "resize", "cols": cols, "rows": rows}).to_string();
                    tx.send(Message::Text(m.into())).await?;
                }
            }
        }
    }
    drop(raw);
    match (exit_code, ended) {
        (Some(code), _) => Ok(code),
        (None, Some(why)) => bail!("the terminal ended: {why}"),
        (None, None) => bail!("the connection to the daemon closed before the command ended"),
    }
}
