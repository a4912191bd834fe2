//! Rail groups over the in-memory transport.

use fabric_core::engine::{EngineConfig, GroupTransfer, RailGroup};
use fabric_core::mem::MemTransport;
use fabric_core::{Access, Error, HostBuffer};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn group(n: usize) -> RailGroup {
    RailGroup::spawn(n, |_| Ok(MemTransport::new()), EngineConfig::default()).unwrap()
}

#[test]
fn a_transfer_is_spread_over_all_rails_and_imm_follows() {
    let a = group(4);
    let b = group(2);
    let len = 4 << 20;
    let src = HostBuffer::new_shared(len).unwrap();
    src.write(0, &pattern(9, len)).unwrap();
    let dst = HostBuffer::new_shared(len).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    assert_eq!(d.remote.rails.len(), 2);
    assert_ne!(
        d.remote.rails[0].key, d.remote.rails[1].key,
        "one key per rail"
    );
    let peer = a.add_peer(&b.addresses()).unwrap();
    assert_eq!(peer.remote_rail, vec![0, 1, 0, 1]);
    let pages: Vec<u64> = (0..256).rev().step_by(2).collect();
    let mut t = GroupTransfer::same_pages(s.clone(), d.remote.clone(), &pages, 16384);
    t.imm = Some(1234);
    let stats = a.submit(&peer, t).unwrap().wait(T).unwrap();
    assert_eq!(stats.bytes, 128 * 16384);
    b.wait_imm(1234, 1, T).unwrap();
    for p in &pages {
        assert!(
            dst.to_vec(p * 16384, 16384).unwrap() == src.to_vec(p * 16384, 16384).unwrap(),
            "page {p}"
        );
    }
    assert!(
        dst.to_vec(0, 16384).unwrap() == vec![0; 16384],
        "unsent pages stay untouched"
    );
    let per_rail = a.rail_counters();
    assert!(
        per_rail.iter().all(|c| c.bytes > 0),
        "every rail carried bytes: {per_rail:?}"
    );
    let max = per_rail.iter().map(|c| c.bytes).max().unwrap();
    let min = per_rail.iter().map(|c| c.bytes).min().unwrap();
    assert!(max - min <= 16384, "shards balanced by bytes: {per_rail:?}");
}

#[test]
fn imm_waiters_count_and_keep_other_values() {
    let a = group(2);
    let b = group(2);
    let src = HostBuffer::new_shared(65536).unwrap();
    let dst = HostBuffer::new_shared(65536).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst, Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    for (i, imm) in [7u32, 8, 7].into_iter().enumerate() {
        let mut t = GroupTransfer::same_pages(s.clone(), d.remote.clone(), &[i as u64], 4096);
        t.imm = Some(imm);
        a.submit(&peer, t).unwrap().wait(T).unwrap();
    }
    b.wait_imm(7, 2, T).unwrap();
    b.wait_imm(8, 1, T).unwrap();
    assert!(matches!(
        b.wait_imm(7, 1, Duration::from_millis(30)),
        Err(Error::TimedOut(..))
    ));
}

#[test]
fn bad_descriptors_fail_clearly() {
    let a = group(2);
    let b = group(1);
    assert!(RailGroup::spawn(0, |_| Ok(MemTransport::new()), EngineConfig::default()).is_err());
    let src = HostBuffer::new_shared(65536).unwrap();
    let dst = HostBuffer::new_shared(65536).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst, Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    assert!(
        GroupTransfer::paged(s.clone(), d.remote.clone(), &[1, 2], 4096, &[1], 4096, 4096).is_err()
    );
    assert!(
        GroupTransfer::paged(s.clone(), d.remote.clone(), &[1], 4096, &[1], 4096, 8192).is_err()
    );
    let beyond = GroupTransfer::same_pages(s.clone(), d.remote.clone(), &[100], 4096);
    assert!(matches!(
        a.submit(&peer, beyond),
        Err(Error::InvalidArgument(_))
    ));
    assert!(a.add_peer(&[]).is_err());
    assert!(a.add_peer(&[b"mem://999999999".to_vec()]).is_err());
    let t = GroupTransfer::paged(s, d.remote, &[3, 1], 8192, &[0, 2], 4096, 4096).unwrap();
    assert_eq!(a.submit(&peer, t).unwrap().wait(T).unwrap().bytes, 8192);
}

