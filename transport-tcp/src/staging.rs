//! Staging for memory the CPU cannot address (GPU memory): a bounded ring of host memory per
//! connection and direction, filled and drained by copies that run while the socket moves
//! other bytes of the same ring.
//!
//! The ring is addressed by byte counters that only grow (`head`, `ready`, `tail`); a
//! counter's place in the staging buffer is `counter % size`. Bytes are given out in order:
//!
//! ```text
//!   tail ........ ready ........ marked ........ head
//!   |  copied, still in use |  copies queued   |  queued, not yet marked
//! ```
//!
//! The source queues device-to-staging copies, marks them every [`CHUNK`] bytes (a CUDA
//! event), and sends a byte once the mark after it has completed (`ready`); the byte's room
//! is free again once the socket took it (`tail`). The target reads payloads into the ring,
//! queues staging-to-device copies at once, and acknowledges a WRITE (and reports its
//! immediate data) only once the mark after its last byte has completed; then its room is
//! free again.
//!
//! A [`CopyEngine`] makes the copies: [`CudaEngine`] with asynchronous copies through pinned
//! memory (one copy-kernel launch per mark where the kernel loads), or [`RegionEngine`]
//! through the region's own batched copy
//! methods, run when the engine is polled (memory that only claims to be a device's, such as
//! the fake devices of the tests, or CUDA memory the driver does not know).

use crate::error::TcpError;
use fabric_core::{HostBuffer, MemoryLocation, MemoryRegion};
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::Arc;

/// Bytes of staging per connection and direction.
pub(crate) const RING: usize = 8 << 20;
/// Copies are marked at least every this many bytes: the first chunk can leave (or be
/// acknowledged) while the next one is copied.
pub(crate) const CHUNK: usize = 1 << 20;

/// How the bytes of a region that has no host pointer are copied.
#[derive(Clone, Debug)]
pub(crate) enum Via {
    /// Asynchronous copies on a CUDA stream of this device, through pinned staging.
    Cuda(gpu_mem::Device),
    /// The region's own (synchronous, batched) copy methods.
    Region,
}

impl Via {
    fn same(&self, other: &Via) -> bool {
        match (self, other) {
            (Via::Cuda(a), Via::Cuda(b)) => a.ordinal() == b.ordinal(),
            (Via::Region, Via::Region) => true,
            _ => false,
        }
    }
}

/// The CUDA driver as a transport found it (probed once, when the first region that claims
/// to be device memory is registered).
#[derive(Default)]
pub(crate) enum CudaProbe {
    #[default]
    Unprobed,
    Absent,
    Present(gpu_mem::Cuda, Vec<gpu_mem::Device>),
}

impl CudaProbe {
    /// How to copy `mem`: through CUDA when the driver knows its whole range as memory of
    /// the device it claims, through its own copy methods otherwise.
    pub fn via_for(&mut self, mem: &dyn MemoryRegion) -> Via {
        let MemoryLocation::Cuda { device: ordinal } = mem.location() else {
            return Via::Region;
        };
        if let CudaProbe::Unprobed = self {
            *self = match gpu_mem::Cuda::probe() {
                Ok(Some(cuda)) => CudaProbe::Present(cuda, Vec::new()),
                Ok(None) => CudaProbe::Absent,
                Err(e) => {
                    tracing::warn!(error = %e, "CUDA present but unusable: device memory is copied through its region");
                    CudaProbe::Absent
                }
            };
        }
        let CudaProbe::Present(cuda, devices) = self else {
            return Via::Region;
        };
        let device = match devices.iter().find(|d| d.ordinal() == ordinal) {
            Some(d) => d.clone(),
            None => match cuda.device(ordinal) {
                Ok(d) => {
                    devices.push(d.clone());
                    d
                }
                Err(e) => {
                    tracing::debug!(ordinal, error = %e, "no such CUDA device: copying through the region");
                    return Via::Region;
                }
            },
        };
        match device.holds_range(mem.device_addr(), mem.len() as u64) {
            Ok(true) => Via::Cuda(device),
            Ok(false) => Via::Region,
            Err(e) => {
                tracing::debug!(ordinal, error = %e, "cannot look the region up: copying through it");
                Via::Region
            }
        }
    }
}

