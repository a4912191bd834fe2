//! The worker loop: commands in, batched posts, deferred re-posts, polled completions out.

use super::handle::{Received, Slot, TransferResult, TransferStats, clock};
use super::notes::{Inbox, NoteKey};
use super::{Counters, EngineConfig, MAX_MESSAGE};
use crate::error::{Error, OpError, Result};
use crate::fence::Fence;
use crate::memory::{HostBuffer, MemoryRegion};
use crate::plan::{Direction, PlannedWrite, Segment, TransferPlan};
use crate::stats::LatencyHistogram;
use crate::transport::{Completion, OpKind, PostOutcome, Transport};
use crate::types::{
    Access, LocalKey, LocalSlice, PeerId, Registration, RemoteSlice, WorkRequestId,
};
use crossbeam_channel::{Receiver, Sender, TryRecvError};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A planned transfer on its way to the worker.
pub(crate) struct Job {
    pub peer: PeerId,
    pub plan: TransferPlan,
    /// WRITE (planned writes) or READ (the same, the bytes flowing in).
    pub direction: Direction,
    /// Immediate value and the segment whose region carries it.
    pub imm: Option<(u32, Segment)>,
    /// A message sent (as a SEND with the immediate value, or 0) once everything else
    /// landed, instead of the immediate-data write.
    pub message: Option<Arc<[u8]>>,
    pub slot: Arc<Slot<TransferResult>>,
    pub deadline: Option<Instant>,
    /// When it was submitted (its latency is counted from here).
    pub submitted: Instant,
    /// Work to wait for before anything of it is posted (see `Transfer::after`).
    pub after: Option<Arc<dyn Fence>>,
    /// The slot whose progress it reports (the whole transfer's, for a rail group's
    /// chunk); `None`: its own.
    pub watch: Option<Arc<Slot<TransferResult>>>,
}

/// Where an `add_peer` is answered: the peer once ready, and the incarnation it announced
/// (if any).
pub(crate) type PeerAnswer = Sender<Result<(PeerId, Option<u64>)>>;

pub(crate) enum Command {
    /// Answered once the peer is ready.
    AddPeer(Vec<u8>, PeerAnswer),
    RemovePeer(PeerId, Sender<Result<()>>),
    Register(Arc<dyn MemoryRegion>, Access, Sender<Result<Registration>>),
    Deregister(LocalKey, Sender<Result<()>>),
    Transfer(Job),
    /// Cancels the transfer whose job carries this slot, if it is still here.
    Cancel(Arc<Slot<TransferResult>>),
    Send {
        peer: PeerId,
        src: LocalSlice,
        imm: Option<u32>,
        slot: Arc<Slot<TransferResult>>,
    },
    Recv {
        dst: LocalSlice,
        slot: Arc<Slot<Result<Received, OpError>>>,
    },
    Shutdown,
}

/// What a queue entry stands for.
#[derive(Clone, Copy)]
enum QueuedOp {
    /// The transfer's planned writes not posted yet (`Active::writes[Active::next..]`).
    Writes,
    /// The write that carries the immediate data.
    Imm(PlannedWrite, u32),
    /// The SEND of the transfer's message, with this immediate value.
    Message(u32),
    Send(LocalSlice, Option<u32>),
}

#[derive(Clone, Copy)]
struct Queued {
    slot: u32,
    generation: u32,
    op: QueuedOp,
}

struct Active {
    generation: u32,
    peer: PeerId,
    slot: Arc<Slot<TransferResult>>,
    /// Where its progress is told (see `Job::watch`).
    watch: Option<Arc<Slot<TransferResult>>>,
    /// Operations queued or posted and not yet completed.
    remaining: u64,
    error: Option<OpError>,
    stats: TransferStats,
    /// The zero-length write that carries the immediate data, sent once all else landed
    /// (its value only, when a message carries it).
    final_imm: Option<(PlannedWrite, u32)>,
    /// The message sent instead of that write.
    message: Option<Arc<[u8]>>,
    /// The slot of the worker's send buffers that the message was copied into.
    out_slot: Option<u32>,
    deadline: Option<Instant>,
    /// When it was submitted.
    submitted: Instant,
    /// The planned writes (or reads), posted in order from `next`.
    writes: Vec<PlannedWrite>,
    next: usize,
    /// Whether `writes` are READs: their local ranges are written by the transport, and
    /// the transfer completes only once each has been placed (its completion says so).
    direction: Direction,
    /// The local regions it reads (counted in `Worker::in_use` until it finishes).
    keys: Vec<LocalKey>,
}

/// Counter increments not yet added to the shared [`Counters`]: the hot path adds here
/// and [`Worker::flush_counters`] publishes them, always before a transfer completes.
#[derive(Default)]
struct PendingCounters {
    bytes: u64,
    ops: u64,
    completed: u64,
    reposts: u64,
    errors: u64,
}

/// Peers whose addresses a worker keeps asked ([`Worker::arrived`]) before it forgets them.
const SENDERS_CACHED: usize = 4096;

/// Work-request ids: bit 63 marks receives; otherwise generation << 32 | slot.
const RECV_BIT: u64 = 1 << 63;
/// With [`RECV_BIT`]: a receive of the worker's own for messages; the low bits its slot.
const POOL_BIT: u64 = 1 << 62;

