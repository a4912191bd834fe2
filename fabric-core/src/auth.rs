//! Proof of a shared token by challenge and response, for every channel that shares the
//! token: the tcp transport's data connections, the cuda-ipc transport's control socket,
//! the rendezvous and its raw streams.
//!
//! The side that checks (the verifier) sends a fresh random [`Nonce`] for every connection;
//! the side that proves (the prover) answers with [`tag`]: an HMAC-SHA256 keyed by the
//! token over a context string and the nonce; the verifier checks it with [`verify`], in
//! constant time. The context names the protocol, its version and the direction (each
//! protocol has its own: `transport_tcp::frame::HELLO_CONTEXT`,
//! `transport_cuda_ipc::wire::HELLO_CONTEXT`), so a tag is worth nothing for another nonce,
//! another protocol, or the other direction: a recorded handshake cannot be replayed, and
//! the token itself never travels.
//!
//! What it does not do: it proves the token at the start of a connection, not the bytes
//! that follow, and it does not say which verifier the prover talks to. An attacker on the
//! path can take a connection over after its handshake, and one that a prover connects to
//! can relay a verifier's challenge to it; on networks you do not trust, run inside an
//! encrypted tunnel.
//!
//! ```
//! use fabric_core::auth::{self, Nonce};
//!
//! const CONTEXT: &str = "example-control/1 HELLO: client to server";
//! // The verifier sends a fresh nonce on every connection (here as hex).
//! let nonce = Nonce::new().unwrap();
//! let sent = nonce.to_hex();
//! // The prover answers with the tag of the nonce it received.
//! let received: Nonce = sent.parse().unwrap();
//! let tag = auth::tag("s3cret", CONTEXT, &received);
//! // The verifier checks it, in constant time.
//! assert!(auth::verify("s3cret", CONTEXT, &nonce, &tag));
//! assert!(!auth::verify("guess", CONTEXT, &nonce, &tag));
//! assert!(!auth::verify("s3cret", "another protocol", &nonce, &tag));
//! // A replay on a later connection meets another nonce.
//! assert!(!auth::verify("s3cret", CONTEXT, &Nonce::new().unwrap(), &tag));
//! ```

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Why a nonce could not be made or parsed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The operating system's random source failed.
    #[error("the operating system's random source failed")]
    Random(#[source] getrandom::Error),
    /// A hexadecimal nonce of the wrong length.
    #[error("a nonce is {digits} hexadecimal digits, not {0} bytes", digits = 2 * NONCE_LEN)]
    NonceLength(usize),
    /// A nonce with a character that is not a hexadecimal digit.
    #[error("a nonce is hexadecimal digits only")]
    NonceNotHex,
}

/// Bytes of a [`Nonce`] (128 bits).
pub const NONCE_LEN: usize = 16;

/// Bytes of a [`tag`] (HMAC-SHA256).
pub const TAG_LEN: usize = 32;

/// The shortest tag [`verify`] accepts: the left half of a tag (128 bits), which is what a
/// tcp HELLO carries.
pub const MIN_TAG_LEN: usize = 16;

/// A challenge: random bytes, fresh for every connection, that the prover's [`tag`] covers.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Nonce([u8; NONCE_LEN]);

impl Nonce {
    /// A fresh nonce from the operating system's random source. Fails (rather than fall
    /// back to anything weaker) when that source fails.
    pub fn new() -> Result<Nonce, AuthError> {
        let mut b = [0u8; NONCE_LEN];
        getrandom::fill(&mut b).map_err(AuthError::Random)?;
        Ok(Nonce(b))
    }

    /// The nonce whose bytes are `b` (one received from a verifier).
    pub fn from_bytes(b: [u8; NONCE_LEN]) -> Nonce {
        Nonce(b)
    }

    /// Its bytes.
    pub fn as_bytes(&self) -> &[u8; NONCE_LEN] {
        &self.0
    }

    /// Lower-case hexadecimal, 32 digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`to_hex`](Self::to_hex)'s form (either case).
    pub fn from_hex(s: &str) -> Result<Nonce, AuthError> {
        let s = s.as_bytes();
        if s.len() != 2 * NONCE_LEN {
            return Err(AuthError::NonceLength(s.len()));
        }
        let digit = |c: u8| char::from(c).to_digit(16).ok_or(AuthError::NonceNotHex);
        let mut b = [0u8; NONCE_LEN];
        for (i, pair) in s.chunks_exact(2).enumerate() {
            b[i] = ((digit(pair[0])? << 4) | digit(pair[1])?) as u8;
        }
        Ok(Nonce(b))
    }
}

impl std::str::FromStr for Nonce {
    type Err = AuthError;

    fn from_str(s: &str) -> Result<Nonce, AuthError> {
        Nonce::from_hex(s)
    }
}

impl std::fmt::Display for Nonce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl std::fmt::Debug for Nonce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nonce({})", self.to_hex())
    }
}

/// The MAC keyed by `token` that has taken in `context` and `nonce`: the context's length
/// first, so that no two (context, nonce) pairs give the same input.
fn mac(token: &str, context: &str, nonce: &Nonce) -> Hmac<Sha256> {
    // HMAC takes keys of any length (a long one is hashed first): this cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(token.as_bytes())
        .expect("HMAC accepts keys of any length");
    m.update(&(context.len() as u64).to_le_bytes());
    m.update(context.as_bytes());
    m.update(&nonce.0);
    m
}

