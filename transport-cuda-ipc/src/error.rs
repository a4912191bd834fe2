//! Why a control connection is closed: its socket failed or the peer closed it
//! ([`ConnError`]), the peer broke the protocol ([`ProtocolError`]), or its handshake was
//! refused ([`HandshakeError`]). The first two do not leave the crate as such: the pending
//! operations of the connection's peer fail with
//! [`OpError::PeerUnreachable`](fabric_core::OpError::PeerUnreachable), whose reason is the
//! error with its sources ([`fabric_core::error::report`]). A refused handshake fails them
//! with [`OpError::Transport`] whose cause is the [`HandshakeError`] itself (a handshake that
//! did not end in time, with `PeerUnreachable`), and an accepted connection's refusal is
//! kept for [`CudaIpcTransport::take_auth_refusals`](crate::CudaIpcTransport::take_auth_refusals).

use crate::wire::{Op, WireError};
use fabric_core::{OpError, PeerId};
use std::time::Duration;

/// Why a connection's handshake (see [`wire`](crate::wire)) was refused, on either side.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The peer has no token and this side has one: refused, whichever side connected.
    #[error(
        "authentication refused: the peer has no auth token and this side has one (give both sides the same token)"
    )]
    PeerHasNoToken,
    /// The peer has a token and this side has none: refused, whichever side connected.
    #[error(
        "authentication refused: the peer has an auth token and this side has none (give both sides the same token)"
    )]
    NoTokenHere,
    /// (Target) a HELLO whose tag is not the token's for this connection's CHALLENGE: another
    /// token, or a HELLO recorded on another connection.
    #[error(
        "authentication failed: the HELLO does not prove the token for this connection's challenge"
    )]
    AuthenticationFailed,
    /// (Initiator) a PROOF whose tag is not the token's for our HELLO's nonce: the target
    /// has another token, or is not the target we meant (one that replays a PROOF).
    #[error(
        "authentication failed: the target's PROOF does not prove the token for this connection's nonce"
    )]
    ProofFailed,
    /// (Initiator) the target refused our HELLO's tag ([`Op::Refuse`]): its token is not
    /// ours.
    #[error(
        "authentication refused by the target: our HELLO does not prove its token (the tokens differ)"
    )]
    RefusedByTarget,
    /// (Initiator) a [`Op::Refuse`] giving a reason this side does not know.
    #[error("the target refused the handshake (reason {0})")]
    UnknownRefusal(u64),
    /// An authentication mode that is neither [`AUTH_NONE`](crate::wire::AUTH_NONE) nor
    /// [`AUTH_TOKEN`](crate::wire::AUTH_TOKEN).
    #[error("unknown authentication mode {0}")]
    UnknownAuthMode(u64),
    /// The peer speaks another protocol version (a target's CHALLENGE, an initiator's
    /// HELLO).
    #[error(
        "the peer speaks CUDA IPC protocol version {0}, this side {ours} (run the same xfer release on both sides)",
        ours = crate::wire::VERSION
    )]
    Version(u64),
    /// A frame the handshake did not expect where it stands (`expected` names the one due).
    #[error("{op:?} frame during the handshake, where a {expected} was due")]
    Unexpected {
        /// The frame that came.
        op: Op,
        /// The frame that was due.
        expected: &'static str,
    },
    /// A handshake frame of the wrong size.
    #[error("malformed handshake frame")]
    Malformed(#[source] WireError),
    /// (Initiator) no CHALLENGE within `peer_timeout`.
    #[error(
        "no CHALLENGE within {0:?} (a target of protocol version 2 or older sends none: it waits for a HELLO)"
    )]
    NoChallenge(Duration),
    /// (Initiator) no PROOF within `peer_timeout` of the connection's start.
    #[error("no PROOF within {0:?}")]
    NoProof(Duration),
}

impl HandshakeError {
    /// Whether this is a refusal of authentication (a token missing on one side, or
    /// another token), rather than a version or protocol fault or a time-out.
    pub fn is_authentication(&self) -> bool {
        matches!(
            self,
            HandshakeError::PeerHasNoToken
                | HandshakeError::NoTokenHere
                | HandshakeError::AuthenticationFailed
                | HandshakeError::ProofFailed
                | HandshakeError::RefusedByTarget
                | HandshakeError::UnknownAuthMode(_)
        )
    }

    /// What the pending operations of `peer` fail with: a handshake that did not end in
    /// time leaves the peer unreachable (retryable, as any silent peer); a refusal is the
    /// refusal itself, as [`OpError::Transport`] (not retryable).
    pub(crate) fn op_error(self, peer: PeerId) -> OpError {
        match self {
            HandshakeError::NoChallenge(_) | HandshakeError::NoProof(_) => {
                OpError::PeerUnreachable {
                    peer,
                    reason: self.to_string(),
                }
            }
            refusal => OpError::transport(refusal),
        }
    }
}

