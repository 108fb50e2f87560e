//! Identifiers and nonces.

use rand::RngCore;

/// A fresh sandbox id: `sb-` and 12 hex digits.
pub fn sandbox_id() -> String {
    format!("sb-{}", random_hex(6))
}

/// True for an id [`sandbox_id`] could have made: a name safe to use as a directory's.
pub fn is_sandbox_id(id: &str) -> bool {
    id.strip_prefix("sb-")
        .is_some_and(|hex| hex.len() == 12 && hex.chars().all(|c| c.is_ascii_hexdigit()))
}

/// `bytes` random bytes as lowercase hex (from the OS RNG).
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::rngs::OsRng.fill_bytes(&mut buf);
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_distinct_and_well_formed() {
        let a = super::sandbox_id();
        let b = super::sandbox_id();
        assert_ne!(a, b);
        assert_eq!(a.len(), 15);
        assert!(a[3..].chars().all(|c| c.is_ascii_hexdigit()));
        assert!(super::is_sandbox_id(&a));
        for bad in ["sb-../../etc/x", "sb-0123456789a", "x-0123456789ab", ""] {
            assert!(!super::is_sandbox_id(bad), "{bad}");
        }
    }
}
