//! How [`Plan`]s are made (the public face is [`Plan::with_options`]).
//!
//! Tensor by tensor, in global id order: the source pieces become boxes with their storage
//! (a flat range is at most `2 * nd - 1` boxes); identical boxes on several ranks become one
//! cell with several holders; cells that overlap without being identical are refined into
//! disjoint ones (box subtraction: rare, so simple). The destination pieces become boxes
//! too, identical ones grouped as replicas. Each destination box meets the cells (a sweep
//! over the first dimension), and each intersection is cut into runs (contiguous dimensions
//! merged into `len`, the next into `count` rows, any outer ones looped over). A tensor
//! whose pieces all hold stretches of its flat order (flat shards, splits of the first
//! dimension, whole tensors: most of a model) is planned as 1-D, one box per piece.
//!
//! Pass 1 emits what a single source holds and counts those forced bytes; tensors with
//! ranges held by several sources are planned again in pass 2, which gives those ranges out
//! by load (see [`Plan::with_options`]).

use super::geometry::{Bx, Store, dims_of, flat_boxes, flat_span, stored_boxes};
use super::inputs::{ByTensor, Catalog};
use super::layout::{ElementBox, Layout, MAX_DIMS, Piece, TensorSpec};
use super::plan::{Bound, Limit, Plan, PlanError, PlanOptions};
use super::runs::{Sink, emit};
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
        sink: Sink::new(sources.len(), dests.len()),
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
    let pairs = p.sink.finish();
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
        let esize = u64::from(spec.elem_size);
        if self.dst_by.of(t).is_empty() {
            return Ok(false);
        }
        // When every piece is a stretch of the flat order, the tensor is planned as 1-D:
        // one box per piece, contiguous runs. Else as boxes of its own dimensions.
        let s = &mut self.s;
        let mut one_d = true;
        s.dst.clear();
        s.src.clear();
        for (list, by, out) in [
            (self.dests, self.dst_by.of(t), &mut s.dst),
            (self.sources, self.src_by.of(t), &mut s.src),
        ] {
            for &(rank, i) in by {
                let piece = &list[rank as usize].pieces[i as usize];
                if !one_d || !flat_box(spec, piece, rank, out) {
                    one_d = false;
                    break;
                }
            }
        }
        let nd = if one_d { 1 } else { dims_of(spec).0 };
        if !one_d {
            s.dst.clear();
            s.src.clear();
            for (list, by, out) in [
                (self.dests, self.dst_by.of(t), &mut s.dst),
                (self.sources, self.src_by.of(t), &mut s.src),
            ] {
                for &(rank, i) in by {
                    let piece = &list[rank as usize].pieces[i as usize];
                    stored_boxes(spec, piece, rank, &mut |b, st| out.push((b, st)));
                }
            }
        }
        // Destination boxes, identical ones grouped.
        s.dst.sort_by_key(|a| a.0);
        s.groups.clear();
        let mut at = 0;
        for run in s.dst.chunk_by(|a, b| a.0 == b.0) {
            s.groups.push((run[0].0, at..at + run.len()));
            at += run.len();
        }
        // Source cells: identical boxes on several ranks are one cell.
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
                            sat_add(&mut self.loads[src.rank as usize], bytes);
                            sat_add(&mut self.dst_loads[dst.rank as usize], bytes);
                        }
                    }
                }
            }
            if covered < d.volume(nd) {
                let missing = uncovered(&s.cells, &d, nd);
                return Err(PlanError::Uncovered {
                    tensor: spec.name.clone(),
                    dst_rank: s.dst[reps.start].1.rank,
                    elements: public_box(spec, &missing, one_d),
                });
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
            let bytes = (vol * esize).saturating_mul(reps.len() as u64);
            match self.sets.get_mut(&s.ranks[..]) {
                Some(b) => sat_add(b, bytes),
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
                    sat_add(&mut self.loads[src.rank as usize], bytes);
                    sat_add(&mut self.dst_loads[dst.rank as usize], bytes);
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
        let total = self
            .dst_loads
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b));
        if !self.sources.is_empty() {
            consider(total.div_ceil(self.sources.len() as u64), Limit::AllSources);
        }
        let mut sets: Vec<(&[u32], u64)> = self.sets.iter().map(|(k, &v)| (&**k, v)).collect();
        sets.sort_unstable();
        // Bytes only H can send: those of every shared set inside H (when few enough sets
        // to compare them all), plus the forced bytes of its members.
        let all_pairs = sets.len() <= 2048;
        for &(h, own) in &sets {
            let mut bytes = h
                .iter()
                .fold(own, |a, &r| a.saturating_add(forced[r as usize]));
            if all_pairs {
                for &(o, b) in &sets {
                    if o != h && o.len() <= h.len() && subset(o, h) {
                        bytes = bytes.saturating_add(b);
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

/// Adds bytes to a load (saturating: absurd layouts may declare exabytes).
fn sat_add(load: &mut u64, bytes: u64) {
    *load = load.saturating_add(bytes);
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

/// A box of destination box `d` that the cells do not cover.
fn uncovered(cells: &[Cell], d: &Bx, nd: usize) -> Bx {
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
    rest.first().copied().unwrap_or(*d)
}

/// Pushes the piece as one box of the flat order and its storage, if its elements follow
/// one another in that order (else says no).
fn flat_box(spec: &TensorSpec, piece: &Piece, rank: u32, out: &mut Vec<(Bx, Store)>) -> bool {
    let Some(r) = flat_span(spec, piece) else {
        return false;
    };
    if r.start < r.end {
        let esize = u64::from(spec.elem_size);
        let mut b = Bx::unit();
        (b.lo[0], b.hi[0]) = (r.start, r.end);
        let mut strides = [0; MAX_DIMS];
        strides[0] = esize;
        let origin = piece.offset.wrapping_sub(r.start.wrapping_mul(esize));
        out.push((
            b,
            Store {
                rank,
                region: piece.region,
                origin,
                strides,
            },
        ));
    }
    true
}

/// How errors name a box (of the flat order, when planning in 1-D: its first box then).
fn public_box(spec: &TensorSpec, b: &Bx, one_d: bool) -> ElementBox {
    if !one_d {
        return b.to_public(spec.shape.len());
    }
    let (nd, ext) = dims_of(spec);
    let mut first = None;
    flat_boxes(&ext[..nd], &[0; MAX_DIMS], b.lo[0], b.hi[0], &mut |x| {
        first.get_or_insert(x.to_public(spec.shape.len()));
    });
    first.unwrap_or(ElementBox(Vec::new()))
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

#[cfg(test)]
mod tests {
    use super::*;

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
