//! READ through the engine and rail groups, over the in-memory transport: paged and
//! scattered shapes, spread over rails, and the checks that refuse what a READ cannot be.

use fabric_core::engine::{Direction, Engine, EngineConfig, GroupTransfer, RailGroup, Transfer};
use fabric_core::mem::MemTransport;
use fabric_core::plan::Segment;
use fabric_core::{
    Access, Completion, Error, HostBuffer, Invalid, LocalKey, LocalSlice, MemoryRegion, PeerId,
    PostOutcome, Registration, RemoteSlice, Transport, TransportLimits, WorkRequestId,
};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn group(n: usize) -> RailGroup {
    RailGroup::spawn(n, |_| Ok(MemTransport::new()), EngineConfig::default()).unwrap()
}

fn engine() -> Engine {
    Engine::spawn(|| Ok(MemTransport::new()), EngineConfig::default()).unwrap()
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
fn a_paged_read_is_spread_over_all_rails_and_lands_in_the_initiator() {
    let a = group(4);
    let b = group(2);
    let (page, stride) = (16384u64, 32768u64);
    let len = (256 * stride) as usize;
    // b owns the bytes; its application does nothing after registering them.
    let owned = HostBuffer::new_shared(len).unwrap();
    let data = pattern(21, len);
    owned.write(0, &data).unwrap();
    let o = b.register(owned.clone(), Access::REMOTE_READ).unwrap();
    let local = HostBuffer::new_shared(len).unwrap();
    let l = a.register(local.clone(), Access::LOCAL_WRITE).unwrap();
    let peer = a.add_peer(&b.addresses()).unwrap();
    // Remote pages 0, 2, 4, ... (stride 32 KiB) into local pages 255, 254, ... (same stride).
    let remote_pages: Vec<u64> = (0..128).map(|i| 2 * i).collect();
    let local_pages: Vec<u64> = (0..128).map(|i| 255 - i).collect();
    let t = GroupTransfer::paged(
        l.clone(),
        o.remote.clone(),
        &local_pages,
        stride,
        &remote_pages,
        stride,
        page,
    )
    .unwrap()
    .read();
    assert_eq!(t.direction, Direction::Read);
    let stats = a.submit(&peer, t).unwrap().wait(T).unwrap();
    assert_eq!(stats.bytes, 128 * page);
    // Complete means placed: every byte is there as the handle returns.
    for (lp, rp) in local_pages.iter().zip(&remote_pages) {
        let got = local.to_vec(lp * stride, page as usize).unwrap();
        let want = &data[(rp * stride) as usize..(rp * stride + page) as usize];
        assert!(got == want, "local page {lp} (remote page {rp})");
        // The rest of each stride is untouched.
        assert_eq!(
            local.to_vec(lp * stride + page, 16).unwrap(),
            vec![0; 16],
            "after local page {lp}"
        );
    }
    assert_eq!(
        local.to_vec(0, 16).unwrap(),
        vec![0; 16],
        "unread pages stay"
    );
    let per_rail = a.rail_counters();
    assert!(
        per_rail.iter().all(|c| c.bytes > 0),
        "every rail carried bytes: {per_rail:?}"
    );
    assert!(
        owned.to_vec(0, len).unwrap() == data,
        "the owner's bytes changed"
    );
    assert!(
        b.next_event(Duration::from_millis(20)).is_err(),
        "the owner hears nothing of a READ"
    );
}

#[test]
fn a_scattered_read_lands_and_may_read_the_same_remote_bytes_twice() {
    let a = engine();
    let b = engine();
    let owned = HostBuffer::new_shared(65536).unwrap();
    let data = pattern(5, 65536);
    owned.write(0, &data).unwrap();
    let o = b.register(owned, Access::REMOTE_READ).unwrap();
    let local = HostBuffer::new_shared(65536).unwrap();
    let l = a.register(local.clone(), Access::LOCAL_WRITE).unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    let seg = |lo: u64, ro: u64, len: u64| Segment {
        src: l.local,
        src_offset: lo,
        dst: o.remote,
        dst_offset: ro,
        len,
    };
    // Remote 0..4096 twice (sources may overlap), adjacent pieces that coalesce, one byte.
    let t = Transfer::new(peer)
        .read()
        .segment(seg(0, 0, 4096))
        .segment(seg(8192, 0, 4096))
        .segment(seg(20000, 30000, 100))
        .segment(seg(20100, 30100, 900))
        .segment(seg(65535, 1, 1));
    let stats = a.submit(t).unwrap().wait(T).unwrap();
    assert_eq!(stats.bytes, 4096 + 4096 + 1000 + 1);
    assert!(local.to_vec(0, 4096).unwrap() == data[..4096]);
    assert!(local.to_vec(8192, 4096).unwrap() == data[..4096]);
    assert!(local.to_vec(20000, 1000).unwrap() == data[30000..31000]);
    assert_eq!(local.to_vec(65535, 1).unwrap(), vec![data[1]]);
    assert_eq!(local.to_vec(4096, 4096).unwrap(), vec![0; 4096]);
}

#[test]
fn bad_reads_fail_at_submit_with_clear_errors() {
    let a = engine();
    let b = engine();
    let owned = HostBuffer::new_shared(8192).unwrap();
    let o = b.register(owned, Access::REMOTE_READ).unwrap();
    let local = HostBuffer::new_shared(8192).unwrap();
    let l = a.register(local.clone(), Access::LOCAL_WRITE).unwrap();
    let ro = a
        .register(HostBuffer::new_shared(8192).unwrap(), Access::NONE)
        .unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    let seg = |key: LocalKey, lo: u64, ro: u64, len: u64| Segment {
        src: key,
        src_offset: lo,
        dst: o.remote,
        dst_offset: ro,
        len,
    };
    // Two reads into the same local bytes: the local side is a READ's destination.
    let overlapping = Transfer::new(peer)
        .read()
        .segment(seg(l.local, 0, 0, 4096))
        .segment(seg(l.local, 2048, 4096, 4096));
    let e = a.submit(overlapping).expect_err("refused");
    assert!(
        matches!(&e, Error::InvalidArgument(Invalid::Overlap { .. })),
        "{e}"
    );
    // The remote range is a READ's source: it must lie in the owner's region.
    let beyond = Transfer::new(peer)
        .read()
        .segment(seg(l.local, 0, 8000, 4096));
    let e = a.submit(beyond).expect_err("refused");
    assert!(
        matches!(
            &e,
            Error::InvalidArgument(Invalid::RemoteOutOfRange { role: "source", .. })
        ),
        "{e}"
    );
    // A READ lands in a region that must allow LOCAL_WRITE.
    let e = a
        .submit(Transfer::new(peer).read().segment(seg(ro.local, 0, 0, 16)))
        .expect_err("refused");
    assert!(
        matches!(
            &e,
            Error::InvalidArgument(Invalid::NotLocallyWritable { .. })
        ),
        "{e}"
    );
    // No immediate data: the owner hears nothing of a READ.
    let e = a
        .submit(
            Transfer::new(peer)
                .read()
                .segment(seg(l.local, 0, 0, 16))
                .imm(3),
        )
        .expect_err("refused");
    assert!(
        matches!(e, Error::InvalidArgument(Invalid::ImmOnRead)),
        "{e}"
    );
    assert_eq!(
        local.to_vec(0, 8192).unwrap(),
        vec![0; 8192],
        "nothing moved"
    );
    // The same overlapping local ranges are fine for a WRITE, whose sources they are.
    let b_sink = b
        .register(HostBuffer::new_shared(8192).unwrap(), Access::REMOTE_WRITE)
        .unwrap();
    let w = Transfer::new(peer)
        .segment(Segment {
            src: l.local,
            src_offset: 0,
            dst: b_sink.remote,
            dst_offset: 0,
            len: 4096,
        })
        .segment(Segment {
            src: l.local,
            src_offset: 2048,
            dst: b_sink.remote,
            dst_offset: 4096,
            len: 4096,
        });
    assert_eq!(a.submit(w).unwrap().wait(T).unwrap().bytes, 8192);
}

#[test]
fn a_read_destination_cannot_be_deregistered_until_the_read_has_landed() {
    let a = engine();
    let b = engine();
    let owned = HostBuffer::new_shared(1 << 20).unwrap();
    owned.fill(0, 1 << 20, 9).unwrap();
    let o = b.register(owned, Access::REMOTE_READ).unwrap();
    let local = HostBuffer::new_shared(1 << 20).unwrap();
    let l = a.register(local.clone(), Access::LOCAL_WRITE).unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    let mut t = Transfer::new(peer).read();
    for i in 0..256u64 {
        t = t.segment(Segment {
            src: l.local,
            src_offset: (255 - i) * 4096,
            dst: o.remote,
            dst_offset: i * 4096,
            len: 4096,
        });
    }
    let h = a.submit(t).unwrap();
    // Either the read is still in flight (then the region is in use) or it has landed.
    match a.deregister(l.local) {
        Err(Error::RegionInUse { .. }) => {
            h.wait(T).unwrap();
            a.deregister(l.local).unwrap();
        }
        Ok(()) => {
            h.wait(T).unwrap();
        }
        Err(e) => panic!("{e}"),
    }
    assert_eq!(local.to_vec(0, 1 << 20).unwrap(), vec![9; 1 << 20]);
}

/// The in-memory transport with READ taken away, as a backend that has none.
struct NoRead(MemTransport);

impl Transport for NoRead {
    fn name(&self) -> &'static str {
        "no-read"
    }
    fn address(&self) -> Vec<u8> {
        self.0.address()
    }
    fn limits(&self) -> TransportLimits {
        self.0.limits()
    }
    fn add_peer(&mut self, address: &[u8]) -> fabric_core::Result<PeerId> {
        self.0.add_peer(address)
    }
    fn remove_peer(&mut self, peer: PeerId) -> fabric_core::Result<()> {
        self.0.remove_peer(peer)
    }
    fn register(
        &mut self,
        mem: Arc<dyn MemoryRegion>,
        access: Access,
    ) -> fabric_core::Result<Registration> {
        self.0.register(mem, access)
    }
    fn deregister(&mut self, key: LocalKey) -> fabric_core::Result<()> {
        self.0.deregister(key)
    }
    fn post_send(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        imm: Option<u32>,
    ) -> fabric_core::Result<PostOutcome> {
        self.0.post_send(peer, wr_id, src, imm)
    }
    fn post_recv(
        &mut self,
        wr_id: WorkRequestId,
        dst: LocalSlice,
    ) -> fabric_core::Result<PostOutcome> {
        self.0.post_recv(wr_id, dst)
    }
    fn post_write(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        dst: RemoteSlice,
        imm: Option<u32>,
    ) -> fabric_core::Result<PostOutcome> {
        self.0.post_write(peer, wr_id, src, dst, imm)
    }
    fn poll(&mut self, out: &mut Vec<Completion>) -> fabric_core::Result<usize> {
        self.0.poll(out)
    }
    fn wait(&mut self, timeout: Duration) -> fabric_core::Result<()> {
        self.0.wait(timeout)
    }
    fn waker(&mut self) -> Arc<dyn fabric_core::wake::Wake> {
        self.0.waker()
    }
}

