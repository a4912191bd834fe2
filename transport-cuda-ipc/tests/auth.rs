//! The optional shared token (`CudaIpcConfig::auth_token`), on the loopback link (host
//! memory, no GPU needed: the control protocol is the one the CUDA link runs). Both ends of
//! every control connection prove it: a peer with the same token writes, reads and sends; one
//! with another token, or a token on one side only, is refused by both sides with a typed
//! reason, before any reservation, handle or byte; a HELLO or PROOF recorded on one
//! connection proves nothing on another.

mod raw;

use fabric_core::testing::{Canaried, pattern};
use fabric_core::{Access, Completion, Error, OpError, OpKind, PostOutcome, Transport};
use fabric_core::{PeerId, WorkRequestId};
use raw::Raw;
use std::time::Instant;
use transport_cuda_ipc::wire::{AUTH_TOKEN, Op};
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport, HandshakeError, LoopbackLink};

type T = CudaIpcTransport<LoopbackLink>;

const LEN: u64 = 4096;

fn transport(token: Option<&str>) -> T {
    let cfg = CudaIpcConfig {
        auth_token: token.map(String::from),
        ..CudaIpcConfig::default()
    };
    CudaIpcTransport::with_link(LoopbackLink::new(), cfg).unwrap()
}

/// Polls both until `a` has `n` completions (the target's go to `b_done`).
fn until_done(a: &mut T, b: &mut T, n: usize, b_done: &mut Vec<Completion>) -> Vec<Completion> {
    let deadline = Instant::now() + raw::PATIENCE;
    let mut done = Vec::new();
    while done.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions",
            done.len()
        );
        a.poll(&mut done).unwrap();
        b.poll(b_done).unwrap();
    }
    done
}

/// What [`write_from`] saw.
struct Outcome {
    /// The write's result.
    write: Result<u64, OpError>,
    /// The SEND's result.
    send: Result<u64, OpError>,
    /// What `peer_ready` said once both had completed.
    ready: Result<bool, Error>,
    /// The target's completions.
    at_target: Vec<Completion>,
}

/// A target with `token`, a region filled with 0x11 (canaried) that peers may write, and
/// a receive posted for one SEND.
fn target(token: Option<&str>) -> (T, Canaried) {
    let mut b = transport(token);
    let dst = Canaried::new(
        &mut b,
        LEN,
        Access::REMOTE_WRITE | Access::LOCAL_WRITE,
        0x11,
    );
    assert_eq!(
        b.post_recv(WorkRequestId(50), dst.local(0, 64)).unwrap(),
        PostOutcome::Posted
    );
    (b, dst)
}

/// A fresh initiator with `token` adds `target`, posts a write of `LEN` bytes into `dst`
/// (immediate value 9) and a 64-byte SEND at once (before the handshake), and polls both.
fn write_from(token: Option<&str>, target: &mut T, dst: &Canaried, seed: u64) -> Outcome {
    let mut a = transport(token);
    let src = Canaried::new(&mut a, LEN, Access::NONE, 0);
    src.write(0, &pattern(seed, LEN as usize));
    let peer = a.add_peer(&target.address()).unwrap();
    assert!(!a.peer_ready(peer).unwrap(), "ready before the PROOF");
    let w = a
        .post_write(
            peer,
            WorkRequestId(1),
            src.local(0, LEN),
            dst.remote(0, LEN),
            Some(9),
        )
        .unwrap();
    let s = a
        .post_send(peer, WorkRequestId(2), src.local(0, 64), None)
        .unwrap();
    assert_eq!((w, s), (PostOutcome::Posted, PostOutcome::Posted));
    let mut at_target = Vec::new();
    let done = until_done(&mut a, target, 2, &mut at_target);
    let result = |wr| {
        done.iter()
            .find(|c| c.wr_id == WorkRequestId(wr))
            .unwrap()
            .result
            .clone()
    };
    let ready = a.peer_ready(peer);
    // Whatever the target does next, it has been polled past everything it was sent.
    for _ in 0..10 {
        target.poll(&mut at_target).unwrap();
    }
    Outcome {
        write: result(1),
        send: result(2),
        ready,
        at_target,
    }
}

