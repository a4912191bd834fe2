//! KV cache between prefill and decode servers of different shapes: a request's blocks
//! moved from every prefill rank's paged cache into every decode rank's, layer by layer,
//! pushed by prefill (WRITEs) or pulled by decode (READs), each side told by
//! notifications that carry the request.
//!
//! The plan is `kv-plan`'s (re-exported here): [`KvLayout`]s say how each rank's cache is
//! laid out (vLLM's and SGLang's shapes, NHD or HND, K and V apart or fused, MLA, which KV
//! heads a rank holds), a [`KvRequest`] gives both sides' block tables, [`plan()`] makes the
//! strided runs per (prefill rank, decode rank) and [`check()`] proves them. This module
//! executes a plan over [`Agent`]s:
//!
//! - A [`KvRank`] is one rank's end: its agent, its cache (a [`KvLayout`] and the regions
//!   that hold it), both sides' layouts, and the other side's ranks it is attached to
//!   ([`KvRank::attach`], from each peer rank's [`KvRankInfo`]).
//! - Prefill pushes: [`KvRank::push_layer`] moves one layer of a request, after the CUDA
//!   event (any [`Fence`]) that says the layer is saved, as one strided transfer per
//!   (decode rank, region pair): a handful of transfers per layer, never one per block or
//!   head. Each carries a [`KvNote`] (request, layer, and how many transfers make the layer
//!   whole at that decode rank), sent once its bytes are placed.
//! - Decode learns from those notes: [`KvRank::wait`] (the request landed),
//!   [`KvRank::wait_layer`] (one layer did), [`KvRank::poll`] (what landed since).
//! - Decode pulls instead: [`KvRank::pull_layer`] reads prefill's blocks; its own handles
//!   say when they landed, and each read tells prefill (a [`NoteKind::Read`] note), whose
//!   [`KvRank::wait`] then says that every reader is done with the request's blocks.
//! - Failures name the request ([`Error::KvRequest`]): a peer that dies or stalls fails
//!   the transfers of its requests only. [`KvTransfers::wait`] reports only once every
//!   transfer of the request has finished, so that a failed pull's blocks are the caller's
//!   again when it hears of the failure (nothing can still write into them).
//!
//! Every rank of a side plans the same request the same way from the same layouts and
//! tables (planning is deterministic and costs one layer's work), so the ranks need not
//! exchange plans: only the request's block tables, as a scheduler already does.

mod note;

pub use kv_plan::{
    Cell, CheckError, HeadOrder, KvError, KvLayout, KvModel, KvPlan, KvRequest, PairPlan,
    PairStats, Placed, PlanStats, Regions, Side, TensorPlace, check, heads_for_rank, plan,
};
pub use note::{KV_IMM, KvNote, MAX_REQUEST_ID, NoteKind};

use crate::agent::{Agent, Notification, Peer, Region, Transfer};
use crate::error::{Error, Result};
use crate::handle::Handle;
use fabric_core::metadata::{AgentInfo, RegionDescriptor};
use fabric_core::plan::StridedRun;
use fabric_core::{Access, Fence, MemoryRegion};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a rank tells the other side's ranks about itself: enough to attach to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvRankInfo {
    /// Its side.
    pub side: Side,
    /// Its rank on that side.
    pub rank: u32,
    /// Its agent.
    pub agent: AgentInfo,
    /// Its cache's layout.
    pub layout: KvLayout,
    /// The descriptors of the regions holding its cache, by the layout's region index.
    pub regions: Vec<RegionDescriptor>,
}

/// A rank of the other side this one is attached to.
struct Attached {
    peer: Peer,
    regions: Vec<RegionDescriptor>,
}

/// What a rank heard of a request, from notes.
struct Heard {
    kind: NoteKind,
    layers: u32,
    /// Per layer: transfers that make it whole (0 until a note said), and those heard.
    expected: Vec<u32>,
    got: Vec<u64>,
    /// Layers whole, and whether [`KvRank::poll`] reported the request whole yet.
    whole: u32,
    reported: bool,
}

impl Heard {
    fn layer_whole(&self, layer: usize) -> bool {
        self.expected[layer] > 0 && self.got[layer] >= u64::from(self.expected[layer])
    }
}

