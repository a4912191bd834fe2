//! The static schedule of a weight sync ([`Plan`]): computed once from the layouts, replayed
//! every step.
//!
//! For every destination piece, the planner finds the source pieces that cover it and cuts
//! the common elements into byte runs. Runs are grouped per [`RegionPair`] (one source
//! rank's region to one destination rank's region), which is what one transfer of the
//! engine moves: `(src_offset, dst_offset, len)` segments between one local region and one
//! remote region. A [`Run`] is `count` rows of `len` bytes, row `i` at
//! `src_offset + i * src_stride` and `dst_offset + i * dst_stride`, so that a
//! tensor-parallel split along a column is one run per source piece instead of one per row.
//!
//! Where a tensor is replicated on several sources, each destination range is given to one
//! of them so that bytes per source stay balanced (see [`Plan::with_options`] for the rule
//! and its bound), and [`Plan::timing`] compares the busiest rank's time with a lower bound
//! that no plan for these layouts can beat ([`Bound`]).
//!
//! ```
//! use std::sync::Arc;
//! use xfer::weights::{Holding, Layout, Plan, TensorSpec, check};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let shape = vec![4u64, 6];
//! let t: Arc<[TensorSpec]> = Arc::from(vec![TensorSpec::new("w", shape.clone(), 2)]);
//! // Two FSDP sources (flat halves), two tensor-parallel destinations (column halves).
//! let src: Vec<Layout> = (0..2)
//!     .map(|i| Layout::pack(t.clone(), "s", [(0, Holding::flat_shard(24, 2, i))]))
//!     .collect::<Result<_, _>>()?;
//! let dst: Vec<Layout> = (0..2)
//!     .map(|i| Layout::pack(t.clone(), "d", [(0, Holding::split(&shape, 1, 2, i)?)]))
//!     .collect::<Result<_, _>>()?;
//! let plan = Plan::new(&src, &dst)?;
//! check(&src, &dst, &plan)?;
//! // Source 0 holds rows 0..2: two rows of 3 columns for each destination.
//! let p = &plan.pairs()[0];
//! assert_eq!((p.src.rank, p.dst.rank), (0, 0));
//! let segments: Vec<_> = p.segments().map(|s| (s.src_offset, s.dst_offset, s.len)).collect();
//! assert_eq!(segments, vec![(0, 0, 6), (12, 6, 6)]);
//! let t = plan.timing(400.0);
//! assert!(t.predicted_s <= 1.1 * t.bound_s);
//! # Ok(())
//! # }
//! ```

use super::layout::{ElementBox, Layout, LayoutError};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Which list of layouts a rank belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Side {
    /// The ranks that hold the weights (trainers).
    Source,
    /// The ranks that receive them (inference servers).
    Destination,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Destination => "destination",
        })
    }
}

/// A region of a rank: `region` indexes that rank's [`Layout::regions`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RankRegion {
    /// The rank (an index into the source or destination layouts).
    pub rank: u32,
    /// The region (an index into that rank's layout's regions).
    pub region: u32,
}

/// `count` rows of `len` bytes: row `i` goes from `src_offset + i * src_stride` of the
/// source region to `dst_offset + i * dst_stride` of the destination region. A contiguous
/// run has `count == 1` and strides 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Run {
    /// Byte offset of the first row in the source region.
    pub src_offset: u64,
    /// Byte offset of the first row in the destination region.
    pub dst_offset: u64,
    /// Bytes per row.
    pub len: u64,
    /// Number of rows (at least 1).
    pub count: u64,
    /// Bytes from one row to the next in the source region (0 when `count == 1`).
    pub src_stride: u64,
    /// Bytes from one row to the next in the destination region (0 when `count == 1`).
    pub dst_stride: u64,
}

impl Run {
    /// A contiguous run of `len` bytes.
    pub fn contiguous(src_offset: u64, dst_offset: u64, len: u64) -> Run {
        Run {
            src_offset,
            dst_offset,
            len,
            count: 1,
            src_stride: 0,
            dst_stride: 0,
        }
    }

    /// The bytes it moves (saturating).
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.count)
    }
}

