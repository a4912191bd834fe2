//! Executing a weight-sync [`Plan`](crate::weights::Plan) over agents: sources push with
//! WRITEs ([`Source`]), destinations learn that an update landed from immediate data
//! ([`Destination::wait`]) or pull their share with READs ([`Destination::pull`]).
//!
//! **Push.** Each source writes its pairs to every destination as one-sided WRITEs, cut
//! into chunks (at most [`SyncOptions::chunk_bytes`] and [`SyncOptions::chunk_segments`]
//! each) that are submitted while fewer than [`SyncOptions::max_inflight_bytes`] and
//! [`SyncOptions::max_inflight_transfers`] are in flight, destinations taking turns chunk by
//! chunk; segment lists are built only for chunks about to go, so a source holds the
//! memory of what is in flight and no more. Once every chunk for destination `d` has
//! completed, the source sends `d` one zero-length WRITE carrying the immediate value
//! [`signal_imm`]`(version, source, sources)`: the engine delivers it only after its
//! transfer, itself after the chunks, so `d` never polls its memory. Every source signals
//! every destination it pushes to, even one it sends no byte (so that a destination needs
//! to know only how many sources there are), and a destination's update has landed once it
//! has heard each source's value for that version ([`Destination::wait`]). The source
//! is part of the value so that a redone update cannot be confused with what a failed one
//! left behind: a destination that heard source 0 but not source 1 before the failure waits
//! for source 1 again, not for any second value.
//!
//! **Failures.** A destination that dies (or stops answering) mid-push fails its own
//! result in the [`PushReport`] with a [`SyncError`] naming it (the transfer's error:
//! unreachable, removed, timed out); its chunks stop, the other destinations' go on and
//! complete. [`Source::push_to`] then redoes that destination alone, once it is back
//! (attached again: a restarted process has new regions).
//!
//! **Pull.** A destination reads its share from the sources' regions (registered with
//! [`Access::REMOTE_READ`](crate::Access::REMOTE_READ)), planned by itself against the
//! sources' layouts: the sources' code does nothing. Each source's record region says which
//! version its memory holds (set by [`Source::push`], made "changing" by
//! [`Source::begin_update`] before the trainer writes its weights); a pull reads those
//! words before and after the weights and retries while they differ, as a sequence lock.
//!
//! **Membership.** Ranks are agents found by name in the cluster directory
//! ([`Agent::follow`](crate::Agent::follow)): each offers its layout's regions under their
//! names and its [`RankRecord`] (side, rank, layout) in a region of its own
//! ([`RECORD_REGION`], see [`record`](mod@record): the directory's records hold agents and
//! region descriptors only). [`Source::refresh`] attaches the destinations that joined,
//! plans in those that were not in the plan ([`Plan::add_destination`](crate::weights::Plan::add_destination):
//! the others' pairs stay as they are) and drops those that left;
//! [`Destination::refresh`] attaches the sources for a pull.
//!
//! **Preparing tensors.** [`Source::push_with`] calls a hook once per piece of the
//! source's layout, just before the first chunk that reads it is submitted, and the chunks
//! that read it wait for the [`Fence`](crate::Fence) it returns: where a dtype conversion or
//! an FSDP gather would write the piece into the registered region (the caller's code), so
//! that preparing later tensors overlaps sending earlier ones.
//!
//! **Timeline.** At trace level the target `xfer::weights::timeline` logs each chunk a push
//! submits (`chunk`: destination lane, bytes, runs) and each that lands (`landed`); with the
//! cuda-ipc transport's own timeline (`transport_cuda_ipc::timeline`) a subscriber with
//! timestamps shows where a push's time goes.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use xfer::weights::exec::{Destination, Source};
//! use xfer::weights::{Holding, Layout, Plan, TensorSpec};
//! use xfer::{Access, Agent, AgentOptions, HostBuffer, TransportChoice, TransportKind};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mem = || Agent::new(AgentOptions {
//!     transport: TransportChoice::Only(TransportKind::Mem),
//!     ..AgentOptions::default()
//! });
//! // A 4 x 6 tensor of 2-byte elements: two sources hold row halves, one destination all.
//! let shape = vec![4u64, 6];
//! let t: Arc<[TensorSpec]> = Arc::from(vec![TensorSpec::new("w", shape.clone(), 2)]);
//! let src: Vec<Layout> = (0..2)
//!     .map(|i| Layout::pack(t.clone(), "w", [(0, Holding::split(&shape, 0, 2, i)?)]))
//!     .collect::<Result<_, _>>()?;
//! let dst = vec![Layout::pack(t, "w", [(0, Holding::whole(&shape))])?];
//! let plan = Plan::new(&src, &dst)?;
//!
//! let d = mem()?;
//! let out = HostBuffer::new_shared(48)?;
//! let region = d.register(out.clone(), Access::REMOTE_WRITE | Access::LOCAL_WRITE)?;
//! let receiver = Destination::new(&d, dst[0].clone(), vec![region.clone()], 2, Some(0))?;
//!
//! let mut senders = Vec::new();
//! for (rank, layout) in src.iter().enumerate() {
//!     let a = mem()?;
//!     let buf = HostBuffer::new_shared(24)?;
//!     buf.fill(0, 24, rank as u8 + 1)?;
//!     let r = a.register(buf, Access::REMOTE_READ)?;
//!     let mut s = Source::new(&a, &plan, rank as u32, layout.clone(), vec![r])?;
//!     s.attach(0, a.connect(d.info())?, vec![region.descriptor().clone()])?;
//!     senders.push(s);
//! }
//! for s in &senders {
//!     let report = s.push(7)?;
//!     assert!(report.is_ok(), "{report:?}");
//! }
//! receiver.wait(7, Duration::from_secs(10))?;
//! assert_eq!(out.to_vec(0, 48)?, [vec![1; 24], vec![2; 24]].concat());
//! # Ok(())
//! # }
//! ```

