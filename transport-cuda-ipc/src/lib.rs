//! # transport-cuda-ipc
//!
//! A [`Transport`](fabric_core::Transport) for peers on the same host: WRITEs between GPUs are device-to-device
//! copies into the peer's memory, opened through CUDA IPC (over NVLink where the GPUs have
//! it), instead of trips through NICs or sockets.
//!
//! - **Registration** of device memory exports it ([`gpu_mem::Device::export_ipc`]); the
//!   remote descriptor carries only a random 64-bit key. Host memory may be registered as a
//!   source of WRITEs and for SEND/RECV, but not as a WRITE target (a clear error at
//!   registration: use the tcp transport for host memory).
//! - **Control** travels over an abstract Unix socket per transport: SEND/RECV payloads,
//!   and for WRITEs a reservation round trip per batch: the initiator sends the ranges it is
//!   about to write, the target checks key, bounds and permission (exactly as the tcp
//!   transport does before any byte lands) and answers with a verdict per range, preceded
//!   the first time by the region's IPC handle, which the initiator opens once and caches.
//!   The target keeps every granted region alive until the initiator reports the batch
//!   done, so deregistration never frees memory under a copy, and a deregistered key fails
//!   the next write with [`OpError::RemoteKeyInvalid`] while leaving memory untouched.
//! - **WRITE** = an asynchronous copy on this transport's stream (one `cuMemcpyBatchAsync`
//!   per batch where the driver has it), completed by an event; then the initiator's
//!   completion, and a DONE frame carrying the immediate values, which the target reports
//!   as [`OpKind::RemoteWrite`] completions after the bytes have landed.
//! - **READ** takes the same path the other way: a reservation of the ranges to read,
//!   checked by the owner for REMOTE_READ (its application does nothing; its transport
//!   answers inside `poll`), then a copy from the peer's mapping into the local region;
//!   the READ completes once its copy has finished.
//! - **Peers** are identified by their host's boot id: an address from another host is
//!   refused at `add_peer`; a peer whose process exits fails its pending operations with
//!   [`OpError::PeerUnreachable`]; removing a peer waits for its copies in flight, then
//!   closes its mappings.
//!
//! **Timeline.** At trace level the target `transport_cuda_ipc::timeline` logs each batch's
//! steps (`reserving` with its writes and bytes, `granted`, `launched`, `copied`), so a
//! subscriber with timestamps shows where a batch waited: for the target's grant, for the
//! launch (building the copy list), or on the GPU. The weight-sync example writes them per
//! process (`XFER_TRACE_DIR`; see `xfer/examples/weights_sync.rs`).
//!
//! Abstract Unix sockets are reachable by every process in the same network namespace;
//! remote keys are random 64-bit values, so a process must be given a descriptor to write.
//!
//! **The token.** With [`CudaIpcConfig::auth_token`], both ends of every control connection
//! prove it by challenge and response before anything else ([`fabric_core::auth`]; the
//! handshake is in [`wire`]): the target sends a fresh nonce, the initiator's HELLO answers
//! it with an HMAC-SHA256 keyed by the token and carries a nonce of its own, which the
//! target's PROOF answers in the other direction's context. The target checks the HELLO (in
//! constant time) before it handles any reservation or SEND, and sends no handle, grant or
//! answer before; the initiator sends no reservation, SEND or handle request before the
//! PROOF has verified. A token on one side only is refused by both, each saying which side
//! lacks it ([`HandshakeError::PeerHasNoToken`], [`HandshakeError::NoTokenHere`]); another
//! token is [`HandshakeError::RefusedByTarget`] at the initiator and
//! [`HandshakeError::AuthenticationFailed`] at the target. The initiator's operations (and
//! [`peer_ready`](fabric_core::Transport::peer_ready)) fail with [`OpError::Transport`]
//! whose cause is the [`HandshakeError`]; the target logs its refusals and keeps them for
//! [`CudaIpcTransport::take_auth_refusals`]. The token guards the control socket only: it
//! does not change what a handle, once sent to a peer that proved it, opens (below).
//!
//! **What a peer can reach.** The target checks every reservation against the region's key,
//! registered range (with checked arithmetic) and access (REMOTE_WRITE for writes,
//! REMOTE_READ for reads) and answers a refused one with its verdict (the initiator's
//! operation fails with [`OpError::OutOfBounds`], [`OpError::PermissionDenied`] or
//! [`OpError::RemoteKeyInvalid`]); a peer is sent a region's handle only with its first
//! granted reservation, never for a refused one. The initiator checks every granted range
//! against the region its KeyInfo described (and that region against the mapping the
//! driver reports) before it queues a copy, so a hostile target cannot make it copy outside
//! what it opened; a handle from a peer is resolved through this process's own exports only
//! when the kernel says (`SO_PEERCRED` on the control socket) that the peer is this very
//! process, so a hostile target cannot aim our copies into our own allocations by sending
//! their handles; a key's mapping is dropped when the target revokes it (deregistration),
//! and a grant for a key without a live mapping fails.
//!
//! What CUDA IPC cannot restrict, and this transport therefore cannot either: a handle opens
//! the *whole allocation* that contains the region (for a PyTorch tensor, the caching
//! allocator's segment, with other tensors in it), for reading and writing alike, whatever
//! the registration allowed; the checks above bind an honest initiator (this crate), not a
//! process that holds the handle and copies with the driver itself, and such a process
//! keeps its mapping after the region is deregistered until it closes it. So a peer that
//! was granted one reservation of a region can reach the whole allocation behind it. The
//! peers this crate serves are processes of the same host (same boot id) that can reach
//! the control socket and were given a descriptor: treat them as trusted with every
//! allocation they were granted a range of. For memory that must be exposed no wider than
//! registered, give the region an allocation of its own, or use a transport whose target
//! copies the bytes itself (tcp).
//!
//! Dependencies and why: `fabric-core` for the [`Transport`](fabric_core::Transport) it
//! implements; `gpu-mem` for the device memory, copies, events and IPC handles
//! (the workspace's one wrapper of the CUDA driver); `libc` for `poll` on the control
//! sockets; `tracing` for the warnings about refused and closed connections, as the other
//! transports log them; `rustc-hash` for the maps looked up per operation (as fabric-core's
//! in-process transport uses it). The tests use `hex`, the workspace's encoder, for the address one
//! process hands the other on its stdout.
//!
//! ```no_run
//! use fabric_core::{Access, LocalSlice, RemoteSlice, Transport, WorkRequestId};
//! use std::sync::Arc;
//! use transport_cuda_ipc::{CudaIpcConfig, CudaIpcTransport};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let Some(cuda) = gpu_mem::Cuda::probe()? else {
//!     println!("no CUDA on this machine");
//!     return Ok(());
//! };
//! let gpu = cuda.device(0)?;
//! let mut a = CudaIpcTransport::new(&cuda, CudaIpcConfig::default())?;
//! let mut b = CudaIpcTransport::new(&cuda, CudaIpcConfig::default())?;
//! let src = a.register(Arc::new(gpu.alloc(1 << 20)?), Access::NONE)?;
//! let dst = b.register(Arc::new(gpu.alloc_zeroed(1 << 20)?), Access::REMOTE_WRITE)?;
//! let peer = a.add_peer(&b.address())?;
//! let _ = a.post_write(
//!     peer,
//!     WorkRequestId(1),
//!     LocalSlice { key: src.local, offset: 0, len: 1 << 20 },
//!     RemoteSlice { region: dst.remote, offset: 0, len: 1 << 20 },
//!     Some(7),
//! )?;
//! let (mut done_a, mut done_b) = (Vec::new(), Vec::new());
//! while done_a.is_empty() || done_b.is_empty() {
//!     a.poll(&mut done_a)?;
//!     b.poll(&mut done_b)?;
//! }
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

