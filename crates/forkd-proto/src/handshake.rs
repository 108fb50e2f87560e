//! The line-based handshake that starts every agent session.
//!
//! The byte stream under the agent protocol is cut and re-joined by every snapshot and
//! restore, and a guest may have stale bytes of an old session in flight when a new host
//! connects. So each session begins with a resynchronisation: the host sends
//! `FORKD-HELLO <nonce>\n` (32 hex digits of fresh randomness); the guest, which scans its
//! input for that pattern and ignores everything else, answers
//! `FORKD-READY <nonce> <protocol>\n`; the host discards everything before the answer that
//! carries its own nonce. Only then does HTTP/2 start, with the host as the client. A nonce
//! is never reused, so an answer from an older session can never be mistaken for a new one.
//!
//! From protocol [`RESUME_IN_GREETING`] on, the greeting of a restored child may carry the
//! resume hook's request (`FORKD-HELLO <nonce> <length>\n` and that many bytes of JSON,
//! the length as 8 hex digits), and the answer its outcome in the same form
//! (`FORKD-READY <nonce> <protocol> <length>\n` and the JSON of a
//! [`crate::context::ResumeOutcome`]): the child takes its identity before any HTTP/2, in
//! one exchange. (Under TCG a fresh restore translates every guest instruction it runs: an
//! HTTP/2 request before the child is handed out cost it about as much as the greeting.)

/// The prefix of the host's greeting.
pub const HELLO_PREFIX: &[u8] = b"FORKD-HELLO ";
/// The prefix of the guest's answer.
pub const READY_PREFIX: &[u8] = b"FORKD-READY ";
/// Hex digits in a nonce.
pub const NONCE_LEN: usize = 32;
/// The first protocol version whose agents take the resume hook in the greeting.
pub const RESUME_IN_GREETING: u32 = 5;
/// Largest body a greeting or an answer carries (a larger resume request goes by HTTP/2).
pub const MAX_BODY: usize = 60 * 1024;
/// Hex digits of a body's length.
const LEN_DIGITS: usize = 8;

/// The host's greeting for `nonce` (32 lowercase hex digits).
pub fn hello(nonce: &str) -> Vec<u8> {
    let mut v = HELLO_PREFIX.to_vec();
    v.extend_from_slice(nonce.as_bytes());
    v.push(b'\n');
    v
}

/// The host's greeting for `nonce` carrying `body` (at most [`MAX_BODY`] bytes).
pub fn hello_with(nonce: &str, body: &[u8]) -> Vec<u8> {
    let mut v = HELLO_PREFIX.to_vec();
    v.extend_from_slice(nonce.as_bytes());
    v.extend_from_slice(format!(" {:0w$x}\n", body.len(), w = LEN_DIGITS).as_bytes());
    v.extend_from_slice(body);
    v
}

/// The guest's answer to the greeting carrying `nonce`.
pub fn ready(nonce: &str) -> Vec<u8> {
    format!(
        "{}{} {}\n",
        std::str::from_utf8(READY_PREFIX).unwrap_or_default(),
        nonce,
        crate::PROTOCOL_VERSION
    )
    .into_bytes()
}

/// The guest's answer to the greeting carrying `nonce`, with `body` (at most
/// [`MAX_BODY`] bytes).
pub fn ready_with(nonce: &str, body: &[u8]) -> Vec<u8> {
    let mut v = format!(
        "{}{} {} {:0w$x}\n",
        std::str::from_utf8(READY_PREFIX).unwrap_or_default(),
        nonce,
        crate::PROTOCOL_VERSION,
        body.len(),
        w = LEN_DIGITS
    )
    .into_bytes();
    v.extend_from_slice(body);
    v
}

/// `LEN_DIGITS` hex digits and a newline at the start of `b`, as a body length.
fn body_len(b: &[u8]) -> Option<usize> {
    let digits = b.get(..LEN_DIGITS)?;
    if b.get(LEN_DIGITS) != Some(&b'\n') || !digits.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    usize::from_str_radix(std::str::from_utf8(digits).ok()?, 16)
        .ok()
        .filter(|&n| n <= MAX_BODY)
}

/// A greeting found by [`scan_hello`].
#[derive(Debug, PartialEq, Eq)]
pub struct Hello {
    /// Its nonce.
    pub nonce: String,
    /// What it carries, if anything.
    pub body: Option<Vec<u8>>,
    /// The index just past it (bytes after it belong to HTTP/2).
    pub end: usize,
}

