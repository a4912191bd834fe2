//! The backend conformance suite (feature `testing`).
//!
//! Every backend runs the same cases through [`conformance_suite!`](crate::conformance_suite):
//!
//! ```text
//! fabric_core::conformance_suite!(|| MyTransport::new().unwrap(), fabric_core::testing::SuiteOptions::default());
//! ```
//!
//! A backend that implements READ ([`Transport::supports_read`]) also runs the READ cases
//! through [`read_conformance_suite!`](crate::read_conformance_suite), with the same
//! arguments; each of them fails at once on a backend that says it has no READ.
//!
//! Two transports are driven step by step from one thread (no sleeps): each step polls both.
#![allow(missing_docs)]
#![allow(clippy::missing_panics_doc)]

use crate::memory::{HostBuffer, MemoryRegion, SubRegion};
use crate::transport::{Completion, OpKind, PostOutcome, Transport};
use crate::types::{Access, LocalSlice, PeerId, Registration, RemoteSlice, Rows, WorkRequestId};
use crate::{Error, OpError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How strict the suite is with a backend.
#[derive(Clone, Copy, Debug)]
pub struct SuiteOptions {
    /// The backend reports the exact cause of remote failures (key, bounds, permission).
    /// Providers that only say "remote access error" set this to false; the case still
    /// requires an error completion and untouched memory.
    pub exact_remote_errors: bool,
    /// The backend can deliver a SEND that arrived before its receive was posted.
    pub buffers_unexpected_sends: bool,
    /// The backend enforces the REMOTE_WRITE permission (some software providers do not).
    pub enforces_permissions: bool,
    /// How long any one wait may take.
    pub timeout: Duration,
    /// Operations in flight for the "many" case.
    pub many: usize,
    /// Allocates the memory the cases register ([`host_alloc`] by default; a GPU backend
    /// passes one that returns device memory).
    pub alloc: fn(usize) -> Arc<dyn MemoryRegion>,
}

/// The suite's default allocator: zeroed host memory.
pub fn host_alloc(len: usize) -> Arc<dyn MemoryRegion> {
    HostBuffer::new_shared(len).expect("allocate host memory")
}

impl Default for SuiteOptions {
    fn default() -> Self {
        SuiteOptions {
            exact_remote_errors: true,
            buffers_unexpected_sends: true,
            enforces_permissions: true,
            timeout: Duration::from_secs(20),
            many: 5000,
            alloc: host_alloc,
        }
    }
}

/// Two connected transports driven from one thread.
pub struct Pair<T: Transport> {
    pub a: T,
    pub b: T,
    /// `b` as known to `a`.
    pub b_at_a: PeerId,
    /// Completions seen so far on each side, not yet taken.
    pub done_a: Vec<Completion>,
    pub done_b: Vec<Completion>,
    pub opts: SuiteOptions,
}

/// A registered buffer (host memory, or whatever the suite's allocator returns) with canary
/// bytes on both sides of the registered window.
pub struct Canaried {
    pub buf: Arc<dyn MemoryRegion>,
    pub reg: Registration,
    pub len: u64,
}

pub const CANARY: u8 = 0xCA;
const GUARD: u64 = 4096;

impl Canaried {
    /// In host memory.
    pub fn new<T: Transport>(t: &mut T, len: u64, access: Access, fill: u8) -> Canaried {
        Canaried::with(host_alloc, t, len, access, fill)
    }

    /// In memory from `alloc`.
    pub fn with<T: Transport>(
        alloc: fn(usize) -> Arc<dyn MemoryRegion>,
        t: &mut T,
        len: u64,
        access: Access,
        fill: u8,
    ) -> Canaried {
        let buf = alloc((len + 2 * GUARD) as usize);
        let mut init = vec![CANARY; (len + 2 * GUARD) as usize];
        init[GUARD as usize..(GUARD + len) as usize].fill(fill);
        buf.write_from_host(0, &init).unwrap();
        let sub = SubRegion::new(buf.clone(), GUARD, len).unwrap();
        let reg = t.register(Arc::new(sub), access).expect("register");
        Canaried { buf, reg, len }
    }
    pub fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.buf.read_to_host(GUARD + offset, &mut v).unwrap();
        v
    }
    pub fn write(&self, offset: u64, data: &[u8]) {
        self.buf.write_from_host(GUARD + offset, data).unwrap()
    }
    pub fn assert_canaries(&self) {
        let mut before = vec![0; GUARD as usize];
        self.buf.read_to_host(0, &mut before).unwrap();
        let mut after = vec![0; GUARD as usize];
        self.buf.read_to_host(GUARD + self.len, &mut after).unwrap();
        assert!(
            before.iter().all(|&b| b == CANARY),
            "bytes before the region changed"
        );
        assert!(
            after.iter().all(|&b| b == CANARY),
            "bytes after the region changed"
        );
    }
    pub fn local(&self, offset: u64, len: u64) -> LocalSlice {
        LocalSlice {
            key: self.reg.local,
            offset,
            len,
        }
    }
    pub fn remote(&self, offset: u64, len: u64) -> RemoteSlice {
        RemoteSlice {
            region: self.reg.remote,
            offset,
            len,
        }
    }
}

/// Host bytes that claim to be device `device`'s memory, as GPU memory does: no host
/// pointer, every access through the copy methods (counted in `copies`), so that a
/// transport or an agent must take the path it takes for device memory. For tests of that
/// path on machines without a GPU.
pub struct ClaimedDevice {
    pub device: u32,
    pub bytes: HostBuffer,
    pub copies: std::sync::atomic::AtomicUsize,
}

