//! CUDA memory through the TCP transport (source, target, or both on the GPU).
//!
//! Compiled everywhere; where no CUDA driver exists each test prints why it skips, unless
//! `XFER_REQUIRE_CUDA=1` is set (device runs set it), which turns the skip into a failure.

mod common;

use fabric_core::testing::{Pair, SuiteOptions};
use fabric_core::{Access, HostBuffer, LocalSlice, MemoryRegion, OpError, RemoteSlice, Transport};
use gpu_mem::{Cuda, Device};
use std::sync::Arc;
use transport_tcp::{TcpConfig, TcpTransport};

fn gpu() -> Option<Device> {
    let cuda = match Cuda::probe() {
        Ok(Some(c)) => c,
        Ok(None) | Err(_) => {
            assert!(
                std::env::var("XFER_REQUIRE_CUDA").as_deref() != Ok("1"),
                "XFER_REQUIRE_CUDA=1 but no usable CUDA driver"
            );
            eprintln!("skipped: no CUDA driver on this machine");
            return None;
        }
    };
    Some(cuda.device(0).expect("device 0"))
}

fn pair(rails: usize) -> Pair<TcpTransport> {
    let make = move || {
        TcpTransport::new(TcpConfig {
            rails,
            ..TcpConfig::default()
        })
        .unwrap()
    };
    Pair::new(&make, SuiteOptions::default())
}

/// 64 scattered 64 KiB pages from `src` to `dst`, every byte checked.
fn scattered(p: &mut Pair<TcpTransport>, src: Arc<dyn MemoryRegion>, dst: Arc<dyn MemoryRegion>) {
    common::scattered_pages(p, src, dst, 65536, 64, 37);
}

#[test]
fn host_to_device() {
    let Some(g) = gpu() else { return };
    let mut p = pair(1);
    scattered(
        &mut p,
        HostBuffer::new_shared(4 << 20).unwrap(),
        Arc::new(g.alloc_zeroed(4 << 20).unwrap()),
    );
}

#[test]
fn device_to_host_over_four_rails() {
    let Some(g) = gpu() else { return };
    let mut p = pair(4);
    scattered(
        &mut p,
        Arc::new(g.alloc_zeroed(4 << 20).unwrap()),
        HostBuffer::new_shared(4 << 20).unwrap(),
    );
}

#[test]
fn device_to_device() {
    let Some(g) = gpu() else { return };
    let mut p = pair(2);
    scattered(
        &mut p,
        Arc::new(g.alloc_zeroed(4 << 20).unwrap()),
        Arc::new(g.alloc_zeroed(4 << 20).unwrap()),
    );
}

#[test]
fn device_bounds_are_enforced() {
    let Some(g) = gpu() else { return };
    let mut p = pair(1);
    let src: Arc<dyn MemoryRegion> = Arc::new(g.alloc_zeroed(1 << 20).unwrap());
    let dst = Arc::new(g.alloc_zeroed(1 << 20).unwrap());
    let s = p.a.register(src, Access::NONE).unwrap();
    let d = p.b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = p.b_at_a;
    // A local page crossing the end of its allocation fails at post.
    let bad = LocalSlice {
        key: s.local,
        offset: (1 << 20) - 100,
        len: 4096,
    };
    assert!(
        p.a.post_write(
            peer,
            fabric_core::WorkRequestId(1),
            bad,
            RemoteSlice {
                region: d.remote,
                offset: 0,
                len: 4096
            },
            None
        )
        .is_err()
    );
    // A remote range past the end fails at the target, which stays untouched.
    let c = p.write_once(
        LocalSlice {
            key: s.local,
            offset: 0,
            len: 4096,
        },
        RemoteSlice {
            region: d.remote,
            offset: (1 << 20) - 100,
            len: 4096,
        },
        None,
    );
    assert!(
        matches!(c.result, Err(OpError::OutOfBounds { .. })),
        "{c:?}"
    );
    assert!(dst.to_vec(0, 1 << 20).unwrap().iter().all(|&b| b == 0));
}

