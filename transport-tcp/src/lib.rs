//! # transport-tcp
//!
//! A [`Transport`] over TCP that keeps RDMA semantics, so that everything built on `xfer`
//! runs and is tested on any laptop:
//!
//! - registered regions with unguessable random 64-bit remote keys;
//! - one-sided WRITE, optionally with 32-bit immediate data delivered to the target once the
//!   bytes have landed, and one-sided READ, served by the owner's transport inside its own
//!   `poll` (its application does nothing);
//! - SEND into receives posted in advance, with a bounded queue for early arrivals whose
//!   room the receiver grants to senders as credit: a sender holds SENDs it has no credit
//!   for (and fails one that waited [`TcpConfig::liveness_timeout`]), so a receiver never stops reading
//!   a connection for them and the WRITEs on it go on;
//! - a polled completion queue; progress happens only inside [`Transport::poll`].
//!
//! The target validates key, bounds and permission **before** it touches memory, reads
//! payloads straight into the registered region, then acknowledges: a WRITE's completion at
//! the initiator means the bytes are placed remotely, and a remote failure returns as an
//! error completion with its cause. Each peer gets `rails` connections; frames of many
//! operations leave in one vectored write. With [`TcpConfig::checksum`], WRITEs carry a
//! CRC32C that the target checks before placing any byte (see [`frame`]).
//!
//! With [`TcpConfig::auth_token`], both ends of every connection prove the token by
//! challenge and response: a fresh nonce per connection and per direction, answered with an
//! HMAC of it (see [`auth`], which other channels that share the token may use too, and
//! [`frame`] for the handshake). A token on one side only is refused by both, each saying
//! which side lacks it ([`TcpError::PeerHasNoToken`], [`TcpError::NoTokenHere`]); a
//! connection we open fails with the refusal itself ([`TcpError::is_authentication`]).
//!
//! Dependencies: `socket2` (socket options std lacks), `libc` (vectored I/O, poll),
//! `fabric-core`'s [`auth`] (HMAC-SHA256 challenge and response, nonces from the operating
//! system), `sha2` (the old static digest of [`auth_digest`]), `crc32c` (the optional checksum:
//! SSE 4.2 / ARMv8 CRC instructions picked at run time, a table where they are missing; one
//! call per payload), `rustc-hash` (FxHash for the maps looked up once or more per
//! operation: peers, local registrations and target regions by integers this process chose,
//! where SipHash was about 2 % of a 4 KiB page's time).
//!
//! ```
//! use fabric_core::{Access, HostBuffer, LocalSlice, RemoteSlice, Transport, WorkRequestId};
//! use transport_tcp::{TcpConfig, TcpTransport};
//! use std::sync::Arc;
//!
//! let mut a = TcpTransport::new(TcpConfig::default()).unwrap();
//! let mut b = TcpTransport::new(TcpConfig::default()).unwrap();
//! let src = HostBuffer::new_shared(4096).unwrap();
//! src.fill(0, 4096, 7).unwrap();
//! let dst = HostBuffer::new_shared(4096).unwrap();
//! let s = a.register(src, Access::NONE).unwrap();
//! let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
//! let peer = a.add_peer(&b.address()).unwrap();
//! let _ = a.post_write(peer, WorkRequestId(1),
//!     LocalSlice { key: s.local, offset: 0, len: 4096 },
//!     RemoteSlice { region: d.remote, offset: 0, len: 4096 }, None).unwrap();
//! let mut done = Vec::new();
//! while done.is_empty() {
//!     a.poll(&mut done).unwrap();
//!     b.poll(&mut Vec::new()).unwrap(); // the target must poll for writes to land
//! }
//! assert_eq!(done[0].result, Ok(4096));
//! assert_eq!(dst.to_vec(0, 4096).unwrap(), vec![7; 4096]);
//! ```
#![warn(missing_docs)]

pub mod auth;
mod congestion;
mod conn;
mod error;
pub mod frame;
mod held;
mod io;
mod staging;

use conn::{Conn, Inflight, Payload, ReadInto, ReadOutcome, Shared, TargetRegion};
use fabric_core::Invalid;
use fabric_core::memory::check_range;
use fabric_core::recv::PostedRecv;
use fabric_core::stats::{PeerState, TransportStats};
use fabric_core::wake::{Wake, WakeFd};
use fabric_core::{
    Access, Completion, Error, LocalKey, LocalSlice, MemoryRegion, OpError, OpKind, PeerId,
    PostOutcome, Registration, RemoteKey, RemoteRegion, RemoteSlice, Result, Rows, Transport,
    TransportLimits, WorkRequestId,
};
use frame::{FLAG_IMM, Header, Op};
use socket2::{Domain, Protocol, SockAddr, Socket, TcpKeepalive, Type};
use staging::{CudaProbe, Via};
use std::collections::HashMap;

/// The maps looked up per operation (see the crate's dependencies above).
pub(crate) type FastMap<K, V> = rustc_hash::FxHashMap<K, V>;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use congestion::Congestion;
pub use error::{CongestionError, CopyCause, FrameError, TcpError, report};

/// A static digest of a shared token: what HELLOs carried up to protocol version 3, and
/// what `xfer serve`'s control port still compares.
///
/// Deprecated for any new use, the control port included: it is the same on every
/// connection, so whoever sees it once can replay it. Prove a token with [`auth`]'s
/// challenge and response instead (a fresh [`auth::Nonce`] per connection, answered with
/// [`auth::tag`], checked with [`auth::verify`]). The data connections no longer use it.
pub fn auth_digest(token: &str) -> [u8; 16] {
    auth::digest(token)
}

/// Bytes of host staging that each connection uses, per direction, for memory the CPU
/// cannot address (GPU memory): device bytes are copied through it in chunks of at most
/// 1 MiB, while the socket moves the chunks before them, and never more than this at once.
pub const DEVICE_STAGING_BYTES: usize = staging::RING;

/// [`TcpConfig::liveness_timeout`]'s default: longer than a process is usually
/// descheduled, paused by a debugger or checkpointed, short enough that a dead host's
/// transfers fail within a minute.
pub const DEFAULT_LIVENESS_TIMEOUT: Duration = Duration::from_secs(30);

/// Prefix of every TCP transport address.
pub const ADDRESS_PREFIX: &str = "tcp://";

/// A non-blocking listener on `addr`, bound to the interface `dev` when one is named.
fn listen_on(addr: SocketAddr, dev: Option<&str>) -> Result<TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| Error::io("socket", e))?;
    s.set_reuse_address(true)
        .map_err(|e| Error::io("SO_REUSEADDR", e))?;
    if let Some(dev) = dev {
        bind_device(&s, dev)?;
    }
    s.bind(&SockAddr::from(addr))
        .map_err(|e| os_error("bind", format!("listen on {addr}"), e))?;
    s.listen(1024).map_err(|e| Error::io("listen", e))?;
    s.set_nonblocking(true)
        .map_err(|e| Error::io("set_nonblocking", e))?;
    Ok(s.into())
}

/// Binds `s` to the network interface `dev` (`SO_BINDTODEVICE`).
fn bind_device(s: &Socket, dev: &str) -> Result<()> {
    s.bind_device(Some(dev.as_bytes()))
        .map_err(|e| os_error("SO_BINDTODEVICE", format!("bind to interface {dev:?}"), e))
}

