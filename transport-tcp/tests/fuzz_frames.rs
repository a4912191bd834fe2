//! A proptest-driven fuzz suite for the frame decoder and the receive state machine
//! (issue 7: "a fuzz target for the frame decoder and the receive state machine").
//!
//! - `Header::decode` on arbitrary 40-byte arrays never panics, accepts exactly the
//!   well-formed ones, and round-trips what it accepts.
//! - Byte streams fed to a real target over a socket (random noise, random frames, and
//!   mutations of a valid HELLO + BATCH + WRITE + SEND stream) never panic it, never change
//!   a byte outside its registered window (canaries), draw only ACK/NACK answers and
//!   READ_REPLYs whose bytes all come from the one region that allows REMOTE_READ (so
//!   READs are served, not only refused, and never read past that region), and leave it
//!   serving a well-behaved peer.
//! - Byte streams fed back to a real initiator by a hostile target complete every posted
//!   write exactly once, and leave it serving a real peer.
//! - A hostile target's first frame (a CHALLENGE with any fields, or another frame) draws
//!   nothing from the initiator unless it is a well-formed CHALLENGE, which draws a HELLO
//!   with the tag of its nonce; anything else fails the peer.
//!
//! Bounded for CI: 64 cases per property (`PROPTEST_CASES` overrides).

mod common;

use common::{Deadline, Node, Raw, fake_target_handshake, hello_frame, honest_write, write_header};
use fabric_core::testing::{Canaried, pattern};
use fabric_core::{
    Access, OpKind, PostOutcome, RemoteKey, RemoteRegion, RemoteSlice, Transport, WorkRequestId,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use std::collections::HashMap;
use std::net::TcpListener;
use transport_tcp::TcpConfig;
use transport_tcp::frame::{
    AUTH_NONE, AUTH_TOKEN, CHALLENGE_VERSION, CHECKSUM_LEN, FLAG_CRC, FLAG_IMM, HEADER_LEN,
    HELLO_CONTEXT, Header, MAX_BATCH, MUTUAL_VERSION, Op, PROTOCOL_VERSION, code,
};

/// The target's registered window.
const WIN: u64 = 16 * 1024;
/// The target's largest message.
const MAX_MSG: u64 = 64 * 1024;
const FILL: u8 = 0x11;
/// What the region that allows REMOTE_READ holds: a READ_REPLY byte of any other value
/// came from outside it (its canaries are `fabric_core::testing::CANARY`).
const READABLE_FILL: u8 = 0x52;
/// Bytes of that region.
const READABLE_LEN: u64 = 8 * 1024;

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    ProptestConfig {
        cases,
        // Each case opens sockets: keep shrinking short, and write no regression files.
        max_shrink_iters: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---- (a) the header decoder ----

/// 40 bytes, biased towards well-formed headers so that both paths of `decode` run.
fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![3 => 0u8..10, 1 => any::<u8>()],
        prop_oneof![3 => 0u8..4, 1 => any::<u8>()],
        prop_oneof![3 => Just(0u8), 1 => any::<u8>()],
        vec(any::<u8>(), HEADER_LEN),
    )
        .prop_map(|(op, flags, rsvd, mut b)| {
            b[0] = op;
            b[1] = flags;
            b[3] = rsvd;
            b
        })
}