/// The refusal a failed operation carries, as the transport's typed error.
fn refusal(r: &Result<u64, OpError>) -> HandshakeError {
    match r {
        Err(OpError::Transport(e)) => e
            .downcast_ref::<HandshakeError>()
            .unwrap_or_else(|| panic!("not a HandshakeError: {e:?}"))
            .clone(),
        other => panic!("expected a refusal of the handshake, got {other:?}"),
    }
}

#[test]
fn the_same_token_on_both_sides_lets_writes_reads_and_sends_through() {
    let mut b = transport(Some("s3cret"));
    let dst = Canaried::new(&mut b, LEN, Access::REMOTE_WRITE | Access::LOCAL_WRITE, 0);
    assert_eq!(
        b.post_recv(WorkRequestId(50), dst.local(0, 64)).unwrap(),
        PostOutcome::Posted
    );
    let Outcome {
        write: w,
        send: s,
        ready,
        at_target,
    } = write_from(Some("s3cret"), &mut b, &dst, 7);
    assert_eq!((w, s), (Ok(LEN), Ok(64)));
    assert!(matches!(ready, Ok(true)), "{ready:?}");
    // The write landed (its immediate value reported), then the SEND over it.
    assert!(
        at_target
            .iter()
            .any(|c| c.op == OpKind::RemoteWrite && c.imm == Some(9)),
        "{at_target:?}"
    );
    assert!(
        at_target
            .iter()
            .any(|c| c.op == OpKind::Recv && c.result == Ok(64))
    );
    // The SEND's 64 bytes are the write's first 64.
    assert_eq!(dst.read(0, LEN as usize), pattern(7, LEN as usize));
    assert!(b.take_auth_refusals().is_empty());

    // And a READ, the other way, over a fresh pair.
    let mut a = transport(Some("s3cret"));
    let mut b = transport(Some("s3cret"));
    let theirs = Canaried::new(&mut b, LEN, Access::REMOTE_READ, 0x77);
    let ours = Canaried::new(&mut a, LEN, Access::LOCAL_WRITE, 0);
    let peer = a.add_peer(&b.address()).unwrap();
    let posted = a
        .post_read(
            peer,
            WorkRequestId(3),
            ours.local(0, LEN),
            theirs.remote(0, LEN),
        )
        .unwrap();
    assert_eq!(posted, PostOutcome::Posted);
    let done = until_done(&mut a, &mut b, 1, &mut Vec::new());
    assert_eq!(done[0].result, Ok(LEN));
    assert_eq!(ours.read(0, LEN as usize), vec![0x77; LEN as usize]);
}

#[test]
fn different_tokens_are_refused_by_both_sides_either_way_and_touch_nothing() {
    for (ours, theirs) in [
        ("s3cret", "other"),
        ("other", "s3cret"),
        ("s3cret", "s3cret "),
    ] {
        let (mut b, dst) = target(Some(theirs));
        let Outcome {
            write: w,
            send: s,
            ready,
            at_target,
        } = write_from(Some(ours), &mut b, &dst, 1);
        let what = format!("{ours:?} against {theirs:?}");
        // The initiator is told the target refused its proof; the target, that the proof
        // failed.
        assert_eq!(refusal(&w), HandshakeError::RefusedByTarget, "{what}");
        assert_eq!(refusal(&s), HandshakeError::RefusedByTarget, "{what}");
        assert!(!w.unwrap_err().is_retryable());
        assert!(
            matches!(&ready, Err(Error::Op(OpError::Transport(e)))
                if e.downcast_ref::<HandshakeError>() == Some(&HandshakeError::RefusedByTarget)),
            "{what}: {ready:?}"
        );
        assert_eq!(
            b.take_auth_refusals(),
            [HandshakeError::AuthenticationFailed],
            "{what}"
        );
        assert!(at_target.is_empty(), "{what}: {at_target:?}");
        assert_eq!(
            dst.read(0, LEN as usize),
            vec![0x11; LEN as usize],
            "{what}"
        );
        dst.assert_canaries();
    }
}