/// What [`scan_hello`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum HelloScan {
    /// The first complete greeting.
    Found(Hello),
    /// A greeting may be arriving from this index on: keep the bytes from there.
    Partial(usize),
    /// None: only the last [`hello_keep`] bytes may still start one.
    Absent,
}

fn is_nonce(b: &[u8]) -> bool {
    b.len() == NONCE_LEN && b.iter().all(|c| c.is_ascii_hexdigit())
}

/// Guest side: finds the first complete greeting in `buf`, plain or carrying a body.
pub fn scan_hello(buf: &[u8]) -> HelloScan {
    let mut start = 0;
    while let Some(pos) = find(&buf[start..], HELLO_PREFIX) {
        let at = start + pos;
        start = at + 1;
        let after = &buf[at + HELLO_PREFIX.len()..];
        let Some(nonce) = after.get(..NONCE_LEN) else {
            return match after.iter().all(u8::is_ascii_hexdigit) {
                true => HelloScan::Partial(at),
                false => continue,
            };
        };
        if !is_nonce(nonce) {
            continue;
        }
        let nonce = String::from_utf8_lossy(nonce).into_owned();
        let rest = &after[NONCE_LEN..];
        let head = at + HELLO_PREFIX.len() + NONCE_LEN;
        match rest.first() {
            None => return HelloScan::Partial(at),
            Some(b'\n') => {
                return HelloScan::Found(Hello {
                    nonce,
                    body: None,
                    end: head + 1,
                })
            }
            Some(b' ') => {}
            Some(_) => continue,
        }
        let framing = &rest[1..];
        let Some(len) = body_len(framing) else {
            // Too short to tell yet, or not a length.
            let short = framing.len() <= LEN_DIGITS && framing.iter().all(u8::is_ascii_hexdigit);
            if short {
                return HelloScan::Partial(at);
            }
            continue;
        };
        let body_at = head + 1 + LEN_DIGITS + 1;
        return match buf.get(body_at..body_at + len) {
            Some(body) => HelloScan::Found(Hello {
                nonce,
                body: Some(body.to_vec()),
                end: body_at + len,
            }),
            None => HelloScan::Partial(at),
        };
    }
    HelloScan::Absent
}

/// How many bytes at the end of `buf` might still be the start of a greeting; the rest can
/// be dropped while scanning, so the scan buffer stays bounded.
pub fn hello_keep(buf: &[u8]) -> usize {
    let total = HELLO_PREFIX.len() + NONCE_LEN + 1;
    let tail = buf.len().min(total - 1);
    // Keep from the last occurrence of 'F' that could start the prefix.
    for i in (buf.len() - tail)..buf.len() {
        let rest = &buf[i..];
        let n = rest.len().min(HELLO_PREFIX.len());
        if rest[..n] == HELLO_PREFIX[..n] {
            return buf.len() - i;
        }
    }
    0
}

/// Result of scanning for the guest's answer.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadyScan {
    /// Not there yet.
    Pending,
    /// Found: the guest's protocol version and the index just past the answer.
    Found {
        /// Protocol version the guest speaks.
        protocol: u32,
        /// What the answer carries, if anything.
        body: Option<Vec<u8>>,
        /// Index just past the answer.
        end: usize,
    },
    /// An answer claiming a body longer than [`MAX_BODY`]: no well-behaved guest sends
    /// one, and waiting for it would let a guest make the host buffer without bound.
    TooLong {
        /// The length it claimed.
        len: usize,
    },
}

