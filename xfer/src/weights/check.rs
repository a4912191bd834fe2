//! Proof that a [`Plan`] is right for its layouts ([`check()`]), by other means than the
//! planner's.
//!
//! The checker does not intersect boxes. It replays the plan segment by segment: each byte
//! range is looked up by offset among the pieces of its destination region and of its
//! source region; both must be pieces of the same tensor, element-aligned, and the source
//! element under every destination element must be the same element of the tensor (the
//! local index of a piece is mapped to the global flat index by division, over stretches
//! where that mapping advances by one). The destination elements written are collected as
//! intervals of each piece's local order, then swept: a hole is a [`CheckError::Gap`], a
//! second write a [`CheckError::Overlap`]. Errors name the tensor and its elements.
//!
//! ```
//! use std::sync::Arc;
//! use xfer::weights::{CheckError, Holding, Layout, Plan, TensorSpec, check};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let t: Arc<[TensorSpec]> = Arc::from(vec![TensorSpec::new("w", vec![8], 4)]);
//! let src = vec![Layout::pack(t.clone(), "s", [(0, Holding::whole(&[8]))])?];
//! let dst = vec![Layout::pack(t, "d", [(0, Holding::whole(&[8]))])?];
//! let mut plan = Plan::new(&src, &dst)?;
//! assert_eq!(check(&src, &dst, &plan)?.bytes, 32);
//! plan.pairs_mut()[0].runs[0].len -= 4; // forget the last element
//! let e = check(&src, &dst, &plan).unwrap_err();
//! assert!(matches!(e, CheckError::Gap { ref tensor, count: 1, .. } if tensor == "w"));
//! assert_eq!(e.to_string(), "tensor w: destination 0 does not get elements [7..8] (1 elements)");
//! # Ok(())
//! # }
//! ```

use super::geometry::flat_boxes;
use super::inputs::Catalog;
use super::layout::{ElementBox, Holding, Layout, MAX_DIMS, Piece, TensorSpec};
use super::plan::{Plan, PlanError, Side};
use std::rc::Rc;

/// What a successful [`check()`] verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckReport {
    /// Destination bytes written, each exactly once.
    pub bytes: u64,
    /// Segments replayed.
    pub segments: u64,
    /// Destination pieces covered.
    pub pieces: u64,
}

