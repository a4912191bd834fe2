//! The conformance suite over libfabric's `sockets` provider on loopback.

mod common;

use fabric_core::testing::SuiteOptions;

/// Relaxed: `exact_remote_errors`. The sockets provider reports an unknown or stale key
/// as FI_EACCES, the same error as a missing REMOTE_WRITE permission, so a bad key
/// arrives as `OpError::PermissionDenied`. Truncation is exact (it reports `olen`);
/// permissions are enforced; unexpected sends are buffered.
const OPTS: SuiteOptions = SuiteOptions {
    exact_remote_errors: false,
    buffers_unexpected_sends: true,
    enforces_permissions: true,
    timeout: std::time::Duration::from_secs(20),
    many: 5000,
    alloc: fabric_core::testing::host_alloc,
};

fabric_core::conformance_suite!(
    match common::maker("sockets") {
        Some(make) => make,
        None => return,
    },
    OPTS
);

// READ (fi_readmsg), with the same options, less one case the provider fails.
fabric_core::read_conformance_suite!(@cases
    match common::maker("sockets") {
        Some(make) => make,
        None => return,
    },
    OPTS;
    read_lands_in_initiator, read_bad_remote_key_fails, read_out_of_bounds_fails, read_without_permission_fails, read_after_deregister_fails, read_local_errors_fail_at_post, read_remove_peer_with_ops_in_flight, read_zero_and_large, read_write_mixed_traffic, read_idle_owner_serves_through_wait;
    ignore
    read_many_in_flight = "libfabric's sockets provider answers FI_EAGAIN to reads for longer than the suite's timeout with 5000 in flight (writes pass the same case)"
);