fn op_of(v: u8) -> Op {
    match v % 9 {
        0 => Op::Hello,
        1 => Op::Write,
        2 => Op::Send,
        3 => Op::Ack,
        4 => Op::Nack,
        5 => Op::Read,
        6 => Op::ReadReply,
        7 => Op::Challenge,
        _ => Op::Batch,
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn decode_accepts_exactly_well_formed_headers(b in header_bytes()) {
        let raw: [u8; HEADER_LEN] = b[..].try_into().unwrap();
        let well_formed =
            (1..=9).contains(&raw[0]) && raw[1] & !(FLAG_IMM | FLAG_CRC) == 0 && raw[3] == 0;
        match Header::decode(&raw) {
            Ok(h) => {
                prop_assert!(well_formed, "accepted {raw:?}");
                prop_assert_eq!(h.encode(), raw, "round trip");
                prop_assert_eq!(h.op as u8, raw[0]);
                prop_assert_eq!(h.imm().is_some(), raw[1] & FLAG_IMM != 0);
            }
            Err(e) => prop_assert!(!well_formed, "rejected {raw:?}: {e}"),
        }
    }

    #[test]
    fn encode_then_decode_is_identity(
        op in any::<u8>(), imm_flag in any::<bool>(), code in any::<u8>(), imm in any::<u32>(),
        wr_id in any::<u64>(), key in any::<u64>(), offset in any::<u64>(), len in any::<u64>(),
    ) {
        let h = Header {
            op: op_of(op),
            flags: if imm_flag { FLAG_IMM } else { 0 },
            code,
            imm,
            wr_id,
            key,
            offset,
            len,
        };
        prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
    }
}

// ---- (b) byte streams against a target ----

/// A target with a window (remote write), a region without remote write, a region peers
/// may read (and not write), and the key of a deregistered region.
struct Fixture {
    target: Node,
    window: Canaried,
    nowrite: Canaried,
    readable: Canaried,
    stale: Canaried,
}

impl Fixture {
    fn new() -> Fixture {
        let mut target = Node::new(TcpConfig {
            max_msg_size: MAX_MSG,
            // Every SEND fits the early-arrival queue: the target always reads to EOF.
            max_unexpected_bytes: 4 << 20,
            max_unexpected_count: 4096,
            ..TcpConfig::default()
        });
        let window = Canaried::new(
            &mut target.t,
            WIN,
            Access::REMOTE_WRITE | Access::LOCAL_WRITE,
            FILL,
        );
        let nowrite = Canaried::new(&mut target.t, 4096, Access::LOCAL_WRITE, FILL);
        let readable = Canaried::new(
            &mut target.t,
            READABLE_LEN,
            Access::REMOTE_READ,
            READABLE_FILL,
        );
        let stale = Canaried::new(&mut target.t, 4096, Access::REMOTE_WRITE, FILL);
        target.t.deregister(stale.reg.local).unwrap();
        Fixture {
            target,
            window,
            nowrite,
            readable,
            stale,
        }
    }

    fn key(&self, k: &KeyPick) -> u64 {
        match k {
            KeyPick::Window => self.window.reg.remote.key.0,
            KeyPick::NoWrite => self.nowrite.reg.remote.key.0,
            KeyPick::Readable => self.readable.reg.remote.key.0,
            KeyPick::Stale => self.stale.reg.remote.key.0,
            KeyPick::Bogus(v) => *v,
        }
    }

    /// Sends `bytes` on a fresh connection, lets the target answer what it will, half-closes,
    /// and waits for the target to close. Returns what the target answered.
    fn feed(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut c = Raw::connect(&self.target.t);
        let t = &mut self.target;
        // The target may close before it has read everything: that is fine.
        let _ = c.send(bytes, || t.step());
        // Collect answers until the target has been quiet for a few rounds (the target drops
        // what it has not sent yet when it reads our EOF).
        let mut quiet = 0;
        while quiet < 5 && !c.closed {
            let before = c.received;
            t.step();
            c.pump();
            quiet = if c.received == before { quiet + 1 } else { 0 };
        }
        c.shutdown_write();
        c.expect_closed("fuzz input", || t.step());
        c.rx
    }

    /// What holds after any input.
    fn check(&mut self, answered: &[u8], seed: u64) {
        let mut rest = answered;
        // The payload (and checksum) lengths of a READ_REPLY header.
        let reply = |h: &Header| {
            assert!(h.len <= READABLE_LEN, "a READ_REPLY of {} bytes", h.len);
            let crc = if h.flags & FLAG_CRC != 0 {
                CHECKSUM_LEN
            } else {
                0
            };
            (h.len as usize, crc as usize)
        };
        // Whole headers only: the target may stop mid-answer when it reads our EOF.
        while let Some(raw) = rest.get(..HEADER_LEN) {
            let h = Header::decode(raw.try_into().unwrap());
            rest = &rest[HEADER_LEN..];
            // The payloads that follow: none, a READ_REPLY's, or those of a BATCH of
            // READ_REPLYs (their headers first, then their payloads in order).
            let payloads: Vec<(usize, usize)> = match h {
                Ok(Header {
                    op: Op::Ack | Op::Nack,
                    ..
                }) => Vec::new(),
                Ok(
                    ref h @ Header {
                        op: Op::ReadReply, ..
                    },
                ) => vec![reply(h)],
                Ok(Header {
                    op: Op::Batch, len, ..
                }) => {
                    let mut lens = Vec::new();
                    for _ in 0..len {
                        let Some(raw) = rest.get(..HEADER_LEN) else {
                            break;
                        };
                        match Header::decode(raw.try_into().unwrap()) {
                            Ok(
                                ref h @ Header {
                                    op: Op::ReadReply, ..
                                },
                            ) => lens.push(reply(h)),
                            other => panic!("the target batched {other:?}"),
                        }
                        rest = &rest[HEADER_LEN..];
                    }
                    lens
                }
                _ => panic!("the target sent {h:?}"),
            };
            for (len, checksum) in payloads {
                assert!(
                    rest[..len.min(rest.len())]
                        .iter()
                        .all(|&b| b == READABLE_FILL),
                    "a READ_REPLY carried bytes from outside the readable region"
                );
                rest = &rest[(len + checksum).min(rest.len())..];
            }
        }
        for c in &self.target.done {
            assert!(
                c.op == OpKind::RemoteWrite && c.result.is_ok(),
                "unexpected completion {c:?}"
            );
        }
        self.target.done.clear();
        self.window.assert_canaries();
        for (r, what) in [(&self.nowrite, "no REMOTE_WRITE"), (&self.stale, "stale")] {
            assert!(
                r.read(0, 4096).iter().all(|&b| b == FILL),
                "{what} region changed"
            );
            r.assert_canaries();
        }
        assert!(
            self.readable
                .read(0, READABLE_LEN as usize)
                .iter()
                .all(|&b| b == READABLE_FILL),
            "the region that allows only REMOTE_READ changed"
        );
        self.readable.assert_canaries();
        honest_write(
            &mut self.target,
            &self.window,
            seed % WIN,
            1024.min(WIN - seed % WIN),
            seed,
        );
    }
}

#[derive(Clone, Debug)]
enum KeyPick {
    Window,
    NoWrite,
    /// The region that allows REMOTE_READ only.
    Readable,
    Stale,
    Bogus(u64),
}

fn key_pick() -> impl Strategy<Value = KeyPick> {
    prop_oneof![
        8 => Just(KeyPick::Window),
        1 => Just(KeyPick::NoWrite),
        2 => Just(KeyPick::Readable),
        1 => Just(KeyPick::Stale),
        1 => any::<u64>().prop_map(KeyPick::Bogus),
    ]
}

/// Values that sit on the edges the target checks.
fn edge_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0),
        Just(1),
        Just(11),
        Just(12),
        Just(4096),
        Just(4097),
        Just(MAX_BATCH as u64),
        Just(MAX_BATCH as u64 + 1),
        Just(WIN - 1),
        Just(WIN),
        Just(WIN + 1),
        Just(MAX_MSG),
        Just(MAX_MSG + 1),
        Just(1 << 32),
        Just(1 << 63),
        Just(u64::MAX - 1),
        Just(u64::MAX),
        any::<u64>(),
    ]
}

