//! The schedule of a pipelined push or pull ([`Pipeline`]): which chunk of which lane goes
//! next, under bounds on the bytes and the transfers in flight. Pure: no agent, no clock.
//!
//! A lane is one peer (a destination for a push, a source for a pull) and the region pairs
//! between it and this rank. The executor asks [`Pipeline::next`] for a step and does it:
//! submits a [`Chunk`] (one transfer: runs of rows between one local and one remote region,
//! at most `chunk_bytes` and `chunk_segments` runs), sends a lane's signal once every chunk of the
//! lane has landed ([`Step::Signal`], pushes only), or waits for a completion
//! ([`Step::Wait`]) and reports it with [`Pipeline::completed`]. Lanes take turns chunk by
//! chunk, so every peer's update progresses at once and a failed one (whose chunks stop) holds
//! up no other. The segment lists of chunks not yet submitted are never built: at any time
//! the memory held is that of the chunks in flight.

use crate::StridedRun;
use crate::weights::RegionPair;

/// Which way a lane's bytes go, which decides how runs are written: the source's offsets
/// local for a push ([`Way::Write`]), the destination's for a pull ([`Way::Read`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Way {
    /// This rank is the source: WRITEs.
    Write,
    /// This rank is the destination: READs.
    Read,
}

/// The bounds of a pipeline.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Bytes per chunk, at most (a longer row is cut).
    pub chunk_bytes: u64,
    /// Runs per chunk, at most (whole rows of a run count one).
    pub chunk_segments: usize,
    /// No chunk is started while this many bytes are in flight (so at most this plus one
    /// chunk are).
    pub max_bytes: u64,
    /// Transfers (chunks and signals) in flight, at most.
    pub max_transfers: usize,
}

/// One transfer to submit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// The lane.
    pub lane: usize,
    /// The local region (an index into this rank's layout's regions).
    pub local_region: u32,
    /// The peer's region (an index into its layout's regions).
    pub remote_region: u32,
    /// What it moves, local offsets first: whole rows of a run as one strided run, a
    /// piece of a row as a run of one.
    pub runs: Vec<StridedRun>,
    /// Rows (and pieces of rows) it moves.
    pub rows: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// What the executor does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Submit this chunk (and report its completion).
    Chunk(Chunk),
    /// Every chunk of this lane has landed: send its signal (and report its completion).
    Signal(usize),
    /// Nothing can start now: wait for a completion and report it.
    Wait,
    /// Every lane is done or failed and nothing is in flight.
    Done,
}

/// Where a lane is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LaneState {
    /// Chunks are being submitted or are in flight.
    Sending,
    /// The signal is in flight.
    Signalling,
    /// Every chunk (and the signal) landed.
    Done,
    /// A chunk or the signal failed, or the lane was failed: nothing more is submitted.
    Failed,
}

/// A position in a lane's pairs.
#[derive(Clone, Copy, Debug, Default)]
struct Cursor {
    pair: usize,
    run: usize,
    row: u64,
    /// Bytes of the row already taken.
    off: u64,
}

struct Lane<'a> {
    pairs: Vec<&'a RegionPair>,
    at: Cursor,
    outstanding: usize,
    state: LaneState,
    /// Bytes, transfers and segments submitted.
    bytes: u64,
    transfers: u64,
    segments: u64,
}

/// What a lane submitted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LaneTotals {
    pub bytes: u64,
    pub transfers: u64,
    pub segments: u64,
}

/// The schedule (see the module documentation).
pub(crate) struct Pipeline<'a> {
    lanes: Vec<Lane<'a>>,
    way: Way,
    signal: bool,
    limits: Limits,
    /// The lane whose turn it is.
    turn: usize,
    inflight: usize,
    inflight_bytes: u64,
}

