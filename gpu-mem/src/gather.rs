//! A copy kernel for many small ranges at once: one launch moves a whole batch of pages,
//! where the copy engines would pay a fixed cost per page (a few microseconds each, which
//! caps 64 KiB pages far below NVLink speed).
//!
//! The kernel (`gather.ptx`, hand-written PTX, JIT-compiled by the driver for the device)
//! reads its list of `(dst, src, len)` from pinned host memory mapped into the device's
//! address space; each list stays untouched until an event recorded after the launch says
//! the kernel is done. Its second entry, `xfer_gather_rows`, takes strided ranges `(dst,
//! src, len, rows, dst_stride, src_stride)`: the rows of a head slice of a KV block, say,
//! as one entry instead of one per row (per-entry work, not bytes, is what a list of
//! small rows costs).

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

/// One list of `(dst, src, len)` (or, for the rows kernel, `(dst, src, len, rows,
/// dst_stride, src_stride)`) in pinned, device-mapped host memory.
pub(crate) struct DescList {
    device: Device,
    host: NonNull<u64>,
    dev: sys::CUdeviceptr,
    entries: usize,
    /// Words per entry: [`PLAIN`] or [`ROWS`].
    words: usize,
}

/// Words of a plain entry.
pub(crate) const PLAIN: usize = 3;
/// Words of a strided entry.
const ROWS: usize = 6;

// SAFETY: the pointer is to pinned memory owned by this value alone (written only through
// `&mut self`); the driver calls in Drop bind the context first.
unsafe impl Send for DescList {}
// SAFETY: `&DescList` gives no access to the memory.
unsafe impl Sync for DescList {}

impl DescList {
    pub(crate) fn new(
        device: &Device,
        entries: usize,
        words: usize,
    ) -> Result<DescList, GpuMemError> {
        device.bind()?;
        let bytes = entries * words * 8;
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
            words,
        };
        check_call(r, "cuMemHostGetDevicePointer")?;
        Ok(list)
    }
}

impl DescList {
    /// The list's first word as the host sees it.
    pub(crate) fn host_word(&self) -> *mut u64 {
        self.host.as_ptr()
    }

    /// The list's first word as the device sees it.
    pub(crate) fn device_word(&self) -> sys::CUdeviceptr {
        self.dev
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

/// The loaded kernels of one device, and spare descriptor lists of each.
pub(crate) struct GatherKernel {
    device: Device,
    module: sys::CUmodule,
    func: sys::CUfunction,
    func_rows: sys::CUfunction,
    spare: Vec<DescList>,
    spare_rows: Vec<DescList>,
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
        let (mut func, mut func_rows): (sys::CUfunction, sys::CUfunction) =
            (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: func and func_rows are valid out-pointers, module is loaded, the names are
        // NUL-terminated.
        let r = unsafe { sys::cuModuleGetFunction(&mut func, module, c"xfer_gather".as_ptr()) };
        let found = check_call(r, "cuModuleGetFunction").and_then(|()| {
            // SAFETY: as above.
            let r = unsafe {
                sys::cuModuleGetFunction(&mut func_rows, module, c"xfer_gather_rows".as_ptr())
            };
            check_call(r, "cuModuleGetFunction (rows)")
        });
        if let Err(e) = found {
            // SAFETY: loaded just above, unloaded once.
            unsafe { sys::cuModuleUnload(module) };
            return Err(e);
        }
        Ok(GatherKernel {
            device: device.clone(),
            module,
            func,
            func_rows,
            spare: Vec::new(),
            spare_rows: Vec::new(),
        })
    }

    /// Launches the copies that `fill` writes into a list of at most `bound` ranges (`(dst,
    /// src, len)` each, through [`ListWriter::push`]) on `stream`, and returns the list,
    /// which the caller keeps until a mark recorded after this launch completes (then hands
    /// it back with [`recycle`](Self::recycle)); `None` (and no launch) when `fill` wrote
    /// nothing.
    ///
    /// # Safety
    /// Every range written must lie in live device memory (or peer memory mapped into this
    /// context) that stays valid until the launch completes; `dst` and `src` must be 16-byte
    /// aligned; `stream` must belong to this device's context, which must be current.
    pub(crate) unsafe fn launch(
        &mut self,
        stream: sys::CUstream,
        bound: usize,
        fill: impl FnOnce(&mut ListWriter<'_>),
    ) -> Result<Option<DescList>, GpuMemError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.launch_list(PLAIN, stream, bound, fill) }
    }

    /// As [`launch`](Self::launch), for strided ranges written with
    /// [`ListWriter::push_rows`] into a list of at most `bound`, copied by the rows kernel.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch), for every row of every range; `len`, `dst`, `src`
    /// and both strides must be multiples of 16.
    pub(crate) unsafe fn launch_rows(
        &mut self,
        stream: sys::CUstream,
        bound: usize,
        fill: impl FnOnce(&mut ListWriter<'_>),
    ) -> Result<Option<DescList>, GpuMemError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.launch_list(ROWS, stream, bound, fill) }
    }

