//! Cutting a box of common elements into [`Run`]s ([`emit`]) and collecting them per
//! region pair, each coalesced with the one before it ([`Sink`]).
//!
//! A plan of a large model has tens of millions of runs over tens of thousands of region
//! pairs, and the planner goes tensor by tensor, so consecutive runs belong to different
//! pairs. Appending each to its pair's vector would touch a random page per run; instead
//! the sink keeps only each pair's open run (in one dense array, where coalescing happens),
//! appends closed runs to one log, and groups the log by pair once at the end.

use super::geometry::{Bx, Store};
use super::layout::MAX_DIMS;
use super::plan::{RankRegion, RegionPair, Run};
use rustc_hash::FxHashMap;

/// Rank pairs up to this many get a dense index (4 bytes each); more use the map alone.
const DENSE_MAX: usize = 1 << 24;

/// Closed runs per chunk of the log (chunks, so that the log never moves as it grows).
const CHUNK: usize = 1 << 16;

/// Cuts the elements of box `x` into runs from `src` to `dst` and pushes them: dimensions
/// contiguous on both sides merge into the row length, the next (and those continuing its
/// strides) into the row count, and any outer ones are looped over.
pub(crate) fn emit(sink: &mut Sink, src: &Store, dst: &Store, x: &Bx, nd: usize, esize: u64) {
    let key = (
        RankRegion {
            rank: src.rank,
            region: src.region,
        },
        RankRegion {
            rank: dst.rank,
            region: dst.region,
        },
    );
    let so = src.offset(&x.lo, nd);
    let dof = dst.offset(&x.lo, nd);
    // (extent, source stride, destination stride) of the dimensions longer than 1.
    let mut dims = [(0u64, 0u64, 0u64); MAX_DIMS];
    let mut n = 0;
    for i in 0..nd {
        let e = x.hi[i] - x.lo[i];
        if e > 1 {
            dims[n] = (e, src.strides[i], dst.strides[i]);
            n += 1;
        }
    }
    let mut len = esize;
    while n > 0 && dims[n - 1].1 == len && dims[n - 1].2 == len {
        len = len.wrapping_mul(dims[n - 1].0);
        n -= 1;
    }
    if n == 0 {
        sink.push(key, Run::contiguous(so, dof, len));
        return;
    }
    let (mut count, ss, ds) = dims[n - 1];
    n -= 1;
    while n > 0
        && dims[n - 1].1 == ss.wrapping_mul(count)
        && dims[n - 1].2 == ds.wrapping_mul(count)
    {
        count = count.wrapping_mul(dims[n - 1].0);
        n -= 1;
    }
    let mut idx = [0u64; MAX_DIMS];
    loop {
        let (mut a, mut b) = (so, dof);
        for j in 0..n {
            a = a.wrapping_add(idx[j].wrapping_mul(dims[j].1));
            b = b.wrapping_add(idx[j].wrapping_mul(dims[j].2));
        }
        sink.push(
            key,
            Run {
                src_offset: a,
                dst_offset: b,
                len,
                count,
                src_stride: ss,
                dst_stride: ds,
            },
        );
        // Next index of the outer dimensions, odometer style.
        let mut j = n;
        loop {
            if j == 0 {
                return;
            }
            j -= 1;
            idx[j] += 1;
            if idx[j] < dims[j].0 {
                break;
            }
            idx[j] = 0;
        }
    }
}

/// Which region pair a run belongs to.
pub(crate) type PairKey = (RankRegion, RankRegion);

/// The region pairs being filled (see the module documentation).
pub(crate) struct Sink {
    destinations: usize,
    /// `src_rank * destinations + dst_rank` -> the pair of those ranks used last.
    dense: Vec<u32>,
    index: FxHashMap<PairKey, u32>,
    keys: Vec<PairKey>,
    /// Each pair's open run (`count == 0`: none yet).
    open: Vec<Run>,
    /// Closed runs, in the order they closed (which, per pair, is their order).
    log: Vec<Vec<(u32, Run)>>,
    last: u32,
}

impl Sink {
    /// A sink for `sources` x `destinations` ranks.
    pub fn new(sources: usize, destinations: usize) -> Sink {
        let cells = sources.saturating_mul(destinations);
        Sink {
            destinations,
            dense: if cells <= DENSE_MAX {
                vec![u32::MAX; cells]
            } else {
                Vec::new()
            },
            index: FxHashMap::default(),
            keys: Vec::new(),
            open: Vec::new(),
            log: Vec::new(),
            last: u32::MAX,
        }
    }

    fn pair(&mut self, key: PairKey) -> usize {
        if let Some(&k) = self.keys.get(self.last as usize)
            && k == key
        {
            return self.last as usize;
        }
        let slot = key.0.rank as usize * self.destinations + key.1.rank as usize;
        let hint = self.dense.get(slot).copied().unwrap_or(u32::MAX);
        let i = if self.keys.get(hint as usize) == Some(&key) {
            hint
        } else {
            let n = self.keys.len() as u32;
            let i = *self.index.entry(key).or_insert(n);
            if i == n {
                self.keys.push(key);
                self.open.push(Run {
                    count: 0,
                    ..Run::contiguous(0, 0, 0)
                });
            }
            if let Some(d) = self.dense.get_mut(slot) {
                *d = i;
            }
            i
        };
        self.last = i;
        i as usize
    }

