//! How [`Plan`]s are made (the public face is [`Plan::with_options`]).
//!
//! Tensor by tensor, in global id order: the source pieces become boxes with their storage
//! (a flat range is at most `2 * nd - 1` boxes); identical boxes on several ranks become one
//! cell with several holders; cells that overlap without being identical are refined into
//! disjoint ones (box subtraction: rare, so simple). The destination pieces become boxes
//! too, identical ones grouped as replicas. Each destination box meets the cells (a sweep
//! over the first dimension), and each intersection is cut into runs (contiguous dimensions
//! merged into `len`, the next into `count` rows, any outer ones looped over).
//!
//! Pass 1 emits what a single source holds and counts those forced bytes; tensors with
//! ranges held by several sources are planned again in pass 2, which gives those ranges out
//! by load (see [`Plan::with_options`]).

use super::geometry::{Bx, Store, flat_boxes};
use super::inputs::{ByTensor, Catalog};
use super::layout::{Layout, dims_of, stored_boxes};
use super::plan::{Bound, Limit, Plan, PlanError, PlanOptions, RankRegion, RegionPair, Run};
use rustc_hash::FxHashMap;
use std::ops::Range;

/// Cells per block of the sweep's skip index.
const BLOCK: usize = 32;

/// Entry point of [`Plan::with_options`].
pub(crate) fn plan(
    sources: &[Layout],
    dests: &[Layout],
    options: &PlanOptions,
) -> Result<Plan, PlanError> {
    let cat = Catalog::new(sources, dests)?;
    let g = cat.tensors.len();
    let mut p = Planner {
        cat: &cat,
        sources,
        dests,
        src_by: ByTensor::new(sources, &cat.src_ids, g),
        dst_by: ByTensor::new(dests, &cat.dst_ids, g),
        q: options.min_split_bytes,
        loads: vec![0; sources.len()],
        dst_loads: vec![0; dests.len()],
        sink: Sink::default(),
        sets: FxHashMap::default(),
        s: Scratch::default(),
    };
    let mut shared = Vec::new();
    for t in 0..g {
        if p.tensor(t, Pass::Forced)? {
            shared.push(t);
        }
    }
    let forced = p.loads.clone();
    for t in shared {
        p.tensor(t, Pass::Shared)?;
    }
    let bound = p.bound(&forced);
    let mut pairs = p.sink.pairs;
    pairs.sort_by_key(|q| (q.src, q.dst));
    Ok(Plan {
        sources: sources.len() as u32,
        destinations: dests.len() as u32,
        pairs,
        bound,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Emit what one source holds; report whether several hold some.
    Forced,
    /// Give out what several hold.
    Shared,
}

/// A disjoint box of source elements and who holds it: `holders` indexes `Scratch::hold`,
/// whose entries index `Scratch::src`.
#[derive(Clone, Debug)]
struct Cell {
    bx: Bx,
    holders: Range<usize>,
}

/// A range several sources hold that a destination box needs.
#[derive(Clone, Copy)]
struct Choice {
    x: Bx,
    cell: usize,
    group: usize,
}

/// Buffers reused from tensor to tensor.
#[derive(Default)]
struct Scratch {
    src: Vec<(Bx, Store)>,
    cells: Vec<Cell>,
    hold: Vec<usize>,
    block_max: Vec<u64>,
    dst: Vec<(Bx, Store)>,
    groups: Vec<(Bx, Range<usize>)>,
    choices: Vec<Choice>,
    parts: Vec<(usize, u64, u64)>,
    cand: Vec<(u64, u32, usize)>,
    ranks: Vec<u32>,
}

struct Planner<'a> {
    cat: &'a Catalog<'a>,
    sources: &'a [Layout],
    dests: &'a [Layout],
    src_by: ByTensor,
    dst_by: ByTensor,
    q: u64,
    loads: Vec<u64>,
    dst_loads: Vec<u64>,
    sink: Sink,
    /// Bytes of ranges held by several sources, by their (sorted) set of holders.
    sets: FxHashMap<Box<[u32]>, u64>,
    s: Scratch,
}

impl Planner<'_> {
    /// Plans tensor `t` in `pass`; in pass 1, says whether several sources hold some of
    /// what destinations need.
    fn tensor(&mut self, t: usize, pass: Pass) -> Result<bool, PlanError> {
        let spec = self.cat.tensors[t];
        let (nd, _) = dims_of(spec);
        let esize = u64::from(spec.elem_size);
        let s = &mut self.s;
        if self.dst_by.of(t).is_empty() {
            return Ok(false);
        }
        // Destination boxes, identical ones grouped.
        s.dst.clear();
        for &(rank, i) in self.dst_by.of(t) {
            let piece = &self.dests[rank as usize].pieces[i as usize];
            stored_boxes(spec, piece, rank, &mut |b, st| s.dst.push((b, st)));
        }
        s.dst.sort_by_key(|a| a.0);
        s.groups.clear();
        let mut at = 0;
        for run in s.dst.chunk_by(|a, b| a.0 == b.0) {
            s.groups.push((run[0].0, at..at + run.len()));
            at += run.len();
        }
        // Source cells.
        s.src.clear();
        for &(rank, i) in self.src_by.of(t) {
            let piece = &self.sources[rank as usize].pieces[i as usize];
            stored_boxes(spec, piece, rank, &mut |b, st| s.src.push((b, st)));
        }
        s.src.sort_by_key(|a| a.0);
        s.cells.clear();
        s.hold.clear();
        let mut at = 0;
        for run in s.src.chunk_by(|a, b| a.0 == b.0) {
            let h = s.hold.len();
            s.hold.extend(at..at + run.len());
            s.cells.push(Cell {
                bx: run[0].0,
                holders: h..s.hold.len(),
            });
            at += run.len();
        }
        if !disjoint(&s.cells, nd) {
            refine(&mut s.cells, &mut s.hold, nd);
        }
        s.block_max.clear();
        for b in s.cells.chunks(BLOCK) {
            s.block_max
                .push(b.iter().map(|c| c.bx.hi[0]).max().unwrap_or(0));
        }
        // Each destination box against the cells.
        let mut shared = false;
        s.choices.clear();
        for gi in 0..s.groups.len() {
            let (d, reps) = s.groups[gi].clone();
            let end = s.cells.partition_point(|c| c.bx.lo[0] < d.hi[0]);
            let mut covered = 0u64;
            for (bi, &m) in s.block_max.iter().enumerate() {
                let lo = bi * BLOCK;
                if lo >= end {
                    break;
                }
                if m <= d.lo[0] {
                    continue;
                }
                for ci in lo..end.min(lo + BLOCK) {
                    let Some(x) = s.cells[ci].bx.intersect(&d, nd) else {
                        continue;
                    };
                    covered += x.volume(nd);
                    let holders = s.cells[ci].holders.clone();
                    if holders.len() > 1 {
                        shared = true;
                        if pass == Pass::Shared {
                            s.choices.push(Choice {
                                x,
                                cell: ci,
                                group: gi,
                            });
                        }
                    } else if pass == Pass::Forced {
                        let src = s.src[s.hold[holders.start]].1;
                        for r in reps.clone() {
                            let dst = s.dst[r].1;
                            emit(&mut self.sink, &src, &dst, &x, nd, esize);
                            let bytes = x.volume(nd) * esize;
                            self.loads[src.rank as usize] += bytes;
                            self.dst_loads[dst.rank as usize] += bytes;
                        }
                    }
                }
            }
            if covered < d.volume(nd) {
                return Err(uncovered(
                    &s.cells,
                    &d,
                    nd,
                    &spec.name,
                    s.dst[reps.start].1.rank,
                ));
            }
        }
        if pass == Pass::Shared {
            self.give_out(nd, esize);
        }
        Ok(shared)
    }

    /// Pass 2 of one tensor: each range several sources hold, fewest holders first, given
    /// out by load for each destination that needs it.
    fn give_out(&mut self, nd: usize, esize: u64) {
        let s = &mut self.s;
        let mut choices = std::mem::take(&mut s.choices);
        choices.sort_by_key(|c| s.cells[c.cell].holders.len());
        for ch in &choices {
            let holders = s.cells[ch.cell].holders.clone();
            let reps = s.groups[ch.group].1.clone();
            let vol = ch.x.volume(nd);
            s.ranks.clear();
            s.ranks
                .extend(s.hold[holders.clone()].iter().map(|&h| s.src[h].1.rank));
            s.ranks.sort_unstable();
            let bytes = vol * esize * reps.len() as u64;
            match self.sets.get_mut(&s.ranks[..]) {
                Some(b) => *b += bytes,
                None => {
                    self.sets.insert(s.ranks.clone().into_boxed_slice(), bytes);
                }
            }
            let ext = ch.x.extents(nd);
            for r in reps {
                let dst = s.dst[r].1;
                s.cand.clear();
                s.cand.extend(s.hold[holders.clone()].iter().map(|&h| {
                    let rank = s.src[h].1.rank;
                    (self.loads[rank as usize], rank, h)
                }));
                split(&mut s.cand, vol, esize, self.q, &mut s.parts);
                for &(h, a, b) in &s.parts {
                    let src = s.src[h].1;
                    let bytes = (b - a) * esize;
                    self.loads[src.rank as usize] += bytes;
                    self.dst_loads[dst.rank as usize] += bytes;
                    flat_boxes(&ext[..nd], &ch.x.lo, a, b, &mut |sub| {
                        emit(&mut self.sink, &src, &dst, sub, nd, esize)
                    });
                }
            }
        }
        s.choices = choices;
    }

    /// The lower bound (see [`Limit`]) from the forced loads of pass 1 and the shared sets.
    fn bound(&self, forced: &[u64]) -> Bound {
        let mut best = Bound {
            bytes: 0,
            limit: Limit::AllSources,
        };
        let mut consider = |bytes: u64, limit: Limit| {
            if bytes > best.bytes {
                best = Bound { bytes, limit };
            }
        };
        for (rank, &b) in self.dst_loads.iter().enumerate() {
            consider(b, Limit::Destination { rank: rank as u32 });
        }
        for (rank, &b) in forced.iter().enumerate() {
            consider(
                b,
                Limit::Sources {
                    ranks: vec![rank as u32],
                },
            );
        }
        let total: u64 = self.dst_loads.iter().sum();
        if !self.sources.is_empty() {
            consider(total.div_ceil(self.sources.len() as u64), Limit::AllSources);
        }
        let mut sets: Vec<(&[u32], u64)> = self.sets.iter().map(|(k, &v)| (&**k, v)).collect();
        sets.sort_unstable();
        // Bytes only H can send: those of every shared set inside H (when few enough sets
        // to compare them all), plus the forced bytes of its members.
        let all_pairs = sets.len() <= 2048;
        for &(h, own) in &sets {
            let mut bytes: u64 = h.iter().map(|&r| forced[r as usize]).sum::<u64>() + own;
            if all_pairs {
                for &(o, b) in &sets {
                    if o != h && o.len() <= h.len() && subset(o, h) {
                        bytes += b;
                    }
                }
            }
            consider(
                bytes.div_ceil(h.len() as u64),
                Limit::Sources { ranks: h.to_vec() },
            );
        }
        best
    }
}

