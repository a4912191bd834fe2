//! [`Agent`]: the one object a user holds. It owns its transports (each a rail group on its
//! NICs, its workers pinned), registers memory on all of them, connects to peers over the
//! best transport both offer, moves data and reports what arrived.

use crate::error::{Error, OptionName, Result};
use crate::handle::Handle;
use crate::lanes::{self, Lane};
use crate::layers::AgentLayers;
use crate::nics::{self, NicChoice};
use crate::options::{AgentOptions, MemoryKind, Role, TransportChoice};
use crate::placement::{CorePin, WorkerPins};
use fabric_core::engine::{
    Direction, GroupPeer, GroupRegistration, GroupStats, GroupTransfer, Notifications, RailGroup,
};
use fabric_core::metadata::{AgentInfo, RegionDescriptor, TransportInfo, TransportKind};
use fabric_core::plan::StridedRun;
use fabric_core::{Access, Fence, Invalid, MemoryLocation, MemoryRegion};
use std::collections::{BTreeMap, HashMap};
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The transport two agents use: the first of cuda-ipc (both hold GPU memory and run on
/// one host, by boot id, in one network namespace), efa, tcp, mem (one process) that both
/// offer. Both sides compute
/// the same answer from each other's [`AgentInfo`], so neither has to tell the other.
pub fn resolve(ours: &AgentInfo, theirs: &AgentInfo) -> Result<TransportKind> {
    let both = |k: TransportKind| ours.transport(k).is_some() && theirs.transport(k).is_some();
    let gpu = |a: &AgentInfo| matches!(a.memory, MemoryLocation::Cuda { .. });
    let pick = TransportKind::ALL.into_iter().find(|&k| {
        both(k)
            && match k {
                TransportKind::CudaIpc => {
                    ours.same_net_namespace(theirs) && gpu(ours) && gpu(theirs)
                }
                _ => true,
            }
    });
    pick.ok_or_else(|| {
        let list = |a: &AgentInfo| {
            let v: Vec<&str> = a.transports.iter().map(|t| t.kind.name()).collect();
            if v.is_empty() {
                "nothing".to_owned()
            } else {
                v.join(", ")
            }
        };
        Error::NoCommonTransport {
            peer: theirs.name.clone(),
            theirs: list(theirs),
            ours: list(ours),
        }
    })
}

/// Why [`resolve`] gives `kind` between `ours` and `theirs`, in words for people (a run's
/// summary): what of the two agents made it the first transport both offer.
pub fn resolve_reason(ours: &AgentInfo, theirs: &AgentInfo, kind: TransportKind) -> &'static str {
    let either = |k: TransportKind| ours.transport(k).is_some() || theirs.transport(k).is_some();
    let gpu = |a: &AgentInfo| matches!(a.memory, MemoryLocation::Cuda { .. });
    match kind {
        TransportKind::Tcp
            if ours.same_host(theirs)
                && !ours.same_net_namespace(theirs)
                && gpu(ours)
                && gpu(theirs) =>
        {
            "GPU memory on one host, but in two network namespaces (cuda-ipc needs one)"
        }
        TransportKind::CudaIpc => "GPU memory on both sides of one host",
        TransportKind::Efa => "EFA on both sides",
        TransportKind::Tcp if either(TransportKind::Efa) => {
            "not GPU memory on one host, and EFA on one side only"
        }
        TransportKind::Tcp => "not GPU memory on one host",
        TransportKind::Mem => "both in one process, with nothing else in common",
    }
}

/// How many agents this process has made, for default names.
static AGENTS: AtomicU64 = AtomicU64::new(0);

/// What an agent is and holds; shared by its handles.
struct Inner {
    info: AgentInfo,
    lanes: Vec<Lane>,
    notes: Notifications,
    /// The core whose NUMA node the agent's memory should come from.
    home: Option<CorePin>,
    regions: Mutex<Regions>,
    /// Agents this one knows (connected to, or was told of), by each of their rails'
    /// addresses: the names of notifications' senders.
    senders: Mutex<HashMap<Vec<u8>, String>>,
    /// When it was made, in milliseconds since the Unix epoch (its directory record's
    /// `started_ms`).
    started_ms: u64,
    /// Transfers' stall timeout unless they set their own.
    stall: Option<Duration>,
    /// What the agent counts of its peers' connections (reconnects, stale descriptors).
    counts: Arc<crate::metrics::AgentCounters>,
}

/// The agent's registrations, and what keeps foreign memory alive.
#[derive(Default)]
struct Regions {
    next: u64,
    /// What keeps each registration's memory alive (foreign memory: a Python buffer's
    /// view, say), with the region the transports hold.
    keep: HashMap<u64, Kept>,
    /// Keep-alives of deregistered regions that a transport still held: given back once
    /// none does.
    later: Vec<Kept>,
    /// Regions offered by name (to the rendezvous and the directory).
    named: BTreeMap<String, RegionDescriptor>,
}

/// A region's memory and what keeps it alive, released only when the region's `Arc` is the
/// last one (no transport can still touch it).
struct Kept {
    mem: Arc<dyn MemoryRegion>,
    keep: Option<Box<dyn Send>>,
}

impl Kept {
    /// Lets go of the memory if nothing else holds it and returns the keep-alive, for the
    /// caller to drop once it holds no lock (dropping a Python buffer view takes the
    /// interpreter's lock, which a thread waiting on ours may hold); else returns itself.
    /// Memory without a keep-alive owns itself (the `Arc`): the agent's reference goes at
    /// once, and the memory with the last one, the caller's or a transport's.
    fn release(self) -> std::result::Result<Option<Box<dyn Send>>, Kept> {
        if self.keep.is_some() && Arc::strong_count(&self.mem) > 1 {
            return Err(self);
        }
        let Kept { mem, keep } = self;
        // The memory goes first: nothing can reach it once the keep-alive is gone.
        drop(mem);
        Ok(keep)
    }
}

/// Releases what of `all` no transport holds: returns the keep-alives to drop (with no lock
/// held) and keeps the rest in `still`.
fn release_all(all: Vec<Kept>, still: &mut Vec<Kept>) -> Vec<Box<dyn Send>> {
    let mut free = Vec::new();
    for k in all {
        match k.release() {
            Ok(keep) => free.extend(keep),
            Err(k) => still.push(k),
        }
    }
    free
}

/// Keep-alives of agents that are gone while a transport still held their memory (a
/// worker stuck past its shutdown timeout keeps its transport): kept for the process, or
/// until no transport holds them ([`release_kept`]).
static KEPT: Mutex<Vec<Kept>> = Mutex::new(Vec::new());

/// Gives back the memory of gone agents that no transport holds any more; returns how many
/// are still kept. Every registration release calls it too.
pub fn release_kept() -> usize {
    let (free, left) = {
        let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
        let all = std::mem::take(&mut *kept);
        let free = release_all(all, &mut kept);
        (free, kept.len())
    };
    drop(free);
    left
}

/// Instances of this process's agents that offer the in-process `mem` transport: a peer
/// reached over `mem` must be one of them (its rail addresses mean nothing elsewhere).
static MEM_AGENTS: Mutex<Vec<u64>> = Mutex::new(Vec::new());

