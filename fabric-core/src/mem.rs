//! `mem`: an in-process transport with the same semantics as the others and no I/O.
//!
//! Peers are other `MemTransport`s of the same process, found by address. A WRITE is
//! checked against local state when posted (local key and bounds, peer), then validated
//! against the target's registrations (key, permission, bounds) and copied in the next
//! [`poll`](Transport::poll), together with the other writes posted since, under one lock
//! of the target per run of writes; any call that could observe a pending write (SEND,
//! peer removal, deregistration, drop) carries them out first. READs take the same path the
//! other way (checked against the owner's REMOTE_READ, copied into the local region), in
//! posting order with the writes. SENDs go to the target's
//! posted receives or its bounded early-arrival queue at once. Used to test the engine
//! and to measure its own overhead (`xfer demo --transport mem`).

use crate::Invalid;
use crate::error::{Error, OpError, Result};
use crate::in_place;
use crate::memory::{MemoryRegion, check_range};
use crate::recv::{Arrival, PostedRecv, RecvMatch};
use crate::stats::{PeerState, TransportStats};
use crate::transport::{Completion, OpKind, PostOutcome, Transport, TransportLimits};
use crate::types::{
    Access, LocalKey, LocalSlice, PeerId, Registration, RemoteKey, RemoteRegion, RemoteSlice, Rows,
    WorkRequestId,
};
use crate::wake::{Signal, Wake};
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

const PREFIX: &str = "mem://";
/// Completions a transport holds before posts answer `NoRoom`.
const MAX_PENDING: usize = 1 << 16;
/// Early-arrival queue for SENDs.
const MAX_UNEXPECTED: usize = 4096;
/// How many writes ahead of its copies a run prefetches: enough to overlap the misses of
/// scattered small writes, few enough that the lines stay in L1 until copied (a whole
/// run's worth, 512 lines, evicted each other and cost ~20% more per write).
const PREFETCH_AHEAD: usize = 16;
/// Pending writes carried out under one lock of the target, at most.
const RUN_OPS: usize = 256;
/// Bytes copied under one lock of the target, at most (a run ends after the write that
/// crosses it), so that the target's own calls never wait long.
const RUN_BYTES: u64 = 1 << 20;

/// The maps on the data path: their keys are small integers chosen by this process (local
/// keys, peer ids, remote keys), so FxHash's multiply spreads them well enough, at a
/// fraction of SipHash's cost.
type KeyMap<K, V> = rustc_hash::FxHashMap<K, V>;

struct Target {
    mem: Arc<dyn MemoryRegion>,
    access: Access,
}

struct Inbox {
    targets: KeyMap<u64, Target>,
    /// Posted receives and early arrivals.
    recv: RecvMatch,
    /// Completions produced by peers' operations (remote writes, receives).
    events: Vec<Completion>,
}

struct Endpoint {
    id: u64,
    inbox: Mutex<Inbox>,
    /// Raised when a peer leaves events in the inbox (or the engine has work): `wait`
    /// sleeps on it.
    signal: Arc<Signal>,
    /// What peers did to this endpoint: their writes count the bytes they place here.
    stats: Arc<TransportStats>,
}

fn registry() -> &'static Mutex<HashMap<u64, Weak<Endpoint>>> {
    static R: OnceLock<Mutex<HashMap<u64, Weak<Endpoint>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A registered region: the memory, its access, its remote key.
type LocalRegion = (Arc<dyn MemoryRegion>, Access, u64);

/// A write accepted by `post_write` (or a read accepted by `post_read`), carried out by
/// [`MemTransport::run_writes`].
struct PendingWrite {
    peer: PeerId,
    wr_id: WorkRequestId,
    /// The local range: a write's source, a read's destination.
    src: LocalSlice,
    /// The peer's range: a write's destination, a read's source.
    dst: RemoteSlice,
    imm: Option<u32>,
    /// A READ: bytes go from `dst` (the peer's) into `src` (ours).
    read: bool,
    /// A strided write's rows (`src` and `dst` are then its first row; checked at post).
    rows: Option<Rows>,
}