/// Whether sorted `a` is a subset of sorted `b`.
fn subset(a: &[u32], b: &[u32]) -> bool {
    let mut j = 0;
    for &x in a {
        while j < b.len() && b[j] < x {
            j += 1;
        }
        if j == b.len() || b[j] != x {
            return false;
        }
        j += 1;
    }
    true
}

/// Whether cells sorted by their first coordinate are pairwise disjoint (a sweep along
/// the first dimension).
fn disjoint(cells: &[Cell], nd: usize) -> bool {
    let mut open: Vec<usize> = Vec::new();
    for (k, c) in cells.iter().enumerate() {
        open.retain(|&o| cells[o].bx.hi[0] > c.bx.lo[0]);
        if open.iter().any(|&o| cells[o].bx.overlaps(&c.bx, nd)) {
            return false;
        }
        open.push(k);
    }
    true
}

/// Makes overlapping cells disjoint: each part of the index space gets the union of its
/// holders. Quadratic, for the rare layouts whose sources overlap without being replicas.
fn refine(cells: &mut Vec<Cell>, hold: &mut Vec<usize>, nd: usize) {
    let mut done: Vec<(Bx, Vec<usize>)> = Vec::new();
    let mut parts = Vec::new();
    for c in cells.iter() {
        let h: Vec<usize> = hold[c.holders.clone()].to_vec();
        let mut rest = vec![c.bx];
        let n = done.len();
        for i in 0..n {
            let Some(x) = done[i].0.intersect(&c.bx, nd) else {
                continue;
            };
            parts.clear();
            done[i].0.subtract(&c.bx, nd, &mut parts);
            let old = done[i].1.clone();
            for &p in &parts {
                done.push((p, old.clone()));
            }
            let mut union = old;
            union.extend_from_slice(&h);
            union.sort_unstable();
            union.dedup();
            done[i] = (x, union);
            let mut next = Vec::with_capacity(rest.len());
            for r in &rest {
                r.subtract(&x, nd, &mut next);
            }
            rest = next;
        }
        done.extend(rest.into_iter().map(|r| (r, h.clone())));
    }
    done.sort_by_key(|a| a.0);
    cells.clear();
    hold.clear();
    for (bx, h) in done {
        let start = hold.len();
        hold.extend(h);
        cells.push(Cell {
            bx,
            holders: start..hold.len(),
        });
    }
}

