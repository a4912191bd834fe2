//! Rails: one endpoint made of several engines, each a worker thread that owns one
//! transport (a NIC, or a TCP connection). A transfer is planned once, sharded over the
//! rails by bytes (each piece still one contiguous write) and completes when every shard has
//! landed; its immediate data follows only after that. Both are decided on the workers: the
//! worker that completes the last shard sends the immediate data on its own rail, so a
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

use super::worker::{Command, Job};
use super::{
    Engine, EngineConfig, Event, Pending, Slot, Transfer, TransferHandle, TransferResult,
    TransferStats, WorkerLink,
};
use crate::error::{Error, OpError, Result};
use crate::memory::MemoryRegion;
use crate::plan::{Segment, plan_transfer, shard_by_bytes};
use crate::transport::Transport;
use crate::types::{Access, LocalKey, PeerId, RemoteRegion};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The immediate value of warm-up writes ([`RailGroup::warm_up`]): rail groups never
/// report it to the application, so applications should not use it.
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
}

/// A transfer between two rail groups: segments of one local region to one remote region.
#[derive(Clone, Debug)]
pub struct GroupTransfer {
    /// Local region.
    pub src: GroupRegistration,
    /// Remote region.
    pub dst: RemoteDescriptor,
    /// `(src_offset, dst_offset, len)` triples.
    pub segments: Vec<(u64, u64, u64)>,
    /// Immediate data delivered to the target after every byte landed.
    pub imm: Option<u32>,
    /// Deadline for each shard.
    pub timeout: Option<Duration>,
}

impl GroupTransfer {
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
            imm: None,
            timeout: None,
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
            return Err(Error::InvalidArgument(format!(
                "{} source pages but {} destination pages",
                src_pages.len(),
                dst_pages.len()
            )));
        }
        if len > src_stride || len > dst_stride {
            return Err(Error::InvalidArgument(
                "page length exceeds the stride".into(),
            ));
        }
        let mut segments = Vec::with_capacity(src_pages.len());
        for (&s, &d) in src_pages.iter().zip(dst_pages) {
            let so = s
                .checked_mul(src_stride)
                .ok_or_else(|| Error::InvalidArgument(format!("source page {s} overflows")))?;
            let d_o = d
                .checked_mul(dst_stride)
                .ok_or_else(|| Error::InvalidArgument(format!("destination page {d} overflows")))?;
            segments.push((so, d_o, len));
        }
        Ok(GroupTransfer {
            src,
            dst,
            segments,
            imm: None,
            timeout: None,
        })
    }
}

