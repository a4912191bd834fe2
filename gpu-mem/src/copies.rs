//! Batches of range copies on one stream: the engine under [`PeerCopies`](crate::PeerCopies)
//! (into peers' memory) and [`StagedCopies`] (between device memory and pinned staging).
//!
//! Ranges `(dst, src, len)` are queued as device-visible addresses, checked by the caller;
//! [`RangeCopies::submit`] issues them with the chosen [`CopyMethod`] and marks the stream
//! (its completion word, else an event) so that the regions they touch stay alive until the
//! copies are done.

use crate::device::Device;
use crate::error::{GpuMemError, check_call};
use crate::gather::{DescList, GatherKernel};
use crate::range::check_range;
use crate::stream::{EventInner, new_nonblocking_stream};
use crate::word::{CHECK_EVERY, StreamWord};
use cudarc::driver::sys;
use fabric_core::{MemoryLocation, MemoryRegion};
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// `cuMemcpyBatchAsync` as CUDA 12.8 declares it.
type BatchFn = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

/// The driver's batched copy, when it has one (12.8 and later).
fn batch_fn() -> Option<BatchFn> {
    static F: OnceLock<Option<BatchFn>> = OnceLock::new();
    *F.get_or_init(|| {
        // SAFETY: only reached through a Device, which exists only after Cuda::probe found
        // the driver library; looking a symbol up by name has no other effect, and the
        // declared type is the one of the CUDA 12.8 headers for this name.
        unsafe {
            sys::culib()
                .get::<BatchFn>(b"cuMemcpyBatchAsync\0")
                .ok()
                .map(|s| *s)
        }
    })
}

/// How a batch of copies is issued. The default is the first that works here, in this
/// order; `with_method` constructors (and `xfer --cuda-copy`) force one, for comparisons.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMethod {
    /// One launch of a copy kernel per batch (ranges with 16-byte aligned ends; others
    /// fall back to `cuMemcpyAsync`): SMs move the bytes, no per-range engine cost.
    Kernel,
    /// As [`Kernel`](Self::Kernel), with each strided run of rows (whole 16-byte chunks,
    /// aligned) one entry of the rows kernel (`xfer_gather_rows`) instead of one piece per
    /// row. Its bytes have not yet been checked on a GPU on their own (the one GPU run
    /// that used it also copied every row a second time, see the git log), so it is
    /// chosen only when asked for; the default keeps rows one plain-kernel piece each,
    /// the path the GPU tests proved.
    KernelRows,
    /// One `cuMemcpyBatchAsync` per batch (driver 12.8 and later).
    Batch,
    /// One `cuMemcpyAsync` per range.
    Memcpy,
}

impl CopyMethod {
    /// Its name, as [`CopyMethod::from_name`] and `xfer --cuda-copy` spell it.
    pub fn name(self) -> &'static str {
        match self {
            CopyMethod::Kernel => "kernel",
            CopyMethod::KernelRows => "kernel-rows",
            CopyMethod::Batch => "batch",
            CopyMethod::Memcpy => "memcpy",
        }
    }

    /// The method of that name (`kernel`, `kernel-rows`, `batch` or `memcpy`), or `None`.
    pub fn from_name(name: &str) -> Option<CopyMethod> {
        [
            CopyMethod::Kernel,
            CopyMethod::KernelRows,
            CopyMethod::Batch,
            CopyMethod::Memcpy,
        ]
        .into_iter()
        .find(|m| m.name() == name)
    }
}

/// The longest range one block of the copy kernel moves: longer ones are cut into pieces of
/// this size (a multiple of 16, so that every piece stays aligned).
const KERNEL_PIECE: u64 = 64 << 10;

/// One queued copy: `rows` ranges of `len` bytes, row `i` from `src + i * src_stride` to
/// `dst + i * dst_stride` (a single range has one row). Rows stay one entry until they are
/// issued, where they are written straight into the kernel's list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Queued {
    dst: u64,
    src: u64,
    len: u64,
    rows: u64,
    dst_stride: u64,
    src_stride: u64,
    /// Whether the copy kernel may move it (both ends reachable by this device's kernels);
    /// others go through `cuMemcpyAsync`, which reaches any device.
    kernel_ok: bool,
    /// Whether its stream's method is [`CopyMethod::KernelRows`].
    rows_kernel: bool,
}

