//! [`DeviceBuffer`]: device memory from `cuMemAlloc`, with synchronous copies, fill, and
//! dmabuf export; it implements [`MemoryRegion`] so transports can register it.

use crate::device::{Device, STAGING};
use crate::error::{CopyDirection, CudaError, GpuMemError, check};
use crate::range::{check_range, page_span};
use cudarc::driver::sys;
use fabric_core::memory::DmabufHandle;
use fabric_core::{MemoryError, MemoryLocation, MemoryRegion};
use std::ffi::{c_int, c_void};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::OnceLock;

/// Granularity of dmabuf exports and of allocation sizes: the host page size the driver
/// requires for `cuMemGetHandleForAddressRange`.
const PAGE: u64 = 4096;

/// Device memory on one CUDA device, allocated with `cuMemAlloc` (plain device memory, never
/// managed memory) and freed on drop.
///
/// Synchronous methods ([`copy_from_host`](Self::copy_from_host),
/// [`copy_to_host`](Self::copy_to_host), [`fill`](Self::fill)) return once the device
/// memory holds the result. Copies go through a pinned bounce buffer and a non-blocking
/// stream private to the calling thread (so several threads copy at once, at DMA speed),
/// `fill` runs on the legacy default stream; neither
/// is ordered with copies queued on a [`CopyStream`](crate::CopyStream): wait for that
/// stream's event first.
///
/// # Thread safety
/// A `DeviceBuffer` is `Send` and `Sync`: it holds only the device address (an integer),
/// its length, an `Arc` of the device's context and an optional dmabuf file descriptor.
/// Every method makes the context current on the calling thread before calling the
/// driver, and the driver API is thread-safe, so any thread may use it.
pub struct DeviceBuffer {
    device: Device,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// The whole-buffer dmabuf, exported on first use (see [`DeviceBuffer::dmabuf_handle`]).
    dmabuf: OnceLock<Result<DmabufExport, GpuMemError>>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on `device`. The contents are unspecified until written.
    ///
    /// The allocation is rounded up to a multiple of 4 KiB (so that a dmabuf export of the
    /// whole buffer stays inside it); [`len`](Self::len) stays `len`.
    pub fn new(device: &Device, len: usize) -> Result<DeviceBuffer, GpuMemError> {
        if len == 0 {
            return Err(GpuMemError::ZeroSize);
        }
        let alloc_len = len.checked_next_multiple_of(PAGE as usize).ok_or_else(|| {
            GpuMemError::DeviceAlloc {
                device: device.ordinal(),
                len: len as u64,
                source: CudaError::out_of_memory(),
            }
        })?;
        device.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        check(
            // SAFETY: ptr is a valid out-pointer; the device's context is current (bound above).
            unsafe { sys::cuMemAlloc_v2(&mut ptr, alloc_len) },
            |source| GpuMemError::DeviceAlloc {
                device: device.ordinal(),
                len: len as u64,
                source,
            },
        )?;
        Ok(DeviceBuffer {
            device: device.clone(),
            ptr,
            len,
            dmabuf: OnceLock::new(),
        })
    }

    /// Length in bytes (as asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: zero-byte buffers cannot be allocated.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The device address of the first byte (what a NIC or kernel uses).
    pub fn device_addr(&self) -> u64 {
        self.ptr
    }

