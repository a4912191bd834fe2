//! The outgoing side of a connection: frames queued in order (one header, or a BATCH of
//! WRITE headers followed by their payloads), written with vectored writes as the socket
//! takes them; device payloads are copied into the out-ring as it has room and leave once
//! their copies have completed.

use super::*;

/// What an outgoing frame carries after its header.
pub(crate) enum Payload {
    None,
    /// Bytes of a registered host region (zero copy).
    Region {
        mem: Arc<dyn MemoryRegion>,
        offset: u64,
        len: usize,
    },
    /// Host bytes of a region that the frame carrying them holds (`OutFrame::keep`): a
    /// WRITE's source, with no reference count of its own.
    Kept {
        at: At,
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
            Payload::Kept { at, len } => {
                let rest = len.checked_sub(skip)?;
                // In bounds: `skip <= len` (checked above) of the checked range at `at`.
                Some(RawIov::of_raw(at.ptr().wrapping_add(skip), rest))
            }
            Payload::Owned(v) => v.get(skip..).map(RawIov::of_slice),
            // Sent from the staging ring (OutFrame::push_iov).
            Payload::Device { .. } => None,
        }
    }
    pub(super) fn len(&self) -> usize {
        match self {
            Payload::None => 0,
            Payload::Region { len, .. }
            | Payload::Kept { len, .. }
            | Payload::Device { len, .. } => *len,
            Payload::Owned(v) => v.len(),
        }
    }
}

/// A write that handed the socket at least this many bytes is followed by a yield of the
/// core (`sched_yield`), so that a thread woken by those bytes on the same core (the
/// target's rail reading them, when both ends share cores, or an application thread) runs
/// now, while they are still in the core's cache, instead of after the rest of this rail's
/// time slice. Without it, two rails of 4 KiB pages and their two readers on 2 cores took
/// turns of about 0.5 ms, 1-2 MB each (the readers copied out of a cache the writer had
/// moved on from), where raw sockets that block take turns of about 10 µs; with it, a
/// reader's turn comes within about 0.2 ms. A thread with a core to itself gets it back at
/// once; [`YIELD_EVERY`] bounds what those calls cost it.
const YIELD_AFTER: usize = 64 * 1024;

/// A thread yields at most once in this long ([`offer_core`]): a rail writing small pages
/// at tens of Gbit/s on a core of its own makes tens of thousands of large writes a second,
/// and a yield for each was a system call each for nothing; one every 50 µs is a small
/// part of the turns it is there to shorten.
const YIELD_EVERY: std::time::Duration = std::time::Duration::from_micros(50);

/// Yields the core (see [`YIELD_AFTER`]) unless this thread did less than [`YIELD_EVERY`]
/// ago.
fn offer_core() {
    thread_local! {
        static LAST: std::cell::Cell<Option<std::time::Instant>> =
            const { std::cell::Cell::new(None) };
    }
    let now = std::time::Instant::now();
    LAST.with(|last| {
        if last
            .get()
            .is_none_or(|t| now.duration_since(t) >= YIELD_EVERY)
        {
            last.set(Some(now));
            std::thread::yield_now();
        }
    });
}

/// Written batch frames a connection keeps for reuse (see `Conn::spare`).
pub(super) const SPARE_FRAMES: usize = 2;

/// A frame on its way out: header bytes, then payloads.
pub(crate) struct OutFrame {
    /// One header, or a BATCH header followed by its WRITE headers.
    pub(super) head: Vec<u8>,
    pub(super) payloads: Vec<Payload>,
    /// The regions of the frame's `Payload::Kept` payloads, each once in a row.
    pub(super) keep: Vec<Arc<dyn MemoryRegion>>,
    /// WRITEs in this batch (0: not a batch).
    pub(super) batch: usize,
    /// An ACK, NACK or READ_REPLY (counted in `Conn::responses`).
    pub(super) response: bool,
    /// READ_REPLYs in this batch (each counted in `Conn::responses`).
    pub(super) replies: usize,
    pub(super) total: usize,
    /// Bytes already written.
    pub(super) written: usize,
    /// Device payloads, and how many of them still lack room in the staging ring.
    pub(super) device: usize,
    pub(super) unstaged: usize,
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

impl Conn {
    /// Queues one frame.
    pub fn queue(&mut self, hdr: Header, payload: Payload) {
        let device = matches!(payload, Payload::Device { .. }) as usize;
        self.unstaged += device;
        let total = HEADER_LEN + payload.len();
        self.out_bytes += total;
        let response = matches!(hdr.op, Op::Ack | Op::Nack | Op::ReadReply);
        self.responses += response as usize;
        self.out.push_back(OutFrame {
            head: hdr.encode().to_vec(),
            payloads: vec![payload],
            keep: Vec::new(),
            batch: 0,
            response,
            replies: 0,
            total,
            written: 0,
            device,
            unstaged: device,
        });
    }

    /// Queues one frame ahead of all others: the HELLO, once the CHALLENGE has come, in
    /// front of the requests posted meanwhile (none of which has left: see `flush`).
    pub(super) fn queue_first(&mut self, hdr: Header, payload: Payload) {
        debug_assert!(self.out.iter().all(|f| f.written == 0));
        self.queue(hdr, payload);
        let f = self.out.pop_back().expect("queued just now");
        self.out.push_front(f);
    }

    /// Queues a WRITE (or a READ, or a READ_REPLY), joining the batch at the end of the
    /// queue if it has not started.
    pub fn queue_write(&mut self, hdr: Header, payload: Payload) {
        self.queue_batched(hdr, payload, None);
    }

