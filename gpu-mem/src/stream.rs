//! [`CopyStream`] and [`CopyEvent`]: asynchronous copies between device memory and host
//! memory, so that a transport can overlap PCIe copies with network I/O.
//!
//! A transport's worker owns one stream per direction, queues chunk copies, records an event
//! after each chunk, and polls the events: a chunk is ready to send (or its staging buffer
//! free again) when its event reports complete.

use crate::device::Device;
use crate::error::{CopyDirection, GpuMemError, check, check_call};
use crate::range::check_range;
use cudarc::driver::sys;
use fabric_core::{MemoryLocation, MemoryRegion};
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Arc;

/// Keeps the regions of a queued copy alive until the stream knows the copy has finished.
type KeepAlive = Box<dyn Send + Sync>;

/// Copies recorded before one event, and the regions they use.
struct Fence {
    event: Arc<EventInner>,
    keep: Vec<KeepAlive>,
}

/// A CUDA stream (non-blocking) for asynchronous copies on one device.
///
/// Copies run in the order they were queued. Each copy takes the regions as `Arc`s and the
/// stream holds a clone of both until it has seen the copy finish (an event recorded after
/// it reports complete, or [`synchronize`](Self::synchronize)), so memory can never be freed
/// under a copy in flight. Dropping the stream waits for its copies.
///
/// Copies on a stream are not ordered with the synchronous methods of
/// [`DeviceBuffer`](crate::DeviceBuffer) (which use the legacy default stream), nor with other
/// streams: wait for an event in between.
///
/// Only page-locked host memory ([`PinnedHostBuffer`](crate::PinnedHostBuffer)) makes the
/// copies truly asynchronous; with pageable memory the driver copies synchronously.
pub struct CopyStream {
    device: Device,
    stream: sys::CUstream,
    /// Regions of copies queued since the last event.
    unfenced: Vec<KeepAlive>,
    /// Events recorded, oldest first, each with the regions of the copies before it.
    fences: VecDeque<Fence>,
    /// Events nobody else holds, ready to record again.
    spare_events: Vec<Arc<EventInner>>,
    /// Copies queued and not yet seen complete (one keep-alive each).
    in_flight: usize,
}

// SAFETY: the stream handle is an opaque driver object that any thread may use once the
// context is current (every call binds it first; the driver API is thread-safe); the other
// fields are Send. Shared references expose only `device()` and `copies_in_flight()`, which
// do not touch the handle or the keep-alive boxes, so Sync is sound too.
unsafe impl Send for CopyStream {}
// SAFETY: see above: `&CopyStream` gives no access to the stream handle or keep-alives.
unsafe impl Sync for CopyStream {}

/// Creates a stream that does not synchronise with the legacy default stream, on the
/// context current on this thread (callers bind it first).
pub(crate) fn new_nonblocking_stream() -> Result<sys::CUstream, GpuMemError> {
    let mut stream: sys::CUstream = std::ptr::null_mut();
    check_call(
        // SAFETY: stream is a valid out-pointer; the caller made the context current.
        unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        },
        "cuStreamCreate",
    )?;
    Ok(stream)
}

impl CopyStream {
    /// Creates a non-blocking stream on `device`.
    pub fn new(device: &Device) -> Result<CopyStream, GpuMemError> {
        device.bind()?;
        let stream = new_nonblocking_stream()?;
        Ok(CopyStream {
            device: device.clone(),
            stream,
            unfenced: Vec::new(),
            fences: VecDeque::new(),
            spare_events: Vec::new(),
            in_flight: 0,
        })
    }

    /// The device the stream runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// How many queued copies the stream has not yet seen complete.
    pub fn copies_in_flight(&self) -> usize {
        self.in_flight
    }

