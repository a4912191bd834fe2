//! Hostile clients against a TCP transport target (issue 2 "Bad input", issue 7 "Hostile
//! input"). The initiator's side (hostile or vanishing targets) is in `initiator_faults.rs`.
//!
//! A real `TcpTransport` is polled from the test thread; a raw socket speaks the wire format
//! by hand. Every case checks that the offending connection is answered with an error or
//! closed, that no byte outside the registered window changes (canaries), that nothing
//! panics, and that the transport keeps serving well-behaved peers.

mod common;

use common::{
    Answer, Deadline, Node, Raw, batch_frame, concat, frame, hello_frame, honest_write, send_frame,
    small_config, write_frame, write_header,
};
use fabric_core::testing::{Canaried, pattern};
use fabric_core::{Access, OpKind, PostOutcome, Transport, WorkRequestId};
use std::time::Duration;
use transport_tcp::frame::{HEADER_LEN, Header, MAX_BATCH, Op, code};
use transport_tcp::{FrameError, TcpConfig, TcpTransport};

const WINDOW: u64 = 64 * 1024;
const FILL: u8 = 0x11;
/// What hostile payloads carry, so that a stray landing is visible.
const EVIL: u8 = 0xEE;

/// A target with a 64 KiB window it allows remote writes into.
fn target_with_window() -> (Node, Canaried) {
    let mut t = Node::small();
    let dst = Canaried::new(&mut t.t, WINDOW, Access::REMOTE_WRITE, FILL);
    (t, dst)
}

fn assert_untouched(dst: &Canaried, what: &str) {
    assert!(
        dst.read(0, dst.len as usize).iter().all(|&b| b == FILL),
        "{what}: the registered window changed"
    );
    dst.assert_canaries();
}

/// Sends `bytes` on a fresh connection and expects the target to close it without answering
/// and without touching memory or reporting completions.
fn expect_rejected(target: &mut Node, dst: &Canaried, what: &str, bytes: &[u8]) {
    let mut c = Raw::connect(&target.t);
    // The target may close while we still write: that is the expected outcome too.
    let _ = c.send(bytes, || target.step());
    c.expect_closed(what, || target.step());
    assert_eq!(
        c.received,
        0,
        "{what}: the target answered {:?}",
        &c.rx[..c.rx.len().min(80)]
    );
    assert!(
        target.done.is_empty(),
        "{what}: completions {:?}",
        target.done
    );
    assert_untouched(dst, what);
}

// 1. Random bytes (and well-formed frames) before HELLO.
#[test]
fn bytes_before_hello_close_the_connection() {
    let (mut target, dst) = target_with_window();
    let key = dst.reg.remote.key.0;
    let mut noise = pattern(1, 4096);
    noise[0] = 0xEE; // no HELLO by chance
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("4 KiB of random bytes", noise),
        (
            "a valid WRITE with imm before HELLO",
            write_frame(key, 0, &[EVIL; 4096], Some(1), 1),
        ),
        (
            "a valid BATCH before HELLO",
            batch_frame(&[(write_header(key, 0, 100, None, 1), vec![EVIL; 100])]),
        ),
        ("a SEND before HELLO", send_frame(&[EVIL; 100], None, 1)),
        ("an ACK before HELLO", frame(Header::new(Op::Ack, 1), &[])),
        ("a NACK before HELLO", frame(Header::new(Op::Nack, 0), &[])),
    ];
    for (what, bytes) in &cases {
        expect_rejected(&mut target, &dst, what, bytes);
    }
    honest_write(&mut target, &dst, 0, 4096, 9);
}

/// Every op this build defines. The match below stops compiling when a kind is added, so
/// that the list is brought up to date instead of letting a test send a defined op as an
/// unknown one (7 was "unknown" in a test until it became READ in protocol 3).
const DEFINED_OPS: [Op; 10] = [
    Op::Hello,
    Op::Write,
    Op::Send,
    Op::Ack,
    Op::Nack,
    Op::Batch,
    Op::Read,
    Op::ReadReply,
    Op::Challenge,
    Op::Proof,
];

/// Where `op` is in [`DEFINED_OPS`] (exhaustive: see there).
fn defined_index(op: Op) -> usize {
    match op {
        Op::Hello => 0,
        Op::Write => 1,
        Op::Send => 2,
        Op::Ack => 3,
        Op::Nack => 4,
        Op::Batch => 5,
        Op::Read => 6,
        Op::ReadReply => 7,
        Op::Challenge => 8,
        Op::Proof => 9,
    }
}

/// Every op byte that names no frame kind, each checked against the decoder: the bytes of
/// [`DEFINED_OPS`] decode to their op, every other byte is refused as unknown.
fn unknown_ops() -> Vec<u8> {
    for (i, op) in DEFINED_OPS.iter().enumerate() {
        assert_eq!(defined_index(*op), i, "DEFINED_OPS is out of order");
    }
    let mut header = Header::new(Op::Ack, 0).encode();
    let unknown: Vec<u8> = (0..=u8::MAX)
        .filter(|&v| {
            header[0] = v;
            match Header::decode(&header) {
                Ok(h) => {
                    assert_eq!(h.op as u8, v);
                    assert!(DEFINED_OPS.contains(&h.op), "{:?} is not listed", h.op);
                    false
                }
                Err(e) => {
                    assert_eq!(e, FrameError::UnknownOp(v));
                    true
                }
            }
        })
        .collect();
    assert_eq!(unknown.len(), 256 - DEFINED_OPS.len());
    unknown
}

