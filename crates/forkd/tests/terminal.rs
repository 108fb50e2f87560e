//! Terminals in a sandbox, under QEMU: the WebSocket (`/v1/sandboxes/{id}/pty`) running
//! bash, resized, exiting with a code, going on across a branch of its sandbox, ended
//! by a pause and by a removal, and a flood its client does not read; and `forkd shell`
//! driven in tmux, a real terminal whose screen is read.

mod common;

use common::{call, create, runtime, Daemon};
use forkd_daemon::client::{Client, WebSocket};
use futures::{SinkExt, StreamExt};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;

/// What a terminal sent so far.
#[derive(Default)]
struct Screen {
    bytes: Vec<u8>,
    texts: Vec<Value>,
    close_reason: Option<String>,
}

impl Screen {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }
}

/// Reads the terminal until `done` holds (at most a minute; the socket may close).
async fn read_until(ws: &mut WebSocket, screen: &mut Screen, done: impl Fn(&Screen) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done(screen) {
        let left = deadline.saturating_duration_since(Instant::now());
        let msg = tokio::time::timeout(left, ws.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "a minute without it; the screen: {:?}, messages: {:?}",
                    screen.text(),
                    screen.texts
                )
            });
        match msg {
            Some(Ok(Message::Binary(b))) => screen.bytes.extend_from_slice(&b),
            Some(Ok(Message::Text(t))) => screen.texts.push(serde_json::from_str(&t).unwrap()),
            Some(Ok(Message::Close(f))) => {
                screen.close_reason = Some(f.map(|f| f.reason.to_string()).unwrap_or_default());
            }
            Some(Ok(_)) => {}
            None | Some(Err(_)) => {
                assert!(
                    done(screen),
                    "the socket ended first; the screen: {:?}, messages: {:?}",
                    screen.text(),
                    screen.texts
                );
                return;
            }
        }
    }
}

/// The terminal's `closed` message.
fn closed(screen: &Screen) -> &serde_json::Value {
    screen
        .texts
        .iter()
        .find(|t| t["type"] == "closed")
        .expect("a closed message")
}

async fn typed(ws: &mut WebSocket, s: &str) {
    ws.send(Message::Binary(s.as_bytes().to_vec().into()))
        .await
        .unwrap();
}

async fn open(c: &Client, id: &str, query: &str) -> (WebSocket, Screen) {
    let mut ws = c
        .websocket(&format!("/v1/sandboxes/{id}/pty?{query}"))
        .await
        .unwrap();
    let mut screen = Screen::default();
    read_until(&mut ws, &mut screen, |s| !s.texts.is_empty()).await;
    assert_eq!(screen.texts[0]["type"], "started", "{:?}", screen.texts);
    assert!(screen.texts[0]["pid"].as_u64().is_some_and(|p| p > 1));
    (ws, screen)
}

#[test]
fn a_terminal_runs_bash_follows_its_size_survives_a_branch_and_ends_on_pause_or_removal() {
    let d = Daemon::start(&[]);
    d.link_snapshot("minimal", "mini");
    let rt = runtime();
    let c = d.unix();
    rt.block_on(async {
        let id = create(&c, "mini", 1).await.remove(0);

        // Bad requests are plain HTTP errors, before any upgrade.
        let e = c
            .websocket("/v1/sandboxes/nope/pty")
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("404"), "{e}");
        let e = c
            .websocket(&format!("/v1/sandboxes/{id}/pty?cols=0"))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("400") && e.contains("cols"), "{e}");
        let e = c
            .websocket(&format!("/v1/sandboxes/{id}/pty?cwd=/no/such/dir"))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("working directory"), "{e}");
        let (s, v) = call(&c, Method::GET, &format!("/v1/sandboxes/{id}/pty"), None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");

        let (mut ws, mut screen) = open(&c, &id, "cols=80&rows=24&cmd=bash&env=PS1=%24%20").await;
        typed(&mut ws, "stty size\n").await;
        read_until(&mut ws, &mut screen, |s| s.text().contains("24 80")).await;
        ws.send(Message::Text(
            json!({"type": "resize", "cols": 100, "rows": 30})
                .to_string()
                .into(),
        ))
        .await
        .unwrap();
        typed(&mut ws, "stty size; echo x=$((6*7))\n").await;
        read_until(&mut ws, &mut screen, |s| {
            s.text().contains("30 100") && s.text().contains("x=42")
        })
        .await;

        // A branch of the sandbox leaves its terminal running on the source side.
        let (s, v) = call(
            &c,
            Method::POST,
            &format!("/v1/sandboxes/{id}/branch"),
            Some(json!({"tag": "t-branch"})),
        )
        .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        typed(&mut ws, "echo after-$((40+2))-branch\n").await;
        read_until(&mut ws, &mut screen, |s| {
            s.text().contains("after-42-branch")
        })
        .await;

        typed(&mut ws, "exit 3\n").await;
        read_until(&mut ws, &mut screen, |s| s.close_reason.is_some()).await;
        let exit = screen
            .texts
            .iter()
            .find(|t| t["type"] == "exit")
            .expect("an exit message");
        assert_eq!(exit["exit_code"], 3, "{exit}");
        assert_eq!(screen.close_reason.as_deref(), Some("exited"));

        // A pause ends a terminal with the reason.
        let (mut ws, mut screen) = open(&c, &id, "").await;
        typed(&mut ws, "echo login=$0\n").await;
        read_until(&mut ws, &mut screen, |s| s.text().contains("login=-")).await;
        let (s, v) = call(&c, Method::POST, &format!("/v1/sandboxes/{id}/pause"), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        read_until(&mut ws, &mut screen, |s| s.close_reason.is_some()).await;
        assert_eq!(closed(&screen)["reason"], "paused");
        assert_eq!(screen.close_reason.as_deref(), Some("paused"));

        // A client that reads nothing of a flood holds the command back, not the
        // daemon's memory.
        let (mut ws, _) = open(&c, &id, "cmd=yes").await;
        let before = common::rss_kib(d.pid());
        tokio::time::sleep(Duration::from_secs(5)).await;
        let after = common::rss_kib(d.pid());
        assert!(
            after.saturating_sub(before) <= 16 * 1024,
            "the daemon grew from {before} to {after} KiB while a terminal's client read nothing"
        );
        let mut screen = Screen::default();
        read_until(&mut ws, &mut screen, |s| s.bytes.len() > 1 << 20).await;
        assert!(
            screen.text().starts_with("y\r\ny\r\n"),
            "{:?}",
            &screen.text()[..20]
        );

        // The sandbox removed under its terminal: the terminal says so.
        let (s, v) = call(&c, Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
        read_until(&mut ws, &mut screen, |s| s.close_reason.is_some()).await;
        assert_eq!(closed(&screen)["reason"], "removed");
    });
}