impl<'a> Pipeline<'a> {
    /// A pipeline over `lanes` (each the pairs between this rank and one peer), moving
    /// bytes `way`, each lane closed by a signal if `signal`.
    pub fn new(lanes: Vec<Vec<&'a RegionPair>>, way: Way, signal: bool, limits: Limits) -> Self {
        let limits = Limits {
            chunk_bytes: limits.chunk_bytes.max(1),
            chunk_segments: limits.chunk_segments.max(1),
            max_bytes: limits.max_bytes.max(1),
            max_transfers: limits.max_transfers.max(1),
        };
        Pipeline {
            lanes: lanes
                .into_iter()
                .map(|pairs| Lane {
                    pairs,
                    at: Cursor::default(),
                    outstanding: 0,
                    state: LaneState::Sending,
                    bytes: 0,
                    transfers: 0,
                    segments: 0,
                })
                .collect(),
            way,
            signal,
            limits,
            turn: 0,
            inflight: 0,
            inflight_bytes: 0,
        }
    }

    /// The next step.
    pub fn next(&mut self) -> Step {
        // Lanes whose chunks have all landed: their signal first (their peer learns early),
        // or they are done.
        for i in 0..self.lanes.len() {
            let l = &self.lanes[i];
            if l.state != LaneState::Sending || l.outstanding > 0 || !self.exhausted(i) {
                continue;
            }
            if !self.signal {
                self.lanes[i].state = LaneState::Done;
                continue;
            }
            if self.inflight >= self.limits.max_transfers {
                return Step::Wait;
            }
            let l = &mut self.lanes[i];
            l.state = LaneState::Signalling;
            l.outstanding += 1;
            l.transfers += 1;
            self.inflight += 1;
            return Step::Signal(i);
        }
        if self.inflight >= self.limits.max_transfers
            || self.inflight_bytes >= self.limits.max_bytes
        {
            return Step::Wait;
        }
        let n = self.lanes.len();
        for k in 0..n {
            let i = (self.turn + k) % n;
            if self.lanes[i].state != LaneState::Sending {
                continue;
            }
            if let Some(c) = self.take(i) {
                self.turn = (i + 1) % n;
                let l = &mut self.lanes[i];
                l.outstanding += 1;
                l.bytes = l.bytes.saturating_add(c.bytes);
                l.transfers += 1;
                l.segments += c.rows;
                self.inflight += 1;
                self.inflight_bytes = self.inflight_bytes.saturating_add(c.bytes);
                return Step::Chunk(c);
            }
        }
        // Every lane with work left has it in flight, or its signal is due: a completion
        // changes that. Lanes exhausted just now get their signal on the next call.
        if (0..n).any(|i| {
            self.lanes[i].state == LaneState::Sending
                && self.lanes[i].outstanding == 0
                && self.exhausted(i)
        }) {
            return self.next();
        }
        if self.inflight > 0 {
            Step::Wait
        } else {
            Step::Done
        }
    }

    /// Reports that a chunk of `bytes` (0 for a signal) of `lane` finished, landed if `ok`.
    /// A failure fails the lane: nothing more of it is submitted.
    pub fn completed(&mut self, lane: usize, bytes: u64, ok: bool) {
        self.inflight = self.inflight.saturating_sub(1);
        self.inflight_bytes = self.inflight_bytes.saturating_sub(bytes);
        let Some(l) = self.lanes.get_mut(lane) else {
            return;
        };
        l.outstanding = l.outstanding.saturating_sub(1);
        if !ok {
            l.state = LaneState::Failed;
        } else if l.state == LaneState::Signalling && l.outstanding == 0 {
            l.state = LaneState::Done;
        }
    }

    /// Where `lane` is.
    pub fn state(&self, lane: usize) -> LaneState {
        self.lanes.get(lane).map_or(LaneState::Failed, |l| l.state)
    }

    /// What `lane` submitted.
    pub fn totals(&self, lane: usize) -> LaneTotals {
        self.lanes
            .get(lane)
            .map_or(LaneTotals::default(), |l| LaneTotals {
                bytes: l.bytes,
                transfers: l.transfers,
                segments: l.segments,
            })
    }

    /// Transfers and bytes in flight.
    #[cfg(test)]
    fn in_flight(&self) -> (usize, u64) {
        (self.inflight, self.inflight_bytes)
    }

