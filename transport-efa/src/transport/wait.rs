//! Waiting for progress without spinning: the CQ's file descriptor (FI_WAIT_FD).
//!
//! A provider with manual data progress (tcp, shm) moves bytes only inside calls such as
//! `fi_cq_read`. An engine whose transport has nothing of its own in flight (a target)
//! calls [`Transport::wait`] between polls; the trait's default sleeps 50 µs there, and a
//! target that reads its CQ only every 50–100 µs left the tcp provider at about 2 Gbps
//! (`xfer demo --transport efa --provider tcp`, 64 KiB pages, 2-core machine). With a wait
//! object the target sleeps in `ppoll` on the CQ's descriptor, which libfabric wakes when a
//! socket has data (or room again, for queued sends), and reads the CQ at once.
//!
//! [`Transport::wait`]: fabric_core::Transport::wait

use super::EfaTransport;
use crate::fi::{Owned, check};
use fabric_core::{Error, Result};
use libfabric_sys as sys;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// The CQ's wait object: a descriptor that libfabric owns (closed with the CQ) and makes
/// readable when reading the CQ would make progress.
#[derive(Clone, Copy, Debug)]
pub(super) struct WaitFd(RawFd);

/// Opens the completion queue of `size` entries; with `want_fd`, with an FD wait object
/// if the provider offers one (else, as when `want_fd` is false, with none).
pub(super) fn open_cq(
    domain: &Owned<sys::fid_domain>,
    size: usize,
    want_fd: bool,
) -> Result<(Owned<sys::fid_cq>, Option<WaitFd>)> {
    let open = |wait_obj| -> Result<Owned<sys::fid_cq>> {
        let mut attr = sys::fi_cq_attr {
            size,
            format: sys::FI_CQ_FORMAT_DATA,
            wait_obj,
            wait_cond: sys::FI_CQ_COND_NONE,
            ..Default::default()
        };
        let mut cq = std::ptr::null_mut();
        // SAFETY: domain is open; attr is a valid attribute struct for the call.
        let rc =
            unsafe { sys::fi_cq_open(domain.as_ptr(), &mut attr, &mut cq, std::ptr::null_mut()) };
        check("fi_cq_open", rc as isize)?;
        Owned::new("fi_cq_open", cq)
    };
    if want_fd {
        match open(sys::FI_WAIT_FD) {
            Ok(cq) => {
                let mut fd: RawFd = -1;
                // SAFETY: cq is open with FI_WAIT_FD; FI_GETWAIT writes one int there.
                let rc = unsafe {
                    sys::fi_control(cq.fid(), sys::FI_GETWAIT as i32, (&raw mut fd).cast())
                };
                if rc == 0 && fd >= 0 {
                    return Ok((cq, Some(WaitFd(fd))));
                }
                tracing::debug!(rc, "FI_GETWAIT gave no descriptor; the CQ is polled");
            }
            Err(e) => tracing::debug!(error = %e, "no FI_WAIT_FD CQ; the CQ is polled"),
        }
    }
    Ok((open(sys::FI_WAIT_NONE)?, None))
}

/// How long an endpoint whose peers' writes are counted keeps polling after it last saw the
/// count move: writes come in bursts (a transfer is many), and shm lands each only inside
/// this side's progress.
const WRITTEN_LINGER: Duration = Duration::from_micros(200);

/// Opens a counter of peers' writes into `ep`'s memory (FI_REMOTE_WRITE) and binds it to
/// `ep` (before `fi_enable`); `None`, with a debug line, where the provider refuses.
pub(super) fn open_write_counter(
    domain: &Owned<sys::fid_domain>,
    ep: &Owned<sys::fid_ep>,
) -> Result<Option<Owned<sys::fid_cntr>>> {
    let mut attr = sys::fi_cntr_attr {
        events: sys::FI_CNTR_EVENTS_COMP,
        wait_obj: sys::FI_WAIT_NONE,
        wait_set: std::ptr::null_mut(),
        flags: 0,
    };
    let mut cntr = std::ptr::null_mut();
    // SAFETY: domain is open; attr is a valid attribute struct; cntr receives the object.
    let rc =
        unsafe { sys::fi_cntr_open(domain.as_ptr(), &mut attr, &mut cntr, std::ptr::null_mut()) };
    if rc != 0 {
        tracing::debug!(rc, "no counter of peers' writes: fi_cntr_open refused");
        return Ok(None);
    }
    let cntr = Owned::new("fi_cntr_open", cntr)?;
    // SAFETY: ep and cntr are open objects of the same domain; ep is not enabled yet.
    let rc = unsafe { sys::fi_ep_bind(ep.as_ptr(), cntr.fid(), sys::FI_REMOTE_WRITE) };
    if rc != 0 {
        tracing::debug!(rc, "no counter of peers' writes: fi_ep_bind refused");
        return Ok(None);
    }
    Ok(Some(cntr))
}

impl EfaTransport {
    /// Peers' writes into this endpoint's memory so far, where they are counted.
    pub(crate) fn remote_writes_counted(&self) -> Option<u64> {
        self.remote_writes.as_ref().map(|c| {
            // SAFETY: the counter is open (owned by self) and read on this transport's
            // thread.
            unsafe { sys::fi_cntr_read(c.as_ptr()) }
        })
    }

