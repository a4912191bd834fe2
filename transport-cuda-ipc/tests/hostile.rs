//! Bad input and vanishing peers, on the loopback link (host memory, no GPU needed): the
//! protocol code is the same one the CUDA link runs. Hostile handshakes, from either side,
//! are refused without a panic, and a side that refuses sends nothing but its handshake.

mod raw;

use fabric_core::auth::Nonce;
use fabric_core::testing::{Canaried, Pair, SuiteOptions, pattern};
use fabric_core::{Access, Completion, Error, OpError, OpKind, Transport, WorkRequestId};
use proptest::prelude::*;
use raw::{Frame, Raw};
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::{Duration, Instant};
use transport_cuda_ipc::wire::{
    self, AUTH_NONE, AUTH_TOKEN, HANDSHAKE_MAX_PAYLOAD, HEADER_LEN, Header, KeyInfo, Op, Reserve,
    TAG_LEN, put_frame,
};
use transport_cuda_ipc::{
    CudaIpcConfig, CudaIpcTransport, HandshakeError, IpcAddress, LoopbackLink,
};

type T = CudaIpcTransport<LoopbackLink>;

fn make() -> T {
    CudaIpcTransport::with_link(LoopbackLink::new(), CudaIpcConfig::default()).unwrap()
}

fn make_with(token: Option<&str>, peer_timeout: Duration) -> T {
    let cfg = CudaIpcConfig {
        auth_token: token.map(String::from),
        peer_timeout,
        ..CudaIpcConfig::default()
    };
    CudaIpcTransport::with_link(LoopbackLink::new(), cfg).unwrap()
}

fn raw_connect(t: &T) -> UnixStream {
    let a = IpcAddress::parse(&t.address()).unwrap();
    let s = UnixStream::connect_addr(&SocketAddr::from_abstract_name(a.socket.as_bytes()).unwrap())
        .unwrap();
    s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    s
}

/// A HELLO that a target without a token lets in (sent without reading its CHALLENGE).
fn hello(from: &[u8]) -> Vec<u8> {
    raw::hello(from)
}

/// Polls `t` until the raw connection is closed by it (EOF), collecting what it sent.
fn until_closed(t: &mut T, s: &mut UnixStream) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        assert!(
            Instant::now() < deadline,
            "the transport kept a hostile connection open"
        );
        t.poll(&mut Vec::new()).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return got,
        }
    }
}

/// After abuse, the transport still serves an honest peer.
fn still_serves(target: T) {
    still_serves_with(target, None)
}

/// After abuse, the transport still serves an honest peer with `token`.
fn still_serves_with(target: T, token: Option<&str>) {
    let mut p = Pair {
        b_at_a: fabric_core::PeerId(0),
        a: make_with(token, CudaIpcConfig::default().peer_timeout),
        b: target,
        done_a: Vec::new(),
        done_b: Vec::new(),
        opts: SuiteOptions::default(),
    };
    p.b_at_a = p.a.add_peer(&p.b.address()).unwrap();
    let src = Canaried::new(&mut p.a, 4096, Access::NONE, 0x33);
    let dst = Canaried::new(&mut p.b, 4096, Access::REMOTE_WRITE, 0);
    let c = p.write_once(src.local(0, 4096), dst.remote(0, 4096), Some(1));
    assert_eq!(c.result, Ok(4096));
    assert_eq!(dst.read(0, 4096), vec![0x33; 4096]);
}

