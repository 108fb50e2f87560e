//! Snapshot tags: the names snapshots are stored and forked by.

use super::SnapshotError;
use std::fmt;

/// Longest tag accepted.
pub const MAX_TAG_LEN: usize = 128;

/// A validated tag: 1 to [`MAX_TAG_LEN`] characters of `A-Z a-z 0-9 . _ -`, starting
/// with a letter or digit, and never `..`. A tag is one path component under the
/// snapshot store, so nothing in it can name another directory.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(String);

impl Tag {
    /// Checks `s` and wraps it.
    pub fn parse(s: &str) -> Result<Tag, SnapshotError> {
        let bad = |reason: &str| SnapshotError::InvalidTag {
            tag: s.chars().take(40).collect(),
            reason: reason.to_owned(),
        };
        if s.is_empty() {
            return Err(bad("it is empty"));
        }
        if s.len() > MAX_TAG_LEN {
            return Err(bad(&format!(
                "it is {} characters long; the limit is {MAX_TAG_LEN}",
                s.len()
            )));
        }
        if s.contains('/') {
            return Err(bad("it contains '/'"));
        }
        if s.contains("..") {
            return Err(bad("it contains '..'"));
        }
        if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(bad(&format!(
                "{c:?} is not allowed (use letters, digits, '.', '_' and '-')"
            )));
        }
        if !s.starts_with(|c: char| c.is_ascii_alphanumeric()) {
            return Err(bad("it must start with a letter or a digit"));
        }
        Ok(Tag(s.to_owned()))
    }

    /// The tag as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for Tag {
    type Err = SnapshotError;
    fn from_str(s: &str) -> Result<Tag, SnapshotError> {
        Tag::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_tags() {
        for t in ["python", "py-3.11_warm", "a", "0", &"x".repeat(MAX_TAG_LEN)] {
            assert_eq!(Tag::parse(t).unwrap().as_str(), t);
        }
    }

    #[test]
    fn bad_tags_say_why() {
        let cases = [
            ("", "empty"),
            ("../x", "'/'"),
            ("a/b", "'/'"),
            ("..", "'..'"),
            ("a..b", "'..'"),
            (".hidden", "start with"),
            ("-x", "start with"),
            ("a b", "' '"),
            ("tag\0", "'\\0'"),
            ("é", "'é'"),
        ];
        for (tag, why) in cases {
            let e = Tag::parse(tag).unwrap_err().to_string();
            assert!(e.contains(why), "{tag:?}: {e}");
        }
        let long = "x".repeat(300);
        let e = Tag::parse(&long).unwrap_err().to_string();
        assert!(e.contains("300 characters"), "{e}");
        assert!(
            e.len() < 200,
            "the message quotes only the start of a long tag: {e}"
        );
    }
}
