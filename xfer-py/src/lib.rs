//! # xfer-py
//!
//! The `xfer` Python package: the transfer engine for numpy, torch and cupy memory, built
//! with PyO3 (stable ABI, `abi3-py311`) by maturin. The Python classes (`Engine`,
//! `Registration`, `Peer`, `Handle`) are a thin layer over [`fabric_core::engine::RailGroup`]:
//! the GIL is released around every call that waits, buffers are taken without copies
//! through the buffer protocol or `__cuda_array_interface__` ([`memory`]), and errors are a
//! class hierarchy under `xfer.Error` ([`errors`]). Addresses and descriptors travel as
//! small versioned byte strings ([`wire`]).
//!
//! ```
//! // The byte forms are plain Rust, usable without Python:
//! use fabric_core::engine::RemoteDescriptor;
//! use fabric_core::{RemoteKey, RemoteRegion};
//! let d = RemoteDescriptor { rails: vec![RemoteRegion { addr: 0, len: 4096, key: RemoteKey(9) }] };
//! let bytes = _xfer::wire::encode_descriptor(&d);
//! assert_eq!(_xfer::wire::decode_descriptor(&bytes).unwrap(), d);
//! assert!(_xfer::wire::decode_descriptor(&bytes[..5]).is_err());
//! ```
//!
//! Transports: tcp, cuda-ipc, efa (cargo feature `efa`, on by default: transport-efa loads
//! libfabric at run time, so the wheel imports on machines without it, and
//! `Engine(transport="efa")` there fails with the loader's message) and the in-process mem
//! transport.
//!
//! Dependencies: `pyo3` (the binding; `abi3-py311` because the buffer protocol is in the
//! stable ABI from Python 3.11, the version of Debian 12), the workspace's backend crates,
//! `thiserror` for the crate's error enums, and `if-addrs` (as the CLI) to find the address
//! of each NIC named in `nics`, and the workspace's `directory` crate for `xfer.Directory`
//! (etcd or a file: members find each other by name).
#![warn(missing_docs)]

pub mod backend;
mod directory;
mod engine;
pub mod errors;
pub mod memory;
mod stream;
pub mod wire;

use pyo3::prelude::*;

/// The native module, re-exported by the `xfer` package.
#[pymodule]
fn _xfer(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::Engine>()?;
    m.add_class::<engine::Registration>()?;
    m.add_class::<engine::Peer>()?;
    m.add_class::<engine::Handle>()?;
    m.add_class::<directory::Directory>()?;
    m.add_class::<directory::Publication>()?;
    m.add_class::<directory::Watch>()?;
    errors::add(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
