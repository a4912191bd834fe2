//! [`GpuMemError`], the one error type of this crate, and [`CudaError`], the driver's own
//! code and text carried as its source.
//!
//! Every driver return code goes through [`check`], which turns it into a `Result`.

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use fabric_core::MemoryError;

/// An error code returned by the CUDA driver, with its name and description.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{name} ({code}): {description}")]
pub struct CudaError {
    code: u32,
    name: String,
    description: String,
}

impl CudaError {
    /// The raw `CUresult` value.
    pub fn code(&self) -> u32 {
        self.code
    }

    /// The driver's name for the error, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The driver's description of the error.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Whether the device (or host, for pinned memory) ran out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.code == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY as u32
    }

    /// Whether the driver says the call is not supported on this device or system.
    pub fn is_not_supported(&self) -> bool {
        self.code == sys::CUresult::CUDA_ERROR_NOT_SUPPORTED as u32
            || self.code == sys::CUresult::CUDA_ERROR_NOT_PERMITTED as u32
    }

    /// Whether the error is one the driver calls sticky: the context is corrupted (an
    /// illegal address, a failed or trapped kernel, an uncorrectable ECC error), every later
    /// call in this process fails the same way, and only a new process recovers. Retrying
    /// the operation is pointless; a transient failure (out of memory, not ready) is not
    /// sticky.
    pub fn is_sticky(&self) -> bool {
        use sys::CUresult as R;
        [
            R::CUDA_ERROR_ECC_UNCORRECTABLE,
            R::CUDA_ERROR_ILLEGAL_ADDRESS,
            R::CUDA_ERROR_LAUNCH_TIMEOUT,
            R::CUDA_ERROR_ASSERT,
            R::CUDA_ERROR_HARDWARE_STACK_ERROR,
            R::CUDA_ERROR_ILLEGAL_INSTRUCTION,
            R::CUDA_ERROR_MISALIGNED_ADDRESS,
            R::CUDA_ERROR_INVALID_ADDRESS_SPACE,
            R::CUDA_ERROR_INVALID_PC,
            R::CUDA_ERROR_LAUNCH_FAILED,
        ]
        .iter()
        .any(|&c| c as u32 == self.code)
    }

    /// `CUDA_ERROR_OUT_OF_MEMORY`, for allocations that fail before reaching the driver.
    pub(crate) fn out_of_memory() -> CudaError {
        CudaError::from_driver(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY))
    }

    pub(crate) fn from_driver(e: DriverError) -> CudaError {
        let name = e
            .error_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0));
        let description = e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "no description".to_owned());
        CudaError {
            code: e.0 as u32,
            name,
            description,
        }
    }
}

/// Direction of a copy, for error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyDirection {
    /// Host memory to device memory.
    HostToDevice,
    /// Device memory to host memory.
    DeviceToHost,
    /// Device memory to device memory.
    DeviceToDevice,
}

impl std::fmt::Display for CopyDirection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CopyDirection::HostToDevice => "host-to-device",
            CopyDirection::DeviceToHost => "device-to-host",
            CopyDirection::DeviceToDevice => "device-to-device",
        })
    }
}