/// Several engines acting as one endpoint. See the module documentation.
pub struct RailGroup {
    rails: Vec<Arc<Engine>>,
    stash: Mutex<HashMap<u32, u64>>,
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
            return Err(Error::InvalidArgument(
                "a rail group needs at least one rail".into(),
            ));
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
            rails,
            stash: Mutex::new(HashMap::new()),
        })
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
            |e, p| e.start_remove_peer(*p),
        )?;
        Ok(GroupPeer {
            rails: added,
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
        let done = self.on_every_rail(
            |_, e| e.start_register(mem.clone(), access),
            |e, r| e.start_deregister(r.local),
        )?;
        let (locals, rails) = done.into_iter().map(|r| (r.local, r.remote)).unzip();
        Ok(GroupRegistration {
            locals,
            remote: RemoteDescriptor { rails },
        })
    }

    /// Deregisters memory from every rail.
    pub fn deregister(&self, reg: &GroupRegistration) -> Result<()> {
        answers(
            self.rails
                .iter()
                .zip(&reg.locals)
                .map(|(e, k)| e.start_deregister(*k)),
        )
        .into_iter()
        .collect()
    }

    /// Submits a transfer: planned, sharded by bytes over the rails, submitted to each.
    pub fn submit(&self, peer: &GroupPeer, t: GroupTransfer) -> Result<GroupHandle> {
        let n = self.rails.len();
        if t.src.locals.len() != n || peer.rails.len() != n {
            return Err(Error::InvalidArgument(
                "registration or peer belongs to another rail group".into(),
            ));
        }
        let dst_of = |i: usize| -> Result<RemoteRegion> {
            t.dst
                .rails
                .get(peer.remote_rail[i])
                .copied()
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "the remote descriptor has no rail {}",
                        peer.remote_rail[i]
                    ))
                })
        };
        let dst0 = dst_of(0)?;
        let segs: Vec<Segment> = t
            .segments
            .iter()
            .map(|&(so, d_o, len)| Segment {
                src: t.src.locals[0],
                src_offset: so,
                dst: dst0,
                dst_offset: d_o,
                len,
            })
            .collect();
        let limit = self
            .rails
            .iter()
            .map(|e| e.limits().max_msg_size)
            .min()
            .unwrap_or(1);
        let plan = plan_transfer(&segs, limit)?;
        let shards = shard_by_bytes(&plan.writes, n);
        let busy: Vec<usize> = (0..n).filter(|&i| !shards[i].is_empty()).collect();
        let imm = match (t.imm, t.segments.first()) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(Error::InvalidArgument(
                    "immediate data needs at least one segment".into(),
                ));
            }
            (Some(v), Some(&(so, d_o, _))) => Some((v, so, d_o)),
        };
        let slot = Slot::spinning(self.rails[0].cfg.wait_spin);
        let handle = TransferHandle { slot: slot.clone() };
        // Each rail's shard, as that rail's engine checks and plans it.
        let shard_transfer = |i: usize, shard: &[crate::plan::PlannedWrite]| -> Result<Transfer> {
            let dst = dst_of(i)?;
            let mut tr = Transfer::new(peer.rails[i]);
            tr.timeout = t.timeout;
            tr.segments = shard
                .iter()
                .map(|w| Segment {
                    src: t.src.locals[i],
                    src_offset: w.src.offset,
                    dst,
                    dst_offset: w.dst.offset,
                    len: w.src.len,
                })
                .collect();
            Ok(tr)
        };
        match busy.as_slice() {
            [] => {
                // Nothing to move: the immediate data alone, on rail 0.
                let Some((v, so, d_o)) = imm else {
                    slot.complete(Ok(TransferStats::default()));
                    return Ok(handle);
                };
                let tr = Transfer::new(peer.rails[0])
                    .segment(Segment {
                        src: t.src.locals[0],
                        src_offset: so,
                        dst: dst0,
                        dst_offset: d_o,
                        len: 0,
                    })
                    .imm(v);
                let tr = Transfer {
                    timeout: t.timeout,
                    ..tr
                };
                let job = self.rails[0].job(tr, slot)?;
                self.rails[0].send_cmd(Command::Transfer(job))?;
            }
            &[only] => {
                // One rail moves it all: its worker sends the immediate data after its own
                // writes (or on its one write), with no other worker involved.
                let mut tr = shard_transfer(only, &shards[only])?;
                tr.imm = imm.map(|(v, ..)| v);
                let job = self.rails[only].job(tr, slot)?;
                self.rails[only].send_cmd(Command::Transfer(job))?;
            }
            _ => {
                // Several rails: the worker that completes the last shard sends the
                // immediate data on its own rail (see `GroupState::shard_done`).
                let imm_on = match imm {
                    None => None,
                    Some((v, so, d_o)) => {
                        let mut per_rail = Vec::with_capacity(n);
                        for i in 0..n {
                            per_rail.push((
                                peer.rails[i],
                                Segment {
                                    src: t.src.locals[i],
                                    src_offset: so,
                                    dst: dst_of(i)?,
                                    dst_offset: d_o,
                                    len: 0,
                                },
                            ));
                        }
                        Some((v, per_rail))
                    }
                };
                let state = Arc::new(GroupState {
                    left: AtomicUsize::new(busy.len()),
                    ops: AtomicU64::new(0),
                    error: Mutex::new(None),
                    imm: imm_on,
                    links: self.rails.iter().map(|e| e.link()).collect(),
                    timeout: t.timeout,
                    bytes: plan.bytes,
                    slot,
                });
                // Plan every shard first, so that a bad segment fails before anything moves.
                let mut jobs = Vec::with_capacity(busy.len());
                for &i in &busy {
                    let st = state.clone();
                    let shard_slot = Slot::with_callback(Box::new(move |r| st.shard_done(i, r)));
                    jobs.push((
                        i,
                        self.rails[i].job(shard_transfer(i, &shards[i])?, shard_slot)?,
                    ));
                }
                for (i, job) in jobs {
                    self.rails[i].send_cmd(Command::Transfer(job))?;
                }
            }
        }
        Ok(handle)
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
                    Error::InvalidArgument(format!(
                        "the remote descriptor has no rail {}",
                        peer.remote_rail[i]
                    ))
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
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut stash = self.stash.lock().unwrap_or_else(|p| p.into_inner());
                let have = stash.get(&imm).copied().unwrap_or(0);
                if have >= count {
                    if have == count {
                        stash.remove(&imm);
                    } else {
                        stash.insert(imm, have - count);
                    }
                    return Ok(());
                }
                for e in &self.rails {
                    while let Ok(ev) = e.events().try_recv() {
                        if let Some(v) = ev.imm().filter(|&v| v != WARM_UP_IMM) {
                            *stash.entry(v).or_default() += 1;
                        }
                    }
                }
                if stash.get(&imm).copied().unwrap_or(0) >= count {
                    continue;
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::TimedOut(timeout, "immediate data"));
            }
            let mut sel = crossbeam_channel::Select::new();
            for e in &self.rails {
                sel.recv(e.events());
            }
            // Wakes on any rail's event; the loop drains it above.
            let _ = sel.ready_timeout(deadline - now);
        }
    }

    /// The next event from any rail (warm-up notifications excepted), waiting at most
    /// `timeout`.
    pub fn next_event(&self, timeout: Duration) -> Result<Event> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut sel = crossbeam_channel::Select::new();
            for e in &self.rails {
                sel.recv(e.events());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = match sel.select_timeout(left) {
                Ok(op) => {
                    let i = op.index();
                    op.recv(self.rails[i].events())
                        .map_err(|_| Error::EngineStopped)?
                }
                Err(_) => return Err(Error::TimedOut(timeout, "an event")),
            };
            if ev.imm() != Some(WARM_UP_IMM) {
                return Ok(ev);
            }
        }
    }

    /// Sums the counters of all rails.
    pub fn counters(&self) -> super::CounterSnapshot {
        let mut s = super::CounterSnapshot::default();
        for e in &self.rails {
            let c = e.counters().snapshot();
            s.bytes += c.bytes;
            s.ops += c.ops;
            s.reposts += c.reposts;
            s.errors += c.errors;
            s.transfers += c.transfers;
        }
        s
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

/// A transfer sharded over several rails, shared by its shards' completion callbacks (which
/// run on the rails' workers).
struct GroupState {
    /// Shards not finished yet.
    left: AtomicUsize,
    /// Operations of the finished shards.
    ops: AtomicU64,
    /// The first error of any shard.
    error: Mutex<Option<OpError>>,
    /// The immediate value and, per rail, the peer and zero-length segment that carry it.
    imm: Option<(u32, Vec<(PeerId, Segment)>)>,
    /// Every rail's worker, to hand the immediate data to.
    links: Vec<Arc<WorkerLink>>,
    timeout: Option<Duration>,
    bytes: u64,
    slot: Arc<Slot<TransferResult>>,
}

impl GroupState {
    /// Shard `rail` finished with `r` (called on that rail's worker). The last one decides
    /// the transfer: an error ends it, else the immediate data goes out on the same rail
    /// (queued to its own worker, no thread hop), and the transfer completes when it lands.
    fn shard_done(self: Arc<Self>, rail: usize, r: TransferResult) {
        match r {
            Ok(s) => {
                self.ops.fetch_add(s.ops, Ordering::Relaxed);
            }
            Err(e) => {
                self.error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
            }
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        if let Some(e) = self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
            self.slot.complete(Err(e));
            return;
        }
        let stats = TransferStats {
            bytes: self.bytes,
            ops: self.ops.load(Ordering::Relaxed),
        };
        let Some((v, per_rail)) = &self.imm else {
            self.slot.complete(Ok(stats));
            return;
        };
        let (peer, seg) = per_rail[rail];
        let st = self.clone();
        let job = Job {
            peer,
            plan: crate::plan::TransferPlan {
                writes: Vec::new(),
                bytes: 0,
            },
            imm: Some((*v, seg)),
            slot: Slot::with_callback(Box::new(move |r: TransferResult| {
                st.slot.complete(r.map(|s| TransferStats {
                    bytes: stats.bytes,
                    ops: stats.ops + s.ops,
                }))
            })),
            deadline: self.timeout.map(|d| Instant::now() + d),
        };
        if let Err(slot) = self.links[rail].send_transfer(job) {
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
