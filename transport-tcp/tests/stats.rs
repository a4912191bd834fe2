//! What the TCP transport counts ([`Transport::stats`](fabric_core::Transport::stats)),
//! read through the engine: the target side of one-sided WRITEs counts the bytes placed in
//! its regions (equal to what the initiator wrote), READs served and requests refused, and
//! each peer's state with the error that closed it.

use fabric_core::engine::{Engine, EngineConfig, Transfer};
use fabric_core::plan::Segment;
use fabric_core::stats::PeerState;
use fabric_core::testing::eventually;
use fabric_core::{Access, HostBuffer, RemoteKey, RemoteRegion};
use std::time::Duration;
use transport_tcp::{TcpConfig, TcpTransport};

const T: Duration = Duration::from_secs(20);

fn tcp_engine(rails: usize) -> Engine {
    Engine::spawn(
        move || {
            TcpTransport::new(TcpConfig {
                rails,
                ..TcpConfig::default()
            })
        },
        EngineConfig::default(),
    )
    .expect("tcp engine")
}

#[test]
fn the_target_counts_what_landed_and_each_side_sees_its_peers() {
    let a = tcp_engine(2);
    let b = tcp_engine(1);
    let src = HostBuffer::new_shared(1 << 20).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let d = b
        .register(
            HostBuffer::new_shared(1 << 20).unwrap(),
            Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    let mine = a.stats().transport.expect("tcp keeps figures").peers;
    assert_eq!(mine.len(), 1);
    assert_eq!(
        (mine[0].state, mine[0].connections, mine[0].passive),
        (PeerState::Connected, 2, false)
    );

    for round in 0..20u64 {
        let mut t = Transfer::new(peer);
        for i in 0..16u64 {
            // Rows landing back to back: a strided write gathered into one WRITE (rows at a
            // stride on both sides would go as a WRITE each, counted so by the target).
            t = t.segment(Segment {
                src: s.local,
                src_offset: i * 16384,
                dst: d.remote,
                dst_offset: (round % 5) * 16 * 12288 + i * 12288,
                len: 12288,
            });
        }
        a.submit(t).unwrap().wait(T).unwrap();
    }
    let written = a.stats().counters.bytes;
    assert_eq!(written, 20 * 16 * 12288);
    // An initiator's completion means placed: the target has counted them all.
    let tb = b.stats().transport.unwrap();
    assert_eq!(tb.received_bytes, written);
    // Every WRITE the initiator's rails posted, counted once (batches count theirs in runs).
    assert_eq!(tb.received_writes, a.stats().counters.ops);
    assert_eq!(tb.refused_requests, 0);
    let theirs: Vec<_> = tb
        .peers
        .iter()
        .filter(|p| p.state == PeerState::Connected)
        .collect();
    assert_eq!(theirs.len(), 1, "{:?}", tb.peers);
    assert!(theirs[0].passive && theirs[0].connections == 2);

    // A WRITE with a key the target never gave is refused there and counted.
    let bogus = RemoteRegion {
        addr: 0,
        len: 1 << 20,
        key: RemoteKey(0x0BAD_0BAD),
    };
    let t = Transfer::new(peer).segment(Segment {
        src: s.local,
        src_offset: 0,
        dst: bogus,
        dst_offset: 0,
        len: 4096,
    });
    assert!(a.submit(t).unwrap().wait(T).is_err());
    assert_eq!(b.stats().transport.unwrap().refused_requests, 1);
    assert_eq!(b.stats().transport.unwrap().received_bytes, written);

    // The initiator leaves: the target sees its peer closed, with why.
    a.remove_peer(peer).unwrap();
    assert_eq!(
        a.stats().transport.unwrap().peers[0].state,
        PeerState::Closed
    );
    eventually("the target to see its peer close", T, || {
        let peers = b.stats().transport.unwrap().peers;
        peers.len() == 1 && peers[0].state == PeerState::Closed && peers[0].last_error.is_some()
    });
}
