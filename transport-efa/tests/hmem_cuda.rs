//! CUDA memory through FI_HMEM: registration with `fi_mr_regattr` (FI_HMEM_CUDA) and
//! writes host -> device and device -> host, over the `shm` provider (which offers
//! FI_HMEM where CUDA is installed; on AWS `efa` does too).
//!
//! Needs a CUDA driver (`libcuda.so.1`), a GPU and a libfabric built with CUDA, so the
//! round trip is `#[ignore]`d: `cargo test` elsewhere counts it as ignored, and
//! `--include-ignored` runs it, failing with what is missing where something is.
//! `hmem_is_there_when_required` always runs, and fails under `XFER_REQUIRE_HMEM=1` when
//! the GPU or the provider's FI_HMEM is missing (set it on GPU machines). The provider can
//! be changed with `XFER_HMEM_PROVIDER` (default `shm`).

mod common;

use fabric_core::{
    Access, MemoryError, MemoryLocation, MemoryRegion, PostOutcome, Transport, WorkRequestId,
};
use std::ffi::{CStr, c_void};
use std::ptr::NonNull;
use std::sync::Arc;
use transport_efa::{EfaConfig, EfaTransport};

fn required() -> bool {
    std::env::var("XFER_REQUIRE_HMEM").is_ok_and(|v| v == "1")
}

/// Fails the test: what it needs is not on this machine.
fn missing(why: String) -> ! {
    panic!("needs a CUDA GPU and a libfabric provider with FI_HMEM: {why}")
}

fn provider() -> String {
    std::env::var("XFER_HMEM_PROVIDER").unwrap_or_else(|_| "shm".into())
}

/// The few CUDA driver calls this test needs, loaded at run time.
struct Cuda {
    ctx: *mut c_void,
    ctx_set_current: unsafe extern "C" fn(*mut c_void) -> i32,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> i32,
    mem_free: unsafe extern "C" fn(u64) -> i32,
    htod: unsafe extern "C" fn(u64, *const c_void, usize) -> i32,
    dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> i32,
}

// SAFETY: the context handle is only passed to cuCtxSetCurrent, which any thread may call.
unsafe impl Send for Cuda {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for Cuda {}

fn sym<T: Copy>(lib: *mut c_void, name: &CStr) -> Result<T, String> {
    // SAFETY: lib is a handle from dlopen; name is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    if p.is_null() {
        return Err(format!("libcuda has no {name:?}"));
    }
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: T is the function-pointer type of the symbol, of pointer size.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

impl Cuda {
    fn load() -> Result<Cuda, String> {
        // SAFETY: dlopen with a constant, NUL-terminated name.
        let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
        if lib.is_null() {
            return Err("no CUDA driver (libcuda.so.1)".into());
        }
        let init: unsafe extern "C" fn(u32) -> i32 = sym(lib, c"cuInit")?;
        let device_get: unsafe extern "C" fn(*mut i32, i32) -> i32 = sym(lib, c"cuDeviceGet")?;
        let retain: unsafe extern "C" fn(*mut *mut c_void, i32) -> i32 =
            sym(lib, c"cuDevicePrimaryCtxRetain")?;
        let mut dev = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            if init(0) != 0 || device_get(&mut dev, 0) != 0 || retain(&mut ctx, dev) != 0 {
                return Err("no usable CUDA device".into());
            }
        }
        Ok(Cuda {
            ctx,
            ctx_set_current: sym(lib, c"cuCtxSetCurrent")?,
            mem_alloc: sym(lib, c"cuMemAlloc_v2")?,
            mem_free: sym(lib, c"cuMemFree_v2")?,
            htod: sym(lib, c"cuMemcpyHtoD_v2")?,
            dtoh: sym(lib, c"cuMemcpyDtoH_v2")?,
        })
    }

    fn current(&self) {
        // SAFETY: ctx is a retained primary context.
        assert_eq!(unsafe { (self.ctx_set_current)(self.ctx) }, 0);
    }
}

/// Device memory allocated with cuMemAlloc.
struct DeviceBuffer {
    cuda: Arc<Cuda>,
    ptr: u64,
    len: usize,
}

impl DeviceBuffer {
    fn new(cuda: &Arc<Cuda>, len: usize) -> DeviceBuffer {
        cuda.current();
        let mut ptr = 0;
        // SAFETY: valid out-pointer; the context is current.
        assert_eq!(unsafe { (cuda.mem_alloc)(&mut ptr, len) }, 0, "cuMemAlloc");
        DeviceBuffer {
            cuda: cuda.clone(),
            ptr,
            len,
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.cuda.current();
        // SAFETY: ptr came from cuMemAlloc and is freed once.
        unsafe { (self.cuda.mem_free)(self.ptr) };
    }
}

// SAFETY: ptr is a device allocation of len bytes that lives as long as self; no host
// pointer is offered; copies go through the driver.
unsafe impl MemoryRegion for DeviceBuffer {
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Cuda { device: 0 }
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }
    fn device_addr(&self) -> u64 {
        self.ptr
    }
    fn read_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        fabric_core::memory::check_range(offset, dst.len() as u64, self.len as u64)?;
        self.cuda.current();
        // SAFETY: the range was checked; dst is writable for its length.
        let rc = unsafe { (self.cuda.dtoh)(dst.as_mut_ptr().cast(), self.ptr + offset, dst.len()) };
        (rc == 0)
            .then_some(())
            .ok_or(MemoryError::Device(format!("cuMemcpyDtoH: {rc}")))
    }
    fn write_from_host(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        fabric_core::memory::check_range(offset, src.len() as u64, self.len as u64)?;
        self.cuda.current();
        // SAFETY: the range was checked; src is readable for its length.
        let rc = unsafe { (self.cuda.htod)(self.ptr + offset, src.as_ptr().cast(), src.len()) };
        (rc == 0)
            .then_some(())
            .ok_or(MemoryError::Device(format!("cuMemcpyHtoD: {rc}")))
    }
}

