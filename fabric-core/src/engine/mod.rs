//! The transfer engine: a worker thread that owns one transport and turns transfers into
//! batched posts, deferred re-posts and one completion per transfer.
//!
//! The application talks to the worker over channels: [`Engine`] is a cheap handle.
//! A transfer is planned in the submitting thread (so bad segments fail at once),
//! queued in the worker's application-level queue, posted in batches of
//! [`EngineConfig::batch`], and what the transport refused ("no room") is posted again
//! after the next poll. Every wait has a timeout.
//!
//! ```
//! use fabric_core::engine::{Engine, EngineConfig, Transfer};
//! use fabric_core::plan::Segment;
//! use fabric_core::{Access, HostBuffer};
//! use std::time::Duration;
//! # fn main() -> fabric_core::Result<()> {
//! // `mem` is a loopback transport for tests; real code passes TcpTransport::new or similar.
//! let a = Engine::spawn(|| Ok(fabric_core::mem::MemTransport::new()), EngineConfig::default())?;
//! let b = Engine::spawn(|| Ok(fabric_core::mem::MemTransport::new()), EngineConfig::default())?;
//! let src = HostBuffer::new_shared(8192)?;
//! src.fill(0, 8192, 1)?;
//! let dst = HostBuffer::new_shared(8192)?;
//! let s = a.register(src, Access::NONE)?;
//! let d = b.register(dst.clone(), Access::REMOTE_WRITE)?;
//! let peer = a.add_peer(&b.address())?;
//! let t = Transfer::new(peer)
//!     .segment(Segment { src: s.local, src_offset: 0, dst: d.remote, dst_offset: 4096, len: 4096 })
//!     .imm(42);
//! let stats = a.submit(t)?.wait(Duration::from_secs(5))?;
//! assert_eq!(stats.bytes, 4096);
//! assert_eq!(b.next_event(Duration::from_secs(5))?.imm(), Some(42));
//! assert_eq!(dst.to_vec(4096, 4096)?, vec![1; 4096]);
//! # Ok(()) }
//! ```

mod counters;
mod handle;
mod notes;
mod rail_rate;
pub mod rails;
mod worker;

pub use rails::{
    Balance, GroupHandle, GroupPeer, GroupRegistration, GroupTransfer, PreparedTransfer, RailGroup,
    RemoteDescriptor, WARM_UP_IMM,
};

pub use crate::plan::Direction;
pub use counters::{CounterSnapshot, Counters, EngineStats, GroupStats};
pub(crate) use handle::Canceller;
pub use handle::{Received, RecvHandle, TransferHandle, TransferResult, TransferStats};
pub use notes::{Inbox, MAX_KEYS, Note, NoteKey, Notifications};

use crate::Invalid;
use crate::error::{Error, OpError, Result};
use crate::fence::Fence;
use crate::memory::{MemoryRegion, check_range};
use crate::plan::{Segment, plan_with_rows};
use crate::stats::{LatencyHistogram, TransportStats};
use crate::transport::{Transport, TransportLimits};
use crate::types::{Access, LocalKey, LocalSlice, PeerId, Registration};
use crate::wake::Wake;
use crossbeam_channel::{Receiver, Sender};
pub(crate) use handle::Slot;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use worker::{Command, Job};