// 2. Malformed headers after HELLO; the frames behind them are never acted on. Every op
// byte that is not a defined op is one of them.
#[test]
fn malformed_headers_after_hello_close_the_connection() {
    let (mut target, dst) = target_with_window();
    let key = dst.reg.remote.key.0;
    let valid = write_header(key, 0, 16, Some(7), 1).encode();
    let with = |i: usize, v: u8| {
        let mut b = valid;
        b[i] = v;
        b
    };
    let short_hello = {
        let p = [0u8; 11];
        frame(Header::new(Op::Hello, 11), &p)
    };
    let long_hello = frame(Header::new(Op::Hello, 4097), &[0u8; 4097]);
    let unknown = unknown_ops();
    let names: Vec<String> = unknown.iter().map(|v| format!("op {v}")).collect();
    let mut cases: Vec<(&str, Vec<u8>, bool)> = names
        .iter()
        .zip(&unknown)
        .map(|(what, &v)| (what.as_str(), with(0, v).to_vec(), true))
        .collect();
    cases.extend(vec![
        ("flags 0x04", with(1, 0x04).to_vec(), true),
        ("flags 0x80", with(1, 0x80).to_vec(), true),
        ("reserved byte 1", with(3, 1).to_vec(), true),
        ("reserved byte 0xff", with(3, 0xff).to_vec(), true),
        ("a second HELLO", hello_frame(), true),
        (
            "an ACK with nothing outstanding",
            frame(Header::new(Op::Ack, 1), &[]),
            true,
        ),
        (
            "a NACK with nothing outstanding",
            frame(Header::new(Op::Nack, 0), &[]),
            true,
        ),
        ("a HELLO of 11 bytes", short_hello, false),
        ("a HELLO of 4097 bytes", long_hello, false),
    ]);
    for (what, bad, after_hello) in &cases {
        // A valid WRITE follows the bad frame: it must not land.
        let behind = write_frame(key, 0, &[EVIL; 16], Some(2), 2);
        let bytes = if *after_hello {
            concat(&[&hello_frame(), bad, &behind])
        } else {
            concat(&[bad, &behind])
        };
        expect_rejected(&mut target, &dst, what, &bytes);
    }
    honest_write(&mut target, &dst, 100, 1000, 10);
}

// 3. Absurd length fields.
#[test]
fn huge_length_fields_close_the_connection() {
    let mut target = Node::small();
    let max = small_config().max_msg_size;
    let dst = Canaried::new(&mut target.t, max, Access::REMOTE_WRITE, FILL);
    let key = dst.reg.remote.key.0;
    let h = |len: u64| write_header(key, 0, len, Some(3), 1);
    let mut send_max = Header::new(Op::Send, u64::MAX);
    send_max.wr_id = 1;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("WRITE of u64::MAX bytes", frame(h(u64::MAX), &[EVIL; 64])),
        (
            "WRITE of max_msg_size + 1 bytes",
            frame(h(max + 1), &[EVIL; 4096]),
        ),
        ("SEND of u64::MAX bytes", frame(send_max, &[EVIL; 64])),
        (
            "SEND of max_msg_size + 1 bytes",
            frame(Header::new(Op::Send, max + 1), &[EVIL; 64]),
        ),
        (
            "BATCH entry of u64::MAX bytes",
            batch_frame(&[(h(u64::MAX), vec![EVIL; 64])]),
        ),
        (
            "BATCH of a valid entry, then one of max_msg_size + 1 bytes",
            batch_frame(&[(h(100), vec![EVIL; 100]), (h(max + 1), vec![EVIL; 64])]),
        ),
    ];
    for (what, bad) in &cases {
        expect_rejected(&mut target, &dst, what, &concat(&[&hello_frame(), bad]));
    }
    expect_rejected(
        &mut target,
        &dst,
        "HELLO of u64::MAX bytes",
        &frame(Header::new(Op::Hello, u64::MAX), &[0; 64]),
    );
    // Control: exactly max_msg_size is a valid WRITE.
    let mut c = Raw::connect(&target.t);
    let data = pattern(4, max as usize);
    c.send_ok(
        &concat(&[&hello_frame(), &write_frame(key, 0, &data, None, 5)]),
        || target.step(),
    );
    assert_eq!(c.answers(1, || target.step()), vec![Answer::Ack]);
    assert!(
        dst.read(0, max as usize) == data,
        "the largest WRITE landed"
    );
    dst.assert_canaries();
}

