//! libfabric's `shm` provider with GPU memory (FI_HMEM) between two endpoints of one
//! process: refused at `add_peer`, with the reason and the way out.
//!
//! In one process, libfabric 2.6's shm (CMA is off with FI_HMEM, so it copies through its
//! bounce buffers) reported writes into GPU memory complete while the bytes were not
//! there, never delivered the immediate data of others, and crashed on the first host to
//! device write (H200, with and without FI_HMEM_DEVICE_ONLY); 1.17 hung. Between two
//! processes, as shm is used, the same writes land and verify: `hmem_cuda.rs` runs the
//! device cases that way, and `xfer bench` against `xfer serve` measures them
//! (`scripts/efa-hmem-proof.sh`).
//!
//! Needs a GPU and a libfabric built with CUDA (Debian's and Ubuntu's 1.17 are not; the one
//! `scripts/libfabric-2.6.sh --cuda` builds is), so the case is `#[ignore]`d:
//! `cargo test` elsewhere counts it as ignored, `--include-ignored` runs it
//! (`scripts/efa-hmem-proof.sh`, with `XFER_LIBFABRIC` pointing at that build), and it fails
//! naming what is missing. The provider can be changed with `XFER_HMEM_PROVIDER`.

use fabric_core::{Error, Transport};
use transport_efa::{EfaConfig, EfaTransport};

fn make(hmem: bool) -> EfaTransport {
    let provider = std::env::var("XFER_HMEM_PROVIDER").unwrap_or_else(|_| "shm".into());
    gpu_mem::testing::require_gpus(1);
    EfaTransport::new(&EfaConfig::with_provider(provider.clone()).hmem(hmem)).unwrap_or_else(|e| {
        panic!("needs a libfabric provider with FI_HMEM ({provider}, built with CUDA): {e}")
    })
}

#[test]
#[ignore = "needs a CUDA GPU and a libfabric built with CUDA (--include-ignored runs it; scripts/efa-hmem-proof.sh)"]
fn gpu_memory_between_endpoints_of_one_process_is_refused_with_the_way_out() {
    let (mut a, b) = (make(true), make(true));
    let e = a.add_peer(&b.address()).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("two processes"), "{e}");
    // One side with FI_HMEM is enough to refuse, whichever adds the other.
    let (mut host, gpu) = (make(false), make(true));
    assert!(host.add_peer(&gpu.address()).is_err());
    let (host, mut gpu) = (make(false), make(true));
    assert!(gpu.add_peer(&host.address()).is_err());
    // Host memory on both sides is what shm in one process does well.
    let (mut x, y) = (make(false), make(false));
    x.add_peer(&y.address())
        .expect("host memory in one process");
}
