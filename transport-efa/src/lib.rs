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
//!   bytes are in the target's memory, and SEND/RECV keep their order (FI_ORDER_SAS);
//! - registration honours the provider's `mr_mode` (see [`mr`](self#memory-registration));
//! - `-FI_EAGAIN` is [`PostOutcome::NoRoom`](fabric_core::PostOutcome::NoRoom), except
//!   while a new peer's connection comes up (see [`EfaTransport`]);
//! - progress happens in [`poll`](fabric_core::Transport::poll), which reads the CQ and its
//!   error queue: a target must keep polling (tcp and sockets have manual progress).
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
//! FI_MR_PROV_KEY (else unique requested keys), FI_MR_VIRT_ADDR (else offsets: then
//! [`RemoteRegion::addr`](fabric_core::RemoteRegion::addr) is 0), FI_MR_LOCAL descriptors,
//! FI_MR_ENDPOINT binding. CUDA memory needs [`EfaConfig::hmem`] and a provider with
//! FI_HMEM; it is registered with `fi_mr_regattr` (FI_HMEM_CUDA), from its dmabuf when the
//! libfabric headers have FI_MR_DMABUF (1.20+) and the memory layer exports one.
//!
//! ## Choices, and provider quirks they absorb
//! Checked with libfabric 1.17's `tcp;ofi_rxm`, `sockets` and `shm` (the test files say
//! which conformance options each needs, and why):
//! - one iovec per operation on each side, so `iov_limit` and `rma_iov_limit` are met;
//!   no FI_INJECT (so `inject_size` is never exceeded); sizes above `max_msg_size` are
//!   refused at post time;
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
//! - completions of received messages and remote writes carry no peer (no FI_SOURCE).
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
mod config;
mod fi;
mod info;
mod mr;
mod ops;
mod transport;

pub use address::ADDRESS_TAG;
pub use config::{DEFAULT_PROVIDER, EfaConfig};
pub use fi::FiError;
pub use info::{Progress, ProviderInfo, info, libfabric_version, requested_api_version};
pub use transport::EfaTransport;
