//! [`Source`]: a source rank's side of a weight sync (pushes, and what pulls read).

use super::pipeline::{Chunk, LaneState, Pipeline, Step, Way};
use super::record::{OwnRecord, RankRecord};
use super::{SyncError, SyncOptions, pair_extent, signal_imm};
use crate::agent::{Agent, Peer, Region};
use crate::weights::{Layout, Piece, Plan, RegionPair, Side, TensorSpec};
use fabric_core::engine::TransferResult;
use fabric_core::metadata::RegionDescriptor;
use fabric_core::{Fence, MemoryError, OpError};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A piece of the source's layout about to be sent, as [`Source::push_with`]'s hook
/// sees it.
#[derive(Clone, Copy, Debug)]
pub struct PieceToSend<'a> {
    /// Its index in the layout's pieces.
    pub index: usize,
    /// The piece: which elements of which tensor, at which offset of which region.
    pub piece: &'a Piece,
    /// Its tensor.
    pub tensor: &'a TensorSpec,
    /// The registered region it lies in.
    pub region: &'a Region,
}

/// What the prepare hook returns: `Some(fence)` when the piece's bytes are written by work
/// still running (a CUDA stream's kernels), which the chunks that read it wait for; `None`
/// when they are in place already; an error fails the destinations that need the piece.
pub type PrepareResult = Result<Option<Arc<dyn Fence>>, Box<dyn std::error::Error + Send + Sync>>;

/// What one destination's part of a push moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PushStats {
    /// Bytes written.
    pub bytes: u64,
    /// Transfers submitted (chunks and the signal).
    pub transfers: u64,
    /// Segments written.
    pub segments: u64,
    /// From the start of the push until the destination's signal completed.
    pub landed: Duration,
}

/// The outcome of a push, per destination: each succeeds or fails on its own.
#[derive(Debug)]
pub struct PushReport {
    /// The version pushed.
    pub version: u32,
    /// Per destination rank, what it got, or why its part failed (a [`SyncError`] naming
    /// it).
    pub destinations: BTreeMap<u32, Result<PushStats, SyncError>>,
    /// How long the push took.
    pub elapsed: Duration,
    /// Of `elapsed`, how long the pushing thread waited for transfers to complete; the rest
    /// it spent cutting chunks, submitting them and in the prepare hook. A push whose
    /// waiting is a small part of it is bound by that thread, not by the transport.
    pub waited: Duration,
}

impl PushReport {
    /// Whether every destination's part landed.
    pub fn is_ok(&self) -> bool {
        self.destinations.values().all(Result::is_ok)
    }

    /// The destinations whose part failed.
    pub fn failed(&self) -> Vec<u32> {
        (self.destinations.iter())
            .filter(|(_, r)| r.is_err())
            .map(|(&d, _)| d)
            .collect()
    }

    /// Bytes written to the destinations that succeeded.
    pub fn bytes(&self) -> u64 {
        (self.destinations.values())
            .filter_map(|r| r.as_ref().ok())
            .fold(0u64, |a, s| a.saturating_add(s.bytes))
    }

    /// The report if every destination's part landed, else the first failure.
    pub fn into_result(mut self) -> Result<PushReport, SyncError> {
        let bad = self
            .destinations
            .iter()
            .find(|(_, r)| r.is_err())
            .map(|(&d, _)| d);
        match bad.and_then(|d| self.destinations.remove(&d)) {
            Some(Err(e)) => Err(e),
            _ => Ok(self),
        }
    }
}

/// A destination as a source knows it: its pairs from this source, and how to reach it.
pub(super) struct Dest {
    pub pairs: Vec<RegionPair>,
    pub link: Option<Link>,
    /// Its name in the cluster, when attached from the directory.
    pub member: Option<MemberId>,
    /// Whether it was planned in after the plan was made.
    pub joined: bool,
}

/// A directory member: its name and the instance it was attached as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct MemberId {
    pub name: String,
    pub instance: u64,
}

/// A peer and its regions by its layout's region index.
pub(super) struct Link {
    pub peer: Peer,
    pub regions: Vec<RegionDescriptor>,
}

/// Where a piece's preparation stands during one push.
#[derive(Clone)]
enum Prep {
    Todo,
    Ready(Option<Arc<dyn Fence>>),
    Failed(Arc<dyn std::error::Error + Send + Sync>),
}

