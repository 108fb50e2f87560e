//! A small host side for the agent's integration tests: starts the real binary in
//! `serve-unix` mode, does the handshake and speaks HTTP/2 to it.

#![allow(dead_code)] // each test file uses its own part of this

use bytes::Bytes;
use forkd_proto::exec::{ExecEvent, ExecRequest, ExitStatus};
use forkd_proto::frame::{self, Decoder, Tag};
use forkd_proto::handshake::{self, ReadyScan};
use forkd_proto::io::Rewind;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::de::DeserializeOwned;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

/// Request bodies of the tests.
pub type ReqBody = BoxBody<Bytes, std::io::Error>;

/// A running `forkd-agent serve-unix`.
pub struct Agent {
    child: Child,
    /// Its socket.
    pub socket: PathBuf,
    /// A scratch directory that lives as long as the agent.
    pub dir: tempfile::TempDir,
}

impl Agent {
    /// Starts the agent and waits for its socket.
    pub async fn start() -> Agent {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("agent.sock");
        let log = std::fs::File::create(dir.path().join("agent.log")).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_forkd-agent"))
            .arg("serve-unix")
            .arg(&socket)
            .stdin(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start forkd-agent");
        let agent = Agent { child, socket, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while UnixStream::connect(&agent.socket).await.is_err() {
            assert!(Instant::now() < deadline, "agent socket never appeared");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        agent
    }

    /// The agent's pid.
    #[allow(dead_code)]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A new connection with a finished handshake.
    pub async fn connect(&self) -> Client {
        self.connect_after(b"").await
    }

    /// Like [`Agent::connect`], sending `garbage` before the greeting.
    pub async fn connect_after(&self, garbage: &[u8]) -> Client {
        connect_socket(&self.socket, garbage).await
    }

    /// Waits up to `timeout` for the agent process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Agent {
    /// What the agent logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A panic in one of the agent's tasks does not stop the agent, so it would go
        // unnoticed without this.
        let log = self.log();
        if log.contains("panicked") && !std::thread::panicking() {
            panic!("the agent panicked:\n{log}");
        }
    }
}

/// Connects to an agent socket (a `serve-unix` agent's, or QEMU's chardev socket of a
/// guest's port), sends `garbage`, then does the handshake.
pub async fn connect_socket(socket: &Path, garbage: &[u8]) -> Client {
    let mut stream = UnixStream::connect(socket).await.expect("connect");
    stream.write_all(garbage).await.expect("write garbage");
    let leftover = handshake_on(&mut stream).await;
    Client::over(Rewind::new(leftover, stream)).await
}

/// 32 hex digits from the kernel's RNG.
pub fn nonce() -> String {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .expect("urandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Sends a greeting on `stream` and reads up to the answer carrying its nonce; returns
/// the bytes read past the answer.
pub async fn handshake_on(stream: &mut UnixStream) -> Vec<u8> {
    let nonce = nonce();
    stream
        .write_all(&handshake::hello(&nonce))
        .await
        .expect("write hello");
    read_ready(stream, &nonce).await
}

/// Reads until the answer for `nonce`; returns the bytes after it.
pub async fn read_ready(stream: &mut UnixStream, nonce: &str) -> Vec<u8> {
    read_ready_with(stream, nonce).await.1
}

/// Reads until the answer for `nonce`; returns what it carried and the bytes after it.
pub async fn read_ready_with(stream: &mut UnixStream, nonce: &str) -> (Option<Vec<u8>>, Vec<u8>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let ReadyScan::Found {
            protocol,
            body,
            end,
        } = handshake::find_ready(&buf, nonce)
        {
            assert_eq!(protocol, forkd_proto::PROTOCOL_VERSION);
            return (body, buf.split_off(end));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let n = tokio::time::timeout(left, stream.read(&mut chunk))
            .await
            .expect("no FORKD-READY within 10 s")
            .expect("read");
        assert!(n > 0, "agent closed the connection before answering");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// An HTTP/2 client on one agent session.
pub struct Client {
    sender: SendRequest<ReqBody>,
}

/// What a finished exec returned.
#[derive(Debug, Default)]
pub struct ExecOutput {
    /// The pid from the `started` event.
    pub pid: Option<u32>,
    /// All stdout bytes.
    pub stdout: Vec<u8>,
    /// All stderr bytes.
    pub stderr: Vec<u8>,
    /// The final event (`exited` or `error`).
    pub last: Option<ExecEvent>,
    /// Frames seen after the final event (must stay 0).
    pub after_last: usize,
}

impl ExecOutput {
    /// The exit status; panics on anything else.
    pub fn exit(&self) -> ExitStatus {
        match &self.last {
            Some(ExecEvent::Exited(s)) => *s,
            other => panic!("expected an exit, got {other:?}"),
        }
    }
}

pub fn full(b: impl Into<Bytes>) -> ReqBody {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

pub fn empty() -> ReqBody {
    full(Bytes::new())
}

/// A request body fed by the returned sender.
pub fn channel_body() -> (mpsc::Sender<Bytes>, ReqBody) {
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::io::Error>(Frame::data(b)), rx))
    });
    (tx, StreamBody::new(stream).boxed())
}

impl Client {
    /// HTTP/2 over `io`, which is just past the handshake.
    pub async fn over<T>(io: T) -> Client
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(4 << 20)
            .initial_connection_window_size(16 << 20)
            .handshake(TokioIo::new(io))
            .await
            .expect("http2 handshake");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Client { sender }
    }

    /// Sends a request; returns the response with its body unread.
    pub async fn send(&mut self, method: Method, path: &str, body: ReqBody) -> Response<Incoming> {
        let req = Request::builder()
            .method(method)
            .uri(format!("http://agent{path}"))
            .body(body)
            .expect("request");
        self.sender.ready().await.expect("connection ready");
        self.sender.send_request(req).await.expect("send request")
    }

    /// Sends a request and reads the whole answer.
    pub async fn call(&mut self, method: Method, path: &str, body: ReqBody) -> (StatusCode, Bytes) {
        let resp = self.send(method, path, body).await;
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, body)
    }

    /// Sends a JSON body (or none) and parses a JSON answer.
    pub async fn json<T: DeserializeOwned>(
        &mut self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> (StatusCode, T) {
        let body = match body {
            Some(v) => full(serde_json::to_vec(&v).expect("json")),
            None => empty(),
        };
        let (status, bytes) = self.call(method, path, body).await;
        let value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!(
                "answer to {path} is not the expected JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            )
        });
        (status, value)
    }

    /// Starts an exec; the response streams frames.
    pub async fn exec_start(&mut self, body: ReqBody) -> Response<Incoming> {
        self.send(Method::POST, forkd_proto::routes::EXEC, body)
            .await
    }

    /// Runs `req` with `stdin` (sent as frames, then the body ends) to completion.
    pub async fn exec(&mut self, req: &ExecRequest, stdin: &[u8]) -> ExecOutput {
        let mut wire = frame::encode_json(req).unwrap().to_vec();
        for f in frame::encode_chunked(Tag::Stdin, stdin) {
            wire.extend_from_slice(&f);
        }
        let resp = self.exec_start(full(wire)).await;
        assert_eq!(resp.status(), StatusCode::OK);
        read_exec(resp.into_body()).await
    }
}

/// Reads an exec response body to its end.
pub async fn read_exec(mut body: Incoming) -> ExecOutput {
    let mut out = ExecOutput::default();
    let mut dec = Decoder::new();
    while let Some(f) = body.frame().await {
        let Ok(data) = f.expect("exec body").into_data() else {
            continue;
        };
        dec.push(&data);
        while let Some(fr) = dec.next_frame().expect("well-formed frames") {
            if out.last.is_some() {
                out.after_last += 1;
            }
            match fr.tag {
                Tag::Stdout => out.stdout.extend_from_slice(&fr.payload),
                Tag::Stderr => out.stderr.extend_from_slice(&fr.payload),
                Tag::Json => match serde_json::from_slice(&fr.payload).expect("event json") {
                    ExecEvent::Started { pid } => {
                        assert!(out.pid.is_none(), "two started events");
                        out.pid = Some(pid);
                    }
                    ev => out.last = Some(ev),
                },
                Tag::Stdin | Tag::Resize => panic!("input frame from the agent"),
            }
        }
    }
    dec.finish().expect("no partial frame at the end");
    out
}

/// Reads frames from an exec response until `pred` holds for the stdout seen so far.
pub async fn read_until_stdout(
    body: &mut Incoming,
    dec: &mut Decoder,
    stdout: &mut Vec<u8>,
    pred: impl Fn(&[u8]) -> bool,
) {
    while !pred(stdout) {
        let f = tokio::time::timeout(Duration::from_secs(60), body.frame())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "waited a minute for output; so far: {:?}",
                    String::from_utf8_lossy(stdout)
                )
            })
            .expect("body ended early")
            .expect("body");
        if let Ok(data) = f.into_data() {
            dec.push(&data);
            while let Some(fr) = dec.next_frame().expect("frames") {
                if fr.tag == Tag::Stdout {
                    stdout.extend_from_slice(&fr.payload);
                }
            }
        }
    }
}

/// URL-encodes a query value.
pub fn q(path: &Path) -> String {
    serde_urlencoded::to_string([("path", path.to_string_lossy())]).expect("query")
}
