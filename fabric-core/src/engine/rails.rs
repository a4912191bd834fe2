//! Rails: one endpoint made of several engines, each a worker thread that owns one
//! transport (a NIC, or a TCP connection); [`RailGroup::spawn_on`] names the NIC of each.
//! A transfer is planned once, cut into chunks of whole writes, and the rails take the
//! chunks as they have room ([`Balance`]): each starts with a few, and a rail whose chunk
//! lands takes the next from the transfer's queue on its own worker, so a slow NIC carries
//! less instead of setting the pace of all. The transfer completes when every chunk has
//! landed; its immediate data follows only after that. Both are decided on the workers: the
//! worker that completes the last chunk sends the immediate data on its own rail, so a
//! caller that only polls its handle, registers a callback or drops the handle still has
//! the immediate data delivered.
//!
//! Registration registers the memory on every rail, so the descriptor a peer receives holds
//! one key per rail ([`RemoteDescriptor`]).
//!
//! Set-up and tear-down call every rail at once: add/remove a peer, register and deregister
//! send the command to every rail's worker before reading any answer, and spawn and drop
//! (whose waits are the worker thread's start and end) run on a thread per rail. One rail
//! after another made set-up time grow as rails times a worker's round trip.

use super::notes::Notifications;
use super::rail_rate::RailRate;
use super::worker::{Command, Job};
use super::{
    Engine, EngineConfig, Event, Pending, Slot, Transfer, TransferHandle, TransferResult,
    TransferStats, WorkerLink,
};
use crate::Invalid;
use crate::error::{Error, OpError, Result};
use crate::fence::Fence;
use crate::memory::{MemoryRegion, SubRegion};
use crate::plan::{Direction, PlannedWrite, Segment, StridedRun, plan_runs, plan_with_rows};
use crate::stats::LatencyHistogram;
use crate::transport::Transport;
use crate::types::{Access, LocalKey, PeerId, RemoteRegion};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The immediate value of warm-up writes ([`RailGroup::warm_up`]): rail groups never
/// report it to the application, and [`RailGroup::submit`] refuses it ([`Error::ReservedImm`]).
pub const WARM_UP_IMM: u32 = u32::MAX;

/// What a peer needs to write into a region registered on every rail of a [`RailGroup`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteDescriptor {
    /// The region as registered on each rail (same memory, one key per rail).
    pub rails: Vec<RemoteRegion>,
}

impl RemoteDescriptor {
    /// Length of the region.
    pub fn len(&self) -> u64 {
        self.rails.first().map_or(0, |r| r.len)
    }
    /// Whether the region is empty (or the descriptor has no rail).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A region registered on every rail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupRegistration {
    /// Local key per rail.
    pub locals: Vec<LocalKey>,
    /// The descriptor to ship to peers.
    pub remote: RemoteDescriptor,
}

/// A peer of a rail group: one peer id per local rail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupPeer {
    /// `rails[i]` is the peer as known to local rail `i`.
    pub rails: Vec<PeerId>,
    /// Which remote rail each local rail talks to.
    pub remote_rail: Vec<usize>,
    /// The incarnation the peer announced when this group connected to it (the first rail
    /// whose transport learned one; see [`Transport::peer_instance`]), if any.
    pub announced: Option<u64>,
}

/// A transfer between two rail groups: segments of one local region to one remote region
/// (a WRITE), or of the remote region into the local one (a READ, see [`Direction`]).
/// Chunking, rails and NICs are the same both ways.
#[derive(Clone, Debug)]
pub struct GroupTransfer {
    /// Local region.
    pub src: GroupRegistration,
    /// Remote region.
    pub dst: RemoteDescriptor,
    /// `(src_offset, dst_offset, len)` triples.
    pub segments: Vec<(u64, u64, u64)>,
    /// Rows at constant strides, moved after the segments: on a backend with strided
    /// writes each run costs the same to submit whatever its rows (see [`plan_runs`]).
    pub runs: Vec<StridedRun>,
    /// Immediate data delivered to the target after every byte landed.
    pub imm: Option<u32>,
    /// A message for the peer, sent after every byte was placed (a WRITE's or a READ's),
    /// with `imm` (or 0): see [`Transfer::message`](super::Transfer::message).
    pub message: Option<Arc<[u8]>>,
    /// Deadline for each shard.
    pub timeout: Option<Duration>,
    /// Which way the bytes flow (`Write` by default).
    pub direction: Direction,
    /// Work the transfer waits for before any rail touches its local memory: a CUDA event
    /// recorded on the stream whose kernels write the source, say. See
    /// [`Transfer`] on ordering with the application's own work.
    pub after: Option<Arc<dyn Fence>>,
}

impl GroupTransfer {
    /// Waits for `fence` before any rail touches the transfer's local memory (see
    /// [`after`](Self::after)'s field).
    pub fn after(mut self, fence: Arc<dyn Fence>) -> GroupTransfer {
        self.after = Some(fence);
        self
    }

    /// Makes it a READ: the remote region's bytes land in the local one.
    pub fn read(mut self) -> GroupTransfer {
        self.direction = Direction::Read;
        self
    }

    /// Sets the direction.
    pub fn with_direction(mut self, d: Direction) -> GroupTransfer {
        self.direction = d;
        self
    }

    /// Pages of `page_size` bytes: local page `i` goes to remote page `i` for each index.
    pub fn same_pages(
        src: GroupRegistration,
        dst: RemoteDescriptor,
        pages: &[u64],
        page_size: u64,
    ) -> GroupTransfer {
        let segments = pages
            .iter()
            .map(|&p| (p * page_size, p * page_size, page_size))
            .collect();
        GroupTransfer {
            src,
            dst,
            segments,
            runs: Vec::new(),
            imm: None,
            message: None,
            timeout: None,
            direction: Direction::Write,
            after: None,
        }
    }

