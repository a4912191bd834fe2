//! [`Destination`]: a destination rank's side of a weight sync (waiting for pushes,
//! pulling).

use super::pipeline::{LaneState, Pipeline, Step, Way};
use super::record::{OwnRecord, RankRecord, SourceState, read_state};
use super::{SyncError, SyncOptions, pair_extent, signal_imm};
use crate::agent::{Agent, Peer, Region};
use crate::weights::{Layout, Plan, RegionPair, Side};
use fabric_core::engine::TransferResult;
use fabric_core::metadata::RegionDescriptor;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// What a destination needs of a source to pull from it.
#[derive(Clone, Debug)]
pub struct SourceInfo {
    /// The source as a peer of the destination's agent.
    pub peer: Peer,
    /// Its layout.
    pub layout: Layout,
    /// Its regions' descriptors, by its layout's region index (registered with
    /// [`Access::REMOTE_READ`](crate::Access)).
    pub regions: Vec<RegionDescriptor>,
    /// Its record region ([`Source::record`](super::Source::record)), whose first
    /// bytes say which version its memory holds.
    pub record: RegionDescriptor,
}

/// What a pull read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullReport {
    /// The version read (every source held it at rest before and after).
    pub version: u32,
    /// Bytes read.
    pub bytes: u64,
    /// Transfers submitted, over every attempt.
    pub transfers: u64,
    /// Attempts (more than one when sources were changing, or not at the version asked).
    pub attempts: u32,
    /// How long it took.
    pub elapsed: Duration,
}

/// A destination rank of a weight sync: its agent, layout and registered regions, and the
/// number of sources it hears from (see the [module documentation](super) and its example).
///
/// [`wait`](Self::wait) returns once every source signalled a version: its bytes have landed.
/// [`pull`](Self::pull) reads the destination's share itself, from sources attached with
/// [`attach_source`](Self::attach_source) or found in the directory
/// ([`refresh`](Self::refresh)); it plans its own pairs against their layouts. Its regions
/// must be registered with [`Access::REMOTE_WRITE`](crate::Access) for pushes and
/// [`Access::LOCAL_WRITE`](crate::Access) for pulls. The agent's immediate values are the
/// sync's: other traffic to it should not use them.
pub struct Destination {
    pub(super) agent: Agent,
    pub(super) layout: Layout,
    regions: Vec<Region>,
    pub(super) sources: u32,
    pub(super) rank: Option<u32>,
    pub(super) options: SyncOptions,
    pub(super) record: OwnRecord,
    /// Sources heard from, per version whose wait has not completed.
    heard: Mutex<BTreeMap<u32, BTreeSet<u32>>>,
    pub(super) links: BTreeMap<u32, SourceInfo>,
    /// This destination's pairs against the attached sources (planned at the first pull).
    pairs: Mutex<Option<Arc<Vec<RegionPair>>>>,
    /// Records read from the directory, by member name: `(instance, record)`.
    pub(super) seen: HashMap<String, (u64, RankRecord)>,
    /// The members attached as sources, by rank.
    pub(super) members: BTreeMap<u32, super::source::MemberId>,
}

