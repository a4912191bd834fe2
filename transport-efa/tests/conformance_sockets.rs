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
