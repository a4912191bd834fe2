//! Matching SENDs to posted receives, with a bounded queue of early arrivals: the one piece
//! every backend that implements SEND/RECV in software uses (mem, tcp, cuda-ipc).
//!
//! Receives are filled in the order they were posted, by messages in the order they
//! arrived. A message that finds no posted receive waits in the early-arrival queue, which
//! is bounded by a count and by bytes; a backend that streams payloads reserves the room
//! ([`reserve`](RecvMatch::reserve)) before the bytes arrive and queues the message
//! ([`arrived`](RecvMatch::arrived)) once they have.
//!
//! ```
//! use fabric_core::recv::{PostedRecv, RecvMatch, Arrival};
//! use fabric_core::{HostBuffer, PeerId, WorkRequestId};
//! let buf = HostBuffer::new_shared(64).unwrap();
//! let mut m = RecvMatch::new(4, 1 << 10);
//! let mut out = Vec::new();
//! // A message before any receive waits; the receive posted later takes it.
//! assert!(matches!(m.arrive(Some(PeerId(1)), Some(9), b"hello", &mut out), Arrival::Queued));
//! m.post(PostedRecv { wr_id: WorkRequestId(5), mem: buf.clone(), offset: 0, cap: 64 }, &mut out);
//! assert_eq!(out[0].result, Ok(5));
//! assert_eq!(out[0].imm, Some(9));
//! assert_eq!(buf.to_vec(0, 5).unwrap(), b"hello");
//! ```

use crate::error::OpError;
use crate::memory::MemoryRegion;
use crate::transport::{Completion, OpKind};
use crate::types::{PeerId, WorkRequestId};
use std::collections::VecDeque;
use std::sync::Arc;

/// A posted receive buffer.
#[derive(Clone)]
pub struct PostedRecv {
    /// The work request it completes.
    pub wr_id: WorkRequestId,
    /// The region it lies in.
    pub mem: Arc<dyn MemoryRegion>,
    /// Where in the region.
    pub offset: u64,
    /// Its size.
    pub cap: u64,
}

impl std::fmt::Debug for PostedRecv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostedRecv")
            .field("wr_id", &self.wr_id)
            .field("offset", &self.offset)
            .field("cap", &self.cap)
            .finish()
    }
}

/// A message that arrived before a receive was posted.
#[derive(Clone, Debug)]
pub struct EarlyArrival {
    /// The sender, where known.
    pub peer: Option<PeerId>,
    /// Its immediate data.
    pub imm: Option<u32>,
    /// Its bytes.
    pub data: Vec<u8>,
}

/// What [`RecvMatch::arrive`] did with a message.
#[derive(Debug)]
pub enum Arrival {
    /// A posted receive took it (its completion is in `out`, success or truncation).
    Delivered(Result<u64, OpError>),
    /// It waits in the early-arrival queue.
    Queued,
    /// No receive and no room: nothing was taken; offer it again later.
    Full,
}

/// Posted receives and early arrivals. See the module documentation.
#[derive(Debug)]
pub struct RecvMatch {
    recvs: VecDeque<PostedRecv>,
    early: VecDeque<EarlyArrival>,
    /// Early arrivals queued or reserved, and their bytes.
    count: usize,
    bytes: usize,
    max_count: usize,
    max_bytes: usize,
}

impl RecvMatch {
    /// Empty, with an early-arrival queue of at most `max_count` messages and `max_bytes`.
    pub fn new(max_count: usize, max_bytes: usize) -> RecvMatch {
        RecvMatch {
            recvs: VecDeque::new(),
            early: VecDeque::new(),
            count: 0,
            bytes: 0,
            max_count,
            max_bytes,
        }
    }

    /// Posts a receive: it takes the oldest early arrival at once if there is one.
    pub fn post(&mut self, r: PostedRecv, out: &mut Vec<Completion>) {
        self.recvs.push_back(r);
        self.match_early(out);
    }

    /// Whether a receive is posted.
    pub fn has_recv(&self) -> bool {
        !self.recvs.is_empty()
    }

    /// Takes the oldest posted receive, for a message whose bytes the caller places itself.
    pub fn take_recv(&mut self) -> Option<PostedRecv> {
        self.recvs.pop_front()
    }

    /// Gives back a receive taken with [`take_recv`](Self::take_recv) and not filled (its
    /// message was cut short): first in line again, and early arrivals may take it.
    pub fn put_back(&mut self, r: PostedRecv, out: &mut Vec<Completion>) {
        self.recvs.push_front(r);
        self.match_early(out);
    }

