//! Commands: foreground exec with streamed output, and background processes.

use super::{empty, with_query, AgentClient, AgentError, ReqBody};
use bytes::Bytes;
use forkd_proto::exec::{
    ExecEvent, ExecRequest, ExitStatus, ProcessInfo, PtySize, SignalRequest, StdinQuery, WaitQuery,
};
use forkd_proto::frame::{self, Decoder, Tag};
use forkd_proto::routes;
use http::Method;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use tokio::io::{AsyncRead, AsyncReadExt};

/// One item of a running command's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecOutput {
    /// The process started with this pid.
    Started(u32),
    /// Bytes it wrote to stdout.
    Stdout(Bytes),
    /// Bytes it wrote to stderr.
    Stderr(Bytes),
    /// It ended. Nothing follows.
    Exited(ExitStatus),
}

/// Everything a finished command produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecResult {
    /// All of stdout.
    pub stdout: Vec<u8>,
    /// All of stderr.
    pub stderr: Vec<u8>,
    /// How it ended.
    pub status: ExitStatus,
}

/// The streamed output of a foreground command.
pub struct ExecStream {
    body: Incoming,
    decoder: Decoder,
    finished: bool,
    /// For a terminal: ends the request's body when the stream is dropped. An HTTP/2
    /// stream whose response was dropped stays open while its request still streams,
    /// so the agent would not learn that the host went and kill the command.
    _input: Option<tokio_util::sync::DropGuard>,
}

impl ExecStream {
    /// The next piece of output; `None` after [`ExecOutput::Exited`].
    pub async fn next(&mut self) -> Result<Option<ExecOutput>, AgentError> {
        loop {
            if self.finished {
                return Ok(None);
            }
            if let Some(f) = self
                .decoder
                .next_frame()
                .map_err(|e| AgentError::Malformed(e.to_string()))?
            {
                return self.interpret(f).map(Some);
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.decoder.push(&data);
                    }
                }
                Some(Err(e)) => return Err(AgentError::Http(e.to_string())),
                None => {
                    return Err(AgentError::Malformed(
                        "exec output ended without an exit status".into(),
                    ))
                }
            }
        }
    }

    fn interpret(&mut self, f: frame::Frame) -> Result<ExecOutput, AgentError> {
        match f.tag {
            Tag::Stdout => Ok(ExecOutput::Stdout(f.payload)),
            Tag::Stderr => Ok(ExecOutput::Stderr(f.payload)),
            Tag::Stdin | Tag::Resize => {
                Err(AgentError::Malformed("input frame in exec output".into()))
            }
            Tag::Json => {
                let ev: ExecEvent = serde_json::from_slice(&f.payload)
                    .map_err(|e| AgentError::Malformed(format!("exec event: {e}")))?;
                match ev {
                    ExecEvent::Started { pid } => Ok(ExecOutput::Started(pid)),
                    ExecEvent::Exited(s) => {
                        self.finished = true;
                        Ok(ExecOutput::Exited(s))
                    }
                    ExecEvent::Error(d) => {
                        self.finished = true;
                        Err(AgentError::Agent {
                            status: d.code.http_status(),
                            code: d.code,
                            message: d.message,
                        })
                    }
                }
            }
        }
    }

    /// Reads the stream to the end, collecting all output.
    pub async fn collect(mut self) -> Result<ExecResult, AgentError> {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        while let Some(out) = self.next().await? {
            match out {
                ExecOutput::Stdout(b) => stdout.extend_from_slice(&b),
                ExecOutput::Stderr(b) => stderr.extend_from_slice(&b),
                ExecOutput::Started(_) => {}
                ExecOutput::Exited(status) => {
                    return Ok(ExecResult {
                        stdout,
                        stderr,
                        status,
                    })
                }
            }
        }
        Err(AgentError::Malformed("exec stream ended early".into()))
    }
}

/// Stdin for a foreground command.
pub type Stdin = Box<dyn AsyncRead + Send + Unpin + 'static>;

