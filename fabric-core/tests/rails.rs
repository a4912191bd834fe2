//! Rail groups over the in-memory transport.

use fabric_core::engine::{EngineConfig, GroupTransfer, RailGroup};
use fabric_core::mem::MemTransport;
use fabric_core::{Access, Error, HostBuffer};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn group(n: usize) -> RailGroup {
    RailGroup::spawn(n, |_| Ok(MemTransport::new()), EngineConfig::default()).unwrap()
}

/// Both ends of a `len`-byte transfer: a source in `a` filled with pattern `seed`, a
/// zeroed destination in `b`, each registered on every rail, and `b` added as `a`'s peer.
struct Ends {
    src: std::sync::Arc<HostBuffer>,
    dst: std::sync::Arc<HostBuffer>,
    s: fabric_core::engine::GroupRegistration,
    d: fabric_core::engine::GroupRegistration,
    peer: fabric_core::engine::GroupPeer,
}

fn ends(a: &RailGroup, b: &RailGroup, len: usize, seed: u64) -> Ends {
    let src = HostBuffer::new_shared(len).unwrap();
    src.write(0, &pattern(seed, len)).unwrap();
    let dst = HostBuffer::new_shared(len).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    Ends {
        src,
        dst,
        s,
        d,
        peer,
    }
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
    assert!(
        max - min <= 16384,
        "chunks spread evenly when all fit in flight: {per_rail:?}"
    );
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
                    // The other rails did not start meanwhile.
                    return Err(fabric_core::Error::TimedOut(
                        Duration::from_secs(5),
                        "the other rails to start",
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
    let Ends { s, d, peer, .. } = ends(&a, &b, 2 << 20, 3);
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

/// A mem transport whose write completions are held back while its gate is closed: a rail
/// on a NIC that has stopped moving.
struct Gated {
    inner: MemTransport,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    held: Vec<fabric_core::Completion>,
    /// Bytes of the writes posted to it.
    posted: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl fabric_core::Transport for Gated {
    fn name(&self) -> &'static str {
        "gated-mem"
    }
    fn address(&self) -> Vec<u8> {
        self.inner.address()
    }
    fn limits(&self) -> fabric_core::TransportLimits {
        fabric_core::TransportLimits {
            busy_poll: true,
            strided_writes: false,
            ..self.inner.limits()
        }
    }
    fn add_peer(&mut self, address: &[u8]) -> fabric_core::Result<fabric_core::PeerId> {
        self.inner.add_peer(address)
    }
    fn remove_peer(&mut self, peer: fabric_core::PeerId) -> fabric_core::Result<()> {
        self.inner.remove_peer(peer)
    }
    fn register(
        &mut self,
        mem: std::sync::Arc<dyn fabric_core::MemoryRegion>,
        access: Access,
    ) -> fabric_core::Result<fabric_core::Registration> {
        self.inner.register(mem, access)
    }
    fn deregister(&mut self, key: fabric_core::LocalKey) -> fabric_core::Result<()> {
        self.inner.deregister(key)
    }
    fn post_send(
        &mut self,
        peer: fabric_core::PeerId,
        wr_id: fabric_core::WorkRequestId,
        src: fabric_core::LocalSlice,
        imm: Option<u32>,
    ) -> fabric_core::Result<fabric_core::PostOutcome> {
        self.inner.post_send(peer, wr_id, src, imm)
    }
    fn post_recv(
        &mut self,
        wr_id: fabric_core::WorkRequestId,
        dst: fabric_core::LocalSlice,
    ) -> fabric_core::Result<fabric_core::PostOutcome> {
        self.inner.post_recv(wr_id, dst)
    }
    fn post_write(
        &mut self,
        peer: fabric_core::PeerId,
        wr_id: fabric_core::WorkRequestId,
        src: fabric_core::LocalSlice,
        dst: fabric_core::RemoteSlice,
        imm: Option<u32>,
    ) -> fabric_core::Result<fabric_core::PostOutcome> {
        let len = src.len;
        let r = self.inner.post_write(peer, wr_id, src, dst, imm);
        if r.is_ok() {
            self.posted
                .fetch_add(len, std::sync::atomic::Ordering::AcqRel);
        }
        r
    }
    fn poll(&mut self, out: &mut Vec<fabric_core::Completion>) -> fabric_core::Result<usize> {
        let mut got = Vec::new();
        self.inner.poll(&mut got)?;
        self.held.append(&mut got);
        if !self.open.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(0);
        }
        let n = self.held.len();
        out.append(&mut self.held);
        Ok(n)
    }
}

/// Rails take chunks as they have room: with one rail of four stalled, the three others
/// carry everything but the stalled rail's first chunks (a split fixed up front would leave
/// a quarter of the transfer waiting on it), and the transfer completes, verified, once the
/// stalled rail moves again.
#[test]
fn a_stalled_rail_carries_only_its_first_chunks() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let open = Arc::new(AtomicBool::new(false));
    let gate = open.clone();
    // Rail 3 is the stalled one; the others are always open.
    let mut gates: Vec<_> = (0..3).map(|_| Arc::new(AtomicBool::new(true))).collect();
    gates.push(gate);
    let a = gated_group(gates);
    let b = group(2);
    let len = 64 << 20;
    let Ends {
        src,
        dst,
        s,
        d,
        peer,
    } = ends(&a, &b, len, 5);
    let pages: Vec<u64> = (0..1024).collect();
    let mut t = GroupTransfer::same_pages(s, d.remote, &pages, 65536);
    t.imm = Some(9);
    let balance = a.balance();
    let chunk = balance.chunk_bytes(len as u64, 4);
    let first = balance.in_flight as u64 * chunk;
    let h = a.submit(&peer, t).unwrap();
    // The three open rails finish everything the stalled one did not take.
    let deadline = std::time::Instant::now() + T;
    let fast = |a: &RailGroup| a.rail_counters()[..3].iter().map(|c| c.bytes).sum::<u64>();
    while fast(&a) < len as u64 - first {
        assert!(
            std::time::Instant::now() < deadline,
            "open rails carried {} of {} bytes",
            fast(&a),
            len as u64 - first
        );
        std::thread::yield_now();
    }
    assert!(!h.is_finished(), "finished before the stalled rail moved");
    open.store(true, Ordering::Release);
    let stats = h.wait(T).unwrap();
    assert_eq!(stats.bytes, len as u64);
    let per_rail = a.rail_counters();
    assert_eq!(per_rail[3].bytes, first, "stalled rail: {per_rail:?}");
    assert_eq!(fast(&a), len as u64 - first, "open rails: {per_rail:?}");
    b.wait_imm(9, 1, T).unwrap();
    assert!(dst.to_vec(0, len).unwrap() == src.to_vec(0, len).unwrap());
}

/// A group of `gates.len()` gated rails, rail `i` held back while `gates[i]` is false.
fn gated_group(gates: Vec<std::sync::Arc<std::sync::atomic::AtomicBool>>) -> RailGroup {
    gated_group_counting(gates).0
}

/// [`gated_group`], and the bytes posted to each rail's transport.
fn gated_group_counting(
    gates: Vec<std::sync::Arc<std::sync::atomic::AtomicBool>>,
) -> (RailGroup, Vec<std::sync::Arc<std::sync::atomic::AtomicU64>>) {
    let posted: Vec<_> = gates.iter().map(|_| Default::default()).collect();
    let counters = posted.clone();
    let g = RailGroup::spawn(
        gates.len(),
        move |i| {
            Ok(Gated {
                inner: MemTransport::new(),
                open: gates[i].clone(),
                held: Vec::new(),
                posted: std::sync::Arc::clone(&counters[i]),
            })
        },
        EngineConfig::default(),
    )
    .unwrap();
    (g, posted)
}

/// Transfers of one chunk go to the rail with the least in flight, not always to rail 0.
#[test]
fn small_transfers_go_to_the_least_loaded_rail() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let gates: Vec<_> = (0..4).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let (a, b) = (gated_group(gates.clone()), group(4));
    let len = 1 << 20;
    let src = HostBuffer::new_shared(len).unwrap();
    let dst = HostBuffer::new_shared(len).unwrap();
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst, Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    // Every rail holds its completions: each one-page transfer stays in flight, and the
    // next goes to a rail with nothing in flight.
    let handles: Vec<_> = (0..4u64)
        .map(|p| {
            let t = GroupTransfer::same_pages(s.clone(), d.remote.clone(), &[p], 4096);
            a.submit(&peer, t).unwrap()
        })
        .collect();
    for g in &gates {
        g.store(true, Ordering::Release);
    }
    for h in handles {
        h.wait(T).unwrap();
    }
    let per_rail = a.rail_counters();
    assert!(
        per_rail.iter().all(|c| c.bytes == 4096),
        "one page on each rail: {per_rail:?}"
    );
}

