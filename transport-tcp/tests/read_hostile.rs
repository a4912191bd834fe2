//! READ against hostile peers: an owner serves READs from a raw socket speaking the wire
//! format by hand. Every refused READ is answered with a NACK before any byte of the region
//! leaves; malformed READ frames close the connection; peers of other protocol versions are
//! refused (or, version 2, served but never read from) with clear errors. The owner's
//! application only polls.

mod common;

use common::{Deadline, Node, Raw, concat, frame, write_frame};
use fabric_core::testing::{Canaried, pattern};
use fabric_core::{Access, Error, Transport};
use transport_tcp::TcpError;
use transport_tcp::frame::{CHALLENGE_VERSION, HEADER_LEN, Header, Op, PROTOCOL_VERSION, code};

const LEN: u64 = 64 * 1024;

/// A HELLO of protocol `version` with a fresh instance id.
fn hello(version: u8, instance: u64) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(&instance.to_le_bytes());
    p.extend_from_slice(b"tcp://127.0.0.1:1");
    let mut h = Header::new(Op::Hello, p.len() as u64);
    h.code = version;
    frame(h, &p)
}

fn read_frame(key: u64, offset: u64, len: u64, wr_id: u64) -> Vec<u8> {
    let mut h = Header::new(Op::Read, len);
    h.key = key;
    h.offset = offset;
    h.wr_id = wr_id;
    h.encode().to_vec()
}

/// The next header that answers a request (grants of SEND credit, ACKs of no request,
/// may come at any point and are skipped).
fn next_answer(c: &mut Raw, t: &mut Node) -> Header {
    loop {
        let h = c.read_header(|| t.step());
        if !(h.op == Op::Ack && h.len == 0) {
            return h;
        }
    }
}

/// The next `n` answers to requests (NACKs, ACKs of requests, READ_REPLYs with their
/// payloads, whether they come alone or in batches); grants of SEND credit are skipped.
fn answers(c: &mut Raw, t: &mut Node, n: usize) -> Vec<(Header, Vec<u8>)> {
    let mut got = Vec::new();
    let d = Deadline::new("answers");
    while got.len() < n {
        d.check();
        let h = next_answer(c, t);
        match h.op {
            Op::Batch => {
                let heads: Vec<Header> = (0..h.len).map(|_| c.read_header(|| t.step())).collect();
                for r in heads {
                    let body = c.read_bytes(r.len as usize, || t.step());
                    got.push((r, body));
                }
            }
            Op::ReadReply => {
                let body = c.read_bytes(h.len as usize, || t.step());
                got.push((h, body));
            }
            _ => got.push((h, Vec::new())),
        }
    }
    got
}

/// An owner with a readable region (pattern 31), and one that allows only writes.
fn owner() -> (Node, Canaried, Canaried) {
    let mut t = Node::small();
    let readable = Canaried::new(&mut t.t, LEN, Access::REMOTE_READ, 0);
    readable.write(0, &pattern(31, LEN as usize));
    let write_only = Canaried::new(&mut t.t, 4096, Access::REMOTE_WRITE, 0x22);
    (t, readable, write_only)
}

/// Sends `bytes` on a fresh connection and expects the owner to close it, answering nothing.
fn expect_closed(t: &mut Node, what: &str, bytes: &[u8]) {
    let mut c = Raw::connect(&t.t);
    let _ = c.send(bytes, || t.step());
    c.expect_closed(what, || t.step());
    // The HELLO draws no answer; nothing after it may either.
    assert_eq!(c.received, 0, "{what}: the owner answered {:?}", &c.rx);
    assert!(t.done.is_empty(), "{what}: completions {:?}", t.done);
}

