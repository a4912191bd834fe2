//! Where peers' immediate data lands: an [`Inbox`] per engine that counts every arrival per
//! (sender, value) and never drops one, and [`Notifications`], one view over the inboxes of
//! several engines (a rail group's rails, or every rail of an agent).
//!
//! An inbox is an immediate-data counter, not a queue of events: memory grows with the
//! distinct (sender, value) pairs not yet taken, never with the arrivals, so a receiver
//! that looks late (or never) loses nothing and holds bounded memory. Waiting for a value
//! and a count ([`Notifications::wait_imm`]), taking arrivals one by one
//! ([`Notifications::next`], [`Notifications::try_next`]) and draining everything
//! ([`Notifications::drain`]) are views of the same counts: they can be mixed, and each
//! arrival is taken exactly once.
//!
//! The one bound: an inbox keeps at most so many distinct (sender, value) pairs untaken
//! ([`EngineConfig::notification_keys`](super::EngineConfig::notification_keys), by
//! default [`MAX_KEYS`]). An arrival of a new pair beyond that is not kept; it is counted
//! ([`Inbox::refused`]) and said in the log at the first and at each power of two, so a
//! peer that sends endless distinct values to a receiver that never looks cannot exhaust
//! its memory, and the loss is never silent. An engine whose application never takes
//! notifications (a server) keeps none: a bound of 0 counts arrivals and keeps nothing,
//! quietly, as asked.

use super::rails::WARM_UP_IMM;
use crate::error::{Error, Result};
use crate::types::PeerId;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// Who sent an arrival and its value: what an inbox counts by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NoteKey {
    /// The immediate value.
    pub imm: u32,
    /// The sender as the receiving transport names it (its id on that engine), where known.
    pub peer: Option<PeerId>,
    /// The sender's address on this transport (what the sender's agent publishes as its
    /// rail's address), where the transport knows it: the same sender has the same address
    /// on every one of its rails, so it names the sender across engines.
    pub from: Option<Arc<[u8]>>,
    /// The bytes a message carried ([`Transfer::message`](super::Transfer::message)),
    /// `None` for plain immediate data. Messages of the same sender, value and bytes are
    /// counted together like plain arrivals.
    pub message: Option<Arc<[u8]>>,
}

/// Arrivals taken from an inbox: one (sender, value) and how many times it landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// The inbox it came from (its index among the [`Notifications`]' engines; 0 for an
    /// engine's own).
    pub source: usize,
    /// Sender and value.
    pub key: NoteKey,
    /// How many arrivals this is (1 from [`Notifications::next`]).
    pub count: u64,
}

/// Raised by an inbox on every arrival, for whoever waits on one or several inboxes.
#[derive(Default)]
pub(crate) struct Bell {
    rung: Mutex<u64>,
    cv: Condvar,
}

impl Bell {
    fn lock(&self) -> MutexGuard<'_, u64> {
        self.rung.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ring(&self) {
        *self.lock() += 1;
        self.cv.notify_all();
    }

    /// How often it has rung.
    fn rung(&self) -> u64 {
        *self.lock()
    }

