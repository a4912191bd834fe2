//! One TCP connection ("rail"): an outgoing frame queue flushed with vectored writes, and an
//! incoming state machine that validates each request before it touches memory.
//!
//! WRITEs leave in batches (see [`Op::Batch`]): the target reads a batch's headers, checks
//! every one, then reads all payloads straight into their destinations with one `readv`.
//!
//! Memory the CPU cannot address (GPU memory) moves through the connection's staging rings
//! (see `crate::staging`): the source copies device payloads into its out-ring, chunk by
//! chunk, and sends each chunk once its copy has completed, while the next chunk is copied;
//! the target reads device payloads into its in-ring, queues their copies into place at
//! once, and holds back the WRITE's acknowledgement (and its immediate data), with every
//! answer after it, until the copy has completed. Host memory never goes through staging.
//!
//! The connection's pieces, each in its module:
//! - [`handshake`]: the target's CHALLENGE, the initiator's HELLO that answers it, the
//!   check of the HELLO's tag, and the target's PROOF that the initiator checks in turn;
//! - [`send`]: the outgoing frame queue (frames, batching of WRITEs, vectored writes, staging
//!   of device payloads);
//! - [`read`]: the incoming state machine (headers, batches, payloads, HELLO, answers
//!   received);
//! - [`place`]: where incoming bytes land (validation of WRITEs, registered regions, device
//!   memory through staging, posted receives and the early-arrival queue);
//! - [`answer`]: the answers we owe (ACKs, NACKs, READ_REPLYs, held back behind device
//!   copies) and the requests we wait on.
//!
//! READ: the owner validates a READ header like a WRITE's (key, bounds, REMOTE_READ) and
//! owes a READ_REPLY in request order, sent straight from the registered region (device
//! memory through the out-ring); the initiator places the reply's payload like a WRITE's
//! (straight into its region, or through the in-ring into device memory) and reports the
//! READ once every byte is there.

mod answer;
mod credit;
mod handshake;
mod place;
mod read;
mod send;

use crate::error::TcpError;
use crate::frame::{self, HEADER_LEN, Header, MAX_BATCH, Op};
use crate::io::{At, RawIov, copy_to_region};
use crate::staging::{CHUNK, Ring, Via};
use fabric_core::recv::{EarlyArrival, PostedRecv, RecvMatch};
use fabric_core::stats::TransportStats;
use fabric_core::{
    Access, Completion, MemoryRegion, OpError, OpKind, PeerId, RemoteKey, WorkRequestId,
};
use std::collections::VecDeque;
use std::io::Read;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use answer::{Answer, Held};
pub(crate) use answer::{Inflight, ReadInto};
use credit::{Credit, EarlyRoom, Granted, WaitingSend};
use handshake::Handshake;
use place::Finish;
pub(crate) use read::ReadOutcome;
use read::ReadState;

use send::OutFrame;
pub(crate) use send::Payload;

/// Size of the read-ahead buffer of each connection.
const RBUF: usize = 256 * 1024;
/// Bytes read ahead while waiting for a header (small, so that batched payloads are not
/// pulled into the staging buffer and copied again).
const HEADER_READ: usize = 4096;
/// Payloads at least this long are read straight into their destination.
const DIRECT_MIN: u64 = 8 * 1024;
/// Most iovecs handed to one writev / readv.
const MAX_IOV: usize = 1024;
/// Largest HELLO payload.
const MAX_HELLO: u64 = 4096;
/// Size of the buffer that swallows the payloads of rejected requests.
const DISCARD: usize = 64 * 1024;
/// Answers (ACK/NACK frames) queued for a peer before we stop reading its requests.
const MAX_RESPONSES: usize = 4096;

/// A registered region as the target sees it.
pub(crate) struct TargetRegion {
    pub mem: Arc<dyn MemoryRegion>,
    pub access: Access,
    /// How its bytes are copied when it has no host pointer.
    pub via: Via,
}

