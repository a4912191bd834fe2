//! # transport-efa
//!
//! The [`Transport`](fabric_core::Transport) of `xfer` over libfabric: one reliable
//! datagram endpoint (FI_EP_RDM) with FI_MSG | FI_RMA per [`EfaTransport`]. On AWS p5 the
//! provider is `efa`; everywhere else the same code runs over libfabric's software
//! providers (`tcp`, `sockets`, `shm`), which is how CI exercises it.
//!
//! - SEND/RECV (`fi_sendmsg` / `fi_recvmsg`) carry control messages, with immediate data
//!   as remote CQ data;
//! - WRITE is `fi_writemsg`; with immediate data (FI_REMOTE_CQ_DATA) the target sees an
//!   [`OpKind::RemoteWrite`](fabric_core::OpKind::RemoteWrite) completion carrying it,
//!   with no receive posted;
//! - every operation asks for FI_DELIVERY_COMPLETE, so a WRITE's completion means the
//!   bytes are in the target's memory, with every provider (see
//!   [Completions](self#completions-what-a-write-completion-means)), and SEND/RECV keep
//!   their order (FI_ORDER_SAS);
//! - registration honours the provider's `mr_mode` (see [`mr`](self#memory-registration));
//! - `-FI_EAGAIN` is [`PostOutcome::NoRoom`](fabric_core::PostOutcome::NoRoom), except
//!   while a new peer's connection comes up (see [`EfaTransport`]);
//! - progress happens in [`poll`](fabric_core::Transport::poll), which reads the CQ and its
//!   error queue, and in [`wait`](fabric_core::Transport::wait), which sleeps on the CQ's
//!   descriptor where the provider gives one: a target must keep polling or waiting (see
//!   [Progress](self#progress)).
//!
//! `rustc-hash` gives the maps looked up once or more per operation (registrations by
//! local key, peers by id: integers this process chose) FxHash instead of SipHash, which
//! took a sixth of the worker's time for 64-byte writes over shm.
//!
//! ```no_run
//! use fabric_core::{Access, HostBuffer, LocalSlice, RemoteSlice, Transport, WorkRequestId};
//! use transport_efa::{EfaConfig, EfaTransport};
//!
//! let cfg = EfaConfig::with_provider("tcp").domain("lo");
//! let mut a = EfaTransport::new(&cfg)?;
//! let mut b = EfaTransport::new(&cfg)?;
//! let peer = a.add_peer(&b.address())?;
//! let src = a.register(HostBuffer::new_shared(4096)?, Access::NONE)?;
//! let dst = b.register(HostBuffer::new_shared(4096)?, Access::REMOTE_WRITE)?;
//! let slice = LocalSlice { key: src.local, offset: 0, len: 4096 };
//! let remote = RemoteSlice { region: dst.remote, offset: 0, len: 4096 };
//! while a.post_write(peer, WorkRequestId(1), slice, remote, Some(7))?.eq(&fabric_core::PostOutcome::NoRoom) {
//!     a.poll(&mut Vec::new())?;
//! }
//! let (mut done_a, mut done_b) = (Vec::new(), Vec::new());
//! while done_a.is_empty() || done_b.is_empty() {
//!     a.poll(&mut done_a)?; // drives the write
//!     b.poll(&mut done_b)?; // the target must poll too: its completion carries imm 7
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Addresses
//! [`EfaTransport::address`](fabric_core::Transport::address) is `b"efa1"`, the provider
//! name (length-prefixed) and the raw `fi_getname` bytes (see [`ADDRESS_TAG`]): an address
//! of another transport or another provider is rejected with a clear
//! [`Error::InvalidAddress`](fabric_core::Error::InvalidAddress).
//!
//! ## Memory registration
//! FI_MR_PROV_KEY (else requested keys, random within the provider's `mr_key_size` and
//! drawn again while taken, so that a peer cannot guess the key of a region it was not
//! given, as it could a counter's), FI_MR_VIRT_ADDR (else offsets: then
//! [`RemoteRegion::addr`](fabric_core::RemoteRegion::addr) is 0), FI_MR_LOCAL descriptors,
//! FI_MR_ENDPOINT binding (decided in one place from the provider's attributes; p5's `efa`
//! attributes are checked by unit tests). CUDA memory needs [`EfaConfig::hmem`] and a
//! provider with FI_HMEM; a CUDA region on an endpoint without it is refused at `register`,
//! never handed to the provider as host memory (libfabric would quietly treat it as such).
//! It is registered with `fi_mr_regattr` (FI_HMEM_CUDA, FI_HMEM_DEVICE_ONLY: shm then moves
//! it with CUDA IPC instead of bouncing it through host buffers;
//! [`EfaConfig::hmem_device_only`] leaves that flag out), from its dmabuf first (FI_MR_DMABUF) when the library loaded
//! takes API 1.20 and the memory layer exports one, else by address.
//!
//! A registration is closed before its memory may go. Should `fi_close` fail, the
//! registration may still be open (the NIC may still reach the memory), so the memory is
//! kept alive for good instead of being freed under it: logged as an error and counted by
//! [`leaked_registrations`].
//!
//! ## libfabric at run time
//! Nothing links against libfabric: `libfabric-sys` loads it on first use, from
//! `XFER_LIBFABRIC`, then `/opt/amazon/efa`, then the system's (see [`library`]), and asks
//! it for API 1.20 or its own version if older. Its suites run in CI against Debian's 1.17
//! and against 2.6 built from `third_party/libfabric` (`scripts/libfabric-2.6.sh`). 2.x also
//! offers FI_EP_RDM over tcp as provider `tcp` itself besides `tcp;ofi_rxm`; asking for
//! `tcp` takes the native one there (libfabric's first; measured no slower, and faster for
//! small READs), `tcp;ofi_rxm` names rxm.
//!
//! ## Choices, and provider quirks they absorb
//! Checked with libfabric 1.17's `tcp;ofi_rxm`, `sockets` and `shm` (the test files say
//! which conformance options each needs, and why):
//! - one iovec per operation on each side; where the provider takes more
//!   (`iov_limit` and `rma_iov_limit` of 4 on tcp, rxm and shm; efa takes one remote
//!   iovec), up to 4 READs, or 4 WRITEs without immediate data, of host memory to one
//!   peer's region go out as one `fi_readmsg` / `fi_writemsg` with an iovec each
//!   (see [Gathering](self#gathering)); no FI_INJECT (so `inject_size` is never
//!   exceeded); sizes above `max_msg_size` are refused at post time;
//! - hints accept the FI_CONTEXT / FI_CONTEXT2 modes (every operation has a context of
//!   `fi_context2` size that stays put until its completion) but not FI_RX_CQ_DATA:
//!   providers that need a receive per remote CQ data are filtered out by `fi_getinfo`;
//! - tcp (rxm) answers `-FI_EAGAIN` while a new peer's connection comes up: posts wait in
//!   a per-peer backlog (at most `tx_size`) and go out inside `poll`;
//! - tcp closes its connection after any failure at the target (bad key, no permission)
//!   and reports it as FI_ECANCELED; later operations fail with FI_ENOTCONN for ~20 ms
//!   until rxm reconnects. Such never-sent operations are retried for up to 5 s before
//!   they fail with [`PeerUnreachable`](fabric_core::OpError::PeerUnreachable);
//! - sockets drops the FI_REMOTE_CQ_DATA flag on a SEND that arrived before its receive
//!   and leaves stale data in completions without the flag: where CQ data is 8 bytes,
//!   SENDs always carry it, tagged in the upper half, so receives read `imm` right;
//! - a peer's write with immediate data is recognised by FI_REMOTE_CQ_DATA and `data`
//!   alone; its reported length differs between providers (tcp says 0);
//! - shm never completes a zero-length operation that asks for delivery completion:
//!   zero-length operations (nothing to deliver) do not ask for it;
//! - a CQ with a wait descriptor (FI_WAIT_FD) is asked for only where data progress is
//!   manual; a provider that refuses it (shm answers FI_ENOSYS) gets a CQ without one;
//! - completions of received messages and remote writes carry no peer (no FI_SOURCE).
//!
//! ## Completions: what a write completion means
//! A WRITE's completion means *placed*: the bytes are in the target's memory. Every
//! operation that carries data asks for FI_DELIVERY_COMPLETE, with every provider. The
//! engine sends a transfer's immediate value in a zero-length write only once all the
//! transfer's other writes have completed, so the target's
//! [`RemoteWrite`](fabric_core::OpKind::RemoteWrite) completion implies that every byte of
//! the transfer has landed, whether or not the provider orders writes; and a failure at
//! the target (unknown or stale key, no permission) fails the write that caused it.
//!
//! A weaker completion ("sent, and ordered before later writes") for writes without
//! immediate data, with FI_ORDER_WAW | FI_ORDER_RMA_WAW requested, was measured and
//! rejected, provider by provider (libfabric 1.17):
//! - `tcp;ofi_rxm` orders writes (FI_ORDER_WAW, FI_ORDER_RMA_WAW, `max_order_waw_size`
//!   unlimited), but acknowledges a write that asks for FI_TRANSMIT_COMPLETE exactly as one
//!   that asks for FI_DELIVERY_COMPLETE (same speed, same errors). With neither flag (the
//!   provider's default) it completes a write once the socket took it: about 30% faster on
//!   loopback (`fi_raw_bw` example, 64 KiB writes: 9–10.5 Gbps against 6–8), but a failure
//!   at the target is never reported to the initiator: the write "succeeds", the target
//!   drops the connection, and the conformance cases `write_without_permission_fails` and
//!   `write_after_deregister_fails` fail. The later immediate-data write would not tell
//!   either: it fails with FI_ENOTCONN and is sent again once rxm has reconnected.
//! - `sockets` orders writes too; the weaker completion measured no faster.
//! - `shm` reports `max_order_waw_size` 0 (no ordering of writes that carry data), so only
//!   delivery completion makes the immediate value trustworthy. It never completes a
//!   zero-length operation that asks for delivery completion: those ask for none. That
//!   holds with every provider and is safe: a zero-length write places nothing, and the
//!   engine's immediate-data write goes out only after the writes it follows were placed.
//! - `efa` does not order RMA writes (the device's SRD transport is unordered), so
//!   placement must be known before the immediate-data write goes out. What delivery
//!   completion costs there, from the provider's source (libfabric 2.6,
//!   `prov/efa/src/rdm/efa_rdm_rma.c`, `efa_rdm_rma_post_write`): when the write goes out as
//!   the device's RDMA write (API 1.18+, p5's devices, after the handshake with the peer),
//!   the flag is not consulted at all: the same RDMA write is posted and its completion
//!   already means the data is in the target's memory. Only the emulated protocols (no
//!   device RDMA write, or a peer before its handshake) switch to their `DC_` variants
//!   (`DC_EAGER_RTW`, `DC_LONGCTS_RTW`), which wait for a receipt packet from the target: one
//!   more trip, on a path p5 does not take for data.
//!
//! ## Progress
//! tcp and shm have manual data progress: bytes move, at the initiator and at the target,
//! only while someone reads the endpoint's CQ. [`poll`](fabric_core::Transport::poll)
//! reads it. [`wait`](fabric_core::Transport::wait), which an engine calls when it has
//! nothing else to do (a target always), reads it too and then, where the CQ was opened
//! with a wait descriptor (FI_WAIT_FD: tcp), sleeps in `ppoll` on that descriptor until
//! the provider has something to do (a socket readable, or writable again for queued
//! sends), so peers' writes land as they arrive without a spinning thread. Such a transport
//! reports [`busy_poll`](fabric_core::TransportLimits::busy_poll) `false`. Elsewhere (shm
//! offers no descriptor; efa and sockets progress on their own) `wait` naps 50 µs as the
//! trait's default does and `busy_poll` is `true`. shm lands a peer's small writes only
//! inside the target's progress and gives the target no completion for them, so an endpoint
//! over shm also asks for FI_RMA_EVENT and binds a counter of peers' writes: while that
//! count moves (and 200 µs after), `wait` reads the CQ without napping, and naps again once
//! the writes stop. Two processes on the 2-core VM (libfabric 2.6, `xfer bench --transport
//! efa --provider shm --pages 64`, medians of 3): 2.50 against 2.01 M writes/s at 64 B,
//! 2.31 against 1.85 M at 1 KiB, 1.09 against 0.86 M at 4 KiB; about what a target that
//! never naps reaches. [`EfaConfig::idle_nap`] zero makes such a
//! `wait` read the CQ without sleeping (yielding the core) when the provider's progress is
//! manual: shm in one process (`xfer demo`) then moves 25 Gbps instead of 4.6 on the H200
//! (libfabric 2.6), because its target copies a peer's write only inside its own progress;
//! between processes it changed nothing measurable, so it is not the default. A target that only napped held the tcp
//! provider at about 2 Gbps in `xfer demo` (64 KiB pages) where it reaches 6–10 now.
//!
//! ## Gathering
//! Over the software providers every operation costs a request of its own: tcp sends one
//! header (and, for a READ, one reply) per operation, and its per-request cost, not the
//! bytes, bounded 4 KiB pages. So where the provider takes several iovecs per side
//! ([`EfaConfig::max_gather`], capped by `iov_limit` and `rma_iov_limit`), READs and
//! WRITEs without immediate data wait in the peer's backlog until the next
//! [`poll`](fabric_core::Transport::poll) or [`wait`](fabric_core::Transport::wait), which
//! hands them over up to 4 to a call: the pages an engine posts for one transfer share
//! requests and replies. One call carries operations of one direction, one peer and one
//! remote region (key), each of host memory (shm picks its CUDA IPC protocol only for a
//! single iovec); its completion completes each of them, and its failure fails each of
//! them with the provider's error. A failure is per region anyway (a bad or stale key,
//! no permission; ranges are checked against the descriptor before posting), so it fails
//! nothing that would have succeeded alone, except where a descriptor claims more than
//! the owner registered. On efa (one remote iovec) each operation is handed over as it is
//! posted, as before. Measured in docs/benchmarks.md (READ over libfabric's tcp provider).
//!
//! ## Discovery
//! [`info`] lists what each provider offers (for `xfer info`), [`libfabric_version`] the
//! library loaded at run time.
//!
//! ## Threads
//! An [`EfaTransport`] is `Send` but used from one thread at a time (its domain is opened
//! with FI_THREAD_DOMAIN). Construct it in the thread that will poll it. Separate
//! transports in separate threads share nothing.
#![warn(missing_docs)]

mod address;
mod attrs;
mod config;
mod fi;
mod info;
mod local;
mod mr;
mod ops;
mod transport;

pub use address::ADDRESS_TAG;
pub use config::{DEFAULT_PROVIDER, EfaConfig};
pub use fi::FiError;
pub use info::{
    Library, Progress, ProviderInfo, info, libfabric_version, library, requested_api_version,
};
pub use mr::leaked_registrations;
pub use transport::EfaTransport;

/// The maps looked up per operation (see the crate's dependencies above).
type FastMap<K, V> = rustc_hash::FxHashMap<K, V>;
