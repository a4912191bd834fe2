//! The optional shared token (`TcpConfig::auth_token`): both ends of every connection
//! prove it. Peers that do not prove it for the nonce of their connection's CHALLENGE are
//! refused during the handshake, before any of their frames touches memory; targets that do
//! not prove it for the nonce of our HELLO (their PROOF) never get a request, a payload or
//! an answer of ours; a token on one side only is refused by both, each saying which side
//! lacks it; a HELLO or PROOF recorded on one connection proves nothing on another.

mod common;

use common::{
    Deadline, Node, Raw, concat, hello_frame, mutual_hello_frame, proof_frame, tagged_hello_frame,
    write_frame,
};
use fabric_core::testing::{Canaried, pattern};
use fabric_core::{Access, Error, OpError, OpKind, PostOutcome, Transport, WorkRequestId};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;
use transport_tcp::auth::{self, Nonce};
use transport_tcp::frame::{
    AUTH_NONE, AUTH_TOKEN, CHALLENGE_VERSION, HEADER_LEN, HELLO_CONTEXT, HELLO_TAG_LEN, Header, Op,
    PROOF_CONTEXT, PROTOCOL_VERSION, code,
};
use transport_tcp::{TcpConfig, TcpError, TcpTransport, auth_digest};

const LEN: u64 = 4096;

fn with_token(t: Option<&str>) -> TcpConfig {
    TcpConfig {
        auth_token: t.map(String::from),
        ..TcpConfig::default()
    }
}

/// Writes `LEN` bytes from a fresh initiator with `token` into `dst`; returns its result.
fn write_from(
    token: Option<&str>,
    target: &mut Node,
    dst: &Canaried,
    seed: u64,
) -> Result<u64, OpError> {
    let mut a = Node::new(with_token(token));
    let src = Canaried::new(&mut a.t, LEN, Access::NONE, 0);
    src.write(0, &pattern(seed, LEN as usize));
    let peer = a.t.add_peer(&target.t.address()).expect("add_peer");
    let d = Deadline::new("the write to complete");
    while a
        .t
        .post_write(
            peer,
            WorkRequestId(1),
            src.local(0, LEN),
            dst.remote(0, LEN),
            None,
        )
        .expect("post")
        == PostOutcome::NoRoom
    {
        a.step();
        target.step();
        d.check();
    }
    while a.done.is_empty() {
        a.step();
        target.step();
        d.check();
    }
    a.done[0].result.clone()
}

/// Peers the target has known (connected, or connected and gone): only a peer whose HELLO
/// it took becomes one.
fn known_peers(t: &mut TcpTransport) -> usize {
    t.stats().expect("stats").snapshot().peers.len()
}

/// The refusal a failed operation carries, as the transport's typed error.
fn refusal(r: &Result<u64, OpError>) -> &TcpError {
    match r {
        Err(OpError::Transport(e)) => e
            .downcast_ref::<TcpError>()
            .unwrap_or_else(|| panic!("not a TcpError: {e:?}")),
        other => panic!("expected a refusal of the handshake, got {other:?}"),
    }
}

#[test]
fn the_right_token_is_let_in_and_others_are_refused_with_typed_errors_on_both_sides() {
    let mut target = Node::new(with_token(Some("s3cret")));
    let dst = Canaried::new(&mut target.t, LEN, Access::REMOTE_WRITE, 0x11);
    for wrong in [None, Some("wrong"), Some("s3cret ")] {
        let r = write_from(wrong, &mut target, &dst, 1);
        // Each side names what it saw: the initiator without a token is told the target has
        // one; one with another token, that the target refused its proof.
        let (ours, theirs) = (refusal(&r), target.t.take_auth_refusals());
        match wrong {
            None => {
                assert!(matches!(ours, TcpError::NoTokenHere), "{ours}");
                assert!(
                    matches!(theirs[..], [TcpError::PeerHasNoToken]),
                    "{theirs:?}"
                );
            }
            Some(_) => {
                assert!(matches!(ours, TcpError::RefusedByTarget), "{ours}");
                assert!(
                    matches!(theirs[..], [TcpError::AuthenticationFailed]),
                    "{theirs:?}"
                );
            }
        }
        assert!(ours.is_authentication() && !r.as_ref().unwrap_err().is_retryable());
        assert_eq!(
            dst.read(0, LEN as usize),
            vec![0x11; LEN as usize],
            "token {wrong:?} wrote"
        );
        assert_eq!(known_peers(&mut target.t), 0, "token {wrong:?} was let in");
    }
    assert_eq!(write_from(Some("s3cret"), &mut target, &dst, 2), Ok(LEN));
    assert_eq!(dst.read(0, LEN as usize), pattern(2, LEN as usize));
    assert_eq!(known_peers(&mut target.t), 1);
    assert!(target.t.take_auth_refusals().is_empty());
    dst.assert_canaries();
}