impl PendingWrite {
    /// The strides and rows: `(count, src_stride, dst_stride)`, one row for a plain write.
    fn shape(&self) -> (u64, u64, u64) {
        match self.rows {
            Some(r) => (r.count, r.src_stride, r.dst_stride),
            None => (1, 0, 0),
        }
    }

    /// Bytes it moves.
    fn bytes(&self) -> u64 {
        self.dst.len.saturating_mul(self.shape().0)
    }

    /// The span of its rows on one side, from the first row's start to the last's end.
    fn span(&self, stride: u64) -> u64 {
        let (count, _, _) = self.shape();
        (count - 1)
            .saturating_mul(stride)
            .saturating_add(self.dst.len)
    }
}

/// The in-memory transport.
pub struct MemTransport {
    me: Arc<Endpoint>,
    peers: KeyMap<PeerId, Weak<Endpoint>>,
    next_peer: u64,
    local: KeyMap<LocalKey, LocalRegion>,
    next_local: u64,
    /// Writes posted and not carried out yet, in posting order.
    writes: Vec<PendingWrite>,
    /// The source region (and its length) and the peer of the last write posted: a run
    /// of writes from one region to one peer checks them without map lookups.
    last_src: Option<(LocalKey, u64)>,
    last_peer: Option<(PeerId, Weak<Endpoint>)>,
    done: Vec<Completion>,
    /// Peers whose inbox got events in the last `poll`, woken by the next (see
    /// [`wake_peers`](Self::wake_peers)).
    wake_later: Vec<Arc<Signal>>,
}

impl Default for MemTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl MemTransport {
    /// A new endpoint, reachable by its [`address`](Transport::address) in this process.
    pub fn new() -> MemTransport {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let me = Arc::new(Endpoint {
            id,
            inbox: Mutex::new(Inbox {
                targets: KeyMap::default(),
                recv: RecvMatch::new(MAX_UNEXPECTED, usize::MAX),
                events: Vec::new(),
            }),
            signal: Arc::new(Signal::new()),
            stats: Arc::new(TransportStats::default()),
        });
        lock(registry()).insert(id, Arc::downgrade(&me));
        MemTransport {
            me,
            peers: KeyMap::default(),
            next_peer: 1,
            local: KeyMap::default(),
            next_local: 1,
            writes: Vec::new(),
            last_src: None,
            last_peer: None,
            done: Vec::new(),
            wake_later: Vec::new(),
        }
    }

    fn src(&self, s: &LocalSlice) -> Result<&Arc<dyn MemoryRegion>> {
        let (m, _, _) = self
            .local
            .get(&s.key)
            .ok_or_else(|| Error::Op(OpError::LocalKeyInvalid(s.key)))?;
        check_range(s.offset, s.len, m.len() as u64).map_err(Error::Memory)?;
        Ok(m)
    }

    fn peer(&self, p: PeerId) -> Result<Arc<Endpoint>> {
        let w = self.peers.get(&p).ok_or_else(|| Error::UnknownPeer(p))?;
        w.upgrade().ok_or_else(|| endpoint_dropped(p))
    }

    /// Wakes the peers that [`run_writes`](Self::run_writes) left events for. `poll` does
    /// this at its next call, not in the one that copied: waking a sleeping thread is a
    /// system call of several microseconds, and the engine completes our own transfers in
    /// between, so the initiator's completion no longer waits for the target's wake-up.
    /// `wait`, every other call that runs writes, and drop wake them at once.
    fn wake_peers(&mut self) {
        for w in self.wake_later.drain(..) {
            w.wake();
        }
    }