    /// Adds `run` to the pair `key`, coalesced with the pair's previous run if it can be.
    pub fn push(&mut self, key: PairKey, run: Run) {
        let i = self.pair(key);
        let open = &mut self.open[i];
        if open.count == 0 {
            *open = run;
        } else if !coalesce(open, &run) {
            let closed = (i as u32, *open);
            *open = run;
            self.log_push(closed);
        }
    }

    fn log_push(&mut self, closed: (u32, Run)) {
        match self.log.last_mut() {
            Some(c) if c.len() < CHUNK => c.push(closed),
            _ => {
                let mut c = Vec::with_capacity(CHUNK);
                c.push(closed);
                self.log.push(c);
            }
        }
    }

    /// The region pairs, sorted by key, each with its runs in order.
    pub fn finish(mut self) -> Vec<RegionPair> {
        for i in 0..self.open.len() {
            if self.open[i].count > 0 {
                self.log_push((i as u32, self.open[i]));
            }
        }
        let mut counts = vec![0usize; self.keys.len()];
        for &(i, _) in self.log.iter().flatten() {
            counts[i as usize] += 1;
        }
        let mut pairs: Vec<RegionPair> = self
            .keys
            .iter()
            .zip(&counts)
            .map(|(k, &n)| RegionPair {
                src: k.0,
                dst: k.1,
                runs: Vec::with_capacity(n),
            })
            .collect();
        for chunk in std::mem::take(&mut self.log) {
            for (i, run) in chunk {
                pairs[i as usize].runs.push(run);
            }
        }
        pairs.sort_unstable_by_key(|p| (p.src, p.dst));
        pairs
    }
}

/// Extends `l` with `r` if `r` continues it: contiguously (both single rows), or as the
/// next rows of one stride (equal row lengths, rows that do not overlap).
pub(crate) fn coalesce(l: &mut Run, r: &Run) -> bool {
    if l.count == 1
        && r.count == 1
        && l.src_offset.checked_add(l.len) == Some(r.src_offset)
        && l.dst_offset.checked_add(l.len) == Some(r.dst_offset)
    {
        l.len += r.len;
        return true;
    }
    if l.len != r.len {
        return false;
    }
    let (ss, ds) = if l.count > 1 {
        (l.src_stride, l.dst_stride)
    } else if r.count > 1 {
        (r.src_stride, r.dst_stride)
    } else {
        match (
            r.src_offset.checked_sub(l.src_offset),
            r.dst_offset.checked_sub(l.dst_offset),
        ) {
            (Some(a), Some(b)) => (a, b),
            _ => return false,
        }
    };
    if (r.count > 1 && (r.src_stride, r.dst_stride) != (ss, ds)) || ss < l.len || ds < l.len {
        return false;
    }
    let next = ss
        .checked_mul(l.count)
        .and_then(|a| l.src_offset.checked_add(a))
        .zip(
            ds.checked_mul(l.count)
                .and_then(|b| l.dst_offset.checked_add(b)),
        );
    if next != Some((r.src_offset, r.dst_offset)) {
        return false;
    }
    l.count += r.count;
    l.src_stride = ss;
    l.dst_stride = ds;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_coalesce_contiguously_then_by_stride() {
        let mut l = Run::contiguous(0, 100, 8);
        assert!(coalesce(&mut l, &Run::contiguous(8, 108, 8)));
        assert_eq!(l, Run::contiguous(0, 100, 16));
        assert!(coalesce(&mut l, &Run::contiguous(64, 200, 16)));
        assert!(coalesce(&mut l, &Run::contiguous(128, 300, 16)));
        assert_eq!((l.count, l.src_stride, l.dst_stride), (3, 64, 100));
        assert!(
            !coalesce(&mut l, &Run::contiguous(200, 400, 16)),
            "off the stride"
        );
        assert!(
            !coalesce(&mut l, &Run::contiguous(192, 400, 8)),
            "another length"
        );
        // Rows that would overlap are not a stride.
        let mut l = Run::contiguous(0, 0, 8);
        assert!(!coalesce(&mut l, &Run::contiguous(4, 100, 8)));
    }

    #[test]
    fn the_sink_keeps_each_pairs_order_across_interleaved_pushes() {
        let key = |s: u32, d: u32| {
            (
                RankRegion { rank: s, region: 0 },
                RankRegion { rank: d, region: 0 },
            )
        };
        for sink in [Sink::new(2, 2), Sink::new(0, 0)] {
            let mut sink = sink;
            sink.push(key(1, 0), Run::contiguous(0, 0, 4));
            sink.push(key(0, 1), Run::contiguous(0, 0, 4));
            sink.push(key(1, 0), Run::contiguous(4, 4, 4)); // coalesces
            sink.push(key(1, 0), Run::contiguous(100, 50, 2));
            sink.push(key(0, 1), Run::contiguous(9, 9, 1));
            sink.push(key(1, 0), Run::contiguous(7, 70, 3));
            let pairs = sink.finish();
            assert_eq!(pairs.len(), 2);
            assert_eq!((pairs[0].src.rank, pairs[0].dst.rank), (0, 1));
            assert_eq!(
                pairs[0].runs,
                vec![Run::contiguous(0, 0, 4), Run::contiguous(9, 9, 1)]
            );
            assert_eq!(
                pairs[1].runs,
                vec![
                    Run::contiguous(0, 0, 8),
                    Run::contiguous(100, 50, 2),
                    Run::contiguous(7, 70, 3)
                ]
            );
        }
    }
}