#[test]
fn an_absent_gpu_index_is_an_error() {
    let Ok(Some(cuda)) = Cuda::probe() else {
        eprintln!("skipped: no CUDA driver on this machine");
        return;
    };
    assert!(cuda.device(10_000).is_err());
}

#[test]
fn gpu0_to_gpu1_when_two_exist() {
    let Ok(Some(cuda)) = Cuda::probe() else {
        eprintln!("skipped: no CUDA driver on this machine");
        return;
    };
    let n = cuda.device_count().expect("device count");
    if n < 2 {
        assert!(
            std::env::var("XFER_REQUIRE_GPUS")
                .map_or(true, |v| v.parse::<u32>().map_or(true, |want| want < 2)),
            "XFER_REQUIRE_GPUS asks for 2 GPUs, this machine has {n}"
        );
        eprintln!("skipped: this machine has {n} CUDA device(s), the test needs 2");
        return;
    }
    let g0 = cuda.device(0).unwrap();
    let g1 = cuda.device(1).unwrap();
    let mut p = pair(4);
    scattered(
        &mut p,
        Arc::new(g0.alloc_zeroed(4 << 20).unwrap()),
        Arc::new(g1.alloc_zeroed(4 << 20).unwrap()),
    );
}

#[test]
fn device_pages_larger_than_the_staging_ring_stream_through_it() {
    let Some(g) = gpu() else { return };
    let mut p = pair(2);
    let n = 4 * (transport_tcp::DEVICE_STAGING_BYTES as u64 / 65536) * 2; // 4 rings a rail
    let len = (n * 65536) as usize;
    common::scattered_pages(
        &mut p,
        Arc::new(g.alloc_zeroed(len).unwrap()),
        Arc::new(g.alloc_zeroed(len).unwrap()),
        65536,
        n,
        37,
    );
}

#[test]
fn the_driver_tells_device_memory_from_memory_that_only_claims_it() {
    let Some(g) = gpu() else { return };
    let buf = g.alloc_zeroed(1 << 20).unwrap();
    let addr = buf.device_addr();
    assert!(g.holds_range(addr, 1 << 20).unwrap());
    assert!(g.holds_range(addr + 4096, 8192).unwrap());
    assert!(!g.holds_range(0x7000_0000_0000, 4096).unwrap());
    let host = HostBuffer::new(4096).unwrap();
    assert!(!g.holds_range(host.device_addr(), 4096).unwrap());
    assert!(!g.holds_range(u64::MAX - 10, 4096).unwrap());
}

#[test]
fn each_imm_is_reported_once_its_bytes_are_in_device_memory() {
    let Some(g) = gpu() else { return };
    let mut p = pair(1);
    let (page, n) = (1u64 << 20, 24u64);
    let len = (page * n) as usize;
    let data = fabric_core::testing::pattern(3, len);
    let src = Arc::new(g.alloc_zeroed(len).unwrap());
    src.copy_from_host(0, &data).unwrap();
    let dst = Arc::new(g.alloc_zeroed(len).unwrap());
    let s = p.a.register(src, Access::NONE).unwrap();
    let d = p.b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
    let peer = p.b_at_a;
    for i in 0..n {
        let (src_slice, dst_slice) = (
            LocalSlice {
                key: s.local,
                offset: i * page,
                len: page,
            },
            RemoteSlice {
                region: d.remote,
                offset: i * page,
                len: page,
            },
        );
        p.post_a(|t| {
            t.post_write(
                peer,
                fabric_core::WorkRequestId(i),
                src_slice,
                dst_slice,
                Some(i as u32),
            )
        });
    }
    let mut seen = 0u64;
    while seen < n {
        let ev = p.take_b(1, "imm").remove(0);
        assert_eq!(ev.imm, Some(seen as u32), "imm out of order");
        let at = (seen * page) as usize;
        assert!(
            dst.to_vec(seen * page, page as usize).unwrap() == data[at..at + page as usize],
            "imm {seen} reported before its bytes were in device memory"
        );
        seen += 1;
    }
    let done = p.take_a(n as usize, "write completions");
    assert!(done.iter().all(|c| c.result == Ok(page)), "{done:?}");
}