impl Destination {
    /// A destination on `agent` holding `layout` in `regions` (registered with `agent`, by
    /// the layout's region index), fed by `sources` sources. `rank` is its rank in the plan
    /// the sources were made with, or `None` for one that joins later (sources plan it in
    /// when they see it in the directory). It registers its record region (its side, rank and
    /// layout, for sources that find it in the directory).
    pub fn new(
        agent: &Agent,
        layout: Layout,
        regions: Vec<Region>,
        sources: u32,
        rank: Option<u32>,
    ) -> Result<Destination, SyncError> {
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
                    side: Side::Destination,
                    rank,
                    region: i as u32,
                    need: spec.len,
                    have: r.len(),
                });
            }
        }
        let record = OwnRecord::new(
            agent,
            &RankRecord {
                side: Side::Destination,
                rank,
                sources,
                layout: layout.clone(),
            },
        )?;
        Ok(Destination {
            agent: agent.clone(),
            layout,
            regions,
            sources,
            rank,
            options: SyncOptions::default(),
            record,
            heard: Mutex::new(BTreeMap::new()),
            links: BTreeMap::new(),
            pairs: Mutex::new(None),
            seen: HashMap::new(),
            members: BTreeMap::new(),
        })
    }

    /// With `options` for later pulls.
    pub fn with_options(mut self, options: SyncOptions) -> Destination {
        self.options = options;
        self
    }

    /// Its layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Its agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The number of sources it hears from.
    pub fn sources(&self) -> u32 {
        self.sources
    }

    /// Its rank in the plan, if it was planned with the others.
    pub fn rank(&self) -> Option<u32> {
        self.rank
    }

    /// Its regions' descriptors, by its layout's region index: what sources attach it with.
    pub fn descriptors(&self) -> Vec<RegionDescriptor> {
        self.regions
            .iter()
            .map(|r| r.descriptor().clone())
            .collect()
    }

    /// Offers its layout's regions under their names and its record under
    /// [`RECORD_REGION`](super::RECORD_REGION), for sources that find it in the directory.
    pub fn offer(&self) -> crate::Result<()> {
        for (spec, r) in self.layout.regions.iter().zip(&self.regions) {
            self.agent.offer(&spec.name, r)?;
        }
        self.agent.offer(super::RECORD_REGION, self.record.region())
    }

    /// Waits until every source has signalled `version` (its bytes have landed here), or
    /// fails after `timeout` with [`SyncError::NotLanded`] naming the sources not heard
    /// from. Signals heard before a failure count: after the failed sources redo their part,
    /// waiting again waits for them alone.
    pub fn wait(&self, version: u32, timeout: Duration) -> Result<(), SyncError> {
        let deadline = Instant::now() + timeout;
        let heard: BTreeSet<u32> = self.lock_heard().get(&version).cloned().unwrap_or_default();
        let mut missing = Vec::new();
        for s in (0..self.sources).filter(|s| !heard.contains(s)) {
            let imm = signal_imm(version, s, self.sources)?;
            let left = deadline.saturating_duration_since(Instant::now());
            match self.agent.wait_imm(imm, 1, left) {
                Ok(()) => {
                    self.lock_heard().entry(version).or_default().insert(s);
                }
                Err(crate::Error::Engine(fabric_core::Error::TimedOut(..))) => missing.push(s),
                Err(e) => return Err(SyncError::agent(e)),
            }
        }
        if missing.is_empty() {
            self.lock_heard().remove(&version);
            Ok(())
        } else {
            Err(SyncError::NotLanded {
                version,
                waited: timeout,
                missing,
            })
        }
    }

    fn lock_heard(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, BTreeSet<u32>>> {
        self.heard.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Attaches source `rank` for pulls. Replaces an earlier attachment.
    pub fn attach_source(&mut self, rank: u32, info: SourceInfo) -> Result<(), SyncError> {
        if rank >= self.sources {
            return Err(SyncError::NoSuchRank {
                side: Side::Source,
                rank,
            });
        }
        if info.regions.len() != info.layout.regions.len() {
            return Err(SyncError::RegionCount {
                given: info.regions.len(),
                want: info.layout.regions.len(),
            });
        }
        for (i, (d, spec)) in info.regions.iter().zip(&info.layout.regions).enumerate() {
            if d.len < spec.len {
                return Err(SyncError::RegionTooShort {
                    side: Side::Source,
                    rank: Some(rank),
                    region: i as u32,
                    need: spec.len,
                    have: d.len,
                });
            }
        }
        self.links.insert(rank, info);
        *self.pairs.lock().unwrap_or_else(|p| p.into_inner()) = None;
        Ok(())
    }

    /// Detaches source `rank`; returns its peer.
    pub fn detach_source(&mut self, rank: u32) -> Option<Peer> {
        *self.pairs.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.links.remove(&rank).map(|i| i.peer)
    }

    /// The source ranks attached.
    pub fn attached_sources(&self) -> Vec<u32> {
        self.links.keys().copied().collect()
    }

    /// This destination's pairs against the attached sources (every source must be).
    fn pull_pairs(&self) -> Result<Arc<Vec<RegionPair>>, SyncError> {
        let mut cached = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = cached.as_ref() {
            return Ok(p.clone());
        }
        let mut layouts = Vec::with_capacity(self.sources as usize);
        for s in 0..self.sources {
            let info = self.links.get(&s).ok_or(SyncError::NotAttached {
                side: Side::Source,
                rank: s,
            })?;
            layouts.push(info.layout.clone());
        }
        let pairs = Plan::destination_pairs(&layouts, &self.layout, 0)?;
        for p in &pairs {
            let ext = pair_extent(p);
            let dst_need = ext.map_or(u64::MAX, |e| e.1);
            let src_need = ext.map_or(u64::MAX, |e| e.0);
            let have = self.regions.get(p.dst.region as usize).map(Region::len);
            if have.is_none_or(|h| h < dst_need) {
                return Err(SyncError::RegionTooShort {
                    side: Side::Destination,
                    rank: self.rank,
                    region: p.dst.region,
                    need: dst_need,
                    have: have.unwrap_or(0),
                });
            }
            let info = &self.links[&p.src.rank];
            let have = info.regions.get(p.src.region as usize).map(|d| d.len);
            if have.is_none_or(|h| h < src_need) {
                return Err(SyncError::RegionTooShort {
                    side: Side::Source,
                    rank: Some(p.src.rank),
                    region: p.src.region,
                    need: src_need,
                    have: have.unwrap_or(0),
                });
            }
        }
        let pairs = Arc::new(pairs);
        *cached = Some(pairs.clone());
        Ok(pairs)
    }

    /// Reads this destination's share from the sources with READs (every source attached),
    /// pipelined as pushes are. The sources must hold one version at rest (`version`, if
    /// given) before and after the read, as their record regions say: while they do not
    /// (a source is changing its weights, or has not pushed the version asked for yet), the
    /// pull looks again every [`SyncOptions::pull_retry`] until `timeout`, then fails with
    /// the last reason ([`SyncError::Unsettled`], [`SyncError::Torn`]). A failed READ fails
    /// the pull at once, naming the source.
    pub fn pull(&self, version: Option<u32>, timeout: Duration) -> Result<PullReport, SyncError> {
        let start = Instant::now();
        let deadline = start + timeout;
        let pairs = self.pull_pairs()?;
        let mut attempts = 0u32;
        let mut transfers = 0u64;
        loop {
            attempts += 1;
            let before = self.states()?;
            let reason = match settled(&before, version) {
                Ok(v) => {
                    let (bytes, n) = self.read_all(&pairs)?;
                    transfers += n;
                    let after = self.states()?;
                    match before.iter().zip(&after).position(|(a, b)| a != b) {
                        None => {
                            return Ok(PullReport {
                                version: v,
                                bytes,
                                transfers,
                                attempts,
                                elapsed: start.elapsed(),
                            });
                        }
                        Some(s) => SyncError::Torn { rank: s as u32 },
                    }
                }
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(reason);
            }
            // Nothing tells a reader that a source's word changed: look again shortly.
            std::thread::sleep(self.options.pull_retry.min(deadline - now));
        }
    }

    /// Every source's state word, in rank order.
    fn states(&self) -> Result<Vec<SourceState>, SyncError> {
        let t = self.options.transfer_timeout;
        (0..self.sources)
            .map(|s| {
                let info = self.links.get(&s).ok_or(SyncError::NotAttached {
                    side: Side::Source,
                    rank: s,
                })?;
                read_state(&self.agent, &info.peer, &info.record, t).map_err(|e| with_rank(e, s))
            })
            .collect()
    }

    /// Reads every pair; returns the bytes and transfers.
    fn read_all(&self, pairs: &[RegionPair]) -> Result<(u64, u64), SyncError> {
        let ranks: Vec<u32> = (0..self.sources).collect();
        let lanes: Vec<Vec<&RegionPair>> = ranks
            .iter()
            .map(|&s| pairs.iter().filter(|p| p.src.rank == s).collect())
            .collect();
        let mut pipe = Pipeline::new(lanes, Way::Read, false, self.options.limits());
        let (tx, rx) = mpsc::channel::<(usize, u64, TransferResult)>();
        let timeout = self.options.transfer_timeout;
        let mut first: Option<SyncError> = None;
        loop {
            match pipe.next() {
                Step::Chunk(c) => {
                    let (lane, bytes) = (c.lane, c.bytes);
                    let info = &self.links[&ranks[lane]];
                    if first.is_some() {
                        // One source failed the pull: nothing more starts.
                        pipe.completed(lane, bytes, false);
                        continue;
                    }
                    let t = crate::Transfer::runs(c.runs).read().timeout(timeout);
                    let local = &self.regions[c.local_region as usize];
                    let remote = &info.regions[c.remote_region as usize];
                    match self.agent.submit(&info.peer, local, remote, t) {
                        Ok(h) => {
                            let tx = tx.clone();
                            h.on_complete_op(move |r| {
                                let _ = tx.send((lane, bytes, r));
                            });
                        }
                        Err(e) => {
                            first.get_or_insert(SyncError::submit(
                                Side::Source,
                                Some(ranks[lane]),
                                &info.peer,
                                e,
                            ));
                            pipe.completed(lane, bytes, false);
                        }
                    }
                }
                Step::Signal(lane) => pipe.completed(lane, 0, true),
                Step::Wait => {
                    let Ok((lane, bytes, r)) = rx.recv() else {
                        break;
                    };
                    if let Err(op) = r {
                        let info = &self.links[&ranks[lane]];
                        let e = SyncError::Transfer {
                            side: Some(Side::Source),
                            rank: Some(ranks[lane]),
                            peer: info.peer.info().name.clone(),
                            source: op,
                        };
                        SyncError::keep_cause(&mut first, e);
                    }
                    pipe.completed(lane, bytes, first.is_none());
                }
                Step::Done => break,
            }
        }
        if let Some(e) = first {
            return Err(e);
        }
        let mut bytes = 0u64;
        let mut n = 0u64;
        for (i, &rank) in ranks.iter().enumerate() {
            if pipe.state(i) != LaneState::Done {
                return Err(SyncError::NotAttached {
                    side: Side::Source,
                    rank,
                });
            }
            let t = pipe.totals(i);
            bytes = bytes.saturating_add(t.bytes);
            n += t.transfers;
        }
        Ok((bytes, n))
    }
}

/// The version all sources hold at rest (`want`, if given), or why not.
fn settled(states: &[SourceState], want: Option<u32>) -> Result<u32, SyncError> {
    let versions: Vec<Option<u32>> = states.iter().map(SourceState::at_rest).collect();
    let first = versions.first().copied().flatten();
    let one = first.filter(|&v| versions.iter().all(|&x| x == Some(v)));
    match (one, want) {
        (Some(v), None) => Ok(v),
        (Some(v), Some(w)) if v == w => Ok(v),
        _ => Err(SyncError::Unsettled {
            want,
            states: versions
                .into_iter()
                .enumerate()
                .map(|(s, v)| (s as u32, v))
                .collect(),
        }),
    }
}

/// `e` naming source `rank` where it names none.
fn with_rank(e: SyncError, rank: u32) -> SyncError {
    match e {
        SyncError::Transfer { peer, source, .. } => SyncError::Transfer {
            side: Some(Side::Source),
            rank: Some(rank),
            peer,
            source,
        },
        SyncError::Submit { peer, source, .. } => SyncError::Submit {
            side: Some(Side::Source),
            rank: Some(rank),
            peer,
            source,
        },
        e => e,
    }
}

impl Drop for Destination {
    fn drop(&mut self) {
        self.record.close(&self.agent);
    }
}

impl std::fmt::Debug for Destination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Destination")
            .field("agent", &self.agent.name())
            .field("rank", &self.rank)
            .field("sources", &self.sources)
            .field("attached_sources", &self.attached_sources())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_settled_when_all_rest_at_one_version() {
        let at = |g, v| SourceState {
            generation: g,
            version: v,
        };
        assert_eq!(settled(&[at(2, 7), at(4, 7)], None).unwrap(), 7);
        assert_eq!(settled(&[at(2, 7), at(4, 7)], Some(7)).unwrap(), 7);
        assert!(matches!(
            settled(&[at(2, 7), at(4, 7)], Some(8)),
            Err(SyncError::Unsettled { want: Some(8), .. })
        ));
        let e = settled(&[at(2, 7), at(5, 7)], None).unwrap_err();
        assert!(
            matches!(&e, SyncError::Unsettled { states, .. } if states == &[(0, Some(7)), (1, None)]),
            "{e:?}"
        );
        assert!(settled(&[at(2, 7), at(2, 6)], None).is_err());
    }
}