#[test]
fn a_token_on_one_side_only_is_refused_by_both_naming_the_side_without() {
    for (ours, theirs, initiator_says, target_says) in [
        (
            Some("s3cret"),
            None,
            HandshakeError::PeerHasNoToken,
            HandshakeError::NoTokenHere,
        ),
        (
            None,
            Some("s3cret"),
            HandshakeError::NoTokenHere,
            HandshakeError::PeerHasNoToken,
        ),
    ] {
        let (mut b, dst) = target(theirs);
        let Outcome {
            write: w,
            send: s,
            ready,
            at_target,
        } = write_from(ours, &mut b, &dst, 1);
        let what = format!("{ours:?} against {theirs:?}");
        assert_eq!(refusal(&w), initiator_says, "{what}");
        assert_eq!(refusal(&s), initiator_says, "{what}");
        assert!(initiator_says.is_authentication());
        assert!(
            refusal(&w)
                .to_string()
                .contains("give both sides the same token"),
            "{what}"
        );
        assert!(ready.is_err(), "{what}");
        assert_eq!(b.take_auth_refusals(), [target_says], "{what}");
        assert!(at_target.is_empty(), "{what}: {at_target:?}");
        assert_eq!(
            dst.read(0, LEN as usize),
            vec![0x11; LEN as usize],
            "{what}"
        );
    }
}