/// Several fences: done when all are.
#[derive(Debug)]
struct AllOf(Vec<Arc<dyn Fence>>);

impl Fence for AllOf {
    fn is_done(&self) -> Result<bool, MemoryError> {
        for f in &self.0 {
            if !f.is_done()? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// A source rank of a weight sync: its agent, its rank and layout, its registered regions,
/// and the destinations it pushes to (see the [module documentation](super) and its
/// example).
///
/// Built from the whole plan, it keeps only its own pairs. Destinations are attached by
/// rank with their peer and region descriptors ([`attach`](Self::attach)), or from the
/// cluster directory ([`refresh`](Self::refresh)). It also registers its record region
/// (its side, rank and layout, and the version its memory holds: what pulls read), deregistered
/// when it is dropped.
pub struct Source {
    pub(super) agent: Agent,
    pub(super) rank: u32,
    pub(super) sources: u32,
    /// Destinations of the plan it was made from (ranks below are planned; joiners come
    /// after).
    pub(super) planned: u32,
    pub(super) layout: Layout,
    pub(super) regions: Vec<Region>,
    pub(super) dests: BTreeMap<u32, Dest>,
    pub(super) next_rank: u32,
    pub(super) options: SyncOptions,
    pub(super) record: OwnRecord,
    /// Per region, its pieces as `(start, end, piece)` sorted by start.
    by_region: Vec<Vec<(u64, u64, usize)>>,
    /// Records read from the directory, by member name: `(instance, record)`.
    pub(super) seen: HashMap<String, (u64, RankRecord)>,
    /// The sources' layouts, once read from the directory (to plan joiners).
    pub(super) source_layouts: Option<Vec<Layout>>,
}

impl Source {
    /// Source `rank` of `plan`, on `agent`, holding `layout` in `regions` (registered with
    /// `agent`, by the layout's region index; with [`Access::REMOTE_READ`](crate::Access)
    /// if destinations are to pull). Every destination of the plan is known, none
    /// attached.
    pub fn new(
        agent: &Agent,
        plan: &Plan,
        rank: u32,
        layout: Layout,
        regions: Vec<Region>,
    ) -> Result<Source, SyncError> {
        if rank >= plan.sources() {
            return Err(SyncError::NoSuchRank {
                side: Side::Source,
                rank,
            });
        }
        layout.validate()?;
        if regions.len() != layout.regions.len() {
            return Err(SyncError::RegionCount {
                given: regions.len(),
                want: layout.regions.len(),
            });
        }
        for (i, (r, spec)) in regions.iter().zip(&layout.regions).enumerate() {
            if r.len() < spec.len {
                return Err(SyncError::RegionTooShort {
                    side: Side::Source,
                    rank: Some(rank),
                    region: i as u32,
                    need: spec.len,
                    have: r.len(),
                });
            }
        }
        let mut dests: BTreeMap<u32, Dest> = (0..plan.destinations())
            .map(|d| {
                let dest = Dest {
                    pairs: Vec::new(),
                    link: None,
                    member: None,
                    joined: false,
                };
                (d, dest)
            })
            .collect();
        for p in plan.pairs_from(rank) {
            check_local(p, &regions, rank)?;
            if let Some(d) = dests.get_mut(&p.dst.rank) {
                d.pairs.push(p.clone());
            }
        }
        let mut by_region: Vec<Vec<(u64, u64, usize)>> = vec![Vec::new(); layout.regions.len()];
        for (i, p) in layout.pieces.iter().enumerate() {
            let spec = &layout.tensors[p.tensor as usize];
            let bytes = p
                .holding
                .elements(spec.shape.len())
                .unwrap_or(0)
                .saturating_mul(u64::from(spec.elem_size));
            if bytes > 0 {
                by_region[p.region as usize].push((p.offset, p.offset + bytes, i));
            }
        }
        for v in &mut by_region {
            v.sort_unstable();
        }
        let record = OwnRecord::new(
            agent,
            &RankRecord {
                side: Side::Source,
                rank: Some(rank),
                sources: plan.sources(),
                layout: layout.clone(),
            },
        )?;
        Ok(Source {
            agent: agent.clone(),
            rank,
            sources: plan.sources(),
            planned: plan.destinations(),
            layout,
            regions,
            dests,
            next_rank: plan.destinations(),
            options: SyncOptions::default(),
            record,
            by_region,
            seen: HashMap::new(),
            source_layouts: None,
        })
    }

    /// With `options` for later pushes.
    pub fn with_options(mut self, options: SyncOptions) -> Source {
        self.options = options;
        self
    }

    /// Its rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The number of sources of the sync.
    pub fn sources(&self) -> u32 {
        self.sources
    }

    /// Its layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Its agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// Its record region: give its descriptor to destinations that pull without the
    /// directory ([`SourceInfo::record`](super::SourceInfo)).
    pub fn record(&self) -> &Region {
        self.record.region()
    }

    /// The version its memory holds at rest, as its record says (`None` before the first
    /// push, and after [`begin_update`](Self::begin_update)).
    pub fn version(&self) -> Option<u32> {
        self.record.state().at_rest()
    }

    /// Every destination rank it knows (planned, or planned in since), attached or not.
    pub fn destinations(&self) -> Vec<u32> {
        self.dests.keys().copied().collect()
    }

    /// The destination ranks attached now.
    pub fn attached(&self) -> Vec<u32> {
        (self.dests.iter())
            .filter(|(_, d)| d.link.is_some())
            .map(|(&r, _)| r)
            .collect()
    }

    /// The directory member attached as destination `rank` (by [`refresh`](Self::refresh)):
    /// its name and its agent's instance.
    pub fn member(&self, rank: u32) -> Option<(&str, u64)> {
        let m = self.dests.get(&rank)?.member.as_ref()?;
        Some((m.name.as_str(), m.instance))
    }

    /// The pairs it sends destination `rank`.
    pub fn pairs_to(&self, rank: u32) -> Option<&[RegionPair]> {
        self.dests.get(&rank).map(|d| d.pairs.as_slice())
    }

    /// Offers its layout's regions under their names and its record under
    /// [`RECORD_REGION`](super::RECORD_REGION), for peers that find it in the directory
    /// (publish the agent after, or update its publication).
    pub fn offer(&self) -> crate::Result<()> {
        for (spec, r) in self.layout.regions.iter().zip(&self.regions) {
            self.agent.offer(&spec.name, r)?;
        }
        self.agent.offer(super::RECORD_REGION, self.record.region())
    }

    /// Attaches destination `rank`: pushes go to `peer`, into `regions` (its region
    /// descriptors by its layout's region index). Replaces an earlier attachment. Fails if a
    /// region is too short for the pairs, or not on the transport the peer is reached by.
    pub fn attach(
        &mut self,
        rank: u32,
        peer: Peer,
        regions: Vec<RegionDescriptor>,
    ) -> Result<(), SyncError> {
        let dest = self.dests.get_mut(&rank).ok_or(SyncError::NoSuchRank {
            side: Side::Destination,
            rank,
        })?;
        if regions.is_empty() {
            // The signal needs a region to land in.
            return Err(SyncError::RegionCount { given: 0, want: 1 });
        }
        for d in &regions {
            if d.on(peer.transport()).is_none() {
                return Err(SyncError::submit(
                    Side::Destination,
                    Some(rank),
                    &peer,
                    crate::Error::RegionNotOnTransport(peer.transport()),
                ));
            }
        }
        for p in &dest.pairs {
            let have = regions.get(p.dst.region as usize).map(|d| d.len);
            let need = pair_extent(p).map_or(u64::MAX, |e| e.1);
            if have.is_none_or(|h| h < need) {
                return Err(SyncError::RegionTooShort {
                    side: Side::Destination,
                    rank: Some(rank),
                    region: p.dst.region,
                    need,
                    have: have.unwrap_or(0),
                });
            }
        }
        dest.link = Some(Link { peer, regions });
        Ok(())
    }

    /// Detaches destination `rank` (it stays planned: attach it again to push to it);
    /// returns its peer, which stays connected.
    pub fn detach(&mut self, rank: u32) -> Option<Peer> {
        let d = self.dests.get_mut(&rank)?;
        d.member = None;
        d.link.take().map(|l| l.peer)
    }

    /// Plans in a destination that was not in the plan: `layout` against `sources` (every
    /// source's layout, in rank order), as [`Plan::add_destination`] does, keeping only
    /// this source's pairs; the pairs to the others stay as they are. Returns its rank
    /// (attach it next). The same layouts give every source the same pairs, whatever order
    /// each learns of joiners in.
    pub fn add_destination(
        &mut self,
        sources: &[Layout],
        layout: &Layout,
    ) -> Result<u32, SyncError> {
        if sources.len() != self.sources as usize {
            return Err(SyncError::Plan(crate::weights::PlanError::SourceCount {
                plan: self.sources,
                layouts: sources.len(),
            }));
        }
        let rank = self.next_rank;
        let pairs = Plan::destination_pairs(sources, layout, rank)?;
        let mine: Vec<RegionPair> = pairs
            .into_iter()
            .filter(|p| p.src.rank == self.rank)
            .collect();
        for p in &mine {
            check_local(p, &self.regions, self.rank)?;
        }
        self.next_rank = rank.checked_add(1).ok_or(SyncError::NoSuchRank {
            side: Side::Destination,
            rank,
        })?;
        self.dests.insert(
            rank,
            Dest {
                pairs: mine,
                link: None,
                member: None,
                joined: true,
            },
        );
        Ok(rank)
    }

    /// Drops destination `rank` (it left): a destination planned in later is forgotten, one
    /// of the plan detached. Returns its peer, if it was attached.
    pub fn remove_destination(&mut self, rank: u32) -> Option<Peer> {
        let joined = self.dests.get(&rank).is_some_and(|d| d.joined);
        if joined {
            self.dests
                .remove(&rank)
                .and_then(|d| d.link)
                .map(|l| l.peer)
        } else {
            self.detach(rank)
        }
    }

    /// Says that the memory is about to change (the trainer's optimizer step): pulls that
    /// read meanwhile retry rather than take a mix of versions. The next push says which
    /// version it holds then.
    pub fn begin_update(&self) -> Result<(), SyncError> {
        self.record.changing()
    }

    /// Pushes `version` to every attached destination. The memory is taken to hold
    /// `version` (the record says so from now on). Fails as a whole only for a version
    /// that cannot be signalled ([`signal_imm`](super::signal_imm)); each destination's
    /// part succeeds or fails on its own in the report.
    pub fn push(&self, version: u32) -> Result<PushReport, SyncError> {
        self.push_inner(version, None, None)
    }

    /// Pushes `version` to the destinations `ranks` only (to redo one whose part failed);
    /// a rank not attached fails its own part.
    pub fn push_to(&self, version: u32, ranks: &[u32]) -> Result<PushReport, SyncError> {
        self.push_inner(version, Some(ranks), None)
    }

    /// As [`push_to`](Self::push_to) (every attached destination for `ranks == None`), with
    /// `prepare` called once per piece of the layout that is sent, just before the first
    /// chunk that reads it is submitted, in the order the chunks go (see [`PrepareResult`]).
    /// It is where the caller writes a piece into the registered region (a dtype
    /// conversion, an FSDP gather) so that preparing later pieces overlaps sending earlier
    /// ones.
    pub fn push_with(
        &self,
        version: u32,
        ranks: Option<&[u32]>,
        mut prepare: impl FnMut(PieceToSend<'_>) -> PrepareResult,
    ) -> Result<PushReport, SyncError> {
        self.push_inner(version, ranks, Some(&mut prepare))
    }

    fn push_inner(
        &self,
        version: u32,
        ranks: Option<&[u32]>,
        mut prepare: Option<&mut dyn FnMut(PieceToSend<'_>) -> PrepareResult>,
    ) -> Result<PushReport, SyncError> {
        let imm = signal_imm(version, self.rank, self.sources)?;
        self.record.at_rest(version)?;
        let start = Instant::now();
        let mut targets: Vec<u32> = match ranks {
            Some(r) => r.to_vec(),
            None => self.attached(),
        };
        targets.sort_unstable();
        targets.dedup();
        let mut results = BTreeMap::new();
        let mut lanes: Vec<(u32, &Link)> = Vec::new();
        let mut lane_pairs: Vec<Vec<&RegionPair>> = Vec::new();
        for r in targets {
            match self.dests.get(&r) {
                None => {
                    let e = SyncError::NoSuchRank {
                        side: Side::Destination,
                        rank: r,
                    };
                    results.insert(r, Err(e));
                }
                Some(Dest { link: None, .. }) => {
                    let e = SyncError::NotAttached {
                        side: Side::Destination,
                        rank: r,
                    };
                    results.insert(r, Err(e));
                }
                Some(Dest {
                    link: Some(link),
                    pairs,
                    ..
                }) => {
                    lanes.push((r, link));
                    lane_pairs.push(pairs.iter().collect());
                }
            }
        }
        let mut pipe = Pipeline::new(lane_pairs, Way::Write, true, self.options.limits());
        let mut errors: Vec<Option<SyncError>> = lanes.iter().map(|_| None).collect();
        let mut landed: Vec<Duration> = vec![Duration::ZERO; lanes.len()];
        let mut preps: Vec<Prep> = if prepare.is_some() {
            vec![Prep::Todo; self.layout.pieces.len()]
        } else {
            Vec::new()
        };
        let (tx, rx) = mpsc::channel::<(usize, u64, TransferResult)>();
        let timeout = self.options.transfer_timeout;
        let mut waited = Duration::ZERO;
        loop {
            match pipe.next() {
                Step::Chunk(c) => {
                    let (lane, bytes) = (c.lane, c.bytes);
                    let (rank, link) = lanes[lane];
                    let fence = match prepare.as_mut() {
                        Some(f) => match self.prepare_chunk(&c, &mut preps, &mut **f) {
                            Ok(fence) => fence,
                            Err(e) => {
                                errors[lane].get_or_insert(e);
                                pipe.completed(lane, bytes, false);
                                continue;
                            }
                        },
                        None => None,
                    };
                    let local = &self.regions[c.local_region as usize];
                    let remote = &link.regions[c.remote_region as usize];
                    let runs = c.runs.len();
                    let mut t = crate::Transfer::runs(c.runs).timeout(timeout);
                    if let Some(f) = fence {
                        t = t.after(f);
                    }
                    tracing::trace!(
                        target: "xfer::weights::timeline",
                        lane,
                        bytes,
                        runs,
                        "chunk"
                    );
                    match self.agent.submit(&link.peer, local, remote, t) {
                        Ok(h) => {
                            let tx = tx.clone();
                            h.on_complete_op(move |r| {
                                let _ = tx.send((lane, bytes, r));
                            });
                        }
                        Err(e) => {
                            let e = SyncError::submit(Side::Destination, Some(rank), &link.peer, e);
                            errors[lane].get_or_insert(e);
                            pipe.completed(lane, bytes, false);
                        }
                    }
                }
                Step::Signal(lane) => {
                    let (rank, link) = lanes[lane];
                    let t = crate::Transfer::segments(vec![(0, 0, 0)])
                        .imm(imm)
                        .timeout(timeout);
                    match self
                        .agent
                        .submit(&link.peer, self.record.region(), &link.regions[0], t)
                    {
                        Ok(h) => {
                            let tx = tx.clone();
                            h.on_complete_op(move |r| {
                                let _ = tx.send((lane, 0, r));
                            });
                        }
                        Err(e) => {
                            let e = SyncError::submit(Side::Destination, Some(rank), &link.peer, e);
                            errors[lane].get_or_insert(e);
                            pipe.completed(lane, 0, false);
                        }
                    }
                }
                Step::Wait => {
                    // We hold a sender, so this waits for a worker's callback: every
                    // transfer completes (its timeout at the latest).
                    let asleep = Instant::now();
                    let got = rx.recv();
                    waited += asleep.elapsed();
                    let Ok((lane, bytes, r)) = got else {
                        break;
                    };
                    tracing::trace!(
                        target: "xfer::weights::timeline",
                        lane,
                        bytes,
                        ok = r.is_ok(),
                        "landed"
                    );
                    match r {
                        Ok(_) => {
                            pipe.completed(lane, bytes, true);
                            if pipe.state(lane) == LaneState::Done {
                                landed[lane] = start.elapsed();
                            }
                        }
                        Err(op) => {
                            let (rank, link) = lanes[lane];
                            let e = transfer_error(rank, &link.peer, op);
                            SyncError::keep_cause(&mut errors[lane], e);
                            pipe.completed(lane, bytes, false);
                        }
                    }
                }
                Step::Done => break,
            }
        }
        for (i, (rank, link)) in lanes.iter().enumerate() {
            let r = match (pipe.state(i), errors[i].take()) {
                (LaneState::Done, _) => {
                    let t = pipe.totals(i);
                    Ok(PushStats {
                        bytes: t.bytes,
                        transfers: t.transfers,
                        segments: t.segments,
                        landed: landed[i],
                    })
                }
                (_, Some(e)) => Err(e),
                (_, None) => Err(SyncError::Transfer {
                    side: Some(Side::Destination),
                    rank: Some(*rank),
                    peer: link.peer.info().name.clone(),
                    source: OpError::Cancelled,
                }),
            };
            results.insert(*rank, r);
        }
        Ok(PushReport {
            version,
            destinations: results,
            elapsed: start.elapsed(),
            waited,
        })
    }

    /// Prepares the pieces `c` reads that are not prepared yet; returns what the chunk
    /// waits for.
    fn prepare_chunk(
        &self,
        c: &Chunk,
        preps: &mut [Prep],
        prepare: &mut dyn FnMut(PieceToSend<'_>) -> PrepareResult,
    ) -> Result<Option<Arc<dyn Fence>>, SyncError> {
        let Some(pieces) = self.by_region.get(c.local_region as usize) else {
            return Ok(None);
        };
        let mut fences: Vec<Arc<dyn Fence>> = Vec::new();
        let mut last = usize::MAX;
        for r in &c.runs {
            // The rows lie between the first's start and the last's end.
            let start = r.src_offset;
            let span = (r.count.saturating_sub(1))
                .saturating_mul(r.src_stride)
                .saturating_add(r.len);
            let end = start.saturating_add(span);
            // The first piece that ends after `start`.
            let mut i = pieces.partition_point(|p| p.1 <= start);
            while let Some(&(p_start, _, index)) = pieces.get(i) {
                if p_start >= end {
                    break;
                }
                i += 1;
                if index == last {
                    continue;
                }
                last = index;
                let prep = match &preps[index] {
                    Prep::Todo => {
                        let piece = &self.layout.pieces[index];
                        let got = prepare(PieceToSend {
                            index,
                            piece,
                            tensor: &self.layout.tensors[piece.tensor as usize],
                            region: &self.regions[c.local_region as usize],
                        });
                        let p = match got {
                            Ok(f) => Prep::Ready(f),
                            Err(e) => Prep::Failed(Arc::from(e)),
                        };
                        preps[index] = p.clone();
                        p
                    }
                    p => p.clone(),
                };
                match prep {
                    Prep::Ready(Some(f)) => {
                        if !fences.iter().any(|g| Arc::ptr_eq(g, &f)) {
                            fences.push(f);
                        }
                    }
                    Prep::Ready(None) | Prep::Todo => {}
                    Prep::Failed(e) => {
                        let piece = &self.layout.pieces[index];
                        return Err(SyncError::Prepare {
                            piece: index,
                            tensor: self.layout.tensors[piece.tensor as usize].name.clone(),
                            source: e,
                        });
                    }
                }
            }
        }
        Ok(match fences.len() {
            0 => None,
            1 => fences.pop(),
            _ => Some(Arc::new(AllOf(fences))),
        })
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        self.record.close(&self.agent);
    }
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source")
            .field("agent", &self.agent.name())
            .field("rank", &self.rank)
            .field("sources", &self.sources)
            .field("destinations", &self.destinations())
            .field("attached", &self.attached())
            .finish()
    }
}

/// The failure of a transfer to destination `rank`.
fn transfer_error(rank: u32, peer: &Peer, op: OpError) -> SyncError {
    SyncError::Transfer {
        side: Some(Side::Destination),
        rank: Some(rank),
        peer: peer.info().name.clone(),
        source: op,
    }
}

/// Checks that pair `p`'s source side lies in this source's regions.
fn check_local(p: &RegionPair, regions: &[Region], rank: u32) -> Result<(), SyncError> {
    let have = regions.get(p.src.region as usize).map(Region::len);
    let need = pair_extent(p).map_or(u64::MAX, |e| e.0);
    if have.is_none_or(|h| h < need) {
        return Err(SyncError::RegionTooShort {
            side: Side::Source,
            rank: Some(rank),
            region: p.src.region,
            need,
            have: have.unwrap_or(0),
        });
    }
    Ok(())
}
