//! Waking a worker that sleeps in [`Transport::wait`](crate::Transport::wait).
//!
//! An engine's worker sleeps in its transport's `wait` when it has nothing to do, and must
//! be woken at once when the application hands it work (a submit, a peer to add, memory to
//! register), never by a timer: latency is paid on every transfer that waits for a sleeping
//! worker. Each transport hands the engine a [`Wake`] handle, which the engine calls from
//! the application's threads after queueing a command:
//!
//! - transports that sleep on file descriptors (sockets, a CQ's wait descriptor) put a
//!   [`WakeFd`]'s descriptor into their poll set, as mio's `Waker` does;
//! - transports with nothing to sleep on wait on a [`Signal`] (a condition variable).
//!
//! Both are sticky: a wake that comes before the `wait` makes that `wait` return at once,
//! so no wake-up is lost between the worker's last look at its queue and its sleep.
//!
//! ```
//! use fabric_core::wake::{Signal, Wake};
//! use std::sync::Arc;
//! use std::time::{Duration, Instant};
//! let s = Arc::new(Signal::new());
//! let w: Arc<dyn Wake> = s.clone();
//! w.wake(); // before the wait: the wait returns at once
//! let t = Instant::now();
//! assert!(s.wait_timeout(Duration::from_secs(5)));
//! assert!(t.elapsed() < Duration::from_secs(5));
//! assert!(!s.wait_timeout(Duration::from_millis(1))); // consumed
//! ```

use std::io::ErrorKind;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Something that makes a sleeping (or the next) [`Transport::wait`](crate::Transport::wait)
/// return at once. Called from any thread; cheap when called often.
pub trait Wake: Send + Sync {
    /// Wakes the waiter (or makes its next wait return at once).
    fn wake(&self);
}

/// A waker that does nothing: for transports whose `wait` only naps briefly.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoWake;

impl Wake for NoWake {
    fn wake(&self) {}
}

/// A sticky flag with a condition variable, for transports that have no descriptor to
/// sleep on. Raising it notifies the condition variable (a system call) only while a
/// waiter sleeps on it.
#[derive(Debug, Default)]
pub struct Signal {
    state: Mutex<SignalState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct SignalState {
    set: bool,
    /// Threads asleep in `wait_timeout` (counted under the lock, so exact for `wake`).
    waiters: usize,
}

impl Signal {
    /// A signal not yet raised.
    pub fn new() -> Signal {
        Signal::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SignalState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sleeps until the signal is raised or `timeout` passes; returns whether it was
    /// raised, and lowers it.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let mut g = self.lock();
        if !g.set {
            g.waiters += 1;
            g = self
                .cv
                .wait_timeout_while(g, timeout, |s| !s.set)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            g.waiters -= 1;
        }
        std::mem::replace(&mut g.set, false)
    }
}

impl Wake for Signal {
    fn wake(&self) {
        let mut g = self.lock();
        if !g.set {
            g.set = true;
            if g.waiters > 0 {
                self.cv.notify_one();
            }
        }
    }
}

/// A descriptor that becomes readable when woken: add [`fd`](WakeFd::fd) to a poll set
/// (`POLLIN`) and call [`drain`](WakeFd::drain) once it is readable. Built on a pair of
/// Unix datagram sockets from `std` (no FFI here); [`waker`](WakeFd::waker) is the other end.
///
/// A waiter that polls instead of sleeping reads [`pending`](WakeFd::pending) (an atomic
/// load) rather than polling the descriptor (a system call) on every turn.
#[derive(Debug)]
pub struct WakeFd {
    rx: UnixDatagram,
    tx: Arc<WakeSender>,
}

/// The sending end of a [`WakeFd`]: the datagram socket, and a flag raised before each
/// datagram is sent.
#[derive(Debug)]
struct WakeSender {
    socket: UnixDatagram,
    raised: AtomicBool,
}

impl Wake for WakeSender {
    fn wake(&self) {
        self.raised.store(true, Ordering::Release);
        // A full queue means wake-ups are already pending: nothing is lost.
        match self.socket.send(&[1]) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => tracing::debug!(error = %e, "wake-up not sent"),
        }
    }
}

