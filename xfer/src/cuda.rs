//! GPU memory for agents: CUDA (the driver, loaded at run time, so a program built with
//! this crate runs on machines without it) through the workspace's `gpu-mem` crate.
//!
//! [`Cuda::probe`] finds the driver (`None` where there is none), [`Device::alloc`] gives
//! [`DeviceBuffer`]s to register with an [`Agent`](crate::Agent), and
//! [`Device::fence_on`] makes the fence a transfer waits for
//! ([`Transfer::after`](crate::Transfer::after)) when a kernel still writes its source.
//!
//! ```no_run
//! use std::sync::Arc;
//! use xfer::cuda::{Cuda, StreamRef};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cuda = Cuda::probe()?.expect("a GPU");
//! let gpu = cuda.device(0)?;
//! let buf = gpu.alloc_zeroed(1 << 20)?;
//! // ... a kernel filling `buf` was queued on the legacy default stream ...
//! let fence = Arc::new(gpu.fence_on(StreamRef::LEGACY)?);
//! let t = xfer::Transfer::segments(vec![(0, 0, 1 << 20)]).after(fence);
//! # let _ = (buf, t);
//! # Ok(())
//! # }
//! ```

pub use gpu_mem::{
    CopyMethod, Cuda, CudaDeviceInfo, CudaError, Device, DeviceBuffer, GpuMemError,
    PinnedHostBuffer, StreamFence, StreamRef, devices, driver_present,
};
