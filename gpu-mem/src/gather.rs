//! A copy kernel for many small ranges at once: one launch moves a whole batch of pages,
//! where the copy engines would pay a fixed cost per page (a few microseconds each, which
//! caps 64 KiB pages far below NVLink speed).
//!
//! The kernel (`gather.ptx`, hand-written PTX, JIT-compiled by the driver for the device)
//! reads its list of `(dst, src, len)` from pinned host memory mapped into the device's
//! address space; each list stays untouched until an event recorded after the launch says
//! the kernel is done.

use crate::device::Device;
use crate::error::{GpuMemError, check_call};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::ptr::NonNull;

/// The kernel's PTX, NUL-terminated for `cuModuleLoadData`.
static PTX: &str = concat!(include_str!("gather.ptx"), "\0");

/// Threads per block: 16 bytes each per step, so 4 KiB per block per step.
const THREADS: u32 = 256;
/// Most blocks per launch (about 8 resident blocks of 256 threads on each of an H100's or
/// H200's 132 SMs); blocks take ranges in turn beyond that.
const MAX_BLOCKS: u32 = 1056;
/// Ranges a descriptor list holds at least.
const MIN_ENTRIES: usize = 1024;

/// One list of `(dst, src, len)` in pinned, device-mapped host memory.
pub(crate) struct DescList {
    device: Device,
    host: NonNull<u64>,
    dev: sys::CUdeviceptr,
    entries: usize,
}

// SAFETY: the pointer is to pinned memory owned by this value alone (written only through
// `&mut self`); the driver calls in Drop bind the context first.
unsafe impl Send for DescList {}
// SAFETY: `&DescList` gives no access to the memory.
unsafe impl Sync for DescList {}

impl DescList {
    fn new(device: &Device, entries: usize) -> Result<DescList, GpuMemError> {
        device.bind()?;
        let bytes = entries * 24;
        let mut p: *mut c_void = std::ptr::null_mut();
        check_call(
            // SAFETY: p is a valid out-pointer; the context is current.
            unsafe {
                sys::cuMemHostAlloc(
                    &mut p,
                    bytes,
                    sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
                )
            },
            "cuMemHostAlloc (copy list)",
        )?;
        let Some(host) = NonNull::new(p.cast::<u64>()) else {
            return Err(GpuMemError::HostAlloc {
                len: bytes as u64,
                source: crate::error::CudaError::out_of_memory(),
            });
        };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: dev is a valid out-pointer; p is mapped pinned memory of this context.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p, 0) };
        let list = DescList {
            device: device.clone(),
            host,
            dev,
            entries,
        };
        check_call(r, "cuMemHostGetDevicePointer")?;
        Ok(list)
    }
}

impl Drop for DescList {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc and freed once; owners drop lists only
            // after the kernels that read them have completed (or the stream was
            // synchronised).
            unsafe { sys::cuMemFreeHost(self.host.as_ptr().cast()) };
        }
    }
}

/// The loaded kernel of one device, and spare descriptor lists.
pub(crate) struct GatherKernel {
    device: Device,
    module: sys::CUmodule,
    func: sys::CUfunction,
    spare: Vec<DescList>,
}

// SAFETY: module and function are opaque driver handles of the device's context, used only
// after binding it; the driver API is thread-safe. `&GatherKernel` exposes nothing.
unsafe impl Send for GatherKernel {}
// SAFETY: as above.
unsafe impl Sync for GatherKernel {}

impl GatherKernel {
    /// JIT-compiles and loads the kernel on `device`.
    pub(crate) fn load(device: &Device) -> Result<GatherKernel, GpuMemError> {
        device.bind()?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        check_call(
            // SAFETY: module is a valid out-pointer; PTX is NUL-terminated text; the context
            // is current.
            unsafe { sys::cuModuleLoadData(&mut module, PTX.as_ptr().cast()) },
            "cuModuleLoadData (copy kernel)",
        )?;
        let mut func: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: func is a valid out-pointer, module is loaded, the name is NUL-terminated.
        let r = unsafe { sys::cuModuleGetFunction(&mut func, module, c"xfer_gather".as_ptr()) };
        if let Err(e) = check_call(r, "cuModuleGetFunction") {
            // SAFETY: loaded just above, unloaded once.
            unsafe { sys::cuModuleUnload(module) };
            return Err(e);
        }
        Ok(GatherKernel {
            device: device.clone(),
            module,
            func,
            spare: Vec::new(),
        })
    }

