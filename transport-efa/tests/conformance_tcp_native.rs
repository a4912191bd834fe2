//! The conformance suite over libfabric 2.x's native `tcp` RDM endpoint (xnet, without
//! rxm), which `--provider tcp` only opens when `FI_PROVIDER` hides rxm: this binary sets
//! `FI_PROVIDER=^ofi_rxm` before libfabric reads it. Skipped (with a note) on 1.x, which
//! has no such endpoint, unless `XFER_REQUIRE_LIBFABRIC_2=1` says that the run is meant to
//! load 2.x (scripts/test.sh's libfabric 2.6 step, under CI): then every case fails instead
//! of passing without having run. `XFER_REQUIRE_LIBFABRIC=1` alone cannot ask for it: CI's
//! main step runs this binary against Debian's 1.17, where the endpoint does not exist.
//!
//! Besides the cases, it holds what made that endpoint slow: it says FI_PROGRESS_AUTO but
//! moves data only while its CQ is read, so the transport must sleep on the CQ's descriptor
//! (`busy_poll` false) instead of napping between reads.

mod common;

use fabric_core::Transport;
use fabric_core::testing::SuiteOptions;
use transport_efa::EfaTransport;

/// As `conformance_tcp`'s: failures at the target arrive as `OpError::Remote`.
const OPTS: SuiteOptions = common::TCP_OPTS;

static HIDE_RXM: std::sync::Once = std::sync::Once::new();

/// Whether this run must load libfabric 2.x (`XFER_REQUIRE_LIBFABRIC_2=1`).
fn required_2() -> bool {
    std::env::var("XFER_REQUIRE_LIBFABRIC_2").is_ok_and(|v| v == "1")
}

/// A maker of native-tcp transports, or `None` on libfabric 1.x (said, not failed: 1.x
/// has no native RDM tcp endpoint, so nothing is skipped that exists), unless the run asks
/// for 2.x (`XFER_REQUIRE_LIBFABRIC_2=1`): then 1.x, or no libfabric, fails.
fn native() -> Option<impl Fn() -> EfaTransport> {
    HIDE_RXM.call_once(|| {
        // SAFETY: every test of this binary passes here first and waits for this call, so
        // no thread of ours reads the environment meanwhile; libfabric reads FI_PROVIDER
        // once, at its first fi_getinfo, which comes after.
        unsafe { std::env::set_var("FI_PROVIDER", "^ofi_rxm") };
    });
    match transport_efa::libfabric_version() {
        Ok((major, _)) if major >= 2 => {}
        Ok((major, minor)) => {
            assert!(
                !required_2(),
                "libfabric 2.x is required (XFER_REQUIRE_LIBFABRIC_2=1) for its native tcp \
                 RDM endpoint, but {major}.{minor} was loaded (is XFER_LIBFABRIC set?)"
            );
            common::say_skipped(&format!(
                "libfabric {major}.{minor} has no native tcp RDM endpoint (2.x has)"
            ));
            return None;
        }
        Err(e) => {
            assert!(
                !common::required() && !required_2(),
                "libfabric is required: {e}"
            );
            common::say_skipped(&format!("no libfabric: {e}"));
            return None;
        }
    }
    let make = common::maker("tcp")?;
    let t = make();
    assert_eq!(
        t.provider(),
        "tcp",
        "FI_PROVIDER=^ofi_rxm leaves the native endpoint"
    );
    Some(make)
}

#[test]
fn the_native_endpoint_is_waited_on_not_napped_between_reads() {
    let Some(make) = native() else { return };
    let t = make();
    assert!(
        !t.limits().busy_poll,
        "native tcp moves data only while its CQ is read: wait must sleep on its descriptor"
    );
}

fabric_core::conformance_suite!(
    match native() {
        Some(make) => make,
        None => return,
    },
    OPTS
);

// READ (fi_readmsg), as over rxm, less the case tcp fails there too.
fabric_core::read_conformance_suite!(@cases
    match native() {
        Some(make) => make,
        None => return,
    },
    OPTS;
    read_lands_in_initiator, read_bad_remote_key_fails, read_out_of_bounds_fails, read_after_deregister_fails, read_local_errors_fail_at_post, read_remove_peer_with_ops_in_flight, read_many_in_flight, read_zero_and_large, read_write_mixed_traffic, read_idle_owner_serves_through_wait;
    ignore
    read_without_permission_fails = "libfabric's tcp provider does not check REMOTE_READ at the target (sockets and mem do; the same registration code serves both)"
);