/// The error for destination box `d`, which the cells do not cover: one box they miss.
fn uncovered(cells: &[Cell], d: &Bx, nd: usize, tensor: &str, dst_rank: u32) -> PlanError {
    let mut rest = vec![*d];
    for c in cells {
        if c.bx.overlaps(d, nd) {
            let mut next = Vec::new();
            for r in &rest {
                r.subtract(&c.bx, nd, &mut next);
            }
            rest = next;
        }
    }
    PlanError::Uncovered {
        tensor: tensor.to_owned(),
        dst_rank,
        elements: rest.first().unwrap_or(d).to_public(nd),
    }
}

/// Splits `vol` elements (of `esize` bytes) among candidates `(load, rank, holder)`:
/// `parts` gets `(holder, first, end)` element ranges, in rank order (the rule is
/// [`Plan::with_options`]'s).
fn split(
    cand: &mut [(u64, u32, usize)],
    vol: u64,
    esize: u64,
    q: u64,
    parts: &mut Vec<(usize, u64, u64)>,
) {
    parts.clear();
    cand.sort_unstable();
    let bytes = vol * esize;
    if cand.len() == 1
        || bytes <= q
        || cand[0].0.saturating_add(bytes) <= cand[1].0.saturating_add(q)
    {
        parts.push((cand[0].2, 0, vol));
        return;
    }
    // Water level: the m least loaded end at (bytes + their loads) / m, at most the next.
    let mut sum = 0u128;
    let mut m = 0usize;
    for (i, c) in cand.iter().enumerate() {
        sum += u128::from(c.0);
        m = i + 1;
        let level = u128::from(bytes) + sum;
        if m == cand.len() || level <= u128::from(cand[m].0) * m as u128 {
            break;
        }
    }
    let level = u128::from(bytes) + sum;
    let mut shares: Vec<(u32, usize, u64)> = cand[..m]
        .iter()
        .map(|&(l, rank, h)| {
            let share =
                level.saturating_sub(u128::from(l) * m as u128) / (m as u128 * u128::from(esize));
            (rank, h, share as u64)
        })
        .collect();
    let mut left = vol - shares.iter().map(|s| s.2).sum::<u64>().min(vol);
    // Fewer than m elements are left; the least loaded take one each.
    for s in shares.iter_mut() {
        if left == 0 {
            break;
        }
        s.2 += 1;
        left -= 1;
    }
    shares.sort_unstable();
    let mut at = 0;
    for (_, h, n) in shares {
        if n > 0 {
            parts.push((h, at, at + n));
            at += n;
        }
    }
}

