//! The backend conformance suite on device memory, two transports in this process.
//!
//! Compiled everywhere and `#[ignore]`d, so `cargo test` without a GPU counts the cases as
//! ignored; `--include-ignored` runs them (`scripts/ipc-proof.sh`), failing where there is no
//! GPU. `cuda_is_there_when_required` always runs and fails when `XFER_REQUIRE_CUDA` asks
//! for a GPU this machine lacks.

mod common;

use fabric_core::Transport;
use fabric_core::testing::{self, SuiteOptions};
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport};

fn make() -> CudaIpcTransport {
    let (cuda, _) = common::cuda();
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
            #[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/ipc-proof.sh)"]
            fn $case() {
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
    strided_writes_land_their_rows,
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

#[test]
fn cuda_is_there_when_required() {
    gpu_mem::testing::check_required_gpus();
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/ipc-proof.sh)"]
fn host_memory_is_refused_as_a_write_target_with_the_reason() {
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

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/ipc-proof.sh)"]
fn writes_wait_for_the_kernels_queued_before_them() {
    gpu_mem::testing::writes_wait_for_the_stream(|| {
        let (cuda, _) = common::cuda();
        CudaIpcTransport::new(cuda, CudaIpcConfig::default())
    });
}