/// Writes `len` bytes from `src` (on a) into `dst` (on b) with imm, and waits for both
/// completions.
fn write(
    a: &mut EfaTransport,
    b: &mut EfaTransport,
    peer: fabric_core::PeerId,
    src: fabric_core::LocalSlice,
    dst: fabric_core::RemoteSlice,
) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let (mut done_a, mut done_b) = (Vec::new(), Vec::new());
    while a
        .post_write(peer, WorkRequestId(1), src, dst, Some(42))
        .expect("post_write")
        == PostOutcome::NoRoom
    {
        a.poll(&mut done_a).unwrap();
        b.poll(&mut done_b).unwrap();
        assert!(std::time::Instant::now() < deadline, "no room");
    }
    while done_a.is_empty() || done_b.is_empty() {
        a.poll(&mut done_a).unwrap();
        b.poll(&mut done_b).unwrap();
        assert!(std::time::Instant::now() < deadline, "timed out");
    }
    assert_eq!(done_a[0].result, Ok(src.len), "{done_a:?}");
    assert_eq!(done_b[0].imm, Some(42), "{done_b:?}");
}

#[test]
fn hmem_is_there_when_required() {
    let cuda = Cuda::load();
    let provider = provider();
    let opened = EfaTransport::new(&EfaConfig::with_provider(provider.clone()).hmem(true));
    let found = format!(
        "CUDA: {}; {provider} with FI_HMEM: {}",
        cuda.as_ref()
            .map_or_else(Clone::clone, |_| "loaded".to_owned()),
        opened
            .as_ref()
            .map_or_else(ToString::to_string, |_| "opened".to_owned())
    );
    assert!(
        !required() || (cuda.is_ok() && opened.is_ok()),
        "XFER_REQUIRE_HMEM=1, but {found}"
    );
    eprintln!("{found}");
}

#[test]
#[ignore = "needs a CUDA GPU and a libfabric with FI_HMEM (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn cuda_memory_round_trip() {
    let cuda = match Cuda::load() {
        Ok(c) => Arc::new(c),
        Err(why) => missing(why),
    };
    let provider = provider();
    let cfg = EfaConfig::with_provider(provider.clone()).hmem(true);
    let (mut a, mut b) = match (EfaTransport::new(&cfg), EfaTransport::new(&cfg)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => missing(format!("{provider} with FI_HMEM: {e}")),
    };
    eprintln!("provider info: {:?}", a.provider_info());
    let peer = a.add_peer(&b.address()).unwrap();
    let peer_ba = b.add_peer(&a.address()).unwrap();

    for len in [1000usize, 64 << 10, 4 << 20] {
        let pattern: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
        // Host -> device.
        let host = fabric_core::HostBuffer::new_shared(len).unwrap();
        host.write(0, &pattern).unwrap();
        let dev = Arc::new(DeviceBuffer::new(&cuda, len));
        dev.write_from_host(0, &vec![0; len]).unwrap();
        let src = a.register(host.clone(), Access::NONE).unwrap();
        let dst = match b.register(dev.clone(), Access::REMOTE_WRITE | Access::LOCAL_WRITE) {
            Ok(r) => r,
            Err(e @ fabric_core::Error::Unsupported(_)) => missing(e.to_string()),
            Err(e) => panic!("register CUDA memory: {e}"),
        };
        let n = len as u64;
        write(
            &mut a,
            &mut b,
            peer,
            fabric_core::LocalSlice {
                key: src.local,
                offset: 0,
                len: n,
            },
            fabric_core::RemoteSlice {
                region: dst.remote,
                offset: 0,
                len: n,
            },
        );
        let mut back = vec![0; len];
        dev.read_to_host(0, &mut back).unwrap();
        assert!(back == pattern, "host -> device: {len} bytes differ");

        // Device -> host, the other way round.
        let host2 = fabric_core::HostBuffer::new_shared(len).unwrap();
        let dst2 = a.register(host2.clone(), Access::REMOTE_WRITE).unwrap();
        write(
            &mut b,
            &mut a,
            peer_ba,
            fabric_core::LocalSlice {
                key: dst.local,
                offset: 0,
                len: n,
            },
            fabric_core::RemoteSlice {
                region: dst2.remote,
                offset: 0,
                len: n,
            },
        );
        assert!(
            host2.to_vec(0, len).unwrap() == pattern,
            "device -> host: {len} bytes differ"
        );
        eprintln!("{provider}: {len} bytes host -> device -> host ok");
    }
}
