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

use crate::error::TcpError;
use crate::frame::{self, HEADER_LEN, Header, MAX_BATCH, Op};
use crate::io::{RawIov, copy_to_region};
use crate::staging::{CHUNK, Ring, Via};
use fabric_core::recv::{EarlyArrival, PostedRecv, RecvMatch};
use fabric_core::{
    Access, Completion, MemoryRegion, OpError, OpKind, PeerId, RemoteKey, WorkRequestId,
};
use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;

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
    pub targets: HashMap<u64, TargetRegion>,
    /// Posted receives and early arrivals (fabric-core's one matching piece).
    pub recv: RecvMatch,
    pub max_msg_size: u64,
    pub completions: Vec<Completion>,
}

/// What an outgoing frame carries after its header.
pub(crate) enum Payload {
    None,
    /// Bytes of a registered host region (zero copy).
    Region {
        mem: Arc<dyn MemoryRegion>,
        offset: u64,
        len: usize,
    },
    /// Bytes owned by the frame (HELLO).
    Owned(Vec<u8>),
    /// Device memory, sent out of the connection's staging ring: copied there in order as
    /// room frees up (`Conn::stage_out`), sent as the copies complete.
    Device {
        mem: Arc<dyn MemoryRegion>,
        offset: u64,
        len: usize,
        via: Via,
        /// Ring counter of the first byte, once it has room.
        staged: Option<u64>,
        /// Bytes given room in the ring (their copies queued).
        assigned: usize,
    },
}

impl Payload {
    /// The bytes from `skip` on, as an iovec (`None`: nothing to send from here, or a
    /// region range that fails its check, which posting already made: a bug).
    fn iov_from(&self, skip: usize) -> Option<RawIov> {
        match self {
            Payload::None => None,
            Payload::Region { mem, offset, len } => {
                RawIov::of_region(&**mem, *offset + skip as u64, len.checked_sub(skip)?)
            }
            Payload::Owned(v) => v.get(skip..).map(RawIov::of_slice),
            // Sent from the staging ring (OutFrame::push_iov).
            Payload::Device { .. } => None,
        }
    }
    fn len(&self) -> usize {
        match self {
            Payload::None => 0,
            Payload::Region { len, .. } | Payload::Device { len, .. } => *len,
            Payload::Owned(v) => v.len(),
        }
    }
}

/// A frame on its way out: header bytes, then payloads.
pub(crate) struct OutFrame {
    /// One header, or a BATCH header followed by its WRITE headers.
    head: Vec<u8>,
    payloads: Vec<Payload>,
    /// WRITEs in this batch (0: not a batch).
    batch: usize,
    /// An ACK or NACK (counted in `Conn::responses`).
    response: bool,
    total: usize,
    /// Bytes already written.
    written: usize,
    /// Device payloads, and how many of them still lack room in the staging ring.
    device: usize,
    unstaged: usize,
}

impl OutFrame {
    /// The frame's bytes from `written` on, as slices, appended to `iov`. False when the
    /// next frame must not follow: `iov` is full, or a device payload is not copied yet.
    fn push_iov(&self, iov: &mut Vec<RawIov>, ring: Option<&Ring>) -> bool {
        let mut skip = self.written;
        if skip < self.head.len() {
            if iov.len() == MAX_IOV {
                return false;
            }
            iov.push(RawIov::of_slice(&self.head[skip..]));
            skip = 0;
        } else {
            skip -= self.head.len();
        }
        for p in &self.payloads {
            if iov.len() == MAX_IOV {
                return false;
            }
            let len = p.len();
            if skip >= len {
                skip -= len;
                continue;
            }
            if let Payload::Device {
                staged, assigned, ..
            } = p
            {
                let (Some(base), Some(ring)) = (*staged, ring) else {
                    return false;
                };
                // Bytes whose copies have completed.
                let ready = (ring.ready.saturating_sub(base) as usize).min(*assigned);
                let mut at = skip;
                while at < ready {
                    if iov.len() == MAX_IOV {
                        return false;
                    }
                    let s = ring.ready_slice(base + at as u64, ready - at);
                    at += s.len();
                    iov.push(RawIov::of_slice(s));
                }
                if ready < len {
                    return false;
                }
            } else if let Some(v) = p.iov_from(skip) {
                iov.push(v);
            }
            skip = 0;
        }
        true
    }

    /// How many of the frame's bytes `from..to` belong to device payloads.
    fn device_bytes(&self, from: usize, to: usize) -> usize {
        let mut at = self.head.len();
        let mut n = 0;
        for p in &self.payloads {
            if at >= to {
                break;
            }
            let len = p.len();
            if let Payload::Device { .. } = p {
                n += (at + len).min(to).saturating_sub(at.max(from));
            }
            at += len;
        }
        n
    }
}

/// An answer held back until the device copies of the bytes before it have completed:
/// answers (and the target's events) leave in the order of the requests.
struct Held {
    /// In-ring counter that must be ready (0: none).
    until: u64,
    /// `None`: an ACK.
    nack: Option<Header>,
    event: Option<Completion>,
}

/// A request waiting for its response.
pub(crate) struct Inflight {
    pub wr_id: WorkRequestId,
    pub op: OpKind,
    pub len: u64,
}