impl ClaimedDevice {
    /// `len` zeroed bytes that claim to be device `device`'s.
    pub fn new(device: u32, len: usize) -> Arc<ClaimedDevice> {
        Arc::new(ClaimedDevice {
            device,
            bytes: HostBuffer::new(len).expect("host memory for a claimed device region"),
            copies: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Whether its `len` bytes at `at` are all `byte` (read without counting a copy).
    pub fn all(&self, at: u64, len: usize, byte: u8) -> bool {
        self.bytes
            .to_vec(at, len)
            .unwrap()
            .iter()
            .all(|&x| x == byte)
    }

    fn counted(&self) {
        self.copies
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

// SAFETY: no host pointer is offered; every access goes through the copy methods, which
// bound-check against the inner buffer.
unsafe impl MemoryRegion for ClaimedDevice {
    fn len(&self) -> usize {
        self.bytes.len()
    }
    fn location(&self) -> crate::MemoryLocation {
        crate::MemoryLocation::Cuda {
            device: self.device,
        }
    }
    fn host_ptr(&self) -> Option<std::ptr::NonNull<u8>> {
        None
    }
    fn device_addr(&self) -> u64 {
        0x7000_0000_0000 + (u64::from(self.device) << 32)
    }
    fn read_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), crate::MemoryError> {
        self.counted();
        self.bytes.read(offset, dst)
    }
    fn write_from_host(&self, offset: u64, src: &[u8]) -> Result<(), crate::MemoryError> {
        self.counted();
        self.bytes.write(offset, src)
    }
}

/// A deterministic byte pattern.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
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

impl<T: Transport> Pair<T> {
    pub fn new(make: &dyn Fn() -> T, opts: SuiteOptions) -> Pair<T> {
        let mut a = make();
        let b = make();
        let b_at_a = a.add_peer(&b.address()).expect("add_peer");
        Pair {
            a,
            b,
            b_at_a,
            done_a: Vec::new(),
            done_b: Vec::new(),
            opts,
        }
    }

    /// Polls both sides once.
    pub fn step(&mut self) {
        self.a.poll(&mut self.done_a).expect("poll a");
        self.b.poll(&mut self.done_b).expect("poll b");
    }

    /// Polls until `cond` holds; panics after the suite's timeout.
    pub fn until(&mut self, what: &str, cond: impl FnMut(&Self) -> bool) {
        self.poll_until(cond, |_| format!("timed out waiting for {what}"));
    }

    /// Polls both sides until `cond` holds; after the suite's timeout, panics with
    /// `message` of the state reached.
    fn poll_until(
        &mut self,
        mut cond: impl FnMut(&Self) -> bool,
        message: impl Fn(&Self) -> String,
    ) {
        let deadline = Instant::now() + self.opts.timeout;
        while !cond(self) {
            assert!(Instant::now() < deadline, "{}", message(self));
            self.step();
        }
    }

    /// Waits until side a has `n` completions, then takes them.
    pub fn take_a(&mut self, n: usize, what: &str) -> Vec<Completion> {
        self.until_counted(what, n, |p| p.done_a.len());
        self.done_a.drain(..n).collect()
    }

    /// Waits until side b has `n` completions, then takes them.
    pub fn take_b(&mut self, n: usize, what: &str) -> Vec<Completion> {
        self.until_counted(what, n, |p| p.done_b.len());
        self.done_b.drain(..n).collect()
    }

    /// Polls until `count` reaches `n`; a timeout says how far it got (all but a few lost
    /// completions reads differently from nothing at all).
    fn until_counted(&mut self, what: &str, n: usize, count: impl Fn(&Self) -> usize) {
        self.poll_until(
            |p| count(p) >= n,
            |p| {
                format!(
                    "timed out waiting for {what}: {} of {n} after {:?}",
                    count(p),
                    p.opts.timeout
                )
            },
        );
    }

    /// Posts on side a, retrying (after polling both sides) while the transport has no room.
    pub fn post_a(&mut self, mut f: impl FnMut(&mut T) -> crate::Result<PostOutcome>) {
        let deadline = Instant::now() + self.opts.timeout;
        loop {
            match f(&mut self.a).expect("post on a") {
                PostOutcome::Posted => return,
                PostOutcome::NoRoom => {
                    assert!(Instant::now() < deadline, "no room for too long");
                    self.step();
                }
            }
        }
    }

    /// Posts on side b, retrying while the transport has no room.
    pub fn post_b(&mut self, mut f: impl FnMut(&mut T) -> crate::Result<PostOutcome>) {
        let deadline = Instant::now() + self.opts.timeout;
        loop {
            match f(&mut self.b).expect("post on b") {
                PostOutcome::Posted => return,
                PostOutcome::NoRoom => {
                    assert!(Instant::now() < deadline, "no room for too long");
                    self.step();
                }
            }
        }
    }

    /// Writes `src` into `dst` from a to b and returns a's completion.
    pub fn write_once(
        &mut self,
        src: LocalSlice,
        dst: RemoteSlice,
        imm: Option<u32>,
    ) -> Completion {
        let peer = self.b_at_a;
        self.post_a(|t| t.post_write(peer, WorkRequestId(77), src, dst, imm));
        let c = self.take_a(1, "write completion").remove(0);
        assert_eq!(c.wr_id, WorkRequestId(77));
        assert_eq!(c.op, OpKind::Write);
        c
    }
}

impl<T: Transport> Pair<T> {
    /// Reads `src` (b's memory) into `dst` (a's) and returns a's completion.
    pub fn read_once(&mut self, dst: LocalSlice, src: RemoteSlice) -> Completion {
        let peer = self.b_at_a;
        self.post_a(|t| t.post_read(peer, WorkRequestId(78), dst, src));
        let c = self.take_a(1, "read completion").remove(0);
        assert_eq!(c.wr_id, WorkRequestId(78));
        assert_eq!(c.op, OpKind::Read, "a READ completes as a READ");
        c
    }
}

fn wr(i: usize) -> WorkRequestId {
    WorkRequestId(1000 + i as u64)
}

/// SEND/RECV: lengths, contents, immediate data and order per peer.
pub fn send_recv_order_and_lengths<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let src = Canaried::with(opts.alloc, &mut p.a, 4096, Access::NONE, 0);
    let dst = Canaried::with(opts.alloc, &mut p.b, 8 * 256, Access::LOCAL_WRITE, 0);
    let lens = [0u64, 1, 50, 256, 77, 200, 3, 255];
    for i in 0..lens.len() {
        p.post_b(|t| t.post_recv(wr(i), dst.local(i as u64 * 256, 256)));
    }
    for (i, &len) in lens.iter().enumerate() {
        src.write(i as u64 * 300, &pattern(i as u64, len as usize));
        let peer = p.b_at_a;
        let imm = (i % 2 == 0).then_some(0xABC0_0000 + i as u32);
        p.post_a(|t| t.post_send(peer, wr(i), src.local(i as u64 * 300, len), imm));
    }
    let sends = p.take_a(lens.len(), "send completions");
    let mut send_ids: Vec<_> = sends.iter().map(|c| c.wr_id).collect();
    send_ids.sort();
    assert_eq!(send_ids, (0..lens.len()).map(wr).collect::<Vec<_>>());
    assert!(
        sends
            .iter()
            .all(|c| c.op == OpKind::Send && c.result.is_ok()),
        "{sends:?}"
    );
    let recvs = p.take_b(lens.len(), "recv completions");
    for (i, c) in recvs.iter().enumerate() {
        assert_eq!(c.op, OpKind::Recv);
        assert_eq!(c.wr_id, wr(i), "receives complete in posting order");
        assert_eq!(c.result, Ok(lens[i]), "length of message {i}");
        assert_eq!(
            c.imm,
            (i % 2 == 0).then_some(0xABC0_0000 + i as u32),
            "imm of message {i}"
        );
        assert_eq!(
            dst.read(i as u64 * 256, lens[i] as usize),
            pattern(i as u64, lens[i] as usize)
        );
    }
    dst.assert_canaries();
}

/// A SEND that arrives before any receive is posted is delivered once one is.
pub fn send_before_recv_is_posted<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    assert!(
        opts.buffers_unexpected_sends,
        "SuiteOptions say this backend does not buffer unexpected sends: list this case under \
         `ignore` in its conformance_suite!, with the reason"
    );
    let mut p = Pair::new(make, opts);
    let src = Canaried::with(opts.alloc, &mut p.a, 1024, Access::NONE, 0);
    let dst = Canaried::with(opts.alloc, &mut p.b, 1024, Access::LOCAL_WRITE, 0);
    src.write(0, &pattern(5, 1000));
    let peer = p.b_at_a;
    p.post_a(|t| t.post_send(peer, wr(0), src.local(0, 1000), Some(9)));
    for _ in 0..2000 {
        p.step();
    }
    assert!(
        p.done_b.is_empty(),
        "no receive is posted, yet b completed {:?}",
        p.done_b
    );
    p.post_b(|t| t.post_recv(wr(1), dst.local(0, 1024)));
    let r = p.take_b(1, "late receive").remove(0);
    assert_eq!(r.result, Ok(1000));
    assert_eq!(r.imm, Some(9));
    assert_eq!(dst.read(0, 1000), pattern(5, 1000));
    let s = p.take_a(1, "send completion").remove(0);
    assert!(s.result.is_ok(), "{s:?}");
}

/// A message longer than the posted buffer fails the receive with `Truncated`, without
/// writing past the buffer.
pub fn recv_too_small_is_truncated<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let src = Canaried::with(opts.alloc, &mut p.a, 1024, Access::NONE, 0x11);
    let dst = Canaried::with(opts.alloc, &mut p.b, 100, Access::LOCAL_WRITE, 0);
    p.post_b(|t| t.post_recv(wr(0), dst.local(0, 100)));
    let peer = p.b_at_a;
    p.post_a(|t| t.post_send(peer, wr(0), src.local(0, 1000), None));
    let r = p.take_b(1, "truncated receive").remove(0);
    assert!(
        r.result.is_err(),
        "a 1000-byte message fit a 100-byte buffer: {r:?}"
    );
    if opts.exact_remote_errors {
        assert_eq!(
            r.result,
            Err(OpError::Truncated {
                len: 1000,
                capacity: 100
            })
        );
    }
    dst.assert_canaries();
    let _ = p.take_a(1, "send completion");
}

/// WRITE without immediate data: bytes land, the target sees no completion.
pub fn write_without_imm<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let src = Canaried::with(opts.alloc, &mut p.a, 64 * 1024, Access::NONE, 0);
    let dst = Canaried::with(opts.alloc, &mut p.b, 64 * 1024, Access::REMOTE_WRITE, 0);
    let data = pattern(42, 64 * 1024);
    src.write(0, &data);
    for (i, (off, len)) in [(0u64, 4096u64), (10_000, 1), (30_000, 30_000)]
        .into_iter()
        .enumerate()
    {
        let c = p.write_once(src.local(off, len), dst.remote(off, len), None);
        assert_eq!(c.result, Ok(len), "write {i}");
        assert_eq!(
            dst.read(off, len as usize),
            data[off as usize..(off + len) as usize]
        );
    }
    assert_eq!(
        dst.read(4096, 100),
        vec![0; 100],
        "bytes between writes untouched"
    );
    for _ in 0..100 {
        p.step();
    }
    assert!(
        p.done_b.is_empty(),
        "writes without imm must not complete at the target"
    );
    dst.assert_canaries();
}