/// What goes to a command's terminal ([`AgentClient::exec_on_terminal`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TerminalInput {
    /// Bytes typed.
    Typed(Bytes),
    /// The terminal's new size.
    Resize(PtySize),
}

impl AgentClient {
    /// Runs a command in the foreground. If `stdin` is given it is streamed to the
    /// command (and `req.stdin` is set); the command sees EOF when it ends.
    pub async fn exec(
        &self,
        mut req: ExecRequest,
        stdin: Option<Stdin>,
    ) -> Result<ExecStream, AgentError> {
        req.stdin = stdin.is_some();
        let header = exec_header(&req)?;
        let body: ReqBody = match stdin {
            None => full_body(header),
            Some(mut reader) => {
                let (tx, rx) =
                    tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
                tokio::spawn(async move {
                    if tx.send(Ok(Frame::data(header))).await.is_err() {
                        return;
                    }
                    let mut buf = vec![0u8; 256 * 1024];
                    loop {
                        match reader.read(&mut buf).await {
                            Ok(0) => break,
                            Ok(n) => {
                                // The buffer is smaller than a frame: one frame per read.
                                for f in frame::encode_chunked(Tag::Stdin, &buf[..n]) {
                                    if tx.send(Ok(Frame::data(f))).await.is_err() {
                                        return;
                                    }
                                }
                            }
                            Err(e) => {
                                let _ = tx.send(Err(e)).await;
                                break;
                            }
                        }
                    }
                });
                StreamBody::new(tokio_stream(rx)).boxed()
            }
        };
        self.exec_request(body, None).await
    }

    async fn exec_request(
        &self,
        body: ReqBody,
        input: Option<tokio_util::sync::DropGuard>,
    ) -> Result<ExecStream, AgentError> {
        let resp = self.send(Method::POST, routes::EXEC, body).await?;
        Ok(ExecStream {
            body: resp.into_body(),
            decoder: Decoder::new(),
            finished: false,
            _input: input,
        })
    }

    /// Runs a command on a terminal of `size` (an empty argv: the user's login shell);
    /// what comes from `input` is typed into it or resizes it. Its output is all
    /// [`ExecOutput::Stdout`]. The end of `input` ends nothing: the command runs until
    /// it exits, or until the returned stream is dropped (which kills it).
    pub async fn exec_on_terminal(
        &self,
        mut req: ExecRequest,
        size: PtySize,
        input: tokio::sync::mpsc::Receiver<TerminalInput>,
    ) -> Result<ExecStream, AgentError> {
        self.needs(forkd_proto::exec::PTY, "run a command on a terminal")?;
        req.pty = Some(size);
        req.stdin = false;
        let header = exec_header(&req)?;
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
        let dropped = tokio_util::sync::CancellationToken::new();
        let guard = dropped.clone().drop_guard();
        tokio::spawn(async move {
            if tx.send(Ok(Frame::data(header))).await.is_err() {
                return;
            }
            // Once `input` ends the body stays open until the command ends: its end
            // would mean nothing to a terminal.
            let mut input = Some(input);
            loop {
                let next = async {
                    match input.as_mut() {
                        Some(i) => i.recv().await,
                        None => std::future::pending().await,
                    }
                };
                let item = tokio::select! {
                    item = next => item,
                    () = tx.closed() => return,
                    () = dropped.cancelled() => {
                        // A body that fails resets the stream: the agent kills the
                        // command at once.
                        let _ = tx.try_send(Err(std::io::Error::other("the terminal was closed")));
                        return;
                    }
                };
                let frames = match item {
                    None => {
                        input = None;
                        continue;
                    }
                    Some(TerminalInput::Typed(b)) => frame::encode_chunked(Tag::Stdin, &b),
                    Some(TerminalInput::Resize(size)) => {
                        let json = serde_json::to_vec(&size).expect("a size serializes");
                        frame::encode_chunked(Tag::Resize, &json)
                    }
                };
                for f in frames {
                    if tx.send(Ok(Frame::data(f))).await.is_err() {
                        return;
                    }
                }
            }
        });
        let body = StreamBody::new(tokio_stream(rx)).boxed();
        self.exec_request(body, Some(guard)).await
    }