/// Settings of an [`Engine`].
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Operations posted before the worker polls the transport again.
    pub batch: usize,
    /// Commands that may wait in the channel before submitters block (back-pressure).
    pub queue_depth: usize,
    /// The longest an idle worker sleeps in the transport's `wait`. Commands (submit,
    /// add/remove peer, register) wake it at once through the transport's
    /// [`waker`](Transport::waker), and peers' traffic wakes it through the transport; this
    /// only bounds how often an idle worker looks around (deadlines, housekeeping).
    pub idle_wait: Duration,
    /// Busy polling: after its last progress, the worker keeps polling (without sleeping)
    /// for this long before it sleeps in the transport's `wait`. Lower latency for a core
    /// kept busy meanwhile; zero (the default) sleeps at once, so an idle engine uses no CPU.
    pub busy_poll: Duration,
    /// How long a wait on one of this engine's handles ([`TransferHandle::wait`]) spins
    /// on the result before it sleeps. A spinning waiter sees its transfer finish without a
    /// wake-up (a system call by the worker, a scheduling delay for the waiter), which is
    /// most of a short transfer's cost; it spends its own thread's time, never more than
    /// this per wait, and yields the core to other runnable threads while it spins. Zero
    /// sleeps at once. The default, 200 µs, covers a loopback TCP round trip on a small
    /// VM; handles of a [`RailGroup`] use its first rail's setting.
    pub wait_spin: Duration,
    /// How long the worker keeps polling after one of its transfers finishes before it
    /// sleeps, so that the submit that usually follows a completion (wait, then submit the
    /// next) finds it awake and costs no wake-up. Bounded: an idle engine sleeps after this,
    /// and the worker yields its core to other runnable threads meanwhile. Zero sleeps at
    /// once (as [`busy_poll`](Self::busy_poll) allows); the default is 50 µs.
    pub linger: Duration,
    /// Limit for control calls (add_peer, register, ...) and for a full command queue.
    pub control_timeout: Duration,
    /// How long dropping (or [`shutdown`](Engine::shutdown) of) an engine waits for its
    /// worker to stop. A worker stuck in its transport past this is left behind (detached,
    /// logged) so that the caller never hangs; it exits when the transport returns.
    pub shutdown_timeout: Duration,
    /// Name of the worker thread.
    pub name: String,
    /// The most distinct (sender, value) pairs of peers' immediate data the engine's inbox
    /// keeps until the application takes them ([`Notifications`]); arrivals of new pairs
    /// beyond it are counted as refused and logged. 0 keeps none, quietly: for an
    /// application that never takes notifications (a server). Default [`MAX_KEYS`].
    pub notification_keys: usize,
    /// Receives the worker keeps posted for peers' messages ([`Transfer::message`]), each
    /// of [`MAX_MESSAGE`] bytes: every SEND that reaches the engine is then taken as a
    /// notification, and [`Engine::post_recv`] is refused. 0 (the default) posts none:
    /// SENDs wait for the application's own receives. While the inbox holds
    /// `notification_keys` pairs untaken, received messages are not replaced by new
    /// receives, so senders are held back (their transport's SEND credit) rather than
    /// their messages dropped. Ignored when `notification_keys` is 0.
    pub messages: usize,
}

/// The most bytes a message ([`Transfer::message`]) carries.
pub const MAX_MESSAGE: usize = 4096;

/// Refuses a message longer than [`MAX_MESSAGE`].
pub(crate) fn check_message(m: Option<&[u8]>) -> Result<()> {
    match m {
        Some(m) if m.len() > MAX_MESSAGE => Err(Invalid::TooLarge {
            op: "message",
            len: m.len() as u64,
            limit: MAX_MESSAGE as u64,
            setting: "MAX_MESSAGE",
        }
        .into()),
        _ => Ok(()),
    }
}

/// The segment a job names for immediate data that a message carries: none is written.
pub(crate) fn message_segment() -> Segment {
    Segment {
        src: LocalKey(0),
        src_offset: 0,
        dst: crate::types::RemoteRegion {
            addr: 0,
            len: 0,
            key: crate::types::RemoteKey(0),
        },
        dst_offset: 0,
        len: 0,
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            batch: 256,
            queue_depth: 4096,
            idle_wait: Duration::from_millis(10),
            busy_poll: Duration::ZERO,
            wait_spin: Duration::from_micros(200),
            linger: Duration::from_micros(50),
            control_timeout: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(5),
            name: "xfer-worker".into(),
            notification_keys: MAX_KEYS,
            messages: 0,
        }
    }
}

