//! What an engine and its transport count, readable from any thread while they run: the
//! figures `xfer serve --metrics` exports, available to any program through
//! [`Engine::stats`](crate::engine::Engine::stats) and
//! [`RailGroup::stats`](crate::engine::RailGroup::stats).
//!
//! - [`LatencyHistogram`]: transfer latencies in power-of-two buckets of atomics (no lock on
//!   the path that records them);
//! - [`TransportStats`]: what a transport saw peers do to it (the bytes their one-sided
//!   WRITEs placed in our regions, the READs it served, the requests it refused) and the
//!   state of each peer with its last error. A transport that keeps them hands the engine
//!   one through [`Transport::stats`](crate::Transport::stats).
//!
//! ```
//! use fabric_core::stats::LatencyHistogram;
//! use std::time::Duration;
//! let h = LatencyHistogram::default();
//! h.record(Duration::from_micros(3));
//! h.record(Duration::from_millis(2));
//! let s = h.snapshot();
//! assert_eq!(s.count, 2);
//! // Cumulative: one transfer took at most 4 µs, both at most 2.1 ms.
//! assert_eq!(s.count_at_most(Duration::from_micros(4)), 1);
//! assert_eq!(s.count_at_most(Duration::from_micros(2048)), 2);
//! ```

use crate::types::PeerId;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Buckets of a [`LatencyHistogram`]: bucket `i` holds latencies of at most `2^i` µs, the
/// last one everything longer (1 µs to about 67 s, then +Inf).
pub const LATENCY_BUCKETS: usize = 28;

/// Transfer latencies: power-of-two buckets of microseconds, a count and a sum, each an
/// atomic (recording is three relaxed additions).
#[derive(Debug)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; LATENCY_BUCKETS],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
        }
    }
}

/// The bucket of a latency: the smallest `i` with `d <= 2^i µs` (the last bucket for
/// anything longer).
fn bucket_of(d: Duration) -> usize {
    let us = d.as_nanos().div_ceil(1000).max(1);
    // ceil(log2(us)): 1 µs -> 0, 2 -> 1, 3..=4 -> 2, ...
    let i = (u128::BITS - (us - 1).leading_zeros()) as usize;
    i.min(LATENCY_BUCKETS - 1)
}

impl LatencyHistogram {
    /// Records one latency.
    pub fn record(&self, d: Duration) {
        self.buckets[bucket_of(d)].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// The figures so far.
    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
            count: self.count.load(Ordering::Relaxed),
            sum: Duration::from_nanos(self.sum_ns.load(Ordering::Relaxed)),
        }
    }
}

/// A [`LatencyHistogram`] read at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HistogramSnapshot {
    /// Latencies per bucket (not cumulative): bucket `i` counts those of at most `2^i` µs
    /// and more than `2^(i-1)` µs; the last one also everything longer.
    pub buckets: [u64; LATENCY_BUCKETS],
    /// Latencies recorded.
    pub count: u64,
    /// Their sum.
    pub sum: Duration,
}

impl HistogramSnapshot {
    /// The upper bound of bucket `i` (`None`: the last bucket, unbounded).
    pub fn upper_bound(i: usize) -> Option<Duration> {
        (i + 1 < LATENCY_BUCKETS).then(|| Duration::from_micros(1 << i))
    }

    /// How many latencies were at most `d` (rounded to the bucket bounds: exact when `d` is
    /// a bound, `2^i` µs).
    pub fn count_at_most(&self, d: Duration) -> u64 {
        self.buckets[..=bucket_of(d)].iter().sum()
    }

    /// Adds another histogram's figures (rails of one group, say).
    pub fn merge(&mut self, other: &HistogramSnapshot) {
        for (a, b) in self.buckets.iter_mut().zip(other.buckets) {
            *a += b;
        }
        self.count += other.count;
        self.sum += other.sum;
    }
}

/// What became of a peer, as its transport sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PeerState {
    /// Added, its connections not all made yet.
    Connecting,
    /// Every connection up.
    Connected,
    /// Gone: removed, its connections closed, or it never connected.
    Closed,
}

impl PeerState {
    /// A short name (`connecting`, `connected`, `closed`), for labels and logs.
    pub fn name(self) -> &'static str {
        match self {
            PeerState::Connecting => "connecting",
            PeerState::Connected => "connected",
            PeerState::Closed => "closed",
        }
    }
}

