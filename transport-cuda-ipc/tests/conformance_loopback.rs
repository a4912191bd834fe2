//! The conformance suite on the loopback link: the whole CUDA IPC protocol (control socket,
//! reservations and grants, revocation, SEND/RECV, completions) with host memory and CPU
//! copies, so that it runs on every machine, GPU or not.

use fabric_core::testing::SuiteOptions;
use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport, LoopbackLink};

fabric_core::conformance_suite!(
    || CudaIpcTransport::with_link(LoopbackLink::new(), CudaIpcConfig::default()).unwrap(),
    SuiteOptions::default()
);

fabric_core::read_conformance_suite!(
    || CudaIpcTransport::with_link(LoopbackLink::new(), CudaIpcConfig::default()).unwrap(),
    SuiteOptions::default()
);
