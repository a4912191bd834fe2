//! Frames on the control socket: a fixed 32-byte header and a payload. Pure encoding and
//! decoding, no I/O, so malformed input is tested (and fuzzed) without processes or GPUs.
//!
//! ```text
//! op u8 | flags u8 | reserved u16 | imm u32 | id u64 | x u64 | len u64 | payload (len bytes)
//! ```
//! All integers are little-endian. `flags & 1` says whether `imm` is set.
//!
//! **Handshake** (protocol version 3): the target speaks first, and each side proves the
//! shared token ([`CudaIpcConfig::auth_token`](crate::CudaIpcConfig::auth_token)) to the
//! other with [`fabric_core::auth`]'s challenge and response.
//!
//! 1. On every connection it accepts, the target sends a [`Op::Challenge`]: `x` = its
//!    protocol version, `id` = its authentication mode ([`AUTH_NONE`], or [`AUTH_TOKEN`]
//!    when it has a token), payload = a fresh random nonce ([`NONCE_LEN`] bytes).
//! 2. The initiator sends nothing before the CHALLENGE. Then its [`Op::Hello`]: `x` = its
//!    version, `id` = its mode, payload = a fresh nonce of its own, the tag
//!    `auth::tag(token, `[`HELLO_CONTEXT`]`, target's nonce)` ([`TAG_LEN`] bytes; zeros
//!    without a token, or when the modes differ), then its address ([`Hello`]).
//! 3. The target checks the version, the modes and (with a token) the tag, in constant
//!    time, before it reads anything else the peer sends; then answers with a
//!    [`Op::Proof`] whose payload is `auth::tag(token, `[`PROOF_CONTEXT`]`, initiator's
//!    nonce)` (zeros without a token). A tag that does not prove the token is answered with
//!    a [`Op::Refuse`] ([`REFUSE_AUTH`]) before the target closes.
//! 4. The initiator sends nothing after its HELLO (no reservation, no SEND) until the PROOF
//!    has come and, with a token, proved it for its nonce.
//!
//! Modes that differ (a token on one side only) are refused by both sides, each saying
//! which side lacks the token: the initiator still sends its HELLO, untagged, so that the
//! target can say so too. Nonces are fresh for every connection, so a HELLO or a PROOF
//! recorded on one proves nothing on another. Handshake frames are at most
//! [`HANDSHAKE_MAX_PAYLOAD`] bytes of payload; a peer of another version is refused (one
//! of version 2 or older sends its HELLO without waiting for a CHALLENGE, and reads none).

use fabric_core::auth::Nonce;
pub use fabric_core::auth::{NONCE_LEN, TAG_LEN};
use std::fmt;

/// Bytes of a frame header.
pub const HEADER_LEN: usize = 32;

/// What a frame asks or answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Initiator → target, the answer to the [`Op::Challenge`]: `x` = protocol version,
    /// `id` = authentication mode, payload = the initiator's nonce, its tag of the target's
    /// nonce and its address ([`Hello`]).
    Hello = 1,
    /// A message for a posted receive: `id` = the sender's work request, payload = bytes.
    Send = 2,
    /// Target → initiator: the SEND `id` was taken; `x` = [`Status`].
    SendAck = 3,
    /// Initiator → target: "I am about to write (or, `x` = [`RESERVE_READS`], read) these
    /// ranges": `id` = batch, payload = [`Reserve`] entries. The target checks key, bounds
    /// and permission (REMOTE_WRITE, or REMOTE_READ), and keeps the regions alive until
    /// [`Op::Done`].
    Reserve = 4,
    /// Target → initiator: the handle of a region, sent once per connection before the
    /// first grant that needs it: `x` = key, payload = [`KeyInfo`].
    KeyInfo = 5,
    /// Target → initiator: verdicts for batch `id`, one [`Grant`] entry per reserved range.
    Grant = 6,
    /// Initiator → target: the copies of batch `id` have finished; payload = one
    /// [`Landed`] per write that carried immediate data, in posting order.
    Done = 7,
    /// Target → initiator: region `x` was deregistered; drop its mapping.
    Revoke = 8,
    /// Target → initiator, first frame: `x` = protocol version, `id` = authentication mode,
    /// payload = a fresh nonce ([`Challenge`]).
    Challenge = 9,
    /// Target → initiator, the answer to a HELLO it let in: payload = its tag of the
    /// initiator's nonce ([`Proof`]).
    Proof = 10,
    /// Target → initiator, in place of the PROOF, before it closes: `x` = why
    /// ([`REFUSE_AUTH`]).
    Refuse = 11,
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Hello,
            2 => Op::Send,
            3 => Op::SendAck,
            4 => Op::Reserve,
            5 => Op::KeyInfo,
            6 => Op::Grant,
            7 => Op::Done,
            8 => Op::Revoke,
            9 => Op::Challenge,
            10 => Op::Proof,
            11 => Op::Refuse,
            _ => return None,
        })
    }
}