// 4. Batch counts and batch contents the target must refuse.
#[test]
fn absurd_batches_close_the_connection() {
    let (mut target, dst) = target_with_window();
    let key = dst.reg.remote.key.0;
    let good = (write_header(key, 0, 100, Some(1), 1), vec![EVIL; 100]);
    let count = |n: u64| frame(Header::new(Op::Batch, n), &[]);
    let entries_of = |bad: Header| {
        let mut v = Header::new(Op::Batch, 2).encode().to_vec();
        v.extend_from_slice(&good.0.encode());
        v.extend_from_slice(&bad.encode());
        v.extend_from_slice(&good.1);
        v
    };
    let mut malformed = good.0.encode();
    malformed[3] = 1;
    let mut nested = Header::new(Op::Batch, 1);
    nested.wr_id = 2;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("BATCH of 0", count(0)),
        ("BATCH of MAX_BATCH + 1", count(MAX_BATCH as u64 + 1)),
        ("BATCH of 100000", count(100_000)),
        ("BATCH of u64::MAX", count(u64::MAX)),
        (
            "BATCH of 100000 followed by WRITE headers",
            concat(&[&count(100_000), &good.0.encode().repeat(300)]),
        ),
        (
            "BATCH with a SEND entry",
            entries_of(Header::new(Op::Send, 0)),
        ),
        (
            "BATCH with a HELLO entry",
            entries_of(Header::new(Op::Hello, 12)),
        ),
        (
            "BATCH with an ACK entry",
            entries_of(Header::new(Op::Ack, 0)),
        ),
        ("BATCH with a BATCH entry", entries_of(nested)),
        ("BATCH with a malformed entry", {
            let mut v = Header::new(Op::Batch, 2).encode().to_vec();
            v.extend_from_slice(&good.0.encode());
            v.extend_from_slice(&malformed);
            v.extend_from_slice(&good.1);
            v
        }),
    ];
    for (what, bad) in &cases {
        expect_rejected(&mut target, &dst, what, &concat(&[&hello_frame(), bad]));
    }
    // Control: a batch of exactly MAX_BATCH writes is answered, every one.
    let mut c = Raw::connect(&target.t);
    let entries: Vec<(Header, Vec<u8>)> = (0..MAX_BATCH as u64)
        .map(|i| (write_header(key, i * 16, 16, None, i), vec![i as u8; 16]))
        .collect();
    c.send_ok(&concat(&[&hello_frame(), &batch_frame(&entries)]), || {
        target.step()
    });
    assert_eq!(
        c.answers(MAX_BATCH, || target.step()),
        vec![Answer::Ack; MAX_BATCH]
    );
    for i in 0..MAX_BATCH as u64 {
        assert_eq!(dst.read(i * 16, 16), vec![i as u8; 16]);
    }
    dst.assert_canaries();
}

/// Sends `bytes`, half-closes, and expects the target to drop the connection
/// without answering or reporting anything; bytes of the window other than `may_land` keep
/// their fill, and those may only hold a prefix of the payload byte `EVIL`.
fn truncated(target: &mut Node, dst: &Canaried, what: &str, bytes: &[u8], may_land: (u64, u64)) {
    truncated_with(target, dst, what, bytes, may_land, &[]);
}

/// As [`truncated`], where the complete writes in front of the cut report `imms`.
fn truncated_with(
    target: &mut Node,
    dst: &Canaried,
    what: &str,
    bytes: &[u8],
    may_land: (u64, u64),
    imms: &[u32],
) {
    dst.write(0, &vec![FILL; dst.len as usize]);
    let mut c = Raw::connect(&target.t);
    c.send_ok(bytes, || target.step());
    c.shutdown_write();
    c.expect_closed(what, || target.step());
    // What the target answered before it saw the cut: ACKs of complete writes at most
    // (it may send them before it reads the end of the stream), never an answer to the
    // incomplete one.
    assert_eq!(
        c.rx.len() % HEADER_LEN,
        0,
        "{what}: a partial answer {:?}",
        c.rx
    );
    let acked: u64 =
        c.rx.chunks(HEADER_LEN)
            .map(|b| {
                let h = Header::decode(b.try_into().expect("header length")).expect("an answer");
                assert_eq!(h.op, Op::Ack, "{what}: the target answered {h:?}");
                h.len
            })
            .sum();
    assert!(
        acked <= imms.len() as u64,
        "{what}: {acked} requests acknowledged, {} complete",
        imms.len()
    );
    let done: Vec<_> = target.done.drain(..).collect();
    assert!(
        done.iter()
            .all(|c| c.op == OpKind::RemoteWrite && c.result.is_ok()),
        "{what}: {done:?}"
    );
    assert_eq!(
        done.iter().map(|c| c.imm).collect::<Vec<_>>(),
        imms.iter().map(|&v| Some(v)).collect::<Vec<_>>(),
        "{what}: only complete writes report imm"
    );
    let now = dst.read(0, dst.len as usize);
    let (lo, hi) = may_land;
    for (i, &b) in now.iter().enumerate() {
        let i = i as u64;
        if i >= lo && i < hi {
            assert!(b == FILL || b == EVIL, "{what}: byte {i} is {b:#x}");
        } else {
            assert_eq!(b, FILL, "{what}: byte {i} outside the write changed");
        }
    }
    dst.assert_canaries();
}