    /// Paged descriptors: `src_pages[i]` (stride `src_stride`) goes to `dst_pages[i]`
    /// (stride `dst_stride`), `len` bytes each.
    pub fn paged(
        src: GroupRegistration,
        dst: RemoteDescriptor,
        src_pages: &[u64],
        src_stride: u64,
        dst_pages: &[u64],
        dst_stride: u64,
        len: u64,
    ) -> Result<GroupTransfer> {
        if src_pages.len() != dst_pages.len() {
            return Err(Invalid::PageCounts {
                local: src_pages.len(),
                remote: dst_pages.len(),
            }
            .into());
        }
        if len > src_stride || len > dst_stride {
            return Err(Invalid::PageExceedsStride {
                len,
                stride: src_stride.min(dst_stride),
            }
            .into());
        }
        let mut segments = Vec::with_capacity(src_pages.len());
        for (&s, &d) in src_pages.iter().zip(dst_pages) {
            let so = s.checked_mul(src_stride).ok_or(Invalid::PageOverflow {
                side: "source",
                page: s,
            })?;
            let d_o = d.checked_mul(dst_stride).ok_or(Invalid::PageOverflow {
                side: "destination",
                page: d,
            })?;
            segments.push((so, d_o, len));
        }
        Ok(GroupTransfer {
            src,
            dst,
            segments,
            runs: Vec::new(),
            imm: None,
            message: None,
            timeout: None,
            direction: Direction::Write,
            after: None,
        })
    }
}

/// Several engines acting as one endpoint. See the module documentation.
pub struct RailGroup {
    rails: Vec<Arc<Engine>>,
    /// Peers' immediate data on every rail, counted per value.
    notes: Notifications,
    /// What the rails share to take chunks from (see [`Balance`]).
    shared: Arc<Shared>,
    /// The NIC of each rail, where it was named.
    nics: Vec<Option<String>>,
}

/// How a [`RailGroup`] spreads a transfer over its rails: by progress, not by a fixed
/// split. A transfer is cut into chunks (whole writes, each chunk about
/// `bytes / (rails * chunks_per_rail)` bytes, within `min_chunk..=max_chunk`) that wait in
/// one queue of the group, oldest transfer first. A rail takes the next chunk from the
/// queue, on its own worker, when one of its chunks lands, as long as it holds fewer than
/// `in_flight` chunks or fewer bytes than it moves in `lead` at the rate it has shown (at
/// most `max_in_flight_bytes`). What no rail has room for stays in the queue for whichever
/// rail frees up first, so a fast rail takes more of each transfer and a slow one less: a
/// rail on a NIC at half speed carries about half as much, and the transfer loses only that
/// NIC's missing share plus, at its end, what the slow rail still holds (at most
/// `in_flight` chunks of up to half a `horizon` of its work). A transfer of one chunk goes
/// whole to the rail with the fewest chunks in flight, its immediate data with it; a group
/// of one rail moves each transfer as one chunk.
///
/// `lead` is zero by default: two chunks in flight keep a rail's pipe full, and a rail that
/// takes more at once holds a transfer's share from the start, so the transfer waits for
/// that rail however the others fare. On the H200 (16 cores, tcp over loopback, host
/// memory, 8 rails, transfers of 1000 pages, 4 in flight; same call, medians of 3) a lead
/// of 16 ms moved 4 KiB pages at 0.70-0.73 of 8 raw page streams and zero at 0.79-0.88;
/// 64 KiB pages 167 against 189 Gbps; GPU memory over tcp and cuda-ipc were equal either
/// way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Balance {
    /// Chunks per rail that a large transfer is cut into (the finer, the better the
    /// balance and the more work items).
    pub chunks_per_rail: u64,
    /// Smallest chunk, in bytes (a chunk holds at least one write whatever this says).
    pub min_chunk: u64,
    /// Largest chunk, in bytes; writes are cut to at most this, so one large segment also
    /// spreads over the rails.
    pub max_chunk: u64,
    /// Chunks a rail may always hold in flight (of all transfers), whatever its rate.
    pub in_flight: usize,
    /// A rail's rate is counted over windows at least this long (so that chunks landing
    /// together do not read as a fast link), and a rail whose rate is known takes chunks of
    /// up to half a horizon of its work (see `max_rail_chunk`).
    pub horizon: Duration,
    /// Beyond `in_flight` chunks, a rail holds what it moves in this long at the rate its
    /// completed chunks show (zero: its `in_flight` chunks and no more). Work beyond that
    /// waits in the group's queue, where the first rail with room takes it.
    pub lead: Duration,
    /// The most bytes a rail holds in flight by its `lead`.
    pub max_in_flight_bytes: u64,
    /// A rail whose rate is known takes chunks of up to half a `horizon` of its work, at
    /// most this many bytes (never less than the transfer's chunk): fewer, larger chunks
    /// for fast rails, whose tail stays within the horizon.
    pub max_rail_chunk: u64,
}

impl Default for Balance {
    fn default() -> Self {
        Balance {
            chunks_per_rail: 16,
            min_chunk: 256 << 10,
            max_chunk: 1 << 20,
            in_flight: 2,
            horizon: Duration::from_millis(16),
            lead: Duration::ZERO,
            max_in_flight_bytes: 64 << 20,
            max_rail_chunk: 16 << 20,
        }
    }
}

/// What a group's rails share: the queue of transfers with chunks not taken yet, and each
/// rail's chunks in flight.
struct Shared {
    queue: Mutex<VecDeque<Arc<GroupState>>>,
    /// Chunks posted and not landed, per rail (one-chunk transfers included).
    inflight: Vec<AtomicUsize>,
    /// Their bytes.
    inflight_bytes: Vec<AtomicU64>,
    /// Each rail's rate.
    rates: Vec<Mutex<RailRate>>,
    links: Vec<Arc<WorkerLink>>,
    balance: Mutex<Balance>,
    /// Latency of the group's successful transfers.
    latency: LatencyHistogram,
    /// Which registrations group transfers use (see [`RegionUse`]).
    regions: Mutex<RegionUse>,
}

/// The registrations that undecided group transfers use, by their rail-0 key, and those
/// being deregistered. Each rail's engine refuses to deregister a region its own transfers
/// use, but only for itself: a group asking every rail would deregister the region on the
/// rails that hold none of the transfer's chunks and fail on the others, leaving it half
/// registered (a later transfer failed on the first rails, a later deregistration too). So
/// the group decides for all rails before it asks any.
#[derive(Default)]
struct RegionUse {
    /// Undecided transfers per registration.
    transfers: HashMap<LocalKey, usize>,
    /// Registrations being deregistered: transfers that would use them are refused.
    closing: HashSet<LocalKey>,
}