/// A transfer: segments from local regions to one peer's regions (a WRITE, the default),
/// or from the peer's regions into local ones (a READ, see [`Direction`]), optionally with
/// immediate data delivered to the peer once every byte has landed (WRITE only).
///
/// A READ's handle completes only once every byte of every segment has been placed in the
/// local regions; those regions must be registered with [`Access::LOCAL_WRITE`], the peer's
/// with [`Access::REMOTE_READ`].
///
/// **Ordering with the application's own work.** The engine reads a WRITE's sources (and
/// writes a READ's destinations) from its worker, at a time of its choosing after
/// `submit`. Memory that work the application has queued but that has not run yet (a GPU
/// kernel on a CUDA stream) is about to write, or still reads, must be named with
/// [`after`](Self::after): the transfer then waits for that work. Without a fence the
/// transfer may move the bytes as they were before that work ran. Host memory written by the
/// submitting thread before `submit` needs no fence.
#[derive(Clone, Debug)]
pub struct Transfer {
    /// The peer.
    pub peer: PeerId,
    /// What to move.
    pub segments: Vec<Segment>,
    /// Immediate data for the target, sent after all other writes are placed.
    pub imm: Option<u32>,
    /// A message for the peer, sent (as a SEND carrying `imm`, or 0) after every byte of
    /// the transfer was placed, WRITE or READ: the peer's engine must keep receives posted
    /// for it ([`EngineConfig::messages`]). At most [`MAX_MESSAGE`] bytes.
    pub message: Option<Arc<[u8]>>,
    /// Fail with `TimedOut` if not finished by then.
    pub timeout: Option<Duration>,
    /// Which way the bytes flow.
    pub direction: Direction,
    /// Work the transfer waits for before any transport touches its local memory (see
    /// [`Transfer`] and [`Fence`]).
    pub after: Option<Arc<dyn Fence>>,
}

impl Transfer {
    /// An empty transfer to `peer`.
    pub fn new(peer: PeerId) -> Transfer {
        Transfer {
            peer,
            segments: Vec::new(),
            imm: None,
            message: None,
            timeout: None,
            direction: Direction::Write,
            after: None,
        }
    }
    /// Sends `bytes` to the peer once the transfer's bytes are placed (see
    /// [`message`](Self::message)'s field).
    pub fn message(mut self, bytes: impl Into<Arc<[u8]>>) -> Transfer {
        self.message = Some(bytes.into());
        self
    }
    /// Waits for `fence` (work the application queued, e.g. a CUDA event recorded on its
    /// stream) before any transport touches the transfer's local memory.
    pub fn after(mut self, fence: Arc<dyn Fence>) -> Transfer {
        self.after = Some(fence);
        self
    }
    /// Makes it a READ: the segments' bytes go from the peer's regions into ours.
    pub fn read(mut self) -> Transfer {
        self.direction = Direction::Read;
        self
    }
    /// Sets the direction.
    pub fn direction(mut self, d: Direction) -> Transfer {
        self.direction = d;
        self
    }
    /// Adds a segment.
    pub fn segment(mut self, s: Segment) -> Transfer {
        self.segments.push(s);
        self
    }
    /// Sets the immediate data.
    pub fn imm(mut self, imm: u32) -> Transfer {
        self.imm = Some(imm);
        self
    }
    /// Sets a deadline relative to submission.
    pub fn timeout(mut self, t: Duration) -> Transfer {
        self.timeout = Some(t);
        self
    }
}

/// Something that happened at this end without a local request.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A peer's transfer with immediate data has landed in our memory.
    Imm {
        /// The sender, where the backend knows it.
        peer: Option<PeerId>,
        /// The immediate value.
        imm: u32,
    },
}

impl Event {
    /// The immediate value, for `Imm` events.
    pub fn imm(&self) -> Option<u32> {
        match self {
            Event::Imm { imm, .. } => Some(*imm),
        }
    }
}

/// What other workers use to hand a worker work: an unbounded channel (a worker never
/// blocks on another's queue) and the means to wake it. Holds no thread alive: a worker
/// stops when its [`Engine`] does.
pub(crate) struct WorkerLink {
    tx: Sender<Command>,
    /// Ends the worker's sleep in the transport's `wait`.
    waker: Arc<dyn Wake>,
    /// Set by the worker while it sleeps (or is about to): commands sent meanwhile wake it.
    sleeping: Arc<AtomicBool>,
}