    /// Whether peers are writing into this endpoint: its counter moved since the last look,
    /// or did less than [`WRITTEN_LINGER`] ago.
    fn being_written(&mut self) -> bool {
        let Some(n) = self.remote_writes_counted() else {
            return false;
        };
        let now = Instant::now();
        if n != self.writes_seen {
            self.writes_seen = n;
            self.written_until = Some(now + WRITTEN_LINGER);
            return true;
        }
        self.written_until.is_some_and(|t| now < t)
    }

    /// [`Transport::wait`](fabric_core::Transport::wait): returns once a completion is
    /// ready for the next `poll` (kept in `self.ready`), or after `timeout`.
    ///
    /// With a wait descriptor, it reads the CQ (which drives progress), then sleeps on the
    /// descriptor when `fi_trywait` says nothing is pending, and repeats until a completion
    /// arrives or time is up. Without one, it naps as the trait's default does.
    pub(super) fn wait_for_progress(&mut self, timeout: Duration) -> Result<()> {
        self.woken = false;
        if !self.ready.is_empty() {
            return Ok(());
        }
        let Some(fd) = self.wait_fd else {
            let nap = self.idle_nap;
            if nap.is_zero() && self.info.data_progress == crate::info::Progress::Manual {
                return self.spin_for_progress(timeout);
            }
            if self.being_written() {
                // Peers' writes are landing, and land only while we read the CQ: poll
                // (yielding the core) instead of napping, as long as the count moves.
                return self.spin_for_progress(timeout.min(WRITTEN_LINGER));
            }
            // Nothing to sleep on but the engine's wake-ups: nap on those.
            return self.sleep_on(None, timeout.min(nap));
        };
        let deadline = Instant::now() + timeout;
        let mut got = std::mem::take(&mut self.waited);
        let result = loop {
            if !self.backlogged.is_empty() {
                // A connection is coming up: the provider gives no event for it, so keep
                // retrying the backlog (as a busy poll would) instead of sleeping.
                self.flush_backlogs();
            }
            if let Err(e) = self.read_cq(&mut got) {
                break Err(e);
            }
            let now = Instant::now();
            if !got.is_empty() || !self.ready.is_empty() || now >= deadline {
                break Ok(());
            }
            if !self.backlogged.is_empty() {
                continue;
            }
            if let Err(e) = self.block_on(fd, deadline - now) {
                break Err(e);
            }
            if self.woken {
                // The engine has work: let it run.
                self.woken = false;
                break Ok(());
            }
        };
        self.ready.extend(got.drain(..));
        self.waited = got;
        result
    }

    /// Reads the CQ (which drives a manual-progress provider such as shm, whose peers'
    /// writes need this side's progress to land) without sleeping, yielding the core
    /// between reads, until a completion arrives, the engine wakes us, or `timeout`.
    fn spin_for_progress(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut got = std::mem::take(&mut self.waited);
        let result = loop {
            if !self.backlogged.is_empty() {
                self.flush_backlogs();
            }
            if let Err(e) = self.read_cq(&mut got) {
                break Err(e);
            }
            if !got.is_empty() || !self.ready.is_empty() || Instant::now() >= deadline {
                break Ok(());
            }
            if self.wake.pending() {
                // The engine has work (an atomic load: a `ppoll` here cost a system call
                // on every turn, and the turns are what a peer's writes wait for).
                self.wake.drain();
                break Ok(());
            }
            std::thread::yield_now();
        };
        self.ready.extend(got.drain(..));
        self.waited = got;
        result
    }

    /// Sleeps on the CQ's descriptor for at most `left`, unless `fi_trywait` says the CQ
    /// must be read first.
    fn block_on(&mut self, fd: WaitFd, left: Duration) -> Result<()> {
        let mut fids = [self.cq.fid()];
        // SAFETY: fabric and CQ are open; fids holds the CQ's fid for the call.
        let rc = unsafe { sys::fi_trywait(self.fabric.as_ptr(), fids.as_mut_ptr(), 1) };
        if rc == -sys::FI_EAGAIN {
            return Ok(());
        }
        check("fi_trywait", rc as isize)?;
        self.sleep_on(Some(fd), left)
    }

    /// Sleeps in `ppoll` on the engine's wake-up descriptor and, if given, the CQ's, for at
    /// most `left`; notes in `woken` (and consumes) a wake-up.
    fn sleep_on(&mut self, cq: Option<WaitFd>, left: Duration) -> Result<()> {
        let ts = libc::timespec {
            tv_sec: left.as_secs() as libc::time_t,
            tv_nsec: left.subsec_nanos() as libc::c_long,
        };
        let mut pfds = [
            libc::pollfd {
                fd: self.wake.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: cq.map_or(-1, |c| c.0), // a negative fd is ignored by ppoll
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds (descriptors the transport and the CQ keep open, or -1,
        // which ppoll skips); ts is valid; no signal mask.
        let rc = unsafe { libc::ppoll(pfds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::io("ppoll", e));
            }
        }
        if pfds[0].revents != 0 {
            self.wake.drain();
            self.woken = true;
        }
        Ok(())
    }
}
