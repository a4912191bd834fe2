//! Finding the driver and the devices: [`Cuda`] (proof that the driver is loaded),
//! [`CudaDeviceInfo`] and [`Device`] (an open device with its context).

use crate::buffer::DeviceBuffer;
use crate::error::{GpuMemError, check, check_call};
use crate::pinned::PinnedHostBuffer;
use crate::range::normalize_pci_bus_id;
use crate::stream::CopyStream;
use cudarc::driver::CudaContext;
use cudarc::driver::sys;
use std::ffi::{c_char, c_int};
use std::sync::{Arc, OnceLock};

/// Proof that a CUDA driver is loaded and initialised on this machine.
///
/// The only way to get one is [`Cuda::probe`], and every type of this crate that calls the
/// driver is reached through it: this is what keeps `cudarc` from panicking on machines
/// without `libcuda`.
#[derive(Clone, Copy, Debug)]
pub struct Cuda {
    _private: (),
}

/// Whether a CUDA driver library (`libcuda.so`) can be loaded. Checked once per process.
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the candidate library names and closes
    // them again; it has no preconditions.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

impl Cuda {
    /// Looks for a usable CUDA driver and initialises it.
    ///
    /// Returns `Ok(None)` when this machine has no CUDA: no driver library, only the
    /// toolkit's stub library, or a driver that sees no device. Returns an error when a
    /// driver exists but fails to initialise (e.g. a kernel module that does not match).
    /// Never panics.
    pub fn probe() -> Result<Option<Cuda>, GpuMemError> {
        if !driver_present() {
            return Ok(None);
        }
        // SAFETY: the driver library is present (checked above), so the lazily loaded
        // symbol resolves; cuInit takes a flags value that must be 0.
        let code = unsafe { sys::cuInit(0) };
        match code {
            sys::CUresult::CUDA_SUCCESS => {}
            sys::CUresult::CUDA_ERROR_NO_DEVICE | sys::CUresult::CUDA_ERROR_STUB_LIBRARY => {
                return Ok(None);
            }
            other => check(other, GpuMemError::Init)?,
        }
        let cuda = Cuda { _private: () };
        if cuda.device_count()? == 0 {
            return Ok(None);
        }
        Ok(Some(cuda))
    }

    /// The CUDA version the driver supports (not the kernel driver's release number).
    pub fn driver_version(&self) -> Result<DriverVersion, GpuMemError> {
        let mut v: c_int = 0;
        check_call(
            // SAFETY: v is a valid out-pointer for the duration of the call.
            unsafe { sys::cuDriverGetVersion(&mut v) },
            "cuDriverGetVersion",
        )?;
        Ok(DriverVersion::from_raw(v))
    }