/// Copies between device regions and a staging buffer, in the order they were queued, with
/// marks that report when the copies before them have finished.
pub(crate) trait CopyEngine: Send {
    /// The staging buffer: [`RING`] bytes the CPU addresses, valid while the engine lives.
    fn staging(&self) -> NonNull<u8>;
    /// Queues a copy of `len` bytes of `src` at `src_offset` into staging at `at`.
    fn copy_out(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        src_offset: u64,
        at: usize,
        len: usize,
    ) -> Result<(), TcpError>;
    /// Queues a copy of `len` staging bytes at `at` into `dst` at `dst_offset`.
    fn copy_in(
        &mut self,
        at: usize,
        dst: &Arc<dyn MemoryRegion>,
        dst_offset: u64,
        len: usize,
    ) -> Result<(), TcpError>;
    /// Marks the copies queued so far.
    fn mark(&mut self) -> Result<(), TcpError>;
    /// How many more marks, oldest first, have completed (never waits).
    fn poll_marks(&mut self) -> Result<usize, TcpError>;
}

/// CUDA copies through pinned staging, batched per mark: one launch of gpu-mem's copy
/// kernel moves every page queued since the last mark (see [`gpu_mem::StagedCopies`]),
/// instead of one driver call per page, which contended on the context's locks once several
/// rails shared a process.
struct CudaEngine {
    copies: gpu_mem::StagedCopies,
}

impl CopyEngine for CudaEngine {
    fn staging(&self) -> NonNull<u8> {
        self.copies
            .staging()
            .host_ptr()
            .expect("pinned memory has a host pointer")
    }

    fn copy_out(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        src_offset: u64,
        at: usize,
        len: usize,
    ) -> Result<(), TcpError> {
        self.copies
            .copy_out(src, src_offset, at as u64, len as u64)
            .map_err(|e| TcpError::CopyOut(e.into()))
    }

    fn copy_in(
        &mut self,
        at: usize,
        dst: &Arc<dyn MemoryRegion>,
        dst_offset: u64,
        len: usize,
    ) -> Result<(), TcpError> {
        self.copies
            .copy_in(at as u64, dst, dst_offset, len as u64)
            .map_err(|e| TcpError::CopyIn(e.into()))
    }

    fn mark(&mut self) -> Result<(), TcpError> {
        self.copies
            .mark()
            .map_err(|e| TcpError::StartCopies(e.into()))
    }

    fn poll_marks(&mut self) -> Result<usize, TcpError> {
        self.copies
            .poll_marks()
            .map_err(|e| TcpError::CopyFailed(e.into()))
    }
}

/// One queued copy of a [`RegionEngine`].
struct RegionCopy {
    region: Arc<dyn MemoryRegion>,
    offset: u64,
    at: usize,
    len: usize,
    out: bool,
}

/// Copies through the region's own batched copy methods, run when the engine is polled:
/// a poll makes one `read_many_to_host` / `write_many_from_host` call per region and
/// direction for the copies it runs.
///
/// Like a device's copies, they complete some time after the call that queued them: a poll
/// runs (and reports the marks of) the copies queued before the previous poll, so the
/// connection's pipeline runs as it does on a GPU, and a byte sent (or acknowledged) before
/// its copy has completed is a stale byte the tests see.
pub(crate) struct RegionEngine {
    staging: HostBuffer,
    /// Copies queued since the last poll, and the marks after them.
    queued: Vec<RegionCopy>,
    marks: usize,
    /// Copies (and marks) queued before the last poll: the next poll runs them.
    due: Vec<RegionCopy>,
    due_marks: usize,
}

