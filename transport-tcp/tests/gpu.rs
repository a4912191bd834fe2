//! CUDA memory through the TCP transport (source, target, or both on the GPU).
//!
//! Compiled everywhere and `#[ignore]`d, so that `cargo test` without a GPU counts them as
//! ignored; `--include-ignored` runs them (`scripts/gpu-proof.sh`), and each fails, naming
//! what is missing, where its GPUs are not there. `cuda_is_there_when_required` always runs
//! and fails when `XFER_REQUIRE_CUDA`/`XFER_REQUIRE_GPUS` ask for GPUs this machine lacks.

mod common;

use fabric_core::testing::{Pair, SuiteOptions};
use fabric_core::{Access, HostBuffer, LocalSlice, MemoryRegion, OpError, RemoteSlice, Transport};
use gpu_mem::Device;
use std::sync::Arc;
use transport_tcp::{TcpConfig, TcpTransport};

fn gpu() -> Device {
    gpu_mem::testing::require_gpus(1)
        .device(0)
        .expect("device 0")
}

#[test]
fn cuda_is_there_when_required() {
    gpu_mem::testing::check_required_gpus();
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
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn host_to_device() {
    let g = gpu();
    let mut p = pair(1);
    scattered(
        &mut p,
        HostBuffer::new_shared(4 << 20).unwrap(),
        Arc::new(g.alloc_zeroed(4 << 20).unwrap()),
    );
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn device_to_host_over_four_rails() {
    let g = gpu();
    let mut p = pair(4);
    scattered(
        &mut p,
        Arc::new(g.alloc_zeroed(4 << 20).unwrap()),
        HostBuffer::new_shared(4 << 20).unwrap(),
    );
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn device_to_device() {
    let g = gpu();
    let mut p = pair(2);
    scattered(
        &mut p,
        Arc::new(g.alloc_zeroed(4 << 20).unwrap()),
        Arc::new(g.alloc_zeroed(4 << 20).unwrap()),
    );
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn device_bounds_are_enforced() {
    let g = gpu();
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
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn an_absent_gpu_index_is_an_error() {
    let cuda = gpu_mem::testing::require_gpus(1);
    assert!(cuda.device(10_000).is_err());
}

#[test]
#[ignore = "needs 2 CUDA GPUs (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn two_gpus_gpu0_to_gpu1() {
    let cuda = gpu_mem::testing::require_gpus(2);
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
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn device_pages_larger_than_the_staging_ring_stream_through_it() {
    let g = gpu();
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
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn the_driver_tells_device_memory_from_memory_that_only_claims_it() {
    let g = gpu();
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
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn each_imm_is_reported_once_its_bytes_are_in_device_memory() {
    let g = gpu();
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

/// The READ conformance cases with every region in device memory: replies leave through
/// the owner's out-ring and land through the initiator's in-ring, on CUDA streams.
mod reads_of_device_memory {
    use super::*;

    fn device_alloc(len: usize) -> Arc<dyn MemoryRegion> {
        Arc::new(gpu().alloc_zeroed(len).expect("device memory"))
    }

    fn make() -> TcpTransport {
        TcpTransport::new(TcpConfig::default()).unwrap()
    }

    macro_rules! cases {
        ($($case:ident),* $(,)?) => {
            $(
                #[test]
                #[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
                fn $case() {
                    fabric_core::testing::$case(
                        &make,
                        SuiteOptions {
                            alloc: device_alloc,
                            ..SuiteOptions::default()
                        },
                    );
                }
            )*
        };
    }

    cases!(
        read_lands_in_initiator,
        read_bad_remote_key_fails,
        read_out_of_bounds_fails,
        read_without_permission_fails,
        read_after_deregister_fails,
        read_local_errors_fail_at_post,
        read_remove_peer_with_ops_in_flight,
        read_many_in_flight,
        read_zero_and_large,
        read_write_mixed_traffic,
        read_idle_owner_serves_through_wait,
    );
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn writes_wait_for_the_kernels_queued_before_them() {
    gpu_mem::testing::writes_wait_for_the_stream(|| TcpTransport::new(TcpConfig::default()));
}