#[test]
fn frames_right_behind_an_unauthenticated_hello_never_land() {
    let mut target = Node::new(with_token(Some("s3cret")));
    let dst = Canaried::new(&mut target.t, LEN, Access::REMOTE_WRITE, 0x11);
    let key = dst.reg.remote.key.0;
    let mut c = Raw::connect(&target.t);
    // HELLO without a token, and a valid WRITE in the same segment.
    c.send_ok(
        &concat(&[
            &hello_frame(),
            &write_frame(key, 0, &[0xEE; 64], Some(5), 1),
        ]),
        || target.step(),
    );
    c.expect_closed("an unauthenticated HELLO", || target.step());
    assert_eq!(dst.read(0, LEN as usize), vec![0x11; LEN as usize]);
    assert!(
        target.remote_writes().is_empty(),
        "no immediate data from a refused peer"
    );
    dst.assert_canaries();
}

#[test]
fn a_target_without_a_token_is_refused_by_an_initiator_with_one_both_ways() {
    // Was `a_target_without_a_token_accepts_peers_that_send_one`: a client with a token
    // wrote to any server, which proved nothing.
    let mut target = Node::new(with_token(None));
    let dst = Canaried::new(&mut target.t, LEN, Access::REMOTE_WRITE, 0);
    let r = write_from(Some("anything"), &mut target, &dst, 3);
    let ours = refusal(&r);
    assert!(matches!(ours, TcpError::PeerHasNoToken), "{ours}");
    let theirs = target.t.take_auth_refusals();
    assert!(matches!(theirs[..], [TcpError::NoTokenHere]), "{theirs:?}");
    assert_eq!(dst.read(0, LEN as usize), vec![0; LEN as usize]);
    assert_eq!(known_peers(&mut target.t), 0);
    // Without a token on either side, as before.
    assert_eq!(write_from(None, &mut target, &dst, 4), Ok(LEN));
    assert_eq!(dst.read(0, LEN as usize), pattern(4, LEN as usize));
}

/// A fake target on a listener of our own: the initiator `a` (with `token`) adds it as a
/// peer and posts a WRITE to it; the fake's side of the connection is returned.
struct FakeTarget {
    a: Node,
    /// The WRITE's source, registered with `a`.
    _src: Canaried,
    peer: fabric_core::PeerId,
    fake: Raw,
}

impl FakeTarget {
    fn new(token: Option<&str>) -> FakeTarget {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = format!("tcp://{}", listener.local_addr().unwrap());
        let mut a = Node::new(with_token(token));
        let src = Canaried::new(&mut a.t, LEN, Access::NONE, 0);
        src.write(0, &[0xA7; LEN as usize]);
        let peer = a.t.add_peer(addr.as_bytes()).expect("add_peer");
        let fake = Raw::from_stream(listener.accept().unwrap().0);
        let region = fabric_core::RemoteRegion {
            addr: 0,
            len: LEN,
            key: fabric_core::RemoteKey(1),
        };
        let dst = fabric_core::RemoteSlice {
            region,
            offset: 0,
            len: LEN,
        };
        let posted =
            a.t.post_write(peer, WorkRequestId(1), src.local(0, LEN), dst, None)
                .unwrap();
        assert_eq!(posted, PostOutcome::Posted);
        FakeTarget {
            a,
            _src: src,
            peer,
            fake,
        }
    }

