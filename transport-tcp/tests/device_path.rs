//! The path for memory the CPU cannot address (GPU memory), exercised without a GPU: a fake
//! device region that only copies, and counts how the transport asks it to.

mod common;

use fabric_core::testing::{Pair, SuiteOptions, pattern};
use fabric_core::{
    Access, HostBuffer, LocalSlice, MemoryError, MemoryLocation, MemoryRegion, OpKind, RemoteSlice,
    Transport,
};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use transport_tcp::{TcpConfig, TcpTransport};

/// Host bytes behind a region that offers no host pointer, like device memory.
struct FakeDevice {
    inner: HostBuffer,
    single: AtomicUsize,
    batched: AtomicUsize,
}

impl FakeDevice {
    fn new(len: usize) -> Arc<FakeDevice> {
        Arc::new(FakeDevice {
            inner: HostBuffer::new(len).unwrap(),
            single: AtomicUsize::new(0),
            batched: AtomicUsize::new(0),
        })
    }
}

// SAFETY: no host pointer is offered; every access goes through the copy methods, which
// bound-check against the inner buffer.
unsafe impl MemoryRegion for FakeDevice {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Cuda { device: 0 }
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        None
    }
    fn device_addr(&self) -> u64 {
        0x7000_0000_0000
    }
    fn read_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.single.fetch_add(1, Ordering::Relaxed);
        self.inner.read(offset, dst)
    }
    fn write_from_host(&self, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.single.fetch_add(1, Ordering::Relaxed);
        self.inner.write(offset, src)
    }
    fn read_many_to_host(&self, parts: &mut [(u64, &mut [u8])]) -> Result<(), MemoryError> {
        self.batched.fetch_add(1, Ordering::Relaxed);
        parts
            .iter_mut()
            .try_for_each(|(o, d)| self.inner.read(*o, d))
    }
    fn write_many_from_host(&self, parts: &[(u64, &[u8])]) -> Result<(), MemoryError> {
        self.batched.fetch_add(1, Ordering::Relaxed);
        parts.iter().try_for_each(|(o, s)| self.inner.write(*o, s))
    }
}

#[test]
fn device_pages_move_in_batches_and_land_before_their_imm() {
    let make = || TcpTransport::new(TcpConfig::default()).unwrap();
    let mut p = Pair::new(&make, SuiteOptions::default());
    let (page, n) = (16384u64, 128u64);
    let src = FakeDevice::new((page * n) as usize);
    let dst = FakeDevice::new((page * n) as usize);
    common::scattered_pages(&mut p, src.clone(), dst.clone(), page, n, 53);
    assert_eq!(
        src.single.load(Ordering::Relaxed),
        0,
        "the source is read in batches only"
    );
    assert_eq!(
        dst.single.load(Ordering::Relaxed),
        0,
        "the target is written in batches only"
    );
    // One batched call each for the test's own fill and check; the rest are the transport's.
    let (rb, wb) = (
        src.batched.load(Ordering::Relaxed) - 1,
        dst.batched.load(Ordering::Relaxed) - 1,
    );
    assert!(
        rb >= 1 && rb < n as usize / 4,
        "{rb} batched reads for {n} pages"
    );
    assert!(
        wb >= 1 && wb < n as usize,
        "{wb} batched writes for {n} pages"
    );
}

#[test]
fn a_failed_device_copy_fails_the_connection_not_the_process() {
    struct Broken;
    // SAFETY: no host pointer is offered and every copy fails.
    unsafe impl MemoryRegion for Broken {
        fn len(&self) -> usize {
            1 << 20
        }
        fn location(&self) -> MemoryLocation {
            MemoryLocation::Cuda { device: 0 }
        }
        fn host_ptr(&self) -> Option<NonNull<u8>> {
            None
        }
        fn device_addr(&self) -> u64 {
            0
        }
        fn read_to_host(&self, _: u64, _: &mut [u8]) -> Result<(), MemoryError> {
            Err(MemoryError::Device("the device fell off the bus".into()))
        }
        fn write_from_host(&self, _: u64, _: &[u8]) -> Result<(), MemoryError> {
            Err(MemoryError::Device("the device fell off the bus".into()))
        }
    }
    let make = || TcpTransport::new(TcpConfig::default()).unwrap();
    let mut p = Pair::new(&make, SuiteOptions::default());
    let good = FakeDevice::new(1 << 20);
    let s = p.a.register(good, Access::NONE).unwrap();
    let d =
        p.b.register(Arc::new(Broken), Access::REMOTE_WRITE)
            .unwrap();
    let c = p.write_once(
        LocalSlice {
            key: s.local,
            offset: 0,
            len: 4096,
        },
        RemoteSlice {
            region: d.remote,
            offset: 0,
            len: 4096,
        },
        Some(1),
    );
    assert!(
        c.result.is_err(),
        "a write the target could not place must fail: {c:?}"
    );
    assert!(
        p.done_b.iter().all(|c| c.op != OpKind::RemoteWrite),
        "no imm for bytes that did not land"
    );
}

#[test]
fn a_device_write_larger_than_a_read_chunk_lands_whole() {
    let make = || TcpTransport::new(TcpConfig::default()).unwrap();
    let mut p = Pair::new(&make, SuiteOptions::default());
    let len = (5 << 20) + 333;
    let data = pattern(21, len);
    let src = FakeDevice::new(len);
    src.inner.write(0, &data).unwrap();
    let dst = FakeDevice::new(len + 4096);
    let s = p.a.register(src, Access::NONE).unwrap();
    let d = p.b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let c = p.write_once(
        LocalSlice {
            key: s.local,
            offset: 0,
            len: len as u64,
        },
        RemoteSlice {
            region: d.remote,
            offset: 4096,
            len: len as u64,
        },
        Some(2),
    );
    assert_eq!(c.result, Ok(len as u64));
    let ev = p.take_b(1, "imm").remove(0);
    assert_eq!(ev.imm, Some(2));
    assert!(dst.inner.to_vec(4096, len).unwrap() == data, "bytes differ");
    assert_eq!(
        dst.inner.to_vec(0, 4096).unwrap(),
        vec![0; 4096],
        "bytes before the write"
    );
}