/// Registered host memory cut into [`MAX_MESSAGE`] slots: the worker's receives for
/// peers' messages, or the send buffers its messages are copied into.
struct Pool {
    mem: Arc<HostBuffer>,
    key: LocalKey,
    free: Vec<u32>,
}

impl Pool {
    /// `slots` slots registered on `t` with `access`.
    fn new<T: Transport>(t: &mut T, slots: usize, access: Access) -> Result<Pool> {
        let mem = HostBuffer::new_shared(slots * MAX_MESSAGE)
            .map_err(|e| Error::Op(OpError::transport(e)))?;
        let key = t.register(mem.clone(), access)?.local;
        Ok(Pool {
            mem,
            key,
            free: (0..slots as u32).rev().collect(),
        })
    }

    fn slice(&self, slot: u32, len: usize) -> LocalSlice {
        LocalSlice {
            key: self.key,
            offset: slot as u64 * MAX_MESSAGE as u64,
            len: len as u64,
        }
    }
}

/// Send buffers a worker keeps for messages: more wait in its queue for one to free up.
const SEND_SLOTS: usize = 64;

pub(crate) struct Worker<T: Transport> {
    t: T,
    rx: Receiver<Command>,
    /// Work handed over by other workers (a rail group's immediate data), never blocking.
    internal: Receiver<Command>,
    /// Where peers' immediate data is counted (never dropped).
    inbox: Arc<Inbox>,
    /// Each sender's address, as the transport says it, asked once per peer (a cache of
    /// at most [`SENDERS_CACHED`]).
    senders: HashMap<PeerId, Option<Arc<[u8]>>>,
    counters: Arc<Counters>,
    pending: PendingCounters,
    latency: Arc<LatencyHistogram>,
    /// `active` as last published in `counters`.
    published_active: usize,
    cfg: EngineConfig,
    slots: Vec<Option<Active>>,
    generations: Vec<u32>,
    free: Vec<u32>,
    queue: VecDeque<Queued>,
    recvs: HashMap<u64, Arc<Slot<Result<Received, OpError>>>>,
    next_recv: u64,
    completions: Vec<Completion>,
    deadlines: usize,
    next_deadline_scan: Instant,
    /// Transfers (and sends) under way.
    active: usize,
    /// The transport's `wait` cannot block on readiness.
    busy_poll: bool,
    /// Raised while the worker sleeps in `wait`, for the engine to wake it (see `sleep`).
    sleeping: Arc<AtomicBool>,
    /// When the worker last made progress, for [`EngineConfig::busy_poll`].
    last_progress: Instant,
    /// A transfer (or SEND) of ours finished since the loop last looked.
    finished: bool,
    /// Until when the worker polls without sleeping after a transfer finished
    /// ([`EngineConfig::linger`]).
    linger_until: Option<Instant>,
    /// Unfinished transfers (and SENDs) per local region: deregistration waits for zero.
    in_use: HashMap<LocalKey, usize>,
    /// Peers added whose set-up goes on in `poll`, with who waits for the answer.
    connecting: Vec<(PeerId, PeerAnswer)>,
    /// Transfers held until their fence reports done (slot, generation, fence): nothing of
    /// them is queued yet.
    fenced: Vec<(u32, u32, Arc<dyn Fence>)>,
    /// Receives for peers' messages ([`EngineConfig::messages`]), registered at start.
    receives: Option<Pool>,
    /// Receive slots not posted again while the inbox is full (the senders wait).
    parked: Vec<u32>,
    /// Send buffers for our messages, registered at the first.
    sends: Option<Pool>,
    /// The progress clock as of the last poll ([`clock`]).
    tick: u64,
}

/// How long a worker with transfers waiting for their fences sleeps between looks: a fence
/// (a CUDA event) cannot wake it, so it asks again this often.
const FENCE_POLL: Duration = Duration::from_micros(20);

fn wr_of(slot: u32, generation: u32) -> WorkRequestId {
    WorkRequestId(((generation as u64 & 0x7fff_ffff) << 32) | slot as u64)
}

/// The slot and generation a work-request id of [`wr_of`] names.
fn slot_of(wr: WorkRequestId) -> (u32, u32) {
    (
        (wr.0 & 0xffff_ffff) as u32,
        ((wr.0 >> 32) & 0x7fff_ffff) as u32,
    )
}

fn op_error(e: Error) -> OpError {
    match e {
        Error::Op(op) => op,
        Error::UnknownPeer(p) => OpError::PeerRemoved(p),
        other => OpError::transport(other),
    }
}

