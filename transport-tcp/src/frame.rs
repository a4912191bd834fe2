//! The wire format: a fixed 40-byte little-endian header, then `len` payload bytes for
//! WRITE, SEND and READ_REPLY (and HELLO); a READ carries none, nor does a CHALLENGE.
//!
//! ```text
//! 0      1       2      3      4        8        16      24       32      40
//! | op   | flags | code | rsvd | imm u32 | wr u64 | key u64| off u64 | len u64|
//! ```
//! Handshake (protocol version 5): the target speaks first, and each side proves the
//! shared token to the other. On every connection it accepts the target sends a
//! `CHALLENGE` whose `key` and `offset` carry a fresh random nonce (16 bytes, see
//! [`Header::key_offset_bytes`]), whose `code` is its protocol version, whose `imm` is
//! its authentication mode ([`AUTH_NONE`], or [`AUTH_TOKEN`] when it has a token), and
//! whose `wr_id` is the incarnation it announces (its agent's instance,
//! [`TcpConfig::announce`](crate::TcpConfig::announce); 0: none, as older builds send). The
//! initiator sends nothing before the CHALLENGE; then its HELLO, whose `imm` is its own
//! mode, whose `key` and `offset` carry the left 16 bytes of
//! [`auth::tag`](crate::auth::tag)`(token, `[`HELLO_CONTEXT`]`, nonce)` (zeros without a
//! token, or when the modes differ), and whose payload begins with a fresh nonce of its
//! own ([`HELLO_NONCE_LEN`] bytes). A target checks the modes and the tag (in constant
//! time, [`auth::verify`](crate::auth::verify)) before it reads anything else the peer
//! sends, and closes the connection if they differ or the tag is wrong; then its `PROOF`
//! (no payload) carries the left 16 bytes of `auth::tag(token, `[`PROOF_CONTEXT`]`,
//! initiator's nonce)`, zeros without a token. The initiator sends nothing after its HELLO
//! until the PROOF has come and, with a token, proves it: a peer that cannot prove the
//! token never gets a request, a payload or an answer. Modes that differ are refused on
//! both sides, each saying which side lacks the token (the initiator still sends its HELLO,
//! untagged, so that the target can say so too). A target that refuses a HELLO of version 5
//! says so with a NACK of code [`code::AUTH`] in place of the PROOF, then closes. Nonces are new for every connection, so a
//! HELLO or a PROOF recorded on one is refused on any other. A connection that gets no
//! CHALLENGE or PROOF (initiator) or no HELLO (target) within `peer_timeout` is closed.
//!
//! A target without a token still serves the HELLOs of version 4 (CHALLENGE, no PROOF), 2
//! and 0 (no nonce of the initiator's, no PROOF, any tag); one with a token refuses them:
//! such a peer cannot check who it talks to.
//!
//! A `BATCH` header announces `len` WRITE headers that follow back to back, then their
//! payloads in order: the target learns every destination before the bytes arrive and reads
//! them straight into place with one `readv`.
//!
//! Responses are cumulative: the target handles a connection's requests in order, so an
//! `ACK` with `len = n` completes the next `n` outstanding requests, and a `NACK` fails the
//! next one with `code`.
//!
//! READ (protocol version 3): a `READ` header asks for `len` bytes of the region `key` at
//! `offset`. The owner checks key, bounds and REMOTE_READ before any byte leaves, and
//! answers in request order, like any request: a `READ_REPLY` whose `len` payload bytes
//! are sent straight from the registered region (and placed straight into the initiator's),
//! or a `NACK`. An `ACK` never answers a READ, and a READ_REPLY answers nothing else.
//! READs and READ_REPLYs travel in batches like WRITEs: a batch's headers may be WRITEs,
//! READs (no payload: served in their turn) and READ_REPLYs, its payloads those of its
//! WRITEs and READ_REPLYs in order.
//!
//! Checksums (opt-in, [`TcpConfig::checksum`](crate::TcpConfig::checksum)): a WRITE with
//! [`FLAG_CRC`] is followed, after its payload, by the CRC32C of its encoded header and its
//! payload (4 bytes, little endian); in a batch each such payload is followed by its own.
//! The target gathers the payload, checks the sum, and only then places it, or NACKs it
//! with [`code::CHECKSUM`]. A target without checksums refuses the flag as unknown.
//!
//! SEND flow control (protocol version [`PROTOCOL_VERSION`], which a HELLO carries in
//! `code`): an `ACK` with `code` = [`ACK_CREDIT`] also grants SEND credit, `key` more
//! messages and `offset` more bytes, and says in `wr_id` the receiver's credit window in
//! bytes. A HELLO with `code` 0 comes from a peer that knows nothing of credit.