#[test]
fn frames_before_hello_unknown_ops_and_oversized_payloads_close_the_connection() {
    let mut t = make();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("reserve before hello", {
            let mut v = Vec::new();
            put_frame(
                &mut v,
                Op::Reserve,
                1,
                0,
                &[Reserve {
                    key: 1,
                    offset: 0,
                    len: 1,
                }],
            );
            v
        }),
        ("unknown op", vec![0xEE; HEADER_LEN]),
        ("oversized payload", {
            let mut v = hello(&make().address());
            Header::new(Op::Send, 1, 0, u64::MAX / 2).encode(&mut v);
            v
        }),
        ("ragged reserve", {
            let mut v = hello(&make().address());
            Header::new(Op::Reserve, 1, 0, 5).encode(&mut v);
            v.extend_from_slice(&[0; 5]);
            v
        }),
        ("answer frames sent to a target", {
            let mut v = hello(&make().address());
            Header::new(Op::Grant, 1, 0, 0).encode(&mut v);
            v
        }),
        ("done for a batch never reserved", {
            let mut v = hello(&make().address());
            Header::new(Op::Done, 77, 0, 0).encode(&mut v);
            v
        }),
        ("second hello", {
            let mut v = hello(&make().address());
            v.extend(hello(&make().address()));
            v
        }),
        ("hello from another host", {
            let mut a = IpcAddress::parse(&make().address()).unwrap();
            a.boot_id = "00000000-0000-4000-8000-000000000000".into();
            hello(&a.encode())
        }),
        ("wrong protocol version", {
            let from = make().address();
            let mut v = Vec::new();
            Header::new(Op::Hello, 0, 99, from.len() as u64).encode(&mut v);
            v.extend_from_slice(&from);
            v
        }),
    ];
    for (what, bytes) in cases {
        let mut s = raw_connect(&t);
        s.write_all(&bytes).unwrap();
        until_closed(&mut t, &mut s);
        eprintln!("closed as expected: {what}");
    }
    still_serves(t);
}

#[test]
fn guessed_keys_are_refused_and_touch_nothing() {
    let mut t = make();
    let dst = Canaried::new(&mut t, 4096, Access::REMOTE_WRITE, 0);
    let mut s = raw_connect(&t);
    let mut v = hello(&make().address());
    let guesses: Vec<Reserve> = (0..64)
        .map(|i| Reserve {
            key: dst.reg.remote.key.0 ^ (1 << i),
            offset: 0,
            len: 4096,
        })
        .collect();
    put_frame(&mut v, Op::Reserve, 1, 0, &guesses);
    s.write_all(&v).unwrap();
    // The answer, after the handshake's CHALLENGE and PROOF: one GRANT with 64 BadKey
    // verdicts and no handle (no KEY_INFO frame).
    let mut r = Raw::new(s);
    let ops: Vec<Op> = std::iter::from_fn(|| {
        r.next(|| {
            t.poll(&mut Vec::new()).unwrap();
        })
    })
    .take(3)
    .map(|f| {
        if f.h.op == Op::Grant {
            assert_eq!(f.h.len, 64 * 12);
            let verdicts: Vec<wire::Grant> = wire::records(Op::Grant, &f.payload).unwrap();
            assert!(verdicts.iter().all(|g| g.status == 1), "{verdicts:?}");
        }
        f.h.op
    })
    .collect();
    assert_eq!(ops, [Op::Challenge, Op::Proof, Op::Grant]);
    assert_eq!(dst.read(0, 4096), vec![0; 4096]);
    dst.assert_canaries();
}

