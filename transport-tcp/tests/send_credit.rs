//! SEND flow control apart from WRITE acknowledgement (issue 14): SENDs that find no posted
//! receive must not stop the connection they arrive on, so the ACKs of WRITEs on it keep
//! flowing, and two peers that both send without receives do not deadlock. The receiver
//! grants SEND credit; the sender holds SENDs it has no credit for, and gives one up after
//! a while with a clear error.

mod common;

use common::{Deadline, Node, Raw, concat, frame, hello_frame, send_frame, small_config};
use fabric_core::testing::{Canaried, pattern};
use fabric_core::{
    Access, Completion, OpError, OpKind, PeerId, PostOutcome, Transport, WorkRequestId,
};
use std::time::Duration;
use transport_tcp::frame::{ACK_CREDIT, CHALLENGE_VERSION, Header, Op};
use transport_tcp::{TcpConfig, TcpError};

const FILL: u8 = 0x11;
/// The early-arrival queue of both sides: 8 messages, 64 KiB.
const QUEUE: usize = 8;

fn config() -> TcpConfig {
    TcpConfig {
        max_unexpected_count: QUEUE,
        max_unexpected_bytes: 64 * 1024,
        ..small_config()
    }
}

fn step_both(a: &mut Node, b: &mut Node) {
    a.step();
    b.step();
}

fn of_kind(n: &Node, op: OpKind, from: u64, to: u64) -> Vec<&Completion> {
    n.done
        .iter()
        .filter(|c| c.op == op && (from..to).contains(&c.wr_id.0))
        .collect()
}

const SEND_WR: u64 = 1_000;
const WRITE_WR: u64 = 2_000;
const RECV_WR: u64 = 3_000;