/// Errors of the CUDA memory layer.
///
/// Each driver call that can fail has its variant (or, for queries, a `call` name), with the
/// driver's [`CudaError`] as its source.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuMemError {
    /// The CUDA driver library was found but `cuInit` failed.
    #[error("cuInit failed")]
    Init(#[source] CudaError),
    /// No CUDA driver library is installed on this machine.
    ///
    /// [`Cuda::probe`](crate::Cuda::probe) reports this as `Ok(None)`; only the
    /// conveniences that need a driver return it as an error.
    #[error("no CUDA driver on this machine")]
    NoDriver,
    /// The device ordinal is not below the number of devices.
    #[error("CUDA device {ordinal} does not exist (this machine has {count})")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// How many devices the driver reports.
        count: u32,
    },
    /// A zero-byte allocation was asked for.
    #[error("cannot allocate zero bytes")]
    ZeroSize,
    /// A range falls outside a buffer.
    #[error("range {offset}+{len} is outside the {size}-byte buffer")]
    OutOfBounds {
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// Size of the buffer.
        size: u64,
    },
    /// A region passed to a copy is not the kind of memory the copy needs (for example host
    /// memory where device memory of the stream's device is expected).
    #[error("wrong memory for this copy: {0}")]
    WrongMemory(String),
    /// Binding the device's context to the calling thread failed.
    #[error("cannot make the context of CUDA device {device} current")]
    Context {
        /// The device ordinal.
        device: u32,
        /// The driver's error.
        #[source]
        source: CudaError,
    },
    /// `cuMemAlloc` failed.
    #[error("cuMemAlloc of {len} bytes on CUDA device {device} failed")]
    DeviceAlloc {
        /// The device ordinal.
        device: u32,
        /// Bytes asked for.
        len: u64,
        /// The driver's error.
        #[source]
        source: CudaError,
    },
    /// `cuMemHostAlloc` failed.
    #[error("cuMemHostAlloc of {len} pinned bytes failed")]
    HostAlloc {
        /// Bytes asked for.
        len: u64,
        /// The driver's error.
        #[source]
        source: CudaError,
    },
    /// A memory copy failed (synchronous or asynchronous).
    #[error("{direction} copy of {len} bytes failed")]
    Copy {
        /// Which way the copy went.
        direction: CopyDirection,
        /// Bytes to copy.
        len: u64,
        /// The driver's error.
        #[source]
        source: CudaError,
    },
    /// `cuMemsetD8` failed.
    #[error("memset of {len} bytes failed")]
    Memset {
        /// Bytes to set.
        len: u64,
        /// The driver's error.
        #[source]
        source: CudaError,
    },
    /// The device, driver or system cannot export device memory as a dmabuf.
    #[error("dmabuf export is not supported: {0}")]
    DmabufUnsupported(String),
    /// `cuMemGetHandleForAddressRange` failed.
    #[error("cuMemGetHandleForAddressRange (dmabuf) of {len} bytes failed")]
    DmabufExport {
        /// Bytes asked for.
        len: u64,
        /// The driver's error.
        #[source]
        source: CudaError,
    },
    /// A CUDA IPC handle could not be opened: stale (its allocation was freed), from a
    /// process that exited, from another host or driver, or not a handle at all.
    #[error(
        "cannot open the CUDA IPC handle of a peer's memory on CUDA device {device} (stale, foreign, or from another host)"
    )]
    IpcOpen {
        /// The device the handle was opened on.
        device: u32,
        /// The driver's error.
        #[source]
        source: CudaError,
    },
    /// A handle from a peer that is this very process names no live export of it.
    #[error("no live CUDA IPC export of this process has this handle")]
    NotOurExport,
    /// Another driver call failed (device queries, streams, events, synchronisation).
    #[error("{call} failed")]
    Driver {
        /// The driver function that failed.
        call: &'static str,
        /// The driver's error.
        #[source]
        source: CudaError,
    },
}

impl GpuMemError {
    /// The driver's error behind this one, if a driver call failed.
    pub fn cuda_error(&self) -> Option<&CudaError> {
        match self {
            GpuMemError::Init(source)
            | GpuMemError::Context { source, .. }
            | GpuMemError::DeviceAlloc { source, .. }
            | GpuMemError::HostAlloc { source, .. }
            | GpuMemError::Copy { source, .. }
            | GpuMemError::Memset { source, .. }
            | GpuMemError::DmabufExport { source, .. }
            | GpuMemError::IpcOpen { source, .. }
            | GpuMemError::Driver { source, .. } => Some(source),
            _ => None,
        }
    }

    /// Whether the driver's error behind this one is sticky ([`CudaError::is_sticky`]): the
    /// process's CUDA context is lost.
    pub fn is_sticky(&self) -> bool {
        self.cuda_error().is_some_and(CudaError::is_sticky)
    }

