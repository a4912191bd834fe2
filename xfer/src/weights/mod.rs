//! Weight sync: the static schedule that moves a model's weights from M source ranks
//! (trainers) into N destination ranks (inference servers), each laid out its own way.
//!
//! - [`Layout`] ([`layout`](mod@layout)): what a rank holds of each tensor (a box of the
//!   global index space, or a flat range of the row-major tensor) and at which byte offset
//!   of which of its registered regions;
//! - [`Plan`] ([`plan`](mod@plan)): for every destination piece, the source pieces that
//!   cover it, cut into byte [`Run`]s per (source region, destination region), balanced
//!   over sources where a tensor is replicated; computed once, serialisable, replayed every
//!   step as `(src_offset, dst_offset, len)` segments ([`RegionPair::segments`]);
//! - [`check()`] ([`check`](mod@check)): an independent proof that a plan writes every
//!   destination byte exactly once, from the same element of the same tensor;
//! - [`Plan::timing`]: the busiest rank's bytes over a per-GPU NIC rate, against a lower
//!   bound for the layouts ([`Bound`]).
//!
//! - [`exec`](mod@exec): executing a plan over [`Agent`](crate::Agent)s: sources push with
//!   WRITEs pipelined in chunks, every destination learning from immediate data that its
//!   update landed, or destinations pull with READs; a failed destination fails alone;
//!   membership through the cluster directory.
//!
//! Planning and checking are pure logic: no agent, no I/O. Errors are typed
//! ([`LayoutError`], [`PlanError`], [`CheckError`], [`SyncError`]) and convert into
//! [`crate::Error`].
//!
//! ```
//! use std::sync::Arc;
//! use xfer::weights::{Holding, Layout, Plan, TensorSpec, check};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // An embedding of 6 rows of 4, BF16: trainers hold FSDP flat shards of it (cut mid-row),
//! // the inference ranks a vocab-parallel half each.
//! let shape = vec![6u64, 4];
//! let t: Arc<[TensorSpec]> = Arc::from(vec![TensorSpec::new("embed", shape.clone(), 2)]);
//! let trainers = (0..3)
//!     .map(|i| Layout::pack(t.clone(), "params", [(0, Holding::flat_shard(24, 3, i))]))
//!     .collect::<Result<Vec<_>, _>>()?;
//! let servers = (0..2)
//!     .map(|i| Layout::pack(t.clone(), "weights", [(0, Holding::split(&shape, 0, 2, i)?)]))
//!     .collect::<Result<Vec<_>, _>>()?;
//! let plan = Plan::new(&trainers, &servers)?;
//! assert_eq!(check(&trainers, &servers, &plan)?.bytes, 48);
//! // Replay: source 1 holds elements 8..16 (rows 2 and 3): row 2 goes to server 0, at
//! // its byte 16; row 3 to server 1, at its byte 0.
//! let sent: Vec<_> = plan
//!     .pairs_from(1)
//!     .iter()
//!     .map(|pair| {
//!         let mut segments = Vec::new();
//!         pair.write_segments(&mut segments); // (local, remote, len): Transfer::segments
//!         (pair.dst.rank, segments)
//!     })
//!     .collect();
//! assert_eq!(sent, vec![(0, vec![(0, 16, 8)]), (1, vec![(8, 0, 8)])]);
//! # Ok(())
//! # }
//! ```

pub mod check;
pub mod exec;
mod geometry;
mod inputs;
pub mod layout;
pub mod plan;
mod planner;
mod runs;

pub use check::{CheckError, CheckReport, check};
pub use exec::{Destination, Source, SyncError, SyncOptions};
pub use layout::{
    ElementBox, Holding, Layout, LayoutError, MAX_DIMS, Piece, RegionSpec, TensorSpec,
};
pub use plan::{
    Bound, Busiest, Limit, Plan, PlanError, PlanOptions, RankRegion, RegionPair, Run, Segment,
    Segments, Side, Timing,
};