    /// How many CUDA devices the driver sees.
    pub fn device_count(&self) -> Result<u32, GpuMemError> {
        let mut n: c_int = 0;
        // SAFETY: n is a valid out-pointer; the driver is initialised (self exists).
        check_call(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    /// Describes every device, in ordinal order. Creates no context.
    pub fn devices(&self) -> Result<Vec<CudaDeviceInfo>, GpuMemError> {
        (0..self.device_count()?)
            .map(|ordinal| self.device_info(ordinal))
            .collect()
    }

    /// Describes one device. Creates no context.
    pub fn device_info(&self, ordinal: u32) -> Result<CudaDeviceInfo, GpuMemError> {
        let dev = self.cu_device(ordinal)?;
        let mut name = [0 as c_char; 256];
        check_call(
            // SAFETY: name is a writable buffer of the length passed; dev came from cuDeviceGet.
            unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev) },
            "cuDeviceGetName",
        )?;
        let mut total: usize = 0;
        check_call(
            // SAFETY: total is a valid out-pointer; dev came from cuDeviceGet.
            unsafe { sys::cuDeviceTotalMem_v2(&mut total, dev) },
            "cuDeviceTotalMem",
        )?;
        let mut bus = [0 as c_char; 64];
        check_call(
            // SAFETY: bus is a writable buffer of the length passed; dev came from cuDeviceGet.
            unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, dev) },
            "cuDeviceGetPCIBusId",
        )?;
        use sys::CUdevice_attribute as A;
        let major = device_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = device_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let driver_version = self.driver_version()?;
        Ok(CudaDeviceInfo {
            ordinal,
            name: c_buf_to_string(&name),
            total_memory: total as u64,
            pci_bus_id: normalize_pci_bus_id(&c_buf_to_string(&bus)),
            driver_version,
            compute_capability: (major as u32, minor as u32),
            dmabuf_supported: dmabuf_supported(dev, driver_version)?,
        })
    }

    /// Opens device `ordinal`: retains its primary context, which stays alive as long as
    /// the returned [`Device`] or anything allocated from it.
    pub fn device(&self, ordinal: u32) -> Result<Device, GpuMemError> {
        self.cu_device(ordinal)?;
        let ctx = CudaContext::new(ordinal as usize).map_err(|e| GpuMemError::Context {
            device: ordinal,
            source: crate::error::CudaError::from_driver(e),
        })?;
        let device = Device {
            inner: Arc::new(DeviceInner {
                ordinal,
                ctx,
                driver_version: self.driver_version()?,
            }),
        };
        Ok(device)
    }

    fn cu_device(&self, ordinal: u32) -> Result<sys::CUdevice, GpuMemError> {
        let count = self.device_count()?;
        if ordinal >= count {
            return Err(GpuMemError::NoSuchDevice { ordinal, count });
        }
        let mut dev: sys::CUdevice = 0;
        check_call(
            // SAFETY: dev is a valid out-pointer and ordinal < count (checked above).
            unsafe { sys::cuDeviceGet(&mut dev, ordinal as c_int) },
            "cuDeviceGet",
        )?;
        Ok(dev)
    }
}

/// Lists the CUDA devices of this machine; an empty list when it has no CUDA.
///
/// A shorthand for [`Cuda::probe`] then [`Cuda::devices`], for callers that only describe
/// the machine (such as `xfer info`).
pub fn devices() -> Result<Vec<CudaDeviceInfo>, GpuMemError> {
    match Cuda::probe()? {
        Some(cuda) => cuda.devices(),
        None => Ok(Vec::new()),
    }
}

fn device_attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32, GpuMemError> {
    let mut v: c_int = 0;
    check_call(
        // SAFETY: v is a valid out-pointer; dev came from cuDeviceGet; attr is a valid enum value.
        unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) },
        "cuDeviceGetAttribute",
    )?;
    Ok(v)
}

/// Whether the device can export dmabufs: the call exists from CUDA 11.7 and the device
/// says so in `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
fn dmabuf_supported(dev: sys::CUdevice, driver: DriverVersion) -> Result<bool, GpuMemError> {
    if driver < DriverVersion::DMABUF_EXPORT {
        return Ok(false);
    }
    let v = device_attribute(
        dev,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
    )?;
    Ok(v != 0)
}