impl Shared {
    fn lock_queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Arc<GroupState>>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn balance(&self) -> Balance {
        *self.balance.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_region_use(&self) -> std::sync::MutexGuard<'_, RegionUse> {
        self.regions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A transfer from now until it is decided uses the registration whose rail-0 key is
    /// `key`; refused while that registration is being deregistered.
    fn hold(&self, key: LocalKey) -> Result<()> {
        let mut r = self.lock_region_use();
        if r.closing.contains(&key) {
            return Err(Error::Op(OpError::LocalKeyInvalid(key)));
        }
        *r.transfers.entry(key).or_default() += 1;
        Ok(())
    }

    /// A transfer that [held](Self::hold) `key` is decided (called before its handle
    /// completes, so that whoever waited on it may deregister at once).
    fn release(&self, key: LocalKey) {
        let mut r = self.lock_region_use();
        if let Some(n) = r.transfers.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                r.transfers.remove(&key);
            }
        }
    }

    /// The next chunk of the oldest transfer that has one (transfers with none left, or
    /// failed, leave the queue), counted as posted. Called with the queue locked.
    fn next_chunk(
        queue: &mut VecDeque<Arc<GroupState>>,
        rail_chunk: u64,
    ) -> Option<(Arc<GroupState>, Vec<PlannedWrite>)> {
        while let Some(st) = queue.front().cloned() {
            let mut w = st.lock_work();
            if w.error.is_some() || w.left().is_empty() {
                drop(w);
                queue.pop_front();
                continue;
            }
            // A fast rail's larger chunks stay within the transfer's fair share per rail,
            // so one transfer still spreads over every rail.
            let limit = st.chunk.max(rail_chunk.min(st.share));
            // Counted first, then copied out in one allocation.
            let mut n = 0;
            let mut bytes = 0u64;
            for next in w.left() {
                if n > 0 && bytes.saturating_add(next.bytes()) > limit {
                    break;
                }
                bytes = bytes.saturating_add(next.bytes());
                n += 1;
            }
            let chunk = w.left()[..n].to_vec();
            w.next += n;
            w.posted += 1;
            let empty = w.left().is_empty();
            drop(w);
            if empty {
                queue.pop_front();
            }
            return Some((st, chunk));
        }
        None
    }

    fn rate(&self, rail: usize) -> f64 {
        self.rates[rail]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .bytes_per_s()
    }

    /// Whether `rail` has room for another chunk (see [`Balance`]).
    fn has_room(&self, rail: usize, b: &Balance) -> bool {
        self.has_room_beside(rail, b, 0, 0)
    }

    /// [`Shared::has_room`] with `chunks` more chunks of `bytes` in all already chosen for
    /// `rail` but not yet counted.
    fn has_room_beside(&self, rail: usize, b: &Balance, chunks: usize, bytes: u64) -> bool {
        if self.inflight[rail].load(Ordering::Acquire) + chunks < b.in_flight.max(1) {
            return true;
        }
        let budget = (self.rate(rail) * b.lead.as_secs_f64()).min(b.max_in_flight_bytes as f64);
        ((self.inflight_bytes[rail].load(Ordering::Acquire) + bytes) as f64) < budget
    }

    /// The chunk size `rail` may take beyond a transfer's own: half a horizon of its work
    /// (at most `max_rail_chunk`), so a fast rail takes few large chunks.
    fn rail_chunk(&self, rail: usize, b: &Balance) -> u64 {
        ((self.rate(rail) * b.horizon.as_secs_f64() / 2.0) as u64).min(b.max_rail_chunk)
    }

    /// Chunks for `rail` from the queue while it has room.
    fn fill(&self, rail: usize) {
        let b = self.balance();
        loop {
            if !self.has_room(rail, &b) {
                return;
            }
            let rail_chunk = self.rail_chunk(rail, &b);
            let Some((st, writes)) = Self::next_chunk(&mut self.lock_queue(), rail_chunk) else {
                return;
            };
            self.post(st, rail, writes);
        }
    }

    /// Counts a chunk of `bytes` in flight on `rail`.
    fn add(&self, rail: usize, bytes: u64) {
        self.inflight[rail].fetch_add(1, Ordering::AcqRel);
        self.inflight_bytes[rail].fetch_add(bytes, Ordering::AcqRel);
    }

    /// A chunk of `bytes` posted at `posted` landed on `rail` (called on its worker): no
    /// longer in flight, and the rail's rate learns from it, over windows of at least the
    /// horizon (see [`RailRate`]).
    fn landed(&self, rail: usize, bytes: u64, posted: Instant, ok: bool) {
        self.inflight[rail].fetch_sub(1, Ordering::AcqRel);
        self.inflight_bytes[rail].fetch_sub(bytes, Ordering::AcqRel);
        let window = self.balance().horizon;
        self.rates[rail]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .landed(bytes, ok, posted, Instant::now(), window);
    }

    /// Posts a chunk of `st` on `rail` (to its worker, without blocking).
    fn post(&self, st: Arc<GroupState>, rail: usize, writes: Vec<PlannedWrite>) {
        self.add(rail, chunk_len(&writes));
        let job = st.chunk_job(rail, writes);
        if let Err(slot) = self.links[rail].send_transfer(job) {
            // The worker stopped: the chunk fails (and may decide the transfer).
            slot.complete(Err(OpError::Cancelled));
        }
    }
}

impl Balance {
    /// The chunk size for a transfer of `total` bytes over `rails` rails.
    pub fn chunk_bytes(&self, total: u64, rails: usize) -> u64 {
        if rails <= 1 {
            return u64::MAX;
        }
        let min = self.min_chunk.max(1);
        (total / (rails as u64).saturating_mul(self.chunks_per_rail.max(1)))
            .clamp(min, self.max_chunk.max(min))
    }
}

