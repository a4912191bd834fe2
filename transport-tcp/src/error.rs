//! The crate's error type: why a connection was closed (a malformed or unexpected frame, a
//! HELLO problem, the peer gone, a socket call failing), why a device copy through staging
//! failed, or why a SEND was given up; and why a congestion control's name was refused
//! ([`CongestionError`]).
//!
//! Errors that end a connection reach callers as [`OpError::PeerUnreachable`]
//! (fabric_core::OpError) with the error's whole chain as the reason (see [`report`]).

use crate::frame::Op;
use fabric_core::MemoryError;
use std::time::Duration;

/// Why a connection, a frame, a copy or a SEND failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TcpError {
    /// A header that does not decode.
    #[error("malformed frame")]
    MalformedFrame(#[source] FrameError),
    /// A header inside a BATCH that does not decode.
    #[error("malformed batch entry")]
    MalformedBatchEntry(#[source] FrameError),
    /// An accepted connection sent something other than HELLO first.
    #[error("{op} frame before HELLO")]
    BeforeHello {
        /// What it sent.
        op: Op,
    },
    /// A HELLO on a connection that is past its HELLO (or one we opened).
    #[error("unexpected HELLO")]
    UnexpectedHello,
    /// A HELLO payload shorter than its fixed part or longer than the limit.
    #[error("HELLO of {0} bytes (12, or 28 from protocol version 5 on, to 4096 expected)")]
    HelloLength(u64),
    /// A HELLO that names a protocol version we do not speak.
    #[error(
        "HELLO of protocol version {0}, which this side does not speak (it speaks {ours}, and serves 0 and {credit} after its CHALLENGE)",
        ours = crate::frame::PROTOCOL_VERSION,
        credit = crate::frame::CREDIT_VERSION
    )]
    HelloVersion(u8),
    /// A HELLO of a version before the PROOF, to a side with a token: such a peer cannot
    /// check who it talks to.
    #[error(
        "HELLO of protocol version {0}, whose sender cannot check this side's token: with a token, this side takes version {mutual} only",
        mutual = crate::frame::MUTUAL_VERSION
    )]
    HelloNotMutual(u8),
    /// A CHALLENGE of a version before the PROOF, to an initiator with a token: that target
    /// cannot prove the token.
    #[error(
        "the target speaks protocol version {0}, which cannot prove the token: with a token, this side needs version {mutual}",
        mutual = crate::frame::MUTUAL_VERSION
    )]
    ChallengeNotMutual(u8),
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
    /// A CHALLENGE or HELLO naming an authentication mode this side does not know.
    #[error("unknown authentication mode {0}")]
    UnknownAuthMode(u32),
    /// A HELLO whose tag is not the token's for our CHALLENGE's nonce: no token, a wrong
    /// one, or a HELLO recorded on another connection.
    #[error(
        "authentication failed: the HELLO does not prove the token for this connection's challenge"
    )]
    AuthenticationFailed,
    /// A PROOF whose tag is not the token's for the nonce of our HELLO: the target has
    /// another token, or is not the target we meant (one that relays or replays).
    #[error(
        "authentication failed: the target's PROOF does not prove the token for this connection's nonce"
    )]
    ProofFailed,
    /// The target refused our HELLO (a NACK of code [`AUTH`](crate::frame::code::AUTH)):
    /// its token is not ours.
    #[error(
        "authentication refused by the target: our HELLO does not prove its token (the tokens differ)"
    )]
    RefusedByTarget,
    /// A connection we opened got no PROOF in time after its HELLO.
    #[error("no PROOF within {0:?} of connecting")]
    NoProof(Duration),
    /// A connection we opened got something other than a PROOF after its HELLO.
    #[error("{op} frame before PROOF")]
    BeforeProof {
        /// What the target sent.
        op: Op,
    },
    /// A PROOF on a connection that waits for none.
    #[error("unexpected PROOF")]
    UnexpectedProof,
    /// A PROOF that announces a payload (it carries none).
    #[error("PROOF announcing {0} payload bytes (none expected)")]
    ProofLength(u64),
    /// The system's random source gave no nonce for our HELLO.
    #[error("no nonce for the HELLO")]
    Random(#[source] AuthError),
    /// An accepted connection sent no HELLO in time.
    #[error("no HELLO within {0:?}")]
    NoHello(Duration),
    /// A connection we opened got no CHALLENGE in time.
    #[error(
        "no CHALLENGE within {0:?} (a target of protocol version 3 or older sends none: it waits for a HELLO)"
    )]
    NoChallenge(Duration),
    /// A connection we opened got something other than a CHALLENGE first.
    #[error("{op} frame before CHALLENGE")]
    BeforeChallenge {
        /// What the target sent.
        op: Op,
    },
    /// A CHALLENGE on a connection past its handshake (or on one we accepted).
    #[error("unexpected CHALLENGE")]
    UnexpectedChallenge,
    /// A CHALLENGE that announces a payload (it carries none).
    #[error("CHALLENGE announcing {0} payload bytes (none expected)")]
    ChallengeLength(u64),
    /// A BATCH of no WRITE, or of more than [`MAX_BATCH`](crate::frame::MAX_BATCH).
    #[error("batch of {0} writes (at most {max})", max = crate::frame::MAX_BATCH)]
    BatchSize(u64),
    /// A frame other than WRITE, READ or READ_REPLY among a batch's headers.
    #[error("{op} frame inside a batch")]
    NotAWrite {
        /// What the entry was.
        op: Op,
    },
    /// A WRITE, SEND or READ longer than the largest message.
    #[error("{op} of {len} bytes exceeds the {limit}-byte limit")]
    TooLong {
        /// WRITE, SEND or READ.
        op: Op,
        /// Its length.
        len: u64,
        /// The largest message.
        limit: u64,
    },
    /// An ACK for more requests than are outstanding.
    #[error("ACK for {acked} requests, {outstanding} outstanding")]
    AckOverrun {
        /// Requests the ACK answers.
        acked: u64,
        /// Requests outstanding.
        outstanding: usize,
    },
    /// A NACK with no request outstanding.
    #[error("NACK with no request outstanding")]
    NackOverrun,
    /// A READ_REPLY when the next outstanding request is not a READ (or none is).
    #[error("READ_REPLY when the next outstanding request is not a READ")]
    UnexpectedReadReply,
    /// A READ_REPLY whose length is not the length its READ asked for.
    #[error("READ_REPLY of {got} bytes for a READ of {asked}")]
    ReadReplyLength {
        /// Bytes the reply carries.
        got: u64,
        /// Bytes the READ asked for.
        asked: u64,
    },
    /// An ACK that would answer a READ (only a READ_REPLY or a NACK does).
    #[error("ACK that answers a READ")]
    AckForRead,
    /// A READ, READ_REPLY, CHALLENGE or PROOF with flags set (they carry no immediate data).
    #[error("{op} frame with flags {flags:#x}")]
    UnexpectedFlags {
        /// The frame.
        op: Op,
        /// Its flags.
        flags: u8,
    },
    /// A SEND beyond the credit we granted (see [`frame`](crate::frame) on SEND credit).
    #[error("SEND of {len} bytes beyond its credit ({messages} message(s), {bytes} bytes granted)")]
    SendBeyondCredit {
        /// Its length.
        len: u64,
        /// Messages the peer still held.
        messages: u64,
        /// Bytes the peer still held.
        bytes: u64,
    },
    /// The peer closed the connection (end of stream).
    #[error("peer closed the connection")]
    PeerClosed,
    /// The peer closed a connection we had stopped reading.
    #[error("peer closed the connection while it was held back")]
    PeerClosedWhileHeld,
    /// The socket took no byte: the connection is gone.
    #[error("connection closed while writing")]
    ClosedWhileWriting,
    /// A socket call failed.
    #[error("{call} failed")]
    Io {
        /// The call (`read`, `write`).
        call: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The connection could not be made.
    #[error("connect failed")]
    Connect(#[source] std::io::Error),
    /// The connection was not made in time.
    #[error("connect timed out after {0:?}")]
    ConnectTimedOut(Duration),
    /// Requests outstanding with no answer while the peer's kernel took all our bytes.
    #[error("{count} request(s) unanswered for {limit:?}")]
    Unanswered {
        /// Requests outstanding.
        count: usize,
        /// How long nothing moved.
        limit: Duration,
    },
    /// A SEND waited too long for credit: the peer posts no receives and its early-arrival
    /// queue stays full.
    #[error(
        "SEND of {len} bytes waited {waited:?} for credit: the peer posts no receive and its early-arrival queue is full"
    )]
    NoSendCredit {
        /// Its length.
        len: u64,
        /// How long it waited.
        waited: Duration,
    },
    /// A checksummed WRITE's bytes were not its payload and checksum (a bug).
    #[error("a checksummed WRITE of {len} bytes came with {got} bytes")]
    ChecksumMissing {
        /// Bytes gathered.
        got: u64,
        /// The payload's length.
        len: u64,
    },
    /// Bytes received could not be placed in host memory.
    #[error("cannot place payload")]
    PlacePayload(#[source] MemoryError),
    /// Device bytes reached the host-memory path (a bug: they go through staging).
    #[error("device bytes must go through staging")]
    DeviceBytesNotStaged,
    /// A copy out of device memory into staging could not be queued.
    #[error("cannot copy device memory out")]
    CopyOut(#[source] CopyCause),
    /// A copy from staging into device memory could not be queued.
    #[error("cannot place payload in device memory")]
    CopyIn(#[source] CopyCause),
    /// The copies queued could not be marked (started).
    #[error("cannot start device copies")]
    StartCopies(#[source] CopyCause),
    /// A device copy failed after it was queued.
    #[error("device copy failed")]
    CopyFailed(#[source] CopyCause),
    /// Staging memory (pinned or host) could not be allocated.
    #[error("cannot allocate staging")]
    StagingAlloc(#[source] CopyCause),
    /// The device's copy engine could not be set up.
    #[error("cannot set up device copies")]
    CopySetup(#[source] CopyCause),
}

impl TcpError {
    /// Whether this is a refusal of the handshake's authentication (a token missing on one
    /// side, a wrong one, a tag that does not prove it, a peer too old to prove it): asking
    /// again will not pass, so a connection we opened fails with it as its cause
    /// ([`OpError::Transport`](fabric_core::OpError::Transport), not retryable) rather
    /// than as an unreachable peer.
    pub fn is_authentication(&self) -> bool {
        matches!(
            self,
            TcpError::AuthenticationFailed
                | TcpError::ProofFailed
                | TcpError::RefusedByTarget
                | TcpError::PeerHasNoToken
                | TcpError::NoTokenHere
                | TcpError::HelloNotMutual(_)
                | TcpError::ChallengeNotMutual(_)
                | TcpError::UnknownAuthMode(_)
        )
    }

    /// Shorthand for a failed socket call.
    pub(crate) fn io(call: &'static str, source: std::io::Error) -> TcpError {
        TcpError::Io { call, source }
    }
}

/// What is wrong with a header that does not decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The op byte names no frame kind.
    #[error("unknown frame op {0}")]
    UnknownOp(u8),
    /// Flags this side does not know.
    #[error("unknown flags {0:#x}")]
    UnknownFlags(u8),
    /// The reserved byte is not zero.
    #[error("reserved byte is {0}, not zero")]
    Reserved(u8),
}

// Why a nonce could not be made or parsed: `fabric_core::auth`'s (the source of
// `TcpError::Random`; public as `auth::AuthError`).
pub use fabric_core::auth::AuthError;

/// The error under a failed copy: the CUDA driver's, or the memory layer's.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CopyCause {
    /// From gpu-mem (the CUDA driver).
    #[error(transparent)]
    Cuda(#[from] gpu_mem::GpuMemError),
    /// From the region's own copy methods or a host allocation.
    #[error(transparent)]
    Memory(#[from] MemoryError),
}

/// Why [`Congestion::parse`](crate::Congestion::parse) refused a name. Only the form is
/// checked: whether the kernel has the algorithm, and lets this process use it, is learnt
/// when a socket is set up ([`Congestion::apply`](crate::Congestion::apply)).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CongestionError {
    /// No name at all.
    #[error("empty: give auto, system or an algorithm's name (cubic, reno, bbr)")]
    Empty,
    /// A name longer than the kernel's (`TCP_CA_NAME_MAX`, 16 bytes with the NUL).
    #[error("{name:?} is longer than Linux's 15-byte algorithm names")]
    TooLong {
        /// The name given.
        name: String,
    },
    /// A name with a byte other than an ASCII letter, digit or `_`.
    #[error("{name:?}: an algorithm's name is letters, digits and '_'")]
    BadCharacter {
        /// The name given.
        name: String,
    },
}

/// `e` and its sources, as one line ("read failed: Connection reset by peer").
pub fn report(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_walks_the_chain() {
        let e = TcpError::io("read", std::io::Error::other("reset"));
        assert_eq!(report(&e), "read failed: reset");
        let e = TcpError::MalformedFrame(FrameError::UnknownOp(99));
        assert_eq!(report(&e), "malformed frame: unknown frame op 99");
    }
}