    /// Queues a copy of `len` bytes from device memory `src` (at `src_offset`) to host memory
    /// `dst` (at `dst_offset`), and returns at once.
    ///
    /// `src` must be memory of this stream's device (a [`DeviceBuffer`](crate::DeviceBuffer)
    /// or a window onto one); `dst` must have a host pointer (best a
    /// [`PinnedHostBuffer`](crate::PinnedHostBuffer)). `dst` holds the bytes once an event
    /// recorded after this call reports complete.
    pub fn copy_d2h_async<S, D>(
        &mut self,
        src: &Arc<S>,
        src_offset: u64,
        dst: &Arc<D>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), GpuMemError>
    where
        S: MemoryRegion + ?Sized,
        D: MemoryRegion + ?Sized,
    {
        let src_addr = self.device_range(&**src, src_offset, len)?;
        let dst_ptr = host_range(&**dst, dst_offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.device.bind()?;
        check(
            // SAFETY: both ranges were checked to lie inside their regions, whose contracts
            // (MemoryRegion) keep device_addr and host_ptr valid while they live; the stream
            // keeps an Arc to both until it has seen this copy complete (pushed below, and
            // released only after an event or stream synchronisation). The context is current.
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst_ptr, src_addr, len as usize, self.stream) },
            |source| GpuMemError::Copy {
                direction: CopyDirection::DeviceToHost,
                len,
                source,
            },
        )?;
        self.hold(src, dst);
        Ok(())
    }

    /// Queues a copy of `len` bytes from host memory `src` (at `src_offset`) to device memory
    /// `dst` (at `dst_offset`), and returns at once.
    ///
    /// `dst` must be memory of this stream's device; `src` must have a host pointer (best a
    /// [`PinnedHostBuffer`](crate::PinnedHostBuffer)) and must not be written until an event
    /// recorded after this call reports complete.
    pub fn copy_h2d_async<S, D>(
        &mut self,
        src: &Arc<S>,
        src_offset: u64,
        dst: &Arc<D>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), GpuMemError>
    where
        S: MemoryRegion + ?Sized,
        D: MemoryRegion + ?Sized,
    {
        let src_ptr = host_range(&**src, src_offset, len)?;
        let dst_addr = self.device_range(&**dst, dst_offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.device.bind()?;
        check(
            // SAFETY: as in copy_d2h_async: both ranges are inside regions kept alive by the
            // stream until it has seen the copy complete; the context is current.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst_addr, src_ptr.cast_const(), len as usize, self.stream)
            },
            |source| GpuMemError::Copy {
                direction: CopyDirection::HostToDevice,
                len,
                source,
            },
        )?;
        self.hold(src, dst);
        Ok(())
    }

    /// Records an event after every copy queued so far, and releases the regions of copies
    /// that earlier events show complete.
    ///
    /// The event reports complete once those copies have finished.
    pub fn record_event(&mut self) -> Result<CopyEvent, GpuMemError> {
        self.release_completed()?;
        let event = match self.spare_events.pop() {
            Some(e) => e,
            None => Arc::new(EventInner::new(&self.device)?),
        };
        self.device.bind()?;
        check_call(
            // SAFETY: event and stream are live handles of this context (the context is
            // current); re-recording an event nobody else holds is allowed.
            unsafe { sys::cuEventRecord(event.event, self.stream) },
            "cuEventRecord",
        )?;
        let keep = std::mem::take(&mut self.unfenced);
        self.fences.push_back(Fence {
            event: event.clone(),
            keep,
        });
        Ok(CopyEvent { inner: event })
    }

    /// Releases the regions of the copies that recorded events show complete, without
    /// waiting. Returns how many copies are still in flight.
    pub fn release_completed(&mut self) -> Result<usize, GpuMemError> {
        while let Some(front) = self.fences.front() {
            if !front.event.query()? {
                break;
            }
            self.retire_front();
        }
        Ok(self.in_flight)
    }

    /// Waits for every queued copy to finish, then releases all the regions it holds.
    pub fn synchronize(&mut self) -> Result<(), GpuMemError> {
        self.device.bind()?;
        check_call(
            // SAFETY: the stream is a live handle of this context, which is current.
            unsafe { sys::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        )?;
        while !self.fences.is_empty() {
            self.retire_front();
        }
        self.unfenced.clear();
        self.in_flight = 0;
        Ok(())
    }

    fn retire_front(&mut self) {
        let Some(fence) = self.fences.pop_front() else {
            return;
        };
        self.in_flight = self.in_flight.saturating_sub(fence.keep.len());
        drop(fence.keep);
        let mut event = fence.event;
        if Arc::get_mut(&mut event).is_some() {
            self.spare_events.push(event);
        }
    }

    fn hold<S, D>(&mut self, src: &Arc<S>, dst: &Arc<D>)
    where
        S: MemoryRegion + ?Sized,
        D: MemoryRegion + ?Sized,
    {
        self.unfenced.push(Box::new((src.clone(), dst.clone())));
        self.in_flight += 1;
    }

    /// Checks that `region` is memory of this stream's device and that the range fits;
    /// returns the device address of `offset`.
    fn device_range<R: MemoryRegion + ?Sized>(
        &self,
        region: &R,
        offset: u64,
        len: u64,
    ) -> Result<u64, GpuMemError> {
        let want = MemoryLocation::Cuda {
            device: self.device.ordinal(),
        };
        if region.location() != want {
            return Err(GpuMemError::WrongMemory(format!(
                "expected memory of CUDA device {}, got {:?} memory",
                self.device.ordinal(),
                region.location()
            )));
        }
        check_range(offset, len, region.len() as u64)?;
        Ok(region.device_addr() + offset)
    }
}

