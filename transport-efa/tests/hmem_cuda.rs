//! CUDA memory through FI_HMEM: registration with `fi_mr_regattr` (FI_HMEM_CUDA) and
//! writes host -> device and device -> host, over the `shm` provider (which offers
//! FI_HMEM where CUDA is installed; on AWS `efa` does too), between two processes as shm is
//! used: this test binary runs itself again as the peer that holds the CUDA memory.
//!
//! Not in one process: there, libfabric 2.6's shm with FI_HMEM crashed (SIGSEGV) on the
//! first host -> device write on the H200, and writes into device memory reported
//! completion with the bytes not there (see `shm_cuda_one_process.rs`, which shows that combination is refused); 1.17 hung.
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
            .ok_or(MemoryError::device(format!("cuMemcpyDtoH: {rc}")))
    }
    fn write_from_host(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        fabric_core::memory::check_range(offset, src.len() as u64, self.len as u64)?;
        self.cuda.current();
        // SAFETY: the range was checked; src is readable for its length.
        let rc = unsafe { (self.cuda.htod)(self.ptr + offset, src.as_ptr().cast(), src.len()) };
        (rc == 0)
            .then_some(())
            .ok_or(MemoryError::device(format!("cuMemcpyHtoD: {rc}")))
    }
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

/// Lines a process of the two-process round trip says to the other start with this.
const SAY: &str = "XFER ";

/// Reads lines of `input` in a thread, forwarding what follows [`SAY`] in those that hold
/// it (the test harness may print its own text before it on the same line).
fn said_lines(input: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(input).lines().map_while(Result::ok) {
            if let Some(at) = line.find(SAY)
                && tx.send(line[at + SAY.len()..].to_string()).is_err()
            {
                break;
            }
        }
    });
    rx
}

/// Polls `t` (its peers' writes land only while it progresses) until a line arrives.
fn poll_until_line(
    t: &mut EfaTransport,
    lines: &std::sync::mpsc::Receiver<String>,
    what: &str,
) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut done = Vec::new();
    loop {
        t.poll(&mut done).unwrap();
        if let Ok(line) = lines.try_recv() {
            return line;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::yield_now();
    }
}

/// Polls `t` until one completion of a local operation arrives; returns it.
fn poll_until_done(t: &mut EfaTransport, what: &str) -> fabric_core::Completion {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut done = Vec::new();
    loop {
        t.poll(&mut done).unwrap();
        if let Some(i) = done.iter().position(|c| c.op == fabric_core::OpKind::Write) {
            return done.swap_remove(i);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
    }
}

fn region_line(r: &fabric_core::RemoteRegion) -> String {
    format!("{} {} {}", r.addr, r.len, r.key.0)
}

fn parse_region(s: &str) -> fabric_core::RemoteRegion {
    let v: Vec<u64> = s.split(' ').map(|x| x.parse().expect("number")).collect();
    fabric_core::RemoteRegion {
        addr: v[0],
        len: v[1],
        key: fabric_core::RemoteKey(v[2]),
    }
}

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 13 + seed) as u8).collect()
}

const LENGTHS: [usize; 3] = [1000, 64 << 10, 4 << 20];

/// Host memory in this process, CUDA memory in a child process (this test binary again,
/// `XFER_HMEM_CHILD=cuda`): shm between two processes, as it is used. Host -> device
/// writes are checked in the child, device -> host writes here, every byte.
#[test]
#[ignore = "needs a CUDA GPU and a libfabric with FI_HMEM (--include-ignored runs it; scripts/efa-hmem-proof.sh)"]
fn cuda_memory_round_trip_between_processes() {
    round_trip_between_processes(true);
}

/// The same two processes with host memory on both sides, which any machine with shm can
/// run: it checks the protocol of the CUDA case (and shm between processes) in CI.
#[test]
fn host_memory_round_trip_between_processes() {
    if std::env::var_os("XFER_HMEM_CHILD").is_none() && common::maker("shm").is_none() {
        return;
    }
    round_trip_between_processes(false);
}

