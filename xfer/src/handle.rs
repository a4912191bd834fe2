//! [`Handle`]: a submitted transfer, as the front door reports it: its result is this
//! crate's [`Error`], like every other call's.

use crate::agent::LinkCell;
use crate::error::{Error, Result};
use fabric_core::engine::{TransferHandle, TransferStats};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// A transfer submitted with [`Agent::submit`](crate::Agent::submit): wait for it with a
/// timeout, ask whether it finished, run a callback when it does, or `.await` it. Its
/// source memory is the caller's again once it has finished, either way (a transfer that
/// fails or times out is reported only once no transport can still touch its memory).
pub struct Handle {
    inner: TransferHandle,
    /// The stall timeout and the peer's name, where the transfer has one.
    stall: Option<(Duration, String)>,
    /// The agent's counters (stalls reported), where the handle is an agent's.
    counts: Option<Arc<crate::metrics::AgentCounters>>,
    /// The peer's connection and its generation the transfer went on: a failure that says
    /// the peer is unreachable marks it broken (the agent reconnects before the next
    /// transfer).
    link: Option<Link>,
}

/// A peer's connection and the generation of it a transfer went on.
pub(crate) type Link = (Arc<LinkCell>, u64);

/// The transfer's failure `e` as this crate reports it: a broken connection is
/// [`Error::ConnectionLost`], naming the peer, and marks the peer's connection broken.
fn op_on(link: Option<&Link>, e: fabric_core::OpError) -> Error {
    let Some((cell, generation)) = link else {
        return Error::Engine(fabric_core::Error::Op(e));
    };
    cell.note(*generation, &e);
    if matches!(e, fabric_core::OpError::PeerUnreachable { .. }) {
        Error::ConnectionLost {
            peer: cell.name().to_owned(),
            source: fabric_core::Error::Op(e),
        }
    } else {
        Error::Engine(fabric_core::Error::Op(e))
    }
}

/// As [`op_on`], for the engine's error of a wait.
fn engine_on(link: Option<&Link>, e: fabric_core::Error) -> Error {
    match e {
        fabric_core::Error::Op(o) => op_on(link, o),
        e => e.into(),
    }
}

impl Handle {
    pub(crate) fn new(
        inner: TransferHandle,
        stall: Option<(Duration, String)>,
        link: Option<Link>,
        counts: Option<Arc<crate::metrics::AgentCounters>>,
    ) -> Handle {
        Handle {
            inner,
            stall,
            counts,
            link,
        }
    }

    /// Blocks until the transfer finishes, at most `timeout`: its figures, or why it
    /// failed. Two outcomes end only the wait, and the transfer goes on: a
    /// [`TimedOut`](crate::ErrorKind::TimedOut) error if `timeout` passed first, and
    /// [`Error::PeerStalled`] once the transfer has made no progress for its stall timeout
    /// ([`Transfer::stall_timeout`](crate::Transfer::stall_timeout)) while its peer's
    /// connection stands (a stopped or descheduled process): wait again (it completes if
    /// the peer comes back) or [`cancel`](Self::cancel).
    pub fn wait(&self, timeout: Duration) -> Result<TransferStats> {
        let Some((limit, _)) = &self.stall else {
            return self
                .inner
                .wait(timeout)
                .map_err(|e| engine_on(self.link.as_ref(), e));
        };
        let began = Instant::now();
        let deadline = began + timeout;
        // Looked at four times per stall timeout: reported within 1.25 of it.
        let every = (*limit / 4).max(Duration::from_millis(1));
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.inner.wait(left.min(every)) {
                Ok(s) => return Ok(s),
                Err(fabric_core::Error::TimedOut(..)) => {}
                Err(e) => return Err(engine_on(self.link.as_ref(), e)),
            }
            if let Some(e) = self.stalled(began.elapsed()) {
                if let Some(c) = &self.counts {
                    c.stalls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                return Err(e);
            }
            if Instant::now() >= deadline {
                return Err(fabric_core::Error::TimedOut(timeout, "a transfer").into());
            }
        }
    }

    /// The engine's handle under it (the layer below, whose errors are the engine's).
    pub fn as_inner(&self) -> &TransferHandle {
        &self.inner
    }

    /// [`Error::PeerStalled`] if the transfer has made no progress for its stall timeout,
    /// counting only the last `waited` (a waiter's own time, so that a wait begun after
    /// the peer came back gives it the stall timeout to show progress); `None` while it
    /// progresses, has no stall timeout, or finished. [`wait`](Self::wait) asks this.
    pub fn stalled(&self, waited: Duration) -> Option<Error> {
        let (limit, peer) = self.stall.as_ref()?;
        let idle = self.idle()?;
        (idle.min(waited) >= *limit && !self.is_finished()).then(|| Error::PeerStalled {
            peer: peer.clone(),
            idle,
            limit: *limit,
        })
    }

    /// How long since the transfer last made progress (an operation of it completed);
    /// `None` while it waits for room on the rails or for its fence.
    pub fn idle(&self) -> Option<Duration> {
        self.inner.idle()
    }

    /// Whether the transfer has finished (either way).
    pub fn is_finished(&self) -> bool {
        self.inner.is_finished()
    }

    /// Blocks until the transfer finishes, at most `timeout`; returns whether it has.
    pub fn finished_within(&self, timeout: Duration) -> bool {
        self.inner.finished_within(timeout)
    }

    /// The result, if the transfer has finished.
    pub fn try_result(&self) -> Option<Result<TransferStats>> {
        let link = self.link.as_ref();
        self.inner
            .try_result()
            .map(|r| r.map_err(|e| op_on(link, e)))
    }

    /// Runs `f` with the result once the transfer finishes: on the worker thread that
    /// decides it (keep it short: that worker runs nothing else meanwhile), or at once in
    /// this thread if it has already finished.
    pub fn on_complete(self, f: impl FnOnce(Result<TransferStats>) + Send + 'static) {
        let link = self.link;
        self.inner
            .on_complete(move |r| f(r.map_err(|e| op_on(link.as_ref(), e))));
    }

    /// As [`on_complete`](Self::on_complete), with the engine's error as it is (weight sync
    /// reports it so); a broken connection still marks the peer's connection broken, so
    /// that the agent connects again before the next transfer.
    pub(crate) fn on_complete_op(
        self,
        f: impl FnOnce(std::result::Result<TransferStats, fabric_core::OpError>) + Send + 'static,
    ) {
        let link = self.link;
        self.inner.on_complete(move |r| {
            if let (Err(e), Some((cell, generation))) = (&r, link.as_ref()) {
                cell.note(*generation, e);
            }
            f(r)
        });
    }

    /// Cancels the transfer if it has not finished: it posts nothing more and finishes
    /// with a [`Cancelled`](crate::ErrorKind::Cancelled) error once every operation it had
    /// posted has completed or failed, so its memory is the caller's again when the handle
    /// says so. Bytes posted before the cancel may still land; a WRITE's immediate data is
    /// not sent once it is cancelled. Returns at once: wait on the handle for the end.
    pub fn cancel(&self) {
        self.inner.cancel();
    }

    /// The engine's handle underneath (the layer below, `fabric_core`).
    pub fn into_inner(self) -> TransferHandle {
        self.inner
    }
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl Future for Handle {
    type Output = Result<TransferStats>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let link = this.link.as_ref();
        Pin::new(&mut this.inner)
            .poll(cx)
            .map(|r| r.map_err(|e| op_on(link, e)))
    }
}
