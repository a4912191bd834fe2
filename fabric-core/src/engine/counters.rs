//! An engine's counters (updated by its worker, readable from any thread) and the
//! snapshots of them, with its latencies, registrations and transport's figures
//! ([`EngineStats`]), and a rail group's ([`GroupStats`]).

use crate::stats::{HistogramSnapshot, TransportSnapshot};
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one engine, readable at any time.
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes of successful operations.
    pub bytes: AtomicU64,
    /// Operations posted.
    pub ops: AtomicU64,
    /// Operations completed (either way): `ops - completed` are in flight.
    pub completed: AtomicU64,
    /// Posts refused for lack of room and retried later.
    pub reposts: AtomicU64,
    /// Operations that failed.
    pub errors: AtomicU64,
    /// Transfers finished (either way).
    pub transfers: AtomicU64,
    /// Transfers (and SENDs) under way now: a gauge.
    pub active: AtomicU64,
    /// Peers' immediate data that arrived (counted in the engine's inbox, never dropped).
    pub notifications: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// See [`Counters::bytes`].
    pub bytes: u64,
    /// See [`Counters::ops`].
    pub ops: u64,
    /// See [`Counters::completed`].
    pub completed: u64,
    /// Operations posted and not completed yet.
    pub in_flight: u64,
    /// See [`Counters::reposts`].
    pub reposts: u64,
    /// See [`Counters::errors`].
    pub errors: u64,
    /// See [`Counters::transfers`].
    pub transfers: u64,
    /// See [`Counters::active`].
    pub active: u64,
    /// See [`Counters::notifications`].
    pub notifications: u64,
}

impl Counters {
    /// Reads all counters.
    pub fn snapshot(&self) -> CounterSnapshot {
        // Completions are read first: a completion counted is then never missing its post.
        let completed = self.completed.load(Ordering::Relaxed);
        let ops = self.ops.load(Ordering::Relaxed);
        CounterSnapshot {
            bytes: self.bytes.load(Ordering::Relaxed),
            ops,
            completed,
            in_flight: ops.saturating_sub(completed),
            reposts: self.reposts.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            transfers: self.transfers.load(Ordering::Relaxed),
            active: self.active.load(Ordering::Relaxed),
            notifications: self.notifications.load(Ordering::Relaxed),
        }
    }
}

impl CounterSnapshot {
    /// Adds another engine's figures (the rails of a group).
    pub fn add(&mut self, c: &CounterSnapshot) {
        self.bytes += c.bytes;
        self.ops += c.ops;
        self.completed += c.completed;
        self.in_flight += c.in_flight;
        self.reposts += c.reposts;
        self.errors += c.errors;
        self.transfers += c.transfers;
        self.active += c.active;
        self.notifications += c.notifications;
    }
}

/// Everything one engine can tell about itself, read at one moment
/// ([`Engine::stats`](super::Engine::stats)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// The backend's name.
    pub backend: &'static str,
    /// What the worker counted.
    pub counters: CounterSnapshot,
    /// Latency of this engine's successful transfers, submit to completion (for a rail of
    /// a [`RailGroup`](super::RailGroup): of the chunks it carried).
    pub latency: HistogramSnapshot,
    /// Bytes of the regions registered now.
    pub registered_bytes: u64,
    /// Regions registered now.
    pub registered_regions: usize,
    /// What the transport counted of its peers, if it keeps figures
    /// ([`Transport::stats`](crate::Transport::stats)).
    pub transport: Option<TransportSnapshot>,
}

/// A rail group's figures ([`RailGroup::stats`](super::RailGroup::stats)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupStats {
    /// Each rail's engine, in rail order.
    pub rails: Vec<EngineStats>,
    /// The NIC of each rail, where it was named.
    pub nics: Vec<Option<String>>,
    /// Latency of the group's successful transfers, submit to completion (every chunk
    /// landed and the immediate data, if any, delivered).
    pub latency: HistogramSnapshot,
}

impl GroupStats {
    /// The rails' counters summed.
    pub fn counters(&self) -> CounterSnapshot {
        let mut s = CounterSnapshot::default();
        for r in &self.rails {
            s.add(&r.counters);
        }
        s
    }

    /// Bytes peers' WRITEs placed in this group's regions, over every rail (0 where the
    /// transport counts none).
    pub fn received_bytes(&self) -> u64 {
        self.rails
            .iter()
            .filter_map(|r| r.transport.as_ref())
            .map(|t| t.received_bytes)
            .sum()
    }
}
