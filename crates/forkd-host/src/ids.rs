//! Identifiers and nonces.

use rand::RngCore;

/// A fresh sandbox id: `sb-` and 12 hex digits.
pub fn sandbox_id() -> String {
    format!("sb-{}", random_hex(6))
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
    }
}