impl Queued {
    /// Row `i`'s (dst, src).
    fn row(&self, i: u64) -> (u64, u64) {
        (
            self.dst + i * self.dst_stride,
            self.src + i * self.src_stride,
        )
    }

    /// The most kernel pieces its rows may become.
    fn max_pieces(&self) -> u64 {
        if self.strided() {
            return 0;
        }
        self.rows * self.len.div_ceil(KERNEL_PIECE)
    }

    /// Whether the rows kernel moves it: rows the kernel may reach, each of whole 16-byte
    /// chunks at 16-byte aligned places, none longer than a piece; and the rows kernel
    /// asked for ([`CopyMethod::KernelRows`]).
    fn strided(&self) -> bool {
        self.rows_kernel && self.strided_shape()
    }

    /// Whether its shape suits the rows kernel (see [`strided`](Self::strided)).
    fn strided_shape(&self) -> bool {
        self.kernel_ok
            && self.rows > 1
            && self.len <= KERNEL_PIECE
            && (self.dst | self.src | self.dst_stride | self.src_stride | self.len) & 15 == 0
    }

    /// Rows per strided entry: each entry at most a piece, so that a long run is shared
    /// by many blocks.
    fn rows_per_entry(&self) -> u64 {
        (KERNEL_PIECE / self.len.max(1)).max(1)
    }

    /// The strided entries it becomes (0 unless [`strided`](Self::strided)).
    fn strided_entries(&self) -> u64 {
        if !self.strided() {
            return 0;
        }
        self.rows.div_ceil(self.rows_per_entry())
    }
}

/// Hands every entry of `queued` that the rows kernel moves to `entry` as ((dst,
/// dst_stride), (src, src_stride), len, rows), cut so that none is longer than a piece.
fn strided_entries(queued: &[Queued], mut entry: impl FnMut((u64, u64), (u64, u64), u64, u64)) {
    for q in queued.iter().filter(|q| q.strided()) {
        cut_rows(q, &mut entry);
    }
}

/// `q`'s rows as entries of at most a piece each.
fn cut_rows(q: &Queued, entry: &mut impl FnMut((u64, u64), (u64, u64), u64, u64)) {
    let per = q.rows_per_entry();
    let mut first = 0;
    while first < q.rows {
        let rows = per.min(q.rows - first);
        let (d, s) = q.row(first);
        entry((d, q.dst_stride), (s, q.src_stride), q.len, rows);
        first += rows;
    }
}

/// Hands every kernel piece of `queued` to `piece` as (dst, src, len), in order, and every
/// range the kernel may not move (not reachable, or an end not 16-byte aligned) to `odd`.
/// One block of the kernel copies one piece: a range longer than [`KERNEL_PIECE`] is cut so
/// that many blocks share it (a 1 GiB write went at one block's pace, about 37 GB/s).
fn kernel_pieces(
    queued: &[Queued],
    mut piece: impl FnMut(u64, u64, u64),
    mut odd: impl FnMut(u64, u64, u64),
) {
    for q in queued.iter().filter(|q| !q.strided()) {
        // Every row is aligned when the first is and the strides are multiples of 16.
        let all_aligned = (q.dst | q.src | q.dst_stride | q.src_stride) & 15 == 0;
        for i in 0..q.rows {
            let (d, s) = q.row(i);
            if !q.kernel_ok || !(all_aligned || (d | s) & 15 == 0) {
                odd(d, s, q.len);
                continue;
            }
            let mut at = 0;
            while at < q.len {
                let n = (q.len - at).min(KERNEL_PIECE);
                piece(d + at, s + at, n);
                at += n;
            }
        }
    }
}

/// The most kernel pieces `queued` may become: the room its copy list needs. Only what the
/// kernel may move counts, so a batch it may move none of takes no list and makes no launch.
fn list_bound(queued: &[Queued]) -> u64 {
    (queued.iter())
        .filter(|q| q.kernel_ok)
        .map(Queued::max_pieces)
        .sum()
}

/// Keeps memory a queued copy touches alive until its event completes.
type KeepAlive = Box<dyn Send + Sync>;

/// The copies of one submit: their event (none where the completion word tells), the
/// kernels' lists of ranges, what they use.
struct Fence {
    event: Option<Arc<EventInner>>,
    ticket: u64,
    lists: [Option<DescList>; 2],
    keep: Vec<KeepAlive>,
}