// 5. Truncated frames, then the client goes away.
#[test]
fn truncated_frames_produce_nothing() {
    let (mut target, dst) = target_with_window();
    let key = dst.reg.remote.key.0;
    let none = (0, 0);
    let zero_imm = write_header(key, 10, 0, Some(1), 1).encode();
    let mut send_imm = Header::new(Op::Send, 1000);
    send_imm.flags = transport_tcp::frame::FLAG_IMM;
    let cases: Vec<(&str, Vec<u8>, (u64, u64))> = vec![
        (
            "half a WRITE header",
            write_header(key, 0, 100, None, 1).encode()[..20].to_vec(),
            none,
        ),
        (
            "39 bytes of a zero-length WRITE header with imm",
            zero_imm[..HEADER_LEN - 1].to_vec(),
            none,
        ),
        (
            "WRITE with imm, half its payload",
            frame(write_header(key, 1000, 1000, Some(2), 2), &[EVIL; 500]),
            (1000, 2000),
        ),
        (
            "WRITE of 64 KiB with imm (read straight into place), part of its payload",
            frame(write_header(key, 0, WINDOW, Some(3), 3), &[EVIL; 40_000]),
            (0, WINDOW),
        ),
        (
            "BATCH of 3 zero-length imm WRITEs with only 2 headers",
            concat(&[&Header::new(Op::Batch, 3).encode(), &zero_imm, &zero_imm]),
            none,
        ),
        (
            "BATCH: imm WRITE with half its payload, then a zero-length imm WRITE",
            concat(&[
                &Header::new(Op::Batch, 2).encode(),
                &write_header(key, 0, 1000, Some(4), 4).encode(),
                &write_header(key, 5000, 0, Some(5), 5).encode(),
                &[EVIL; 500],
            ]),
            (0, 1000),
        ),
        (
            "BATCH of two 32 KiB imm WRITEs (one readv), part of the first payload",
            concat(&[
                &Header::new(Op::Batch, 2).encode(),
                &write_header(key, 0, 32768, Some(6), 6).encode(),
                &write_header(key, 32768, 32768, Some(7), 7).encode(),
                &[EVIL; 20_000],
            ]),
            (0, WINDOW),
        ),
        (
            "SEND with imm, part of its payload, no receive posted",
            frame(send_imm, &[EVIL; 10]),
            none,
        ),
    ];
    for (what, bytes, may_land) in &cases {
        let bytes = concat(&[&hello_frame(), bytes]);
        truncated(&mut target, &dst, what, &bytes, *may_land);
    }
    // The first write of a batch is complete, the second is not: only the first reports.
    truncated_with(
        &mut target,
        &dst,
        "BATCH of two 32 KiB imm WRITEs, part of the second payload",
        &concat(&[
            &hello_frame(),
            &Header::new(Op::Batch, 2).encode(),
            &write_header(key, 0, 32768, Some(6), 6).encode(),
            &write_header(key, 32768, 32768, Some(7), 7).encode(),
            &[EVIL; 40_000],
        ]),
        (0, WINDOW),
        &[6],
    );
    assert_eq!(
        dst.read(0, 32768),
        vec![EVIL; 32768],
        "the complete write landed"
    );
    let hello = hello_frame();
    truncated(
        &mut target,
        &dst,
        "half a HELLO",
        &hello[..HEADER_LEN + 5],
        none,
    );
    truncated(&mut target, &dst, "half a HELLO header", &hello[..20], none);
    honest_write(&mut target, &dst, 0, WINDOW, 11);
}

// 5b. A SEND cut short must not swallow the receive it was matched with.
#[test]
fn truncated_send_does_not_swallow_a_posted_receive() {
    let mut target = Node::small();
    let rbuf = Canaried::new(&mut target.t, 4096, Access::LOCAL_WRITE, FILL);
    assert_eq!(
        target
            .t
            .post_recv(WorkRequestId(5), rbuf.local(0, 4096))
            .unwrap(),
        PostOutcome::Posted
    );
    let mut c = Raw::connect(&target.t);
    c.send_ok(
        &concat(&[
            &hello_frame(),
            &frame(Header::new(Op::Send, 1000), &[EVIL; 10]),
        ]),
        || target.step(),
    );
    c.shutdown_write();
    c.expect_closed("a truncated SEND", || target.step());
    rbuf.assert_canaries();
    // An honest SEND follows. The receive must complete exactly once: with an error for
    // the cut message, or with the honest message.
    let mut a = Node::new(TcpConfig::default());
    let src = Canaried::new(&mut a.t, 100, Access::NONE, 0x42);
    let peer = a.t.add_peer(&target.t.address()).unwrap();
    let _ =
        a.t.post_send(peer, WorkRequestId(1), src.local(0, 100), None)
            .unwrap();
    let d = Deadline::within(Duration::from_secs(3), "the posted receive to complete");
    while !target.done.iter().any(|c| c.op == OpKind::Recv) {
        assert!(
            !d.passed(),
            "receive 5 never completed: the cut SEND took it and nothing gave it back \
             (target completions {:?}, sender completions {:?})",
            target.done,
            a.done
        );
        a.step();
        target.step();
    }
    let r = target
        .done
        .iter()
        .find(|c| c.op == OpKind::Recv)
        .unwrap()
        .clone();
    assert_eq!(r.wr_id, WorkRequestId(5));
    if r.result.is_ok() {
        assert_eq!(r.result, Ok(100));
        assert_eq!(rbuf.read(0, 100), vec![0x42; 100]);
    }
    rbuf.assert_canaries();
}