#[derive(Clone, Debug)]
struct WriteSpec {
    key: KeyPick,
    offset: u64,
    len: u64,
    imm: Option<u32>,
}

fn write_spec() -> impl Strategy<Value = WriteSpec> {
    (
        key_pick(),
        0..WIN,
        prop_oneof![3 => 0u64..2048, 1 => 8192u64..12288],
        any::<Option<u32>>(),
        prop::bool::weighted(0.15),
    )
        .prop_map(|(key, offset, len, imm, oob)| WriteSpec {
            key,
            offset,
            len: if oob { len } else { len.min(WIN - offset) },
            imm,
        })
}

/// A valid stream: HELLO, BATCHes of WRITEs, a plain WRITE, a SEND.
#[derive(Clone, Debug)]
struct StreamSpec {
    batches: Vec<Vec<WriteSpec>>,
    single: Option<WriteSpec>,
    send: Option<(usize, Option<u32>)>,
}

fn stream_spec() -> impl Strategy<Value = StreamSpec> {
    (
        vec(vec(write_spec(), 1..8), 0..3),
        prop::option::of(write_spec()),
        prop::option::of((0usize..600, any::<Option<u32>>())),
    )
        .prop_map(|(batches, single, send)| StreamSpec {
            batches,
            single,
            send,
        })
}

/// What the target must do with an unmutated stream.
struct Expected {
    answers: Vec<Option<u8>>,
    window: Vec<u8>,
    imms: Vec<u32>,
}