use crate::auth::Nonce;
pub use crate::error::FrameError;
use fabric_core::{OpError, RemoteKey};

/// Header size in bytes.
pub const HEADER_LEN: usize = 40;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// The initiator's first frame, the answer to the CHALLENGE: payload = rail (u32 LE) +
    /// instance (u64 LE) + the sender's address; `code` = the protocol version, `key` and
    /// `offset` = the tag of the CHALLENGE's nonce (see the module documentation).
    Hello = 1,
    /// One-sided write into a registered region.
    Write = 2,
    /// Message for a posted receive.
    Send = 3,
    /// `len` requests succeeded.
    Ack = 4,
    /// The next request failed with `code`.
    Nack = 5,
    /// `len` WRITE (READ, READ_REPLY) headers follow back to back, then their payloads in
    /// the same order, so that the target can place all payloads with one vectored read.
    Batch = 6,
    /// One-sided read of `len` bytes of region `key` at `offset` (no payload).
    Read = 7,
    /// The answer to the next outstanding request, a READ: its `len` bytes follow.
    ReadReply = 8,
    /// The target's first frame (no payload): `key` and `offset` = a fresh nonce that the
    /// HELLO's tag must cover, `code` = the target's protocol version, `imm` = its
    /// authentication mode.
    Challenge = 9,
    /// The target's answer to a HELLO of version 5 (no payload): `key` and `offset` = the tag
    /// of the initiator's nonce (see the module documentation).
    Proof = 10,
}

impl std::fmt::Display for Op {
    /// The frame's name as the protocol documents write it (`WRITE`, `ACK`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Op::Hello => "HELLO",
            Op::Write => "WRITE",
            Op::Send => "SEND",
            Op::Ack => "ACK",
            Op::Nack => "NACK",
            Op::Batch => "BATCH",
            Op::Read => "READ",
            Op::ReadReply => "READ_REPLY",
            Op::Challenge => "CHALLENGE",
            Op::Proof => "PROOF",
        })
    }
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Hello,
            2 => Op::Write,
            3 => Op::Send,
            4 => Op::Ack,
            5 => Op::Nack,
            6 => Op::Batch,
            7 => Op::Read,
            8 => Op::ReadReply,
            9 => Op::Challenge,
            10 => Op::Proof,
            _ => return None,
        })
    }
}

/// The protocol version of this code, in a HELLO's `code` and a CHALLENGE's: 5 adds the
/// PROOF and the authentication modes (4 added the CHALLENGE, 3 READ). A target without a
/// token also serves HELLOs that claim version 4 (no PROOF), 2 (SEND credit, no READ: such
/// a peer never sends one, and is never sent one) or 0 (before SEND credit); one with a
/// token refuses every version but this one
/// ([`TcpError::HelloNotMutual`](crate::TcpError::HelloNotMutual)), and every other
/// version is refused with [`TcpError::HelloVersion`](crate::TcpError::HelloVersion). An
/// initiator without a token answers a target of version 4 as one of version 4 did; one
/// with a token refuses it
/// ([`TcpError::ChallengeNotMutual`](crate::TcpError::ChallengeNotMutual)). A build before
/// 4 reads no CHALLENGE and sends no tag: it cannot connect to this one, nor this one to it
/// ([`TcpError::NoChallenge`](crate::TcpError::NoChallenge)).
pub const PROTOCOL_VERSION: u8 = 5;

/// The first protocol version in which the target proves the token too (the PROOF).
pub const MUTUAL_VERSION: u8 = 5;

/// The version that added the CHALLENGE, still served by targets without a token.
pub const CHALLENGE_VERSION: u8 = 4;

/// The first protocol version with READ.
pub const READ_VERSION: u8 = 3;

/// The version of SEND credit without READ, still served.
pub const CREDIT_VERSION: u8 = 2;

/// The context of a HELLO's tag ([`auth::tag`](crate::auth::tag)): this protocol, its
/// version and the direction, so that the tag proves nothing anywhere else.
pub const HELLO_CONTEXT: &str = "xfer-tcp/5 HELLO: initiator to target";

