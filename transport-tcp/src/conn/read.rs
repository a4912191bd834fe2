//! The incoming state machine of a connection: reads what the socket has (straight into
//! place where it can), decodes headers, and walks each frame (HELLO, WRITE, BATCH, SEND,
//! READ, READ_REPLY, ACK, NACK) to its end; [`place`](super::place) says where payload bytes go.

use super::place::{Dest, Got, Item, count_received, device_room, direct, place, read_batch};
use super::*;
use crate::frame::ACK_CREDIT;

pub(super) enum ReadState {
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
        /// The host regions the batch's `Dest::Kept` entries write into, each once: held
        /// (never read) so that they outlive every entry.
        #[allow(dead_code)]
        keep: Vec<Arc<dyn MemoryRegion>>,
        next: usize,
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

impl Conn {
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
    pub(super) fn stalled(&mut self) -> Result<bool, TcpError> {
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

    pub(super) fn read_frames(
        &mut self,
        shared: &mut Shared,
        budget: usize,
    ) -> Result<ReadOutcome, TcpError> {
        let mut read = 0usize;
        // The last read was short: the socket was empty, and trying again at once would
        // only fail (the next poll, or the wait's readiness, picks up what comes). A
        // connection that places into device memory (it has a staging ring) reads on until
        // the socket says `WouldBlock`: its copies into place are queued per read and
        // started once per call, and larger batches of them move GPU memory faster (H200:
        // stopping early there took 8 rails of GPU memory over tcp from 151-160 to 127-141
        // Gbps).
        let mut drained = false;
        loop {
            self.process(shared)?;
            if let Some((rail, instance, address)) = self.hello.take() {
                return Ok(ReadOutcome::Hello {
                    rail,
                    instance,
                    address,
                });
            }
            if drained || self.reads_paused() || read >= budget || self.stalled()? {
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
                    // Bytes gathered before they are placed (Dest::put). Checksummed
                    // payloads are all gathered so: read as much as the buffer takes.
                    let want = match items[*next].dest {
                        Dest::Checked(_) => RBUF,
                        _ => (items[*next].remaining as usize).saturating_add(HEADER_READ),
                    };
                    read_staged(&mut self.stream, &mut self.rbuf, &mut self.rlen, want)
                }
                ReadState::BatchPayloads { items, next, .. } => {
                    debug_assert_eq!(self.rlen, 0);
                    read_batch(
                        &mut self.stream,
                        items,
                        *next,
                        &mut self.rbuf[..HEADER_LEN],
                        &mut self.discard,
                        &mut self.in_ring,
                    )
                    .inspect(|r| self.rlen = r.tail)
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
                            unsafe { crate::io::readv(self.stream.as_raw_fd(), &iov) }.map(|n| {
                                let d = n.min(direct_len);
                                *offset += d as u64;
                                *remaining -= d as u64;
                                self.rlen = n - d;
                                Got {
                                    n,
                                    short: n < direct_len + HEADER_LEN,
                                    tail: n - d,
                                }
                            })
                        }
                        None => read_staged(&mut self.stream, &mut self.rbuf, &mut self.rlen, RBUF),
                    }
                }
                ReadState::BatchHeaders { count } => {
                    let want = (*count * HEADER_LEN).saturating_sub(self.rlen).max(1);
                    read_staged(&mut self.stream, &mut self.rbuf, &mut self.rlen, want)
                }
                ReadState::Payload {
                    dest: Dest::Checked(_),
                    ..
                } => read_staged(&mut self.stream, &mut self.rbuf, &mut self.rlen, RBUF),
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
                Ok(Got { n: 0, .. }) => return Err(TcpError::PeerClosed),
                Ok(Got { n, short, .. }) => {
                    drained = short && self.in_ring.is_none();
                    read += n;
                    // Progress for `check_answers`: a READ's reply may take long to arrive.
                    self.received = self.received.wrapping_add(n as u64);
                }
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
    pub(super) fn process(&mut self, shared: &mut Shared) -> Result<(), TcpError> {
        loop {
            if self.hello.is_some() {
                // The frames after a HELLO wait until the transport has named the peer, so
                // that what they report carries its id.
                return Ok(());
            }
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
                    if !self.start_send(h, false, shared) {
                        return Ok(());
                    }
                }
                ReadState::BatchHeaders { count } => {
                    let count = *count;
                    if self.rlen - self.rpos < count * HEADER_LEN {
                        return Ok(());
                    }
                    let mut items = Vec::with_capacity(count);
                    let mut keep = Vec::new();
                    for i in 0..count {
                        let at = self.rpos + i * HEADER_LEN;
                        let raw: &[u8; HEADER_LEN] = self.rbuf[at..at + HEADER_LEN]
                            .try_into()
                            .expect("header length");
                        let entry = Header::decode(raw)
                            .map_err(TcpError::MalformedBatchEntry)
                            .and_then(|h| self.batch_entry(&h, shared, &mut keep));
                        match entry {
                            Ok(item) => items.push(item),
                            Err(e) => {
                                // Replies taken off the requests go back, to fail with them.
                                self.unpop_replies(items.into_iter());
                                return Err(e);
                            }
                        }
                    }
                    self.rpos += count * HEADER_LEN;
                    self.rstate = ReadState::BatchPayloads {
                        items,
                        keep,
                        next: 0,
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
    ///
    /// A run of plain WRITEs into host memory (no immediate data, no answer held back) is
    /// finished in place: an ACK each and one update of the counters for the run, what
    /// [`finish`](Self::finish) does for each of them one by one.
    pub(super) fn settle_batch(&mut self, shared: &mut Shared) -> Result<(), TcpError> {
        loop {
            let ReadState::BatchPayloads { items, next, .. } = &mut self.rstate else {
                return Ok(());
            };
            if self.held.is_empty() {
                let (mut writes, mut bytes) = (0u64, 0u64);
                while let Some(Item {
                    dest: Dest::Kept(_),
                    remaining: 0,
                    finish: Finish::Write { imm: None, len },
                }) = items.get(*next)
                {
                    writes += 1;
                    bytes += len;
                    *next += 1;
                }
                if writes > 0 {
                    self.pending_acks += writes;
                    count_received(shared, writes, bytes);
                }
            }
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

    pub(super) fn on_header(&mut self, h: Header, shared: &mut Shared) -> Result<(), TcpError> {
        if self.awaiting_hello() && h.op != Op::Hello {
            return Err(TcpError::BeforeHello { op: h.op });
        }
        if self.awaiting_challenge() && h.op != Op::Challenge {
            return Err(TcpError::BeforeChallenge { op: h.op });
        }
        if self.opening() && !self.awaiting_challenge() && h.op != Op::Proof {
            if h.op == Op::Nack && h.code == frame::code::AUTH {
                return Err(TcpError::RefusedByTarget);
            }
            return Err(TcpError::BeforeProof { op: h.op });
        }
        // Only WRITEs carry checksums.
        if h.flags & crate::frame::FLAG_CRC != 0 && h.op != Op::Write {
            return Err(TcpError::UnexpectedFlags {
                op: h.op,
                flags: h.flags,
            });
        }
        match h.op {
            Op::Hello => {
                if !self.awaiting_hello() {
                    return Err(TcpError::UnexpectedHello);
                }
                // Checked before anything else of the peer is read (the token is never logged).
                self.check_hello(&h).inspect_err(|_| {
                    // A peer of version 5 is told, in place of the PROOF.
                    self.refused_hello = h.code >= frame::MUTUAL_VERSION;
                })?;
                self.on_hello_version(h.code, shared)?;
                if h.len > MAX_HELLO || h.len < frame::hello_min_len(h.code) {
                    return Err(TcpError::HelloLength(h.len));
                }
                self.rstate = ReadState::Payload {
                    dest: Dest::Buffer(Vec::with_capacity(h.len as usize)),
                    remaining: h.len,
                    finish: Finish::Hello,
                };
            }
            Op::Write => {
                let item = self.batch_item(&h, shared, None)?;
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
                if self.charge_send(h.len)? {
                    // Its room is ours already: it never waits.
                    self.start_send(h, true, shared);
                } else {
                    self.rstate = ReadState::SendWaiting(h);
                }
            }
            Op::Read => {
                if h.flags != 0 {
                    return Err(TcpError::UnexpectedFlags {
                        op: h.op,
                        flags: h.flags,
                    });
                }
                self.serve_read(&h, shared)?;
            }
            Op::ReadReply => self.start_read_reply(&h)?,
            Op::Challenge => self.on_challenge(&h)?,
            Op::Proof => self.on_proof(&h)?,
            Op::Ack => {
                if h.len > self.inflight.len() as u64 {
                    return Err(TcpError::AckOverrun {
                        acked: h.len,
                        outstanding: self.inflight.len(),
                    });
                }
                // Only a READ_REPLY (or a NACK) answers a READ: its bytes must be placed.
                if self
                    .inflight
                    .iter()
                    .take(h.len as usize)
                    .any(|op| op.read.is_some())
                {
                    return Err(TcpError::AckForRead);
                }
                for _ in 0..h.len {
                    let op = self.inflight.pop_front().expect("checked above");
                    self.answered += 1;
                    if op.silent {
                        continue;
                    }
                    // The last row of a strided write reports a failure of an earlier one.
                    let result = match self.carried.take() {
                        Some((wr, e)) if wr == op.wr_id => Err(e),
                        _ => Ok(op.len),
                    };
                    shared.completions.push(Completion {
                        wr_id: op.wr_id,
                        op: op.op,
                        result,
                        peer: Some(self.peer),
                        imm: None,
                    });
                }
                if h.code == ACK_CREDIT {
                    self.on_credit(&h, shared);
                }
            }
            Op::Nack => {
                let op = self.inflight.pop_front().ok_or(TcpError::NackOverrun)?;
                self.answered += 1;
                let err = frame::error_of_nack(&h);
                if op.silent {
                    // Kept for the write's last row, which reports the write.
                    if self.carried.is_none() {
                        self.carried = Some((op.wr_id, err));
                    }
                    return Ok(());
                }
                let first = match self.carried.take() {
                    Some((wr, e)) if wr == op.wr_id => e,
                    _ => err,
                };
                shared.completions.push(Completion {
                    wr_id: op.wr_id,
                    op: op.op,
                    result: Err(first),
                    peer: Some(self.peer),
                    imm: None,
                });
            }
        }
        Ok(())
    }
}

/// Reads into the staging buffer, at most `want` more bytes.
pub(super) fn read_staged(
    stream: &mut TcpStream,
    rbuf: &mut [u8],
    rlen: &mut usize,
    want: usize,
) -> std::io::Result<Got> {
    let end = rbuf.len().min(*rlen + want.max(1));
    let asked = end - *rlen;
    let n = stream.read(&mut rbuf[*rlen..end])?;
    *rlen += n;
    Ok(Got {
        n,
        short: n < asked,
        tail: n,
    })
}