    /// Reserves room for an early arrival of `len` bytes still on its way; false if the
    /// queue is full.
    pub fn reserve(&mut self, len: usize) -> bool {
        if self.count >= self.max_count || self.bytes.saturating_add(len) > self.max_bytes {
            return false;
        }
        self.count += 1;
        self.bytes += len;
        true
    }

    /// Gives back a reservation whose message never completed.
    pub fn release(&mut self, len: usize) {
        self.count = self.count.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(len);
    }

    /// Queues a message whose room was [`reserve`](Self::reserve)d, then delivers early
    /// arrivals to receives posted meanwhile.
    pub fn arrived(&mut self, a: EarlyArrival, out: &mut Vec<Completion>) {
        self.early.push_back(a);
        self.match_early(out);
    }

    /// A message whose bytes are all here: into the oldest posted receive, else into the
    /// early-arrival queue if it has room.
    pub fn arrive(
        &mut self,
        peer: Option<PeerId>,
        imm: Option<u32>,
        data: &[u8],
        out: &mut Vec<Completion>,
    ) -> Arrival {
        if let Some(r) = self.recvs.pop_front() {
            let c = deliver(r, peer, imm, data);
            let res = c.result.clone();
            out.push(c);
            return Arrival::Delivered(res);
        }
        if !self.reserve(data.len()) {
            return Arrival::Full;
        }
        self.early.push_back(EarlyArrival {
            peer,
            imm,
            data: data.to_vec(),
        });
        Arrival::Queued
    }

    /// Delivers early arrivals to posted receives, oldest first, while both exist.
    fn match_early(&mut self, out: &mut Vec<Completion>) {
        while !self.early.is_empty() && !self.recvs.is_empty() {
            let (Some(m), Some(r)) = (self.early.pop_front(), self.recvs.pop_front()) else {
                break;
            };
            self.release(m.data.len());
            out.push(deliver(r, m.peer, m.imm, &m.data));
        }
    }
}

/// Places `data` into the posted receive `r` and reports it (truncation if it does not fit).
pub fn deliver(r: PostedRecv, peer: Option<PeerId>, imm: Option<u32>, data: &[u8]) -> Completion {
    let result = if data.len() as u64 > r.cap {
        Err(OpError::Truncated {
            len: data.len() as u64,
            capacity: r.cap,
        })
    } else {
        r.mem
            .write_from_host(r.offset, data)
            .map(|_| data.len() as u64)
            .map_err(OpError::transport)
    };
    Completion {
        wr_id: r.wr_id,
        op: OpKind::Recv,
        result,
        peer,
        imm,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostBuffer;

    fn recv(buf: &Arc<HostBuffer>, wr: u64, cap: u64) -> PostedRecv {
        PostedRecv {
            wr_id: WorkRequestId(wr),
            mem: buf.clone(),
            offset: 0,
            cap,
        }
    }

    #[test]
    fn messages_fill_receives_in_order_and_the_queue_is_bounded() {
        let buf = HostBuffer::new_shared(16).unwrap();
        let mut m = RecvMatch::new(2, 10);
        let mut out = Vec::new();
        assert!(matches!(
            m.arrive(Some(PeerId(1)), None, b"aaaa", &mut out),
            Arrival::Queued
        ));
        assert!(matches!(
            m.arrive(Some(PeerId(1)), None, b"bbbbbbb", &mut out),
            Arrival::Full
        ));
        assert!(matches!(
            m.arrive(Some(PeerId(1)), None, b"cc", &mut out),
            Arrival::Queued
        ));
        assert!(matches!(
            m.arrive(Some(PeerId(1)), None, b"d", &mut out),
            Arrival::Full
        ));
        m.post(recv(&buf, 1, 16), &mut out);
        m.post(recv(&buf, 2, 1), &mut out);
        assert_eq!(out[0].wr_id, WorkRequestId(1));
        assert_eq!(out[0].result, Ok(4));
        assert_eq!(
            out[1].result,
            Err(OpError::Truncated {
                len: 2,
                capacity: 1
            })
        );
        // Room again.
        assert!(m.reserve(10));
        m.release(10);
        m.post(recv(&buf, 3, 16), &mut out);
        assert!(matches!(
            m.arrive(Some(PeerId(2)), Some(1), b"e", &mut out),
            Arrival::Delivered(Ok(1))
        ));
    }
}