    /// Runs a command to completion and returns all of its output.
    pub async fn exec_output(
        &self,
        req: ExecRequest,
        stdin: Option<Vec<u8>>,
    ) -> Result<ExecResult, AgentError> {
        let stdin = stdin.map(|b| Box::new(std::io::Cursor::new(b)) as Stdin);
        self.exec(req, stdin).await?.collect().await
    }

    /// Starts a background process.
    pub async fn spawn_process(&self, req: &ExecRequest) -> Result<ProcessInfo, AgentError> {
        self.post_json(routes::PROCESSES, req).await
    }

    /// Lists background processes, running and exited.
    pub async fn list_processes(&self) -> Result<Vec<ProcessInfo>, AgentError> {
        self.get_json(routes::PROCESSES).await
    }

    /// One background process.
    pub async fn get_process(&self, id: u64) -> Result<ProcessInfo, AgentError> {
        self.get_json(&routes::process(id)).await
    }

    /// Waits for a background process to end, at most `timeout_ms` if given.
    pub async fn wait_process(
        &self,
        id: u64,
        timeout_ms: Option<u64>,
    ) -> Result<ProcessInfo, AgentError> {
        let path = with_query(&routes::process_wait(id), &WaitQuery { timeout_ms });
        let resp = self.send(Method::POST, &path, empty()).await?;
        super::read_json(resp).await
    }

    /// Writes `data` to the stdin of a background process started with `stdin`, then
    /// closes it if `close`.
    pub async fn write_process_stdin(
        &self,
        id: u64,
        data: Bytes,
        close: bool,
    ) -> Result<ProcessInfo, AgentError> {
        let path = with_query(&routes::process_stdin(id), &StdinQuery { close });
        let resp = self.send(Method::POST, &path, full_body(data)).await?;
        super::read_json(resp).await
    }

    /// Sends `signal` to a background process's group.
    pub async fn signal_process(
        &self,
        id: u64,
        signal: i32,
        process_only: bool,
    ) -> Result<ProcessInfo, AgentError> {
        if process_only {
            self.needs(
                forkd_proto::exec::SIGNALS,
                "signal a process outside its group",
            )?;
        }
        let req = SignalRequest {
            signal,
            process_only,
        };
        self.post_json(&routes::process_signal(id), &req).await
    }

    /// Sends `signal` to the guest process `pid` (a foreground command's, from its
    /// `Started` event, or any other but the agent), or to its group.
    pub async fn signal_pid(&self, pid: u32, signal: i32, group: bool) -> Result<(), AgentError> {
        self.needs(forkd_proto::exec::SIGNALS, "signal a process by its pid")?;
        let req = forkd_proto::exec::PidSignalRequest { pid, signal, group };
        let _: serde_json::Value = self.post_json(routes::SIGNAL, &req).await?;
        Ok(())
    }

    /// Kills a background process and forgets it.
    pub async fn kill_process(&self, id: u64) -> Result<ProcessInfo, AgentError> {
        self.request_json(Method::DELETE, &routes::process(id))
            .await
    }
}

/// An exec request's header frame. The request travels as one frame: one that does not
/// fit is the caller's to shrink (big inputs belong on stdin), not something to cut.
fn exec_header(req: &ExecRequest) -> Result<Bytes, AgentError> {
    frame::encode_json(req).map_err(|e| AgentError::Agent {
        status: 413,
        code: forkd_proto::ErrorCode::InvalidArgument,
        message: format!(
            "the command, its environment and working directory are too large for the \
             agent protocol ({e}); pass large inputs on stdin or as a file"
        ),
    })
}

fn full_body(header: Bytes) -> ReqBody {
    http_body_util::Full::new(header)
        .map_err(|never| match never {})
        .boxed()
}

/// An mpsc receiver as a `Stream`.
pub(crate) fn tokio_stream<T>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
