//! Boxes of a tensor's index space and where their elements are stored (a piece as boxes
//! and their storage): the arithmetic the layouts' validation and the planner share (the
//! checker has its own, on purpose).
//!
//! A box is kept in fixed arrays of [`MAX_DIMS`] so that the planner allocates nothing per
//! box; dimensions past a tensor's own are `0..1`, so that volumes, comparisons and
//! intersections need no special case. A scalar (shape `[]`) is handled as shape `[1]`.

use super::layout::{ElementBox, Holding, MAX_DIMS, Piece, TensorSpec};
use std::ops::Range;

/// Per-dimension coordinates.
pub(crate) type Dims = [u64; MAX_DIMS];

/// A box `lo..hi` per dimension of an `nd`-dimensional index space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Bx {
    pub lo: Dims,
    pub hi: Dims,
}

impl Bx {
    /// The box `0..ext[i]` per dimension.
    #[cfg(test)]
    pub fn full(ext: &[u64]) -> Bx {
        let mut b = Bx::unit();
        for (i, &e) in ext.iter().enumerate() {
            b.lo[i] = 0;
            b.hi[i] = e;
        }
        b
    }

    /// Every dimension `0..1`.
    pub fn unit() -> Bx {
        Bx {
            lo: [0; MAX_DIMS],
            hi: [1; MAX_DIMS],
        }
    }

    /// The number of elements (saturating: boxes inside a validated tensor never saturate).
    pub fn volume(&self, nd: usize) -> u64 {
        let mut v: u64 = 1;
        for i in 0..nd {
            v = v.saturating_mul(self.hi[i].saturating_sub(self.lo[i]));
        }
        v
    }

    /// `hi - lo` per dimension.
    pub fn extents(&self, nd: usize) -> Dims {
        let mut e = [1; MAX_DIMS];
        for (i, e) in e.iter_mut().enumerate().take(nd) {
            *e = self.hi[i] - self.lo[i];
        }
        e
    }

    /// The common part, if any element is in both.
    pub fn intersect(&self, o: &Bx, nd: usize) -> Option<Bx> {
        let mut r = Bx::unit();
        for i in 0..nd {
            r.lo[i] = self.lo[i].max(o.lo[i]);
            r.hi[i] = self.hi[i].min(o.hi[i]);
            if r.lo[i] >= r.hi[i] {
                return None;
            }
        }
        Some(r)
    }

    /// Whether some element is in both.
    pub fn overlaps(&self, o: &Bx, nd: usize) -> bool {
        (0..nd).all(|i| self.lo[i].max(o.lo[i]) < self.hi[i].min(o.hi[i]))
    }

    /// Pushes `self \ o` as disjoint boxes (at most `2 * nd`).
    pub fn subtract(&self, o: &Bx, nd: usize, out: &mut Vec<Bx>) {
        if !self.overlaps(o, nd) {
            out.push(*self);
            return;
        }
        let mut rest = *self;
        for i in 0..nd {
            if rest.lo[i] < o.lo[i] {
                let mut below = rest;
                below.hi[i] = o.lo[i];
                out.push(below);
                rest.lo[i] = o.lo[i];
            }
            if rest.hi[i] > o.hi[i] {
                let mut above = rest;
                above.lo[i] = o.hi[i];
                out.push(above);
                rest.hi[i] = o.hi[i];
            }
        }
    }

    /// The public form, for errors.
    pub fn to_public(self, nd: usize) -> ElementBox {
        ElementBox((0..nd).map(|i| self.lo[i]..self.hi[i]).collect())
    }
}

/// Calls `emit` with the boxes (at most `2 * nd - 1`, in row-major order) whose union is the
/// elements `a..b` of the row-major order of a box of extents `ext` whose first element is
/// at `origin`.
pub(crate) fn flat_boxes(ext: &[u64], origin: &Dims, a: u64, b: u64, emit: &mut impl FnMut(&Bx)) {
    let nd = ext.len();
    if a >= b || nd == 0 {
        return;
    }
    let mut cur = Bx::unit();
    // inner[d]: the number of elements of one index of dimension d.
    let mut inner = [1u64; MAX_DIMS];
    for d in (0..nd.saturating_sub(1)).rev() {
        inner[d] = inner[d + 1].saturating_mul(ext[d + 1]);
    }
    flat_rec(ext, &inner, origin, 0, a, b, &mut cur, emit);
}