impl StreamSpec {
    fn build(&self, fx: &Fixture) -> (Vec<u8>, Expected) {
        let mut bytes = hello_frame();
        let mut exp = Expected {
            answers: Vec::new(),
            window: vec![FILL; WIN as usize],
            imms: Vec::new(),
        };
        let mut wr = 0u64;
        let expect = |w: &WriteSpec, wr: u64, exp: &mut Expected| {
            let fail = match w.key {
                KeyPick::Window => match w.offset.checked_add(w.len) {
                    Some(end) if end <= WIN => None,
                    _ => Some(code::BOUNDS),
                },
                KeyPick::NoWrite | KeyPick::Readable => Some(code::PERMISSION),
                KeyPick::Stale | KeyPick::Bogus(_) => Some(code::KEY),
            };
            if fail.is_none() {
                exp.window[w.offset as usize..(w.offset + w.len) as usize]
                    .copy_from_slice(&pattern(wr, w.len as usize));
                exp.imms.extend(w.imm);
            }
            exp.answers.push(fail);
        };
        for batch in &self.batches {
            bytes.extend(Header::new(Op::Batch, batch.len() as u64).encode());
            for w in batch {
                wr += 1;
                let h = write_header(fx.key(&w.key), w.offset, w.len, w.imm, wr);
                bytes.extend(h.encode());
                expect(w, wr, &mut exp);
            }
            let first = wr + 1 - batch.len() as u64;
            for (i, w) in batch.iter().enumerate() {
                bytes.extend(pattern(first + i as u64, w.len as usize));
            }
        }
        if let Some(w) = &self.single {
            wr += 1;
            let h = write_header(fx.key(&w.key), w.offset, w.len, w.imm, wr);
            bytes.extend(h.encode());
            bytes.extend(pattern(wr, w.len as usize));
            expect(w, wr, &mut exp);
        }
        if let Some((len, imm)) = self.send {
            let mut h = Header::new(Op::Send, len as u64);
            if let Some(v) = imm {
                h.flags = FLAG_IMM;
                h.imm = v;
            }
            bytes.extend(h.encode());
            bytes.extend(pattern(999, len));
            exp.answers.push(None);
        }
        (bytes, exp)
    }
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(Index, u8),
    Set64(Index, u64),
    Insert(Index, Vec<u8>),
    Delete(Index, usize),
    Truncate(Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<Index>(), 1u8..=255).prop_map(|(i, x)| Mutation::Flip(i, x)),
        3 => (any::<Index>(), edge_u64()).prop_map(|(i, v)| Mutation::Set64(i, v)),
        1 => (any::<Index>(), vec(any::<u8>(), 1..64)).prop_map(|(i, v)| Mutation::Insert(i, v)),
        1 => (any::<Index>(), 1usize..128).prop_map(|(i, n)| Mutation::Delete(i, n)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(mut b: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        if b.is_empty() {
            break;
        }
        match m {
            Mutation::Flip(i, x) => {
                let i = i.index(b.len());
                b[i] ^= x;
            }
            Mutation::Set64(i, v) => {
                let i = i.index(b.len());
                let n = (b.len() - i).min(8);
                b[i..i + n].copy_from_slice(&v.to_le_bytes()[..n]);
            }
            Mutation::Insert(i, v) => {
                let i = i.index(b.len());
                b.splice(i..i, v.iter().copied());
            }
            Mutation::Delete(i, n) => {
                let i = i.index(b.len());
                let end = (i + n).min(b.len());
                b.drain(i..end);
            }
            Mutation::Truncate(i) => {
                let i = i.index(b.len());
                b.truncate(i);
            }
        }
    }
    b
}

/// A frame with arbitrary header fields (the op, flags and reserved byte included) and a
/// payload that may or may not match its length.
#[derive(Clone, Debug)]
struct FrameSpec {
    op: u8,
    flags: u8,
    rsvd: u8,
    code: u8,
    imm: u32,
    key: KeyPick,
    offset: u64,
    len: u64,
    payload: Option<usize>,
}

fn frame_spec() -> impl Strategy<Value = FrameSpec> {
    (
        (
            // Mostly requests a target serves, so that sequences run on.
            prop_oneof![
                10 => Just(Op::Write as u8),
                3 => Just(Op::Batch as u8),
                3 => Just(Op::Send as u8),
                1 => Just(Op::Ack as u8),
                1 => Just(Op::Nack as u8),
                1 => Just(Op::Hello as u8),
                // Served (READ_REPLY) when aimed inside the region that allows REMOTE_READ,
                // refused (NACK) elsewhere.
                4 => Just(Op::Read as u8),
                1 => Just(Op::ReadReply as u8),
                // Only targets send it: a peer's closes the connection.
                1 => Just(Op::Challenge as u8),
                1 => any::<u8>(),
            ],
            prop_oneof![19 => 0u8..=1, 1 => any::<u8>()],
            prop_oneof![29 => Just(0u8), 1 => any::<u8>()],
            any::<u8>(),
            any::<u32>(),
        ),
        key_pick(),
        prop_oneof![3 => 0..WIN, 1 => edge_u64()],
        prop_oneof![6 => 0u64..512, 3 => 0u64..8, 1 => edge_u64()],
        prop_oneof![4 => Just(None), 1 => (0usize..2048).prop_map(Some)],
    )
        .prop_map(
            |((op, flags, rsvd, code, imm), key, offset, len, payload)| FrameSpec {
                op,
                flags,
                rsvd,
                code,
                imm,
                key,
                offset,
                len,
                payload,
            },
        )
}

impl FrameSpec {
    fn header(&self, fx: &Fixture, wr: u64) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0] = self.op;
        h[1] = self.flags;
        h[2] = self.code;
        h[3] = self.rsvd;
        h[4..8].copy_from_slice(&self.imm.to_le_bytes());
        h[8..16].copy_from_slice(&wr.to_le_bytes());
        h[16..24].copy_from_slice(&fx.key(&self.key).to_le_bytes());
        h[24..32].copy_from_slice(&self.offset.to_le_bytes());
        h[32..40].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    /// The payload bytes that follow: by default what a WRITE or SEND announces.
    fn payload(&self, wr: u64) -> Vec<u8> {
        let n = self.payload.unwrap_or(match self.op {
            2 | 3 => self.len.min(4096) as usize,
            _ => 0,
        });
        pattern(wr, n)
    }
}