impl WorkerLink {
    /// Asks the worker to cancel the transfer whose job carries `slot` (see
    /// [`TransferHandle::cancel`]); nothing if the worker has stopped.
    pub(crate) fn cancel(&self, slot: Arc<Slot<TransferResult>>) {
        if self.tx.send(Command::Cancel(slot)).is_ok() {
            self.wake();
        }
    }

    /// Queues a transfer without blocking; gives back its slot if the worker has stopped.
    pub(crate) fn send_transfer(
        &self,
        job: Job,
    ) -> std::result::Result<(), Arc<Slot<TransferResult>>> {
        let slot = job.slot.clone();
        self.tx.send(Command::Transfer(job)).map_err(|_| slot)?;
        self.wake();
        Ok(())
    }

    /// Wakes the worker if it sleeps (or is about to). Pairs with the worker's
    /// announcement in `Worker::sleep`: the command was queued before the fence, the flag
    /// is read after it, so either the worker sees the command before sleeping or we see
    /// the flag and wake it.
    fn wake(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.sleeping.swap(false, Ordering::SeqCst) {
            self.waker.wake();
        }
    }
}

/// A handle to a worker thread that owns one transport.
pub struct Engine {
    tx: Sender<Command>,
    link: Arc<WorkerLink>,
    /// Where peers' immediate data is counted; `notes` is this engine's own view of it.
    inbox: Arc<Inbox>,
    notes: Notifications,
    thread: Option<JoinHandle<()>>,
    /// Disconnects when the worker thread has ended.
    exited: Receiver<()>,
    address: Vec<u8>,
    backend: &'static str,
    limits: TransportLimits,
    /// Whether the transport implements READ.
    reads: bool,
    /// Length and access of every registered region.
    regions: Mutex<HashMap<LocalKey, (u64, Access)>>,
    counters: Arc<Counters>,
    /// Latency of this engine's successful transfers (the worker records them).
    latency: Arc<LatencyHistogram>,
    /// What the transport counts of its peers, if it does.
    transport_stats: Option<Arc<TransportStats>>,
    cfg: EngineConfig,
}