/// Deregistering a region that an undecided transfer uses fails on every rail or on none:
/// the region stays registered and usable on all of them (the rails that held none of the
/// transfer's chunks used to deregister it, so the next transfer there and the
/// deregistration after the transfer failed), and once the transfers are decided it
/// deregisters from every rail.
#[test]
fn a_region_in_use_stays_registered_on_every_rail() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let gates: Vec<_> = (0..2).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let (a, b) = (gated_group(gates.clone()), group(2));
    let len = 1 << 20;
    let Ends {
        src,
        dst,
        s,
        d,
        peer,
    } = ends(&a, &b, len, 11);
    let page = |p: u64| GroupTransfer::same_pages(s.clone(), d.remote.clone(), &[p], 4096);
    // One page: one rail's chunk, held there.
    let first = a.submit(&peer, page(0)).unwrap();
    match a.deregister(&s) {
        Err(Error::RegionInUse { transfers: 1, .. }) => {}
        other => panic!("deregistered under a transfer: {other:?}"),
    }
    // Still registered on the other rail: the next page goes there (the least loaded).
    let second = a.submit(&peer, page(1)).unwrap();
    for g in &gates {
        g.store(true, Ordering::Release);
    }
    first.wait(T).unwrap();
    second.wait(T).unwrap();
    let per_rail = a.rail_counters();
    assert!(
        per_rail.iter().all(|c| c.bytes == 4096),
        "a page on each rail: {per_rail:?}"
    );
    assert_eq!(dst.to_vec(0, 8192).unwrap(), src.to_vec(0, 8192).unwrap());
    a.deregister(&s).unwrap();
    assert!(
        a.submit(&peer, page(2)).is_err(),
        "deregistered from every rail"
    );
}

