//! Shared by the CUDA IPC tests: the driver (the tests that need it are `#[ignore]`d and fail
//! where there is no GPU) and device memory for the conformance suite.
#![allow(dead_code)]

use fabric_core::MemoryRegion;
use gpu_mem::{Cuda, Device};
use std::sync::{Arc, OnceLock};

/// The driver and device 0; fails the test, naming what is missing, where there is no GPU.
pub fn cuda() -> &'static (Cuda, Device) {
    static C: OnceLock<(Cuda, Device)> = OnceLock::new();
    C.get_or_init(|| {
        let c = gpu_mem::testing::require_gpus(1);
        let d = c.device(0).expect("device 0");
        (c, d)
    })
}

/// Zeroed device memory on device 0 (the suite's allocator).
pub fn device_alloc(len: usize) -> Arc<dyn MemoryRegion> {
    let (_, d) = cuda();
    Arc::new(d.alloc_zeroed(len).expect("device memory"))
}
