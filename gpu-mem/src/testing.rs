//! What the hardware tests of the workspace need from this machine (feature `testing`).
//!
//! Tests that need a GPU are marked `#[ignore = "needs a CUDA GPU ..."]`, so that
//! `cargo test` on a machine without one counts them as ignored rather than passed. Run
//! them with `--include-ignored` (`scripts/gpu-proof.sh` and `scripts/ipc-proof.sh` do):
//! each starts with [`require_gpus`], which fails the test, naming what is missing, when
//! the machine does not have it. Every suite with such tests also has one test that is not
//! ignored and calls [`check_required_gpus`]: with `XFER_REQUIRE_CUDA=1` (or
//! `XFER_REQUIRE_GPUS=N`) set, plain `cargo test` fails on a machine without the GPUs asked
//! for, so a GPU run can never pass by skipping.

use crate::Cuda;

/// How many CUDA GPUs the environment says this machine must have: `XFER_REQUIRE_GPUS=N`,
/// else 1 with `XFER_REQUIRE_CUDA=1`, else 0.
pub fn required_gpus() -> usize {
    let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
    match var("XFER_REQUIRE_GPUS") {
        Some(n) => n
            .parse()
            .unwrap_or_else(|_| panic!("XFER_REQUIRE_GPUS must be a number of GPUs, not {n:?}")),
        None => usize::from(var("XFER_REQUIRE_CUDA").is_some_and(|v| v != "0")),
    }
}

/// What this machine has, in words, and its number of CUDA devices.
fn inventory() -> (String, usize) {
    match Cuda::probe() {
        Ok(Some(cuda)) => match cuda.device_count() {
            Ok(n) => (format!("{n} CUDA GPU(s)"), n as usize),
            Err(e) => (
                format!("a CUDA driver that cannot count its devices ({e})"),
                0,
            ),
        },
        Ok(None) if !crate::driver_present() => {
            ("no CUDA driver (libcuda.so.1 not found)".to_owned(), 0)
        }
        Ok(None) => ("a CUDA driver but no CUDA device".to_owned(), 0),
        Err(e) => (format!("a CUDA driver that fails to start ({e})"), 0),
    }
}

/// The CUDA driver, on a machine with at least `n` GPUs.
///
/// # Panics
/// When the machine has fewer: the message names what was needed and what was found.
pub fn require_gpus(n: usize) -> Cuda {
    let (found, count) = inventory();
    assert!(
        count >= n.max(1),
        "this test needs {} CUDA GPU(s); this machine has {found}",
        n.max(1)
    );
    Cuda::probe()
        .ok()
        .flatten()
        .expect("probed successfully just above")
}

/// The gate of a hardware suite: fails when the environment asks for GPUs
/// ([`required_gpus`]) that this machine lacks; otherwise checks that probing for CUDA
/// reports its absence as a value and never panics.
///
/// # Panics
/// When fewer GPUs are present than required, or when the probe contradicts itself.
pub fn check_required_gpus() {
    let required = required_gpus();
    let (found, count) = inventory();
    assert!(
        count >= required,
        "XFER_REQUIRE_CUDA/XFER_REQUIRE_GPUS ask for {required} CUDA GPU(s); this machine has {found}"
    );
    if !crate::driver_present() {
        assert!(
            matches!(Cuda::probe(), Ok(None)),
            "no driver, yet a CUDA value"
        );
        assert_eq!(crate::devices().map(|d| d.len()), Ok(0));
    }
}