mod destination;
mod members;
mod pipeline;
pub mod record;
mod source;

pub use destination::{Destination, PullReport, SourceInfo};
pub use members::Changes;
pub use record::{RECORD_REGION, RankRecord, SourceState, read_record};
pub use source::{PieceToSend, PrepareResult, PushReport, PushStats, Source};

use crate::weights::{LayoutError, PlanError, Side};
use fabric_core::OpError;
use fabric_core::engine::WARM_UP_IMM;
use std::sync::Arc;
use std::time::Duration;

/// How a push or a pull is cut into transfers and how many may be in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SyncOptions {
    /// Bytes per transfer, at most (default 64 MiB): a longer row is cut. Every transfer
    /// costs a fixed round of work on both sides (tens of microseconds over cuda-ipc), so
    /// small chunks cap the rate: on an H200 over cuda-ipc, 1 MiB chunks synced 0.87 Tbps, 8 MiB
    /// 3.2 Tbps and 64 MiB 6.3 Tbps, against 8.1-8.7 Tbps for a paged write of the same bytes.
    pub chunk_bytes: u64,
    /// Entries per transfer, at most (default 16 384): what one transfer's list holds. The
    /// rows of a strided piece that fit in a transfer are one entry (a
    /// [`StridedRun`](crate::StridedRun)); a backend without strided writes moves them as
    /// a segment each.
    pub chunk_segments: usize,
    /// No transfer starts while this many bytes are in flight (default 1 GiB: 16 chunks).
    pub max_inflight_bytes: u64,
    /// Transfers in flight, at most (default 64).
    pub max_inflight_transfers: usize,
    /// Each transfer fails with `TimedOut` if not done in this time (default 60 s): what a
    /// destination that stops answering without breaking its connection costs the others'
    /// push at most.
    pub transfer_timeout: Duration,
    /// How long a pull waits between two looks at sources whose memory is changing, or
    /// does not hold the version asked for (default 20 ms).
    pub pull_retry: Duration,
}

impl Default for SyncOptions {
    fn default() -> SyncOptions {
        SyncOptions {
            chunk_bytes: 64 << 20,
            chunk_segments: 16 << 10,
            max_inflight_bytes: 1 << 30,
            max_inflight_transfers: 64,
            transfer_timeout: Duration::from_secs(60),
            pull_retry: Duration::from_millis(20),
        }
    }
}