#[test]
fn sends_without_receives_do_not_hold_up_writes_either_way() {
    // Five times the early-arrival queue, from each side, over one connection.
    const COUNT: u64 = 5 * QUEUE as u64;
    const MSG: u64 = 4096;
    const WRITES: u64 = 64;
    const W: u64 = 16 * 1024;
    let (mut a, mut b) = (Node::new(config()), Node::new(config()));
    let mut sides = Vec::new();
    for n in [&mut a, &mut b] {
        let msgs = Canaried::new(&mut n.t, COUNT * MSG, Access::NONE, 0);
        for seq in 0..COUNT {
            msgs.write(seq * MSG, &pattern(seq, MSG as usize));
        }
        let src = Canaried::new(&mut n.t, WRITES * W, Access::NONE, 0);
        src.write(0, &pattern(77, (WRITES * W) as usize));
        let dst = Canaried::new(&mut n.t, WRITES * W, Access::REMOTE_WRITE, FILL);
        let rbufs = Canaried::new(&mut n.t, COUNT * MSG, Access::LOCAL_WRITE, FILL);
        sides.push((msgs, src, dst, rbufs));
    }
    let (sa, sb) = (&sides[0], &sides[1]);

    // One connection, opened by `a`; `b` learns `a`'s id from a WRITE with immediate data.
    let peer_b = a.t.add_peer(&b.t.address()).unwrap();
    let r =
        a.t.post_write(
            peer_b,
            WorkRequestId(1),
            sa.1.local(0, 16),
            sb.2.remote(0, 16),
            Some(1),
        )
        .unwrap();
    assert_eq!(r, PostOutcome::Posted);
    let d = Deadline::new("the first WRITE");
    while b.remote_writes().is_empty() || a.done.is_empty() {
        step_both(&mut a, &mut b);
        d.check();
    }
    assert_eq!(a.done[0].result, Ok(16));
    let peer_a: PeerId = b.remote_writes()[0].peer.expect("the writer is known");
    a.done.clear();
    b.done.clear();

    // Both send far more than the other side's early-arrival queue holds, with no receive
    // posted, then write both ways.
    for (n, peer, s) in [(&mut a, peer_b, sa), (&mut b, peer_a, sb)] {
        for seq in 0..COUNT {
            let r =
                n.t.post_send(
                    peer,
                    WorkRequestId(SEND_WR + seq),
                    s.0.local(seq * MSG, MSG),
                    Some(seq as u32),
                )
                .unwrap();
            assert_eq!(r, PostOutcome::Posted);
        }
    }
    for (n, peer, s, t) in [(&mut a, peer_b, sa, sb), (&mut b, peer_a, sb, sa)] {
        for i in 0..WRITES {
            let r =
                n.t.post_write(
                    peer,
                    WorkRequestId(WRITE_WR + i),
                    s.1.local(i * W, W),
                    t.2.remote(i * W, W),
                    None,
                )
                .unwrap();
            assert_eq!(r, PostOutcome::Posted);
        }
    }
    // Well within `peer_timeout` (5 s): a connection held back by SENDs would not answer.
    let d = Deadline::within(Duration::from_secs(3), "every WRITE to complete both ways");
    loop {
        let done_a = of_kind(&a, OpKind::Write, WRITE_WR, WRITE_WR + WRITES).len();
        let done_b = of_kind(&b, OpKind::Write, WRITE_WR, WRITE_WR + WRITES).len();
        if done_a == WRITES as usize && done_b == WRITES as usize {
            break;
        }
        assert!(
            !d.passed(),
            "WRITEs held up behind SENDs nobody receives: {done_a}/{WRITES} done at a, \
             {done_b}/{WRITES} at b"
        );
        step_both(&mut a, &mut b);
    }
    for (n, s) in [(&a, sb), (&b, sa)] {
        for c in of_kind(n, OpKind::Write, WRITE_WR, WRITE_WR + WRITES) {
            assert_eq!(c.result, Ok(W), "{c:?}");
        }
        assert!(
            s.2.read(0, (WRITES * W) as usize) == pattern(77, (WRITES * W) as usize),
            "written bytes differ"
        );
        s.2.assert_canaries();
        let sent = of_kind(n, OpKind::Send, SEND_WR, SEND_WR + COUNT);
        assert!(
            sent.len() <= QUEUE,
            "{} SENDs completed with room for {QUEUE} at the target",
            sent.len()
        );
        assert!(sent.iter().all(|c| c.result == Ok(MSG)), "{sent:?}");
        assert!(of_kind(n, OpKind::Recv, 0, u64::MAX).is_empty());
    }

    // Receives posted now take every SEND, in order, on both sides.
    for (n, s) in [(&mut a, sa), (&mut b, sb)] {
        for seq in 0..COUNT {
            let r =
                n.t.post_recv(WorkRequestId(RECV_WR + seq), s.3.local(seq * MSG, MSG))
                    .unwrap();
            assert_eq!(r, PostOutcome::Posted);
        }
    }
    let d = Deadline::new("every SEND to land in a receive");
    loop {
        let all = [&a, &b].iter().all(|n| {
            of_kind(n, OpKind::Recv, RECV_WR, RECV_WR + COUNT).len() == COUNT as usize
                && of_kind(n, OpKind::Send, SEND_WR, SEND_WR + COUNT).len() == COUNT as usize
        });
        if all {
            break;
        }
        step_both(&mut a, &mut b);
        d.check();
    }
    for (n, s) in [(&a, sa), (&b, sb)] {
        let recvs = of_kind(n, OpKind::Recv, RECV_WR, RECV_WR + COUNT);
        for (seq, c) in recvs.iter().enumerate() {
            let seq = seq as u64;
            assert_eq!(
                c.wr_id,
                WorkRequestId(RECV_WR + seq),
                "receives complete in order"
            );
            assert_eq!(c.result, Ok(MSG));
            assert_eq!(c.imm, Some(seq as u32), "message {seq} in receive {seq}");
            assert!(
                s.3.read(seq * MSG, MSG as usize) == pattern(seq, MSG as usize),
                "content of message {seq}"
            );
        }
        s.3.assert_canaries();
        for c in of_kind(n, OpKind::Send, SEND_WR, SEND_WR + COUNT) {
            assert_eq!(c.result, Ok(MSG), "{c:?}");
        }
    }
}