impl RegionEngine {
    pub fn new() -> Result<RegionEngine, TcpError> {
        Ok(RegionEngine {
            staging: HostBuffer::new(RING).map_err(|e| TcpError::StagingAlloc(e.into()))?,
            queued: Vec::new(),
            marks: 0,
            due: Vec::new(),
            due_marks: 0,
        })
    }

    fn run(&mut self) -> Result<(), TcpError> {
        let queued = std::mem::take(&mut self.due);
        let base = self.staging();
        let mut i = 0;
        while i < queued.len() {
            let (region, out) = (&queued[i].region, queued[i].out);
            let mut j = i;
            while j < queued.len() && queued[j].out == out && Arc::ptr_eq(&queued[j].region, region)
            {
                j += 1;
            }
            let run = &queued[i..j];
            if out {
                let mut parts: Vec<(u64, &mut [u8])> = run
                    .iter()
                    .map(|c| {
                        // SAFETY: `at..at + len` lies inside the staging buffer (the ring
                        // gives out ranges below RING) and belongs to this copy alone: the
                        // ring hands each range to one copy, and nobody reads it before the
                        // mark after it is reported complete, which happens after this call.
                        let s = unsafe {
                            std::slice::from_raw_parts_mut(base.as_ptr().add(c.at), c.len)
                        };
                        (c.offset, s)
                    })
                    .collect();
                region
                    .read_many_to_host(&mut parts)
                    .map_err(|e| TcpError::CopyOut(e.into()))?;
            } else {
                let parts: Vec<(u64, &[u8])> = run
                    .iter()
                    .map(|c| {
                        // SAFETY: as above; the range holds bytes read from the socket, which
                        // nothing writes again until the mark after it is reported complete.
                        let s =
                            unsafe { std::slice::from_raw_parts(base.as_ptr().add(c.at), c.len) };
                        (c.offset, s)
                    })
                    .collect();
                region
                    .write_many_from_host(&parts)
                    .map_err(|e| TcpError::CopyIn(e.into()))?;
            }
            i = j;
        }
        Ok(())
    }
}

impl CopyEngine for RegionEngine {
    fn staging(&self) -> NonNull<u8> {
        self.staging.host_ptr().expect("host memory")
    }

    fn copy_out(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        src_offset: u64,
        at: usize,
        len: usize,
    ) -> Result<(), TcpError> {
        self.queued.push(RegionCopy {
            region: src.clone(),
            offset: src_offset,
            at,
            len,
            out: true,
        });
        Ok(())
    }

    fn copy_in(
        &mut self,
        at: usize,
        dst: &Arc<dyn MemoryRegion>,
        dst_offset: u64,
        len: usize,
    ) -> Result<(), TcpError> {
        self.queued.push(RegionCopy {
            region: dst.clone(),
            offset: dst_offset,
            at,
            len,
            out: false,
        });
        Ok(())
    }

    fn mark(&mut self) -> Result<(), TcpError> {
        self.marks += 1;
        Ok(())
    }

    fn poll_marks(&mut self) -> Result<usize, TcpError> {
        self.run()?;
        let done = std::mem::take(&mut self.due_marks);
        self.due = std::mem::take(&mut self.queued);
        self.due_marks = std::mem::take(&mut self.marks);
        Ok(done)
    }
}

/// Makes the engine for `via`.
fn engine_for(via: &Via) -> Result<Box<dyn CopyEngine>, TcpError> {
    match via {
        Via::Region => Ok(Box::new(RegionEngine::new()?)),
        Via::Cuda(device) => {
            let staging = Arc::new(
                device
                    .alloc_pinned(RING)
                    .map_err(|e| TcpError::StagingAlloc(e.into()))?,
            );
            // The best copy method here (the copy kernel where it loads), unless
            // XFER_TCP_GPU_COPY=stream asks for one driver copy per page.
            let copies = if std::env::var("XFER_TCP_GPU_COPY").as_deref() == Ok("stream") {
                gpu_mem::StagedCopies::with_method(device, staging, gpu_mem::CopyMethod::Memcpy)
            } else {
                gpu_mem::StagedCopies::new(device, staging)
            }
            .map_err(|e| TcpError::CopySetup(e.into()))?;
            tracing::debug!(method = copies.method().name(), "staging copies");
            Ok(Box::new(CudaEngine { copies }))
        }
    }
}

