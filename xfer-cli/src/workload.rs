//! The bench workload of the reference program: transfers of N pages chosen at random from a
//! large region, written to the same page indices of the remote region, until enough bytes
//! have moved; then every written page is checked.

use crate::pattern::{self, Rng};
use crate::progress::Progress;
use fabric_core::engine::{Engine, Transfer, TransferHandle};
use fabric_core::plan::Segment;
use fabric_core::{Error, HostBuffer, LocalKey, PeerId, RemoteRegion};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What to move.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Bytes per page.
    pub page_size: u64,
    /// Pages per transfer.
    pub pages: u64,
    /// Bytes to move in all.
    pub bytes: u64,
    /// Size of the source and target regions.
    pub region_size: u64,
    /// Transfers in flight at once.
    pub depth: usize,
    /// Seed of the page choice and of the data pattern.
    pub seed: u64,
    /// A transfer that takes longer than this fails the run.
    pub transfer_timeout: Duration,
}

impl Workload {
    /// Checks the knobs against each other.
    pub fn validate(&self) -> Result<(), String> {
        if self.page_size == 0 || !self.page_size.is_multiple_of(8) {
            return Err(format!(
                "--page-size must be a positive multiple of 8 bytes (got {})",
                self.page_size
            ));
        }
        if self.pages == 0 {
            return Err("--pages must be at least 1".into());
        }
        if self.region_size < self.page_size {
            return Err("--region-size is smaller than one page".into());
        }
        let region_pages = self.region_size / self.page_size;
        if self.pages > region_pages {
            return Err(format!(
                "--pages {} exceeds the {} pages of {} in the region",
                self.pages,
                region_pages,
                crate::size::format_size(self.page_size)
            ));
        }
        if self.bytes == 0 {
            return Err("--bytes must be positive".into());
        }
        if self.depth == 0 {
            return Err("--depth must be at least 1".into());
        }
        Ok(())
    }

    /// Pages in the region.
    pub fn region_pages(&self) -> u64 {
        self.region_size / self.page_size
    }
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct RunReport {
    /// Bytes moved.
    pub bytes: u64,
    /// Pages written (operations before coalescing).
    pub page_writes: u64,
    /// Wall time of the timed part.
    pub seconds: f64,
    /// Which pages were written at least once.
    pub written: Vec<bool>,
}

impl RunReport {
    /// Throughput in Gbit/s.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.seconds / 1e9
    }
    /// Page writes per second, in millions.
    pub fn mops(&self) -> f64 {
        self.page_writes as f64 / self.seconds / 1e6
    }
    /// Indices of written pages.
    pub fn written_pages(&self) -> Vec<u64> {
        self.written
            .iter()
            .enumerate()
            .filter(|(_, w)| **w)
            .map(|(i, _)| i as u64)
            .collect()
    }
}

/// A source buffer filled with the pattern of `seed`.
pub fn pattern_buffer(size: u64, seed: u64) -> Result<std::sync::Arc<HostBuffer>, Error> {
    let b = HostBuffer::new_shared(size as usize)?;
    b.fill_with(|off, chunk| pattern::fill(seed, off, chunk));
    Ok(b)
}

/// Runs the workload from `src` (registered as `src_key`) to `dst` at `peer`.
pub fn run(
    engine: &Engine,
    src_key: LocalKey,
    peer: PeerId,
    dst: RemoteRegion,
    w: &Workload,
    progress: &mut Progress,
) -> Result<RunReport, Error> {
    let region_pages = w.region_pages();
    let mut perm: Vec<u64> = (0..region_pages).collect();
    let mut rng = Rng::new(w.seed);
    let mut written = vec![false; region_pages as usize];
    let per_transfer = w.pages * w.page_size;
    let mut left = w.bytes;
    let mut inflight: VecDeque<TransferHandle> = VecDeque::with_capacity(w.depth);
    let mut page_writes = 0u64;
    let mut moved = 0u64;
    let start = Instant::now();
    let c0 = engine.counters().snapshot();
    progress.start(w.bytes);
    loop {
        while inflight.len() < w.depth && left > 0 {
            let this = left.min(per_transfer);
            let n = this.div_ceil(w.page_size);
            left -= this;
            // Partial Fisher-Yates: n distinct pages.
            let mut t = Transfer::new(peer).timeout(w.transfer_timeout);
            t.segments.reserve(n as usize);
            for i in 0..n as usize {
                let j = i + rng.below(region_pages - i as u64) as usize;
                perm.swap(i, j);
                let p = perm[i];
                written[p as usize] = true;
                let len = if i as u64 == n - 1 {
                    this - (n - 1) * w.page_size
                } else {
                    w.page_size
                };
                t.segments.push(Segment {
                    src: src_key,
                    src_offset: p * w.page_size,
                    dst,
                    dst_offset: p * w.page_size,
                    len,
                });
            }
            page_writes += n;
            inflight.push_back(engine.submit(t)?);
        }
        let Some(h) = inflight.front() else { break };
        match h.wait(Duration::from_millis(100)) {
            Ok(stats) => {
                moved += stats.bytes;
                inflight.pop_front();
            }
            Err(Error::TimedOut(..)) => {}
            Err(e) => return Err(e),
        }
        let c = engine.counters().snapshot();
        progress.update(start.elapsed(), c.bytes - c0.bytes, c.ops - c0.ops);
    }
    let seconds = start.elapsed().as_secs_f64();
    let c = engine.counters().snapshot();
    progress.finish(start.elapsed(), c.bytes - c0.bytes, c.ops - c0.ops);
    Ok(RunReport {
        bytes: moved,
        page_writes,
        seconds,
        written,
    })
}

/// Checks `pages` of `dst` against the pattern; returns (mismatched pages, first one).
pub fn verify_pages(
    dst: &HostBuffer,
    page_size: u64,
    seed: u64,
    pages: &[u64],
) -> Result<(u64, Option<u64>), Error> {
    let mut buf = vec![0u8; page_size as usize];
    let mut bad = 0;
    let mut first = None;
    for &p in pages {
        dst.read(p * page_size, &mut buf)?;
        if !pattern::matches(seed, p * page_size, &buf) {
            bad += 1;
            first.get_or_insert(p);
        }
    }
    Ok((bad, first))
}
