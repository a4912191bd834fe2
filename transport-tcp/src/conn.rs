//! One TCP connection ("rail"): an outgoing frame queue flushed with vectored writes, and an
//! incoming state machine that validates each request before it touches memory.
//!
//! WRITEs leave in batches (see [`Op::Batch`]): the target reads a batch's headers, checks
//! every one, then reads all payloads straight into their destinations with one `readv`.

use crate::frame::{self, HEADER_LEN, Header, MAX_BATCH, Op};
use crate::io::{host_slice, host_slice_mut};
use fabric_core::{
    Access, Completion, MemoryRegion, OpError, OpKind, PeerId, RemoteKey, WorkRequestId,
};
use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
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
/// Received bytes for device memory gathered before they are placed.
const MAX_PLACING: usize = 16 << 20;
/// Largest piece of one device WRITE read in one call, and most device bytes per call.
const DEVICE_CHUNK: usize = 1 << 20;
const DEVICE_READ: usize = 16 << 20;

/// A registered region as the target sees it.
pub(crate) struct TargetRegion {
    pub mem: Arc<dyn MemoryRegion>,
    pub access: Access,
}

/// A posted receive.
pub(crate) struct PostedRecv {
    pub wr_id: WorkRequestId,
    pub mem: Arc<dyn MemoryRegion>,
    pub offset: u64,
    pub cap: u64,
}

/// A SEND that arrived before a receive was posted.
pub(crate) struct Unexpected {
    pub peer: PeerId,
    pub imm: Option<u32>,
    pub data: Vec<u8>,
}

/// State shared by all connections of a transport, that incoming frames act on.
pub(crate) struct Shared {
    pub targets: HashMap<u64, TargetRegion>,
    pub recvs: VecDeque<PostedRecv>,
    pub unexpected: VecDeque<Unexpected>,
    pub unexpected_bytes: usize,
    pub max_unexpected_bytes: usize,
    pub max_unexpected_count: usize,
    pub max_msg_size: u64,
    pub completions: Vec<Completion>,
}

impl Shared {
    /// Delivers early arrivals to posted receives, oldest first, while both exist.
    pub fn match_unexpected(&mut self) {
        while !self.unexpected.is_empty() && !self.recvs.is_empty() {
            let m = self.unexpected.pop_front().expect("non-empty");
            let r = self.recvs.pop_front().expect("non-empty");
            self.unexpected_bytes -= m.data.len();
            self.deliver(r, m.peer, m.imm, &m.data);
        }
    }

    /// Places `data` into a posted receive and reports it.
    pub fn deliver(&mut self, r: PostedRecv, peer: PeerId, imm: Option<u32>, data: &[u8]) {
        let result = if data.len() as u64 > r.cap {
            Err(OpError::Truncated {
                len: data.len() as u64,
                capacity: r.cap,
            })
        } else {
            r.mem
                .write_from_host(r.offset, data)
                .map(|_| data.len() as u64)
                .map_err(|e| OpError::Transport(e.to_string()))
        };
        self.completions.push(Completion {
            wr_id: r.wr_id,
            op: OpKind::Recv,
            result,
            peer: Some(peer),
            imm,
        });
    }
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
    /// Bytes copied out (device memory once resolved, HELLO).
    Owned(Vec<u8>),
    /// Device memory still to be copied out: resolved in batches by `Conn::flush`, so a
    /// batch of GPU pages costs one synchronisation, not one per page.
    Device {
        mem: Arc<dyn MemoryRegion>,
        offset: u64,
        len: usize,
    },
}