    /// Sends `challenge`, and takes the initiator's HELLO (header and payload).
    fn challenge(&mut self, challenge: Header) -> (Header, Vec<u8>) {
        let a = &mut self.a;
        self.fake.send_ok(&challenge.encode(), || a.step());
        let h = self.fake.read_header(|| a.step());
        assert_eq!(h.op, Op::Hello, "{h:?}");
        let payload = self.fake.read_bytes(h.len as usize, || a.step());
        (h, payload)
    }

    /// Steps the initiator until the peer fails; its error.
    fn failure(&mut self) -> Error {
        let d = Deadline::new("the initiator to give the fake target up");
        loop {
            self.a.step();
            self.fake.pump();
            match self.a.t.peer_ready(self.peer) {
                Ok(_) => d.check(),
                Err(e) => return e,
            }
        }
    }
}

/// The typed refusal in a failed `peer_ready`.
fn peer_refusal(e: &Error) -> &TcpError {
    match e {
        Error::Op(OpError::Transport(t)) => t.downcast_ref::<TcpError>().expect("a TcpError"),
        e => panic!("expected a refusal of the handshake, got {e:?}"),
    }
}

#[test]
fn an_initiator_sends_nothing_after_its_hello_until_the_target_proves_the_token() {
    let nonce = Nonce::new().unwrap();
    type Prover = fn(&Nonce, &Nonce) -> [u8; auth::TAG_LEN];
    // PROOFs that do not prove the token for this connection's nonce (the initiator's, the
    // first 16 bytes of its HELLO's payload).
    let wrong: [(&str, Prover); 5] = [
        ("another token's", |mine, _| {
            auth::tag("guess", PROOF_CONTEXT, mine)
        }),
        ("a replayed PROOF (another nonce)", |_, _| {
            auth::tag("s3cret", PROOF_CONTEXT, &Nonce::new().unwrap())
        }),
        ("the HELLO's own tag reflected", |_, challenge| {
            auth::tag("s3cret", HELLO_CONTEXT, challenge)
        }),
        ("the HELLO context over our nonce", |mine, _| {
            auth::tag("s3cret", HELLO_CONTEXT, mine)
        }),
        ("zeros", |_, _| [0u8; auth::TAG_LEN]),
    ];
    for (what, prover) in wrong {
        let mut f = FakeTarget::new(Some("s3cret"));
        let (h, payload) = f.challenge(Header::challenge(&nonce, AUTH_TOKEN));
        assert_eq!((h.code, h.imm), (PROTOCOL_VERSION, AUTH_TOKEN), "{what}");
        let want = auth::tag("s3cret", HELLO_CONTEXT, &nonce);
        assert_eq!(h.key_offset_bytes()[..], want[..HELLO_TAG_LEN], "{what}");
        let mine = Nonce::from_bytes(payload[..16].try_into().unwrap());
        // Nothing but the HELLO leaves while the PROOF has not come: not the WRITE.
        for _ in 0..50 {
            f.a.step();
        }
        f.fake.pump();
        assert!(
            f.fake.rx.is_empty(),
            "{what}: sent before a PROOF: {:?}",
            f.fake.rx
        );
        let tag = prover(&mine, &nonce);
        f.fake.send_ok(
            &Header::proof(tag[..HELLO_TAG_LEN].try_into().unwrap()).encode(),
            || f.a.step(),
        );
        let e = f.failure();
        assert!(
            matches!(peer_refusal(&e), TcpError::ProofFailed),
            "{what}: {e}"
        );
        f.fake.expect_closed(what, || f.a.step());
        assert!(
            f.fake.rx.is_empty(),
            "{what}: the WRITE left: {:?}",
            f.fake.rx
        );
        assert_eq!(f.a.done.len(), 1, "{what}");
        assert!(f.a.done[0].result.is_err(), "{what}");
    }
    // The right PROOF lets the WRITE go.
    let mut f = FakeTarget::new(Some("s3cret"));
    let (_, payload) = f.challenge(Header::challenge(&nonce, AUTH_TOKEN));
    f.fake
        .send_ok(&proof_frame(Some("s3cret"), &payload), || f.a.step());
    let w = f.fake.read_header(|| f.a.step());
    assert!(matches!(w.op, Op::Write | Op::Batch), "{w:?}");
    let a = &mut f.a;
    let _ = f.fake.read_bytes(LEN as usize, || a.step());
    assert!(f.a.t.peer_ready(f.peer).unwrap());
}

