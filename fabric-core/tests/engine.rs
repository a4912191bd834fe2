//! The engine over in-memory transports, including ones that misbehave on purpose.

use fabric_core::engine::{Engine, EngineConfig, Event, Transfer};
use fabric_core::mem::MemTransport;
use fabric_core::plan::Segment;
use fabric_core::{
    Access, Completion, Error, HostBuffer, LocalKey, LocalSlice, MemoryRegion, OpError, OpKind,
    PeerId, PostOutcome, Registration, RemoteSlice, Result, Transport, TransportLimits,
    WorkRequestId,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn mem_engine() -> Engine {
    Engine::spawn(|| Ok(MemTransport::new()), EngineConfig::default()).unwrap()
}

struct Setup {
    a: Engine,
    b: Engine,
    peer: PeerId,
    src: Arc<HostBuffer>,
    dst: Arc<HostBuffer>,
    s: Registration,
    d: Registration,
}

fn setup(a: Engine, b: Engine, len: usize) -> Setup {
    let src = HostBuffer::new_shared(len).unwrap();
    src.write(0, &pattern(1, len)).unwrap();
    let dst = HostBuffer::new_shared(len).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let d = b
        .register(dst.clone(), Access::REMOTE_WRITE | Access::LOCAL_WRITE)
        .unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    Setup {
        a,
        b,
        peer,
        src,
        dst,
        s,
        d,
    }
}

fn page(s: &Setup, src_page: u64, dst_page: u64, size: u64) -> Segment {
    Segment {
        src: s.s.local,
        src_offset: src_page * size,
        dst: s.d.remote,
        dst_offset: dst_page * size,
        len: size,
    }
}

#[test]
fn scattered_pages_land_and_imm_comes_last() {
    let s = setup(mem_engine(), mem_engine(), 1 << 20);
    let mut t = Transfer::new(s.peer).imm(77);
    for i in 0..64u64 {
        t = t.segment(page(&s, i, (i * 7) % 64, 16384));
    }
    let stats = s.a.submit(t).unwrap().wait(T).unwrap();
    assert_eq!(stats.bytes, 1 << 20);
    assert!(matches!(
        s.b.next_event(T).unwrap(),
        Event::Imm { imm: 77, .. }
    ));
    let src = s.src.to_vec(0, 1 << 20).unwrap();
    let dst = s.dst.to_vec(0, 1 << 20).unwrap();
    for i in 0..64usize {
        let d = (i * 7) % 64;
        assert_eq!(
            src[i * 16384..(i + 1) * 16384],
            dst[d * 16384..(d + 1) * 16384],
            "page {i}"
        );
    }
}

#[test]
fn bad_segments_fail_at_submit() {
    let s = setup(mem_engine(), mem_engine(), 65536);
    let mut oob = page(&s, 0, 0, 4096);
    oob.dst_offset = 65536 - 100;
    assert!(matches!(
        s.a.submit(Transfer::new(s.peer).segment(oob)),
        Err(Error::InvalidArgument(_))
    ));
    let overlap = Transfer::new(s.peer)
        .segment(page(&s, 0, 0, 4096))
        .segment(Segment {
            dst_offset: 100,
            ..page(&s, 1, 0, 4096)
        });
    assert!(matches!(
        s.a.submit(overlap),
        Err(Error::InvalidArgument(_))
    ));
    let mut local_oob = page(&s, 0, 0, 4096);
    local_oob.src_offset = 65000;
    assert!(matches!(
        s.a.submit(Transfer::new(s.peer).segment(local_oob)),
        Err(Error::InvalidArgument(_))
    ));
    let mut unknown = page(&s, 0, 0, 4096);
    unknown.src = LocalKey(999);
    assert!(matches!(
        s.a.submit(Transfer::new(s.peer).segment(unknown)),
        Err(Error::Op(OpError::LocalKeyInvalid(_)))
    ));
    assert!(matches!(
        s.a.submit(Transfer::new(s.peer).imm(1)),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(s.dst.to_vec(0, 65536).unwrap(), vec![0; 65536]);
}

#[test]
fn counters_are_up_to_date_when_a_transfer_completes() {
    let s = setup(mem_engine(), mem_engine(), 1 << 20);
    for round in 1..=20u64 {
        // 64 pages to every other destination page, backwards: none coalesce, and no
        // run of them is rows of a strided write (strides go forwards).
        let mut t = Transfer::new(s.peer);
        for i in 0..64u64 {
            t = t.segment(page(&s, i, 2 * (63 - i) + round % 2, 4096));
        }
        let stats = s.a.submit(t).unwrap().wait(T).unwrap();
        assert_eq!(stats.ops, 64);
        let c = s.a.counters().snapshot();
        assert_eq!(
            (c.transfers, c.ops, c.bytes, c.errors, c.reposts),
            (round, 64 * round, 64 * 4096 * round, 0, 0),
            "round {round}"
        );
    }
}

#[test]
fn a_failed_post_drops_the_rest_of_its_transfer() {
    let s = setup(mem_engine(), mem_engine(), 1 << 20);
    let transfer = |peer| {
        // Backwards, as above: one write per page.
        let mut t = Transfer::new(peer).imm(3);
        for i in 0..100u64 {
            t = t.segment(page(&s, i, 2 * (99 - i), 4096));
        }
        t
    };
    s.a.remove_peer(s.peer).unwrap();
    let e = s.a.submit(transfer(s.peer)).unwrap().wait(T).unwrap_err();
    assert!(matches!(e, Error::Op(OpError::PeerRemoved(_))), "{e}");
    let c = s.a.counters().snapshot();
    assert_eq!(
        (c.transfers, c.ops, c.bytes, c.errors),
        (1, 0, 0, 1),
        "the first post fails, the other 99 and the imm are never posted"
    );
    assert!(s.b.next_event(Duration::from_millis(50)).is_err());
    assert_eq!(s.dst.to_vec(0, 1 << 20).unwrap(), vec![0; 1 << 20]);

    let peer = s.a.add_peer(&s.b.address()).unwrap();
    let stats = s.a.submit(transfer(peer)).unwrap().wait(T).unwrap();
    assert_eq!(stats.ops, 101, "100 writes and the imm");
    assert_eq!(s.b.next_event(T).unwrap().imm(), Some(3));
    for i in 0..100u64 {
        assert_eq!(
            s.src.to_vec(i * 4096, 4096).unwrap(),
            s.dst.to_vec(2 * (99 - i) * 4096, 4096).unwrap()
        );
    }
}

#[test]
fn remote_failure_is_the_transfer_error_and_touches_nothing() {
    let s = setup(mem_engine(), mem_engine(), 65536);
    let mut bad = page(&s, 0, 1, 4096);
    bad.dst.key.0 ^= 1;
    let t = Transfer::new(s.peer)
        .segment(page(&s, 0, 0, 4096))
        .segment(bad)
        .imm(5);
    let e = s.a.submit(t).unwrap().wait(T).unwrap_err();
    assert!(matches!(e, Error::Op(OpError::RemoteKeyInvalid(_))), "{e}");
    assert_eq!(s.dst.to_vec(4096, 4096).unwrap(), vec![0; 4096]);
    assert!(
        s.b.next_event(Duration::from_millis(50)).is_err(),
        "a failed transfer must not deliver its imm"
    );
    assert!(s.a.counters().snapshot().errors >= 1);
}

#[test]
fn callbacks_and_futures_report_completion() {
    let s = setup(mem_engine(), mem_engine(), 65536);
    let (tx, rx) = crossbeam_channel::bounded(1);
    s.a.submit_with_callback(
        Transfer::new(s.peer).segment(page(&s, 0, 0, 4096)),
        move |r| {
            tx.send(r).unwrap();
        },
    )
    .unwrap();
    assert_eq!(rx.recv_timeout(T).unwrap().unwrap().bytes, 4096);

    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut h =
        s.a.submit(Transfer::new(s.peer).segment(page(&s, 1, 1, 4096)))
            .unwrap();
    let mut cx = Context::from_waker(&waker);
    let deadline = std::time::Instant::now() + T;
    let r = loop {
        match std::pin::Pin::new(&mut h).poll(&mut cx) {
            Poll::Ready(r) => break r,
            Poll::Pending => {
                assert!(std::time::Instant::now() < deadline);
                std::thread::park_timeout(Duration::from_millis(100));
            }
        }
    };
    assert_eq!(r.unwrap().bytes, 4096);
}

use std::future::Future;

#[test]
fn send_and_receive_through_engines() {
    let s = setup(mem_engine(), mem_engine(), 65536);
    let r =
        s.b.post_recv(LocalSlice {
            key: s.d.local,
            offset: 0,
            len: 1000,
        })
        .unwrap();
    let h =
        s.a.send(
            s.peer,
            LocalSlice {
                key: s.s.local,
                offset: 0,
                len: 600,
            },
            Some(3),
        )
        .unwrap();
    assert_eq!(h.wait(T).unwrap().bytes, 600);
    let got = r.wait(T).unwrap();
    assert_eq!((got.len, got.imm), (600, Some(3)));
    assert_eq!(s.dst.to_vec(0, 600).unwrap(), s.src.to_vec(0, 600).unwrap());
}

#[test]
fn many_submitters_at_once() {
    let s = Arc::new(setup(mem_engine(), mem_engine(), 1 << 20));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    let p = t * 16 + i % 16;
                    let h =
                        s.a.submit(Transfer::new(s.peer).segment(page(&s, p, p, 4096)))
                            .unwrap();
                    h.wait(T).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(s.a.counters().snapshot().transfers, 800);
    assert_eq!(
        s.dst.to_vec(0, 64 * 4096).unwrap(),
        s.src.to_vec(0, 64 * 4096).unwrap()
    );
}

/// A transport that accepts posts and completes them only when told (or on removal).
struct Blackhole {
    inner: MemTransport,
    held: HashMap<PeerId, Vec<WorkRequestId>>,
    removed: std::collections::HashSet<PeerId>,
    out: Vec<Completion>,
    no_room_every: usize,
    posts: usize,
    reposts_seen: Arc<AtomicUsize>,
    swallow: bool,
}

impl Blackhole {
    fn new(swallow: bool, no_room_every: usize, seen: Arc<AtomicUsize>) -> Blackhole {
        Blackhole {
            inner: MemTransport::new(),
            held: HashMap::new(),
            removed: Default::default(),
            out: Vec::new(),
            no_room_every,
            posts: 0,
            reposts_seen: seen,
            swallow,
        }
    }
}

impl Transport for Blackhole {
    fn name(&self) -> &'static str {
        "blackhole"
    }
    fn address(&self) -> Vec<u8> {
        self.inner.address()
    }
    fn limits(&self) -> TransportLimits {
        TransportLimits {
            max_msg_size: 4096,
            ..self.inner.limits()
        }
    }
    fn add_peer(&mut self, a: &[u8]) -> Result<PeerId> {
        self.inner.add_peer(a)
    }
    fn remove_peer(&mut self, p: PeerId) -> Result<()> {
        self.inner.remove_peer(p)?;
        self.removed.insert(p);
        for wr in self.held.remove(&p).unwrap_or_default() {
            self.out.push(Completion {
                wr_id: wr,
                op: OpKind::Write,
                result: Err(OpError::PeerRemoved(p)),
                peer: Some(p),
                imm: None,
            });
        }
        Ok(())
    }
    fn register(&mut self, m: Arc<dyn MemoryRegion>, a: Access) -> Result<Registration> {
        self.inner.register(m, a)
    }
    fn deregister(&mut self, k: LocalKey) -> Result<()> {
        self.inner.deregister(k)
    }
    fn post_send(
        &mut self,
        p: PeerId,
        w: WorkRequestId,
        s: LocalSlice,
        i: Option<u32>,
    ) -> Result<PostOutcome> {
        self.inner.post_send(p, w, s, i)
    }
    fn post_recv(&mut self, w: WorkRequestId, d: LocalSlice) -> Result<PostOutcome> {
        self.inner.post_recv(w, d)
    }
    fn post_write(
        &mut self,
        p: PeerId,
        w: WorkRequestId,
        s: LocalSlice,
        d: RemoteSlice,
        i: Option<u32>,
    ) -> Result<PostOutcome> {
        self.posts += 1;
        if self.no_room_every > 0 && self.posts.is_multiple_of(self.no_room_every) {
            self.reposts_seen.fetch_add(1, Ordering::Relaxed);
            return Ok(PostOutcome::NoRoom);
        }
        if self.swallow {
            if self.removed.contains(&p) {
                return Err(Error::UnknownPeer(p));
            }
            self.held.entry(p).or_default().push(w);
            return Ok(PostOutcome::Posted);
        }
        self.inner.post_write(p, w, s, d, i)
    }
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        let n = self.out.len();
        out.append(&mut self.out);
        Ok(n + self.inner.poll(out)?)
    }
}

#[test]
fn refused_posts_are_deferred_and_retried() {
    let seen = Arc::new(AtomicUsize::new(0));
    let seen2 = seen.clone();
    let a = Engine::spawn(
        move || Ok(Blackhole::new(false, 3, seen2)),
        EngineConfig::default(),
    )
    .unwrap();
    let s = setup(a, mem_engine(), 1 << 20);
    let mut t = Transfer::new(s.peer);
    for i in 0..128u64 {
        t = t.segment(page(&s, i, 127 - i, 8192)); // split in two by the 4096-byte limit
    }
    let stats = s.a.submit(t).unwrap().wait(T).unwrap();
    assert_eq!(stats.ops, 256);
    assert!(seen.load(Ordering::Relaxed) > 50);
    assert_eq!(
        s.a.counters().snapshot().reposts as usize,
        seen.load(Ordering::Relaxed)
    );
    for i in 0..128u64 {
        let d = 127 - i;
        assert_eq!(
            s.src.to_vec(i * 8192, 8192).unwrap(),
            s.dst.to_vec(d * 8192, 8192).unwrap()
        );
    }
}

#[test]
fn transfer_times_out_and_removal_fails_pending_ones() {
    let seen = Arc::new(AtomicUsize::new(0));
    let a = Engine::spawn(
        move || Ok(Blackhole::new(true, 0, seen)),
        EngineConfig::default(),
    )
    .unwrap();
    let s = setup(a, mem_engine(), 65536);
    let h =
        s.a.submit(
            Transfer::new(s.peer)
                .segment(page(&s, 0, 0, 4096))
                .timeout(Duration::from_millis(50)),
        )
        .unwrap();
    // Past its deadline, but the transport still holds its write (it may still read the
    // source): not reported yet, and its region cannot be deregistered.
    assert!(!h.finished_within(Duration::from_millis(300)));
    let e = s.a.deregister(s.s.local).unwrap_err();
    assert!(matches!(e, Error::RegionInUse { transfers: 1, .. }), "{e}");
    // The transport lets go of it (the peer is removed): now it is reported, with the
    // first cause, and the region is the caller's again.
    s.a.remove_peer(s.peer).unwrap();
    let e = h.wait(T).unwrap_err();
    assert!(matches!(e, Error::Op(OpError::TimedOut)), "{e}");
    let peer = s.a.add_peer(&s.b.address()).unwrap();

    let h =
        s.a.submit(Transfer::new(peer).segment(page(&s, 1, 1, 4096)))
            .unwrap();
    assert!(
        matches!(h.wait(Duration::from_millis(30)), Err(Error::TimedOut(..))),
        "nothing completes it yet"
    );
    s.a.remove_peer(peer).unwrap();
    let e = h.wait(T).unwrap_err();
    assert!(matches!(e, Error::Op(OpError::PeerRemoved(_))), "{e}");
    let h =
        s.a.submit(Transfer::new(peer).segment(page(&s, 1, 1, 4096)))
            .unwrap();
    assert!(
        matches!(h.wait(T), Err(Error::Op(OpError::PeerRemoved(_)))),
        "posting to a removed peer fails"
    );
    // Nothing holds the region any more.
    s.a.deregister(s.s.local).unwrap();
}

#[test]
fn shutdown_cancels_pending_transfers() {
    let seen = Arc::new(AtomicUsize::new(0));
    let a = Engine::spawn(
        move || Ok(Blackhole::new(true, 0, seen)),
        EngineConfig::default(),
    )
    .unwrap();
    let s = setup(a, mem_engine(), 65536);
    let h =
        s.a.submit(Transfer::new(s.peer).segment(page(&s, 0, 0, 4096)))
            .unwrap();
    let Setup { a, .. } = s;
    a.shutdown();
    assert!(matches!(h.wait(T), Err(Error::Op(OpError::Cancelled))));
}

#[test]
fn a_failing_transport_constructor_is_reported() {
    let e = Engine::spawn(
        || -> Result<MemTransport> { Err(Error::Unsupported("no such device".into())) },
        EngineConfig::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("no such device"));
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

/// An engine whose idle worker would sleep far longer than any wait below: only a wake-up
/// from the command itself can make these finish in time.
fn sleepy_mem_engine() -> Engine {
    let cfg = EngineConfig {
        idle_wait: Duration::from_secs(600),
        ..EngineConfig::default()
    };
    Engine::spawn(|| Ok(MemTransport::new()), cfg).unwrap()
}

/// Waits (at most 10 s) until both workers sleep in their transports' waits.
fn both_asleep(a: &Engine, b: &Engine) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !(a.is_asleep() && b.is_asleep()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle workers never went to sleep"
        );
        std::thread::yield_now();
    }
}