/// One contiguous piece of a transfer: `len` bytes from `src_offset` of the source region
/// to `dst_offset` of the destination region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Segment {
    /// Byte offset in the source region.
    pub src_offset: u64,
    /// Byte offset in the destination region.
    pub dst_offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// The runs from one source rank's region to one destination rank's region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionPair {
    /// Where the bytes are read.
    pub src: RankRegion,
    /// Where they land.
    pub dst: RankRegion,
    /// The runs, in the planner's (deterministic) order.
    pub runs: Vec<Run>,
}

impl RegionPair {
    /// Every row of every run as a segment (the replay: no allocation). Offsets of a
    /// deserialised plan that overflow wrap; the engine refuses segments outside a region.
    pub fn segments(&self) -> Segments<'_> {
        Segments {
            runs: &self.runs,
            run: 0,
            row: 0,
        }
    }

    /// Appends the segments as `(local, remote, len)` for a push by the source
    /// (`xfer::Transfer::segments`, a WRITE from the source region into the destination's).
    pub fn write_segments(&self, out: &mut Vec<(u64, u64, u64)>) {
        out.extend(self.segments().map(|s| (s.src_offset, s.dst_offset, s.len)));
    }

    /// Appends the segments as `(local, remote, len)` for a pull by the destination (a
    /// READ of the source region into the destination's: `Transfer::segments(..).read()`).
    pub fn read_segments(&self, out: &mut Vec<(u64, u64, u64)>) {
        out.extend(self.segments().map(|s| (s.dst_offset, s.src_offset, s.len)));
    }

    /// The bytes it moves (saturating).
    pub fn bytes(&self) -> u64 {
        self.runs
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.bytes()))
    }

    /// The number of segments its runs expand to (saturating).
    pub fn segment_count(&self) -> u64 {
        self.runs
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.count))
    }
}

/// The rows of a [`RegionPair`]'s runs, in order ([`RegionPair::segments`]).
#[derive(Clone, Debug)]
pub struct Segments<'a> {
    runs: &'a [Run],
    run: usize,
    row: u64,
}

impl Iterator for Segments<'_> {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        loop {
            let r = self.runs.get(self.run)?;
            if self.row < r.count {
                let i = self.row;
                self.row += 1;
                return Some(Segment {
                    src_offset: r.src_offset.wrapping_add(i.wrapping_mul(r.src_stride)),
                    dst_offset: r.dst_offset.wrapping_add(i.wrapping_mul(r.dst_stride)),
                    len: r.len,
                });
            }
            self.run += 1;
            self.row = 0;
        }
    }
}

/// Options of the planner.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PlanOptions {
    /// Below this many bytes, a range that several sources hold goes whole to the least
    /// loaded one instead of being split among them (default 1 MiB). The balance bound is
    /// in terms of it: see [`Plan::with_options`].
    pub min_split_bytes: u64,
}

impl Default for PlanOptions {
    fn default() -> PlanOptions {
        PlanOptions {
            min_split_bytes: 1 << 20,
        }
    }
}

impl PlanOptions {
    /// Sets [`PlanOptions::min_split_bytes`].
    pub fn min_split_bytes(mut self, bytes: u64) -> PlanOptions {
        self.min_split_bytes = bytes;
        self
    }
}

/// A lower bound on the busiest rank's bytes that any plan for the layouts must reach, and
/// which term of it binds (see [`Bound`]'s fields and [`Plan::timing`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bound {
    /// Bytes the busiest rank must move at the least.
    pub bytes: u64,
    /// The term that gives it.
    pub limit: Limit,
}

/// The term of the lower bound that binds.
///
/// The bound is the largest of: every destination's bytes (it must receive them all);
/// for every set `H` of sources that holds some bytes nobody else has, those bytes over
/// `|H|` (the sources of `H` must send them between them; a single source's forced bytes
/// are the case `|H| = 1`); and all bytes over all sources.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Limit {
    /// Destination `rank` must receive this much.
    Destination {
        /// The destination.
        rank: u32,
    },
    /// These sources alone hold bytes that they must send between them.
    Sources {
        /// The sources.
        ranks: Vec<u32>,
    },
    /// All bytes spread evenly over all sources.
    AllSources,
}

