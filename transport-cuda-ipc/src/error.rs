//! Why a control connection is closed: its socket failed or the peer closed it
//! ([`ConnError`]), or the peer broke the protocol ([`ProtocolError`]). Neither leaves the
//! crate as such: the pending operations of the connection's peer fail with
//! [`OpError::PeerUnreachable`](fabric_core::OpError::PeerUnreachable), whose reason is the
//! error with its sources ([`fabric_core::error::report`]).

use crate::wire::{Op, WireError};

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
    /// A HELLO of a protocol version this side does not speak.
    #[error("protocol version {0} (we speak {ours})", ours = crate::wire::VERSION)]
    Version(u64),
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
            report(&ProtocolError::Version(9)),
            format!("protocol version 9 (we speak {})", crate::wire::VERSION)
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
}