/// Queued range copies on one non-blocking stream of one device, issued per submit.
pub(crate) struct RangeCopies {
    device: Device,
    stream: sys::CUstream,
    method: CopyMethod,
    kernel: Option<GatherKernel>,
    batch: Option<BatchFn>,
    /// Why a better method is not used, when it is not.
    note: Option<String>,
    /// Copies queued since the last submit.
    queued: Vec<Queued>,
    /// Scratch for the driver's batched copy: one entry per range.
    dsts: Vec<sys::CUdeviceptr>,
    srcs: Vec<sys::CUdeviceptr>,
    sizes: Vec<usize>,
    keep: Vec<KeepAlive>,
    /// Address of the last keep-alive, so that runs of copies from one region keep it once.
    last_kept: Vec<usize>,
    fences: VecDeque<Fence>,
    spare: Vec<Arc<EventInner>>,
    /// Where the stream writes each submit's ticket once its copies are done (`None`: the
    /// driver cannot, and each submit records an event instead).
    word: Option<StreamWord>,
    /// When the driver was last asked about the stream while the word stood still.
    checked: Instant,
    next_ticket: u64,
    done: u64,
}

// SAFETY: the stream handle is an opaque driver object any thread may use once the context
// is current (every call binds it); the raw addresses are plain integers; the other fields
// are Send. `&RangeCopies` exposes nothing that touches the stream, so Sync is sound too.
unsafe impl Send for RangeCopies {}
// SAFETY: see above.
unsafe impl Sync for RangeCopies {}

impl RangeCopies {
    /// Copies on `device` with the best method that works here.
    pub(crate) fn new(device: &Device) -> Result<RangeCopies, GpuMemError> {
        match RangeCopies::with_method(device, CopyMethod::Kernel) {
            Ok(c) => Ok(c),
            Err(e) => {
                let m = if batch_fn().is_some() {
                    CopyMethod::Batch
                } else {
                    CopyMethod::Memcpy
                };
                let mut c = RangeCopies::with_method(device, m)?;
                c.note = Some(format!("copy kernel unavailable: {e}"));
                Ok(c)
            }
        }
    }

    /// Copies on `device` with `method`; fails when this machine cannot do it (the kernel
    /// does not load, or the driver has no batched copy).
    pub(crate) fn with_method(
        device: &Device,
        method: CopyMethod,
    ) -> Result<RangeCopies, GpuMemError> {
        let kernel = match method {
            CopyMethod::Kernel | CopyMethod::KernelRows => Some(GatherKernel::load(device)?),
            _ => None,
        };
        let batch = batch_fn();
        if method == CopyMethod::Batch && batch.is_none() {
            return Err(GpuMemError::WrongMemory(
                "this driver has no cuMemcpyBatchAsync (CUDA 12.8 or later)".into(),
            ));
        }
        device.bind()?;
        let stream = new_nonblocking_stream()?;
        let word = match StreamWord::probe(device, stream) {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: created above, unused by anything else, destroyed once.
                unsafe { sys::cuStreamDestroy_v2(stream) };
                return Err(e);
            }
        };
        Ok(RangeCopies {
            device: device.clone(),
            stream,
            method,
            kernel,
            batch,
            note: None,
            queued: Vec::new(),
            dsts: Vec::new(),
            srcs: Vec::new(),
            sizes: Vec::new(),
            keep: Vec::new(),
            last_kept: Vec::new(),
            fences: VecDeque::new(),
            spare: Vec::new(),
            word,
            checked: Instant::now(),
            next_ticket: 1,
            done: 0,
        })
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    pub(crate) fn stream(&self) -> sys::CUstream {
        self.stream
    }

    pub(crate) fn method(&self) -> CopyMethod {
        self.method
    }

    pub(crate) fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    /// Bytes queued since the last submit.
    pub(crate) fn queued_bytes(&self) -> u64 {
        self.queued.iter().map(|q| q.len * q.rows).sum()
    }

    /// Queues a copy of `len` bytes between device-visible addresses. The caller has
    /// checked both ranges against live memory, which it passes to [`keep`](Self::keep).
    pub(crate) fn queue(&mut self, dst: u64, src: u64, len: u64, kernel_ok: bool) {
        self.queue_rows((dst, 0), (src, 0), len, 1, kernel_ok);
    }

