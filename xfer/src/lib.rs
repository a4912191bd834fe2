//! # xfer
//!
//! Move non-contiguous memory (GPU or host) from one machine into another's at line rate,
//! as one-sided RDMA-style WRITEs and READs: KV-cache pages from prefill to decode, model
//! weights from trainers to inference servers, any list of scattered segments.
//!
//! An [`Agent`] is the one object a program holds. It is built from [`AgentOptions`]
//! (defaults: every transport that can work here, NICs from the placement plan, workers
//! pinned near their GPU), registers memory ([`Agent::register`]) and gets back a
//! [`Region`] whose [`RegionDescriptor`] peers use, says who it is in an [`AgentInfo`],
//! connects to peers ([`Agent::connect`], over the best transport both offer: cuda-ipc
//! between GPUs of one host, efa on EFA NICs, tcp otherwise) and moves data
//! ([`Agent::submit`]); the receiver learns that a WRITE has landed from its immediate
//! value ([`Agent::wait_imm`]).
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use xfer::{Access, Agent, AgentOptions, HostBuffer, Transfer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (a, b) = (Agent::new(AgentOptions::default())?, Agent::new(AgentOptions::default())?);
//! let src = HostBuffer::new_shared(1 << 20)?;
//! src.fill(0, 1 << 20, 7)?;
//! let dst = HostBuffer::new_shared(1 << 20)?;
//! let s = a.register(src, Access::NONE)?;
//! let d = b.register(dst.clone(), Access::REMOTE_WRITE)?;
//! // b.info() and d.descriptor() travel to `a` by any channel (serde, or to_bytes()).
//! let peer = a.connect(b.info())?;
//! let pages = Transfer::pages(&[3, 9], 4096, &[0, 1], 4096, 4096)?.imm(42);
//! a.submit(&peer, &s, d.descriptor(), pages)?.wait(Duration::from_secs(10))?;
//! b.wait_imm(42, 1, Duration::from_secs(10))?;
//! assert_eq!(dst.to_vec(0, 8192)?, vec![7; 8192]);
//! # Ok(())
//! # }
//! ```
//!
//! Peers find each other by name through the cluster directory (etcd, or a file):
//! [`Agent::publish`] puts an agent and the regions it [offers](Agent::offer) in a cluster,
//! [`Agent::lookup`] finds a member, and [`Agent::follow`] keeps every member connected as
//! it joins and disconnected as it leaves; see [`discovery`].
//!
//! The layers below, for what this crate does not wrap, are under [`layers`]: how an agent
//! builds its transports (lanes, NICs, placement) and, through
//! [`AgentLayers`](layers::AgentLayers), an agent's rail groups; then the crates
//! `fabric-core` (the transfer engine, the `Transport` trait, the metadata format), the
//! backends (`transport-tcp`, `transport-efa`, `transport-cuda-ipc`) and `directory` (the
//! cluster directory's backends and records).
//!
//! Dependencies: the workspace's crates; `serde`, `serde_json` and `thiserror` as
//! everywhere; `tracing` for logs; `if-addrs` lists network interfaces and their addresses
//! for NIC choice (getifaddrs, with no unsafe code of ours); `mio` (the maintained event
//! loop under tokio: epoll, so thousands of pending connections cost one wait) runs the
//! rendezvous server's unauthenticated phase; `hex` spells authentication tags; `libc`
//! raises the open-file limit of a server; `rustc-hash` (the compiler's fast, deterministic
//! hash) keys the weight-sync planner's maps; `prometheus-client` (the Prometheus
//! project's own Rust client) writes the [`metrics`] exposition.
//!
//! What the receiver learns: each WRITE with immediate data ([`Transfer::imm`]) is counted
//! where it lands, per sender and value, and never dropped however late the application
//! looks. [`Agent::wait_imm`] (a value and a count), [`Agent::next_notification`],
//! [`Agent::try_notification`] and [`Agent::notifications`] take from those counts and
//! can be mixed; a [`Notification`] names its sender where the agent knows it
//! ([`Agent::connect`], [`Agent::know`]).
//!
//! Handles belong to their agent: another agent's [`Peer`], [`Region`] or [`Prepared`]
//! is refused ([`ErrorKind::ForeignHandle`]). Every call fails with this crate's
//! [`Error`], whose [`kind`](Error::kind) a program matches on. A transfer can be
//! cancelled ([`Handle::cancel`]); one moved again and again (the same pages every step)
//! is planned once ([`Agent::prepare`]) and posted many times ([`Agent::post`]).
//! GPU memory comes from [`cuda`]; `docs/api.md` lists the whole surface.
//!
//! Many small transfers: the same pages moved again and again (a KV block table, a weight
//! shard, every step) are best [prepared](Agent::prepare) once and [posted](Agent::post):
//! a post plans nothing and allocates no plan. Each [`submit`](Agent::submit) plans anew,
//! and its plan is allocated by the thread that submits and freed by a rail's worker, a
//! hand-off between threads that glibc's malloc pays for (a quarter of the rate of 16-page
//! transfers on the H200). A program that submits many distinct transfers should run on an
//! allocator built for it; the `xfer` command and the Python package use `mimalloc`:
//!
//! ```text
//! #[global_allocator]
//! static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
//! ```
//!
//! Weight sync ([`weights`]): layouts of what each trainer and inference rank holds, the
//! static plan of byte runs between them, its checker, and its execution over agents
//! ([`weights::exec`]: pushes signalled per destination with immediate data, pulls, a
//! failed destination failing alone, membership through the directory).
#![warn(missing_docs)]

mod agent;
pub mod cuda;
pub mod discovery;
mod error;
mod handle;
pub mod kv;
pub mod layers;
pub mod metrics;
mod options;
pub mod rendezvous;
pub mod weights;

pub use agent::{
    Agent, AgentStats, Notification, Peer, Prepared, Region, Transfer, release_kept, resolve,
    resolve_reason,
};
pub use error::{Error, ErrorKind, OptionName, Result};
pub use fabric_core::engine::MAX_MESSAGE;
pub use layers::nics::Nics;
pub use layers::placement::PinMode;
pub use options::{
    AgentOptions, AuthTokenError, BalanceOptions, CudaIpcOptions, DEFAULT_MESSAGES, EfaOptions,
    MAX_RAILS, MemoryKind, Role, TcpOptions, TransportChoice, WorkerOptions, read_token_file,
};
pub use transport_tcp::{Congestion, CongestionError};

pub use fabric_core::engine::TransferStats;
pub use fabric_core::metadata::{AgentInfo, RegionDescriptor, TransportInfo, TransportKind};
pub use fabric_core::plan::StridedRun;
pub use fabric_core::{Access, Fence, HostBuffer, MemoryError, MemoryLocation, MemoryRegion};
pub use handle::Handle;

// Short paths to the layers, for this crate's own modules.
pub(crate) use layers::{lanes, nics, placement};
