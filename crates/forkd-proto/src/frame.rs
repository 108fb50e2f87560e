//! The frame codec used for streamed bodies (exec input and output).
//!
//! A frame is `[tag: u8][len: u32, big endian][payload: len bytes]`. Frames never exceed
//! [`MAX_PAYLOAD`], so a reader's buffer stays bounded whatever the peer sends.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Largest payload a frame may carry.
pub const MAX_PAYLOAD: usize = 1 << 20;

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 5;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Tag {
    /// Bytes for the command's stdin (host → guest).
    Stdin = 0,
    /// Bytes the command wrote to stdout (guest → host).
    Stdout = 1,
    /// Bytes the command wrote to stderr (guest → host).
    Stderr = 2,
    /// A JSON document: the request header or an [`crate::exec::ExecEvent`].
    Json = 3,
    /// A new size for the command's terminal, as a JSON [`crate::exec::PtySize`]
    /// (host → guest, protocol 7).
    Resize = 4,
}

impl Tag {
    fn from_u8(b: u8) -> Option<Tag> {
        Some(match b {
            0 => Tag::Stdin,
            1 => Tag::Stdout,
            2 => Tag::Stderr,
            3 => Tag::Json,
            4 => Tag::Resize,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// What the payload is.
    pub tag: Tag,
    /// The payload.
    pub payload: Bytes,
}

/// A malformed frame stream.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("frame has unknown tag {0}")]
    UnknownTag(u8),
    #[error("frame payload of {0} bytes exceeds the limit of {max} bytes (1 MiB)", max = MAX_PAYLOAD)]
    TooLarge(usize),
    #[error("stream ended inside a frame ({0} bytes left over)")]
    Truncated(usize),
}

/// Encodes one frame. A payload over [`MAX_PAYLOAD`] is an error (the peer's decoder
/// would refuse it): split byte streams with [`encode_chunked`]; a JSON document cannot
/// be split, so its size is the sender's to check.
pub fn encode(tag: Tag, payload: &[u8]) -> Result<Bytes, FrameError> {
    if payload.len() > MAX_PAYLOAD {
        return Err(FrameError::TooLarge(payload.len()));
    }
    Ok(encode_unchecked(tag, payload))
}

fn encode_unchecked(tag: Tag, payload: &[u8]) -> Bytes {
    debug_assert!(payload.len() <= MAX_PAYLOAD);
    let mut b = BytesMut::with_capacity(HEADER_LEN + payload.len());
    b.put_u8(tag as u8);
    // At most MAX_PAYLOAD, far below u32::MAX: every caller checks the length first.
    b.put_u32(u32::try_from(payload.len()).expect("a payload of at most MAX_PAYLOAD"));
    b.put_slice(payload);
    b.freeze()
}

/// Encodes `payload` as as many frames of `tag` as needed.
pub fn encode_chunked(tag: Tag, payload: &[u8]) -> Vec<Bytes> {
    payload
        .chunks(MAX_PAYLOAD)
        .map(|c| encode_unchecked(tag, c))
        .collect()
}

/// Encodes a JSON frame; [`FrameError::TooLarge`] when the document is over
/// [`MAX_PAYLOAD`] (a request with a huge command line or environment, say).
pub fn encode_json<T: serde::Serialize>(value: &T) -> Result<Bytes, FrameError> {
    let json = serde_json::to_vec(value).expect("wire types always serialize");
    encode(Tag::Json, &json)
}

/// Incremental decoder: feed it bytes as they arrive, take frames out.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: BytesMut,
}

impl Decoder {
    /// An empty decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends received bytes.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete frame, if one is buffered.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let tag = Tag::from_u8(self.buf[0]).ok_or(FrameError::UnknownTag(self.buf[0]))?;
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(FrameError::TooLarge(len));
        }
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        self.buf.advance(HEADER_LEN);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Frame { tag, payload }))
    }

    /// Call at the end of the stream: an error if a partial frame is left.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Truncated(self.buf.len()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_survive_arbitrary_splits() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&encode(Tag::Stdout, b"hello").unwrap());
        wire.extend_from_slice(&encode(Tag::Stderr, b"").unwrap());
        wire.extend_from_slice(&encode_json(&serde_json::json!({"a": 1})).unwrap());
        for split in 0..wire.len() {
            let mut d = Decoder::new();
            let mut got = Vec::new();
            for part in [&wire[..split], &wire[split..]] {
                d.push(part);
                while let Some(f) = d.next_frame().unwrap() {
                    got.push(f);
                }
            }
            d.finish().unwrap();
            assert_eq!(got.len(), 3);
            assert_eq!(got[0].payload.as_ref(), b"hello");
            assert_eq!(got[1].tag, Tag::Stderr);
            assert_eq!(got[2].tag, Tag::Json);
        }
    }

    #[test]
    fn bad_frames_are_errors() {
        let mut d = Decoder::new();
        d.push(&[9, 0, 0, 0, 0]);
        assert_eq!(d.next_frame(), Err(FrameError::UnknownTag(9)));
        let mut d = Decoder::new();
        d.push(&[4, 0, 0, 0, 0]);
        assert_eq!(d.next_frame().unwrap().unwrap().tag, Tag::Resize);
        let mut d = Decoder::new();
        d.push(&[1, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(d.next_frame(), Err(FrameError::TooLarge(_))));
        let mut d = Decoder::new();
        d.push(&[1, 0, 0, 0, 4, b'a']);
        assert_eq!(d.next_frame(), Ok(None));
        assert_eq!(d.finish(), Err(FrameError::Truncated(6)));
    }

    #[test]
    fn chunking_splits_large_payloads() {
        let data = vec![7u8; MAX_PAYLOAD * 2 + 3];
        let frames = encode_chunked(Tag::Stdin, &data);
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[2].len(), HEADER_LEN + 3);
    }

    #[test]
    fn oversized_payloads_are_errors_not_panics() {
        let max = vec![0u8; MAX_PAYLOAD];
        let frame = encode(Tag::Stdout, &max).unwrap();
        assert_eq!(frame.len(), HEADER_LEN + MAX_PAYLOAD);
        let mut d = Decoder::new();
        d.push(&frame);
        assert_eq!(d.next_frame().unwrap().unwrap().payload.len(), MAX_PAYLOAD);

        let over = vec![0u8; MAX_PAYLOAD + 1];
        assert_eq!(
            encode(Tag::Stdout, &over),
            Err(FrameError::TooLarge(MAX_PAYLOAD + 1))
        );
        // A JSON document one byte over: `"` + n characters + `"`.
        let doc = "x".repeat(MAX_PAYLOAD - 1);
        assert_eq!(
            encode_json(&doc),
            Err(FrameError::TooLarge(MAX_PAYLOAD + 1))
        );
        let fits = "x".repeat(MAX_PAYLOAD - 2);
        assert_eq!(encode_json(&fits).unwrap().len(), HEADER_LEN + MAX_PAYLOAD);
        let e = FrameError::TooLarge(MAX_PAYLOAD + 1).to_string();
        assert!(e.contains("1048577") && e.contains("1048576"), "{e}");
    }
}