/// A deterministic byte pattern.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn warm_up_touches_every_rail_and_no_byte_and_is_not_reported() {
    let a = group(3);
    let b = group(2);
    let src = HostBuffer::new_shared(65536).unwrap();
    src.fill(0, 65536, 9).unwrap();
    let dst = HostBuffer::new_shared(65536).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    a.warm_up(&peer, &s, &d.remote, T).unwrap();
    assert!(
        a.rail_counters().iter().all(|c| c.ops >= 1),
        "every rail posted: {:?}",
        a.rail_counters()
    );
    assert!(
        dst.to_vec(0, 65536).unwrap() == vec![0; 65536],
        "warm-up writes no byte"
    );
    assert!(matches!(
        b.next_event(Duration::from_millis(50)),
        Err(Error::TimedOut(..))
    ));
    let handles = a
        .scatter(vec![(
            peer.clone(),
            GroupTransfer::same_pages(s.clone(), d.remote.clone(), &[1], 4096),
        )])
        .unwrap();
    for h in handles {
        assert_eq!(h.wait(T).unwrap().bytes, 4096);
    }
    assert_eq!(dst.to_vec(4096, 4096).unwrap(), vec![9; 4096]);
}

/// The rails of a group start at once: each rail's transport is made only when every other
/// rail's is being made too (one after another, the first would wait in vain).
#[test]
fn rails_start_at_once() {
    use std::sync::{Condvar, Mutex};
    use std::time::Instant;
    const N: usize = 8;
    let meet = std::sync::Arc::new((Mutex::new(0usize), Condvar::new()));
    let m = meet.clone();
    let g = RailGroup::spawn(
        N,
        move |_| {
            let (count, cv) = &*m;
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut here = count.lock().unwrap();
            *here += 1;
            cv.notify_all();
            while *here < N {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(fabric_core::Error::InvalidArgument(
                        "the other rails did not start meanwhile".into(),
                    ));
                }
                here = cv.wait_timeout(here, left).unwrap().0;
            }
            Ok(MemTransport::new())
        },
        EngineConfig::default(),
    )
    .expect("all rails start together");
    assert_eq!(g.rails().len(), N);
    assert_eq!(*meet.0.lock().unwrap(), N);
}

/// Two 4-rail groups and a transfer spread over all rails, with immediate data 77.
fn spread_transfer() -> (
    RailGroup,
    RailGroup,
    fabric_core::engine::GroupPeer,
    GroupTransfer,
) {
    let a = group(4);
    let b = group(4);
    let len = 2 << 20;
    let src = HostBuffer::new_shared(len).unwrap();
    src.write(0, &pattern(3, len)).unwrap();
    let dst = HostBuffer::new_shared(len).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst, Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    // Not adjacent, so not coalesced: 64 writes, sharded over the 4 rails.
    let pages: Vec<u64> = (0..128).step_by(2).collect();
    let mut t = GroupTransfer::same_pages(s, d.remote, &pages, 16384);
    t.imm = Some(77);
    (a, b, peer, t)
}

#[test]
fn group_imm_arrives_when_the_caller_only_registers_a_callback() {
    let (a, b, peer, t) = spread_transfer();
    let (tx, rx) = std::sync::mpsc::channel();
    a.submit_with_callback(&peer, t, move |r| {
        let _ = tx.send(r);
    })
    .unwrap();
    // Nobody waits on a handle: the workers alone must send the immediate data.
    b.wait_imm(77, 1, T).unwrap();
    let r = rx.recv_timeout(T).expect("callback ran");
    assert_eq!(r.unwrap().bytes, 64 * 16384);
    assert_eq!(a.rail_counters().iter().filter(|c| c.bytes > 0).count(), 4);
}

#[test]
fn group_imm_arrives_when_the_caller_only_polls() {
    let (a, b, peer, t) = spread_transfer();
    let h = a.submit(&peer, t).unwrap();
    let deadline = std::time::Instant::now() + T;
    while !h.is_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "transfer never finished"
        );
        std::thread::yield_now();
    }
    assert!(h.failed().is_none());
    // Finished means the immediate data was placed too; the target's worker reports it.
    b.wait_imm(77, 1, T).unwrap();
}

#[test]
fn group_imm_arrives_when_the_handle_is_dropped() {
    let (a, b, peer, t) = spread_transfer();
    drop(a.submit(&peer, t).unwrap());
    b.wait_imm(77, 1, T).unwrap();
}

#[test]
fn group_handles_are_futures() {
    use std::future::Future;
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    struct Flag(std::sync::Mutex<bool>, std::sync::Condvar);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            *self.0.lock().unwrap() = true;
            self.1.notify_all();
        }
    }
    let (a, b, peer, t) = spread_transfer();
    let flag = Arc::new(Flag(Default::default(), Default::default()));
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    let mut h = a.submit(&peer, t).unwrap();
    let r = loop {
        match std::pin::Pin::new(&mut h).poll(&mut cx) {
            Poll::Ready(r) => break r,
            Poll::Pending => {
                let g = flag.0.lock().unwrap();
                let (mut g, to) = flag.1.wait_timeout_while(g, T, |woken| !*woken).unwrap();
                assert!(!to.timed_out(), "the future was never woken");
                *g = false;
            }
        }
    };
    assert_eq!(r.unwrap().bytes, 64 * 16384);
    b.wait_imm(77, 1, T).unwrap();
}