/// The frames in order; a BATCH of `n` (small) takes the next `n` frames as its entries:
/// their headers back to back, then their payloads.
fn build_frames(fx: &Fixture, hello: bool, frames: &[FrameSpec]) -> Vec<u8> {
    let mut bytes = if hello { hello_frame() } else { Vec::new() };
    let mut i = 0;
    while i < frames.len() {
        let f = &frames[i];
        bytes.extend(f.header(fx, i as u64));
        let n = f.len as usize;
        if f.op == Op::Batch as u8 && f.payload.is_none() && n < frames.len() - i {
            let entries = &frames[i + 1..i + 1 + n];
            for (j, e) in entries.iter().enumerate() {
                bytes.extend(e.header(fx, (i + 1 + j) as u64));
            }
            for (j, e) in entries.iter().enumerate() {
                bytes.extend(e.payload((i + 1 + j) as u64));
            }
            i += 1 + n;
        } else {
            bytes.extend(f.payload(i as u64));
            i += 1;
        }
    }
    bytes
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn random_bytes_never_hurt_the_target(hello in any::<bool>(), noise in vec(any::<u8>(), 0..4096)) {
        let mut fx = Fixture::new();
        let mut bytes = if hello { hello_frame() } else { Vec::new() };
        bytes.extend(&noise);
        let answered = fx.feed(&bytes);
        if !hello {
            prop_assert!(
                answered.is_empty() && fx.target.done.is_empty(),
                "bytes before HELLO were acted on"
            );
            prop_assert!(fx.window.read(0, WIN as usize).iter().all(|&b| b == FILL));
        }
        fx.check(&answered, noise.len() as u64);
    }

    #[test]
    fn random_frames_never_hurt_the_target(
        hello in prop::bool::weighted(0.9),
        frames in vec(frame_spec(), 1..16),
    ) {
        let mut fx = Fixture::new();
        let bytes = build_frames(&fx, hello, &frames);
        let answered = fx.feed(&bytes);
        fx.check(&answered, frames.len() as u64);
    }

    #[test]
    fn mutated_valid_streams_never_hurt_the_target(
        spec in stream_spec(),
        muts in vec(mutation(), 0..5),
    ) {
        let mut fx = Fixture::new();
        let (valid, exp) = spec.build(&fx);
        if muts.is_empty() {
            // Unmutated: every request gets its own answer, and the window is exactly what
            // the valid writes make it.
            let mut c = Raw::connect(&fx.target.t);
            let t = &mut fx.target;
            c.send_ok(&valid, || t.step());
            let got = c.answers(exp.answers.len(), || t.step());
            for (i, (a, want)) in got.iter().zip(&exp.answers).enumerate() {
                match (a, want) {
                    (common::Answer::Ack, None) => {}
                    (common::Answer::Nack(h), Some(code)) => prop_assert_eq!(h.code, *code, "request {}", i),
                    _ => prop_assert!(false, "request {i}: {a:?}, expected {want:?}"),
                }
            }
            prop_assert!(fx.window.read(0, WIN as usize) == exp.window, "window differs");
            let imms: Vec<u32> = fx.target.done.iter().filter_map(|c| c.imm).collect();
            prop_assert_eq!(imms, exp.imms);
            c.shutdown_write();
            c.expect_closed("the end of a valid stream", || fx.target.step());
            fx.check(&[], 1);
        } else {
            let bytes = mutate(valid, &muts);
            let answered = fx.feed(&bytes);
            fx.check(&answered, bytes.len() as u64);
        }
    }
}

// ---- (c) byte streams against an initiator ----

/// What a hostile target answers.
#[derive(Clone, Debug)]
enum Reply {
    Ack(u64),
    Nack(u8),
    Bytes(Vec<u8>),
}

fn reply() -> impl Strategy<Value = Reply> {
    prop_oneof![
        4 => prop_oneof![4 => 0u64..4, 1 => edge_u64()].prop_map(Reply::Ack),
        2 => any::<u8>().prop_map(Reply::Nack),
        1 => vec(any::<u8>(), 1..80).prop_map(Reply::Bytes),
    ]
}

fn encode_replies(replies: &[Reply]) -> Vec<u8> {
    let mut b = Vec::new();
    for r in replies {
        match r {
            Reply::Ack(n) => b.extend(Header::new(Op::Ack, *n).encode()),
            Reply::Nack(c) => {
                let mut h = Header::new(Op::Nack, 0);
                h.code = *c;
                b.extend(h.encode());
            }
            Reply::Bytes(v) => b.extend(v),
        }
    }
    b
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn hostile_replies_complete_every_write_once(
        k in 1usize..8,
        replies in vec(reply(), 0..8),
        muts in vec(mutation(), 0..3),
    ) {
        // Every SEND the fake may send fits the early-arrival queue, so that the initiator
        // always reads on to the fake's EOF (see `hostile.rs` for a SEND that does not fit).
        let mut a = Node::new(TcpConfig {
            max_msg_size: MAX_MSG,
            max_unexpected_bytes: 4 << 20,
            ..TcpConfig::default()
        });
        let src = Canaried::new(&mut a.t, 64 * 1024, Access::REMOTE_WRITE, 0x5A);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = format!("tcp://{}", listener.local_addr().unwrap());
        let fake_peer = a.t.add_peer(addr.as_bytes()).unwrap();
        let mut fake = Raw::from_stream(listener.accept().unwrap().0);
        let region = RemoteRegion { addr: 0, len: 1 << 20, key: RemoteKey(0xFA6E) };
        for i in 0..k as u64 {
            let dst = RemoteSlice { region, offset: i * 4096, len: 4096 };
            let r = a.t.post_write(fake_peer, WorkRequestId(i), src.local(0, 4096), dst, None).unwrap();
            prop_assert_eq!(r, PostOutcome::Posted);
        }
        // The fake sends its CHALLENGE, and takes in HELLO and the k requests (one BATCH)
        // before it answers.
        fake_target_handshake(&mut fake, || a.step());
        let _ = fake.read_bytes(HEADER_LEN + k * (HEADER_LEN + 4096), || a.step());
        let _ = fake.send(&mutate(encode_replies(&replies), &muts), || a.step());
        fake.shutdown_write();
        let d = Deadline::new("every write to complete");
        while a.done.len() < k {
            fake.pump();
            a.step();
            d.check();
        }
        for _ in 0..20 {
            a.step();
        }
        let mut seen = HashMap::new();
        for c in a.done.drain(..) {
            prop_assert_eq!(c.op, OpKind::Write);
            prop_assert!(c.wr_id.0 < k as u64);
            prop_assert!(seen.insert(c.wr_id.0, c.result.clone()).is_none(), "wr {} twice", c.wr_id.0);
            if let Ok(n) = c.result {
                prop_assert_eq!(n, 4096);
            }
        }
        prop_assert_eq!(seen.len(), k);
        src.assert_canaries();
        drop(fake);
        // The initiator still works with a real peer.
        let mut real = Node::new(TcpConfig::default());
        let dst = Canaried::new(&mut real.t, 4096, Access::REMOTE_WRITE, 0);
        let peer = a.t.add_peer(&real.t.address()).unwrap();
        let r = a.t.post_write(peer, WorkRequestId(100), src.local(0, 4096), dst.remote(0, 4096), None).unwrap();
        prop_assert_eq!(r, PostOutcome::Posted);
        let d = Deadline::new("a write to a real peer");
        while a.done.is_empty() {
            a.step();
            real.step();
            d.check();
        }
        prop_assert_eq!(&a.done[0].result, &Ok(4096));
        prop_assert_eq!(dst.read(0, 4096), src.read(0, 4096));
    }
}

