//! Resource safety of the TCP transport under an [`Engine`]: a soak of many small transfers
//! over loopback that must not grow resident memory or open descriptors, and deregistration
//! of regions while writes into (or out of) them are in flight.
//!
//! `XFER_SOAK_TRANSFERS` sets the soak's length (default 100 000, about a minute at most in
//! a debug build on two cores). The tests of this file take turns (one lock), so that one's
//! descriptors and allocations do not show up in the other's figures.

use fabric_core::engine::{Engine, EngineConfig, Transfer, TransferHandle};
use fabric_core::memory::SubRegion;
use fabric_core::plan::Segment;
use fabric_core::testing::{eventually, pattern};
use fabric_core::{Access, Error, HostBuffer, MemoryRegion, OpError, Registration};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use transport_tcp::{TcpConfig, TcpTransport};

/// The longest any one wait may take.
const WAIT: Duration = Duration::from_secs(20);
const PAGE: u64 = 4096;
/// Pages per transfer; every other page, so that the planner cannot coalesce them.
const PAGES_PER_TRANSFER: u64 = 4;
/// Pages of the source and target regions.
const REGION_PAGES: u64 = 256;
/// Transfers in flight at once.
const WINDOW: usize = 32;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn engine(name: &str) -> Engine {
    let cfg = EngineConfig {
        name: name.into(),
        ..EngineConfig::default()
    };
    Engine::spawn(|| TcpTransport::new(TcpConfig::default()), cfg).expect("start an engine")
}

/// Resident set size in bytes, from /proc/self/statm.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("statm's second field");
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page.max(4096) as u64
}

/// Open file descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("list /proc/self/fd")
        .count()
}

/// Transfer `k`: 4 of every other page, starting at a page that moves with `k`, each to
/// the same offset of the target.
fn transfer(k: u64, peer: fabric_core::PeerId, src: &Registration, dst: &Registration) -> Transfer {
    let first = (k * 2 * PAGES_PER_TRANSFER) % REGION_PAGES;
    let mut t = Transfer::new(peer).timeout(WAIT);
    for p in 0..PAGES_PER_TRANSFER {
        let off = ((first + 2 * p) % REGION_PAGES) * PAGE;
        t = t.segment(Segment {
            src: src.local,
            src_offset: off,
            dst: dst.remote,
            dst_offset: off,
            len: PAGE,
        });
    }
    t
}

fn soak_transfers() -> u64 {
    match std::env::var("XFER_SOAK_TRANSFERS") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("XFER_SOAK_TRANSFERS={v:?} is not a count")),
        Err(_) => 100_000,
    }
}

