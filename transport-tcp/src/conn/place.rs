//! Receive placement: where the bytes of incoming WRITEs and SENDs land. A WRITE is
//! validated (key, permission, bounds) before any byte is placed, then read straight into
//! its registered host region, or into the in-ring for device memory with its copy into
//! place queued at once; a rejected one is swallowed and NACKed. A SEND goes to the oldest
//! posted receive, or to the early-arrival queue. A READ is validated the same way (with
//! REMOTE_READ) and answered from its region; the reply to one of ours lands like a WRITE.

use super::*;
use crate::frame::{CHECKSUM_LEN, CHECKSUM_MAX_LEN, FLAG_CRC};

/// Where incoming payload bytes go.
pub(super) enum Dest {
    Region {
        mem: Arc<dyn MemoryRegion>,
        offset: u64,
    },
    /// A batch entry's bytes in a host region that the batch keeps alive (one `Arc` per
    /// region in `ReadState::BatchPayloads::keep`, not one per entry): where the next byte
    /// goes, inside the range `validate` checked.
    Kept(At),
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
    /// A checksummed WRITE ([`FLAG_CRC`](crate::frame::FLAG_CRC)), boxed: the common
    /// destinations stay small, and a batch moves each of its entries a few times.
    Checked(Box<Checked>),
    Discard,
}

/// A checksummed WRITE's payload and checksum, gathered in `buf`, placed at `offset` of
/// `mem` only once the checksum of `head` and the payload matches.
pub(super) struct Checked {
    mem: Arc<dyn MemoryRegion>,
    offset: u64,
    head: [u8; HEADER_LEN],
    buf: Vec<u8>,
    /// Bytes `buf` will hold: the payload and the checksum.
    whole: usize,
}

impl Dest {
    /// Copies staged bytes in.
    fn put(&mut self, src: &[u8]) -> Result<(), TcpError> {
        match self {
            Dest::Kept(at) => {
                // `at` has room for the entry's remaining bytes (validated range; callers put
                // at most that many), in a region the batch keeps alive.
                // SAFETY: as above; `src` is our read-ahead buffer, never registered memory.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), at.ptr(), src.len()) };
                at.advance(src.len());
            }
            Dest::Region { mem, offset } => {
                if !copy_to_region(&**mem, *offset, src) {
                    mem.write_from_host(*offset, src)
                        .map_err(TcpError::PlacePayload)?;
                }
                *offset += src.len() as u64;
            }
            Dest::Buffer(v) => v.extend_from_slice(src),
            Dest::Checked(c) => {
                let Checked { buf, whole, .. } = &mut **c;
                if buf.capacity() == 0 {
                    // Its payload and checksum, at once (made when its first bytes come,
                    // so a batch holds one such buffer at a time).
                    buf.reserve_exact(*whole);
                }
                buf.extend_from_slice(src)
            }
            Dest::Device { .. } => return Err(TcpError::DeviceBytesNotStaged),
            Dest::Discard => {}
        }
        Ok(())
    }
}

/// What to do when a payload is complete.
pub(super) enum Finish {
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
    /// The reply to one of our READs: complete once its bytes are in place.
    ReadReply(Inflight),
    /// A peer's READ inside a batch: served when its turn comes (after the entries before
    /// it), so that answers stay in request order.
    Serve(Header),
}

/// One WRITE of a batch being received.
pub(super) struct Item {
    pub(super) dest: Dest,
    pub(super) remaining: u64,
    pub(super) finish: Finish,
}