// 5c. A SEND cut short must give back the room it took in the early-arrival queue.
#[test]
fn truncated_send_gives_back_its_early_arrival_room() {
    let cfg = TcpConfig {
        max_msg_size: 1 << 20,
        max_unexpected_bytes: 1 << 20,
        max_unexpected_count: 16,
        ..TcpConfig::default()
    };
    let mut target = Node::new(cfg);
    let rbuf = Canaried::new(&mut target.t, 4096, Access::LOCAL_WRITE, FILL);
    // Claims the whole early-arrival budget, sends 10 bytes, leaves.
    let mut c = Raw::connect(&target.t);
    c.send_ok(
        &concat(&[
            &hello_frame(),
            &frame(Header::new(Op::Send, 1 << 20), &[EVIL; 10]),
        ]),
        || target.step(),
    );
    c.shutdown_write();
    c.expect_closed("a truncated SEND of 1 MiB", || target.step());
    // An honest 100-byte SEND with no receive posted must be taken into the (now empty)
    // early-arrival queue and acknowledged.
    let mut a = Node::new(TcpConfig::default());
    let src = Canaried::new(&mut a.t, 100, Access::NONE, 0x42);
    let peer = a.t.add_peer(&target.t.address()).unwrap();
    let _ =
        a.t.post_send(peer, WorkRequestId(1), src.local(0, 100), None)
            .unwrap();
    let d = Deadline::within(Duration::from_secs(3), "the honest SEND to be taken");
    let mut stuck = false;
    while a.done.is_empty() {
        if d.passed() {
            stuck = true;
            break;
        }
        a.step();
        target.step();
    }
    // Show that a receive unblocks it, so the only cause is the lost room.
    let _ = target.t.post_recv(WorkRequestId(9), rbuf.local(0, 4096));
    let d = Deadline::new("the SEND once a receive is posted");
    while a.done.is_empty() {
        d.check();
        a.step();
        target.step();
    }
    assert_eq!(a.done[0].result, Ok(100));
    assert!(
        !stuck,
        "the honest SEND waited for a receive although the early-arrival queue was empty: \
         the cut SEND's 1 MiB is still counted"
    );
}

// 6. Invalid WRITEs are NACKed with their cause; the connection stays usable.
#[test]
fn invalid_writes_are_nacked_and_the_connection_stays_usable() {
    let (mut target, dst) = target_with_window();
    let key = dst.reg.remote.key.0;
    let nowrite = Canaried::new(
        &mut target.t,
        4096,
        Access::LOCAL_WRITE | Access::REMOTE_READ,
        FILL,
    );
    let gone = Canaried::new(&mut target.t, 4096, Access::REMOTE_WRITE, FILL);
    let gone_key = gone.reg.remote.key.0;
    target.t.deregister(gone.reg.local).unwrap();
    let bogus = key ^ 0x5A5A_0000_0001;
    struct Bad {
        what: &'static str,
        key: u64,
        offset: u64,
        len: u64,
        code: u8,
    }
    let bad = |what, key, offset, len, code| Bad {
        what,
        key,
        offset,
        len,
        code,
    };
    let cases = [
        bad("straddles the end", key, WINDOW - 10, 100, code::BOUNDS),
        bad("starts at the end", key, WINDOW, 1, code::BOUNDS),
        bad("zero bytes past the end", key, WINDOW + 1, 0, code::BOUNDS),
        bad(
            "offset + len overflows",
            key,
            u64::MAX - 10,
            100,
            code::BOUNDS,
        ),
        bad("offset u64::MAX", key, u64::MAX, 1, code::BOUNDS),
        bad("unknown key", bogus, 0, 100, code::KEY),
        bad("key 0", 0, 0, 100, code::KEY),
        bad("unknown key, zero bytes", bogus, 0, 0, code::KEY),
        bad(
            "no REMOTE_WRITE",
            nowrite.reg.remote.key.0,
            0,
            100,
            code::PERMISSION,
        ),
        bad("deregistered key", gone_key, 0, 100, code::KEY),
        bad("unknown key, 64 KiB payload", bogus, 0, WINDOW, code::KEY),
    ];
    let mut c = Raw::connect(&target.t);
    c.send_ok(&hello_frame(), || target.step());
    let mut model = vec![FILL; WINDOW as usize];
    let mut imms = Vec::new();
    for (i, b) in cases.iter().enumerate() {
        let i = i as u64;
        let wr = 100 + i;
        let payload = vec![EVIL; b.len.min(1 << 20) as usize];
        // The bad WRITE carries imm: a rejected write must not report it.
        let bad_frame = write_frame(b.key, b.offset, &payload, Some(0xBAD), wr);
        let good = pattern(i, 100);
        let good_frame = write_frame(key, i * 100, &good, Some(i as u32), wr + 1000);
        c.send_ok(&concat(&[&bad_frame, &good_frame]), || target.step());
        let answers = c.answers(2, || target.step());
        let h = answers[0].nack(b.code, b.what);
        assert_eq!(h.wr_id, wr, "{}: NACK names the request", b.what);
        match b.code {
            code::KEY => assert_eq!(h.key, b.key, "{}: NACK names the key", b.what),
            code::BOUNDS => {
                assert_eq!(
                    (h.offset, h.len, h.key),
                    (b.offset, b.len, WINDOW),
                    "{}: NACK names the range and the region's length",
                    b.what
                );
            }
            _ => {}
        }
        assert_eq!(answers[1], Answer::Ack, "{}: the next WRITE works", b.what);
        model[(i * 100) as usize..(i * 100 + 100) as usize].copy_from_slice(&good);
        imms.push(i as u32);
    }
    // Edge: zero bytes at the very end is in bounds.
    c.send_ok(&write_frame(key, WINDOW, &[], None, 1), || target.step());
    assert_eq!(c.answers(1, || target.step()), vec![Answer::Ack]);
    target.until("imm of every valid write", |t| {
        t.remote_writes().len() >= imms.len()
    });
    let got: Vec<_> = target.remote_writes().iter().map(|c| c.imm).collect();
    assert_eq!(
        got,
        imms.iter().map(|&v| Some(v)).collect::<Vec<_>>(),
        "only valid writes report imm, in order"
    );
    assert!(dst.read(0, WINDOW as usize) == model, "window differs");
    dst.assert_canaries();
    assert_untouched(&nowrite, "no REMOTE_WRITE");
    assert_untouched(&gone, "deregistered");
}

