//! The path for memory the CPU cannot address (GPU memory), exercised without a GPU: a fake
//! device region that only copies, and counts how the transport asks it to.

mod common;

use fabric_core::testing::{Pair, SuiteOptions, pattern};
use fabric_core::{
    Access, Completion, HostBuffer, LocalSlice, MemoryError, MemoryLocation, MemoryRegion, OpError,
    OpKind, PeerId, RemoteSlice, Transport, WorkRequestId,
};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use transport_tcp::{DEVICE_STAGING_BYTES, TcpConfig, TcpTransport};

/// Host bytes behind a region that offers no host pointer, like device memory.
struct FakeDevice {
    inner: HostBuffer,
    single: AtomicUsize,
    batched: AtomicUsize,
    /// Most bytes moved by one batched call.
    most: AtomicUsize,
    /// Copies touching bytes at or past this offset fail.
    fail_from: AtomicU64,
}

impl FakeDevice {
    fn new(len: usize) -> Arc<FakeDevice> {
        Arc::new(FakeDevice {
            inner: HostBuffer::new(len).unwrap(),
            single: AtomicUsize::new(0),
            batched: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
            fail_from: AtomicU64::new(u64::MAX),
        })
    }

    /// Counts a batched call of `parts`, or fails it when it touches the broken range.
    fn batch(&self, parts: impl Iterator<Item = (u64, usize)>) -> Result<(), MemoryError> {
        self.batched.fetch_add(1, Ordering::Relaxed);
        let fail_from = self.fail_from.load(Ordering::Relaxed);
        let mut total = 0;
        for (offset, len) in parts {
            if offset + len as u64 > fail_from {
                return Err(MemoryError::device("uncorrectable ECC error"));
            }
            total += len;
        }
        self.most.fetch_max(total, Ordering::Relaxed);
        Ok(())
    }
}

// SAFETY: no host pointer is offered; every access goes through the copy methods, which
// bound-check against the inner buffer.
unsafe impl MemoryRegion for FakeDevice {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Cuda { device: 0 }
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }
    fn device_addr(&self) -> u64 {
        0x7000_0000_0000
    }
    fn read_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.single.fetch_add(1, Ordering::Relaxed);
        self.inner.read(offset, dst)
    }
    fn write_from_host(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.single.fetch_add(1, Ordering::Relaxed);
        self.inner.write(offset, src)
    }
    fn read_many_to_host(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), MemoryError> {
        self.batch(parts.iter().map(|(o, d)| (*o, d.len())))?;
        parts
            .iter_mut()
            .try_for_each(|(o, d)| self.inner.read(*o, d))
    }
    fn write_many_from_host(&self, parts: &[(u64, &[u8])]) -> Result<(), MemoryError> {
        self.batch(parts.iter().map(|(o, s)| (*o, s.len())))?;
        parts.iter().try_for_each(|(o, s)| self.inner.write(*o, s))
    }
}

#[test]
fn device_pages_move_in_batches_and_land_before_their_imm() {
    let make = || TcpTransport::new(TcpConfig::default()).unwrap();
    let mut p = Pair::new(&make, SuiteOptions::default());
    let (page, n) = (16384u64, 128u64);
    let src = FakeDevice::new((page * n) as usize);
    let dst = FakeDevice::new((page * n) as usize);
    common::scattered_pages(&mut p, src.clone(), dst.clone(), page, n, 53);
    assert_eq!(
        src.single.load(Ordering::Relaxed),
        0,
        "the source is read in batches only"
    );
    assert_eq!(
        dst.single.load(Ordering::Relaxed),
        0,
        "the target is written in batches only"
    );
    // One batched call each for the test's own fill and check; the rest are the transport's.
    let (rb, wb) = (
        src.batched.load(Ordering::Relaxed) - 1,
        dst.batched.load(Ordering::Relaxed) - 1,
    );
    assert!(
        rb >= 1 && rb < n as usize / 4,
        "{rb} batched reads for {n} pages"
    );
    assert!(
        wb >= 1 && wb < n as usize,
        "{wb} batched writes for {n} pages"
    );
}