impl Inner {
    /// Stops the lanes (their workers, within their shutdown timeout), then gives back what
    /// they no longer hold; what a stuck worker still holds is kept ([`KEPT`]). Returns how
    /// many regions are kept so. Idempotent: the second call finds nothing.
    fn shut_down(&mut self) -> usize {
        // The notifications hold the rails' engines too: they go first, so that dropping
        // the lanes drops the last handles and stops every worker (at once).
        self.notes = Notifications::new(Vec::new());
        self.lanes.clear();
        MEM_AGENTS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|&i| i != self.info.instance);
        let r = self.regions.get_mut().unwrap_or_else(|p| p.into_inner());
        let all: Vec<Kept> = r
            .keep
            .drain()
            .map(|(_, k)| k)
            .chain(r.later.drain(..))
            .collect();
        let mut stuck = Vec::new();
        let free = release_all(all, &mut stuck);
        drop(free);
        let n = stuck.len();
        if n > 0 {
            KEPT.lock().unwrap_or_else(|p| p.into_inner()).extend(stuck);
            tracing::warn!(
                stuck = n,
                "agent closed while a transport still holds {n} region(s): their memory is \
                 kept until it lets go, or for the rest of the process"
            );
        }
        n
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// An agent: it owns its transports, registers memory on all of them, connects to peers
/// over the best transport both offer, moves data and reports what arrived (see the
/// crate's example).
///
/// Cheap to clone (a handle); the agent stops when its last handle is dropped, or closed
/// ([`Agent::close`], which also says what a stuck transport still holds). Its regions' and
/// peers' handles do not keep it running.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

/// A region registered with an agent, on every transport it offers. A handle: it holds no
/// reference to the memory (the agent does, until the region is deregistered and no
/// transport holds it).
#[derive(Clone, Debug)]
pub struct Region {
    /// The instance of the agent that registered it.
    owner: u64,
    id: u64,
    /// The registration on each transport, in the agent's lane order.
    regs: Vec<(TransportKind, GroupRegistration)>,
    descriptor: RegionDescriptor,
}

impl Region {
    /// What a peer needs to reach this region (ship it: serde, or
    /// [`RegionDescriptor::to_bytes`]).
    pub fn descriptor(&self) -> &RegionDescriptor {
        &self.descriptor
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.descriptor.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.descriptor.len == 0
    }

    fn on(&self, kind: TransportKind) -> Result<&GroupRegistration> {
        self.regs
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, r)| r)
            .ok_or(Error::RegionNotOnTransport(kind))
    }
}

/// A peer an agent is connected to: over the best transport both offer
/// ([`transport`](Peer::transport)), and, where that transport moves GPU memory only
/// (cuda-ipc), also over the next one both offer, for host memory. Each transfer goes over
/// the first of them on which both its regions are registered.
///
/// The handle stays valid when the peer's connection drops: the agent reconnects before
/// the next transfer to it (see `docs/connections.md`), and every clone of the handle sees
/// the new connection.
#[derive(Clone, Debug)]
pub struct Peer {
    /// The instance of the agent that connected to it.
    owner: u64,
    info: AgentInfo,
    /// The transports it is reached by, the preferred first, as of `generation`.
    links: Links,
    /// The connection `links` belong to.
    generation: u64,
    /// The connection as it stands now, shared by every clone.
    cell: Arc<LinkCell>,
}

/// A peer's transports and their group peers, the preferred first.
type Links = Arc<[(TransportKind, GroupPeer)]>;

/// `LinkCell::state`'s bit for a connection found broken (a transfer failed with
/// `PeerUnreachable`): the next transfer reconnects first.
const BROKEN: u64 = 1;
/// `LinkCell::state`'s bit for a peer this agent disconnected: never reconnected.
const CLOSED: u64 = 2;
/// `LinkCell::state`'s generation is above these bits.
const GENERATION_SHIFT: u32 = 2;

/// A peer's connection as it stands, shared by every clone of its [`Peer`], by its
/// [`Prepared`] transfers and by the handles of its transfers (which mark it broken).
pub(crate) struct LinkCell {
    /// The peer's name, for errors and logs.
    name: String,
    /// `generation << GENERATION_SHIFT | CLOSED | BROKEN`: the generation counts the
    /// connections made to the peer (0 for [`Agent::connect`]'s, then one more per
    /// reconnect or [`Agent::update_peer`]). A transfer reads it once: equal to its
    /// handle's generation shifted, nothing happened since the handle was made.
    state: AtomicU64,
    /// The current connection: what a handle of an older generation reads, and what a
    /// reconnect replaces (under this lock, one reconnect at a time).
    now: Mutex<LinkNow>,
}

/// A peer's current connection.
struct LinkNow {
    links: Links,
    /// What the peer said about itself last (its addresses, its instance).
    info: AgentInfo,
    /// Its group peers were removed (by a reconnect that then failed to add them again).
    removed: bool,
}

impl std::fmt::Debug for LinkCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.load(Ordering::Relaxed);
        f.debug_struct("LinkCell")
            .field("peer", &self.name)
            .field("generation", &(s >> GENERATION_SHIFT))
            .field("broken", &(s & BROKEN != 0))
            .field("closed", &(s & CLOSED != 0))
            .finish()
    }
}

impl LinkCell {
    fn lock(&self) -> MutexGuard<'_, LinkNow> {
        self.now.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The peer's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// A transfer of connection `generation` failed with `e`: if the peer is unreachable
    /// or was removed under us (not by [`Agent::disconnect`]), the connection is marked
    /// broken, unless it was replaced since (a late failure of the old connection).
    pub(crate) fn note(&self, generation: u64, e: &fabric_core::OpError) {
        use fabric_core::OpError as O;
        if !matches!(e, O::PeerUnreachable { .. } | O::PeerRemoved(_)) {
            return;
        }
        let marked = self
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                (s >> GENERATION_SHIFT == generation && s & (BROKEN | CLOSED) == 0)
                    .then_some(s | BROKEN)
            });
        if marked.is_ok() {
            tracing::info!(peer = %self.name, error = %e, "connection to peer lost: reconnecting before its next transfer");
        }
    }
}

/// A peer's links for one transfer: the handle's own (nothing changed since it was made)
/// or the current ones.
enum LinksNow<'a> {
    Own(&'a Links),
    Now(Links),
}

impl Deref for LinksNow<'_> {
    type Target = [(TransportKind, GroupPeer)];
    fn deref(&self) -> &Self::Target {
        match self {
            LinksNow::Own(l) => l,
            LinksNow::Now(l) => l,
        }
    }
}

/// The first of `links` on which `local` and `remote` are both registered.
fn link_for<'a>(
    links: &'a [(TransportKind, GroupPeer)],
    local: &Region,
    remote: &RegionDescriptor,
) -> Result<&'a (TransportKind, GroupPeer)> {
    links
        .iter()
        .find(|(k, _)| local.on(*k).is_ok() && remote.on(*k).is_some())
        .ok_or(Error::RegionNotOnTransport(links[0].0))
}

impl Peer {
    /// What the peer said about itself (when this handle was made; after
    /// [`Agent::update_peer`], [`Agent::peer_info`] says what it says now).
    pub fn info(&self) -> &AgentInfo {
        &self.info
    }

    /// The transport this agent reaches it by (the best both offer, [`resolve`]).
    pub fn transport(&self) -> TransportKind {
        self.links[0].0
    }

    /// Every transport this agent reaches it by, the preferred first.
    pub fn transports(&self) -> Vec<TransportKind> {
        self.links.iter().map(|(k, _)| *k).collect()
    }

    /// How many times the agent has connected to it again (after a dropped connection,
    /// or [`Agent::update_peer`]).
    pub fn reconnects(&self) -> u64 {
        self.cell.state.load(Ordering::Acquire) >> GENERATION_SHIFT
    }
}