/// The target's verdict on a reserved range or a SEND.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    /// Granted (or delivered).
    Ok = 0,
    /// No region has this key (never registered, or deregistered).
    BadKey = 1,
    /// The range does not fit the region.
    OutOfBounds = 2,
    /// The region was not registered for remote writes.
    NoPermission = 3,
    /// The message was longer than the posted receive.
    Truncated = 4,
}

impl Status {
    /// Decodes a status; unknown values are `None`.
    pub fn from_u32(v: u32) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::BadKey,
            2 => Status::OutOfBounds,
            3 => Status::NoPermission,
            4 => Status::Truncated,
            _ => return None,
        })
    }
}

/// The version this code speaks (3: the CHALLENGE, the nonces and the PROOF; 2 added
/// reservations for READ). A peer of another version is refused: a target refuses its
/// HELLO, an initiator its CHALLENGE.
pub const VERSION: u64 = 3;

/// The context of a HELLO's tag ([`fabric_core::auth::tag`]): this protocol, its version
/// and the direction, so that the tag proves nothing anywhere else (not on tcp, whose
/// contexts differ, nor in the other direction).
pub const HELLO_CONTEXT: &str = "xfer-cuda-ipc/3 HELLO: initiator to target";

/// The context of a PROOF's tag: the other direction's.
pub const PROOF_CONTEXT: &str = "xfer-cuda-ipc/3 PROOF: target to initiator";

/// The authentication mode (a CHALLENGE's or a HELLO's `id`) of a side without a token.
pub const AUTH_NONE: u64 = 0;

/// The authentication mode of a side with a token: it proves it, and asks for proof.
pub const AUTH_TOKEN: u64 = 1;

/// The `x` of a [`Op::Refuse`]: the HELLO's tag does not prove the target's token.
pub const REFUSE_AUTH: u64 = 1;

/// The largest payload a connection takes before its handshake is over (a HELLO's is its
/// nonce, its tag and an address of at most a few hundred bytes).
pub const HANDSHAKE_MAX_PAYLOAD: u64 = 1024;

/// The `x` of a [`Op::Reserve`] whose ranges the initiator reads (0: writes).
pub const RESERVE_READS: u64 = 1;

/// A frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The operation.
    pub op: Op,
    /// Immediate data, if any.
    pub imm: Option<u32>,
    /// Work request or batch id.
    pub id: u64,
    /// Operation-specific value (version, key, status).
    pub x: u64,
    /// Payload bytes that follow.
    pub len: u64,
}

/// Why bytes from the socket are not a frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireError {
    /// The op byte names no operation.
    UnknownOp(u8),
    /// The payload is longer than the connection allows.
    TooLong {
        /// Announced payload length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A payload does not have the size its operation needs.
    BadPayload {
        /// The operation.
        op: Op,
        /// The payload's length.
        len: usize,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::UnknownOp(op) => write!(f, "unknown frame op {op}"),
            WireError::TooLong { len, max } => {
                write!(
                    f,
                    "frame payload of {len} bytes exceeds the {max}-byte limit"
                )
            }
            WireError::BadPayload { op, len } => {
                write!(f, "{op:?} frame with a malformed {len}-byte payload")
            }
        }
    }
}

impl std::error::Error for WireError {}

impl Header {
    /// A header with no immediate data and no payload.
    pub fn new(op: Op, id: u64, x: u64, len: u64) -> Header {
        Header {
            op,
            imm: None,
            id,
            x,
            len,
        }
    }

    /// Appends the encoded header to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.op as u8);
        out.push(self.imm.is_some() as u8);
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&self.imm.unwrap_or(0).to_le_bytes());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.x.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }

    /// Decodes a header; `max_payload` bounds the announced payload.
    pub fn decode(b: &[u8; HEADER_LEN], max_payload: u64) -> Result<Header, WireError> {
        let op = Op::from_u8(b[0]).ok_or(WireError::UnknownOp(b[0]))?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let len = u64_at(24);
        if len > max_payload {
            return Err(WireError::TooLong {
                len,
                max: max_payload,
            });
        }
        Ok(Header {
            op,
            imm: (b[1] & 1 == 1).then(|| u32_at(4)),
            id: u64_at(8),
            x: u64_at(16),
            len,
        })
    }
}