#[test]
fn an_initiator_with_a_token_gives_no_tag_to_a_target_without_one() {
    // A target of this version without a token: the HELLO says we have one, untagged, and
    // the peer fails with the reason.
    let mut f = FakeTarget::new(Some("s3cret"));
    let (h, _) = f.challenge(Header::challenge(&Nonce::new().unwrap(), AUTH_NONE));
    assert_eq!((h.code, h.imm), (PROTOCOL_VERSION, AUTH_TOKEN));
    assert_eq!(
        h.key_offset_bytes(),
        [0u8; 16],
        "a tag for a target without a token"
    );
    let e = f.failure();
    assert!(matches!(peer_refusal(&e), TcpError::PeerHasNoToken), "{e}");
    f.fake
        .expect_closed("the refusing initiator", || f.a.step());
    assert!(
        f.fake.rx.is_empty(),
        "sent after its HELLO: {:?}",
        f.fake.rx
    );

    // A target of version 4 cannot prove a token: nothing at all is sent to it.
    let mut f = FakeTarget::new(Some("s3cret"));
    let mut old = Header::challenge(&Nonce::new().unwrap(), AUTH_NONE);
    old.code = CHALLENGE_VERSION;
    f.fake.send_ok(&old.encode(), || f.a.step());
    let e = f.failure();
    assert!(
        matches!(peer_refusal(&e), TcpError::ChallengeNotMutual(4)),
        "{e}"
    );
    f.fake
        .expect_closed("the initiator refusing version 4", || f.a.step());
    assert_eq!(f.fake.received, 0, "sent {:?}", f.fake.rx);

    // Without a token, an initiator answers a target of version 4 as version 4 did.
    let mut f = FakeTarget::new(None);
    let mut old = Header::challenge(&Nonce::new().unwrap(), AUTH_NONE);
    old.code = CHALLENGE_VERSION;
    let (h, payload) = f.challenge(old);
    assert_eq!((h.code, h.len as usize), (CHALLENGE_VERSION, payload.len()));
    let w = f.fake.read_header(|| f.a.step());
    assert!(matches!(w.op, Op::Write | Op::Batch), "{w:?}");
}

#[test]
fn an_initiator_without_a_token_is_told_the_target_has_one() {
    let mut f = FakeTarget::new(None);
    let (h, payload) = f.challenge(Header::challenge(&Nonce::new().unwrap(), AUTH_TOKEN));
    assert_eq!((h.code, h.imm), (PROTOCOL_VERSION, AUTH_NONE));
    assert_eq!(h.key_offset_bytes(), [0u8; 16]);
    assert!(payload.len() >= 28);
    let e = f.failure();
    assert!(matches!(peer_refusal(&e), TcpError::NoTokenHere), "{e}");
    f.fake
        .expect_closed("the refusing initiator", || f.a.step());
    assert!(
        f.fake.rx.is_empty(),
        "sent after its HELLO: {:?}",
        f.fake.rx
    );
}

/// A relay on loopback between an initiator and a target, polled from the test thread,
/// that records every byte each side sends.
struct Recorder {
    listener: TcpListener,
    target: std::net::SocketAddr,
    /// The initiator's connection (accepted), and ours to the target.
    sides: Option<(Raw, Raw)>,
    /// What the initiator sent, and what the target sent.
    up: Vec<u8>,
    down: Vec<u8>,
}

