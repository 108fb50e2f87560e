//! Agent sessions over one byte stream: scan for the host's greeting, answer it, serve
//! HTTP/2 until the stream ends or breaks, and start over.
//!
//! The stream under a session is cut at every snapshot and restore, and a restored guest
//! may still be inside the HTTP/2 session of the host it was snapshotted with when the new
//! host's greeting arrives. Two things bring the agent back to scanning then:
//! - the greeting read as HTTP/2 is a protocol error, which ends the connection; the last
//!   bytes it read are scanned again, so the greeting is not lost;
//! - if the greeting landed inside a frame the old session was still reading, no error
//!   comes; but a host that sent its greeting sends nothing more until it is answered, so
//!   a greeting at the very end of the input followed by [`HELLO_QUIET`] of silence ends
//!   the old session too. (Uploaded data that ends in a well-formed greeting and is
//!   followed by that much silence would trip it: the host would see its session reset.)

use crate::server::AppState;
use axum::Router;
use forkd_proto::context::{ResumeOutcome, ResumeRequest};
use forkd_proto::handshake::{
    hello_keep, ready, ready_with, scan_hello, Hello, HelloScan, HELLO_PREFIX, MAX_BODY,
};
use forkd_proto::io::Rewind;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::Notify;

/// HTTP/2 flow-control windows: generous, because the channel is a single local stream
/// and small windows would cost a round trip per few KiB of a large file or output.
const STREAM_WINDOW: u32 = 4 << 20;
const CONNECTION_WINDOW: u32 = 16 << 20;

/// How many of the last bytes a session read are kept for a rescan: a whole greeting,
/// body included.
const TAIL_KEEP: usize = MAX_BODY + 1024;

/// Silence after a greeting that ends the session it arrived in.
pub const HELLO_QUIET: Duration = Duration::from_millis(200);

/// A byte stream sessions run over.
pub trait Channel: AsyncRead + AsyncWrite + Unpin + Send {
    /// Called when a read returned end-of-file while no session is running. Returns once
    /// reading is worth trying again, or false if the stream is gone for good.
    fn idle(&mut self) -> impl Future<Output = bool> + Send;
}

impl Channel for tokio::net::UnixStream {
    async fn idle(&mut self) -> bool {
        false
    }
}

/// Serves sessions on `io` until it is gone for good (never, for the virtio port).
pub async fn serve_channel<C: Channel>(mut io: C, state: Arc<AppState>, label: &str) {
    let router: Router = crate::server::router(state.clone());
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        // The host watches the session itself; a keep-alive ping would only be noise
        // (and would fire across every pause of the VM).
        .keep_alive_interval(None);
    let mut pending = Vec::new();
    let mut count: u64 = 0;
    loop {
        let Some((hello, rest)) = scan(&mut io, std::mem::take(&mut pending)).await else {
            return;
        };
        if let Err(e) = answer(&mut io, &hello, &state).await {
            eprintln!("forkd-agent: {label}: answering the greeting failed: {e}");
            if !io.idle().await {
                return;
            }
            continue;
        }
        count += 1;
        let tail = Arc::new(Tail::default());
        let stream = Recorder {
            inner: Rewind::new(rest, &mut io),
            tail: Arc::clone(&tail),
        };
        let conn = builder.serve_connection(
            TokioIo::new(stream),
            TowerToHyperService::new(router.clone()),
        );
        let (why, rescan) = tokio::select! {
            r = conn => match r {
                Ok(()) => ("the host closed it".to_string(), false),
                Err(e) => (error_chain(&e), true),
            },
            () = stale_hello(&tail) => ("a new greeting arrived".to_string(), true),
        };
        if rescan {
            pending = tail.bytes();
        }
        // A host that greets again takes the channel over (every restored child's first
        // greeting ends the session its snapshot was taken in): that end is expected,
        // and a line on the console costs a restore real time under TCG.
        let greeted = !matches!(scan_hello(&pending), HelloScan::Absent)
            || hello_keep(&pending) >= HELLO_PREFIX.len();
        if !(rescan && greeted) {
            eprintln!("forkd-agent: {label}: session {count} ended: {why}");
        }
    }
}

/// Reads until a greeting shows up; returns it and the bytes after it. `buf` holds bytes
/// to look at first. Returns `None` once the stream is gone for good.
async fn scan<C: Channel>(io: &mut C, mut buf: Vec<u8>) -> Option<(Hello, Vec<u8>)> {
    let mut chunk = vec![0u8; 4096];
    loop {
        match scan_hello(&buf) {
            HelloScan::Found(hello) => {
                let rest = buf.split_off(hello.end);
                return Some((hello, rest));
            }
            // A greeting (at most MAX_BODY long) may be arriving from there.
            HelloScan::Partial(at) => drop(buf.drain(..at)),
            // Everything but a possible greeting's start is noise from an older session.
            HelloScan::Absent => {
                let keep = hello_keep(&buf);
                buf.drain(..buf.len() - keep);
            }
        }
        match io.read(&mut chunk).await {
            Ok(0) => {
                if !io.idle().await {
                    return None;
                }
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("forkd-agent: reading the agent channel failed: {e}");
                if !io.idle().await {
                    return None;
                }
            }
        }
    }
}

