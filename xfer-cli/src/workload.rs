//! The bench workload of the reference program: transfers of N pages chosen at random from a
//! large region, written to the same page indices of the remote region (or, `--op read`,
//! read from them into the local region), until enough bytes have moved; then every page
//! moved is checked where it landed.
//!
//! Only whole pages move: `--bytes` that is not a whole number of pages is rounded up (see
//! [`Workload::whole_pages`]), so that every page checked was written whole.

use crate::progress::Progress;
use fabric_core::engine::{Direction, RailGroup};
use fabric_core::{Error, MemoryRegion};
use std::collections::VecDeque;
use std::time::{Duration, Instant};
use xfer::layers::AgentLayers;
use xfer::{Agent, Handle, Peer, Region, RegionDescriptor, Transfer};

/// Transfers in flight by default, whatever the rails.
pub const DEFAULT_DEPTH: usize = 4;

/// Transfers in flight per rail by default, where that is more than [`DEFAULT_DEPTH`]. A
/// transfer ends only when every rail's share of it has landed, so a rail that stops for a
/// moment (descheduled on a busy host) holds up every transfer it has a share of; at a
/// fixed depth each rail has less in flight the more rails there are (4 transfers of 1000
/// 4 KiB pages over 8 rails: 2 MiB a rail, under a millisecond of its work). H200, 4 KiB
/// pages at 8 rails in one call: 78-98 Gbps at depth 4, 138-158 at depth 16, with or
/// without one or two busy loops beside it; 2-core VM: 34.8-35.3 against 36.8-37.3 Gbps.
pub const DEPTH_PER_RAIL: usize = 2;

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
    /// Transfers in flight at once; `None`: [`Workload::depth_for`]'s default.
    pub depth: Option<usize>,
    /// Seed of the page choice and of the data pattern.
    pub seed: u64,
    /// A transfer that takes longer than this fails the run.
    pub transfer_timeout: Duration,
    /// WRITE the pages into the remote region, or READ them from it (`--op`).
    pub direction: Direction,
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
        if self.depth == Some(0) {
            return Err("--depth must be at least 1".into());
        }
        Ok(())
    }

    /// Transfers in flight over `rails` rails: the asked depth, else [`DEFAULT_DEPTH`] or
    /// [`DEPTH_PER_RAIL`] per rail, whichever is more.
    pub fn depth_for(&self, rails: usize) -> usize {
        self.depth
            .unwrap_or_else(|| DEFAULT_DEPTH.max(DEPTH_PER_RAIL.saturating_mul(rails)))
            .max(1)
    }

    /// Pages in the region.
    pub fn region_pages(&self) -> u64 {
        self.region_size / self.page_size
    }

    /// This workload with `bytes` rounded up to a whole number of pages (the summary says
    /// so): a page written in part but checked whole would be a false mismatch. Call after
    /// [`validate`](Self::validate).
    pub fn whole_pages(mut self) -> Workload {
        self.bytes = self
            .bytes
            .div_ceil(self.page_size)
            .saturating_mul(self.page_size);
        self
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
    /// What each rail carried in the timed part.
    pub rails: Vec<RailFigures>,
}

/// What one rail carried during a run.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RailFigures {
    /// Its position in the group.
    pub rail: usize,
    /// The NIC it ran on (`None`: not bound to one).
    pub nic: Option<String>,
    /// Bytes it wrote.
    pub bytes: u64,
    /// Write operations it posted.
    pub ops: u64,
    /// Posts it had to repeat (the transport had no room).
    pub reposts: u64,
    /// Operations that failed.
    pub errors: u64,
    /// Its bytes over the run's time, in Gbit/s.
    pub gbps: f64,
}

