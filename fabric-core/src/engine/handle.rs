//! Waitable results: [`TransferHandle`] (blocking wait with timeout, or `.await`) and the
//! slot the worker fills.

use crate::error::{Error, OpError};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// What a finished transfer reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TransferStats {
    /// Bytes moved.
    pub bytes: u64,
    /// Operations posted for it.
    pub ops: u64,
}

/// What a finished receive reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    /// The sender, where the backend knows it.
    pub peer: Option<crate::PeerId>,
    /// Bytes received.
    pub len: u64,
    /// Immediate data sent with the message.
    pub imm: Option<u32>,
}

/// The outcome of a transfer: its figures, or the first error of any of its operations.
pub type TransferResult = Result<TransferStats, OpError>;

struct SlotState<T> {
    value: Option<T>,
    waker: Option<Waker>,
    callback: Option<Box<dyn FnOnce(T) + Send>>,
    /// Threads asleep on `ready`: `complete` pays for a notification only when one is.
    parked: usize,
}

/// A one-shot cell the worker completes and the application waits on.
///
/// A waiter first spins for up to `spin` on `done` (an atomic, no lock), then parks on the
/// condition variable; the completer stores the value, raises `done`, and notifies only if
/// someone parked. A spinning waiter thus sees the result without either thread making a
/// system call, and a parked one is woken as before.
pub(crate) struct Slot<T> {
    state: Mutex<SlotState<T>>,
    ready: Condvar,
    /// Raised (with release ordering, after `value` is stored) once the slot is complete.
    done: AtomicBool,
    /// How long [`wait`](Slot::wait) spins before it parks.
    spin: Duration,
    /// When the work it stands for last made progress ([`clock`]; 0: not started).
    touched: AtomicU64,
}

/// The process's clock for progress: nanoseconds since its first reading, never 0.
pub(crate) fn clock() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64 + 1
}

/// Spin iterations between two looks at the clock in [`Slot::wait`].
const CLOCK_EVERY: u32 = 64;