impl<T: Transport> Worker<T> {
    pub fn new(
        t: T,
        rx: Receiver<Command>,
        internal: Receiver<Command>,
        inbox: Arc<Inbox>,
        (counters, latency): (Arc<Counters>, Arc<LatencyHistogram>),
        cfg: EngineConfig,
        sleeping: Arc<AtomicBool>,
    ) -> Self {
        let busy_poll = t.limits().busy_poll;
        Worker {
            t,
            rx,
            internal,
            inbox,
            senders: HashMap::new(),
            counters,
            pending: PendingCounters::default(),
            latency,
            published_active: 0,
            cfg,
            slots: Vec::new(),
            generations: Vec::new(),
            free: Vec::new(),
            queue: VecDeque::new(),
            recvs: HashMap::new(),
            next_recv: 0,
            completions: Vec::with_capacity(1024),
            deadlines: 0,
            next_deadline_scan: Instant::now(),
            active: 0,
            busy_poll,
            sleeping,
            last_progress: Instant::now(),
            finished: false,
            linger_until: None,
            in_use: HashMap::new(),
            connecting: Vec::new(),
            fenced: Vec::new(),
            receives: None,
            parked: Vec::new(),
            sends: None,
            tick: clock(),
        }
    }

    /// Registers and posts the receives for peers' messages, if the engine takes them.
    fn open_receives(&mut self) {
        let n = self.cfg.messages;
        if n == 0 || self.cfg.notification_keys == 0 {
            return;
        }
        match Pool::new(&mut self.t, n, Access::LOCAL_WRITE) {
            Ok(mut p) => {
                self.parked = std::mem::take(&mut p.free);
                self.receives = Some(p);
                self.repost();
            }
            Err(e) => tracing::warn!(
                error = %e,
                "no receives for peers' messages: their notifications with bytes will not arrive"
            ),
        }
    }