/// An error with its causes: hyper's own message ("http2 error") says little alone.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// Answers `hello`: for a greeting that carries the resume hook's request, once the hook
/// has run, with its outcome.
async fn answer<C: Channel>(io: &mut C, hello: &Hello, state: &AppState) -> io::Result<()> {
    let (answer, _reseeds) = match &hello.body {
        None => (ready(&hello.nonce), None),
        Some(body) => {
            let (outcome, reseeds) = resume_outcome(state, body).await;
            (ready_with(&hello.nonce, &outcome), reseeds)
        }
    };
    io.write_all(&answer).await?;
    // The contexts' reseeds start once the answer is out (as `_reseeds` drops).
    io.flush().await
}

/// Runs the resume hook a greeting carried; its outcome as JSON, and the gate of the
/// contexts' reseeds.
async fn resume_outcome(
    state: &AppState,
    body: &[u8],
) -> (Vec<u8>, Option<crate::contexts::ReseedGate>) {
    let outcome = match crate::server::parse_json::<ResumeRequest>(body) {
        Ok(req) => crate::resume::apply(state, req).await,
        Err(e) => Err(e),
    };
    let (outcome, reseeds) = match outcome {
        Ok((r, reseeds)) => (ResumeOutcome::Resumed(r), reseeds),
        Err(e) => (
            ResumeOutcome::Failed(forkd_proto::ErrorBody { error: e.detail() }),
            None,
        ),
    };
    (serde_json::to_vec(&outcome).unwrap_or_default(), reseeds)
}

/// The last bytes a session read, and whether they end with a greeting.
#[derive(Debug, Default)]
struct Tail {
    state: Mutex<TailState>,
    greeting: Notify,
}

#[derive(Debug, Default)]
struct TailState {
    bytes: Vec<u8>,
    reads: u64,
    /// Where the last greeting prefix in `bytes` starts, if one is there.
    hello_at: Option<usize>,
}

impl Tail {
    fn lock(&self) -> std::sync::MutexGuard<'_, TailState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let ends_with_hello = {
            let mut st = self.lock();
            st.reads += 1;
            // Only the new bytes (and a prefix's worth before them) are searched.
            let from = st.bytes.len().saturating_sub(HELLO_PREFIX.len() - 1);
            st.bytes.extend_from_slice(data);
            if let Some(i) = st.bytes[from..]
                .windows(HELLO_PREFIX.len())
                .rposition(|w| w == HELLO_PREFIX)
            {
                st.hello_at = Some(from + i);
            }
            // Trimmed in batches: each byte is moved at most once more.
            if st.bytes.len() > 2 * TAIL_KEEP {
                let excess = st.bytes.len() - TAIL_KEEP;
                st.bytes.drain(..excess);
                st.hello_at = st.hello_at.and_then(|at| at.checked_sub(excess));
            }
            st.ends_with_hello()
        };
        if ends_with_hello {
            self.greeting.notify_one();
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let st = self.lock();
        st.bytes[st.bytes.len().saturating_sub(TAIL_KEEP)..].to_vec()
    }

    fn reads(&self) -> u64 {
        self.lock().reads
    }

    fn ends_with_hello(&self) -> bool {
        self.lock().ends_with_hello()
    }
}

impl TailState {
    /// Whether the bytes end with a whole greeting (with its body, if it carries one).
    fn ends_with_hello(&self) -> bool {
        let Some(at) = self.hello_at else {
            return false;
        };
        matches!(scan_hello(&self.bytes[at..]), HelloScan::Found(h) if at + h.end == self.bytes.len())
    }
}

/// Resolves when the session's input ended with a greeting and then went quiet.
async fn stale_hello(tail: &Tail) {
    loop {
        tail.greeting.notified().await;
        let seen = tail.reads();
        tokio::time::sleep(HELLO_QUIET).await;
        if tail.reads() == seen && tail.ends_with_hello() {
            return;
        }
    }
}

/// Passes IO through, remembering the last bytes read into a [`Tail`].
struct Recorder<T> {
    inner: T,
    tail: Arc<Tail>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Recorder<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            self.tail.record(&buf.filled()[before..]);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Recorder<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    /// Only flushes: the channel outlives the session, and the next session needs it
    /// open in both directions (hyper shuts its IO down when a connection ends).
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkd_proto::handshake::{hello, hello_with};

    const N: &str = "0123456789abcdef0123456789abcdef";

    fn tail_of(parts: &[&[u8]]) -> Tail {
        let t = Tail::default();
        for p in parts {
            t.record(p);
        }
        t
    }

    #[test]
    fn greeting_at_the_end_is_seen() {
        let junk: &[u8] = b"\x00\x00\x04\x08junk";
        assert!(!tail_of(&[junk]).ends_with_hello());
        assert!(tail_of(&[junk, &hello(N)]).ends_with_hello());
        assert!(!tail_of(&[junk, &hello(N), b"x"]).ends_with_hello());
        // Split across reads, and with a body.
        let with = hello_with(N, br#"{"hostname":"sb-1"}"#);
        let (a, b) = with.split_at(5);
        assert!(tail_of(&[junk, a, b]).ends_with_hello());
        assert!(!tail_of(&[junk, a]).ends_with_hello());
    }

    #[test]
    fn tail_is_bounded() {
        let t = Tail::default();
        for _ in 0..5 {
            t.record(&vec![1u8; TAIL_KEEP]);
            assert!(t.lock().bytes.len() <= 2 * TAIL_KEEP);
        }
        t.record(&hello(N));
        assert_eq!(t.bytes().len(), TAIL_KEEP);
        assert!(t.ends_with_hello());
        assert_eq!(t.reads(), 6);
    }
}