/// Per-rail figures between two snapshots of a group's rail counters, over `seconds`.
pub fn rail_figures(
    group: &RailGroup,
    before: &[fabric_core::engine::CounterSnapshot],
    seconds: f64,
) -> Vec<RailFigures> {
    let after = group.rail_counters();
    after
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let b = before.get(i).copied().unwrap_or_default();
            let bytes = c.bytes - b.bytes;
            RailFigures {
                rail: i,
                nic: group.rail_nics().get(i).cloned().flatten(),
                bytes,
                ops: c.ops - b.ops,
                reposts: c.reposts - b.reposts,
                errors: c.errors - b.errors,
                gbps: if seconds > 0.0 {
                    bytes as f64 * 8.0 / seconds / 1e9
                } else {
                    0.0
                },
            }
        })
        .collect()
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

/// Fills `region` with the pattern of `seed` at the memory's own speed (a kernel for
/// device memory, every core for host memory: [`gpu_mem::fill_pattern`]).
pub fn fill_pattern(region: &dyn MemoryRegion, seed: u64) -> Result<(), Error> {
    Ok(gpu_mem::fill_pattern(region, seed)?)
}

/// The pages of a run's transfers, in the order the run submits them: `pages` distinct
/// pages per transfer (one drawn at random from each of `pages` equal lanes of the region,
/// seeded by `seed`: see [`PageDraw`]), whole pages only, until `bytes` are covered (the last
/// transfer may have fewer). The engine's run and the demo's direct-copy baselines take
/// their pages from here, so both move the same pages.
pub struct TransferPages {
    pages: PageDraw,
    page_size: u64,
    per_transfer: u64,
    left: u64,
}

/// Distinct pages drawn at random from a region's, seeded. A draw of `n` pages cuts the
/// region's pages into `n` lanes of equal size (the first `region_pages % n` one page
/// longer) and takes one page at random from each, so a draw never holds a page twice (a
/// transfer that writes one destination twice is refused), every page of the region can be
/// drawn (each as likely as the others of its lane; all equally when `n` divides the
/// region's pages), and the pages come in increasing order, as a block table allocated
/// in order lists them (the raw page streams of `baseline` draw theirs here too, 16 at a
/// time). A draw costs one random number per page and no table of the region's pages (a
/// shuffle of the region's page indices took a random access into a table of 8 bytes per
/// page for every page drawn: 2 MiB for 1 GiB of 4 KiB pages, and that cost showed in the
/// timed run's own thread).
pub struct PageDraw {
    region_pages: u64,
    drawn: Vec<u64>,
    rng: fastrand::Rng,
}

