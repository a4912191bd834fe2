//! Faults between two engines over TCP that this kernel cannot make (no netem), made by a
//! userspace proxy on the initiator's path (`proxy/mod.rs`): delay with jitter, a
//! connection cut in the middle of a frame, reads stalled for 5 s, a flipped payload byte.
//! In each, a transfer completes with every byte verified, or fails with a typed error
//! within its timeout; nothing hangs; and no byte of the target outside the ranges written
//! changes (the region is filled with a marker first, and guard bytes surround it).
//!
//! `cargo test -p transport-tcp --test proxy_faults -- --nocapture` prints the timings.

mod proxy;

use fabric_core::engine::{Engine, EngineConfig, Transfer, TransferStats};
use fabric_core::plan::Segment;
use fabric_core::stats::PeerState;
use fabric_core::testing::pattern;
use fabric_core::{Access, Error, HostBuffer, OpError, Registration, SubRegion};
use proxy::{Faults, Proxy};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport_tcp::{TcpConfig, TcpTransport};

/// The target's pages.
const PAGES: u64 = 64;
const PAGE: u64 = 64 << 10;
const REGION: u64 = PAGES * PAGE;
/// Bytes on each side of the target region that nothing may write.
const GUARD: u64 = 4096;
/// What the target's memory holds before anything is written.
const FILL: u8 = 0xEE;
/// What a loaded machine may add to a timeout before the failure is reported.
const SLACK: Duration = Duration::from_secs(4);

/// An initiator, a target, their regions, and the initiator's peer: the target reached
/// through `proxy`.
struct Setup {
    a: Engine,
    b: Engine,
    src: Arc<HostBuffer>,
    /// The target's whole buffer: guard, region, guard.
    dst: Arc<HostBuffer>,
    s: Registration,
    d: Registration,
    proxy: Proxy,
}