impl Engine {
    /// Starts a worker thread, creates the transport there with `make` (so that a `make`
    /// that pins the thread first gets its queues allocated on the right NUMA node), and
    /// returns once it is ready, or with `make`'s error.
    pub fn spawn<T, F>(make: F, cfg: EngineConfig) -> Result<Engine>
    where
        T: Transport,
        F: FnOnce() -> Result<T> + Send + 'static,
    {
        let (tx, rx) = crossbeam_channel::bounded(cfg.queue_depth.max(1));
        let inbox = Arc::new(Inbox::new(cfg.notification_keys));
        let worker_inbox = inbox.clone();
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
        // Disconnected when the worker thread ends, however it ends.
        let (exit_tx, exit_rx) = crossbeam_channel::bounded::<()>(0);
        let counters = Arc::new(Counters::default());
        let c2 = counters.clone();
        let latency = Arc::new(LatencyHistogram::default());
        let l2 = latency.clone();
        let wcfg = cfg.clone();
        let sleeping = Arc::new(AtomicBool::new(false));
        let s2 = sleeping.clone();
        let (internal_tx, internal_rx) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name(cfg.name.clone())
            .spawn(move || {
                let _exit = exit_tx;
                let mut t = match make() {
                    Ok(t) => t,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let waker = t.waker();
                let stats = t.stats();
                let _ = ready_tx.send(Ok((
                    t.address(),
                    t.name(),
                    t.limits(),
                    t.supports_read(),
                    waker,
                    stats,
                )));
                worker::Worker::new(t, rx, internal_rx, worker_inbox, (c2, l2), wcfg, s2).run();
            })
            .map_err(|e| Error::io("spawn worker thread", e))?;
        let (address, backend, limits, reads, waker, transport_stats) =
            match ready_rx.recv_timeout(cfg.control_timeout) {
                Ok(r) => r?,
                Err(_) => {
                    return Err(Error::TimedOut(
                        cfg.control_timeout,
                        "the transport to start",
                    ));
                }
            };
        Ok(Engine {
            tx,
            link: Arc::new(WorkerLink {
                tx: internal_tx,
                waker,
                sleeping,
            }),
            notes: Notifications::new(vec![inbox.clone()]),
            inbox,
            thread: Some(thread),
            exited: exit_rx,
            address,
            backend,
            limits,
            reads,
            regions: Mutex::new(HashMap::new()),
            counters,
            latency,
            transport_stats,
            cfg,
        })
    }

    /// The transport's address, for peers.
    pub fn address(&self) -> Vec<u8> {
        self.address.clone()
    }

    /// The backend's name.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// The backend's limits.
    pub fn limits(&self) -> TransportLimits {
        self.limits
    }

    /// Whether the backend implements READ ([`Transport::supports_read`]): READ transfers
    /// on one that does not fail at submission with [`Error::UnsupportedOp`].
    pub fn supports_read(&self) -> bool {
        self.reads
    }

    /// Whether the worker sleeps in its transport's wait (or is about to), with nothing
    /// queued: a diagnostic, and what tests of wake-ups wait for before they send work.
    pub fn is_asleep(&self) -> bool {
        self.link.sleeping.load(Ordering::SeqCst)
    }

    /// Live counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Everything this engine can tell about itself, read now: its counters (with the
    /// operations in flight and the events dropped), the latency of its transfers, the
    /// regions registered, and what its transport counted of its peers (bytes their
    /// WRITEs placed here, each peer's state and last error) where it keeps that.
    pub fn stats(&self) -> EngineStats {
        let (registered_bytes, registered_regions) = {
            let r = self.lock_regions();
            (r.values().map(|(len, _)| len).sum(), r.len())
        };
        EngineStats {
            backend: self.backend,
            counters: self.counters.snapshot(),
            latency: self.latency.snapshot(),
            registered_bytes,
            registered_regions,
            transport: self.transport_stats.as_ref().map(|t| t.snapshot()),
        }
    }

    pub(crate) fn send_cmd(&self, cmd: Command) -> Result<()> {
        self.tx
            .send_timeout(cmd, self.cfg.control_timeout)
            .map_err(|e| match e {
                crossbeam_channel::SendTimeoutError::Timeout(_) => {
                    Error::TimedOut(self.cfg.control_timeout, "room in the engine's queue")
                }
                crossbeam_channel::SendTimeoutError::Disconnected(_) => Error::EngineStopped,
            })?;
        self.link.wake();
        Ok(())
    }

    /// The link other workers use to hand this one work.
    pub(crate) fn link(&self) -> Arc<WorkerLink> {
        self.link.clone()
    }

    /// Sends a control command; its answer is read by [`Pending::finish`]. Sending to many
    /// workers first and then reading every answer lets them work at the same time.
    fn start<R>(
        &self,
        make: impl FnOnce(Sender<Result<R>>) -> Command,
        what: &'static str,
    ) -> Result<Pending<'_, R>> {
        let (rtx, rrx) = crossbeam_channel::bounded(1);
        self.send_cmd(make(rtx))?;
        Ok(Pending {
            engine: self,
            rx: rrx,
            what,
            after: None,
        })
    }

    /// Adds a peer by its transport address.
    pub fn add_peer(&self, address: &[u8]) -> Result<PeerId> {
        self.start_add_peer(address)?.finish().map(|(p, _)| p)
    }