/// The context of a PROOF's tag: the other direction's.
pub const PROOF_CONTEXT: &str = "xfer-tcp/5 PROOF: target to initiator";

/// Bytes of the tag a HELLO or a PROOF carries (in `key` and `offset`): the left half of
/// the HMAC-SHA256, 128 bits.
pub const HELLO_TAG_LEN: usize = 16;

/// Bytes of the initiator's nonce at the start of a HELLO's payload (version 5).
pub const HELLO_NONCE_LEN: usize = crate::auth::NONCE_LEN;

/// The authentication mode (a CHALLENGE's or a HELLO's `imm`) of a side without a token.
pub const AUTH_NONE: u32 = 0;

/// The authentication mode of a side with a token: it proves it, and asks for proof.
pub const AUTH_TOKEN: u32 = 1;

/// The shortest HELLO payload of protocol `version`: rail (u32) and instance (u64), after
/// the initiator's nonce from version 5 on.
pub fn hello_min_len(version: u8) -> u64 {
    if version >= MUTUAL_VERSION {
        (HELLO_NONCE_LEN + 12) as u64
    } else {
        12
    }
}

/// The `code` of an ACK that also grants SEND credit (see the module documentation).
pub const ACK_CREDIT: u8 = 1;

/// The header carries immediate data.
pub const FLAG_IMM: u8 = 1;

/// A WRITE whose payload is followed by [`CHECKSUM_LEN`] bytes: the CRC32C (little
/// endian) of the header's 40 encoded bytes (this flag set) and the payload. The target
/// checks it before any byte is placed and answers a mismatch with a NACK
/// ([`code::CHECKSUM`]). Only WRITEs carry it, of at most [`CHECKSUM_MAX_LEN`] bytes.
pub const FLAG_CRC: u8 = 2;

/// Bytes of the checksum that follows a [`FLAG_CRC`] payload.
pub const CHECKSUM_LEN: u64 = 4;

/// Longest payload of a checksummed WRITE: the target holds it whole until the checksum
/// says it may be placed.
pub const CHECKSUM_MAX_LEN: u64 = 4 << 20;

/// Most WRITEs in one batch.
pub const MAX_BATCH: usize = 256;

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub op: Op,
    /// Flags (`FLAG_IMM`).
    pub flags: u8,
    /// Error code of a NACK, [`ACK_CREDIT`] on an ACK that grants credit, protocol version
    /// of a HELLO, a CHALLENGE or a PROOF.
    pub code: u8,
    /// Immediate data, or the sender's authentication mode (CHALLENGE, HELLO).
    pub imm: u32,
    /// The initiator's work-request id (diagnostics only).
    pub wr_id: u64,
    /// Remote key (WRITE, READ), detail (NACK), messages of SEND credit (ACK), or the first
    /// half of a nonce (CHALLENGE) or tag (HELLO, PROOF).
    pub key: u64,
    /// Remote offset (WRITE, READ), detail (NACK), bytes of SEND credit (ACK), or the second
    /// half of a nonce (CHALLENGE) or tag (HELLO, PROOF).
    pub offset: u64,
    /// Payload length (WRITE, SEND, HELLO, READ_REPLY), bytes asked for (READ), count
    /// (ACK), or detail (NACK).
    pub len: u64,
}

impl Header {
    /// A header with only `op` and `len` set.
    pub fn new(op: Op, len: u64) -> Header {
        Header {
            op,
            flags: 0,
            code: 0,
            imm: 0,
            wr_id: 0,
            key: 0,
            offset: 0,
            len,
        }
    }

    /// A CHALLENGE carrying `nonce`, of this protocol version, from a side of
    /// authentication mode `mode` ([`AUTH_NONE`], [`AUTH_TOKEN`]).
    pub fn challenge(nonce: &Nonce, mode: u32) -> Header {
        let mut h = Header::new(Op::Challenge, 0);
        h.code = PROTOCOL_VERSION;
        h.imm = mode;
        h.set_key_offset_bytes(nonce.as_bytes());
        h
    }

    /// A PROOF carrying `tag` (zeros from a target without a token).
    pub fn proof(tag: &[u8; HELLO_TAG_LEN]) -> Header {
        let mut h = Header::new(Op::Proof, 0);
        h.code = PROTOCOL_VERSION;
        h.set_key_offset_bytes(tag);
        h
    }