/// A transfer planned once ([`Agent::prepare`]) and started any number of times
/// ([`Agent::post`]). It belongs to the agent that prepared it.
#[derive(Clone, Debug)]
pub struct Prepared {
    owner: u64,
    kind: TransportKind,
    inner: fabric_core::engine::PreparedTransfer,
    /// Its stall timeout and its peer's name.
    stall: Option<(Duration, String)>,
    /// Its peer's connection, and the generation of it that it was planned on: a post
    /// after a reconnect is refused ([`Error::PreparedStale`]).
    cell: Arc<LinkCell>,
    generation: u64,
}

impl Prepared {
    /// The bytes each post moves.
    pub fn bytes(&self) -> u64 {
        self.inner.bytes()
    }

    /// The operations (writes or reads, after coalescing and splitting) each post makes.
    pub fn ops(&self) -> usize {
        self.inner.ops()
    }
}

/// Arrivals of a peer's immediate data ([`Transfer::imm`]): the value, how many times it
/// landed, and who sent it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The sender's name ([`AgentInfo::name`]), where this agent knows it: an agent it
    /// connected to, or was told of ([`Agent::know`]); `None` otherwise, or where the
    /// transport cannot tell senders apart (efa, cuda-ipc).
    pub sender: Option<String>,
    /// The immediate value.
    pub imm: u32,
    /// How many arrivals of this sender and value this is (1 from
    /// [`Agent::next_notification`]; identical messages of one sender are counted
    /// together too).
    pub count: u64,
    /// The bytes the sender attached ([`Transfer::message`]), `None` for plain immediate
    /// data.
    pub message: Option<Vec<u8>>,
}

/// The incarnation a peer's handshake announced at its addresses (tcp's CHALLENGE), where
/// it is not `known`: the peer restarted there since `known` was learned.
fn other_incarnation(links: &[(TransportKind, GroupPeer)], known: u64) -> Option<u64> {
    links
        .iter()
        .find_map(|(_, g)| g.announced)
        .filter(|&i| i != known)
}

/// A transfer's stall timeout and its peer's name.
type Stall = Option<(Duration, String)>;

/// A transfer between a local region and a peer's: segments, which way, and what goes
/// with it. Build it with [`Transfer::segments`] or [`Transfer::pages`], then the builder
/// methods.
#[derive(Clone, Debug, Default)]
pub struct Transfer {
    segments: Vec<(u64, u64, u64)>,
    runs: Vec<StridedRun>,
    imm: Option<u32>,
    message: Option<Arc<[u8]>>,
    timeout: Option<Duration>,
    stall: Option<Duration>,
    direction: Direction,
    after: Option<Arc<dyn Fence>>,
}

impl Transfer {
    /// `(local_offset, remote_offset, len)` triples.
    pub fn segments(segments: Vec<(u64, u64, u64)>) -> Transfer {
        Transfer {
            segments,
            ..Transfer::default()
        }
    }

    /// Rows at constant strides (see [`StridedRun`]): a strided piece of a tensor as one
    /// entry per run, not one per row. Where the backend has strided writes (cuda-ipc,
    /// mem) a WRITE's run is posted as such, so submitting it costs the same whatever its
    /// rows; elsewhere its rows are moved as segments.
    pub fn runs(runs: Vec<StridedRun>) -> Transfer {
        Transfer {
            runs,
            ..Transfer::default()
        }
    }

    /// Adds `runs` after the segments (see [`Transfer::runs`]).
    pub fn with_runs(mut self, runs: impl IntoIterator<Item = StridedRun>) -> Transfer {
        self.runs.extend(runs);
        self
    }

    /// Pages: local page `local[i]` (at `local[i] * local_stride`) and remote page
    /// `remote[i]` (at `remote[i] * remote_stride`), `len` bytes each.
    pub fn pages(
        local: &[u64],
        local_stride: u64,
        remote: &[u64],
        remote_stride: u64,
        len: u64,
    ) -> Result<Transfer> {
        if local.len() != remote.len() {
            return Err(Error::Engine(
                Invalid::PageCounts {
                    local: local.len(),
                    remote: remote.len(),
                }
                .into(),
            ));
        }
        if len > local_stride || len > remote_stride {
            return Err(Error::Engine(
                Invalid::PageExceedsStride {
                    len,
                    stride: local_stride.min(remote_stride),
                }
                .into(),
            ));
        }
        let mut segments = Vec::with_capacity(local.len());
        for (&l, &r) in local.iter().zip(remote) {
            let overflow = |side, page| Error::Engine(Invalid::PageOverflow { side, page }.into());
            let lo = l
                .checked_mul(local_stride)
                .ok_or_else(|| overflow("source", l))?;
            let ro = r
                .checked_mul(remote_stride)
                .ok_or_else(|| overflow("destination", r))?;
            segments.push((lo, ro, len));
        }
        Ok(Transfer::segments(segments))
    }

    /// Immediate data the peer is told once every byte of a WRITE has landed.
    pub fn imm(mut self, imm: u32) -> Transfer {
        self.imm = Some(imm);
        self
    }

    /// Bytes for the peer (a request id and what goes with it, at most
    /// [`MAX_MESSAGE`](fabric_core::engine::MAX_MESSAGE)), sent once every byte of the
    /// transfer is placed, a WRITE's or a READ's: the peer takes them as a
    /// [`Notification`] with its [`message`](Notification::message), naming us, with the
    /// immediate value given by [`imm`](Self::imm) (0 without). Never dropped: while the
    /// peer keeps too many untaken, our transfer waits for it to take some.
    pub fn message(mut self, bytes: impl Into<Vec<u8>>) -> Transfer {
        self.message = Some(Arc::from(bytes.into()));
        self
    }

    /// A wait on the transfer reports [`Error::PeerStalled`] once it has made no progress
    /// for `t` while the peer's connection stands (a stopped or descheduled process); the
    /// transfer goes on (see [`Handle::wait`]). Default: the agent's
    /// [`WorkerOptions::stall_timeout`](crate::WorkerOptions::stall_timeout).
    pub fn stall_timeout(mut self, t: Duration) -> Transfer {
        self.stall = Some(t);
        self
    }

    /// Fails with `TimedOut` if not done in time (reported only once no transport touches
    /// its memory).
    pub fn timeout(mut self, t: Duration) -> Transfer {
        self.timeout = Some(t);
        self
    }

    /// Makes it a READ: the peer's bytes land in the local region.
    pub fn read(mut self) -> Transfer {
        self.direction = Direction::Read;
        self
    }

    /// Waits for `fence` (the caller's CUDA stream, say) before any transport touches the
    /// local memory: see `fabric_core::engine::Transfer` on ordering.
    pub fn after(mut self, fence: Arc<dyn Fence>) -> Transfer {
        self.after = Some(fence);
        self
    }
}

/// What an agent can tell about itself: each transport's rail group.
#[derive(Clone, Debug)]
pub struct AgentStats {
    /// Per transport, its group's stats.
    pub lanes: Vec<(TransportKind, GroupStats)>,
}

impl Agent {
    /// Builds an agent: its transports (all that can work here for
    /// [`TransportChoice::Auto`]), each with its rails on the chosen NICs and its workers
    /// pinned.
    pub fn new(o: AgentOptions) -> Result<Agent> {
        <Agent as AgentLayers>::with_pins(o, None)
    }

