//! The handshake of a control connection (see [`wire`](crate::wire)), as pure steps over
//! frames and output buffers, no sockets: the target's CHALLENGE with a fresh nonce and its
//! authentication mode, the initiator's HELLO that answers it with a tag of that nonce keyed
//! by the shared token and a fresh nonce of its own, the target's check of that tag before
//! it reads anything else, and its PROOF (the tag of the initiator's nonce), which the
//! initiator checks before it sends anything else. A token on one side only is refused by
//! both. Tags are compared in constant time ([`fabric_core::auth::verify`]).

use crate::error::HandshakeError;
use crate::wire::{
    AUTH_NONE, AUTH_TOKEN, Challenge, HELLO_CONTEXT, Header, Hello, Op, PROOF_CONTEXT, Proof,
    REFUSE_AUTH, TAG_LEN, VERSION,
};
use fabric_core::auth::{self, Nonce};

/// Where a connection is in its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Handshake {
    /// Accepted: our CHALLENGE carried `nonce`; the HELLO must prove the token for it.
    Challenged {
        /// Our CHALLENGE's nonce.
        nonce: Nonce,
    },
    /// Opened by us: nothing leaves before the target's CHALLENGE; our HELLO will carry
    /// `nonce`.
    AwaitingChallenge {
        /// Our HELLO's nonce, drawn when the connection was opened.
        nonce: Nonce,
    },
    /// Opened by us: our HELLO carried `nonce`; nothing else leaves until the target's
    /// PROOF has proved the token for it.
    AwaitingProof {
        /// Our HELLO's nonce.
        nonce: Nonce,
    },
    /// Over: the HELLO was let in (accepted), or the PROOF (opened).
    Done,
}

impl Handshake {
    /// Whether the handshake is over.
    pub(crate) fn is_done(&self) -> bool {
        matches!(self, Handshake::Done)
    }
}

/// The authentication mode of a side with `token`.
pub(crate) fn mode(token: Option<&str>) -> u64 {
    if token.is_some() {
        AUTH_TOKEN
    } else {
        AUTH_NONE
    }
}

/// Whether modes `theirs` and ours (from `token`) agree: `Ok(Some(token))` both have a
/// token, `Ok(None)` neither, else the refusal naming the side that lacks it.
fn agree(theirs: u64, token: Option<&str>) -> Result<Option<&str>, HandshakeError> {
    match (theirs, token) {
        (AUTH_TOKEN, Some(t)) => Ok(Some(t)),
        (AUTH_NONE, None) => Ok(None),
        (AUTH_NONE, Some(_)) => Err(HandshakeError::PeerHasNoToken),
        (AUTH_TOKEN, None) => Err(HandshakeError::NoTokenHere),
        (m, _) => Err(HandshakeError::UnknownAuthMode(m)),
    }
}

/// (Target) appends the CHALLENGE of a connection just accepted, carrying `nonce` (fresh
/// for it) and our mode.
pub(crate) fn challenge(nonce: &Nonce, token: Option<&str>, out: &mut Vec<u8>) {
    Challenge {
        version: VERSION,
        mode: mode(token),
        nonce: *nonce,
    }
    .encode(out);
}

/// (Initiator) answers the CHALLENGE `h`/`payload` with our HELLO (carrying `nonce` and
/// `address`), appended to `out`. When the modes differ the HELLO still goes, untagged, so
/// that the target can say why too, and the refusal is returned: the caller sends what
/// `out` holds and closes. Without a token no tag is made, nor for a target without one (it
/// would be a tag of a nonce of its choosing, for nothing).
pub(crate) fn answer_challenge(
    nonce: &Nonce,
    token: Option<&str>,
    h: &Header,
    payload: &[u8],
    address: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), HandshakeError> {
    let c = Challenge::decode(h, payload).map_err(HandshakeError::Malformed)?;
    if c.version != VERSION {
        return Err(HandshakeError::Version(c.version));
    }
    let agreed = agree(c.mode, token);
    if let Err(HandshakeError::UnknownAuthMode(m)) = agreed {
        return Err(HandshakeError::UnknownAuthMode(m));
    }
    let tag = match agreed {
        Ok(Some(token)) => auth::tag(token, HELLO_CONTEXT, &c.nonce),
        _ => [0u8; TAG_LEN],
    };
    Hello {
        version: VERSION,
        mode: mode(token),
        nonce: *nonce,
        tag,
        address,
    }
    .encode(out);
    agreed.map(|_| ())
}

