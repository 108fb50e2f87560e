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

/// The prefix of the host's greeting.
pub const HELLO_PREFIX: &[u8] = b"FORKD-HELLO ";
/// The prefix of the guest's answer.
pub const READY_PREFIX: &[u8] = b"FORKD-READY ";
/// Hex digits in a nonce.
pub const NONCE_LEN: usize = 32;

/// The host's greeting for `nonce` (32 lowercase hex digits).
pub fn hello(nonce: &str) -> Vec<u8> {
    let mut v = HELLO_PREFIX.to_vec();
    v.extend_from_slice(nonce.as_bytes());
    v.push(b'\n');
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

fn is_nonce(b: &[u8]) -> bool {
    b.len() == NONCE_LEN && b.iter().all(|c| c.is_ascii_hexdigit())
}

/// Guest side: finds the first complete greeting in `buf`. Returns the nonce and the
/// index just past the greeting's newline (bytes after it belong to HTTP/2).
pub fn find_hello(buf: &[u8]) -> Option<(String, usize)> {
    let total = HELLO_PREFIX.len() + NONCE_LEN + 1;
    let mut start = 0;
    while let Some(pos) = find(&buf[start..], HELLO_PREFIX) {
        let at = start + pos;
        if buf.len() < at + total {
            return None;
        }
        let nonce = &buf[at + HELLO_PREFIX.len()..at + HELLO_PREFIX.len() + NONCE_LEN];
        if is_nonce(nonce) && buf[at + total - 1] == b'\n' {
            return Some((String::from_utf8_lossy(nonce).into_owned(), at + total));
        }
        start = at + 1;
    }
    None
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
        /// Index just past the answer's newline.
        end: usize,
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
    let rest = &buf[at + pat.len()..];
    let Some(nl) = rest.iter().position(|&c| c == b'\n') else {
        return ReadyScan::Pending;
    };
    let protocol = std::str::from_utf8(&rest[..nl])
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    ReadyScan::Found {
        protocol,
        end: at + pat.len() + nl + 1,
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

    #[test]
    fn hello_is_found_after_garbage() {
        let mut buf = b"\x00\x01garbage FORKD-HELLO short\nFORKD-HEL".to_vec();
        assert_eq!(find_hello(&buf), None);
        buf.extend_from_slice(&hello(N)[9..]);
        buf.extend_from_slice(b"PRI * HTTP/2.0");
        let (nonce, end) = find_hello(&buf).unwrap();
        assert_eq!(nonce, N);
        assert_eq!(&buf[end..], b"PRI * HTTP/2.0");
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
            ReadyScan::Found { protocol, end } => {
                assert_eq!(protocol, crate::PROTOCOL_VERSION);
                assert_eq!(&buf[end..], b"h2");
            }
            ReadyScan::Pending => panic!("not found"),
        }
    }
}