#[test]
fn a_failed_device_copy_fails_the_connection_not_the_process() {
    struct Broken;
    // SAFETY: no host pointer is offered and every copy fails.
    unsafe impl MemoryRegion for Broken {
        fn len(&self) -> usize {
            1 << 20
        }
        fn location(&self) -> MemoryLocation {
            MemoryLocation::Cuda { device: 0 }
        }
        fn host_ptr(&self) -> Option<NonNull<u8>> {
            None
        }
        fn device_addr(&self) -> u64 {
            0
        }
        fn read_to_host(&self, _: u64, _: &mut [u8]) -> Result<(), MemoryError> {
            Err(MemoryError::device("the device fell off the bus"))
        }
        fn write_from_host(&self, _: u64, _: &[u8]) -> Result<(), MemoryError> {
            Err(MemoryError::device("the device fell off the bus"))
        }
    }
    let make = || TcpTransport::new(TcpConfig::default()).unwrap();
    let mut p = Pair::new(&make, SuiteOptions::default());
    let good = FakeDevice::new(1 << 20);
    let s = p.a.register(good, Access::NONE).unwrap();
    let d =
        p.b.register(Arc::new(Broken), Access::REMOTE_WRITE)
            .unwrap();
    let c = p.write_once(
        LocalSlice {
            key: s.local,
            offset: 0,
            len: 4096,
        },
        RemoteSlice {
            region: d.remote,
            offset: 0,
            len: 4096,
        },
        Some(1),
    );
    assert!(
        c.result.is_err(),
        "a write the target could not place must fail: {c:?}"
    );
    assert!(
        p.done_b.iter().all(|c| c.op != OpKind::RemoteWrite),
        "no imm for bytes that did not land"
    );
}

#[test]
fn a_device_write_larger_than_a_read_chunk_lands_whole() {
    let make = || TcpTransport::new(TcpConfig::default()).unwrap();
    let mut p = Pair::new(&make, SuiteOptions::default());
    let len = (5 << 20) + 333;
    let data = pattern(21, len);
    let src = FakeDevice::new(len);
    src.inner.write(0, &data).unwrap();
    let dst = FakeDevice::new(len + 4096);
    let s = p.a.register(src, Access::NONE).unwrap();
    let d = p.b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let c = p.write_once(
        LocalSlice {
            key: s.local,
            offset: 0,
            len: len as u64,
        },
        RemoteSlice {
            region: d.remote,
            offset: 4096,
            len: len as u64,
        },
        Some(2),
    );
    assert_eq!(c.result, Ok(len as u64));
    let ev = p.take_b(1, "imm").remove(0);
    assert_eq!(ev.imm, Some(2));
    assert!(dst.inner.to_vec(4096, len).unwrap() == data, "bytes differ");
    assert_eq!(
        dst.inner.to_vec(0, 4096).unwrap(),
        vec![0; 4096],
        "bytes before the write"
    );
}

const PAGE: u64 = 64 << 10;

fn pair(rails: usize) -> Pair<TcpTransport> {
    let make = move || {
        TcpTransport::new(TcpConfig {
            rails,
            ..TcpConfig::default()
        })
        .unwrap()
    };
    Pair::new(&make, SuiteOptions::default())
}

/// Registers `src` (filled with a pattern) at a and `dst` at b, and posts `n` pages from
/// page i of `src` to page `(i * 37) % n` of `dst`, wr_id i, the last with imm 99. All are
/// posted before either side polls. Returns the pattern.
fn post_pages(
    p: &mut Pair<TcpTransport>,
    peer: PeerId,
    src: &Arc<FakeDevice>,
    dst: Arc<dyn MemoryRegion>,
    n: u64,
) -> Vec<u8> {
    let data = pattern(5, (PAGE * n) as usize);
    src.inner.write(0, &data).unwrap();
    let s = p.a.register(src.clone(), Access::NONE).unwrap();
    let d = p.b.register(dst, Access::REMOTE_WRITE).unwrap();
    for i in 0..n {
        let imm = (i == n - 1).then_some(99);
        let (src_slice, dst_slice) = (
            LocalSlice {
                key: s.local,
                offset: i * PAGE,
                len: PAGE,
            },
            RemoteSlice {
                region: d.remote,
                offset: (i * 37 % n) * PAGE,
                len: PAGE,
            },
        );
        let posted =
            p.a.post_write(peer, WorkRequestId(i), src_slice, dst_slice, imm)
                .unwrap();
        assert_eq!(posted, fabric_core::PostOutcome::Posted);
    }
    data
}