/// Checks that `plan` writes every byte of every destination piece exactly once, each
/// from a source byte of the same element of the same tensor, and nothing else. Returns
/// the first fault found (destinations in rank order).
pub fn check(sources: &[Layout], dests: &[Layout], plan: &Plan) -> Result<CheckReport, CheckError> {
    let cat = Catalog::new(sources, dests)?;
    for (side, planned, given) in [
        (Side::Source, plan.sources(), sources.len()),
        (Side::Destination, plan.destinations(), dests.len()),
    ] {
        if planned as usize != given {
            return Err(CheckError::RankCount {
                side,
                plan: planned,
                layouts: given,
            });
        }
    }
    let src_index: Vec<RankIndex> = sources.iter().map(RankIndex::new).collect();
    let mut by_dst: Vec<Vec<usize>> = vec![Vec::new(); dests.len()];
    for (i, p) in plan.pairs().iter().enumerate() {
        let Some(v) = by_dst.get_mut(p.dst.rank as usize) else {
            return Err(CheckError::NoSuchRank {
                side: Side::Destination,
                rank: p.dst.rank,
            });
        };
        v.push(i);
    }
    let mut report = CheckReport {
        bytes: 0,
        segments: 0,
        pieces: 0,
    };
    for (d, pairs) in by_dst.iter().enumerate() {
        let d = d as u32;
        let layout = &dests[d as usize];
        let dst_index = RankIndex::new(layout);
        // Replay at most one byte more than the destination holds: past that, some byte
        // was written twice (a crafted run may have 2^64 rows), and the sweep says which.
        let held =
            (dst_index.regions.iter().flatten()).fold(0u64, |a, e| a.saturating_add(e.1 - e.0));
        let mut written = 0u64;
        let mut cover: Vec<Vec<(u64, u64)>> = vec![Vec::new(); layout.pieces.len()];
        'replay: for &pi in pairs {
            let pair = &plan.pairs()[pi];
            let s = pair.src.rank;
            let src_layout = sources.get(s as usize).ok_or(CheckError::NoSuchRank {
                side: Side::Source,
                rank: s,
            })?;
            let src_region =
                src_index[s as usize]
                    .region(pair.src.region)
                    .ok_or(CheckError::NoSuchRegion {
                        side: Side::Source,
                        rank: s,
                        region: pair.src.region,
                    })?;
            let dst_region = dst_index
                .region(pair.dst.region)
                .ok_or(CheckError::NoSuchRegion {
                    side: Side::Destination,
                    rank: d,
                    region: pair.dst.region,
                })?;
            let mut walk = Walk {
                cat: &cat,
                src: End::new(
                    src_layout,
                    &cat.src_ids[s as usize],
                    src_region,
                    Side::Source,
                    s,
                    pair.src.region,
                ),
                dst: End::new(
                    layout,
                    &cat.dst_ids[d as usize],
                    dst_region,
                    Side::Destination,
                    d,
                    pair.dst.region,
                ),
                cover: &mut cover,
            };
            // Row i of a run: len bytes at src_offset + i * src_stride, dst_offset + i *
            // dst_stride (empty runs write nothing, however many rows they claim).
            for r in pair.runs.iter().filter(|r| r.len > 0) {
                for i in 0..r.count {
                    let so = r.src_offset.wrapping_add(i.wrapping_mul(r.src_stride));
                    let dof = r.dst_offset.wrapping_add(i.wrapping_mul(r.dst_stride));
                    walk.segment(so, dof, r.len)?;
                    report.segments += 1;
                    written = written.saturating_add(r.len);
                    if written > held {
                        break 'replay;
                    }
                }
            }
        }
        for (pi, iv) in cover.iter_mut().enumerate() {
            let piece = &layout.pieces[pi];
            let spec = &cat.tensors[cat.dst_ids[d as usize][piece.tensor as usize] as usize];
            let n = piece_elements(piece, spec);
            if n == 0 {
                continue;
            }
            iv.sort_unstable();
            // A replay stopped early leaves holes that are not the plan's: name overlaps only.
            let stopped = written > held;
            let mut at = 0u64;
            for &(a, b) in iv.iter() {
                if a > at && !stopped {
                    return Err(CheckError::Gap {
                        tensor: spec.name.clone(),
                        dst_rank: d,
                        elements: local_box(piece, spec, at, a),
                        count: a - at,
                    });
                }
                if a < at {
                    let end = b.min(at);
                    return Err(CheckError::Overlap {
                        tensor: spec.name.clone(),
                        dst_rank: d,
                        elements: local_box(piece, spec, a, end),
                        count: end - a,
                    });
                }
                at = b;
            }
            if at < n && !stopped {
                return Err(CheckError::Gap {
                    tensor: spec.name.clone(),
                    dst_rank: d,
                    elements: local_box(piece, spec, at, n),
                    count: n - at,
                });
            }
            report.bytes = report.bytes.saturating_add(n * u64::from(spec.elem_size));
            report.pieces += 1;
        }
        if written > held {
            return Err(CheckError::Oversubscribed {
                dst_rank: d,
                written,
                held,
            });
        }
    }
    Ok(report)
}

/// A rank's pieces by region, sorted by offset: `(start, end, piece)` byte ranges.
struct RankIndex {
    regions: Vec<Vec<(u64, u64, usize)>>,
}

impl RankIndex {
    fn new(l: &Layout) -> RankIndex {
        let mut regions = vec![Vec::new(); l.regions.len()];
        for (i, p) in l.pieces.iter().enumerate() {
            let esize = u64::from(l.tensors[p.tensor as usize].elem_size);
            let n = piece_elements(p, &l.tensors[p.tensor as usize]);
            if n > 0 {
                regions[p.region as usize].push((p.offset, p.offset + n * esize, i));
            }
        }
        for r in &mut regions {
            r.sort_unstable();
        }
        RankIndex { regions }
    }

    fn region(&self, r: u32) -> Option<&[(u64, u64, usize)]> {
        self.regions.get(r as usize).map(Vec::as_slice)
    }
}

/// One side of a segment being walked: the rank's pieces in the region, and the last one
/// found.
struct End<'a> {
    layout: &'a Layout,
    ids: &'a Rc<Vec<u32>>,
    index: &'a [(u64, u64, usize)],
    side: Side,
    rank: u32,
    region: u32,
    last: usize,
}

impl<'a> End<'a> {
    fn new(
        layout: &'a Layout,
        ids: &'a Rc<Vec<u32>>,
        index: &'a [(u64, u64, usize)],
        side: Side,
        rank: u32,
        region: u32,
    ) -> End<'a> {
        End {
            layout,
            ids,
            index,
            side,
            rank,
            region,
            last: 0,
        }
    }

    /// The piece whose bytes contain `offset`: (start, end, piece index).
    fn find(&mut self, offset: u64) -> Result<(u64, u64, usize), CheckError> {
        // Consecutive segments mostly stay in a piece or go on to the next one.
        for i in [self.last, self.last + 1] {
            if let Some(&e) = self.index.get(i)
                && e.0 <= offset
                && offset < e.1
            {
                self.last = i;
                return Ok(e);
            }
        }
        let i = self.index.partition_point(|e| e.0 <= offset);
        match i.checked_sub(1).map(|i| (i, self.index[i])) {
            Some((i, e)) if offset < e.1 => {
                self.last = i;
                Ok(e)
            }
            _ => Err(CheckError::OutsidePieces {
                side: self.side,
                rank: self.rank,
                region: self.region,
                offset,
            }),
        }
    }
}