impl RailGroup {
    /// Starts `n` rails; `make(i)` creates rail `i`'s transport inside its worker thread
    /// (pin the thread there first, so the transport's queues are allocated near it).
    pub fn spawn<T, F>(n: usize, make: F, cfg: EngineConfig) -> Result<RailGroup>
    where
        T: Transport,
        F: Fn(usize) -> Result<T> + Send + Sync + 'static,
    {
        if n == 0 {
            return Err(Invalid::NoRails.into());
        }
        let make = Arc::new(make);
        let started = at_once((0..n).collect(), |i| {
            let m = make.clone();
            let c = EngineConfig {
                name: format!("{}-{i}", cfg.name),
                ..cfg.clone()
            };
            Engine::spawn(move || m(i), c).map(Arc::new)
        });
        // On a failure the rails that did start stop as they drop.
        let rails = started.into_iter().collect::<Result<Vec<_>>>()?;
        Ok(RailGroup {
            shared: Arc::new(Shared {
                queue: Mutex::new(VecDeque::new()),
                inflight: (0..n).map(|_| AtomicUsize::new(0)).collect(),
                inflight_bytes: (0..n).map(|_| AtomicU64::new(0)).collect(),
                rates: (0..n).map(|_| Mutex::new(RailRate::default())).collect(),
                links: rails.iter().map(|e| e.link()).collect(),
                balance: Mutex::new(Balance::default()),
                latency: LatencyHistogram::default(),
                regions: Mutex::new(RegionUse::default()),
            }),
            nics: vec![None; n],
            notes: Notifications::new(rails.iter().map(|e| e.inbox().clone()).collect()),
            rails,
        })
    }

    /// Starts one rail per entry of `nics`, rail `i` on NIC `nics[i]` (a name several
    /// entries may share: more endpoints on one NIC). `make(i, nic)` creates rail `i`'s
    /// transport inside its worker thread, opened on that NIC (for EFA its libfabric domain,
    /// for TCP the interface it binds to); [`rail_nics`](Self::rail_nics) reports them.
    pub fn spawn_on<T, F>(nics: Vec<String>, make: F, cfg: EngineConfig) -> Result<RailGroup>
    where
        T: Transport,
        F: Fn(usize, &str) -> Result<T> + Send + Sync + 'static,
    {
        let names = nics.clone();
        let mut g = Self::spawn(nics.len(), move |i| make(i, &names[i]), cfg)?;
        g.nics = nics.into_iter().map(Some).collect();
        Ok(g)
    }

    /// The engines, one per rail.
    pub fn rails(&self) -> &[Arc<Engine>] {
        &self.rails
    }

    /// The transport address of every rail.
    pub fn addresses(&self) -> Vec<Vec<u8>> {
        self.rails.iter().map(|e| e.address()).collect()
    }

    /// Adds a peer group by its rails' addresses; local rail `i` talks to remote rail
    /// `i % remote.len()`.
    pub fn add_peer(&self, remote: &[Vec<u8>]) -> Result<GroupPeer> {
        if remote.is_empty() {
            return Err(Error::InvalidAddress("the peer offers no rail".into()));
        }
        let remote_rail: Vec<usize> = (0..self.rails.len()).map(|i| i % remote.len()).collect();
        let added = self.on_every_rail(
            |i, e| e.start_add_peer(&remote[remote_rail[i]]),
            |e, p| e.start_remove_peer(p.0),
        )?;
        Ok(GroupPeer {
            announced: added.iter().find_map(|(_, i)| *i),
            rails: added.into_iter().map(|(p, _)| p).collect(),
            remote_rail,
        })
    }