    /// Carries out the pending writes, in posting order: one lock of the target per run
    /// of writes to the same peer (at most [`RUN_OPS`] writes, about [`RUN_BYTES`] bytes).
    fn run_writes(&mut self) {
        if self.writes.is_empty() {
            return;
        }
        let writes = std::mem::take(&mut self.writes);
        let me = self.me.id;
        let mut rest = &writes[..];
        while let Some(first) = rest.first() {
            let mut n = 0;
            let mut bytes = 0;
            while n < rest.len().min(RUN_OPS) && rest[n].peer == first.peer && bytes < RUN_BYTES {
                bytes += rest[n].bytes();
                n += 1;
            }
            let (run, tail) = rest.split_at(n);
            rest = tail;
            // Posts checked the peer; it can only have gone away since (endpoint dropped).
            let Some(ep) = self.peers.get(&first.peer).and_then(Weak::upgrade) else {
                for w in run {
                    self.done.push(Completion {
                        wr_id: w.wr_id,
                        op: OpKind::one_sided(w.read),
                        result: Err(OpError::PeerUnreachable {
                            peer: w.peer,
                            reason: "endpoint dropped".into(),
                        }),
                        peer: Some(w.peer),
                        imm: None,
                    });
                }
                continue;
            };
            let mut inbox = lock(&ep.inbox);
            let events_before = inbox.events.len();
            // Bytes this run placed in the peer's memory (its writes, not reads).
            let (mut placed, mut writes_placed, mut served) = (0u64, 0u64, 0u64);
            let mut views = RunViews::default();
            for w in &run[..PREFETCH_AHEAD.min(run.len())] {
                let (s, d) = views.of(&self.local, &inbox, w);
                prefetch_write(w, s, d);
            }
            for (i, w) in run.iter().enumerate() {
                if let Some(later) = run.get(i + PREFETCH_AHEAD) {
                    let (s, d) = views.of(&self.local, &inbox, later);
                    prefetch_write(later, s, d);
                }
                let (s, d) = views.of(&self.local, &inbox, w);
                let result = write_into(&self.local, &inbox, w, s, d);
                match (&result, w.read) {
                    (Ok(len), false) => {
                        placed += len;
                        writes_placed += 1;
                    }
                    (Ok(len), true) => served += len,
                    _ => {}
                }
                if let (Ok(len), Some(v)) = (&result, w.imm) {
                    inbox.events.push(Completion {
                        wr_id: WorkRequestId(0),
                        op: OpKind::RemoteWrite,
                        result: Ok(*len),
                        peer: Some(PeerId(me)),
                        imm: Some(v),
                    });
                }
                // Success is built from scalars, in place (see `in_place`).
                let (wr_id, peer, op) = (w.wr_id, Some(w.peer), OpKind::one_sided(w.read));
                match result {
                    Ok(len) => in_place::push(&mut self.done, || Completion {
                        wr_id,
                        op,
                        result: Ok(len),
                        peer,
                        imm: None,
                    }),
                    Err(e) => self.done.push(Completion {
                        wr_id,
                        op,
                        result: Err(e),
                        peer,
                        imm: None,
                    }),
                }
            }
            let notify = inbox.events.len() > events_before;
            drop(inbox);
            TransportStats::add(&ep.stats.received_bytes, placed);
            TransportStats::add(&ep.stats.received_writes, writes_placed);
            TransportStats::add(&ep.stats.served_read_bytes, served);
            if notify && !self.wake_later.iter().any(|w| Arc::ptr_eq(w, &ep.signal)) {
                self.wake_later.push(ep.signal.clone());
            }
        }
        // Keep the allocation for the next posts.
        let mut writes = writes;
        writes.clear();
        self.writes = writes;
    }

    fn copy_out(&self, s: &LocalSlice) -> Result<Vec<u8>> {
        let mut v = vec![0u8; s.len as usize];
        self.src(s)?.read_to_host(s.offset, &mut v)?;
        Ok(v)
    }
}