impl Recorder {
    fn new(target: &TcpTransport) -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        Recorder {
            listener,
            target: target.local_addr(),
            sides: None,
            up: Vec::new(),
            down: Vec::new(),
        }
    }

    fn address(&self) -> Vec<u8> {
        format!("tcp://{}", self.listener.local_addr().unwrap()).into_bytes()
    }

    /// Accepts the initiator's connection (once), and moves what has come either way.
    fn relay(&mut self) {
        if self.sides.is_none() {
            match self.listener.accept() {
                Ok((client, _)) => {
                    // Raw on both sides: every byte as it came, the CHALLENGE included.
                    let server = TcpStream::connect(self.target).unwrap();
                    self.sides = Some((Raw::from_stream(client), Raw::from_stream(server)));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => panic!("accept: {e}"),
            }
        }
        let (client, server) = self.sides.as_mut().expect("accepted above");
        client.pump();
        let up: Vec<u8> = client.rx.drain(..).collect();
        server.send_ok(&up, || {});
        self.up.extend(up);
        server.pump();
        let down: Vec<u8> = server.rx.drain(..).collect();
        client.send_ok(&down, || {});
        self.down.extend(down);
    }
}

#[test]
fn a_replayed_hello_is_refused() {
    let mut target = Node::new(with_token(Some("s3cret")));
    let dst = Canaried::new(&mut target.t, LEN, Access::REMOTE_WRITE, 0x11);
    // A legitimate initiator writes through the recorder: its bytes (HELLO, the WRITE and
    // its payload) are what an eavesdropper sees.
    let mut a = Node::new(with_token(Some("s3cret")));
    let src = Canaried::new(&mut a.t, LEN, Access::NONE, 0);
    src.write(0, &pattern(7, LEN as usize));
    let mut rec = Recorder::new(&target.t);
    let peer = a.t.add_peer(&rec.address()).expect("add_peer");
    let posted =
        a.t.post_write(
            peer,
            WorkRequestId(1),
            src.local(0, LEN),
            dst.remote(0, LEN),
            Some(77),
        )
        .expect("post");
    assert_eq!(posted, PostOutcome::Posted);
    let d = Deadline::new("the recorded write to complete");
    while a.done.is_empty() || target.remote_writes().is_empty() {
        a.step();
        rec.relay();
        target.step();
        d.check();
    }
    assert_eq!(a.done[0].result, Ok(LEN), "the legitimate write");
    assert_eq!(dst.read(0, LEN as usize), pattern(7, LEN as usize));
    assert_eq!(target.remote_writes()[0].imm, Some(77));
    let recorded = rec.up.clone();
    let first = Header::decode(recorded[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!((first.op, first.code), (Op::Hello, PROTOCOL_VERSION));
    let old = Header::decode(rec.down[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!(old.op, Op::Challenge);
    let old_nonce = Nonce::from_bytes(old.key_offset_bytes());
    // The target proved itself for the initiator's nonce before the WRITE was answered.
    let proof = Header::decode(rec.down[HEADER_LEN..2 * HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!(proof.op, Op::Proof);
    let theirs = Nonce::from_bytes(recorded[HEADER_LEN..HEADER_LEN + 16].try_into().unwrap());
    assert!(auth::verify(
        "s3cret",
        PROOF_CONTEXT,
        &theirs,
        &proof.key_offset_bytes()
    ));
    assert!(
        recorded.len() > HEADER_LEN + LEN as usize,
        "the HELLO, the WRITE and its payload were recorded"
    );

    // The region back to its fill; what the target knows now.
    dst.write(0, &[0x11; LEN as usize]);
    target.done.clear();
    let peers = known_peers(&mut target.t);
    let writes = target.t.stats().unwrap().snapshot().received_writes;

    // The eavesdropper replays the recorded bytes on a connection of its own, after the
    // target's CHALLENGE, as a real initiator would.
    let mut r = Raw::connect(&target.t);
    let nonce = r.nonce(|| target.step());
    assert_ne!(nonce, old_nonce, "a fresh nonce for every connection");
    let _ = r.send(&recorded, || target.step());
    r.expect_closed("a replayed HELLO", || target.step());
    assert_refused_only(&r.rx, "a replayed HELLO");
    let theirs = target.t.take_auth_refusals();
    assert!(
        matches!(theirs[..], [TcpError::AuthenticationFailed]),
        "{theirs:?}"
    );
    assert_eq!(dst.read(0, LEN as usize), vec![0x11; LEN as usize]);
    dst.assert_canaries();
    assert!(
        target.remote_writes().is_empty(),
        "immediate data from a replay"
    );
    assert_eq!(
        known_peers(&mut target.t),
        peers,
        "the replayer became a peer"
    );
    let snap = target.t.stats().unwrap().snapshot();
    assert_eq!(snap.received_writes, writes);

    // Blind, without waiting for the CHALLENGE: the same.
    let mut r = Raw::connect(&target.t);
    let _ = r.send(&recorded, || target.step());
    r.expect_closed("a replayed HELLO sent blind", || target.step());
    assert_eq!(dst.read(0, LEN as usize), vec![0x11; LEN as usize]);
    assert!(target.remote_writes().is_empty());

    // The same bytes with a HELLO tagged for the new connection's nonce are let in: the
    // tag was all that was wrong with the replay.
    let mut r = Raw::connect(&target.t);
    let nonce = r.nonce(|| target.step());
    let mut fresh = recorded.clone();
    let mut h = first;
    let tag = auth::tag("s3cret", HELLO_CONTEXT, &nonce);
    h.set_key_offset_bytes(tag[..16].try_into().unwrap());
    fresh[..HEADER_LEN].copy_from_slice(&h.encode());
    r.send_ok(&fresh, || target.step());
    target.until("the re-tagged write", |t| !t.remote_writes().is_empty());
    assert_eq!(dst.read(0, LEN as usize), pattern(7, LEN as usize));
    dst.assert_canaries();
}

/// What a target sends a refused HELLO of version 5 before it closes: at most a NACK of
/// code AUTH (nothing else: no PROOF, no answer).
fn assert_refused_only(rx: &[u8], what: &str) {
    match rx.len() {
        0 => {}
        HEADER_LEN => {
            let h = Header::decode(rx.try_into().unwrap()).unwrap();
            assert_eq!((h.op, h.code), (Op::Nack, code::AUTH), "{what}: {h:?}");
        }
        _ => panic!("{what}: the target answered {rx:?}"),
    }
}

/// A HELLO of this version, with a token's mode and the initiator's nonce `mine`, carrying
/// `tag`'s left 16 bytes.
fn hello_with_tag(tag: &[u8; auth::TAG_LEN], mine: &Nonce) -> Vec<u8> {
    let mut b = mutual_hello_frame(
        PROTOCOL_VERSION,
        Some("unused"),
        &Nonce::new().unwrap(),
        mine,
    );
    let mut h = Header::decode(b[..HEADER_LEN].try_into().unwrap()).unwrap();
    h.set_key_offset_bytes(tag[..16].try_into().unwrap());
    b[..HEADER_LEN].copy_from_slice(&h.encode());
    b
}

#[test]
fn a_raw_hello_with_the_tag_of_its_challenge_is_let_in() {
    let mut target = Node::new(with_token(Some("s3cret")));
    let dst = Canaried::new(&mut target.t, LEN, Access::REMOTE_WRITE, 0x11);
    let key = dst.reg.remote.key.0;
    // A connection open meanwhile: its nonce is another one.
    let mut other = Raw::connect(&target.t);
    let other_nonce = other.nonce(|| target.step());
    type Tagger = fn(&Nonce, &Nonce) -> [u8; auth::TAG_LEN];
    let wrong: [(&str, Tagger); 3] = [
        ("a tag of another context", |n, _| {
            auth::tag("s3cret", "xfer-tcp/4 HELLO: target to initiator", n)
        }),
        ("a tag of another connection's nonce", |_, other| {
            auth::tag("s3cret", HELLO_CONTEXT, other)
        }),
        ("a tag of another token", |n, _| {
            auth::tag("guess", HELLO_CONTEXT, n)
        }),
    ];
    for (what, tagger) in wrong {
        let mut c = Raw::connect(&target.t);
        let nonce = c.nonce(|| target.step());
        assert_ne!(nonce, other_nonce, "a fresh nonce for every connection");
        let hello = hello_with_tag(&tagger(&nonce, &other_nonce), &Nonce::new().unwrap());
        let _ = c.send(
            &concat(&[&hello, &write_frame(key, 0, &[0xEE; 64], Some(5), 1)]),
            || target.step(),
        );
        c.expect_closed(what, || target.step());
        assert_refused_only(&c.rx, what);
        assert_eq!(
            dst.read(0, LEN as usize),
            vec![0x11; LEN as usize],
            "{what}"
        );
        assert_eq!(known_peers(&mut target.t), 0, "{what}");
    }

    // The HELLO as the protocol says: the left 16 bytes of the tag of this connection's
    // nonce, in `key` and `offset`. The target's PROOF comes first: the tag of our nonce.
    let mut c = Raw::connect(&target.t);
    let nonce = c.nonce(|| target.step());
    assert_eq!(c.challenge.unwrap().imm, AUTH_TOKEN);
    let mine = Nonce::new().unwrap();
    c.send_ok(
        &concat(&[
            &hello_with_tag(&auth::tag("s3cret", HELLO_CONTEXT, &nonce), &mine),
            &write_frame(key, 0, &[0xA5; 64], Some(5), 1),
        ]),
        || target.step(),
    );
    let proof = c.read_header(|| target.step());
    assert_eq!((proof.op, proof.len, proof.flags), (Op::Proof, 0, 0));
    assert!(auth::verify(
        "s3cret",
        PROOF_CONTEXT,
        &mine,
        &proof.key_offset_bytes()
    ));
    assert!(!auth::verify(
        "s3cret",
        PROOF_CONTEXT,
        &nonce,
        &proof.key_offset_bytes()
    ));
    assert_eq!(c.answers(1, || target.step()), vec![common::Answer::Ack]);
    assert_eq!(dst.read(0, 64), vec![0xA5; 64]);
    assert_eq!(known_peers(&mut target.t), 1);
    dst.assert_canaries();
}

#[test]
fn a_target_without_a_token_serves_peers_without_one_and_refuses_peers_with_one() {
    let mut target = Node::new(with_token(None));
    let dst = Canaried::new(&mut target.t, LEN, Access::REMOTE_WRITE, 0);
    let key = dst.reg.remote.key.0;
    for (i, version) in [0u8, CHALLENGE_VERSION, PROTOCOL_VERSION]
        .into_iter()
        .enumerate()
    {
        let mut c = Raw::connect(&target.t);
        // The same frames as with a token: the CHALLENGE comes first, saying it has none.
        let nonce = c.nonce(|| target.step());
        assert_eq!(c.challenge.unwrap().imm, AUTH_NONE);
        let hello = match version {
            0 => hello_frame(),
            v => mutual_hello_frame(v, None, &nonce, &Nonce::new().unwrap()),
        };
        let data = [i as u8 + 1; 64];
        c.send_ok(
            &concat(&[&hello, &write_frame(key, 0, &data, None, 1)]),
            || target.step(),
        );
        if version == PROTOCOL_VERSION {
            // A PROOF of zeros: no token, as agreed.
            let p = c.read_header(|| target.step());
            assert_eq!((p.op, p.key_offset_bytes()), (Op::Proof, [0u8; 16]));
        }
        assert_eq!(c.answers(1, || target.step()), vec![common::Answer::Ack]);
        assert_eq!(dst.read(0, 64), data);
    }
    // A HELLO that says it has a token, tagged or not: refused, and told so.
    for tagged in [false, true] {
        let mut c = Raw::connect(&target.t);
        let nonce = c.nonce(|| target.step());
        let mut hello = tagged_hello_frame(PROTOCOL_VERSION, "anything", &nonce);
        if !tagged {
            hello[16..32].fill(0);
        }
        let _ = c.send(
            &concat(&[&hello, &write_frame(key, 0, &[0xEE; 64], None, 1)]),
            || target.step(),
        );
        c.expect_closed("a HELLO with a token to a target without one", || {
            target.step()
        });
        assert_refused_only(&c.rx, "a HELLO with a token");
        let theirs = target.t.take_auth_refusals();
        assert!(matches!(theirs[..], [TcpError::NoTokenHere]), "{theirs:?}");
    }
    assert_eq!(dst.read(0, 64), [3u8; 64]);
}

#[test]
fn a_peer_of_protocol_version_3_is_refused() {
    let mut target = Node::new(with_token(Some("s3cret")));
    let dst = Canaried::new(&mut target.t, LEN, Access::REMOTE_WRITE, 0x11);
    let key = dst.reg.remote.key.0;
    // What a build of version 3 sends: its HELLO with the static digest, at once.
    let v3 = {
        let mut b = hello_frame();
        let mut h = Header::decode(b[..HEADER_LEN].try_into().unwrap()).unwrap();
        h.code = 3;
        h.set_key_offset_bytes(&auth_digest("s3cret"));
        b[..HEADER_LEN].copy_from_slice(&h.encode());
        b
    };
    let mut c = Raw::connect(&target.t);
    let _ = c.send(
        &concat(&[&v3, &write_frame(key, 0, &[0xEE; 64], Some(5), 1)]),
        || target.step(),
    );
    c.expect_closed("a HELLO of version 3", || target.step());
    // Version 3 with a right tag: refused for its version.
    let mut c = Raw::connect(&target.t);
    let nonce = c.nonce(|| target.step());
    let _ = c.send(
        &concat(&[
            &tagged_hello_frame(3, "s3cret", &nonce),
            &write_frame(key, 0, &[0xEE; 64], Some(5), 1),
        ]),
        || target.step(),
    );
    c.expect_closed("a tagged HELLO of version 3", || target.step());
    // Version 4 proves the token but cannot check ours: refused by a target with a token.
    let mut c = Raw::connect(&target.t);
    let nonce = c.nonce(|| target.step());
    let _ = c.send(
        &concat(&[
            &tagged_hello_frame(CHALLENGE_VERSION, "s3cret", &nonce),
            &write_frame(key, 0, &[0xEE; 64], Some(5), 1),
        ]),
        || target.step(),
    );
    c.expect_closed("a tagged HELLO of version 4", || target.step());
    assert!(c.rx.is_empty(), "answered version 4: {:?}", c.rx);
    let theirs = target.t.take_auth_refusals();
    assert!(
        theirs
            .iter()
            .any(|e| matches!(e, TcpError::HelloNotMutual(4))),
        "{theirs:?}"
    );
    assert_eq!(dst.read(0, LEN as usize), vec![0x11; LEN as usize]);
    assert!(target.remote_writes().is_empty());
    assert_eq!(known_peers(&mut target.t), 0);
}

#[test]
fn an_initiator_sends_nothing_before_the_challenge_and_fails_without_one() {
    // A target of version 3 or older: it accepts, and waits for a HELLO.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("tcp://{}", listener.local_addr().unwrap());
    let mut a = Node::new(TcpConfig {
        auth_token: Some("s3cret".into()),
        peer_timeout: Duration::from_millis(300),
        ..TcpConfig::default()
    });
    let src = Canaried::new(&mut a.t, LEN, Access::NONE, 0);
    let peer = a.t.add_peer(addr.as_bytes()).expect("add_peer");
    let mut old = Raw::from_stream(listener.accept().unwrap().0);
    let region = fabric_core::RemoteRegion {
        addr: 0,
        len: LEN,
        key: fabric_core::RemoteKey(1),
    };
    let dst = fabric_core::RemoteSlice {
        region,
        offset: 0,
        len: LEN,
    };
    assert_eq!(
        a.t.post_write(peer, WorkRequestId(1), src.local(0, LEN), dst, None)
            .unwrap(),
        PostOutcome::Posted
    );
    let d = Deadline::new("the peer to fail for want of a CHALLENGE");
    let err = loop {
        a.step();
        old.pump();
        match a.t.peer_ready(peer) {
            Ok(_) => d.check(),
            Err(e) => break e,
        }
    };
    match &err {
        Error::Op(OpError::PeerUnreachable { reason, .. }) => {
            assert!(reason.contains("no CHALLENGE"), "{reason}")
        }
        e => panic!("{e:?}"),
    }
    assert_eq!(a.done.len(), 1, "{:?}", a.done);
    assert_eq!(
        (a.done[0].op, a.done[0].wr_id),
        (OpKind::Write, WorkRequestId(1))
    );
    assert!(a.done[0].result.is_err());
    old.expect_closed("the initiator giving up", || a.step());
    assert_eq!(old.received, 0, "the initiator sent {:?}", old.rx);
}