/// Fixed-size payload records, encoded back to back.
pub trait Record: Sized {
    /// Encoded size.
    const LEN: usize;
    /// Appends the record.
    fn put(&self, out: &mut Vec<u8>);
    /// Reads one record from exactly `LEN` bytes.
    fn get(b: &[u8]) -> Self;
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(a)
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[i..i + 4]);
    u32::from_le_bytes(a)
}

/// Decodes a payload of `op` made of whole records.
pub fn records<R: Record>(op: Op, payload: &[u8]) -> Result<Vec<R>, WireError> {
    if !payload.len().is_multiple_of(R::LEN) {
        return Err(WireError::BadPayload {
            op,
            len: payload.len(),
        });
    }
    Ok(payload.chunks_exact(R::LEN).map(R::get).collect())
}

/// One range of a [`Op::Reserve`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reserve {
    /// Remote key.
    pub key: u64,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl Record for Reserve {
    const LEN: usize = 24;
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.key.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }
    fn get(b: &[u8]) -> Reserve {
        Reserve {
            key: u64_at(b, 0),
            offset: u64_at(b, 8),
            len: u64_at(b, 16),
        }
    }
}

/// One verdict of a [`Op::Grant`]: the status, and the region's length (for error reports).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// Raw [`Status`].
    pub status: u32,
    /// Length of the region (0 when the key is unknown).
    pub region_len: u64,
}

impl Record for Grant {
    const LEN: usize = 12;
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.status.to_le_bytes());
        out.extend_from_slice(&self.region_len.to_le_bytes());
    }
    fn get(b: &[u8]) -> Grant {
        Grant {
            status: u32_at(b, 0),
            region_len: u64_at(b, 4),
        }
    }
}

/// One write with immediate data that has landed, in a [`Op::Done`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Landed {
    /// The immediate value.
    pub imm: u32,
    /// Bytes written.
    pub len: u64,
}

impl Record for Landed {
    const LEN: usize = 12;
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.imm.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }
    fn get(b: &[u8]) -> Landed {
        Landed {
            imm: u32_at(b, 0),
            len: u64_at(b, 4),
        }
    }
}

/// What an initiator needs to map a region: the allocation's IPC handle, where the region
/// starts in it, its length, and the exporter's device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyInfo {
    /// CUDA IPC handle of the allocation.
    pub handle: [u8; 64],
    /// Offset of the region's first byte in the allocation.
    pub offset: u64,
    /// Region length.
    pub len: u64,
    /// CUDA device ordinal of the exporter.
    pub device: u32,
}

impl Record for KeyInfo {
    const LEN: usize = 84;
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.handle);
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.device.to_le_bytes());
    }
    fn get(b: &[u8]) -> KeyInfo {
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&b[..64]);
        KeyInfo {
            handle,
            offset: u64_at(b, 64),
            len: u64_at(b, 72),
            device: u32_at(b, 80),
        }
    }
}

/// A [`Op::Challenge`]: the target's first frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// The target's protocol version.
    pub version: u64,
    /// The target's authentication mode ([`AUTH_NONE`], [`AUTH_TOKEN`]; others are
    /// refused by the reader).
    pub mode: u64,
    /// The nonce the HELLO's tag must cover.
    pub nonce: Nonce,
}

impl Challenge {
    /// Appends the frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        Header::new(Op::Challenge, self.mode, self.version, NONCE_LEN as u64).encode(out);
        out.extend_from_slice(self.nonce.as_bytes());
    }

    /// Reads a CHALLENGE frame (`h` is its header): a payload of exactly [`NONCE_LEN`]
    /// bytes, no immediate data.
    pub fn decode(h: &Header, payload: &[u8]) -> Result<Challenge, WireError> {
        let nonce = nonce_at(h, payload, payload.len() == NONCE_LEN)?;
        Ok(Challenge {
            version: h.x,
            mode: h.id,
            nonce,
        })
    }
}

