//! A TCP transport as initiator facing hostile or vanishing targets (issue 2 "Bad input",
//! issue 7 "Hostile input"): a raw socket posing as a peer answers with bogus ACKs/NACKs,
//! garbage, or leaves; or a real target is dropped with writes in flight. Every posted write
//! completes exactly once, the bad connection is closed, and the initiator keeps working
//! with its other peers.

mod common;

use common::{Deadline, Node, Raw, concat, fake_target_handshake, hello_frame, write_frame};
use fabric_core::testing::{Canaried, pattern};
use fabric_core::{
    Access, Error, OpError, OpKind, PeerId, PostOutcome, RemoteKey, RemoteRegion, RemoteSlice,
    Transport, WorkRequestId,
};
use std::collections::HashMap;
use std::net::TcpListener;
use std::time::Duration;
use transport_tcp::TcpConfig;
use transport_tcp::frame::{Header, Op, code};

/// What hostile payloads carry, so that a stray landing is visible.
const EVIL: u8 = 0xEE;

/// A real initiator, a real peer it writes to, and a raw socket posing as a second peer.
struct Scene {
    a: Node,
    real: Node,
    src: Canaried,
    real_dst: Canaried,
    real_peer: PeerId,
    fake: Raw,
    fake_peer: PeerId,
    fake_region: RemoteRegion,
    wr: u64,
}

impl Scene {
    fn new() -> Scene {
        let mut a = Node::new(TcpConfig::default());
        let mut real = Node::new(TcpConfig::default());
        let src = Canaried::new(&mut a.t, 64 * 1024, Access::REMOTE_WRITE, 0x5A);
        let real_dst = Canaried::new(&mut real.t, 64 * 1024, Access::REMOTE_WRITE, 0);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = format!("tcp://{}", listener.local_addr().unwrap());
        let fake_peer = a.t.add_peer(addr.as_bytes()).unwrap();
        // add_peer connected already: the connection waits in the backlog.
        let (stream, _) = listener.accept().unwrap();
        let real_peer = a.t.add_peer(&real.t.address()).unwrap();
        let mut s = Scene {
            a,
            real,
            src,
            real_dst,
            real_peer,
            fake: Raw::from_stream(stream),
            fake_peer,
            fake_region: RemoteRegion {
                addr: 0,
                len: 1 << 20,
                key: RemoteKey(0xFA6E),
            },
            wr: 0,
        };
        // The fake speaks first, as a target does; the HELLO answers its CHALLENGE, and
        // the fake's PROOF lets the requests go.
        fake_target_handshake(&mut s.fake, || {
            s.a.step();
            s.real.step();
        });
        // The fake peer is connected once the initiator has taken the PROOF in.
        let d = Deadline::new("the initiator to take the fake's PROOF");
        while !s.a.t.peer_ready(s.fake_peer).expect("the fake's PROOF") {
            s.step();
            d.check();
        }
        s
    }

    fn step(&mut self) {
        self.a.step();
        self.real.step();
    }

    /// Posts a 4 KiB WRITE to the fake peer; returns its id.
    fn post_fake(&mut self) -> u64 {
        self.wr += 1;
        let dst = RemoteSlice {
            region: self.fake_region,
            offset: self.wr * 4096,
            len: 4096,
        };
        let r = self
            .a
            .t
            .post_write(
                self.fake_peer,
                WorkRequestId(self.wr),
                self.src.local(0, 4096),
                dst,
                None,
            )
            .unwrap();
        assert_eq!(r, PostOutcome::Posted);
        self.wr
    }

    /// Posts a WRITE to the real peer; returns its id.
    fn post_real(&mut self) -> u64 {
        self.wr += 1;
        let off = (self.wr % 16) * 4096;
        let r = self
            .a
            .t
            .post_write(
                self.real_peer,
                WorkRequestId(self.wr),
                self.src.local(off, 4096),
                self.real_dst.remote(off, 4096),
                None,
            )
            .unwrap();
        assert_eq!(r, PostOutcome::Posted);
        self.wr
    }

    /// The fake reads `n` requests (headers and payloads) off the wire.
    fn fake_reads(&mut self, n: usize) -> Vec<Header> {
        let Scene { a, real, fake, .. } = self;
        let mut step = || {
            a.step();
            real.step();
        };
        let mut out = Vec::new();
        while out.len() < n {
            let h = fake.read_header(&mut step);
            match h.op {
                Op::Batch => {
                    let hs: Vec<Header> = (0..h.len).map(|_| fake.read_header(&mut step)).collect();
                    for e in &hs {
                        let _ = fake.read_bytes(e.len as usize, &mut step);
                    }
                    out.extend(hs);
                }
                Op::Write | Op::Send => {
                    let _ = fake.read_bytes(h.len as usize, &mut step);
                    out.push(h);
                }
                op => panic!("{op:?} from the initiator"),
            }
        }
        out
    }