    /// Queues a WRITE of `len` host bytes at `at` of `mem` (checked by the caller), which
    /// the batch frame carrying it holds: one reference count per region and frame, not
    /// per WRITE.
    pub(super) fn queue_write_kept(
        &mut self,
        hdr: Header,
        mem: &Arc<dyn MemoryRegion>,
        at: At,
        len: usize,
    ) {
        self.queue_batched(hdr, Payload::Kept { at, len }, Some(mem));
    }

    /// Queues a WRITE whose payload is the host rows at `ats` of `mem`, `len` bytes each,
    /// back to back (the header says their sum): each row is a payload of the frame after
    /// the header's place, as a checksum trailer is.
    pub(super) fn queue_write_kept_rows(
        &mut self,
        hdr: Header,
        mem: &Arc<dyn MemoryRegion>,
        ats: Vec<At>,
        len: usize,
    ) {
        let mut ats = ats.into_iter();
        let Some(first) = ats.next() else {
            return;
        };
        self.queue_batched(hdr, Payload::Kept { at: first, len }, Some(mem));
        if let Some(f) = self.out.back_mut() {
            for at in ats {
                f.payloads.push(Payload::Kept { at, len });
                f.total += len;
                self.out_bytes += len;
            }
        }
    }

    /// [`queue_write`](Self::queue_write), with the region that the frame must hold for a
    /// `Payload::Kept`.
    fn queue_batched(
        &mut self,
        hdr: Header,
        payload: Payload,
        keep: Option<&Arc<dyn MemoryRegion>>,
    ) {
        let reply = (hdr.op == Op::ReadReply) as usize;
        self.responses += reply;
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
            if let Some(mem) = keep {
                keep_once(&mut f.keep, mem);
            }
            f.batch += 1;
            f.replies += reply;
            f.device += device;
            f.unstaged += device;
            f.total += HEADER_LEN + plen;
            // The BATCH header's count, in place.
            Header::set_len(&mut f.head, f.batch as u64);
            return;
        }
        self.out_bytes += HEADER_LEN;
        let (mut head, mut payloads, mut kept) = match self.spare.pop() {
            Some(f) => (f.head, f.payloads, f.keep),
            None => (
                Vec::with_capacity(HEADER_LEN * 16),
                Vec::with_capacity(16),
                Vec::new(),
            ),
        };
        head.extend_from_slice(&Header::new(Op::Batch, 1).encode());
        head.extend_from_slice(&hdr.encode());
        payloads.push(payload);
        if let Some(mem) = keep {
            keep_once(&mut kept, mem);
        }
        self.out.push_back(OutFrame {
            head,
            payloads,
            keep: kept,
            batch: 1,
            response: false,
            replies: reply,
            total: 2 * HEADER_LEN + plen,
            written: 0,
            device,
            unstaged: device,
        });
    }

    /// Appends `bytes` to the frame queued last, after the payload just queued: a WRITE's
    /// checksum ([`FLAG_CRC`](crate::frame::FLAG_CRC)).
    pub fn queue_trailer(&mut self, bytes: [u8; 4]) {
        let Some(f) = self.out.back_mut() else {
            return;
        };
        f.payloads.push(Payload::Owned(bytes.to_vec()));
        f.total += bytes.len();
        self.out_bytes += bytes.len();
    }

    /// Writes as much of the queue as the socket takes. `Err` = connection broken.
    ///
    /// Device payloads leave from the staging ring as their copies complete; the copies of
    /// the next ones run while the socket takes these.
    pub fn flush(&mut self, shared: &mut Shared) -> Result<(), TcpError> {
        if self.awaiting_challenge() {
            // Our HELLO goes first, and it needs the CHALLENGE's nonce.
            return Ok(());
        }
        // Until the target's PROOF, our HELLO only (see `handshake`).
        let opening = self.opening();
        self.flush_acks();
        // SEND credit rides on the ACK just queued, if any.
        self.grant_credit(&mut shared.early);
        loop {
            self.stage_out()?;
            if self.out.is_empty() {
                return Ok(());
            }
            // Sized for what is queued (a header and the payloads of each frame), so that
            // it does not grow while filled.
            let want: usize = self.out.iter().map(|f| 1 + f.payloads.len()).sum();
            let mut iov: Vec<RawIov> = Vec::with_capacity(want.min(MAX_IOV));
            let frames = if opening {
                self.writable_frames()
            } else {
                self.out.len()
            };
            for f in self.out.iter().take(frames) {
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
            // holds, in a payload or in its `keep`), all alive and unchanged until `advance` below; writev only reads.
            let n = match unsafe { crate::io::writev(self.stream.as_raw_fd(), &iov) } {
                Ok(0) => return Err(TcpError::ClosedWhileWriting),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(TcpError::io("write", e)),
            };
            drop(iov);
            self.advance(n);
            if n >= YIELD_AFTER {
                offer_core();
            }
        }
    }

    pub(super) fn advance(&mut self, mut n: usize) {
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
                self.responses -= f.response as usize + f.replies;
                if let Some(mut done) = self.out.pop_front()
                    && done.batch > 0
                    && self.spare.len() < SPARE_FRAMES
                {
                    // Emptied: the payloads' regions are no longer held.
                    done.head.clear();
                    done.payloads.clear();
                    done.keep.clear();
                    self.spare.push(done);
                }
            }
        }
    }

    /// Learns which copies out have completed, and gives the next device payloads room in
    /// the staging ring, in queue order, as far as it has room: their copies start now.
    pub(super) fn stage_out(&mut self) -> Result<(), TcpError> {
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
}
