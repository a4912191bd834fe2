//! SEND flow control, apart from the acknowledgement of WRITEs.
//!
//! A SEND that finds no posted receive waits at the target in the early-arrival queue,
//! which is bounded. Rather than stop reading a connection when that queue is full (which
//! would also stop the ACKs of WRITEs on it, and deadlock two peers that both send), the
//! target grants each connection **credit**: a number of messages and of bytes it may send
//! as SENDs, taken from the early-arrival queue's room ([`EarlyRoom`]) when granted. A
//! SEND spends one message and its length in bytes; the sender holds SENDs in its queue
//! while it has no credit (WRITEs go on), and fails one that waited longer than its limit
//! ([`TcpError::NoSendCredit`]). The room comes back, and is granted again, when a SEND
//! lands in a posted receive, or when a receive takes a message from the queue.
//!
//! On the wire (protocol version [`PROTOCOL_VERSION`], in the HELLO's `code`; see
//! `crate::frame`):
//! - an ACK with `code` = [`ACK_CREDIT`] grants `key` more messages and `offset` more bytes,
//!   and says in `wr_id` the connection's credit window in bytes (the most it is ever
//!   granted at once); its `len` still acknowledges requests;
//! - the target of a HELLO of this version sends such an ACK at once (its credit, maybe
//!   none yet), which tells the initiator that credit is spoken; the initiator then grants
//!   credit the other way. Until then a sender holds its SENDs.
//! - A SEND longer than the window can never be covered: it goes uncredited, and the target
//!   treats it as a peer of version 0 (HELLO `code` 0, which knows nothing of credit) has
//!   every SEND treated: into a posted receive, else into the queue if it has room, else
//!   the target stops reading the connection until a receive is posted.
//!
//! A peer that claims the version and sends a SEND its credit does not cover breaks the
//! protocol: the connection is closed ([`TcpError::SendBeyondCredit`]).

use super::*;
use crate::frame::{ACK_CREDIT, CHALLENGE_VERSION, CREDIT_VERSION, PROTOCOL_VERSION};
use std::time::{Duration, Instant};
/// A connection's credit window is at most this share of the early-arrival queue (so that
/// a few peers may each hold a window before one has to wait for another's to come back)...
const WINDOW_SHARE: u64 = 4;
/// ...and, on a queue large enough, at most this share of it, so that as many connections
/// hold a window at once: credit a connection holds comes back only as its SENDs are
/// received, so a peer that never sends keeps its window, and a fixed four windows left a
/// fifth connection (a decode rank read by prefill ranks over several rails each) without
/// credit for good.
const WINDOWS: u64 = 64;
/// The smallest window the share of [`WINDOWS`] may give, in messages and bytes (a smaller
/// queue shares by [`WINDOW_SHARE`] alone).
const MIN_WINDOW: (u64, u64) = (16, 1 << 20);

/// Room in the early-arrival queue of a transport, shared by all its connections: what is
/// queued, reserved for messages on their way, or granted to peers as credit.
pub(crate) struct EarlyRoom {
    max_msgs: u64,
    max_bytes: u64,
    used_msgs: u64,
    used_bytes: u64,
    /// Lengths of the messages in the early-arrival queue, oldest first (as `RecvMatch`
    /// holds them): their room comes back as receives take them.
    queued: VecDeque<u64>,
}

impl EarlyRoom {
    /// Room for `max_msgs` messages and `max_bytes` bytes.
    pub fn new(max_msgs: usize, max_bytes: usize) -> EarlyRoom {
        EarlyRoom {
            max_msgs: max_msgs as u64,
            max_bytes: max_bytes as u64,
            used_msgs: 0,
            used_bytes: 0,
            queued: VecDeque::new(),
        }
    }

    /// Takes room for `msgs` messages of `bytes` bytes in all; false (nothing taken) if
    /// there is not that much.
    pub fn take(&mut self, msgs: u64, bytes: u64) -> bool {
        let (m, b) = self.free();
        if msgs > m || bytes > b {
            return false;
        }
        self.used_msgs += msgs;
        self.used_bytes += bytes;
        true
    }