/// A staging ring and the engine that copies through it. See the module documentation.
pub(crate) struct Ring {
    engine: Box<dyn CopyEngine>,
    via: Via,
    size: usize,
    /// Bytes given out.
    pub head: u64,
    /// Bytes whose copies have completed.
    pub ready: u64,
    /// Bytes whose room is free again.
    pub tail: u64,
    /// `head` when the last mark was made.
    marked: u64,
    /// Where each incomplete mark was made, oldest first.
    marks: VecDeque<u64>,
}

impl Ring {
    /// A ring copying through `via`.
    pub fn new(via: &Via) -> Result<Ring, TcpError> {
        Ring::with_engine(via.clone(), engine_for(via)?, RING)
    }

    /// A ring over `size` bytes of `engine`'s staging (at most [`RING`]).
    pub fn with_engine(
        via: Via,
        engine: Box<dyn CopyEngine>,
        size: usize,
    ) -> Result<Ring, TcpError> {
        debug_assert!(size > 0 && size <= RING);
        Ok(Ring {
            engine,
            via,
            size,
            head: 0,
            ready: 0,
            tail: 0,
            marked: 0,
            marks: VecDeque::new(),
        })
    }

    /// Makes `ring` copy through `via`: kept when it already does, replaced when it is idle
    /// (counters carry on, so that positions given out stay comparable). False when a ring
    /// for another engine still has bytes in use: wait for it to drain.
    pub fn ensure(ring: &mut Option<Ring>, via: &Via) -> Result<bool, TcpError> {
        match ring {
            Some(r) if r.via.same(via) => Ok(true),
            Some(r) if !r.idle() => Ok(false),
            _ => {
                let at = ring.as_ref().map_or(0, |r| r.head);
                let mut r = Ring::new(via)?;
                (r.head, r.ready, r.tail, r.marked) = (at, at, at, at);
                *ring = Some(r);
                Ok(true)
            }
        }
    }

    /// Whether the ring copies through `via`.
    pub fn copies_via(&self, via: &Via) -> bool {
        self.via.same(via)
    }

    /// No byte in use and no copy in flight.
    pub fn idle(&self) -> bool {
        self.tail == self.head && self.marks.is_empty()
    }

    /// Copies queued whose completion is not yet known.
    pub fn busy(&self) -> bool {
        !self.marks.is_empty() || self.marked != self.head
    }

    /// Free bytes.
    pub fn free(&self) -> usize {
        self.size - (self.head - self.tail) as usize
    }

    /// Free bytes from `at` (a counter at or after `head`) up to the end of the buffer or
    /// the first byte in use, whichever comes first; `used` bytes after `head` are taken.
    pub fn contiguous(&self, used: usize) -> usize {
        let at = self.head + used as u64;
        let to_end = self.size - (at % self.size as u64) as usize;
        self.free().saturating_sub(used).min(to_end)
    }

    /// The staging address of counter `at`.
    pub fn ptr(&self, at: u64) -> *mut u8 {
        // SAFETY: `at % size` is below `size`, which is at most the staging buffer's length.
        unsafe {
            self.engine
                .staging()
                .as_ptr()
                .add((at % self.size as u64) as usize)
        }
    }