/// WRITE with immediate data: the target's completion carries it, after the bytes landed.
pub fn write_with_imm<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let src = Canaried::with(opts.alloc, &mut p.a, 1 << 20, Access::NONE, 0);
    let dst = Canaried::with(opts.alloc, &mut p.b, 1 << 20, Access::REMOTE_WRITE, 0);
    let data = pattern(7, 1 << 20);
    src.write(0, &data);
    let peer = p.b_at_a;
    p.post_a(|t| {
        t.post_write(
            peer,
            wr(0),
            src.local(0, 1 << 20),
            dst.remote(0, 1 << 20),
            Some(0xDEAD_BEEF),
        )
    });
    let r = p.take_b(1, "remote write completion").remove(0);
    assert_eq!(r.op, OpKind::RemoteWrite);
    assert_eq!(r.imm, Some(0xDEAD_BEEF));
    assert!(r.result.is_ok(), "{r:?}");
    assert!(
        dst.read(0, 1 << 20) == data,
        "bytes had not landed when the imm arrived"
    );
    let c = p.take_a(1, "write completion").remove(0);
    assert_eq!(c.result, Ok(1 << 20));
    dst.assert_canaries();
}

/// A strided write (`post_write_rows`) lands every row where its strides say and nothing
/// between them, with one completion for all its bytes and the immediate data after the
/// last row; one whose last row passes the region's end fails whole, before any byte
/// lands; malformed rows are refused at post. A backend without strided writes refuses
/// them as unsupported, and says so in its limits.
pub fn strided_writes_land_their_rows<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let src = Canaried::with(opts.alloc, &mut p.a, 1 << 20, Access::NONE, 0);
    let dst = Canaried::with(opts.alloc, &mut p.b, 1 << 20, Access::REMOTE_WRITE, 0);
    let data = pattern(21, 1 << 20);
    src.write(0, &data);
    let peer = p.b_at_a;
    // 100 rows of 1 KiB, every 4 KiB of the source from 512, packed at the destination
    // from 64 (a tensor-parallel piece of a row-major matrix).
    let (len, rows) = (1024u64, 100u64);
    let r = Rows {
        count: rows,
        src_stride: 4096,
        dst_stride: len,
    };
    if !p.a.limits().strided_writes {
        let e =
            p.a.post_write_rows(
                peer,
                wr(0),
                src.local(512, len),
                dst.remote(64, len),
                r,
                None,
            )
            .expect_err("a backend without strided writes refuses them");
        assert!(matches!(e, Error::UnsupportedOp { .. }), "{e:?}");
        return;
    }
    p.post_a(|t| {
        t.post_write_rows(
            peer,
            wr(0),
            src.local(512, len),
            dst.remote(64, len),
            r,
            Some(0x5EED),
        )
    });
    let done = p.take_b(1, "remote write completion").remove(0);
    assert_eq!((done.op, done.imm), (OpKind::RemoteWrite, Some(0x5EED)));
    let mut want = vec![0u8; 1 << 20];
    for i in 0..rows as usize {
        let from = 512 + i * 4096;
        want[64 + i * 1024..64 + (i + 1) * 1024].copy_from_slice(&data[from..from + 1024]);
    }
    assert!(
        dst.read(0, 1 << 20) == want,
        "the rows had not all landed, or landed elsewhere, when the imm arrived"
    );
    let c = p.take_a(1, "strided write completion").remove(0);
    assert_eq!(c.result, Ok(rows * len));
    // The last row would end 64 bytes past the region: nothing of it lands.
    let before = dst.read(0, 1 << 20);
    let far = Rows {
        count: 16,
        src_stride: 4096,
        dst_stride: 65536,
    };
    let start = (1 << 20) - 15 * 65536 - len + 64;
    p.post_a(|t| {
        t.post_write_rows(
            peer,
            WorkRequestId(78),
            src.local(0, len),
            dst.remote(start, len),
            far,
            None,
        )
    });
    let c = p.take_a(1, "out-of-bounds strided write").remove(0);
    assert_remote_error(
        &c,
        opts.exact_remote_errors,
        |e| matches!(e, OpError::OutOfBounds { .. }),
        "strided past the end",
    );
    assert!(
        dst.read(0, 1 << 20) == before,
        "a refused strided write landed bytes"
    );
    dst.assert_canaries();
    // Malformed rows are refused at post: one row, or rows that overlap.
    for bad in [
        Rows { count: 1, ..r },
        Rows {
            dst_stride: len - 1,
            ..r
        },
    ] {
        let e =
            p.a.post_write_rows(
                peer,
                wr(1),
                src.local(0, len),
                dst.remote(0, len),
                bad,
                None,
            )
            .expect_err("malformed rows");
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    }
}