/// An OS error with what was being done (a name or address the static call name lacks).
fn os_error(call: &'static str, what: String, e: std::io::Error) -> Error {
    Error::Backend {
        call,
        message: format!("{what}: {e}"),
        source: Some(Arc::new(e)),
    }
}

/// `congestion` could not be set (`TCP_CONGESTION`): the kernel's error, explained.
fn congestion_error(congestion: &Congestion, e: std::io::Error) -> Error {
    os_error("TCP_CONGESTION", congestion.explain(&e), e)
}

/// Settings of a [`TcpTransport`].
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Where to listen for peers (`127.0.0.1:0` picks a free port).
    pub listen: SocketAddr,
    /// Connections opened to each peer added with `add_peer`.
    pub rails: usize,
    /// Largest single WRITE or SEND.
    pub max_msg_size: u64,
    /// Requests a connection may have outstanding before posts answer `NoRoom`.
    pub max_outstanding: usize,
    /// Bytes a connection may have queued before posts answer `NoRoom`.
    pub max_queued_bytes: usize,
    /// Early-arrival queue for SENDs with no posted receive: bytes and messages.
    pub max_unexpected_bytes: usize,
    /// See `max_unexpected_bytes`.
    pub max_unexpected_count: usize,
    /// The limit for setting a connection up: connecting, then the target's CHALLENGE (a
    /// target that sends none fails the peer), and an accepted connection's HELLO. Once a
    /// connection is up, [`liveness_timeout`](Self::liveness_timeout) alone judges it.
    pub peer_timeout: Duration,
    /// How long an established connection may go unanswered before it is declared dead:
    /// the peer's kernel not acknowledging our bytes (a partition, a dead host:
    /// TCP_USER_TIMEOUT and TCP keep-alives), keeping its window shut (a stopped or
    /// descheduled process whose buffers are full), or its transport not answering
    /// requests that its kernel took (a stopped process; checked in [`Transport::poll`]).
    /// Until then nothing fails: a peer stopped (SIGSTOP, a debugger, a checkpoint) or
    /// partitioned for less than this keeps its connection, and what was in flight
    /// completes once it goes on. A transfer that must not wait that long sets its own
    /// stall limit above the transport (the engine's `Transfer::stall_timeout`), which
    /// reports the stall and leaves the connection alone. SENDs held for lack of credit
    /// fail after this long too. Default 30 s; on a congested or lossy link keep it above
    /// several retransmission timeouts (a segment dropped three times waits 1.4 s).
    pub liveness_timeout: Duration,
    /// Socket buffer sizes (SO_SNDBUF / SO_RCVBUF); `None` keeps the system's.
    pub socket_buffer: Option<usize>,
    /// Most open connections (accepted ones beyond this are refused). A connection that sends
    /// no HELLO within `peer_timeout` is closed.
    pub max_connections: usize,
    /// A shared secret. When set, peers whose HELLO does not prove knowledge of it are
    /// refused before any of their frames touches memory, and our HELLOs carry its proof;
    /// targets we connect to must prove it back (their PROOF) before any request, payload
    /// or answer of ours leaves. Each proof is an HMAC of a nonce that the other side draws
    /// afresh for each connection (see [`auth`] and [`frame`]): the token never travels,
    /// and a recorded HELLO or PROOF is refused on any other connection. It authenticates
    /// the start of a connection, not the bytes after it: on untrusted networks run inside
    /// an encrypted tunnel. A token on one side and none on the other is refused by both.
    /// Without a token, the transport lets in every peer without one (and old peers of
    /// protocol version 4, 2 or 0).
    pub auth_token: Option<String>,
    /// How long `wait` naps on the sockets while device copies are in flight (they finish
    /// without a socket event). Zero (the default) polls again at once; a few microseconds
    /// ease the contention of many rails' threads on one CUDA context. Replaces the
    /// `XFER_TCP_COPY_NAP_US` environment variable.
    pub copy_nap: Duration,
    /// The network interface (NIC) this transport runs on, by name (`eth0`, `veth1`): the
    /// listener and every connection are bound to it (`SO_BINDTODEVICE`), and connections
    /// leave from `listen`'s IP address when that is not the unspecified one, so a rail
    /// uses its own NIC whatever the routing table prefers. `None` (the default) leaves the
    /// choice to the routing table. Needs Linux 5.7 or CAP_NET_RAW.
    pub interface: Option<String>,
    /// Our WRITEs from host memory carry a CRC32C of their header and payload
    /// ([`frame::FLAG_CRC`]), which the target checks before it places any byte: a payload
    /// corrupted on its way (by a middlebox, a NIC, memory; not caught by TCP's 16-bit
    /// checksum, or recomputed after the corruption) is refused with
    /// [`OpError::ChecksumMismatch`] instead of written. WRITEs are then at most
    /// [`frame::CHECKSUM_MAX_LEN`] bytes (the engine splits larger ones), and the target
    /// holds each whole before placing it: a copy more on each side. Writes from device
    /// memory, SENDs and READs carry none. Targets always check checksums that come.
    pub checksum: bool,
    /// The incarnation this transport announces to the peers that connect to it, in its
    /// CHALLENGE (the agent's [`AgentInfo::instance`](fabric_core::metadata::AgentInfo::instance)):
    /// an initiator that connects again to the same address learns that a restarted
    /// process answers ([`Transport::peer_instance`]). `None` (0 on the wire) announces
    /// nothing; builds that predate it ignore it.
    pub announce: Option<u64>,
    /// The congestion control of the connections (`TCP_CONGESTION`). The default,
    /// [`Congestion::Auto`], takes loopback connections off BBR, whose pacing halves a
    /// loopback stream (see [`Congestion`]), and leaves connections between hosts to the
    /// system.
    pub congestion: Congestion,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            rails: 1,
            max_msg_size: 256 << 20,
            max_outstanding: 1 << 16,
            max_queued_bytes: 256 << 20,
            max_unexpected_bytes: 64 << 20,
            max_unexpected_count: 4096,
            peer_timeout: Duration::from_secs(5),
            liveness_timeout: DEFAULT_LIVENESS_TIMEOUT,
            socket_buffer: None,
            max_connections: 4096,
            auth_token: None,
            copy_nap: Duration::ZERO,
            interface: None,
            checksum: false,
            announce: None,
            congestion: Congestion::Auto,
        }
    }
}

struct LocalRegion {
    mem: Arc<dyn MemoryRegion>,
    access: Access,
    rkey: u64,
    via: Via,
}

struct Peer {
    address: Vec<u8>,
    conns: Vec<usize>,
    next: usize,
    /// Known only because it connected to us.
    passive: bool,
}

/// The TCP backend. See the crate documentation.
pub struct TcpTransport {
    cfg: TcpConfig,
    listener: TcpListener,
    address: Vec<u8>,
    instance: u64,
    next_peer: u64,
    next_local: u64,
    peers: FastMap<PeerId, Peer>,
    passive: HashMap<u64, PeerId>,
    conns: Vec<Option<Conn>>,
    local: FastMap<LocalKey, LocalRegion>,
    shared: Shared,
    pollfds: Vec<libc::pollfd>,
    /// `cfg.auth_token`, shared with every connection's handshake.
    token: Option<Arc<str>>,
    /// The CUDA driver, looked for when device memory is first registered.
    cuda: CudaProbe,
    /// In `wait`'s poll set: the engine makes it readable when it has work for us.
    wake: WakeFd,
    /// Added peers whose connection failed, and why, until `peer_ready` reports it.
    failed_connects: HashMap<PeerId, OpError>,
    /// Accepted connections refused for their authentication, and why (the latest
    /// [`MAX_AUTH_REFUSALS`]), until [`take_auth_refusals`](TcpTransport::take_auth_refusals).
    auth_refusals: std::collections::VecDeque<TcpError>,
    /// Where payloads are read to compute their checksums (made on first use).
    scratch: Vec<u8>,
    /// `wait` saw the listener readable: the next `poll` accepts.
    listener_ready: bool,
    /// When `poll` next looks for new connections without being told of one (see
    /// [`ACCEPT_EVERY`]).
    next_accept: Instant,
}

