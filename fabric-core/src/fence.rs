//! [`Fence`]: work the application queued that a transfer must not overtake.
//!
//! GPU memory is written by kernels that run after the call that queued them has returned:
//! a KV-cache page computed by a kernel on a CUDA stream is not there yet when the
//! application calls `submit` right after launching it. A transfer that carries a fence
//! ([`Transfer::after`](crate::engine::Transfer::after)) is held by the engine until the
//! fence reports done, and only then does any transport read its sources (or, for a READ,
//! write its destinations). gpu-mem's `StreamFence` is the fence for CUDA streams (an event
//! recorded on the application's stream when the transfer is submitted); this crate knows no
//! CUDA and only asks the fence whether it is done.
//!
//! ```
//! use fabric_core::{Fence, MemoryError};
//! use std::sync::atomic::{AtomicBool, Ordering};
//!
//! /// Done once the application says so.
//! #[derive(Debug, Default)]
//! struct Flag(AtomicBool);
//!
//! impl Fence for Flag {
//!     fn is_done(&self) -> Result<bool, MemoryError> {
//!         Ok(self.0.load(Ordering::Acquire))
//!     }
//! }
//!
//! let f = Flag::default();
//! assert!(!f.is_done().unwrap());
//! f.0.store(true, Ordering::Release);
//! assert!(f.is_done().unwrap());
//! ```

use crate::error::MemoryError;

/// Work queued before a transfer (a kernel on a CUDA stream, a copy) that must finish before
/// any transport touches the transfer's local memory. See the [module docs](self).
pub trait Fence: Send + Sync + std::fmt::Debug + 'static {
    /// Whether the work has finished. Never blocks: the engine's worker asks again on each
    /// turn of its loop until it has. An error (a device fault) fails the transfer with
    /// it, and nothing of the transfer moves.
    fn is_done(&self) -> Result<bool, MemoryError>;
}