#[derive(Default)]
struct Tracker {
    requests: HashMap<Vec<u8>, Heard>,
    /// Notifications that are not KV notes, for [`KvRank::other_notifications`].
    others: VecDeque<Notification>,
    /// Events not yet taken by [`KvRank::poll`].
    events: VecDeque<KvEvent>,
}

/// What [`KvRank::poll`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// A layer of a request is whole here (pushed into this decode rank, or read by
    /// every reader of this prefill rank).
    Layer {
        /// Push or pull.
        kind: NoteKind,
        /// The request.
        request: Vec<u8>,
        /// The layer.
        layer: u32,
    },
    /// Every layer of a request is.
    Request {
        /// Push or pull.
        kind: NoteKind,
        /// The request.
        request: Vec<u8>,
    },
}

/// One rank's end of KV transfers: see the [module documentation](self).
pub struct KvRank {
    agent: Agent,
    side: Side,
    rank: u32,
    regions: Vec<Region>,
    prefill: Vec<KvLayout>,
    decode: Vec<KvLayout>,
    peers: Mutex<Vec<Option<Arc<Attached>>>>,
    /// What the agent's KV notes said: shared by every rank over the same agent (a decode
    /// rank fed by several prefill instances is one rank per instance), since any of them
    /// may take a note meant for another.
    tracker: Arc<Mutex<Tracker>>,
}

/// The tracker of each agent (by instance) that KV ranks use.
static TRACKERS: Mutex<Vec<(u64, std::sync::Weak<Mutex<Tracker>>)>> = Mutex::new(Vec::new());

fn tracker_of(agent: &Agent) -> Arc<Mutex<Tracker>> {
    let id = agent.info().instance;
    let mut all = lock(&TRACKERS);
    all.retain(|(_, w)| w.strong_count() > 0);
    if let Some(t) = all
        .iter()
        .find(|(i, _)| *i == id)
        .and_then(|(_, w)| w.upgrade())
    {
        return t;
    }
    let t = Arc::new(Mutex::new(Tracker::default()));
    all.push((id, Arc::downgrade(&t)));
    t
}

impl std::fmt::Debug for KvRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRank")
            .field("side", &self.side)
            .field("rank", &self.rank)
            .field("regions", &self.regions.len())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn request_name(id: &[u8]) -> String {
    String::from_utf8_lossy(id).into_owned()
}

fn check_id(id: &[u8]) -> Result<()> {
    if id.is_empty() || id.len() > MAX_REQUEST_ID {
        return Err(Error::KvRequestId { len: id.len() });
    }
    Ok(())
}

/// The transfers one pair makes for one layer: per (prefill region, decode region), the
/// runs of every component held there.
fn layer_groups(
    pair: &PairPlan,
    prefill: &KvLayout,
    decode: &KvLayout,
    layer: u32,
    read: bool,
) -> Result<Vec<(u32, u32, Vec<StridedRun>)>> {
    let mut groups: Vec<(u32, u32, Vec<StridedRun>)> = Vec::with_capacity(1);
    for c in 0..prefill.components {
        let p = pair.placed(prefill, decode, layer, c)?;
        let at = match groups
            .iter()
            .position(|g| (g.0, g.1) == (p.prefill_region, p.decode_region))
        {
            Some(i) => i,
            None => {
                groups.push((p.prefill_region, p.decode_region, Vec::new()));
                groups.len() - 1
            }
        };
        if read {
            groups[at].2.extend(p.read_runs());
        } else {
            groups[at].2.extend(p.write_runs());
        }
    }
    Ok(groups)
}

/// How many distinct (prefill region, decode region) pairs a layer's components use.
fn region_pairs(prefill: &KvLayout, decode: &KvLayout, layer: u32) -> Result<u32> {
    let mut seen: Vec<(u32, u32)> = Vec::with_capacity(2);
    for c in 0..prefill.components {
        let k = (
            prefill.place(layer, c)?.region,
            decode.place(layer, c)?.region,
        );
        if !seen.contains(&k) {
            seen.push(k);
        }
    }
    Ok(seen.len() as u32)
}