    /// Copies `src` into the buffer at `offset`; returns once the bytes are in device memory.
    pub fn copy_from_host(&self, offset: u64, src: &[u8]) -> Result<(), GpuMemError> {
        check_range(offset, src.len() as u64, self.len as u64)?;
        if src.is_empty() {
            return Ok(());
        }
        self.device.bind()?;
        let (stream, staging) = self.device.thread_staging()?;
        let err = |source| GpuMemError::Copy {
            direction: CopyDirection::HostToDevice,
            len: src.len() as u64,
            source,
        };
        for (i, chunk) in src.chunks(STAGING).enumerate() {
            // SAFETY: staging holds STAGING >= chunk.len() bytes private to this thread, and
            // the previous copy from it was waited for; chunk is a valid slice.
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), staging, chunk.len()) };
            check(
                // SAFETY: the destination lies inside this live allocation (range checked
                // above); staging is pinned memory of at least chunk.len() bytes that is not
                // touched until the stream is synchronised below; the context is current.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        self.ptr + offset + (i * STAGING) as u64,
                        staging.cast::<c_void>(),
                        chunk.len(),
                        stream,
                    )
                },
                err,
            )?;
            // Wait for this thread's stream only, so that other threads' copies run meanwhile.
            self.sync_stream(stream, err)?;
        }
        Ok(())
    }

    /// Copies bytes at `offset` into `dst`; returns once `dst` holds them.
    pub fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuMemError> {
        check_range(offset, dst.len() as u64, self.len as u64)?;
        if dst.is_empty() {
            return Ok(());
        }
        self.device.bind()?;
        let (stream, staging) = self.device.thread_staging()?;
        let len = dst.len() as u64;
        let err = |source| GpuMemError::Copy {
            direction: CopyDirection::DeviceToHost,
            len,
            source,
        };
        for (i, chunk) in dst.chunks_mut(STAGING).enumerate() {
            check(
                // SAFETY: the source lies inside this live allocation (range checked above);
                // staging is pinned memory of at least chunk.len() bytes private to this
                // thread; the context is current.
                unsafe {
                    sys::cuMemcpyDtoHAsync_v2(
                        staging.cast::<c_void>(),
                        self.ptr + offset + (i * STAGING) as u64,
                        chunk.len(),
                        stream,
                    )
                },
                err,
            )?;
            self.sync_stream(stream, err)?;
            // SAFETY: the copy into staging has completed (stream synchronised); chunk is a
            // distinct writable slice of chunk.len() <= STAGING bytes.
            unsafe { std::ptr::copy_nonoverlapping(staging, chunk.as_mut_ptr(), chunk.len()) };
        }
        Ok(())
    }

    /// Copies several ranges out, `(offset, destination)` each: the copies are queued
    /// together through this thread's pinned bounce buffer and waited for once per 4 MiB
    /// (one synchronisation for a batch of pages instead of one per page).
    pub fn copy_many_to_host(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), GpuMemError> {
        for (offset, dst) in parts.iter() {
            check_range(*offset, dst.len() as u64, self.len as u64)?;
        }
        self.device.bind()?;
        let (stream, staging) = self.device.thread_staging()?;
        let err = |len: u64| {
            move |source| GpuMemError::Copy {
                direction: CopyDirection::DeviceToHost,
                len,
                source,
            }
        };
        // Parts queued into the bounce buffer: (index in parts, position in staging).
        let mut queued: Vec<(usize, usize)> = Vec::new();
        let mut used = 0usize;
        let mut i = 0;
        while i < parts.len() {
            let len = parts[i].1.len();
            if len > STAGING {
                // Too big to share the buffer: copied alone, chunk by chunk, once the copies
                // queued in the buffer have been taken out of it.
                self.drain_to(stream, staging, &queued, parts, used)?;
                queued.clear();
                used = 0;
                let (off, dst) = &mut parts[i];
                self.copy_to_host(*off, dst)?;
                i += 1;
                continue;
            }
            if used + len > STAGING {
                self.drain_to(stream, staging, &queued, parts, used)?;
                queued.clear();
                used = 0;
                continue;
            }
            if len > 0 {
                check(
                    // SAFETY: the source lies inside this live allocation (checked above);
                    // staging + used .. + len lies inside the STAGING-byte pinned buffer private
                    // to this thread; the context is current.
                    unsafe {
                        sys::cuMemcpyDtoHAsync_v2(
                            staging.add(used).cast::<c_void>(),
                            self.ptr + parts[i].0,
                            len,
                            stream,
                        )
                    },
                    err(len as u64),
                )?;
                queued.push((i, used));
                used += len;
            }
            i += 1;
        }
        self.drain_to(stream, staging, &queued, parts, used)
    }

    /// Waits for the queued device-to-host copies, then moves them out of the bounce buffer.
    fn drain_to(
        &self,
        stream: sys::CUstream,
        staging: *mut u8,
        queued: &[(usize, usize)],
        parts: &mut [(u64, &mut [u8])],
        used: usize,
    ) -> Result<(), GpuMemError> {
        if queued.is_empty() {
            return Ok(());
        }
        self.sync_stream(stream, |source| GpuMemError::Copy {
            direction: CopyDirection::DeviceToHost,
            len: used as u64,
            source,
        })?;
        for &(i, at) in queued {
            let dst = &mut parts[i].1;
            // SAFETY: the copies into staging[at..at+len] completed (stream synchronised);
            // dst is a distinct writable slice of that length.
            unsafe { std::ptr::copy_nonoverlapping(staging.add(at), dst.as_mut_ptr(), dst.len()) };
        }
        Ok(())
    }

    /// Copies several ranges in, `(offset, source)` each, batched like
    /// [`copy_many_to_host`](Self::copy_many_to_host).
    pub fn copy_many_from_host(&self, parts: &[(u64, &[u8])]) -> Result<(), GpuMemError> {
        for (offset, src) in parts {
            check_range(*offset, src.len() as u64, self.len as u64)?;
        }
        self.device.bind()?;
        let (stream, staging) = self.device.thread_staging()?;
        let mut used = 0usize;
        for (offset, src) in parts {
            if used + src.len() > STAGING || (src.len() > STAGING && used > 0) {
                // The bounce buffer is full: let its copies finish before reusing it.
                self.sync_stream(stream, |source| GpuMemError::Copy {
                    direction: CopyDirection::HostToDevice,
                    len: used as u64,
                    source,
                })?;
                used = 0;
            }
            if src.len() > STAGING {
                // Too big to share the buffer (now idle): copied alone, chunk by chunk.
                self.copy_from_host(*offset, src)?;
                continue;
            }
            if src.is_empty() {
                continue;
            }
            // SAFETY: staging + used .. + len lies inside the pinned buffer, whose earlier
            // copies from this region were waited for (or queue behind this one and read
            // other bytes); src is a valid slice.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), staging.add(used), src.len()) };
            check(
                // SAFETY: the destination lies inside this live allocation (checked above);
                // the source is pinned memory that stays untouched until the stream is
                // synchronised; the context is current.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        self.ptr + offset,
                        staging.add(used).cast::<c_void>(),
                        src.len(),
                        stream,
                    )
                },
                |source| GpuMemError::Copy {
                    direction: CopyDirection::HostToDevice,
                    len: src.len() as u64,
                    source,
                },
            )?;
            used += src.len();
        }
        self.sync_stream(stream, |source| GpuMemError::Copy {
            direction: CopyDirection::HostToDevice,
            len: used as u64,
            source,
        })
    }

    /// Returns a copy of `len` bytes at `offset`.
    pub fn to_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, GpuMemError> {
        check_range(offset, len as u64, self.len as u64)?;
        let mut v = vec![0u8; len];
        self.copy_to_host(offset, &mut v)?;
        Ok(v)
    }

    /// Sets `len` bytes at `offset` to `byte`; returns once the device memory is set.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<(), GpuMemError> {
        check_range(offset, len, self.len as u64)?;
        if len == 0 {
            return Ok(());
        }
        self.device.bind()?;
        let err = |source| GpuMemError::Memset { len, source };
        check(
            // SAFETY: the range lies inside this live allocation (checked above, and len fits
            // a usize since it is at most self.len); the context is current.
            unsafe { sys::cuMemsetD8_v2(self.ptr + offset, byte, len as usize) },
            err,
        )?;
        // cuMemsetD8 is asynchronous for device memory: wait for it.
        self.sync_legacy_stream(err)
    }

    /// Copies `len` bytes from `src` at `src_offset` into this buffer at `offset`; returns
    /// once the copy has completed. `src` may live on another device.
    pub fn copy_from_device(
        &self,
        offset: u64,
        src: &DeviceBuffer,
        src_offset: u64,
        len: u64,
    ) -> Result<(), GpuMemError> {
        check_range(offset, len, self.len as u64)?;
        check_range(src_offset, len, src.len as u64)?;
        if len == 0 {
            return Ok(());
        }
        self.device.bind()?;
        let err = |source| GpuMemError::Copy {
            direction: CopyDirection::DeviceToDevice,
            len,
            source,
        };
        check(
            // SAFETY: both ranges lie inside live allocations (checked above; both buffers are
            // borrowed for the call) and the context is current. Device memory is reached only
            // through the driver, so even overlapping ranges of one buffer (whose result the
            // driver leaves unspecified) cannot break Rust's aliasing rules.
            unsafe { sys::cuMemcpyDtoD_v2(self.ptr + offset, src.ptr + src_offset, len as usize) },
            err,
        )?;
        self.sync_legacy_stream(err)
    }

    /// Exports `offset..offset+len` of the buffer as a dmabuf (for NIC registration).
    ///
    /// The driver exports whole host pages, so the dmabuf covers the page-aligned span
    /// around the range; [`DmabufExport::offset`] is where the range's first byte sits
    /// inside it. The returned value owns the file descriptor and closes it on drop; the
    /// buffer must outlive every registration made with it.
    ///
    /// Fails with [`GpuMemError::DmabufUnsupported`] when the driver (before CUDA 11.7),
    /// the device or the kernel cannot export dmabufs.
    pub fn export_dmabuf_range(&self, offset: u64, len: u64) -> Result<DmabufExport, GpuMemError> {
        check_range(offset, len, self.len as u64)?;
        if len == 0 {
            return Err(GpuMemError::ZeroSize);
        }
        if !self.device.dmabuf_supported()? {
            return Err(GpuMemError::DmabufUnsupported(format!(
                "CUDA device {} or its driver ({}) cannot export dmabufs",
                self.device.ordinal(),
                self.device.inner.driver_version
            )));
        }
        let (start, end, inner_offset) =
            page_span(self.ptr + offset, len, PAGE).ok_or(GpuMemError::OutOfBounds {
                offset,
                len,
                size: self.len as u64,
            })?;
        self.device.bind()?;
        let mut fd: c_int = -1;
        // SAFETY: the driver writes one int (the fd) through the handle pointer, which
        // points to fd; start..end is page aligned and covers a range of this live
        // allocation; the context is current.
        let code = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut c_int).cast::<c_void>(),
                start,
                (end - start) as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        check(code, |source| {
            if source.is_not_supported() {
                GpuMemError::DmabufUnsupported(source.to_string())
            } else {
                GpuMemError::DmabufExport { len, source }
            }
        })?;
        if fd < 0 {
            return Err(GpuMemError::DmabufUnsupported(format!(
                "the driver returned no file descriptor ({fd})"
            )));
        }
        // SAFETY: the driver just created fd for us and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DmabufExport {
            fd,
            offset: inner_offset,
            len,
        })
    }

    /// The dmabuf of the whole buffer, exported on the first call and kept (with its file
    /// descriptor) until the buffer is dropped. A failed export is remembered too, and
    /// returned again by later calls.
    ///
    /// [`MemoryRegion::dmabuf`] returns this handle, or `None` when the export failed.
    pub fn dmabuf_handle(&self) -> Result<DmabufHandle, GpuMemError> {
        match self
            .dmabuf
            .get_or_init(|| self.export_dmabuf_range(0, self.len as u64))
        {
            Ok(export) => Ok(export.handle()),
            Err(e) => Err(e.clone()),
        }
    }

    fn sync_stream(
        &self,
        stream: sys::CUstream,
        err: impl FnOnce(CudaError) -> GpuMemError,
    ) -> Result<(), GpuMemError> {
        // SAFETY: `stream` is this thread's live stream on this buffer's (current) context.
        check(unsafe { sys::cuStreamSynchronize(stream) }, err)
    }

    fn sync_legacy_stream(
        &self,
        err: impl FnOnce(CudaError) -> GpuMemError,
    ) -> Result<(), GpuMemError> {
        // SAFETY: the null stream is the context's legacy default stream, always valid; the
        // context is current (every caller bound it).
        check(
            unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) },
            err,
        )
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Close the dmabuf before the memory it exports goes away.
        drop(self.dmabuf.take());
        if self.device.bind().is_err() {
            // Without the context the memory cannot be freed; leaking it is the only safe
            // choice (the context is torn down with the process).
            return;
        }
        // SAFETY: ptr came from cuMemAlloc in this context and is freed exactly once;
        // copies queued on a CopyStream hold an Arc to the buffer, so none is in flight.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer(cuda:{} {:#x}, {} bytes)",
            self.device.ordinal(),
            self.ptr,
            self.len
        )
    }
}