impl SyncOptions {
    /// Sets [`SyncOptions::chunk_bytes`].
    pub fn chunk_bytes(mut self, bytes: u64) -> SyncOptions {
        self.chunk_bytes = bytes;
        self
    }

    /// Sets [`SyncOptions::chunk_segments`].
    pub fn chunk_segments(mut self, segments: usize) -> SyncOptions {
        self.chunk_segments = segments;
        self
    }

    /// Sets [`SyncOptions::max_inflight_bytes`].
    pub fn max_inflight_bytes(mut self, bytes: u64) -> SyncOptions {
        self.max_inflight_bytes = bytes;
        self
    }

    /// Sets [`SyncOptions::max_inflight_transfers`].
    pub fn max_inflight_transfers(mut self, transfers: usize) -> SyncOptions {
        self.max_inflight_transfers = transfers;
        self
    }

    /// Sets [`SyncOptions::transfer_timeout`].
    pub fn transfer_timeout(mut self, t: Duration) -> SyncOptions {
        self.transfer_timeout = t;
        self
    }

    /// Sets [`SyncOptions::pull_retry`].
    pub fn pull_retry(mut self, t: Duration) -> SyncOptions {
        self.pull_retry = t;
        self
    }

    pub(crate) fn limits(&self) -> pipeline::Limits {
        pipeline::Limits {
            chunk_bytes: self.chunk_bytes,
            chunk_segments: self.chunk_segments,
            max_bytes: self.max_inflight_bytes,
            max_transfers: self.max_inflight_transfers,
        }
    }
}

/// Bits of an immediate value that name the source, for `sources` sources.
fn source_bits(sources: u32) -> u32 {
    32 - sources.saturating_sub(1).leading_zeros()
}

/// The largest version a sync of `sources` sources can signal: the value's low bits name
/// the source ([`signal_imm`]), and the engine keeps `u32::MAX` for its warm-up writes. For
/// one source, `u32::MAX - 1`; for 2, `2^31 - 2`; for 256, `2^24 - 2`.
pub fn max_version(sources: u32) -> u32 {
    let bits = source_bits(sources);
    ((1u64 << (32 - bits)).saturating_sub(2)) as u32
}

/// The immediate value with which source `source` of `sources` tells a destination that
/// its part of update `version` has landed: `version` in the high bits, `source` in the
/// `ceil(log2(sources))` low ones. Refuses a version above [`max_version`] (the value
/// would not fit, or would be the engine's warm-up value) and a source out of range.
pub fn signal_imm(version: u32, source: u32, sources: u32) -> Result<u32, SyncError> {
    let max = max_version(sources);
    if version > max || source >= sources {
        return Err(SyncError::Version {
            version,
            rank: source,
            sources,
            max,
        });
    }
    let imm = (u64::from(version) << source_bits(sources)) | u64::from(source);
    match u32::try_from(imm) {
        Ok(v) if v != WARM_UP_IMM => Ok(v),
        _ => Err(SyncError::Version {
            version,
            rank: source,
            sources,
            max,
        }),
    }
}

/// Who a failure concerns, for messages: "destination 3 (name)", "source 1 (name)",
/// "peer name".
fn who(side: &Option<Side>, rank: &Option<u32>, peer: &str) -> String {
    match (side, rank) {
        (Some(s), Some(r)) => format!("{s} {r} ({peer})"),
        (Some(s), None) => format!("{s} {peer}"),
        _ => format!("peer {peer}"),
    }
}