    /// `key` then `offset` as they travel (16 bytes, each little endian): a CHALLENGE's
    /// nonce, a HELLO's tag.
    pub fn key_offset_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.key.to_le_bytes());
        b[8..].copy_from_slice(&self.offset.to_le_bytes());
        b
    }

    /// Sets `key` and `offset` to carry `b` (see [`key_offset_bytes`](Self::key_offset_bytes)).
    pub fn set_key_offset_bytes(&mut self, b: &[u8; 16]) {
        let (key, offset) = b.split_at(8);
        self.key = u64::from_le_bytes(key.try_into().expect("8 bytes"));
        self.offset = u64::from_le_bytes(offset.try_into().expect("8 bytes"));
    }

    /// Immediate data, if flagged.
    pub fn imm(&self) -> Option<u32> {
        (self.flags & FLAG_IMM != 0).then_some(self.imm)
    }

    /// Encodes into 40 bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.op as u8;
        b[1] = self.flags;
        b[2] = self.code;
        b[4..8].copy_from_slice(&self.imm.to_le_bytes());
        b[8..16].copy_from_slice(&self.wr_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.key.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Rewrites the `len` field of an encoded header in place (a BATCH's count, an ACK's).
    pub(crate) fn set_len(encoded: &mut [u8], len: u64) {
        encoded[32..40].copy_from_slice(&len.to_le_bytes());
    }

    /// The `len` field of an encoded header.
    pub(crate) fn len_of(encoded: &[u8]) -> u64 {
        u64::from_le_bytes(encoded[32..40].try_into().expect("8 bytes"))
    }

    /// Decodes 40 bytes; `Err` names what is malformed.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
        let op = Op::from_u8(b[0]).ok_or(FrameError::UnknownOp(b[0]))?;
        if b[1] & !(FLAG_IMM | FLAG_CRC) != 0 {
            return Err(FrameError::UnknownFlags(b[1]));
        }
        if b[3] != 0 {
            return Err(FrameError::Reserved(b[3]));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(Header {
            op,
            flags: b[1],
            code: b[2],
            imm: u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")),
            wr_id: u64_at(8),
            key: u64_at(16),
            offset: u64_at(24),
            len: u64_at(32),
        })
    }
}

/// NACK codes.
pub mod code {
    /// Unknown or stale remote key (`key` = the key).
    pub const KEY: u8 = 1;
    /// Out of bounds (`offset`, `len` as requested; `key` = region length).
    pub const BOUNDS: u8 = 2;
    /// Region lacks the access the request needs (REMOTE_WRITE, REMOTE_READ).
    pub const PERMISSION: u8 = 3;
    /// Message longer than the receive buffer (`len`, `offset` = capacity).
    pub const TRUNCATED: u8 = 4;
    /// The target could not place the bytes (device copy failed).
    pub const INTERNAL: u8 = 5;
    /// The payload's checksum did not match: nothing was placed.
    pub const CHECKSUM: u8 = 6;
    /// Before the PROOF, in answer to a HELLO of version 5: the target refused it (a tag
    /// that does not prove its token, or modes that differ), and closes the connection.
    pub const AUTH: u8 = 7;
}

/// The NACK header that reports `err` for request `wr_id`.
pub fn nack_for(err: &OpError, wr_id: u64) -> Header {
    let mut h = Header::new(Op::Nack, 0);
    h.wr_id = wr_id;
    match *err {
        OpError::RemoteKeyInvalid(k) => {
            h.code = code::KEY;
            h.key = k.0;
        }
        OpError::OutOfBounds {
            offset,
            len,
            region_len,
        } => {
            h.code = code::BOUNDS;
            h.offset = offset;
            h.len = len;
            h.key = region_len;
        }
        OpError::PermissionDenied => h.code = code::PERMISSION,
        OpError::Truncated { len, capacity } => {
            h.code = code::TRUNCATED;
            h.len = len;
            h.offset = capacity;
        }
        OpError::ChecksumMismatch => h.code = code::CHECKSUM,
        _ => h.code = code::INTERNAL,
    }
    h
}