/// What a hostile owner answers to READs.
#[derive(Clone, Debug)]
enum ReadAnswer {
    Ack(u64),
    Nack(u8),
    /// A READ_REPLY of `len` bytes (right or wrong), with `flags`, and as many bytes of
    /// `seed`'s pattern as it announces (or fewer: the stream then ends).
    Reply {
        len: u64,
        flags: u8,
        seed: u64,
    },
    Bytes(Vec<u8>),
}

fn read_answer() -> impl Strategy<Value = ReadAnswer> {
    prop_oneof![
        6 => (
            prop_oneof![6 => Just(4096u64), 1 => 0u64..8192, 1 => edge_u64()],
            prop_oneof![9 => Just(0u8), 1 => any::<u8>()],
            any::<u64>()
        )
            .prop_map(|(len, flags, seed)| ReadAnswer::Reply { len, flags, seed }),
        1 => (0u64..3).prop_map(ReadAnswer::Ack),
        2 => any::<u8>().prop_map(ReadAnswer::Nack),
        1 => vec(any::<u8>(), 1..80).prop_map(ReadAnswer::Bytes),
    ]
}

fn encode_read_answers(answers: &[ReadAnswer]) -> Vec<u8> {
    let mut b = Vec::new();
    for r in answers {
        match r {
            ReadAnswer::Ack(n) => b.extend(Header::new(Op::Ack, *n).encode()),
            ReadAnswer::Nack(c) => {
                let mut h = Header::new(Op::Nack, 0);
                h.code = *c;
                b.extend(h.encode());
            }
            ReadAnswer::Reply { len, flags, seed } => {
                let mut h = Header::new(Op::ReadReply, *len);
                h.flags = *flags;
                b.extend(h.encode());
                b.extend(pattern(*seed, (*len).min(8192) as usize));
            }
            ReadAnswer::Bytes(v) => b.extend(v),
        }
    }
    b
}

proptest! {
    #![proptest_config(config())]

    /// A hostile owner's answers to READs (wrong lengths, ACKs, flags, garbage, a stream cut
    /// short) complete every READ exactly once; bytes land only inside the READ's own
    /// range, and a READ that succeeds holds exactly what its reply carried.
    #[test]
    fn hostile_read_replies_complete_every_read_once(
        k in 1usize..6,
        answers in vec(read_answer(), 0..8),
        muts in vec(mutation(), 0..2),
    ) {
        let mut a = Node::new(TcpConfig {
            max_msg_size: MAX_MSG,
            ..TcpConfig::default()
        });
        let dst = Canaried::new(&mut a.t, 64 * 1024, Access::LOCAL_WRITE, 0x5A);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = format!("tcp://{}", listener.local_addr().unwrap());
        let fake_peer = a.t.add_peer(addr.as_bytes()).unwrap();
        let mut fake = Raw::from_stream(listener.accept().unwrap().0);
        let region = RemoteRegion { addr: 0, len: 1 << 20, key: RemoteKey(0xFA6E) };
        for i in 0..k as u64 {
            let src = RemoteSlice { region, offset: i * 4096, len: 4096 };
            let r = a.t.post_read(fake_peer, WorkRequestId(i), dst.local(i * 4096, 4096), src).unwrap();
            prop_assert_eq!(r, PostOutcome::Posted);
        }
        fake_target_handshake(&mut fake, || a.step());
        // The k READs leave as one batch (no payloads).
        let h = fake.read_header(|| a.step());
        prop_assert_eq!((h.op, h.len), (Op::Batch, k as u64));
        for i in 0..k as u64 {
            let h = fake.read_header(|| a.step());
            prop_assert_eq!(h.op, Op::Read);
            prop_assert_eq!((h.key, h.offset, h.len), (0xFA6E, i * 4096, 4096));
        }
        let mutated = !muts.is_empty();
        let _ = fake.send(&mutate(encode_read_answers(&answers), &muts), || a.step());
        fake.shutdown_write();
        let d = Deadline::new("every read to complete");
        while a.done.len() < k {
            fake.pump();
            a.step();
            d.check();
        }
        for _ in 0..20 {
            a.step();
        }
        let mut seen = HashMap::new();
        for c in a.done.drain(..) {
            prop_assert_eq!(c.op, OpKind::Read);
            prop_assert!(c.wr_id.0 < k as u64);
            prop_assert!(seen.insert(c.wr_id.0, c.result.clone()).is_none(), "read {} twice", c.wr_id.0);
        }
        prop_assert_eq!(seen.len(), k);
        // Unmutated, well-formed answers say exactly what each read must hold.
        if !mutated {
            let mut i = 0u64;
            for r in &answers {
                if i >= k as u64 {
                    break;
                }
                match r {
                    ReadAnswer::Reply { len: 4096, flags: 0, seed } => {
                        prop_assert_eq!(&seen[&i], &Ok(4096));
                        prop_assert_eq!(dst.read(i * 4096, 4096), pattern(*seed, 4096));
                        i += 1;
                    }
                    // Answers nothing.
                    ReadAnswer::Ack(0) => {}
                    ReadAnswer::Nack(_) => {
                        prop_assert!(seen[&i].is_err());
                        prop_assert_eq!(dst.read(i * 4096, 4096), vec![0x5A; 4096]);
                        i += 1;
                    }
                    // Anything else breaks the connection: the rest fail.
                    _ => break,
                }
            }
            for j in i..k as u64 {
                prop_assert!(seen[&j].is_err(), "read {j} succeeded after a broken answer");
            }
        }
        dst.assert_canaries();
        prop_assert!(dst.read(k as u64 * 4096, 4096).iter().all(|&b| b == 0x5A), "bytes past the reads changed");
        drop(fake);
        // The initiator still reads from a real peer.
        let mut real = Node::new(TcpConfig::default());
        let src = Canaried::new(&mut real.t, 4096, Access::REMOTE_READ, 0x3C);
        let peer = a.t.add_peer(&real.t.address()).unwrap();
        let r = a.t.post_read(peer, WorkRequestId(100), dst.local(0, 4096), src.remote(0, 4096)).unwrap();
        prop_assert_eq!(r, PostOutcome::Posted);
        let d = Deadline::new("a read from a real peer");
        while a.done.is_empty() {
            a.step();
            real.step();
            d.check();
        }
        prop_assert_eq!(&a.done[0].result, &Ok(4096));
        prop_assert_eq!(dst.read(0, 4096), vec![0x3C; 4096]);
    }
}

