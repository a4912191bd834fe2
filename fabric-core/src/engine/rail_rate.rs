//! A rail's rate, as the chunks it lands show it: what lets a
//! [`RailGroup`](super::rails::RailGroup)'s rail hold more than its first chunks in flight
//! (see [`Balance`](super::rails::Balance)). Pure: time is an argument.
//!
//! Chunks land in bunches. A rail's worker that was off its core reads several completions
//! in one poll, and TCP hands over a chunk held behind a lost segment together with the
//! chunks behind it. Measured from one landing to the next, the second of two chunks that
//! landed 0.2 ms apart looked like gigabytes per second, and the smoothed rate followed: a
//! rail then took up to `Balance::max_in_flight_bytes` at once. Under CPU load with `tc`'s
//! token bucket dropping packets, a NIC at a quarter of the others' speed so took 39 % of a
//! transfer, which then moved at that NIC's pace (`xfer-cli/tests/netns_nics.rs`), and fast
//! rails took 44 % where they should have taken 31 %.
//!
//! So bytes are counted over windows of at least the balance's horizon: a bunch can raise
//! a sample only by its own bytes spread over the whole window, and the budget a rail takes
//! from it (its rate times the horizon) grows by at most a quarter of those bytes.
//!
//! A window's length is the time the rail was busy (had a chunk in flight), not the time
//! since it opened: idle time is not the link's, and it is left out of the window rather
//! than restarting it. A rail whose chunks each land well within a horizon and that drains
//! between them (a fast link whose completions come in one poll: the next chunk is taken
//! only after they land) so still closes windows; restarting the window at every such gap
//! left its rate unknown for good, and the rail at its `in_flight` chunks of the
//! transfer's smallest size (an engine-only bench, `sim_p5`, lost half its rate).

use std::time::{Duration, Instant};

/// Weight of a new window's rate in the smoothed rate.
const SAMPLE_WEIGHT: f64 = 0.25;

/// A rail's smoothed rate and the window it is counting (updated on the rail's worker).
#[derive(Debug, Default)]
pub(crate) struct RailRate {
    /// How long the rail was busy (a chunk in flight) in the window being counted.
    busy: Duration,
    /// Bytes landed in the window.
    bytes: u64,
    /// When the last chunk landed.
    last: Option<Instant>,
    /// Bytes per second, smoothed; 0 until a window has closed.
    bytes_per_s: f64,
}

impl RailRate {
    /// Bytes per second, smoothed; 0 while unknown.
    pub(crate) fn bytes_per_s(&self) -> f64 {
        self.bytes_per_s
    }