/// A relay between a real initiator and a real target records a whole handshake (which
/// succeeds: nothing binds the proofs to the socket, as the docs say). Replayed on another
/// connection, the HELLO is refused by the target, and the PROOF by a fresh initiator: each
/// connection's nonces are new.
#[test]
fn a_recorded_handshake_replayed_on_another_connection_is_refused() {
    let token = Some("s3cret");
    let mut t = transport(token);
    let dst = Canaried::new(&mut t, LEN, Access::REMOTE_WRITE, 0x11);
    let mut a = transport(token);
    let (l, relay_addr) = raw::fake_listener();
    let peer = a.add_peer(&relay_addr).unwrap();
    let (s, _) = l.accept().unwrap();
    let mut to_a = Raw::new(s);
    let mut to_t = Raw::connect(&t.address());
    let poll_t = |t: &mut T| {
        t.poll(&mut Vec::new()).unwrap();
    };
    let poll_a = |a: &mut T| {
        a.poll(&mut Vec::new()).unwrap();
    };

    let challenge = to_t.next(|| poll_t(&mut t)).expect("CHALLENGE");
    assert_eq!(
        (challenge.h.op, challenge.h.id),
        (Op::Challenge, AUTH_TOKEN)
    );
    to_a.send(&challenge.bytes);
    let hello = to_a.next(|| poll_a(&mut a)).expect("HELLO");
    assert_eq!(hello.h.op, Op::Hello);
    to_t.send(&hello.bytes);
    let proof = to_t.next(|| poll_t(&mut t)).expect("PROOF");
    assert_eq!(proof.h.op, Op::Proof);
    to_a.send(&proof.bytes);
    let deadline = Instant::now() + raw::PATIENCE;
    while !a.peer_ready(peer).unwrap() {
        assert!(
            Instant::now() < deadline,
            "the relayed handshake did not end"
        );
        poll_a(&mut a);
    }
    assert!(t.take_auth_refusals().is_empty());

    // The HELLO again, on a connection of its own: its tag covers the first CHALLENGE's
    // nonce, not this one's.
    let mut again = Raw::connect(&t.address());
    let second = again.next(|| poll_t(&mut t)).expect("CHALLENGE");
    assert_ne!(raw::nonce_of(&second), raw::nonce_of(&challenge));
    again.send(&hello.bytes);
    // A reservation right behind it must not be served.
    let mut reserve = Vec::new();
    transport_cuda_ipc::wire::put_frame(
        &mut reserve,
        Op::Reserve,
        1,
        0,
        &[transport_cuda_ipc::wire::Reserve {
            key: dst.reg.remote.key.0,
            offset: 0,
            len: LEN,
        }],
    );
    again.send(&reserve);
    let answered: Vec<Op> = again
        .until_closed(|| poll_t(&mut t))
        .iter()
        .map(|f| f.h.op)
        .collect();
    assert_eq!(answered, [Op::Refuse]);
    assert_eq!(
        t.take_auth_refusals(),
        [HandshakeError::AuthenticationFailed]
    );

    // The PROOF again, to a fresh initiator's connection: it covers the first HELLO's
    // nonce, not this one's.
    let (l, addr) = raw::fake_listener();
    let mut b = transport(token);
    let src = Canaried::new(&mut b, LEN, Access::NONE, 0x22);
    let peer = b.add_peer(&addr).unwrap();
    let posted = b
        .post_write(
            peer,
            WorkRequestId(1),
            src.local(0, LEN),
            dst.remote(0, LEN),
            None,
        )
        .unwrap();
    assert_eq!(posted, PostOutcome::Posted);
    let (s, _) = l.accept().unwrap();
    let mut fake = Raw::new(s);
    fake.send(&challenge.bytes);
    let hello2 = fake.next(|| poll_a(&mut b)).expect("HELLO");
    assert_ne!(raw::hello_nonce(&hello2), raw::hello_nonce(&hello));
    fake.send(&proof.bytes);
    let deadline = Instant::now() + raw::PATIENCE;
    let e = loop {
        assert!(
            Instant::now() < deadline,
            "the replayed PROOF was not refused"
        );
        match b.peer_ready(peer) {
            Ok(true) => panic!("a replayed PROOF was taken"),
            Ok(false) => poll_a(&mut b),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(&e, Error::Op(OpError::Transport(t))
            if t.downcast_ref::<HandshakeError>() == Some(&HandshakeError::ProofFailed)),
        "{e}"
    );
    // It got nothing after the HELLO: no reservation of the write posted before.
    let sent: Vec<Op> = fake
        .until_closed(|| poll_a(&mut b))
        .iter()
        .map(|f| f.h.op)
        .collect();
    assert!(sent.is_empty(), "{sent:?}");
    assert_eq!(dst.read(0, LEN as usize), vec![0x11; LEN as usize]);
}

/// An initiator of protocol version 2 (its HELLO at once, an address only) is refused, and
/// the target says why.
#[test]
fn a_peer_of_the_previous_version_is_refused_naming_the_versions() {
    for token in [None, Some("s3cret")] {
        let mut t = transport(token);
        let mut r = Raw::connect(&t.address());
        r.send(&raw::old_hello(&transport(None).address()));
        let answered: Vec<Op> = r
            .until_closed(|| {
                t.poll(&mut Vec::new()).unwrap();
            })
            .iter()
            .map(|f| f.h.op)
            .collect();
        assert_eq!(answered, [Op::Challenge], "{token:?}");
        let refused = t.take_auth_refusals();
        assert_eq!(refused, [HandshakeError::Version(2)], "{token:?}");
        assert!(
            refused[0]
                .to_string()
                .contains("protocol version 2, this side 3"),
            "{}",
            refused[0]
        );
    }
}

#[test]
fn peer_ready_waits_for_the_targets_proof() {
    let mut a = transport(Some("s3cret"));
    let mut b = transport(Some("s3cret"));
    let peer = a.add_peer(&b.address()).unwrap();
    // The target has not polled: no CHALLENGE yet, so not ready however often we poll.
    for _ in 0..10 {
        a.poll(&mut Vec::new()).unwrap();
        assert!(!a.peer_ready(peer).unwrap());
    }
    let deadline = Instant::now() + raw::PATIENCE;
    while !a.peer_ready(peer).unwrap() {
        assert!(Instant::now() < deadline, "never ready");
        b.poll(&mut Vec::new()).unwrap();
        a.poll(&mut Vec::new()).unwrap();
    }
    assert!(matches!(
        a.peer_ready(PeerId(999)),
        Err(Error::UnknownPeer(_))
    ));
}

#[test]
fn the_configurations_debug_form_does_not_show_the_token() {
    let cfg = CudaIpcConfig {
        auth_token: Some("s3cret-value".into()),
        ..CudaIpcConfig::default()
    };
    let shown = format!("{cfg:?}");
    assert!(!shown.contains("s3cret-value"), "{shown}");
    assert!(
        shown.contains("auth_token: Some(\"<redacted>\")"),
        "{shown}"
    );
}