mod address;
mod api;
mod conn;
mod error;
mod handshake;
mod initiator;
mod link;
mod target;
pub mod wire;

pub use address::{IpcAddress, boot_id, is_local_address};
pub use error::HandshakeError;

use conn::{FrameConn, ReadOutcome};
use error::ProtocolError;
use fabric_core::{
    Access, Completion, Error, LocalKey, LocalSlice, MemoryRegion, OpError, OpKind, PeerId,
    RemoteKey, Result, WorkRequestId,
};
use gpu_mem::Cuda;
use handshake::Handshake;
pub use link::{CudaLink, Link, LinkError, LinkExport, LoopbackLink, LoopbackMapping};
use std::collections::{HashMap, VecDeque};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wire::{Header, Op, Reserve, Status};

/// The maps on the data path, looked up once or more per operation: their keys are integers
/// this process chose (local keys, peer ids, batch numbers) or random 64-bit remote keys, so
/// FxHash's multiply spreads them well, at a fraction of SipHash's cost (which was a tenth of
/// a small write's time).
type FastMap<K, V> = rustc_hash::FxHashMap<K, V>;
/// See [`FastMap`].
type FastSet<K> = rustc_hash::FxHashSet<K>;

/// Settings of a [`CudaIpcTransport`]. Its `Debug` form does not show the token.
#[derive(Clone)]
pub struct CudaIpcConfig {
    /// The CUDA device this transport copies from (its stream and mappings live there).
    pub device: u32,
    /// Largest single WRITE.
    pub max_msg_size: u64,
    /// Largest SEND (its bytes travel through the control socket and are buffered whole).
    pub max_send_size: u64,
    /// Operations in flight before posts answer `NoRoom`.
    pub max_outstanding: usize,
    /// Writes per reservation round trip.
    pub max_batch: usize,
    /// Reservations (and copy batches) in flight per peer.
    pub max_batches_in_flight: usize,
    /// SENDs buffered for receives not yet posted (count and bytes); beyond that the
    /// connection stops being read until receives are posted.
    pub max_unexpected_count: usize,
    /// See `max_unexpected_count`.
    pub max_unexpected_bytes: usize,
    /// How long a peer may leave a reservation unanswered before it is declared
    /// unreachable, and how long a new connection's handshake may take (an accepted one's
    /// HELLO; one we opened, the target's CHALLENGE and PROOF).
    pub peer_timeout: Duration,
    /// Most open connections.
    pub max_connections: usize,
    /// How batches of copies are issued (`None`: the best that works here, the copy kernel
    /// first); forcing one is for comparisons. Was the `XFER_CUDA_COPY` variable.
    pub copy_method: Option<gpu_mem::CopyMethod>,
    /// A shared secret that both ends of every control connection prove to each other
    /// before any reservation, handle, SEND or copy (see the [crate documentation](crate)).
    /// A peer with another token, or without one, is refused, and so is one with a token
    /// when this side has none. `None`: every peer without a token is let in.
    pub auth_token: Option<String>,
}