    /// The agent of `info` over `lanes`.
    fn assemble(info: AgentInfo, lanes: Vec<Lane>, home: Option<CorePin>) -> Agent {
        if lanes.iter().any(|l| l.kind == TransportKind::Mem) {
            MEM_AGENTS
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(info.instance);
        }
        let inboxes = lanes
            .iter()
            .flat_map(|l| l.group.rails().iter().map(|e| e.inbox().clone()))
            .collect();
        Agent {
            inner: Arc::new(Inner {
                info,
                notes: Notifications::new(inboxes),
                senders: Mutex::new(HashMap::new()),
                lanes,
                home,
                regions: Mutex::new(Regions::default()),
                started_ms: now_ms(),
                stall: None,
                counts: Arc::default(),
            }),
        }
    }

    /// Stops the agent now if this is its last handle: its workers stop (each within its
    /// shutdown timeout) and its regions' memory (and keep-alives, see
    /// [`register_kept`](Self::register_kept)) is given back where no transport holds it.
    /// Returns how many regions a transport still holds (a worker stuck in its transport
    /// past its shutdown timeout keeps it): their memory is kept until the transport lets go
    /// ([`release_kept`]), or for the rest of the process. `None` when other handles remain:
    /// the agent stops when the last one goes.
    pub fn close(self) -> Option<usize> {
        Arc::try_unwrap(self.inner)
            .ok()
            .map(|mut inner| inner.shut_down())
    }

    /// What this agent says about itself: ship it to peers (serde, or
    /// [`AgentInfo::to_bytes`]), who pass it to [`Agent::connect`].
    pub fn info(&self) -> &AgentInfo {
        &self.inner.info
    }

    /// When it was made, in milliseconds since the Unix epoch.
    pub(crate) fn started_ms(&self) -> u64 {
        self.inner.started_ms
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.inner.info.name
    }

    /// The transports it offers, in the order they are tried.
    pub fn transports(&self) -> Vec<TransportKind> {
        self.inner.lanes.iter().map(|l| l.kind).collect()
    }

    fn lane(&self, kind: TransportKind) -> Result<&Lane> {
        self.inner
            .lanes
            .iter()
            .find(|l| l.kind == kind)
            .ok_or(Error::RegionNotOnTransport(kind))
    }

    /// Whether `region` is this agent's (else [`Error::ForeignHandle`]). Every call that
    /// takes a region checks this itself.
    pub fn check_region(&self, region: &Region) -> Result<()> {
        self.own(region.owner, "region")
    }

    /// Whether `peer` is this agent's (else [`Error::ForeignHandle`]). Every call that
    /// takes a peer checks this itself.
    pub fn check_peer(&self, peer: &Peer) -> Result<()> {
        self.own(peer.owner, "peer")
    }

    /// Refuses a handle (`owner`: the instance of the agent that made it) of another agent.
    fn own(&self, owner: u64, what: &'static str) -> Result<()> {
        if owner == self.inner.info.instance {
            Ok(())
        } else {
            Err(Error::ForeignHandle {
                what,
                owner,
                agent: self.inner.info.name.clone(),
            })
        }
    }

    fn regions(&self) -> MutexGuard<'_, Regions> {
        self.inner.regions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `mem` on every transport of the agent, allowing `access` (peers may
    /// write it with [`Access::REMOTE_WRITE`], read it with [`Access::REMOTE_READ`]; this
    /// agent's READs land in it with [`Access::LOCAL_WRITE`]).
    pub fn register(&self, mem: Arc<dyn MemoryRegion>, access: Access) -> Result<Region> {
        self.register_kept(mem, access, None)
    }

    /// As [`register`](Self::register), for memory someone else owns: `keep` (a Python
    /// buffer's view, a tensor) is held until the region is deregistered **and** no
    /// transport can still touch it, then dropped; never earlier, even when the agent is
    /// dropped while a transport still holds the region (then it is kept for the process).
    pub fn register_kept(
        &self,
        mem: Arc<dyn MemoryRegion>,
        access: Access,
        keep: Option<Box<dyn Send>>,
    ) -> Result<Region> {
        let mut regs: Vec<(TransportKind, GroupRegistration)> = Vec::new();
        let mut unsupported = None;
        for l in &self.inner.lanes {
            match l.group.register(mem.clone(), access) {
                Ok(r) => regs.push((l.kind, r)),
                // A transport that cannot hold this kind of memory (cuda-ipc and host memory
                // that peers reach) is left out of the region: its transfers go over
                // another transport of the agent's.
                Err(e) if crate::error::core_kind(&e) == crate::ErrorKind::Unsupported => {
                    tracing::debug!(transport = %l.kind, error = %e, "not registered on it");
                    unsupported.get_or_insert(e);
                }
                Err(e) => {
                    for (kind, r) in &regs {
                        if let Ok(l) = self.lane(*kind) {
                            let _ = l.group.deregister(r);
                        }
                    }
                    self.give_back(mem, keep);
                    return Err(e.into());
                }
            }
        }
        if regs.is_empty()
            && let Some(e) = unsupported
        {
            // No transport of the agent can hold it.
            self.give_back(mem, keep);
            return Err(e.into());
        }
        let descriptor = RegionDescriptor {
            version: fabric_core::metadata::METADATA_VERSION,
            owner: self.inner.info.instance,
            len: mem.len() as u64,
            memory: mem.location(),
            access: Access::from_bits_truncate(
                access.bits() & (Access::REMOTE_WRITE | Access::REMOTE_READ).bits(),
            ),
            transports: regs.iter().map(|(k, r)| (*k, r.remote.clone())).collect(),
        };
        let mut r = self.regions();
        r.next += 1;
        let id = r.next;
        r.keep.insert(id, Kept { mem, keep });
        Ok(Region {
            owner: self.inner.info.instance,
            id,
            regs,
            descriptor,
        })
    }

    /// Gives back the memory (and keep-alive) of a registration that failed: the
    /// keep-alive goes only once no transport holds the memory.
    fn give_back(&self, mem: Arc<dyn MemoryRegion>, keep: Option<Box<dyn Send>>) {
        if let Err(k) = (Kept { mem, keep }).release().map(drop) {
            self.regions().later.push(k);
        }
    }

    /// Deregisters `region` from every transport: fails with `RegionInUse` (and changes
    /// nothing) while transfers that use it are unfinished. Its memory (and keep-alive) is
    /// given back once no transport holds it. Regions offered by name under it are
    /// withdrawn.
    pub fn deregister(&self, region: &Region) -> Result<()> {
        self.own(region.owner, "region")?;
        for (kind, reg) in &region.regs {
            self.lane(*kind)?.group.deregister(reg)?;
        }
        let free = {
            let mut r = self.regions();
            r.named.retain(|_, d| d != &region.descriptor);
            if let Some(k) = r.keep.remove(&region.id) {
                r.later.push(k);
            }
            let later = std::mem::take(&mut r.later);
            release_all(later, &mut r.later)
        };
        // Dropped with no lock held (see `Kept::release`).
        drop(free);
        release_kept();
        Ok(())
    }

    /// Offers `region` under `name`: peers that rendezvous with this agent or find it in
    /// the directory see it among its regions.
    pub fn offer(&self, name: &str, region: &Region) -> Result<()> {
        self.own(region.owner, "region")?;
        self.regions()
            .named
            .insert(name.to_owned(), region.descriptor.clone());
        Ok(())
    }

    /// The regions offered by name.
    pub fn offered(&self) -> BTreeMap<String, RegionDescriptor> {
        self.regions().named.clone()
    }

    /// Connects to the agent `peer` describes, over the best transport both offer
    /// ([`resolve`]). Connecting to the same agent twice gives two peers.
    pub fn connect(&self, peer: &AgentInfo) -> Result<Peer> {
        peer.check()?;
        let kind = resolve(&self.inner.info, peer)?;
        if kind == TransportKind::Mem
            && !MEM_AGENTS
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&peer.instance)
        {
            return Err(Error::NotInThisProcess {
                peer: peer.name.clone(),
                kind,
            });
        }
        let mut kinds = vec![kind];
        if kind == TransportKind::CudaIpc {
            // cuda-ipc moves GPU memory only: host memory goes over the next transport both
            // offer (efa, tcp), connected too.
            let next = TransportKind::ALL.into_iter().find(|&k| {
                !matches!(k, TransportKind::CudaIpc | TransportKind::Mem)
                    && self.inner.info.transport(k).is_some()
                    && peer.transport(k).is_some()
            });
            kinds.extend(next);
        }
        let links = self.add_links(peer, &kinds)?;
        let mut info = peer.clone();
        // Another incarnation than `peer` says answered at its addresses (it restarted
        // since `peer` was taken): that one is the peer, and descriptors of the one `peer`
        // describes are refused.
        if let Some(i) = other_incarnation(&links, info.instance) {
            tracing::warn!(
                peer = %info.name,
                described_instance = format_args!("{:016x}", info.instance),
                instance = format_args!("{i:016x}"),
                "another incarnation of the peer answered: its descriptors are refused"
            );
            info.instance = i;
        }
        self.know(&info);
        let links: Links = links.into();
        Ok(Peer {
            owner: self.inner.info.instance,
            info: info.clone(),
            links: links.clone(),
            generation: 0,
            cell: Arc::new(LinkCell {
                name: peer.name.clone(),
                state: AtomicU64::new(0),
                now: Mutex::new(LinkNow {
                    links,
                    info,
                    removed: false,
                }),
            }),
        })
    }