/// A batch entry: key, offset, len, imm, and the NACK code expected (`None`: ACK).
type Entry = (u64, u64, u64, Option<u32>, Option<u8>);

// 7. One BATCH mixing valid and invalid entries: each request gets its own answer, in order.
#[test]
fn mixed_batch_answers_each_entry_in_order() {
    let (mut target, dst) = target_with_window();
    let key = dst.reg.remote.key.0;
    let nowrite = Canaried::new(&mut target.t, 4096, Access::LOCAL_WRITE, FILL);
    let gone = Canaried::new(&mut target.t, 4096, Access::REMOTE_WRITE, FILL);
    let gone_key = gone.reg.remote.key.0;
    target.t.deregister(gone.reg.local).unwrap();
    let spec: Vec<Entry> = vec![
        (key, 0, 100, Some(100), None),
        (key ^ 1, 0, 100, Some(101), Some(code::KEY)),
        (key, 1000, 10_000, None, None),
        (key, WINDOW, 0, Some(103), None),
        (key, 50_000, 20_000, Some(104), Some(code::BOUNDS)),
        (
            nowrite.reg.remote.key.0,
            0,
            50,
            None,
            Some(code::PERMISSION),
        ),
        (key, 20_000, 16, None, None),
        (key, u64::MAX - 5, 10, None, Some(code::BOUNDS)),
        (gone_key, 0, 0, Some(108), Some(code::KEY)),
        (key, 30_000, 30_000, Some(109), None),
        (key ^ 2, 0, 8192, None, Some(code::KEY)),
        (key, 62_000, 3536, None, None),
    ];
    let mut model = vec![FILL; WINDOW as usize];
    let mut expected = Vec::new();
    let mut imms = Vec::new();
    let mut bytes = hello_frame();
    for round in 0..3u64 {
        let entries: Vec<(Header, Vec<u8>)> = spec
            .iter()
            .enumerate()
            .map(|(i, &(k, off, len, imm, _))| {
                let wr = round * 1000 + i as u64;
                (
                    write_header(k, off, len, imm, wr),
                    pattern(wr, len as usize),
                )
            })
            .collect();
        for (i, &(_, off, len, imm, fail)) in spec.iter().enumerate() {
            let wr = round * 1000 + i as u64;
            match fail {
                None => {
                    model[off as usize..(off + len) as usize]
                        .copy_from_slice(&pattern(wr, len as usize));
                    imms.extend(imm);
                    expected.push((wr, None));
                }
                Some(c) => expected.push((wr, Some(c))),
            }
        }
        bytes.extend(batch_frame(&entries));
    }
    let mut c = Raw::connect(&target.t);
    c.send_ok(&bytes, || target.step());
    let answers = c.answers(expected.len(), || target.step());
    for (i, (a, &(wr, fail))) in answers.iter().zip(&expected).enumerate() {
        match fail {
            None => assert_eq!(*a, Answer::Ack, "request {i} (wr {wr})"),
            Some(code) => {
                let h = a.nack(code, &format!("request {i}"));
                assert_eq!(h.wr_id, wr, "request {i}: NACK for another request");
            }
        }
    }
    target.until("imm of every valid write", |t| {
        t.remote_writes().len() >= imms.len()
    });
    let got: Vec<_> = target.remote_writes().iter().map(|c| c.imm).collect();
    assert_eq!(got, imms.iter().map(|&v| Some(v)).collect::<Vec<_>>());
    assert!(dst.read(0, WINDOW as usize) == model, "window differs");
    dst.assert_canaries();
    assert_untouched(&nowrite, "no REMOTE_WRITE");
    assert_untouched(&gone, "deregistered");
}

