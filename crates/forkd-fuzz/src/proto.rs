//! The host–guest channel, decoded on both sides: the frame codec of streamed bodies,
//! the requests the guest agent reads (JSON bodies, query strings, the exec body's
//! frames), what the host reads back from a guest (which it must not trust either),
//! and the handshake both scan for in a stream that may hold stale bytes.

use forkd_proto::context::{
    ContextEvent, ContextInfo, CreateContextRequest, Execution, ResumeRequest, ResumeResponse,
    RunCodeRequest,
};
use forkd_proto::exec::{
    ExecEvent, ExecRequest, ProcessInfo, SignalRequest, StdinQuery, WaitQuery,
};
use forkd_proto::files::{
    FileStat, MkdirRequest, PathQuery, RemoveRequest, RenameRequest, WriteQuery,
};
use forkd_proto::frame::{self, Decoder, Frame, FrameError, Tag, MAX_PAYLOAD};
use forkd_proto::handshake::{self, ReadyScan};
use forkd_proto::{ErrorBody, PingResponse, ShutdownRequest};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fmt::Debug;

/// Decodes `wire` fed `step` bytes at a time; the frames, and the error that stopped
/// it if one did (else whether a partial frame was left).
fn decode(wire: &[u8], step: usize) -> (Vec<Frame>, Result<(), FrameError>) {
    let mut dec = Decoder::new();
    let mut frames = Vec::new();
    for chunk in wire.chunks(step.max(1)) {
        dec.push(chunk);
        loop {
            match dec.next_frame() {
                Ok(Some(f)) => frames.push(f),
                Ok(None) => break,
                Err(e) => return (frames, Err(e)),
            }
        }
    }
    (frames, dec.finish())
}

/// The frame decoder: the first byte says how the rest arrives (1 to 256 bytes at a
/// time); the rest is the stream.
pub fn frame(data: &[u8]) {
    let Some((&step, wire)) = data.split_first() else {
        return;
    };
    let (frames, end) = decode(wire, usize::from(step) + 1);
    // However the stream is cut, the decoder sees the same frames and the same error:
    // a peer cannot make the result depend on how its bytes were delivered.
    let (whole, whole_end) = decode(wire, wire.len());
    assert_eq!(frames, whole, "frames depend on how the stream was cut");
    assert_eq!(
        end, whole_end,
        "the outcome depends on how the stream was cut"
    );
    let mut again = Vec::new();
    for f in &frames {
        assert!(
            f.payload.len() <= MAX_PAYLOAD,
            "a frame of {} bytes got through",
            f.payload.len()
        );
        again.extend_from_slice(&frame::encode(f.tag, &f.payload).expect("a decoded frame fits"));
    }
    // Re-encoding the frames gives back the bytes they came from: nothing skipped,
    // nothing invented.
    assert_eq!(
        &wire[..again.len()],
        &again[..],
        "re-encoded frames differ from the stream"
    );
    match end {
        Ok(()) => assert_eq!(again.len(), wire.len(), "bytes left over without an error"),
        Err(FrameError::Truncated(n)) => assert_eq!(again.len() + n, wire.len()),
        Err(_) => {}
    }
}

/// A JSON body as the agent (or host) parses it; what it accepts must serialize and read
/// back as the same value, or the two sides could disagree on what was asked.
fn json<T: DeserializeOwned + Serialize + PartialEq + Debug>(body: &[u8]) -> Option<T> {
    let value: T = serde_json::from_slice(body).ok()?;
    let text = serde_json::to_vec(&value).expect("a wire type serializes");
    let back: T = serde_json::from_slice(&text).expect("what was written reads back");
    assert_eq!(back, value, "a request changed on its way back and forth");
    Some(value)
}

/// A query string as the agent parses it (`serde_urlencoded`, as its `parse_query`).
fn query<T: DeserializeOwned + Serialize + PartialEq + Debug>(raw: &[u8]) {
    let Ok(text) = std::str::from_utf8(raw) else {
        return; // a URI's query is text
    };
    if let Ok(v) = serde_urlencoded::from_str::<T>(text) {
        let again = serde_urlencoded::to_string(&v).expect("a query serializes");
        let back: T = serde_urlencoded::from_str(&again).expect("what was written reads back");
        assert_eq!(back, v, "a query changed on its way back and forth");
    }
}

/// The body of `POST /v1/exec` as the agent reads it: frames, the first a JSON
/// `ExecRequest`, then stdin.
fn exec_body(wire: &[u8]) {
    let (frames, _) = decode(wire, 4096);
    let Some(first) = frames.first() else {
        return;
    };
    if first.tag == Tag::Json {
        if let Some(req) = json::<ExecRequest>(&first.payload) {
            let _ = forkd_proto::exec::env_problem(&req.env);
            let _ = req.command.to_argv();
        }
    }
}

