//! Whose memory a cuda-ipc transport holds: its own device's (and host memory it copies
//! from), never another device's, which is refused as unsupported so that an agent carries
//! it over another transport instead of failing its registration. Run on the loopback link
//! (device 0), with regions that claim a device the way GPU memory does.

use fabric_core::{
    Access, Error, HostBuffer, MemoryError, MemoryLocation, MemoryRegion, Transport,
};
use std::ptr::NonNull;
use std::sync::Arc;
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport, LoopbackLink};

/// Host bytes that claim to be device `device`'s memory.
struct OnDevice {
    device: u32,
    bytes: HostBuffer,
}

// SAFETY: no host pointer is offered; the copy methods bound-check against the buffer.
unsafe impl MemoryRegion for OnDevice {
    fn len(&self) -> usize {
        self.bytes.len()
    }
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Cuda {
            device: self.device,
        }
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }
    fn device_addr(&self) -> u64 {
        0x7000_0000_0000
    }
    fn read_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.bytes.read(offset, dst)
    }
    fn write_from_host(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.bytes.write(offset, src)
    }
}

fn on(device: u32) -> Arc<dyn MemoryRegion> {
    Arc::new(OnDevice {
        device,
        bytes: HostBuffer::new(4096).unwrap(),
    })
}

#[test]
fn another_devices_memory_is_unsupported_and_its_own_is_held() {
    let mut t = CudaIpcTransport::with_link(LoopbackLink::new(), CudaIpcConfig::default()).unwrap();
    for access in [Access::NONE, Access::REMOTE_WRITE, Access::REMOTE_READ] {
        match t.register(on(1), access) {
            Err(Error::Unsupported(why)) => {
                assert!(
                    why.contains("device 0") && why.contains("device 1"),
                    "{why}"
                );
            }
            other => panic!("device 1's memory on device 0's transport ({access:?}): {other:?}"),
        }
    }
    // Its own device's memory and host memory, as sources, are held.
    let own = t.register(on(0), Access::NONE).unwrap();
    let host = t
        .register(HostBuffer::new_shared(4096).unwrap(), Access::NONE)
        .unwrap();
    t.deregister(own.local).unwrap();
    t.deregister(host.local).unwrap();
}