    /// Posts the parked receive slots again while the inbox has room; returns how many.
    fn repost(&mut self) -> usize {
        let Some(p) = &self.receives else {
            return 0;
        };
        let mut n = 0;
        while let Some(&slot) = self.parked.last() {
            if !self.inbox.has_room() {
                break;
            }
            let wr = WorkRequestId(RECV_BIT | POOL_BIT | slot as u64);
            match self.t.post_recv(wr, p.slice(slot, MAX_MESSAGE)) {
                Ok(PostOutcome::Posted) => {
                    self.parked.pop();
                    n += 1;
                }
                Ok(PostOutcome::NoRoom) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "a receive for peers' messages was refused");
                    break;
                }
            }
        }
        n
    }

    pub fn run(mut self) {
        self.open_receives();
        loop {
            let mut progressed = false;
            for _ in 0..1024 {
                match self.rx.try_recv() {
                    Ok(Command::Shutdown) | Err(TryRecvError::Disconnected) => {
                        self.shutdown();
                        return;
                    }
                    Ok(cmd) => {
                        self.command(cmd);
                        progressed = true;
                    }
                    Err(TryRecvError::Empty) => break,
                }
            }
            while let Ok(cmd) = self.internal.try_recv() {
                self.command(cmd);
                progressed = true;
            }
            progressed |= self.post_batch() > 0;
            progressed |= self.poll() > 0;
            if !self.connecting.is_empty() {
                progressed |= self.settle_connecting();
            }
            if !self.fenced.is_empty() {
                progressed |= self.release_fenced();
            }
            if !self.parked.is_empty() {
                progressed |= self.repost() > 0;
            }
            self.flush_counters();
            if self.deadlines > 0 && Instant::now() >= self.next_deadline_scan {
                self.expire();
            }
            if progressed {
                if !self.cfg.busy_poll.is_zero() {
                    self.last_progress = Instant::now();
                }
                if std::mem::take(&mut self.finished) && !self.cfg.linger.is_zero() {
                    self.linger_until = Some(Instant::now() + self.cfg.linger);
                }
                continue;
            }
            let busy = self.active > 0 || !self.queue.is_empty();
            if busy && self.busy_poll {
                // Work in flight and nothing to sleep on: keep polling.
                std::hint::spin_loop();
                continue;
            }
            if !self.cfg.busy_poll.is_zero() && self.last_progress.elapsed() < self.cfg.busy_poll {
                // Busy polling: a bounded spin before sleeping.
                std::hint::spin_loop();
                continue;
            }
            if let Some(until) = self.linger_until {
                if Instant::now() < until {
                    // Lingering after a completion: the next submit finds us awake. Other
                    // runnable threads (the target's worker, the waiter) go first.
                    std::thread::yield_now();
                    continue;
                }
                self.linger_until = None;
            }
            let mut wait = if busy && !self.queue.is_empty() {
                // Refused posts wait for room, which only polling shows.
                Duration::ZERO
            } else {
                // The transport wakes us when a peer answers, the engine when work comes.
                self.cfg.idle_wait
            };
            if self.deadlines > 0 {
                wait = wait.min(
                    self.next_deadline_scan
                        .saturating_duration_since(Instant::now()),
                );
            }
            if !self.fenced.is_empty() {
                wait = wait.min(FENCE_POLL);
            }
            self.sleep(wait);
        }
    }

    /// Answers the `add_peer` calls whose peers have finished setting up (or failed);
    /// returns whether any did.
    fn settle_connecting(&mut self) -> bool {
        let before = self.connecting.len();
        let mut i = 0;
        while i < self.connecting.len() {
            let p = self.connecting[i].0;
            let res = match self.t.peer_ready(p) {
                Ok(false) => {
                    i += 1;
                    continue;
                }
                Ok(true) => Ok((p, self.t.peer_instance(p))),
                Err(e) => Err(e),
            };
            let (_, r) = self.connecting.swap_remove(i);
            let _ = r.send(res);
        }
        self.connecting.len() != before
    }

    /// Waits in the transport for at most `wait`, announced through `sleeping` so that a
    /// command sent meanwhile wakes it (the engine's `wake_worker` is the other half).
    fn sleep(&mut self, wait: Duration) {
        if wait.is_zero() {
            if let Err(e) = self.t.wait(wait) {
                tracing::warn!(error = %e, "transport wait failed");
            }
            return;
        }
        self.sleeping.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        if !self.rx.is_empty() || !self.internal.is_empty() {
            self.sleeping.store(false, Ordering::Relaxed);
            return;
        }
        let res = self.t.wait(wait);
        self.sleeping.store(false, Ordering::Relaxed);
        // Work that arrives now starts its progress clock now, not at the last completion.
        self.tick = clock();
        if let Err(e) = res {
            tracing::warn!(error = %e, "transport wait failed");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::AddPeer(a, r) => match self.t.add_peer(&a) {
                Ok(p) => self.connecting.push((p, r)),
                Err(e) => {
                    let _ = r.send(Err(e));
                }
            },
            Command::RemovePeer(p, r) => {
                let res = self.t.remove_peer(p);
                // Operations that were queued but not posted fail too.
                let _ = r.send(res);
            }
            Command::Register(m, a, r) => {
                let _ = r.send(self.t.register(m, a));
            }
            Command::Deregister(k, r) => {
                // Never under operations that may still read or write it.
                let res = match self.in_use.get(&k) {
                    Some(&transfers) if transfers > 0 => {
                        Err(Error::RegionInUse { key: k, transfers })
                    }
                    _ => self.t.deregister(k),
                };
                let _ = r.send(res);
            }
            Command::Transfer(job) => self.start_transfer(job),
            Command::Send {
                peer,
                src,
                imm,
                slot,
            } => {
                let (idx, generation) = self.alloc(Active {
                    generation: 0,
                    peer,
                    slot,
                    watch: None,
                    remaining: 1,
                    error: None,
                    stats: TransferStats::default(),
                    final_imm: None,
                    message: None,
                    out_slot: None,
                    deadline: None,
                    submitted: Instant::now(),
                    writes: Vec::new(),
                    next: 0,
                    direction: Direction::Write,
                    keys: vec![src.key],
                });
                self.queue.push_back(Queued {
                    slot: idx,
                    generation,
                    op: QueuedOp::Send(src, imm),
                });
            }
            Command::Recv { dst, slot } => {
                let id = RECV_BIT | self.next_recv;
                self.next_recv += 1;
                match self.t.post_recv(WorkRequestId(id), dst) {
                    Ok(PostOutcome::Posted) => {
                        self.recvs.insert(id, slot);
                    }
                    Ok(PostOutcome::NoRoom) => {
                        slot.complete(Err(OpError::transport("no room for another receive")))
                    }
                    Err(e) => slot.complete(Err(op_error(e))),
                }
            }
            Command::Cancel(slot) => self.cancel(&slot),
            Command::Shutdown => {}
        }
    }

    /// Cancels the transfer of `slot`: it posts nothing more and finishes (with
    /// `Cancelled`) once every operation it had posted has completed or failed, as a
    /// timed-out one does. A transfer that already finished is not here: nothing happens.
    fn cancel(&mut self, slot: &Arc<Slot<TransferResult>>) {
        let found = self
            .slots
            .iter()
            .position(|a| a.as_ref().is_some_and(|a| Arc::ptr_eq(&a.slot, slot)));
        let Some(idx) = found else {
            return;
        };
        let Some(a) = self.slots[idx].as_mut() else {
            return;
        };
        a.error.get_or_insert(OpError::Cancelled);
        a.final_imm = None;
        let unposted = (a.writes.len() - a.next) as u64;
        a.next = a.writes.len();
        let generation = a.generation;
        self.ops_done(idx as u32, generation, unposted, Ok(()));
    }

    fn alloc(&mut self, mut a: Active) -> (u32, u32) {
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.generations.push(0);
                (self.slots.len() - 1) as u32
            }
        };
        let generation = self.generations[idx as usize];
        a.generation = generation;
        if a.deadline.is_some() {
            self.deadlines += 1;
        }
        for k in &a.keys {
            *self.in_use.entry(*k).or_default() += 1;
        }
        self.slots[idx as usize] = Some(a);
        self.active += 1;
        (idx, generation)
    }

    fn start_transfer(&mut self, mut job: Job) {
        if job.message.is_some() && job.imm.is_none() {
            // The message carries value 0; no write carries it.
            job.imm = Some((0, super::message_segment()));
        }
        let final_imm = job.imm.map(|(v, s)| {
            let w = PlannedWrite {
                src: LocalSlice {
                    key: s.src,
                    offset: s.src_offset,
                    len: 0,
                },
                dst: RemoteSlice {
                    region: s.dst,
                    offset: s.dst_offset,
                    len: 0,
                },
                rows: None,
            };
            (w, v)
        });
        let mut final_imm = final_imm;
        let message = job.message.take();
        if let (Some((_, v)), [only], None) =
            (final_imm, job.plan.writes.as_slice(), message.as_ref())
        {
            // One write: it carries the immediate data itself (a transport delivers it only
            // after that write's bytes have landed), which saves a round trip.
            final_imm = Some((*only, v));
            job.plan.writes.clear();
        }
        let n = job.plan.writes.len() as u64;
        if n == 0 && final_imm.is_none() {
            self.flush_counters();
            self.counters.transfers.fetch_add(1, Ordering::Relaxed);
            job.slot.complete(Ok(TransferStats::default()));
            return;
        }
        let after = job.after.take();
        let watch = job.watch.take();
        watch.as_ref().unwrap_or(&job.slot).touch(self.tick);
        let (idx, generation) = self.alloc(Active {
            generation: 0,
            peer: job.peer,
            slot: job.slot,
            watch,
            remaining: n,
            error: None,
            stats: TransferStats {
                bytes: job.plan.bytes,
                ops: 0,
            },
            final_imm,
            deadline: job.deadline,
            submitted: job.submitted,
            keys: keys_of(
                &job.plan.writes,
                final_imm
                    .as_ref()
                    .filter(|_| message.is_none())
                    .map(|(w, _)| w),
            ),
            message,
            out_slot: None,
            writes: job.plan.writes,
            next: 0,
            direction: job.direction,
        });
        match after {
            Some(f) if !matches!(f.is_done(), Ok(true)) => {
                // Asked again (and its error, if any, reported) in `release_fenced`.
                self.fenced.push((idx, generation, f));
            }
            _ => self.queue_transfer(idx, generation),
        }
    }

    /// Queues the operations of a transfer that may start.
    fn queue_transfer(&mut self, idx: u32, generation: u32) {
        let Some(a) = self.active(idx, generation) else {
            return; // it ended meanwhile (time-out)
        };
        if a.writes.is_empty() {
            self.release_imm(idx);
        } else {
            self.queue.push_back(Queued {
                slot: idx,
                generation,
                op: QueuedOp::Writes,
            });
        }
    }

    /// Starts the transfers whose fences report done, and fails those whose fence failed
    /// (nothing of them was posted). Returns whether any left the list.
    fn release_fenced(&mut self) -> bool {
        let before = self.fenced.len();
        let mut i = 0;
        while i < self.fenced.len() {
            let (idx, generation) = (self.fenced[i].0, self.fenced[i].1);
            let verdict = if self.active(idx, generation).is_none() {
                None // ended meanwhile (time-out, shut down)
            } else {
                match self.fenced[i].2.is_done() {
                    Ok(false) => {
                        i += 1;
                        continue;
                    }
                    Ok(true) => Some(Ok(())),
                    Err(e) => Some(Err(e)),
                }
            };
            self.fenced.swap_remove(i);
            match verdict {
                Some(Ok(())) => self.queue_transfer(idx, generation),
                Some(Err(e)) => {
                    if let Some(a) = self.active(idx, generation) {
                        a.error = Some(OpError::transport_with(
                            "the work the transfer waits for (its fence) failed",
                            e,
                        ));
                        a.final_imm = None;
                        let unposted = (a.writes.len() - a.next) as u64;
                        a.next = a.writes.len();
                        self.pending.errors += 1;
                        self.ops_done(idx, generation, unposted, Ok(()));
                    }
                }
                None => {}
            }
        }
        self.fenced.len() != before
    }

    /// Queues the immediate-data write of a transfer whose other writes all landed.
    fn release_imm(&mut self, idx: u32) {
        let Some(a) = self.slots[idx as usize].as_mut() else {
            return;
        };
        if let Some((w, v)) = a.final_imm.take() {
            a.remaining += 1;
            let generation = a.generation;
            let op = match a.message {
                Some(_) => QueuedOp::Message(v),
                None => QueuedOp::Imm(w, v),
            };
            self.queue.push_back(Queued {
                slot: idx,
                generation,
                op,
            });
        }
    }

    fn active(&mut self, idx: u32, generation: u32) -> Option<&mut Active> {
        self.slots
            .get_mut(idx as usize)?
            .as_mut()
            .filter(|a| a.generation == generation)
    }

    /// One operation of a transfer is done (or dropped).
    fn op_done(&mut self, idx: u32, generation: u32, res: std::result::Result<(), OpError>) {
        self.ops_done(idx, generation, 1, res);
    }

    /// `count` operations of a transfer are done (or dropped), with one outcome.
    fn ops_done(
        &mut self,
        idx: u32,
        generation: u32,
        count: u64,
        res: std::result::Result<(), OpError>,
    ) {
        let tick = self.tick;
        let Some(a) = self.active(idx, generation) else {
            return;
        };
        // Never more than are outstanding, even if a transport reported one twice.
        debug_assert!(count <= a.remaining, "{count} done of {} left", a.remaining);
        a.watch.as_ref().unwrap_or(&a.slot).touch(tick);
        a.remaining = a.remaining.saturating_sub(count);
        if let Err(e) = res
            && a.error.is_none()
        {
            a.error = Some(e);
        }
        if a.remaining > 0 {
            return;
        }
        if a.error.is_none() && a.final_imm.is_some() {
            self.release_imm(idx);
            return;
        }
        self.finish(idx);
    }

    fn finish(&mut self, idx: u32) {
        let Some(a) = self.slots[idx as usize].take() else {
            return;
        };
        self.active -= 1;
        self.finished = true;
        self.generations[idx as usize] =
            self.generations[idx as usize].wrapping_add(1) & 0x7fff_ffff;
        self.free.push(idx);
        if a.deadline.is_some() {
            self.deadlines -= 1;
        }
        if let (Some(slot), Some(p)) = (a.out_slot, self.sends.as_mut()) {
            p.free.push(slot);
        }
        for k in &a.keys {
            if let Some(n) = self.in_use.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    self.in_use.remove(k);
                }
            }
        }
        // Whoever sees the transfer finished also sees its operations counted.
        self.flush_counters();
        self.counters.transfers.fetch_add(1, Ordering::Relaxed);
        if a.error.is_none() {
            self.latency.record(a.submitted.elapsed());
        }
        a.slot.complete(match a.error {
            None => Ok(a.stats),
            Some(e) => Err(e),
        });
    }

    /// Adds the pending counter increments to the shared counters.
    fn flush_counters(&mut self) {
        let p = std::mem::take(&mut self.pending);
        // Posts before completions: a reader that sees a completion sees its post.
        for (counter, n) in [
            (&self.counters.bytes, p.bytes),
            (&self.counters.ops, p.ops),
            (&self.counters.completed, p.completed),
            (&self.counters.reposts, p.reposts),
            (&self.counters.errors, p.errors),
        ] {
            if n > 0 {
                counter.fetch_add(n, Ordering::Relaxed);
            }
        }
        if self.active != self.published_active {
            self.published_active = self.active;
            self.counters
                .active
                .store(self.active as u64, Ordering::Relaxed);
        }
    }

    /// Posts up to `cfg.batch` operations from the front of the queue; stops at the first
    /// "no room" (deferred posting: the rest waits for the next poll).
    fn post_batch(&mut self) -> usize {
        let mut posted = 0;
        while posted < self.cfg.batch {
            let Some(&q) = self.queue.front() else {
                break;
            };
            let (n, no_room) = match q.op {
                QueuedOp::Writes => self.post_writes(q, self.cfg.batch - posted),
                QueuedOp::Imm(w, v) => {
                    self.post_one(q, |t, peer, wr| post_planned(t, peer, wr, w, Some(v)))
                }
                QueuedOp::Message(v) => match self.message_slice(q) {
                    Ok(Some(src)) => {
                        self.post_one(q, |t, peer, wr| t.post_send(peer, wr, src, Some(v)))
                    }
                    // Every send buffer is taken: wait for a completion.
                    Ok(None) => (0, true),
                    Err(e) => {
                        self.queue.pop_front();
                        self.pending.errors += 1;
                        self.op_done(q.slot, q.generation, Err(op_error(e)));
                        (0, false)
                    }
                },
                QueuedOp::Send(src, imm) => {
                    self.post_one(q, |t, peer, wr| t.post_send(peer, wr, src, imm))
                }
            };
            posted += n;
            if no_room {
                // Deferred posting: retried after the next poll.
                self.pending.reposts += 1;
                break;
            }
        }
        self.pending.ops += posted as u64;
        posted
    }

    /// Posts the planned writes of the transfer at the front of the queue, at most `room`;
    /// pops the entry once none is left. Returns (posted, refused for lack of room).
    fn post_writes(&mut self, q: Queued, room: usize) -> (usize, bool) {
        let wr = wr_of(q.slot, q.generation);
        let Some(a) = self
            .slots
            .get_mut(q.slot as usize)
            .and_then(Option::as_mut)
            .filter(|a| a.generation == q.generation)
        else {
            self.queue.pop_front(); // the transfer already ended (time-out)
            return (0, false);
        };
        if a.error.is_some() {
            // A failed transfer posts nothing more; what was queued counts as done.
            let left = (a.writes.len() - a.next) as u64;
            a.next = a.writes.len();
            self.queue.pop_front();
            self.ops_done(q.slot, q.generation, left, Ok(()));
            return (0, false);
        }
        let peer = a.peer;
        let read = a.direction == Direction::Read;
        let mut posted = 0;
        let mut no_room = false;
        let mut failed = None;
        while posted < room && a.next < a.writes.len() {
            let w = a.writes[a.next];
            let r = if read {
                self.t.post_read(peer, wr, w.src, w.dst)
            } else {
                post_planned(&mut self.t, peer, wr, w, None)
            };
            match r {
                Ok(PostOutcome::Posted) => {
                    a.next += 1;
                    posted += 1;
                }
                Ok(PostOutcome::NoRoom) => {
                    no_room = true;
                    break;
                }
                Err(e) => {
                    a.next += 1;
                    failed = Some(e);
                    break;
                }
            }
        }
        a.stats.ops += posted as u64;
        if a.next == a.writes.len() {
            self.queue.pop_front();
        }
        if let Some(e) = failed {
            self.pending.errors += 1;
            self.op_done(q.slot, q.generation, Err(op_error(e)));
        }
        (posted, no_room)
    }

    /// The send buffer holding the message of the transfer at the front of the queue
    /// (copied into one the first time), or `None` while every buffer is taken.
    fn message_slice(&mut self, q: Queued) -> Result<Option<LocalSlice>> {
        if self.sends.is_none() {
            self.sends = Some(Pool::new(&mut self.t, SEND_SLOTS, Access::NONE)?);
        }
        let Some(p) = self.sends.as_mut() else {
            return Ok(None);
        };
        let Some(a) = self.slots[q.slot as usize]
            .as_mut()
            .filter(|a| a.generation == q.generation)
        else {
            // It ended meanwhile: post_one drops the entry.
            return Ok(Some(p.slice(0, 0)));
        };
        let len = a.message.as_ref().map_or(0, |m| m.len());
        if let Some(slot) = a.out_slot {
            return Ok(Some(p.slice(slot, len)));
        }
        let Some(slot) = p.free.pop() else {
            return Ok(None);
        };
        a.out_slot = Some(slot);
        let src = p.slice(slot, len);
        if let Some(m) = &a.message {
            p.mem
                .write(src.offset, m)
                .map_err(|e| Error::Op(OpError::transport(e)))?;
        }
        Ok(Some(src))
    }

    /// Posts the single operation at the front of the queue and pops it unless refused.
    /// Returns (posted, refused for lack of room).
    fn post_one(
        &mut self,
        q: Queued,
        post: impl FnOnce(&mut T, PeerId, WorkRequestId) -> Result<PostOutcome>,
    ) -> (usize, bool) {
        let (peer, failed) = match self.active(q.slot, q.generation) {
            None => {
                self.queue.pop_front(); // the transfer already ended (time-out)
                return (0, false);
            }
            Some(a) => (a.peer, a.error.is_some()),
        };
        if failed {
            self.queue.pop_front();
            self.op_done(q.slot, q.generation, Ok(()));
            return (0, false);
        }
        match post(&mut self.t, peer, wr_of(q.slot, q.generation)) {
            Ok(PostOutcome::Posted) => {
                self.queue.pop_front();
                if let Some(a) = self.active(q.slot, q.generation) {
                    a.stats.ops += 1;
                }
                (1, false)
            }
            Ok(PostOutcome::NoRoom) => (0, true),
            Err(e) => {
                self.queue.pop_front();
                self.pending.errors += 1;
                self.op_done(q.slot, q.generation, Err(op_error(e)));
                (0, false)
            }
        }
    }

    fn poll(&mut self) -> usize {
        let mut comps = std::mem::take(&mut self.completions);
        if let Err(e) = self.t.poll(&mut comps) {
            tracing::warn!(error = %e, "transport poll failed");
        }
        let n = comps.len();
        if n > 0 {
            self.tick = clock();
        }
        // Successful writes (or reads) of one transfer share a work-request id and usually
        // come back together: count each such run with one slot lookup.
        let mut run: Option<(WorkRequestId, u64, u64)> = None;
        for c in comps.drain(..) {
            if let (OpKind::Write | OpKind::Read, Ok(bytes)) = (c.op, &c.result) {
                match &mut run {
                    Some((wr, count, sum)) if *wr == c.wr_id => {
                        *count += 1;
                        *sum += bytes;
                    }
                    _ => {
                        if let Some(done) = run.replace((c.wr_id, 1, *bytes)) {
                            self.writes_done(done);
                        }
                    }
                }
                continue;
            }
            if let Some(done) = run.take() {
                self.writes_done(done);
            }
            self.completion(c);
        }
        if let Some(done) = run {
            self.writes_done(done);
        }
        self.completions = comps;
        n
    }

    /// `count` writes with work-request id `wr` succeeded, moving `bytes` in all.
    fn writes_done(&mut self, (wr, count, bytes): (WorkRequestId, u64, u64)) {
        self.pending.bytes += bytes;
        self.pending.completed += count;
        let (idx, generation) = slot_of(wr);
        self.ops_done(idx, generation, count, Ok(()));
    }

    fn completion(&mut self, c: Completion) {
        match c.op {
            OpKind::RemoteWrite => {
                if let Some(imm) = c.imm {
                    self.arrived(c.peer, imm, None);
                }
            }
            OpKind::Recv if c.wr_id.0 & POOL_BIT != 0 => self.message_arrived(c),
            OpKind::Recv => {
                if let Some(slot) = self.recvs.remove(&c.wr_id.0) {
                    slot.complete(c.result.map(|len| Received {
                        peer: c.peer,
                        len,
                        imm: c.imm,
                    }));
                }
            }
            OpKind::Write | OpKind::Read | OpKind::Send => {
                self.pending.completed += 1;
                let (idx, generation) = slot_of(c.wr_id);
                let sent = *c.result.as_ref().unwrap_or(&0);
                let res = match c.result {
                    Ok(b) => {
                        self.pending.bytes += b;
                        Ok(())
                    }
                    Err(e) => {
                        self.pending.errors += 1;
                        Err(e)
                    }
                };
                if c.op == OpKind::Send
                    && let Some(a) = self.active(idx, generation)
                {
                    a.stats.bytes += sent;
                }
                self.op_done(idx, generation, res);
            }
        }
    }

    /// A receive of ours for peers' messages completed: the message goes to the inbox and
    /// the receive is posted again (once the inbox has room).
    fn message_arrived(&mut self, c: Completion) {
        let slot = (c.wr_id.0 & 0xffff_ffff) as u32;
        let payload = match (&c.result, &self.receives) {
            (Ok(len), Some(p)) => p
                .mem
                .to_vec(slot as u64 * MAX_MESSAGE as u64, *len as usize)
                .map_err(|e| tracing::warn!(error = %e, "a peer's message could not be read")),
            (Err(e), _) => {
                tracing::warn!(error = %e, "a receive for peers' messages failed");
                Err(())
            }
            (Ok(_), None) => Err(()),
        };
        if let Ok(bytes) = payload {
            self.arrived(c.peer, c.imm.unwrap_or(0), Some(Arc::from(bytes)));
        }
        if !matches!(c.result, Err(OpError::Cancelled)) {
            self.parked.push(slot);
            self.repost();
        }
    }

    /// Counts a peer's immediate data (or message) in the inbox, with the sender's
    /// address (asked of the transport once per peer).
    fn arrived(&mut self, peer: Option<PeerId>, imm: u32, payload: Option<Arc<[u8]>>) {
        let from = match peer {
            Some(p) => {
                if self.senders.len() >= SENDERS_CACHED && !self.senders.contains_key(&p) {
                    // A cache: a server's passing clients do not grow it for good.
                    self.senders.clear();
                }
                let t = &self.t;
                self.senders
                    .entry(p)
                    .or_insert_with(|| t.peer_address(p).map(Arc::from))
                    .clone()
            }
            None => None,
        };
        // Counted before it can be taken, so that whoever took it sees it counted.
        self.counters.notifications.fetch_add(1, Ordering::Relaxed);
        let is_message = payload.is_some();
        let key = NoteKey {
            imm,
            peer,
            from,
            message: payload,
        };
        if is_message {
            self.inbox.message(key);
        } else {
            self.inbox.arrive(key);
        }
    }

    /// Times out transfers past their deadline: they post nothing more, and finish (with
    /// `TimedOut`) once every operation they had posted has completed or failed, so that no
    /// transport still touches their memory when the caller hears of it. A transport fails
    /// operations whose peer stops answering (TCP: within its `liveness_timeout`).
    fn expire(&mut self) {
        let now = Instant::now();
        self.next_deadline_scan = now + Duration::from_millis(1);
        let mut drained = Vec::new();
        for idx in 0..self.slots.len() {
            let Some(a) = self.slots[idx].as_mut() else {
                continue;
            };
            if a.deadline.is_none_or(|d| d > now) {
                continue;
            }
            a.deadline = None;
            self.deadlines -= 1;
            a.error.get_or_insert(OpError::TimedOut);
            a.final_imm = None;
            // Writes not posted yet will never be: count them done now.
            let unposted = (a.writes.len() - a.next) as u64;
            a.next = a.writes.len();
            drained.push((idx as u32, a.generation, unposted));
        }
        for (idx, generation, unposted) in drained {
            // Entries still queued for it are dropped as the queue reaches them.
            self.ops_done(idx, generation, unposted, Ok(()));
        }
    }

    fn shutdown(&mut self) {
        for idx in 0..self.slots.len() {
            if let Some(a) = self.slots[idx].as_mut() {
                a.error.get_or_insert(OpError::Cancelled);
                self.finish(idx as u32);
            }
        }
        for (_, s) in self.recvs.drain() {
            s.complete(Err(OpError::Cancelled));
        }
        // Work other workers handed over (from the callbacks just run, too) fails as well.
        while let Ok(cmd) = self.internal.try_recv().or_else(|_| self.rx.try_recv()) {
            match cmd {
                Command::Transfer(job) => job.slot.complete(Err(OpError::Cancelled)),
                Command::Cancel(_) => {}
                Command::Send { slot, .. } => slot.complete(Err(OpError::Cancelled)),
                Command::Recv { slot, .. } => slot.complete(Err(OpError::Cancelled)),
                _ => {}
            }
        }
    }
}

/// Posts a planned write: plain, or strided when it has rows.
fn post_planned<T: Transport>(
    t: &mut T,
    peer: PeerId,
    wr: WorkRequestId,
    w: PlannedWrite,
    imm: Option<u32>,
) -> Result<PostOutcome> {
    match w.rows {
        None => t.post_write(peer, wr, w.src, w.dst, imm),
        Some(rows) => t.post_write_rows(peer, wr, w.src, w.dst, rows, imm),
    }
}

/// The distinct local regions that `writes` (and the immediate-data write) read.
fn keys_of(writes: &[PlannedWrite], imm: Option<&PlannedWrite>) -> Vec<LocalKey> {
    let mut keys: Vec<LocalKey> = Vec::with_capacity(1);
    for w in writes.iter().chain(imm) {
        if keys.last() != Some(&w.src.key) && !keys.contains(&w.src.key) {
            keys.push(w.src.key);
        }
    }
    keys
}