impl WakeFd {
    /// A new pair.
    pub fn new() -> std::io::Result<WakeFd> {
        let (rx, tx) = UnixDatagram::pair()?;
        rx.set_nonblocking(true)?;
        tx.set_nonblocking(true)?;
        Ok(WakeFd {
            rx,
            tx: Arc::new(WakeSender {
                socket: tx,
                raised: AtomicBool::new(false),
            }),
        })
    }

    /// Whether a wake-up came since the last [`drain`](WakeFd::drain), read without a
    /// system call.
    pub fn pending(&self) -> bool {
        self.tx.raised.load(Ordering::Acquire)
    }

    /// The descriptor to poll for `POLLIN`.
    pub fn fd(&self) -> RawFd {
        self.rx.as_raw_fd()
    }

    /// The handle that wakes this descriptor, for the engine.
    pub fn waker(&self) -> Arc<dyn Wake> {
        self.tx.clone()
    }

    /// Consumes pending wake-ups, so that the descriptor polls as not readable again.
    pub fn drain(&self) {
        // Lowered first: a wake-up that comes during the drain raises it again (and its
        // datagram, if drained too, is not needed to see it).
        self.tx.raised.store(false, Ordering::Release);
        let mut buf = [0u8; 64];
        loop {
            match self.rx.recv(&mut buf) {
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return, // WouldBlock: empty
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn signal_wakes_a_sleeping_waiter_from_another_thread() {
        let s = Arc::new(Signal::new());
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            let t0 = Instant::now();
            let woken = s2.wait_timeout(Duration::from_secs(10));
            (woken, t0.elapsed())
        });
        // Wakes it whether it already sleeps or not (sticky).
        s.wake();
        let (woken, took) = t.join().expect("waiter");
        assert!(woken);
        assert!(took < Duration::from_secs(10));
    }

    #[test]
    fn signal_notifies_a_parked_waiter_and_counts_it_exactly() {
        let s = Arc::new(Signal::new());
        let s2 = s.clone();
        let t = std::thread::spawn(move || s2.wait_timeout(Duration::from_secs(60)));
        // Wait (with a deadline) until the waiter is parked, then raise: the notification
        // must reach it, or it would sleep its 60 s.
        let deadline = Instant::now() + Duration::from_secs(30);
        while s.lock().waiters == 0 {
            assert!(Instant::now() < deadline, "the waiter never parked");
            std::thread::yield_now();
        }
        s.wake();
        assert!(t.join().expect("waiter"));
        assert_eq!(s.lock().waiters, 0);
        assert!(!s.lock().set, "the waiter lowered it");
    }

    #[test]
    fn wake_fd_is_sticky_and_drains() {
        let w = WakeFd::new().expect("socketpair");
        let waker = w.waker();
        let mut buf = [0u8; 8];
        assert!(w.rx.recv(&mut buf).is_err(), "nothing pending yet");
        for _ in 0..10_000 {
            waker.wake(); // more than the socket queue holds: extra wakes are dropped
        }
        assert!(w.rx.recv(&mut buf).is_ok(), "pending after wake");
        w.drain();
        assert!(w.rx.recv(&mut buf).is_err(), "drained");
    }

    #[test]
    fn wake_fd_pending_follows_wakes_from_another_thread_and_drains() {
        let w = WakeFd::new().expect("socketpair");
        assert!(!w.pending());
        let waker = w.waker();
        std::thread::spawn(move || waker.wake())
            .join()
            .expect("waker");
        assert!(w.pending(), "a wake-up from another thread is seen");
        w.drain();
        assert!(!w.pending(), "lowered by drain");
        let mut buf = [0u8; 8];
        assert!(w.rx.recv(&mut buf).is_err(), "and its datagram consumed");
        w.waker().wake();
        assert!(w.pending());
    }
}