fn assert_remote_error(c: &Completion, exact: bool, want: impl Fn(&OpError) -> bool, what: &str) {
    match &c.result {
        Ok(_) => panic!("{what}: the write succeeded"),
        Err(e) if exact => assert!(want(e), "{what}: wrong error {e:?}"),
        Err(_) => {}
    }
}

/// A wrong remote key fails the write at the initiator; the target is untouched.
pub fn bad_remote_key_fails<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let src = Canaried::with(opts.alloc, &mut p.a, 4096, Access::NONE, 0x55);
    let dst = Canaried::with(opts.alloc, &mut p.b, 4096, Access::REMOTE_WRITE, 0);
    let mut bad = dst.remote(0, 4096);
    bad.region.key.0 ^= 0x5A5A_0000_0001;
    let c = p.write_once(src.local(0, 4096), bad, Some(1));
    assert_remote_error(
        &c,
        opts.exact_remote_errors,
        |e| matches!(e, OpError::RemoteKeyInvalid(_)),
        "bad key",
    );
    assert_eq!(dst.read(0, 4096), vec![0; 4096]);
    dst.assert_canaries();
    // The connection still works afterwards.
    let c = p.write_once(src.local(0, 4096), dst.remote(0, 4096), None);
    assert_eq!(c.result, Ok(4096));
    assert_eq!(dst.read(0, 4096), vec![0x55; 4096]);
    assert!(
        p.done_b.iter().all(|c| c.op != OpKind::RemoteWrite),
        "failed write delivered imm"
    );
}

/// A write past the end of the region fails; nothing outside (or inside) changes.
pub fn out_of_bounds_write_fails<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let src = Canaried::with(opts.alloc, &mut p.a, 8192, Access::NONE, 0x66);
    let dst = Canaried::with(opts.alloc, &mut p.b, 4096, Access::REMOTE_WRITE, 0);
    let mut oob = dst.remote(4000, 200);
    oob.len = 200;
    let c = p.write_once(src.local(0, 200), oob, None);
    assert_remote_error(
        &c,
        opts.exact_remote_errors,
        |e| matches!(e, OpError::OutOfBounds { .. }),
        "oob",
    );
    let mut huge = dst.remote(u64::MAX - 10, 100);
    huge.len = 100;
    let c = p.write_once(src.local(0, 100), huge, None);
    assert_remote_error(
        &c,
        opts.exact_remote_errors,
        |e| matches!(e, OpError::OutOfBounds { .. }),
        "overflowing offset",
    );
    assert_eq!(dst.read(0, 4096), vec![0; 4096]);
    dst.assert_canaries();
}

/// A write into a region registered without REMOTE_WRITE fails.
pub fn write_without_permission_fails<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    assert!(
        opts.enforces_permissions,
        "SuiteOptions say this backend does not enforce remote-write permission: list this \
         case under `ignore` in its conformance_suite!, with the reason"
    );
    let mut p = Pair::new(make, opts);
    let src = Canaried::with(opts.alloc, &mut p.a, 4096, Access::NONE, 0x77);
    let dst = Canaried::with(opts.alloc, &mut p.b, 4096, Access::LOCAL_WRITE, 0);
    let c = p.write_once(src.local(0, 4096), dst.remote(0, 4096), None);
    assert_remote_error(
        &c,
        opts.exact_remote_errors,
        |e| matches!(e, OpError::PermissionDenied),
        "permission",
    );
    assert_eq!(dst.read(0, 4096), vec![0; 4096]);
    dst.assert_canaries();
}

/// A write with the key of a deregistered region fails.
pub fn write_after_deregister_fails<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let src = Canaried::with(opts.alloc, &mut p.a, 4096, Access::NONE, 0x77);
    let dst = Canaried::with(opts.alloc, &mut p.b, 4096, Access::REMOTE_WRITE, 0);
    let c = p.write_once(src.local(0, 16), dst.remote(0, 16), None);
    assert_eq!(c.result, Ok(16));
    p.b.deregister(dst.reg.local).expect("deregister");
    let c = p.write_once(src.local(0, 4096), dst.remote(0, 4096), None);
    assert_remote_error(
        &c,
        opts.exact_remote_errors,
        |e| matches!(e, OpError::RemoteKeyInvalid(_)),
        "stale key",
    );
    assert_eq!(dst.read(16, 4080), vec![0; 4080]);
    dst.assert_canaries();
    assert!(
        p.b.deregister(dst.reg.local).is_err(),
        "double deregistration must fail"
    );
}

/// Local mistakes fail the post call itself, with nothing posted.
pub fn local_errors_fail_at_post<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let src = Canaried::with(opts.alloc, &mut p.a, 4096, Access::NONE, 0);
    let dst = Canaried::with(opts.alloc, &mut p.b, 4096, Access::REMOTE_WRITE, 0);
    let peer = p.b_at_a;
    let mut bogus = src.local(0, 16);
    bogus.key.0 += 1000;
    assert!(
        p.a.post_write(peer, wr(0), bogus, dst.remote(0, 16), None)
            .is_err(),
        "unknown local key"
    );
    assert!(
        p.a.post_write(peer, wr(0), src.local(4090, 16), dst.remote(0, 16), None)
            .is_err(),
        "local oob"
    );
    assert!(
        p.a.post_write(peer, wr(0), src.local(0, 16), dst.remote(0, 32), None)
            .is_err(),
        "length mismatch"
    );
    assert!(
        p.a.post_send(PeerId(999_999), wr(0), src.local(0, 16), None)
            .is_err(),
        "unknown peer"
    );
    assert!(
        p.a.post_recv(wr(0), src.local(0, 16)).is_err(),
        "receive into a region without LOCAL_WRITE"
    );
    assert!(
        matches!(
            p.a.add_peer(b"\xff\x00garbage"),
            Err(Error::InvalidAddress(_))
        ),
        "malformed address"
    );
    for _ in 0..100 {
        p.step();
    }
    assert!(
        p.done_a.is_empty(),
        "rejected posts must not complete: {:?}",
        p.done_a
    );
}

/// Removing a peer with operations in flight completes every one of them (success or
/// `PeerRemoved`), and later posts to it fail.
pub fn remove_peer_with_ops_in_flight<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let n = 64;
    let src = Canaried::with(opts.alloc, &mut p.a, 64 * 1024, Access::NONE, 0x42);
    let dst = Canaried::with(opts.alloc, &mut p.b, 64 * 1024 * n, Access::REMOTE_WRITE, 0);
    let peer = p.b_at_a;
    let mut posted = 0;
    // The first half is handed over (a poll), the second is posted just before the removal:
    // a backend that queues posts until its next poll holds those still.
    for i in 0..n as usize {
        if i == n as usize / 2 {
            p.step();
        }
        match p.a.post_write(
            peer,
            wr(i),
            src.local(0, 65536),
            dst.remote(i as u64 * 65536, 65536),
            None,
        ) {
            Ok(PostOutcome::Posted) => posted += 1,
            Ok(PostOutcome::NoRoom) => break,
            Err(e) => panic!("post {i}: {e}"),
        }
    }
    assert!(posted > 0);
    p.a.remove_peer(peer).expect("remove_peer");
    let done = p.take_a(posted, "completions of all posted writes");
    for c in &done {
        match &c.result {
            Ok(_) | Err(OpError::PeerRemoved(_)) => {}
            Err(e) => panic!("unexpected error after removal: {e:?}"),
        }
    }
    let mut ids: Vec<_> = done.iter().map(|c| c.wr_id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), posted, "every write completes exactly once");
    assert!(
        p.a.post_write(peer, wr(0), src.local(0, 1), dst.remote(0, 1), None)
            .is_err()
    );
    assert!(p.a.remove_peer(peer).is_err(), "removing twice must fail");
    // The same address can be added again and works.
    let again = p.a.add_peer(&p.b.address()).expect("re-add");
    p.b_at_a = again;
    let c = p.write_once(src.local(0, 100), dst.remote(0, 100), None);
    assert_eq!(c.result, Ok(100));
    dst.assert_canaries();
}

