//! [`PinnedHostBuffer`]: page-locked host memory from `cuMemHostAlloc`, the staging memory
//! for asynchronous copies; it implements [`MemoryRegion`] as host memory.

use crate::device::Device;
use crate::error::{CudaError, GpuMemError, check};
use crate::range::checked_offset;
use cudarc::driver::sys;
use fabric_core::{MemoryLocation, MemoryRegion};
use std::ffi::c_void;
use std::ptr::NonNull;

/// Page-locked (pinned) host memory, zeroed at allocation and freed on drop.
///
/// Allocated as portable memory (`CU_MEMHOSTALLOC_PORTABLE`), so every CUDA context treats it
/// as pinned. Copies between it and device memory run at full PCIe speed and, on a
/// [`CopyStream`](crate::CopyStream), asynchronously.
///
/// Access from the CPU goes through copies ([`read`](Self::read), [`write`](Self::write)) or
/// raw pointers, never through references, because a device copy may write the bytes at any
/// time; as for any [`MemoryRegion`], the application must not read a range while a copy or
/// transfer that writes it is in flight.
pub struct PinnedHostBuffer {
    device: Device,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively and hands out no references into it,
// only copies through raw pointers, which the MemoryRegion contract already requires callers
// to order against in-flight copies; freeing binds the context on whatever thread drops it.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: as above: `&PinnedHostBuffer` gives access to the bytes only through copies.
unsafe impl Sync for PinnedHostBuffer {}

impl PinnedHostBuffer {
    /// Allocates `len` bytes of page-locked host memory and zeroes them.
    pub fn new(device: &Device, len: usize) -> Result<PinnedHostBuffer, GpuMemError> {
        if len == 0 {
            return Err(GpuMemError::ZeroSize);
        }
        device.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        check(
            // SAFETY: p is a valid out-pointer; the context is current (bound above).
            unsafe {
                sys::cuMemHostAlloc(
                    &mut p,
                    len,
                    sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
                )
            },
            |source| GpuMemError::HostAlloc {
                len: len as u64,
                source,
            },
        )?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| GpuMemError::HostAlloc {
            len: len as u64,
            source: CudaError::out_of_memory(),
        })?;
        // SAFETY: ptr points to len freshly allocated bytes that nothing else uses yet.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedHostBuffer {
            device: device.clone(),
            ptr,
            len,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: zero-byte buffers cannot be allocated.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte, for I/O calls (`writev`, `recv`) that fill or drain the buffer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Copies `dst.len()` bytes at `offset` out of the buffer.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuMemError> {
        let off = checked_offset(offset, dst.len(), self.len)?;
        // SAFETY: off+dst.len() lies inside the allocation (checked); dst is a distinct
        // &mut borrow, so the ranges cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), GpuMemError> {
        let off = checked_offset(offset, src.len(), self.len)?;
        // SAFETY: off+src.len() lies inside the allocation (checked); src is a shared
        // borrow of other memory (no reference into this buffer is ever handed out).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len())
        };
        Ok(())
    }

    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<(), GpuMemError> {
        crate::range::check_range(offset, len, self.len as u64)?;
        // SAFETY: offset+len lies inside the allocation (checked above), so both fit a usize.
        unsafe {
            std::ptr::write_bytes(self.ptr.as_ptr().add(offset as usize), byte, len as usize)
        };
        Ok(())
    }

    /// Returns a copy of `len` bytes at `offset`.
    pub fn to_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, GpuMemError> {
        checked_offset(offset, len, self.len)?;
        let mut v = vec![0u8; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }

    /// The whole buffer as a slice.
    ///
    /// # Safety
    /// For as long as the slice lives, nothing may write the buffer: no copy queued on a
    /// [`CopyStream`](crate::CopyStream) into it may be in flight (wait for its event
    /// first), no transfer may land in it, and no other thread may call
    /// [`write`](Self::write) or [`fill`](Self::fill).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr points to len initialised (zeroed at allocation) bytes that live as
        // long as self; the caller guarantees no writes while the slice lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The device whose context allocated the buffer.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_err() {
            // Leaking is the only safe choice without a context to free it in.
            return;
        }
        // SAFETY: ptr came from cuMemHostAlloc and is freed exactly once; copies queued on
        // a CopyStream hold an Arc to the buffer, so none is in flight.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.as_ptr().cast::<c_void>()) };
    }
}

impl std::fmt::Debug for PinnedHostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedHostBuffer({:p}, {} bytes)", self.ptr, self.len)
    }
}

// SAFETY: host_ptr() points to len() bytes of page-locked memory owned by self, valid for
// reads and writes from any thread until drop, and never moved (pinned memory is not even
// paged out). device_addr() is the same address, which CUDA and NICs accept for host memory.
unsafe impl MemoryRegion for PinnedHostBuffer {
    fn len(&self) -> usize {
        self.len
    }

    fn location(&self) -> MemoryLocation {
        MemoryLocation::Host
    }

    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.ptr)
    }

    fn device_addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}