impl Drop for MemTransport {
    fn drop(&mut self) {
        // Posted writes land, as they would have on the wire.
        self.run_writes();
        self.wake_peers();
        lock(registry()).remove(&self.me.id);
    }
}

fn endpoint_dropped(peer: PeerId) -> Error {
    Error::Op(OpError::PeerUnreachable {
        peer,
        reason: "endpoint dropped".into(),
    })
}

/// What a write needs of a region: looked up, with the region's virtual calls, once per
/// run of writes that use it.
#[derive(Clone, Copy)]
struct View {
    /// The host address of the first byte, for host memory. Valid while the run lasts:
    /// the source is registered (deregistration runs pending writes first) and the target
    /// stays registered while its inbox is locked; both maps hold the region's `Arc`.
    base: Option<NonNull<u8>>,
    len: u64,
    access: Access,
}

impl View {
    fn of(mem: &dyn MemoryRegion, access: Access) -> View {
        View {
            base: mem.host_ptr(),
            len: mem.len() as u64,
            access,
        }
    }
}

/// The views of the last source and target regions of a run.
#[derive(Default)]
struct RunViews {
    src: Option<(LocalKey, Option<View>)>,
    dst: Option<(u64, Option<View>)>,
}

impl RunViews {
    /// The views of `w`'s source and target (`None` where the key is unknown).
    #[inline(always)]
    fn of(
        &mut self,
        local: &KeyMap<LocalKey, LocalRegion>,
        inbox: &Inbox,
        w: &PendingWrite,
    ) -> (Option<View>, Option<View>) {
        let s = match self.src {
            Some((key, v)) if key == w.src.key => v,
            _ => {
                let v = local.get(&w.src.key).map(|r| View::of(&*r.0, r.1));
                self.src = Some((w.src.key, v));
                v
            }
        };
        let key = w.dst.region.key.0;
        let d = match self.dst {
            Some((k, v)) if k == key => v,
            _ => {
                let v = inbox.targets.get(&key).map(|t| View::of(&*t.mem, t.access));
                self.dst = Some((key, v));
                v
            }
        };
        (s, d)
    }
}

/// Asks the CPU to start loading the first line of a write's source and destination. A
/// run issues these [`PREFETCH_AHEAD`] writes ahead of its copies, so that scattered small
/// writes wait on memory together rather than one after another.
fn prefetch_write(w: &PendingWrite, s: Option<View>, d: Option<View>) {
    if w.src.len == 0 {
        return;
    }
    // Unchecked offsets are fine: a prefetch is a hint, never an access.
    if let Some(base) = s.and_then(|v| v.base) {
        prefetch(base.as_ptr().wrapping_add(w.src.offset as usize));
    }
    if let Some(base) = d.and_then(|v| v.base) {
        prefetch(base.as_ptr().wrapping_add(w.dst.offset as usize));
    }
}

#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: SSE is part of the x86_64 baseline, and a prefetch neither faults nor
        // counts as a memory access, whatever the address.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Validates a write against the target's registrations and copies it. `s` and `d` are