/// Thousands of operations in flight, all complete and land.
pub fn many_operations_in_flight<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let n = opts.many;
    let page = 1024u64;
    let src = Canaried::with(opts.alloc, &mut p.a, page * n as u64, Access::NONE, 0);
    let dst = Canaried::with(
        opts.alloc,
        &mut p.b,
        page * n as u64,
        Access::REMOTE_WRITE,
        0,
    );
    let data = pattern(99, (page * n as u64) as usize);
    src.write(0, &data);
    let peer = p.b_at_a;
    let mut done = Vec::new();
    for i in 0..n {
        // Reverse order on the target, so that nothing is accidentally contiguous.
        let j = (n - 1 - i) as u64;
        let imm = (i == n - 1).then_some(5u32);
        p.post_a(|t| {
            t.post_write(
                peer,
                wr(i),
                src.local(j * page, page),
                dst.remote(j * page, page),
                imm,
            )
        });
        done.append(&mut p.done_a);
    }
    let rest = n - done.len();
    done.extend(p.take_a(rest, "all write completions"));
    assert!(
        done.iter().all(|c| c.result == Ok(page)),
        "all writes succeed"
    );
    let mut ids: Vec<_> = done.iter().map(|c| c.wr_id.0).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), n);
    let r = p.take_b(1, "imm of the last write").remove(0);
    assert_eq!(r.imm, Some(5));
    assert!(dst.read(0, data.len()) == data, "target bytes differ");
    dst.assert_canaries();
}

/// Zero-length writes and sends work, and so does a large write.
pub fn zero_and_large_segments<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let big = p.a.limits().max_msg_size.min(16 << 20);
    let src = Canaried::with(opts.alloc, &mut p.a, big, Access::NONE, 0);
    let dst = Canaried::with(
        opts.alloc,
        &mut p.b,
        big,
        Access::REMOTE_WRITE | Access::LOCAL_WRITE,
        0,
    );
    let data = pattern(3, big as usize);
    src.write(0, &data);
    let c = p.write_once(src.local(0, 0), dst.remote(0, 0), Some(11));
    assert_eq!(c.result, Ok(0));
    let r = p.take_b(1, "zero-length write's imm").remove(0);
    assert_eq!((r.op, r.imm), (OpKind::RemoteWrite, Some(11)));
    let c = p.write_once(src.local(0, big), dst.remote(0, big), None);
    assert_eq!(c.result, Ok(big));
    assert!(
        dst.read(0, big as usize) == data,
        "large write landed wrong"
    );
    p.post_b(|t| t.post_recv(wr(1), dst.local(0, 16)));
    let peer = p.b_at_a;
    p.post_a(|t| t.post_send(peer, wr(2), src.local(0, 0), None));
    let r = p.take_b(1, "zero-length receive").remove(0);
    assert_eq!(r.result, Ok(0));
    dst.assert_canaries();
}

/// A target that only alternates `wait` and `poll` (as an idle engine does) keeps the
/// transfer moving: backends whose progress is manual must wake from `wait` in time.
pub fn idle_target_progresses_through_wait<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = Pair::new(make, opts);
    let page = 65536u64;
    let n = 64u64;
    let src = Canaried::with(opts.alloc, &mut p.a, page * n, Access::NONE, 0);
    let dst = Canaried::with(opts.alloc, &mut p.b, page * n, Access::REMOTE_WRITE, 0);
    let data = pattern(17, (page * n) as usize);
    src.write(0, &data);
    let peer = p.b_at_a;
    let deadline = Instant::now() + opts.timeout;
    let mut posted = 0u64;
    let mut imm_seen = false;
    while p.done_a.len() < n as usize || !imm_seen {
        assert!(
            Instant::now() < deadline,
            "no progress with a target driven by wait + poll"
        );
        if posted < n {
            let imm = (posted == n - 1).then_some(3u32);
            let r =
                p.a.post_write(
                    peer,
                    wr(posted as usize),
                    src.local(posted * page, page),
                    dst.remote(posted * page, page),
                    imm,
                )
                .expect("post_write");
            if r == PostOutcome::Posted {
                posted += 1;
            }
        }
        p.a.poll(&mut p.done_a).expect("poll a");
        p.b.wait(Duration::from_millis(5)).expect("wait b");
        p.b.poll(&mut p.done_b).expect("poll b");
        imm_seen |= p
            .done_b
            .iter()
            .any(|c| c.op == OpKind::RemoteWrite && c.imm == Some(3));
    }
    assert!(
        p.done_a.iter().all(|c| c.result == Ok(page)),
        "all writes succeed"
    );
    assert!(dst.read(0, data.len()) == data, "target bytes differ");
    dst.assert_canaries();
}

/// The READ cases' common start: a pair whose side a reads, after checking that the
/// backend says it can.
fn read_pair<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) -> Pair<T> {
    let p = Pair::new(make, opts);
    assert!(
        p.a.supports_read(),
        "the {} backend says it has no READ (Transport::supports_read): do not run the READ \
         cases on it",
        p.a.name()
    );
    p
}

/// READ: the owner's bytes land in the initiator's region, the owner sees no completion
/// and its memory is unchanged.
pub fn read_lands_in_initiator<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = read_pair(make, opts);
    let dst = Canaried::with(opts.alloc, &mut p.a, 64 * 1024, Access::LOCAL_WRITE, 0);
    let src = Canaried::with(opts.alloc, &mut p.b, 64 * 1024, Access::REMOTE_READ, 0);
    let data = pattern(43, 64 * 1024);
    src.write(0, &data);
    for (i, (off, len)) in [(0u64, 4096u64), (10_000, 1), (30_000, 30_000)]
        .into_iter()
        .enumerate()
    {
        let c = p.read_once(dst.local(off, len), src.remote(off, len));
        assert_eq!(c.result, Ok(len), "read {i}");
        assert_eq!(
            dst.read(off, len as usize),
            data[off as usize..(off + len) as usize],
            "read {i} placed wrong bytes"
        );
    }
    assert_eq!(
        dst.read(4096, 100),
        vec![0; 100],
        "bytes between reads untouched"
    );
    for _ in 0..100 {
        p.step();
    }
    assert!(
        p.done_b.is_empty(),
        "a READ must not complete at the owner: {:?}",
        p.done_b
    );
    assert!(src.read(0, data.len()) == data, "the owner's bytes changed");
    dst.assert_canaries();
    src.assert_canaries();
}