/// Cuts the elements of box `x` into runs from `src` to `dst` and pushes them.
fn emit(sink: &mut Sink, src: &Store, dst: &Store, x: &Bx, nd: usize, esize: u64) {
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
    let mut dims = [(0u64, 0u64, 0u64); super::layout::MAX_DIMS];
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
    let mut idx = [0u64; super::layout::MAX_DIMS];
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

type PairKey = (RankRegion, RankRegion);

/// The region pairs being filled, each run coalesced with the one before it if it can.
#[derive(Default)]
struct Sink {
    index: FxHashMap<PairKey, usize>,
    pairs: Vec<RegionPair>,
    last: Option<(PairKey, usize)>,
}

impl Sink {
    fn push(&mut self, key: PairKey, run: Run) {
        let i = match self.last {
            Some((k, i)) if k == key => i,
            _ => {
                let n = self.pairs.len();
                let i = *self.index.entry(key).or_insert(n);
                if i == n {
                    self.pairs.push(RegionPair {
                        src: key.0,
                        dst: key.1,
                        runs: Vec::new(),
                    });
                }
                self.last = Some((key, i));
                i
            }
        };
        let runs = &mut self.pairs[i].runs;
        if let Some(last) = runs.last_mut()
            && coalesce(last, &run)
        {
            return;
        }
        runs.push(run);
    }
}

/// Extends `l` with `r` if `r` continues it: contiguously (both single rows), or as the
/// next rows of one stride (equal row lengths, rows that do not overlap).
fn coalesce(l: &mut Run, r: &Run) -> bool {
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
    fn water_filling_levels_the_least_loaded() {
        let mut parts = Vec::new();
        // Loads 0, 10, 100 bytes; 50 one-byte elements: the first two end at 30 each.
        let mut cand = vec![(100, 2, 2), (10, 1, 1), (0, 0, 0)];
        split(&mut cand, 50, 1, 4, &mut parts);
        assert_eq!(parts, vec![(0, 0, 30), (1, 30, 50)]);
        // Small: whole to the least loaded.
        let mut cand = vec![(5, 0, 0), (0, 1, 1)];
        split(&mut cand, 4, 1, 4, &mut parts);
        assert_eq!(parts, vec![(1, 0, 4)]);
        // Fits within q of the second: whole.
        let mut cand = vec![(0, 0, 0), (8, 1, 1)];
        split(&mut cand, 10, 1, 4, &mut parts);
        assert_eq!(parts, vec![(0, 0, 10)]);
        // Remainders: 7 elements of 2 bytes over 3 equal holders.
        let mut cand = vec![(0, 0, 0), (0, 1, 1), (0, 2, 2)];
        split(&mut cand, 7, 2, 2, &mut parts);
        assert_eq!(parts, vec![(0, 0, 3), (1, 3, 5), (2, 5, 7)]);
    }

    #[test]
    fn subsets() {
        assert!(subset(&[1, 3], &[0, 1, 2, 3]));
        assert!(!subset(&[1, 4], &[0, 1, 2, 3]));
        assert!(subset(&[], &[0]));
    }
}