    /// Queues `rows` copies of `len` bytes, row `i` from `src + i * src_stride` to `dst + i *
    /// dst_stride`, as one entry. The caller has checked every row against live memory, which
    /// it passes to [`keep`](Self::keep).
    pub(crate) fn queue_rows(
        &mut self,
        (dst, dst_stride): (u64, u64),
        (src, src_stride): (u64, u64),
        len: u64,
        rows: u64,
        kernel_ok: bool,
    ) {
        if len == 0 || rows == 0 {
            return;
        }
        self.queued.push(Queued {
            dst,
            src,
            len,
            rows,
            dst_stride,
            src_stride,
            kernel_ok,
            rows_kernel: self.method == CopyMethod::KernelRows,
        });
    }

    /// Keeps `what` alive until the next submit's copies have finished; consecutive calls
    /// for the same `Arc` keep it once.
    pub(crate) fn keep<T: ?Sized + Send + Sync + 'static>(&mut self, what: &Arc<T>) {
        let addr = Arc::as_ptr(what).cast::<()>() as usize;
        if self.last_kept.last() != Some(&addr) {
            self.last_kept.push(addr);
            self.keep.push(Box::new(what.clone()));
        }
    }

    /// Issues every queued copy and marks the stream; returns its ticket. On error none of
    /// the queued copies may be assumed done (nor assumed not done); the memory they use
    /// stays alive until the stream has passed its mark anyway.
    pub(crate) fn submit(&mut self) -> Result<u64, GpuMemError> {
        self.device.bind()?;
        let mut lists = [None, None];
        let issued = match self.method {
            CopyMethod::Kernel | CopyMethod::KernelRows => self.issue_kernel(&mut lists),
            CopyMethod::Batch => self.issue_batch(),
            CopyMethod::Memcpy => self.issue_each(self.queued.iter().flat_map(|q| {
                (0..q.rows).map(move |i| {
                    let (d, s) = q.row(i);
                    (d, s, q.len)
                })
            })),
        };
        self.queued.clear();
        self.last_kept.clear();
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        // The stream is marked even after an error, so the memory stays alive until it has
        // finished whatever it did start; the fence is kept whatever happens (a fence whose
        // mark failed is retired once the stream is seen idle).
        let (event, marked) = match &self.word {
            // SAFETY: the stream is this context's, which is current; the word lives as
            // long as self, whose Drop synchronises the stream first.
            Some(w) => (None, unsafe { w.write(self.stream, ticket) }),
            None => match self.record_event() {
                Ok(e) => (Some(e), Ok(())),
                Err(e) => (None, Err(e)),
            },
        };
        self.fences.push_back(Fence {
            event,
            ticket,
            lists,
            keep: std::mem::take(&mut self.keep),
        });
        marked?;
        issued.map(|()| ticket)
    }

    /// An event recorded on the stream now.
    fn record_event(&mut self) -> Result<Arc<EventInner>, GpuMemError> {
        let event = match self.spare.pop() {
            Some(e) => e,
            None => Arc::new(EventInner::new(&self.device)?),
        };
        let r = check_call(
            // SAFETY: event and stream are live handles of this context, which is current.
            unsafe { sys::cuEventRecord(event.event, self.stream) },
            "cuEventRecord",
        );
        match r {
            Ok(()) => Ok(event),
            Err(e) => {
                self.spare.push(event);
                Err(e)
            }
        }
    }

    /// Launches the copy kernel for the queued copies it may move, plain copies for the
    /// rest.
    fn issue_kernel(&mut self, lists: &mut [Option<DescList>; 2]) -> Result<(), GpuMemError> {
        let mut odd = Vec::new();
        let bound = list_bound(&self.queued);
        let rows_bound: u64 = self.queued.iter().map(Queued::strided_entries).sum();
        if let (Some(k), true) = (self.kernel.as_mut(), rows_bound > 0) {
            let queued = &self.queued;
            // SAFETY: as for the plain launch below; `strided_entries` hands over only
            // entries `Queued::strided` says the rows kernel may move (reachable rows, every
            // address, stride and length a multiple of 16), at most `rows_bound` of them.
            lists[1] = unsafe {
                k.launch_rows(self.stream, rows_bound as usize, |w| {
                    strided_entries(queued, |d, s, l, r| w.push_rows(d, s, l, r))
                })?
            };
        }
        match self.kernel.as_mut() {
            Some(k) if bound > 0 => {
                let queued = &self.queued;
                // SAFETY: every range was checked by the caller against live memory that
                // `keep` holds until the mark after this launch completes (the list too,
                // held by the fence); `kernel_pieces` hands over only ranges that kernel_ok
                // says both ends of are reachable by this device's kernels, with 16-byte
                // aligned ends, at most `bound` of them; the stream is this context's,
                // which is current.
                let launched = unsafe {
                    k.launch(self.stream, bound as usize, |w| {
                        kernel_pieces(
                            queued,
                            |d, s, l| w.push(d, s, l),
                            |d, s, l| odd.push((d, s, l)),
                        )
                    })?
                };
                lists[0] = launched;
            }
            _ => {
                kernel_pieces(&self.queued, |_, _, _| {}, |d, s, l| odd.push((d, s, l)));
                if self.kernel.is_none() {
                    // No kernel (so no rows launch above): strided entries are copied a row
                    // at a time.
                    strided_entries(&self.queued, |(d, ds), (s, ss), l, rows| {
                        odd.extend((0..rows).map(|i| (d + i * ds, s + i * ss, l)));
                    });
                }
            }
        }
        self.issue_each(odd.into_iter())
    }

    fn issue_batch(&mut self) -> Result<(), GpuMemError> {
        self.dsts.clear();
        self.srcs.clear();
        self.sizes.clear();
        for q in &self.queued {
            for i in 0..q.rows {
                let (d, s) = q.row(i);
                self.dsts.push(d);
                self.srcs.push(s);
                self.sizes.push(q.len as usize);
            }
        }
        let n = self.sizes.len();
        let f = match self.batch {
            Some(f) if n > 1 => f,
            _ => {
                let ranges: Vec<_> = (0..n)
                    .map(|i| (self.dsts[i], self.srcs[i], self.sizes[i] as u64))
                    .collect();
                return self.issue_each(ranges.into_iter());
            }
        };
        let loc = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
            id: 0,
        };
        let mut attr = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: loc,
            dstLocHint: loc,
            flags: 0,
        };
        let mut attr_idx = 0usize;
        let mut fail_idx = usize::MAX;
        // SAFETY: the three arrays hold n entries each; every (src, dst, size) was checked
        // by the caller against live memory that `keep` holds until the event recorded
        // after this call completes; the stream belongs to this context, which is current;
        // one attribute applies from index 0.
        let r = unsafe {
            f(
                self.dsts.as_mut_ptr(),
                self.srcs.as_mut_ptr(),
                self.sizes.as_mut_ptr(),
                n,
                &mut attr,
                &mut attr_idx,
                1,
                &mut fail_idx,
                self.stream,
            )
        };
        check_call(r, "cuMemcpyBatchAsync")
    }

    /// One `cuMemcpyAsync` per range `(dst, src, len)`.
    fn issue_each(&self, ranges: impl Iterator<Item = (u64, u64, u64)>) -> Result<(), GpuMemError> {
        for (d, s, l) in ranges {
            check_call(
                // SAFETY: as for the batch: the range was checked by the caller and its
                // memory stays alive until the event recorded after this call completes.
                unsafe { sys::cuMemcpyAsync(d, s, l as usize, self.stream) },
                "cuMemcpyAsync",
            )?;
        }
        Ok(())
    }

    /// The highest ticket whose copies have all finished (0 before any), without waiting.
    pub(crate) fn completed(&mut self) -> Result<u64, GpuMemError> {
        if let Some(w) = &self.word {
            let seen = w.read();
            while self.fences.front().is_some_and(|f| f.ticket <= seen) {
                self.retire_front();
            }
            if !self.fences.is_empty() && self.checked.elapsed() >= CHECK_EVERY {
                self.checked = Instant::now();
                if self.stream_idle()? {
                    // Idle with tickets unseen: their marks failed to queue. The copies
                    // before them have finished all the same.
                    while !self.fences.is_empty() {
                        self.retire_front();
                    }
                }
            }
            return Ok(self.done);
        }
        while let Some(f) = self.fences.front() {
            let done = match &f.event {
                Some(e) => e.query()?,
                // Its event failed to record: done once the stream is idle.
                None => self.stream_idle()?,
            };
            if !done {
                break;
            }
            self.retire_front();
        }
        Ok(self.done)
    }

    /// Whether the stream has finished all its work; its error if it failed.
    fn stream_idle(&self) -> Result<bool, GpuMemError> {
        self.device.bind()?;
        // SAFETY: the stream is a live handle of this context, which is current.
        match unsafe { sys::cuStreamQuery(self.stream) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check_call(other, "cuStreamQuery").map(|()| false),
        }
    }

    /// How completions are learnt: `word` (the stream writes host memory) or `event`.
    pub(crate) fn completion(&self) -> &'static str {
        if self.word.is_some() { "word" } else { "event" }
    }

    /// Tickets submitted and not yet seen complete.
    pub(crate) fn in_flight(&self) -> usize {
        self.fences.len()
    }

    /// Waits for every submitted copy; returns the last ticket.
    pub(crate) fn synchronize(&mut self) -> Result<u64, GpuMemError> {
        self.device.bind()?;
        check_call(
            // SAFETY: the stream is a live handle of this context, which is current.
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        )?;
        while !self.fences.is_empty() {
            self.retire_front();
        }
        Ok(self.done)
    }

    fn retire_front(&mut self) {
        if let Some(f) = self.fences.pop_front() {
            self.done = f.ticket;
            // The copies are done: their memory may go now, and their list be reused.
            drop(f.keep);
            if let Some(k) = self.kernel.as_mut() {
                for l in f.lists.into_iter().flatten() {
                    k.recycle(l);
                }
            }
            if let Some(e) = f.event {
                self.spare.push(e);
            }
        }
    }
}

