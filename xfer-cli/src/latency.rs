//! `--latency`: transfers one at a time (depth 1), each timed from submit to completion,
//! with percentiles; beside them, in the same run, a raw TCP ping-pong of the same pages
//! (the floor: a vectored write of the pages, an 8-byte answer), and, where the target is in
//! this process (`demo`), the time from submit to the target's immediate-data event.
//! `bench --latency` plays the ping-pong against the server it writes to (the control
//! channel's `echo` request opens the answering end there), so both series cross the same
//! path; it has no immediate-data series, the target's clock being another process's.

use crate::workload::{PageDraw, Workload};
use fabric_core::engine::WARM_UP_IMM;
use serde::Serialize;
use std::io::{IoSlice, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use xfer::{Agent, Congestion, Error, Peer, Region, RegionDescriptor, Transfer};

/// Most transfers timed in one run (whatever `--bytes` asks).
pub const MAX_SAMPLES: u64 = 200_000;

/// How long the immediate-data watcher waits for an event before it looks whether the
/// transfers have stopped.
const WATCH_SLICE: Duration = Duration::from_millis(50);

/// Transfers to time: as many as `--bytes` holds, at least one, at most [`MAX_SAMPLES`].
pub fn sample_count(w: &Workload) -> u64 {
    (w.bytes / (w.pages * w.page_size)).clamp(1, MAX_SAMPLES)
}

/// The summary of a latency run (sorts the samples).
pub fn summary(
    transport: &'static str,
    rails: usize,
    busy_poll_us: u64,
    w: &Workload,
    transfers: &mut [Duration],
    imm: &mut [Duration],
    raw: &mut [Duration],
) -> LatencySummary {
    let transfer = Percentiles::of(transfers).unwrap_or(Percentiles {
        count: 0,
        p50_us: 0.0,
        p90_us: 0.0,
        p99_us: 0.0,
        max_us: 0.0,
        mean_us: 0.0,
    });
    let raw_tcp_round_trip = Percentiles::of(raw);
    LatencySummary {
        transport,
        page_size: w.page_size,
        pages: w.pages,
        rails,
        busy_poll_us,
        ratio_p50: raw_tcp_round_trip.map(|r| transfer.p50_us / r.p50_us),
        transfer,
        imm_event: Percentiles::of(imm),
        raw_tcp_round_trip,
        peer: None,
    }
}

/// Percentiles of one series, in microseconds.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Percentiles {
    /// Samples.
    pub count: usize,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Largest.
    pub max_us: f64,
    /// Mean.
    pub mean_us: f64,
}

impl Percentiles {
    /// Of `samples` (sorted here); `None` for none.
    pub fn of(samples: &mut [Duration]) -> Option<Percentiles> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let at = |q: f64| us(samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)]);
        let sum: Duration = samples.iter().sum();
        Some(Percentiles {
            count: samples.len(),
            p50_us: at(0.50),
            p90_us: at(0.90),
            p99_us: at(0.99),
            max_us: us(samples[samples.len() - 1]),
            mean_us: us(sum) / samples.len() as f64,
        })
    }

    fn line(&self) -> String {
        format!(
            "p50 {:.1} us, p90 {:.1} us, p99 {:.1} us, max {:.1} us ({} samples)",
            self.p50_us, self.p90_us, self.p99_us, self.max_us, self.count
        )
    }
}

/// What `--latency` measured.
#[derive(Debug, Serialize)]
pub struct LatencySummary {
    /// The transport.
    pub transport: &'static str,
    /// Bytes per page.
    pub page_size: u64,
    /// Pages per transfer.
    pub pages: u64,
    /// Rails.
    pub rails: usize,
    /// The worker's busy-poll spin, microseconds (0: sleeps at once).
    pub busy_poll_us: u64,
    /// Submit to completion at the initiator, per transfer.
    pub transfer: Percentiles,
    /// Submit to the target's immediate-data event (demo only: the target is in this
    /// process, so both times come from one clock).
    pub imm_event: Option<Percentiles>,
    /// Raw TCP round trip: a vectored write of the same pages, an 8-byte answer.
    pub raw_tcp_round_trip: Option<Percentiles>,
    /// `transfer.p50_us / raw_tcp_round_trip.p50_us`.
    pub ratio_p50: Option<f64>,
    /// The server (`bench`): the target is another process, and the raw ping-pong ran
    /// against it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
}