/// How often `poll` looks for new connections when no `wait` has seen one coming: a
/// worker that polls in a loop would otherwise pay a failing `accept` per turn (about a
/// fifth of all its system calls when moving 4 KiB pages), while a connection still gets
/// its CHALLENGE within this long of arriving, or at once after a `wait`.
const ACCEPT_EVERY: Duration = Duration::from_millis(10);

/// Refusals of accepted connections' authentication kept for
/// [`TcpTransport::take_auth_refusals`].
pub const MAX_AUTH_REFUSALS: usize = 64;

impl TcpTransport {
    /// Listens on `cfg.listen`, ready for peers.
    pub fn new(cfg: TcpConfig) -> Result<TcpTransport> {
        if cfg.rails == 0 {
            return Err(Invalid::NoRails.into());
        }
        let listener = listen_on(cfg.listen, cfg.interface.as_deref())?;
        // Accepted connections start with the listener's algorithm (set before any peer:
        // see `Congestion`); a name the kernel refuses is refused here.
        cfg.congestion
            .apply(&listener, cfg.listen.ip())
            .map_err(|e| congestion_error(&cfg.congestion, e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("local_addr", e))?;
        let shared = Shared::new(
            cfg.max_unexpected_count,
            cfg.max_unexpected_bytes,
            cfg.max_msg_size,
        );
        let token = cfg.auth_token.as_deref().map(Arc::from);
        Ok(TcpTransport {
            address: format!("{ADDRESS_PREFIX}{local}").into_bytes(),
            cfg,
            listener,
            instance: fabric_core::random_u64(),
            next_peer: 1,
            next_local: 1,
            peers: FastMap::default(),
            passive: HashMap::new(),
            conns: Vec::new(),
            local: FastMap::default(),
            shared,
            pollfds: Vec::new(),
            token,
            cuda: CudaProbe::default(),
            wake: WakeFd::new().map_err(|e| Error::io("wake-up socket pair", e))?,
            failed_connects: HashMap::new(),
            auth_refusals: std::collections::VecDeque::new(),
            scratch: Vec::new(),
            listener_ready: false,
            next_accept: Instant::now(),
        })
    }

    /// Why connections peers opened to us were refused for their authentication since the
    /// last call (the latest [`MAX_AUTH_REFUSALS`]; each is also logged): a peer without
    /// our token ([`TcpError::PeerHasNoToken`]), one with a token when we have none
    /// ([`TcpError::NoTokenHere`]), a wrong one ([`TcpError::AuthenticationFailed`]), or
    /// one too old to check us ([`TcpError::HelloNotMutual`]). Connections we open report
    /// theirs through [`peer_ready`](fabric_core::Transport::peer_ready) and their requests.
    pub fn take_auth_refusals(&mut self) -> Vec<TcpError> {
        self.auth_refusals.drain(..).collect()
    }

    /// The socket address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("listener has an address")
    }

    /// Parses a `tcp://HOST:PORT` address.
    pub fn parse_address(address: &[u8]) -> Result<SocketAddr> {
        let s = std::str::from_utf8(address)
            .map_err(|_| Error::InvalidAddress("not UTF-8 (not a TCP transport address)".into()))?;
        let rest = s.strip_prefix(ADDRESS_PREFIX).ok_or_else(|| {
            Error::InvalidAddress(format!("{s:?} does not start with {ADDRESS_PREFIX}"))
        })?;
        rest.to_socket_addrs()
            .map_err(|e| Error::InvalidAddress(format!("{s:?}: {e}")))?
            .next()
            .ok_or_else(|| Error::InvalidAddress(format!("{s:?} resolves to nothing")))
    }

    /// Rails (connections) per active peer.
    pub fn rails(&self) -> usize {
        self.cfg.rails
    }

    /// Sets up a connection to or from `peer` before it carries data.
    fn setup_socket(&self, s: &Socket, peer: IpAddr) -> Result<()> {
        match self.cfg.congestion.apply(s, peer) {
            Ok(Some(set)) => tracing::debug!(%peer, congestion = %set, "congestion control set"),
            Ok(None) => {}
            Err(e) => return Err(congestion_error(&self.cfg.congestion, e)),
        }
        s.set_tcp_nodelay(true)
            .map_err(|e| Error::io("TCP_NODELAY", e))?;
        // Keep-alive probes on an idle connection from a quarter of the liveness timeout,
        // once a second; TCP_USER_TIMEOUT (which overrides the probes' count) ends the
        // connection once the peer's kernel has acknowledged nothing, or kept its window
        // shut, for the whole timeout.
        let live = self.cfg.liveness_timeout;
        let ka = TcpKeepalive::new()
            .with_time((live / 4).max(Duration::from_secs(1)))
            .with_interval(Duration::from_secs(1))
            .with_retries(3);
        s.set_tcp_keepalive(&ka)
            .map_err(|e| Error::io("SO_KEEPALIVE", e))?;
        s.set_tcp_user_timeout(Some(live))
            .map_err(|e| Error::io("TCP_USER_TIMEOUT", e))?;
        if let Some(n) = self.cfg.socket_buffer {
            s.set_send_buffer_size(n)
                .map_err(|e| Error::io("SO_SNDBUF", e))?;
            s.set_recv_buffer_size(n)
                .map_err(|e| Error::io("SO_RCVBUF", e))?;
        }
        s.set_nonblocking(true)
            .map_err(|e| Error::io("set_nonblocking", e))
    }

