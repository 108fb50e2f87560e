//! The digest of everything that determines an asset. An asset is rebuilt exactly
//! when this digest changes, so every field that could change the output belongs here.

use sha2::{Digest, Sha256};

/// Builder for an inputs digest: a sha256 over length-prefixed `key=value` fields,
/// so that no two different field lists can produce the same byte stream.
#[derive(Debug, Clone)]
pub(crate) struct Inputs {
    hasher: Sha256,
    fields: Vec<String>,
}

impl Inputs {
    /// `kind` separates the namespaces of the asset kinds ("kernel", "rootfs"...).
    pub(crate) fn new(kind: &str) -> Inputs {
        Inputs {
            hasher: Sha256::new(),
            fields: Vec::new(),
        }
        .field("kind", kind)
    }

    pub(crate) fn field(mut self, key: &str, value: impl AsRef<str>) -> Inputs {
        let value = value.as_ref();
        for part in [key, value] {
            self.hasher.update((part.len() as u64).to_le_bytes());
            self.hasher.update(part.as_bytes());
        }
        self.fields.push(format!("{key}={value}"));
        self
    }

    /// The list field's items in order; order matters (module load order, for one).
    pub(crate) fn list<S: AsRef<str>>(self, key: &str, items: &[S]) -> Inputs {
        let joined: Vec<&str> = items.iter().map(|s| s.as_ref()).collect();
        self.field(key, joined.join("\n"))
    }

    pub(crate) fn digest(self) -> String {
        // Logged so that "why did this rebuild?" can be answered with RUST_LOG=debug.
        tracing::debug!(fields = ?self.fields, "asset inputs");
        hex::encode(self.hasher.finalize())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_unambiguous() {
        let a = Inputs::new("k").field("a", "bc").digest();
        let b = Inputs::new("k").field("ab", "c").digest();
        assert_ne!(a, b);
        let c = Inputs::new("k").field("a", "bc").digest();
        assert_eq!(a, c);
        assert_ne!(a, Inputs::new("j").field("a", "bc").digest());
        assert_eq!(a.len(), 64);
    }
}