    /// Waits until it rings past `seen`, or `deadline`.
    fn wait_past(&self, seen: u64, deadline: Instant) {
        let mut g = self.lock();
        while *g == seen {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            g = self
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// The most distinct (sender, value) pairs one inbox keeps untaken, by default.
pub const MAX_KEYS: usize = 1 << 20;

/// Stamps keys in order of first arrival, process-wide, so that [`Notifications::next`]
/// takes the oldest across inboxes.
static STAMP: AtomicU64 = AtomicU64::new(0);

#[derive(Default)]
struct Counts {
    /// Untaken arrivals per key.
    counts: HashMap<NoteKey, u64>,
    /// Keys with arrivals, oldest first, each once, with the stamp of its first arrival
    /// (or of when it was last taken from, see `take_front`).
    order: VecDeque<(u64, NoteKey)>,
    /// Untaken arrivals per value, all senders.
    per_value: HashMap<u32, u64>,
}

impl Counts {
    /// Counts `n` arrivals of `key`; false (nothing counted) for a new key beyond
    /// `max_keys`.
    fn add(&mut self, key: NoteKey, n: u64, max_keys: usize) -> bool {
        if self.counts.len() >= max_keys && !self.counts.contains_key(&key) {
            return false;
        }
        *self.per_value.entry(key.imm).or_default() += n;
        let c = self.counts.entry(key.clone()).or_default();
        if *c == 0 {
            self.order
                .push_back((STAMP.fetch_add(1, Ordering::Relaxed), key));
        }
        *c += n;
        true
    }

    fn available(&self, imm: u32) -> u64 {
        self.per_value.get(&imm).copied().unwrap_or(0)
    }

    /// Takes up to `want` arrivals of value `imm`, oldest sender first; returns how many.
    fn take_value(&mut self, imm: u32, want: u64) -> u64 {
        let mut left = want.min(self.available(imm));
        let taken = left;
        if left == 0 {
            return 0;
        }
        let counts = &mut self.counts;
        self.order.retain(|(_, k)| {
            if left == 0 || k.imm != imm {
                return true;
            }
            let c = counts.get_mut(k).expect("a key in order has a count");
            let n = left.min(*c);
            *c -= n;
            left -= n;
            if *c == 0 {
                counts.remove(k);
                false
            } else {
                true
            }
        });
        self.sub_value(imm, taken);
        taken
    }

    fn sub_value(&mut self, imm: u32, n: u64) {
        if let Some(v) = self.per_value.get_mut(&imm) {
            *v -= n;
            if *v == 0 {
                self.per_value.remove(&imm);
            }
        }
    }

    /// Takes one arrival or all of them (`all`) of the oldest key. A key with arrivals
    /// left goes to the back, as if it arrived again now, so that senders and values
    /// interleave as they arrived instead of one draining before the next is seen.
    fn take_front(&mut self, all: bool) -> Option<(NoteKey, u64)> {
        let (_, key) = self.order.pop_front()?;
        let c = self
            .counts
            .get_mut(&key)
            .expect("a key in order has a count");
        let n = if all { *c } else { 1 };
        *c -= n;
        if *c == 0 {
            self.counts.remove(&key);
        } else {
            self.order
                .push_back((STAMP.fetch_add(1, Ordering::Relaxed), key.clone()));
        }
        self.sub_value(key.imm, n);
        Some((key, n))
    }
}

/// One engine's arrivals (see the module documentation). The engine's worker adds to it;
/// any number of [`Notifications`] may take from it.
pub struct Inbox {
    counts: Mutex<Counts>,
    /// The most distinct (sender, value) pairs kept untaken (0: none kept, quietly).
    max_keys: usize,
    /// The bells of the views that wait on this inbox (its own first).
    bells: Mutex<Vec<Weak<Bell>>>,
    /// Arrivals not kept: new pairs beyond [`MAX_KEYS`].
    refused: AtomicU64,
}

impl Default for Inbox {
    /// An inbox that keeps up to [`MAX_KEYS`] pairs.
    fn default() -> Inbox {
        Inbox::new(MAX_KEYS)
    }
}

impl Inbox {
    /// An inbox that keeps up to `max_keys` distinct (sender, value) pairs untaken; 0
    /// keeps none (arrivals are only counted by the engine, with no log line).
    pub fn new(max_keys: usize) -> Inbox {
        Inbox {
            counts: Mutex::new(Counts::default()),
            max_keys,
            bells: Mutex::new(Vec::new()),
            refused: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one arrival of `key` (warm-up writes, [`WARM_UP_IMM`], are not counted) and
    /// wakes whoever waits.
    pub(crate) fn arrive(&self, key: NoteKey) {
        if key.imm == WARM_UP_IMM {
            return;
        }
        self.count(key, self.max_keys);
    }

    /// Keeps one message (a notification with bytes), beyond the bound if need be: a
    /// message is never dropped. The worker that receives messages holds the senders back
    /// instead, posting no receive while [`has_room`](Self::has_room) is false.
    pub(crate) fn message(&self, key: NoteKey) {
        self.count(key, usize::MAX);
    }

    /// Whether fewer distinct (sender, value) pairs than the bound wait untaken.
    pub(crate) fn has_room(&self) -> bool {
        self.lock().counts.len() < self.max_keys
    }

    fn count(&self, key: NoteKey, max_keys: usize) {
        if !self.lock().add(key, 1, max_keys) {
            let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
            if self.max_keys > 0 && n.is_power_of_two() {
                tracing::error!(
                    refused = n,
                    keys = self.max_keys,
                    "notifications lost: {} distinct (sender, value) pairs wait untaken; \
                     take them (wait_imm, next, drain) to make room",
                    self.max_keys
                );
            }
            return;
        }
        let bells = self.bells.lock().unwrap_or_else(|p| p.into_inner());
        for b in bells.iter().filter_map(Weak::upgrade) {
            b.ring();
        }
    }

    fn listen(&self, bell: &Arc<Bell>) {
        let mut bells = self.bells.lock().unwrap_or_else(|p| p.into_inner());
        bells.retain(|b| b.strong_count() > 0);
        bells.push(Arc::downgrade(bell));
    }

    /// Arrivals not kept since the inbox was made: new (sender, value) pairs beyond its
    /// bound.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Arrivals not yet taken, all values and senders.
    pub fn pending(&self) -> u64 {
        self.lock().per_value.values().sum()
    }
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("pending", &self.pending())
            .finish()
    }
}

/// One view over the inboxes of a set of engines (see the module documentation). Any
/// number of views may take from the same inboxes: every arrival is taken once, by one of
/// them.
pub struct Notifications {
    inboxes: Vec<Arc<Inbox>>,
    bell: Arc<Bell>,
}

impl Notifications {
    /// A view over `inboxes` (an engine's is [`Engine::inbox`](super::Engine::inbox)).
    pub fn new(inboxes: Vec<Arc<Inbox>>) -> Notifications {
        let bell = Arc::new(Bell::default());
        for i in &inboxes {
            i.listen(&bell);
        }
        Notifications { inboxes, bell }
    }

    /// Every inbox, locked in order (one order for all views: no deadlock).
    fn lock_all(&self) -> Vec<MutexGuard<'_, Counts>> {
        self.inboxes.iter().map(|i| i.lock()).collect()
    }

    /// Waits until `cond` (run with every inbox locked) returns `Some`, or `timeout`.
    fn wait_for<R>(
        &self,
        timeout: Duration,
        what: &'static str,
        mut cond: impl FnMut(&mut [MutexGuard<'_, Counts>]) -> Option<R>,
    ) -> Result<R> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.bell.rung();
            if let Some(r) = cond(&mut self.lock_all()) {
                return Ok(r);
            }
            if Instant::now() >= deadline {
                return Err(Error::TimedOut(timeout, what));
            }
            self.bell.wait_past(seen, deadline);
        }
    }

    /// Waits until `count` arrivals of immediate value `imm` (from any sender, on any
    /// engine) are there, or `timeout` passes; then takes them. Nothing is taken on a
    /// timeout.
    pub fn wait_imm(&self, imm: u32, count: u64, timeout: Duration) -> Result<()> {
        self.wait_for(timeout, "immediate data", |all| {
            let have: u64 = all.iter().map(|c| c.available(imm)).sum();
            if have < count {
                return None;
            }
            let mut left = count;
            for c in all.iter_mut() {
                left -= c.take_value(imm, left);
            }
            Some(())
        })
    }

    /// How many arrivals of `imm` are there, not yet taken.
    pub fn count(&self, imm: u32) -> u64 {
        self.lock_all().iter().map(|c| c.available(imm)).sum()
    }

    /// Takes the oldest arrival (`all` false: one of it; true: all of its sender and value).
    fn take(all: &mut [MutexGuard<'_, Counts>], every: bool) -> Option<Note> {
        let (source, _) = all
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.order.front().map(|(s, _)| (i, *s)))
            .min_by_key(|&(_, s)| s)?;
        let (key, count) = all[source].take_front(every)?;
        Some(Note { source, key, count })
    }

    /// The oldest arrival not yet taken (one of it), waiting at most `timeout`.
    pub fn next(&self, timeout: Duration) -> Result<Note> {
        self.wait_for(timeout, "a notification", |all| Self::take(all, false))
    }

    /// The oldest arrival not yet taken (one of it), if any, without waiting.
    pub fn try_next(&self) -> Option<Note> {
        Self::take(&mut self.lock_all(), false)
    }

    /// Takes everything there is: each (sender, value) once with its count, oldest first.
    pub fn drain(&self) -> Vec<Note> {
        let mut all = self.lock_all();
        std::iter::from_fn(|| Self::take(&mut all, true)).collect()
    }
}

impl std::fmt::Debug for Notifications {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifications")
            .field("inboxes", &self.inboxes.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(imm: u32, from: &str) -> NoteKey {
        NoteKey {
            imm,
            peer: Some(PeerId(1)),
            from: Some(Arc::from(from.as_bytes())),
            message: None,
        }
    }

    #[test]
    fn waiting_iterating_and_draining_take_each_arrival_once() {
        let (a, b) = (Arc::new(Inbox::default()), Arc::new(Inbox::default()));
        let n = Notifications::new(vec![a.clone(), b.clone()]);
        for i in 0..1000u32 {
            a.arrive(key(i % 7, "x"));
            b.arrive(key(i % 7, "y"));
        }
        a.arrive(key(WARM_UP_IMM, "x"));
        assert_eq!(n.count(3), 2 * 143);
        n.wait_imm(3, 200, Duration::ZERO)
            .expect("200 of 286 are there");
        assert_eq!(n.count(3), 86);
        // One at a time, oldest key first: value 0 from x came first, then 0 from y.
        let first = n.next(Duration::ZERO).expect("arrivals are there");
        assert_eq!((first.source, first.key, first.count), (0, key(0, "x"), 1));
        let second = n.next(Duration::ZERO).expect("arrivals are there");
        assert_eq!((second.source, second.key), (1, key(0, "y")));
        let mut total = 2 + 200;
        for note in n.drain() {
            assert!(note.key.imm != WARM_UP_IMM);
            total += note.count;
        }
        assert_eq!(total, 2000);
        assert!(n.try_next().is_none());
        let e = n.wait_imm(3, 1, Duration::from_millis(1)).unwrap_err();
        assert!(matches!(e, Error::TimedOut(..)), "{e}");
    }

    #[test]
    fn a_timed_out_wait_takes_nothing_and_a_second_view_sees_the_rest() {
        let a = Arc::new(Inbox::default());
        let (v1, v2) = (
            Notifications::new(vec![a.clone()]),
            Notifications::new(vec![a.clone()]),
        );
        for _ in 0..5 {
            a.arrive(key(9, "x"));
        }
        assert!(v1.wait_imm(9, 6, Duration::from_millis(1)).is_err());
        assert_eq!(v2.count(9), 5);
        v2.wait_imm(9, 2, Duration::ZERO).expect("two of five");
        v1.wait_imm(9, 3, Duration::ZERO).expect("the three left");
        assert_eq!(a.pending(), 0);
    }

    #[test]
    fn an_inbox_keeps_no_more_pairs_than_its_bound_and_counts_the_rest() {
        let a = Arc::new(Inbox::new(2));
        let n = Notifications::new(vec![a.clone()]);
        for v in [1, 2, 1, 3, 4, 2] {
            a.arrive(key(v, "x"));
        }
        assert_eq!((n.count(1), n.count(2), n.count(3)), (2, 2, 0));
        assert_eq!(a.refused(), 2);
        let none = Inbox::new(0);
        none.arrive(key(1, "x"));
        assert_eq!((none.pending(), none.refused()), (0, 1));
    }

    #[test]
    fn a_waiter_wakes_on_an_arrival_from_another_thread() {
        let a = Arc::new(Inbox::default());
        let n = Notifications::new(vec![a.clone()]);
        let t = std::thread::spawn(move || n.wait_imm(5, 3, Duration::from_secs(30)));
        for _ in 0..3 {
            a.arrive(key(5, "x"));
        }
        t.join().expect("no panic").expect("woken by the third");
    }
}