/// the views of its source and target, from [`RunViews::of`].
fn write_into(
    local: &KeyMap<LocalKey, LocalRegion>,
    inbox: &Inbox,
    w: &PendingWrite,
    s: Option<View>,
    d: Option<View>,
) -> std::result::Result<u64, OpError> {
    let (src, dst) = (&w.src, &w.dst);
    // Deregistration runs pending writes first, so the source is still there.
    let s = s.ok_or(OpError::LocalKeyInvalid(src.key))?;
    let d = d.ok_or(OpError::RemoteKeyInvalid(dst.region.key))?;
    let need = if w.read {
        Access::REMOTE_READ
    } else {
        Access::REMOTE_WRITE
    };
    if !d.access.contains(need) {
        return Err(OpError::PermissionDenied);
    }
    // A strided write's whole span is checked before any of its rows lands.
    let (count, src_stride, dst_stride) = w.shape();
    let dst_span = w.span(dst_stride);
    if check_range(dst.offset, dst_span, d.len).is_err() {
        return Err(OpError::OutOfBounds {
            offset: dst.offset,
            len: dst_span,
            region_len: d.len,
        });
    }
    match (s.base, d.base) {
        (Some(sb), Some(db)) => {
            check_range(src.offset, w.span(src_stride), s.len).map_err(OpError::transport)?;
            for i in 0..count {
                let local = sb
                    .as_ptr()
                    .wrapping_add((src.offset + i * src_stride) as usize);
                let remote = db
                    .as_ptr()
                    .wrapping_add((dst.offset + i * dst_stride) as usize);
                let (from, to) = if w.read {
                    (remote, local)
                } else {
                    (local, remote)
                };
                // SAFETY: both spans lie inside their regions (checked just above), so
                // every row does; the regions are alive and unmoved for the whole run (see
                // `View::base`); `copy` tolerates overlap (a region written to itself).
                unsafe { std::ptr::copy(from, to, dst.len as usize) };
            }
            Ok(w.bytes())
        }
        _ => {
            // Views exist only for registered regions, so both lookups succeed.
            let (sm, t) = match (local.get(&src.key), inbox.targets.get(&dst.region.key.0)) {
                (Some(sm), Some(t)) => (sm, t),
                (None, _) => return Err(OpError::LocalKeyInvalid(src.key)),
                (_, None) => return Err(OpError::RemoteKeyInvalid(dst.region.key)),
            };
            for i in 0..count {
                let (so, d_o) = (src.offset + i * src_stride, dst.offset + i * dst_stride);
                if w.read {
                    copy_region(&*t.mem, d_o, &*sm.0, so, dst.len)?;
                } else {
                    copy_region(&*sm.0, so, &*t.mem, d_o, dst.len)?;
                }
            }
            Ok(w.bytes())
        }
    }
}

fn copy_region(
    src: &dyn MemoryRegion,
    so: u64,
    dst: &dyn MemoryRegion,
    d_o: u64,
    len: u64,
) -> std::result::Result<(), OpError> {
    let err = |e: crate::MemoryError| OpError::transport(e);
    match (src.host_ptr(), dst.host_ptr()) {
        (Some(_), Some(_)) => {
            let s = crate::memory::checked_host_ptr(src, so, len).map_err(err)?;
            let d = crate::memory::checked_host_ptr(dst, d_o, len).map_err(err)?;
            // SAFETY: both ranges were bounds-checked against live regions (kept alive by the
            // Arcs the caller holds); `copy` tolerates overlap (a region written to itself).
            unsafe { std::ptr::copy(s, d, len as usize) };
            Ok(())
        }
        _ => {
            let mut v = vec![0u8; len as usize];
            src.read_to_host(so, &mut v).map_err(err)?;
            dst.write_from_host(d_o, &v).map_err(err)
        }
    }
}