#[test]
fn refused_reads_are_nacked_before_any_byte_leaves_and_good_ones_are_served() {
    let (mut t, readable, write_only) = owner();
    let key = readable.remote(0, 0).region.key.0;
    let wkey = write_only.remote(0, 0).region.key.0;
    let mut c = Raw::connect(&t.t);
    c.send_ok(
        &concat(&[
            &hello(CHALLENGE_VERSION, 0xEAD0_0001),
            &read_frame(key ^ 0x55, 0, 16, 1),
            &read_frame(key, LEN - 10, 11, 2),
            &read_frame(key, u64::MAX - 4, 16, 3),
            &read_frame(wkey, 0, 16, 4),
            &read_frame(key, 100, 5000, 5),
            &read_frame(key, LEN, 0, 6),
        ]),
        || t.step(),
    );
    let got = answers(&mut c, &mut t, 6);
    for (i, (want, wr)) in [code::KEY, code::BOUNDS, code::BOUNDS, code::PERMISSION]
        .into_iter()
        .zip(1..)
        .enumerate()
    {
        let h = got[i].0;
        assert_eq!((h.op, h.code, h.wr_id), (Op::Nack, want, wr), "{h:?}");
    }
    // Only the valid READ's bytes leave, exactly the range asked for.
    let (h, body) = &got[4];
    assert_eq!((h.op, h.len, h.wr_id), (Op::ReadReply, 5000, 5), "{h:?}");
    assert!(*body == pattern(31, LEN as usize)[100..5100], "reply bytes");
    // A zero-length READ at the very end is in bounds.
    let (h, _) = &got[5];
    assert_eq!((h.op, h.len, h.wr_id), (Op::ReadReply, 0, 6), "{h:?}");
    for _ in 0..50 {
        t.step();
    }
    c.pump();
    // Nothing more, but grants of SEND credit (ACKs that answer no request).
    assert_eq!(c.rx.len() % HEADER_LEN, 0, "{:?}", c.rx);
    for chunk in c.rx.chunks_exact(HEADER_LEN) {
        let h = Header::decode(chunk.try_into().unwrap()).unwrap();
        assert_eq!((h.op, h.len), (Op::Ack, 0), "more answers: {h:?}");
    }
    assert!(
        t.done.is_empty(),
        "READs complete nothing at the owner: {:?}",
        t.done
    );
    assert!(readable.read(0, LEN as usize) == pattern(31, LEN as usize));
    readable.assert_canaries();
    write_only.assert_canaries();
}

#[test]
fn malformed_read_frames_close_the_connection() {
    let (mut t, readable, _w) = owner();
    let key = readable.remote(0, 0).region.key.0;
    let h3 = || hello(CHALLENGE_VERSION, fabric_core::random_u64());
    // Longer than the largest message (Node::small's), whatever the region.
    expect_closed(
        &mut t,
        "READ past the largest message",
        &concat(&[&h3(), &read_frame(key, 0, u64::MAX, 1)]),
    );
    // A READ carries no immediate data.
    let mut flagged = Header::new(Op::Read, 16);
    flagged.key = key;
    flagged.flags = transport_tcp::frame::FLAG_IMM;
    expect_closed(
        &mut t,
        "READ with flags",
        &concat(&[&h3(), &flagged.encode()]),
    );
    // A READ_REPLY nobody asked for.
    expect_closed(
        &mut t,
        "unsolicited READ_REPLY",
        &concat(&[&h3(), &frame(Header::new(Op::ReadReply, 4), &[1, 2, 3, 4])]),
    );
    // A READ_REPLY inside a BATCH, with no READ outstanding.
    let mut batch = Header::new(Op::Batch, 1).encode().to_vec();
    batch.extend(Header::new(Op::ReadReply, 0).encode());
    expect_closed(
        &mut t,
        "READ_REPLY inside a BATCH",
        &concat(&[&h3(), &batch]),
    );
    // A SEND inside a BATCH (WRITEs, READs and READ_REPLYs go there).
    let mut batch = Header::new(Op::Batch, 1).encode().to_vec();
    batch.extend(Header::new(Op::Send, 0).encode());
    expect_closed(&mut t, "SEND inside a BATCH", &concat(&[&h3(), &batch]));
    // A READ before the HELLO.
    expect_closed(&mut t, "READ before HELLO", &read_frame(key, 0, 16, 1));
    // The owner still serves a well-behaved reader.
    let mut c = Raw::connect(&t.t);
    c.send_ok(&concat(&[&h3(), &read_frame(key, 0, 64, 9)]), || t.step());
    let (h, body) = answers(&mut c, &mut t, 1).remove(0);
    assert_eq!((h.op, h.len), (Op::ReadReply, 64));
    assert!(body == pattern(31, 64));
    readable.assert_canaries();
}