impl LatencySummary {
    /// This summary, for a run against the server at `peer`.
    pub fn at_peer(self, peer: &str) -> LatencySummary {
        LatencySummary {
            peer: Some(peer.to_owned()),
            ..self
        }
    }

    /// Prints it (text or one JSON object).
    pub fn print(&self, json: bool) {
        if json {
            outln!(
                "{}",
                serde_json::to_string(self).expect("summary serialises")
            );
            return;
        }
        outln!(
            "{} latency{}, {} page(s) of {} x {} rails, depth 1 (busy-poll {} us):",
            self.transport,
            self.peer
                .as_deref()
                .map(|p| format!(" to {p}"))
                .unwrap_or_default(),
            self.pages,
            crate::size::format_size(self.page_size),
            self.rails,
            self.busy_poll_us
        );
        outln!(
            "  transfer (submit to completion): {}",
            self.transfer.line()
        );
        match (&self.imm_event, &self.peer) {
            (Some(p), _) => outln!("  submit to target's immediate data: {}", p.line()),
            (None, Some(_)) => outln!(
                "  submit to target's immediate data: not measured (the target is another \
                 process; xfer demo --latency measures it)"
            ),
            (None, None) => {}
        }
        if let Some(p) = &self.raw_tcp_round_trip {
            let to = if self.peer.is_some() {
                " to the server"
            } else {
                ""
            };
            outln!("  raw TCP round trip{to}, same pages:  {}", p.line());
        }
        if let Some(r) = self.ratio_p50 {
            outln!("  ratio of p50s (transfer / raw round trip): {r:.2}");
        }
    }
}

/// Transfers of `pages` random pages of `page_size` from `src` to the peer's `dst`, one at
/// a time; `target`, when the target agent is in this process, is watched for the immediate
/// data of each transfer. Returns (per-transfer times, submit-to-immediate-data times).
pub fn run_transfers(
    agent: &Agent,
    src: &Region,
    peer: &Peer,
    dst: &RegionDescriptor,
    target: Option<&Agent>,
    w: &Workload,
    count: u64,
) -> Result<(Vec<Duration>, Vec<Duration>), Error> {
    let timeout = Duration::from_secs(30);
    let page_size = w.page_size;
    let mut pages = PageDraw::new(w.region_pages(), w.seed);
    let mut times = Vec::with_capacity(count as usize);
    let mut submitted = Vec::with_capacity(count as usize);
    // Set when the transfers stop early (an error), so that the watcher gives up at once
    // instead of waiting for events that will not come.
    let stopped = AtomicBool::new(false);
    let watch = |t: &Agent| -> Result<Vec<(u32, Instant)>, Error> {
        let mut seen = Vec::with_capacity(count as usize);
        let mut waited = Duration::ZERO;
        while (seen.len() as u64) < count && !stopped.load(Ordering::Acquire) {
            match t.next_notification(WATCH_SLICE) {
                Ok(n) => {
                    waited = Duration::ZERO;
                    seen.push((n.imm, Instant::now()));
                }
                Err(Error::Engine(fabric_core::Error::TimedOut(..))) if waited < timeout => {
                    waited += WATCH_SLICE;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(seen)
    };
    let seen = std::thread::scope(|s| -> Result<Option<Vec<(u32, Instant)>>, Error> {
        let watcher = target.map(|t| s.spawn(|| watch(t)));
        let mut run = || -> Result<(), Error> {
            for i in 0..count {
                let segments = (pages.draw(w.pages as usize).iter())
                    .map(|&p| (p * page_size, p * page_size, page_size))
                    .collect();
                // Never the warm-up value, which rail groups drop.
                let t = Transfer::segments(segments)
                    .imm((i % WARM_UP_IMM as u64) as u32)
                    .timeout(timeout);
                let t0 = Instant::now();
                let h = agent.submit(peer, src, dst, t)?;
                h.wait(timeout)?;
                times.push(t0.elapsed());
                submitted.push(t0);
            }
            Ok(())
        };
        let ran = run();
        if ran.is_err() {
            stopped.store(true, Ordering::Release);
        }
        let seen = watcher.map(|w| {
            w.join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        });
        ran?;
        seen.transpose()
    })?;
    let mut imm = Vec::new();
    if let Some(seen) = seen {
        for (v, at) in seen {
            if let Some(t0) = submitted.get(v as usize) {
                imm.push(at.saturating_duration_since(*t0));
            }
        }
    }
    Ok((times, imm))
}

/// Bytes of the answer to each round of the raw ping-pong.
const ACK: usize = 8;

/// The floor: `count` round trips over one loopback TCP connection (TCP_NODELAY), each a
/// vectored write of `pages` random pages of `page_size` from a `region`-byte buffer,
/// answered with 8 bytes once the receiver has read them all. Both ends run the congestion
/// control `congestion` gives a loopback connection (what tcp rails run).
pub fn raw_round_trips(
    (page_size, pages): (u64, u64),
    region: u64,
    count: u64,
    seed: u64,
    congestion: &Congestion,
) -> std::io::Result<Vec<Duration>> {
    let per = round_bytes(page_size, pages)?;
    let (mut c, s) = crate::baseline::loopback_pair(congestion)?;
    let server = std::thread::spawn(move || echo_rounds(s, per));
    let times = ping_pong(&mut c, page_size, pages, region, count, seed)?;
    drop(c);
    server
        .join()
        .map_err(|_| std::io::Error::other("ping-pong server panicked"))??;
    Ok(times)
}

/// Bytes of one round: `pages` pages of `page_size`, or an error if that overflows.
pub fn round_bytes(page_size: u64, pages: u64) -> std::io::Result<usize> {
    page_size
        .checked_mul(pages)
        .and_then(|b| usize::try_from(b).ok())
        .filter(|&b| b > 0)
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{pages} pages of {page_size} bytes is not a round size"),
            )
        })
}