    /// [`Engine::add_peer`], its answer read later: the peer, and the incarnation it
    /// announced ([`Transport::peer_instance`](crate::Transport::peer_instance)).
    pub(crate) fn start_add_peer(
        &self,
        address: &[u8],
    ) -> Result<Pending<'_, (PeerId, Option<u64>)>> {
        let a = address.to_vec();
        self.start(|r| Command::AddPeer(a, r), "add_peer")
    }

    /// Removes a peer; its pending transfers fail with `PeerRemoved`.
    pub fn remove_peer(&self, peer: PeerId) -> Result<()> {
        self.start_remove_peer(peer)?.finish()
    }

    /// [`Engine::remove_peer`], its answer read later.
    pub(crate) fn start_remove_peer(&self, peer: PeerId) -> Result<Pending<'_, ()>> {
        self.start(|r| Command::RemovePeer(peer, r), "remove_peer")
    }

    /// Registers memory with the transport.
    pub fn register(&self, mem: Arc<dyn MemoryRegion>, access: Access) -> Result<Registration> {
        self.start_register(mem, access)?.finish()
    }

    /// [`Engine::register`], its answer read later.
    pub(crate) fn start_register(
        &self,
        mem: Arc<dyn MemoryRegion>,
        access: Access,
    ) -> Result<Pending<'_, Registration>> {
        let len = mem.len() as u64;
        let mut p = self.start(|r| Command::Register(mem, access, r), "register")?;
        p.after = Some(Box::new(move |e: &Engine, reg: &Registration| {
            e.lock_regions().insert(reg.local, (len, access));
        }));
        Ok(p)
    }

    /// Deregisters memory.
    pub fn deregister(&self, key: LocalKey) -> Result<()> {
        self.start_deregister(key)?.finish()
    }

    /// [`Engine::deregister`], its answer read later.
    pub(crate) fn start_deregister(&self, key: LocalKey) -> Result<Pending<'_, ()>> {
        let mut p = self.start(|r| Command::Deregister(key, r), "deregister")?;
        p.after = Some(Box::new(move |e: &Engine, _: &()| {
            e.lock_regions().remove(&key);
        }));
        Ok(p)
    }

    fn lock_regions(&self) -> std::sync::MutexGuard<'_, HashMap<LocalKey, (u64, Access)>> {
        self.regions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_local(&self, key: LocalKey, offset: u64, len: u64, what: &str) -> Result<()> {
        let (size, _) = *self
            .lock_regions()
            .get(&key)
            .ok_or_else(|| Error::Op(OpError::LocalKeyInvalid(key)))?;
        check_range(offset, len, size).map_err(|_| local_range_error(what, offset, len, size))
    }

    /// As [`check_local`](Engine::check_local) for every segment, under one lock and with
    /// one map lookup per run of segments from the same region; a READ's local regions must
    /// also allow LOCAL_WRITE.
    fn check_segments(&self, segments: &[Segment], direction: Direction) -> Result<()> {
        let regions = self.lock_regions();
        let mut last: Option<(LocalKey, u64)> = None;
        for (i, s) in segments.iter().enumerate() {
            let size = match last {
                Some((key, size)) if key == s.src => size,
                _ => {
                    let (size, access) = *regions
                        .get(&s.src)
                        .ok_or_else(|| Error::Op(OpError::LocalKeyInvalid(s.src)))?;
                    if direction == Direction::Read && !access.contains(Access::LOCAL_WRITE) {
                        return Err(Invalid::NotLocallyWritable {
                            what: format!("segment {i}: a READ into local region {:?}", s.src),
                        }
                        .into());
                    }
                    last = Some((s.src, size));
                    size
                }
            };
            check_range(s.src_offset, s.len, size).map_err(|_| {
                local_range_error(&format!("segment {i}"), s.src_offset, s.len, size)
            })?;
        }
        Ok(())
    }

    /// Refuses what a READ cannot be: on a backend without READ, or with immediate data.
    pub(crate) fn check_direction(&self, direction: Direction, imm: Option<u32>) -> Result<()> {
        if direction == Direction::Read {
            if !self.reads {
                return Err(Error::UnsupportedOp {
                    backend: self.backend,
                    op: "READ",
                });
            }
            if imm.is_some() {
                return Err(Invalid::ImmOnRead.into());
            }
        }
        Ok(())
    }

    pub(crate) fn job(&self, t: Transfer, slot: Arc<Slot<TransferResult>>) -> Result<Job> {
        check_message(t.message.as_deref())?;
        // A message carries the immediate value itself, after a READ too.
        self.check_direction(t.direction, t.imm.filter(|_| t.message.is_none()))?;
        self.check_segments(&t.segments, t.direction)?;
        let plan = plan_with_rows(
            &t.segments,
            self.limits.max_msg_size,
            t.direction,
            self.limits.strided_writes,
        )?;
        let now = Instant::now();
        let imm = match (t.imm, t.segments.first(), &t.message) {
            (None, _, _) => None,
            (Some(v), _, Some(_)) => Some((v, message_segment())),
            (Some(_), None, None) => {
                return Err(Invalid::ImmWithoutSegment.into());
            }
            (Some(v), Some(first), None) => Some((v, *first)),
        };
        Ok(Job {
            peer: t.peer,
            plan,
            direction: t.direction,
            imm,
            message: t.message,
            slot,
            deadline: t.timeout.map(|d| now + d),
            submitted: now,
            after: t.after,
            watch: None,
        })
    }

    /// Submits a transfer. Bad segments (out of the remote region, overlapping
    /// destinations, unknown local region) fail here, before anything moves, and so does a
    /// READ on a backend without it ([`Error::UnsupportedOp`]).
    pub fn submit(&self, t: Transfer) -> Result<TransferHandle> {
        let slot = Slot::spinning(self.cfg.wait_spin);
        let job = self.job(t, slot.clone())?;
        self.send_cmd(Command::Transfer(job))?;
        Ok(TransferHandle {
            cancel: Some(self.canceller(slot.clone())),
            slot,
        })
    }

    /// What cancels the transfer whose job carries `slot`: a command on the channel the job
    /// went by, so that it reaches the worker after the job.
    pub(crate) fn canceller(&self, slot: Arc<Slot<TransferResult>>) -> Canceller {
        let (tx, link) = (self.tx.clone(), self.link.clone());
        let limit = self.cfg.control_timeout;
        Arc::new(move || {
            // A worker that stopped has failed its transfers already.
            if tx
                .send_timeout(Command::Cancel(slot.clone()), limit)
                .is_ok()
            {
                link.wake();
            }
        })
    }

    /// Submits a transfer and calls `done` on the worker thread when it finishes.
    /// Keep `done` short: the worker runs nothing else meanwhile.
    pub fn submit_with_callback(
        &self,
        t: Transfer,
        done: impl FnOnce(TransferResult) + Send + 'static,
    ) -> Result<()> {
        let slot = Slot::with_callback(Box::new(done));
        let job = self.job(t, slot)?;
        self.send_cmd(Command::Transfer(job))
    }

    /// Sends `src` to a receive the peer posted.
    pub fn send(&self, peer: PeerId, src: LocalSlice, imm: Option<u32>) -> Result<TransferHandle> {
        self.check_local(src.key, src.offset, src.len, "send")?;
        let slot = Slot::spinning(self.cfg.wait_spin);
        self.send_cmd(Command::Send {
            peer,
            src,
            imm,
            slot: slot.clone(),
        })?;
        Ok(TransferHandle { slot, cancel: None })
    }

    /// Posts a receive buffer for one message from any peer. Refused on an engine that
    /// takes every message as a notification ([`EngineConfig::messages`]).
    pub fn post_recv(&self, dst: LocalSlice) -> Result<RecvHandle> {
        if self.cfg.messages > 0 && self.cfg.notification_keys > 0 {
            return Err(Error::UnsupportedOp {
                backend: self.backend,
                op: "a receive of the application's own on an engine that takes messages as notifications",
            });
        }
        self.check_local(dst.key, dst.offset, dst.len, "receive")?;
        let slot = Slot::new();
        self.send_cmd(Command::Recv {
            dst,
            slot: slot.clone(),
        })?;
        Ok(RecvHandle { slot })
    }

    /// The next event (one arrival of a peer's immediate data, oldest sender and value
    /// first), waiting at most `timeout`. Arrivals are counted, never dropped, however late
    /// the application looks; see [`Notifications`] for waiting on a value and count.
    pub fn next_event(&self, timeout: Duration) -> Result<Event> {
        let n = self.notes.next(timeout)?;
        Ok(Event::Imm {
            peer: n.key.peer,
            imm: n.key.imm,
        })
    }

    /// This engine's notifications: wait for a value and count, take arrivals (and
    /// messages, with their bytes) one by one or all at once (see [`Notifications`]).
    pub fn notifications(&self) -> &Notifications {
        &self.notes
    }

    /// Where this engine counts peers' immediate data: give it to a [`Notifications`] to
    /// wait on several engines at once.
    pub fn inbox(&self) -> &Arc<Inbox> {
        &self.inbox
    }

    /// Stops the worker: pending transfers fail with `Cancelled`. Also done on drop. Returns
    /// within [`EngineConfig::shutdown_timeout`], even if the transport hangs.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let deadline = Instant::now() + self.cfg.shutdown_timeout;
        let _ = self
            .tx
            .send_timeout(Command::Shutdown, self.cfg.shutdown_timeout);
        self.link.wake();
        let Some(t) = self.thread.take() else {
            return;
        };
        // Bounded: a transport that hangs must not hang the caller.
        match self
            .exited
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                tracing::error!(
                    timeout = ?self.cfg.shutdown_timeout,
                    "engine worker did not stop in time; left behind"
                );
            }
            _ => {
                if t.join().is_err() {
                    tracing::error!("engine worker panicked");
                }
            }
        }
    }
}