fn round_trip_between_processes(cuda: bool) {
    let test = if cuda {
        "cuda_memory_round_trip_between_processes"
    } else {
        "host_memory_round_trip_between_processes"
    };
    if std::env::var_os("XFER_HMEM_CHILD").is_some() {
        return hmem_child(cuda);
    }
    let provider = if cuda { provider() } else { "shm".into() };
    let cfg = EfaConfig::with_provider(provider.clone()).hmem(cuda);
    let mut a = EfaTransport::new(&cfg)
        .unwrap_or_else(|e| missing(format!("{provider} with FI_HMEM: {e}")));
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            test,
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("XFER_HMEM_CHILD", "1")
        .env_remove("XFER_REQUIRE_HMEM")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the child process");
    let lines = said_lines(child.stdout.take().unwrap());
    let mut to_child = child.stdin.take().unwrap();
    let mut tell = |s: String| {
        use std::io::Write;
        writeln!(to_child, "{SAY}{s}").expect("tell the child");
    };
    let max = *LENGTHS.iter().max().unwrap();
    let src = fabric_core::HostBuffer::new_shared(max).unwrap();
    let back = fabric_core::HostBuffer::new_shared(max).unwrap();
    let s = a.register(src.clone(), Access::NONE).unwrap();
    let d = a.register(back.clone(), Access::REMOTE_WRITE).unwrap();
    tell(format!("addr {}", hex::encode(a.address())));
    tell(format!("region {}", region_line(&d.remote)));
    let hello = poll_until_line(&mut a, &lines, "the child's address");
    let child_addr = hex::decode(hello.strip_prefix("addr ").expect("addr line")).unwrap();
    let child_region = parse_region(
        poll_until_line(&mut a, &lines, "the child's region")
            .strip_prefix("region ")
            .expect("region line"),
    );
    let peer = a.add_peer(&child_addr).unwrap();
    for (i, len) in LENGTHS.into_iter().enumerate() {
        let n = len as u64;
        src.write(0, &pattern(len, i)).unwrap();
        // Host (here) -> device (child).
        while a
            .post_write(
                peer,
                WorkRequestId(1),
                fabric_core::LocalSlice {
                    key: s.local,
                    offset: 0,
                    len: n,
                },
                fabric_core::RemoteSlice {
                    region: child_region,
                    offset: 0,
                    len: n,
                },
                Some(7),
            )
            .unwrap()
            == PostOutcome::NoRoom
        {
            a.poll(&mut Vec::new()).unwrap();
        }
        let c = poll_until_done(&mut a, "the host -> device write");
        assert_eq!(c.result, Ok(n), "{c:?}");
        tell(format!("check {len} {i}"));
        let verdict = poll_until_line(&mut a, &lines, "the child's check");
        assert_eq!(verdict, format!("ok {len}"), "host -> device, {len} bytes");
        // Device (child) -> host (here): this side must progress for it to land.
        tell(format!("send {len}"));
        let sent = poll_until_line(&mut a, &lines, "the child's write");
        assert_eq!(sent, format!("sent {len}"));
        assert!(
            back.to_vec(0, len).unwrap() == pattern(len, i),
            "device -> host: {len} bytes differ"
        );
        eprintln!(
            "{provider}, two processes: {len} bytes to the peer's {} memory and back ok",
            if cuda { "CUDA" } else { "host" }
        );
    }
    tell("quit".into());
    assert!(child.wait().unwrap().success(), "the child failed");
}

/// The child of [`round_trip_between_processes`]: CUDA (or host) memory on a transport of
/// its own, driven by the parent's lines on stdin.
fn hmem_child(cuda: bool) {
    let max = *LENGTHS.iter().max().unwrap();
    let (cfg, dev): (EfaConfig, Arc<dyn MemoryRegion>) = if cuda {
        let driver = Arc::new(Cuda::load().unwrap_or_else(|e| missing(e)));
        let cfg = EfaConfig::with_provider(provider()).hmem(true);
        (cfg, Arc::new(DeviceBuffer::new(&driver, max)))
    } else {
        let buf: Arc<dyn MemoryRegion> = fabric_core::HostBuffer::new_shared(max).unwrap();
        (EfaConfig::with_provider("shm"), buf)
    };
    let mut b = EfaTransport::new(&cfg).unwrap();
    dev.write_from_host(0, &vec![0; max]).unwrap();
    let r = b
        .register(dev.clone(), Access::REMOTE_WRITE | Access::LOCAL_WRITE)
        .unwrap_or_else(|e| missing(format!("register CUDA memory: {e}")));
    println!("{SAY}addr {}", hex::encode(b.address()));
    println!("{SAY}region {}", region_line(&r.remote));
    let lines = said_lines(std::io::stdin());
    let parent = hex::decode(
        poll_until_line(&mut b, &lines, "the parent's address")
            .strip_prefix("addr ")
            .expect("addr line"),
    )
    .unwrap();
    let parent_region = parse_region(
        poll_until_line(&mut b, &lines, "the parent's region")
            .strip_prefix("region ")
            .expect("region line"),
    );
    let peer = b.add_peer(&parent).unwrap();
    loop {
        let line = poll_until_line(&mut b, &lines, "the parent's next line");
        let words: Vec<&str> = line.split(' ').collect();
        match words.as_slice() {
            ["check", len, seed] => {
                let (len, seed): (usize, usize) = (len.parse().unwrap(), seed.parse().unwrap());
                let mut got = vec![0; len];
                dev.read_to_host(0, &mut got).unwrap();
                let verdict = if got == pattern(len, seed) {
                    "ok"
                } else {
                    "differ"
                };
                println!("{SAY}{verdict} {len}");
            }
            ["send", len] => {
                let n: u64 = len.parse().unwrap();
                while b
                    .post_write(
                        peer,
                        WorkRequestId(2),
                        fabric_core::LocalSlice {
                            key: r.local,
                            offset: 0,
                            len: n,
                        },
                        fabric_core::RemoteSlice {
                            region: parent_region,
                            offset: 0,
                            len: n,
                        },
                        None,
                    )
                    .unwrap()
                    == PostOutcome::NoRoom
                {
                    b.poll(&mut Vec::new()).unwrap();
                }
                let c = poll_until_done(&mut b, "the device -> host write");
                assert_eq!(c.result, Ok(n), "{c:?}");
                println!("{SAY}sent {len}");
            }
            ["quit"] => return,
            other => panic!("unexpected line {other:?}"),
        }
    }
}