/// A READ with a wrong remote key fails at the initiator; its region is untouched.
pub fn read_bad_remote_key_fails<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = read_pair(make, opts);
    let dst = Canaried::with(opts.alloc, &mut p.a, 4096, Access::LOCAL_WRITE, 0);
    let src = Canaried::with(opts.alloc, &mut p.b, 4096, Access::REMOTE_READ, 0x55);
    let mut bad = src.remote(0, 4096);
    bad.region.key.0 ^= 0x5A5A_0000_0001;
    let c = p.read_once(dst.local(0, 4096), bad);
    assert_remote_error(
        &c,
        opts.exact_remote_errors,
        |e| matches!(e, OpError::RemoteKeyInvalid(_)),
        "read with a bad key",
    );
    assert_eq!(dst.read(0, 4096), vec![0; 4096]);
    dst.assert_canaries();
    // The connection still works afterwards.
    let c = p.read_once(dst.local(0, 4096), src.remote(0, 4096));
    assert_eq!(c.result, Ok(4096));
    assert_eq!(dst.read(0, 4096), vec![0x55; 4096]);
}

/// A READ past the end of the owner's region fails; nothing of the initiator changes.
pub fn read_out_of_bounds_fails<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = read_pair(make, opts);
    let dst = Canaried::with(opts.alloc, &mut p.a, 8192, Access::LOCAL_WRITE, 0);
    let src = Canaried::with(opts.alloc, &mut p.b, 4096, Access::REMOTE_READ, 0x66);
    let mut oob = src.remote(4000, 200);
    oob.len = 200;
    let c = p.read_once(dst.local(0, 200), oob);
    assert_remote_error(
        &c,
        opts.exact_remote_errors,
        |e| matches!(e, OpError::OutOfBounds { .. }),
        "read oob",
    );
    let mut huge = src.remote(u64::MAX - 10, 100);
    huge.len = 100;
    let c = p.read_once(dst.local(0, 100), huge);
    assert_remote_error(
        &c,
        opts.exact_remote_errors,
        |e| matches!(e, OpError::OutOfBounds { .. }),
        "read at an overflowing offset",
    );
    assert_eq!(dst.read(0, 8192), vec![0; 8192]);
    dst.assert_canaries();
}

/// A READ of a region registered without REMOTE_READ (but with REMOTE_WRITE) fails.
pub fn read_without_permission_fails<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    assert!(
        opts.enforces_permissions,
        "SuiteOptions say this backend does not enforce remote permissions: list this case \
         under `ignore` in its read_conformance_suite!, with the reason"
    );
    let mut p = read_pair(make, opts);
    let dst = Canaried::with(opts.alloc, &mut p.a, 4096, Access::LOCAL_WRITE, 0);
    let src = Canaried::with(opts.alloc, &mut p.b, 4096, Access::REMOTE_WRITE, 0x77);
    let c = p.read_once(dst.local(0, 4096), src.remote(0, 4096));
    assert_remote_error(
        &c,
        opts.exact_remote_errors,
        |e| matches!(e, OpError::PermissionDenied),
        "read permission",
    );
    assert_eq!(dst.read(0, 4096), vec![0; 4096]);
    dst.assert_canaries();
}

/// A READ with the key of a deregistered region fails.
pub fn read_after_deregister_fails<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = read_pair(make, opts);
    let dst = Canaried::with(opts.alloc, &mut p.a, 4096, Access::LOCAL_WRITE, 0);
    let src = Canaried::with(opts.alloc, &mut p.b, 4096, Access::REMOTE_READ, 0x77);
    let c = p.read_once(dst.local(0, 16), src.remote(0, 16));
    assert_eq!(c.result, Ok(16));
    p.b.deregister(src.reg.local).expect("deregister");
    let c = p.read_once(dst.local(0, 4096), src.remote(0, 4096));
    assert_remote_error(
        &c,
        opts.exact_remote_errors,
        |e| matches!(e, OpError::RemoteKeyInvalid(_)),
        "read with a stale key",
    );
    assert_eq!(dst.read(16, 4080), vec![0; 4080]);
    dst.assert_canaries();
}

/// Local mistakes of a READ fail the post call itself, with nothing posted.
pub fn read_local_errors_fail_at_post<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = read_pair(make, opts);
    let dst = Canaried::with(opts.alloc, &mut p.a, 4096, Access::LOCAL_WRITE, 0);
    let no_write = Canaried::with(opts.alloc, &mut p.a, 4096, Access::NONE, 0);
    let src = Canaried::with(opts.alloc, &mut p.b, 4096, Access::REMOTE_READ, 0x12);
    let peer = p.b_at_a;
    let mut bogus = dst.local(0, 16);
    bogus.key.0 += 1000;
    assert!(
        p.a.post_read(peer, wr(0), bogus, src.remote(0, 16))
            .is_err(),
        "unknown local key"
    );
    assert!(
        p.a.post_read(peer, wr(0), dst.local(4090, 16), src.remote(0, 16))
            .is_err(),
        "local oob"
    );
    assert!(
        p.a.post_read(peer, wr(0), dst.local(0, 16), src.remote(0, 32))
            .is_err(),
        "length mismatch"
    );
    assert!(
        p.a.post_read(peer, wr(0), no_write.local(0, 16), src.remote(0, 16))
            .is_err(),
        "read into a region without LOCAL_WRITE"
    );
    assert!(
        p.a.post_read(PeerId(999_999), wr(0), dst.local(0, 16), src.remote(0, 16))
            .is_err(),
        "unknown peer"
    );
    for _ in 0..100 {
        p.step();
    }
    assert!(
        p.done_a.is_empty(),
        "rejected posts must not complete: {:?}",
        p.done_a
    );
    assert_eq!(dst.read(0, 4096), vec![0; 4096]);
    assert_eq!(no_write.read(0, 4096), vec![0; 4096]);
}

/// Removing a peer with READs in flight completes every one (success, with its bytes
/// placed, or `PeerRemoved`), and later READs from it fail.
pub fn read_remove_peer_with_ops_in_flight<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = read_pair(make, opts);
    let n = 64u64;
    let page = 65536u64;
    let dst = Canaried::with(opts.alloc, &mut p.a, page * n, Access::LOCAL_WRITE, 0);
    let src = Canaried::with(opts.alloc, &mut p.b, page * n, Access::REMOTE_READ, 0);
    let data = pattern(61, (page * n) as usize);
    src.write(0, &data);
    let peer = p.b_at_a;
    let mut posted = 0;
    for i in 0..n as usize {
        let at = i as u64 * page;
        match p
            .a
            .post_read(peer, wr(i), dst.local(at, page), src.remote(at, page))
        {
            Ok(PostOutcome::Posted) => posted += 1,
            Ok(PostOutcome::NoRoom) => break,
            Err(e) => panic!("post {i}: {e}"),
        }
    }
    assert!(posted > 0);
    // Let some of them start moving (the owner serves them in its poll).
    p.step();
    p.a.remove_peer(peer).expect("remove_peer");
    let done = p.take_a(posted, "completions of all posted reads");
    for c in &done {
        let i = (c.wr_id.0 - 1000) as usize;
        let at = i * page as usize;
        match &c.result {
            Ok(len) => {
                assert_eq!(*len, page);
                assert!(
                    dst.read(at as u64, page as usize) == data[at..at + page as usize],
                    "read {i} completed before its bytes were placed"
                );
            }
            Err(OpError::PeerRemoved(_)) => {}
            Err(e) => panic!("unexpected error after removal: {e:?}"),
        }
    }
    let mut ids: Vec<_> = done.iter().map(|c| c.wr_id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), posted, "every read completes exactly once");
    assert!(
        p.a.post_read(peer, wr(0), dst.local(0, 1), src.remote(0, 1))
            .is_err()
    );
    // The same address can be added again and reads work.
    let again = p.a.add_peer(&p.b.address()).expect("re-add");
    p.b_at_a = again;
    let c = p.read_once(dst.local(0, 100), src.remote(0, 100));
    assert_eq!(c.result, Ok(100));
    assert_eq!(dst.read(0, 100), data[..100]);
    dst.assert_canaries();
}