/// The answering end of the raw ping-pong: reads `per` bytes, answers 8, until the peer
/// closes the connection between rounds. Returns the rounds answered.
pub fn echo_rounds(mut s: TcpStream, per: usize) -> std::io::Result<u64> {
    s.set_nodelay(true)?;
    let mut buf = vec![0u8; per];
    let mut rounds = 0;
    loop {
        // The first read tells a close between rounds (0 bytes) from one within a round.
        let n = loop {
            match s.read(&mut buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        if n == 0 {
            return Ok(rounds);
        }
        s.read_exact(&mut buf[n..])?;
        s.write_all(&[1u8; ACK])?;
        rounds += 1;
    }
}

/// The timing end of the raw ping-pong over `c` (set to TCP_NODELAY here): `count`
/// rounds, each a vectored write of `pages` random pages of `page_size` from a
/// `region`-byte buffer, timed until the 8-byte answer has arrived.
pub fn ping_pong(
    c: &mut TcpStream,
    page_size: u64,
    pages: u64,
    region: u64,
    count: u64,
    seed: u64,
) -> std::io::Result<Vec<Duration>> {
    round_bytes(page_size, pages)?;
    c.set_nodelay(true)?;
    let region = region.clamp(page_size, 256 << 20) as usize;
    let page = page_size as usize;
    let src = vec![0x5Au8; region];
    let region_pages = (region / page) as u64;
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut times = Vec::with_capacity(count as usize);
    let mut ack = [0u8; ACK];
    for _ in 0..count {
        let offs: Vec<usize> = (0..pages)
            .map(|_| rng.u64(..region_pages) as usize * page)
            .collect();
        let t0 = Instant::now();
        let mut iov: Vec<IoSlice<'_>> = offs
            .iter()
            .map(|&o| IoSlice::new(&src[o..o + page]))
            .collect();
        let mut slices = &mut iov[..];
        while !slices.is_empty() {
            let n = c.write_vectored(slices)?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut slices, n);
        }
        c.read_exact(&mut ack)?;
        times.push(t0.elapsed());
    }
    Ok(times)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn the_raw_ping_pong_times_every_round_and_the_echo_counts_them() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let echo = std::thread::spawn(move || echo_rounds(listener.accept().unwrap().0, 3 * 512));
        let mut c = TcpStream::connect(addr).unwrap();
        let times = ping_pong(&mut c, 512, 3, 1 << 20, 25, 7).unwrap();
        assert_eq!(times.len(), 25);
        assert!(times.iter().all(|t| !t.is_zero()));
        drop(c);
        assert_eq!(echo.join().unwrap().unwrap(), 25);
    }

    #[test]
    fn a_close_within_a_round_is_an_error_for_the_echo() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let echo = std::thread::spawn(move || echo_rounds(listener.accept().unwrap().0, 4096));
        let mut c = TcpStream::connect(addr).unwrap();
        c.write_all(&[0u8; 100]).unwrap();
        drop(c);
        let e = echo.join().unwrap().unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        assert!(round_bytes(0, 1).is_err() && round_bytes(u64::MAX, 2).is_err());
    }
}
