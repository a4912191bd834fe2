//! Whose memory a cuda-ipc transport holds: its own device's (and host memory it copies
//! from), never another device's, which is refused as unsupported so that an agent carries
//! it over another transport instead of failing its registration. Run on the loopback link
//! (device 0), with regions that claim a device the way GPU memory does.

use fabric_core::testing::ClaimedDevice;
use fabric_core::{Access, Error, HostBuffer, MemoryRegion, Transport};
use std::sync::Arc;
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport, LoopbackLink};

fn on(device: u32) -> Arc<dyn MemoryRegion> {
    ClaimedDevice::new(device, 4096)
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