/// Whether page i of `data` is at its place in `dst`.
fn landed(dst: &FakeDevice, data: &[u8], n: u64, i: u64) -> bool {
    let at = (i * 37 % n) * PAGE;
    let want = &data[(i * PAGE) as usize..((i + 1) * PAGE) as usize];
    dst.inner.to_vec(at, PAGE as usize).unwrap() == want
}

#[test]
fn pages_larger_than_the_staging_ring_stream_through_it_in_bounded_chunks() {
    let mut p = pair(1);
    let n = 4 * (DEVICE_STAGING_BYTES as u64 / PAGE); // four rings' worth, all queued at once
    let src = FakeDevice::new((PAGE * n) as usize);
    let dst = FakeDevice::new((PAGE * n) as usize);
    let peer = p.b_at_a;
    let data = post_pages(&mut p, peer, &src, dst.clone(), n);
    let done = p.take_a(n as usize, "write completions");
    assert!(done.iter().all(|c| c.result == Ok(PAGE)), "{done:?}");
    let ev = p.take_b(1, "imm").remove(0);
    assert_eq!((ev.op, ev.imm), (OpKind::RemoteWrite, Some(99)));
    assert!((0..n).all(|i| landed(&dst, &data, n, i)), "bytes differ");
    for (side, d) in [("source", &src), ("target", &dst)] {
        let most = d.most.load(Ordering::Relaxed);
        assert!(
            most <= DEVICE_STAGING_BYTES,
            "the {side} copied {most} bytes at once: staging is not bounded"
        );
        let calls = d.batched.load(Ordering::Relaxed);
        assert!(
            calls >= 4 && calls <= n as usize / 4,
            "the {side} made {calls} batched copies for {n} pages"
        );
    }
}

#[test]
fn imm_data_follows_its_bytes_and_keeps_post_order() {
    let mut p = pair(1);
    let peer = p.b_at_a;
    let big = 3 << 20;
    let (dsrc, ddst) = (FakeDevice::new(big), FakeDevice::new(big));
    let (hsrc, hdst) = (
        HostBuffer::new_shared(1 << 20).unwrap(),
        HostBuffer::new_shared(1 << 20).unwrap(),
    );
    let (ddata, hdata) = (pattern(7, big), pattern(8, 1 << 20));
    dsrc.inner.write(0, &ddata).unwrap();
    hsrc.write(0, &hdata).unwrap();
    let ds = p.a.register(dsrc, Access::NONE).unwrap();
    let dd = p.b.register(ddst.clone(), Access::REMOTE_WRITE).unwrap();
    let hs = p.a.register(hsrc, Access::NONE).unwrap();
    let hd = p.b.register(hdst.clone(), Access::REMOTE_WRITE).unwrap();
    // (device?, offset, len): device and host writes alternate on one connection.
    let writes = [
        (true, 0u64, big as u64 - PAGE),
        (false, 0, 4096),
        (true, big as u64 - PAGE, PAGE),
        (false, 4096, (1 << 20) - 4096),
        (true, 0, 0),
        (false, 0, 0),
    ];
    for (i, &(device, offset, len)) in writes.iter().enumerate() {
        let (s, d) = if device { (&ds, &dd) } else { (&hs, &hd) };
        let src = LocalSlice {
            key: s.local,
            offset,
            len,
        };
        let dst = RemoteSlice {
            region: d.remote,
            offset,
            len,
        };
        p.post_a(|t| t.post_write(peer, WorkRequestId(i as u64), src, dst, Some(i as u32)));
    }
    // Each event is checked the moment it appears: its bytes must already be in place.
    let mut seen = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while seen < writes.len() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out: {seen} events"
        );
        p.step();
        let events: Vec<Completion> = p.done_b.drain(..).collect();
        for ev in events {
            assert_eq!(ev.op, OpKind::RemoteWrite);
            assert_eq!(ev.imm, Some(seen as u32), "events out of post order");
            let (device, offset, len) = writes[seen];
            let (o, l) = (offset as usize, len as usize);
            if device {
                assert!(
                    ddst.inner.to_vec(offset, l).unwrap() == ddata[o..o + l],
                    "imm {seen} reported before its device bytes landed"
                );
            } else {
                assert!(hdst.to_vec(offset, l).unwrap() == hdata[o..o + l]);
            }
            seen += 1;
        }
    }
    let done = p.take_a(writes.len(), "write completions");
    assert!(
        done.iter()
            .enumerate()
            .all(|(i, c)| c.wr_id == WorkRequestId(i as u64) && c.result.is_ok()),
        "{done:?}"
    );
}