/// The busiest rank of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Busiest {
    /// Source or destination.
    pub side: Side,
    /// Which one.
    pub rank: u32,
    /// The bytes it sends or receives.
    pub bytes: u64,
}

/// A plan's predicted transfer time and its lower bound, at one NIC rate per GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// The busiest rank's bytes over the rate, in seconds.
    pub predicted_s: f64,
    /// [`Bound::bytes`] over the rate, in seconds.
    pub bound_s: f64,
    /// The busiest rank.
    pub busiest: Busiest,
}

/// The static schedule of a weight sync (see the [module documentation](self)).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub(crate) sources: u32,
    pub(crate) destinations: u32,
    pub(crate) pairs: Vec<RegionPair>,
    pub(crate) bound: Bound,
}

impl Plan {
    /// Plans with the default [`PlanOptions`].
    pub fn new(sources: &[Layout], destinations: &[Layout]) -> Result<Plan, PlanError> {
        Plan::with_options(sources, destinations, &PlanOptions::default())
    }

    /// Plans moving every destination piece from the sources: `sources[i]` is source rank
    /// `i`, `destinations[j]` destination rank `j`. Tensors are matched by name; a tensor
    /// that no destination holds is not moved; a destination element that no source holds
    /// is [`PlanError::Uncovered`]. Deterministic: the same input gives the same plan.
    ///
    /// Where several sources hold an element, the choice is greedy: bytes only one source
    /// holds are counted first; then each range `X` several sources hold, for each
    /// destination that needs it, goes whole to the least loaded of its holders if it is at
    /// most [`PlanOptions::min_split_bytes`] (`q`), or if that holder stays within `q` of
    /// the second least loaded; otherwise it is water-filled: split (in elements) among the
    /// least loaded holders so that they end level. The bound: among sources that share
    /// ranges only with each other (a tensor replicated on `k` sources), none carries more
    /// than `ceil(total / k) + max(q, element size)` bytes, because a holder that receives a
    /// range was at most average before, and ends within `q` (whole) or one element
    /// (water-filled) of the average after.
    pub fn with_options(
        sources: &[Layout],
        destinations: &[Layout],
        options: &PlanOptions,
    ) -> Result<Plan, PlanError> {
        super::planner::plan(sources, destinations, options)
    }

    /// Plans one more destination, `layout`, against `sources` (the layouts this plan was
    /// made from, in rank order) without touching the pairs already planned: its pairs are
    /// added, it gets the next rank (returned), and the bound takes its bytes into account.
    ///
    /// Its pairs are exactly those of `Plan::new(sources, &[layout])` (ranked anew), so
    /// they depend on the sources and on it alone: processes that each hold a copy of a
    /// plan (every source of a push) compute the same pairs for a joiner whatever order
    /// they learn of joiners in. Where several sources hold a range it needs, the range is
    /// balanced over them by the joiner's own bytes, not by the loads the plan already puts
    /// on them (that would make the pairs depend on which joiners came first). The sum of
    /// two balanced loads is balanced, so a plan whose sources are balanced stays so.
    ///
    /// Fails with [`PlanError::SourceCount`] if `sources` is not as many layouts as the
    /// plan's sources, and as [`Plan::new`] fails for a layout that cannot be planned
    /// (errors name the new rank).
    pub fn add_destination(
        &mut self,
        sources: &[Layout],
        layout: &Layout,
    ) -> Result<u32, PlanError> {
        let rank = self.destinations;
        if sources.len() != self.sources as usize {
            return Err(PlanError::SourceCount {
                plan: self.sources,
                layouts: sources.len(),
            });
        }
        let pairs = Plan::destination_pairs(sources, layout, rank)?;
        let next = rank.checked_add(1).ok_or(PlanError::TooManyRanks {
            side: Side::Destination,
            count: rank as usize + 1,
        })?;
        let bytes = pairs.iter().fold(0u64, |a, p| a.saturating_add(p.bytes()));
        self.pairs.extend(pairs);
        // Stable: the pairs already planned keep their order, the new rank's go last in
        // each source's block.
        self.pairs.sort_by_key(|p| (p.src, p.dst));
        self.destinations = next;
        // Every term of the old bound still holds with more work to do; the joiner must
        // receive its own bytes.
        if bytes > self.bound.bytes {
            self.bound = Bound {
                bytes,
                limit: Limit::Destination { rank },
            };
        }
        Ok(rank)
    }