/// Checks that `region` has a host pointer and that the range fits; returns the pointer to
/// `offset`.
fn host_range<R: MemoryRegion + ?Sized>(
    region: &R,
    offset: u64,
    len: u64,
) -> Result<*mut c_void, GpuMemError> {
    let base = region.host_ptr().ok_or_else(|| {
        GpuMemError::WrongMemory(format!(
            "expected host memory, got {:?} memory with no host pointer",
            region.location()
        ))
    })?;
    check_range(offset, len, region.len() as u64)?;
    // SAFETY: offset <= len() (checked), so the pointer stays inside or one past the region.
    Ok(unsafe { base.as_ptr().add(offset as usize) }.cast::<c_void>())
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        let synced = self.device.bind().is_ok() && {
            // SAFETY: the stream is a live handle of this context, which is current.
            let code = unsafe { sys::cuStreamSynchronize(self.stream) };
            code == sys::CUresult::CUDA_SUCCESS
        };
        if !synced {
            // The device may still be copying: keep its regions alive forever rather than
            // free memory under it.
            std::mem::forget(std::mem::take(&mut self.unfenced));
            for fence in self.fences.drain(..) {
                std::mem::forget(fence.keep);
            }
            return;
        }
        // SAFETY: the stream is idle (synchronised above) and destroyed exactly once.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.stream) };
    }
}

impl std::fmt::Debug for CopyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CopyStream(cuda:{}, {} copies in flight)",
            self.device.ordinal(),
            self.in_flight
        )
    }
}

pub(crate) struct EventInner {
    pub(crate) device: Device,
    pub(crate) event: sys::CUevent,
}

// SAFETY: the event handle is an opaque driver object; every call on it binds the context
// first and the driver API is thread-safe; it is destroyed once, in Drop.
unsafe impl Send for EventInner {}
// SAFETY: as above; `&EventInner` only queries or waits on the event.
unsafe impl Sync for EventInner {}

impl EventInner {
    pub(crate) fn new(device: &Device) -> Result<EventInner, GpuMemError> {
        device.bind()?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        check_call(
            // SAFETY: event is a valid out-pointer; the context is current.
            unsafe {
                sys::cuEventCreate(
                    &mut event,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            },
            "cuEventCreate",
        )?;
        Ok(EventInner {
            device: device.clone(),
            event,
        })
    }

    pub(crate) fn query(&self) -> Result<bool, GpuMemError> {
        self.device.bind()?;
        // SAFETY: the event is a live handle of this context, which is current.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check_call(other, "cuEventQuery").map(|()| false),
        }
    }

    pub(crate) fn synchronize(&self) -> Result<(), GpuMemError> {
        self.device.bind()?;
        check_call(
            // SAFETY: the event is a live handle of this context, which is current.
            unsafe { sys::cuEventSynchronize(self.event) },
            "cuEventSynchronize",
        )
    }
}

impl Drop for EventInner {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: the event is destroyed exactly once; the driver defers the release
            // if work recorded into it is still pending.
            let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
        }
    }
}

/// A point in a [`CopyStream`]: it reports complete once every copy queued before it has
/// finished. Cheap to clone; may be waited on from any thread.
#[derive(Clone)]
pub struct CopyEvent {
    inner: Arc<EventInner>,
}