impl Drop for RangeCopies {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: the stream is live and destroyed once; synchronising first keeps the
            // memory (dropped after this) alive until its copies are done.
            unsafe {
                sys::cuStreamSynchronize(self.stream);
                sys::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}

/// Batched copies between device memory of one device and a pinned staging buffer: copies
/// queued with [`copy_out`](Self::copy_out) (device to staging) and
/// [`copy_in`](Self::copy_in) (staging to device) start together at the next
/// [`mark`](Self::mark), as one launch of the copy kernel where it loads (see
/// [`CopyMethod`]); [`poll_marks`](Self::poll_marks) says how many marks have completed
/// since it last said so, without waiting.
///
/// One driver call per mark instead of one per range: with many rails in one process, the
/// per-range calls of [`CopyStream`](crate::CopyStream) contend on the context's locks.
/// Regions stay alive until their mark completes; dropping the value waits for its copies.
pub struct StagedCopies {
    copies: RangeCopies,
    staging: Arc<crate::PinnedHostBuffer>,
    /// The staging buffer's address on the device.
    staging_dev: u64,
    /// Marks reported complete by `poll_marks` so far.
    reported: u64,
}

impl StagedCopies {
    /// Copies between memory of `device` and `staging` (pinned memory, which every CUDA
    /// context maps), with the best [`CopyMethod`] here.
    pub fn new(
        device: &Device,
        staging: Arc<crate::PinnedHostBuffer>,
    ) -> Result<StagedCopies, GpuMemError> {
        StagedCopies::with(RangeCopies::new(device)?, staging)
    }