#[test]
fn peers_of_other_protocol_versions_are_refused_clearly() {
    let (mut t, readable, _w) = owner();
    let key = readable.remote(0, 0).region.key.0;
    // 3: the version before the CHALLENGE, whose builds send a replayable digest.
    for v in [1u8, 3, PROTOCOL_VERSION + 1, 255] {
        expect_closed(
            &mut t,
            &format!("HELLO of version {v}"),
            &concat(&[
                &hello(v, fabric_core::random_u64()),
                &read_frame(key, 0, 16, 1),
            ]),
        );
    }
    let e = TcpError::HelloVersion(3).to_string();
    assert!(
        e.contains("version 3") && e.contains(&format!("speaks {PROTOCOL_VERSION}")),
        "{e}"
    );
}

#[test]
fn a_peer_of_version_2_is_served_but_never_read_from() {
    let mut t = Node::small();
    let sink = Canaried::new(&mut t.t, 4096, Access::REMOTE_WRITE, 0);
    let mine = Canaried::new(&mut t.t, 4096, Access::LOCAL_WRITE, 0);
    let key = sink.remote(0, 0).region.key.0;
    let mut c = Raw::connect(&t.t);
    c.send_ok(
        &concat(&[
            &hello(2, 0xEAD0_0002),
            &write_frame(key, 0, &[7u8; 16], Some(5), 1),
        ]),
        || t.step(),
    );
    t.until("the version-2 peer's WRITE", |t| {
        !t.remote_writes().is_empty()
    });
    assert_eq!(sink.read(0, 16), vec![7u8; 16]);
    let peer = t.remote_writes()[0].peer.expect("a peer");
    // Its WRITE is acknowledged as before.
    let h = next_answer(&mut c, &mut t);
    assert_eq!((h.op, h.len), (Op::Ack, 1));
    // A READ from it would be a frame it does not know: refused at post, nothing sent.
    let e =
        t.t.post_read(
            peer,
            fabric_core::WorkRequestId(1),
            mine.local(0, 16),
            sink.remote(0, 16),
        )
        .unwrap_err();
    assert!(
        matches!(&e, Error::Unsupported(m) if m.contains("version 2")),
        "{e}"
    );
    let d = Deadline::new("quiet");
    for _ in 0..50 {
        t.step();
        d.check();
    }
    c.pump();
    assert!(
        c.rx.len() < HEADER_LEN,
        "the owner sent a frame: {:?}",
        c.rx
    );
    assert!(t.done.iter().all(|c| c.wr_id.0 != 1), "{:?}", t.done);
}

#[test]
fn reads_inside_a_batch_are_answered_in_order_with_the_writes_around_them() {
    let mut t = Node::small();
    let readable = Canaried::new(&mut t.t, LEN, Access::REMOTE_READ | Access::REMOTE_WRITE, 0);
    readable.write(0, &pattern(31, LEN as usize));
    let key = readable.remote(0, 0).region.key.0;
    let mut c = Raw::connect(&t.t);
    // [WRITE 0..16 := 9s, READ 0..32, READ of a bad key, READ 100..164], then the
    // WRITE's payload: the first READ must see the WRITE, answers in order.
    let mut batch = Header::new(Op::Batch, 4).encode().to_vec();
    batch.extend(common::write_header(key, 0, 16, None, 1).encode());
    batch.extend(read_frame(key, 0, 32, 2));
    batch.extend(read_frame(key ^ 1, 0, 32, 3));
    batch.extend(read_frame(key, 100, 64, 4));
    batch.extend([9u8; 16]);
    c.send_ok(
        &concat(&[&hello(CHALLENGE_VERSION, 0xEAD0_0003), &batch]),
        || t.step(),
    );
    // The WRITE's ACK comes first; then the answers, in order.
    let got: Vec<(Op, u64, Vec<u8>)> = answers(&mut c, &mut t, 4)
        .into_iter()
        .map(|(h, b)| (h.op, h.wr_id, b))
        .collect();
    assert_eq!(got[0].0, Op::Ack);
    assert_eq!((got[1].0, got[1].1), (Op::ReadReply, 2));
    let mut want = pattern(31, 32);
    want[..16].fill(9);
    assert_eq!(got[1].2, want, "the READ after the WRITE sees it");
    assert_eq!((got[2].0, got[2].1), (Op::Nack, 3));
    assert_eq!((got[3].0, got[3].1), (Op::ReadReply, 4));
    assert!(got[3].2 == pattern(31, LEN as usize)[100..164]);
    readable.assert_canaries();
}