/// Thousands of READs in flight, all complete and land.
pub fn read_many_in_flight<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = read_pair(make, opts);
    let n = opts.many;
    let page = 1024u64;
    let dst = Canaried::with(
        opts.alloc,
        &mut p.a,
        page * n as u64,
        Access::LOCAL_WRITE,
        0,
    );
    let src = Canaried::with(
        opts.alloc,
        &mut p.b,
        page * n as u64,
        Access::REMOTE_READ,
        0,
    );
    let data = pattern(98, (page * n as u64) as usize);
    src.write(0, &data);
    let peer = p.b_at_a;
    let mut done = Vec::new();
    for i in 0..n {
        // Reverse order on the owner, so that nothing is accidentally contiguous.
        let j = (n - 1 - i) as u64;
        p.post_a(|t| {
            t.post_read(
                peer,
                wr(i),
                dst.local(j * page, page),
                src.remote(j * page, page),
            )
        });
        done.append(&mut p.done_a);
    }
    let rest = n - done.len();
    done.extend(p.take_a(rest, "all read completions"));
    assert!(
        done.iter().all(|c| c.result == Ok(page)),
        "all reads succeed"
    );
    let mut ids: Vec<_> = done.iter().map(|c| c.wr_id.0).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), n);
    assert!(dst.read(0, data.len()) == data, "initiator bytes differ");
    dst.assert_canaries();
}

/// A zero-length READ completes with 0 bytes and changes nothing; a READ of the largest
/// size (the backend's maximum, at most 16 MiB) lands whole.
pub fn read_zero_and_large<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = read_pair(make, opts);
    let big = p.a.limits().max_msg_size.min(16 << 20);
    let dst = Canaried::with(opts.alloc, &mut p.a, big, Access::LOCAL_WRITE, 0);
    let src = Canaried::with(opts.alloc, &mut p.b, big, Access::REMOTE_READ, 0);
    let data = pattern(4, big as usize);
    src.write(0, &data);
    let c = p.read_once(dst.local(0, 0), src.remote(0, 0));
    assert_eq!(c.result, Ok(0));
    assert_eq!(dst.read(0, 16), vec![0; 16]);
    let c = p.read_once(dst.local(0, big), src.remote(0, big));
    assert_eq!(c.result, Ok(big));
    assert!(dst.read(0, big as usize) == data, "large read landed wrong");
    dst.assert_canaries();
    // One byte more than the local region holds: refused at post.
    let peer = p.b_at_a;
    let r =
        p.a.post_read(peer, wr(9), dst.local(0, big + 1), src.remote(0, big + 1));
    assert!(
        r.is_err(),
        "a read past the local region was accepted: {r:?}"
    );
    for _ in 0..10 {
        p.step();
    }
    assert!(
        p.done_a.is_empty(),
        "a refused read completed: {:?}",
        p.done_a
    );
}

/// READs and WRITEs mixed on one connection, in flight together: all land; and a READ
/// posted after a WRITE's completion sees that WRITE's bytes.
pub fn read_write_mixed_traffic<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = read_pair(make, opts);
    let page = 16 * 1024u64;
    let n = 128usize;
    let len = page * n as u64;
    // a: `out` is written to b, `back` receives the reads.
    let out = Canaried::with(opts.alloc, &mut p.a, len, Access::NONE, 0);
    let back = Canaried::with(opts.alloc, &mut p.a, len, Access::LOCAL_WRITE, 0);
    // b: `sink` takes the writes, `source` is read.
    let sink = Canaried::with(
        opts.alloc,
        &mut p.b,
        len,
        Access::REMOTE_WRITE | Access::REMOTE_READ,
        0,
    );
    let source = Canaried::with(opts.alloc, &mut p.b, len, Access::REMOTE_READ, 0);
    let wdata = pattern(71, len as usize);
    let rdata = pattern(72, len as usize);
    out.write(0, &wdata);
    source.write(0, &rdata);
    let peer = p.b_at_a;
    for i in 0..n {
        let at = i as u64 * page;
        if i % 2 == 0 {
            p.post_a(|t| {
                t.post_write(
                    peer,
                    wr(i),
                    out.local(at, page),
                    sink.remote(at, page),
                    None,
                )
            });
            p.post_a(|t| {
                t.post_read(
                    peer,
                    wr(n + i),
                    back.local(at, page),
                    source.remote(at, page),
                )
            });
        } else {
            p.post_a(|t| {
                t.post_read(
                    peer,
                    wr(n + i),
                    back.local(at, page),
                    source.remote(at, page),
                )
            });
            p.post_a(|t| {
                t.post_write(
                    peer,
                    wr(i),
                    out.local(at, page),
                    sink.remote(at, page),
                    None,
                )
            });
        }
    }
    let done = p.take_a(2 * n, "all write and read completions");
    assert!(
        done.iter().all(|c| c.result == Ok(page)),
        "all succeed: {:?}",
        done.iter().find(|c| c.result != Ok(page))
    );
    let mut ids: Vec<_> = done.iter().map(|c| c.wr_id.0).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 2 * n);
    assert!(sink.read(0, len as usize) == wdata, "written bytes differ");
    assert!(back.read(0, len as usize) == rdata, "read bytes differ");
    // Read back what a completed write placed.
    p.post_a(|t| {
        t.post_write(
            peer,
            wr(0),
            out.local(0, page),
            sink.remote(page, page),
            None,
        )
    });
    let w = p.take_a(1, "write completion").remove(0);
    assert_eq!(w.result, Ok(page));
    let c = p.read_once(back.local(0, page), sink.remote(page, page));
    assert_eq!(c.result, Ok(page));
    assert!(
        back.read(0, page as usize) == wdata[..page as usize],
        "a read missed a completed write"
    );
    for c in [&out, &back, &sink, &source] {
        c.assert_canaries();
    }
}