/// A [`Op::Hello`]: the initiator's answer to the CHALLENGE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello<'a> {
    /// The initiator's protocol version.
    pub version: u64,
    /// The initiator's authentication mode.
    pub mode: u64,
    /// The nonce the target's PROOF must cover.
    pub nonce: Nonce,
    /// The tag of the CHALLENGE's nonce (zeros without a token).
    pub tag: [u8; TAG_LEN],
    /// The initiator's address (what it returns from `Transport::address`).
    pub address: &'a [u8],
}

impl Hello<'_> {
    /// Appends the frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let len = NONCE_LEN + TAG_LEN + self.address.len();
        Header::new(Op::Hello, self.mode, self.version, len as u64).encode(out);
        out.extend_from_slice(self.nonce.as_bytes());
        out.extend_from_slice(&self.tag);
        out.extend_from_slice(self.address);
    }

    /// Reads a HELLO frame of this version (`h` is its header): at least the nonce and the
    /// tag, no immediate data. The address is not checked here.
    pub fn decode<'a>(h: &Header, payload: &'a [u8]) -> Result<Hello<'a>, WireError> {
        let nonce = nonce_at(h, payload, payload.len() >= NONCE_LEN + TAG_LEN)?;
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(&payload[NONCE_LEN..NONCE_LEN + TAG_LEN]);
        Ok(Hello {
            version: h.x,
            mode: h.id,
            nonce,
            tag,
            address: &payload[NONCE_LEN + TAG_LEN..],
        })
    }
}

/// A [`Op::Proof`]: the target's tag of the initiator's nonce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Proof {
    /// The tag (zeros without a token).
    pub tag: [u8; TAG_LEN],
}

impl Proof {
    /// Appends the frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        Header::new(Op::Proof, 0, 0, TAG_LEN as u64).encode(out);
        out.extend_from_slice(&self.tag);
    }

    /// Reads a PROOF frame (`h` is its header): a payload of exactly [`TAG_LEN`] bytes, no
    /// immediate data.
    pub fn decode(h: &Header, payload: &[u8]) -> Result<Proof, WireError> {
        if h.imm.is_some() || payload.len() != TAG_LEN {
            return Err(WireError::BadPayload {
                op: h.op,
                len: payload.len(),
            });
        }
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(payload);
        Ok(Proof { tag })
    }
}

/// The nonce at the start of `payload`, where `ok` (its length is right) and the header
/// carries no immediate data.
fn nonce_at(h: &Header, payload: &[u8], ok: bool) -> Result<Nonce, WireError> {
    if h.imm.is_some() || !ok || payload.len() < NONCE_LEN {
        return Err(WireError::BadPayload {
            op: h.op,
            len: payload.len(),
        });
    }
    let mut b = [0u8; NONCE_LEN];
    b.copy_from_slice(&payload[..NONCE_LEN]);
    Ok(Nonce::from_bytes(b))
}