    /// The pairs that [`Plan::add_destination`] would add for `layout` at `rank`: those of
    /// `Plan::new(sources, &[layout])`, with the destination rank set to `rank`.
    pub fn destination_pairs(
        sources: &[Layout],
        layout: &Layout,
        rank: u32,
    ) -> Result<Vec<RegionPair>, PlanError> {
        let one = Plan::new(sources, std::slice::from_ref(layout)).map_err(|e| match e {
            PlanError::Uncovered {
                tensor, elements, ..
            } => PlanError::Uncovered {
                tensor,
                dst_rank: rank,
                elements,
            },
            PlanError::Layout {
                side: Side::Destination,
                source,
                ..
            } => PlanError::Layout {
                side: Side::Destination,
                rank,
                source,
            },
            PlanError::TensorMismatch {
                tensor,
                side: Side::Destination,
                shape,
                elem_size,
                expected_shape,
                expected_elem_size,
                ..
            } => PlanError::TensorMismatch {
                tensor,
                side: Side::Destination,
                rank,
                shape,
                elem_size,
                expected_shape,
                expected_elem_size,
            },
            e => e,
        })?;
        let mut pairs = one.pairs;
        for p in &mut pairs {
            p.dst.rank = rank;
        }
        Ok(pairs)
    }

    /// Drops destination `rank` from the plan: its pairs go, the others stay as they are,
    /// and its rank is not given to anyone else (so that every other rank keeps meaning
    /// the same destination; [`check`](super::check()) then takes a layout with no pieces
    /// in its place). Returns whether it had pairs.
    pub fn remove_destination(&mut self, rank: u32) -> bool {
        let before = self.pairs.len();
        self.pairs.retain(|p| p.dst.rank != rank);
        self.pairs.len() != before
    }

    /// The runs, per region pair, sorted by source rank and region, then destination rank
    /// and region.
    pub fn pairs(&self) -> &[RegionPair] {
        &self.pairs
    }

    /// The runs, to edit (tools and tests: [`check`](super::check()) re-validates an edited
    /// plan; [`Plan::pairs_from`] expects the order kept).
    pub fn pairs_mut(&mut self) -> &mut Vec<RegionPair> {
        &mut self.pairs
    }

    /// The region pairs that source `rank` sends (what its agent pushes). Expects the pairs
    /// in [`Plan::pairs`]' order (a plan edited out of order gives some of them).
    pub fn pairs_from(&self, rank: u32) -> &[RegionPair] {
        let a = self.pairs.partition_point(|p| p.src.rank < rank);
        let b = self.pairs.partition_point(|p| p.src.rank <= rank);
        &self.pairs[a..b.max(a)]
    }

    /// The region pairs that destination `rank` receives (what its agent pulls).
    pub fn pairs_to(&self, rank: u32) -> impl Iterator<Item = &RegionPair> {
        self.pairs.iter().filter(move |p| p.dst.rank == rank)
    }

    /// The number of source ranks planned for.
    pub fn sources(&self) -> u32 {
        self.sources
    }

    /// The number of destination ranks planned for.
    pub fn destinations(&self) -> u32 {
        self.destinations
    }

    /// The number of runs.
    pub fn run_count(&self) -> usize {
        self.pairs.iter().map(|p| p.runs.len()).sum()
    }

    /// The number of segments the runs expand to (saturating).
    pub fn segment_count(&self) -> u64 {
        (self.pairs.iter()).fold(0u64, |a, p| a.saturating_add(p.segment_count()))
    }

    /// The bytes moved (saturating).
    pub fn bytes(&self) -> u64 {
        (self.pairs.iter()).fold(0u64, |a, p| a.saturating_add(p.bytes()))
    }