    /// Up to `len` copied bytes from counter `at`, as far as the end of the buffer.
    /// `at..at + len` must lie between `tail` and `ready`.
    pub fn ready_slice(&self, at: u64, len: usize) -> &[u8] {
        assert!(
            at >= self.tail && at + len as u64 <= self.ready,
            "only copied bytes in use are read"
        );
        let n = len.min(self.size - (at % self.size as u64) as usize);
        // SAFETY: the bytes lie inside the staging buffer (n stops at its end); they are
        // between tail and ready: their copies have completed, and no copy writes them again
        // until tail has passed them, which takes `&mut self` while this borrow lives.
        unsafe { std::slice::from_raw_parts(self.ptr(at), n) }
    }

    /// Gives out `len` bytes (the caller checked `free`) and queues their copy from `src`,
    /// split where the buffer wraps; returns the counter of the first.
    pub fn copy_out(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        mut src_offset: u64,
        len: usize,
    ) -> Result<u64, TcpError> {
        debug_assert!(len <= self.free());
        let start = self.head;
        let mut left = len;
        while left > 0 {
            let phys = (self.head % self.size as u64) as usize;
            let n = left.min(self.size - phys);
            self.engine.copy_out(src, src_offset, phys, n)?;
            self.head += n as u64;
            src_offset += n as u64;
            left -= n;
        }
        self.mark_if(false)?;
        Ok(start)
    }

    /// Takes `len` bytes at `head` that the caller has filled (they lie before the end of
    /// the buffer: see [`contiguous`](Self::contiguous)) and queues their copy into `dst`.
    pub fn copy_in(
        &mut self,
        dst: &Arc<dyn MemoryRegion>,
        dst_offset: u64,
        len: usize,
    ) -> Result<(), TcpError> {
        let phys = (self.head % self.size as u64) as usize;
        debug_assert!(len <= self.contiguous(0));
        self.head += len as u64;
        self.engine.copy_in(phys, dst, dst_offset, len)?;
        self.mark_if(false)
    }

    /// Marks the copies queued since the last mark, when there are `CHUNK` bytes of them
    /// (or any, when `force`).
    pub fn mark_if(&mut self, force: bool) -> Result<(), TcpError> {
        let unmarked = self.head - self.marked;
        if unmarked > 0 && (force || unmarked >= CHUNK as u64) {
            self.engine.mark()?;
            self.marks.push_back(self.head);
            self.marked = self.head;
        }
        Ok(())
    }

