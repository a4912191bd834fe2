//! The set-up of a run (rails started, memory filled and registered, rails connected and
//! warmed up), timed: when it takes longer than [`SLOW_SET_UP`], one line on stderr says
//! what it is doing, and a second, when it ends, what each stage took. `RUST_LOG=info`
//! logs the stages of every set-up.

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// After this long in set-up, say so.
pub const SLOW_SET_UP: Duration = Duration::from_secs(1);

/// Stage: the rendezvous's hello to the server (bench).
pub const ASKING: &str = "asking the server for a region";
/// Stage: the rails' workers start (and their transports listen).
pub const STARTING: &str = "starting rails";
/// Stage: regions are allocated (host memory: mapped with every page faulted in).
pub const ALLOCATING: &str = "allocating memory";
/// Stage: the source region is filled with the pattern.
pub const FILLING: &str = "filling memory";
/// Stage: regions are registered on every rail.
pub const REGISTERING: &str = "registering memory";
/// Stage: every rail connects to its peer rail.
pub const CONNECTING: &str = "connecting rails";
/// Stage: a zero-length write on every rail.
pub const WARMING_UP: &str = "warming up rails";

/// The clock of one set-up. Stages are named as they begin; [`finish`](Self::finish) ends it.
pub struct SetUpClock {
    what: String,
    start: Instant,
    stages: Vec<(&'static str, Instant)>,
    now: Arc<Mutex<&'static str>>,
    /// Whether the slow line was printed.
    said_slow: Arc<AtomicBool>,
    done: Option<Sender<()>>,
    watcher: Option<JoinHandle<()>>,
}

impl SetUpClock {
    /// Starts timing the set-up of `what` (e.g. `4 rails`), in stage `first`.
    pub fn start(what: String, first: &'static str) -> SetUpClock {
        SetUpClock::saying_slow_after(what, first, SLOW_SET_UP)
    }

    /// As [`start`](Self::start), with the slow line after `after`.
    fn saying_slow_after(what: String, first: &'static str, after: Duration) -> SetUpClock {
        let now = Arc::new(Mutex::new(first));
        let (done, stopped) = crossbeam_channel::bounded(1);
        let said_slow = Arc::new(AtomicBool::new(false));
        let (w, n, said) = (what.clone(), now.clone(), said_slow.clone());
        let start = Instant::now();
        let watcher = std::thread::Builder::new()
            .name("xfer-set-up".into())
            .spawn(move || watch(&w, start, after, &n, &stopped, &said))
            .ok();
        SetUpClock {
            what,
            start,
            stages: vec![(first, start)],
            now,
            said_slow,
            done: Some(done),
            watcher,
        }
    }

    /// The next stage begins.
    pub fn stage(&mut self, name: &'static str) {
        self.stages.push((name, Instant::now()));
        *self.now.lock().unwrap_or_else(|p| p.into_inner()) = name;
    }

    /// Ends the set-up: logs what each stage took and, if the slow line was printed, prints
    /// it too. Returns whether it was.
    pub fn finish(mut self) -> bool {
        let end = Instant::now();
        drop(self.done.take());
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
        let said_slow = self.said_slow.load(Ordering::Relaxed);
        let parts: Vec<String> = self
            .stages
            .iter()
            .enumerate()
            .map(|(i, (name, at))| {
                let until = self.stages.get(i + 1).map_or(end, |s| s.1);
                format!("{name} {:.2}s", (until - *at).as_secs_f64())
            })
            .collect();
        let total = (end - self.start).as_secs_f64();
        tracing::info!(what = %self.what, seconds = total, stages = %parts.join(", "), "set-up done");
        if said_slow {
            eprintln!(
                "xfer: set-up of {} took {total:.1}s ({})",
                self.what,
                parts.join(", ")
            );
        }
        said_slow
    }
}

impl Drop for SetUpClock {
    /// A set-up that failed stops its watcher too.
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
    }
}

/// Waits for the set-up to end (`stopped` disconnects); past `after` prints one line and
/// sets `said`.
fn watch(
    what: &str,
    start: Instant,
    after: Duration,
    now: &Mutex<&'static str>,
    stopped: &Receiver<()>,
    said: &AtomicBool,
) {
    if let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(after) {
        let stage = *now.lock().unwrap_or_else(|p| p.into_inner());
        eprintln!(
            "xfer: setting up {what} is taking a while: {stage} ({:.1}s so far)",
            start.elapsed().as_secs_f64()
        );
        said.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quick_set_up_says_nothing_and_a_slow_one_says_so() {
        let mut quick = SetUpClock::saying_slow_after("1 rail".into(), FILLING, Duration::MAX);
        quick.stage(STARTING);
        assert!(!quick.finish());
        // Slow after no time at all: the line is due at once, while the set-up goes on.
        let slow = SetUpClock::saying_slow_after("1 rail".into(), FILLING, Duration::ZERO);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !slow.said_slow.load(Ordering::Relaxed) && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert!(slow.finish());
    }
}