impl Transport for MemTransport {
    fn name(&self) -> &'static str {
        "mem"
    }

    fn address(&self) -> Vec<u8> {
        format!("{PREFIX}{}", self.me.id).into_bytes()
    }

    fn limits(&self) -> TransportLimits {
        TransportLimits {
            max_msg_size: 1 << 30,
            max_outstanding: MAX_PENDING,
            write_imm: true,
            busy_poll: true,
            strided_writes: true,
        }
    }

    /// Sleeps on the endpoint's signal, which peers raise when they leave it events (remote
    /// writes with immediate data, received messages) and the engine raises when it has work.
    fn wait(&mut self, timeout: Duration) -> Result<()> {
        self.wake_peers();
        if !self.done.is_empty() || !self.writes.is_empty() {
            return Ok(());
        }
        if !lock(&self.me.inbox).events.is_empty() {
            return Ok(());
        }
        self.me.signal.wait_timeout(timeout);
        Ok(())
    }

    fn waker(&mut self) -> Arc<dyn Wake> {
        self.me.signal.clone()
    }

    fn add_peer(&mut self, address: &[u8]) -> Result<PeerId> {
        let s =
            std::str::from_utf8(address).map_err(|_| Error::InvalidAddress("not UTF-8".into()))?;
        let id: u64 = s
            .strip_prefix(PREFIX)
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| Error::InvalidAddress(format!("{s:?} is not a mem:// address")))?;
        let ep = lock(registry()).get(&id).cloned().ok_or_else(|| {
            Error::InvalidAddress(format!("no mem endpoint {id} in this process"))
        })?;
        let p = PeerId(self.next_peer);
        self.next_peer += 1;
        self.peers.insert(p, ep);
        self.me.stats.peer_added(p, s.to_owned(), false);
        self.me.stats.peer_state(p, PeerState::Connected, 1);
        Ok(p)
    }

    /// A sender's id in the completions of its writes and messages is its endpoint's
    /// number (not a peer of this transport's table), so its address is that number's.
    fn peer_address(&self, peer: PeerId) -> Option<Vec<u8>> {
        Some(format!("{PREFIX}{}", peer.0).into_bytes())
    }

    fn remove_peer(&mut self, peer: PeerId) -> Result<()> {
        // Pending writes land first, so none is in flight to fail.
        self.run_writes();
        self.wake_peers();
        self.last_peer = None;
        self.peers.remove(&peer).ok_or(Error::UnknownPeer(peer))?;
        self.me.stats.peer_closed(peer, None);
        Ok(())
    }

    fn stats(&mut self) -> Option<Arc<TransportStats>> {
        Some(self.me.stats.clone())
    }

    fn register(&mut self, mem: Arc<dyn MemoryRegion>, access: Access) -> Result<Registration> {
        static KEYS: AtomicU64 = AtomicU64::new(0x5EED_0000_0000_0001);
        let rkey = KEYS.fetch_add(0x9E37_79B9, Ordering::Relaxed);
        let local = LocalKey(self.next_local);
        self.next_local += 1;
        let len = mem.len() as u64;
        lock(&self.me.inbox).targets.insert(
            rkey,
            Target {
                mem: mem.clone(),
                access,
            },
        );
        self.local.insert(local, (mem, access, rkey));
        Ok(Registration {
            local,
            remote: RemoteRegion {
                addr: 0,
                len,
                key: RemoteKey(rkey),
            },
        })
    }

    fn deregister(&mut self, key: LocalKey) -> Result<()> {
        // Pending writes from this region, or into it (a transport may be its own peer),
        // land first.
        self.run_writes();
        self.wake_peers();
        self.last_src = None;
        let (_, _, rkey) = self
            .local
            .remove(&key)
            .ok_or(Error::Op(OpError::LocalKeyInvalid(key)))?;
        lock(&self.me.inbox).targets.remove(&rkey);
        Ok(())
    }

    fn post_send(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        // A SEND lands after the writes posted before it.
        self.run_writes();
        self.wake_peers();
        if self.done.len() >= MAX_PENDING {
            return Ok(PostOutcome::NoRoom);
        }
        let ep = self.peer(peer)?;
        let data = self.copy_out(&src)?;
        let mut inbox = lock(&ep.inbox);
        let me = Some(PeerId(self.me.id));
        let Inbox { recv, events, .. } = &mut *inbox;
        let result = match recv.arrive(me, imm, &data, events) {
            Arrival::Delivered(res) => res,
            Arrival::Queued => Ok(src.len),
            Arrival::Full => return Ok(PostOutcome::NoRoom),
        };
        drop(inbox);
        // The peer's receive completed (or waits for it): wake its worker.
        ep.signal.wake();
        self.done.push(Completion {
            wr_id,
            op: OpKind::Send,
            result,
            peer: Some(peer),
            imm: None,
        });
        Ok(PostOutcome::Posted)
    }

    fn post_recv(&mut self, wr_id: WorkRequestId, dst: LocalSlice) -> Result<PostOutcome> {
        let m = self.src(&dst)?.clone();
        let access = self.local[&dst.key].1;
        if !access.contains(Access::LOCAL_WRITE) {
            return Err(Invalid::NotLocallyWritable {
                what: "a received message".into(),
            }
            .into());
        }
        let mut inbox = lock(&self.me.inbox);
        let Inbox { recv, events, .. } = &mut *inbox;
        let r = PostedRecv {
            wr_id,
            mem: m,
            offset: dst.offset,
            cap: dst.len,
        };
        recv.post(r, events);
        Ok(PostOutcome::Posted)
    }

    fn post_write(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        dst: RemoteSlice,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        crate::types::check_write_lengths(&src, &dst)?;
        self.queue_write(peer, wr_id, src, dst, None, imm)
    }

    fn post_write_rows(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        dst: RemoteSlice,
        rows: Rows,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        crate::types::check_write_lengths(&src, &dst)?;
        self.queue_write(peer, wr_id, src, dst, Some(rows), imm)
    }

    fn post_read(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        dst: LocalSlice,
        src: RemoteSlice,
    ) -> Result<PostOutcome> {
        crate::types::check_read_lengths(&dst, &src)?;
        if self.done.len() + self.writes.len() >= MAX_PENDING {
            return Ok(PostOutcome::NoRoom);
        }
        self.src(&dst)?;
        if !self.local[&dst.key].1.contains(Access::LOCAL_WRITE) {
            return Err(Invalid::NotLocallyWritable {
                what: "a READ".into(),
            }
            .into());
        }
        self.peer(peer)?;
        self.writes.push(PendingWrite {
            peer,
            wr_id,
            src: dst,
            dst: src,
            imm: None,
            read: true,
            rows: None,
        });
        Ok(PostOutcome::Posted)
    }

    fn supports_read(&self) -> bool {
        true
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        self.wake_peers();
        self.run_writes();
        let n0 = out.len();
        if out.is_empty() {
            // Hand over the whole buffer (and take `out`'s, empty) rather than copy.
            std::mem::swap(out, &mut self.done);
        } else {
            out.append(&mut self.done);
        }
        {
            let mut inbox = lock(&self.me.inbox);
            out.append(&mut inbox.events);
        }
        Ok(out.len() - n0)
    }
}