// ---- (d) a hostile target's CHALLENGE against an initiator ----

/// What a hostile target sends first: mostly a CHALLENGE, with any fields, and what follows.
#[derive(Clone, Debug)]
struct ChallengeSpec {
    op: u8,
    flags: u8,
    rsvd: u8,
    code: u8,
    len: u64,
    mode: u32,
    nonce: [u8; 16],
    tail: Vec<u8>,
}

fn challenge_spec() -> impl Strategy<Value = ChallengeSpec> {
    (
        prop_oneof![
            8 => Just(Op::Challenge as u8),
            1 => Just(Op::Ack as u8),
            1 => Just(Op::Hello as u8),
            1 => any::<u8>(),
        ],
        prop_oneof![6 => Just(0u8), 1 => any::<u8>()],
        prop_oneof![6 => Just(0u8), 1 => any::<u8>()],
        prop_oneof![3 => Just(transport_tcp::frame::PROTOCOL_VERSION), 1 => any::<u8>()],
        prop_oneof![6 => Just(0u64), 1 => edge_u64()],
        prop_oneof![3 => Just(AUTH_NONE), 3 => Just(AUTH_TOKEN), 1 => any::<u32>()],
        any::<[u8; 16]>(),
        prop_oneof![3 => Just(Vec::new()), 1 => vec(any::<u8>(), 1..80)],
    )
        .prop_map(
            |(op, flags, rsvd, code, len, mode, nonce, tail)| ChallengeSpec {
                op,
                flags,
                rsvd,
                code,
                len,
                mode,
                nonce,
                tail,
            },
        )
}

impl ChallengeSpec {
    fn bytes(&self) -> Vec<u8> {
        let mut h = [0u8; HEADER_LEN];
        h[0] = self.op;
        h[1] = self.flags;
        h[2] = self.code;
        h[3] = self.rsvd;
        h[4..8].copy_from_slice(&self.mode.to_le_bytes());
        h[16..32].copy_from_slice(&self.nonce);
        h[32..40].copy_from_slice(&self.len.to_le_bytes());
        let mut b = h.to_vec();
        b.extend(&self.tail);
        b
    }
}

/// The CHALLENGE an initiator must take at the start of `bytes`, if there is one.
fn leading_challenge(bytes: &[u8]) -> Option<Header> {
    let raw: &[u8; HEADER_LEN] = bytes.get(..HEADER_LEN)?.try_into().ok()?;
    Header::decode(raw)
        .ok()
        .filter(|h| h.op == Op::Challenge && h.flags == 0 && h.len == 0)
}