    fn fake_sends(&mut self, bytes: &[u8]) {
        let Scene { a, real, fake, .. } = self;
        // The initiator may close as soon as it reads the first bad byte.
        let _ = fake.send(bytes, || {
            a.step();
            real.step();
        });
    }

    /// Waits until the initiator has `n` completions and takes them, checking that no
    /// more arrive for a while after.
    fn take(&mut self, n: usize, what: &str) -> HashMap<u64, Result<u64, OpError>> {
        let d = Deadline::new(what.to_string());
        while self.a.done.len() < n {
            d.check();
            self.step();
        }
        for _ in 0..50 {
            self.step();
        }
        assert_eq!(
            self.a.done.len(),
            n,
            "{what}: more completions than posts: {:?}",
            self.a.done
        );
        let mut m = HashMap::new();
        for c in self.a.done.drain(..) {
            assert_eq!(c.op, OpKind::Write);
            assert!(
                m.insert(c.wr_id.0, c.result).is_none(),
                "{what}: wr {} completed twice",
                c.wr_id.0
            );
        }
        m
    }

    fn expect_fake_closed(&mut self, what: &str) {
        let Scene { a, real, fake, .. } = self;
        fake.expect_closed(what, || {
            a.step();
            real.step();
        });
    }

    /// Later posts to the fake peer fail at once.
    fn fake_posts_fail(&mut self, what: &str) {
        let dst = RemoteSlice {
            region: self.fake_region,
            offset: 0,
            len: 16,
        };
        match self.a.t.post_write(
            self.fake_peer,
            WorkRequestId(9999),
            self.src.local(0, 16),
            dst,
            None,
        ) {
            Err(Error::Op(OpError::PeerUnreachable { peer, .. })) => {
                assert_eq!(peer, self.fake_peer)
            }
            other => panic!("{what}: a post to the closed peer gave {other:?}"),
        }
    }

    /// The initiator still writes to the real peer.
    fn real_still_works(&mut self, what: &str) {
        let wr = self.post_real();
        let got = self.take(1, what);
        assert_eq!(got[&wr], Ok(4096), "{what}: write to the real peer");
        let off = (wr % 16) * 4096;
        assert_eq!(
            self.real_dst.read(off, 4096),
            self.src.read(off, 4096),
            "{what}: real peer's bytes"
        );
        self.real_dst.assert_canaries();
    }
}

fn unreachable_from(r: &Result<u64, OpError>, peer: PeerId) -> bool {
    matches!(r, Err(OpError::PeerUnreachable { peer: p, .. }) if *p == peer)
}

/// The fake answers 3 pending WRITEs with `answer`: the initiator closes the connection and
/// fails each of them once with PeerUnreachable; a write to the real peer posted alongside
/// succeeds.
fn hostile_answer(what: &str, answer: &[u8], then_close: bool) {
    let mut s = Scene::new();
    let ids: Vec<u64> = (0..3).map(|_| s.post_fake()).collect();
    let real = s.post_real();
    let reqs = s.fake_reads(3);
    assert_eq!(
        reqs.iter().map(|h| h.wr_id).collect::<Vec<_>>(),
        ids,
        "requests arrive in order"
    );
    s.fake_sends(answer);
    if then_close {
        s.fake.s.shutdown(std::net::Shutdown::Both).unwrap();
    } else {
        s.expect_fake_closed(what);
    }
    let got = s.take(4, what);
    for id in &ids {
        assert!(
            unreachable_from(&got[id], s.fake_peer),
            "{what}: wr {id} ended with {:?}",
            got[id]
        );
    }
    assert_eq!(got[&real], Ok(4096), "{what}: the real peer's write");
    s.fake_posts_fail(what);
    s.real_still_works(what);
    s.src.assert_canaries();
}

// 9. A malicious target.
#[test]
fn malicious_target_acks_more_than_outstanding() {
    hostile_answer("ACK for 5 of 3", &Header::new(Op::Ack, 5).encode(), false);
    hostile_answer(
        "ACK for u64::MAX of 3",
        &Header::new(Op::Ack, u64::MAX).encode(),
        false,
    );
    // A valid ACK for 3 glued to a bogus one: the 3 succeed, and the connection closes.
    let mut s = Scene::new();
    let ids: Vec<u64> = (0..3).map(|_| s.post_fake()).collect();
    let _ = s.fake_reads(3);
    s.fake_sends(&concat(&[
        &Header::new(Op::Ack, 3).encode(),
        &Header::new(Op::Ack, 1).encode(),
    ]));
    s.expect_fake_closed("an ACK with nothing outstanding");
    let got = s.take(3, "answered writes");
    for id in &ids {
        assert_eq!(got[id], Ok(4096));
    }
    s.fake_posts_fail("an ACK with nothing outstanding");
    s.real_still_works("an ACK with nothing outstanding");
}