/// What a stalled rail whose rate is known holds of a new transfer: with the default
/// `lead` (zero) its `in_flight` chunks and no more, the rest going to the rails that
/// move; with a lead of 16 ms of its (fast) rate it takes a quarter of the transfer at
/// submit, which then waits for it. Rates are learned first (a rate is unknown until a
/// rail has moved chunks for a horizon, and an unknown rate gives no lead at all).
#[test]
fn a_stalled_rail_with_a_known_rate_holds_only_its_in_flight_chunks() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    assert_eq!(fabric_core::engine::Balance::default().lead, Duration::ZERO);
    const CHUNK: u64 = 256 << 10;
    let held = |lead: Duration| -> u64 {
        let gates: Vec<_> = (0..4).map(|_| Arc::new(AtomicBool::new(true))).collect();
        let (a, posted) = gated_group_counting(gates.clone());
        let b = group(2);
        let chunk = CHUNK;
        let mut balance = a.balance();
        balance.horizon = Duration::from_millis(1);
        balance.max_rail_chunk = chunk;
        balance.lead = lead;
        a.set_balance(balance);
        let len = 64usize << 20;
        let Ends {
            src,
            dst,
            s,
            d,
            peer,
        } = ends(&a, &b, len, 11);
        // Every rail moves 16 MiB a transfer, chunk after chunk: longer than the horizon.
        let all: Vec<u64> = (0..(len as u64 / chunk)).collect();
        for _ in 0..3 {
            let t = GroupTransfer::same_pages(s.clone(), d.remote.clone(), &all, chunk);
            a.submit(&peer, t).unwrap().wait(T).unwrap();
        }
        gates[3].store(false, Ordering::Release);
        let before = posted[3].load(Ordering::Acquire);
        // 16 MiB: 64 chunks of 256 KiB.
        let pages: Vec<u64> = (0..64).collect();
        let t = GroupTransfer::same_pages(s, d.remote, &pages, chunk);
        let fast = |a: &RailGroup| a.rail_counters()[..3].iter().map(|c| c.bytes).sum::<u64>();
        let warm = fast(&a);
        let h = a.submit(&peer, t).unwrap();
        let taken = || posted[3].load(Ordering::Acquire) - before;
        // The stalled rail lands nothing, so it takes nothing after what it took at submit:
        // wait until the open rails have carried all the rest.
        let deadline = std::time::Instant::now() + T;
        while fast(&a) - warm + taken() < 64 * chunk {
            assert!(
                std::time::Instant::now() < deadline,
                "the open rails stopped"
            );
            std::thread::yield_now();
        }
        let took = taken();
        assert!(!h.is_finished(), "finished before the stalled rail moved");
        gates[3].store(true, Ordering::Release);
        assert_eq!(h.wait(T).unwrap().bytes, 64 * chunk);
        assert!(dst.to_vec(0, len).unwrap() == src.to_vec(0, len).unwrap());
        took
    };
    let in_flight = fabric_core::engine::Balance::default().in_flight as u64;
    assert_eq!(held(Duration::ZERO), in_flight * CHUNK, "default lead");
    let greedy = held(Duration::from_millis(16));
    assert!(
        greedy > in_flight * CHUNK,
        "a 16 ms lead took only {greedy} bytes: the rates were not learned"
    );
}

