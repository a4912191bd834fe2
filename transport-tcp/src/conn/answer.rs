//! Answers: the ACKs, NACKs and READ_REPLYs a target owes for the requests it handled (in
//! request order, held back while device copies of earlier bytes run, ACKs merged), and the
//! initiator's side of it: the requests outstanding and the check that a peer still answers.

use super::*;

/// What a handled request owes, in request order.
pub(super) enum Answer {
    /// An ACK (merged with its neighbours).
    Ack,
    /// A NACK with this header.
    Nack(Header),
    /// A READ_REPLY: its header and the bytes it carries from the registered region.
    Reply(Header, Payload),
    /// Nothing owed to the peer: the completion of one of our READs whose bytes were
    /// copied into device memory, reported once they are there.
    ReadDone(Completion),
}

/// An answer held back until the device copies of the bytes before it have completed:
/// answers (and the target's events) leave in the order of the requests.
pub(super) struct Held {
    /// In-ring counter that must be ready (0: none).
    pub(super) until: u64,
    pub(super) answer: Answer,
    pub(super) event: Option<Completion>,
}

/// Where a READ's bytes land: the initiator's registered region, as posted.
pub(crate) struct ReadInto {
    pub mem: Arc<dyn MemoryRegion>,
    pub offset: u64,
    pub via: Via,
}

/// A request waiting for its response.
pub(crate) struct Inflight {
    pub wr_id: WorkRequestId,
    pub op: OpKind,
    pub len: u64,
    /// A READ's destination (`None`: a WRITE or SEND).
    pub read: Option<ReadInto>,
    /// A row of a strided WRITE sent as frames of its own, all but the last: its answer
    /// makes no completion (a failure is carried to the last row's, which completes the
    /// whole write).
    pub silent: bool,
}

impl Conn {
    /// Fails once requests have been outstanding for `limit` with neither an answer from
    /// the peer (nor a byte of a READ's reply) nor a byte of ours leaving, while the peer's kernel has acknowledged all our
    /// bytes: it takes them while its transport is stopped, which TCP's own timers never
    /// notice. (Unacknowledged bytes are TCP_USER_TIMEOUT's to judge.)
    pub fn check_answers(&mut self, limit: std::time::Duration) -> Result<(), TcpError> {
        if self.inflight.is_empty() {
            self.unanswered_since = None;
            return Ok(());
        }
        let now = std::time::Instant::now();
        let seen = (self.answered, self.out_bytes, self.received);
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

    /// Answers a request (`answer`) and reports `event`, once the in-ring is ready up to
    /// `until` and every earlier answer has left.
    pub(super) fn answer(
        &mut self,
        until: Option<u64>,
        answer: Answer,
        event: Option<Completion>,
        shared: &mut Shared,
    ) {
        let ready = self.in_ring.as_ref().map_or(u64::MAX, |r| r.ready);
        if self.held.is_empty() && until.is_none_or(|u| u <= ready) {
            self.apply(answer, event, shared);
        } else {
            self.held.push_back(Held {
                until: until.unwrap_or(0),
                answer,
                event,
            });
        }
    }

    pub(super) fn apply(&mut self, answer: Answer, event: Option<Completion>, shared: &mut Shared) {
        match answer {
            Answer::Ack => self.pending_acks += 1,
            Answer::Nack(h) => {
                self.flush_acks();
                self.queue(h, Payload::None);
            }
            Answer::Reply(h, payload) => {
                self.flush_acks();
                // Replies leave in batches, like WRITEs: the initiator reads every header
                // of a batch, then all payloads straight into place with one readv.
                self.queue_write(h, payload);
            }
            Answer::ReadDone(c) => shared.completions.push(c),
        }
        if let Some(e) = event {
            shared.completions.push(e);
        }
    }

    /// The completions of our READs that were held behind device copies, when the
    /// connection closes: they fail with the connection's error (after
    /// [`settle_copies`](Self::settle_copies), so that no copy still writes their memory).
    pub fn held_reads(&mut self) -> Vec<WorkRequestId> {
        self.held
            .drain(..)
            .filter_map(|h| match h.answer {
                Answer::ReadDone(c) => Some(c.wr_id),
                _ => None,
            })
            .collect()
    }

    /// Waits (at most `limit`) until no copy into device memory is in flight, so that the
    /// READs this connection fails are reported only once nothing writes their memory.
    pub fn settle_copies(&mut self, limit: std::time::Duration) {
        let Some(r) = self.in_ring.as_mut() else {
            return;
        };
        let deadline = std::time::Instant::now() + limit;
        loop {
            let res = r.mark_if(true).and_then(|_| r.poll());
            if res.is_err() || !r.busy() {
                return;
            }
            if std::time::Instant::now() >= deadline {
                tracing::error!(
                    ?limit,
                    "copies into device memory still in flight as the connection closes"
                );
                return;
            }
            std::thread::yield_now();
        }
    }

    pub(super) fn flush_acks(&mut self) {
        if self.pending_acks == 0 {
            return;
        }
        let n = std::mem::take(&mut self.pending_acks);
        // ACKs are cumulative: an unsent ACK at the end of the queue absorbs this one (and
        // keeps the SEND credit it may carry).
        if let Some(f) = self.out.back_mut()
            && f.response
            && f.written == 0
            && f.head[0] == Op::Ack as u8
        {
            let len = Header::len_of(&f.head) + n;
            Header::set_len(&mut f.head, len);
            return;
        }
        self.queue(Header::new(Op::Ack, n), Payload::None);
    }

    pub(super) fn nack(&mut self, err: &OpError, wr_id: u64, shared: &mut Shared) {
        self.answer(
            None,
            Answer::Nack(frame::nack_for(err, wr_id)),
            None,
            shared,
        );
    }
}