#[test]
fn malicious_target_nacks_with_nothing_outstanding() {
    let mut s = Scene::new();
    s.fake_sends(&Header::new(Op::Nack, 0).encode());
    s.expect_fake_closed("a NACK with nothing outstanding");
    s.fake_posts_fail("a NACK with nothing outstanding");
    s.real_still_works("a NACK with nothing outstanding");
    // Two writes answered, then a NACK too many.
    let mut s = Scene::new();
    let ids: Vec<u64> = (0..2).map(|_| s.post_fake()).collect();
    let _ = s.fake_reads(2);
    let mut nack = Header::new(Op::Nack, 0);
    nack.code = code::KEY;
    s.fake_sends(&concat(&[
        &Header::new(Op::Ack, 1).encode(),
        &nack.encode(),
        &nack.encode(),
    ]));
    s.expect_fake_closed("a NACK too many");
    let got = s.take(2, "answered writes");
    assert_eq!(got[&ids[0]], Ok(4096));
    assert_eq!(
        got[&ids[1]],
        Err(OpError::RemoteKeyInvalid(RemoteKey(0))),
        "the NACK that had a request keeps its meaning"
    );
    s.fake_posts_fail("a NACK too many");
    s.real_still_works("a NACK too many");
}

#[test]
fn malicious_target_sends_garbage() {
    let mut noise = pattern(3, 4096);
    noise[0] = 0xEE;
    hostile_answer("random bytes", &noise, false);
    let mut bad_flags = Header::new(Op::Ack, 1).encode();
    bad_flags[1] = 0x40;
    hostile_answer("ACK with unknown flags", &bad_flags, false);
    hostile_answer("a HELLO from the target", &hello_frame(), false);
    hostile_answer(
        "a SEND larger than max_msg_size",
        &Header::new(Op::Send, u64::MAX).encode(),
        false,
    );
    hostile_answer(
        "a BATCH of 100000",
        &Header::new(Op::Batch, 100_000).encode(),
        false,
    );
    hostile_answer(
        "half an ACK, then the target leaves",
        &Header::new(Op::Ack, 3).encode()[..20],
        true,
    );
    hostile_answer("the target leaves without a word", &[], true);
}

// A hostile target parks the initiator's connection with a SEND too large for the
// early-arrival queue (the initiator stops reading it until a receive is posted), then
// leaves: the writes pending on that connection must still fail.
#[test]
fn malicious_target_parks_the_connection_then_leaves() {
    let mut s = Scene::new();
    let ids: Vec<u64> = (0..3).map(|_| s.post_fake()).collect();
    let _ = s.fake_reads(3);
    // 100 MiB: within max_msg_size (256 MiB), beyond max_unexpected_bytes (64 MiB).
    s.fake_sends(&Header::new(Op::Send, 100 << 20).encode());
    s.fake.s.shutdown(std::net::Shutdown::Both).unwrap();
    let d = Deadline::within(Duration::from_secs(5), "the pending writes to fail");
    while s.a.done.len() < 3 && !d.passed() {
        s.step();
    }
    let got: Vec<_> =
        s.a.done
            .iter()
            .map(|c| (c.wr_id.0, c.result.clone()))
            .collect();
    assert_eq!(
        got.len(),
        3,
        "writes {ids:?} to a target that has gone are still pending after 5 s: {got:?}"
    );
    for (id, r) in &got {
        assert!(unreachable_from(r, s.fake_peer), "wr {id}: {r:?}");
    }
}

// A NACK with a code the initiator does not know still fails exactly its request, and the
// connection goes on.
#[test]
fn malicious_target_unknown_nack_code_fails_one_request() {
    let mut s = Scene::new();
    let ids: Vec<u64> = (0..2).map(|_| s.post_fake()).collect();
    let _ = s.fake_reads(2);
    let mut nack = Header::new(Op::Nack, 0);
    nack.code = 200;
    s.fake_sends(&concat(&[
        &nack.encode(),
        &Header::new(Op::Ack, 1).encode(),
    ]));
    let got = s.take(2, "answered writes");
    assert!(
        matches!(got[&ids[0]], Err(OpError::Remote(_))),
        "{:?}",
        got[&ids[0]]
    );
    assert_eq!(got[&ids[1]], Ok(4096));
    let id = s.post_fake();
    let _ = s.fake_reads(1);
    s.fake_sends(&Header::new(Op::Ack, 1).encode());
    assert_eq!(s.take(1, "a later write")[&id], Ok(4096));
}

