//! The backend conformance suite on device memory, two transports in this process.
//!
//! Compiled everywhere; without a CUDA driver every case prints that it skips, unless
//! `XFER_REQUIRE_CUDA=1` (set on GPU machines), which turns the skip into a failure.

mod common;

use fabric_core::Transport;
use fabric_core::testing::{self, SuiteOptions};
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport};

fn make() -> CudaIpcTransport {
    let (cuda, _) = common::cuda().expect("checked by the case");
    CudaIpcTransport::new(cuda, CudaIpcConfig::default()).expect("transport")
}

fn opts() -> SuiteOptions {
    SuiteOptions {
        alloc: common::device_alloc,
        ..SuiteOptions::default()
    }
}

macro_rules! cases {
    ($($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                if common::cuda().is_none() {
                    return;
                }
                testing::$case(&make, opts());
            }
        )*
    };
}

cases!(
    send_recv_order_and_lengths,
    send_before_recv_is_posted,
    recv_too_small_is_truncated,
    write_without_imm,
    write_with_imm,
    bad_remote_key_fails,
    out_of_bounds_write_fails,
    write_without_permission_fails,
    write_after_deregister_fails,
    local_errors_fail_at_post,
    remove_peer_with_ops_in_flight,
    many_operations_in_flight,
    zero_and_large_segments,
    idle_target_progresses_through_wait,
);

#[test]
fn host_memory_is_refused_as_a_write_target_with_the_reason() {
    if common::cuda().is_none() {
        return;
    }
    let mut t = make();
    let host = fabric_core::HostBuffer::new_shared(4096).unwrap();
    let e = t
        .register(host.clone(), fabric_core::Access::REMOTE_WRITE)
        .unwrap_err();
    assert!(matches!(e, fabric_core::Error::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("tcp transport"), "{e}");
    // As a source (no remote access) host memory is fine.
    t.register(host, fabric_core::Access::NONE).unwrap();
}