/// (Target) whether the HELLO `h`/`payload` may be let in, judged before anything else of
/// the peer is read: its version, its mode against ours, and (with a token) its tag of our
/// CHALLENGE's `nonce`, in constant time. Returns the HELLO (its address is for the caller
/// to check).
pub(crate) fn check_hello<'a>(
    nonce: &Nonce,
    token: Option<&str>,
    h: &Header,
    payload: &'a [u8],
) -> Result<Hello<'a>, HandshakeError> {
    if h.x != VERSION {
        return Err(HandshakeError::Version(h.x));
    }
    let hello = Hello::decode(h, payload).map_err(HandshakeError::Malformed)?;
    if let Some(token) = agree(hello.mode, token)?
        && !auth::verify(token, HELLO_CONTEXT, nonce, &hello.tag)
    {
        return Err(HandshakeError::AuthenticationFailed);
    }
    Ok(hello)
}

/// (Target) appends the PROOF for a HELLO that was let in: the tag of its nonce `theirs`,
/// zeros without a token.
pub(crate) fn prove(token: Option<&str>, theirs: &Nonce, out: &mut Vec<u8>) {
    let tag = match token {
        Some(t) => auth::tag(t, PROOF_CONTEXT, theirs),
        None => [0u8; TAG_LEN],
    };
    Proof { tag }.encode(out);
}

/// (Target) appends the REFUSE that tells the initiator its HELLO's tag does not prove our
/// token.
pub(crate) fn refuse(out: &mut Vec<u8>) {
    Header::new(Op::Refuse, 0, REFUSE_AUTH, 0).encode(out);
}

/// (Initiator) whether the PROOF `h`/`payload` proves `token` for our HELLO's `nonce` (in
/// constant time); without a token it only ends the handshake.
pub(crate) fn check_proof(
    nonce: &Nonce,
    token: Option<&str>,
    h: &Header,
    payload: &[u8],
) -> Result<(), HandshakeError> {
    let p = Proof::decode(h, payload).map_err(HandshakeError::Malformed)?;
    if let Some(token) = token
        && !auth::verify(token, PROOF_CONTEXT, nonce, &p.tag)
    {
        return Err(HandshakeError::ProofFailed);
    }
    Ok(())
}