    /// Gives back room taken with [`take`](Self::take).
    pub fn give(&mut self, msgs: u64, bytes: u64) {
        self.used_msgs = self.used_msgs.saturating_sub(msgs);
        self.used_bytes = self.used_bytes.saturating_sub(bytes);
    }

    /// Messages and bytes not taken.
    fn free(&self) -> (u64, u64) {
        (
            self.max_msgs.saturating_sub(self.used_msgs),
            self.max_bytes.saturating_sub(self.used_bytes),
        )
    }

    /// A connection's credit window: messages and bytes.
    fn window(&self) -> (u64, u64) {
        let share = |max: u64, least: u64| (max / WINDOW_SHARE).min((max / WINDOWS).max(least));
        (
            share(self.max_msgs, MIN_WINDOW.0).max(1),
            share(self.max_bytes, MIN_WINDOW.1),
        )
    }
}

/// The credit we granted a peer on one connection (receiver side).
pub(crate) struct Granted {
    window_msgs: u64,
    window_bytes: u64,
    /// Credit the peer holds: granted (sent or not) and not spent.
    msgs: u64,
    bytes: u64,
    /// Granted since the last credit frame.
    unsent_msgs: u64,
    unsent_bytes: u64,
    /// The first credit frame (which says that we speak credit) is still to be sent.
    announce: bool,
}

impl Granted {
    fn new(room: &EarlyRoom) -> Granted {
        let (window_msgs, window_bytes) = room.window();
        Granted {
            window_msgs,
            window_bytes,
            msgs: 0,
            bytes: 0,
            unsent_msgs: 0,
            unsent_bytes: 0,
            announce: true,
        }
    }
}

/// The credit a peer granted us on one connection (sender side).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Credit {
    /// Not known yet whether the peer speaks credit: SENDs wait.
    Unknown,
    /// The peer speaks protocol version 0: SENDs go as they come.
    Legacy,
    /// What the peer granted and we have not spent, and its window in bytes.
    Held { msgs: u64, bytes: u64, window: u64 },
}

/// A SEND held back for lack of credit.
pub(super) struct WaitingSend {
    hdr: Header,
    payload: Payload,
    inflight: Inflight,
    since: Instant,
}

impl Shared {
    /// The state for a transport whose early-arrival queue holds `max_unexpected_count`
    /// messages and `max_unexpected_bytes` bytes.
    pub fn new(
        max_unexpected_count: usize,
        max_unexpected_bytes: usize,
        max_msg_size: u64,
    ) -> Shared {
        Shared {
            targets: crate::FastMap::default(),
            // Bounded by `early`, which also counts the room granted as credit.
            recv: RecvMatch::new(usize::MAX, usize::MAX),
            early: EarlyRoom::new(max_unexpected_count, max_unexpected_bytes),
            max_msg_size,
            completions: Vec::new(),
            stats: Arc::new(TransportStats::default()),
        }
    }

    /// Posts a receive (it may take a queued message at once).
    pub fn post_recv(&mut self, r: PostedRecv) {
        let before = self.completions.len();
        self.recv.post(r, &mut self.completions);
        self.taken_from_queue(before);
    }

    /// Gives back a receive a message cut short had taken.
    pub(super) fn put_back_recv(&mut self, r: PostedRecv) {
        let before = self.completions.len();
        self.recv.put_back(r, &mut self.completions);
        self.taken_from_queue(before);
    }

    /// Queues a message whose room was taken, and delivers queued messages to receives
    /// posted meanwhile.
    pub(super) fn arrived(&mut self, a: EarlyArrival) {
        self.early.queued.push_back(a.data.len() as u64);
        let before = self.completions.len();
        self.recv.arrived(a, &mut self.completions);
        self.taken_from_queue(before);
    }

    /// Every completion since `before` is a queued message a receive took (oldest first):
    /// their room comes back.
    fn taken_from_queue(&mut self, before: usize) {
        for _ in before..self.completions.len() {
            if let Some(len) = self.early.queued.pop_front() {
                self.early.give(1, len);
            }
        }
    }
}

