//! The figures an engine and a rail group report ([`Engine::stats`], [`RailGroup::stats`])
//! over the in-memory transport: bytes counted at both ends of one-sided writes, latency,
//! operations in flight, registrations, peers, and the bounded event queue.

use fabric_core::engine::{Engine, EngineConfig, GroupTransfer, RailGroup, Transfer};
use fabric_core::mem::MemTransport;
use fabric_core::plan::Segment;
use fabric_core::stats::PeerState;
use fabric_core::testing::eventually;
use fabric_core::{Access, HostBuffer};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn mem_engine(cfg: EngineConfig) -> Engine {
    Engine::spawn(|| Ok(MemTransport::new()), cfg).unwrap()
}

#[test]
fn both_ends_count_the_bytes_of_one_sided_writes() {
    let a = mem_engine(EngineConfig::default());
    let b = mem_engine(EngineConfig::default());
    let src = HostBuffer::new_shared(1 << 20).unwrap();
    let dst = HostBuffer::new_shared(2 << 20).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst, Access::REMOTE_WRITE).unwrap();
    let before = a.stats();
    assert_eq!(before.registered_bytes, 1 << 20);
    assert_eq!(before.registered_regions, 1);
    assert_eq!(b.stats().registered_bytes, 2 << 20);
    let peer = a.add_peer(&b.address()).unwrap();
    let peers = a.stats().transport.expect("mem keeps figures").peers;
    assert_eq!(peers.len(), 1);
    assert_eq!(peers[0].state, PeerState::Connected);

    for round in 0..10u64 {
        let mut t = Transfer::new(peer);
        for i in 0..8u64 {
            t = t.segment(Segment {
                src: s.local,
                src_offset: i * 8192,
                dst: d.remote,
                dst_offset: (round * 8 + i) * 8192 % (2 << 20),
                len: 4096,
            });
        }
        a.submit(t).unwrap().wait(T).unwrap();
    }
    let sa = a.stats();
    assert_eq!(sa.counters.bytes, 10 * 8 * 4096);
    assert_eq!(sa.counters.transfers, 10);
    assert_eq!(sa.counters.in_flight, 0);
    assert_eq!(sa.counters.ops, sa.counters.completed);
    assert_eq!(sa.latency.count, 10, "one latency per transfer");
    assert!(sa.latency.sum > Duration::ZERO);
    // The target counted what landed in its memory, and nothing of its own.
    let sb = b.stats();
    let tb = sb.transport.expect("mem keeps figures");
    assert_eq!(tb.received_bytes, sa.counters.bytes);
    assert_eq!(tb.received_writes, sa.counters.ops);
    assert_eq!(sb.counters.bytes, 0);

    a.deregister(s.local).unwrap();
    assert_eq!(a.stats().registered_bytes, 0);
    a.remove_peer(peer).unwrap();
    let peers = a.stats().transport.unwrap().peers;
    assert_eq!(peers[0].state, PeerState::Closed);
}

#[test]
fn a_group_reports_every_rail_and_its_own_latency() {
    let a = RailGroup::spawn(3, |_| Ok(MemTransport::new()), EngineConfig::default()).unwrap();
    let b = RailGroup::spawn(2, |_| Ok(MemTransport::new()), EngineConfig::default()).unwrap();
    let len = 8 << 20;
    let s = a
        .register(HostBuffer::new_shared(len).unwrap(), Access::NONE)
        .unwrap();
    let d = b
        .register(HostBuffer::new_shared(len).unwrap(), Access::REMOTE_WRITE)
        .unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    let pages: Vec<u64> = (0..512).collect();
    for _ in 0..4 {
        let t = GroupTransfer::same_pages(s.clone(), d.remote.clone(), &pages, 16384);
        a.submit(&peer, t).unwrap().wait(T).unwrap();
    }
    let sa = a.stats();
    assert_eq!(sa.rails.len(), 3);
    assert_eq!(sa.latency.count, 4, "one latency per group transfer");
    assert_eq!(sa.counters().bytes, 4 * 512 * 16384);
    assert!(
        sa.rails.iter().all(|r| r.registered_bytes == len as u64),
        "the region is registered on every rail"
    );
    // Chunks are the rails' own transfers.
    let chunks: u64 = sa.rails.iter().map(|r| r.latency.count).sum();
    assert_eq!(chunks, sa.counters().transfers);
    let sb = b.stats();
    assert_eq!(sb.received_bytes(), sa.counters().bytes);
}

#[test]
fn events_the_application_takes_late_are_all_kept_and_counted() {
    let a = mem_engine(EngineConfig::default());
    let b = mem_engine(EngineConfig::default());
    let s = a
        .register(HostBuffer::new_shared(4096).unwrap(), Access::NONE)
        .unwrap();
    let d = b
        .register(HostBuffer::new_shared(4096).unwrap(), Access::REMOTE_WRITE)
        .unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    let seg = Segment {
        src: s.local,
        src_offset: 0,
        dst: d.remote,
        dst_offset: 0,
        len: 64,
    };
    // Far more than any queue an engine used to keep, while the target does not look.
    for round in 0..3000 {
        for i in 0..10 {
            let t = Transfer::new(peer).segment(seg).imm(i);
            a.submit(t)
                .unwrap()
                .wait(T)
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
    }
    eventually("the target to count every arrival", T, || {
        b.stats().counters.notifications == 30_000
    });
    // Taken one at a time, values come in the order they first arrived, each as often as
    // it was sent.
    for i in 0..10 {
        assert_eq!(b.next_event(T).unwrap().imm(), Some(i));
    }
    assert_eq!(b.inbox().pending(), 30_000 - 10);
    assert_eq!(b.inbox().refused(), 0);
}