    /// As [`new`](Self::new), with `method`.
    pub fn with_method(
        device: &Device,
        staging: Arc<crate::PinnedHostBuffer>,
        method: CopyMethod,
    ) -> Result<StagedCopies, GpuMemError> {
        StagedCopies::with(RangeCopies::with_method(device, method)?, staging)
    }

    fn with(
        copies: RangeCopies,
        staging: Arc<crate::PinnedHostBuffer>,
    ) -> Result<StagedCopies, GpuMemError> {
        copies.device().bind()?;
        let mut staging_dev: sys::CUdeviceptr = 0;
        check_call(
            // SAFETY: staging_dev is a valid out-pointer; the buffer is pinned memory from
            // cuMemHostAlloc (portable and device-mapped), alive while `staging` is.
            unsafe {
                sys::cuMemHostGetDevicePointer_v2(
                    &mut staging_dev,
                    staging.as_ptr().cast::<c_void>(),
                    0,
                )
            },
            "cuMemHostGetDevicePointer",
        )?;
        Ok(StagedCopies {
            copies,
            staging,
            staging_dev,
            reported: 0,
        })
    }

    /// The staging buffer.
    pub fn staging(&self) -> &Arc<crate::PinnedHostBuffer> {
        &self.staging
    }

    /// How marks are copied.
    pub fn method(&self) -> CopyMethod {
        self.copies.method()
    }