    /// Connects to `to` for the peer that will be `peer`.
    /// Starts connecting to `to` for the peer that will be `peer`, without waiting: the
    /// connection completes (or fails, or times out after `peer_timeout`) inside `poll`,
    /// so a peer that does not answer never stalls the others.
    fn connect(&self, to: SocketAddr, peer: PeerId) -> Result<TcpStream> {
        let s = Socket::new(Domain::for_address(to), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::io("socket", e))?;
        if let Some(dev) = &self.cfg.interface {
            bind_device(&s, dev)?;
            let ip = self.cfg.listen.ip();
            if !ip.is_unspecified() && ip.is_ipv4() == to.is_ipv4() {
                s.bind(&SockAddr::from(SocketAddr::new(ip, 0)))
                    .map_err(|e| os_error("bind", format!("leave from {ip} on {dev}"), e))?;
            }
        }
        self.setup_socket(&s, to.ip())?; // non-blocking from here
        match s.connect(&SockAddr::from(to)) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) => {
                return Err(Error::Op(OpError::PeerUnreachable {
                    peer,
                    reason: format!("connect to {to}: {e}"),
                }));
            }
        }
        Ok(s.into())
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

    /// Closes a connection: its outstanding and queued requests fail with `err`.
    fn close_conn(&mut self, idx: usize, err: OpError) {
        let Some(mut c) = self.conns.get_mut(idx).and_then(Option::take) else {
            return;
        };
        c.abandon(&mut self.shared);
        let peer = c.peer;
        // READs fail only once no copy into their device memory is in flight.
        c.settle_copies(self.cfg.peer_timeout);
        for wr_id in c.held_reads() {
            self.shared.completions.push(Completion {
                wr_id,
                op: OpKind::Read,
                result: Err(err.clone()),
                peer: Some(peer),
                imm: None,
            });
        }
        // Sent, and still waiting for SEND credit.
        // (The silent rows of a strided write are reported by its last row.)
        for op in c.into_unanswered().filter(|op| !op.silent) {
            self.shared.completions.push(Completion {
                wr_id: op.wr_id,
                op: op.op,
                result: Err(err.clone()),
                peer: Some(peer),
                imm: None,
            });
        }
        if let Some(p) = self.peers.get_mut(&peer) {
            p.conns.retain(|&i| i != idx);
            if p.passive && p.conns.is_empty() {
                self.peers.remove(&peer);
                self.passive.retain(|_, id| *id != peer);
                self.shared.stats.peer_closed(peer, Some(err.to_string()));
            } else {
                self.shared
                    .stats
                    .peer_error(peer, err.to_string(), p.conns.len());
            }
        }
    }

    fn local_region(&self, s: &LocalSlice) -> Result<&LocalRegion> {
        let r = self
            .local
            .get(&s.key)
            .ok_or_else(|| Error::Op(OpError::LocalKeyInvalid(s.key)))?;
        check_range(s.offset, s.len, r.mem.len() as u64).map_err(Error::Memory)?;
        Ok(r)
    }

    fn post_request(
        &mut self,
        peer: PeerId,
        first_rail: bool,
        mut hdr: Header,
        src: &LocalSlice,
        op: OpKind,
        wr_id: WorkRequestId,
    ) -> Result<PostOutcome> {
        let limit = self.max_msg(op);
        if src.len > limit {
            return Err(Invalid::TooLarge {
                op: if op == OpKind::Send { "SEND" } else { "WRITE" },
                len: src.len,
                limit,
                setting: if limit < self.cfg.max_msg_size {
                    "the largest checksummed frame"
                } else {
                    "TcpConfig::max_msg_size"
                },
            }
            .into());
        }
        // One lookup of the source (fields borrowed apart: the peers, the connections and
        // the checksum's scratch are other fields).
        let r = self
            .local
            .get(&src.key)
            .ok_or_else(|| Error::Op(OpError::LocalKeyInvalid(src.key)))?;
        check_range(src.offset, src.len, r.mem.len() as u64).map_err(Error::Memory)?;
        let idx = pick_conn(&mut self.peers, peer, first_rail)?;
        let c = self.conns[idx].as_mut().expect("peer conns are open");
        if c.outstanding() >= self.cfg.max_outstanding
            || c.queued_bytes() >= self.cfg.max_queued_bytes
        {
            return Ok(PostOutcome::NoRoom);
        }
        hdr.wr_id = wr_id.0;
        let inflight = Inflight {
            wr_id,
            op,
            len: src.len,
            read: None,
            silent: false,
        };
        self.post_on(idx, hdr, src, inflight)?;
        Ok(PostOutcome::Posted)
    }

    /// Queues the request `hdr` (its `wr_id` set) with the payload `src` (a range of a
    /// local region the caller checked) on connection `idx`, which has room for it.
    fn post_on(
        &mut self,
        idx: usize,
        mut hdr: Header,
        src: &LocalSlice,
        inflight: Inflight,
    ) -> Result<()> {
        let op = inflight.op;
        let r = self
            .local
            .get(&src.key)
            .ok_or_else(|| Error::Op(OpError::LocalKeyInvalid(src.key)))?;
        let c = self.conns[idx].as_mut().expect("peer conns are open");
        // A WRITE from host memory: its batch frame holds the region (one reference count
        // per region and frame, not per WRITE).
        if op == OpKind::Write
            && !self.cfg.checksum
            && let Some(at) = io::At::of(&*r.mem, src.offset, src.len)
        {
            c.post_write_kept(hdr, &r.mem, at, src.len as usize, inflight);
            return Ok(());
        }
        let payload = if r.mem.host_ptr().is_some() {
            Payload::Region {
                mem: r.mem.clone(),
                offset: src.offset,
                len: src.len as usize,
            }
        } else {
            // Copied into the connection's staging ring as it has room, sent from there.
            Payload::Device {
                mem: r.mem.clone(),
                offset: src.offset,
                len: src.len as usize,
                via: r.via.clone(),
                staged: None,
                assigned: 0,
            }
        };
        let trailer = match &payload {
            Payload::Region { mem, offset, len } if op == OpKind::Write && self.cfg.checksum => {
                hdr.flags |= frame::FLAG_CRC;
                if self.scratch.is_empty() {
                    self.scratch = vec![0u8; 64 << 10];
                }
                let crc = io::checksum(&hdr.encode(), &**mem, *offset, *len, &mut self.scratch)
                    .map_err(Error::Memory)?;
                Some(crc.to_le_bytes())
            }
            _ => None,
        };
        // A SEND may wait for credit from the peer (see conn::credit).
        c.post(hdr, payload, inflight);
        if let Some(t) = trailer {
            c.queue_trailer(t);
        }
        Ok(())
    }

    /// The largest message `op` may carry: checksummed WRITEs are held whole by the target.
    fn max_msg(&self, op: OpKind) -> u64 {
        if op == OpKind::Write && self.cfg.checksum {
            self.cfg.max_msg_size.min(frame::CHECKSUM_MAX_LEN)
        } else {
            self.cfg.max_msg_size
        }
    }

    fn accept_new(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, from)) => {
                    if self.conns.iter().flatten().count() >= self.cfg.max_connections {
                        tracing::warn!(%from, limit = self.cfg.max_connections, "refusing connection: too many open");
                        continue;
                    }
                    let sock = Socket::from(stream);
                    if let Err(e) = self.setup_socket(&sock, from.ip()) {
                        tracing::warn!(%from, error = %e, "dropping new connection");
                        continue;
                    }
                    // A fresh nonce for every connection: a HELLO recorded on another one
                    // does not prove the token here. No weaker source stands in for the
                    // system's.
                    let nonce = match auth::Nonce::new() {
                        Ok(n) => n,
                        Err(e) => {
                            tracing::warn!(%from, error = %report(&e), "dropping new connection");
                            continue;
                        }
                    };
                    // The peer id is settled by the HELLO; until then the conn has none.
                    let token = self.token.clone();
                    let announce = self.cfg.announce.unwrap_or(0);
                    self.insert_conn(Conn::challenging(sock.into(), nonce, token, announce));
                    tracing::debug!(%from, "accepted connection, CHALLENGE queued");
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    return;
                }
            }
        }
    }

    /// A connection of an added peer could not be made: the peer is gone (its other
    /// connections too, its requests failed), and `peer_ready` reports why.
    fn fail_connect(&mut self, idx: usize, peer: PeerId, err: OpError) {
        let reason = report(&err);
        if matches!(err, OpError::Transport(_)) {
            tracing::warn!(%peer, %reason, "connection refused");
        } else {
            tracing::debug!(%peer, %reason, "connection failed");
        }
        self.close_conn(idx, err.clone());
        if let Some(p) = self.peers.remove(&peer) {
            for i in p.conns {
                self.close_conn(i, err.clone());
            }
        }
        self.shared.stats.peer_closed(peer, Some(reason));
        self.failed_connects.insert(peer, err);
    }

    /// A connection of `peer` we opened is up (connected, and the target's PROOF in):
    /// the peer is connected once all are.
    fn note_connected(&mut self, peer: PeerId) {
        let Some(p) = self.peers.get(&peer) else {
            return;
        };
        let up = p
            .conns
            .iter()
            .filter(|&&i| {
                self.conns
                    .get(i)
                    .and_then(Option::as_ref)
                    .is_some_and(Conn::is_up)
            })
            .count();
        let state = if up == p.conns.len() {
            PeerState::Connected
        } else {
            PeerState::Connecting
        };
        self.shared.stats.peer_state(peer, state, up);
    }

    fn on_hello(&mut self, idx: usize, rail: u32, instance: u64, address: Vec<u8>) {
        let id = match self.passive.get(&instance) {
            Some(&id) => id,
            None => {
                let id = PeerId(self.next_peer);
                self.next_peer += 1;
                self.passive.insert(instance, id);
                self.peers.insert(
                    id,
                    Peer {
                        address: address.clone(),
                        conns: Vec::new(),
                        next: 0,
                        passive: true,
                    },
                );
                self.shared.stats.peer_added(
                    id,
                    String::from_utf8_lossy(&address).into_owned(),
                    true,
                );
                id
            }
        };
        if let Some(p) = self.peers.get_mut(&id) {
            p.conns.push(idx);
            self.shared
                .stats
                .peer_state(id, PeerState::Connected, p.conns.len());
        }
        if let Some(c) = self.conns[idx].as_mut() {
            c.peer = id;
        }
        tracing::debug!(peer = %id, rail, address = %String::from_utf8_lossy(&address), "peer connected");
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn address(&self) -> Vec<u8> {
        self.address.clone()
    }

    fn limits(&self) -> TransportLimits {
        TransportLimits {
            max_msg_size: self.max_msg(OpKind::Write).min(self.cfg.max_msg_size),
            max_outstanding: self.cfg.max_outstanding,
            write_imm: true,
            busy_poll: false,
            strided_writes: true,
        }
    }

    fn add_peer(&mut self, address: &[u8]) -> Result<PeerId> {
        let to = Self::parse_address(address)?;
        let id = PeerId(self.next_peer);
        let mut conns = Vec::with_capacity(self.cfg.rails);
        for rail in 0..self.cfg.rails {
            let stream = match self.connect(to, id) {
                Ok(s) => s,
                Err(e) => {
                    for idx in conns {
                        self.conns[idx] = None;
                    }
                    return Err(e);
                }
            };
            let mut hello = Vec::with_capacity(12 + self.address.len());
            hello.extend_from_slice(&(rail as u32).to_le_bytes());
            hello.extend_from_slice(&self.instance.to_le_bytes());
            hello.extend_from_slice(&self.address);
            // The HELLO (and every request posted meanwhile) leaves once the target's
            // CHALLENGE is in: connecting, then the CHALLENGE, each within peer_timeout.
            let mut c = Conn::initiating(stream, id, hello, self.token.clone());
            c.connecting = Some(std::time::Instant::now() + self.cfg.peer_timeout);
            conns.push(self.insert_conn(c));
        }
        self.next_peer += 1;
        self.shared
            .stats
            .peer_added(id, String::from_utf8_lossy(address).into_owned(), false);
        self.peers.insert(
            id,
            Peer {
                address: address.to_vec(),
                conns,
                next: 0,
                passive: false,
            },
        );
        tracing::debug!(peer = %id, %to, rails = self.cfg.rails, "peer added");
        Ok(id)
    }

    fn peer_ready(&mut self, peer: PeerId) -> Result<bool> {
        if let Some(err) = self.failed_connects.remove(&peer) {
            return Err(Error::Op(err));
        }
        let p = self.peers.get(&peer).ok_or(Error::UnknownPeer(peer))?;
        Ok(p.conns
            .iter()
            .all(|&i| self.conns[i].as_ref().is_some_and(Conn::is_up)))
    }

    /// The address a peer connected to (ours), or the one it said in its HELLO (a peer
    /// that connected to us): its listening address either way.
    fn peer_address(&self, peer: PeerId) -> Option<Vec<u8>> {
        self.peers.get(&peer).map(|p| p.address.clone())
    }

    fn peer_instance(&self, peer: PeerId) -> Option<u64> {
        let p = self.peers.get(&peer)?;
        p.conns
            .iter()
            .find_map(|&i| self.conns.get(i)?.as_ref()?.announced)
    }

    fn remove_peer(&mut self, peer: PeerId) -> Result<()> {
        let p = self.peers.remove(&peer).ok_or(Error::UnknownPeer(peer))?;
        self.passive.retain(|_, id| *id != peer);
        for idx in p.conns {
            self.close_conn(idx, OpError::PeerRemoved(peer));
        }
        self.shared.stats.peer_closed(peer, None);
        tracing::debug!(%peer, address = %String::from_utf8_lossy(&p.address), "peer removed");
        Ok(())
    }

    fn register(&mut self, mem: Arc<dyn MemoryRegion>, access: Access) -> Result<Registration> {
        // This registration's own count, not shared with other rails' transports.
        let mem = held::Held::wrap(mem);
        let rkey = RemoteKey::random(|k| self.shared.targets.contains_key(&k)).0;
        let local = LocalKey(self.next_local);
        self.next_local += 1;
        let len = mem.len() as u64;
        let via = if mem.host_ptr().is_some() {
            Via::Region // never staged
        } else {
            let via = self.cuda.via_for(&*mem);
            tracing::debug!(location = ?mem.location(), len, ?via, "device memory registered: copied through staging");
            via
        };
        self.shared.targets.insert(
            rkey,
            TargetRegion {
                mem: mem.clone(),
                access,
                via: via.clone(),
            },
        );
        self.local.insert(
            local,
            LocalRegion {
                mem,
                access,
                rkey,
                via,
            },
        );
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
        let r = self
            .local
            .remove(&key)
            .ok_or(Error::Op(OpError::LocalKeyInvalid(key)))?;
        self.shared.targets.remove(&r.rkey);
        Ok(())
    }

    fn post_send(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        let mut h = Header::new(Op::Send, src.len);
        if let Some(v) = imm {
            h.flags = FLAG_IMM;
            h.imm = v;
        }
        self.post_request(peer, true, h, &src, OpKind::Send, wr_id)
    }

    fn post_recv(&mut self, wr_id: WorkRequestId, dst: LocalSlice) -> Result<PostOutcome> {
        let r = self.local_region(&dst)?;
        if !r.access.contains(Access::LOCAL_WRITE) {
            return Err(Invalid::NotLocallyWritable {
                what: "a received message".into(),
            }
            .into());
        }
        let recv = PostedRecv {
            wr_id,
            mem: r.mem.clone(),
            offset: dst.offset,
            cap: dst.len,
        };
        self.shared.post_recv(recv);
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
        fabric_core::check_write_lengths(&src, &dst)?;
        let mut h = Header::new(Op::Write, src.len);
        h.key = dst.region.key.0;
        h.offset = dst.offset;
        if let Some(v) = imm {
            h.flags = FLAG_IMM;
            h.imm = v;
        }
        self.post_request(peer, false, h, &src, OpKind::Write, wr_id)
    }

    /// A strided WRITE: host rows that land contiguously go as one WRITE whose payload is
    /// gathered from the rows (the target sees a plain WRITE: one header, one answer, rows
    /// of a few hundred bytes at the cost of one frame); otherwise each row is a WRITE frame
    /// of its own on one connection, only the last of them answered to the engine (with any
    /// failure of an earlier one) and carrying the immediate data.
    fn post_write_rows(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        dst: RemoteSlice,
        rows: Rows,
        imm: Option<u32>,
    ) -> Result<PostOutcome> {
        fabric_core::check_write_lengths(&src, &dst)?;
        let (src_span, dst_span, bytes) = rows.check(src.len)?;
        // Rows sent as frames of their own are checked by the target one by one: a write
        // that leaves the peer's region (as its descriptor says) fails whole, here, before
        // any row lands.
        if dst
            .offset
            .checked_add(dst_span)
            .is_none_or(|end| end > dst.region.len)
        {
            self.shared.completions.push(Completion {
                wr_id,
                op: OpKind::Write,
                result: Err(OpError::OutOfBounds {
                    offset: dst.offset,
                    len: dst_span,
                    region_len: dst.region.len,
                }),
                peer: Some(peer),
                imm: None,
            });
            return Ok(PostOutcome::Posted);
        }
        let r = self
            .local
            .get(&src.key)
            .ok_or_else(|| Error::Op(OpError::LocalKeyInvalid(src.key)))?;
        check_range(src.offset, src_span, r.mem.len() as u64).map_err(Error::Memory)?;
        let limit = self.max_msg(OpKind::Write);
        if src.len > limit {
            return Err(Invalid::TooLarge {
                op: "WRITE",
                len: src.len,
                limit,
                setting: "TcpConfig::max_msg_size",
            }
            .into());
        }
        let row = |i: u64| src.offset + i * rows.src_stride;
        // Rows of host memory that land contiguously: one WRITE, gathered.
        let gathered: Option<Vec<io::At>> =
            if rows.dst_stride == src.len && bytes <= limit && !self.cfg.checksum {
                (0..rows.count)
                    .map(|i| io::At::of(&*r.mem, row(i), src.len))
                    .collect()
            } else {
                None
            };
        let idx = pick_conn(&mut self.peers, peer, false)?;
        let c = self.conns[idx].as_mut().expect("peer conns are open");
        let frames = if gathered.is_some() { 1 } else { rows.count };
        // Room for every frame, or none posted (a write is never half queued); a write of
        // more rows than the limit goes alone.
        if c.outstanding() > 0
            && (c.outstanding() as u64 + frames > self.cfg.max_outstanding as u64
                || c.queued_bytes() >= self.cfg.max_queued_bytes)
        {
            return Ok(PostOutcome::NoRoom);
        }
        let header = |offset: u64, len: u64, last: bool| {
            let mut h = Header::new(Op::Write, len);
            h.key = dst.region.key.0;
            h.offset = offset;
            h.wr_id = wr_id.0;
            if let (true, Some(v)) = (last, imm) {
                h.flags = FLAG_IMM;
                h.imm = v;
            }
            h
        };
        if let Some(ats) = gathered {
            let inflight = Inflight {
                wr_id,
                op: OpKind::Write,
                len: bytes,
                read: None,
                silent: false,
            };
            let h = header(dst.offset, bytes, true);
            c.post_write_kept_rows(h, &r.mem, ats, src.len as usize, inflight);
            return Ok(PostOutcome::Posted);
        }
        for i in 0..rows.count {
            let last = i + 1 == rows.count;
            let inflight = Inflight {
                wr_id,
                op: OpKind::Write,
                len: if last { bytes } else { src.len },
                read: None,
                silent: !last,
            };
            let h = header(dst.offset + i * rows.dst_stride, src.len, last);
            let piece = LocalSlice {
                key: src.key,
                offset: row(i),
                len: src.len,
            };
            self.post_on(idx, h, &piece, inflight)?;
        }
        Ok(PostOutcome::Posted)
    }

    /// A READ request leaves at once (no payload); the owner's transport validates it and
    /// sends the bytes straight from its registered region, and they are placed straight
    /// into `dst` (device memory through the connection's staging ring). Peers that
    /// connected to us with protocol version 2 have no READ: refused here.
    fn post_read(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        dst: LocalSlice,
        src: RemoteSlice,
    ) -> Result<PostOutcome> {
        fabric_core::check_read_lengths(&dst, &src)?;
        if dst.len > self.cfg.max_msg_size {
            return Err(Invalid::TooLarge {
                op: "READ",
                len: dst.len,
                limit: self.cfg.max_msg_size,
                setting: "TcpConfig::max_msg_size",
            }
            .into());
        }
        let r = self.local_region(&dst)?;
        if !r.access.contains(Access::LOCAL_WRITE) {
            return Err(Invalid::NotLocallyWritable {
                what: "a READ".into(),
            }
            .into());
        }
        let into = ReadInto {
            mem: r.mem.clone(),
            offset: dst.offset,
            via: r.via.clone(),
        };
        let idx = pick_conn(&mut self.peers, peer, false)?;
        let c = self.conns[idx].as_mut().expect("peer conns are open");
        if let Some(v) = c.version_without_read() {
            return Err(Error::Unsupported(format!(
                "{peer} speaks TCP protocol version {v}, which has no READ (version {} has)",
                frame::READ_VERSION
            )));
        }
        if c.outstanding() >= self.cfg.max_outstanding
            || c.queued_bytes() >= self.cfg.max_queued_bytes
        {
            return Ok(PostOutcome::NoRoom);
        }
        let mut h = Header::new(Op::Read, dst.len);
        h.key = src.region.key.0;
        h.offset = src.offset;
        h.wr_id = wr_id.0;
        c.post(
            h,
            Payload::None,
            Inflight {
                wr_id,
                op: OpKind::Read,
                len: dst.len,
                read: Some(into),
                silent: false,
            },
        );
        Ok(PostOutcome::Posted)
    }

    fn supports_read(&self) -> bool {
        true
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        let now = Instant::now();
        if std::mem::take(&mut self.listener_ready) || now >= self.next_accept {
            self.next_accept = now + ACCEPT_EVERY;
            self.accept_new();
        }
        let mut connected = Vec::new();
        for idx in 0..self.conns.len() {
            let Some(c) = self.conns[idx].as_mut() else {
                continue;
            };
            if let Some(deadline) = c.connecting {
                match io::connect_outcome(&c.stream) {
                    // Up once the target's CHALLENGE is in (read below).
                    Ok(true) => c.made(std::time::Instant::now(), self.cfg.peer_timeout),
                    Ok(false) if std::time::Instant::now() < deadline => continue,
                    Ok(false) => {
                        let (peer, reason) = (
                            c.peer,
                            report(&TcpError::ConnectTimedOut(self.cfg.peer_timeout)),
                        );
                        self.fail_connect(idx, peer, OpError::PeerUnreachable { peer, reason });
                        continue;
                    }
                    Err(e) => {
                        let (peer, reason) = (c.peer, report(&TcpError::Connect(e)));
                        self.fail_connect(idx, peer, OpError::PeerUnreachable { peer, reason });
                        continue;
                    }
                }
            }
            // A connection we opened, still in its handshake: it fails as a connection that
            // could not be made would (`peer_ready` reports it), and is up once done.
            let handshaking = c.opening();
            let mut res = c
                .progress_copies(&mut self.shared)
                .and_then(|_| c.flush(&mut self.shared))
                .map(|_| ReadOutcome::Open);
            if c.awaiting_hello() && c.opened.elapsed() > self.cfg.peer_timeout {
                res = Err(TcpError::NoHello(self.cfg.peer_timeout));
            }
            if res.is_ok() {
                res = c.read(&mut self.shared, 8 << 20);
            }
            if let Ok(ReadOutcome::Hello {
                rail,
                instance,
                address,
            }) = res
            {
                self.on_hello(idx, rail, instance, address);
                // The frames that came with the HELLO, now that the peer has its id.
                res = match self.conns[idx].as_mut() {
                    Some(c) => c.read(&mut self.shared, 8 << 20),
                    None => Ok(ReadOutcome::Open),
                };
                if let Ok(ReadOutcome::Hello { .. }) = res {
                    // A second HELLO is refused before it completes (`UnexpectedHello`).
                    res = Ok(ReadOutcome::Open);
                }
            }
            let c = self.conns[idx].as_mut().expect("still open");
            // Checked once what came has been read: a CHALLENGE or PROOF that is in counts.
            if res.is_ok() {
                res = c
                    .check_handshake(std::time::Instant::now(), self.cfg.peer_timeout)
                    .map(|_| ReadOutcome::Open);
            }
            if res.is_ok() {
                // Credit that came in lets waiting SENDs go; those that waited too long fail.
                c.release_sends(self.cfg.liveness_timeout, &mut self.shared);
                res = c.flush(&mut self.shared).map(|_| ReadOutcome::Open);
            }
            // A refusal fails the connection as soon as its untagged HELLO has left.
            if res.is_ok() && handshaking {
                res = c
                    .check_handshake(std::time::Instant::now(), self.cfg.peer_timeout)
                    .map(|_| ReadOutcome::Open);
            }
            // A connection we do not read from cannot see its end by reading: ask the kernel.
            if res.is_ok() && c.reads_paused() && io::peer_hung_up(c.stream.as_raw_fd()) {
                res = Err(TcpError::PeerClosedWhileHeld);
            }
            // A peer whose kernel takes our bytes but whose transport never answers (a
            // stopped process, a hung peer) fails its requests after `liveness_timeout`, so
            // that nothing waits on it for ever (TCP's own timers see a healthy socket).
            if res.is_ok() {
                res = c
                    .check_answers(self.cfg.liveness_timeout)
                    .map(|_| ReadOutcome::Open);
            }
            if let Err(err) = res {
                // A connection heading for a refusal fails with it, whatever came first.
                let err = c.take_refusal().unwrap_or(err);
                let (peer, reason) = (c.peer, report(&err));
                if handshaking {
                    // A refused authentication is the cause itself (typed, not retryable).
                    let why = if err.is_authentication() {
                        OpError::transport(err)
                    } else {
                        OpError::PeerUnreachable {
                            peer,
                            reason: reason.clone(),
                        }
                    };
                    self.fail_connect(idx, peer, why);
                    continue;
                }
                if c.awaiting_hello() {
                    c.tell_refusal();
                    tracing::warn!(%reason, "closing connection before HELLO");
                    if err.is_authentication() {
                        if self.auth_refusals.len() == MAX_AUTH_REFUSALS {
                            self.auth_refusals.pop_front();
                        }
                        self.auth_refusals.push_back(err);
                    }
                } else if c.inflight.is_empty() && c.out.is_empty() {
                    tracing::debug!(%peer, %reason, "connection closed with nothing pending");
                } else {
                    tracing::warn!(%peer, %reason, pending = c.inflight.len(), "closing connection");
                }
                self.close_conn(idx, OpError::PeerUnreachable { peer, reason });
            } else if handshaking && !c.opening() {
                connected.push(c.peer);
            }
        }
        for peer in connected {
            self.note_connected(peer);
        }
        let n = self.shared.completions.len();
        if out.is_empty() {
            // The caller's empty buffer for ours: the completions are not copied.
            std::mem::swap(out, &mut self.shared.completions);
        } else {
            out.append(&mut self.shared.completions);
        }
        Ok(n)
    }

    fn wait(&mut self, timeout: Duration) -> Result<()> {
        if !self.shared.completions.is_empty() {
            return Ok(());
        }
        // Copies in flight complete without a socket event: poll again soon. Spinning on
        // the driver's event queries from every rail's thread contends on the context's
        // locks, so nap up to `copy_nap` on the sockets instead (0: spin).
        let copying = self.conns.iter().flatten().any(Conn::copies_pending);
        let nap = self.cfg.copy_nap;
        if copying && nap.is_zero() {
            return Ok(());
        }

        self.pollfds.clear();
        self.pollfds.push(libc::pollfd {
            fd: self.wake.fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        self.pollfds.push(libc::pollfd {
            fd: self.listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        for c in self.conns.iter().flatten() {
            let mut events = 0;
            if c.reads_paused() {
                events |= libc::POLLRDHUP;
            } else {
                events |= libc::POLLIN;
            }
            // Writable also says that a connection we opened is made; nothing leaves before
            // the CHALLENGE has come, and only the HELLO before the PROOF.
            if c.connecting.is_some() || c.wants_write() {
                events |= libc::POLLOUT;
            }
            self.pollfds.push(libc::pollfd {
                fd: c.stream.as_raw_fd(),
                events,
                revents: 0,
            });
        }
        // Exactly the time asked for (ppoll has microsecond resolution): the engine wakes
        // us through `wake` when it has work, so long idle waits cost nothing.
        let limit = if copying { nap.min(timeout) } else { timeout };
        io::ppoll_fds(&mut self.pollfds, limit).map_err(|e| Error::io("poll", e))?;
        if self.pollfds[0].revents != 0 {
            self.wake.drain();
        }
        self.listener_ready |= self.pollfds[1].revents != 0;
        Ok(())
    }

    fn waker(&mut self) -> Arc<dyn Wake> {
        self.wake.waker()
    }

    /// Counted as it happens: bytes peers' WRITEs placed in our regions, READs served,
    /// requests refused, checksums that did not match, and every peer (added or connected
    /// to us) with its state and the error that closed its last connection to fail.
    fn stats(&mut self) -> Option<Arc<TransportStats>> {
        Some(self.shared.stats.clone())
    }
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("address", &String::from_utf8_lossy(&self.address))
            .field("peers", &self.peers.len())
            .field("regions", &self.local.len())
            .finish()
    }
}

/// The connection of `peer` that the next request takes: its first for `first` (SENDs keep
/// their order on one connection), else the next in turn.
fn pick_conn(peers: &mut FastMap<PeerId, Peer>, peer: PeerId, first: bool) -> Result<usize> {
    // Built only when missing (`ok_or` made and dropped an error on every post).
    let p = peers
        .get_mut(&peer)
        .ok_or_else(|| Error::UnknownPeer(peer))?;
    if p.conns.is_empty() {
        return Err(Error::Op(OpError::PeerUnreachable {
            peer,
            reason: "no open connection".into(),
        }));
    }
    if first {
        return Ok(p.conns[0]);
    }
    // In turn, kept below the count (connections come and go) without a division per post.
    if p.next >= p.conns.len() {
        p.next = 0;
    }
    let i = p.next;
    p.next += 1;
    Ok(p.conns[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_conns(t: &TcpTransport) -> usize {
        t.conns.iter().flatten().count()
    }

    /// WRITEs waiting to be sent hold their region through the transport's own handle: the
    /// caller's `Arc` is not cloned per page (nor per frame). They hold it until written,
    /// even when it is deregistered and dropped meanwhile.
    #[test]
    fn queued_writes_leave_the_callers_count_alone() {
        // One WRITE (a frame of its own) and a batch of them.
        queued_writes_hold_their_source(1);
        queued_writes_hold_their_source(16);
    }

    /// Posts `writes` WRITEs of 4 KiB from `s` to the same offsets of `d` (page `i` at
    /// `i * 4096`); returns how many the transport took.
    fn post_pages(
        a: &mut TcpTransport,
        peer: PeerId,
        (s, d): (&Registration, &Registration),
        writes: u64,
    ) -> usize {
        let mut posted = 0;
        for i in 0..writes {
            let local = LocalSlice {
                key: s.local,
                offset: i * 4096,
                len: 4096,
            };
            let remote = RemoteSlice {
                region: d.remote,
                offset: i * 4096,
                len: 4096,
            };
            let out = a.post_write(peer, WorkRequestId(i), local, remote, None);
            posted += usize::from(out.unwrap() == PostOutcome::Posted);
        }
        posted
    }

    /// Polls both ends until `a` has `n` completions (within 30 s), and returns them.
    fn poll_until_done(a: &mut TcpTransport, b: &mut TcpTransport, n: usize) -> Vec<Completion> {
        let (mut done, mut ignored) = (Vec::new(), Vec::new());
        let deadline = Instant::now() + Duration::from_secs(30);
        while done.len() < n {
            assert!(Instant::now() < deadline, "WRITEs never completed");
            a.poll(&mut done).unwrap();
            b.poll(&mut ignored).unwrap();
        }
        done
    }

    fn queued_writes_hold_their_source(writes: u64) {
        let mut a = TcpTransport::new(TcpConfig::default()).unwrap();
        let mut b = TcpTransport::new(TcpConfig::default()).unwrap();
        let src = fabric_core::HostBuffer::new_shared(1 << 16).unwrap();
        src.fill(0, 1 << 16, 9).unwrap();
        let dst = fabric_core::HostBuffer::new_shared(1 << 16).unwrap();
        let s = a.register(src.clone(), Access::NONE).unwrap();
        let d = b.register(dst.clone(), Access::REMOTE_WRITE).unwrap();
        let registered = Arc::strong_count(&src);
        let peer = a.add_peer(&b.address()).unwrap();
        let posted = post_pages(&mut a, peer, (&s, &d), writes);
        assert!(posted > 0, "no WRITE was taken");
        assert_eq!(Arc::strong_count(&src), registered);
        // Deregistered and dropped by the caller while queued: the frames still hold the
        // bytes they send, and let go of them once written.
        a.deregister(s.local).unwrap();
        let weak = Arc::downgrade(&src);
        drop(src);
        assert!(
            weak.upgrade().is_some(),
            "queued WRITEs no longer hold their source"
        );
        let done = poll_until_done(&mut a, &mut b, posted);
        assert!(done.iter().all(|c| c.result == Ok(4096)));
        assert_eq!(
            dst.to_vec(0, 4096 * posted).unwrap(),
            vec![9; 4096 * posted]
        );
        assert!(
            weak.upgrade().is_none(),
            "the source is held after its WRITEs completed"
        );
    }

    /// The algorithms a transport's open connections run.
    fn algorithms(t: &TcpTransport) -> Vec<String> {
        t.conns
            .iter()
            .flatten()
            .map(|c| Congestion::algorithm(&c.stream).unwrap())
            .collect()
    }

    /// Two transports of `congestion`, connected (a WRITE has landed), with their
    /// connections' algorithms, initiator's then target's.
    fn connected_with(congestion: Congestion) -> (Vec<String>, Vec<String>) {
        let cfg = TcpConfig {
            congestion,
            rails: 2,
            ..TcpConfig::default()
        };
        let mut a = TcpTransport::new(cfg.clone()).unwrap();
        let mut b = TcpTransport::new(cfg).unwrap();
        let src = fabric_core::HostBuffer::new_shared(2 * 4096).unwrap();
        let dst = fabric_core::HostBuffer::new_shared(2 * 4096).unwrap();
        let s = a.register(src, Access::NONE).unwrap();
        let d = b.register(dst, Access::REMOTE_WRITE).unwrap();
        let peer = a.add_peer(&b.address()).unwrap();
        // Two WRITEs, one on each rail's connection.
        assert_eq!(
            post_pages(&mut a, peer, (&s, &d), 2),
            2,
            "a WRITE was refused"
        );
        poll_until_done(&mut a, &mut b, 2);
        (algorithms(&a), algorithms(&b))
    }

    /// Loopback connections of both ends are off BBR by default (the kernels here default
    /// to it), a named algorithm is set on both ends, and one the kernel refuses stops the
    /// transport from starting, naming it.
    #[test]
    fn connections_run_the_configured_congestion_control() {
        let (a, b) = connected_with(Congestion::Auto);
        assert!(a.len() == 2 && b.len() == 2, "{a:?} {b:?}");
        assert!(
            a.iter().chain(&b).all(|n| !n.starts_with("bbr")),
            "loopback connections on BBR: {a:?} {b:?}"
        );
        let (a, b) = connected_with(Congestion::Named("reno".into()));
        assert!(a.iter().chain(&b).all(|n| n == "reno"), "{a:?} {b:?}");
        let Err(err) = TcpTransport::new(TcpConfig {
            congestion: Congestion::Named("no_such_algo".into()),
            ..TcpConfig::default()
        }) else {
            panic!("an unknown algorithm was accepted");
        };
        assert!(err.to_string().contains("no_such_algo"), "{err}");
    }

    /// A busy poll loop does not look for connections on every turn, yet a connection is
    /// taken at once after a `wait` has seen it coming, and at the latest `ACCEPT_EVERY`
    /// after the last look.
    #[test]
    fn poll_accepts_when_a_wait_saw_the_listener_or_when_due() {
        let mut t = TcpTransport::new(TcpConfig::default()).unwrap();
        let mut out = Vec::new();
        t.poll(&mut out).unwrap();
        // Not due for an hour: a connection that arrives now waits.
        t.next_accept = Instant::now() + Duration::from_secs(3600);
        let _c1 = TcpStream::connect(t.local_addr()).unwrap();
        t.poll(&mut out).unwrap();
        assert_eq!(open_conns(&t), 0, "accepted on a poll that was not due");
        // The wait sees the listener readable (the connection is queued on it): taken.
        t.wait(Duration::from_secs(10)).unwrap();
        assert!(t.listener_ready);
        t.poll(&mut out).unwrap();
        assert_eq!(open_conns(&t), 1);
        // Due: taken without a wait.
        let _c2 = TcpStream::connect(t.local_addr()).unwrap();
        // The kernel completes the handshake on its own; poll until it is queued.
        let deadline = Instant::now() + Duration::from_secs(10);
        while open_conns(&t) < 2 {
            assert!(
                Instant::now() < deadline,
                "the due poll never took the connection"
            );
            t.next_accept = Instant::now();
            t.poll(&mut out).unwrap();
        }
    }
}