impl KvRank {
    /// Registers `memory` (the regions holding this rank's cache, by `layout`'s region
    /// index) with `agent` and makes rank `rank` of `side` (see [`new`](Self::new)). A
    /// prefill cache is registered readable by peers (for pulls), a decode cache writable
    /// by them (for pushes) and locally (for pulls).
    pub fn register(
        agent: Agent,
        side: Side,
        rank: u32,
        memory: Vec<Arc<dyn MemoryRegion>>,
        prefill: Vec<KvLayout>,
        decode: Vec<KvLayout>,
    ) -> Result<KvRank> {
        let mut regions = Vec::with_capacity(memory.len());
        for m in memory {
            regions.push(agent.register(m, Self::access(side))?);
        }
        KvRank::new(agent, side, rank, regions, prefill, decode)
    }

    /// The access a rank's cache regions need: peers read a prefill cache (pulls); peers
    /// write a decode cache (pushes), and its own reads land in it (pulls).
    pub fn access(side: Side) -> Access {
        match side {
            Side::Prefill => Access::REMOTE_READ,
            Side::Decode => Access::REMOTE_WRITE | Access::LOCAL_WRITE,
        }
    }

    /// Rank `rank` of `side` over `regions` (this rank's cache, by its layout's region
    /// index, registered with `agent` with at least [`access`](Self::access)), given every
    /// rank's layout of both sides (`prefill[p]`, `decode[d]`).
    pub fn new(
        agent: Agent,
        side: Side,
        rank: u32,
        regions: Vec<Region>,
        prefill: Vec<KvLayout>,
        decode: Vec<KvLayout>,
    ) -> Result<KvRank> {
        let mine = match side {
            Side::Prefill => &prefill,
            Side::Decode => &decode,
        };
        let layout = mine.get(rank as usize).ok_or(Error::KvNoSuchRank {
            side,
            rank,
            ranks: mine.len(),
        })?;
        for l in prefill.iter().chain(&decode) {
            l.validate()?;
        }
        for r in &regions {
            agent.check_region(r)?;
        }
        let lens: Vec<u64> = regions.iter().map(|r| r.len()).collect();
        layout.validate_regions(&lens)?;
        let others = match side {
            Side::Prefill => decode.len(),
            Side::Decode => prefill.len(),
        };
        Ok(KvRank {
            side,
            rank,
            regions,
            prefill,
            decode,
            peers: Mutex::new(vec![None; others]),
            tracker: tracker_of(&agent),
            agent,
        })
    }

    /// What the other side's ranks need to attach to this one.
    pub fn info(&self) -> KvRankInfo {
        KvRankInfo {
            side: self.side,
            rank: self.rank,
            agent: self.agent.info().clone(),
            layout: self.layout().clone(),
            regions: self
                .regions
                .iter()
                .map(|r| r.descriptor().clone())
                .collect(),
        }
    }

    /// This rank's layout.
    pub fn layout(&self) -> &KvLayout {
        match self.side {
            Side::Prefill => &self.prefill[self.rank as usize],
            Side::Decode => &self.decode[self.rank as usize],
        }
    }

    /// The agent under it.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// Connects to a rank of the other side (and names it in notifications): its layout
    /// must be the one this rank was given for it, and it must describe a region for each
    /// of its layout's region indices. Attaching again replaces the earlier connection.
    pub fn attach(&self, info: &KvRankInfo) -> Result<()> {
        let (want_side, layouts) = match self.side {
            Side::Prefill => (Side::Decode, &self.decode),
            Side::Decode => (Side::Prefill, &self.prefill),
        };
        let expected = layouts.get(info.rank as usize);
        if info.side != want_side || expected != Some(&info.layout) {
            return Err(Error::KvPeerLayout {
                side: info.side,
                rank: info.rank,
            });
        }
        let lens: Vec<u64> = info.regions.iter().map(|r| r.len).collect();
        info.layout.validate_regions(&lens)?;
        let peer = self.agent.connect(&info.agent)?;
        self.agent.know(&info.agent);
        lock(&self.peers)[info.rank as usize] = Some(Arc::new(Attached {
            peer,
            regions: info.regions.clone(),
        }));
        Ok(())
    }

    fn attached(&self, side: Side, rank: u32) -> Result<Arc<Attached>> {
        lock(&self.peers)
            .get(rank as usize)
            .cloned()
            .flatten()
            .ok_or(Error::KvNotAttached { side, rank })
    }