#[allow(clippy::too_many_arguments)]
fn flat_rec(
    ext: &[u64],
    inner: &Dims,
    origin: &Dims,
    d: usize,
    a: u64,
    b: u64,
    cur: &mut Bx,
    emit: &mut impl FnMut(&Bx),
) {
    let nd = ext.len();
    if a >= b {
        return;
    }
    if d + 1 == nd {
        cur.lo[d] = origin[d] + a;
        cur.hi[d] = origin[d] + b;
        emit(cur);
        return;
    }
    let n = inner[d];
    if n == 0 {
        return;
    }
    let (r0, o0) = (a / n, a % n);
    let (r1, o1) = (b / n, b % n);
    let row = |cur: &mut Bx, r: u64| {
        cur.lo[d] = origin[d] + r;
        cur.hi[d] = origin[d] + r + 1;
    };
    if r0 == r1 {
        row(cur, r0);
        flat_rec(ext, inner, origin, d + 1, o0, o1, cur, emit);
        return;
    }
    let mut start = r0;
    if o0 != 0 {
        row(cur, r0);
        flat_rec(ext, inner, origin, d + 1, o0, n, cur, emit);
        start = r0 + 1;
    }
    if r1 > start {
        cur.lo[d] = origin[d] + start;
        cur.hi[d] = origin[d] + r1;
        for j in d + 1..nd {
            cur.lo[j] = origin[j];
            cur.hi[j] = origin[j] + ext[j];
        }
        emit(cur);
    }
    if o1 != 0 {
        row(cur, r1);
        flat_rec(ext, inner, origin, d + 1, 0, o1, cur, emit);
    }
}

/// Row-major strides in bytes of a box of extents `ext` with elements of `esize` bytes
/// (wrapping: only called on validated sizes).
pub(crate) fn row_major(ext: &[u64], esize: u64) -> Dims {
    let mut s = [0u64; MAX_DIMS];
    let mut acc = esize;
    for d in (0..ext.len()).rev() {
        s[d] = acc;
        acc = acc.wrapping_mul(ext[d]);
    }
    s
}

/// Where an element of a box is stored: byte `origin + sum(x[i] * strides[i])` of region
/// `region` of rank `rank`, in wrapping arithmetic (`origin` may "underflow"; the offsets of
/// the box's own elements do not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Store {
    pub rank: u32,
    pub region: u32,
    pub origin: u64,
    pub strides: Dims,
}

impl Store {
    /// The byte offset of the element at global index `x`.
    pub fn offset(&self, x: &Dims, nd: usize) -> u64 {
        let mut o = self.origin;
        for (i, x) in x.iter().enumerate().take(nd) {
            o = o.wrapping_add(x.wrapping_mul(self.strides[i]));
        }
        o
    }
}

/// The number of dimensions the planner works in (a scalar is `[1]`) and the extents.
pub(crate) fn dims_of(spec: &TensorSpec) -> (usize, Dims) {
    let mut ext = [1u64; MAX_DIMS];
    ext[..spec.shape.len()].copy_from_slice(&spec.shape);
    (spec.shape.len().max(1), ext)
}

