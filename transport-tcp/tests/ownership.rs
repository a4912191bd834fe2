//! Buffer ownership when the target stalls: a peer whose kernel accepts our bytes while its
//! transport never answers (as a stopped process does). A transfer that times out is
//! reported only once the transport has let go of its memory; until then its source region
//! cannot be deregistered; afterwards the memory is the caller's and new transfers work.

use fabric_core::engine::{Engine, EngineConfig, Transfer};
use fabric_core::plan::Segment;
use fabric_core::{Access, Error, HostBuffer, OpError};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use transport_tcp::auth::Nonce;
use transport_tcp::frame::{AUTH_NONE, HEADER_LEN, Header};
use transport_tcp::{TcpConfig, TcpTransport};

const PEER_TIMEOUT: Duration = Duration::from_secs(1);

#[test]
fn a_timed_out_transfer_holds_its_source_until_the_transport_lets_go() {
    // The stalled peer: accepts connections, goes through the handshake (its CHALLENGE,
    // the HELLO read, its PROOF: a target stopped after its handshake), then never reads
    // or answers.
    let stalled = TcpListener::bind("127.0.0.1:0").unwrap();
    let stalled_addr = format!("tcp://{}", stalled.local_addr().unwrap());
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let (mut conn, _) = stalled.accept().unwrap();
        let nonce = Nonce::new().unwrap();
        conn.write_all(&Header::challenge(&nonce, AUTH_NONE).encode())
            .unwrap();
        let mut head = [0u8; HEADER_LEN];
        conn.read_exact(&mut head).unwrap();
        let hello = Header::decode(&head).unwrap();
        let mut payload = vec![0u8; hello.len as usize];
        conn.read_exact(&mut payload).unwrap();
        conn.write_all(&Header::proof(&[0u8; 16]).encode()).unwrap();
        let _ = stop_rx.recv_timeout(Duration::from_secs(60));
        drop(conn);
    });

    let tcp = || {
        TcpTransport::new(TcpConfig {
            peer_timeout: PEER_TIMEOUT,
            liveness_timeout: PEER_TIMEOUT,
            ..TcpConfig::default()
        })
    };
    let a = Engine::spawn(tcp, EngineConfig::default()).unwrap();
    let b = Engine::spawn(tcp, EngineConfig::default()).unwrap();
    let src = HostBuffer::new_shared(8192).unwrap();
    src.fill(0, 8192, 0x42).unwrap();
    let dst = HostBuffer::new_shared(8192).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let stuck_peer = a.add_peer(stalled_addr.as_bytes()).unwrap();
    let seg = |dst_region| Segment {
        src: s.local,
        src_offset: 0,
        dst: dst_region,
        dst_offset: 0,
        len: 4096,
    };

    let start = Instant::now();
    let h = a
        .submit(
            Transfer::new(stuck_peer)
                .segment(seg(d.remote)) // any key: the stalled peer never checks it
                .timeout(Duration::from_millis(100)),
        )
        .unwrap();
    // Well past its deadline, the write is still the transport's: no report yet, and the
    // source region cannot be deregistered.
    assert!(
        !h.finished_within(Duration::from_millis(500)),
        "reported while the transport still held the write"
    );
    let e = a.deregister(s.local).unwrap_err();
    assert!(
        matches!(e, Error::RegionInUse { key, .. } if key == s.local),
        "{e}"
    );

    // The transport gives up on the silent peer (after its peer_timeout) and lets go; only
    // then is the time-out reported.
    let e = h.wait(Duration::from_secs(20)).unwrap_err();
    assert!(matches!(e, Error::Op(OpError::TimedOut)), "{e}");
    assert!(
        start.elapsed() >= PEER_TIMEOUT,
        "reported after {:?}, before the transport let go",
        start.elapsed()
    );

    // The memory is the caller's again: a new transfer from it works, and then it can be
    // deregistered.
    let live = a.add_peer(&b.address()).unwrap();
    a.submit(Transfer::new(live).segment(seg(d.remote)).imm(7))
        .unwrap()
        .wait(Duration::from_secs(10))
        .unwrap();
    assert_eq!(
        b.next_event(Duration::from_secs(10)).unwrap().imm(),
        Some(7)
    );
    assert_eq!(dst.to_vec(0, 4096).unwrap(), vec![0x42; 4096]);
    a.deregister(s.local).unwrap();

    stop_tx.send(()).unwrap();
    holder.join().unwrap();
}