#[test]
fn strided_runs_land_every_row_as_few_strided_writes_over_every_rail() {
    use fabric_core::plan::StridedRun;
    let a = group(4);
    let b = group(4);
    let len = 4 << 20;
    let e = ends(&a, &b, len, 5);
    // 16 384 rows of 96 bytes, every other 192-byte row of the source, back to back from
    // byte 1000 of the destination (a tensor-parallel half of each row); and a plain segment.
    let (rows, row) = (16384u64, 96u64);
    let run = StridedRun {
        src_offset: 64,
        dst_offset: 1000,
        len: row,
        count: rows,
        src_stride: 2 * row,
        dst_stride: row,
    };
    let t = GroupTransfer {
        segments: vec![(len as u64 - 10, 0, 10)],
        runs: vec![run],
        imm: Some(77),
        ..GroupTransfer::same_pages(e.s.clone(), e.d.remote.clone(), &[], 1)
    };
    let stats = a.submit(&e.peer, t).unwrap().wait(T).unwrap();
    b.wait_imm(77, 1, T).unwrap();
    assert_eq!(stats.bytes, rows * row + 10);
    let src = e.src.to_vec(0, len).unwrap();
    let dst = e.dst.to_vec(0, len).unwrap();
    assert_eq!(dst[..10], src[len - 10..]);
    assert_eq!(
        dst[10..1000],
        vec![0; 990][..],
        "bytes before the rows stay"
    );
    for i in 0..rows as usize {
        let (s, d) = (64 + i * 2 * row as usize, 1000 + i * row as usize);
        assert!(
            dst[d..d + row as usize] == src[s..s + row as usize],
            "row {i}"
        );
    }
    let end = 1000 + (rows * row) as usize;
    assert!(
        dst[end..].iter().all(|&b| b == 0),
        "bytes after the rows stay"
    );
    // Strided writes of up to a chunk each, not a write per row; every rail took some.
    assert!(stats.ops < 64, "{} operations for {rows} rows", stats.ops);
    let per_rail = a.rail_counters();
    assert!(per_rail.iter().all(|c| c.bytes > 0), "{per_rail:?}");
}

#[test]
fn a_bad_run_fails_at_submit_and_moves_nothing() {
    use fabric_core::plan::StridedRun;
    let a = group(2);
    let b = group(2);
    let e = ends(&a, &b, 65536, 6);
    let submit = |run: StridedRun| {
        let t = GroupTransfer {
            runs: vec![run],
            ..GroupTransfer::same_pages(e.s.clone(), e.d.remote.clone(), &[], 1)
        };
        a.submit(&e.peer, t)
    };
    let ok = StridedRun {
        src_offset: 0,
        dst_offset: 0,
        len: 100,
        count: 10,
        src_stride: 200,
        dst_stride: 100,
    };
    // Past the local region's end, past the remote one's, strides shorter than a row.
    for bad in [
        StridedRun {
            src_offset: 65536 - 1000,
            ..ok
        },
        StridedRun {
            dst_offset: 65536 - 500,
            ..ok
        },
        StridedRun {
            dst_stride: 50,
            ..ok
        },
        StridedRun {
            count: u64::MAX,
            ..ok
        },
    ] {
        assert!(
            matches!(submit(bad), Err(Error::InvalidArgument(_))),
            "{bad:?} was accepted"
        );
    }
    assert!(e.dst.to_vec(0, 65536).unwrap().iter().all(|&b| b == 0));
    submit(ok).unwrap().wait(T).unwrap();
    assert_eq!(e.dst.to_vec(0, 100).unwrap(), e.src.to_vec(0, 100).unwrap());
}