    /// A chunk of `bytes` posted at `posted` landed at `now` (`ok`: placed, not failed).
    /// Its bytes join the window, and so does the time the rail was busy since its last
    /// landing, or since this chunk's post if the rail sat idle in between (the chunk was
    /// posted after that landing: idle time is not the link's). Once the rail was busy for
    /// at least `window`, the window's bytes over its busy time are a sample of the rate and
    /// a new window starts.
    pub(crate) fn landed(
        &mut self,
        bytes: u64,
        ok: bool,
        posted: Instant,
        now: Instant,
        window: Duration,
    ) {
        let from = self.last.map_or(posted, |l| l.max(posted));
        self.busy += now.saturating_duration_since(from);
        self.last = Some(self.last.map_or(now, |l| l.max(now)));
        if ok {
            self.bytes = self.bytes.saturating_add(bytes);
        }
        if self.bytes == 0 || self.busy.is_zero() || self.busy < window {
            return;
        }
        let sample = self.bytes as f64 / self.busy.as_secs_f64();
        self.bytes_per_s = if self.bytes_per_s == 0.0 {
            sample
        } else {
            (1.0 - SAMPLE_WEIGHT) * self.bytes_per_s + SAMPLE_WEIGHT * sample
        };
        self.busy = Duration::ZERO;
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ops::Range;

    const HORIZON: Duration = Duration::from_millis(16);
    /// The chunk the CLI's bench cut (15 pages of 64 KiB).
    const CHUNK: u64 = 983_040;

    fn ms(x: f64) -> Duration {
        Duration::from_secs_f64(x / 1e3)
    }

    /// A rail that holds two chunks from `start` on, one landing every `every`: chunks 0
    /// and 1 are posted at `start`, chunk `i` lands at `start + (i + 1) * every` and the
    /// next is posted then. Lands the chunks of `range`; returns the last landing's time.
    fn steady(r: &mut RailRate, start: Instant, every: Duration, range: Range<u32>) -> Instant {
        let mut t = start;
        for i in range {
            t = start + every * (i + 1);
            r.landed(CHUNK, true, start + every * i.saturating_sub(1), t, HORIZON);
        }
        t
    }

    fn close(a: f64, b: f64, tolerance: f64) -> bool {
        (a - b).abs() <= tolerance * b
    }

    #[test]
    fn a_steady_rail_is_measured_at_its_rate() {
        let start = Instant::now();
        // 25 Mbit/s: a chunk each 0.315 s; 100 Mbit/s: each 78.6 ms; 100 Gbps: 78.6 µs.
        for (every, rate) in [
            (ms(314.57), 3.125e6),
            (ms(78.643), 12.5e6),
            (ms(0.078643), 12.5e9),
        ] {
            let mut r = RailRate::default();
            steady(&mut r, start, every, 0..400);
            assert!(
                close(r.bytes_per_s(), rate, 0.01),
                "{} != {rate}",
                r.bytes_per_s()
            );
        }
    }

    #[test]
    fn the_first_sample_waits_for_a_whole_window() {
        let start = Instant::now();
        let mut r = RailRate::default();
        // 1 ms per chunk, counted from the first post: 15 landings span 15 ms.
        steady(&mut r, start, ms(1.0), 0..15);
        assert_eq!(r.bytes_per_s(), 0.0, "15 ms is less than the horizon");
        steady(&mut r, start, ms(1.0), 15..16);
        assert!(close(r.bytes_per_s(), CHUNK as f64 / 1e-3, 0.01));
    }

    /// Two chunks that land 0.2 ms apart (a bunch) on a rail at a quarter of 100 Mbit/s:
    /// its budget stays under one chunk, so it keeps holding only its first two. Counted
    /// from one landing to the next, the bunch made it about 1.2 GB/s: a budget of 19 MB.
    #[test]
    fn a_bunch_of_landings_does_not_make_a_slow_rail_fast() {
        let start = Instant::now();
        let every = ms(314.57);
        let mut r = RailRate::default();
        steady(&mut r, start, every, 0..10);
        // Chunk 10 is held (a lost segment) and lands with chunk 11, behind it.
        let late = start + every * 12;
        r.landed(CHUNK, true, start + every * 9, late, HORIZON);
        r.landed(CHUNK, true, start + every * 10, late + ms(0.2), HORIZON);
        let budget = |r: &RailRate| r.bytes_per_s() * HORIZON.as_secs_f64();
        assert!(budget(&r) < CHUNK as f64, "{} B/s", r.bytes_per_s());
        // The two posted then land at the link's pace.
        for i in 1..=2u32 {
            r.landed(CHUNK, true, late, late + every * i, HORIZON);
            assert!(budget(&r) < CHUNK as f64, "{} B/s", r.bytes_per_s());
        }
        // Only bunches from now on: still the rail's rate over time.
        let mut t = late + every * 2;
        for _ in 0..50 {
            let posted = t;
            t += every * 2;
            r.landed(CHUNK, true, posted, t, HORIZON);
            r.landed(CHUNK, true, posted + ms(0.2), t + ms(0.2), HORIZON);
            assert!(budget(&r) < CHUNK as f64, "{} B/s", r.bytes_per_s());
        }
        assert!(close(r.bytes_per_s(), 3.125e6, 0.05), "{}", r.bytes_per_s());
    }

    #[test]
    fn idle_time_is_not_the_links() {
        let start = Instant::now();
        let every = ms(78.643);
        let mut r = RailRate::default();
        let t = steady(&mut r, start, every, 0..20);
        // Idle for 5 s, then one chunk alone: measured from its post, not from the last
        // landing.
        let posted = t + Duration::from_secs(5);
        r.landed(CHUNK, true, posted, posted + every, HORIZON);
        assert!(close(r.bytes_per_s(), 12.5e6, 0.01), "{}", r.bytes_per_s());
    }

    /// A fast rail that drains between its chunks: both land in one poll 20 µs after their
    /// post, and the next two are posted 5 µs later. Its rate is its bytes over the time it
    /// was busy, once that time reaches the horizon (restarting the window at each gap, it
    /// never closed one and the rate stayed unknown).
    #[test]
    fn a_rail_that_drains_between_its_chunks_is_measured() {
        let start = Instant::now();
        let mut r = RailRate::default();
        let (busy, gap) = (Duration::from_micros(20), Duration::from_micros(5));
        let mut t = start;
        for _ in 0..1000 {
            r.landed(CHUNK, true, t, t + busy, HORIZON);
            r.landed(CHUNK, true, t, t + busy, HORIZON);
            t += busy + gap;
        }
        let rate = 2.0 * CHUNK as f64 / busy.as_secs_f64();
        assert!(
            close(r.bytes_per_s(), rate, 0.01),
            "{} != {rate}",
            r.bytes_per_s()
        );
    }

    #[test]
    fn failed_chunks_carry_no_bytes() {
        let start = Instant::now();
        let mut r = RailRate::default();
        r.landed(CHUNK, false, start, start + Duration::from_secs(1), HORIZON);
        assert_eq!(r.bytes_per_s(), 0.0);
    }
}