impl<T: Clone + Send + 'static> Slot<T> {
    /// A slot whose waiters park at once.
    pub fn new() -> Arc<Slot<T>> {
        Self::spinning(Duration::ZERO)
    }

    /// A slot whose waiters spin for up to `spin` before they park.
    pub fn spinning(spin: Duration) -> Arc<Slot<T>> {
        Arc::new(Slot {
            state: Mutex::new(SlotState {
                value: None,
                waker: None,
                callback: None,
                parked: 0,
            }),
            ready: Condvar::new(),
            done: AtomicBool::new(false),
            spin,
            touched: AtomicU64::new(0),
        })
    }

    /// Says that the work made progress at `now` ([`clock`]).
    pub fn touch(&self, now: u64) {
        self.touched.store(now, Ordering::Relaxed);
    }

    pub fn with_callback(f: Box<dyn FnOnce(T) + Send>) -> Arc<Slot<T>> {
        let s = Self::new();
        s.lock().callback = Some(f);
        s
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState<T>> {
        // A poisoned lock means a callback panicked; the state itself is still coherent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Completes the slot (once; later calls are ignored).
    pub fn complete(&self, v: T) {
        let mut st = self.lock();
        if st.value.is_some() {
            return;
        }
        if let Some(cb) = st.callback.take() {
            drop(st);
            cb(v.clone());
            st = self.lock();
        }
        st.value = Some(v);
        self.done.store(true, Ordering::Release);
        if let Some(w) = st.waker.take() {
            w.wake();
        }
        // Waiters park under the lock we hold, so none can be between its check of the
        // value and its sleep: `parked` is exact.
        if st.parked > 0 {
            self.ready.notify_all();
        }
    }

    /// Calls `f` with the value once the slot is complete: at once (in this thread) if it
    /// already is, else in the thread that completes it. Replaces an earlier callback.
    pub fn set_callback(&self, f: Box<dyn FnOnce(T) + Send>) {
        let mut st = self.lock();
        match st.value.clone() {
            Some(v) => {
                drop(st);
                f(v);
            }
            None => st.callback = Some(f),
        }
    }

    /// Spins until the slot is complete or `limit` has passed; returns whether it is.
    /// Yields the core on each turn once a few microseconds have gone, so that a spinning
    /// waiter on a machine with fewer cores than runnable threads lets the workers it
    /// waits for run.
    fn spin_until_done(&self, limit: Duration) -> bool {
        let start = Instant::now();
        let mut turns = 0u32;
        let mut yielding = false;
        loop {
            if self.done.load(Ordering::Acquire) {
                return true;
            }
            turns = turns.wrapping_add(1);
            if turns.is_multiple_of(CLOCK_EVERY) {
                let gone = start.elapsed();
                if gone >= limit {
                    return false;
                }
                yielding = gone >= YIELD_AFTER;
            }
            if yielding {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    fn wait(&self, timeout: Duration) -> Option<T> {
        let spin = self.spin.min(timeout);
        if !spin.is_zero() && !self.done.load(Ordering::Acquire) {
            self.spin_until_done(spin);
        }
        let mut st = self.lock();
        if st.value.is_none() {
            let left = timeout.saturating_sub(spin);
            st.parked += 1;
            st = self
                .ready
                .wait_timeout_while(st, left, |s| s.value.is_none())
                .unwrap_or_else(|p| p.into_inner())
                .0;
            st.parked -= 1;
        }
        st.value.clone()
    }

    fn try_get(&self, waker: Option<&Waker>) -> Option<T> {
        let mut st = self.lock();
        if st.value.is_none()
            && let Some(w) = waker
        {
            st.waker = Some(w.clone());
        }
        st.value.clone()
    }
}

/// How long [`Slot::wait`] spins with `spin_loop` hints before it yields on each turn.
const YIELD_AFTER: Duration = Duration::from_micros(5);

/// A submitted transfer (or SEND), on one engine or a rail group. Wait with a timeout
/// ([`wait`](Self::wait)), poll it ([`try_result`](Self::try_result)), have a callback run
/// ([`on_complete`](Self::on_complete)), or `.await` it from any async runtime; or drop it:
/// the transfer still runs to its end, immediate data included, since the workers decide
/// completions and immediate data, never the thread that holds the handle.
///
/// # Buffer ownership
///
/// From submit until the handle reports a result (success or failure), the source ranges
/// belong to the engine: do not write them (the bytes that arrive would be undefined), and
/// do not deregister their region (deregistration fails with
/// [`Error::RegionInUse`](crate::Error::RegionInUse) while a transfer uses it). Once a
/// result is reported, no transport touches the source any more, even for a failure: a
/// transfer past its deadline posts nothing more and is reported
/// [`TimedOut`](crate::OpError::TimedOut) only after every operation the transport had
/// accepted has completed or failed (TCP fails a silent peer's operations after its
/// `liveness_timeout`), so a resubmit never races the NIC. A wait that runs out
/// ([`Error::TimedOut`](crate::Error::TimedOut) from [`wait`](Self::wait)) ends only the
/// wait: the transfer goes on. The target region may be read once the target has seen the
/// transfer's immediate data (or a later SEND): the initiator's success says the bytes
/// were placed, not that the target's application knows. (The EFA backend's peer removal
/// still reports a removed peer's operations at once, without waiting for the provider.)
pub struct TransferHandle {
    pub(crate) slot: Arc<Slot<TransferResult>>,
    /// Cancels it (see [`TransferHandle::cancel`]); `None` for what cannot be cancelled.
    pub(crate) cancel: Option<Canceller>,
}

/// What cancels a transfer: asks its workers to stop it.
pub(crate) type Canceller = Arc<dyn Fn() + Send + Sync>;

impl std::fmt::Debug for TransferHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferHandle")
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl TransferHandle {
    /// Whether the transfer has finished (either way).
    pub fn is_finished(&self) -> bool {
        self.slot.try_get(None).is_some()
    }

    /// The error, if the transfer has finished and failed.
    pub fn failed(&self) -> Option<OpError> {
        self.slot.try_get(None).and_then(|r| r.err())
    }

    /// Blocks until the transfer finishes, at most `timeout`; returns whether it has.
    pub fn finished_within(&self, timeout: Duration) -> bool {
        self.slot.wait(timeout).is_some()
    }

    /// Runs `f` with the result once the transfer finishes: on the worker thread that
    /// decides it (keep it short: that worker runs nothing else meanwhile), or at once in
    /// this thread if it has already finished.
    pub fn on_complete(self, f: impl FnOnce(TransferResult) + Send + 'static) {
        self.slot.set_callback(Box::new(f));
    }

    /// Blocks until the transfer finishes, at most `timeout`.
    pub fn wait(&self, timeout: Duration) -> Result<TransferStats, Error> {
        match self.slot.wait(timeout) {
            Some(r) => r.map_err(Error::Op),
            None => Err(Error::TimedOut(timeout, "a transfer")),
        }
    }

    /// The result, if the transfer has finished.
    pub fn try_result(&self) -> Option<TransferResult> {
        self.slot.try_get(None)
    }

    /// How long since the transfer last made progress (an operation of it completed, or a
    /// worker took it up), read now; `None` while no worker has taken it up yet (it waits
    /// behind other transfers for room on the rails, or for its fence). A peer that stops
    /// answering (a stopped or descheduled process) shows as a growing idle time while
    /// the connection stays up: see `xfer`'s stall timeout.
    pub fn idle(&self) -> Option<Duration> {
        match self.slot.touched.load(Ordering::Relaxed) {
            0 => None,
            t => Some(Duration::from_nanos(clock().saturating_sub(t))),
        }
    }

    /// Cancels the transfer, if it has not finished: it posts nothing more, and finishes
    /// with [`OpError::Cancelled`] once every operation it had posted has completed or
    /// failed (so its memory is the caller's again when the handle says so, as for any
    /// finish). Bytes posted before the cancel may still land; a WRITE's immediate data is
    /// not sent once it is cancelled. Returns at once; wait on the handle for the end. A
    /// transfer that finishes before the cancel reaches its workers keeps its result.
    pub fn cancel(&self) {
        if !self.is_finished()
            && let Some(c) = &self.cancel
        {
            c();
        }
    }
}

impl Future for TransferHandle {
    type Output = TransferResult;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<TransferResult> {
        match self.slot.try_get(Some(cx.waker())) {
            Some(v) => Poll::Ready(v),
            None => Poll::Pending,
        }
    }
}

/// A posted receive. Wait with a timeout, or `.await` it.
pub struct RecvHandle {
    pub(crate) slot: Arc<Slot<Result<Received, OpError>>>,
}

impl RecvHandle {
    /// Blocks until a message arrives, at most `timeout`.
    pub fn wait(&self, timeout: Duration) -> Result<Received, Error> {
        match self.slot.wait(timeout) {
            Some(r) => r.map_err(Error::Op),
            None => Err(Error::TimedOut(timeout, "a message")),
        }
    }
}

impl Future for RecvHandle {
    type Output = Result<Received, OpError>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.slot.try_get(Some(cx.waker())) {
            Some(v) => Poll::Ready(v),
            None => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::engine::eventually;

    #[test]
    fn a_waiter_that_parks_is_woken_by_the_completion() {
        let slot: Arc<Slot<u32>> = Slot::new();
        let s2 = slot.clone();
        let t = std::thread::spawn(move || s2.wait(Duration::from_secs(60)));
        assert!(
            eventually(Duration::from_secs(30), || slot.lock().parked == 1),
            "a slot without spin parks its waiter"
        );
        slot.complete(7);
        assert_eq!(t.join().unwrap(), Some(7));
        assert_eq!(slot.lock().parked, 0);
    }

    #[test]
    fn a_spinning_waiter_sees_the_completion_without_parking() {
        let slot: Arc<Slot<u32>> = Slot::spinning(Duration::from_secs(60));
        let s2 = slot.clone();
        let started = Arc::new(std::sync::Barrier::new(2));
        let b2 = started.clone();
        let t = std::thread::spawn(move || {
            b2.wait();
            s2.wait(Duration::from_secs(120))
        });
        started.wait();
        // For 50 ms the waiter spins: it never parks (a slot that parked at once would
        // show it within microseconds).
        assert!(!eventually(Duration::from_millis(50), || slot
            .lock()
            .parked
            > 0));
        slot.complete(8);
        assert_eq!(t.join().unwrap(), Some(8));
    }

    #[test]
    fn a_spin_longer_than_the_timeout_still_times_out() {
        let slot: Arc<Slot<u32>> = Slot::spinning(Duration::from_secs(60));
        let t0 = Instant::now();
        assert_eq!(slot.wait(Duration::from_millis(20)), None);
        assert!(t0.elapsed() < Duration::from_secs(30));
        slot.complete(1);
        // Complete already: no spin, no park.
        assert_eq!(slot.wait(Duration::ZERO), Some(1));
        assert_eq!(slot.lock().parked, 0);
    }
}