/// Why a weight-sync call failed, or why one destination's (or source's) part did.
/// Converts into [`crate::Error`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SyncError {
    /// The version cannot be signalled with this many sources (see [`signal_imm`]).
    #[error(
        "version {version} from source {rank} cannot be signalled: a sync of {sources} \
         sources signals versions 0..={max}"
    )]
    Version {
        /// The version asked for.
        version: u32,
        /// The source.
        rank: u32,
        /// The number of sources.
        sources: u32,
        /// The largest version that can be signalled.
        max: u32,
    },
    /// A rank that the plan (or this sync) does not have.
    #[error("{side} {rank} is not part of this sync")]
    NoSuchRank {
        /// Which list.
        side: Side,
        /// The rank.
        rank: u32,
    },
    /// A rank of the sync that is not attached (no peer and regions given for it yet, or it
    /// was detached).
    #[error("{side} {rank} is not attached")]
    NotAttached {
        /// Which list.
        side: Side,
        /// The rank.
        rank: u32,
    },
    /// Not as many regions as the layout has.
    #[error("{given} regions given for a layout of {want}")]
    RegionCount {
        /// Regions given.
        given: usize,
        /// Regions of the layout.
        want: usize,
    },
    /// A region (local, or a peer's descriptor) is shorter than the layout or the plan
    /// needs.
    #[error("{side} {rank:?}: region {region} is {have} bytes, {need} are needed")]
    RegionTooShort {
        /// Whose region.
        side: Side,
        /// Its rank, if it has one here.
        rank: Option<u32>,
        /// The region (an index into that rank's layout's regions).
        region: u32,
        /// The bytes needed.
        need: u64,
        /// Its length.
        have: u64,
    },
    /// A transfer to or from a peer failed: it is unreachable or its connection broke, it
    /// was removed (left the cluster), the transfer timed out, or the peer refused it (the
    /// engine's error says which).
    #[error("{}: a transfer failed", who(side, rank, peer))]
    Transfer {
        /// The peer's side.
        side: Option<Side>,
        /// The peer's rank.
        rank: Option<u32>,
        /// The peer's name.
        peer: String,
        /// The engine's error.
        #[source]
        source: OpError,
    },
    /// A transfer to or from a peer could not be submitted (its region is not on the
    /// transport it is reached by, a segment outside a region).
    #[error("{}: a transfer could not be submitted", who(side, rank, peer))]
    Submit {
        /// The peer's side.
        side: Option<Side>,
        /// The peer's rank.
        rank: Option<u32>,
        /// The peer's name.
        peer: String,
        /// Why.
        #[source]
        source: Box<crate::Error>,
    },
    /// The prepare hook of [`Source::push_with`] failed for a piece: every destination
    /// that needs the piece fails with this.
    #[error("preparing piece {piece} (tensor {tensor}) failed")]
    Prepare {
        /// The piece (an index into the source's layout's pieces).
        piece: usize,
        /// Its tensor.
        tensor: String,
        /// The hook's error.
        #[source]
        source: Arc<dyn std::error::Error + Send + Sync>,
    },
    /// A version did not land in time: these sources have not signalled it.
    #[error(
        "version {version} has not landed after {waited:?}: no signal from sources {missing:?}"
    )]
    NotLanded {
        /// The version.
        version: u32,
        /// How long it was waited for.
        waited: Duration,
        /// The sources not heard from.
        missing: Vec<u32>,
    },
    /// The sources do not hold one version at rest (or not the one asked for): per source,
    /// the version held at rest, `None` while its memory changes.
    #[error("the sources do not hold {} at rest: {states:?}", want.map_or("one version".to_owned(), |v| format!("version {v}")))]
    Unsettled {
        /// The version asked for, if one was.
        want: Option<u32>,
        /// `(source rank, version at rest)`.
        states: Vec<(u32, Option<u32>)>,
    },
    /// A source's memory changed while a pull read it.
    #[error("source {rank}'s weights changed while they were read")]
    Torn {
        /// The source.
        rank: u32,
    },
    /// A peer's record (its side, rank and layout, see [`record`](mod@record)) is missing or
    /// malformed.
    #[error("{peer}'s weight-sync record: {reason}")]
    Record {
        /// The peer.
        peer: String,
        /// What is wrong.
        reason: String,
    },
    /// A layout given is invalid.
    #[error("invalid layout")]
    Layout(#[from] LayoutError),
    /// A destination cannot be planned in.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The agent (registration, memory, CUDA) failed.
    #[error(transparent)]
    Agent(Box<crate::Error>),
}

