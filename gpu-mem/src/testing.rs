//! What the hardware tests of the workspace need from this machine (feature `testing`).
//!
//! Tests that need a GPU are marked `#[ignore = "needs a CUDA GPU ..."]`, so that
//! `cargo test` on a machine without one counts them as ignored rather than passed. Run
//! them with `--include-ignored` (`scripts/gpu-proof.sh` and `scripts/ipc-proof.sh` do):
//! each starts with [`require_gpus`], which fails the test, naming what is missing, when
//! the machine does not have it. Every suite with such tests also has one test that is not
//! ignored and calls [`check_required_gpus`]: with `XFER_REQUIRE_CUDA=1` (or
//! `XFER_REQUIRE_GPUS=N`) set, plain `cargo test` fails on a machine without the GPUs asked
//! for, so a GPU run can never pass by skipping.

use crate::Cuda;

/// How many CUDA GPUs the environment says this machine must have: `XFER_REQUIRE_GPUS=N`,
/// else 1 with `XFER_REQUIRE_CUDA=1`, else 0.
pub fn required_gpus() -> usize {
    let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
    match var("XFER_REQUIRE_GPUS") {
        Some(n) => n
            .parse()
            .unwrap_or_else(|_| panic!("XFER_REQUIRE_GPUS must be a number of GPUs, not {n:?}")),
        None => usize::from(var("XFER_REQUIRE_CUDA").is_some_and(|v| v != "0")),
    }
}

/// What this machine has, in words, and its number of CUDA devices.
fn inventory() -> (String, usize) {
    match Cuda::probe() {
        Ok(Some(cuda)) => match cuda.device_count() {
            Ok(n) => (format!("{n} CUDA GPU(s)"), n as usize),
            Err(e) => (
                format!("a CUDA driver that cannot count its devices ({e})"),
                0,
            ),
        },
        Ok(None) if !crate::driver_present() => {
            ("no CUDA driver (libcuda.so.1 not found)".to_owned(), 0)
        }
        Ok(None) => ("a CUDA driver but no CUDA device".to_owned(), 0),
        Err(e) => (format!("a CUDA driver that fails to start ({e})"), 0),
    }
}

/// The CUDA driver, on a machine with at least `n` GPUs.
///
/// # Panics
/// When the machine has fewer: the message names what was needed and what was found.
pub fn require_gpus(n: usize) -> Cuda {
    let (found, count) = inventory();
    assert!(
        count >= n.max(1),
        "this test needs {} CUDA GPU(s); this machine has {found}",
        n.max(1)
    );
    Cuda::probe()
        .ok()
        .flatten()
        .expect("probed successfully just above")
}

/// The gate of a hardware suite: fails when the environment asks for GPUs
/// ([`required_gpus`]) that this machine lacks; otherwise checks that probing for CUDA
/// reports its absence as a value and never panics.
///
/// # Panics
/// When fewer GPUs are present than required, or when the probe contradicts itself.
pub fn check_required_gpus() {
    let required = required_gpus();
    let (found, count) = inventory();
    assert!(
        count >= required,
        "XFER_REQUIRE_CUDA/XFER_REQUIRE_GPUS ask for {required} CUDA GPU(s); this machine has {found}"
    );
    if !crate::driver_present() {
        assert!(
            matches!(Cuda::probe(), Ok(None)),
            "no driver, yet a CUDA value"
        );
        assert_eq!(crate::devices().map(|d| d.len()), Ok(0));
    }
}

/// The late-fill kernel's PTX, NUL-terminated for `cuModuleLoadData`.
static LATE_FILL_PTX: &str = concat!(include_str!("late_fill.ptx"), "\0");

/// The loaded late-fill kernel of each device (ordinal, `CUfunction` as an address): loaded
/// once per process and never unloaded, since launches may still run when a test ends.
static LATE_FILL: std::sync::Mutex<Vec<(u32, usize)>> = std::sync::Mutex::new(Vec::new());