#[test]
fn a_target_that_goes_away_fails_pending_writes_as_unreachable() {
    let mut p = Pair::new(&make, SuiteOptions::default());
    let src = Canaried::new(&mut p.a, 65536, Access::NONE, 1);
    let dst = Canaried::new(&mut p.b, 65536, Access::REMOTE_WRITE, 0);
    let c = p.write_once(src.local(0, 100), dst.remote(0, 100), None);
    assert_eq!(c.result, Ok(100));
    // The target disappears without a word (its sockets close, as when a process dies).
    let Pair {
        mut a, b, b_at_a, ..
    } = p;
    drop(b);
    let _ = a.post_write(
        b_at_a,
        fabric_core::WorkRequestId(5),
        src.local(0, 10),
        dst.remote(0, 10),
        None,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut done = Vec::new();
    while done.is_empty() {
        assert!(Instant::now() < deadline, "a write to a vanished peer hung");
        a.poll(&mut done).unwrap();
    }
    assert!(
        matches!(done[0].result, Err(OpError::PeerUnreachable { .. })),
        "{done:?}"
    );
    // Later posts fail at once, with the reason; removing and re-adding is allowed.
    let e = a
        .post_write(
            b_at_a,
            fabric_core::WorkRequestId(6),
            src.local(0, 10),
            dst.remote(0, 10),
            None,
        )
        .unwrap_err();
    assert!(
        matches!(e, Error::Op(OpError::PeerUnreachable { .. })),
        "{e}"
    );
    a.remove_peer(b_at_a).unwrap();
}

#[test]
fn a_silent_target_is_declared_unreachable_within_the_timeout() {
    let cfg = CudaIpcConfig {
        peer_timeout: Duration::from_millis(300),
        ..CudaIpcConfig::default()
    };
    let mut a = CudaIpcTransport::with_link(LoopbackLink::new(), cfg).unwrap();
    let mut b = make();
    let src = Canaried::new(&mut a, 4096, Access::NONE, 1);
    let dst = Canaried::new(&mut b, 4096, Access::REMOTE_WRITE, 0);
    let peer = a.add_peer(&b.address()).unwrap();
    // b never polls: nobody answers the reservation.
    let _ = a.post_write(
        peer,
        fabric_core::WorkRequestId(1),
        src.local(0, 8),
        dst.remote(0, 8),
        None,
    );
    let start = Instant::now();
    let mut done = Vec::new();
    while done.is_empty() {
        assert!(start.elapsed() < Duration::from_secs(10), "no timeout");
        a.wait(Duration::from_millis(10)).unwrap();
        a.poll(&mut done).unwrap();
    }
    assert!(
        matches!(done[0].result, Err(OpError::PeerUnreachable { .. })),
        "{done:?}"
    );
    assert!(start.elapsed() >= Duration::from_millis(300));
    drop(b);
}

#[test]
fn another_host_and_a_vanished_process_are_refused_at_add_peer() {
    let mut t = make();
    let mut a = IpcAddress::parse(&t.address()).unwrap();
    a.boot_id = "00000000-0000-4000-8000-000000000000".into();
    let e = t.add_peer(&a.encode()).unwrap_err();
    assert!(matches!(e, Error::InvalidAddress(_)), "{e}");
    assert!(e.to_string().contains("another host"), "{e}");
    let gone = IpcAddress {
        socket: "xfer-ipc-1-deadbeef".into(),
        ..IpcAddress::parse(&t.address()).unwrap()
    };
    let e = t.add_peer(&gone.encode()).unwrap_err();
    assert!(e.to_string().contains("exited"), "{e}");
}

#[test]
fn unexpected_sends_beyond_the_queue_back_pressure_instead_of_growing() {
    let cfg = CudaIpcConfig {
        max_unexpected_count: 4,
        ..CudaIpcConfig::default()
    };
    let mut p = Pair::new(
        &move || CudaIpcTransport::with_link(LoopbackLink::new(), cfg.clone()).unwrap(),
        SuiteOptions::default(),
    );
    let src = Canaried::new(&mut p.a, 64, Access::NONE, 0);
    let dst = Canaried::new(&mut p.b, 64 * 16, Access::LOCAL_WRITE, 0);
    for i in 0..16u64 {
        src.write(0, &pattern(i, 64));
        let peer = p.b_at_a;
        p.post_a(|t| t.post_send(peer, fabric_core::WorkRequestId(i), src.local(0, 64), None));
        p.step();
    }
    for _ in 0..200 {
        p.step();
    }
    let acked = p.done_a.len();
    assert!(acked <= 4, "{acked} sends acknowledged with room for 4");
    for i in 0..16u64 {
        p.post_b(|t| t.post_recv(fabric_core::WorkRequestId(100 + i), dst.local(i * 64, 64)));
    }
    let r = p.take_b(16, "all sends delivered once receives exist");
    assert!(r.iter().all(|c| c.op == OpKind::Recv && c.result == Ok(64)));
    for i in 0..16u64 {
        assert_eq!(dst.read(i * 64, 64), pattern(i, 64), "message {i}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if std::env::var("CI").is_ok() { 64 } else { 256 }))]
    #[test]
    fn random_bytes_after_hello_never_panic_and_never_stop_the_transport(
        junk in proptest::collection::vec(any::<u8>(), 0..512)
    ) {
        let mut t = make();
        let mut s = raw_connect(&t);
        let mut v = hello(&make().address());
        v.extend_from_slice(&junk);
        s.write_all(&v).unwrap();
        for _ in 0..20 {
            t.poll(&mut Vec::new()).unwrap();
        }
        drop(s);
        still_serves(t);
    }
}

#[test]
fn a_done_claiming_more_writes_than_were_granted_closes_the_connection() {
    let mut t = make();
    let dst = Canaried::new(&mut t, 4096, Access::REMOTE_WRITE, 0);
    let mut s = raw_connect(&t);
    let mut v = hello(&make().address());
    put_frame(
        &mut v,
        Op::Reserve,
        1,
        0,
        &[Reserve {
            key: dst.reg.remote.key.0,
            offset: 0,
            len: 16,
        }],
    );
    // One write granted, a thousand immediate values claimed.
    let landed: Vec<transport_cuda_ipc::wire::Landed> = (0..1000)
        .map(|i| transport_cuda_ipc::wire::Landed { imm: i, len: 16 })
        .collect();
    put_frame(&mut v, Op::Done, 1, 0, &landed);
    s.write_all(&v).unwrap();
    until_closed(&mut t, &mut s);
    let mut done = Vec::new();
    t.poll(&mut done).unwrap();
    assert!(
        done.iter().all(|c| c.op != OpKind::RemoteWrite),
        "a forged DONE produced completions: {done:?}"
    );
}

#[test]
fn reservations_of_an_unknown_kind_or_version_close_the_connection() {
    let mut t = make();
    let reserve = |kind: u64| {
        let mut v = hello(&make().address());
        put_frame(
            &mut v,
            Op::Reserve,
            1,
            kind,
            &[Reserve {
                key: 1,
                offset: 0,
                len: 1,
            }],
        );
        v
    };
    let old_hello = {
        let from = make().address();
        let mut v = Vec::new();
        Header::new(Op::Hello, 0, 1, from.len() as u64).encode(&mut v);
        v.extend_from_slice(&from);
        v
    };
    for (what, bytes) in [
        ("reservation of kind 2", reserve(2)),
        ("reservation of kind u64::MAX", reserve(u64::MAX)),
        ("HELLO of version 1 (no READ)", old_hello),
    ] {
        let mut r = Raw::connect(&t.address());
        r.send(&bytes);
        // At most the handshake's frames (what was queued when the connection closed): no
        // grant, no handle.
        let got: Vec<Op> = r
            .until_closed(|| {
                t.poll(&mut Vec::new()).unwrap();
            })
            .iter()
            .map(|f| f.h.op)
            .collect();
        assert!(
            got.iter().all(|op| matches!(op, Op::Challenge | Op::Proof)),
            "{what}: the target answered {got:?}"
        );
    }
    assert_eq!(t.take_auth_refusals(), [HandshakeError::Version(1)]);
    still_serves(t);
}

/// What a hostile initiator's HELLO (or a frame in its place) is, given the CHALLENGE's
/// nonce, and the refusal the target keeps for it (`None`: closed as a protocol error, no
/// refusal of the handshake).
type HelloCase = (
    &'static str,
    Box<dyn Fn(&Nonce) -> Vec<u8>>,
    Option<HandshakeError>,
);

/// Runs each case against `t` on a fresh connection: the CHALLENGE is read, the case's
/// bytes are sent, and the target must close answering nothing but a REFUSE (for a tag
/// that fails), keeping the refusal.
fn refused_hellos(t: &mut T, cases: Vec<HelloCase>) {
    let mut nonces = Vec::new();
    for (what, bytes, refusal) in cases {
        let mut r = Raw::connect(&t.address());
        let c = r
            .next(|| {
                t.poll(&mut Vec::new()).unwrap();
            })
            .expect("a CHALLENGE");
        let nonce = raw::nonce_of(&c);
        nonces.push(nonce);
        r.send(&bytes(&nonce));
        let answered: Vec<Op> = r
            .until_closed(|| {
                t.poll(&mut Vec::new()).unwrap();
            })
            .iter()
            .map(|f| f.h.op)
            .collect();
        let want: &[Op] = match refusal {
            Some(HandshakeError::AuthenticationFailed) => &[Op::Refuse],
            _ => &[],
        };
        assert_eq!(answered, want, "{what}: answered");
        let kept = t.take_auth_refusals();
        assert_eq!(kept, refusal.into_iter().collect::<Vec<_>>(), "{what}");
        eprintln!("refused as expected: {what}");
    }
    let n = nonces.len();
    nonces.sort_by_key(|n| *n.as_bytes());
    nonces.dedup();
    assert_eq!(nonces.len(), n, "a CHALLENGE's nonce came twice");
}

#[test]
fn hostile_hellos_are_refused_with_a_typed_reason_and_answered_with_nothing() {
    let from = make().address();
    let f = from.clone();
    let addr = move || f.clone();
    let a = addr.clone();
    let mut t = make();
    let cases: Vec<HelloCase> = vec![
        (
            "a HELLO shorter than its nonce and tag",
            Box::new(|_| {
                let mut v = Vec::new();
                Header::new(Op::Hello, AUTH_NONE, wire::VERSION, 20).encode(&mut v);
                v.extend_from_slice(&[0; 20]);
                v
            }),
            Some(HandshakeError::Malformed(wire::WireError::BadPayload {
                op: Op::Hello,
                len: 20,
            })),
        ),
        (
            "a HELLO of an unknown mode",
            Box::new({
                let a = a.clone();
                move |_| raw::hello_with(&a(), 5, [0; TAG_LEN], Nonce::new().unwrap())
            }),
            Some(HandshakeError::UnknownAuthMode(5)),
        ),
        (
            "a HELLO claiming a token, to a target without one",
            Box::new({
                let a = a.clone();
                move |n| raw::proving_hello(&a(), "s3cret", n).0
            }),
            Some(HandshakeError::NoTokenHere),
        ),
        (
            "a HELLO of version 2 (no nonce, no tag)",
            Box::new({
                let a = a.clone();
                move |_| raw::old_hello(&a())
            }),
            Some(HandshakeError::Version(2)),
        ),
        (
            "a HELLO of version u64::MAX",
            Box::new(|_| {
                let mut v = Vec::new();
                Header::new(Op::Hello, AUTH_NONE, u64::MAX, 0).encode(&mut v);
                v
            }),
            Some(HandshakeError::Version(u64::MAX)),
        ),
        (
            "a HELLO announcing more than a handshake frame may carry",
            Box::new(|_| {
                let mut v = Vec::new();
                Header::new(
                    Op::Hello,
                    AUTH_NONE,
                    wire::VERSION,
                    HANDSHAKE_MAX_PAYLOAD + 1,
                )
                .encode(&mut v);
                v
            }),
            None,
        ),
        (
            "a HELLO whose address is not one",
            Box::new(|_| raw::hello(b"garbage")),
            None,
        ),
        (
            "a CHALLENGE sent to a target",
            Box::new(|_| raw::challenge(AUTH_NONE).0),
            None,
        ),
        (
            "a PROOF sent to a target",
            Box::new(|n| raw::proof(None, n)),
            None,
        ),
        (
            "a REFUSE sent to a target",
            Box::new(|_| {
                let mut v = Vec::new();
                Header::new(Op::Refuse, 0, wire::REFUSE_AUTH, 0).encode(&mut v);
                v
            }),
            None,
        ),
    ];
    refused_hellos(&mut t, cases);
    still_serves(t);

    let mut t = make_with(Some("s3cret"), Duration::from_secs(5));
    let cases: Vec<HelloCase> = vec![
        (
            "a HELLO without a token, to a target with one",
            Box::new({
                let a = addr.clone();
                move |_| raw::hello(&a())
            }),
            Some(HandshakeError::PeerHasNoToken),
        ),
        (
            "a HELLO claiming a token with a zero tag",
            Box::new({
                let a = addr.clone();
                move |_| raw::hello_with(&a(), AUTH_TOKEN, [0; TAG_LEN], Nonce::new().unwrap())
            }),
            Some(HandshakeError::AuthenticationFailed),
        ),
        (
            "a HELLO proving another token",
            Box::new({
                let a = addr.clone();
                move |n| raw::proving_hello(&a(), "s3cret ", n).0
            }),
            Some(HandshakeError::AuthenticationFailed),
        ),
        (
            "a HELLO whose tag is the token's for another nonce",
            Box::new({
                let a = addr.clone();
                move |_| raw::proving_hello(&a(), "s3cret", &Nonce::new().unwrap()).0
            }),
            Some(HandshakeError::AuthenticationFailed),
        ),
        (
            "a HELLO with the PROOF's tag of the CHALLENGE (the other direction)",
            Box::new({
                let a = addr.clone();
                move |n| {
                    let p = raw::frame_of(&raw::proof(Some("s3cret"), n));
                    let tag: [u8; TAG_LEN] = p.payload.try_into().unwrap();
                    raw::hello_with(&a(), AUTH_TOKEN, tag, Nonce::new().unwrap())
                }
            }),
            Some(HandshakeError::AuthenticationFailed),
        ),
        (
            "a HELLO with tcp's tag of the CHALLENGE (another protocol)",
            Box::new({
                let a = addr.clone();
                move |n| {
                    let tag = fabric_core::auth::tag(
                        "s3cret",
                        "xfer-tcp/5 HELLO: initiator to target",
                        n,
                    );
                    raw::hello_with(&a(), AUTH_TOKEN, tag, Nonce::new().unwrap())
                }
            }),
            Some(HandshakeError::AuthenticationFailed),
        ),
        (
            "a reservation in place of the HELLO",
            Box::new(|_| {
                let mut v = Vec::new();
                put_frame(
                    &mut v,
                    Op::Reserve,
                    1,
                    0,
                    &[Reserve {
                        key: 1,
                        offset: 0,
                        len: 1,
                    }],
                );
                v
            }),
            None,
        ),
    ];
    refused_hellos(&mut t, cases);
    still_serves_with(t, Some("s3cret"));
}

/// How an initiator must end against a hostile target: refused with this handshake error,
/// or unreachable with a reason that says this.
#[derive(Debug)]
enum Ends {
    Refused(HandshakeError),
    Unreachable(&'static str),
}

/// What a hostile target does on a connection an initiator opened (`r`), polling the
/// initiator (`poll`) while it waits for its frames.
type Play = Box<dyn Fn(&mut Raw, &mut dyn FnMut())>;

/// The HELLO the initiator sends for a CHALLENGE of `mode`, read while polling.
fn challenge_and_hello(r: &mut Raw, poll: &mut dyn FnMut(), mode: u64) -> Frame {
    r.send(&raw::challenge(mode).0);
    let hello = r.next(&mut *poll).expect("a HELLO");
    assert_eq!(hello.h.op, Op::Hello);
    hello
}

fn frame_bytes(op: Op, id: u64, x: u64, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    Header::new(op, id, x, payload.len() as u64).encode(&mut v);
    v.extend_from_slice(payload);
    v
}

/// Runs `play` as the target of a fresh initiator with `token` that has posted a write and
/// a SEND before anything came: both must fail as `ends` says, and the target must get
/// nothing from the initiator but (at most) its HELLO: no reservation, no key, no SEND.
fn against_hostile_target(what: &str, token: Option<&str>, play: Play, ends: Ends) {
    let (l, addr) = raw::fake_listener();
    let mut a = make_with(token, Duration::from_secs(5));
    let src = Canaried::new(&mut a, 4096, Access::NONE, 0x5A);
    let peer = a.add_peer(&addr).unwrap();
    let posted = a.post_write(
        peer,
        WorkRequestId(1),
        src.local(0, 64),
        fabric_core::RemoteSlice {
            region: fabric_core::RemoteRegion {
                addr: 0,
                len: 4096,
                key: fabric_core::RemoteKey(0xFA4E),
            },
            offset: 0,
            len: 64,
        },
        None,
    );
    assert!(matches!(posted, Ok(fabric_core::PostOutcome::Posted)));
    let posted = a.post_send(peer, WorkRequestId(2), src.local(0, 64), None);
    assert!(matches!(posted, Ok(fabric_core::PostOutcome::Posted)));
    // The connection is queued at the listener: accept does not wait.
    let (s, _) = l.accept().unwrap();
    let mut r = Raw::new(s);
    let mut done: Vec<Completion> = Vec::new();
    play(&mut r, &mut || {
        a.poll(&mut done).unwrap();
    });
    let deadline = Instant::now() + raw::PATIENCE;
    while done.len() < 2 {
        assert!(Instant::now() < deadline, "{what}: the initiator hung");
        a.poll(&mut done).unwrap();
    }
    for c in &done {
        match (&ends, &c.result) {
            (Ends::Refused(want), Err(OpError::Transport(e))) => {
                assert_eq!(e.downcast_ref::<HandshakeError>(), Some(want), "{what}");
            }
            (Ends::Unreachable(why), Err(OpError::PeerUnreachable { reason, .. })) => {
                assert!(reason.contains(why), "{what}: {reason}");
            }
            (_, r) => panic!("{what}: expected {ends:?}, got {r:?}"),
        }
    }
    // Whatever came, nothing but a HELLO left the initiator.
    let sent: Vec<Op> = r
        .until_closed(|| {
            a.poll(&mut Vec::new()).unwrap();
        })
        .iter()
        .map(|f| f.h.op)
        .collect();
    assert!(
        sent.iter().all(|op| *op == Op::Hello) && sent.len() <= 1,
        "{what}: the initiator sent {sent:?}"
    );
    assert!(a.peer_ready(peer).is_err(), "{what}: the peer is ready");
    eprintln!("refused as expected: {what}");
}

#[test]
fn hostile_targets_handshakes_are_refused_and_get_nothing_but_a_hello() {
    let grant = frame_bytes(Op::Grant, 1, 0, &[0; 12]);
    let key_info = {
        let mut v = Vec::new();
        let info = KeyInfo {
            handle: [7; 64],
            offset: 0,
            len: 4096,
            device: 0,
        };
        put_frame(&mut v, Op::KeyInfo, 0, 0xFA4E, &[info]);
        v
    };
    let unexpected = |op, expected| Ends::Refused(HandshakeError::Unexpected { op, expected });
    let cases: Vec<(&str, Option<&str>, Play, Ends)> = vec![
        (
            "a PROOF before the CHALLENGE",
            None,
            Box::new(|r, _| r.send(&raw::proof(None, &Nonce::new().unwrap()))),
            unexpected(Op::Proof, "CHALLENGE"),
        ),
        (
            "a GRANT before the CHALLENGE",
            None,
            Box::new({
                let g = grant.clone();
                move |r, _| r.send(&g)
            }),
            unexpected(Op::Grant, "CHALLENGE"),
        ),
        (
            "a REFUSE before the CHALLENGE",
            Some("s3cret"),
            Box::new(|r, _| r.send(&frame_bytes(Op::Refuse, 0, wire::REFUSE_AUTH, &[]))),
            unexpected(Op::Refuse, "CHALLENGE"),
        ),
        (
            "a CHALLENGE three bytes long",
            None,
            Box::new(|r, _| {
                r.send(&frame_bytes(
                    Op::Challenge,
                    AUTH_NONE,
                    wire::VERSION,
                    &[1, 2, 3],
                ))
            }),
            Ends::Refused(HandshakeError::Malformed(wire::WireError::BadPayload {
                op: Op::Challenge,
                len: 3,
            })),
        ),
        (
            "a CHALLENGE of an unknown mode",
            Some("s3cret"),
            Box::new(|r, _| r.send(&frame_bytes(Op::Challenge, 9, wire::VERSION, &[0; 16]))),
            Ends::Refused(HandshakeError::UnknownAuthMode(9)),
        ),
        (
            "a CHALLENGE of version 2",
            None,
            Box::new(|r, _| r.send(&frame_bytes(Op::Challenge, AUTH_NONE, 2, &[0; 16]))),
            Ends::Refused(HandshakeError::Version(2)),
        ),
        (
            "a frame longer than a handshake frame may be",
            None,
            Box::new(|r, _| {
                let mut v = Vec::new();
                Header::new(Op::Send, 1, 0, 1 << 20).encode(&mut v);
                r.send(&v)
            }),
            Ends::Unreachable("exceeds the 1024-byte limit"),
        ),
        (
            "a KEY_INFO after the HELLO, before the PROOF",
            None,
            Box::new({
                let k = key_info.clone();
                move |r, poll| {
                    challenge_and_hello(r, poll, AUTH_NONE);
                    r.send(&k)
                }
            }),
            unexpected(Op::KeyInfo, "PROOF"),
        ),
        (
            "a GRANT after the HELLO, before the PROOF",
            Some("s3cret"),
            Box::new({
                let g = grant.clone();
                move |r, poll| {
                    challenge_and_hello(r, poll, AUTH_TOKEN);
                    r.send(&g)
                }
            }),
            unexpected(Op::Grant, "PROOF"),
        ),
        (
            "a second CHALLENGE",
            None,
            Box::new(|r, poll| {
                challenge_and_hello(r, poll, AUTH_NONE);
                r.send(&raw::challenge(AUTH_NONE).0)
            }),
            unexpected(Op::Challenge, "PROOF"),
        ),
        (
            "a REFUSE of a reason this side does not know",
            Some("s3cret"),
            Box::new(|r, poll| {
                challenge_and_hello(r, poll, AUTH_TOKEN);
                r.send(&frame_bytes(Op::Refuse, 0, 7, &[]))
            }),
            Ends::Refused(HandshakeError::UnknownRefusal(7)),
        ),
        (
            "a PROOF of another token",
            Some("s3cret"),
            Box::new(|r, poll| {
                let hello = challenge_and_hello(r, poll, AUTH_TOKEN);
                r.send(&raw::proof(Some("other"), &raw::hello_nonce(&hello)))
            }),
            Ends::Refused(HandshakeError::ProofFailed),
        ),
        (
            "a zero PROOF to an initiator with a token",
            Some("s3cret"),
            Box::new(|r, poll| {
                challenge_and_hello(r, poll, AUTH_TOKEN);
                r.send(&raw::proof(None, &Nonce::new().unwrap()))
            }),
            Ends::Refused(HandshakeError::ProofFailed),
        ),
        (
            "a PROOF of the token for another nonce",
            Some("s3cret"),
            Box::new(|r, poll| {
                challenge_and_hello(r, poll, AUTH_TOKEN);
                r.send(&raw::proof(Some("s3cret"), &Nonce::new().unwrap()))
            }),
            Ends::Refused(HandshakeError::ProofFailed),
        ),
        (
            "a PROOF that reflects the initiator's own HELLO tag",
            Some("s3cret"),
            Box::new(|r, poll| {
                let hello = challenge_and_hello(r, poll, AUTH_TOKEN);
                let tag = &hello.payload[16..16 + TAG_LEN];
                r.send(&frame_bytes(Op::Proof, 0, 0, tag))
            }),
            Ends::Refused(HandshakeError::ProofFailed),
        ),
        (
            "a PROOF 33 bytes long",
            None,
            Box::new(|r, poll| {
                challenge_and_hello(r, poll, AUTH_NONE);
                r.send(&frame_bytes(Op::Proof, 0, 0, &[0; 33]))
            }),
            Ends::Refused(HandshakeError::Malformed(wire::WireError::BadPayload {
                op: Op::Proof,
                len: 33,
            })),
        ),
        (
            "a close after the HELLO",
            Some("s3cret"),
            Box::new(|r, poll| {
                challenge_and_hello(r, poll, AUTH_TOKEN);
                r.s.shutdown(std::net::Shutdown::Write).unwrap();
            }),
            Ends::Unreachable("the peer closed the connection"),
        ),
    ];
    for (what, token, play, ends) in cases {
        against_hostile_target(what, token, play, ends);
    }
}

#[test]
fn a_target_that_never_proves_itself_is_unreachable_within_the_timeout() {
    for (what, challenges, reason) in [
        (
            "silent (a target of version 2 waits for a HELLO)",
            false,
            "no CHALLENGE within",
        ),
        ("no PROOF after the HELLO", true, "no PROOF within"),
    ] {
        let timeout = Duration::from_millis(300);
        let (l, addr) = raw::fake_listener();
        let mut a = make_with(None, timeout);
        let opened = Instant::now();
        let peer = a.add_peer(&addr).unwrap();
        let (s, _) = l.accept().unwrap();
        let mut r = Raw::new(s);
        if challenges {
            challenge_and_hello(
                &mut r,
                &mut || {
                    a.poll(&mut Vec::new()).unwrap();
                },
                AUTH_NONE,
            );
        }
        let start = Instant::now();
        let e = loop {
            assert!(start.elapsed() < raw::PATIENCE, "{what}: no time-out");
            match a.peer_ready(peer) {
                Ok(false) => {}
                Ok(true) => panic!("{what}: ready"),
                Err(e) => break e,
            }
            a.wait(Duration::from_millis(10)).unwrap();
            a.poll(&mut Vec::new()).unwrap();
        };
        assert!(
            matches!(&e, Error::Op(OpError::PeerUnreachable { reason: r, .. }) if r.contains(reason)),
            "{what}: {e}"
        );
        assert!(
            opened.elapsed() >= timeout,
            "{what}: refused before its time"
        );
        assert!(
            matches!(a.peer_ready(peer), Err(Error::UnknownPeer(_))),
            "{what}: the peer stayed"
        );
    }
}