impl PageDraw {
    /// Draws from the pages `0..region_pages`, with `seed`.
    pub fn new(region_pages: u64, seed: u64) -> PageDraw {
        PageDraw {
            region_pages,
            drawn: Vec::new(),
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// `n` distinct pages in increasing order (all of the region's if it holds fewer).
    pub fn draw(&mut self, n: usize) -> &[u64] {
        let n = (n as u64).min(self.region_pages);
        self.drawn.clear();
        if n == 0 {
            return &self.drawn;
        }
        let (lane, longer) = (self.region_pages / n, self.region_pages % n);
        let mut start = 0u64;
        for i in 0..n {
            let len = lane + u64::from(i < longer);
            self.drawn.push(start + self.rng.u64(0..len));
            start += len;
        }
        &self.drawn
    }

    /// The region's pages.
    pub fn region_pages(&self) -> usize {
        self.region_pages as usize
    }
}

impl TransferPages {
    /// The pages of `w`'s transfers.
    pub fn new(w: &Workload) -> TransferPages {
        TransferPages {
            pages: PageDraw::new(w.region_pages(), w.seed),
            page_size: w.page_size,
            per_transfer: w.pages * w.page_size,
            left: w.bytes,
        }
    }

    /// The next transfer's page indices (distinct), or `None` once every byte is covered.
    pub fn next_transfer(&mut self) -> Option<&[u64]> {
        if self.left == 0 || self.page_size == 0 {
            return None;
        }
        // Whole pages only (see `Workload::whole_pages`): a partial page left over is sent
        // whole.
        let n = (self.left.min(self.per_transfer).div_ceil(self.page_size) as usize)
            .min(self.pages.region_pages());
        if n == 0 {
            return None;
        }
        self.left = self.left.saturating_sub(n as u64 * self.page_size);
        Some(self.pages.draw(n))
    }
}

/// Runs the workload from `src` to `dst` at `peer` (for a READ, from `dst` into `src`), over
/// every rail of the agent's transport to that peer.
pub fn run(
    agent: &Agent,
    src: &Region,
    peer: &Peer,
    dst: &RegionDescriptor,
    w: &Workload,
    progress: &mut Progress,
) -> Result<RunReport, xfer::Error> {
    let group = agent
        .group(peer.transport())
        .ok_or(xfer::Error::RegionNotOnTransport(peer.transport()))?;
    let mut pages = TransferPages::new(w);
    let mut written = vec![false; w.region_pages() as usize];
    let mut more = true;
    let depth = w.depth_for(group.rails().len());
    let mut inflight: VecDeque<Handle> = VecDeque::with_capacity(depth);
    let mut page_writes = 0u64;
    let mut moved = 0u64;
    let start = Instant::now();
    let c0 = group.counters();
    let rails0 = group.rail_counters();
    progress.start(w.bytes);
    progress.per_nic(group);
    loop {
        while inflight.len() < depth && more {
            let Some(chosen) = pages.next_transfer() else {
                more = false;
                break;
            };
            let mut segments = Vec::with_capacity(chosen.len());
            for &p in chosen {
                written[p as usize] = true;
                segments.push((p * w.page_size, p * w.page_size, w.page_size));
            }
            page_writes += chosen.len() as u64;
            let mut t = Transfer::segments(segments).timeout(w.transfer_timeout);
            if w.direction == Direction::Read {
                t = t.read();
            }
            inflight.push_back(agent.submit(peer, src, dst, t)?);
        }
        let Some(h) = inflight.front() else { break };
        if let Some(Err(e)) = h.try_result() {
            return Err(e);
        }
        if h.finished_within(Duration::from_millis(100)) {
            let h = inflight.pop_front().expect("front exists");
            moved += h.wait(w.transfer_timeout)?.bytes;
        }
        let c = group.counters();
        progress.update(start.elapsed(), c.bytes - c0.bytes, c.ops - c0.ops);
        progress.update_nics(group, &rails0, start.elapsed());
    }
    let seconds = start.elapsed().as_secs_f64();
    let c = group.counters();
    progress.finish(start.elapsed(), c.bytes - c0.bytes, c.ops - c0.ops);
    Ok(RunReport {
        bytes: moved,
        page_writes,
        seconds,
        written,
        rails: rail_figures(group, &rails0, seconds),
    })
}

/// Checks the written pages of `dst` against the pattern, reading 4 MiB at a time (host or
/// device memory); returns (mismatched pages, first one).
pub fn verify_pages(
    dst: &dyn MemoryRegion,
    page_size: u64,
    seed: u64,
    written: &[u64],
) -> Result<(u64, Option<u64>), Error> {
    let mut pages = written.to_vec();
    pages.sort_unstable();
    let chunk = (4 << 20u64).max(page_size) / page_size * page_size;
    let mut buf = vec![0u8; chunk.min(dst.len() as u64) as usize];
    let mut bad = 0;
    let mut first = None;
    let mut i = 0;
    while i < pages.len() {
        let base = pages[i] * page_size / chunk * chunk;
        let n = chunk.min(dst.len() as u64 - base) as usize;
        dst.read_to_host(base, &mut buf[..n])?;
        while i < pages.len() && pages[i] * page_size < base + n as u64 {
            let off = (pages[i] * page_size - base) as usize;
            let end = (off + page_size as usize).min(n);
            if !gpu_mem::pattern_matches(seed, pages[i] * page_size, &buf[off..end]) {
                bad += 1;
                first.get_or_insert(pages[i]);
            }
            i += 1;
        }
    }
    Ok((bad, first))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use fabric_core::{Access, HostBuffer};
    use std::sync::Arc;

    fn workload(page_size: u64, bytes: u64, region_size: u64) -> Workload {
        let w = Workload {
            page_size,
            pages: 4,
            bytes,
            region_size,
            depth: Some(2),
            seed: 9,
            transfer_timeout: Duration::from_secs(10),
            direction: Direction::Write,
        };
        w.validate().expect("valid knobs");
        w.whole_pages()
    }

    #[test]
    fn depth_is_the_asked_one_else_four_or_two_per_rail() {
        let mut w = workload(4096, 1 << 20, 1 << 20);
        assert_eq!(w.depth_for(8), 2, "asked: kept at any rail count");
        w.depth = None;
        assert_eq!(w.depth_for(0), DEFAULT_DEPTH);
        assert_eq!(w.depth_for(1), 4);
        assert_eq!(w.depth_for(2), 4);
        assert_eq!(w.depth_for(3), 6);
        assert_eq!(w.depth_for(8), 16);
        assert_eq!(w.depth_for(usize::MAX), usize::MAX);
        w.depth = Some(0);
        assert_eq!(
            w.validate().unwrap_err(),
            "--depth must be at least 1",
            "zero is refused, not run"
        );
    }

    #[test]
    fn transfer_pages_cover_the_bytes_in_distinct_pages_the_same_for_a_seed() {
        let mut w = workload(4096, 40 * 4 * 4096 + 3 * 4096, 1 << 20);
        let all = |w: &Workload| {
            let mut pages = TransferPages::new(w);
            std::iter::from_fn(|| pages.next_transfer().map(<[u64]>::to_vec)).collect::<Vec<_>>()
        };
        let transfers = all(&w);
        // 40 transfers of 4 pages and one of 3.
        assert_eq!(transfers.len(), 41);
        assert_eq!(transfers.last().map(Vec::len), Some(3));
        for t in &transfers {
            let mut d = t.clone();
            d.sort_unstable();
            d.dedup();
            assert_eq!(d.len(), t.len(), "pages of a transfer are distinct");
            assert!(t.iter().all(|&p| p < w.region_pages()));
        }
        assert_eq!(all(&w), transfers);
        w.seed += 1;
        assert_ne!(all(&w), transfers);
    }

    #[test]
    fn a_draw_takes_one_page_of_each_lane_in_order_and_reaches_every_page() {
        // 10 pages in 3 lanes: 0..4, 4..7, 7..10.
        let mut d = PageDraw::new(10, 5);
        let mut seen = [0u32; 10];
        for _ in 0..300 {
            let got = d.draw(3).to_vec();
            assert_eq!(got.len(), 3);
            assert!((0..4).contains(&got[0]), "{got:?}");
            assert!((4..7).contains(&got[1]), "{got:?}");
            assert!((7..10).contains(&got[2]), "{got:?}");
            for p in got {
                seen[p as usize] += 1;
            }
        }
        // Every page is drawn, each about as often as the others of its lane.
        assert!(seen.iter().all(|&n| n > 40), "{seen:?}");
        // As many pages as the region holds, or more: all of them, once each.
        assert_eq!(d.draw(10), (0..10).collect::<Vec<u64>>());
        assert_eq!(d.draw(25), (0..10).collect::<Vec<u64>>());
        assert!(d.draw(0).is_empty());
    }

    #[test]
    fn bytes_are_rounded_up_to_whole_pages() {
        // Not a multiple of the page, smaller than a page, larger than the region, exact.
        assert_eq!(workload(3072, 64 << 20, 1 << 20).bytes, 21846 * 3072);
        assert_eq!(workload(65536, 1000, 1 << 20).bytes, 65536);
        assert_eq!(
            workload(4096, (5 << 20) + 1, 1 << 20).bytes,
            (5 << 20) + 4096
        );
        assert_eq!(workload(4096, 1 << 20, 1 << 20).bytes, 1 << 20);
    }

    /// Two agents of this process over in-process copies (`mem`), unpinned.
    pub(crate) fn mem_agents() -> (Agent, Agent) {
        let make = || {
            Agent::new(xfer::AgentOptions {
                transport: xfer::TransportChoice::Only(xfer::TransportKind::Mem),
                rails: Some(2),
                pin: xfer::PinMode::Off,
                ..xfer::AgentOptions::default()
            })
            .expect("a mem agent")
        };
        (make(), make())
    }

    /// Runs `w` from a patterned region to a zeroed one over in-process rails; returns the
    /// run and the target.
    fn run_over_mem(w: &Workload) -> (RunReport, Arc<HostBuffer>) {
        let (a, b) = mem_agents();
        let src = HostBuffer::new_shared(w.region_size as usize).expect("source");
        fill_pattern(&*src, w.seed).expect("fill");
        let dst = HostBuffer::new_shared(w.region_size as usize).expect("target");
        let s = a.register(src, Access::NONE).expect("register source");
        let d = b
            .register(dst.clone(), Access::REMOTE_WRITE)
            .expect("register target");
        let peer = a.connect(b.info()).expect("peer");
        let report = run(&a, &s, &peer, d.descriptor(), w, &mut Progress::new(true)).expect("run");
        (report, dst)
    }

    #[test]
    fn a_run_of_part_pages_moves_and_verifies_whole_pages() {
        for (page, bytes, region) in [(3072, 100_000, 96 << 10), (4096, 1000, 64 << 10)] {
            let w = workload(page, bytes, region);
            let (report, dst) = run_over_mem(&w);
            assert_eq!(report.bytes, bytes.div_ceil(page) * page, "{page} {bytes}");
            let pages = report.written_pages();
            assert_eq!(
                verify_pages(&*dst, page, w.seed, &pages).expect("verify"),
                (0, None),
                "{page} {bytes}"
            );
        }
    }

    #[test]
    fn a_read_run_lands_the_remote_pattern_in_the_local_region() {
        let mut w = workload(4096, 256 << 10, 1 << 20);
        w.direction = Direction::Read;
        let (a, b) = mem_agents();
        let local = HostBuffer::new_shared(w.region_size as usize).expect("local");
        let remote = HostBuffer::new_shared(w.region_size as usize).expect("remote");
        fill_pattern(&*remote, w.seed).expect("fill");
        let l = a
            .register(local.clone(), Access::LOCAL_WRITE)
            .expect("register");
        let r = b.register(remote, Access::REMOTE_READ).expect("register");
        let peer = a.connect(b.info()).expect("peer");
        let report = run(&a, &l, &peer, r.descriptor(), &w, &mut Progress::new(true)).expect("run");
        let pages = report.written_pages();
        // 64 pages moved; a page may be chosen by more than one transfer.
        assert_eq!(report.bytes, 64 * 4096);
        assert!(!pages.is_empty() && pages.len() <= 64, "{}", pages.len());
        assert_eq!(
            verify_pages(&*local, 4096, w.seed, &pages).expect("verify"),
            (0, None)
        );
        // A page not read holds no pattern.
        let other = (0..w.region_pages()).find(|p| !pages.contains(p)).unwrap();
        assert_eq!(
            verify_pages(&*local, 4096, w.seed, &[other])
                .expect("verify")
                .0,
            1
        );
    }

    #[test]
    fn verification_still_catches_a_changed_byte() {
        let w = workload(4096, 1000, 64 << 10);
        let (report, dst) = run_over_mem(&w);
        let pages = report.written_pages();
        assert_eq!(pages.len(), 1);
        // The last byte of the page: the one a part page would not have written.
        let last = pages[0] * 4096 + 4095;
        let byte = dst.to_vec(last, 1).expect("read")[0];
        dst.write_from_host(last, &[!byte]).expect("corrupt");
        assert_eq!(
            verify_pages(&*dst, 4096, w.seed, &pages).expect("verify"),
            (1, Some(pages[0]))
        );
        // A page that was never written does not match the pattern either.
        let other = (pages[0] + 1) % w.region_pages();
        assert_eq!(
            verify_pages(&*dst, 4096, w.seed, &[other])
                .expect("verify")
                .0,
            1
        );
    }
}
