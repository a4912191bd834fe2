//! The [`Transport`] trait: register memory, post operations, poll completions.

use crate::error::{OpError, Result};
use crate::memory::MemoryRegion;
use crate::stats::TransportStats;
use crate::types::{
    Access, LocalKey, LocalSlice, PeerId, Registration, RemoteSlice, Rows, WorkRequestId,
};
use crate::wake::{NoWake, Wake};
use std::sync::Arc;
use std::time::Duration;

/// What a post call did. "No room now" is expected, never an error: poll, then post again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum PostOutcome {
    /// The operation was accepted; a completion will follow.
    Posted,
    /// The transport's queues are full; nothing was taken. Poll, then retry.
    NoRoom,
}

/// The kind of operation a completion reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// A local SEND finished (delivered into a posted receive at the peer).
    Send,
    /// A local receive was filled.
    Recv,
    /// A local WRITE was placed in the peer's memory.
    Write,
    /// A local READ's bytes were placed in our memory ([`Transport::post_read`]).
    Read,
    /// A peer's WRITE with immediate data landed in our memory (no local work request:
    /// `wr_id` is [`WorkRequestId(0)`](WorkRequestId)).
    RemoteWrite,
}

impl OpKind {
    /// The kind of a one-sided operation's completion: [`Read`](OpKind::Read) for a READ,
    /// [`Write`](OpKind::Write) for a WRITE.
    pub fn one_sided(read: bool) -> OpKind {
        if read { OpKind::Read } else { OpKind::Write }
    }
}

/// One finished operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The work-request id given at post time (0 for [`OpKind::RemoteWrite`]).
    pub wr_id: WorkRequestId,
    /// What finished.
    pub op: OpKind,
    /// Bytes moved on success, or why it failed.
    pub result: std::result::Result<u64, OpError>,
    /// The peer involved, where known (the sender of a received message or remote write).
    pub peer: Option<PeerId>,
    /// Immediate data carried by the message or write, if any.
    pub imm: Option<u32>,
}

impl Completion {
    /// Whether it succeeded.
    pub fn is_ok(&self) -> bool {
        self.result.is_ok()
    }
}

/// What a backend can do, for the planner and the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransportLimits {
    /// Largest single message or write, in bytes.
    pub max_msg_size: u64,
    /// Operations the transport accepts before it answers [`PostOutcome::NoRoom`] (a hint).
    pub max_outstanding: usize,
    /// Whether immediate data is supported on writes.
    pub write_imm: bool,
    /// `wait` cannot block on readiness (no file descriptor to sleep on): the engine polls
    /// without pausing while operations are in flight, and naps only when idle.
    pub busy_poll: bool,
    /// [`post_write_rows`](Transport::post_write_rows) is implemented: the planner then
    /// turns runs of equally long segments at constant strides (a tensor-parallel piece's
    /// rows) into one strided write instead of one write per row.
    pub strided_writes: bool,
}