    /// How completed marks are learnt: `"word"` (the stream writes a word of host memory
    /// that polling reads, no driver call) or `"event"` (a CUDA event per mark, queried).
    pub fn completion(&self) -> &'static str {
        self.copies.completion()
    }

    /// Checks that `offset..+len` of `region` is memory of this device; its address.
    fn device_range(
        &self,
        region: &Arc<dyn MemoryRegion>,
        offset: u64,
        len: u64,
    ) -> Result<u64, GpuMemError> {
        let ordinal = self.copies.device().ordinal();
        match region.location() {
            MemoryLocation::Cuda { device } if device == ordinal => {}
            other => {
                return Err(GpuMemError::WrongMemory(format!(
                    "staged copies move memory of CUDA device {ordinal}, not {other:?}"
                )));
            }
        }
        check_range(offset, len, region.len() as u64)?;
        Ok(region.device_addr() + offset)
    }

    /// Queues a copy of `len` bytes of device memory `src` at `src_offset` into staging at
    /// `at`.
    pub fn copy_out(
        &mut self,
        src: &Arc<dyn MemoryRegion>,
        src_offset: u64,
        at: u64,
        len: u64,
    ) -> Result<(), GpuMemError> {
        let from = self.device_range(src, src_offset, len)?;
        check_range(at, len, self.staging.len() as u64)?;
        self.copies.queue(self.staging_dev + at, from, len, true);
        self.copies.keep(src);
        Ok(())
    }

    /// Queues a copy of `len` staging bytes at `at` into device memory `dst` at
    /// `dst_offset`.
    pub fn copy_in(
        &mut self,
        at: u64,
        dst: &Arc<dyn MemoryRegion>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), GpuMemError> {
        let to = self.device_range(dst, dst_offset, len)?;
        check_range(at, len, self.staging.len() as u64)?;
        self.copies.queue(to, self.staging_dev + at, len, true);
        self.copies.keep(dst);
        Ok(())
    }

    /// Starts the copies queued since the last mark and marks them.
    pub fn mark(&mut self) -> Result<(), GpuMemError> {
        self.copies.submit().map(drop)
    }