fn local_range_error(what: &str, offset: u64, len: u64, size: u64) -> Error {
    Error::InvalidArgument(Invalid::LocalOutOfRange {
        what: what.to_owned(),
        offset,
        len,
        region_len: size,
    })
}

/// A control command sent to an engine's worker, its answer not read yet.
pub(crate) struct Pending<'e, R> {
    engine: &'e Engine,
    rx: Receiver<Result<R>>,
    what: &'static str,
    /// What the engine records once the worker said yes.
    after: Option<AfterOk<'e, R>>,
}

/// See [`Pending`]'s `after`.
type AfterOk<'e, R> = Box<dyn FnOnce(&Engine, &R) + 'e>;

impl<R> Pending<'_, R> {
    /// Waits for the answer, at most the engine's control timeout.
    pub(crate) fn finish(self) -> Result<R> {
        let timeout = self.engine.cfg.control_timeout;
        let r = match self.rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                Err(Error::TimedOut(timeout, self.what))
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(Error::EngineStopped),
        }?;
        if let Some(after) = self.after {
            after(self.engine, &r);
        }
        Ok(r)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.backend)
            .field("address", &String::from_utf8_lossy(&self.address))
            .finish()
    }
}

/// Polls `f` until it holds, at most `within` (for this module's tests).
#[cfg(test)]
pub(crate) fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::yield_now();
    }
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostBuffer;
    use crate::mem::MemTransport;

    /// One 4 KiB write from an engine with `cfg` to another; returns the initiator.
    fn one_transfer(cfg: EngineConfig) -> Engine {
        let a = Engine::spawn(|| Ok(MemTransport::new()), cfg).unwrap();
        let b = Engine::spawn(|| Ok(MemTransport::new()), EngineConfig::default()).unwrap();
        let s = a
            .register(HostBuffer::new_shared(4096).unwrap(), Access::NONE)
            .unwrap();
        let d = b
            .register(HostBuffer::new_shared(4096).unwrap(), Access::REMOTE_WRITE)
            .unwrap();
        let peer = a.add_peer(&b.address()).unwrap();
        let t = Transfer::new(peer).segment(Segment {
            src: s.local,
            src_offset: 0,
            dst: d.remote,
            dst_offset: 0,
            len: 4096,
        });
        let stats = a.submit(t).unwrap().wait(Duration::from_secs(10)).unwrap();
        assert_eq!(stats.bytes, 4096);
        a
    }

    #[test]
    fn a_worker_lingers_awake_after_a_transfer_then_sleeps() {
        let lingering = one_transfer(EngineConfig {
            linger: Duration::from_secs(60),
            ..EngineConfig::default()
        });
        // Lingering: it never announces a sleep, so the next submit needs no wake-up.
        assert!(!eventually(Duration::from_millis(50), || lingering
            .link
            .sleeping
            .load(Ordering::SeqCst)));
        // A command still reaches a lingering worker: shutdown returns.
        lingering.shutdown();
        let prompt = one_transfer(EngineConfig {
            linger: Duration::ZERO,
            ..EngineConfig::default()
        });
        assert!(
            eventually(Duration::from_secs(30), || prompt
                .link
                .sleeping
                .load(Ordering::SeqCst)),
            "without linger the idle worker goes to sleep"
        );
    }
}