proptest! {
    #![proptest_config(config())]

    /// Whatever a target sends first, the initiator sends nothing before a well-formed
    /// CHALLENGE, answers one with a HELLO that carries the tag of its nonce, fails the peer
    /// (reported by `peer_ready`) when the first frame is anything else, completes every
    /// posted write exactly once, and keeps serving real peers.
    #[test]
    fn hostile_challenges_fail_the_peer_cleanly(
        spec in challenge_spec(),
        muts in vec(mutation(), 0..2),
        k in 0usize..3,
        with_token in any::<bool>(),
    ) {
        let token = with_token.then_some("s3cret");
        let mut a = Node::new(TcpConfig {
            auth_token: token.map(String::from),
            ..TcpConfig::default()
        });
        let src = Canaried::new(&mut a.t, 64 * 1024, Access::NONE, 0x5A);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = format!("tcp://{}", listener.local_addr().unwrap());
        let fake_peer = a.t.add_peer(addr.as_bytes()).unwrap();
        let mut fake = Raw::from_stream(listener.accept().unwrap().0);
        let region = RemoteRegion { addr: 0, len: 1 << 20, key: RemoteKey(0xFA6E) };
        for i in 0..k as u64 {
            let dst = RemoteSlice { region, offset: i * 4096, len: 4096 };
            let r = a.t.post_write(fake_peer, WorkRequestId(i), src.local(0, 4096), dst, None).unwrap();
            prop_assert_eq!(r, PostOutcome::Posted);
        }
        let bytes = mutate(spec.bytes(), &muts);
        let challenge = leading_challenge(&bytes);
        let alone = challenge.is_some() && bytes.len() == HEADER_LEN;
        let mut mutual_hello = false;
        if let (Some(c), true) = (challenge, alone) {
            // A CHALLENGE alone: the HELLO must answer it, with the tag of its nonce where
            // both sides have a token, untagged where one side has none (toward a refusal),
            // none at all where the target cannot prove our token or names an unknown mode.
            fake.send_ok(&bytes, || a.step());
            let mutual = c.code >= MUTUAL_VERSION;
            let answers = if mutual { c.imm <= AUTH_TOKEN } else { token.is_none() };
            if answers {
                let h = fake.read_header(|| a.step());
                let version = if mutual { PROTOCOL_VERSION } else { CHALLENGE_VERSION };
                prop_assert_eq!((h.op, h.code), (Op::Hello, version));
                let nonce = transport_tcp::auth::Nonce::from_bytes(c.key_offset_bytes());
                let want = match token {
                    Some(t) if mutual && c.imm == AUTH_TOKEN => {
                        let tag = transport_tcp::auth::tag(t, HELLO_CONTEXT, &nonce);
                        tag[..16].try_into().unwrap()
                    }
                    _ => [0u8; 16],
                };
                prop_assert_eq!(h.key_offset_bytes(), want);
                if mutual {
                    prop_assert_eq!(h.imm, if token.is_some() { AUTH_TOKEN } else { AUTH_NONE });
                }
                let _ = fake.read_bytes(h.len as usize, || a.step());
                mutual_hello = mutual;
            }
        } else {
            let _ = fake.send(&bytes, || a.step());
        }
        fake.shutdown_write();
        let d = Deadline::new("the initiator to close the connection and complete the writes");
        while !fake.closed || a.done.len() < k {
            fake.pump();
            a.step();
            d.check();
        }
        for _ in 0..20 {
            a.step();
        }
        let mut seen = HashMap::new();
        for c in a.done.drain(..) {
            prop_assert_eq!(c.op, OpKind::Write);
            prop_assert!(c.wr_id.0 < k as u64);
            prop_assert!(seen.insert(c.wr_id.0, c.result.clone()).is_none(), "wr {} twice", c.wr_id.0);
            if let Ok(n) = c.result {
                prop_assert_eq!(n, 4096);
            }
        }
        prop_assert_eq!(seen.len(), k);
        if mutual_hello {
            // No PROOF came: nothing of ours but the HELLO left.
            prop_assert!(fake.rx.is_empty(), "sent before a PROOF: {:?}", &fake.rx[..fake.rx.len().min(80)]);
            prop_assert!(a.t.peer_ready(fake_peer).is_err(), "the peer did not fail");
        }
        match challenge {
            None => {
                prop_assert_eq!(fake.received, 0, "the initiator sent bytes before a CHALLENGE");
                prop_assert!(a.t.peer_ready(fake_peer).is_err(), "the peer did not fail");
            }
            // Whatever it sent (if anything: a broken tail may close the connection first)
            // begins with the HELLO (checked above when the CHALLENGE came alone).
            Some(_) if !alone && fake.rx.len() >= HEADER_LEN => {
                let h = Header::decode(fake.rx[..HEADER_LEN].try_into().unwrap());
                prop_assert!(matches!(h, Ok(Header { op: Op::Hello, .. })), "sent first: {h:?}");
            }
            Some(_) => {}
        }
        src.assert_canaries();
        drop(fake);
        // The initiator still writes to a real peer.
        let mut real = Node::new(TcpConfig {
            auth_token: token.map(String::from),
            ..TcpConfig::default()
        });
        let dst = Canaried::new(&mut real.t, 4096, Access::REMOTE_WRITE, 0);
        let peer = a.t.add_peer(&real.t.address()).unwrap();
        let r = a.t.post_write(peer, WorkRequestId(100), src.local(0, 4096), dst.remote(0, 4096), None).unwrap();
        prop_assert_eq!(r, PostOutcome::Posted);
        let d = Deadline::new("a write to a real peer");
        while a.done.is_empty() {
            a.step();
            real.step();
            d.check();
        }
        prop_assert_eq!(&a.done[0].result, &Ok(4096));
        prop_assert_eq!(dst.read(0, 4096), src.read(0, 4096));
    }
}