/// Runs `tmux` on the test's own server socket.
fn tmux(socket: &str, args: &[&str]) -> String {
    let out = Command::new("tmux")
        .arg("-L")
        .arg(socket)
        .args(args)
        .output()
        .expect("tmux runs");
    assert!(
        out.status.success(),
        "tmux {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits (at most a minute) for the pane to show `want`; returns the screen.
fn screen_shows(socket: &str, want: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let screen = tmux(socket, &["capture-pane", "-p", "-t", "t"]);
        if screen.contains(want) {
            return screen;
        }
        assert!(
            Instant::now() < deadline,
            "the screen never showed {want:?}:\n{screen}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn forkd_shell_in_a_real_terminal_types_resizes_and_exits_with_the_remote_code() {
    let d = Daemon::start(&[]);
    d.link_snapshot("minimal", "mini");
    let rt = runtime();
    let c = d.unix();
    let id = rt.block_on(async { create(&c, "mini", 1).await.remove(0) });
    let dir = tempfile::tempdir().unwrap();
    let rc = dir.path().join("rc");
    let socket = format!("forkd-test-{}", std::process::id());
    let forkd = env!("CARGO_BIN_EXE_forkd");
    let cmd = format!(
        "FORKD_HOME={home} {forkd} shell {id} -- bash; echo \"rc=$?\" > {rc}; sleep 600",
        home = d.home.path().display(),
        rc = rc.display()
    );
    tmux(
        &socket,
        &[
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "100",
            "-y",
            "30",
            &cmd,
        ],
    );
    struct Server(String);
    impl Drop for Server {
        fn drop(&mut self) {
            let _ = Command::new("tmux")
                .args(["-L", &self.0, "kill-server"])
                .status();
        }
    }
    let _server = Server(socket.clone());

    tmux(
        &socket,
        &[
            "send-keys",
            "-t",
            "t",
            "echo hello-$((6*7)); stty size",
            "Enter",
        ],
    );
    let screen = screen_shows(&socket, "hello-42");
    screen_shows(&socket, "30 100");
    // Raw mode: ^C goes to the sandbox's foreground command, not to forkd.
    tmux(&socket, &["send-keys", "-t", "t", "sleep 100", "Enter"]);
    std::thread::sleep(Duration::from_millis(500));
    tmux(&socket, &["send-keys", "-t", "t", "C-c"]);
    tmux(
        &socket,
        &["send-keys", "-t", "t", "echo status=$?", "Enter"],
    );
    screen_shows(&socket, "status=130");
    // The window changes size: SIGWINCH, and the sandbox's terminal follows.
    tmux(
        &socket,
        &["resize-window", "-t", "t", "-x", "120", "-y", "40"],
    );
    std::thread::sleep(Duration::from_millis(300));
    tmux(&socket, &["send-keys", "-t", "t", "stty size", "Enter"]);
    screen_shows(&socket, "40 120");
    tmux(&socket, &["send-keys", "-t", "t", "exit 5", "Enter"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !rc.exists() {
        assert!(
            Instant::now() < deadline,
            "forkd shell did not end:\n{screen}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(std::fs::read_to_string(&rc).unwrap().trim(), "rc=5");
}