/// What the guest agent reads from the host: the first byte picks the route, the rest
/// is its body or query string.
pub fn agent_request(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 14 {
        0 => exec_body(body),
        1 => {
            if let Some(r) = json::<ExecRequest>(body) {
                let _ = forkd_proto::exec::env_problem(&r.env);
            }
        }
        2 => {
            let _ = json::<SignalRequest>(body);
        }
        3 => {
            let _ = json::<CreateContextRequest>(body);
        }
        4 => {
            let _ = json::<RunCodeRequest>(body);
        }
        5 => {
            let _ = json::<ResumeRequest>(body);
        }
        6 => {
            let _ = json::<MkdirRequest>(body);
        }
        7 => {
            let _ = json::<RemoveRequest>(body);
        }
        8 => {
            let _ = json::<RenameRequest>(body);
        }
        9 => {
            let _ = json::<ShutdownRequest>(body);
        }
        10 => query::<PathQuery>(body),
        11 => query::<WriteQuery>(body),
        12 => query::<StdinQuery>(body),
        _ => query::<WaitQuery>(body),
    }
}

/// What the host reads from a guest: the first byte picks the answer, the rest is its
/// body (an exec response's frames, a run's JSON lines, or a JSON answer).
pub fn agent_response(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    match which % 9 {
        0 => {
            // An exec response: output frames and JSON events, as the host's exec
            // stream reads them.
            let (frames, _) = decode(body, 4096);
            for f in frames {
                if f.tag == Tag::Json {
                    {
                        let _ = json::<ExecEvent>(&f.payload);
                    };
                }
            }
        }
        1 => {
            // A run's events, one JSON document a line, collected as the host does.
            let mut x = Execution::default();
            for line in body.split(|b| *b == b'\n') {
                if let Some(e) = json::<ContextEvent>(line) {
                    if x.push(e) {
                        break;
                    }
                }
            }
            let _ = x.text();
        }
        2 => {
            let _ = json::<PingResponse>(body);
        }
        3 => {
            let _ = json::<ErrorBody>(body);
        }
        4 => {
            let _ = json::<ProcessInfo>(body);
        }
        5 => {
            let _ = json::<Vec<FileStat>>(body);
        }
        6 => {
            let _ = json::<ContextInfo>(body);
        }
        7 => {
            let _ = json::<ResumeResponse>(body);
        }
        _ => {
            if let Some(p) = json::<ProcessInfo>(body) {
                let _ = p.exit.map(|e| (e.shell_code(), e.success()));
            }
        }
    }
}

/// A fixed nonce the host side looks for.
const NONCE: &str = "0123456789abcdef0123456789abcdef";

/// The handshake: the guest scanning for the host's greeting, the bound on what it
/// keeps, and the host scanning for the answer carrying its nonce.
pub fn handshake(data: &[u8]) {
    match handshake::scan_hello(data) {
        handshake::HelloScan::Found(hello) => {
            assert!(hello.end <= data.len(), "the greeting ends past the buffer");
            assert_eq!(hello.nonce.len(), handshake::NONCE_LEN);
            let want = match &hello.body {
                Some(body) => {
                    assert!(body.len() <= handshake::MAX_BODY, "a body past the limit");
                    handshake::hello_with(&hello.nonce, body)
                }
                None => handshake::hello(&hello.nonce),
            };
            assert!(
                data[..hello.end].ends_with(&want),
                "the greeting found is not the bytes before its end"
            );
        }
        handshake::HelloScan::Partial(at) => {
            assert!(
                data[at..].starts_with(handshake::HELLO_PREFIX),
                "a partial greeting that does not start with the prefix"
            );
            assert!(
                data.len() - at
                    <= handshake::HELLO_PREFIX.len()
                        + handshake::NONCE_LEN
                        + 10
                        + handshake::MAX_BODY,
                "a partial greeting longer than any greeting"
            );
        }
        handshake::HelloScan::Absent => {}
    }
    let keep = handshake::hello_keep(data);
    assert!(
        keep < handshake::HELLO_PREFIX.len() + handshake::NONCE_LEN + 1 && keep <= data.len(),
        "the scan keeps {keep} bytes"
    );
    if let ReadyScan::Found { end, body, .. } = handshake::find_ready(data, NONCE) {
        assert!(end <= data.len(), "the answer ends past the buffer");
        match body {
            None => assert_eq!(data[end - 1], b'\n'),
            Some(body) => assert!(data[..end].ends_with(&body)),
        }
    }
}