/// The proof that the sender knows `token`, for `nonce` and `context` only:
/// HMAC-SHA256(token, len(context) as u64 LE ‖ context ‖ nonce).
pub fn tag(token: &str, context: &str, nonce: &Nonce) -> [u8; TAG_LEN] {
    mac(token, context, nonce).finalize().into_bytes().into()
}

/// Whether `tag` is [`tag`]`(token, context, nonce)`, or its left part of at least
/// [`MIN_TAG_LEN`] bytes, compared in constant time. A shorter (or empty) tag, or a longer
/// one, is refused.
pub fn verify(token: &str, context: &str, nonce: &Nonce, tag: &[u8]) -> bool {
    // The length is no secret: refusing short tags early leaks nothing about the token.
    if tag.len() < MIN_TAG_LEN {
        return false;
    }
    mac(token, context, nonce)
        .verify_truncated_left(tag)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nonce(v: u8) -> Nonce {
        Nonce::from_bytes([v; NONCE_LEN])
    }

    #[test]
    fn a_tag_verifies_for_its_token_context_and_nonce_only() {
        let t = tag("secret", "ctx", &nonce(1));
        assert!(verify("secret", "ctx", &nonce(1), &t));
        assert!(!verify("secret2", "ctx", &nonce(1), &t));
        assert!(!verify("secret", "ctx", &nonce(2), &t));
        assert!(!verify("secret", "ctx2", &nonce(1), &t));
    }

    #[test]
    fn tags_differ_per_nonce_and_per_context() {
        let a = tag("secret", "ctx", &nonce(1));
        assert_ne!(a, tag("secret", "ctx", &nonce(2)));
        assert_ne!(a, tag("secret", "other ctx", &nonce(1)));
        assert_ne!(a, tag("other secret", "ctx", &nonce(1)));
        // The context's length is part of the input: moving bytes between the context and
        // the nonce does not give the same tag.
        let mut shifted = [1u8; NONCE_LEN];
        shifted[0] = b'x';
        assert_ne!(
            tag("secret", "ctx", &nonce(1)),
            tag("secret", "ct", &Nonce::from_bytes(shifted))
        );
        // Deterministic: the verifier recomputes the prover's.
        assert_eq!(a, tag("secret", "ctx", &nonce(1)));
    }

    #[test]
    fn verify_refuses_flipped_short_long_and_empty_tags() {
        let n = nonce(7);
        let t = tag("secret", "ctx", &n);
        for byte in [0, TAG_LEN / 2, TAG_LEN - 1] {
            for bit in 0..8 {
                let mut bad = t;
                bad[byte] ^= 1 << bit;
                assert!(!verify("secret", "ctx", &n, &bad), "byte {byte} bit {bit}");
            }
        }
        // A left part of at least MIN_TAG_LEN bytes verifies (a HELLO carries 16).
        assert!(verify("secret", "ctx", &n, &t[..MIN_TAG_LEN]));
        assert!(verify("secret", "ctx", &n, &t[..MIN_TAG_LEN + 1]));
        assert!(!verify("secret", "ctx", &n, &t[..MIN_TAG_LEN - 1]));
        assert!(!verify("secret", "ctx", &n, &t[..1]));
        assert!(!verify("secret", "ctx", &n, &[]));
        // A right part is not a left part.
        assert!(!verify("secret", "ctx", &n, &t[TAG_LEN - MIN_TAG_LEN..]));
        let mut long = t.to_vec();
        long.push(0);
        assert!(!verify("secret", "ctx", &n, &long));
        // All zeros (what an initiator without a token sends).
        assert!(!verify("secret", "ctx", &n, &[0u8; MIN_TAG_LEN]));
    }

    #[test]
    fn nonces_are_fresh_and_round_trip_through_hex() {
        let a = Nonce::new().unwrap();
        let b = Nonce::new().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.to_hex().len(), 2 * NONCE_LEN);
        assert_eq!(Nonce::from_hex(&a.to_hex()).unwrap(), a);
        assert_eq!(a.to_string().parse::<Nonce>().unwrap(), a);
        assert_eq!(Nonce::from_bytes(*a.as_bytes()), a);
        let n = Nonce::from_bytes([0xAB; NONCE_LEN]);
        assert_eq!(n.to_hex(), "ab".repeat(NONCE_LEN));
        assert_eq!(Nonce::from_hex(&"AB".repeat(NONCE_LEN)).unwrap(), n);
    }

    #[test]
    fn malformed_hex_nonces_are_refused() {
        assert!(matches!(
            Nonce::from_hex("abcd"),
            Err(AuthError::NonceLength(4))
        ));
        assert!(matches!(
            Nonce::from_hex(""),
            Err(AuthError::NonceLength(0))
        ));
        let mut s = "0".repeat(2 * NONCE_LEN);
        s.replace_range(5..6, "g");
        assert!(matches!(Nonce::from_hex(&s), Err(AuthError::NonceNotHex)));
        // u8::from_str_radix would take a sign: not hex.
        let s = format!("+f{}", "0".repeat(2 * NONCE_LEN - 2));
        assert!(matches!(Nonce::from_hex(&s), Err(AuthError::NonceNotHex)));
        // 32 bytes that are not 32 characters.
        let s = format!("é{}", "0".repeat(2 * NONCE_LEN - 2));
        assert!(matches!(Nonce::from_hex(&s), Err(AuthError::NonceNotHex)));
    }
}