fn c_buf_to_string(buf: &[c_char]) -> String {
    // The driver writes a NUL-terminated string into the zeroed buffer; stop at the NUL, or
    // at the end if the driver filled the buffer entirely.
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The CUDA version a driver supports, e.g. 12.8 (as `cuDriverGetVersion` reports it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DriverVersion {
    /// Major version (12 for CUDA 12.8).
    pub major: u32,
    /// Minor version (8 for CUDA 12.8).
    pub minor: u32,
}

impl DriverVersion {
    /// The first version with `cuMemGetHandleForAddressRange` (dmabuf export).
    pub const DMABUF_EXPORT: DriverVersion = DriverVersion {
        major: 11,
        minor: 7,
    };

    /// From the driver's integer form (`1000 * major + 10 * minor`, e.g. 12080).
    pub fn from_raw(v: i32) -> DriverVersion {
        let v = v.max(0) as u32;
        DriverVersion {
            major: v / 1000,
            minor: (v % 1000) / 10,
        }
    }
}

impl std::fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// What the driver says about one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// The CUDA device ordinal.
    pub ordinal: u32,
    /// The marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Total device memory in bytes.
    pub total_memory: u64,
    /// PCI address as `dddd:bb:dd.f`, lower-case hex (e.g. `0000:18:00.0`), the form the
    /// topology crate matches against hwloc's PCI devices.
    pub pci_bus_id: String,
    /// The CUDA version the driver supports.
    pub driver_version: DriverVersion,
    /// Compute capability, e.g. (9, 0) for Hopper.
    pub compute_capability: (u32, u32),
    /// Whether the device can export memory as a dmabuf (for NIC registration).
    pub dmabuf_supported: bool,
}

/// Bytes of the pinned bounce buffer each thread keeps per device.
pub(crate) const STAGING: usize = 4 << 20;

/// A stream and a pinned bounce buffer owned by one thread (see [`Device::thread_stream`]).
struct ThreadStream {
    stream: sys::CUstream,
    /// Page-locked memory of `STAGING` bytes, allocated on first use.
    staging: Option<std::ptr::NonNull<u8>>,
    /// Keeps the context (and so the stream) alive until the thread exits.
    ctx: Arc<CudaContext>,
}

impl Drop for ThreadStream {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the stream was created on this context by this thread and is destroyed
            // once; pending work on it completes first (cuStreamDestroy's contract).
            unsafe { sys::cuStreamDestroy_v2(self.stream) };
            if let Some(p) = self.staging.take() {
                // SAFETY: p came from cuMemHostAlloc on this context and is freed once; every
                // copy that used it was waited for.
                unsafe { sys::cuMemFreeHost(p.as_ptr().cast()) };
            }
        }
    }
}

thread_local! {
    static THREAD_STREAMS: std::cell::RefCell<Vec<ThreadStream>> = const { std::cell::RefCell::new(Vec::new()) };
}

pub(crate) struct DeviceInner {
    pub(crate) ordinal: u32,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) driver_version: DriverVersion,
}

/// An open CUDA device: its ordinal and its primary context. Cheap to clone.
///
/// Every call this crate makes on the device first makes its context current on the
/// calling thread, so a `Device` and everything allocated from it can be used from any
/// thread (transports call them from their worker threads).
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device(cuda:{})", self.inner.ordinal)
    }
}