impl Payload {
    fn bytes(&self) -> &[u8] {
        match self {
            Payload::None => &[],
            // The range was checked at post time; an empty slice can only mean a bug.
            Payload::Region { mem, offset, len } => {
                host_slice(&**mem, *offset, *len).unwrap_or(&[])
            }
            Payload::Owned(v) => v,
            // Resolved before anything is written; never reached.
            Payload::Device { .. } => &[],
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
}

impl OutFrame {
    /// The frame's bytes from `written` on, as slices, appended to `iov`.
    fn push_iov<'a>(&'a self, iov: &mut Vec<IoSlice<'a>>) -> bool {
        let mut skip = self.written;
        for seg in std::iter::once(&self.head[..]).chain(self.payloads.iter().map(Payload::bytes)) {
            if iov.len() == MAX_IOV {
                return false;
            }
            if skip >= seg.len() {
                skip -= seg.len();
                continue;
            }
            iov.push(IoSlice::new(&seg[skip..]));
            skip = 0;
        }
        true
    }
}

/// A received device WRITE waiting to be placed: region, offset, bytes, and the
/// immediate-data event to report once they are in place.
type Placing = (Arc<dyn MemoryRegion>, u64, Vec<u8>, Option<Completion>);

/// Device payloads of one region waiting to be copied out: (frame, payload, offset, len).
type DeviceReads = (Arc<dyn MemoryRegion>, Vec<(usize, usize, u64, usize)>);

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
    /// A WRITE into memory the CPU cannot address: gathered here, then placed together with
    /// the other writes of the same read (see `Conn::commit_device`).
    Device {
        mem: Arc<dyn MemoryRegion>,
        offset: u64,
        /// Received bytes (`filled` of them); grown as they arrive, never ahead of the peer
        /// by more than one chunk, so a peer's claimed lengths allocate nothing by themselves.
        buf: Vec<u8>,
        filled: usize,
    },
    Buffer(Vec<u8>),
    Discard,
}

impl Dest {
    /// Copies staged bytes in.
    fn put(&mut self, src: &[u8]) -> Result<(), String> {
        match self {
            Dest::Region { mem, offset } => {
                if let Some(dst) = host_slice_mut(&**mem, *offset, src.len()) {
                    dst.copy_from_slice(src);
                } else {
                    mem.write_from_host(*offset, src)
                        .map_err(|e| format!("cannot place payload: {e}"))?;
                }
                *offset += src.len() as u64;
            }
            Dest::Buffer(v) => v.extend_from_slice(src),
            Dest::Device { buf, filled, .. } => {
                let end = *filled + src.len();
                if buf.len() < end {
                    buf.resize(end, 0);
                }
                buf[*filled..end].copy_from_slice(src);
                *filled = end;
            }
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
    /// Device payloads in `out` not yet copied out (see `Payload::Device`).
    device_out: usize,
    /// Received device WRITEs not yet placed, with their immediate-data events.
    placing: Vec<Placing>,
    placing_bytes: usize,
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
            device_out: 0,
            placing: Vec::new(),
            placing_bytes: 0,
            rbuf: vec![0u8; RBUF].into_boxed_slice(),
            rpos: 0,
            rlen: 0,
            rstate: ReadState::Header,
            awaiting_hello,
            hello: None,
            opened: std::time::Instant::now(),
            discard: Vec::new().into_boxed_slice(),
        }
    }