    /// `start(i, rail i)` on every rail, then every answer: the workers take the commands at
    /// the same time, and no thread waits on each. If any fails, `undo` on those that did
    /// not (the same way), and the first error.
    fn on_every_rail<'a, R: 'a, U: 'a>(
        &'a self,
        start: impl Fn(usize, &'a Engine) -> Result<Pending<'a, R>>,
        undo: impl Fn(&'a Engine, &R) -> Result<Pending<'a, U>>,
    ) -> Result<Vec<R>> {
        let done = answers(self.rails.iter().enumerate().map(|(i, e)| start(i, e)));
        if done.iter().any(Result::is_err) {
            // Best effort: the first error is what the caller hears.
            let _ = answers(
                self.rails
                    .iter()
                    .zip(&done)
                    .filter_map(|(e, r)| r.as_ref().ok().map(|r| undo(e, r))),
            );
        }
        done.into_iter().collect()
    }

    /// Removes a peer from every rail; its pending transfers fail with `PeerRemoved`.
    pub fn remove_peer(&self, peer: &GroupPeer) -> Result<()> {
        answers(
            self.rails
                .iter()
                .zip(&peer.rails)
                .map(|(e, p)| e.start_remove_peer(*p)),
        )
        .into_iter()
        .collect()
    }

    /// Registers memory on every rail.
    pub fn register(
        &self,
        mem: Arc<dyn MemoryRegion>,
        access: Access,
    ) -> Result<GroupRegistration> {
        // Each rail gets its own handle on the memory (a window over all of it): a transport
        // holds its region per operation in flight, and one reference count shared by every
        // rail's thread would be a cache line they fight over millions of times a second.
        let len = mem.len() as u64;
        let mut views = Vec::with_capacity(self.rails.len());
        for _ in &self.rails {
            let view: Arc<dyn MemoryRegion> = Arc::new(SubRegion::new(mem.clone(), 0, len)?);
            views.push(view);
        }
        let done = self.on_every_rail(
            |i, e| e.start_register(views[i].clone(), access),
            |e, r| e.start_deregister(r.local),
        )?;
        let (locals, rails) = done.into_iter().map(|r| (r.local, r.remote)).unzip();
        Ok(GroupRegistration {
            locals,
            remote: RemoteDescriptor { rails },
        })
    }

    /// Deregisters memory from every rail, or from none: while a transfer of the group uses
    /// it, [`Error::RegionInUse`] and it stays registered on every rail (wait for the
    /// transfer, then deregister).
    pub fn deregister(&self, reg: &GroupRegistration) -> Result<()> {
        let key = reg.locals.first().copied();
        if let Some(key) = key {
            let mut r = self.shared.lock_region_use();
            if let Some(&transfers) = r.transfers.get(&key) {
                return Err(Error::RegionInUse { key, transfers });
            }
            r.closing.insert(key);
        }
        let done = answers(
            self.rails
                .iter()
                .zip(&reg.locals)
                .map(|(e, k)| e.start_deregister(*k)),
        )
        .into_iter()
        .collect();
        if let Some(key) = key {
            self.shared.lock_region_use().closing.remove(&key);
        }
        done
    }

    /// Submits a transfer: planned once, cut into chunks, and carried by the rails as they
    /// have room (see [`Balance`]); a transfer of one chunk goes to the rail with the least
    /// in flight. Bad segments fail here, before anything moves.
    pub fn submit(&self, peer: &GroupPeer, t: GroupTransfer) -> Result<GroupHandle> {
        let after = t.after.clone();
        let p = self.prepare(peer, t)?;
        self.start(p, after)
    }

    /// Checks and plans a transfer once, for [`post`](Self::post) to start as many times
    /// as wanted with no planning at each (the same segments of the same regions, a weight
    /// sync's step or a KV layer's pages, say). Bad segments fail here. The transfer's
    /// fence ([`GroupTransfer::after`]) is not kept: each post takes its own.
    pub fn prepare(&self, peer: &GroupPeer, t: GroupTransfer) -> Result<PreparedTransfer> {
        if t.imm == Some(WARM_UP_IMM) {
            // The target's group would drop it as a warm-up: the transfer would complete
            // and its receiver never be told.
            return Err(Error::ReservedImm(WARM_UP_IMM));
        }
        let n = self.rails.len();
        if t.src.locals.len() != n || peer.rails.len() != n || peer.remote_rail.len() != n {
            return Err(Invalid::ForeignHandle.into());
        }
        let mut dsts = Vec::with_capacity(n);
        for &r in &peer.remote_rail {
            dsts.push(
                t.dst
                    .rails
                    .get(r)
                    .copied()
                    .ok_or_else(|| Error::from(Invalid::NoSuchRail { rail: r }))?,
            );
        }
        let segs: Vec<Segment> = t
            .segments
            .iter()
            .map(|&(so, d_o, len)| Segment {
                src: t.src.locals[0],
                src_offset: so,
                dst: dsts[0],
                dst_offset: d_o,
                len,
            })
            .collect();
        // Every rail's key must be known to its engine; the ranges are checked on rail 0
        // (the same memory is registered on every rail).
        super::check_message(t.message.as_deref())?;
        for e in &self.rails {
            // A message carries the immediate value itself, after a READ too.
            e.check_direction(t.direction, t.imm.filter(|_| t.message.is_none()))?;
        }
        self.rails[0].check_segments(&segs, t.direction)?;
        // A run's rows lie between its first row's start and its last row's end.
        let mut run_bytes = 0u64;
        if !t.runs.is_empty() {
            let mut spans = Vec::with_capacity(t.runs.len());
            for r in &t.runs {
                let (span, _, bytes) = r.spans()?;
                if r.is_empty() {
                    continue;
                }
                run_bytes = run_bytes
                    .checked_add(bytes)
                    .ok_or_else(|| Invalid::Overflow {
                        what: "the bytes of the runs".into(),
                    })?;
                spans.push(Segment {
                    src: t.src.locals[0],
                    src_offset: r.src_offset,
                    dst: dsts[0],
                    dst_offset: r.dst_offset,
                    len: span,
                });
            }
            self.rails[0].check_segments(&spans, t.direction)?;
        }
        for (e, &key) in self.rails.iter().zip(&t.src.locals).skip(1) {
            if !e.lock_regions().contains_key(&key) {
                return Err(Error::Op(OpError::LocalKeyInvalid(key)));
            }
        }
        let limit = self
            .rails
            .iter()
            .map(|e| e.limits().max_msg_size)
            .min()
            .unwrap_or(1);
        let total = segs
            .iter()
            .try_fold(run_bytes, |a, s| a.checked_add(s.len))
            .ok_or_else(|| Invalid::Overflow {
                what: "the sum of segment lengths".into(),
            })?;
        let chunk = self.balance().chunk_bytes(total, n);
        // Writes no longer than a chunk, so that one large segment spreads over the rails.
        let rows = self.rails.iter().all(|e| e.limits().strided_writes);
        let plan = if t.runs.is_empty() {
            plan_with_rows(&segs, limit.min(chunk), t.direction, rows)?
        } else {
            let (src, dst) = (t.src.locals[0], dsts[0]);
            plan_runs(
                &segs,
                &t.runs,
                src,
                dst,
                limit.min(chunk),
                t.direction,
                rows,
            )?
        };
        let first = (t.segments.first().map(|&(so, d_o, _)| (so, d_o)))
            .or_else(|| t.runs.first().map(|r| (r.src_offset, r.dst_offset)));
        let imm = match (t.imm, first, &t.message) {
            (None, _, _) => None,
            // The message carries it: no write does.
            (Some(v), _, Some(_)) => Some((v, 0, 0)),
            (Some(_), None, None) => {
                return Err(Invalid::ImmWithoutSegment.into());
            }
            (Some(v), Some((so, d_o)), None) => Some((v, so, d_o)),
        };
        Ok(PreparedTransfer {
            group: Arc::as_ptr(&self.shared) as usize,
            peers: peer.rails.clone(),
            srcs: t.src.locals.clone(),
            dsts,
            writes: Arc::new(plan.writes),
            bytes: plan.bytes,
            chunk,
            imm,
            message: t.message,
            direction: t.direction,
            timeout: t.timeout,
        })
    }

    /// Starts a transfer that [`prepare`](Self::prepare) planned, waiting for `after` (if
    /// any) before any rail touches its local memory. Nothing is planned or checked again
    /// but that its local region is still registered; every post is a transfer of its own,
    /// with its own handle and deadline.
    pub fn post(&self, p: &PreparedTransfer, after: Option<Arc<dyn Fence>>) -> Result<GroupHandle> {
        if p.group != Arc::as_ptr(&self.shared) as usize {
            return Err(Invalid::ForeignHandle.into());
        }
        let key = p.srcs[0];
        if !self.rails[0].lock_regions().contains_key(&key) {
            return Err(Error::Op(OpError::LocalKeyInvalid(key)));
        }
        self.start(p.clone(), after)
    }

    /// Starts a planned transfer (see [`submit`](Self::submit)).
    fn start(&self, p: PreparedTransfer, after: Option<Arc<dyn Fence>>) -> Result<GroupHandle> {
        let n = self.rails.len();
        let PreparedTransfer {
            peers,
            srcs,
            dsts,
            writes,
            bytes: plan_bytes,
            chunk,
            imm,
            message,
            direction,
            timeout,
            ..
        } = p;
        let submitted = Instant::now();
        let deadline = timeout.map(|d| submitted + d);
        let slot = Slot::spinning(self.rails[0].cfg.wait_spin);
        let mut handle = TransferHandle {
            slot: slot.clone(),
            cancel: None,
        };
        if writes.is_empty() && imm.is_none() && message.is_none() {
            slot.complete(Ok(TransferStats::default()));
            return Ok(handle);
        }
        let sh = &self.shared;
        let key = srcs[0];
        sh.hold(key)?;
        if plan_bytes <= chunk {
            // One chunk (or only immediate data): one rail moves it all and its worker
            // sends the immediate data right after its writes (or on its one write), with
            // no other worker involved.
            let r = (0..n)
                .min_by_key(|&i| (sh.inflight[i].load(Ordering::Relaxed), i))
                .unwrap_or(0);
            let shared = sh.clone();
            let bytes = plan_bytes;
            let posted = submitted;
            let watch = slot.clone();
            let done = Slot::with_callback(Box::new(move |res: TransferResult| {
                shared.landed(r, bytes, posted, res.is_ok());
                if res.is_ok() {
                    shared.latency.record(submitted.elapsed());
                }
                shared.release(key);
                slot.complete(res);
                // A chunk slot came free on this rail: other transfers' chunks may wait.
                shared.fill(r);
            }));
            // A prepared transfer's writes are copied for the worker; a submitted one's are
            // its own, taken as they are.
            let writes = Arc::try_unwrap(writes).unwrap_or_else(|w| w.as_ref().clone());
            let job = Job {
                peer: peers[r],
                plan: crate::plan::TransferPlan {
                    bytes: plan_bytes,
                    writes: on_rail(writes, srcs[r], dsts[r]),
                },
                direction,
                imm: imm.map(|(v, so, d_o)| (v, imm_segment(srcs[r], so, dsts[r], d_o))),
                message,
                slot: done,
                deadline,
                submitted,
                after,
                watch: Some(watch),
            };
            sh.add(r, bytes);
            let cancel = self.rails[r].canceller(job.slot.clone());
            if let Err(e) = self.rails[r].send_cmd(Command::Transfer(job)) {
                sh.inflight[r].fetch_sub(1, Ordering::AcqRel);
                sh.inflight_bytes[r].fetch_sub(bytes, Ordering::AcqRel);
                sh.release(key);
                return Err(e);
            }
            handle.cancel = Some(cancel);
            return Ok(handle);
        }
        let state = Arc::new(GroupState {
            work: Mutex::new(Work {
                writes,
                next: 0,
                chunks: Vec::new(),
                posted: 0,
                finished: false,
                error: None,
                ops: 0,
            }),
            chunk,
            share: plan_bytes / n as u64,
            peers,
            srcs,
            dsts,
            imm,
            message,
            direction,
            after,
            shared: sh.clone(),
            deadline,
            submitted,
            bytes: plan_bytes,
            slot,
        });
        let st = state.clone();
        handle.cancel = Some(Arc::new(move || st.cancel()));
        // The rails with the fewest chunks in flight take theirs first, one round at a
        // time, all chosen before any is posted (so that a fast rail's completion cannot
        // take the others' first chunks); the rest wait in the queue.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| (sh.inflight[i].load(Ordering::Relaxed), i));
        let b = self.balance();
        let mut first = Vec::new();
        {
            let mut q = sh.lock_queue();
            q.push_back(state);
            // Each rail takes chunks while it has room by the same rule as when its chunks
            // land: its `in_flight` chunks, or what it moves in its `lead` at its rate.
            let mut taken = vec![(0usize, 0u64); n];
            'rounds: loop {
                let mut any = false;
                for &r in &order {
                    if !sh.has_room_beside(r, &b, taken[r].0, taken[r].1) {
                        continue;
                    }
                    match Shared::next_chunk(&mut q, sh.rail_chunk(r, &b)) {
                        Some(c) => {
                            taken[r].0 += 1;
                            taken[r].1 += chunk_len(&c.1);
                            first.push((r, c));
                            any = true;
                        }
                        None => break 'rounds,
                    }
                }
                if !any {
                    break;
                }
            }
        }
        for (r, (st, writes)) in first {
            sh.post(st, r, writes);
        }
        Ok(handle)
    }