impl CopyEvent {
    /// Whether the copies before the event have finished (does not wait).
    pub fn query(&self) -> Result<bool, GpuMemError> {
        self.inner.query()
    }

    /// Waits until the copies before the event have finished.
    pub fn synchronize(&self) -> Result<(), GpuMemError> {
        self.inner.synchronize()
    }
}

impl std::fmt::Debug for CopyEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CopyEvent(cuda:{})", self.inner.device.ordinal())
    }
}

/// A CUDA stream of the application (torch's current stream, a cupy stream, its own), by
/// the driver's handle, to order transfers after the work queued on it
/// ([`Device::fence_on`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamRef(u64);

impl StreamRef {
    /// The legacy default stream (`CU_STREAM_LEGACY`; torch reports it as `cuda_stream` 0,
    /// `__cuda_array_interface__` as 1). Work recorded on it follows the work of every
    /// blocking stream of the context queued before it.
    pub const LEGACY: StreamRef = StreamRef(0x1);
    /// The calling thread's per-thread default stream (`CU_STREAM_PER_THREAD`;
    /// `__cuda_array_interface__`'s 2).
    pub const PER_THREAD: StreamRef = StreamRef(0x2);

    /// The stream whose driver handle (`CUstream`, as an integer) is `raw`: 0 (the NULL
    /// stream, which is the legacy default stream for the driver calls this crate makes),
    /// 1 ([`LEGACY`](Self::LEGACY)), 2 ([`PER_THREAD`](Self::PER_THREAD)), or a stream
    /// created on the primary context of the device it will be used with (what
    /// `torch.cuda.Stream.cuda_stream` and `cupy.cuda.Stream.ptr` return).
    ///
    /// # Safety
    /// `raw` must be one of those: a handle of a stream that was destroyed, or of another
    /// context, is undefined behaviour in the driver (it may crash the process).
    pub unsafe fn from_raw(raw: u64) -> StreamRef {
        StreamRef(raw)
    }

    /// The driver handle.
    pub fn as_raw(self) -> u64 {
        self.0
    }
}

/// The work queued on an application's stream up to a point: a [`fabric_core::Fence`]
/// that reports done once that work has finished, so that a transfer carrying it
/// ([`Transfer::after`](fabric_core::engine::Transfer::after)) moves what that work wrote.
/// Made by [`Device::fence_on`]; an event recorded on the stream, queried (never waited on)
/// by the engine's workers.
pub struct StreamFence {
    event: EventInner,
    stream: StreamRef,
}

impl StreamFence {
    /// Waits (blocking) until the work before the fence has finished.
    pub fn synchronize(&self) -> Result<(), GpuMemError> {
        self.event.synchronize()
    }
}

impl std::fmt::Debug for StreamFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StreamFence(cuda:{}, stream {:#x})",
            self.event.device.ordinal(),
            self.stream.0
        )
    }
}

impl fabric_core::Fence for StreamFence {
    fn is_done(&self) -> Result<bool, fabric_core::MemoryError> {
        Ok(self.event.query()?)
    }
}

impl Device {
    /// A fence after the work queued on `stream` so far: an event recorded on it now, from
    /// the calling thread (for [`StreamRef::PER_THREAD`], the stream is this thread's).
    /// A transfer that carries it touches its memory only once that work has finished.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use fabric_core::Fence;
    /// let cuda = gpu_mem::Cuda::probe()?.expect("a GPU");
    /// let gpu = cuda.device(0)?;
    /// // ... a kernel writing the source was queued on the legacy default stream ...
    /// let fence = gpu.fence_on(gpu_mem::StreamRef::LEGACY)?;
    /// fence.synchronize()?;
    /// assert!(fence.is_done()?);
    /// # Ok(())
    /// # }
    /// ```
    pub fn fence_on(&self, stream: StreamRef) -> Result<StreamFence, GpuMemError> {
        let event = EventInner::new(self)?;
        check_call(
            // SAFETY: the event is a live handle of this device's context, current on this
            // thread (EventInner::new bound it); `stream` is, per StreamRef::from_raw's
            // contract, a special handle or a live stream of this primary context.
            unsafe { sys::cuEventRecord(event.event, stream.0 as sys::CUstream) },
            "cuEventRecord",
        )?;
        Ok(StreamFence { event, stream })
    }
}