impl Conn {
    /// Validates one WRITE of a batch.
    ///
    /// With `keep` (an entry of a batch), a WRITE into host memory holds its region through
    /// `keep`, which holds each region once: no reference count is touched per entry.
    pub(super) fn batch_item(
        &mut self,
        h: &Header,
        shared: &Shared,
        keep: Option<&mut Vec<Arc<dyn MemoryRegion>>>,
    ) -> Result<Item, TcpError> {
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
        let checked = h.flags & FLAG_CRC != 0;
        if checked && h.len > CHECKSUM_MAX_LEN {
            return Err(TcpError::TooLong {
                op: Op::Write,
                len: h.len,
                limit: CHECKSUM_MAX_LEN,
            });
        }
        // A checksummed payload is followed by its checksum.
        let remaining = h.len + if checked { CHECKSUM_LEN } else { 0 };
        let valid = validate(h, shared, Access::REMOTE_WRITE);
        if let Ok((mem, _)) = valid
            && !checked
            && let Some(keep) = keep
            && let Some(at) = At::of(&**mem, h.offset, h.len)
        {
            keep_once(keep, mem);
            return Ok(Item {
                dest: Dest::Kept(at),
                remaining: h.len,
                finish: Finish::Write {
                    imm: h.imm(),
                    len: h.len,
                },
            });
        }
        Ok(match valid {
            Ok((mem, _)) if checked => Item {
                dest: Dest::Checked(Box::new(Checked {
                    mem: mem.clone(),
                    offset: h.offset,
                    head: h.encode(),
                    buf: Vec::new(),
                    whole: remaining as usize,
                })),
                remaining,
                finish: Finish::Write {
                    imm: h.imm(),
                    len: h.len,
                },
            },
            Ok((mem, via)) => Item {
                dest: if mem.host_ptr().is_some() {
                    Dest::Region {
                        mem: mem.clone(),
                        offset: h.offset,
                    }
                } else {
                    // The ring is made by the first device WRITE, even an empty one: the
                    // engine's warm-up pays for the pinned allocation, not the first transfer.
                    if self.in_ring.is_none() {
                        Ring::ensure(&mut self.in_ring, via)?;
                    }
                    Dest::Device {
                        mem: mem.clone(),
                        offset: h.offset,
                        via: via.clone(),
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
                TransportStats::add(&shared.stats.refused_requests, 1);
                if self.discard.is_empty() && remaining > 0 {
                    self.discard = vec![0u8; DISCARD].into_boxed_slice();
                }
                Item {
                    dest: Dest::Discard,
                    remaining,
                    finish: Finish::Rejected {
                        err,
                        wr_id: h.wr_id,
                    },
                }
            }
        })
    }

    /// Starts receiving a SEND's payload; false if it must wait for a receive. A
    /// `credited` SEND (see `credit`) has its room in the early-arrival queue already, and
    /// never waits.
    pub(super) fn start_send(&mut self, h: Header, credited: bool, shared: &mut Shared) -> bool {
        let imm = h.imm();
        if let Some(r) = shared.recv.take_recv() {
            if credited {
                // Its room in the queue is not needed: it can be granted again.
                shared.early.give(1, h.len);
            }
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
        // Room in the early-arrival queue, reserved until the bytes are here (`early`
        // bounds the queue; `recv`'s own count is unbounded and only keeps its books).
        if !credited && !shared.early.take(1, h.len) {
            self.rstate = ReadState::SendWaiting(h);
            return false;
        }
        shared.recv.reserve(h.len as usize);
        self.rstate = ReadState::Payload {
            dest: Dest::Buffer(Vec::with_capacity(h.len as usize)),
            remaining: h.len,
            finish: Finish::Unexpected { imm, len: h.len },
        };
        true
    }

    pub(super) fn finish(
        &mut self,
        dest: Dest,
        finish: Finish,
        shared: &mut Shared,
    ) -> Result<(), TcpError> {
        match finish {
            Finish::Write { imm, len } => {
                if let Dest::Checked(c) = &dest
                    && !self.place_checked(&c.mem, c.offset, &c.head, &c.buf, len, shared)?
                {
                    return Ok(());
                }
                count_received(shared, 1, len);
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
                self.answer(until, Answer::Ack, event, shared);
            }
            Finish::Recv { recv, imm, len } => {
                self.answer(None, Answer::Ack, None, shared);
                shared.completions.push(Completion {
                    wr_id: recv.wr_id,
                    op: OpKind::Recv,
                    result: Ok(len),
                    peer: Some(self.peer),
                    imm,
                });
            }
            Finish::Unexpected { imm, .. } => {
                self.answer(None, Answer::Ack, None, shared);
                let Dest::Buffer(data) = dest else {
                    unreachable!("unexpected SENDs go to a buffer")
                };
                // A receive posted while this message was arriving is its receive: matched
                // now, before the next SEND of this connection can take it.
                shared.arrived(EarlyArrival {
                    peer: Some(self.peer),
                    imm,
                    data,
                });
            }
            Finish::Hello => {
                let Dest::Buffer(data) = dest else {
                    unreachable!("HELLO goes to a buffer")
                };
                // Its length was checked against its version's fixed part.
                self.hello = Some(self.on_hello_payload(&data));
            }
            Finish::Rejected { err, wr_id } => self.nack(&err, wr_id, shared),
            Finish::Dropped => {}
            Finish::Serve(h) => self.serve_read(&h, shared)?,
            Finish::ReadReply(op) => {
                self.answered += 1;
                let done = Completion {
                    wr_id: op.wr_id,
                    op: op.op,
                    result: Ok(op.len),
                    peer: Some(self.peer),
                    imm: None,
                };
                match dest {
                    // Reported once the copies into device memory have completed (and
                    // after the answers held before it).
                    Dest::Device { end, .. } => {
                        self.answer(Some(end), Answer::ReadDone(done), None, shared)
                    }
                    _ if self.held.is_empty() => shared.completions.push(done),
                    _ => self.answer(None, Answer::ReadDone(done), None, shared),
                }
            }
        }
        Ok(())
    }

    /// Places a checksummed WRITE's payload if its checksum matches (true); else counts
    /// and NACKs it, placing nothing (false).
    fn place_checked(
        &mut self,
        mem: &Arc<dyn MemoryRegion>,
        offset: u64,
        head: &[u8; HEADER_LEN],
        buf: &[u8],
        len: u64,
        shared: &mut Shared,
    ) -> Result<bool, TcpError> {
        if buf.len() as u64 != len + CHECKSUM_LEN {
            return Err(TcpError::ChecksumMissing {
                got: buf.len() as u64,
                len,
            });
        }
        let (payload, sum) = buf.split_at(len as usize);
        let want = u32::from_le_bytes(sum.try_into().expect("4 bytes, checked above"));
        let got = crc32c::crc32c_append(crc32c::crc32c(head), payload);
        if got != want {
            let wr_id = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
            tracing::warn!(peer = %self.peer, offset, len, "WRITE refused: checksum mismatch");
            TransportStats::add(&shared.stats.checksum_mismatches, 1);
            TransportStats::add(&shared.stats.refused_requests, 1);
            self.nack(&OpError::ChecksumMismatch, wr_id, shared);
            return Ok(false);
        }
        if !copy_to_region(&**mem, offset, payload) {
            // Memory the CPU cannot address: one synchronous copy (checksums are a mode
            // for integrity, not speed).
            mem.write_from_host(offset, payload)
                .map_err(TcpError::PlacePayload)?;
        }
        Ok(true)
    }

    /// Serves a peer's READ: validated (key, bounds, REMOTE_READ) before any byte leaves,
    /// then answered in request order with a READ_REPLY sent straight from the registered
    /// region (device memory through the out-ring), or with a NACK.
    pub(super) fn serve_read(&mut self, h: &Header, shared: &mut Shared) -> Result<(), TcpError> {
        if h.len > shared.max_msg_size {
            return Err(TcpError::TooLong {
                op: Op::Read,
                len: h.len,
                limit: shared.max_msg_size,
            });
        }
        match validate(h, shared, Access::REMOTE_READ) {
            Ok((mem, via)) => {
                let (mem, via) = (mem.clone(), via.clone());
                let len = h.len as usize;
                let payload = if mem.host_ptr().is_some() {
                    Payload::Region {
                        mem,
                        offset: h.offset,
                        len,
                    }
                } else {
                    Payload::Device {
                        mem,
                        offset: h.offset,
                        len,
                        via,
                        staged: None,
                        assigned: 0,
                    }
                };
                TransportStats::add(&shared.stats.served_read_bytes, h.len);
                let mut reply = Header::new(Op::ReadReply, h.len);
                reply.wr_id = h.wr_id;
                self.answer(None, Answer::Reply(reply, payload), None, shared);
            }
            Err(err) => {
                tracing::debug!(peer = %self.peer, error = %err, "rejected READ");
                TransportStats::add(&shared.stats.refused_requests, 1);
                self.nack(&err, h.wr_id, shared);
            }
        }
        Ok(())
    }

    /// Starts placing the reply to the READ at the front of the requests outstanding.
    pub(super) fn start_read_reply(&mut self, h: &Header) -> Result<(), TcpError> {
        let item = self.reply_item(h)?;
        self.rstate = ReadState::Payload {
            dest: item.dest,
            remaining: item.remaining,
            finish: item.finish,
        };
        Ok(())
    }

    /// A peer's READ as an entry of a batch: no payload, served in its turn.
    pub(super) fn read_item(&self, h: &Header) -> Result<Item, TcpError> {
        if h.flags != 0 {
            return Err(TcpError::UnexpectedFlags {
                op: h.op,
                flags: h.flags,
            });
        }
        Ok(Item {
            dest: Dest::Discard,
            remaining: 0,
            finish: Finish::Serve(*h),
        })
    }

    /// Where the reply to the READ at the front of the requests outstanding lands (taken
    /// off the front: a batch that fails gives it back, see `unpop_replies`).
    pub(super) fn reply_item(&mut self, h: &Header) -> Result<Item, TcpError> {
        if h.flags != 0 {
            return Err(TcpError::UnexpectedFlags {
                op: h.op,
                flags: h.flags,
            });
        }
        let asked = match self.inflight.front() {
            Some(op) if op.read.is_some() => op.len,
            _ => return Err(TcpError::UnexpectedReadReply),
        };
        if h.len != asked {
            return Err(TcpError::ReadReplyLength { got: h.len, asked });
        }
        let op = self.inflight.pop_front().expect("checked above");
        let into = op.read.as_ref().expect("checked above");
        let dest = if into.mem.host_ptr().is_some() {
            Dest::Region {
                mem: into.mem.clone(),
                offset: into.offset,
            }
        } else {
            if self.in_ring.is_none() {
                Ring::ensure(&mut self.in_ring, &into.via)?;
            }
            Dest::Device {
                mem: into.mem.clone(),
                offset: into.offset,
                via: into.via.clone(),
                end: 0,
            }
        };
        Ok(Item {
            dest,
            remaining: h.len,
            finish: Finish::ReadReply(op),
        })
    }

    /// Gives the READs whose replies `items` were to place back to the front of the
    /// requests outstanding, in order (a batch cut short, or refused).
    pub(super) fn unpop_replies(&mut self, items: impl DoubleEndedIterator<Item = Item>) {
        for item in items.rev() {
            if let Finish::ReadReply(op) = item.finish {
                self.inflight.push_front(op);
            }
        }
    }

    /// One entry of a batch: a WRITE, a peer's READ, or the reply to one of ours.
    pub(super) fn batch_entry(
        &mut self,
        h: &Header,
        shared: &Shared,
        keep: &mut Vec<Arc<dyn MemoryRegion>>,
    ) -> Result<Item, TcpError> {
        match h.op {
            Op::Write => self.batch_item(h, shared, Some(keep)),
            Op::Read => self.read_item(h),
            Op::ReadReply => self.reply_item(h),
            op => Err(TcpError::NotAWrite { op }),
        }
    }
}

/// Room in the in-ring for bytes that go to device memory through `via` (0: wait for
/// copies to complete); makes the ring on first use.
pub(super) fn device_room(ring: &mut Option<Ring>, via: &Via) -> Result<usize, TcpError> {
    if !Ring::ensure(ring, via)? {
        return Ok(0);
    }
    Ok(ring.as_ref().map_or(0, |r| r.contiguous(0)))
}

/// Puts bytes already received (in the read-ahead buffer) into `dest`; returns how many it
/// took (fewer than `src.len()` only for device memory, when the in-ring is full).
pub(super) fn place(
    ring: &mut Option<Ring>,
    dest: &mut Dest,
    src: &[u8],
) -> Result<usize, TcpError> {
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

/// Counts `writes` WRITEs of `bytes` in all placed in our regions (the transport's figures).
pub(super) fn count_received(shared: &Shared, writes: u64, bytes: u64) {
    TransportStats::add(&shared.stats.received_bytes, bytes);
    TransportStats::add(&shared.stats.received_writes, writes);
}

/// Whether bytes for `d` can be read straight into place.
pub(super) fn direct(d: &Dest) -> bool {
    match d {
        Dest::Region { mem, .. } => mem.host_ptr().is_some(),
        Dest::Kept(_) | Dest::Discard => true,
        Dest::Device { .. } => true,
        Dest::Buffer(_) | Dest::Checked(_) => false,
    }
}

/// One `readv` straight into the destinations of `items[next..]`, plus `tail` for the next
/// header. Returns bytes read and how many of them landed in `tail`.
///
/// Destinations of one batch may overlap (a peer may send that): `readv` fills its areas
/// in order, so the later entry's bytes are the ones that remain, as when the entries are
/// placed one after the other.
pub(super) fn read_batch(
    stream: &mut TcpStream,
    items: &mut [Item],
    next: usize,
    tail: &mut [u8],
    discard: &mut [u8],
    ring: &mut Option<Ring>,
) -> std::io::Result<Got> {
    let mut iov: Vec<RawIov> = Vec::with_capacity((items.len() - next + 1).min(MAX_IOV));
    let mut lens: Vec<usize> = Vec::with_capacity(iov.capacity());
    let mut discard = Some(discard);
    // Device items are read into the in-ring, one after the other from its head.
    let mut ring_used = 0usize;
    for item in items[next..].iter_mut() {
        if iov.len() == MAX_IOV - 1 || item.remaining == 0 {
            break;
        }
        let remaining = item.remaining as usize;
        let slice: Option<RawIov> = match &mut item.dest {
            Dest::Region { mem, offset } => {
                RawIov::of_region(&**mem, *offset, item.remaining as usize)
            }
            Dest::Kept(at) => Some(RawIov::of_raw(at.ptr(), remaining)),
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
            Dest::Buffer(_) | Dest::Checked(_) => None,
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
    let asked: usize = iov.iter().map(RawIov::len).sum();
    // SAFETY: each entry covers a checked range of a live destination region (its Arc is
    // in `items`, or for `Dest::Kept` in the batch's `keep`), free room of the staging ring (alive in `ring`), the discard buffer (at
    // most one entry) or `tail`; entries overlap one another only inside registered regions
    // (a peer's overlapping destinations), never our own buffers.
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
            Dest::Kept(at) => at.advance(d),
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
    Ok(Got {
        n,
        short: n < asked,
        tail: left,
    })
}

/// What one read from the socket gave.
pub(super) struct Got {
    /// Bytes read.
    pub n: usize,
    /// Fewer than asked for: the socket had no more at that moment, so another read now
    /// would most likely fail with `WouldBlock` (a system call for nothing).
    pub short: bool,
    /// Of `n`, the bytes that went into the connection's read buffer (for `read_batch`,
    /// its `tail`: the start of the next header).
    pub tail: usize,
}

/// Checks a WRITE (`need` = REMOTE_WRITE) or a READ (REMOTE_READ) against the target's
/// registrations before any byte is placed or leaves.
pub(super) fn validate<'s>(
    h: &Header,
    shared: &'s Shared,
    need: Access,
) -> Result<(&'s Arc<dyn MemoryRegion>, &'s Via), OpError> {
    let t = shared
        .targets
        .get(&h.key)
        .ok_or_else(|| OpError::RemoteKeyInvalid(RemoteKey(h.key)))?;
    if !t.access.contains(need) {
        return Err(OpError::PermissionDenied);
    }
    let region_len = t.mem.len() as u64;
    match h.offset.checked_add(h.len) {
        Some(end) if end <= region_len => Ok((&t.mem, &t.via)),
        _ => Err(OpError::OutOfBounds {
            offset: h.offset,
            len: h.len,
            region_len,
        }),
    }
}