    /// Whether `lane` has nothing left to submit.
    fn exhausted(&self, lane: usize) -> bool {
        let l = &self.lanes[lane];
        let mut at = l.at;
        // Skip what holds no byte: empty pairs, runs of no rows or no length.
        while let Some(p) = l.pairs.get(at.pair) {
            match p.runs.get(at.run) {
                Some(r) if r.count > at.row && r.len > at.off => return false,
                Some(_) => {
                    at.run += 1;
                    at.row = 0;
                    at.off = 0;
                }
                None => {
                    at.pair += 1;
                    at.run = 0;
                    at.row = 0;
                    at.off = 0;
                }
            }
        }
        true
    }

    /// The next chunk of `lane`, or `None` if it has nothing left.
    fn take(&mut self, lane: usize) -> Option<Chunk> {
        let lim = self.limits;
        let way = self.way;
        let l = &mut self.lanes[lane];
        while let Some(&pair) = l.pairs.get(l.at.pair) {
            let mut runs = Vec::new();
            let mut bytes = 0u64;
            let mut rows = 0u64;
            while let Some(r) = pair.runs.get(l.at.run) {
                if l.at.row >= r.count || l.at.off >= r.len {
                    l.at.run += 1;
                    l.at.row = 0;
                    l.at.off = 0;
                    continue;
                }
                let src = (r.src_offset)
                    .wrapping_add(l.at.row.wrapping_mul(r.src_stride))
                    .wrapping_add(l.at.off);
                let dst = (r.dst_offset)
                    .wrapping_add(l.at.row.wrapping_mul(r.dst_stride))
                    .wrapping_add(l.at.off);
                let room = lim.chunk_bytes - bytes;
                // Whole rows that fit go as one strided run; a row longer than the room
                // left goes in pieces, one segment each.
                let whole = if l.at.off == 0 && r.len <= room {
                    (r.count - l.at.row).min(room / r.len)
                } else {
                    0
                };
                let run = if whole > 0 {
                    l.at.row += whole;
                    rows += whole;
                    bytes += whole * r.len;
                    StridedRun {
                        src_offset: src,
                        dst_offset: dst,
                        len: r.len,
                        count: whole,
                        src_stride: r.src_stride,
                        dst_stride: r.dst_stride,
                    }
                } else {
                    let len = (r.len - l.at.off).min(room);
                    bytes += len;
                    rows += 1;
                    l.at.off += len;
                    if l.at.off == r.len {
                        l.at.row += 1;
                        l.at.off = 0;
                    }
                    StridedRun::contiguous(src, dst, len)
                };
                runs.push(match way {
                    Way::Write => run,
                    Way::Read => StridedRun {
                        src_offset: run.dst_offset,
                        dst_offset: run.src_offset,
                        src_stride: run.dst_stride,
                        dst_stride: run.src_stride,
                        ..run
                    },
                });
                if bytes >= lim.chunk_bytes || runs.len() >= lim.chunk_segments {
                    break;
                }
            }
            let (local_region, remote_region) = match way {
                Way::Write => (pair.src.region, pair.dst.region),
                Way::Read => (pair.dst.region, pair.src.region),
            };
            if pair.runs.get(l.at.run).is_none() {
                l.at = Cursor {
                    pair: l.at.pair + 1,
                    ..Cursor::default()
                };
            }
            if !runs.is_empty() {
                return Some(Chunk {
                    lane,
                    local_region,
                    remote_region,
                    runs,
                    rows,
                    bytes,
                });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::{RankRegion, Run};

    fn pair(src: u32, dst: u32, runs: Vec<Run>) -> RegionPair {
        RegionPair {
            src: RankRegion {
                rank: src,
                region: 0,
            },
            dst: RankRegion {
                rank: dst,
                region: 1,
            },
            runs,
        }
    }

    type Segments = Vec<(u64, u64, u64)>;

    /// Every row of `runs` as `(local, remote, len)`.
    fn rows_of(runs: &[StridedRun]) -> Segments {
        runs.iter()
            .flat_map(|r| {
                (0..r.count).map(move |i| {
                    (
                        r.src_offset + i * r.src_stride,
                        r.dst_offset + i * r.dst_stride,
                        r.len,
                    )
                })
            })
            .collect()
    }

    fn limits(chunk: u64, max_bytes: u64, max_transfers: usize) -> Limits {
        Limits {
            chunk_bytes: chunk,
            chunk_segments: 1000,
            max_bytes,
            max_transfers,
        }
    }

    /// Runs a pipeline to the end, completing the oldest transfer whenever it waits
    /// (`fails(lane, nth chunk of it)` decides failures); returns the bytes each lane
    /// moved per destination offset, and the order of steps.
    fn drive(
        p: &mut Pipeline<'_>,
        fails: impl Fn(usize, usize) -> bool,
        peak: &mut (usize, u64),
    ) -> (Vec<Segments>, Vec<String>) {
        let mut flying: std::collections::VecDeque<(usize, u64, bool)> = Default::default();
        let mut moved = vec![Vec::new(); p.lanes.len()];
        let mut log = Vec::new();
        let mut nth = vec![0usize; p.lanes.len()];
        loop {
            match p.next() {
                Step::Chunk(c) => {
                    let bad = fails(c.lane, nth[c.lane]);
                    nth[c.lane] += 1;
                    assert!(c.runs.len() <= p.limits.chunk_segments);
                    if !bad {
                        moved[c.lane].extend(rows_of(&c.runs));
                    }
                    log.push(format!("c{}", c.lane));
                    flying.push_back((c.lane, c.bytes, !bad));
                }
                Step::Signal(l) => {
                    assert!(
                        flying.iter().all(|f| f.0 != l),
                        "a signal while chunks of its lane fly"
                    );
                    log.push(format!("s{l}"));
                    flying.push_back((l, 0, true));
                }
                Step::Wait => {
                    let (l, b, ok) = flying.pop_front().expect("a wait with nothing in flight");
                    p.completed(l, b, ok);
                }
                Step::Done => {
                    assert!(flying.is_empty());
                    return (moved, log);
                }
            }
            let f = p.in_flight();
            peak.0 = peak.0.max(f.0);
            peak.1 = peak.1.max(f.1);
        }
    }

    #[test]
    fn every_byte_goes_once_in_bounded_chunks_and_the_signal_comes_last() {
        let a = pair(
            0,
            0,
            vec![
                Run::contiguous(0, 100, 10),
                Run {
                    src_offset: 20,
                    dst_offset: 200,
                    len: 7,
                    count: 3,
                    src_stride: 10,
                    dst_stride: 8,
                },
                Run::contiguous(0, 0, 0),
            ],
        );
        let b = pair(0, 1, vec![Run::contiguous(50, 0, 25)]);
        let empty = pair(0, 2, Vec::new());
        let mut p = Pipeline::new(
            vec![vec![&a], vec![&b], vec![&empty]],
            Way::Write,
            true,
            limits(8, 16, 3),
        );
        let mut peak = (0, 0);
        let (moved, log) = drive(&mut p, |_, _| false, &mut peak);
        assert!(peak.0 <= 3 && peak.1 < 16 + 8, "{peak:?}");
        // Lane 0: 10 bytes as 8 + 2, then rows of 7 (each its own segment).
        let mut bytes_a: Vec<(u64, u64)> = moved[0]
            .iter()
            .flat_map(|&(s, d, n)| (0..n).map(move |i| (s + i, d + i)))
            .collect();
        bytes_a.sort_unstable();
        let mut want: Vec<(u64, u64)> = (0..10).map(|i| (i, 100 + i)).collect();
        for row in 0..3 {
            want.extend((0..7).map(|i| (20 + row * 10 + i, 200 + row * 8 + i)));
        }
        want.sort_unstable();
        assert_eq!(bytes_a, want);
        assert!(moved[0].iter().all(|s| s.2 <= 8));
        assert_eq!(moved[1].iter().map(|s| s.2).sum::<u64>(), 25);
        assert!(moved[2].is_empty());
        // The empty lane is signalled first; every lane's signal follows its chunks.
        assert_eq!(log[0], "s2");
        for l in 0..3 {
            let last_chunk = log.iter().rposition(|s| *s == format!("c{l}"));
            let signal = log.iter().position(|s| *s == format!("s{l}")).unwrap();
            assert!(last_chunk.is_none_or(|c| c < signal), "{log:?}");
        }
        for l in 0..3 {
            assert_eq!(p.state(l), LaneState::Done);
        }
        assert_eq!(p.totals(1).bytes, 25);
        assert_eq!(p.totals(1).transfers, 4 + 1, "4 chunks and the signal");
    }

    #[test]
    fn a_failed_lane_stops_and_the_others_finish() {
        let a = pair(0, 0, vec![Run::contiguous(0, 0, 100)]);
        let b = pair(0, 1, vec![Run::contiguous(0, 0, 100)]);
        let mut p = Pipeline::new(
            vec![vec![&a], vec![&b]],
            Way::Write,
            true,
            limits(10, 30, 4),
        );
        let mut peak = (0, 0);
        let (moved, log) = drive(&mut p, |lane, nth| lane == 0 && nth == 2, &mut peak);
        assert_eq!(p.state(0), LaneState::Failed);
        assert_eq!(p.state(1), LaneState::Done);
        assert!(!log.contains(&"s0".to_string()));
        assert!(moved[0].len() < 10, "lane 0 stopped early: {log:?}");
        assert_eq!(moved[1].iter().map(|s| s.2).sum::<u64>(), 100);
    }

    #[test]
    fn reads_turn_segments_around_and_send_no_signal() {
        let a = pair(3, 0, vec![Run::contiguous(5, 9, 4)]);
        let mut p = Pipeline::new(vec![vec![&a]], Way::Read, false, limits(64, 64, 2));
        let Step::Chunk(c) = p.next() else {
            panic!("a chunk first")
        };
        assert_eq!((c.local_region, c.remote_region), (1, 0));
        assert_eq!(c.runs, vec![StridedRun::contiguous(9, 5, 4)]);
        assert_eq!(p.next(), Step::Wait);
        p.completed(0, 4, true);
        assert_eq!(p.next(), Step::Done);
        assert_eq!(p.state(0), LaneState::Done);
    }

    #[test]
    fn whole_rows_go_as_one_strided_run_and_a_cut_row_in_pieces() {
        let r = Run {
            src_offset: 4,
            dst_offset: 100,
            len: 7,
            count: 1000,
            src_stride: 16,
            dst_stride: 7,
        };
        let a = pair(0, 0, vec![r]);
        for way in [Way::Write, Way::Read] {
            // Chunks of 75 bytes: 10 whole rows, then 5 bytes of the next; the next chunk
            // starts with that row's last 2 bytes.
            let mut p = Pipeline::new(vec![vec![&a]], way, false, limits(75, 1 << 20, 1));
            let mut got = Vec::new();
            let mut chunks = Vec::new();
            loop {
                match p.next() {
                    Step::Chunk(c) => {
                        p.completed(0, c.bytes, true);
                        chunks.push(c);
                    }
                    Step::Done => break,
                    s => panic!("{s:?}"),
                }
            }
            for c in &chunks {
                assert!(c.bytes <= 75 && c.runs.len() <= 3, "{c:?}");
                for (s, d, n) in rows_of(&c.runs) {
                    let (src, dst) = if way == Way::Write { (s, d) } else { (d, s) };
                    got.extend((0..n).map(|b| (src + b, dst + b)));
                }
            }
            assert_eq!(
                chunks[0].runs,
                vec![
                    if way == Way::Write {
                        StridedRun {
                            count: 10,
                            src_stride: 16,
                            dst_stride: 7,
                            ..StridedRun::contiguous(4, 100, 7)
                        }
                    } else {
                        StridedRun {
                            count: 10,
                            src_stride: 7,
                            dst_stride: 16,
                            ..StridedRun::contiguous(100, 4, 7)
                        }
                    },
                    if way == Way::Write {
                        StridedRun::contiguous(4 + 160, 170, 5)
                    } else {
                        StridedRun::contiguous(170, 4 + 160, 5)
                    },
                ]
            );
            assert_eq!(chunks[0].rows, 11);
            let mut want: Vec<(u64, u64)> = (0..1000)
                .flat_map(|i| (0..7).map(move |b| (4 + i * 16 + b, 100 + i * 7 + b)))
                .collect();
            got.sort_unstable();
            want.sort_unstable();
            assert_eq!(got, want);
            assert_eq!(p.totals(0).bytes, 7000);
        }
    }
}