#[test]
fn a_send_without_credit_is_given_up_with_a_clear_error() {
    // Room for 4 messages at the target, which posts no receive: 4 of 6 SENDs get credit.
    let cfg = TcpConfig {
        max_unexpected_count: 4,
        liveness_timeout: Duration::from_millis(300),
        ..config()
    };
    let (mut a, mut b) = (Node::new(cfg.clone()), Node::new(cfg));
    let src = Canaried::new(&mut a.t, 4096, Access::NONE, 0x42);
    let dst = Canaried::new(
        &mut b.t,
        4096,
        Access::REMOTE_WRITE | Access::LOCAL_WRITE,
        FILL,
    );
    let peer = a.t.add_peer(&b.t.address()).unwrap();
    for seq in 0..6 {
        let r =
            a.t.post_send(peer, WorkRequestId(SEND_WR + seq), src.local(0, 1024), None)
                .unwrap();
        assert_eq!(r, PostOutcome::Posted);
    }
    let d = Deadline::within(Duration::from_secs(5), "the SENDs to complete or fail");
    while of_kind(&a, OpKind::Send, SEND_WR, SEND_WR + 6).len() < 6 {
        step_both(&mut a, &mut b);
        d.check();
    }
    let sends = of_kind(&a, OpKind::Send, SEND_WR, SEND_WR + 6);
    for c in sends.iter().filter(|c| c.wr_id.0 < SEND_WR + 4) {
        assert_eq!(
            c.result,
            Ok(1024),
            "a credited SEND waits at the target: {c:?}"
        );
    }
    for c in sends.iter().filter(|c| c.wr_id.0 >= SEND_WR + 4) {
        match &c.result {
            Err(OpError::Transport(e)) => assert!(
                matches!(
                    e.downcast_ref::<TcpError>(),
                    Some(TcpError::NoSendCredit { len: 1024, .. })
                ),
                "{e:?}"
            ),
            other => panic!("SEND {} without credit: {other:?}", c.wr_id.0),
        }
    }
    // The connection is fine: a WRITE completes, and the queued message reaches a receive.
    let r =
        a.t.post_write(
            peer,
            WorkRequestId(WRITE_WR),
            src.local(0, 64),
            dst.remote(0, 64),
            None,
        )
        .unwrap();
    assert_eq!(r, PostOutcome::Posted);
    let r =
        b.t.post_recv(WorkRequestId(RECV_WR), dst.local(1024, 2048))
            .unwrap();
    assert_eq!(r, PostOutcome::Posted);
    let d = Deadline::new("the WRITE and the receive");
    while of_kind(&a, OpKind::Write, WRITE_WR, WRITE_WR + 1).is_empty()
        || of_kind(&b, OpKind::Recv, RECV_WR, RECV_WR + 1).is_empty()
    {
        step_both(&mut a, &mut b);
        d.check();
    }
    assert_eq!(
        of_kind(&a, OpKind::Write, WRITE_WR, WRITE_WR + 1)[0].result,
        Ok(64)
    );
    assert_eq!(
        of_kind(&b, OpKind::Recv, RECV_WR, RECV_WR + 1)[0].result,
        Ok(1024)
    );
}

/// The HELLO of `common::hello_frame` (version 0), claiming the credit protocol (version 2).
fn hello_v2() -> Vec<u8> {
    let mut h = hello_frame();
    h[2] = CHALLENGE_VERSION;
    h
}