/// One peer of a transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerStatus {
    /// The peer, as this transport names it.
    pub peer: PeerId,
    /// Its transport address, as text.
    pub address: String,
    /// It connected to us (rather than being added by [`add_peer`](crate::Transport::add_peer)).
    pub passive: bool,
    /// Its state.
    pub state: PeerState,
    /// Open connections.
    pub connections: usize,
    /// Why its last connection to fail failed, if one has.
    pub last_error: Option<String>,
}

/// Peers that are gone but still reported, the most recent first out of this many.
pub const CLOSED_PEERS_KEPT: usize = 32;

#[derive(Debug, Default)]
struct PeerTable {
    live: HashMap<PeerId, PeerStatus>,
    /// The last [`CLOSED_PEERS_KEPT`] peers that closed, oldest first.
    closed: VecDeque<PeerStatus>,
}

/// What a transport saw peers do to it, and its peers: counters of atomics and a table of
/// peers behind a lock taken only when a peer comes, goes or fails. Shared by the
/// transport (which updates it) and its engine (which reads it).
///
/// The target side of a one-sided WRITE counts here: an initiator's engine counts the bytes
/// it wrote ([`CounterSnapshot::bytes`](crate::engine::CounterSnapshot::bytes)), and the
/// target's transport the bytes that landed ([`received_bytes`](Self::received_bytes)).
/// Backends whose NIC places bytes without the CPU (RDMA) cannot count these.
#[derive(Debug, Default)]
pub struct TransportStats {
    /// Bytes that peers' WRITEs placed in our registered regions.
    pub received_bytes: AtomicU64,
    /// Peers' WRITEs placed (each frame once, however many bytes).
    pub received_writes: AtomicU64,
    /// Bytes sent from our regions to answer peers' READs.
    pub served_read_bytes: AtomicU64,
    /// Peers' requests refused before they touched memory (unknown key, out of bounds,
    /// no permission, a checksum that does not match).
    pub refused_requests: AtomicU64,
    /// Peers' WRITEs whose checksum did not match: refused, nothing placed.
    pub checksum_mismatches: AtomicU64,
    peers: Mutex<PeerTable>,
}

/// A [`TransportStats`] read at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransportSnapshot {
    /// See [`TransportStats::received_bytes`].
    pub received_bytes: u64,
    /// See [`TransportStats::received_writes`].
    pub received_writes: u64,
    /// See [`TransportStats::served_read_bytes`].
    pub served_read_bytes: u64,
    /// See [`TransportStats::refused_requests`].
    pub refused_requests: u64,
    /// See [`TransportStats::checksum_mismatches`].
    pub checksum_mismatches: u64,
    /// Live peers (by id), then the last [`CLOSED_PEERS_KEPT`] closed ones.
    pub peers: Vec<PeerStatus>,
}

impl TransportStats {
    fn lock(&self) -> std::sync::MutexGuard<'_, PeerTable> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `n` to a counter (relaxed).
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// A peer appeared (added, or connected to us), its connections not up yet.
    pub fn peer_added(&self, peer: PeerId, address: String, passive: bool) {
        self.lock().live.insert(
            peer,
            PeerStatus {
                peer,
                address,
                passive,
                state: PeerState::Connecting,
                connections: 0,
                last_error: None,
            },
        );
    }

    /// A live peer's state and open connections changed.
    pub fn peer_state(&self, peer: PeerId, state: PeerState, connections: usize) {
        if let Some(p) = self.lock().live.get_mut(&peer) {
            p.state = state;
            p.connections = connections;
        }
    }

    /// A connection of a live peer failed with `error` (the peer may stay, on others).
    pub fn peer_error(&self, peer: PeerId, error: String, connections: usize) {
        if let Some(p) = self.lock().live.get_mut(&peer) {
            p.last_error = Some(error);
            p.connections = connections;
        }
    }

    /// A peer is gone (with `error`, if one ended it); it stays in the report among the
    /// last [`CLOSED_PEERS_KEPT`] closed ones.
    pub fn peer_closed(&self, peer: PeerId, error: Option<String>) {
        let mut t = self.lock();
        let Some(mut p) = t.live.remove(&peer) else {
            return;
        };
        p.state = PeerState::Closed;
        p.connections = 0;
        if error.is_some() {
            p.last_error = error;
        }
        if t.closed.len() == CLOSED_PEERS_KEPT {
            t.closed.pop_front();
        }
        t.closed.push_back(p);
    }

