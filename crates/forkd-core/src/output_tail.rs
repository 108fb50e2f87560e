//! The end of a command's output, kept within a fixed number of bytes.
//!
//! Used where output is only needed to explain a failure (the warm-up steps of a template
//! build): a step may print gigabytes, and only its last bytes are kept.

use std::collections::VecDeque;

/// The last `cap` bytes written, and how many came before them.
#[derive(Debug, Clone)]
pub struct OutputTail {
    kept: VecDeque<u8>,
    cap: usize,
    dropped: u64,
}

impl OutputTail {
    /// An empty tail keeping at most `cap` bytes.
    pub fn new(cap: usize) -> OutputTail {
        OutputTail {
            kept: VecDeque::new(),
            cap,
            dropped: 0,
        }
    }

    /// Appends `data`, dropping the oldest bytes beyond the cap.
    pub fn push(&mut self, mut data: &[u8]) {
        if data.len() > self.cap {
            let skip = data.len() - self.cap;
            self.dropped += skip as u64;
            data = &data[skip..];
        }
        let over = (self.kept.len() + data.len()).saturating_sub(self.cap);
        self.kept.drain(..over);
        self.dropped += over as u64;
        self.kept.extend(data);
    }

    /// How many bytes were dropped.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The kept bytes, lossily decoded, after a note of what was dropped, if anything.
    pub fn render(&self) -> String {
        let (a, b) = self.kept.as_slices();
        let mut bytes = Vec::with_capacity(a.len() + b.len());
        bytes.extend_from_slice(a);
        bytes.extend_from_slice(b);
        let text = String::from_utf8_lossy(&bytes);
        if self.dropped == 0 {
            return text.into_owned();
        }
        format!(
            "[{} earlier bytes dropped; the last {} follow (FORKD_WARMUP_OUTPUT_CAP)]\n{text}",
            self.dropped,
            bytes.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_bytes_and_counts_the_rest() {
        let mut t = OutputTail::new(10);
        t.push(b"hello ");
        assert_eq!(t.render(), "hello ");
        t.push(b"world, again");
        assert_eq!(t.dropped(), 8);
        assert_eq!(
            t.render(),
            "[8 earlier bytes dropped; the last 10 follow (FORKD_WARMUP_OUTPUT_CAP)]\nrld, again"
        );
        let mut t = OutputTail::new(4);
        for _ in 0..1000 {
            t.push(b"abc");
        }
        assert_eq!(t.dropped(), 2996);
        assert!(t.render().ends_with("\ncabc"), "{}", t.render());
        t.push(&[b'z'; 100]);
        assert_eq!(t.dropped(), 3096);
        assert!(t.render().ends_with("\nzzzz"));
    }
}