/// The error a received NACK stands for.
pub fn error_of_nack(h: &Header) -> OpError {
    match h.code {
        code::KEY => OpError::RemoteKeyInvalid(RemoteKey(h.key)),
        code::BOUNDS => OpError::OutOfBounds {
            offset: h.offset,
            len: h.len,
            region_len: h.key,
        },
        code::PERMISSION => OpError::PermissionDenied,
        code::TRUNCATED => OpError::Truncated {
            len: h.len,
            capacity: h.offset,
        },
        code::CHECKSUM => OpError::ChecksumMismatch,
        c => OpError::Remote(format!("target failed to place the data (code {c})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn len_is_rewritten_in_place() {
        let mut h = Header::new(Op::Batch, 3);
        h.wr_id = 9;
        h.key = 11;
        let mut b = h.encode();
        assert_eq!(Header::len_of(&b), 3);
        Header::set_len(&mut b, 1 << 33);
        assert_eq!(Header::len_of(&b), 1 << 33);
        h.len = 1 << 33;
        // Only the length changed.
        assert_eq!(Header::decode(&b), Ok(h));
    }

    #[test]
    fn header_round_trip() {
        let mut h = Header::new(Op::Write, 65536);
        h.flags = FLAG_IMM;
        h.imm = 0xDEAD_BEEF;
        h.wr_id = 7;
        h.key = u64::MAX;
        h.offset = 1 << 40;
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        assert_eq!(h.imm(), Some(0xDEAD_BEEF));
    }

    #[test]
    fn malformed_headers_are_rejected() {
        let mut b = Header::new(Op::Ack, 1).encode();
        b[0] = 99;
        assert_eq!(Header::decode(&b), Err(FrameError::UnknownOp(99)));
        let mut b = Header::new(Op::Ack, 1).encode();
        b[1] = 0x80;
        assert_eq!(Header::decode(&b), Err(FrameError::UnknownFlags(0x80)));
        let mut b = Header::new(Op::Ack, 1).encode();
        b[3] = 1;
        assert_eq!(Header::decode(&b), Err(FrameError::Reserved(1)));
    }

    #[test]
    fn read_frames_round_trip() {
        let mut h = Header::new(Op::Read, 4096);
        h.key = 0x1234_5678_9ABC_DEF0;
        h.offset = 1 << 33;
        h.wr_id = 9;
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        let r = Header::new(Op::ReadReply, 4096);
        assert_eq!(Header::decode(&r.encode()), Ok(r));
        assert_eq!(Op::Read.to_string(), "READ");
        assert_eq!(Op::ReadReply.to_string(), "READ_REPLY");
    }

    #[test]
    fn challenge_frames_round_trip_their_nonce() {
        let n = Nonce::from_bytes(std::array::from_fn(|i| i as u8 + 1));
        let h = Header::challenge(&n, AUTH_TOKEN);
        assert_eq!(
            (h.op, h.code, h.len, h.flags, h.imm),
            (Op::Challenge, PROTOCOL_VERSION, 0, 0, AUTH_TOKEN)
        );
        let d = Header::decode(&h.encode()).unwrap();
        assert_eq!(d, h);
        assert_eq!(Nonce::from_bytes(d.key_offset_bytes()), n);
        // On the wire, the nonce's bytes are the header's bytes 16..32, in order.
        assert_eq!(&h.encode()[16..32], n.as_bytes());
        assert_eq!(Op::Challenge.to_string(), "CHALLENGE");
    }

    #[test]
    fn proof_frames_round_trip_their_tag() {
        let tag: [u8; HELLO_TAG_LEN] = std::array::from_fn(|i| 0xA0 + i as u8);
        let h = Header::proof(&tag);
        assert_eq!(
            (h.op, h.code, h.len, h.flags, h.imm),
            (Op::Proof, PROTOCOL_VERSION, 0, 0, 0)
        );
        let d = Header::decode(&h.encode()).unwrap();
        assert_eq!(d, h);
        assert_eq!(d.key_offset_bytes(), tag);
        assert_eq!(Op::Proof.to_string(), "PROOF");
        assert_eq!(hello_min_len(MUTUAL_VERSION), 28);
        assert_eq!(hello_min_len(CHALLENGE_VERSION), 12);
        assert_ne!(HELLO_CONTEXT, PROOF_CONTEXT);
    }

    #[test]
    fn nack_round_trip() {
        for e in [
            OpError::RemoteKeyInvalid(RemoteKey(5)),
            OpError::OutOfBounds {
                offset: 1,
                len: 2,
                region_len: 3,
            },
            OpError::PermissionDenied,
            OpError::Truncated {
                len: 10,
                capacity: 5,
            },
            OpError::ChecksumMismatch,
        ] {
            assert_eq!(error_of_nack(&nack_for(&e, 1)), e);
        }
    }
}