    /// How transfers are cut into chunks and spread (see [`Balance`]).
    pub fn balance(&self) -> Balance {
        self.shared.balance()
    }

    /// Changes how later transfers are cut into chunks and spread.
    pub fn set_balance(&self, b: Balance) {
        *self
            .shared
            .balance
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = b;
    }

    /// The NIC each rail runs on, as given to [`RailGroup::spawn_on`] (`None` for rails
    /// started with [`RailGroup::spawn`]).
    pub fn rail_nics(&self) -> &[Option<String>] {
        &self.nics
    }

    /// Submits a transfer and calls `done` with its result on the worker thread that
    /// decides it. Keep `done` short: that worker runs nothing else meanwhile.
    pub fn submit_with_callback(
        &self,
        peer: &GroupPeer,
        t: GroupTransfer,
        done: impl FnOnce(super::TransferResult) + Send + 'static,
    ) -> Result<()> {
        self.submit(peer, t)?.on_complete(done);
        Ok(())
    }

    /// Warm-up: one zero-length write on every rail, carrying [`WARM_UP_IMM`], so that every
    /// connection is up and every queue has run before timed work starts; no byte of `dst`
    /// changes, and the rail groups at the target drop the warm-up notifications. Fails with
    /// the first rail's error.
    pub fn warm_up(
        &self,
        peer: &GroupPeer,
        src: &GroupRegistration,
        dst: &RemoteDescriptor,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut handles = Vec::with_capacity(self.rails.len());
        for (i, e) in self.rails.iter().enumerate() {
            let region = dst
                .rails
                .get(*peer.remote_rail.get(i).unwrap_or(&0))
                .copied()
                .ok_or_else(|| {
                    Error::from(Invalid::NoSuchRail {
                        rail: peer.remote_rail[i],
                    })
                })?;
            let t = Transfer::new(peer.rails[i])
                .segment(Segment {
                    src: src.locals[i],
                    src_offset: 0,
                    dst: region,
                    dst_offset: 0,
                    len: 0,
                })
                .imm(WARM_UP_IMM)
                .timeout(timeout);
            handles.push(e.submit(t)?);
        }
        for h in handles {
            h.wait(deadline.saturating_duration_since(Instant::now()))?;
        }
        Ok(())
    }