impl MemTransport {
    /// Queues a WRITE (of `rows`, when strided) after checking the rows, its local span and
    /// its peer; it runs at the next poll.
    fn queue_write(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        dst: RemoteSlice,
        rows: Option<Rows>,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        let span = match rows {
            Some(r) => r.check(src.len)?.0,
            None => src.len,
        };
        if self.done.len() + self.writes.len() >= MAX_PENDING {
            return Ok(PostOutcome::NoRoom);
        }
        match self.last_src {
            Some((key, len)) if key == src.key => {
                check_range(src.offset, span, len).map_err(Error::Memory)?
            }
            _ => {
                let len = self.src(&src)?.len() as u64;
                check_range(src.offset, span, len).map_err(Error::Memory)?;
                self.last_src = Some((src.key, len));
            }
        }
        let alive = match &self.last_peer {
            Some((p, ep)) if *p == peer => ep.strong_count() > 0,
            _ => {
                let ep = self
                    .peers
                    .get(&peer)
                    .ok_or_else(|| Error::UnknownPeer(peer))?;
                let alive = ep.strong_count() > 0;
                self.last_peer = Some((peer, ep.clone()));
                alive
            }
        };
        if !alive {
            return Err(endpoint_dropped(peer));
        }
        in_place::push(&mut self.writes, || PendingWrite {
            peer,
            wr_id,
            src,
            dst,
            imm,
            read: false,
            rows,
        });
        Ok(PostOutcome::Posted)
    }
}