/// Host side: looks for the answer carrying `nonce` in `buf`.
pub fn find_ready(buf: &[u8], nonce: &str) -> ReadyScan {
    let mut pat = READY_PREFIX.to_vec();
    pat.extend_from_slice(nonce.as_bytes());
    pat.push(b' ');
    let Some(at) = find(buf, &pat) else {
        return ReadyScan::Pending;
    };
    let line_at = at + pat.len();
    let rest = &buf[line_at..];
    let Some(nl) = rest.iter().position(|&c| c == b'\n') else {
        return ReadyScan::Pending;
    };
    let line = std::str::from_utf8(&rest[..nl]).unwrap_or_default();
    let (protocol, len) = match line.split_once(' ') {
        None => (line, None),
        Some((protocol, len)) => (protocol, usize::from_str_radix(len, 16).ok()),
    };
    let protocol = protocol.parse().unwrap_or(0);
    let end = line_at + nl + 1;
    if let Some(len) = len.filter(|&l| l > MAX_BODY) {
        return ReadyScan::TooLong { len };
    }
    match len {
        None => ReadyScan::Found {
            protocol,
            body: None,
            end,
        },
        Some(len) => match buf.get(end..end + len) {
            Some(body) => ReadyScan::Found {
                protocol,
                body: Some(body.to_vec()),
                end: end + len,
            },
            None => ReadyScan::Pending,
        },
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: &str = "0123456789abcdef0123456789abcdef";

    fn found(buf: &[u8]) -> Hello {
        match scan_hello(buf) {
            HelloScan::Found(h) => h,
            other => panic!("no greeting in {buf:?}: {other:?}"),
        }
    }

    #[test]
    fn an_answer_claiming_too_long_a_body_is_named_at_once() {
        let mut buf = format!("FORKD-READY {N} 5 {:08x}\n", MAX_BODY + 1).into_bytes();
        assert_eq!(
            find_ready(&buf, N),
            ReadyScan::TooLong { len: MAX_BODY + 1 }
        );
        buf = ready_with(N, b"{}");
        assert!(matches!(find_ready(&buf, N), ReadyScan::Found { .. }));
    }

    #[test]
    fn hello_is_found_after_garbage() {
        let mut buf = b"\x00\x01garbage FORKD-HELLO short\nFORKD-HEL".to_vec();
        // A prefix cut short is no greeting yet; the scan keeps its bytes.
        assert_eq!(scan_hello(&buf), HelloScan::Absent);
        assert!(hello_keep(&buf) >= 9);
        buf.extend_from_slice(&hello(N)[9..]);
        buf.extend_from_slice(b"PRI * HTTP/2.0");
        let h = found(&buf);
        assert_eq!((h.nonce.as_str(), h.body), (N, None));
        assert_eq!(&buf[h.end..], b"PRI * HTTP/2.0");
    }

    #[test]
    fn a_greeting_carries_its_body_and_is_partial_until_the_body_is_whole() {
        let body = br#"{"hostname":"sb-1"}"#;
        let greeting = hello_with(N, body);
        for cut in 1..greeting.len() {
            let mut buf = b"old session".to_vec();
            buf.extend_from_slice(&greeting[..cut]);
            let want = if cut < HELLO_PREFIX.len() {
                HelloScan::Absent
            } else {
                HelloScan::Partial(11)
            };
            assert_eq!(scan_hello(&buf), want, "cut at {cut}");
        }
        let mut buf = greeting.clone();
        buf.extend_from_slice(b"PRI");
        let h = found(&buf);
        assert_eq!(h.body.as_deref(), Some(&body[..]));
        assert_eq!(&buf[h.end..], b"PRI");
    }

    #[test]
    fn a_length_beyond_the_limit_or_not_hex_is_no_greeting() {
        let mut big = HELLO_PREFIX.to_vec();
        big.extend_from_slice(format!("{N} {:08x}\n", MAX_BODY + 1).as_bytes());
        assert_eq!(scan_hello(&big), HelloScan::Absent);
        let mut bad = HELLO_PREFIX.to_vec();
        bad.extend_from_slice(format!("{N} 0000zz10\n").as_bytes());
        assert_eq!(scan_hello(&bad), HelloScan::Absent);
        // A real greeting after a false one is found.
        bad.extend_from_slice(&hello(N));
        assert_eq!(found(&bad).nonce, N);
    }

    #[test]
    fn keep_bounds_the_scan_buffer() {
        assert_eq!(hello_keep(b"xxxxxxxx"), 0);
        assert_eq!(hello_keep(b"xxxxFORK"), 4);
        let h = hello(N);
        assert_eq!(hello_keep(&h[..h.len() - 1]), h.len() - 1);
    }

    #[test]
    fn ready_must_carry_our_nonce() {
        let other = "ffffffffffffffffffffffffffffffff";
        let mut buf = ready(other);
        assert_eq!(find_ready(&buf, N), ReadyScan::Pending);
        buf.extend_from_slice(&ready(N));
        buf.extend_from_slice(b"h2");
        match find_ready(&buf, N) {
            ReadyScan::Found {
                protocol,
                body: None,
                end,
            } => {
                assert_eq!(protocol, crate::PROTOCOL_VERSION);
                assert_eq!(&buf[end..], b"h2");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_answer_with_a_body_is_pending_until_the_body_is_whole() {
        let answer = ready_with(N, b"{}");
        assert_eq!(
            find_ready(&answer[..answer.len() - 1], N),
            ReadyScan::Pending
        );
        let mut buf = answer.clone();
        buf.extend_from_slice(b"h2");
        match find_ready(&buf, N) {
            ReadyScan::Found {
                body: Some(body),
                end,
                ..
            } => {
                assert_eq!(body, b"{}");
                assert_eq!(&buf[end..], b"h2");
            }
            other => panic!("{other:?}"),
        }
    }
}