    /// Scatter: the same source to several peers, one transfer each, submitted together.
    /// Each handle completes (or fails) on its own.
    pub fn scatter(&self, transfers: Vec<(GroupPeer, GroupTransfer)>) -> Result<Vec<GroupHandle>> {
        transfers
            .into_iter()
            .map(|(p, t)| self.submit(&p, t))
            .collect()
    }

    /// Waits until `count` transfers carrying immediate value `imm` have landed here
    /// (from any rail), or `timeout` passes. Other values seen meanwhile are kept for their
    /// own waiters.
    pub fn wait_imm(&self, imm: u32, count: u64, timeout: Duration) -> Result<()> {
        self.notes.wait_imm(imm, count, timeout)
    }

    /// The next event from any rail (warm-up notifications excepted), waiting at most
    /// `timeout`.
    pub fn next_event(&self, timeout: Duration) -> Result<Event> {
        let n = self.notes.next(timeout)?;
        Ok(Event::Imm {
            peer: n.key.peer,
            imm: n.key.imm,
        })
    }

    /// The group's notifications: wait for a value and count, take arrivals one by one or
    /// all at once, with their senders (see [`Notifications`]).
    pub fn notifications(&self) -> &Notifications {
        &self.notes
    }

    /// Sums the counters of all rails.
    pub fn counters(&self) -> super::CounterSnapshot {
        let mut s = super::CounterSnapshot::default();
        for e in &self.rails {
            s.add(&e.counters().snapshot());
        }
        s
    }

    /// Everything the group can tell about itself, read now: each rail's
    /// [`Engine::stats`], the rails' NICs, and the latency of the group's transfers.
    pub fn stats(&self) -> super::GroupStats {
        super::GroupStats {
            rails: self.rails.iter().map(|e| e.stats()).collect(),
            nics: self.nics.clone(),
            latency: self.shared.latency.snapshot(),
        }
    }

    /// Counters per rail.
    pub fn rail_counters(&self) -> Vec<super::CounterSnapshot> {
        self.rails.iter().map(|e| e.counters().snapshot()).collect()
    }
}

impl Drop for RailGroup {
    /// Stops every rail at once (each stop waits for its worker to see the command).
    fn drop(&mut self) {
        at_once(std::mem::take(&mut self.rails), drop);
    }
}

/// Every command sent first (the iterator is drained), then every answer, in order.
fn answers<'a, R: 'a>(sent: impl Iterator<Item = Result<Pending<'a, R>>>) -> Vec<Result<R>> {
    let sent: Vec<_> = sent.collect();
    sent.into_iter()
        .map(|p| p.and_then(Pending::finish))
        .collect()
}

/// `f(item)` for every item at once: a scoped thread per item and this thread take them
/// from a queue (with fewer threads where the OS refuses more, down to this one alone); the
/// results in the items' order.
fn at_once<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    let n = items.len();
    let (todo, queue) = crossbeam_channel::unbounded();
    for item in items.into_iter().enumerate() {
        let _ = todo.send(item);
    }
    drop(todo);
    let (done, results) = crossbeam_channel::unbounded();
    let work = || {
        while let Ok((i, item)) = queue.recv() {
            let _ = done.send((i, f(item)));
        }
    };
    std::thread::scope(|s| {
        for _ in 1..n {
            if std::thread::Builder::new().spawn_scoped(s, work).is_err() {
                break;
            }
        }
        work();
    });
    drop(done);
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    for (i, r) in results {
        out[i] = Some(r);
    }
    // Every item was taken (this thread drained the queue) and every taker has finished.
    out.into_iter()
        .map(|r| r.expect("every item ran"))
        .collect()
}

/// A transfer submitted to a rail group: the same handle as one engine's.
pub type GroupHandle = TransferHandle;

/// A transfer checked and planned once by [`RailGroup::prepare`], started any number of
/// times by [`RailGroup::post`] (NIXL's prepared descriptor lists): posting it plans
/// nothing. It belongs to the group that prepared it (another group refuses it), and names
/// its regions by key: a post after the local region was deregistered fails.
#[derive(Clone, Debug)]
pub struct PreparedTransfer {
    /// The group that prepared it (its shared state's address).
    group: usize,
    peers: Vec<PeerId>,
    srcs: Vec<LocalKey>,
    dsts: Vec<RemoteRegion>,
    writes: Arc<Vec<PlannedWrite>>,
    bytes: u64,
    chunk: u64,
    imm: Option<(u32, u64, u64)>,
    message: Option<Arc<[u8]>>,
    direction: Direction,
    timeout: Option<Duration>,
}

impl PreparedTransfer {
    /// The bytes each post moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The operations (writes or reads, after coalescing and splitting) each post makes.
    pub fn ops(&self) -> usize {
        self.writes.len()
    }
}

fn chunk_len(writes: &[PlannedWrite]) -> u64 {
    writes.iter().map(PlannedWrite::bytes).sum()
}

/// `writes` (planned with rail 0's keys) as rail `src`/`dst` names the same memory.
fn on_rail(mut writes: Vec<PlannedWrite>, src: LocalKey, dst: RemoteRegion) -> Vec<PlannedWrite> {
    for w in &mut writes {
        w.src.key = src;
        w.dst.region = dst;
    }
    writes
}

/// The zero-length segment that carries immediate data on a rail.
fn imm_segment(src: LocalKey, src_offset: u64, dst: RemoteRegion, dst_offset: u64) -> Segment {
    Segment {
        src,
        src_offset,
        dst,
        dst_offset,
        len: 0,
    }
}

/// A transfer spread over several rails, shared by its chunks' completion callbacks (which
/// run on the rails' workers) and the group's queue.
struct GroupState {
    work: Mutex<Work>,
    /// Bytes per chunk.
    chunk: u64,
    /// The transfer's bytes over the rails: the most a fast rail's chunk takes.
    share: u64,
    /// Per local rail: the peer, the local key and the remote region of the same memory.
    peers: Vec<PeerId>,
    srcs: Vec<LocalKey>,
    dsts: Vec<RemoteRegion>,
    /// The immediate value and the offsets of the segment that carries it.
    imm: Option<(u32, u64, u64)>,
    /// The message sent once every chunk landed.
    message: Option<Arc<[u8]>>,
    /// Every chunk's direction.
    direction: Direction,
    /// What every chunk waits for before it is posted.
    after: Option<Arc<dyn Fence>>,
    shared: Arc<Shared>,
    deadline: Option<Instant>,
    /// When it was submitted (for the group's latency).
    submitted: Instant,
    bytes: u64,
    slot: Arc<Slot<TransferResult>>,
}