    /// Bytes each source sends.
    pub fn source_bytes(&self) -> Vec<u64> {
        let mut v = vec![0u64; self.sources as usize];
        for p in &self.pairs {
            if let Some(b) = v.get_mut(p.src.rank as usize) {
                *b = b.saturating_add(p.bytes());
            }
        }
        v
    }

    /// Bytes each destination receives.
    pub fn destination_bytes(&self) -> Vec<u64> {
        let mut v = vec![0u64; self.destinations as usize];
        for p in &self.pairs {
            if let Some(b) = v.get_mut(p.dst.rank as usize) {
                *b = b.saturating_add(p.bytes());
            }
        }
        v
    }

    /// The lower bound for the layouts this plan was made from.
    pub fn bound(&self) -> &Bound {
        &self.bound
    }

    /// The predicted time at `gbit_per_s` per GPU (every rank's NIC rate, in Gbit/s): the
    /// busiest source's or destination's bytes over the rate, assuming every rank sends or
    /// receives at its full rate at once and nothing else limits (switches, PCIe, the
    /// engine). Against it, [`Bound::bytes`] over the same rate.
    pub fn timing(&self, gbit_per_s: f64) -> Timing {
        let rate = gbit_per_s * 1e9 / 8.0;
        let mut busiest = Busiest {
            side: Side::Destination,
            rank: 0,
            bytes: 0,
        };
        for (side, loads) in [
            (Side::Source, self.source_bytes()),
            (Side::Destination, self.destination_bytes()),
        ] {
            for (rank, &bytes) in loads.iter().enumerate() {
                if bytes > busiest.bytes {
                    busiest = Busiest {
                        side,
                        rank: rank as u32,
                        bytes,
                    };
                }
            }
        }
        Timing {
            predicted_s: busiest.bytes as f64 / rate,
            bound_s: self.bound.bytes as f64 / rate,
            busiest,
        }
    }
}

/// Why a plan cannot be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A layout is invalid.
    #[error("{side} {rank}: invalid layout")]
    Layout {
        /// Which list.
        side: Side,
        /// Which rank.
        rank: u32,
        /// Why.
        #[source]
        source: LayoutError,
    },
    /// Two layouts disagree on a tensor's shape or element size.
    #[error(
        "tensor {tensor}: {side} {rank} says shape {shape:?} of {elem_size}-byte elements, \
         an earlier layout {expected_shape:?} of {expected_elem_size}"
    )]
    TensorMismatch {
        /// The tensor.
        tensor: String,
        /// The layout that disagrees.
        side: Side,
        /// Its rank.
        rank: u32,
        /// Its shape.
        shape: Vec<u64>,
        /// Its element size.
        elem_size: u32,
        /// The shape seen first.
        expected_shape: Vec<u64>,
        /// The element size seen first.
        expected_elem_size: u32,
    },
    /// A destination needs elements that no source holds.
    #[error(
        "tensor {tensor}: no source holds elements {elements} that destination {dst_rank} needs"
    )]
    Uncovered {
        /// The tensor.
        tensor: String,
        /// A destination that needs them.
        dst_rank: u32,
        /// Elements nobody holds (one box of them).
        elements: ElementBox,
    },
    /// More than `u32::MAX` ranks.
    #[error("{count} {side} layouts: at most u32::MAX")]
    TooManyRanks {
        /// Which list.
        side: Side,
        /// How many.
        count: usize,
    },
    /// A layout with more than `u32::MAX` pieces.
    #[error("{side} {rank}: more than u32::MAX pieces")]
    TooManyPieces {
        /// Which list.
        side: Side,
        /// Which rank.
        rank: u32,
    },
    /// More than `u32::MAX` distinct tensors.
    #[error("more than u32::MAX distinct tensors")]
    TooManyTensors,
    /// [`Plan::add_destination`] was given another number of source layouts than the plan
    /// has sources.
    #[error("the plan has {plan} sources, but {layouts} source layouts were given")]
    SourceCount {
        /// The plan's sources.
        plan: u32,
        /// The layouts given.
        layouts: usize,
    },
}