    /// Queues one frame.
    pub fn queue(&mut self, hdr: Header, payload: Payload) {
        self.device_out += matches!(payload, Payload::Device { .. }) as usize;
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
        });
    }

    /// Queues a WRITE, joining the batch at the end of the queue if it has not started.
    pub fn queue_write(&mut self, hdr: Header, payload: Payload) {
        self.device_out += matches!(payload, Payload::Device { .. }) as usize;
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
        });
    }

    /// Whether the reader is held back: a SEND waits for a receive, or the peer does not
    /// read our answers (so reading more would only queue more of them).
    pub fn reads_paused(&self) -> bool {
        matches!(self.rstate, ReadState::SendWaiting(_)) || self.responses > MAX_RESPONSES
    }

    /// Gives back what a frame cut short by a closing connection had taken: the posted
    /// receive it was filling (to the front of the queue, where it came from) and its room
    /// in the early-arrival queue.
    pub fn abandon(&mut self, shared: &mut Shared) {
        if let ReadState::Payload { finish, .. } =
            std::mem::replace(&mut self.rstate, ReadState::Header)
        {
            match finish {
                Finish::Recv { recv, .. } => {
                    shared.recvs.push_front(recv);
                    shared.match_unexpected();
                }
                Finish::Unexpected { len, .. } => shared.unexpected_bytes -= len as usize,
                _ => {}
            }
        }
    }

    /// Writes as much of the queue as the socket takes. `Err` = connection broken.
    pub fn flush(&mut self) -> Result<(), String> {
        self.resolve_device()?;
        self.flush_acks();
        while !self.out.is_empty() {
            let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(64);
            for f in self.out.iter() {
                if !f.push_iov(&mut iov) {
                    break;
                }
            }
            let n = match self.stream.write_vectored(&iov) {
                Ok(0) => return Err("connection closed while writing".into()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("write failed: {e}")),
            };
            drop(iov);
            self.advance(n);
        }
        Ok(())
    }

    fn advance(&mut self, mut n: usize) {
        self.out_bytes -= n;
        while n > 0 {
            let f = self
                .out
                .front_mut()
                .expect("written bytes belong to queued frames");
            let take = (f.total - f.written).min(n);
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

    /// Copies every pending device payload out, one batched call per region.
    fn resolve_device(&mut self) -> Result<(), String> {
        if self.device_out == 0 {
            return Ok(());
        }
        // (region, [(frame, payload, offset, len)]): regions compared by address.
        let mut groups: Vec<DeviceReads> = Vec::new();
        for (fi, f) in self.out.iter().enumerate() {
            for (pi, p) in f.payloads.iter().enumerate() {
                if let Payload::Device { mem, offset, len } = p {
                    match groups.iter_mut().find(|(m, _)| Arc::ptr_eq(m, mem)) {
                        Some((_, v)) => v.push((fi, pi, *offset, *len)),
                        None => groups.push((mem.clone(), vec![(fi, pi, *offset, *len)])),
                    }
                }
            }
        }
        for (mem, parts) in groups {
            let mut bufs: Vec<Vec<u8>> =
                parts.iter().map(|&(_, _, _, len)| vec![0u8; len]).collect();
            let mut io: Vec<(u64, &mut [u8])> = parts
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&(_, _, off, _), b)| (off, &mut b[..]))
                .collect();
            mem.read_many_to_host(&mut io)
                .map_err(|e| format!("cannot copy device memory out: {e}"))?;
            for (&(fi, pi, _, _), b) in parts.iter().zip(bufs) {
                self.out[fi].payloads[pi] = Payload::Owned(b);
            }
        }
        self.device_out = 0;
        Ok(())
    }

    /// Places the gathered device WRITEs, one batched call per region, then reports their
    /// immediate data: a target's event follows its bytes.
    pub fn commit_device(&mut self, shared: &mut Shared) -> Result<(), String> {
        if self.placing.is_empty() {
            return Ok(());
        }
        let placing = std::mem::take(&mut self.placing);
        self.placing_bytes = 0;
        let mut done = vec![false; placing.len()];
        for i in 0..placing.len() {
            if done[i] {
                continue;
            }
            let mem = &placing[i].0;
            let mut parts: Vec<(u64, &[u8])> = Vec::new();
            for (j, p) in placing.iter().enumerate().skip(i) {
                if !done[j] && Arc::ptr_eq(&p.0, mem) {
                    done[j] = true;
                    parts.push((p.1, &p.2[..]));
                }
            }
            mem.write_many_from_host(&parts)
                .map_err(|e| format!("cannot place payload in device memory: {e}"))?;
        }
        shared
            .completions
            .extend(placing.into_iter().filter_map(|p| p.3));
        Ok(())
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

    fn nack(&mut self, err: &OpError, wr_id: u64) {
        self.flush_acks();
        self.queue(frame::nack_for(err, wr_id), Payload::None);
    }

    /// Reads what the socket has (up to about `budget` bytes) and acts on complete frames.
    pub fn read(&mut self, shared: &mut Shared, budget: usize) -> Result<ReadOutcome, String> {
        let r = self.read_frames(shared, budget);
        // Whatever was read for device memory lands before any ACK or event reports it.
        self.commit_device(shared)?;
        r
    }

    fn read_frames(&mut self, shared: &mut Shared, budget: usize) -> Result<ReadOutcome, String> {
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
            if self.reads_paused() || read >= budget {
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
                    match host_slice_mut(&**mem, *offset, *remaining as usize) {
                        Some(direct) => {
                            let direct_len = direct.len();
                            // Only the next header rides along.
                            let mut iov = [
                                IoSliceMut::new(direct),
                                IoSliceMut::new(&mut self.rbuf[..HEADER_LEN]),
                            ];
                            self.stream.read_vectored(&mut iov).inspect(|&n| {
                                let d = n.min(direct_len);
                                *offset += d as u64;
                                *remaining -= d as u64;
                                self.rlen = n - d;
                            })
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
                Ok(0) => return Err("peer closed the connection".into()),
                Ok(n) => read += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return Ok(ReadOutcome::Open);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("read failed: {e}")),
            }
            // A direct read may have completed items or a payload: act on it.
            if let ReadState::BatchPayloads { .. } = self.rstate {
                self.settle_batch(shared)?;
            }
        }
    }

    /// Acts on buffered bytes until a frame is incomplete.
    fn process(&mut self, shared: &mut Shared) -> Result<(), String> {
        loop {
            match &mut self.rstate {
                ReadState::Header => {
                    if self.rlen - self.rpos < HEADER_LEN {
                        return Ok(());
                    }
                    let raw: &[u8; HEADER_LEN] = self.rbuf[self.rpos..self.rpos + HEADER_LEN]
                        .try_into()
                        .expect("header length");
                    let h = Header::decode(raw).map_err(|e| format!("malformed frame: {e}"))?;
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
                        let h = Header::decode(raw)
                            .map_err(|e| format!("malformed batch entry: {e}"))?;
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
                    item.dest.put(&self.rbuf[self.rpos..self.rpos + take])?;
                    item.remaining -= take as u64;
                    self.rpos += take;
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
                        dest.put(&self.rbuf[self.rpos..self.rpos + take])?;
                        self.rpos += take;
                        *remaining -= take as u64;
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
    fn settle_batch(&mut self, shared: &mut Shared) -> Result<(), String> {
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
    fn batch_item(&mut self, h: &Header, shared: &Shared) -> Result<Item, String> {
        if h.op != Op::Write {
            return Err(format!("{:?} frame inside a batch", h.op));
        }
        if h.len > shared.max_msg_size {
            return Err(format!(
                "WRITE of {} bytes exceeds the {}-byte limit",
                h.len, shared.max_msg_size
            ));
        }
        Ok(match validate_write(h, shared) {
            Ok(mem) => Item {
                dest: if mem.host_ptr().is_some() {
                    Dest::Region {
                        mem,
                        offset: h.offset,
                    }
                } else {
                    Dest::Device {
                        mem,
                        offset: h.offset,
                        buf: Vec::new(),
                        filled: 0,
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

    fn on_header(&mut self, h: Header, shared: &mut Shared) -> Result<(), String> {
        if self.awaiting_hello && h.op != Op::Hello {
            return Err(format!("{:?} frame before HELLO", h.op));
        }
        match h.op {
            Op::Hello => {
                if !self.awaiting_hello {
                    return Err("unexpected HELLO".into());
                }
                if h.len > MAX_HELLO || h.len < 12 {
                    return Err(format!("HELLO of {} bytes", h.len));
                }
                // Checked before anything else of the peer is read (the token is never logged).
                if let Some(want) = self.auth
                    && !crate::auth::matches(&want, h.key, h.offset)
                {
                    return Err(
                        "authentication failed: the HELLO carries no token or a wrong one".into(),
                    );
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
                    return Err(format!("batch of {} writes (at most {MAX_BATCH})", h.len));
                }
                self.rstate = ReadState::BatchHeaders {
                    count: h.len as usize,
                };
            }
            Op::Send => {
                if h.len > shared.max_msg_size {
                    return Err(format!(
                        "SEND of {} bytes exceeds the {}-byte limit",
                        h.len, shared.max_msg_size
                    ));
                }
                self.rstate = ReadState::SendWaiting(h);
            }
            Op::Ack => {
                if h.len > self.inflight.len() as u64 {
                    return Err(format!(
                        "ACK for {} requests, {} outstanding",
                        h.len,
                        self.inflight.len()
                    ));
                }
                for _ in 0..h.len {
                    let op = self.inflight.pop_front().expect("checked above");
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
                let op = self
                    .inflight
                    .pop_front()
                    .ok_or("NACK with no request outstanding")?;
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
        if let Some(r) = shared.recvs.pop_front() {
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
                self.nack(&err, h.wr_id);
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
        let fits = shared.unexpected.len() < shared.max_unexpected_count
            && shared.unexpected_bytes + h.len as usize <= shared.max_unexpected_bytes;
        if !fits {
            self.rstate = ReadState::SendWaiting(h);
            return false;
        }
        shared.unexpected_bytes += h.len as usize;
        self.rstate = ReadState::Payload {
            dest: Dest::Buffer(Vec::with_capacity(h.len as usize)),
            remaining: h.len,
            finish: Finish::Unexpected { imm, len: h.len },
        };
        true
    }

    fn finish(&mut self, dest: Dest, finish: Finish, shared: &mut Shared) -> Result<(), String> {
        match finish {
            Finish::Write { imm, len } => {
                self.pending_acks += 1;
                let event = imm.map(|imm| Completion {
                    wr_id: WorkRequestId(0),
                    op: OpKind::RemoteWrite,
                    result: Ok(len),
                    peer: Some(self.peer),
                    imm: Some(imm),
                });
                if let Dest::Device {
                    mem,
                    offset,
                    mut buf,
                    filled,
                } = dest
                {
                    buf.truncate(filled);
                    // Reported once the bytes are in device memory (commit_device).
                    self.placing_bytes += buf.len();
                    self.placing.push((mem, offset, buf, event));
                    if self.placing_bytes >= MAX_PLACING {
                        self.commit_device(shared)?;
                    }
                } else if let Some(e) = event {
                    shared.completions.push(e);
                }
            }
            Finish::Recv { recv, imm, len } => {
                self.pending_acks += 1;
                shared.completions.push(Completion {
                    wr_id: recv.wr_id,
                    op: OpKind::Recv,
                    result: Ok(len),
                    peer: Some(self.peer),
                    imm,
                });
            }
            Finish::Unexpected { imm, .. } => {
                self.pending_acks += 1;
                let Dest::Buffer(data) = dest else {
                    unreachable!("unexpected SENDs go to a buffer")
                };
                shared.unexpected.push_back(Unexpected {
                    peer: self.peer,
                    imm,
                    data,
                });
                // A receive posted while this message was arriving is its receive: match
                // now, before the next SEND of this connection can take it.
                shared.match_unexpected();
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
            Finish::Rejected { err, wr_id } => self.nack(&err, wr_id),
            Finish::Dropped => {}
        }
        Ok(())
    }
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
fn read_batch(
    stream: &mut TcpStream,
    items: &mut [Item],
    next: usize,
    max_items: usize,
    tail: &mut [u8],
    discard: &mut [u8],
) -> std::io::Result<(usize, usize)> {
    let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity((items.len() - next + 1).min(MAX_IOV));
    let mut lens: Vec<usize> = Vec::with_capacity(iov.capacity());
    let mut discard = Some(discard);
    // Device items are read into buffers grown here: at most this much per call.
    let mut device_budget = DEVICE_READ;
    for item in items[next..].iter_mut() {
        if iov.len() == max_items || item.remaining == 0 {
            break;
        }
        let remaining = item.remaining as usize;
        let slice: Option<&mut [u8]> = match &mut item.dest {
            Dest::Region { mem, offset } => {
                host_slice_mut(&**mem, *offset, item.remaining as usize)
            }
            // Only one iovec may point at the discard buffer (it is reused).
            Dest::Discard => discard.take().map(|d| {
                let n = d.len().min(item.remaining as usize);
                &mut d[..n]
            }),
            Dest::Device { buf, filled, .. } => {
                let want = remaining.min(DEVICE_CHUNK);
                if want > device_budget && !iov.is_empty() {
                    None
                } else {
                    device_budget = device_budget.saturating_sub(want);
                    if buf.len() < *filled + want {
                        buf.resize(*filled + want, 0);
                    }
                    Some(&mut buf[*filled..*filled + want])
                }
            }
            Dest::Buffer(_) => None,
        };
        let Some(s) = slice else { break };
        let full = s.len() as u64 == item.remaining;
        lens.push(s.len());
        iov.push(IoSliceMut::new(s));
        if !full {
            break;
        }
    }
    debug_assert!(
        !iov.is_empty(),
        "callers check that the next item can be read directly"
    );
    iov.push(IoSliceMut::new(tail));
    let n = stream.read_vectored(&mut iov)?;
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
            Dest::Device { filled, .. } => *filled += d,
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
fn validate_write(h: &Header, shared: &Shared) -> Result<Arc<dyn MemoryRegion>, OpError> {
    let t = shared
        .targets
        .get(&h.key)
        .ok_or(OpError::RemoteKeyInvalid(RemoteKey(h.key)))?;
    if !t.access.contains(Access::REMOTE_WRITE) {
        return Err(OpError::PermissionDenied);
    }
    let region_len = t.mem.len() as u64;
    match h.offset.checked_add(h.len) {
        Some(end) if end <= region_len => Ok(t.mem.clone()),
        _ => Err(OpError::OutOfBounds {
            offset: h.offset,
            len: h.len,
            region_len,
        }),
    }
}