/// State shared by all connections of a transport, that incoming frames act on.
pub(crate) struct Shared {
    pub targets: crate::FastMap<u64, TargetRegion>,
    /// Posted receives and early arrivals (fabric-core's one matching piece).
    pub recv: RecvMatch,
    /// Room in the early-arrival queue: what is queued, on its way, or granted as credit.
    pub early: EarlyRoom,
    pub max_msg_size: u64,
    pub completions: Vec<Completion>,
    /// What peers did to us (bytes their WRITEs placed, READs served, refusals) and each
    /// peer's state: shared with the engine ([`Transport::stats`](fabric_core::Transport)).
    pub stats: Arc<TransportStats>,
}

pub(crate) struct Conn {
    pub stream: TcpStream,
    pub peer: PeerId,
    /// The incarnation the target announced in its CHALLENGE (a connection we opened), if
    /// it announced one (see [`TcpConfig::announce`](crate::TcpConfig::announce)).
    pub announced: Option<u64>,
    pub out: VecDeque<OutFrame>,
    /// Written batch frames, emptied, whose buffers the next batches reuse (at most
    /// [`SPARE_FRAMES`](send::SPARE_FRAMES)): a batch grows to hundreds of WRITEs, and
    /// growing fresh vectors for every one was a reallocation per doubling.
    spare: Vec<OutFrame>,
    pub out_bytes: usize,
    pub inflight: VecDeque<Inflight>,
    pending_acks: u64,
    /// ACK/NACK frames in `out`.
    responses: usize,
    /// Device payloads in `out` still without room in `out_ring`.
    unstaged: usize,
    /// Staging for device payloads we send, and for device WRITEs we receive.
    out_ring: Option<Ring>,
    in_ring: Option<Ring>,
    /// Answers waiting for copies into device memory, in request order.
    held: VecDeque<Held>,
    rbuf: Box<[u8]>,
    rpos: usize,
    rlen: usize,
    rstate: ReadState,
    /// The CHALLENGE, HELLO and PROOF (see [`handshake`]).
    handshake: Handshake,
    hello: Option<(u32, u64, Vec<u8>)>,
    /// An accepted connection whose HELLO of version 5 was refused: the peer is told so
    /// before the connection closes ([`Conn::tell_refusal`]).
    refused_hello: bool,
    /// When the connection was opened (a peer that never says HELLO is dropped).
    pub opened: std::time::Instant,
    discard: Box<[u8]>,
    /// Requests answered so far (ACK or NACK).
    answered: u64,
    /// The failure of a strided write's silent row (and the write's request id), for the
    /// write's last row to report.
    carried: Option<(WorkRequestId, OpError)>,
    /// Until when a connection we opened may take to connect (`None`: connected, or
    /// accepted).
    pub connecting: Option<std::time::Instant>,
    /// Bytes read from the socket so far (progress of READ replies, for `check_answers`).
    received: u64,
    /// `(answered, out_bytes, received)` as last seen changing, and when: see
    /// `check_answers`.
    unanswered_since: Option<((u64, usize, u64), std::time::Instant)>,
    /// Accepted (the peer opened it), rather than opened by us.
    accepted: bool,
    /// The SEND credit the peer granted us, and the SENDs that wait for it.
    credit: Credit,
    waiting: VecDeque<WaitingSend>,
    waiting_bytes: usize,
    /// The SEND credit we granted the peer (`None`: it does not speak credit, or not yet).
    granted: Option<Granted>,
    /// The protocol version of an accepted connection's HELLO (`None`: not yet, or a
    /// connection we opened, whose peer accepted our version).
    peer_version: Option<u8>,
}

