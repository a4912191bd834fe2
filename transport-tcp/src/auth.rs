//! Proof of a shared token by challenge and response: [`fabric_core::auth`], re-exported
//! here (its home before every transport with a token used it), and the static digest of
//! protocol version 3's HELLO that `xfer serve`'s control port still compares.
//!
//! ```
//! use transport_tcp::auth::{self, Nonce};
//!
//! let nonce = Nonce::new().unwrap();
//! let tag = auth::tag("s3cret", "example/1 HELLO: client to server", &nonce);
//! assert!(auth::verify("s3cret", "example/1 HELLO: client to server", &nonce, &tag));
//! ```

pub use fabric_core::auth::*;
use sha2::{Digest, Sha256};

/// The static digest of protocol version 3's HELLO (see [`crate::auth_digest`]).
pub(crate) fn digest(token: &str) -> [u8; 16] {
    let mut h = Sha256::new();
    h.update(b"xfer-tcp-auth-v1\0");
    h.update(token.as_bytes());
    let full = h.finalize();
    let mut d = [0u8; 16];
    d.copy_from_slice(&full[..16]);
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_legacy_digest_differs_per_token() {
        assert_ne!(digest("secret"), digest("secret2"));
        assert_eq!(digest("secret"), digest("secret"));
    }
}