#[test]
fn a_backend_without_read_refuses_it_with_a_typed_error() {
    let mut t = NoRead(MemTransport::new());
    assert!(!t.supports_read());
    let dst = LocalSlice {
        key: LocalKey(1),
        offset: 0,
        len: 0,
    };
    let src = RemoteSlice {
        region: fabric_core::RemoteRegion {
            addr: 0,
            len: 0,
            key: fabric_core::RemoteKey(1),
        },
        offset: 0,
        len: 0,
    };
    assert!(matches!(
        t.post_read(PeerId(1), WorkRequestId(1), dst, src),
        Err(Error::UnsupportedOp {
            backend: "no-read",
            op: "READ"
        })
    ));
    let a = Engine::spawn(|| Ok(NoRead(MemTransport::new())), EngineConfig::default()).unwrap();
    let b = engine();
    assert!(!a.supports_read());
    let o = b
        .register(HostBuffer::new_shared(4096).unwrap(), Access::REMOTE_READ)
        .unwrap();
    let l = a
        .register(HostBuffer::new_shared(4096).unwrap(), Access::LOCAL_WRITE)
        .unwrap();
    let peer = a.add_peer(&b.address()).unwrap();
    let e = a
        .submit(Transfer::new(peer).read().segment(Segment {
            src: l.local,
            src_offset: 0,
            dst: o.remote,
            dst_offset: 0,
            len: 4096,
        }))
        .expect_err("refused");
    assert!(matches!(e, Error::UnsupportedOp { op: "READ", .. }), "{e}");
    assert_eq!(e.to_string(), "the no-read backend does not support READ");
    // A rail group refuses it the same way, before anything moves.
    let g = RailGroup::spawn(
        2,
        |_| Ok(NoRead(MemTransport::new())),
        EngineConfig::default(),
    )
    .unwrap();
    let h = group(1);
    let gl = g
        .register(HostBuffer::new_shared(4096).unwrap(), Access::LOCAL_WRITE)
        .unwrap();
    let ho = h
        .register(HostBuffer::new_shared(4096).unwrap(), Access::REMOTE_READ)
        .unwrap();
    let gp = g.add_peer(&h.addresses()).unwrap();
    let t = GroupTransfer::same_pages(gl, ho.remote, &[0], 4096).read();
    assert!(matches!(
        g.submit(&gp, t),
        Err(Error::UnsupportedOp { op: "READ", .. })
    ));
}