    /// Everything, read now.
    pub fn snapshot(&self) -> TransportSnapshot {
        let t = self.lock();
        let mut peers: Vec<PeerStatus> = t.live.values().cloned().collect();
        peers.sort_by_key(|p| p.peer);
        peers.extend(t.closed.iter().rev().cloned());
        drop(t);
        TransportSnapshot {
            received_bytes: self.received_bytes.load(Ordering::Relaxed),
            received_writes: self.received_writes.load(Ordering::Relaxed),
            served_read_bytes: self.served_read_bytes.load(Ordering::Relaxed),
            refused_requests: self.refused_requests.load(Ordering::Relaxed),
            checksum_mismatches: self.checksum_mismatches.load(Ordering::Relaxed),
            peers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latencies_land_in_power_of_two_buckets_of_microseconds() {
        assert_eq!(bucket_of(Duration::ZERO), 0);
        assert_eq!(bucket_of(Duration::from_nanos(999)), 0);
        assert_eq!(bucket_of(Duration::from_micros(1)), 0);
        assert_eq!(bucket_of(Duration::from_nanos(1001)), 1);
        assert_eq!(bucket_of(Duration::from_micros(2)), 1);
        assert_eq!(bucket_of(Duration::from_micros(3)), 2);
        assert_eq!(bucket_of(Duration::from_micros(1024)), 10);
        assert_eq!(bucket_of(Duration::from_secs(3600)), LATENCY_BUCKETS - 1);
        for i in 0..LATENCY_BUCKETS - 1 {
            let b = HistogramSnapshot::upper_bound(i).expect("bounded");
            assert_eq!(bucket_of(b), i, "bound of bucket {i}");
            assert_eq!(bucket_of(b + Duration::from_nanos(1)), i + 1);
        }
        assert_eq!(HistogramSnapshot::upper_bound(LATENCY_BUCKETS - 1), None);
        let h = LatencyHistogram::default();
        for us in [1, 5, 5, 300, 70_000_000] {
            h.record(Duration::from_micros(us));
        }
        let mut s = h.snapshot();
        assert_eq!(s.count, 5);
        assert_eq!(s.sum, Duration::from_micros(70_000_311));
        assert_eq!(s.buckets[0], 1);
        assert_eq!(s.buckets[3], 2);
        assert_eq!(s.buckets[9], 1);
        assert_eq!(s.buckets[LATENCY_BUCKETS - 1], 1);
        assert_eq!(s.count_at_most(Duration::from_micros(8)), 3);
        s.merge(&h.snapshot());
        assert_eq!(s.count, 10);
        assert_eq!(s.count_at_most(Duration::from_micros(512)), 8);
    }

    #[test]
    fn peers_keep_their_last_error_and_closed_ones_are_bounded() {
        let s = TransportStats::default();
        s.peer_added(PeerId(1), "tcp://a".into(), false);
        s.peer_state(PeerId(1), PeerState::Connected, 2);
        s.peer_error(PeerId(1), "connection reset".into(), 1);
        let snap = s.snapshot();
        assert_eq!(snap.peers.len(), 1);
        let p = &snap.peers[0];
        assert_eq!((p.state, p.connections), (PeerState::Connected, 1));
        assert_eq!(p.last_error.as_deref(), Some("connection reset"));
        // Closed without a new error: the last one stays.
        s.peer_closed(PeerId(1), None);
        let p = &s.snapshot().peers[0];
        assert_eq!((p.state, p.connections), (PeerState::Closed, 0));
        assert_eq!(p.last_error.as_deref(), Some("connection reset"));
        for i in 2..100 {
            s.peer_added(PeerId(i), format!("tcp://{i}"), true);
            s.peer_closed(PeerId(i), Some(format!("gone {i}")));
        }
        s.peer_added(PeerId(500), "tcp://live".into(), true);
        let snap = s.snapshot();
        assert_eq!(snap.peers.len(), 1 + CLOSED_PEERS_KEPT);
        assert_eq!(snap.peers[0].peer, PeerId(500));
        // The most recent closed first.
        assert_eq!(snap.peers[1].last_error.as_deref(), Some("gone 99"));
        // Unknown peers change nothing.
        s.peer_state(PeerId(7777), PeerState::Connected, 1);
        s.peer_closed(PeerId(7777), None);
        assert_eq!(s.snapshot().peers.len(), 1 + CLOSED_PEERS_KEPT);
    }
}
