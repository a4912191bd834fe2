//! Answers: the ACKs and NACKs a target owes for the requests it handled (in request
//! order, held back while device copies of earlier bytes run, ACKs merged), and the
//! initiator's side of it: the requests outstanding and the check that a peer still answers.

use super::*;

/// An answer held back until the device copies of the bytes before it have completed:
/// answers (and the target's events) leave in the order of the requests.
pub(super) struct Held {
    /// In-ring counter that must be ready (0: none).
    pub(super) until: u64,
    /// `None`: an ACK.
    pub(super) nack: Option<Header>,
    pub(super) event: Option<Completion>,
}

/// A request waiting for its response.
pub(crate) struct Inflight {
    pub wr_id: WorkRequestId,
    pub op: OpKind,
    pub len: u64,
}

impl Conn {
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

    /// Answers a request (an ACK, or the NACK `nack`) and reports `event`, once the in-ring
    /// is ready up to `until` and every earlier answer has left.
    pub(super) fn answer(
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

    pub(super) fn apply(
        &mut self,
        nack: Option<Header>,
        event: Option<Completion>,
        shared: &mut Shared,
    ) {
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
            let len = u64::from_le_bytes(f.head[32..40].try_into().expect("8 bytes")) + n;
            f.head[32..40].copy_from_slice(&len.to_le_bytes());
            return;
        }
        self.queue(Header::new(Op::Ack, n), Payload::None);
    }

    pub(super) fn nack(&mut self, err: &OpError, wr_id: u64, shared: &mut Shared) {
        self.answer(None, Some(frame::nack_for(err, wr_id)), None, shared);
    }
}