/// Queues on `stream` a kernel that waits `delay` on the GPU, then sets every byte of `buf`
/// to `byte`, and returns at once: what an application does when it launches the kernel
/// that computes a buffer and then, at once, hands the buffer to a transfer. A transfer
/// that does not wait for the stream moves the bytes as they were before the fill.
pub fn late_fill(
    buf: &crate::DeviceBuffer,
    byte: u8,
    delay: std::time::Duration,
    stream: crate::StreamRef,
) -> Result<(), crate::GpuMemError> {
    use crate::error::check_call;
    use cudarc::driver::sys;
    let device = buf.device();
    device.bind()?;
    let func = {
        let mut loaded = LATE_FILL.lock().unwrap_or_else(|p| p.into_inner());
        match loaded.iter().find(|(o, _)| *o == device.ordinal()) {
            Some(&(_, f)) => f as sys::CUfunction,
            None => {
                let mut module: sys::CUmodule = std::ptr::null_mut();
                check_call(
                    // SAFETY: module is a valid out-pointer; the PTX is NUL-terminated text;
                    // the device's context is current (bound above).
                    unsafe { sys::cuModuleLoadData(&mut module, LATE_FILL_PTX.as_ptr().cast()) },
                    "cuModuleLoadData (late fill)",
                )?;
                let mut f: sys::CUfunction = std::ptr::null_mut();
                check_call(
                    // SAFETY: f is a valid out-pointer; the module is loaded (and stays so);
                    // the name is NUL-terminated.
                    unsafe { sys::cuModuleGetFunction(&mut f, module, c"xfer_late_fill".as_ptr()) },
                    "cuModuleGetFunction (late fill)",
                )?;
                loaded.push((device.ordinal(), f as usize));
                f
            }
        }
    };
    let mut dst = buf.device_addr();
    let mut len = buf.len() as u64;
    let mut wait = delay.as_nanos().min(u64::MAX as u128) as u64;
    let mut value = u32::from(byte);
    let mut params = [
        (&mut dst as *mut u64).cast::<std::ffi::c_void>(),
        (&mut len as *mut u64).cast::<std::ffi::c_void>(),
        (&mut wait as *mut u64).cast::<std::ffi::c_void>(),
        (&mut value as *mut u32).cast::<std::ffi::c_void>(),
    ];
    check_call(
        // SAFETY: the kernel takes (u64, u64, u64, u32), matching params; it writes
        // dst..dst+len, which is `buf`'s device memory (the caller keeps `buf` alive until the
        // launch has finished, as for any kernel it queues); the stream is, per StreamRef's
        // contract, one of this primary context's; the context is current.
        unsafe {
            sys::cuLaunchKernel(
                func,
                264,
                1,
                1,
                256,
                1,
                1,
                0,
                stream.as_raw() as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        },
        "cuLaunchKernel (late fill)",
    )
}

/// Bytes the stream-order case moves.
const STREAM_ORDER_LEN: usize = 64 << 20;

/// The stream-order case every backend that moves device memory runs on a GPU, two engines
/// of `make`'s transports in this process: the source is filled by a kernel queued on the
/// legacy default stream behind half a second of GPU time, and the WRITE (with immediate
/// data) is submitted at once, carrying a fence on that stream
/// ([`Device::fence_on`](crate::Device::fence_on)). Every byte the target holds must be the
/// fill's, read on a stream of its own right after the immediate data arrived. Without the
/// fence (or with an engine that ignores it) the transfer moves the zeros that were there
/// before the kernel ran.
///
/// # Panics
/// Where there is no GPU, and when the case fails.
pub fn writes_wait_for_the_stream<T, F>(make: F)
where
    T: fabric_core::Transport,
    F: Fn() -> fabric_core::Result<T> + Send + Sync + Clone + 'static,
{
    use fabric_core::engine::{Engine, EngineConfig, Transfer};
    use fabric_core::plan::Segment;
    use std::time::{Duration, Instant};
    let cuda = require_gpus(1);
    let gpu = cuda.device(0).expect("device 0");
    let m = make.clone();
    let a = Engine::spawn(m, EngineConfig::default()).expect("initiator");
    let b = Engine::spawn(make, EngineConfig::default()).expect("target");
    let src = std::sync::Arc::new(gpu.alloc_zeroed(STREAM_ORDER_LEN).expect("source"));
    let dst = std::sync::Arc::new(gpu.alloc_zeroed(STREAM_ORDER_LEN).expect("destination"));
    let s = a
        .register(src.clone(), fabric_core::Access::NONE)
        .expect("register the source");
    let d = b
        .register(dst.clone(), fabric_core::Access::REMOTE_WRITE)
        .expect("register the destination");
    let peer = a.add_peer(&b.address()).expect("add the peer");
    // Nothing else may be queued on the device that would make the case pass by accident.
    gpu.synchronize().expect("idle device");
    let start = Instant::now();
    late_fill(
        &src,
        7,
        Duration::from_millis(500),
        crate::StreamRef::LEGACY,
    )
    .expect("late fill");
    let fence = gpu.fence_on(crate::StreamRef::LEGACY).expect("fence");
    let t = Transfer::new(peer)
        .segment(Segment {
            src: s.local,
            src_offset: 0,
            dst: d.remote,
            dst_offset: 0,
            len: STREAM_ORDER_LEN as u64,
        })
        .imm(11)
        .after(std::sync::Arc::new(fence));
    let stats = a
        .submit(t)
        .expect("submit")
        .wait(Duration::from_secs(30))
        .expect("the transfer");
    assert_eq!(stats.bytes, STREAM_ORDER_LEN as u64);
    let ev = b
        .next_event(Duration::from_secs(30))
        .expect("the immediate data");
    assert_eq!(ev.imm(), Some(11));
    // The target reads at once, on a stream of its own (none of the transport's).
    let host = std::sync::Arc::new(gpu.alloc_pinned(STREAM_ORDER_LEN).expect("pinned"));
    let mut reader = gpu.copy_stream().expect("a stream of the target's own");
    reader
        .copy_d2h_async(&dst, 0, &host, 0, STREAM_ORDER_LEN as u64)
        .expect("read the destination");
    reader
        .record_event()
        .expect("event")
        .synchronize()
        .expect("read done");
    let mut got = vec![0u8; STREAM_ORDER_LEN];
    fabric_core::MemoryRegion::read_to_host(&*host, 0, &mut got).expect("host copy");
    let filled = got.iter().filter(|&&v| v == 7).count();
    assert_eq!(
        filled,
        STREAM_ORDER_LEN,
        "{filled} of {STREAM_ORDER_LEN} bytes carry the fill queued before the write ({:?} after submit)",
        start.elapsed()
    );
}