/// Copies of `n` pages where those past `fail_from` fail, on the source (`on_source`) or
/// the target: every write completes, none past the failure succeeds, each that succeeds
/// landed, and the target reports no imm for the last page.
fn copy_fails_mid_pipeline(on_source: bool) {
    let mut p = pair(1);
    let n = 3 * (DEVICE_STAGING_BYTES as u64 / PAGE);
    let src = FakeDevice::new((PAGE * n) as usize);
    let dst = FakeDevice::new((PAGE * n) as usize);
    let fail_from = n / 2 * PAGE;
    if on_source {
        src.fail_from.store(fail_from, Ordering::Relaxed);
    } else {
        dst.fail_from.store(fail_from, Ordering::Relaxed);
    }
    let peer = p.b_at_a;
    let data = post_pages(&mut p, peer, &src, dst.clone(), n);
    let done = p.take_a(n as usize, "every write's completion");
    let mut ok = 0;
    for c in &done {
        let i = c.wr_id.0;
        // The target's failing page of write i is (i * 37 % n).
        let failing = if on_source {
            i * PAGE >= fail_from
        } else {
            (i * 37 % n) * PAGE >= fail_from
        };
        match &c.result {
            Ok(_) => {
                assert!(!failing, "write {i} succeeded although its copy failed");
                assert!(
                    landed(&dst, &data, n, i),
                    "write {i} reported but not landed"
                );
                ok += 1;
            }
            Err(e) => assert!(matches!(e, OpError::PeerUnreachable { .. }), "{e:?}"),
        }
    }
    assert!(ok < n, "some writes must fail");
    assert!(
        p.done_b.iter().all(|c| c.imm != Some(99)),
        "imm reported for bytes that did not land"
    );
}

#[test]
fn a_source_copy_that_fails_mid_pipeline_fails_the_writes_not_the_process() {
    copy_fails_mid_pipeline(true);
}

#[test]
fn a_target_copy_that_fails_mid_pipeline_fails_the_writes_not_the_process() {
    copy_fails_mid_pipeline(false);
}

#[test]
fn removing_a_peer_with_chunks_in_flight_fails_its_writes_only() {
    let mut p = pair(1);
    let n = 4 * (DEVICE_STAGING_BYTES as u64 / PAGE);
    let src = FakeDevice::new((PAGE * n) as usize);
    let dst = FakeDevice::new((PAGE * n) as usize);
    let peer = p.b_at_a;
    post_pages(&mut p, peer, &src, dst, n);
    p.until("the first completion", |p| !p.done_a.is_empty());
    assert!(
        p.done_a.len() < n as usize / 2,
        "the pipeline must still be busy"
    );
    p.a.remove_peer(peer).unwrap();
    p.until("every write's completion", |p| p.done_a.len() == n as usize);
    let failed = p
        .done_a
        .iter()
        .filter(|c| c.result == Err(OpError::PeerRemoved(peer)))
        .count();
    assert!(
        failed > 0
            && p.done_a
                .iter()
                .all(|c| c.result.is_ok() || c.result == Err(OpError::PeerRemoved(peer)))
    );
    // The transport goes on: a new connection to the same target stages afresh.
    let again = p.a.add_peer(&p.b.address()).unwrap();
    p.b_at_a = again;
    p.done_a.clear();
    p.done_b.clear();
    let (src2, dst2) = (
        FakeDevice::new(64 * PAGE as usize),
        FakeDevice::new(64 * PAGE as usize),
    );
    let data = post_pages(&mut p, again, &src2, dst2.clone(), 64);
    let done = p.take_a(64, "writes after the removal");
    assert!(done.iter().all(|c| c.result == Ok(PAGE)), "{done:?}");
    assert!((0..64).all(|i| landed(&dst2, &data, 64, i)));
}

/// The READ conformance cases with every region in fake device memory: the owner's replies
/// leave through its out-ring, and land through the initiator's in-ring, the completion
/// held until the copies into place have run.
mod reads_through_staging {
    use super::*;

    fn fake(len: usize) -> Arc<dyn MemoryRegion> {
        FakeDevice::new(len)
    }

    fn make() -> TcpTransport {
        TcpTransport::new(TcpConfig::default()).unwrap()
    }

    fabric_core::read_conformance_suite!(
        make,
        SuiteOptions {
            alloc: fake,
            ..SuiteOptions::default()
        }
    );
}
