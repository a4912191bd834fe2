//! Bad input and vanishing peers, on the loopback link (host memory, no GPU needed): the
//! protocol code is the same one the CUDA link runs.

use fabric_core::testing::{Canaried, Pair, SuiteOptions, pattern};
use fabric_core::{Access, Error, OpError, OpKind, Transport};
use proptest::prelude::*;
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::{Duration, Instant};
use transport_cuda_ipc::wire::{HEADER_LEN, Header, Op, Record, Reserve, put_frame};
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport, IpcAddress, LoopbackLink};

type T = CudaIpcTransport<LoopbackLink>;

fn make() -> T {
    CudaIpcTransport::with_link(LoopbackLink::new(), CudaIpcConfig::default()).unwrap()
}

fn raw_connect(t: &T) -> UnixStream {
    let a = IpcAddress::parse(&t.address()).unwrap();
    let s = UnixStream::connect_addr(&SocketAddr::from_abstract_name(a.socket.as_bytes()).unwrap())
        .unwrap();
    s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    s
}

fn hello(from: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    Header::new(
        Op::Hello,
        0,
        transport_cuda_ipc::wire::VERSION,
        from.len() as u64,
    )
    .encode(&mut v);
    v.extend_from_slice(from);
    v
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
    let mut p = Pair {
        b_at_a: fabric_core::PeerId(0),
        a: make(),
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
    // The answer: one GRANT with 64 BadKey verdicts and no handle (no KEY_INFO frame).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    let want = HEADER_LEN + 64 * <transport_cuda_ipc::wire::Grant as Record>::LEN;
    let mut buf = [0u8; 4096];
    while got.len() < want {
        assert!(Instant::now() < deadline, "no grant");
        t.poll(&mut Vec::new()).unwrap();
        if let Ok(n) = s.read(&mut buf) {
            got.extend_from_slice(&buf[..n]);
        }
    }
    let h = Header::decode(&got[..HEADER_LEN].try_into().unwrap(), 1 << 20).unwrap();
    assert_eq!(h.op, Op::Grant);
    let verdicts: Vec<transport_cuda_ipc::wire::Grant> =
        transport_cuda_ipc::wire::records(Op::Grant, &got[HEADER_LEN..want]).unwrap();
    assert!(verdicts.iter().all(|g| g.status == 1), "{verdicts:?}");
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
        let mut s = raw_connect(&t);
        s.write_all(&bytes).unwrap();
        let got = until_closed(&mut t, &mut s);
        assert!(got.is_empty(), "{what}: the target answered {got:?}");
    }
    still_serves(t);
}