    /// Plans `req` between every prefill and every decode rank (deterministic: every rank
    /// plans the same).
    pub fn plan(&self, req: &KvRequest) -> Result<KvPlan> {
        Ok(plan(&self.prefill, &self.decode, req)?)
    }

    /// Layers of the model.
    pub fn layers(&self) -> u32 {
        self.layout().num_layers
    }

    /// Prefill: WRITEs layer `layer` of request `id` into every decode rank the plan sends
    /// this rank's share to, after `after` (the CUDA event recorded when the layer was
    /// saved) if given. One strided transfer per (decode rank, region pair), each telling
    /// its decode rank with a [`KvNote`] once its bytes are placed.
    pub fn push_layer(
        &self,
        id: &[u8],
        plan: &KvPlan,
        layer: u32,
        after: Option<Arc<dyn Fence>>,
    ) -> Result<KvTransfers> {
        self.must_be(Side::Prefill, "push")?;
        let mut out = KvTransfers::new(id);
        self.post_into(&mut out, plan, layer, after)?;
        Ok(out)
    }

    /// Prefill: every layer of request `id` (see [`push_layer`](Self::push_layer)).
    pub fn push(
        &self,
        id: &[u8],
        plan: &KvPlan,
        after: Option<Arc<dyn Fence>>,
    ) -> Result<KvTransfers> {
        self.must_be(Side::Prefill, "push")?;
        let mut out = KvTransfers::new(id);
        for layer in 0..self.layers() {
            self.post_into(&mut out, plan, layer, after.clone())?;
        }
        Ok(out)
    }

    /// Posts one layer of a request: this rank's pairs, one transfer per region pair,
    /// WRITEs from a prefill rank (`Landed` notes) or READs from a decode rank (`Read`
    /// notes, to the prefill rank read from).
    fn post_into(
        &self,
        out: &mut KvTransfers,
        plan: &KvPlan,
        layer: u32,
        after: Option<Arc<dyn Fence>>,
    ) -> Result<()> {
        check_id(&out.id)?;
        self.check_layer(layer)?;
        let pull = self.side == Side::Decode;
        let (kind, other) = match self.side {
            Side::Prefill => (NoteKind::Landed, Side::Decode),
            Side::Decode => (NoteKind::Read, Side::Prefill),
        };
        let pairs: Vec<&PairPlan> = if pull {
            plan.pairs_to(self.rank).collect()
        } else {
            plan.pairs_from(self.rank).collect()
        };
        for pair in pairs {
            let (p, d) = (pair.prefill, pair.decode);
            let them = if pull { p } else { d };
            let peer = self.attached(other, them)?;
            // The receiver's transfers for the layer, from every rank of this side.
            let expected = if pull {
                self.expected(plan.pairs_from(p), layer)?
            } else {
                self.expected(plan.pairs_to(d), layer)?
            };
            let note = KvNote {
                kind,
                request: out.id.clone(),
                layer,
                layers: self.layers(),
                expected,
            }
            .encode();
            let (pl, dl) = (self.prefill_layout(p)?, self.decode_layout(d)?);
            for (pr, dr, runs) in layer_groups(pair, pl, dl, layer, pull)? {
                let (mine, theirs) = if pull { (dr, pr) } else { (pr, dr) };
                let local = self.region(mine)?;
                let remote = peer
                    .regions
                    .get(theirs as usize)
                    .ok_or(Error::KvNoSuchRegion {
                        side: other,
                        rank: them,
                        region: theirs,
                    })?;
                let mut t = Transfer::runs(runs).imm(KV_IMM).message(note.clone());
                if pull {
                    t = t.read();
                }
                if let Some(f) = &after {
                    t = t.after(f.clone());
                }
                let h = self
                    .agent
                    .submit(&peer.peer, local, remote, t)
                    .map_err(|e| out.failure(Some(layer), Some(them), e))?;
                out.handles.push((layer, them, h));
            }
        }
        Ok(())
    }

    /// Decode: READs layer `layer` of request `id` from every prefill rank the plan takes
    /// this rank's share from; each read tells its prefill rank with a [`KvNote`] of kind
    /// [`NoteKind::Read`] once its bytes are here. The handles say when the bytes landed.
    pub fn pull_layer(&self, id: &[u8], plan: &KvPlan, layer: u32) -> Result<KvTransfers> {
        self.must_be(Side::Decode, "pull")?;
        let mut out = KvTransfers::new(id);
        self.post_into(&mut out, plan, layer, None)?;
        Ok(out)
    }