fn engine(cfg: TcpConfig, name: &str) -> Engine {
    Engine::spawn(
        move || TcpTransport::new(cfg),
        EngineConfig {
            name: name.into(),
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

/// Engines whose connections are set up and judged alive within `peer_timeout` (both
/// the transport's `peer_timeout` and its `liveness_timeout`).
fn setup(peer_timeout: Duration, faults: Faults) -> (Setup, fabric_core::PeerId) {
    setup_with(
        TcpConfig {
            peer_timeout,
            liveness_timeout: peer_timeout,
            ..TcpConfig::default()
        },
        faults,
    )
}

/// As [`setup`], both transports with `cfg`.
fn setup_with(cfg: TcpConfig, faults: Faults) -> (Setup, fabric_core::PeerId) {
    let a = engine(cfg.clone(), "initiator");
    let b = engine(cfg, "target");
    let src = HostBuffer::new_shared(REGION as usize).unwrap();
    src.write(0, &pattern(7, REGION as usize)).unwrap();
    let dst = HostBuffer::new_shared((REGION + 2 * GUARD) as usize).unwrap();
    dst.fill(0, REGION + 2 * GUARD, FILL).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let window = SubRegion::new(dst.clone(), GUARD, REGION).unwrap();
    let d = b.register(Arc::new(window), Access::REMOTE_WRITE).unwrap();
    let target = TcpTransport::parse_address(&b.address()).unwrap();
    let proxy = Proxy::start(target, faults);
    let peer = a
        .add_peer(&proxy.transport_address())
        .expect("peer via the proxy");
    (
        Setup {
            a,
            b,
            src,
            dst,
            s,
            d,
            proxy,
        },
        peer,
    )
}

impl Setup {
    /// A transfer of source pages `pages` to the same pages of the target.
    fn transfer(&self, peer: fabric_core::PeerId, pages: &[u64], timeout: Duration) -> Transfer {
        let mut t = Transfer::new(peer).timeout(timeout);
        for &p in pages {
            t = t.segment(Segment {
                src: self.s.local,
                src_offset: p * PAGE,
                dst: self.d.remote,
                dst_offset: p * PAGE,
                len: PAGE,
            });
        }
        t
    }

    /// Writes `pages` (a 60 s transfer, waited for up to 60 s) and times it.
    fn timed_write(
        &self,
        peer: fabric_core::PeerId,
        pages: &[u64],
    ) -> (Result<TransferStats, Error>, Duration) {
        let started = Instant::now();
        let r = self
            .a
            .submit(self.transfer(peer, pages, Duration::from_secs(60)))
            .unwrap()
            .wait(Duration::from_secs(60));
        (r, started.elapsed())
    }

    /// The target's page `p`.
    fn page(&self, p: u64) -> Vec<u8> {
        self.dst.to_vec(GUARD + p * PAGE, PAGE as usize).unwrap()
    }

    /// Every page written (in `done`) holds the source's bytes, every page of `touched`
    /// (written or being written when a fault struck) holds whatever it may, every other
    /// page and both guards still the marker.
    fn check(&self, done: &BTreeSet<u64>, touched: &BTreeSet<u64>) {
        for p in 0..PAGES {
            let got = self.page(p);
            if done.contains(&p) {
                let want = self.src.to_vec(p * PAGE, PAGE as usize).unwrap();
                assert!(got == want, "page {p} was written but differs");
            } else if !touched.contains(&p) {
                assert!(
                    got.iter().all(|&b| b == FILL),
                    "page {p} was never written but changed"
                );
            }
        }
        let before = self.dst.to_vec(0, GUARD as usize).unwrap();
        let after = self.dst.to_vec(GUARD + REGION, GUARD as usize).unwrap();
        assert!(
            before.iter().chain(&after).all(|&b| b == FILL),
            "bytes outside the region changed"
        );
    }
}

/// Non-adjacent pages (so that each is its own write): `count` of them from `first`, every
/// other page.
fn pages(first: u64, count: u64) -> Vec<u64> {
    (0..count).map(|i| (first + 2 * i) % PAGES).collect()
}

/// How a failed transfer failed: a typed error of the peer's connection, or a timeout.
fn assert_typed_failure(r: &fabric_core::Result<TransferStats>, what: &str) {
    match r {
        Err(Error::Op(OpError::PeerUnreachable { reason, .. })) => {
            println!("{what}: PeerUnreachable: {reason}");
        }
        Err(Error::Op(OpError::TimedOut)) => println!("{what}: TimedOut"),
        other => panic!("{what}: expected a typed failure of the peer, got {other:?}"),
    }
}

#[test]
fn delay_with_jitter_slows_transfers_and_every_byte_lands() {
    let (s, peer) = setup(
        Duration::from_secs(5),
        Faults {
            delay: Duration::from_millis(2),
            jitter: Duration::from_millis(1),
            ..Faults::default()
        },
    );
    let mut done = BTreeSet::new();
    let mut latencies = Vec::new();
    // Rounds of 4 transfers in flight, 4 pages each (16 apart), every page in the end.
    for round in 0..4u64 {
        let started = Instant::now();
        let handles: Vec<_> = (0..4u64)
            .map(|k| {
                let ps: Vec<u64> = (0..4).map(|i| round * 4 + k + 16 * i).collect();
                let t = s.transfer(peer, &ps, Duration::from_secs(30));
                (ps, s.a.submit(t).unwrap())
            })
            .collect();
        for (ps, h) in handles {
            h.wait(Duration::from_secs(40))
                .expect("a delayed transfer completes");
            latencies.push(started.elapsed());
            done.extend(ps);
        }
    }
    assert_eq!(done.len() as u64, PAGES);
    s.check(&done, &done);
    latencies.sort();
    println!("delay 2 ms ± 1 ms: transfer latencies {latencies:?}");
    // Each transfer waits for its bytes to cross the proxy and the answer to come back:
    // at least a millisecond each way.
    assert!(
        latencies[0] >= Duration::from_millis(2),
        "the delay applied: {latencies:?}"
    );
    assert!(
        s.proxy
            .seen
            .upstream_bytes
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0
    );
}

#[test]
fn a_cut_in_the_middle_of_a_frame_fails_the_transfer_typed_and_in_time() {
    let peer_timeout = Duration::from_secs(5);
    // The HELLO (its header, rail, instance and address), a BATCH header and up to 8 WRITE
    // headers, then 30 000 bytes: inside the first 64 KiB payload whatever the batching
    // (it starts 80 to 360 bytes after the HELLO).
    let cut = hello_bytes() + 40 + 8 * 40 + 30_000;
    let (s, peer) = setup(
        peer_timeout,
        Faults {
            cut_after: Some(cut),
            ..Faults::default()
        },
    );
    let ps = pages(1, 8);
    let (r, took) = s.timed_write(peer, &ps);
    println!("cut after {cut} bytes: failed in {took:?}");
    assert_typed_failure(&r, "cut mid-frame");
    assert!(took < peer_timeout + SLACK, "took {took:?}");
    assert!(s.proxy.seen.cut.load(std::sync::atomic::Ordering::SeqCst));
    assert_eq!(
        s.proxy
            .seen
            .upstream_bytes
            .load(std::sync::atomic::Ordering::SeqCst),
        cut,
        "exactly the bytes before the cut reached the target"
    );
    // The target dropped the half frame: its bytes may be in their pages, no others.
    s.proxy.wait_for(
        Duration::from_secs(20),
        "the cut connection to close",
        |seen| seen.closed.load(std::sync::atomic::Ordering::SeqCst) == 1,
    );
    let touched: BTreeSet<u64> = ps.iter().copied().collect();
    s.check(&BTreeSet::new(), &touched);
    // The target saw its peer close, with why, and serves others as before.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let peers = s.b.stats().transport.unwrap().peers;
        if peers
            .iter()
            .any(|p| p.state == PeerState::Closed && p.last_error.is_some())
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the target never saw the cut: {peers:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let direct = s.a.add_peer(&s.b.address()).expect("a direct peer");
    let again = pages(1, 8);
    s.a.submit(s.transfer(direct, &again, Duration::from_secs(30)))
        .unwrap()
        .wait(Duration::from_secs(40))
        .expect("the target still takes writes");
    let done: BTreeSet<u64> = again.into_iter().collect();
    s.check(&done, &done);
}

#[test]
fn a_5s_stall_within_the_peer_timeout_completes_verified() {
    let (s, peer) = setup(
        Duration::from_secs(15),
        Faults {
            stall: Some((300_000, Duration::from_secs(5))),
            ..Faults::default()
        },
    );
    let ps = pages(0, 32);
    let (r, took) = s.timed_write(peer, &ps);
    r.expect("the stalled transfer completes");
    println!("stall 5 s, peer_timeout 15 s: completed in {took:?}");
    assert!(
        s.proxy
            .seen
            .stall_over
            .load(std::sync::atomic::Ordering::SeqCst)
    );
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(5) + SLACK,
        "took {took:?}"
    );
    let done: BTreeSet<u64> = ps.into_iter().collect();
    s.check(&done, &done);
}

#[test]
fn a_5s_stall_beyond_the_peer_timeout_fails_typed_before_it_ends() {
    let peer_timeout = Duration::from_secs(1);
    let (s, peer) = setup(
        peer_timeout,
        Faults {
            stall: Some((300_000, Duration::from_secs(5))),
            ..Faults::default()
        },
    );
    let ps = pages(0, 32);
    let (r, took) = s.timed_write(peer, &ps);
    println!("stall 5 s, peer_timeout 1 s: failed in {took:?}");
    assert_typed_failure(&r, "stall beyond the peer timeout");
    // A peer that takes bytes but never answers fails after its liveness timeout.
    assert!(took < peer_timeout + SLACK, "took {took:?}");
    // Once the proxy has let the rest through and closed, nothing outside the pages of the
    // transfer changed.
    s.proxy.wait_for(
        Duration::from_secs(30),
        "the stalled connection to close",
        |seen| seen.closed.load(std::sync::atomic::Ordering::SeqCst) == 1,
    );
    let touched: BTreeSet<u64> = ps.into_iter().collect();
    s.check(&BTreeSet::new(), &touched);
}

/// The offset, in the initiator's stream, of byte `at` of the payload of a transfer's only
/// WRITE: after the HELLO, a BATCH header and the WRITE's header.
fn in_first_payload(at: u64) -> u64 {
    hello_bytes() + 2 * 40 + at
}

/// The bytes of an initiator's HELLO (header, fixed fields and its address, whose length a
/// probe engine's tells).
fn hello_bytes() -> u64 {
    let probe = engine(TcpConfig::default(), "probe");
    40 + 12 + probe.address().len() as u64
}

#[test]
fn a_flipped_payload_byte_is_refused_with_checksums_and_written_without() {
    for checksum in [true, false] {
        let (s, peer) = setup_with(
            TcpConfig {
                checksum,
                ..TcpConfig::default()
            },
            Faults {
                flip_at: Some(in_first_payload(1000)),
                ..Faults::default()
            },
        );
        let page = 5;
        let r =
            s.a.submit(s.transfer(peer, &[page], Duration::from_secs(30)))
                .unwrap()
                .wait(Duration::from_secs(40));
        assert!(
            s.proxy
                .seen
                .flipped
                .load(std::sync::atomic::Ordering::SeqCst)
        );
        let got = s.page(page);
        let want = s.src.to_vec(page * PAGE, PAGE as usize).unwrap();
        let target = s.b.stats().transport.unwrap();
        if checksum {
            // Detected, not written: the page still holds the marker.
            assert!(
                matches!(r, Err(Error::Op(OpError::ChecksumMismatch))),
                "with checksums: {r:?}"
            );
            assert!(
                got.iter().all(|&b| b == FILL),
                "a corrupted payload was placed"
            );
            assert_eq!(target.checksum_mismatches, 1);
            assert_eq!(target.received_bytes, 0);
            // The connection stays; the same write again (the proxy flips once) lands.
            s.a.submit(s.transfer(peer, &[page], Duration::from_secs(30)))
                .unwrap()
                .wait(Duration::from_secs(40))
                .expect("the write sent again lands");
            let done = BTreeSet::from([page]);
            s.check(&done, &done);
        } else {
            // Without them, the corruption lands unnoticed: one byte differs.
            r.expect("without checksums the write succeeds");
            let differ: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
            // One byte differs, near byte 1000 of the page: where the flip lands in the
            // payload shifts with what precedes it in the stream (the address's length in
            // the HELLO, a header more when the sender splits its batch under load).
            assert_eq!(differ.len(), 1, "exactly one byte differs: {differ:?}");
            assert!(
                (900..1100).contains(&differ[0]),
                "the flipped byte is near byte 1000 of the page: {differ:?}"
            );
            assert_eq!(target.checksum_mismatches, 0);
            let done = BTreeSet::new();
            s.check(&done, &BTreeSet::from([page]));
        }
    }
}

#[test]
fn checksummed_writes_land_verified_in_batches_and_up_to_the_largest() {
    let (s, peer) = setup_with(
        TcpConfig {
            checksum: true,
            ..TcpConfig::default()
        },
        Faults::default(),
    );
    // The engine plans writes no longer than the target holds whole.
    assert_eq!(
        s.a.limits().max_msg_size,
        transport_tcp::frame::CHECKSUM_MAX_LEN
    );
    // 32 scattered writes of odd lengths in one transfer: one BATCH whose payloads are
    // each followed by their checksum.
    let lens: Vec<u64> = (0..32).map(|i| 1 + i * 2047).collect();
    let mut t = Transfer::new(peer).timeout(Duration::from_secs(30));
    for (i, &len) in lens.iter().enumerate() {
        let p = 2 * i as u64;
        t = t.segment(Segment {
            src: s.s.local,
            src_offset: p * PAGE,
            dst: s.d.remote,
            dst_offset: p * PAGE,
            len,
        });
    }
    s.a.submit(t)
        .unwrap()
        .wait(Duration::from_secs(40))
        .unwrap();
    for (i, &len) in lens.iter().enumerate() {
        let p = 2 * i as u64;
        let got = s.page(p);
        let want = s.src.to_vec(p * PAGE, len as usize).unwrap();
        assert!(got[..len as usize] == want[..], "page {p}");
        assert!(
            got[len as usize..].iter().all(|&b| b == FILL),
            "page {p} tail"
        );
    }
    // The whole region in one segment: one write of the largest checksummed size.
    let t = Transfer::new(peer)
        .timeout(Duration::from_secs(30))
        .segment(Segment {
            src: s.s.local,
            src_offset: 0,
            dst: s.d.remote,
            dst_offset: 0,
            len: REGION,
        });
    let stats =
        s.a.submit(t)
            .unwrap()
            .wait(Duration::from_secs(40))
            .unwrap();
    assert_eq!(stats.ops, 1);
    let done: BTreeSet<u64> = (0..PAGES).collect();
    s.check(&done, &done);
    let target = s.b.stats().transport.unwrap();
    assert_eq!(target.received_bytes, REGION + lens.iter().sum::<u64>());
    assert_eq!(target.checksum_mismatches, 0);
}