#[test]
fn soak_keeps_memory_and_descriptors_flat() {
    let _turn = serial();
    let total = soak_transfers();
    let a = engine("soak-a");
    let b = engine("soak-b");
    let len = REGION_PAGES * PAGE;
    let src_buf = HostBuffer::new_shared(len as usize).unwrap();
    src_buf.write(0, &pattern(7, len as usize)).unwrap();
    let dst_buf = HostBuffer::new_shared(len as usize).unwrap();
    let src = a.register(src_buf.clone(), Access::NONE).unwrap();
    let dst = b.register(dst_buf.clone(), Access::REMOTE_WRITE).unwrap();
    let mut peer = a.add_peer(&b.address()).unwrap();
    // Every so often the peer is removed and added again, so that connections close and
    // open under the soak too (and a descriptor leak on either side would show).
    let churn = (total / 20).max(1);
    let mut reconnects = 0;

    let started = Instant::now();
    let mut window: VecDeque<TransferHandle> = VecDeque::with_capacity(WINDOW);
    let mut baseline = None;
    let mut max_rss = 0;
    let mut max_fds = 0;
    for k in 0..total {
        if window.len() == WINDOW {
            let h = window.pop_front().unwrap();
            let s = h
                .wait(WAIT)
                .unwrap_or_else(|e| panic!("transfer failed: {e}"));
            assert_eq!(s.bytes, PAGES_PER_TRANSFER * PAGE);
        }
        if k > 0 && k % churn == 0 {
            for h in window.drain(..) {
                h.wait(WAIT).unwrap();
            }
            a.remove_peer(peer).unwrap();
            peer = a.add_peer(&b.address()).unwrap();
            reconnects += 1;
        }
        window.push_back(a.submit(transfer(k, peer, &src, &dst)).unwrap());
        if k == total / 10 {
            baseline = Some((rss_bytes(), open_fds(), started.elapsed()));
        }
        if k % 1024 == 0 && baseline.is_some() {
            max_rss = max_rss.max(rss_bytes());
            max_fds = max_fds.max(open_fds());
        }
    }
    for h in window {
        h.wait(WAIT).unwrap();
    }
    let elapsed = started.elapsed();
    let (base_rss, base_fds, base_at) = baseline.expect("a 10% mark");
    // The target closes its side of a removed peer's connection when it next polls.
    let settle = Instant::now();
    while open_fds() > base_fds && settle.elapsed() < WAIT {
        std::thread::sleep(Duration::from_millis(5));
    }
    let (end_rss, end_fds) = (rss_bytes(), open_fds());
    let c = a.counters().snapshot();
    println!(
        "soak: {total} transfers of {PAGES_PER_TRANSFER} x {PAGE} B in {elapsed:.2?} \
         ({:.0}/s); rss at 10% ({base_at:.2?}) {} KiB, max {} KiB, end {} KiB; \
         fds at 10% {base_fds}, max {max_fds}, end {end_fds}; {reconnects} reconnections; \
         counters {c:?}",
        total as f64 / elapsed.as_secs_f64(),
        base_rss >> 10,
        max_rss.max(end_rss) >> 10,
        end_rss >> 10,
    );
    assert_eq!(c.transfers, total);
    assert_eq!(c.errors, 0);
    assert_eq!(c.bytes, total * PAGES_PER_TRANSFER * PAGE);
    // Transfers write the even pages only: after a full turn of the region, every even
    // page holds the source's bytes and every odd page is still zero.
    let want = pattern(7, len as usize);
    let got = dst_buf.to_vec(0, len as usize).unwrap();
    let turn = REGION_PAGES / (2 * PAGES_PER_TRANSFER);
    if total >= turn {
        for p in 0..REGION_PAGES {
            let r = (p * PAGE) as usize..((p + 1) * PAGE) as usize;
            if p % 2 == 0 {
                assert!(
                    got[r.clone()] == want[r],
                    "page {p} differs from the source"
                );
            } else {
                assert!(got[r].iter().all(|&x| x == 0), "page {p} was written");
            }
        }
    }
    // A little slack for the allocator's arenas and lazily mapped pages; a leak of even
    // 100 bytes per transfer would be far beyond it.
    let growth = max_rss.max(end_rss).saturating_sub(base_rss);
    assert!(
        growth <= 8 << 20,
        "resident memory grew by {} KiB after the first 10%",
        growth >> 10
    );
    // During the run, a removed peer's connection may still be open at the target for a
    // moment (one per side); at the end, none may remain.
    assert!(
        max_fds <= base_fds + 2,
        "open descriptors grew from {base_fds} to {max_fds} during the run"
    );
    assert!(
        end_fds <= base_fds,
        "open descriptors grew from {base_fds} to {end_fds} by the end"
    );
}

/// Bytes of each region in the deregistration tests, and of each of their transfers.
const DEREG_LEN: u64 = 4 << 20;
const DEREG_TRANSFER: u64 = 256 << 10;
const DEREG_TRANSFERS: u64 = 200;
/// Canary bytes on each side of the target window.
const GUARD: u64 = 4096;
const CANARY: u8 = 0xCA;

/// Transfer `k` of the deregistration tests: 4 segments of 64 KiB of a 256 KiB window.
fn big_transfer(
    k: u64,
    peer: fabric_core::PeerId,
    src: &Registration,
    dst: &Registration,
) -> Transfer {
    let base = (k * DEREG_TRANSFER) % DEREG_LEN;
    let seg = DEREG_TRANSFER / 4;
    let mut t = Transfer::new(peer).timeout(WAIT);
    // Reversed, so that the planner keeps four writes.
    for i in (0..4).rev() {
        t = t.segment(Segment {
            src: src.local,
            src_offset: base + i * seg,
            dst: dst.remote,
            dst_offset: base + i * seg,
            len: seg,
        });
    }
    t
}

/// Deregistration happens once this many transfers of a round have completed (one round
/// each), so that it meets writes at different stages: queued, on the wire, landing.
const DEREG_AFTER: [usize; 4] = [0, 1, 20, 100];

/// Waits for every handle; returns (completed, failed) and checks that each failure is
/// `allowed`.
fn settle(handles: &[TransferHandle], allowed: impl Fn(&OpError) -> bool) -> (usize, usize) {
    let (mut ok, mut failed) = (0, 0);
    for h in handles {
        match h.wait(WAIT) {
            Ok(s) => {
                assert_eq!(s.bytes, DEREG_TRANSFER);
                ok += 1;
            }
            Err(Error::Op(e)) if allowed(&e) => failed += 1,
            Err(e) => panic!("unexpected outcome of a transfer: {e}"),
        }
    }
    (ok, failed)
}

