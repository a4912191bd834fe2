//! The conformance suite over libfabric's `tcp` provider through rxm (`tcp;ofi_rxm`, named
//! explicitly: on 2.x `tcp` alone opens the native endpoint, which `conformance_tcp_native`
//! covers) on loopback.

mod common;

use fabric_core::testing::SuiteOptions;

const OPTS: SuiteOptions = common::TCP_OPTS;

fabric_core::conformance_suite!(
    match common::maker("tcp;ofi_rxm") {
        Some(make) => make,
        None => return,
    },
    OPTS
);

// READ (fi_readmsg), with the same options, less one case the provider fails.
fabric_core::read_conformance_suite!(@cases
    match common::maker("tcp;ofi_rxm") {
        Some(make) => make,
        None => return,
    },
    OPTS;
    read_lands_in_initiator, read_bad_remote_key_fails, read_out_of_bounds_fails, read_after_deregister_fails, read_local_errors_fail_at_post, read_remove_peer_with_ops_in_flight, read_many_in_flight, read_zero_and_large, read_write_mixed_traffic, read_idle_owner_serves_through_wait;
    ignore
    read_without_permission_fails = "libfabric's tcp provider does not check REMOTE_READ at the target (sockets and mem do; the same registration code serves both)"
);
