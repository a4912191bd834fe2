//! Shared by the CUDA IPC tests: the CUDA probe that skips (or fails, under
//! `XFER_REQUIRE_CUDA=1`) and device memory for the conformance suite.
#![allow(dead_code)]

use fabric_core::MemoryRegion;
use gpu_mem::{Cuda, Device};
use std::sync::{Arc, OnceLock};

/// The driver and device 0, or `None` (with a message) where there is no CUDA.
pub fn cuda() -> Option<&'static (Cuda, Device)> {
    static C: OnceLock<Option<(Cuda, Device)>> = OnceLock::new();
    let c = C.get_or_init(|| match Cuda::probe() {
        Ok(Some(c)) => {
            let d = c.device(0).expect("device 0");
            Some((c, d))
        }
        Ok(None) | Err(_) => None,
    });
    if c.is_none() {
        assert!(
            std::env::var("XFER_REQUIRE_CUDA").as_deref() != Ok("1"),
            "XFER_REQUIRE_CUDA=1 but no usable CUDA driver"
        );
        eprintln!("skipped: no CUDA driver on this machine");
    }
    c.as_ref()
}

/// Zeroed device memory on device 0 (the suite's allocator).
pub fn device_alloc(len: usize) -> Arc<dyn MemoryRegion> {
    let (_, d) = cuda().expect("the suite runs only where CUDA exists");
    Arc::new(d.alloc_zeroed(len).expect("device memory"))
}