impl SyncError {
    pub(crate) fn agent(e: crate::Error) -> SyncError {
        SyncError::Agent(Box::new(e))
    }

    pub(crate) fn memory(e: fabric_core::MemoryError) -> SyncError {
        SyncError::agent(e.into())
    }

    pub(crate) fn submit(
        side: Side,
        rank: Option<u32>,
        peer: &crate::Peer,
        e: crate::Error,
    ) -> SyncError {
        SyncError::Submit {
            side: Some(side),
            rank,
            peer: peer.info().name.clone(),
            source: Box::new(e),
        }
    }

    /// The rank this error is about, where it names one (the destination of a failed push
    /// part, the source of a failed pull).
    pub fn rank(&self) -> Option<u32> {
        match self {
            SyncError::Transfer { rank, .. } | SyncError::Submit { rank, .. } => *rank,
            SyncError::NoSuchRank { rank, .. }
            | SyncError::NotAttached { rank, .. }
            | SyncError::Torn { rank } => Some(*rank),
            SyncError::RegionTooShort { rank, .. } => *rank,
            _ => None,
        }
    }

    /// Keeps in `first` the first cause of a peer's failure, given a transfer's own failure
    /// `e`: it replaces a submit that could not connect to the peer again
    /// ([`Error::Reconnect`](crate::Error::Reconnect)), which only follows from it (a
    /// broken connection is marked when the failure is, and the next submit may try to
    /// connect again before the failure is read).
    pub(crate) fn keep_cause(first: &mut Option<SyncError>, e: SyncError) {
        let reconnect = matches!(first, Some(SyncError::Submit { source, .. })
            if matches!(**source, crate::Error::Reconnect { .. }));
        if first.is_none() || reconnect {
            *first = Some(e);
        }
    }

    /// The engine's error of a failed transfer (peer unreachable, removed, timed out...).
    pub fn op_error(&self) -> Option<&OpError> {
        match self {
            SyncError::Transfer { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// `(max end of the source side, max end of the destination side)` of a pair's runs, or
/// `None` where an offset overflows.
pub(crate) fn pair_extent(p: &crate::weights::RegionPair) -> Option<(u64, u64)> {
    let mut ends = (0u64, 0u64);
    for r in &p.runs {
        if r.count == 0 || r.len == 0 {
            continue;
        }
        let last = r.count - 1;
        let s = r
            .src_offset
            .checked_add(last.checked_mul(r.src_stride)?)?
            .checked_add(r.len)?;
        let d = r
            .dst_offset
            .checked_add(last.checked_mul(r.dst_stride)?)?
            .checked_add(r.len)?;
        ends = (ends.0.max(s), ends.1.max(d));
    }
    Some(ends)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_name_the_version_and_the_source_and_never_the_warm_up_value() {
        assert_eq!(max_version(1), u32::MAX - 1);
        assert_eq!(signal_imm(u32::MAX - 1, 0, 1).unwrap(), u32::MAX - 1);
        assert!(matches!(
            signal_imm(u32::MAX, 0, 1),
            Err(SyncError::Version { .. })
        ));
        assert_eq!(max_version(2), (1 << 31) - 2);
        assert_eq!(signal_imm(5, 1, 2).unwrap(), 11);
        assert_eq!(max_version(3), (1 << 30) - 2);
        assert_eq!(max_version(4), (1 << 30) - 2);
        assert_eq!(max_version(256), (1 << 24) - 2);
        assert_eq!(signal_imm(7, 255, 256).unwrap(), (7 << 8) | 255);
        assert!(signal_imm(7, 256, 256).is_err(), "a source out of range");
        // Every source of the largest version is below the warm-up value.
        for m in [1u32, 2, 3, 4, 5, 256, 1000] {
            for s in [0, m - 1] {
                assert_ne!(signal_imm(max_version(m), s, m).unwrap(), WARM_UP_IMM);
            }
        }
        // Distinct (version, source) give distinct values.
        let mut seen = std::collections::HashSet::new();
        for v in 0..50 {
            for s in 0..3 {
                assert!(seen.insert(signal_imm(v, s, 3).unwrap()));
            }
        }
    }
}