impl Conn {
    /// Posts a WRITE of `len` host bytes at `at` of `mem` (a range the caller checked),
    /// carried by its batch frame without a reference count of its own.
    /// Posts a WRITE whose payload is `rows` of `len` host bytes each, at `ats` of `mem`
    /// (ranges the caller checked), one after the other: the target sees one WRITE of
    /// `rows × len` bytes.
    pub(crate) fn post_write_kept_rows(
        &mut self,
        hdr: Header,
        mem: &Arc<dyn MemoryRegion>,
        ats: Vec<At>,
        len: usize,
        inflight: Inflight,
    ) {
        debug_assert_eq!(hdr.op, Op::Write);
        self.queue_write_kept_rows(hdr, mem, ats, len);
        self.inflight.push_back(inflight);
    }

    pub(crate) fn post_write_kept(
        &mut self,
        hdr: Header,
        mem: &Arc<dyn MemoryRegion>,
        at: At,
        len: usize,
        inflight: Inflight,
    ) {
        debug_assert_eq!(hdr.op, Op::Write);
        self.queue_write_kept(hdr, mem, at, len);
        self.inflight.push_back(inflight);
    }

    /// Queues a request (WRITE, READ or SEND) and waits for its answer; a SEND without
    /// credit waits in `waiting` first.
    pub fn post(&mut self, hdr: Header, payload: Payload, inflight: Inflight) {
        if hdr.op == Op::Write {
            self.queue_write(hdr, payload);
            self.inflight.push_back(inflight);
            return;
        }
        if hdr.op == Op::Read {
            // READ headers join the batch too: the owner learns many at once.
            self.queue_write(hdr, payload);
            self.inflight.push_back(inflight);
            return;
        }
        if self.waiting.is_empty() && self.spend_credit(hdr.len) {
            self.queue(hdr, payload);
            self.inflight.push_back(inflight);
            return;
        }
        self.waiting_bytes += payload.len();
        self.waiting.push_back(WaitingSend {
            hdr,
            payload,
            inflight,
            since: Instant::now(),
        });
    }

    /// Requests queued or waiting for credit: both count against the limits of posting.
    pub fn outstanding(&self) -> usize {
        self.inflight.len() + self.waiting.len()
    }

    /// Bytes queued or waiting for credit.
    pub fn queued_bytes(&self) -> usize {
        self.out_bytes + self.waiting_bytes
    }

    /// Every request that will not be answered now that the connection is gone: those sent
    /// and those still waiting for credit.
    pub fn into_unanswered(self) -> impl Iterator<Item = Inflight> {
        self.inflight
            .into_iter()
            .chain(self.waiting.into_iter().map(|w| w.inflight))
    }

    /// Whether a SEND of `len` bytes may leave now; spends its credit if so.
    fn spend_credit(&mut self, len: u64) -> bool {
        match &mut self.credit {
            Credit::Unknown => false,
            Credit::Legacy => true,
            // Longer than any credit the peer grants: goes uncredited (see the module doc).
            Credit::Held { window, .. } if len > *window => true,
            Credit::Held { msgs, bytes, .. } if *msgs >= 1 && *bytes >= len => {
                *msgs -= 1;
                *bytes -= len;
                true
            }
            Credit::Held { .. } => false,
        }
    }

    /// Sends the waiting SENDs that credit now covers, in order, and fails those that
    /// waited longer than `limit`.
    pub fn release_sends(&mut self, limit: Duration, shared: &mut Shared) {
        while let Some((len, since)) = self.waiting.front().map(|w| (w.hdr.len, w.since)) {
            if self.spend_credit(len) {
                let Some(w) = self.waiting.pop_front() else {
                    break;
                };
                self.waiting_bytes -= w.payload.len();
                self.queue(w.hdr, w.payload);
                self.inflight.push_back(w.inflight);
                continue;
            }
            let waited = since.elapsed();
            if waited <= limit {
                break;
            }
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            self.waiting_bytes -= w.payload.len();
            tracing::debug!(peer = %self.peer, len, ?waited, "SEND given up for lack of credit");
            shared.completions.push(Completion {
                wr_id: w.inflight.wr_id,
                op: w.inflight.op,
                result: Err(OpError::transport(TcpError::NoSendCredit { len, waited })),
                peer: Some(self.peer),
                imm: None,
            });
        }
    }