/// Why a connection's socket is gone.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnError {
    /// `read` returned end of stream.
    #[error("the peer closed the connection")]
    PeerClosed,
    /// `read` failed.
    #[error("read failed")]
    Read(#[source] std::io::Error),
    /// `write` took no byte.
    #[error("the peer stopped reading")]
    StoppedReading,
    /// `write` failed.
    #[error("write failed")]
    Write(#[source] std::io::Error),
}

/// A frame the peer should not have sent, or sent malformed: the connection is closed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProtocolError {
    /// Bytes that are not a frame header (or announce too long a payload).
    #[error(transparent)]
    Frame(WireError),
    /// A payload that is not whole records of its operation.
    #[error(transparent)]
    Payload(WireError),
    /// A frame for the target's side arrived on a connection that is not (or no longer)
    /// one the peer opened.
    #[error("not a target connection")]
    NotTarget,
    /// A frame other than HELLO first.
    #[error("{0:?} before HELLO")]
    BeforeHello(Op),
    /// A HELLO on a connection past its HELLO.
    #[error("second HELLO")]
    SecondHello,
    /// The handshake was refused.
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    /// A HELLO whose payload is not an address.
    #[error(transparent)]
    HelloAddress(fabric_core::Error),
    /// A HELLO from a process of another host (its boot id is not ours).
    #[error(transparent)]
    OtherHost(fabric_core::Error),
    /// More reservations granted and not yet DONE than the connection may hold.
    #[error("too many reservations outstanding")]
    TooManyReservations,
    /// A reservation under a batch number already granted.
    #[error("batch {0} reserved twice")]
    ReservedTwice(u64),
    /// A reservation that is neither for writes nor for reads.
    #[error("reservation of unknown kind {0}")]
    ReservationKind(u64),
    /// A DONE for a batch that was not granted (or is done already).
    #[error("DONE for unknown batch {0}")]
    UnknownDone(u64),
    /// A DONE that reports more writes than its batch was granted.
    #[error("DONE reports {reported} writes for a batch of {granted} granted")]
    DoneOverrun {
        /// Writes the DONE reports.
        reported: usize,
        /// Writes the batch was granted.
        granted: usize,
    },
    /// A frame only an initiator sends arrived at the target's side.
    #[error("{0:?} frame sent to a target")]
    NotForTarget(Op),
    /// An answer for a peer that was removed.
    #[error("answer for a removed peer")]
    RemovedPeer,
    /// An acknowledgement of no SEND in flight.
    #[error("acknowledgement of unknown SEND {0}")]
    UnknownSend(u64),
    /// A KeyInfo frame that does not carry exactly one record.
    #[error("KeyInfo with {0} records (one expected)")]
    KeyInfoRecords(usize),
    /// A grant for no reservation in flight.
    #[error("grant for unknown batch {0}")]
    UnknownGrant(u64),
    /// A grant whose verdicts do not match its reservation's writes one to one.
    #[error("grant with {verdicts} verdicts for {writes} writes")]
    GrantCount {
        /// Verdicts the grant carries.
        verdicts: usize,
        /// Writes (or reads) the reservation asked for.
        writes: usize,
    },
    /// A frame only a target sends arrived at the initiator's side.
    #[error("{0:?} frame sent to an initiator")]
    NotForInitiator(Op),
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_core::error::report;

    /// What a peer's failed operations give as their reason: the same words as when these
    /// were strings, the OS error after the call that failed.
    #[test]
    fn reasons_read_as_sentences_with_their_cause() {
        let os = || std::io::Error::from_raw_os_error(libc::EPIPE);
        assert_eq!(
            report(&ConnError::Write(os())),
            format!("write failed: {}", os())
        );
        assert_eq!(
            report(&ConnError::Read(os())),
            format!("read failed: {}", os())
        );
        assert_eq!(
            report(&ConnError::PeerClosed),
            "the peer closed the connection"
        );
        assert_eq!(
            report(&ProtocolError::Handshake(HandshakeError::Version(9))),
            format!(
                "the peer speaks CUDA IPC protocol version 9, this side {} (run the same xfer release on both sides)",
                crate::wire::VERSION
            )
        );
        assert_eq!(
            report(&HandshakeError::Malformed(WireError::BadPayload {
                op: Op::Challenge,
                len: 3
            })),
            "malformed handshake frame: Challenge frame with a malformed 3-byte payload"
        );
        assert_eq!(
            report(&ProtocolError::BeforeHello(Op::Reserve)),
            "Reserve before HELLO"
        );
        let bad = WireError::BadPayload {
            op: Op::Done,
            len: 5,
        };
        assert_eq!(
            report(&ProtocolError::Payload(bad)),
            "Done frame with a malformed 5-byte payload"
        );
        assert_eq!(
            report(&ProtocolError::KeyInfoRecords(0)),
            "KeyInfo with 0 records (one expected)"
        );
    }

    /// A refusal fails operations with itself (not retryable); a time-out with an
    /// unreachable peer (retryable).
    #[test]
    fn refusals_are_typed_and_final_time_outs_retryable() {
        let peer = PeerId(3);
        let e = HandshakeError::RefusedByTarget.op_error(peer);
        let OpError::Transport(t) = &e else {
            panic!("{e:?}")
        };
        assert_eq!(
            t.downcast_ref::<HandshakeError>(),
            Some(&HandshakeError::RefusedByTarget)
        );
        assert!(!e.is_retryable());
        let e = HandshakeError::NoChallenge(Duration::from_secs(1)).op_error(peer);
        assert!(
            matches!(&e, OpError::PeerUnreachable { reason, .. } if reason.contains("no CHALLENGE")),
            "{e:?}"
        );
        assert!(e.is_retryable());
        assert!(HandshakeError::PeerHasNoToken.is_authentication());
        assert!(!HandshakeError::Version(2).is_authentication());
    }
}