    /// Fills a list of entries of `words` words and launches the kernel that reads them.
    ///
    /// # Safety
    /// See [`launch`](Self::launch) and [`launch_rows`](Self::launch_rows).
    unsafe fn launch_list(
        &mut self,
        words: usize,
        stream: sys::CUstream,
        bound: usize,
        fill: impl FnOnce(&mut ListWriter<'_>),
    ) -> Result<Option<DescList>, GpuMemError> {
        let (spare, func) = match words {
            ROWS => (&mut self.spare_rows, self.func_rows),
            _ => (&mut self.spare, self.func),
        };
        let list = match best_fit(spare.iter().map(|l| l.entries), bound) {
            Some(i) => spare.swap_remove(i),
            None => DescList::new(&self.device, list_entries(bound), words)?,
        };
        let mut w = ListWriter {
            list: &list,
            len: 0,
            overflow: false,
        };
        fill(&mut w);
        let (n, overflow) = (w.len, w.overflow);
        if n == 0 || overflow {
            self.recycle(list);
            return match overflow {
                false => Ok(None),
                true => Err(GpuMemError::WrongMemory(format!(
                    "more ranges than the {bound} the copy list was sized for"
                ))),
            };
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
            // alive until the caller recycles it after the launch's mark.
            unsafe {
                sys::cuLaunchKernel(
                    func,
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
            Ok(()) => Ok(Some(list)),
            Err(e) => {
                self.recycle(list);
                Err(e)
            }
        }
    }

    /// Takes back a list whose launch has completed.
    pub(crate) fn recycle(&mut self, list: DescList) {
        let spare = match list.words {
            ROWS => &mut self.spare_rows,
            _ => &mut self.spare,
        };
        if spare.len() < MAX_SPARE {
            spare.push(list);
        }
    }
}

/// Writes ranges into a list that no kernel reads (new, or recycled after its launch).
pub(crate) struct ListWriter<'a> {
    list: &'a DescList,
    len: usize,
    overflow: bool,
}

impl ListWriter<'_> {
    /// Appends the range `(dst, src, len)`. One beyond the list's entries fails the launch
    /// instead (the caller's bound counts every range it writes, so none is).
    pub(crate) fn push(&mut self, dst: u64, src: u64, len: u64) {
        self.write(&[dst, src, len]);
    }

    /// Appends the strided range of `rows` rows of `len` bytes, row `i` from `src + i *
    /// src_stride` to `dst + i * dst_stride` (a list of the rows kernel only).
    pub(crate) fn push_rows(
        &mut self,
        (dst, dst_stride): (u64, u64),
        (src, src_stride): (u64, u64),
        len: u64,
        rows: u64,
    ) {
        self.write(&[dst, src, len, rows, dst_stride, src_stride]);
    }

    /// Appends one entry, `words` being the list's own number of words an entry.
    fn write(&mut self, words: &[u64]) {
        if self.len >= self.list.entries || words.len() != self.list.words {
            self.overflow = true;
            return;
        }
        // SAFETY: len < entries and the entry has the list's words, so they lie inside the
        // list's pinned memory, which no kernel reads until the launch that follows this
        // fill.
        unsafe {
            let p = self.list.host.as_ptr().add(self.list.words * self.len);
            for (i, &w) in words.iter().enumerate() {
                p.add(i).write(w);
            }
        }
        self.len += 1;
    }
}

/// Spare lists a kernel keeps. Lists are allocated only when no spare one is large enough
/// and come in powers of two, so the spares stay few (about as many as launches in flight at
/// once); one beyond this is freed.
const MAX_SPARE: usize = 64;

/// The entries of a new list for `n` ranges: the next power of two, at least
/// [`MIN_ENTRIES`]. Allocating pinned memory (`cuMemHostAlloc`) takes milliseconds for lists
/// of megabytes, and freeing it (`cuMemFreeHost`) waits for the device: with lists of exactly
/// `n` entries, batches of varying sizes would allocate a list whenever one outgrew every
/// spare, and free one whenever the spares were full. Rounded up, a spare list serves every
/// later batch up to twice the size that allocated it.
fn list_entries(n: usize) -> usize {
    n.max(MIN_ENTRIES).next_power_of_two()
}

/// The index of the smallest of `spare` (entries of the spare lists) that holds `n` ranges:
/// a small batch does not take the large list a later large batch would need.
fn best_fit(spare: impl Iterator<Item = usize>, n: usize) -> Option<usize> {
    spare
        .enumerate()
        .filter(|&(_, entries)| entries >= n)
        .min_by_key(|&(_, entries)| entries)
        .map(|(i, _)| i)
}

impl Drop for GatherKernel {
    fn drop(&mut self) {
        self.spare.clear();
        self.spare_rows.clear();
        if self.device.bind().is_ok() {
            // SAFETY: loaded in `load`, unloaded once; owners synchronise their streams
            // before dropping the kernel.
            unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{MIN_ENTRIES, best_fit, list_entries};

    #[test]
    fn new_lists_come_in_powers_of_two_from_the_minimum() {
        assert_eq!(list_entries(0), MIN_ENTRIES);
        assert_eq!(list_entries(MIN_ENTRIES), MIN_ENTRIES);
        assert_eq!(list_entries(MIN_ENTRIES + 1), 2 * MIN_ENTRIES);
        assert_eq!(list_entries(131_073), 262_144);
        for n in [1, 999, 4097, 70_000, 1 << 20] {
            let e = list_entries(n);
            assert!(e >= n && e.is_power_of_two() && e < 2 * n.max(MIN_ENTRIES));
        }
    }

    #[test]
    fn a_batch_takes_the_smallest_spare_list_that_holds_it() {
        let spare = [4096, 1024, 65_536, 2048];
        assert_eq!(best_fit(spare.into_iter(), 1500), Some(3));
        assert_eq!(best_fit(spare.into_iter(), 1024), Some(1));
        assert_eq!(best_fit(spare.into_iter(), 5000), Some(2));
        assert_eq!(best_fit(spare.into_iter(), 65_537), None);
        assert_eq!(best_fit(std::iter::empty(), 1), None);
    }
}