    /// The version of an accepted connection's HELLO: whether its peer speaks credit.
    pub(super) fn on_hello_version(
        &mut self,
        version: u8,
        shared: &Shared,
    ) -> Result<(), TcpError> {
        match version {
            0 => self.credit = Credit::Legacy,
            CREDIT_VERSION | CHALLENGE_VERSION | PROTOCOL_VERSION => {
                self.granted = Some(Granted::new(&shared.early))
            }
            v => return Err(TcpError::HelloVersion(v)),
        }
        self.peer_version = Some(version);
        Ok(())
    }

    /// An ACK that grants credit (`h.code == ACK_CREDIT`).
    pub(super) fn on_credit(&mut self, h: &Header, shared: &Shared) {
        if self.credit == Credit::Legacy {
            // A peer of version 0 grants nothing: not ours to believe.
            return;
        }
        self.credit = match self.credit {
            Credit::Held { msgs, bytes, .. } => Credit::Held {
                msgs: msgs.saturating_add(h.key),
                bytes: bytes.saturating_add(h.offset),
                window: h.wr_id,
            },
            _ => Credit::Held {
                msgs: h.key,
                bytes: h.offset,
                window: h.wr_id,
            },
        };
        // The target of our HELLO speaks credit: grant it some the other way.
        if self.granted.is_none() && !self.accepted {
            self.granted = Some(Granted::new(&shared.early));
        }
    }

    /// Charges an incoming SEND of `len` bytes to the credit we granted: true if it is
    /// covered (its room is taken already), false if it comes uncredited (a peer of
    /// version 0, or longer than the window).
    pub(super) fn charge_send(&mut self, len: u64) -> Result<bool, TcpError> {
        let Some(g) = self.granted.as_mut() else {
            return Ok(false);
        };
        if len > g.window_bytes {
            return Ok(false);
        }
        if g.msgs == 0 || g.bytes < len {
            return Err(TcpError::SendBeyondCredit {
                len,
                messages: g.msgs,
                bytes: g.bytes,
            });
        }
        g.msgs -= 1;
        g.bytes -= len;
        Ok(true)
    }

    /// Tops the peer's credit up to the window from the room free now, and queues the
    /// grant (with the ACK at the end of the queue when there is one).
    pub(super) fn grant_credit(&mut self, room: &mut EarlyRoom) {
        let Some(g) = self.granted.as_mut() else {
            return;
        };
        let (free_msgs, free_bytes) = room.free();
        let msgs = g.window_msgs.saturating_sub(g.msgs).min(free_msgs);
        let bytes = g.window_bytes.saturating_sub(g.bytes).min(free_bytes);
        if (msgs > 0 || bytes > 0) && room.take(msgs, bytes) {
            g.msgs += msgs;
            g.bytes += bytes;
            g.unsent_msgs += msgs;
            g.unsent_bytes += bytes;
        }
        if g.unsent_msgs == 0 && g.unsent_bytes == 0 && !g.announce {
            return;
        }
        let (msgs, bytes, window) = (g.unsent_msgs, g.unsent_bytes, g.window_bytes);
        (g.unsent_msgs, g.unsent_bytes, g.announce) = (0, 0, false);
        if let Some(f) = self.out.back_mut()
            && f.response
            && f.written == 0
            && f.head[0] == Op::Ack as u8
            && let Ok(mut h) = Header::decode(
                f.head[..HEADER_LEN]
                    .try_into()
                    .expect("a frame's head holds its header"),
            )
        {
            if h.code == ACK_CREDIT {
                h.key = h.key.saturating_add(msgs);
                h.offset = h.offset.saturating_add(bytes);
            } else {
                (h.key, h.offset) = (msgs, bytes);
            }
            h.code = ACK_CREDIT;
            h.wr_id = window;
            f.head[..HEADER_LEN].copy_from_slice(&h.encode());
            return;
        }
        let mut h = Header::new(Op::Ack, 0);
        h.code = ACK_CREDIT;
        (h.key, h.offset, h.wr_id) = (msgs, bytes, window);
        self.queue(h, Payload::None);
    }

    /// Gives back the room of the credit the peer held when the connection closes.
    pub(super) fn return_credit(&mut self, room: &mut EarlyRoom) {
        if let Some(g) = self.granted.take() {
            room.give(g.msgs, g.bytes);
        }
    }
}