/// Calls `emit` with the boxes a piece of a validated layout holds and where each is stored
/// (a box piece is one box; a flat range is at most `2 * nd - 1` boxes, in flat order).
pub(crate) fn stored_boxes(
    spec: &TensorSpec,
    p: &Piece,
    rank: u32,
    emit: &mut impl FnMut(Bx, Store),
) {
    let (nd, ext) = dims_of(spec);
    let esize = u64::from(spec.elem_size);
    match &p.holding {
        Holding::Box(r) => {
            let mut b = Bx::unit();
            for (i, r) in r.iter().enumerate() {
                b.lo[i] = r.start;
                b.hi[i] = r.end;
            }
            if b.volume(nd) == 0 {
                return;
            }
            let strides = row_major(&b.extents(nd)[..nd], esize);
            let mut s = Store {
                rank,
                region: p.region,
                origin: 0,
                strides,
            };
            s.origin = p.offset.wrapping_sub(s.offset(&b.lo, nd));
            emit(b, s);
        }
        Holding::Flat(r) => {
            let s = Store {
                rank,
                region: p.region,
                origin: p.offset.wrapping_sub(r.start.wrapping_mul(esize)),
                strides: row_major(&ext[..nd], esize),
            };
            flat_boxes(&ext[..nd], &[0; MAX_DIMS], r.start, r.end, &mut |b| {
                emit(*b, s)
            });
        }
    }
}

/// The flat range of a piece of a validated layout whose elements follow one another in the
/// tensor's flat order (a flat range; a box whole in every dimension after its first longer
/// than one), else `None`.
pub(crate) fn flat_span(spec: &TensorSpec, p: &Piece) -> Option<Range<u64>> {
    match &p.holding {
        Holding::Flat(r) => Some(r.clone()),
        Holding::Box(b) => {
            let first = b
                .iter()
                .position(|r| r.end - r.start != 1)
                .unwrap_or(b.len());
            let whole = |(r, &e): (&Range<u64>, &u64)| r.start == 0 && r.end == e;
            if !b.iter().zip(&spec.shape).skip(first + 1).all(whole) {
                return None;
            }
            let (mut start, mut n) = (0u64, 1u64);
            for (r, &e) in b.iter().zip(&spec.shape) {
                start = start * e + r.start;
                n *= r.end - r.start;
            }
            Some(start..start + n)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boxes(ext: &[u64], a: u64, b: u64) -> Vec<Vec<(u64, u64)>> {
        let mut v = Vec::new();
        flat_boxes(ext, &[0; MAX_DIMS], a, b, &mut |bx| {
            v.push((0..ext.len()).map(|i| (bx.lo[i], bx.hi[i])).collect())
        });
        v
    }

    #[test]
    fn flat_range_cut_mid_row_is_head_rows_tail() {
        assert_eq!(
            boxes(&[4, 5], 3, 17),
            vec![
                vec![(0, 1), (3, 5)],
                vec![(1, 3), (0, 5)],
                vec![(3, 4), (0, 2)]
            ]
        );
        assert_eq!(boxes(&[4, 5], 6, 8), vec![vec![(1, 2), (1, 3)]]);
        assert_eq!(boxes(&[4, 5], 0, 20), vec![vec![(0, 4), (0, 5)]]);
        assert_eq!(boxes(&[7], 2, 5), vec![vec![(2, 5)]]);
    }

    #[test]
    fn flat_boxes_cover_the_range_in_order_for_every_cut() {
        let ext = [3, 2, 4];
        for a in 0..24 {
            for b in a..=24 {
                let mut flat = Vec::new();
                for bx in boxes(&ext, a, b) {
                    for i in bx[0].0..bx[0].1 {
                        for j in bx[1].0..bx[1].1 {
                            for k in bx[2].0..bx[2].1 {
                                flat.push(i * 8 + j * 4 + k);
                            }
                        }
                    }
                }
                assert_eq!(flat, (a..b).collect::<Vec<_>>(), "{a}..{b}");
            }
        }
    }

    #[test]
    fn subtraction_leaves_disjoint_boxes_of_the_right_volume() {
        let a = Bx::full(&[6, 6]);
        let mut o = Bx::unit();
        o.lo[..2].copy_from_slice(&[2, 1]);
        o.hi[..2].copy_from_slice(&[4, 9]);
        let mut out = Vec::new();
        a.subtract(&o, 2, &mut out);
        let v: u64 = out.iter().map(|b| b.volume(2)).sum();
        assert_eq!(v, 36 - 2 * 5);
        for (i, x) in out.iter().enumerate() {
            assert!(!x.overlaps(&o, 2));
            for y in &out[i + 1..] {
                assert!(!x.overlaps(y, 2));
            }
        }
    }
}
