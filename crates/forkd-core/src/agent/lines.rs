//! Splitting a streamed body into lines, in linear time and with a longest line.
//!
//! `LinesCodec` remembers how far it has searched for a newline, so each byte is looked
//! at once however the body is cut into frames, and it refuses a line longer than its
//! maximum instead of buffering it.

use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio_util::codec::{FramedRead, LinesCodec, LinesCodecError};
use tokio_util::io::StreamReader;

use super::AgentError;

/// The lines of a byte stream, none longer than a maximum.
pub(crate) struct Lines<S> {
    inner: FramedRead<StreamReader<S, Bytes>, LinesCodec>,
    max: usize,
    what: &'static str,
    setting: &'static str,
}

impl<S: Stream<Item = std::io::Result<Bytes>> + Unpin> Lines<S> {
    /// Lines of `body`, at most `max` bytes each (without the newline). `what` names a
    /// line in errors and `setting` the variable that raises the limit.
    pub(crate) fn new(body: S, max: usize, what: &'static str, setting: &'static str) -> Self {
        Lines {
            inner: FramedRead::new(
                StreamReader::new(body),
                LinesCodec::new_with_max_length(max),
            ),
            max,
            what,
            setting,
        }
    }

    /// The next line; `None` at the end of the stream (a last line without a newline is
    /// returned first).
    pub(crate) async fn next(&mut self) -> Result<Option<String>, AgentError> {
        match self.inner.next().await {
            None => Ok(None),
            Some(Ok(line)) => Ok(Some(line)),
            Some(Err(LinesCodecError::MaxLineLengthExceeded)) => Err(AgentError::TooLarge {
                what: self.what,
                limit: self.max as u64,
                setting: self.setting,
            }),
            Some(Err(LinesCodecError::Io(e))) => Err(AgentError::Io {
                context: format!("reading a {}", self.what),
                source: e,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(
        chunks: Vec<&'static [u8]>,
        max: usize,
    ) -> Lines<impl Stream<Item = std::io::Result<Bytes>> + Unpin> {
        let s = futures::stream::iter(chunks.into_iter().map(|c| Ok(Bytes::from_static(c))));
        Lines::new(s, max, "test line", "TEST_LIMIT")
    }

    #[tokio::test]
    async fn lines_split_across_chunks() {
        let mut l = lines_of(vec![b"ab", b"c\nd", b"", b"e\n\nf\n", b"tail"], 16);
        let mut got = Vec::new();
        while let Some(line) = l.next().await.unwrap() {
            got.push(line);
        }
        assert_eq!(got, ["abc", "de", "", "f", "tail"]);
    }

    #[tokio::test]
    async fn a_line_over_the_maximum_is_refused_naming_the_limit() {
        let mut l = lines_of(vec![b"12345678", b"\n", b"123456789", b"0\nok\n"], 8);
        assert_eq!(l.next().await.unwrap().unwrap(), "12345678");
        let e = l.next().await.unwrap_err();
        assert!(matches!(e, AgentError::TooLarge { limit: 8, .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("8 bytes") && msg.contains("TEST_LIMIT"),
            "{msg}"
        );
        // Nothing after it is trusted: the stream ends there.
        assert!(l.next().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_long_line_in_tiny_chunks_is_cut_at_the_maximum() {
        // 1 MiB without a newline, a byte at a time: refused once the maximum is passed,
        // without waiting for the end of the line.
        let one: &'static [u8] = b"x";
        let endless =
            futures::stream::repeat_with(move || Ok(Bytes::from_static(one))).take(1 << 20);
        let mut l = Lines::new(endless, 4096, "test line", "TEST_LIMIT");
        assert!(matches!(l.next().await, Err(AgentError::TooLarge { .. })));
    }
}
