//! # gpu-mem
//!
//! CUDA memory for `xfer`, through [`cudarc`]'s driver API loaded at run time: device
//! buffers, pinned host staging buffers, asynchronous copies with streams and events, and
//! dmabuf export of device memory for NIC registration.
//!
//! The crate builds and runs on machines without CUDA. Everything that calls the driver is
//! reached through a [`Cuda`] value, and the only way to get one is [`Cuda::probe`], which
//! returns `Ok(None)` when there is no driver (so callers fall back to host memory) instead
//! of letting `cudarc` panic.
//!
//! [`DeviceBuffer`] and [`PinnedHostBuffer`] implement [`fabric_core::MemoryRegion`], so a
//! transport registers CUDA memory exactly as it registers host memory:
//! [`MemoryLocation::Cuda`](fabric_core::MemoryLocation::Cuda) tells it that the bytes must be
//! moved with copies (or a dmabuf), not through a host pointer.
//!
//! ```
//! use fabric_core::MemoryRegion;
//! use gpu_mem::Cuda;
//! use std::sync::Arc;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let Some(cuda) = Cuda::probe()? else {
//!     println!("no CUDA on this machine: using host memory");
//!     return Ok(());
//! };
//! let gpu = cuda.device(0)?;
//! println!("{:?}", gpu.info()?);
//!
//! // 1 MiB of device memory and a pinned staging buffer.
//! let dev = Arc::new(gpu.alloc(1 << 20)?);
//! let staging = Arc::new(gpu.alloc_pinned(1 << 20)?);
//! staging.fill(0, 1 << 20, 0xab)?;
//!
//! // Asynchronous host-to-device copy, completed when the event says so.
//! let mut stream = gpu.copy_stream()?;
//! stream.copy_h2d_async(&staging, 0, &dev, 0, 1 << 20)?;
//! stream.record_event()?.synchronize()?;
//! assert_eq!(dev.to_vec(4096, 4)?, vec![0xab; 4]);
//!
//! // What a transport sees once the buffer is registered.
//! let region: Arc<dyn MemoryRegion> = dev;
//! let mut back = [0u8; 4];
//! region.read_to_host(0, &mut back)?;
//! assert_eq!(back, [0xab; 4]);
//! # Ok(())
//! # }
//! ```
//!
//! # Threads
//! Every call makes the device's context current on the calling thread first, so buffers,
//! devices and events may be used from any thread. A [`CopyStream`] is owned by one thread at
//! a time (its copy methods take `&mut self`); it can be moved between threads.
#![warn(missing_docs)]

mod buffer;
mod copies;
mod device;
mod error;
mod gather;
mod host;
mod ipc;
mod pattern;
mod pinned;
mod range;
mod stream;
#[cfg(feature = "testing")]
pub mod testing;
mod word;

pub use buffer::{DeviceBuffer, DmabufExport};
pub use copies::{CopyMethod, StagedCopies};
pub use device::{Cuda, CudaDeviceInfo, Device, DriverVersion, devices, driver_present};
pub use error::{CopyDirection, CudaError, GpuMemError};
pub use host::HostMemory;
pub use ipc::{
    IPC_HANDLE_LEN, IpcExport, IpcHandle, IpcMapping, PeerCopies, SameProcess, can_access_peer,
    enable_peer_access, open_ipc_mappings, plain_copy_gbps,
};
pub use pattern::{fill_pattern, pattern_bytes, pattern_matches, pattern_word};
pub use pinned::PinnedHostBuffer;
pub use stream::{CopyEvent, CopyStream, StreamFence, StreamRef};