/// Where incoming payload bytes go.
enum Dest {
    Region {
        mem: Arc<dyn MemoryRegion>,
        offset: u64,
    },
    /// A WRITE into memory the CPU cannot address: read into the connection's staging
    /// ring, whose copies into place are queued at once (see `place`).
    Device {
        mem: Arc<dyn MemoryRegion>,
        /// Where the next byte goes.
        offset: u64,
        via: Via,
        /// In-ring counter after the last byte received (0: none yet).
        end: u64,
    },
    Buffer(Vec<u8>),
    Discard,
}

impl Dest {
    /// Copies staged bytes in.
    fn put(&mut self, src: &[u8]) -> Result<(), TcpError> {
        match self {
            Dest::Region { mem, offset } => {
                if !copy_to_region(&**mem, *offset, src) {
                    mem.write_from_host(*offset, src)
                        .map_err(TcpError::PlacePayload)?;
                }
                *offset += src.len() as u64;
            }
            Dest::Buffer(v) => v.extend_from_slice(src),
            Dest::Device { .. } => return Err(TcpError::DeviceBytesNotStaged),
            Dest::Discard => {}
        }
        Ok(())
    }
}

/// What to do when a payload is complete.
enum Finish {
    Write {
        imm: Option<u32>,
        len: u64,
    },
    /// The receive is kept whole, to be given back if the connection breaks mid-payload.
    Recv {
        recv: PostedRecv,
        imm: Option<u32>,
        len: u64,
    },
    Unexpected {
        imm: Option<u32>,
        len: u64,
    },
    Hello,
    /// A rejected request: its NACK is sent once its turn comes.
    Rejected {
        err: OpError,
        wr_id: u64,
    },
    /// Payload thrown away whose response was already queued.
    Dropped,
}

/// One WRITE of a batch being received.
struct Item {
    dest: Dest,
    remaining: u64,
    finish: Finish,
}

enum ReadState {
    Header,
    Payload {
        dest: Dest,
        remaining: u64,
        finish: Finish,
    },
    /// A SEND whose payload waits for a receive (or room in the early-arrival queue).
    SendWaiting(Header),
    /// The headers of a batch of `count` WRITEs are being read.
    BatchHeaders {
        count: usize,
    },
    /// The payloads of a batch, in order, from `next` on.
    BatchPayloads {
        items: Vec<Item>,
        next: usize,
        /// Some destinations overlap: read one item per call, so that no two live slices
        /// alias the same bytes.
        one_at_a_time: bool,
    },
}

/// Outcome of reading a connection.
pub(crate) enum ReadOutcome {
    /// Keep going.
    Open,
    /// A HELLO arrived: rail and the sender's address.
    Hello {
        rail: u32,
        instance: u64,
        address: Vec<u8>,
    },
}

pub(crate) struct Conn {
    pub stream: TcpStream,
    pub peer: PeerId,
    pub out: VecDeque<OutFrame>,
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
    /// An accepted connection until its HELLO arrives.
    pub awaiting_hello: bool,
    hello: Option<(u32, u64, Vec<u8>)>,
    /// When the connection was opened (a peer that never says HELLO is dropped).
    pub opened: std::time::Instant,
    /// Digest of the shared token that an accepted connection's HELLO must carry.
    auth: Option<[u8; 16]>,
    discard: Box<[u8]>,
    /// Requests answered so far (ACK or NACK).
    answered: u64,
    /// Until when a connection we opened may take to connect (`None`: connected, or
    /// accepted).
    pub connecting: Option<std::time::Instant>,
    /// `(answered, out_bytes)` as last seen changing, and when: see `check_answers`.
    unanswered_since: Option<((u64, usize), std::time::Instant)>,
}

impl Conn {
    /// A connection; `auth` is the token digest an accepted connection's HELLO must carry.
    pub fn new(
        stream: TcpStream,
        peer: PeerId,
        awaiting_hello: bool,
        auth: Option<[u8; 16]>,
    ) -> Conn {
        Conn {
            auth,
            stream,
            peer,
            out: VecDeque::new(),
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
            awaiting_hello,
            hello: None,
            opened: std::time::Instant::now(),
            discard: Vec::new().into_boxed_slice(),
            answered: 0,
            unanswered_since: None,
            connecting: None,
        }
    }

    /// Fails once requests have been outstanding for `limit` with neither an answer from
    /// the peer nor a byte of ours leaving, while the peer's kernel has acknowledged all our
    /// bytes: it takes them while its transport is stopped, which TCP's own timers never
    /// notice. (Unacknowledged bytes are TCP_USER_TIMEOUT's to judge.)
    pub fn check_answers(&mut self, limit: std::time::Duration) -> Result<(), TcpError> {
        if self.inflight.is_empty() {
            self.unanswered_since = None;
            return Ok(());
        }
        let now = std::time::Instant::now();
        let seen = (self.answered, self.out_bytes);
        match self.unanswered_since {
            Some((s, since)) if s == seen => {
                if now.duration_since(since) > limit {
                    if crate::io::kernel_unacked(self.stream.as_raw_fd()) == Some(true) {
                        // Bytes still unacknowledged by the peer's kernel (a partition, a
                        // slow path): TCP's own timers (TCP_USER_TIMEOUT) judge that.
                        self.unanswered_since = Some((seen, now));
                        return Ok(());
                    }
                    return Err(TcpError::Unanswered {
                        count: self.inflight.len(),
                        limit,
                    });
                }
            }
            _ => self.unanswered_since = Some((seen, now)),
        }
        Ok(())
    }