    /// Whether an allocation failed for lack of memory (retrying after freeing may help).
    pub fn is_out_of_memory(&self) -> bool {
        self.cuda_error().is_some_and(CudaError::is_out_of_memory)
    }
}

/// Turns a driver return code into a `Result`, naming the error with `wrap`.
pub(crate) fn check(
    code: sys::CUresult,
    wrap: impl FnOnce(CudaError) -> GpuMemError,
) -> Result<(), GpuMemError> {
    code.result().map_err(|e| wrap(CudaError::from_driver(e)))
}

/// Shorthand for [`check`] with a [`GpuMemError::Driver`] naming `call`.
pub(crate) fn check_call(code: sys::CUresult, call: &'static str) -> Result<(), GpuMemError> {
    check(code, |source| GpuMemError::Driver { call, source })
}

impl From<GpuMemError> for MemoryError {
    fn from(e: GpuMemError) -> MemoryError {
        match e {
            GpuMemError::OutOfBounds { offset, len, size } => {
                MemoryError::OutOfBounds { offset, len, size }
            }
            GpuMemError::DeviceAlloc { len, .. } | GpuMemError::HostAlloc { len, .. } => {
                MemoryError::Alloc(len)
            }
            GpuMemError::ZeroSize => MemoryError::Alloc(0),
            GpuMemError::DmabufUnsupported(_) | GpuMemError::WrongMemory(_) => {
                MemoryError::Unsupported(e.to_string())
            }
            // Kept whole: the driver's code stays reachable (is_sticky) through the source.
            other => MemoryError::device(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_onto_memory_errors_without_a_driver() {
        let oob = GpuMemError::OutOfBounds {
            offset: 5,
            len: 10,
            size: 12,
        };
        assert_eq!(
            MemoryError::from(oob.clone()),
            MemoryError::OutOfBounds {
                offset: 5,
                len: 10,
                size: 12
            }
        );
        assert_eq!(oob.to_string(), "range 5+10 is outside the 12-byte buffer");
        assert_eq!(
            MemoryError::from(GpuMemError::ZeroSize),
            MemoryError::Alloc(0)
        );
        assert!(matches!(
            MemoryError::from(GpuMemError::WrongMemory("x".into())),
            MemoryError::Unsupported(_)
        ));
        assert!(matches!(
            MemoryError::from(GpuMemError::NoSuchDevice {
                ordinal: 3,
                count: 1
            }),
            MemoryError::Device(_)
        ));
        assert!(GpuMemError::NoDriver.cuda_error().is_none());
        // A driver error stays whole behind the memory error, sticky or not.
        // Built by hand: naming a driver error asks the driver, which is not here.
        let illegal = |code: sys::CUresult| CudaError {
            code: code as u32,
            name: format!("{code:?}"),
            description: "an illegal memory access was encountered".into(),
        };
        let sticky = GpuMemError::Driver {
            call: "cuEventQuery",
            source: illegal(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
        };
        assert!(sticky.is_sticky());
        let MemoryError::Device(cause) = MemoryError::from(sticky) else {
            panic!("a driver error is a device error");
        };
        let back = cause
            .downcast_ref::<GpuMemError>()
            .expect("the GpuMemError itself");
        assert!(back.is_sticky());
        assert_eq!(
            back.cuda_error().map(CudaError::code),
            Some(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS as u32)
        );
        assert!(!illegal(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY).is_sticky());
        assert!(!GpuMemError::ZeroSize.is_out_of_memory());
    }

    #[test]
    fn copy_directions_read_well() {
        assert_eq!(CopyDirection::HostToDevice.to_string(), "host-to-device");
        assert_eq!(CopyDirection::DeviceToHost.to_string(), "device-to-host");
        assert_eq!(
            CopyDirection::DeviceToDevice.to_string(),
            "device-to-device"
        );
    }
}