// A malicious target WRITEs back into the initiator: the initiator validates like any
// target (its window has REMOTE_WRITE; the canaries around it hold).
#[test]
fn malicious_target_writes_back_out_of_bounds() {
    let mut s = Scene::new();
    let key = s.src.reg.remote.key.0;
    let before = s.src.read(0, 64 * 1024);
    s.fake_sends(&concat(&[
        &write_frame(key, 64 * 1024 - 8, &[EVIL; 16], None, 1),
        &write_frame(key ^ 1, 0, &[EVIL; 16], None, 2),
        &write_frame(key, u64::MAX - 4, &[EVIL; 16], None, 3),
    ]));
    let Scene { a, real, fake, .. } = &mut s;
    let answers = fake.answers(3, || {
        a.step();
        real.step();
    });
    answers[0].nack(code::BOUNDS, "past the end");
    answers[1].nack(code::KEY, "bad key");
    answers[2].nack(code::BOUNDS, "overflow");
    assert!(s.src.read(0, 64 * 1024) == before);
    s.src.assert_canaries();
    s.real_still_works("writes from the target");
}

// 10. The target vanishes with writes in flight.
fn peer_vanishes_mid_transfer(rails: usize) {
    const N: u64 = 256;
    const LEN: u64 = 64 * 1024;
    // Small socket buffers, so that the transfer takes many rounds.
    let buffers = Some(64 * 1024);
    let mut a = Node::new(TcpConfig {
        rails,
        socket_buffer: buffers,
        ..TcpConfig::default()
    });
    let mut b = Node::new(TcpConfig {
        socket_buffer: buffers,
        ..TcpConfig::default()
    });
    let src = Canaried::new(&mut a.t, LEN, Access::NONE, 0x77);
    let dst = Canaried::new(&mut b.t, N * LEN, Access::REMOTE_WRITE, 0);
    let peer = a.t.add_peer(&b.t.address()).unwrap();
    let mut posted = 0;
    for i in 0..N {
        match a
            .t
            .post_write(
                peer,
                WorkRequestId(i),
                src.local(0, LEN),
                dst.remote(i * LEN, LEN),
                None,
            )
            .unwrap()
        {
            PostOutcome::Posted => posted += 1,
            PostOutcome::NoRoom => break,
        }
    }
    assert!(posted > 1);
    let d = Deadline::new("the first completion");
    while a.done.is_empty() {
        d.check();
        a.step();
        b.step();
    }
    assert!(
        (a.done.len() as u64) < posted,
        "every write finished before the target could vanish"
    );
    drop(b);
    let d = Deadline::new("every posted write to complete");
    while (a.done.len() as u64) < posted {
        d.check();
        a.step();
    }
    for _ in 0..50 {
        a.step();
    }
    let mut ids = HashMap::new();
    let mut failed = 0;
    for c in a.done.drain(..) {
        match &c.result {
            Ok(n) => assert_eq!(*n, LEN),
            Err(OpError::PeerUnreachable { peer: p, .. }) => {
                assert_eq!(*p, peer);
                failed += 1;
            }
            Err(e) => panic!("wr {}: unexpected {e:?}", c.wr_id.0),
        }
        *ids.entry(c.wr_id.0).or_insert(0) += 1;
    }
    assert_eq!(ids.len() as u64, posted, "every write completes");
    assert!(
        ids.values().all(|&n| n == 1),
        "a write completed twice: {ids:?}"
    );
    assert!(failed > 0, "no write failed although the target vanished");
    // Later posts fail at once, or complete with an error.
    match a.t.post_write(
        peer,
        WorkRequestId(N + 1),
        src.local(0, 16),
        dst.remote(0, 16),
        None,
    ) {
        Err(_) => {}
        Ok(PostOutcome::NoRoom) => panic!("NoRoom for a vanished peer"),
        Ok(PostOutcome::Posted) => {
            a.until("the late write to fail", |a| !a.done.is_empty());
            assert!(a.done[0].result.is_err(), "{:?}", a.done[0]);
        }
    }
    a.t.remove_peer(peer).unwrap();
    src.assert_canaries();
}

#[test]
fn peer_vanishes_mid_transfer_one_rail() {
    peer_vanishes_mid_transfer(1);
}

#[test]
fn peer_vanishes_mid_transfer_four_rails() {
    peer_vanishes_mid_transfer(4);
}