/// What is left of a transfer.
struct Work {
    /// The transfer's writes; those from `next` on no rail has taken yet.
    writes: Arc<Vec<PlannedWrite>>,
    next: usize,
    /// The chunks handed to rails, by rail (those finished are dead).
    chunks: Vec<(usize, Weak<Slot<TransferResult>>)>,
    /// Chunks posted and not finished.
    posted: usize,
    /// Whether the transfer has been decided.
    finished: bool,
    /// The first error of any chunk; once set, no further chunk starts.
    error: Option<OpError>,
    ops: u64,
}

impl Work {
    /// The writes no rail has taken yet.
    fn left(&self) -> &[PlannedWrite] {
        &self.writes[self.next..]
    }
}

impl GroupState {
    fn lock_work(&self) -> std::sync::MutexGuard<'_, Work> {
        self.work.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The job that carries `writes` on rail `rail`; its completion calls
    /// [`chunk_done`](Self::chunk_done) on that rail's worker.
    fn chunk_job(self: &Arc<Self>, rail: usize, writes: Vec<PlannedWrite>) -> Job {
        let bytes = chunk_len(&writes);
        let st = self.clone();
        let posted = Instant::now();
        let slot = Slot::with_callback(Box::new(move |r| st.chunk_done(rail, bytes, posted, r)));
        {
            let mut w = self.lock_work();
            w.chunks.retain(|(_, s)| s.strong_count() > 0);
            w.chunks.push((rail, Arc::downgrade(&slot)));
        }
        Job {
            peer: self.peers[rail],
            plan: crate::plan::TransferPlan {
                writes: on_rail(writes, self.srcs[rail], self.dsts[rail]),
                bytes,
            },
            direction: self.direction,
            imm: None,
            message: None,
            slot,
            deadline: self.deadline,
            submitted: posted,
            after: self.after.clone(),
            watch: Some(self.slot.clone()),
        }
    }

    /// Cancels the transfer: no chunk starts any more, the chunks in flight are cancelled on
    /// their rails, and the transfer is decided (with `Cancelled`) when the last of them
    /// finishes, or now if none is in flight.
    fn cancel(self: &Arc<Self>) {
        let (decided, chunks) = {
            let mut w = self.lock_work();
            if w.finished {
                return;
            }
            w.error.get_or_insert(OpError::Cancelled);
            w.next = w.writes.len();
            if w.posted == 0 {
                w.finished = true;
                (Some(w.error.take()), Vec::new())
            } else {
                let chunks: Vec<_> = (w.chunks.iter())
                    .filter_map(|(r, s)| s.upgrade().map(|s| (*r, s)))
                    .collect();
                (None, chunks)
            }
        };
        if let Some(error) = decided {
            self.clone().decide(0, error, 0);
        }
        for (rail, slot) in chunks {
            self.shared.links[rail].cancel(slot);
        }
    }

    /// A chunk finished on `rail` with `r` (on that rail's worker). The last one decides
    /// the transfer: an error ends it, else the immediate data goes out on the same rail
    /// and the transfer completes when it lands. Then the rail takes the next chunks from
    /// the group's queue, on its own worker.
    fn chunk_done(self: Arc<Self>, rail: usize, bytes: u64, posted: Instant, r: TransferResult) {
        let shared = self.shared.clone();
        shared.landed(rail, bytes, posted, r.is_ok());
        let decided = {
            let mut w = self.lock_work();
            w.posted -= 1;
            match r {
                Ok(s) => w.ops += s.ops,
                Err(e) => {
                    w.error.get_or_insert(e);
                    // Writes not taken never will be.
                    w.next = w.writes.len();
                }
            }
            if w.posted == 0 && w.left().is_empty() && !w.finished {
                w.finished = true;
                Some((w.error.take(), w.ops))
            } else {
                None
            }
        };
        if let Some((error, ops)) = decided {
            self.decide(rail, error, ops);
        }
        shared.fill(rail);
    }

    /// Completes the transfer's handle with `r`, its registration no longer used by it.
    fn complete(&self, r: TransferResult) {
        self.shared.release(self.srcs[0]);
        self.slot.complete(r);
    }

    /// Completes the transfer with `error`, or sends its immediate data on `rail` first.
    fn decide(self: Arc<Self>, rail: usize, error: Option<OpError>, ops: u64) {
        if let Some(e) = error {
            self.complete(Err(e));
            return;
        }
        let stats = TransferStats {
            bytes: self.bytes,
            ops,
        };
        if self.imm.is_none() && self.message.is_none() {
            self.shared.latency.record(self.submitted.elapsed());
            self.complete(Ok(stats));
            return;
        }
        let imm = self
            .imm
            .map(|(v, so, d_o)| (v, imm_segment(self.srcs[rail], so, self.dsts[rail], d_o)));
        let st = self.clone();
        let job = Job {
            peer: self.peers[rail],
            plan: crate::plan::TransferPlan {
                writes: Vec::new(),
                bytes: 0,
            },
            direction: Direction::Write,
            imm,
            message: self.message.clone(),
            slot: Slot::with_callback(Box::new(move |r: TransferResult| {
                if r.is_ok() {
                    st.shared.latency.record(st.submitted.elapsed());
                }
                st.complete(r.map(|s| TransferStats {
                    bytes: stats.bytes,
                    ops: stats.ops + s.ops,
                }))
            })),
            deadline: self.deadline,
            submitted: Instant::now(),
            // Every chunk has landed: whatever they waited for has finished.
            after: None,
            watch: Some(self.slot.clone()),
        };
        if let Err(slot) = self.shared.links[rail].send_transfer(job) {
            slot.complete(Err(OpError::Cancelled));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::at_once;

    #[test]
    fn results_keep_the_order_of_the_items() {
        // That they run at the same time is `tests/rails.rs`'s `rails_start_at_once`.
        let out = at_once((0..64).collect(), |i: usize| i * 2);
        assert_eq!(out, (0..64).map(|i| i * 2).collect::<Vec<_>>());
        assert_eq!(at_once(vec![7], |i: i32| i + 1), vec![8]);
        assert!(at_once(Vec::<u8>::new(), |i| i).is_empty());
    }
}
