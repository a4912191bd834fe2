//! Shared by the provider test binaries: make transports on loopback, or skip loudly.
//!
//! Tests of one binary run in parallel threads: each makes its own transports (its own
//! fabric, domain, endpoint and, on tcp/sockets, its own ephemeral port on `lo`), and
//! libfabric's `fi_getinfo`/`fi_fabric` are thread-safe, so they share nothing.
#![allow(dead_code)]

use fabric_core::testing::SuiteOptions;
use transport_efa::{EfaConfig, EfaTransport};

/// Whether a missing libfabric provider is a failure (CI sets `XFER_REQUIRE_LIBFABRIC=1`).
pub fn required() -> bool {
    std::env::var("XFER_REQUIRE_LIBFABRIC").is_ok_and(|v| v == "1")
}

/// Prints "skipped: ..." where it is seen even when the test harness captures output
/// (it captures `eprintln!`, not direct writes to stderr).
pub fn say_skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "skipped: {why}");
}

/// The configuration the tests use for `provider`: loopback for the socket providers.
pub fn config(provider: &str) -> EfaConfig {
    let cfg = EfaConfig::with_provider(provider);
    match provider {
        "tcp" | "tcp;ofi_rxm" | "sockets" => cfg.domain("lo"),
        _ => cfg,
    }
}

/// A maker of transports for `provider`, or `None` (after printing why) when the provider
/// cannot be opened here and `XFER_REQUIRE_LIBFABRIC` is not `1`.
pub fn maker(provider: &'static str) -> Option<impl Fn() -> EfaTransport> {
    match EfaTransport::new(&config(provider)) {
        Ok(_) => Some(move || EfaTransport::new(&config(provider)).expect("open endpoint")),
        Err(e) if required() => {
            panic!("libfabric provider {provider} is required (XFER_REQUIRE_LIBFABRIC=1): {e}")
        }
        Err(e) => {
            say_skipped(&format!(
                "libfabric provider {provider} is not usable here: {e}"
            ));
            None
        }
    }
}

/// The suite options of both tcp endpoints (rxm, and 2.x's native one). Relaxed:
/// `exact_remote_errors`. The tcp provider reports every failure at the target (unknown
/// key, stale key, no REMOTE_WRITE permission) the same way, as FI_ECANCELED with the
/// target's errno (ENOENT) as prov_errno, so the cause cannot be told (they arrive as
/// `OpError::Remote`); and a truncated receive comes with `olen` 0, so the message's length
/// is unknown. Everything else is strict: permissions are enforced, unexpected sends are
/// buffered.
pub const TCP_OPTS: SuiteOptions = SuiteOptions {
    exact_remote_errors: false,
    buffers_unexpected_sends: true,
    enforces_permissions: true,
    timeout: std::time::Duration::from_secs(20),
    many: 5000,
    alloc: fabric_core::testing::host_alloc,
};
