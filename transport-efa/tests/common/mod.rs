//! Shared by the provider test binaries: make transports on loopback, or skip loudly.
//!
//! Tests of one binary run in parallel threads: each makes its own transports (its own
//! fabric, domain, endpoint and, on tcp/sockets, its own ephemeral port on `lo`), and
//! libfabric's `fi_getinfo`/`fi_fabric` are thread-safe, so they share nothing.
#![allow(dead_code)]

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