impl std::fmt::Debug for CudaIpcConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaIpcConfig")
            .field("device", &self.device)
            .field("max_msg_size", &self.max_msg_size)
            .field("max_send_size", &self.max_send_size)
            .field("max_outstanding", &self.max_outstanding)
            .field("max_batch", &self.max_batch)
            .field("max_batches_in_flight", &self.max_batches_in_flight)
            .field("max_unexpected_count", &self.max_unexpected_count)
            .field("max_unexpected_bytes", &self.max_unexpected_bytes)
            .field("peer_timeout", &self.peer_timeout)
            .field("max_connections", &self.max_connections)
            .field("copy_method", &self.copy_method)
            .field(
                "auth_token",
                &self.auth_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl Default for CudaIpcConfig {
    fn default() -> Self {
        CudaIpcConfig {
            device: 0,
            max_msg_size: 1 << 30,
            max_send_size: 16 << 20,
            max_outstanding: 1 << 16,
            max_batch: 1024,
            max_batches_in_flight: 16,
            max_unexpected_count: 4096,
            max_unexpected_bytes: 64 << 20,
            peer_timeout: Duration::from_secs(5),
            max_connections: 1024,
            copy_method: None,
            auth_token: None,
        }
    }
}

/// One WRITE on its way.
struct WriteOp {
    wr: WorkRequestId,
    /// The local region: a write's source, a read's destination.
    src: Arc<dyn MemoryRegion>,
    src_off: u64,
    key: u64,
    off: u64,
    len: u64,
    imm: Option<u32>,
    /// A READ: the copy goes from the peer's range into `src`.
    read: bool,
    /// Rows of a strided write (1 for a plain one; `len` is then a row's length), and the
    /// distances between rows' starts on each side.
    rows: u64,
    src_stride: u64,
    dst_stride: u64,
}

impl WriteOp {
    /// Bytes it moves (checked not to overflow when posted).
    fn bytes(&self) -> u64 {
        self.len * self.rows
    }

    /// Bytes of the peer's region it spans, first row's start to last row's end (checked
    /// when posted): what the reservation asks the target to check.
    fn dst_span(&self) -> u64 {
        (self.rows - 1) * self.dst_stride + self.len
    }
}

/// A peer's region as this side reaches it.
struct KeyMap<M> {
    mapping: Arc<M>,
    /// Where the region starts in the mapped allocation.
    offset: u64,
    /// The region's length, as its KeyInfo said (checked to fit the mapping): every granted
    /// range is checked against it before a copy is queued.
    len: u64,
}

impl<M> KeyMap<M> {
    /// Where in the mapping `op`'s range of the region starts, once the range (first row's
    /// start to last row's end) is checked, without overflow, to lie inside the region: a
    /// target's grant never makes us copy outside what its KeyInfo described.
    fn place(&self, op: &WriteOp) -> std::result::Result<u64, OpError> {
        let span = op.dst_span();
        match op.off.checked_add(span) {
            Some(end) if end <= self.len => Ok(self.offset + op.off),
            _ => Err(OpError::OutOfBounds {
                offset: op.off,
                len: span,
                region_len: self.len,
            }),
        }
    }
}

/// A peer added with `add_peer` (the initiator's side of a connection).
struct Peer<M> {
    conn: Option<usize>,
    address: Vec<u8>,
    /// Set once the connection is gone: later posts fail with this.
    broken: Option<OpError>,
    pending: VecDeque<WriteOp>,
    reserving: FastMap<u64, (Instant, Vec<WriteOp>)>,
    next_batch: u64,
    /// Batches reserved or copying.
    in_flight: usize,
    keys: FastMap<u64, std::result::Result<KeyMap<M>, LinkError>>,
    sends: VecDeque<(WorkRequestId, u64)>,
    /// The kernel's word (SO_PEERCRED, at connect) that the peer is this very process: only
    /// then are its handles resolved through our own exports (see [`Link::open`]).
    same_process: Option<gpu_mem::SameProcess>,
}

/// What a connection is for.
enum Role {
    /// We connected: we send requests, the peer answers.
    Initiator(PeerId),
    /// The peer connected: it sends requests, we answer.
    Target {
        /// Known after HELLO.
        peer: Option<PeerId>,
        /// Keys whose handle this connection was sent.
        known_keys: FastSet<u64>,
        /// Regions of granted batches, kept alive until DONE, and how many writes each
        /// batch was granted.
        granted: FastMap<u64, (Vec<Arc<dyn MemoryRegion>>, usize)>,
    },
}

struct Conn {
    io: FrameConn,
    role: Role,
    /// Where the handshake stands: nothing but its frames is read or sent before it is over.
    hs: Handshake,
    /// (Initiator) SENDs posted before the handshake was over, sent once it is.
    held: Vec<u8>,
    /// When the connection was opened or accepted (its handshake must end within
    /// `peer_timeout`).
    opened: Instant,
    /// Reading stopped: a SEND waits for room in the unexpected queue.
    paused: bool,
    /// When the last frame arrived (or the connection opened).
    last_heard: Instant,
}

/// A locally registered region.
struct LocalRegion {
    mem: Arc<dyn MemoryRegion>,
    access: Access,
    rkey: u64,
}

/// A region peers may write (or be refused).
struct TargetRegion {
    mem: Arc<dyn MemoryRegion>,
    access: Access,
    export: Option<LinkExport>,
}

/// A batch whose copies run on the stream.
struct Copying {
    ticket: u64,
    peer: PeerId,
    batch: u64,
    ops: Vec<WriteOp>,
}

/// The CUDA IPC transport. See the [crate documentation](crate).
///
/// `L` is the data path: [`CudaLink`] (the default), or [`LoopbackLink`] to run the
/// protocol on host memory inside one process (tests without a GPU).
pub struct CudaIpcTransport<L: Link = CudaLink> {
    cfg: CudaIpcConfig,
    link: L,
    listener: UnixListener,
    address: Vec<u8>,
    boot_id: String,
    conns: Vec<Option<Conn>>,
    peers: FastMap<PeerId, Peer<L::Mapping>>,
    passive: HashMap<Vec<u8>, PeerId>,
    next_peer: u64,
    local: FastMap<LocalKey, LocalRegion>,
    targets: FastMap<u64, TargetRegion>,
    next_local: u64,
    /// Posted receives and early arrivals (fabric-core's one matching piece).
    recv: fabric_core::recv::RecvMatch,
    copying: VecDeque<Copying>,
    done: Vec<Completion>,
    outstanding: usize,
    pollfds: Vec<libc::pollfd>,
    /// In `wait`'s poll set: the engine makes it readable when it has work for us.
    wake: fabric_core::wake::WakeFd,
    /// Accepted connections whose handshake was refused, and why (the latest
    /// [`MAX_AUTH_REFUSALS`]), until [`take_auth_refusals`](Self::take_auth_refusals).
    auth_refusals: VecDeque<HandshakeError>,
}

/// Refusals of accepted connections' handshakes kept for
/// [`CudaIpcTransport::take_auth_refusals`].
pub const MAX_AUTH_REFUSALS: usize = 64;

fn op_error(status: u32, op: &WriteOp, region_len: u64) -> OpError {
    match Status::from_u32(status) {
        Some(Status::BadKey) => OpError::RemoteKeyInvalid(RemoteKey(op.key)),
        Some(Status::OutOfBounds) => OpError::OutOfBounds {
            offset: op.off,
            len: op.dst_span(),
            region_len,
        },
        Some(Status::NoPermission) => OpError::PermissionDenied,
        _ => OpError::Remote(format!("the target answered status {status}")),
    }
}

impl CudaIpcTransport<CudaLink> {
    /// Creates a transport on `cfg.device`, listening on a fresh abstract Unix socket.
    pub fn new(cuda: &Cuda, cfg: CudaIpcConfig) -> Result<CudaIpcTransport> {
        let link =
            CudaLink::new(cuda, cfg.device, cfg.copy_method).map_err(|e| Error::Backend {
                call: "open the CUDA device and its copy stream",
                message: e.to_string(),
                source: Some(Arc::new(e)),
            })?;
        CudaIpcTransport::with_link(link, cfg)
    }
}

impl<L: Link> CudaIpcTransport<L> {
    /// Creates a transport over `link`, listening on a fresh abstract Unix socket.
    pub fn with_link(link: L, cfg: CudaIpcConfig) -> Result<CudaIpcTransport<L>> {
        let recv =
            fabric_core::recv::RecvMatch::new(cfg.max_unexpected_count, cfg.max_unexpected_bytes);
        let pid = std::process::id();
        let boot_id = boot_id()?;
        let (listener, socket) = loop {
            let name = format!("xfer-ipc-{pid}-{:016x}", fabric_core::random_u64());
            let addr = SocketAddr::from_abstract_name(name.as_bytes())
                .map_err(|e| Error::io("abstract socket name", e))?;
            match UnixListener::bind_addr(&addr) {
                Ok(l) => break (l, name),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
                Err(e) => return Err(Error::io("bind the CUDA IPC control socket", e)),
            }
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("set_nonblocking", e))?;
        let address = IpcAddress {
            boot_id: boot_id.clone(),
            pid,
            device: link.device(),
            socket,
        }
        .encode();
        Ok(CudaIpcTransport {
            cfg,
            link,
            listener,
            address,
            boot_id,
            conns: Vec::new(),
            peers: FastMap::default(),
            passive: HashMap::new(),
            next_peer: 1,
            local: FastMap::default(),
            targets: FastMap::default(),
            next_local: 1,
            recv,
            copying: VecDeque::new(),
            done: Vec::new(),
            outstanding: 0,
            pollfds: Vec::new(),
            wake: fabric_core::wake::WakeFd::new()
                .map_err(|e| Error::io("wake-up socket pair", e))?,
            auth_refusals: VecDeque::new(),
        })
    }

    /// The handshakes of accepted connections refused since the last call (the latest
    /// [`MAX_AUTH_REFUSALS`]), each also logged when it happened: a peer without the token
    /// ([`HandshakeError::PeerHasNoToken`]), one with a token when this side has none
    /// ([`HandshakeError::NoTokenHere`]), another token or a replayed HELLO
    /// ([`HandshakeError::AuthenticationFailed`]), another protocol version
    /// ([`HandshakeError::Version`]) or a malformed HELLO. Connections we open report
    /// theirs through [`peer_ready`](fabric_core::Transport::peer_ready) and their
    /// operations.
    pub fn take_auth_refusals(&mut self) -> Vec<HandshakeError> {
        self.auth_refusals.drain(..).collect()
    }

    /// Whether copies go out as one `cuMemcpyBatchAsync` per batch (driver 12.8 or later).
    pub fn batched_copies(&self) -> bool {
        self.link.batched()
    }

    /// How the link copies (`kernel`, `batch`, `memcpy`, or `cpu` for the loopback link) and,
    /// on the CUDA link, how finished batches are learnt (`completions by word` or `event`).
    pub fn copy_method(&self) -> String {
        self.link.copy_method()
    }

    fn max_payload(&self) -> u64 {
        let per_batch = (self.cfg.max_batch * <Reserve as wire::Record>::LEN) as u64;
        self.cfg.max_send_size.max(per_batch) + 4096
    }

    fn insert_conn(&mut self, c: Conn) -> usize {
        if let Some(i) = self.conns.iter().position(Option::is_none) {
            self.conns[i] = Some(c);
            i
        } else {
            self.conns.push(Some(c));
            self.conns.len() - 1
        }
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if self.conns.iter().flatten().count() >= self.cfg.max_connections {
                        tracing::warn!("connection refused: {} open", self.cfg.max_connections);
                        continue;
                    }
                    // A fresh nonce for every connection: a HELLO recorded on another one
                    // proves nothing here. No weaker source stands in for the system's.
                    let nonce = match fabric_core::auth::Nonce::new() {
                        Ok(n) => n,
                        Err(e) => {
                            let e = fabric_core::error::report(&e);
                            tracing::warn!("dropping a new CUDA IPC connection: {e}");
                            continue;
                        }
                    };
                    // Until its HELLO is let in, a connection's frames are handshake-sized.
                    let Ok(mut io) = FrameConn::new(stream, wire::HANDSHAKE_MAX_PAYLOAD) else {
                        continue;
                    };
                    handshake::challenge(&nonce, self.cfg.auth_token.as_deref(), io.out());
                    let now = Instant::now();
                    self.insert_conn(Conn {
                        io,
                        role: Role::Target {
                            peer: None,
                            known_keys: FastSet::default(),
                            granted: FastMap::default(),
                        },
                        hs: Handshake::Challenged { nonce },
                        held: Vec::new(),
                        opened: now,
                        paused: false,
                        last_heard: now,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    return;
                }
            }
        }
    }

    /// Closes connection `idx`; for an initiator's connection every pending operation of
    /// its peer fails with `err(peer)`.
    fn close_conn(&mut self, idx: usize, err: impl Fn(PeerId) -> OpError) {
        let Some(c) = self.conns.get_mut(idx).and_then(Option::take) else {
            return;
        };
        if let Role::Initiator(peer) = c.role {
            // Copies in flight into this peer's memory finish first: the peer keeps the
            // memory alive only while the connection lives.
            self.drain_copies_of(peer);
            let e = err(peer);
            if let Some(p) = self.peers.get_mut(&peer) {
                p.conn = None;
                // A refused handshake stays itself (its cause typed); anything else leaves
                // the peer unreachable, saying why.
                p.broken = Some(match &e {
                    OpError::Transport(_) => e.clone(),
                    other => OpError::PeerUnreachable {
                        peer,
                        reason: other.to_string(),
                    },
                });
                let mut failed: Vec<WriteOp> = p.pending.drain(..).collect();
                for (_, (_, ops)) in p.reserving.drain() {
                    failed.extend(ops);
                }
                p.in_flight = 0;
                p.keys.clear();
                for op in failed {
                    self.outstanding -= 1;
                    self.done.push(Completion {
                        wr_id: op.wr,
                        op: OpKind::one_sided(op.read),
                        result: Err(e.clone()),
                        peer: Some(peer),
                        imm: None,
                    });
                }
                for (wr, _) in p.sends.drain(..) {
                    self.outstanding -= 1;
                    self.done.push(Completion {
                        wr_id: wr,
                        op: OpKind::Send,
                        result: Err(e.clone()),
                        peer: Some(peer),
                        imm: None,
                    });
                }
            }
        }
    }

    fn protocol_error(&mut self, idx: usize, why: ProtocolError) {
        if let ProtocolError::Handshake(e) = why {
            return self.handshake_failed(idx, e);
        }
        let why = fabric_core::error::report(&why);
        tracing::warn!(conn = idx, "closing a CUDA IPC connection: {why}");
        self.close_conn(idx, |peer| OpError::PeerUnreachable {
            peer,
            reason: format!("protocol error: {why}"),
        });
    }

    /// Closes connection `idx`, whose handshake was refused with `e`. What is queued on it
    /// leaves first, best effort (an untagged HELLO that tells the target why; a REFUSE,
    /// queued here for a HELLO whose tag failed). An accepted connection's refusal is kept
    /// for [`take_auth_refusals`](Self::take_auth_refusals); one we opened fails its peer's
    /// operations with it.
    fn handshake_failed(&mut self, idx: usize, e: HandshakeError) {
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            return;
        };
        if e == HandshakeError::AuthenticationFailed {
            handshake::refuse(c.io.out());
        }
        let _ = c.io.flush();
        let why = fabric_core::error::report(&e);
        match c.role {
            Role::Target { .. } => {
                tracing::warn!(conn = idx, "refused a CUDA IPC connection: {why}");
                if self.auth_refusals.len() == MAX_AUTH_REFUSALS {
                    self.auth_refusals.pop_front();
                }
                self.auth_refusals.push_back(e);
                // An accepted connection has no operations of ours to fail.
                self.close_conn(idx, OpError::PeerRemoved);
            }
            Role::Initiator(peer) => {
                tracing::warn!(%peer, "CUDA IPC connection refused: {why}");
                let failed = e.op_error(peer);
                self.close_conn(idx, |_| failed.clone());
            }
        }
    }

    /// (Initiator) a frame of the handshake of connection `idx`, which we opened for
    /// `peer`: the CHALLENGE (answered with our HELLO), then the PROOF (checked; then the
    /// SENDs posted meanwhile go, and reservations may) or a REFUSE.
    fn on_handshake(
        &mut self,
        idx: usize,
        (h, payload): (Header, Vec<u8>),
    ) -> std::result::Result<(), ProtocolError> {
        let max_payload = self.max_payload();
        let token = self.cfg.auth_token.as_deref();
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            return Ok(());
        };
        match (c.hs, h.op) {
            (Handshake::AwaitingChallenge { nonce }, Op::Challenge) => {
                handshake::answer_challenge(
                    &nonce,
                    token,
                    &h,
                    &payload,
                    &self.address,
                    c.io.out(),
                )?;
                c.hs = Handshake::AwaitingProof { nonce };
            }
            (Handshake::AwaitingProof { nonce }, Op::Proof) => {
                handshake::check_proof(&nonce, token, &h, &payload)?;
                c.hs = Handshake::Done;
                c.io.set_max_payload(max_payload);
                let held = std::mem::take(&mut c.held);
                c.io.out().extend_from_slice(&held);
            }
            (Handshake::AwaitingProof { .. }, Op::Refuse) => {
                return Err(handshake::refusal(&h).into());
            }
            (Handshake::AwaitingChallenge { .. }, op) => {
                return Err(HandshakeError::Unexpected {
                    op,
                    expected: "CHALLENGE",
                }
                .into());
            }
            (_, op) => {
                return Err(HandshakeError::Unexpected {
                    op,
                    expected: "PROOF",
                }
                .into());
            }
        }
        Ok(())
    }

    /// Reads and handles the frames of connection `idx`.
    fn service(&mut self, idx: usize) {
        let Some(Some(c)) = self.conns.get_mut(idx) else {
            return;
        };
        if let ReadOutcome::Closed(why) = c.io.fill(16 << 20) {
            let why = fabric_core::error::report(&why);
            // Handle what arrived before the close, then close.
            self.handle_frames(idx);
            self.close_conn(idx, |peer| OpError::PeerUnreachable {
                peer,
                reason: format!("{why} (did its process exit?)"),
            });
            return;
        }
        self.handle_frames(idx);
    }

    fn handle_frames(&mut self, idx: usize) {
        loop {
            let Some(Some(c)) = self.conns.get_mut(idx) else {
                return;
            };
            if c.paused {
                return;
            }
            let frame = match c.io.next_frame() {
                Ok(Some(f)) => {
                    c.last_heard = Instant::now();
                    f
                }
                Ok(None) => return,
                Err(e) => return self.protocol_error(idx, ProtocolError::Frame(e)),
            };
            let r = match c.role {
                Role::Initiator(_) if !c.hs.is_done() => self.on_handshake(idx, frame),
                Role::Initiator(peer) => self.on_answer(idx, peer, frame),
                Role::Target { .. } => self.on_request(idx, frame),
            };
            if let Err(why) = r {
                return self.protocol_error(idx, why);
            }
        }
    }

    fn expire(&mut self, now: Instant) {
        let timeout = self.cfg.peer_timeout;
        let mut dead = Vec::new();
        let mut unshaken = Vec::new();
        for (i, c) in self.conns.iter().enumerate() {
            match c {
                Some(Conn {
                    role: Role::Target { peer: None, .. },
                    opened,
                    ..
                }) if now.duration_since(*opened) > timeout => dead.push((i, "no HELLO")),
                // A connection we opened whose target has not proved itself in time.
                Some(Conn {
                    role: Role::Initiator(_),
                    hs,
                    opened,
                    ..
                }) if !hs.is_done() && now.duration_since(*opened) > timeout => unshaken.push((
                    i,
                    match hs {
                        Handshake::AwaitingChallenge { .. } => HandshakeError::NoChallenge(timeout),
                        _ => HandshakeError::NoProof(timeout),
                    },
                )),
                // Unanswered for the whole timeout, and nothing else heard from the peer
                // meanwhile (a busy initiator that reads grants late is not a dead peer).
                Some(Conn {
                    role: Role::Initiator(peer),
                    last_heard,
                    ..
                }) if now.duration_since(*last_heard) > timeout
                    && self.peers.get(peer).is_some_and(|p| {
                        p.reserving
                            .values()
                            .any(|(t, _)| now.duration_since(*t) > timeout)
                    }) =>
                {
                    dead.push((i, "no answer to a reservation"))
                }
                _ => {}
            }
        }
        for (i, why) in dead {
            self.close_conn(i, |peer| OpError::PeerUnreachable {
                peer,
                reason: format!("{why} within {timeout:?}"),
            });
        }
        for (i, why) in unshaken {
            self.handshake_failed(i, why);
        }
    }

    fn local_slice(&self, s: LocalSlice) -> Result<&LocalRegion> {
        let r = self
            .local
            .get(&s.key)
            .ok_or(Error::Op(OpError::LocalKeyInvalid(s.key)))?;
        fabric_core::memory::check_range(s.offset, s.len, r.mem.len() as u64)?;
        Ok(r)
    }

    fn live_peer(&mut self, peer: PeerId) -> Result<&mut Peer<L::Mapping>> {
        let p = self.peers.get_mut(&peer).ok_or(Error::UnknownPeer(peer))?;
        if let Some(why) = &p.broken {
            return Err(Error::Op(why.clone()));
        }
        Ok(p)
    }
}

impl<L: Link> Drop for CudaIpcTransport<L> {
    fn drop(&mut self) {
        // Copies into peers' memory finish before their connections (and the peers'
        // keep-alives) go away.
        let _ = self.link.synchronize();
    }
}

impl<L: Link> std::fmt::Debug for CudaIpcTransport<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaIpcTransport")
            .field("address", &String::from_utf8_lossy(&self.address))
            .field("link", &self.link.name())
            .field("device", &self.link.device())
            .field("peers", &self.peers.len())
            .finish()
    }
}
