//! # xfer-py
//!
//! The `xfer` Python package: the transfer engine for numpy, torch and cupy memory, built
//! with PyO3 (stable ABI, `abi3-py311`) by maturin. A thin layer over the [`xfer`] crate,
//! whose names it uses: `xfer.Agent` is one [`xfer::Agent`] (built by the library from the
//! keyword arguments, [`options`]), and `Region`, `Peer`, `Handle` and `Notification` are
//! the library's [`xfer::Region`], [`xfer::Peer`], [`xfer::Handle`] and
//! [`xfer::Notification`] (`xfer.Engine`, `xfer.Registration` and `xfer.EngineClosed` are
//! deprecated aliases kept by the package's `__init__.py`). What this crate adds is what
//! Python needs: the GIL released around every call that waits, buffers taken without
//! copies through the buffer protocol, `__cuda_array_interface__` or DLPack ([`memory`]),
//! CUDA stream order for GPU memory (`stream`), errors as a class hierarchy under
//! `xfer.Error` ([`errors`]), and `xfer.Directory`, `xfer.weights` ([`weights`]): layouts,
//! plans and the weight sync, and `xfer.kv` ([`kv`]): KV cache layouts, request plans and
//! ranks between prefill and decode. An agent's info (`Agent.info`) and a region's
//! descriptor are the library's metadata as bytes (`AgentInfo::to_bytes`,
//! `RegionDescriptor::to_bytes`).
//!
//! ```
//! // The byte forms are the library's, usable without Python:
//! use xfer::{Agent, AgentInfo, AgentOptions, TransportChoice, TransportKind};
//! let a = Agent::new(AgentOptions {
//!     transport: TransportChoice::Only(TransportKind::Mem),
//!     ..AgentOptions::default()
//! }).unwrap();
//! let bytes = a.info().to_bytes().unwrap(); // what `Agent.info` returns
//! assert_eq!(&AgentInfo::from_bytes(&bytes).unwrap(), a.info());
//! assert!(AgentInfo::from_bytes(&bytes[..5]).is_err());
//! ```
//!
//! Transports: those of the library (tcp, cuda-ipc, efa, mem); efa loads libfabric at run
//! time, so the wheel imports on machines without it, and `Agent(transport="efa")` there
//! fails with the loader's message.
//!
//! Dependencies: `pyo3` (the binding; `abi3-py311` because the buffer protocol is in the
//! stable ABI from Python 3.11, the version of Debian 12), the `xfer` crate (and
//! `fabric-core` for the types it re-exports), `gpu-mem` for CUDA device checks and stream
//! fences, and the workspace's `directory` crate for `xfer.Directory` (etcd or a file:
//! members find each other by name), `mimalloc` as the allocator of the extension's Rust
//! code (each transfer's plan and completion are allocated by the calling thread and freed
//! by a rail's worker, a hand-off that glibc's malloc pays for: a quarter of the rate of
//! 16-page transfers in `xfer-cli`'s measurement), built with `no_thp` like the
//! command's: the heap takes no transparent huge pages, the registered regions do.
#![warn(missing_docs)]

/// See the crate docs: transfers allocate on one thread and free on another.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub mod args;
mod directory;
mod engine;
pub mod errors;
mod handle;
pub mod kv;
pub mod memory;
pub mod options;
mod stream;
pub mod weights;

use pyo3::prelude::*;

/// The native module, re-exported by the `xfer` package.
#[pymodule]
fn _xfer(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::Engine>()?;
    m.add_class::<engine::Registration>()?;
    m.add_class::<engine::Peer>()?;
    m.add_class::<engine::Notification>()?;
    m.add_class::<engine::Server>()?;
    m.add_class::<handle::Handle>()?;
    m.add_class::<directory::Directory>()?;
    m.add_class::<directory::Publication>()?;
    m.add_class::<directory::Watch>()?;
    m.add_class::<directory::Following>()?;
    m.add_class::<weights::PyLayout>()?;
    m.add_class::<weights::PyPlan>()?;
    m.add_class::<weights::PySource>()?;
    m.add_class::<weights::PyDestination>()?;
    m.add_submodule(&kv::module(m.py())?)?;
    errors::add(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