// SAFETY: device_addr() is the start of a live cuMemAlloc allocation of at least len()
// bytes that never moves and is freed only when the buffer is dropped (so never while an
// Arc to it is held); host_ptr() is None, so no host access is promised. Send + Sync hold
// soundly (and are derived, not asserted): the fields are an integer address, lengths, an
// Arc'd context (cudarc's CudaContext is Send + Sync) and an OnceLock'd file descriptor, and
// every driver call first makes the context current on the calling thread.
unsafe impl MemoryRegion for DeviceBuffer {
    fn len(&self) -> usize {
        self.len
    }

    fn location(&self) -> MemoryLocation {
        MemoryLocation::Cuda {
            device: self.device.ordinal(),
        }
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }

    fn device_addr(&self) -> u64 {
        self.ptr
    }

    /// Exports the whole buffer on first call (see [`DeviceBuffer::dmabuf_handle`]).
    fn dmabuf(&self) -> Option<DmabufHandle> {
        self.dmabuf_handle().ok()
    }

    fn read_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.copy_to_host(offset, dst).map_err(MemoryError::from)
    }

    fn write_from_host(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.copy_from_host(offset, src).map_err(MemoryError::from)
    }

    fn read_many_to_host(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), MemoryError> {
        self.copy_many_to_host(parts).map_err(MemoryError::from)
    }

    fn write_many_from_host(&self, parts: &[(u64, &[u8])]) -> Result<(), MemoryError> {
        self.copy_many_from_host(parts).map_err(MemoryError::from)
    }
}

/// A dmabuf export of a device range: an owned file descriptor, closed on drop.
#[derive(Debug)]
pub struct DmabufExport {
    fd: OwnedFd,
    offset: u64,
    len: u64,
}

impl DmabufExport {
    /// The dmabuf file descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Offset of the exported range's first byte inside the dmabuf.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length of the exported range in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: empty ranges are not exported.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The handle in fabric-core's form; the fd stays owned by `self`.
    pub fn handle(&self) -> DmabufHandle {
        DmabufHandle {
            fd: self.raw_fd(),
            offset: self.offset,
        }
    }

    /// Gives up ownership of the file descriptor.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

// Compile-time proof of the thread-safety claims above.
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<DeviceBuffer>();
    assert_send_sync::<DmabufExport>();
};