// 8. A SEND flood with no receive posted back-pressures the connection, then drains in order.
#[test]
fn send_flood_back_pressures_then_drains_in_order() {
    const MSG: usize = 32 * 1024;
    const COUNT: u64 = 256; // 8 MiB in all
    const QUEUE: usize = 16;
    let cfg = TcpConfig {
        max_unexpected_bytes: 1 << 20,
        max_unexpected_count: QUEUE,
        socket_buffer: Some(64 * 1024),
        ..small_config()
    };
    let mut target = Node::new(cfg);
    let mut stream = hello_frame();
    for seq in 0..COUNT {
        stream.extend(send_frame(&pattern(seq, MSG), Some(seq as u32), seq));
    }
    let mut c = Raw::connect_with(target.t.local_addr(), Some(64 * 1024));
    let mut sent = 0;
    let mut acked = 0u64;
    // Phase 1: no receive posted. Write until the target has not read anything for 200
    // rounds of progress in a row.
    let d = Deadline::new("back-pressure");
    let mut stalled = 0;
    while stalled < 200 {
        let n = c
            .try_write(&stream[sent..])
            .expect("target closed the flood");
        sent += n;
        stalled = if n == 0 { stalled + 1 } else { 0 };
        assert!(
            sent < stream.len(),
            "all {} MiB went through with no receive posted",
            stream.len() >> 20
        );
        target.step();
        c.pump();
        acked += drain_acks(&mut c);
        d.check();
    }
    assert!(
        acked <= QUEUE as u64,
        "{acked} SENDs acknowledged with room for {QUEUE}"
    );
    assert!(
        target.done.is_empty(),
        "completions without a receive: {:?}",
        target.done
    );
    eprintln!(
        "flood blocked after {} KiB written, {acked} SENDs queued",
        sent >> 10
    );
    // Phase 2: receives for every message drain the queue, then the rest of the flood, in
    // order. (Receives posted one by one while messages arrive: see
    // `a_send_buffered_while_a_receive_is_posted_keeps_its_place`.)
    let slots = Canaried::new(&mut target.t, COUNT * MSG as u64, Access::LOCAL_WRITE, FILL);
    for seq in 0..COUNT {
        let r = target
            .t
            .post_recv(
                WorkRequestId(seq),
                slots.local(seq * MSG as u64, MSG as u64),
            )
            .unwrap();
        assert_eq!(r, PostOutcome::Posted);
    }
    let mut next = 0u64;
    let d = Deadline::new("the flood to drain");
    while next < COUNT || acked < COUNT {
        let n = c
            .try_write(&stream[sent..])
            .expect("target closed the flood");
        sent += n;
        target.step();
        for r in std::mem::take(&mut target.done) {
            assert_eq!(r.op, OpKind::Recv);
            assert_eq!(r.wr_id, WorkRequestId(next), "receives complete in order");
            assert_eq!(r.result, Ok(MSG as u64));
            assert_eq!(r.imm, Some(next as u32), "message {next} in its receive");
            assert!(
                slots.read(next * MSG as u64, MSG) == pattern(next, MSG),
                "message {next} content"
            );
            next += 1;
        }
        c.pump();
        acked += drain_acks(&mut c);
        d.check();
    }
    assert_eq!(acked, COUNT);
    slots.assert_canaries();
}

// 8a. A SEND still being buffered as an early arrival when a receive is posted: it must go
// to that receive, ahead of the SENDs behind it.
#[test]
fn a_send_buffered_while_a_receive_is_posted_keeps_its_place() {
    let mut target = Node::small();
    let rbuf = Canaried::new(&mut target.t, 8192, Access::LOCAL_WRITE, FILL);
    let a = send_frame(&[0xA1; 4096], Some(1), 1);
    let b = send_frame(&[0xB2; 100], Some(2), 2);
    let half = HEADER_LEN + 2048;
    let mut c = Raw::connect(&target.t);
    // A's header and half its payload: with no receive posted, A is being buffered.
    c.send_ok(&concat(&[&hello_frame(), &a[..half]]), || target.step());
    for _ in 0..10 {
        target.step();
    }
    let post = |t: &mut TcpTransport, wr: u64| {
        let r = t
            .post_recv(WorkRequestId(wr), rbuf.local((wr - 1) * 4096, 4096))
            .unwrap();
        assert_eq!(r, PostOutcome::Posted);
    };
    post(&mut target.t, 1);
    c.send_ok(&concat(&[&a[half..], &b]), || target.step());
    for _ in 0..10 {
        target.step();
    }
    post(&mut target.t, 2);
    let d = Deadline::within(Duration::from_secs(3), "two receives");
    while target.done.len() < 2 && !d.passed() {
        target.step();
    }
    let got: Vec<_> = target
        .done
        .iter()
        .map(|r| (r.wr_id.0, r.result.clone(), r.imm))
        .collect();
    assert_eq!(
        got,
        vec![(1, Ok(4096), Some(1)), (2, Ok(100), Some(2))],
        "receive 1 gets SEND A, receive 2 gets SEND B"
    );
    assert_eq!(rbuf.read(0, 4096), vec![0xA1; 4096]);
    assert_eq!(rbuf.read(4096, 100), vec![0xB2; 100]);
    rbuf.assert_canaries();
}

/// Consumes buffered ACK headers and returns how many requests they answer.
fn drain_acks(c: &mut Raw) -> u64 {
    let mut n = 0;
    while c.rx.len() >= HEADER_LEN {
        let b: Vec<u8> = c.rx.drain(..HEADER_LEN).collect();
        let h = Header::decode(b[..].try_into().unwrap()).unwrap();
        assert_eq!(h.op, Op::Ack, "{h:?}");
        n += h.len;
    }
    n
}

// 8b. A client that never reads its answers must not grow the target's memory without
// bound: the target stops reading it once its answers pile up.
#[test]
fn answers_to_a_client_that_never_reads_are_bounded() {
    let mut target = Node::new(TcpConfig {
        socket_buffer: Some(64 * 1024),
        ..small_config()
    });
    let _dst = Canaried::new(&mut target.t, 4096, Access::REMOTE_WRITE, FILL);
    let mut c = Raw::connect_with(target.t.local_addr(), Some(64 * 1024));
    c.send_ok(&hello_frame(), || target.step());
    // 40-byte WRITEs with an unknown key: each is answered by its own 40-byte NACK.
    let chunk = write_header(1, 0, 0, None, 1).encode().repeat(4096);
    let limit = 32usize << 20;
    let mut sent = 0usize;
    let mut stalled = 0;
    let d = Deadline::new("back-pressure on a client that never reads");
    while stalled < 200 {
        let off = sent % chunk.len();
        let n = c.try_write(&chunk[off..]).expect("target closed");
        sent += n;
        stalled = if n == 0 { stalled + 1 } else { 0 };
        assert!(
            sent < limit,
            "the target read {} MiB of requests without our reading a single answer: \
             their NACKs are all queued in its memory",
            sent >> 20
        );
        target.step();
        d.check();
    }
}