    /// Decode: every layer of request `id` (see [`pull_layer`](Self::pull_layer)).
    pub fn pull(&self, id: &[u8], plan: &KvPlan) -> Result<KvTransfers> {
        self.must_be(Side::Decode, "pull")?;
        let mut out = KvTransfers::new(id);
        for layer in 0..self.layers() {
            self.post_into(&mut out, plan, layer, None)?;
        }
        Ok(out)
    }

    /// Transfers that make `layer` whole at the receiver of `pairs`.
    fn expected<'a>(&self, pairs: impl Iterator<Item = &'a PairPlan>, layer: u32) -> Result<u32> {
        let mut n = 0;
        for q in pairs {
            let (p, d) = (
                self.prefill_layout(q.prefill)?,
                self.decode_layout(q.decode)?,
            );
            n += region_pairs(p, d, layer)?;
        }
        Ok(n)
    }

    fn prefill_layout(&self, rank: u32) -> Result<&KvLayout> {
        self.prefill.get(rank as usize).ok_or(Error::KvNoSuchRank {
            side: Side::Prefill,
            rank,
            ranks: self.prefill.len(),
        })
    }

    fn decode_layout(&self, rank: u32) -> Result<&KvLayout> {
        self.decode.get(rank as usize).ok_or(Error::KvNoSuchRank {
            side: Side::Decode,
            rank,
            ranks: self.decode.len(),
        })
    }

    fn region(&self, index: u32) -> Result<&Region> {
        self.regions
            .get(index as usize)
            .ok_or(Error::KvNoSuchRegion {
                side: self.side,
                rank: self.rank,
                region: index,
            })
    }

    fn must_be(&self, side: Side, what: &'static str) -> Result<()> {
        if self.side != side {
            return Err(Error::KvWrongSide { what, side });
        }
        Ok(())
    }

    fn check_layer(&self, layer: u32) -> Result<()> {
        if layer >= self.layers() {
            return Err(Error::KvNoSuchLayer {
                layer,
                layers: self.layers(),
            });
        }
        Ok(())
    }

    /// Counts a notification: a KV note goes to its request, anything else to the others.
    fn record(t: &mut Tracker, n: Notification) {
        let note = match (n.imm, n.message.as_deref().and_then(KvNote::decode)) {
            (KV_IMM, Some(note)) => note,
            _ => {
                t.others.push_back(n);
                return;
            }
        };
        let layers = note.layers as usize;
        let h = t
            .requests
            .entry(note.request.clone())
            .or_insert_with(|| Heard {
                kind: note.kind,
                layers: note.layers,
                expected: vec![0; layers],
                got: vec![0; layers],
                whole: 0,
                reported: false,
            });
        if h.layers != note.layers || h.kind != note.kind {
            tracing::warn!(
                request = %request_name(&note.request),
                "a KV note disagrees with the request's earlier ones (layers or kind): ignored"
            );
            return;
        }
        let l = note.layer as usize;
        let was = h.layer_whole(l);
        if h.expected[l] == 0 {
            h.expected[l] = note.expected;
        }
        h.got[l] += n.count;
        if !was && h.layer_whole(l) {
            h.whole += 1;
            t.events.push_back(KvEvent::Layer {
                kind: note.kind,
                request: note.request.clone(),
                layer: note.layer,
            });
            if h.whole == h.layers && !h.reported {
                h.reported = true;
                t.events.push_back(KvEvent::Request {
                    kind: note.kind,
                    request: note.request,
                });
            }
        }
    }

    /// Takes the agent's notifications there are now (waiting up to `wait` for one).
    fn pump(&self, wait: Duration) -> Result<()> {
        let first = if wait.is_zero() {
            self.agent.try_notification()
        } else {
            match self.agent.next_notification(wait) {
                Ok(n) => Some(n),
                Err(e) if e.kind() == crate::ErrorKind::TimedOut => None,
                Err(e) => return Err(e),
            }
        };
        let mut t = lock(&self.tracker);
        for n in first
            .into_iter()
            .chain(std::iter::from_fn(|| self.agent.try_notification()))
        {
            Self::record(&mut t, n);
        }
        Ok(())
    }

    /// What became whole here since the last call: layers and requests (pushed into this
    /// decode rank, or read from this prefill rank by all its readers). Never blocks.
    pub fn poll(&self) -> Result<Vec<KvEvent>> {
        self.pump(Duration::ZERO)?;
        Ok(lock(&self.tracker).events.drain(..).collect())
    }

    /// Waits until every layer of request `id` is whole here (pushed into this decode
    /// rank; on a prefill rank, read by every reader), at most `timeout`.
    pub fn wait(&self, id: &[u8], timeout: Duration) -> Result<()> {
        self.wait_for(id, None, timeout)
    }

    /// Waits until layer `layer` of request `id` is whole here, at most `timeout`.
    pub fn wait_layer(&self, id: &[u8], layer: u32, timeout: Duration) -> Result<()> {
        self.check_layer(layer)?;
        self.wait_for(id, Some(layer), timeout)
    }

    fn wait_for(&self, id: &[u8], layer: Option<u32>, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let t = lock(&self.tracker);
                let h = t.requests.get(id);
                let done = match (h, layer) {
                    (Some(h), None) => h.whole == h.layers,
                    (Some(h), Some(l)) => h.layer_whole(l as usize),
                    (None, _) => false,
                };
                if done {
                    return Ok(());
                }
                if Instant::now() >= deadline {
                    let (whole, layers) = h.map_or((0, self.layers()), |h| (h.whole, h.layers));
                    return Err(Error::KvNotLanded {
                        request: request_name(id),
                        layer,
                        whole,
                        layers,
                        waited: timeout,
                    });
                }
            }
            // A slice: another thread may take this request's notes meanwhile.
            let left = deadline.saturating_duration_since(Instant::now());
            self.pump(left.min(Duration::from_millis(1)))?;
        }
    }

    /// Forgets what was heard of request `id` (once the application is done with it).
    pub fn forget(&self, id: &[u8]) {
        lock(&self.tracker).requests.remove(id);
    }

    /// Notifications of the agent that were not KV notes, taken meanwhile.
    pub fn other_notifications(&self) -> Vec<Notification> {
        lock(&self.tracker).others.drain(..).collect()
    }
}