#[test]
fn deregistering_the_target_with_writes_in_flight() {
    let _turn = serial();
    let a = engine("dereg-t-a");
    let b = engine("dereg-t-b");
    let src_buf = HostBuffer::new_shared(DEREG_LEN as usize).unwrap();
    src_buf.write(0, &pattern(11, DEREG_LEN as usize)).unwrap();
    let src = a.register(src_buf.clone(), Access::NONE).unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    for after in DEREG_AFTER {
        // The target window, with canary bytes around it; the test keeps only a weak
        // reference to the window itself, so that the transport's is the last one.
        let outer = HostBuffer::new_shared((DEREG_LEN + 2 * GUARD) as usize).unwrap();
        outer.fill(0, DEREG_LEN + 2 * GUARD, CANARY).unwrap();
        let window: Arc<dyn MemoryRegion> =
            Arc::new(SubRegion::new(outer.clone(), GUARD, DEREG_LEN).unwrap());
        let weak = Arc::downgrade(&window);
        let dst = b.register(window, Access::REMOTE_WRITE).unwrap();

        let handles: Vec<_> = (0..DEREG_TRANSFERS)
            .map(|k| a.submit(big_transfer(k, peer, &src, &dst)).unwrap())
            .collect();
        if after > 0 {
            handles[after - 1].wait(WAIT).unwrap();
        }
        b.deregister(dst.local).unwrap();
        let (ok, failed) = settle(&handles, |e| matches!(e, OpError::RemoteKeyInvalid(_)));
        println!(
            "target deregistered after {after} completions: {ok} transfers completed, \
             {failed} failed with RemoteKeyInvalid"
        );
        // Later writes fail: the key died with the registration.
        let late = a
            .submit(big_transfer(1, peer, &src, &dst))
            .unwrap()
            .wait(WAIT);
        assert!(
            matches!(late, Err(Error::Op(OpError::RemoteKeyInvalid(_)))),
            "a write after deregistration: {late:?}"
        );
        // Nothing landed outside the window, and the transport let go of it.
        let before = outer.to_vec(0, GUARD as usize).unwrap();
        assert!(
            before.iter().all(|&x| x == CANARY),
            "canary before the window"
        );
        let behind = outer.to_vec(GUARD + DEREG_LEN, GUARD as usize).unwrap();
        assert!(
            behind.iter().all(|&x| x == CANARY),
            "canary after the window"
        );
        eventually("the target transport to drop the region", WAIT, || {
            weak.upgrade().is_none()
        });
    }
    // The engines still work.
    let dst = b
        .register(
            HostBuffer::new_shared(DEREG_LEN as usize).unwrap(),
            Access::REMOTE_WRITE,
        )
        .unwrap();
    a.submit(big_transfer(2, peer, &src, &dst))
        .unwrap()
        .wait(WAIT)
        .unwrap();
}

#[test]
fn deregistering_the_source_with_writes_in_flight() {
    let _turn = serial();
    let a = engine("dereg-s-a");
    let b = engine("dereg-s-b");
    let dst_buf = HostBuffer::new_shared(DEREG_LEN as usize).unwrap();
    let dst = b.register(dst_buf.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    for (round, after) in DEREG_AFTER.into_iter().enumerate() {
        let data = pattern(13 + round as u64, DEREG_LEN as usize);
        let src_buf = HostBuffer::new_shared(DEREG_LEN as usize).unwrap();
        src_buf.write(0, &data).unwrap();
        let weak = Arc::downgrade(&src_buf);
        let src = a.register(src_buf, Access::NONE).unwrap();
        dst_buf.fill(0, DEREG_LEN, 0).unwrap();

        let handles: Vec<_> = (0..DEREG_TRANSFERS)
            .map(|k| a.submit(big_transfer(k, peer, &src, &dst)).unwrap())
            .collect();
        if after > 0 {
            handles[after - 1].wait(WAIT).unwrap();
        }
        // The engine never deregisters under transfers that still read the region: it
        // refuses until they have finished (each one's handle says when).
        let first = a.deregister(src.local);
        match &first {
            Err(Error::RegionInUse { key, transfers }) => {
                assert_eq!(*key, src.local);
                assert!(*transfers >= 1);
            }
            Ok(()) => {}
            Err(e) => panic!("deregistration with transfers in flight: {e}"),
        }
        let (ok, failed) = settle(&handles, |_| false);
        assert_eq!((ok, failed), (DEREG_TRANSFERS as usize, 0));
        if first.is_err() {
            a.deregister(src.local).unwrap();
        }
        println!(
            "source deregistration after {after} completions: {}; {ok} transfers completed",
            if first.is_err() {
                "refused, then done"
            } else {
                "done at once"
            }
        );
        // What was sent is the source's bytes, read while the transport still held them.
        let got = dst_buf.to_vec(0, DEREG_LEN as usize).unwrap();
        for (i, (g, w)) in got.chunks(4096).zip(data.chunks(4096)).enumerate() {
            assert!(
                g == w || g.iter().all(|&x| x == 0),
                "page {i} holds other bytes"
            );
        }
        // A new transfer from the dead key fails before anything moves.
        let late = a.submit(big_transfer(1, peer, &src, &dst));
        assert!(
            matches!(late, Err(Error::Op(OpError::LocalKeyInvalid(_)))),
            "a transfer after deregistration: {:?}",
            late.map(|_| ())
        );
        eventually("the initiator's transport to drop the region", WAIT, || {
            weak.upgrade().is_none()
        });
    }
}