/// Replays segments between one source region and one destination region.
struct Walk<'a, 'c> {
    cat: &'a Catalog<'a>,
    src: End<'a>,
    dst: End<'a>,
    cover: &'c mut Vec<Vec<(u64, u64)>>,
}

impl Walk<'_, '_> {
    fn segment(&mut self, mut so: u64, mut dof: u64, mut len: u64) -> Result<(), CheckError> {
        while len > 0 {
            let (ds, de, dpi) = self.dst.find(dof)?;
            let (ss, se, spi) = self.src.find(so)?;
            let dpiece = &self.dst.layout.pieces[dpi];
            let spiece = &self.src.layout.pieces[spi];
            let dt = self.dst.ids[dpiece.tensor as usize];
            let st = self.src.ids[spiece.tensor as usize];
            let spec = self.cat.tensors[dt as usize];
            let esize = u64::from(spec.elem_size);
            let (dl, sl) = (dof - ds, so - ss);
            let n = len.min(de - dof).min(se - so);
            if dt != st {
                let sspec = self.cat.tensors[st as usize];
                let sesize = u64::from(sspec.elem_size);
                let read = local_box(spiece, sspec, sl / sesize, sl / sesize + 1);
                return Err(CheckError::Mismatch {
                    tensor: spec.name.clone(),
                    dst_rank: self.dst.rank,
                    elements: local_box(dpiece, spec, dl / esize, dl / esize + 1),
                    src_rank: self.src.rank,
                    src_tensor: sspec.name.clone(),
                    read,
                });
            }
            if !dl.is_multiple_of(esize) || !sl.is_multiple_of(esize) || !n.is_multiple_of(esize) {
                let (side, rank, offset) = if !dl.is_multiple_of(esize) || sl.is_multiple_of(esize)
                {
                    (Side::Destination, self.dst.rank, dof)
                } else {
                    (Side::Source, self.src.rank, so)
                };
                return Err(CheckError::Misaligned {
                    tensor: spec.name.clone(),
                    side,
                    rank,
                    offset,
                });
            }
            let (mut i, mut j, mut m) = (dl / esize, sl / esize, n / esize);
            let first = i;
            while m > 0 {
                let (gd, rd) = global(dpiece, spec, i);
                let (gs, rs) = global(spiece, spec, j);
                if gd != gs {
                    return Err(CheckError::Mismatch {
                        tensor: spec.name.clone(),
                        dst_rank: self.dst.rank,
                        elements: local_box(dpiece, spec, i, i + 1),
                        src_rank: self.src.rank,
                        src_tensor: spec.name.clone(),
                        read: local_box(spiece, spec, j, j + 1),
                    });
                }
                let step = m.min(rd).min(rs);
                i += step;
                j += step;
                m -= step;
            }
            let c = &mut self.cover[dpi];
            match c.last_mut() {
                Some(last) if last.1 == first => last.1 = i,
                _ => c.push((first, i)),
            }
            so += n;
            dof += n;
            len -= n;
        }
        Ok(())
    }
}

/// Elements a piece of a valid layout holds.
fn piece_elements(p: &Piece, spec: &TensorSpec) -> u64 {
    p.holding.elements(spec.shape.len()).unwrap_or(0)
}

/// The global flat index of element `i` of a piece's storage order, and how many elements
/// from there on follow one another in the tensor's flat order too.
fn global(p: &Piece, spec: &TensorSpec, i: u64) -> (u64, u64) {
    match &p.holding {
        Holding::Flat(r) => (r.start + i, r.end - r.start - i),
        Holding::Box(b) => {
            let nd = b.len();
            if nd == 0 {
                return (0, 1);
            }
            // Innermost first: the local index's digits, and the global index they make.
            let (mut rest, mut g, mut gstride) = (i, 0u64, 1u64);
            for k in (0..nd).rev() {
                let e = b[k].end - b[k].start;
                let digit = rest % e;
                rest /= e;
                g += (b[k].start + digit) * gstride;
                gstride *= spec.shape[k];
            }
            (g, stretch(b, spec, i))
        }
    }
}