    /// Learns which marks have completed (never waits) and moves `ready` past them.
    pub fn poll(&mut self) -> Result<(), TcpError> {
        if self.marks.is_empty() {
            return Ok(());
        }
        for _ in 0..self.engine.poll_marks()? {
            if let Some(at) = self.marks.pop_front() {
                self.ready = at;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_core::MemoryError;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// An engine whose copies complete only when the test says so, and which fails the
    /// copy-out of a chosen source offset.
    struct Manual {
        staging: HostBuffer,
        marks: usize,
        complete: Arc<AtomicUsize>,
        fail_at: Option<u64>,
    }

    impl CopyEngine for Manual {
        fn staging(&self) -> NonNull<u8> {
            self.staging.host_ptr().unwrap()
        }
        fn copy_out(
            &mut self,
            src: &Arc<dyn MemoryRegion>,
            off: u64,
            at: usize,
            len: usize,
        ) -> Result<(), TcpError> {
            if self.fail_at == Some(off) {
                return Err(TcpError::CopyOut(MemoryError::device("copy failed").into()));
            }
            let mut buf = vec![0u8; len];
            src.read_to_host(off, &mut buf)
                .map_err(|e| TcpError::CopyOut(e.into()))?;
            self.staging
                .write(at as u64, &buf)
                .map_err(|e| TcpError::CopyOut(e.into()))
        }
        fn copy_in(
            &mut self,
            _: usize,
            _: &Arc<dyn MemoryRegion>,
            _: u64,
            _: usize,
        ) -> Result<(), TcpError> {
            Ok(())
        }
        fn mark(&mut self) -> Result<(), TcpError> {
            self.marks += 1;
            Ok(())
        }
        fn poll_marks(&mut self) -> Result<usize, TcpError> {
            let n = self.complete.load(Ordering::Relaxed).min(self.marks);
            self.complete.fetch_sub(n, Ordering::Relaxed);
            self.marks -= n;
            Ok(n)
        }
    }

    fn manual_ring(size: usize, fail_at: Option<u64>) -> (Ring, Arc<AtomicUsize>) {
        let complete = Arc::new(AtomicUsize::new(0));
        let engine = Manual {
            staging: HostBuffer::new(RING).unwrap(),
            marks: 0,
            complete: complete.clone(),
            fail_at,
        };
        (
            Ring::with_engine(Via::Region, Box::new(engine), size).unwrap(),
            complete,
        )
    }

    #[test]
    fn bytes_are_ready_only_once_their_mark_completes() {
        let (mut r, complete) = manual_ring(4 * CHUNK, None);
        let src: Arc<dyn MemoryRegion> = HostBuffer::new_shared(3 * CHUNK).unwrap();
        // Two chunks' worth: the first crosses the mark threshold and is marked at once.
        assert_eq!(r.copy_out(&src, 0, CHUNK + 10).unwrap(), 0);
        assert_eq!(r.copy_out(&src, 0, 100).unwrap(), (CHUNK + 10) as u64);
        assert_eq!(r.marks.len(), 1, "one mark after the first chunk");
        r.mark_if(true).unwrap();
        assert_eq!(r.marks.len(), 2);
        r.poll().unwrap();
        assert_eq!(r.ready, 0, "nothing is ready before a mark completes");
        complete.store(1, Ordering::Relaxed);
        r.poll().unwrap();
        assert_eq!(
            r.ready,
            (CHUNK + 10) as u64,
            "ready up to the first mark only"
        );
        assert!(r.busy());
        complete.store(1, Ordering::Relaxed);
        r.poll().unwrap();
        assert_eq!(r.ready, r.head);
        assert!(!r.busy());
        assert!(!r.idle(), "bytes stay in use until the socket took them");
        r.tail = r.head;
        assert!(r.idle());
    }

    #[test]
    fn the_ring_is_bounded_and_wraps() {
        let size = 3 * 4096;
        let (mut r, complete) = manual_ring(size, None);
        let src = HostBuffer::new_shared(size).unwrap();
        let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
        src.write(0, &data).unwrap();
        let src: Arc<dyn MemoryRegion> = src;
        r.copy_out(&src, 0, 2 * 4096).unwrap();
        assert_eq!(r.free(), 4096);
        r.tail += 4096; // the socket took the first page
        assert_eq!(r.free(), 2 * 4096);
        // This one wraps: 4096 bytes at the end, 4096 at the start.
        let at = r.copy_out(&src, 4096, 2 * 4096).unwrap();
        assert_eq!(r.free(), 0);
        assert_eq!(r.contiguous(0), 0);
        r.mark_if(true).unwrap();
        complete.store(2, Ordering::Relaxed);
        r.poll().unwrap();
        assert_eq!(r.ready, r.head);
        // SAFETY: both pieces lie inside the staging buffer and are complete.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(r.ptr(at), 4096),
                std::slice::from_raw_parts(r.ptr(at + 4096), 4096),
            )
        };
        assert_eq!(a, &data[4096..8192]);
        assert_eq!(b, &data[8192..]);
    }

    #[test]
    fn a_failed_copy_is_an_error() {
        let (mut r, _) = manual_ring(RING, Some(4096));
        let src: Arc<dyn MemoryRegion> = HostBuffer::new_shared(8192).unwrap();
        r.copy_out(&src, 0, 4096).unwrap();
        assert!(r.copy_out(&src, 4096, 4096).is_err());
    }

    #[test]
    fn host_memory_is_not_staged_through_cuda() {
        let mem = HostBuffer::new(4096).unwrap();
        assert!(matches!(CudaProbe::default().via_for(&mem), Via::Region));
    }
}