/// (Initiator) what a REFUSE `h` says.
pub(crate) fn refusal(h: &Header) -> HandshakeError {
    match h.x {
        REFUSE_AUTH => HandshakeError::RefusedByTarget,
        why => HandshakeError::UnknownRefusal(why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{HEADER_LEN, NONCE_LEN};

    const ADDRESS: &[u8] = b"xipc1 boot 1 0 xfer-ipc-1-00";

    /// The one frame in `out`: its header and payload.
    fn frame(out: &[u8]) -> (Header, Vec<u8>) {
        let h = Header::decode(out[..HEADER_LEN].try_into().unwrap(), 1 << 20).unwrap();
        assert_eq!(out.len(), HEADER_LEN + h.len as usize, "one frame");
        (h, out[HEADER_LEN..].to_vec())
    }

    fn nonce(v: u8) -> Nonce {
        Nonce::from_bytes([v; NONCE_LEN])
    }

    /// What each side concludes when an initiator with `ours` meets a target with
    /// `theirs`: the initiator's result (of the CHALLENGE, then of the PROOF) and the
    /// target's (of the HELLO).
    fn run(
        initiator: Option<&str>,
        target: Option<&str>,
    ) -> (Result<(), HandshakeError>, Result<(), HandshakeError>) {
        let (nt, ni) = (nonce(1), nonce(2));
        let mut out = Vec::new();
        challenge(&nt, target, &mut out);
        let (h, p) = frame(&out);
        let mut hello = Vec::new();
        let asked = answer_challenge(&ni, initiator, &h, &p, ADDRESS, &mut hello);
        // The HELLO leaves whatever the initiator concluded.
        let (h, p) = frame(&hello);
        let checked = check_hello(&nt, target, &h, &p).map(|hello| {
            assert_eq!(hello.address, ADDRESS);
            assert_eq!(hello.nonce, ni);
            let mut out = Vec::new();
            prove(target, &hello.nonce, &mut out);
            out
        });
        let initiator_result = match (&asked, &checked) {
            (Err(e), _) => Err(e.clone()),
            (Ok(()), Ok(proof)) => {
                let (h, p) = frame(proof);
                check_proof(&ni, initiator, &h, &p)
            }
            (Ok(()), Err(HandshakeError::AuthenticationFailed)) => {
                let mut out = Vec::new();
                refuse(&mut out);
                Err(refusal(&frame(&out).0))
            }
            (Ok(()), Err(e)) => panic!("the target refused a HELLO the initiator sent: {e}"),
        };
        (initiator_result, checked.map(|_| ()))
    }

    #[test]
    fn the_same_token_or_none_on_both_sides_passes() {
        assert_eq!(run(Some("s3cret"), Some("s3cret")), (Ok(()), Ok(())));
        assert_eq!(run(None, None), (Ok(()), Ok(())));
    }

    #[test]
    fn different_tokens_are_refused_by_both_sides() {
        assert_eq!(
            run(Some("s3cret"), Some("other")),
            (
                Err(HandshakeError::RefusedByTarget),
                Err(HandshakeError::AuthenticationFailed)
            )
        );
        assert_eq!(
            run(Some("other"), Some("s3cret")),
            (
                Err(HandshakeError::RefusedByTarget),
                Err(HandshakeError::AuthenticationFailed)
            )
        );
    }

    #[test]
    fn a_token_on_one_side_only_is_refused_by_both_naming_the_side_without() {
        assert_eq!(
            run(Some("s3cret"), None),
            (
                Err(HandshakeError::PeerHasNoToken),
                Err(HandshakeError::NoTokenHere)
            )
        );
        assert_eq!(
            run(None, Some("s3cret")),
            (
                Err(HandshakeError::NoTokenHere),
                Err(HandshakeError::PeerHasNoToken)
            )
        );
    }

    #[test]
    fn an_initiator_with_a_token_tags_nothing_for_a_target_without_one() {
        let mut out = Vec::new();
        challenge(&nonce(1), None, &mut out);
        let (h, p) = frame(&out);
        let mut hello = Vec::new();
        let r = answer_challenge(&nonce(2), Some("s3cret"), &h, &p, ADDRESS, &mut hello);
        assert_eq!(r, Err(HandshakeError::PeerHasNoToken));
        let (h, p) = frame(&hello);
        let hello = Hello::decode(&h, &p).unwrap();
        assert_eq!((hello.mode, hello.tag), (AUTH_TOKEN, [0u8; TAG_LEN]));
    }

    #[test]
    fn a_hello_or_proof_recorded_on_one_connection_proves_nothing_on_another() {
        let token = Some("s3cret");
        // Connection 1: the target's nonce 1, the initiator's 2.
        let mut out = Vec::new();
        challenge(&nonce(1), token, &mut out);
        let (h, p) = frame(&out);
        let mut recorded_hello = Vec::new();
        answer_challenge(&nonce(2), token, &h, &p, ADDRESS, &mut recorded_hello).unwrap();
        let (hh, hp) = frame(&recorded_hello);
        assert!(check_hello(&nonce(1), token, &hh, &hp).is_ok());
        let mut recorded_proof = Vec::new();
        prove(token, &nonce(2), &mut recorded_proof);
        let (ph, pp) = frame(&recorded_proof);
        assert_eq!(check_proof(&nonce(2), token, &ph, &pp), Ok(()));
        // Connection 2: other nonces; the recordings are refused.
        assert_eq!(
            check_hello(&nonce(3), token, &hh, &hp).unwrap_err(),
            HandshakeError::AuthenticationFailed
        );
        assert_eq!(
            check_proof(&nonce(4), token, &ph, &pp),
            Err(HandshakeError::ProofFailed)
        );
        // A tag of one direction is no proof in the other (a reflected HELLO tag).
        let hello = Hello::decode(&hh, &hp).unwrap();
        let reflected = Proof { tag: hello.tag };
        let mut out = Vec::new();
        reflected.encode(&mut out);
        let (h, p) = frame(&out);
        assert_eq!(
            check_proof(&nonce(1), token, &h, &p),
            Err(HandshakeError::ProofFailed)
        );
        // Nor is tcp's HELLO tag for the same nonce.
        let tcp = auth::tag("s3cret", "xfer-tcp/5 HELLO: initiator to target", &nonce(1));
        let forged = Hello { tag: tcp, ..hello };
        let mut out = Vec::new();
        forged.encode(&mut out);
        let (h, p) = frame(&out);
        assert_eq!(
            check_hello(&nonce(1), token, &h, &p).unwrap_err(),
            HandshakeError::AuthenticationFailed
        );
    }

    #[test]
    fn other_versions_unknown_modes_and_malformed_frames_are_refused() {
        let token = Some("s3cret");
        // A target of another version.
        let mut out = Vec::new();
        Challenge {
            version: 2,
            mode: AUTH_NONE,
            nonce: nonce(1),
        }
        .encode(&mut out);
        let (h, p) = frame(&out);
        let mut hello = Vec::new();
        assert_eq!(
            answer_challenge(&nonce(2), None, &h, &p, ADDRESS, &mut hello),
            Err(HandshakeError::Version(2))
        );
        assert!(hello.is_empty(), "a HELLO went to a target of version 2");
        // An unknown mode: nothing is sent.
        let mut out = Vec::new();
        Challenge {
            version: VERSION,
            mode: 7,
            nonce: nonce(1),
        }
        .encode(&mut out);
        let (h, p) = frame(&out);
        assert_eq!(
            answer_challenge(&nonce(2), token, &h, &p, ADDRESS, &mut hello),
            Err(HandshakeError::UnknownAuthMode(7))
        );
        assert!(hello.is_empty());
        // A short CHALLENGE.
        let h = Header::new(Op::Challenge, AUTH_NONE, VERSION, 3);
        assert!(matches!(
            answer_challenge(&nonce(2), None, &h, &[0; 3], ADDRESS, &mut hello),
            Err(HandshakeError::Malformed(_))
        ));
        // HELLOs: an old version (its payload is an address only), an unknown mode, a
        // short one.
        let old = Header::new(Op::Hello, 0, 2, ADDRESS.len() as u64);
        assert_eq!(
            check_hello(&nonce(1), None, &old, ADDRESS).unwrap_err(),
            HandshakeError::Version(2)
        );
        let odd = Header::new(Op::Hello, 9, VERSION, 48);
        assert_eq!(
            check_hello(&nonce(1), token, &odd, &[0; 48]).unwrap_err(),
            HandshakeError::UnknownAuthMode(9)
        );
        let short = Header::new(Op::Hello, AUTH_TOKEN, VERSION, 40);
        assert!(matches!(
            check_hello(&nonce(1), token, &short, &[0; 40]),
            Err(HandshakeError::Malformed(_))
        ));
        // A zero tag (what a side without a token sends) claiming a token.
        let zeros = Header::new(Op::Hello, AUTH_TOKEN, VERSION, 48);
        assert_eq!(
            check_hello(&nonce(1), token, &zeros, &[0; 48]).unwrap_err(),
            HandshakeError::AuthenticationFailed
        );
        // PROOFs of the wrong size; REFUSEs.
        let p = Header::new(Op::Proof, 0, 0, 16);
        assert!(matches!(
            check_proof(&nonce(1), token, &p, &[0; 16]),
            Err(HandshakeError::Malformed(_))
        ));
        assert_eq!(
            refusal(&Header::new(Op::Refuse, 0, 99, 0)),
            HandshakeError::UnknownRefusal(99)
        );
    }
}