#[test]
fn a_peer_that_sends_beyond_its_credit_is_closed() {
    let mut target = Node::new(config());
    let mut c = Raw::connect(&target.t);
    c.send_ok(&hello_v2(), || target.step());
    // The target speaks first: the credit it grants (a quarter of the queue: 2 messages).
    let h = c.read_header(|| target.step());
    assert_eq!((h.op, h.code, h.len), (Op::Ack, ACK_CREDIT, 0), "{h:?}");
    assert_eq!((h.key, h.offset), (2, 16 * 1024), "{h:?}");
    // More SENDs than the whole queue could ever give credit for (no receive is posted).
    let msg = [7u8; 100];
    let sends: Vec<Vec<u8>> = (0..QUEUE as u64 + 2)
        .map(|i| send_frame(&msg, None, i))
        .collect();
    let parts: Vec<&[u8]> = sends.iter().map(Vec::as_slice).collect();
    c.send_ok(&concat(&parts), || target.step());
    c.expect_closed("a SEND beyond its credit", || target.step());
    assert!(
        target.done.is_empty(),
        "nothing is reported to the application: {:?}",
        target.done
    );
}

#[test]
fn a_hello_of_an_unknown_version_is_refused() {
    let mut target = Node::new(config());
    let mut c = Raw::connect(&target.t);
    let mut hello = hello_frame();
    hello[2] = 9;
    c.send_ok(&hello, || target.step());
    c.expect_closed("a HELLO of version 9", || target.step());
    // Version 0 (no credit) is still served: its SEND is taken into the queue and ACKed.
    let mut c = Raw::connect(&target.t);
    c.send_ok(
        &concat(&[&hello_frame(), &frame(Header::new(Op::Send, 3), b"abc")]),
        || target.step(),
    );
    let h = c.read_header(|| target.step());
    assert_eq!((h.op, h.code, h.len), (Op::Ack, 0, 1), "{h:?}");
}

#[test]
fn a_target_grants_credit_to_many_connections_at_once() {
    // The default early-arrival queue (4096 messages, 64 MiB). Eight peers connect and
    // none sends before all are connected, so every connection is granted its window at
    // once: with a quarter of the queue per window, the fifth connection on got none, and
    // its SEND waited for credit that no one gave back.
    const PEERS: u64 = 8;
    let mut target = Node::new(TcpConfig::default());
    let inbox = Canaried::new(
        &mut target.t,
        PEERS * 1024,
        Access::REMOTE_WRITE | Access::LOCAL_WRITE,
        FILL,
    );
    let mut peers: Vec<(Node, PeerId, Canaried)> = (0..PEERS)
        .map(|i| {
            let mut n = Node::new(TcpConfig::default());
            let src = Canaried::new(&mut n.t, 1024, Access::NONE, i as u8 + 1);
            let p = n.t.add_peer(&target.t.address()).unwrap();
            (n, p, src)
        })
        .collect();
    let d = Deadline::within(Duration::from_secs(10), "every connection set up");
    while !peers
        .iter_mut()
        .all(|(n, p, _)| n.t.peer_ready(*p).unwrap_or(false))
    {
        target.step();
        for (n, _, _) in &mut peers {
            n.step();
        }
        d.check();
    }
    for (i, (n, p, src)) in peers.iter_mut().enumerate() {
        let wr = WorkRequestId(SEND_WR + i as u64);
        assert_eq!(
            n.t.post_send(*p, wr, src.local(0, 1024), None).unwrap(),
            PostOutcome::Posted
        );
    }
    for i in 0..PEERS {
        let r = target
            .t
            .post_recv(WorkRequestId(RECV_WR + i), inbox.local(i * 1024, 1024))
            .unwrap();
        assert_eq!(r, PostOutcome::Posted);
    }
    let d = Deadline::within(Duration::from_secs(5), "every SEND to be received");
    while of_kind(&target, OpKind::Recv, RECV_WR, RECV_WR + PEERS).len() < PEERS as usize {
        target.step();
        for (n, _, _) in &mut peers {
            n.step();
        }
        d.check();
    }
    for (n, _, _) in &peers {
        let c = of_kind(n, OpKind::Send, SEND_WR, SEND_WR + PEERS);
        assert!(c.iter().all(|c| c.result == Ok(1024)), "{c:?}");
    }
}