impl Conn {
    /// A connection at the start of `handshake` (see [`Conn::challenging`], [`Conn::initiating`]).
    fn new(stream: TcpStream, peer: PeerId, handshake: Handshake) -> Conn {
        let accepted = matches!(handshake, Handshake::Challenged { .. });
        Conn {
            handshake,
            stream,
            peer,
            announced: None,
            out: VecDeque::new(),
            spare: Vec::new(),
            out_bytes: 0,
            inflight: VecDeque::new(),
            pending_acks: 0,
            responses: 0,
            unstaged: 0,
            out_ring: None,
            in_ring: None,
            held: VecDeque::new(),
            rbuf: vec![0u8; RBUF].into_boxed_slice(),
            rpos: 0,
            rlen: 0,
            rstate: ReadState::Header,
            hello: None,
            refused_hello: false,
            opened: std::time::Instant::now(),
            discard: Vec::new().into_boxed_slice(),
            answered: 0,
            carried: None,
            received: 0,
            unanswered_since: None,
            connecting: None,
            accepted,
            credit: Credit::Unknown,
            waiting: VecDeque::new(),
            waiting_bytes: 0,
            granted: None,
            peer_version: None,
        }
    }

    /// The peer's protocol version if it has no READ (`None`: it has). Every peer that
    /// accepted our HELLO has READ (a target without it refuses our version); a peer that
    /// connected to us has it if its HELLO named a version with READ.
    pub fn version_without_read(&self) -> Option<u8> {
        match self.peer_version {
            Some(v) if v < frame::READ_VERSION => Some(v),
            _ => None,
        }
    }

    /// Whether the reader is held back: a SEND waits for a receive, or the peer does not
    /// read our answers, or too many answers wait for copies into device memory (so
    /// reading more would only queue more of them).
    pub fn reads_paused(&self) -> bool {
        matches!(self.rstate, ReadState::SendWaiting(_))
            || self.responses > MAX_RESPONSES
            || self.held.len() > MAX_RESPONSES
    }

    /// Gives back what a frame cut short by a closing connection had taken: the posted
    /// receive it was filling (to the front of the queue, where it came from) and its room
    /// in the early-arrival queue; and the room of the SEND credit the peer still held. A
    /// READ whose reply was cut short goes back to the front of the requests outstanding,
    /// to fail with them.
    pub fn abandon(&mut self, shared: &mut Shared) {
        match std::mem::replace(&mut self.rstate, ReadState::Header) {
            ReadState::Payload { finish, .. } => match finish {
                Finish::Recv { recv, .. } => shared.put_back_recv(recv),
                Finish::Unexpected { len, .. } => {
                    shared.recv.release(len as usize);
                    shared.early.give(1, len);
                }
                Finish::ReadReply(op) => self.inflight.push_front(op),
                _ => {}
            },
            // The entries not finished: their READs fail with the others.
            ReadState::BatchPayloads { items, next, .. } => {
                self.unpop_replies(items.into_iter().skip(next))
            }
            _ => {}
        }
        self.return_credit(&mut shared.early);
    }

    /// Drives the copies into device memory: marks what was queued, learns what completed,
    /// frees its room, and releases the answers (and events) that waited for it.
    pub fn progress_copies(&mut self, shared: &mut Shared) -> Result<(), TcpError> {
        if let Some(r) = self.in_ring.as_mut() {
            r.mark_if(true)?;
            r.poll()?;
            r.tail = r.ready;
        }
        let ready = self.in_ring.as_ref().map_or(u64::MAX, |r| r.ready);
        while self.held.front().is_some_and(|h| h.until <= ready) {
            let h = self.held.pop_front().expect("non-empty");
            self.apply(h.answer, h.event, shared);
        }
        Ok(())
    }

    /// Whether copies are in flight (or answers wait for them): progress needs polling,
    /// whatever the sockets say.
    pub fn copies_pending(&self) -> bool {
        self.out_ring.as_ref().is_some_and(Ring::busy)
            || self.in_ring.as_ref().is_some_and(Ring::busy)
            || !self.held.is_empty()
    }
}

/// Adds `mem` to the regions a batch or frame holds, unless it is the last one added (a
/// batch's entries mostly share one region): one reference count per region, not per entry.
fn keep_once(keep: &mut Vec<Arc<dyn MemoryRegion>>, mem: &Arc<dyn MemoryRegion>) {
    if !keep.last().is_some_and(|k| Arc::ptr_eq(k, mem)) {
        keep.push(mem.clone());
    }
}