    /// How many more marks, oldest first, have completed (never waits). An error means a
    /// copy failed on the device.
    pub fn poll_marks(&mut self) -> Result<usize, GpuMemError> {
        let done = self.copies.completed()?;
        let n = done - self.reported;
        self.reported = done;
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::{
        CopyMethod, KERNEL_PIECE, Queued, cut_rows, kernel_pieces, list_bound, strided_entries,
    };
    use proptest::prelude::*;

    type Ranges = Vec<(u64, u64, u64)>;

    /// The ranges `queued` becomes: (kernel pieces, odd ranges, rows the rows kernel
    /// moves), each (dst, src, len); checks that pieces are aligned, no longer than a
    /// piece, that strided entries are aligned whole chunks of at most a piece, and that
    /// the three together cover each row of each entry exactly, in order.
    fn issued(queued: &[Queued]) -> (Ranges, Ranges, Ranges) {
        let (mut pieces, mut odd, mut strided) = (Vec::new(), Vec::new(), Vec::new());
        for q in queued {
            let all = std::cell::RefCell::new(Vec::new());
            kernel_pieces(
                std::slice::from_ref(q),
                |d, s, l| {
                    assert_eq!((d | s) & 15, 0, "unaligned piece {d:#x} {s:#x}");
                    assert!(l > 0 && l <= KERNEL_PIECE);
                    pieces.push((d, s, l));
                    all.borrow_mut().push((d, s, l));
                },
                |d, s, l| {
                    odd.push((d, s, l));
                    all.borrow_mut().push((d, s, l));
                },
            );
            strided_entries(std::slice::from_ref(q), |(d, ds), (s, ss), l, rows| {
                assert_eq!((d | s | ds | ss | l) & 15, 0, "unaligned strided entry");
                assert!(l * rows <= KERNEL_PIECE || rows == 1);
                for i in 0..rows {
                    strided.push((d + i * ds, s + i * ss, l));
                    all.borrow_mut().push((d + i * ds, s + i * ss, l));
                }
            });
            let mut at = all.into_inner().into_iter();
            for i in 0..q.rows {
                let (d, s) = q.row(i);
                let mut done = 0;
                while done < q.len {
                    let (pd, ps, pl) = at.next().expect("a row is covered");
                    assert_eq!((pd, ps), (d + done, s + done));
                    done += pl;
                }
                assert_eq!(done, q.len);
            }
            assert!(at.next().is_none());
        }
        (pieces, odd, strided)
    }

    proptest! {
        /// Rows queued as one entry move exactly the bytes of their rows one by one, the
        /// kernel takes every aligned reachable row (cut into pieces), and no more pieces
        /// than the entry's bound.
        #[test]
        fn rows_as_one_entry_move_the_bytes_of_their_rows(
            dst in 0u64..64, src in 0u64..64, len in 1u64..200_000,
            rows in 1u64..6, ds in 0u64..300_000, ss in 0u64..300_000,
            kernel_ok: bool, rows_kernel: bool,
        ) {
            let (dst, src) = (dst * 8, (1 << 40) | (src * 8));
            let q = Queued {
                dst, src, len, rows, dst_stride: ds, src_stride: ss, kernel_ok, rows_kernel,
            };
            let one: Vec<Queued> = (0..rows)
                .map(|i| Queued {
                    dst: dst + i * ds, src: src + i * ss, len, rows: 1,
                    dst_stride: 0, src_stride: 0, kernel_ok, rows_kernel,
                })
                .collect();
            let (a, odd_a, rows_a) = issued(&[q]);
            let (b, odd_b, rows_b) = issued(&one);
            prop_assert!(rows_b.is_empty(), "one row is never strided");
            // What the kernels move is the same bytes, whichever kernel moves them.
            let kernel_a: Ranges = a.iter().chain(&rows_a).copied().collect();
            prop_assert_eq!(&kernel_a, &b);
            prop_assert_eq!(&odd_a, &odd_b);
            prop_assert!(a.len() as u64 <= list_bound(&[q]));
            prop_assert_eq!(list_bound(&[q]) == 0, !kernel_ok || q.strided());
            prop_assert_eq!(rows_a.is_empty(), !q.strided());
            let pa = kernel_a.len();
            let aligned_rows = (0..rows)
                .filter(|i| ((dst + i * ds) | (src + i * ss)) & 15 == 0)
                .count() as u64;
            let want = if kernel_ok { aligned_rows * len.div_ceil(KERNEL_PIECE) } else { 0 };
            prop_assert_eq!(pa as u64, want);
        }
    }

    #[test]
    fn a_long_strided_copy_is_cut_into_entries_of_at_most_a_piece() {
        // 4096 rows of 512 bytes (2 MiB): 128 rows an entry, 32 entries.
        let q = Queued {
            dst: 1 << 20,
            src: 1 << 40,
            len: 512,
            rows: 4096,
            dst_stride: 512,
            src_stride: 1024,
            kernel_ok: true,
            rows_kernel: true,
        };
        assert!(q.strided_shape());
        assert!(q.strided());
        assert!(
            !Queued {
                rows_kernel: false,
                ..q
            }
            .strided(),
            "only when asked for"
        );
        let mut entries = Vec::new();
        cut_rows(&q, &mut |d, s, l, r| entries.push((d, s, l, r)));
        assert_eq!(entries.len(), 32);
        assert!(entries.iter().all(|&(_, _, l, r)| l == 512 && r == 128));
        assert_eq!(entries[1].0, (q.dst + 128 * 512, 512));
        assert_eq!(entries[1].1, (q.src + 128 * 1024, 1024));
        // Not whole 16-byte chunks, or one row: the plain kernel's pieces instead.
        assert!(!Queued { len: 500, ..q }.strided_shape());
        assert!(!Queued { rows: 1, ..q }.strided_shape());
        assert!(
            !Queued {
                src_stride: 1000,
                ..q
            }
            .strided()
        );
        assert!(
            !Queued {
                kernel_ok: false,
                ..q
            }
            .strided()
        );
    }

    #[test]
    fn copy_methods_round_trip_by_name_and_nothing_else_parses() {
        for m in [
            CopyMethod::Kernel,
            CopyMethod::KernelRows,
            CopyMethod::Batch,
            CopyMethod::Memcpy,
        ] {
            assert_eq!(CopyMethod::from_name(m.name()), Some(m));
        }
        for bad in ["", "Kernel", "dma", "memcpy "] {
            assert_eq!(CopyMethod::from_name(bad), None, "{bad:?}");
        }
    }
}