/// A reliable, connectionless-looking transport with RDMA semantics.
///
/// Call order: create (in the thread that will poll it), [`register`](Transport::register)
/// memory, [`add_peer`](Transport::add_peer) with an address obtained out of band, post
/// operations, and [`poll`](Transport::poll) until their completions arrive. Every post
/// returns at once. The transport makes progress only inside `poll` (and `wait`), so a
/// target must keep polling for peers' writes to land.
pub trait Transport: Send + 'static {
    /// A short name of the backend ("tcp", "efa", "mem").
    fn name(&self) -> &'static str;

    /// The address peers pass to [`add_peer`](Transport::add_peer).
    fn address(&self) -> Vec<u8>;

    /// Limits of this backend.
    fn limits(&self) -> TransportLimits;

    /// Adds a peer by address. Connection set-up may continue inside `poll`.
    fn add_peer(&mut self, address: &[u8]) -> Result<PeerId>;

    /// Whether a peer that [`add_peer`](Transport::add_peer) returned has finished setting
    /// up (connections made): `Ok(true)` ready, `Ok(false)` still connecting (set-up goes on
    /// inside `poll`), or the error that made it fail, after which the peer is gone. The
    /// engine answers an `add_peer` call only once this is settled, without blocking its
    /// worker meanwhile. The default: ready at once.
    fn peer_ready(&mut self, peer: PeerId) -> Result<bool> {
        let _ = peer;
        Ok(true)
    }

    /// The address of peer `peer` as the peer itself publishes it (what it returns from
    /// [`address`](Transport::address)), where the transport knows it: for a peer that
    /// connected to us, the address it said in its handshake. It names the sender of a
    /// peer's immediate data across rails and engines. The default: unknown.
    fn peer_address(&self, peer: PeerId) -> Option<Vec<u8>> {
        let _ = peer;
        None
    }

    /// The incarnation that peer `peer` announced when we connected to it (its agent's
    /// [`AgentInfo::instance`](crate::metadata::AgentInfo::instance)), where the transport's
    /// handshake carries one and the peer announced it: a reconnect that finds another
    /// incarnation at the same address knows the peer restarted. Asked once
    /// [`peer_ready`](Transport::peer_ready) says the peer is ready. The default: unknown.
    fn peer_instance(&self, peer: PeerId) -> Option<u64> {
        let _ = peer;
        None
    }

    /// Removes a peer: its pending operations complete with [`OpError::PeerRemoved`].
    fn remove_peer(&mut self, peer: PeerId) -> Result<()>;

    /// Registers memory. The transport keeps `mem` alive until it is deregistered and
    /// no operation uses it any more.
    fn register(&mut self, mem: Arc<dyn MemoryRegion>, access: Access) -> Result<Registration>;

    /// Deregisters memory: peers' later accesses with its key fail.
    fn deregister(&mut self, key: LocalKey) -> Result<()>;

    /// Sends `src` to a receive the peer has posted (or will post).
    fn post_send(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        imm: Option<u32>,
    ) -> Result<PostOutcome>;

    /// Posts a receive buffer for a SEND from any peer.
    fn post_recv(&mut self, wr_id: WorkRequestId, dst: LocalSlice) -> Result<PostOutcome>;

    /// Writes `src` into the peer's memory at `dst`, optionally with immediate data that the
    /// peer receives as an [`OpKind::RemoteWrite`] completion once the bytes have landed.
    /// `src.len` must equal `dst.len`.
    fn post_write(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        dst: RemoteSlice,
        imm: Option<u32>,
    ) -> Result<PostOutcome>;

    /// Writes `rows.count` rows of `src.len` bytes into the peer's memory: row `i` from
    /// `src.offset + i * rows.src_stride` to `dst.offset + i * rows.dst_stride`, as one
    /// operation with one completion (its result the bytes of all rows). `src` and `dst`
    /// are the first row (equal lengths); every row must lie in its region, which the
    /// target checks for the whole span before any byte lands, as for a plain write.
    /// Immediate data, if any, is delivered once every row has landed.
    ///
    /// The default refuses with [`Error::UnsupportedOp`](crate::Error::UnsupportedOp): a
    /// backend that implements it overrides this and sets
    /// [`TransportLimits::strided_writes`], and only then does the engine post one.
    fn post_write_rows(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        dst: RemoteSlice,
        rows: Rows,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        let _ = (peer, wr_id, src, dst, rows, imm);
        Err(crate::Error::UnsupportedOp {
            backend: self.name(),
            op: "strided WRITE",
        })
    }

    /// Reads the peer's memory at `src` into the local range `dst` (one-sided: the owner's
    /// application does nothing; its transport serves the read inside its own `poll`).
    /// `dst.len` must equal `src.len`; `dst`'s region must be registered with
    /// [`Access::LOCAL_WRITE`], the peer's with [`Access::REMOTE_READ`]. The completion
    /// (kind [`OpKind::Read`], with the bytes read) comes only once every byte has been
    /// placed in `dst`; remote failures (key, bounds, permission) come as error completions,
    /// and nothing of `dst` changes then.
    ///
    /// The default refuses with [`Error::UnsupportedOp`](crate::Error::UnsupportedOp):
    /// a backend that implements READ overrides this and [`supports_read`](Self::supports_read).
    fn post_read(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        dst: LocalSlice,
        src: RemoteSlice,
    ) -> Result<PostOutcome> {
        let _ = (peer, wr_id, dst, src);
        Err(crate::Error::UnsupportedOp {
            backend: self.name(),
            op: "READ",
        })
    }

    /// Whether [`post_read`](Self::post_read) is implemented. The engine refuses READ
    /// transfers on a backend without it, and the READ conformance cases require it.
    fn supports_read(&self) -> bool {
        false
    }

    /// Drives progress and appends finished operations to `out`; returns how many.
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize>;

    /// Blocks until `poll` may make progress, or `timeout` passes. The default sleeps
    /// briefly; backends with a waitable source (sockets, a CQ file descriptor) block on it.
    ///
    /// A backend whose progress is manual (bytes move only while it is polled) must
    /// override this, or set [`TransportLimits::busy_poll`]: an idle target engine calls
    /// `wait` between polls, and the default's naps starved libfabric's tcp provider to a
    /// third of its speed.
    ///
    /// A call of the [`waker`](Transport::waker)'s [`Wake::wake`] from any thread makes a
    /// `wait` in progress, or the next one, return at once.
    fn wait(&mut self, timeout: Duration) -> Result<()> {
        std::thread::sleep(timeout.min(Duration::from_micros(50)));
        Ok(())
    }

    /// The handle that ends a [`wait`](Transport::wait) at once, from any thread: the engine
    /// calls it when it hands its worker new work, so a sleeping worker starts on it without
    /// delay. Called once, in the thread that created the transport. The default does
    /// nothing (the default `wait` only naps); a backend that sleeps longer must return a
    /// real one (a [`WakeFd`](crate::wake::WakeFd) in its poll set, or a
    /// [`Signal`](crate::wake::Signal) it waits on).
    fn waker(&mut self) -> Arc<dyn Wake> {
        Arc::new(NoWake)
    }

    /// What this transport counts of its peers (bytes their WRITEs placed here, READs
    /// served, requests refused, each peer's state and last error), shared with whoever
    /// reads it while the transport runs: the engine asks once, in the thread that created
    /// the transport, and reports it in [`Engine::stats`](crate::engine::Engine::stats).
    /// The default keeps none.
    fn stats(&mut self) -> Option<Arc<TransportStats>> {
        None
    }
}