// A connection that never says HELLO is closed after the peer timeout, not kept forever.
#[test]
fn a_silent_connection_is_closed_after_the_peer_timeout() {
    let mut target = Node::new(TcpConfig {
        peer_timeout: Duration::from_millis(200),
        ..small_config()
    });
    let dst = Canaried::new(&mut target.t, WINDOW, Access::REMOTE_WRITE, FILL);
    let mut c = Raw::connect(&target.t);
    c.expect_closed("a connection without HELLO", || target.step());
    honest_write(&mut target, &dst, 0, WINDOW, 21);
}

// Overlapping destinations inside one batch land in order (last writer wins), read by one
// `readv` or across several.
#[test]
fn overlapping_batch_entries_land_in_order() {
    let mut target = Node::small();
    let dst = Canaried::new(&mut target.t, WINDOW, Access::REMOTE_WRITE, FILL);
    let key = dst.reg.remote.key.0;
    let first = pattern(1, 8192);
    let second = pattern(2, 8192);
    let mut c = Raw::connect(&target.t);
    let batch = batch_frame(&[
        (write_header(key, 0, 8192, None, 1), first.clone()),
        (write_header(key, 4096, 8192, None, 2), second.clone()),
    ]);
    c.send_ok(&concat(&[&hello_frame(), &batch]), || target.step());
    let answers = c.answers(2, || target.step());
    assert_eq!(answers, vec![Answer::Ack, Answer::Ack]);
    assert_eq!(dst.read(0, 4096), first[..4096]);
    assert_eq!(dst.read(4096, 8192), second);
    dst.assert_canaries();
}

// A batch holds the regions its entries write into until every entry has landed: a region
// deregistered (and dropped by its owner) while an entry is half received still takes the
// rest of that entry's bytes, and is let go of once the batch is done.
#[test]
fn a_batch_holds_its_regions_until_it_is_done() {
    let mut target = Node::small();
    let outer = fabric_core::HostBuffer::new_shared(3 * WINDOW as usize).unwrap();
    outer.fill(0, 3 * WINDOW, FILL).unwrap();
    let window: std::sync::Arc<dyn fabric_core::MemoryRegion> =
        std::sync::Arc::new(fabric_core::SubRegion::new(outer.clone(), WINDOW, WINDOW).unwrap());
    let weak = std::sync::Arc::downgrade(&window);
    let reg = target.t.register(window, Access::REMOTE_WRITE).unwrap();
    let key = reg.remote.key.0;
    let first = pattern(3, 4096);
    let second = pattern(4, 8192);
    let batch = batch_frame(&[
        (write_header(key, 0, 4096, None, 1), first.clone()),
        (write_header(key, 4096, 8192, None, 2), second.clone()),
    ]);
    // Everything up to half of the second entry's payload.
    let cut = batch.len() - 4096;
    let mut c = Raw::connect(&target.t);
    c.send_ok(&concat(&[&hello_frame(), &batch[..cut]]), || target.step());
    // The first entry landed (its ACK came): the target is inside the second one.
    assert_eq!(c.answers(1, || target.step()), vec![Answer::Ack]);
    target.t.deregister(reg.local).unwrap();
    assert!(
        weak.upgrade().is_some(),
        "a half-received batch let go of its region"
    );
    c.send_ok(&batch[cut..], || target.step());
    assert_eq!(c.answers(1, || target.step()), vec![Answer::Ack]);
    assert_eq!(outer.to_vec(WINDOW, 4096).unwrap(), first);
    assert_eq!(outer.to_vec(WINDOW + 4096, 8192).unwrap(), second);
    // Nothing outside the window changed.
    assert!(
        outer
            .to_vec(0, WINDOW as usize)
            .unwrap()
            .iter()
            .all(|&b| b == FILL)
    );
    assert!(
        outer
            .to_vec(WINDOW + 12288, (2 * WINDOW - 12288) as usize)
            .unwrap()
            .iter()
            .all(|&b| b == FILL)
    );
    assert!(
        weak.upgrade().is_none(),
        "the region is still held after its batch"
    );
}

// 9. Frames that arrive with the HELLO (in the same read) report the peer the HELLO names,
// not a placeholder id.
#[test]
fn frames_read_with_the_hello_carry_the_peer_id() {
    let (mut target, dst) = target_with_window();
    let key = dst.remote(0, 16).region.key.0;
    let mut c = Raw::connect(&target.t);
    c.send_ok(
        &concat(&[
            &hello_frame(),
            &write_frame(key, 0, &[5u8; 16], Some(42), 1),
        ]),
        || target.step(),
    );
    target.until("the WRITE's immediate data", |t| {
        !t.remote_writes().is_empty()
    });
    let ev = target.remote_writes()[0].clone();
    assert_eq!(ev.imm, Some(42));
    let peer = ev.peer.expect("a peer");
    assert_ne!(peer.0, 0, "the event names no peer the transport knows");
    // The id is the one the transport gave the HELLO's sender: it can be removed by it.
    target
        .t
        .remove_peer(peer)
        .expect("the peer of the event is known");
}
