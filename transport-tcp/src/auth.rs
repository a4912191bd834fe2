//! The optional shared token: a HELLO carries a 128-bit digest of it in the header's `key`
//! and `offset` fields (zero when no token is set), checked in constant time by a target
//! that requires one, before anything else the peer sends is read.

use sha2::{Digest, Sha256};

/// The 128-bit digest of `token` that travels in HELLOs.
pub fn digest(token: &str) -> [u8; 16] {
    let mut h = Sha256::new();
    h.update(b"xfer-tcp-auth-v1\0");
    h.update(token.as_bytes());
    let full = h.finalize();
    let mut d = [0u8; 16];
    d.copy_from_slice(&full[..16]);
    d
}

/// The digest as the HELLO header's `key` and `offset` fields.
pub fn split(d: &[u8; 16]) -> (u64, u64) {
    (
        u64::from_le_bytes(d[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(d[8..].try_into().expect("8 bytes")),
    )
}

/// Whether the HELLO fields carry `want`, compared in constant time.
pub fn matches(want: &[u8; 16], key: u64, offset: u64) -> bool {
    let (a, b) = split(want);
    ((a ^ key) | (b ^ offset)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_differ_and_match_themselves() {
        let a = digest("secret");
        let b = digest("secret2");
        assert_ne!(a, b);
        let (k, o) = split(&a);
        assert!(matches(&a, k, o));
        assert!(!matches(&a, k, o ^ 1));
        assert!(!matches(&a, 0, 0));
    }
}