/// An owner that only alternates `wait` and `poll` (as an idle engine does) serves the
/// reads: the application at the owner does nothing else.
pub fn read_idle_owner_serves_through_wait<T: Transport>(make: &dyn Fn() -> T, opts: SuiteOptions) {
    let mut p = read_pair(make, opts);
    let page = 65536u64;
    let n = 64u64;
    let dst = Canaried::with(opts.alloc, &mut p.a, page * n, Access::LOCAL_WRITE, 0);
    let src = Canaried::with(opts.alloc, &mut p.b, page * n, Access::REMOTE_READ, 0);
    let data = pattern(18, (page * n) as usize);
    src.write(0, &data);
    let peer = p.b_at_a;
    let deadline = Instant::now() + opts.timeout;
    let mut posted = 0u64;
    while p.done_a.len() < n as usize {
        assert!(
            Instant::now() < deadline,
            "no progress with an owner driven by wait + poll"
        );
        if posted < n {
            let at = posted * page;
            let r =
                p.a.post_read(
                    peer,
                    wr(posted as usize),
                    dst.local(at, page),
                    src.remote(at, page),
                )
                .expect("post_read");
            if r == PostOutcome::Posted {
                posted += 1;
            }
        }
        p.a.poll(&mut p.done_a).expect("poll a");
        p.b.wait(Duration::from_millis(5)).expect("wait b");
        p.b.poll(&mut p.done_b).expect("poll b");
    }
    assert!(
        p.done_a.iter().all(|c| c.result == Ok(page)),
        "all reads succeed"
    );
    assert!(
        p.done_b.is_empty(),
        "the owner saw completions: {:?}",
        p.done_b
    );
    assert!(dst.read(0, data.len()) == data, "initiator bytes differ");
    dst.assert_canaries();
}

/// Generates one `#[test]` per READ conformance case, as
/// [`conformance_suite!`](crate::conformance_suite) does for the others (same arguments,
/// same `@cases ...; ignore ...` form). A backend opts in once its
/// [`Transport::supports_read`] is true.
#[macro_export]
macro_rules! read_conformance_suite {
    ($make:expr, $opts:expr) => {
        $crate::conformance_suite!(@cases $make, $opts;
            read_lands_in_initiator, read_bad_remote_key_fails, read_out_of_bounds_fails,
            read_without_permission_fails, read_after_deregister_fails,
            read_local_errors_fail_at_post, read_remove_peer_with_ops_in_flight,
            read_many_in_flight, read_zero_and_large, read_write_mixed_traffic,
            read_idle_owner_serves_through_wait);
    };
    (@cases $($rest:tt)*) => {
        $crate::conformance_suite!(@cases $($rest)*);
    };
}

/// Generates one `#[test]` per conformance case for a backend.
///
/// `$make` is an expression of type `impl Fn() -> T`; `$opts` a [`SuiteOptions`].
/// `conformance_suite!(make, opts)` runs every case. A backend that cannot pass some case
/// names the cases it runs and those it cannot, each with its reason, so that `cargo test`
/// counts them as ignored (and `--include-ignored` shows how they fail):
///
/// ```text
/// fabric_core::conformance_suite!(@cases make, opts; write_with_imm, write_without_imm;
///     ignore bad_remote_key_fails = "the provider never completes a write with a bad key");
/// ```
#[macro_export]
macro_rules! conformance_suite {
    ($make:expr, $opts:expr) => {
        $crate::conformance_suite!(@cases $make, $opts;
            send_recv_order_and_lengths, send_before_recv_is_posted, recv_too_small_is_truncated,
            write_without_imm, write_with_imm, bad_remote_key_fails, out_of_bounds_write_fails,
            write_without_permission_fails, write_after_deregister_fails, local_errors_fail_at_post,
            remove_peer_with_ops_in_flight, many_operations_in_flight, zero_and_large_segments,
            idle_target_progresses_through_wait, strided_writes_land_their_rows);
    };
    (@cases $make:expr, $opts:expr; $($case:ident),* $(,)?
        ; ignore $($ignored:ident = $why:literal),* $(,)?) => {
        $crate::conformance_suite!(@cases $make, $opts; $($case),*);
        $(
            #[test]
            #[ignore = $why]
            fn $ignored() {
                let make = $make;
                $crate::testing::$ignored(&make, $opts);
            }
        )*
    };
    (@cases $make:expr, $opts:expr; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let make = $make;
                $crate::testing::$case(&make, $opts);
            }
        )*
    };
}

/// Polls `cond` until it holds, panicking with `what` once `within` has passed: for a state
/// that tests can only observe by looking (a counter, a peer's state), never as a stand-in
/// for an event they could wait on.
pub fn eventually(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether a [`StuckTransport`]'s `poll` hangs: shut it, and the next `poll` blocks (as a
/// provider call the engine cannot interrupt) until it is opened again.
#[derive(Debug, Default)]
pub struct StuckGate {
    /// Whether it is shut, and how many polls hang in it now.
    state: std::sync::Mutex<(bool, usize)>,
    changed: std::sync::Condvar,
}

impl StuckGate {
    fn lock(&self) -> std::sync::MutexGuard<'_, (bool, usize)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the next `poll` hang.
    pub fn shut(&self) {
        self.lock().0 = true;
    }

    /// Lets a hanging `poll` (and every later one) return.
    pub fn open(&self) {
        self.lock().0 = false;
        self.changed.notify_all();
    }

    /// Whether a `poll` hangs in the gate now (the worker is stuck in its transport).
    pub fn hanging(&self) -> bool {
        self.lock().1 > 0
    }

    /// Blocks while the gate is shut.
    fn pass(&self) {
        let mut state = self.lock();
        state.1 += 1;
        while state.0 {
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        state.1 -= 1;
    }
}

/// The in-memory transport, with a `poll` that hangs while its [`StuckGate`] is shut: a
/// worker stuck in its transport, for tests of shutdown and of memory that must outlive a
/// transport that may still touch it.
pub struct StuckTransport {
    inner: crate::mem::MemTransport,
    gate: Arc<StuckGate>,
}

impl StuckTransport {
    /// A transport whose `poll` passes `gate`.
    pub fn new(gate: Arc<StuckGate>) -> StuckTransport {
        StuckTransport {
            inner: crate::mem::MemTransport::new(),
            gate,
        }
    }
}

impl Transport for StuckTransport {
    fn name(&self) -> &'static str {
        "stuck"
    }
    fn address(&self) -> Vec<u8> {
        self.inner.address()
    }
    fn limits(&self) -> crate::TransportLimits {
        self.inner.limits()
    }
    fn add_peer(&mut self, a: &[u8]) -> crate::Result<PeerId> {
        self.inner.add_peer(a)
    }
    fn remove_peer(&mut self, p: PeerId) -> crate::Result<()> {
        self.inner.remove_peer(p)
    }
    fn register(&mut self, m: Arc<dyn MemoryRegion>, a: Access) -> crate::Result<Registration> {
        self.inner.register(m, a)
    }
    fn deregister(&mut self, k: crate::LocalKey) -> crate::Result<()> {
        self.inner.deregister(k)
    }
    fn post_send(
        &mut self,
        p: PeerId,
        w: WorkRequestId,
        s: LocalSlice,
        i: Option<u32>,
    ) -> crate::Result<PostOutcome> {
        self.inner.post_send(p, w, s, i)
    }
    fn post_recv(&mut self, w: WorkRequestId, d: LocalSlice) -> crate::Result<PostOutcome> {
        self.inner.post_recv(w, d)
    }
    fn post_write(
        &mut self,
        p: PeerId,
        w: WorkRequestId,
        s: LocalSlice,
        d: RemoteSlice,
        i: Option<u32>,
    ) -> crate::Result<PostOutcome> {
        self.inner.post_write(p, w, s, d, i)
    }
    fn poll(&mut self, out: &mut Vec<Completion>) -> crate::Result<usize> {
        self.gate.pass();
        self.inner.poll(out)
    }
}