#[test]
fn commands_wake_a_sleeping_worker() {
    let (a, b) = (sleepy_mem_engine(), sleepy_mem_engine());
    both_asleep(&a, &b);
    let short = Duration::from_secs(5);
    let src = HostBuffer::new_shared(8192).unwrap();
    src.fill(0, 8192, 3).unwrap();
    let dst = HostBuffer::new_shared(8192).unwrap();
    // Control calls wake it too (unwoken, they would time out after 10 s).
    let s = a.register(src, Access::NONE).unwrap();
    let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    for round in 0..3u32 {
        both_asleep(&a, &b);
        let t = Transfer::new(peer)
            .segment(Segment {
                src: s.local,
                src_offset: 0,
                dst: d.remote,
                dst_offset: 4096,
                len: 4096,
            })
            .imm(round);
        a.submit(t).unwrap().wait(short).unwrap();
        // The target's worker sleeps too: the peer's write must wake it for the event.
        assert_eq!(b.next_event(short).unwrap().imm(), Some(round));
    }
    assert_eq!(dst.to_vec(4096, 4096).unwrap(), vec![3; 4096]);
}

#[test]
fn one_write_carries_the_immediate_data_itself() {
    let s = setup(mem_engine(), mem_engine(), 1 << 16);
    let t = Transfer::new(s.peer).segment(page(&s, 1, 2, 4096)).imm(5);
    let stats = s.a.submit(t).unwrap().wait(T).unwrap();
    // No extra zero-length write for the immediate data.
    assert_eq!(stats.ops, 1);
    assert_eq!(stats.bytes, 4096);
    assert_eq!(s.b.next_event(T).unwrap().imm(), Some(5));
    assert_eq!(
        s.dst.to_vec(2 * 4096, 4096).unwrap(),
        s.src.to_vec(4096, 4096).unwrap()
    );
}

#[test]
fn dropping_an_engine_whose_transport_hangs_returns_in_time() {
    let gate = Arc::new(fabric_core::testing::StuckGate::default());
    let g2 = gate.clone();
    let cfg = EngineConfig {
        shutdown_timeout: Duration::from_millis(500),
        ..EngineConfig::default()
    };
    let a = Engine::spawn(
        move || Ok(fabric_core::testing::StuckTransport::new(g2)),
        cfg,
    )
    .unwrap();
    // The worker runs (a control call answers), then its transport hangs in poll.
    a.register(HostBuffer::new_shared(4096).unwrap(), Access::NONE)
        .unwrap();
    gate.shut();
    let t = std::time::Instant::now();
    drop(a);
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "drop took {took:?} with a 500 ms shutdown timeout"
    );
    gate.open();
}