    /// Adds `peer` to the rail group of each of `kinds`: all or none.
    fn add_links(
        &self,
        peer: &AgentInfo,
        kinds: &[TransportKind],
    ) -> Result<Vec<(TransportKind, GroupPeer)>> {
        let mut links = Vec::with_capacity(kinds.len());
        for &k in kinds {
            let addresses = &peer
                .transport(k)
                .ok_or(Error::RegionNotOnTransport(k))?
                .rails;
            let lane = self.lane(k)?;
            match lane.group.add_peer(addresses) {
                Ok(g) => links.push((k, g)),
                Err(e) => {
                    for (k, g) in &links {
                        if let Ok(l) = self.lane(*k) {
                            let _ = l.group.remove_peer(g);
                        }
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(links)
    }

    /// The links a transfer to `peer` takes now: the handle's own while nothing happened
    /// to the connection (one atomic load), else the current ones, after connecting again
    /// if the connection was found broken. Also the peer's current instance.
    fn links_now<'a>(&self, peer: &'a Peer) -> Result<(LinksNow<'a>, u64, u64)> {
        let s = peer.cell.state.load(Ordering::Acquire);
        if s == peer.generation << GENERATION_SHIFT {
            return Ok((
                LinksNow::Own(&peer.links),
                peer.info.instance,
                peer.generation,
            ));
        }
        self.reconnect(&peer.cell, None)
            .map(|(l, i, g)| (LinksNow::Now(l), i, g))
    }

    /// Connects again to the peer of `cell` if its connection is broken (or to `info`, a
    /// new incarnation of it, if given), bounded by the control timeout of each rail; returns
    /// the current links, the peer's instance and the connection's generation. One at a
    /// time per peer: a transfer that finds the reconnect done uses it.
    fn reconnect(&self, cell: &LinkCell, info: Option<&AgentInfo>) -> Result<(Links, u64, u64)> {
        let mut now = cell.lock();
        let s = cell.state.load(Ordering::Acquire);
        let generation = s >> GENERATION_SHIFT;
        let renew = info.is_some_and(|i| *i != now.info);
        if (s & BROKEN == 0 && !renew) || s & CLOSED != 0 {
            return Ok((now.links.clone(), now.info.instance, generation));
        }
        let mut target = info.unwrap_or(&now.info).clone();
        let kinds: Vec<TransportKind> = now.links.iter().map(|(k, _)| *k).collect();
        if !now.removed {
            // The dead connection's group peers go: what was still in flight on them ends
            // with `PeerRemoved` (the transport had failed it already, as a rule).
            for (k, g) in now.links.iter() {
                if let Ok(l) = self.lane(*k) {
                    let _ = l.group.remove_peer(g);
                }
            }
            now.removed = true;
        }
        let added = self.add_links(&target, &kinds);
        match added {
            Ok(links) => {
                // The peer's handshake says which incarnation answered at its addresses: one
                // other than we knew restarted there. Its descriptors of before are refused
                // from now on (`StaleDescriptor`), its new ones taken.
                let restarted = info
                    .is_none()
                    .then(|| other_incarnation(&links, target.instance))
                    .flatten();
                if let Some(i) = restarted {
                    tracing::warn!(
                        peer = %cell.name,
                        previous_instance = format_args!("{:016x}", target.instance),
                        instance = format_args!("{i:016x}"),
                        "peer restarted: descriptors of its previous incarnation are refused"
                    );
                    target.instance = i;
                }
                let links: Links = links.into();
                now.links = links.clone();
                now.removed = false;
                let old = std::mem::replace(&mut now.info, target);
                if renew || restarted.is_some() {
                    self.know(&now.info);
                }
                let next = generation + 1;
                cell.state
                    .store(next << GENERATION_SHIFT, Ordering::Release);
                self.inner.counts.reconnects.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    peer = %cell.name,
                    generation = next,
                    instance = format_args!("{:016x}", now.info.instance),
                    previous_instance = format_args!("{:016x}", old.instance),
                    "reconnected to peer"
                );
                Ok((links, now.info.instance, next))
            }
            Err(e) => {
                // Still broken: the next transfer tries again.
                cell.state.fetch_or(BROKEN, Ordering::AcqRel);
                self.inner
                    .counts
                    .reconnect_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(peer = %cell.name, error = %e, "reconnecting to peer failed");
                Err(Error::Reconnect {
                    peer: cell.name.clone(),
                    source: Box::new(e),
                })
            }
        }
    }

    /// The direct rendezvous: connects to the server at `addr` (an agent serving with
    /// [`crate::rendezvous::serve`]), says hello, and connects to it over the transport
    /// both offer. Returns the peer and what the server offered (its regions by name); a
    /// full server is asked again with back-off for up to `within`.
    pub fn rendezvous(
        &self,
        addr: std::net::SocketAddr,
        token: Option<&str>,
        within: Duration,
    ) -> Result<(Peer, crate::rendezvous::Welcome)> {
        let (_client, welcome) = crate::rendezvous::hello(
            addr,
            Duration::from_secs(5).min(within.max(Duration::from_millis(1))),
            within,
            &self.inner.info,
            None,
            token,
        )?;
        let peer = self.connect(&welcome.agent)?;
        Ok((peer, welcome))
    }

    /// Disconnects `peer`: its pending transfers fail with `PeerRemoved`, and the agent
    /// never connects to it again by itself.
    pub fn disconnect(&self, peer: &Peer) -> Result<()> {
        self.own(peer.owner, "peer")?;
        let now = peer.cell.lock();
        peer.cell.state.fetch_or(CLOSED, Ordering::AcqRel);
        if now.removed {
            return Ok(());
        }
        let mut first = None;
        for (k, g) in now.links.iter() {
            if let Err(e) = self.lane(*k).and_then(|l| Ok(l.group.remove_peer(g)?)) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Tells the agent that `peer` is now the agent `info` describes: a new incarnation of
    /// it (restarted under the same name, [`AgentInfo::instance`] new), learned from the
    /// directory, a rendezvous or the application's own exchange. The agent connects to
    /// `info`'s addresses (before this returns), and from then on refuses descriptors of
    /// the earlier incarnation ([`Error::StaleDescriptor`]) and prepared transfers made
    /// before ([`Error::PreparedStale`]). Nothing happens if `info` is what the agent
    /// knows already.
    pub fn update_peer(&self, peer: &Peer, info: &AgentInfo) -> Result<()> {
        self.own(peer.owner, "peer")?;
        info.check()?;
        if info.name != peer.cell.name {
            return Err(Error::PeerRenamed {
                peer: peer.cell.name.clone(),
                name: info.name.clone(),
            });
        }
        self.reconnect(&peer.cell, Some(info)).map(drop)
    }

    /// What `peer` said about itself last: [`Peer::info`], or the info given to
    /// [`update_peer`](Self::update_peer) since.
    pub fn peer_info(&self, peer: &Peer) -> AgentInfo {
        peer.cell.lock().info.clone()
    }

    /// `t` as the transfer of the lane `peer` is reached by, its handles checked to be ours,
    /// with the connection's generation.
    #[allow(clippy::type_complexity)]
    fn group_transfer<'a, 'p>(
        &'a self,
        peer: &'p Peer,
        local: &Region,
        remote: &RegionDescriptor,
        t: Transfer,
    ) -> Result<(&'a Lane, GroupTransfer, Stall, LinksNow<'p>, usize, u64)> {
        self.own(peer.owner, "peer")?;
        self.own(local.owner, "region")?;
        let (links, instance, generation) = self.links_now(peer)?;
        self.check_owner(peer, remote, instance)?;
        let stall = t
            .stall
            .or(self.inner.stall)
            .map(|d| (d, peer.info.name.clone()));
        let (kind, _) = link_for(&links, local, remote)?;
        let kind = *kind;
        let at = links.iter().position(|(k, _)| *k == kind).unwrap_or(0);
        let lane = self.lane(kind)?;
        let kind = &kind;
        let dst = remote
            .on(*kind)
            .ok_or(Error::RegionNotOnTransport(*kind))?
            .clone();
        let g = GroupTransfer {
            src: local.on(*kind)?.clone(),
            dst,
            segments: t.segments,
            runs: t.runs,
            imm: t.imm,
            message: t.message,
            timeout: t.timeout,
            direction: t.direction,
            after: t.after,
        };
        Ok((lane, g, stall, links, at, generation))
    }

    /// Submits `t` between `local` and the peer's region `remote`. Bad segments fail here,
    /// before anything moves. If the peer's connection was found broken (an earlier
    /// transfer failed with `PeerUnreachable`), the agent connects to it again first
    /// ([`Error::Reconnect`] if it cannot).
    pub fn submit(
        &self,
        peer: &Peer,
        local: &Region,
        remote: &RegionDescriptor,
        t: Transfer,
    ) -> Result<Handle> {
        let (lane, g, stall, links, at, generation) =
            self.group_transfer(peer, local, remote, t)?;
        let h = lane
            .group
            .submit(&links[at].1, g)
            .inspect_err(|e| self.note_failure(&peer.cell, generation, e))?;
        Ok(Handle::new(
            h,
            stall,
            Some((peer.cell.clone(), generation)),
            Some(self.inner.counts.clone()),
        ))
    }

    /// Refuses `remote` unless it is a region of the peer's current incarnation
    /// (`instance`): [`Error::StaleDescriptor`], counted, before anything moves.
    fn check_owner(&self, peer: &Peer, remote: &RegionDescriptor, instance: u64) -> Result<()> {
        if remote.owner == instance {
            return Ok(());
        }
        self.inner
            .counts
            .stale_descriptors
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            peer = %peer.cell.name,
            descriptor_instance = format_args!("{:016x}", remote.owner),
            peer_instance = format_args!("{instance:016x}"),
            "refused a descriptor of another incarnation of the peer"
        );
        Err(Error::StaleDescriptor {
            peer: peer.cell.name.clone(),
            descriptor_instance: remote.owner,
            peer_instance: instance,
        })
    }

    /// A call failed at once with `e`: an unreachable peer marks its connection broken.
    fn note_failure(&self, cell: &LinkCell, generation: u64, e: &fabric_core::Error) {
        match e {
            fabric_core::Error::Op(op) => cell.note(generation, op),
            fabric_core::Error::UnknownPeer(p) => {
                cell.note(generation, &fabric_core::OpError::PeerRemoved(*p));
            }
            _ => {}
        }
    }

    /// Checks and plans `t` between `local` and the peer's region `remote` once, for
    /// [`post`](Self::post) to start as many times as wanted with no planning at each: the
    /// same pages of the same regions every step (a weight sync's, a KV layer's). Bad
    /// segments fail here. A fence given with [`Transfer::after`] is not kept: each post
    /// takes its own ([`post_after`](Self::post_after)). It is planned on the peer's
    /// connection of now: once the agent has connected to the peer again (its connection
    /// dropped, or [`update_peer`](Self::update_peer)), posting it fails with
    /// [`Error::PreparedStale`]: prepare it again.
    pub fn prepare(
        &self,
        peer: &Peer,
        local: &Region,
        remote: &RegionDescriptor,
        t: Transfer,
    ) -> Result<Prepared> {
        let (lane, g, stall, links, at, generation) =
            self.group_transfer(peer, local, remote, t)?;
        Ok(Prepared {
            owner: self.inner.info.instance,
            kind: lane.kind,
            inner: lane.group.prepare(&links[at].1, g)?,
            stall,
            cell: peer.cell.clone(),
            generation,
        })
    }

    /// Starts a transfer [`prepare`](Self::prepare) planned: a transfer of its own, with
    /// its own handle and deadline. Fails if its local region was deregistered since, or
    /// with [`Error::PreparedStale`] if the agent has connected to its peer again since it
    /// was prepared (a broken connection is re-established here first).
    pub fn post(&self, p: &Prepared) -> Result<Handle> {
        self.post_after_maybe(p, None)
    }

    /// As [`post`](Self::post), waiting for `fence` (the caller's CUDA stream, say) before
    /// any transport touches the local memory.
    pub fn post_after(&self, p: &Prepared, fence: Arc<dyn Fence>) -> Result<Handle> {
        self.post_after_maybe(p, Some(fence))
    }

    fn post_after_maybe(&self, p: &Prepared, after: Option<Arc<dyn Fence>>) -> Result<Handle> {
        self.own(p.owner, "prepared transfer")?;
        let s = p.cell.state.load(Ordering::Acquire);
        if s != p.generation << GENERATION_SHIFT {
            // Something happened to the connection: reconnect if it broke, then refuse a
            // plan of an older connection (its group peer ids are gone).
            let (_, _, generation) = self.reconnect(&p.cell, None)?;
            if generation != p.generation {
                return Err(Error::PreparedStale {
                    peer: p.cell.name.clone(),
                    prepared: p.generation,
                    now: generation,
                });
            }
        }
        let lane = self.lane(p.kind)?;
        let h = lane
            .group
            .post(&p.inner, after)
            .inspect_err(|e| self.note_failure(&p.cell, p.generation, e))?;
        Ok(Handle::new(
            h,
            p.stall.clone(),
            Some((p.cell.clone(), p.generation)),
            Some(self.inner.counts.clone()),
        ))
    }

    /// Warm-up: a zero-length write on every rail toward `peer`'s `remote` region, so that
    /// every connection is up before timed work starts; no byte changes.
    pub fn warm_up(
        &self,
        peer: &Peer,
        local: &Region,
        remote: &RegionDescriptor,
        timeout: Duration,
    ) -> Result<()> {
        self.own(peer.owner, "peer")?;
        self.own(local.owner, "region")?;
        let (links, instance, _) = self.links_now(peer)?;
        self.check_owner(peer, remote, instance)?;
        let (kind, group) = link_for(&links, local, remote)?;
        let dst = remote.on(*kind).ok_or(Error::RegionNotOnTransport(*kind))?;
        Ok(self
            .lane(*kind)?
            .group
            .warm_up(group, local.on(*kind)?, dst, timeout)?)
    }

    /// Waits until `count` transfers carrying immediate value `imm` have landed here (over
    /// any transport), or `timeout` passes.
    pub fn wait_imm(&self, imm: u32, count: u64, timeout: Duration) -> Result<()> {
        Ok(self.inner.notes.wait_imm(imm, count, timeout)?)
    }

    /// The next notification (one arrival of a peer's immediate data, the oldest sender
    /// and value first), waiting at most `timeout`. Arrivals are counted where they land,
    /// never dropped however late the application looks, and each is taken once by
    /// whichever of [`wait_imm`](Self::wait_imm), this,
    /// [`try_notification`](Self::try_notification) or
    /// [`notifications`](Self::notifications) comes first: they can be mixed.
    pub fn next_notification(&self, timeout: Duration) -> Result<Notification> {
        let n = self.inner.notes.next(timeout)?;
        Ok(self.notification(n))
    }

    /// The oldest notification not yet taken, if any, without waiting.
    pub fn try_notification(&self) -> Option<Notification> {
        self.inner.notes.try_next().map(|n| self.notification(n))
    }

    /// Every notification not yet taken, each sender and value once with its count, oldest
    /// first.
    pub fn notifications(&self) -> Vec<Notification> {
        let all = self.inner.notes.drain();
        all.into_iter().map(|n| self.notification(n)).collect()
    }

    /// How many arrivals of immediate value `imm` are here, not yet taken.
    pub fn imm_count(&self, imm: u32) -> u64 {
        self.inner.notes.count(imm)
    }

    /// Tells this agent of `peer` without connecting to it, so that notifications it sends
    /// name it ([`Notification::sender`]). [`connect`](Self::connect) does this too.
    pub fn know(&self, peer: &AgentInfo) {
        let mut s = self.inner.senders.lock().unwrap_or_else(|p| p.into_inner());
        for t in &peer.transports {
            for a in &t.rails {
                s.insert(a.clone(), peer.name.clone());
            }
        }
    }

    /// Forgets `peer`'s names of senders ([`know`](Self::know)): a server's client that
    /// left.
    pub(crate) fn forget(&self, peer: &AgentInfo) {
        let mut s = self.inner.senders.lock().unwrap_or_else(|p| p.into_inner());
        for t in &peer.transports {
            for a in &t.rails {
                if s.get(a) == Some(&peer.name) {
                    s.remove(a);
                }
            }
        }
    }

    fn notification(&self, n: fabric_core::engine::Note) -> Notification {
        let sender = n.key.from.as_ref().and_then(|a| {
            let s = self.inner.senders.lock().unwrap_or_else(|p| p.into_inner());
            s.get(&a[..]).cloned()
        });
        Notification {
            sender,
            imm: n.key.imm,
            count: n.count,
            message: n.key.message.map(|p| p.to_vec()),
        }
    }

    /// The sums of every rail's counters, over all transports.
    pub fn counters(&self) -> fabric_core::engine::CounterSnapshot {
        let mut c = fabric_core::engine::CounterSnapshot::default();
        for l in &self.inner.lanes {
            c.add(&l.group.counters());
        }
        c
    }

    /// The agent's figures in the Prometheus text exposition format (see
    /// [`crate::metrics`]): every transport's rail group, labelled `group="tcp"` and so on.
    pub fn metrics(&self) -> String {
        let sources = Arc::new(crate::metrics::Sources::default());
        for l in &self.inner.lanes {
            sources.add_group(l.kind.name().to_owned(), &l.group);
        }
        sources.set_agent(self.inner.counts.clone());
        crate::metrics::render(&sources)
    }

    /// What the agent's transports counted.
    pub fn stats(&self) -> AgentStats {
        AgentStats {
            lanes: self
                .inner
                .lanes
                .iter()
                .map(|l| (l.kind, l.group.stats()))
                .collect(),
        }
    }
}

/// The layers' calls ([`AgentLayers`]): here, beside the agent's fields.
impl AgentLayers for Agent {
    fn with_pins(o: AgentOptions, pins: Option<Vec<Option<CorePin>>>) -> Result<Agent> {
        // The token, read once (from its file, if given): every lane below sees it.
        let mut o = o;
        o.auth_token = o.token()?;
        o.auth_token_file = None;
        if let Some(r) = o.rails {
            lanes::check_rails(r)?;
        }
        let kinds = kinds_for(&o)?;
        let slot = crate::placement::plan_slot(o.memory == MemoryKind::Cuda, o.gpu, o.worker);
        let worker_pins = WorkerPins::for_slot(o.pin, slot);
        // Rails placed by the caller (an agent per GPU) have their home where the first
        // one runs, on its GPU's node; else the role's core of the plan.
        let home = match &pins {
            Some(p) => p.first().copied().flatten(),
            None => match o.role {
                Role::Initiator => worker_pins.initiator,
                Role::Target => worker_pins.target.or(worker_pins.initiator),
            },
        };
        let id = AGENTS.fetch_add(1, Ordering::Relaxed);
        let name = o
            .name
            .clone()
            .unwrap_or_else(|| format!("xfer-{}-{id}", std::process::id()));
        let mut lanes_built = Vec::new();
        let instance = fabric_core::random_u64();
        for kind in kinds {
            let choice = lanes::nic_choice(&o, kind)?;
            let rails = o.rails.unwrap_or(choice.default_rails(1));
            lanes::check_rails(rails)?;
            let rail_nics = choice.per_rail(rails);
            let rail_pins = match &pins {
                Some(p) => (0..rails).map(|i| p.get(i).copied().flatten()).collect(),
                None => match o.role {
                    Role::Initiator => worker_pins.rail_pins(worker_pins.initiator, rails, 0),
                    Role::Target => worker_pins.serve_pins(rails),
                },
            };
            let group = lanes::spawn(
                kind,
                &o,
                rails,
                &rail_nics,
                rail_pins,
                &format!("xfer-{}-{}", kind.name(), o.worker),
                instance,
            )?;
            lanes_built.push(Lane {
                kind,
                group: Arc::new(group),
                nics: choice,
            });
        }
        lanes::check_exposure(&o, &lanes_built, &name)?;
        let memory = match o.memory {
            MemoryKind::Host => MemoryLocation::Host,
            MemoryKind::Cuda => MemoryLocation::Cuda { device: o.gpu },
        };
        let boot_id = transport_cuda_ipc::boot_id().unwrap_or_default();
        let mut info = AgentInfo::new(&name, &boot_id, memory);
        // The incarnation the tcp rails announced in their handshakes.
        info.instance = instance;
        info.hostname = hostname();
        info.net_namespace = net_namespace();
        info.control = o.control.clone();
        info.transports = lanes_built
            .iter()
            .map(|l| TransportInfo {
                kind: l.kind,
                provider: (l.kind == TransportKind::Efa)
                    .then(|| o.efa.provider.clone())
                    .flatten(),
                rails: l.group.addresses(),
                nics: if l.nics.nics.is_empty() {
                    Vec::new()
                } else {
                    l.group
                        .rail_nics()
                        .iter()
                        .map(|n| n.clone().unwrap_or_default())
                        .collect()
                },
            })
            .collect();
        let mut a = Agent::assemble(info, lanes_built, home);
        if let Some(inner) = Arc::get_mut(&mut a.inner) {
            inner.stall = o.workers.stall_timeout;
        }
        Ok(a)
    }

    fn from_groups(
        name: &str,
        memory: MemoryLocation,
        groups: Vec<(TransportKind, RailGroup)>,
    ) -> Result<Agent> {
        let lanes: Vec<Lane> = groups
            .into_iter()
            .map(|(kind, g)| Lane {
                kind,
                group: Arc::new(g),
                nics: NicChoice::unbound("made by the caller"),
            })
            .collect();
        let boot_id = transport_cuda_ipc::boot_id().unwrap_or_default();
        let mut info = AgentInfo::new(name, &boot_id, memory);
        info.hostname = hostname();
        info.net_namespace = net_namespace();
        info.transports = lanes
            .iter()
            .map(|l| TransportInfo::new(l.kind, l.group.addresses()))
            .collect();
        info.check()?;
        Ok(Agent::assemble(info, lanes, None))
    }

    fn group(&self, kind: TransportKind) -> Option<&Arc<RailGroup>> {
        self.lane(kind).ok().map(|l| &l.group)
    }

    fn nics(&self, kind: TransportKind) -> Option<&NicChoice> {
        self.lane(kind).ok().map(|l| &l.nics)
    }

    fn home(&self) -> Option<CorePin> {
        self.inner.home
    }
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.inner.info.name)
            .field("transports", &self.transports())
            .finish()
    }
}

/// The transports an agent of `o` offers.
fn kinds_for(o: &AgentOptions) -> Result<Vec<TransportKind>> {
    // What the options say alone is checked before the machine is probed, so that a
    // contradiction is reported as such rather than as a missing driver.
    if let TransportChoice::Only(k) = o.transport {
        if k == TransportKind::CudaIpc && o.memory != MemoryKind::Cuda {
            return Err(Error::option(
                OptionName::Transport,
                "cuda-ipc moves GPU memory: use cuda memory (or the tcp transport)",
            ));
        }
        if o.efa.provider.is_some() && k != TransportKind::Efa {
            return Err(Error::option(
                OptionName::Provider,
                format!("applies to the efa transport only, not {k}"),
            ));
        }
        if matches!(o.nics, crate::nics::Nics::Named(_))
            && !matches!(k, TransportKind::Tcp | TransportKind::Efa)
        {
            return Err(nics::NicError::NotOnNics(k).into());
        }
    }
    let kinds = match o.transport {
        TransportChoice::Only(k) => {
            lanes::check_available(k)?;
            if k == TransportKind::CudaIpc || o.memory == MemoryKind::Cuda {
                lanes::cuda()?.device(o.gpu)?;
            }
            vec![k]
        }
        TransportChoice::Auto => {
            let mut v = Vec::new();
            if o.memory == MemoryKind::Cuda {
                // A GPU that is not there fails here, clearly, whatever the transports.
                lanes::cuda()?.device(o.gpu)?;
                v.push(TransportKind::CudaIpc);
            }
            if plan_has_efa(o) {
                v.push(TransportKind::Efa);
            }
            v.push(TransportKind::Tcp);
            v
        }
    };
    Ok(kinds)
}

/// Whether the placement plan gives this agent's worker EFA NICs that libfabric's efa
/// provider can open (on a p5, the four under its GPU's PCIe switch).
fn plan_has_efa(o: &AgentOptions) -> bool {
    let Some(t) = crate::placement::machine() else {
        return false;
    };
    let plan = t.plan();
    let slot = crate::placement::plan_slot(o.memory == MemoryKind::Cuda, o.gpu, o.worker);
    let Some(w) = nics::plan_worker(&plan, slot) else {
        return false;
    };
    let has = w
        .nics
        .iter()
        .filter_map(|&i| t.nic(i))
        .any(|n| n.kind == topology::NicKind::Efa);
    has && lanes::check_available(TransportKind::Efa).is_ok()
}

/// This host's name, for people (empty if unknown).
/// This process's network namespace (`/proc/self/ns/net`'s target), empty if unknown.
fn net_namespace() -> String {
    std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// This host's name, empty if unknown.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use TransportKind::{CudaIpc, Efa, Mem, Tcp};

    /// An agent on the host of `boot_id` with `memory`, offering `kinds` (one rail each).
    fn agent(boot_id: &str, memory: MemoryLocation, kinds: &[TransportKind]) -> AgentInfo {
        AgentInfo {
            transports: kinds
                .iter()
                .map(|&k| TransportInfo::new(k, vec![b"rail".to_vec()]))
                .collect(),
            net_namespace: "net:[1]".into(),
            ..AgentInfo::new("a", boot_id, memory)
        }
    }

    #[test]
    fn resolve_picks_the_first_transport_both_offer_and_says_why() {
        let gpu = MemoryLocation::Cuda { device: 0 };
        let host = MemoryLocation::Host;
        let both = |a: &AgentInfo, b: &AgentInfo| {
            let k = resolve(a, b).expect("a transport in common");
            assert_eq!(resolve(b, a).expect("the same both ways"), k);
            (k, resolve_reason(a, b, k))
        };
        let ipc = agent("boot-1", gpu, &[CudaIpc, Tcp]);
        assert_eq!(
            both(&ipc, &agent("boot-1", gpu, &[CudaIpc, Tcp])),
            (CudaIpc, "GPU memory on both sides of one host")
        );
        // Another host (another boot id), or host memory on one side: tcp.
        for other in [
            agent("boot-2", gpu, &[CudaIpc, Tcp]),
            agent("boot-1", host, &[Tcp]),
        ] {
            assert_eq!(both(&ipc, &other), (Tcp, "not GPU memory on one host"));
        }
        let efa = agent("boot-3", host, &[Efa, Tcp]);
        assert_eq!(
            both(&efa, &agent("boot-4", host, &[Efa, Tcp])),
            (Efa, "EFA on both sides")
        );
        assert_eq!(
            both(&efa, &agent("boot-4", host, &[Tcp])),
            (Tcp, "not GPU memory on one host, and EFA on one side only")
        );
        // Two pods of one node: one boot id, two network namespaces, so no cuda-ipc.
        let pod = AgentInfo {
            net_namespace: "net:[2]".into(),
            ..agent("boot-1", gpu, &[CudaIpc, Tcp])
        };
        assert_eq!(
            both(&ipc, &pod),
            (
                Tcp,
                "GPU memory on one host, but in two network namespaces (cuda-ipc needs one)"
            )
        );
        let e = resolve(&efa, &agent("boot-3", host, &[Mem])).unwrap_err();
        assert!(matches!(e, Error::NoCommonTransport { .. }), "{e}");
    }
}