impl Device {
    /// The CUDA device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.inner.ordinal
    }

    /// Describes the device.
    pub fn info(&self) -> Result<CudaDeviceInfo, GpuMemError> {
        Cuda { _private: () }.device_info(self.inner.ordinal)
    }

    /// Allocates `len` bytes of device memory (contents unspecified). See [`DeviceBuffer::new`].
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer, GpuMemError> {
        DeviceBuffer::new(self, len)
    }

    /// Allocates `len` bytes of device memory set to zero.
    pub fn alloc_zeroed(&self, len: usize) -> Result<DeviceBuffer, GpuMemError> {
        let b = DeviceBuffer::new(self, len)?;
        b.fill(0, len as u64, 0)?;
        Ok(b)
    }

    /// Allocates `len` bytes of zeroed, page-locked host memory. See [`PinnedHostBuffer::new`].
    pub fn alloc_pinned(&self, len: usize) -> Result<PinnedHostBuffer, GpuMemError> {
        PinnedHostBuffer::new(self, len)
    }

    /// Creates a stream for asynchronous copies. See [`CopyStream`].
    pub fn copy_stream(&self) -> Result<CopyStream, GpuMemError> {
        CopyStream::new(self)
    }

    /// Waits until all work on the device's context has finished.
    pub fn synchronize(&self) -> Result<(), GpuMemError> {
        self.bind()?;
        // SAFETY: the context is current on this thread (bound above).
        check_call(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }

    /// Whether `addr..addr + len` lies inside one allocation of this device's memory, as the
    /// driver knows it.
    ///
    /// A transport asks this before it queues asynchronous copies on a region that only
    /// claims to be CUDA memory ([`fabric_core::MemoryLocation::Cuda`]): an address the
    /// driver does not know answers `false` (the query never touches the memory), whereas a
    /// copy from it could fail or poison the context.
    pub fn holds_range(&self, addr: u64, len: u64) -> Result<bool, GpuMemError> {
        let Some(end) = addr.checked_add(len) else {
            return Ok(false);
        };
        self.bind()?;
        let mut mem_type: std::ffi::c_uint = 0;
        // SAFETY: mem_type is a valid out-pointer of the size this attribute writes (an
        // unsigned int); the query only looks the address up, and fails for unknown ones.
        let code = unsafe {
            sys::cuPointerGetAttribute(
                (&mut mem_type as *mut std::ffi::c_uint).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        };
        if code != sys::CUresult::CUDA_SUCCESS
            || mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as std::ffi::c_uint
        {
            return Ok(false);
        }
        let mut ordinal: c_int = -1;
        // SAFETY: ordinal is a valid out-pointer for this attribute (an int).
        let code = unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut c_int).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        };
        if code != sys::CUresult::CUDA_SUCCESS || ordinal != self.inner.ordinal as c_int {
            return Ok(false);
        }
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: base and size are valid out-pointers; addr is known device memory.
        let code = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
        if code != sys::CUresult::CUDA_SUCCESS {
            return Ok(false);
        }
        Ok(base <= addr && end <= base.saturating_add(size as u64))
    }

    /// Whether device memory can be exported as a dmabuf (driver ≥ 11.7 and device support).
    pub fn dmabuf_supported(&self) -> Result<bool, GpuMemError> {
        dmabuf_supported(self.inner.ctx.cu_device(), self.inner.driver_version)
    }

    /// This thread's private non-blocking stream on this device, for the synchronous copies of
    /// [`DeviceBuffer`]: the legacy default stream would serialise every thread's copies (and
    /// waiting on it would wait for all of them), which capped several rails at the speed of
    /// one. Created on first use, destroyed when the thread exits. The context must be bound.
    pub(crate) fn thread_stream(&self) -> Result<sys::CUstream, GpuMemError> {
        THREAD_STREAMS.with(|cell| {
            let mut streams = cell.borrow_mut();
            if let Some(s) = streams
                .iter()
                .find(|s| Arc::ptr_eq(&s.ctx, &self.inner.ctx))
            {
                return Ok(s.stream);
            }
            // The caller bound this device's context to the thread.
            let stream = crate::stream::new_nonblocking_stream()?;
            streams.push(ThreadStream {
                stream,
                staging: None,
                ctx: self.inner.ctx.clone(),
            });
            Ok(stream)
        })
    }

    /// This thread's stream and its pinned bounce buffer of [`STAGING`] bytes on this device.
    ///
    /// Copies between device memory and ordinary (pageable) host memory go through the
    /// driver's own staging, which one context shares among all threads: on the H200 that held
    /// every rail together to about 12-15 Gbps. A private pinned buffer per thread lets each
    /// rail copy at DMA speed, plus one CPU copy. The context must be bound.
    pub(crate) fn thread_staging(&self) -> Result<(sys::CUstream, *mut u8), GpuMemError> {
        let stream = self.thread_stream()?;
        THREAD_STREAMS.with(|cell| {
            let mut streams = cell.borrow_mut();
            let ts = streams
                .iter_mut()
                .find(|s| Arc::ptr_eq(&s.ctx, &self.inner.ctx))
                .expect("thread_stream just made it");
            if let Some(p) = ts.staging {
                return Ok((stream, p.as_ptr()));
            }
            let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
            check(
                // SAFETY: `p` is a valid out-pointer; the context is bound.
                unsafe { sys::cuMemHostAlloc(&mut p, STAGING, 0) },
                |source| GpuMemError::HostAlloc {
                    len: STAGING as u64,
                    source,
                },
            )?;
            let Some(p) = std::ptr::NonNull::new(p.cast::<u8>()) else {
                return Err(GpuMemError::HostAlloc {
                    len: STAGING as u64,
                    source: crate::error::CudaError::out_of_memory(),
                });
            };
            ts.staging = Some(p);
            Ok((stream, p.as_ptr()))
        })
    }

    /// Makes the device's context current on the calling thread (a no-op when it already is).
    pub(crate) fn bind(&self) -> Result<(), GpuMemError> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(|e| GpuMemError::Context {
                device: self.inner.ordinal,
                source: crate::error::CudaError::from_driver(e),
            })
    }
}