    /// Queues one frame.
    pub fn queue(&mut self, hdr: Header, payload: Payload) {
        let device = matches!(payload, Payload::Device { .. }) as usize;
        self.unstaged += device;
        let total = HEADER_LEN + payload.len();
        self.out_bytes += total;
        let response = matches!(hdr.op, Op::Ack | Op::Nack);
        self.responses += response as usize;
        self.out.push_back(OutFrame {
            head: hdr.encode().to_vec(),
            payloads: vec![payload],
            batch: 0,
            response,
            total,
            written: 0,
            device,
            unstaged: device,
        });
    }

    /// Queues a WRITE, joining the batch at the end of the queue if it has not started.
    pub fn queue_write(&mut self, hdr: Header, payload: Payload) {
        let device = matches!(payload, Payload::Device { .. }) as usize;
        self.unstaged += device;
        let plen = payload.len();
        self.out_bytes += HEADER_LEN + plen;
        if let Some(f) = self.out.back_mut()
            && f.batch > 0
            && f.batch < MAX_BATCH
            && f.written == 0
        {
            // Headers stay contiguous: payloads follow all of them.
            f.head.extend_from_slice(&hdr.encode());
            f.payloads.push(payload);
            f.batch += 1;
            f.device += device;
            f.unstaged += device;
            f.total += HEADER_LEN + plen;
            f.head[..HEADER_LEN].copy_from_slice(&Header::new(Op::Batch, f.batch as u64).encode());
            return;
        }
        self.out_bytes += HEADER_LEN;
        let mut head = Vec::with_capacity(HEADER_LEN * 16);
        head.extend_from_slice(&Header::new(Op::Batch, 1).encode());
        head.extend_from_slice(&hdr.encode());
        self.out.push_back(OutFrame {
            head,
            payloads: vec![payload],
            batch: 1,
            response: false,
            total: 2 * HEADER_LEN + plen,
            written: 0,
            device,
            unstaged: device,
        });
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
    /// in the early-arrival queue.
    pub fn abandon(&mut self, shared: &mut Shared) {
        if let ReadState::Payload { finish, .. } =
            std::mem::replace(&mut self.rstate, ReadState::Header)
        {
            match finish {
                Finish::Recv { recv, .. } => shared.recv.put_back(recv, &mut shared.completions),
                Finish::Unexpected { len, .. } => shared.recv.release(len as usize),
                _ => {}
            }
        }
    }

    /// Writes as much of the queue as the socket takes. `Err` = connection broken.
    ///
    /// Device payloads leave from the staging ring as their copies complete; the copies of
    /// the next ones run while the socket takes these.
    pub fn flush(&mut self) -> Result<(), TcpError> {
        self.flush_acks();
        loop {
            self.stage_out()?;
            if self.out.is_empty() {
                return Ok(());
            }
            let mut iov: Vec<RawIov> = Vec::with_capacity(64);
            for f in self.out.iter() {
                if !f.push_iov(&mut iov, self.out_ring.as_ref()) {
                    break;
                }
            }
            if iov.is_empty() {
                // The next bytes are device bytes still being copied.
                return Ok(());
            }
            // SAFETY: every entry covers bytes of a frame in `self.out` (its header, its
            // owned bytes, the staging ring, or a registered region whose Arc the frame
            // holds), all alive and unchanged until `advance` below; writev only reads.
            let n = match unsafe { crate::io::writev(self.stream.as_raw_fd(), &iov) } {
                Ok(0) => return Err(TcpError::ClosedWhileWriting),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(TcpError::io("write", e)),
            };
            drop(iov);
            self.advance(n);
        }
    }

    fn advance(&mut self, mut n: usize) {
        self.out_bytes -= n;
        while n > 0 {
            let f = self
                .out
                .front_mut()
                .expect("written bytes belong to queued frames");
            let take = (f.total - f.written).min(n);
            if f.device > 0
                && let Some(r) = self.out_ring.as_mut()
            {
                // The socket took these staged bytes: their room is free again.
                r.tail += f.device_bytes(f.written, f.written + take) as u64;
            }
            f.written += take;
            n -= take;
            if f.written == f.total {
                if f.response {
                    self.responses -= 1;
                }
                self.out.pop_front();
            }
        }
    }

    /// Learns which copies out have completed, and gives the next device payloads room in
    /// the staging ring, in queue order, as far as it has room: their copies start now.
    fn stage_out(&mut self) -> Result<(), TcpError> {
        if let Some(r) = self.out_ring.as_mut() {
            r.poll()?;
        }
        if self.unstaged == 0 {
            return Ok(());
        }
        let Conn {
            out,
            out_ring,
            unstaged,
            ..
        } = self;
        'frames: for f in out.iter_mut() {
            if f.unstaged == 0 {
                continue;
            }
            for p in f.payloads.iter_mut() {
                let Payload::Device {
                    mem,
                    offset,
                    len,
                    via,
                    staged,
                    assigned,
                } = p
                else {
                    continue;
                };
                if staged.is_some() && *assigned == *len {
                    continue;
                }
                // A ring of another device must drain first (bytes leave in order).
                if !Ring::ensure(out_ring, via)? {
                    break 'frames;
                }
                let ring = out_ring.as_mut().expect("ensured above");
                if staged.is_none() {
                    *staged = Some(ring.head);
                }
                while *assigned < *len {
                    let n = (*len - *assigned).min(ring.free()).min(CHUNK);
                    if n == 0 {
                        break 'frames;
                    }
                    ring.copy_out(mem, *offset + *assigned as u64, n)?;
                    *assigned += n;
                }
                f.unstaged -= 1;
                *unstaged -= 1;
            }
        }
        if let Some(r) = out_ring.as_mut() {
            r.mark_if(true)?;
            // Copies that complete at once (or synchronous ones) can leave in this flush.
            r.poll()?;
        }
        Ok(())
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
            self.apply(h.nack, h.event, shared);
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

    /// Answers a request (an ACK, or the NACK `nack`) and reports `event`, once the in-ring
    /// is ready up to `until` and every earlier answer has left.
    fn answer(
        &mut self,
        until: Option<u64>,
        nack: Option<Header>,
        event: Option<Completion>,
        shared: &mut Shared,
    ) {
        let ready = self.in_ring.as_ref().map_or(u64::MAX, |r| r.ready);
        if self.held.is_empty() && until.is_none_or(|u| u <= ready) {
            self.apply(nack, event, shared);
        } else {
            self.held.push_back(Held {
                until: until.unwrap_or(0),
                nack,
                event,
            });
        }
    }

    fn apply(&mut self, nack: Option<Header>, event: Option<Completion>, shared: &mut Shared) {
        match nack {
            None => self.pending_acks += 1,
            Some(h) => {
                self.flush_acks();
                self.queue(h, Payload::None);
            }
        }
        if let Some(e) = event {
            shared.completions.push(e);
        }
    }

    fn flush_acks(&mut self) {
        if self.pending_acks == 0 {
            return;
        }
        let n = std::mem::take(&mut self.pending_acks);
        // ACKs are cumulative: an unsent ACK at the end of the queue absorbs this one.
        if let Some(f) = self.out.back_mut()
            && f.response
            && f.written == 0
            && f.head[0] == Op::Ack as u8
        {
            let mut h = Header::new(Op::Ack, 0);
            h.len = u64::from_le_bytes(f.head[32..40].try_into().expect("8 bytes")) + n;
            f.head[..HEADER_LEN].copy_from_slice(&h.encode());
            return;
        }
        self.queue(Header::new(Op::Ack, n), Payload::None);
    }

    fn nack(&mut self, err: &OpError, wr_id: u64, shared: &mut Shared) {
        self.answer(None, Some(frame::nack_for(err, wr_id)), None, shared);
    }

    /// Reads what the socket has (up to about `budget` bytes) and acts on complete frames.
    pub fn read(&mut self, shared: &mut Shared, budget: usize) -> Result<ReadOutcome, TcpError> {
        let r = self.read_frames(shared, budget);
        // Bytes read for device memory are copied into place from now on; the answers and
        // events that report them wait for the copies (progress_copies).
        self.progress_copies(shared)?;
        r
    }

    /// Whether the payload being received goes to device memory and the in-ring has no
    /// room for it now (reading waits for copies to complete).
    fn stalled(&mut self) -> Result<bool, TcpError> {
        let dest = match &self.rstate {
            ReadState::Payload {
                dest, remaining, ..
            } if *remaining > 0 => dest,
            ReadState::BatchPayloads { items, next, .. }
                if *next < items.len() && items[*next].remaining > 0 =>
            {
                &items[*next].dest
            }
            _ => return Ok(false),
        };
        let Dest::Device { via, .. } = dest else {
            return Ok(false);
        };
        let via = via.clone();
        Ok(device_room(&mut self.in_ring, &via)? == 0)
    }

    fn read_frames(&mut self, shared: &mut Shared, budget: usize) -> Result<ReadOutcome, TcpError> {
        let mut read = 0usize;
        loop {
            self.process(shared)?;
            if let Some((rail, instance, address)) = self.hello.take() {
                return Ok(ReadOutcome::Hello {
                    rail,
                    instance,
                    address,
                });
            }
            if self.reads_paused() || read >= budget || self.stalled()? {
                return Ok(ReadOutcome::Open);
            }
            // Everything buffered was consumed except part of a header block (or nothing).
            if self.rpos > 0 {
                self.rbuf.copy_within(self.rpos..self.rlen, 0);
                self.rlen -= self.rpos;
                self.rpos = 0;
            }
            let res = match &mut self.rstate {
                ReadState::BatchPayloads { items, next, .. } if !direct(&items[*next].dest) => {
                    // Memory the CPU cannot address: stage, then copy (Dest::put).
                    let want = (items[*next].remaining as usize).saturating_add(HEADER_READ);
                    read_staged(&mut self.stream, &mut self.rbuf, &mut self.rlen, want)
                }
                ReadState::BatchPayloads {
                    items,
                    next,
                    one_at_a_time,
                } => {
                    debug_assert_eq!(self.rlen, 0);
                    read_batch(
                        &mut self.stream,
                        items,
                        *next,
                        if *one_at_a_time { 1 } else { MAX_IOV - 1 },
                        &mut self.rbuf[..HEADER_LEN],
                        &mut self.discard,
                        &mut self.in_ring,
                    )
                    .map(|(n, tail)| {
                        self.rlen = tail;
                        n
                    })
                }
                ReadState::Payload {
                    dest: Dest::Region { mem, offset },
                    remaining,
                    ..
                } if *remaining >= DIRECT_MIN && self.rlen == 0 => {
                    match RawIov::of_region(&**mem, *offset, *remaining as usize) {
                        Some(direct) => {
                            let direct_len = direct.len();
                            // Only the next header rides along.
                            let iov = [direct, RawIov::of_slice_mut(&mut self.rbuf[..HEADER_LEN])];
                            // SAFETY: `direct` covers a checked range of the live region
                            // (this payload's destination, whose Arc the read state holds;
                            // one connection places one frame's bytes at a time), the other
                            // entry our own buffer; they do not overlap.
                            unsafe { crate::io::readv(self.stream.as_raw_fd(), &iov) }.inspect(
                                |&n| {
                                    let d = n.min(direct_len);
                                    *offset += d as u64;
                                    *remaining -= d as u64;
                                    self.rlen = n - d;
                                },
                            )
                        }
                        None => read_staged(&mut self.stream, &mut self.rbuf, &mut self.rlen, RBUF),
                    }
                }
                ReadState::BatchHeaders { count } => {
                    let want = (*count * HEADER_LEN).saturating_sub(self.rlen).max(1);
                    read_staged(&mut self.stream, &mut self.rbuf, &mut self.rlen, want)
                }
                ReadState::Payload { remaining, .. } => {
                    let want = (*remaining as usize).saturating_add(HEADER_READ);
                    read_staged(&mut self.stream, &mut self.rbuf, &mut self.rlen, want)
                }
                _ => read_staged(
                    &mut self.stream,
                    &mut self.rbuf,
                    &mut self.rlen,
                    HEADER_READ,
                ),
            };
            match res {
                Ok(0) => return Err(TcpError::PeerClosed),
                Ok(n) => read += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return Ok(ReadOutcome::Open);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                // A copy into device memory that failed inside `read_batch`, or the read.
                Err(e) => {
                    return Err(match e.downcast::<TcpError>() {
                        Ok(copy) => copy,
                        Err(e) => TcpError::io("read", e),
                    });
                }
            }
            // A direct read may have completed items or a payload: act on it.
            if let ReadState::BatchPayloads { .. } = self.rstate {
                self.settle_batch(shared)?;
            }
        }
    }

    /// Acts on buffered bytes until a frame is incomplete.
    fn process(&mut self, shared: &mut Shared) -> Result<(), TcpError> {
        loop {
            match &mut self.rstate {
                ReadState::Header => {
                    if self.rlen - self.rpos < HEADER_LEN {
                        return Ok(());
                    }
                    let raw: &[u8; HEADER_LEN] = self.rbuf[self.rpos..self.rpos + HEADER_LEN]
                        .try_into()
                        .expect("header length");
                    let h = Header::decode(raw).map_err(TcpError::MalformedFrame)?;
                    self.rpos += HEADER_LEN;
                    self.on_header(h, shared)?;
                }
                ReadState::SendWaiting(h) => {
                    let h = *h;
                    if !self.start_send(h, shared) {
                        return Ok(());
                    }
                }
                ReadState::BatchHeaders { count } => {
                    let count = *count;
                    if self.rlen - self.rpos < count * HEADER_LEN {
                        return Ok(());
                    }
                    let mut items = Vec::with_capacity(count);
                    for i in 0..count {
                        let at = self.rpos + i * HEADER_LEN;
                        let raw: &[u8; HEADER_LEN] = self.rbuf[at..at + HEADER_LEN]
                            .try_into()
                            .expect("header length");
                        let h = Header::decode(raw).map_err(TcpError::MalformedBatchEntry)?;
                        items.push(self.batch_item(&h, shared)?);
                    }
                    self.rpos += count * HEADER_LEN;
                    let one_at_a_time = destinations_overlap(&items);
                    self.rstate = ReadState::BatchPayloads {
                        items,
                        next: 0,
                        one_at_a_time,
                    };
                    self.settle_batch(shared)?;
                }
                ReadState::BatchPayloads { items, next, .. } => {
                    let avail = self.rlen - self.rpos;
                    if avail == 0 {
                        return Ok(());
                    }
                    let item = &mut items[*next];
                    let take = item.remaining.min(avail as u64) as usize;
                    let took = place(
                        &mut self.in_ring,
                        &mut item.dest,
                        &self.rbuf[self.rpos..self.rpos + take],
                    )?;
                    item.remaining -= took as u64;
                    self.rpos += took;
                    if took == 0 {
                        // No room in the in-ring: wait for copies.
                        return Ok(());
                    }
                    self.settle_batch(shared)?;
                }
                ReadState::Payload {
                    dest, remaining, ..
                } => {
                    if *remaining > 0 {
                        let avail = self.rlen - self.rpos;
                        if avail == 0 {
                            return Ok(());
                        }
                        let take = (*remaining).min(avail as u64) as usize;
                        let took = place(
                            &mut self.in_ring,
                            dest,
                            &self.rbuf[self.rpos..self.rpos + take],
                        )?;
                        self.rpos += took;
                        *remaining -= took as u64;
                        if took == 0 {
                            // No room in the in-ring: wait for copies.
                            return Ok(());
                        }
                    }
                    if *remaining == 0 {
                        let ReadState::Payload { dest, finish, .. } =
                            std::mem::replace(&mut self.rstate, ReadState::Header)
                        else {
                            unreachable!("matched Payload above")
                        };
                        self.finish(dest, finish, shared)?;
                    }
                }
            }
        }
    }

    /// Finishes the leading items of a batch whose payload is complete; back to `Header`
    /// when all are done.
    fn settle_batch(&mut self, shared: &mut Shared) -> Result<(), TcpError> {
        loop {
            let ReadState::BatchPayloads { items, next, .. } = &mut self.rstate else {
                return Ok(());
            };
            if *next == items.len() {
                self.rstate = ReadState::Header;
                return Ok(());
            }
            if items[*next].remaining > 0 {
                return Ok(());
            }
            let i = *next;
            *next += 1;
            let dest = std::mem::replace(&mut items[i].dest, Dest::Discard);
            let finish = std::mem::replace(&mut items[i].finish, Finish::Dropped);
            self.finish(dest, finish, shared)?;
        }
    }

    /// Validates one WRITE of a batch.
    fn batch_item(&mut self, h: &Header, shared: &Shared) -> Result<Item, TcpError> {
        if h.op != Op::Write {
            return Err(TcpError::NotAWrite { op: h.op });
        }
        if h.len > shared.max_msg_size {
            return Err(TcpError::TooLong {
                op: Op::Write,
                len: h.len,
                limit: shared.max_msg_size,
            });
        }
        Ok(match validate_write(h, shared) {
            Ok((mem, via)) => Item {
                dest: if mem.host_ptr().is_some() {
                    Dest::Region {
                        mem,
                        offset: h.offset,
                    }
                } else {
                    // The ring is made by the first device WRITE, even an empty one: the
                    // engine's warm-up pays for the pinned allocation, not the first transfer.
                    if self.in_ring.is_none() {
                        Ring::ensure(&mut self.in_ring, &via)?;
                    }
                    Dest::Device {
                        mem,
                        offset: h.offset,
                        via,
                        end: 0,
                    }
                },
                remaining: h.len,
                finish: Finish::Write {
                    imm: h.imm(),
                    len: h.len,
                },
            },
            Err(err) => {
                tracing::debug!(peer = %self.peer, error = %err, "rejected WRITE");
                if self.discard.is_empty() && h.len > 0 {
                    self.discard = vec![0u8; DISCARD].into_boxed_slice();
                }
                Item {
                    dest: Dest::Discard,
                    remaining: h.len,
                    finish: Finish::Rejected {
                        err,
                        wr_id: h.wr_id,
                    },
                }
            }
        })
    }

    fn on_header(&mut self, h: Header, shared: &mut Shared) -> Result<(), TcpError> {
        if self.awaiting_hello && h.op != Op::Hello {
            return Err(TcpError::BeforeHello { op: h.op });
        }
        match h.op {
            Op::Hello => {
                if !self.awaiting_hello {
                    return Err(TcpError::UnexpectedHello);
                }
                if h.len > MAX_HELLO || h.len < 12 {
                    return Err(TcpError::HelloLength(h.len));
                }
                // Checked before anything else of the peer is read (the token is never logged).
                if let Some(want) = self.auth
                    && !crate::auth::matches(&want, h.key, h.offset)
                {
                    return Err(TcpError::AuthenticationFailed);
                }
                self.rstate = ReadState::Payload {
                    dest: Dest::Buffer(Vec::with_capacity(h.len as usize)),
                    remaining: h.len,
                    finish: Finish::Hello,
                };
            }
            Op::Write => {
                let item = self.batch_item(&h, shared)?;
                self.rstate = ReadState::Payload {
                    dest: item.dest,
                    remaining: item.remaining,
                    finish: item.finish,
                };
            }
            Op::Batch => {
                if h.len == 0 || h.len > MAX_BATCH as u64 {
                    return Err(TcpError::BatchSize(h.len));
                }
                self.rstate = ReadState::BatchHeaders {
                    count: h.len as usize,
                };
            }
            Op::Send => {
                if h.len > shared.max_msg_size {
                    return Err(TcpError::TooLong {
                        op: Op::Send,
                        len: h.len,
                        limit: shared.max_msg_size,
                    });
                }
                self.rstate = ReadState::SendWaiting(h);
            }
            Op::Ack => {
                if h.len > self.inflight.len() as u64 {
                    return Err(TcpError::AckOverrun {
                        acked: h.len,
                        outstanding: self.inflight.len(),
                    });
                }
                for _ in 0..h.len {
                    let op = self.inflight.pop_front().expect("checked above");
                    self.answered += 1;
                    shared.completions.push(Completion {
                        wr_id: op.wr_id,
                        op: op.op,
                        result: Ok(op.len),
                        peer: Some(self.peer),
                        imm: None,
                    });
                }
            }
            Op::Nack => {
                let op = self.inflight.pop_front().ok_or(TcpError::NackOverrun)?;
                self.answered += 1;
                shared.completions.push(Completion {
                    wr_id: op.wr_id,
                    op: op.op,
                    result: Err(frame::error_of_nack(&h)),
                    peer: Some(self.peer),
                    imm: None,
                });
            }
        }
        Ok(())
    }

    /// Starts receiving a SEND's payload; false if it must wait for a receive.
    fn start_send(&mut self, h: Header, shared: &mut Shared) -> bool {
        let imm = h.imm();
        if let Some(r) = shared.recv.take_recv() {
            if h.len > r.cap {
                let err = OpError::Truncated {
                    len: h.len,
                    capacity: r.cap,
                };
                shared.completions.push(Completion {
                    wr_id: r.wr_id,
                    op: OpKind::Recv,
                    result: Err(err.clone()),
                    peer: Some(self.peer),
                    imm,
                });
                self.nack(&err, h.wr_id, shared);
                self.rstate = ReadState::Payload {
                    dest: Dest::Discard,
                    remaining: h.len,
                    finish: Finish::Dropped,
                };
            } else {
                self.rstate = ReadState::Payload {
                    dest: Dest::Region {
                        mem: r.mem.clone(),
                        offset: r.offset,
                    },
                    remaining: h.len,
                    finish: Finish::Recv {
                        recv: r,
                        imm,
                        len: h.len,
                    },
                };
            }
            return true;
        }
        // Room in the early-arrival queue, reserved until the bytes are here.
        if !shared.recv.reserve(h.len as usize) {
            self.rstate = ReadState::SendWaiting(h);
            return false;
        }
        self.rstate = ReadState::Payload {
            dest: Dest::Buffer(Vec::with_capacity(h.len as usize)),
            remaining: h.len,
            finish: Finish::Unexpected { imm, len: h.len },
        };
        true
    }

    fn finish(&mut self, dest: Dest, finish: Finish, shared: &mut Shared) -> Result<(), TcpError> {
        match finish {
            Finish::Write { imm, len } => {
                let event = imm.map(|imm| Completion {
                    wr_id: WorkRequestId(0),
                    op: OpKind::RemoteWrite,
                    result: Ok(len),
                    peer: Some(self.peer),
                    imm: Some(imm),
                });
                // Device bytes are acknowledged (and their imm reported) once their copies
                // into device memory have completed.
                let until = match dest {
                    Dest::Device { end, .. } => Some(end),
                    _ => None,
                };
                self.answer(until, None, event, shared);
            }
            Finish::Recv { recv, imm, len } => {
                self.answer(None, None, None, shared);
                shared.completions.push(Completion {
                    wr_id: recv.wr_id,
                    op: OpKind::Recv,
                    result: Ok(len),
                    peer: Some(self.peer),
                    imm,
                });
            }
            Finish::Unexpected { imm, .. } => {
                self.answer(None, None, None, shared);
                let Dest::Buffer(data) = dest else {
                    unreachable!("unexpected SENDs go to a buffer")
                };
                // A receive posted while this message was arriving is its receive: matched
                // now, before the next SEND of this connection can take it.
                shared.recv.arrived(
                    EarlyArrival {
                        peer: Some(self.peer),
                        imm,
                        data,
                    },
                    &mut shared.completions,
                );
            }
            Finish::Hello => {
                let Dest::Buffer(data) = dest else {
                    unreachable!("HELLO goes to a buffer")
                };
                let rail = u32::from_le_bytes(data[0..4].try_into().expect("len >= 12 checked"));
                let instance =
                    u64::from_le_bytes(data[4..12].try_into().expect("len >= 12 checked"));
                self.awaiting_hello = false;
                self.hello = Some((rail, instance, data[12..].to_vec()));
            }
            Finish::Rejected { err, wr_id } => self.nack(&err, wr_id, shared),
            Finish::Dropped => {}
        }
        Ok(())
    }
}

/// Room in the in-ring for bytes that go to device memory through `via` (0: wait for
/// copies to complete); makes the ring on first use.
fn device_room(ring: &mut Option<Ring>, via: &Via) -> Result<usize, TcpError> {
    if !Ring::ensure(ring, via)? {
        return Ok(0);
    }
    Ok(ring.as_ref().map_or(0, |r| r.contiguous(0)))
}

/// Puts bytes already received (in the read-ahead buffer) into `dest`; returns how many it
/// took (fewer than `src.len()` only for device memory, when the in-ring is full).
fn place(ring: &mut Option<Ring>, dest: &mut Dest, src: &[u8]) -> Result<usize, TcpError> {
    let Dest::Device {
        mem,
        offset,
        via,
        end,
    } = dest
    else {
        dest.put(src)?;
        return Ok(src.len());
    };
    let n = src.len().min(device_room(ring, via)?);
    if n == 0 {
        return Ok(0);
    }
    let r = ring.as_mut().expect("device_room made it");
    // SAFETY: the n bytes at `head` are free room of the staging buffer (contiguous() said
    // so): no copy reads them and no slice covers them; `src` is the read-ahead buffer.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), r.ptr(r.head), n) };
    r.copy_in(mem, *offset, n)?;
    *offset += n as u64;
    *end = r.head;
    Ok(n)
}

/// Whether bytes for `d` can be read straight into place.
fn direct(d: &Dest) -> bool {
    match d {
        Dest::Region { mem, .. } => mem.host_ptr().is_some(),
        Dest::Discard => true,
        Dest::Device { .. } => true,
        Dest::Buffer(_) => false,
    }
}

/// Reads into the staging buffer, at most `want` more bytes.
fn read_staged(
    stream: &mut TcpStream,
    rbuf: &mut [u8],
    rlen: &mut usize,
    want: usize,
) -> std::io::Result<usize> {
    let end = rbuf.len().min(*rlen + want.max(1));
    let n = stream.read(&mut rbuf[*rlen..end])?;
    *rlen += n;
    Ok(n)
}

/// One `readv` straight into the destinations of `items[next..]`, plus `tail` for the next
/// header. Returns bytes read and how many of them landed in `tail`.
#[allow(clippy::too_many_arguments)]
fn read_batch(
    stream: &mut TcpStream,
    items: &mut [Item],
    next: usize,
    max_items: usize,
    tail: &mut [u8],
    discard: &mut [u8],
    ring: &mut Option<Ring>,
) -> std::io::Result<(usize, usize)> {
    let mut iov: Vec<RawIov> = Vec::with_capacity((items.len() - next + 1).min(MAX_IOV));
    let mut lens: Vec<usize> = Vec::with_capacity(iov.capacity());
    let mut discard = Some(discard);
    // Device items are read into the in-ring, one after the other from its head.
    let mut ring_used = 0usize;
    for item in items[next..].iter_mut() {
        if iov.len() == max_items || item.remaining == 0 {
            break;
        }
        let remaining = item.remaining as usize;
        let slice: Option<RawIov> = match &mut item.dest {
            Dest::Region { mem, offset } => {
                RawIov::of_region(&**mem, *offset, item.remaining as usize)
            }
            // Only one iovec may point at the discard buffer (it is reused).
            Dest::Discard => discard.take().map(|d| {
                let n = d.len().min(item.remaining as usize);
                RawIov::of_slice_mut(&mut d[..n])
            }),
            Dest::Device { via, .. } => match ring.as_ref() {
                Some(r) if r.copies_via(via) => {
                    let n = remaining.min(r.contiguous(ring_used));
                    (n > 0).then(|| {
                        let at = r.ptr(r.head + ring_used as u64);
                        ring_used += n;
                        // `n` bytes from `at` are free room of the staging buffer
                        // (contiguous() counts from after the room given to the items
                        // before): no copy reads them and no other iovec covers them.
                        RawIov::of_raw(at, n)
                    })
                }
                _ => None,
            },
            Dest::Buffer(_) => None,
        };
        let Some(s) = slice else { break };
        let full = s.len() as u64 == item.remaining;
        lens.push(s.len());
        iov.push(s);
        if !full {
            break;
        }
    }
    debug_assert!(
        !iov.is_empty(),
        "callers check that the next item can be read directly"
    );
    iov.push(RawIov::of_slice_mut(tail));
    // SAFETY: each entry covers a checked range of a live destination region (its Arc is
    // in `items`), free room of the staging ring (alive in `ring`), the discard buffer (at
    // most one entry) or `tail`; `destinations_overlap` keeps overlapping destinations of
    // one batch out of the same call, so no two entries overlap.
    let n = unsafe { crate::io::readv(stream.as_raw_fd(), &iov) }?;
    drop(iov);
    let mut left = n;
    for (item, l) in items[next..].iter_mut().zip(lens) {
        if left == 0 {
            break;
        }
        let d = l.min(left);
        item.remaining -= d as u64;
        match &mut item.dest {
            Dest::Region { offset, .. } => *offset += d as u64,
            Dest::Device {
                mem, offset, end, ..
            } => {
                // The bytes are in the ring, in order from its head: copy them into place.
                let r = ring.as_mut().expect("device items were given ring room");
                r.copy_in(mem, *offset, d).map_err(std::io::Error::other)?;
                *offset += d as u64;
                *end = r.head;
            }
            _ => {}
        }
        left -= d;
    }
    Ok((n, left))
}

/// Whether two destinations of a batch share bytes (a peer may send that; we must then not
/// hold slices of both at once).
fn destinations_overlap(items: &[Item]) -> bool {
    let mut ranges: Vec<(u64, u64)> = items
        .iter()
        .filter_map(|i| match &i.dest {
            Dest::Region { mem, offset } if i.remaining > 0 => {
                let start = (mem.host_ptr()?.as_ptr() as u64).checked_add(*offset)?;
                Some((start, start.saturating_add(i.remaining)))
            }
            _ => None,
        })
        .collect();
    ranges.sort_unstable();
    ranges.windows(2).any(|w| w[0].1 > w[1].0)
}

/// Checks a WRITE against the target's registrations before any byte is placed.
fn validate_write(h: &Header, shared: &Shared) -> Result<(Arc<dyn MemoryRegion>, Via), OpError> {
    let t = shared
        .targets
        .get(&h.key)
        .ok_or(OpError::RemoteKeyInvalid(RemoteKey(h.key)))?;
    if !t.access.contains(Access::REMOTE_WRITE) {
        return Err(OpError::PermissionDenied);
    }
    let region_len = t.mem.len() as u64;
    match h.offset.checked_add(h.len) {
        Some(end) if end <= region_len => Ok((t.mem.clone(), t.via.clone())),
        _ => Err(OpError::OutOfBounds {
            offset: h.offset,
            len: h.len,
            region_len,
        }),
    }
}