    /// Launches the copies `(dst, src, len)` on `stream` and returns their list, which the
    /// caller keeps until an event recorded after this launch completes (then hands it back
    /// with [`recycle`](Self::recycle)).
    ///
    /// # Safety
    /// Every range must lie in live device memory (or peer memory mapped into this context)
    /// that stays valid until the launch completes; `dst` and `src` must be 16-byte
    /// aligned; `stream` must belong to this device's context, which must be current.
    pub(crate) unsafe fn launch(
        &mut self,
        stream: sys::CUstream,
        copies: &[(u64, u64, u64)],
    ) -> Result<DescList, GpuMemError> {
        let n = copies.len();
        let pos = self.spare.iter().position(|l| l.entries >= n);
        let list = match pos {
            Some(i) => self.spare.swap_remove(i),
            None => DescList::new(&self.device, n.max(MIN_ENTRIES))?,
        };
        for (i, &(d, s, l)) in copies.iter().enumerate() {
            // SAFETY: i < n <= list.entries, so the three words lie inside the list, which
            // no kernel reads any more (it was recycled after its event, or is new).
            unsafe {
                let p = list.host.as_ptr().add(3 * i);
                p.write(d);
                p.add(1).write(s);
                p.add(2).write(l);
            }
        }
        let mut descs = list.dev;
        let mut count = n as u32;
        let mut params = [
            (&mut descs as *mut sys::CUdeviceptr).cast::<c_void>(),
            (&mut count as *mut u32).cast::<c_void>(),
        ];
        let blocks = (n as u32).clamp(1, MAX_BLOCKS);
        let r = check_call(
            // SAFETY: the function takes (u64, u32), matching params; the caller upholds
            // the ranges' validity and alignment and the stream's context; the list stays
            // alive until the caller recycles it after the launch's event.
            unsafe {
                sys::cuLaunchKernel(
                    self.func,
                    blocks,
                    1,
                    1,
                    THREADS,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel (copy kernel)",
        );
        match r {
            Ok(()) => Ok(list),
            Err(e) => {
                self.spare.push(list);
                Err(e)
            }
        }
    }

    /// Takes back a list whose launch has completed.
    pub(crate) fn recycle(&mut self, list: DescList) {
        if self.spare.len() < 64 {
            self.spare.push(list);
        }
    }
}

impl Drop for GatherKernel {
    fn drop(&mut self) {
        self.spare.clear();
        if self.device.bind().is_ok() {
            // SAFETY: loaded in `load`, unloaded once; owners synchronise their streams
            // before dropping the kernel.
            unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

/// Batched copies between device memory of one device and a pinned staging buffer: copies
/// queued with [`copy_out`](Self::copy_out) (device to staging) and
/// [`copy_in`](Self::copy_in) (staging to device) run together, as one launch of the copy
/// kernel, at the next [`mark`](Self::mark); [`poll_marks`](Self::poll_marks) says how many
/// marks have completed since it last said so, without waiting.
///
/// One driver call per mark instead of one per range: with many rails in one process, the
/// per-range calls of [`CopyStream`](crate::CopyStream) contend on the context's locks.
/// Regions stay alive until their mark completes; dropping the value waits for its copies.
pub struct StagedCopies {
    device: Device,
    stream: sys::CUstream,
    kernel: GatherKernel,
    staging: std::sync::Arc<crate::PinnedHostBuffer>,
    /// The staging buffer's address on the device.
    staging_dev: u64,
    /// 16-byte aligned copies `(dst, src, len)` for the kernel.
    aligned: Vec<(u64, u64, u64)>,
    /// The others, copied one by one.
    odd: Vec<(u64, u64, u64)>,
    keep: Vec<std::sync::Arc<dyn fabric_core::MemoryRegion>>,
    fences: std::collections::VecDeque<StagedFence>,
    spare: Vec<std::sync::Arc<crate::stream::EventInner>>,
}

struct StagedFence {
    event: std::sync::Arc<crate::stream::EventInner>,
    list: Option<DescList>,
    keep: Vec<std::sync::Arc<dyn fabric_core::MemoryRegion>>,
}

// SAFETY: the stream is an opaque driver handle used only after binding its context; the
// other fields are Send. `&StagedCopies` exposes nothing that touches them.
unsafe impl Send for StagedCopies {}
// SAFETY: as above.
unsafe impl Sync for StagedCopies {}

impl StagedCopies {
    /// Copies between memory of `device` and `staging` (pinned memory, which every CUDA
    /// context maps). Fails where the copy kernel does not load.
    pub fn new(
        device: &Device,
        staging: std::sync::Arc<crate::PinnedHostBuffer>,
    ) -> Result<StagedCopies, GpuMemError> {
        let kernel = GatherKernel::load(device)?;
        device.bind()?;
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
        let stream = crate::stream::new_nonblocking_stream()?;
        Ok(StagedCopies {
            device: device.clone(),
            stream,
            kernel,
            staging,
            staging_dev,
            aligned: Vec::new(),
            odd: Vec::new(),
            keep: Vec::new(),
            fences: std::collections::VecDeque::new(),
            spare: Vec::new(),
        })
    }

    /// The staging buffer.
    pub fn staging(&self) -> &std::sync::Arc<crate::PinnedHostBuffer> {
        &self.staging
    }

    fn device_range(
        &self,
        region: &std::sync::Arc<dyn fabric_core::MemoryRegion>,
        offset: u64,
        len: u64,
    ) -> Result<u64, GpuMemError> {
        match region.location() {
            fabric_core::MemoryLocation::Cuda { device } if device == self.device.ordinal() => {}
            other => {
                return Err(GpuMemError::WrongMemory(format!(
                    "staged copies move memory of CUDA device {}, not {other:?}",
                    self.device.ordinal()
                )));
            }
        }
        crate::range::check_range(offset, len, region.len() as u64)?;
        Ok(region.device_addr() + offset)
    }

    fn queue(
        &mut self,
        dst: u64,
        src: u64,
        len: u64,
        region: &std::sync::Arc<dyn fabric_core::MemoryRegion>,
    ) {
        if len == 0 {
            return;
        }
        if (dst | src) & 15 == 0 {
            self.aligned.push((dst, src, len));
        } else {
            self.odd.push((dst, src, len));
        }
        if !self
            .keep
            .last()
            .is_some_and(|k| std::sync::Arc::ptr_eq(k, region))
        {
            self.keep.push(region.clone());
        }
    }

    /// Queues a copy of `len` bytes of device memory `src` at `src_offset` into staging at
    /// `at`.
    pub fn copy_out(
        &mut self,
        src: &std::sync::Arc<dyn fabric_core::MemoryRegion>,
        src_offset: u64,
        at: u64,
        len: u64,
    ) -> Result<(), GpuMemError> {
        let from = self.device_range(src, src_offset, len)?;
        crate::range::check_range(at, len, self.staging.len() as u64)?;
        self.queue(self.staging_dev + at, from, len, src);
        Ok(())
    }

    /// Queues a copy of `len` staging bytes at `at` into device memory `dst` at
    /// `dst_offset`.
    pub fn copy_in(
        &mut self,
        at: u64,
        dst: &std::sync::Arc<dyn fabric_core::MemoryRegion>,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), GpuMemError> {
        let to = self.device_range(dst, dst_offset, len)?;
        crate::range::check_range(at, len, self.staging.len() as u64)?;
        self.queue(to, self.staging_dev + at, len, dst);
        Ok(())
    }

    /// Starts the copies queued since the last mark and marks them.
    pub fn mark(&mut self) -> Result<(), GpuMemError> {
        self.device.bind()?;
        let mut list = None;
        let mut r = Ok(());
        if !self.aligned.is_empty() {
            // SAFETY: every range was checked against its live region (kept alive in
            // `keep` until this mark's event completes) or against the staging buffer
            // (alive as long as self); the ends are 16-byte aligned; the stream is this
            // context's, which is current.
            match unsafe { self.kernel.launch(self.stream, &self.aligned) } {
                Ok(l) => list = Some(l),
                Err(e) => r = Err(e),
            }
        }
        for &(d, s, l) in &self.odd {
            if r.is_err() {
                break;
            }
            r = check_call(
                // SAFETY: as above, for one range.
                unsafe { sys::cuMemcpyAsync(d, s, l as usize, self.stream) },
                "cuMemcpyAsync",
            );
        }
        self.aligned.clear();
        self.odd.clear();
        let event = match self.spare.pop() {
            Some(e) => e,
            None => std::sync::Arc::new(crate::stream::EventInner::new(&self.device)?),
        };
        check_call(
            // SAFETY: event and stream are live handles of this context, which is current.
            unsafe { sys::cuEventRecord(event.event, self.stream) },
            "cuEventRecord",
        )?;
        self.fences.push_back(StagedFence {
            event,
            list,
            keep: std::mem::take(&mut self.keep),
        });
        r
    }

    /// How many more marks, oldest first, have completed (never waits). An error means a
    /// copy failed on the device.
    pub fn poll_marks(&mut self) -> Result<usize, GpuMemError> {
        let mut n = 0;
        while let Some(f) = self.fences.front() {
            if !f.event.query()? {
                break;
            }
            if let Some(f) = self.fences.pop_front() {
                if let Some(l) = f.list {
                    self.kernel.recycle(l);
                }
                drop(f.keep);
                self.spare.push(f.event);
            }
            n += 1;
        }
        Ok(n)
    }
}

impl Drop for StagedCopies {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: the stream is live and destroyed once; synchronising first keeps the
            // regions and lists (dropped after this) alive until its copies are done.
            unsafe {
                sys::cuStreamSynchronize(self.stream);
                sys::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}