/// Encodes records after a header into `out`.
pub fn put_frame<R: Record>(out: &mut Vec<u8>, op: Op, id: u64, x: u64, recs: &[R]) {
    Header::new(op, id, x, (recs.len() * R::LEN) as u64).encode(out);
    for r in recs {
        r.put(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn headers_round_trip() {
        let h = Header {
            op: Op::Send,
            imm: Some(0xDEAD_BEEF),
            id: 7,
            x: u64::MAX,
            len: 100,
        };
        let mut v = Vec::new();
        h.encode(&mut v);
        assert_eq!(v.len(), HEADER_LEN);
        let b: [u8; HEADER_LEN] = v.try_into().unwrap();
        assert_eq!(Header::decode(&b, 100), Ok(h));
        assert_eq!(
            Header::decode(&b, 99),
            Err(WireError::TooLong { len: 100, max: 99 })
        );
    }

    #[test]
    fn unknown_ops_and_ragged_payloads_are_errors() {
        let mut b = [0u8; HEADER_LEN];
        b[0] = 200;
        assert_eq!(Header::decode(&b, 0), Err(WireError::UnknownOp(200)));
        assert!(records::<Reserve>(Op::Reserve, &[0; 25]).is_err());
        assert!(records::<KeyInfo>(Op::KeyInfo, &[0; 83]).is_err());
        assert_eq!(records::<Grant>(Op::Grant, &[]).unwrap(), vec![]);
    }

    #[test]
    fn records_round_trip() {
        let mut v = Vec::new();
        let r = [
            Reserve {
                key: 1,
                offset: 2,
                len: 3,
            },
            Reserve {
                key: u64::MAX,
                offset: 0,
                len: 1 << 40,
            },
        ];
        put_frame(&mut v, Op::Reserve, 9, 0, &r);
        assert_eq!(
            records::<Reserve>(Op::Reserve, &v[HEADER_LEN..]).unwrap(),
            r
        );
        let k = KeyInfo {
            handle: [7; 64],
            offset: 4096,
            len: 1 << 20,
            device: 1,
        };
        let mut v = Vec::new();
        k.put(&mut v);
        assert_eq!(KeyInfo::get(&v), k);
        let l = Landed { imm: 5, len: 9 };
        let mut v = Vec::new();
        l.put(&mut v);
        assert_eq!(Landed::get(&v), l);
    }

    fn header_of(v: &[u8]) -> Header {
        Header::decode(&v[..HEADER_LEN].try_into().unwrap(), HANDSHAKE_MAX_PAYLOAD).unwrap()
    }

    #[test]
    fn handshake_frames_round_trip() {
        let c = Challenge {
            version: VERSION,
            mode: AUTH_TOKEN,
            nonce: Nonce::from_bytes([3; NONCE_LEN]),
        };
        let mut v = Vec::new();
        c.encode(&mut v);
        assert_eq!(Challenge::decode(&header_of(&v), &v[HEADER_LEN..]), Ok(c));
        let h = Hello {
            version: VERSION,
            mode: AUTH_NONE,
            nonce: Nonce::from_bytes([4; NONCE_LEN]),
            tag: [5; TAG_LEN],
            address: b"xipc1 a 1 0 s",
        };
        let mut v = Vec::new();
        h.encode(&mut v);
        assert_eq!(Hello::decode(&header_of(&v), &v[HEADER_LEN..]), Ok(h));
        let p = Proof { tag: [6; TAG_LEN] };
        let mut v = Vec::new();
        p.encode(&mut v);
        assert_eq!(Proof::decode(&header_of(&v), &v[HEADER_LEN..]), Ok(p));
    }

    #[test]
    fn handshake_frames_of_the_wrong_size_or_with_immediate_data_are_errors() {
        let h = |op, len| Header::new(op, 0, VERSION, len);
        for len in [0, NONCE_LEN - 1, NONCE_LEN + 1, 4 * NONCE_LEN] {
            let p = vec![0u8; len];
            assert_eq!(
                Challenge::decode(&h(Op::Challenge, len as u64), &p),
                Err(WireError::BadPayload {
                    op: Op::Challenge,
                    len
                })
            );
        }
        for len in [0, NONCE_LEN, NONCE_LEN + TAG_LEN - 1] {
            let p = vec![0u8; len];
            assert!(
                Hello::decode(&h(Op::Hello, len as u64), &p).is_err(),
                "{len}"
            );
        }
        let hello = Hello::decode(&h(Op::Hello, 48), &[0; NONCE_LEN + TAG_LEN]).unwrap();
        assert!(hello.address.is_empty());
        for len in [0, TAG_LEN - 1, TAG_LEN + 1] {
            let p = vec![0u8; len];
            assert!(
                Proof::decode(&h(Op::Proof, len as u64), &p).is_err(),
                "{len}"
            );
        }
        let mut imm = h(Op::Challenge, NONCE_LEN as u64);
        imm.imm = Some(1);
        assert!(Challenge::decode(&imm, &[0; NONCE_LEN]).is_err());
        let mut imm = h(Op::Proof, TAG_LEN as u64);
        imm.imm = Some(1);
        assert!(Proof::decode(&imm, &[0; TAG_LEN]).is_err());
    }

    proptest! {
        #[test]
        fn any_handshake_payload_decodes_or_fails_cleanly(
            op in 9u8..=11,
            p in proptest::collection::vec(any::<u8>(), 0..128),
        ) {
            let h = Header::new(Op::from_u8(op).unwrap(), 1, VERSION, p.len() as u64);
            let _ = Challenge::decode(&h, &p);
            let _ = Hello::decode(&h, &p);
            let _ = Proof::decode(&h, &p);
        }

        #[test]
        fn any_header_bytes_decode_or_fail_cleanly(b in proptest::array::uniform32(any::<u8>()), max in any::<u64>()) {
            if let Ok(h) = Header::decode(&b, max) {
                prop_assert!(h.len <= max);
                let mut v = Vec::new();
                h.encode(&mut v);
                prop_assert_eq!(Header::decode(&v.try_into().unwrap(), max), Ok(h));
            }
        }
    }
}
