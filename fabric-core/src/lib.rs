//! # fabric-core
//!
//! The centre of `xfer`: identifier and descriptor types, the memory layer's
//! [`MemoryRegion`] trait, the small [`Transport`] trait every backend implements,
//! transfer planning ([`plan`]) and the transfer [`engine`].
//!
//! This crate has no sockets, no FFI and no CUDA. Backends live in their own crates
//! (`transport-tcp`, `transport-efa`), and every backend runs the same conformance suite
//! (module `testing`, behind the cargo feature `testing`).
//!
//! ```
//! use fabric_core::{plan::{plan_transfer, Segment}, LocalKey, RemoteKey, RemoteRegion};
//! let remote = RemoteRegion { addr: 0, len: 1 << 20, key: RemoteKey(7) };
//! // Two pages adjacent on both sides merge into one write; a third stays apart.
//! let segs = [
//!     Segment { src: LocalKey(1), src_offset: 0, dst: remote, dst_offset: 4096, len: 4096 },
//!     Segment { src: LocalKey(1), src_offset: 4096, dst: remote, dst_offset: 8192, len: 4096 },
//!     Segment { src: LocalKey(1), src_offset: 65536, dst: remote, dst_offset: 0, len: 4096 },
//! ];
//! let plan = plan_transfer(&segs, 1 << 20).unwrap();
//! assert_eq!(plan.writes.len(), 2);
//! assert_eq!(plan.bytes, 3 * 4096);
//! ```
//!
//! Dependencies: `serde` (descriptors travel out of band), `thiserror` (the error enum),
//! `tracing` (logs), `crossbeam-channel` (the engine's command and event channels, with
//! timeouts and select), `getrandom` (unguessable remote keys), `rustc-hash` (FxHash for
//! the in-memory transport's small-integer keys, in place of a hasher written here),
//! `postcard` (the compact byte form of the [`metadata`]: a maintained serde format that
//! reads untrusted input without panicking and grows nothing beyond the input's size) and
//! `hex` (byte strings in the metadata's JSON form); `hmac` and `sha2` for [`auth`], the
//! challenge and response by which both ends of a connection prove a shared token (every
//! transport that has one uses it, so it lives here).
#![warn(missing_docs)]

pub mod auth;
pub mod engine;
pub mod error;
pub mod fence;
mod in_place;
pub mod mem;
pub mod memory;
pub mod metadata;
pub mod plan;
pub mod recv;
pub mod stats;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;
pub mod types;
pub mod wake;

pub use error::{DeviceError, Error, Invalid, MemoryError, OpError, Result, TransportError};
pub use fence::Fence;
pub use memory::{HostBuffer, MemoryLocation, MemoryRegion, SubRegion};
pub use transport::{Completion, OpKind, PostOutcome, Transport, TransportLimits};
pub use types::{
    Access, LocalKey, LocalSlice, PeerId, Registration, RemoteKey, RemoteRegion, RemoteSlice, Rows,
    WorkRequestId, check_read_lengths, check_write_lengths, random_u64,
};