/// A request's transfers from one rank ([`KvRank::push`], [`KvRank::pull`]): wait for all
/// of them, or cancel them.
#[derive(Debug)]
pub struct KvTransfers {
    id: Vec<u8>,
    /// (layer, the other side's rank, handle).
    handles: Vec<(u32, u32, Handle)>,
}

impl KvTransfers {
    fn new(id: &[u8]) -> KvTransfers {
        KvTransfers {
            id: id.to_vec(),
            handles: Vec::new(),
        }
    }

    fn failure(&self, layer: Option<u32>, peer: Option<u32>, e: Error) -> Error {
        Error::KvRequest {
            request: request_name(&self.id),
            layer,
            peer,
            source: Box::new(e),
        }
    }

    /// The request's id.
    pub fn id(&self) -> &[u8] {
        &self.id
    }

    /// How many transfers (strided, one per peer rank, layer and region pair).
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether there are none (this rank moves nothing of the request).
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Adds `other`'s transfers (another layer of the same request).
    pub fn extend(&mut self, other: KvTransfers) {
        self.handles.extend(other.handles);
    }

    /// Whether every transfer has finished (either way).
    pub fn is_finished(&self) -> bool {
        self.handles.iter().all(|(_, _, h)| h.is_finished())
    }

    /// Waits for every transfer, at most `timeout` in all. On a failure it still waits
    /// for the others (within `timeout`) and then reports the first, naming the request,
    /// the layer and the peer rank ([`Error::KvRequest`]): once it returns with every
    /// transfer finished, no transport touches the request's memory any more. A wait that
    /// runs out ends only the wait (the error's source is `TimedOut` or `PeerStalled`).
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut first: Option<Error> = None;
        for (layer, peer, h) in &self.handles {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Err(e) = h.wait(left)
                && first.is_none()
            {
                first = Some(self.failure(Some(*layer), Some(*peer), e));
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Cancels every transfer not finished (see [`Handle::cancel`]).
    pub fn cancel(&self) {
        for (_, _, h) in &self.handles {
            h.cancel();
        }
    }
}