/// For a box piece: elements from local index `i` to the end of its stretch, the largest
/// aligned block of local order in which the global index advances by one.
fn stretch(b: &[std::ops::Range<u64>], spec: &TensorSpec, i: u64) -> u64 {
    let nd = b.len();
    let mut p = nd - 1;
    while p > 0 && b[p].end - b[p].start == spec.shape[p] {
        p -= 1;
    }
    let c: u64 = b[p..].iter().map(|r| r.end - r.start).product();
    c - i % c
}

/// The first box of elements `a..b` of a piece's storage order, in global coordinates.
fn local_box(p: &Piece, spec: &TensorSpec, a: u64, b: u64) -> ElementBox {
    let nd = spec.shape.len().max(1);
    let mut ext = [1u64; MAX_DIMS];
    let mut origin = [0u64; MAX_DIMS];
    let (a, b) = match &p.holding {
        Holding::Flat(r) => {
            ext[..spec.shape.len()].copy_from_slice(&spec.shape);
            (r.start + a, r.start + b)
        }
        Holding::Box(bx) => {
            for (k, r) in bx.iter().enumerate() {
                ext[k] = r.end - r.start;
                origin[k] = r.start;
            }
            (a, b)
        }
    };
    let mut first = None;
    flat_boxes(&ext[..nd], &origin, a, b, &mut |x| {
        if first.is_none() {
            first = Some(x.to_public(spec.shape.len()));
        }
    });
    first.unwrap_or(ElementBox(Vec::new()))
}

/// What is wrong with a plan (or with the layouts it is checked against).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckError {
    /// The layouts themselves are invalid or inconsistent.
    #[error(transparent)]
    Inputs(#[from] PlanError),
    /// The plan was made for another number of ranks.
    #[error("the plan has {plan} {side}s, the layouts {layouts}")]
    RankCount {
        /// Which list.
        side: Side,
        /// Ranks in the plan.
        plan: u32,
        /// Layouts given.
        layouts: usize,
    },
    /// A region pair names a rank that has no layout.
    #[error("the plan names {side} {rank}, which has no layout")]
    NoSuchRank {
        /// Which list.
        side: Side,
        /// The rank.
        rank: u32,
    },
    /// A region pair names a region the rank's layout lacks.
    #[error("the plan names region {region} of {side} {rank}, which has no such region")]
    NoSuchRegion {
        /// Which list.
        side: Side,
        /// The rank.
        rank: u32,
        /// The region index.
        region: u32,
    },
    /// The plan writes more bytes into a destination than its pieces hold (reported when
    /// the bytes written twice could not be named).
    #[error(
        "the plan writes at least {written} bytes into destination {dst_rank}, whose pieces \
         hold {held}"
    )]
    Oversubscribed {
        /// The destination.
        dst_rank: u32,
        /// Bytes replayed before the checker stopped.
        written: u64,
        /// Bytes its pieces hold.
        held: u64,
    },
    /// A segment touches a byte that no piece holds.
    #[error("byte {offset} of region {region} of {side} {rank} belongs to no piece")]
    OutsidePieces {
        /// Which list.
        side: Side,
        /// The rank.
        rank: u32,
        /// The region index.
        region: u32,
        /// The byte.
        offset: u64,
    },
    /// A segment starts or ends inside an element.
    #[error("tensor {tensor}: a segment cuts an element at byte {offset} of {side} {rank}")]
    Misaligned {
        /// The tensor.
        tensor: String,
        /// Which list.
        side: Side,
        /// The rank.
        rank: u32,
        /// The byte.
        offset: u64,
    },
    /// A destination element would get another element (or another tensor's).
    #[error(
        "tensor {tensor}: destination {dst_rank}'s elements {elements} would get {src_tensor} \
         elements {read} of source {src_rank}"
    )]
    Mismatch {
        /// The destination's tensor.
        tensor: String,
        /// The destination.
        dst_rank: u32,
        /// The destination element.
        elements: ElementBox,
        /// The source.
        src_rank: u32,
        /// The tensor read.
        src_tensor: String,
        /// The element read.
        read: ElementBox,
    },
    /// Destination elements that no segment writes.
    #[error(
        "tensor {tensor}: destination {dst_rank} does not get elements {elements} ({count} elements)"
    )]
    Gap {
        /// The tensor.
        tensor: String,
        /// The destination.
        dst_rank: u32,
        /// The first box of the missing elements.
        elements: ElementBox,
        /// How many are missing in a row (in the piece's storage order).
        count: u64,
    },
    /// Destination elements written more than once.
    #[error(
        "tensor {tensor}: destination {dst_rank} gets elements {elements} twice ({count} elements)"
    )]
    Overlap {
        /// The tensor.
        tensor: String,
        /// The destination.
        dst_rank: u32,
        /// The first box of the elements written twice.
        elements: ElementBox,
        /// How many in a row (in the piece's storage order).
        count: u64,
    },
}
