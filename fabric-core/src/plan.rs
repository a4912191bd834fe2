//! Transfer planning: pure functions from a list of segments to the writes (or reads) to
//! post.
//!
//! Planning coalesces neighbouring segments that are adjacent on both sides, splits what
//! exceeds the transport's largest message, and shards the writes over rails by bytes. For
//! a transport with strided writes ([`plan_with_rows`]) it also turns runs of equally long
//! segments at constant strides into one write of [`Rows`]. A
//! READ plans the same way ([`plan_directed`]): its operations are [`PlannedWrite`]s whose
//! bytes flow the other way, and the ranges that must not overlap are the local ones.

use crate::Invalid;
use crate::error::{Error, Result};
use crate::in_place;
use crate::memory::check_range;
use crate::types::{LocalKey, LocalSlice, RemoteRegion, RemoteSlice, Rows};

/// Which way a transfer's bytes flow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Direction {
    /// WRITE: from the local regions into the peer's (the default).
    #[default]
    Write,
    /// READ: from the peer's regions into the local ones
    /// ([`Transport::post_read`](crate::Transport::post_read)); the owner does nothing.
    Read,
}

impl Direction {
    /// `"write"` or `"read"`, as the CLI and its JSON name them.
    pub fn name(self) -> &'static str {
        match self {
            Direction::Write => "write",
            Direction::Read => "read",
        }
    }
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One piece of a transfer: `len` bytes between a local region and a remote one. The
/// fields name a WRITE's flow; in a READ (see [`Direction`]) the bytes go from `dst` (the
/// peer's) into `src` (ours).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Local registered region.
    pub src: LocalKey,
    /// Offset in the local region.
    pub src_offset: u64,
    /// The peer's region.
    pub dst: RemoteRegion,
    /// Offset in the peer's region.
    pub dst_offset: u64,
    /// Bytes to move.
    pub len: u64,
}

/// Rows of equal length at constant strides, between one local region and one remote
/// region: row `i` is `len` bytes at `src_offset + i * src_stride` locally and
/// `dst_offset + i * dst_stride` remotely (the fields name a WRITE's flow, as
/// [`Segment`]'s do). A tensor-parallel piece of a weight matrix is one run where a segment
/// list would need a segment per row. `count` 1 is a plain segment (its strides are not
/// looked at) and `count` 0 holds nothing; from two rows on, strides are no shorter than
/// a row (see [`Rows::check`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StridedRun {
    /// Offset of the first row in the local region.
    pub src_offset: u64,
    /// Offset of the first row in the remote region.
    pub dst_offset: u64,
    /// Bytes per row.
    pub len: u64,
    /// Rows.
    pub count: u64,
    /// From one row's local start to the next's.
    pub src_stride: u64,
    /// From one row's remote start to the next's.
    pub dst_stride: u64,
}

impl StridedRun {
    /// A run of one row: the segment `(src_offset, dst_offset, len)`.
    pub fn contiguous(src_offset: u64, dst_offset: u64, len: u64) -> StridedRun {
        StridedRun {
            src_offset,
            dst_offset,
            len,
            count: 1,
            src_stride: 0,
            dst_stride: 0,
        }
    }

    /// Whether it moves no byte (no row, or rows of no length).
    pub fn is_empty(&self) -> bool {
        self.count == 0 || self.len == 0
    }

    /// Checks its shape and returns the bytes it spans on each side, first row's start to
    /// last row's end, and the bytes it moves: `(src_span, dst_span, bytes)` (all zero for
    /// an empty run).
    pub fn spans(&self) -> Result<(u64, u64, u64)> {
        match self.count {
            _ if self.is_empty() => Ok((0, 0, 0)),
            1 => Ok((self.len, self.len, self.len)),
            _ => self.rows().check(self.len),
        }
    }

    /// Row `i`'s offsets `(local, remote)` (for rows below `count` of a run whose ranges
    /// were checked to fit in 64 bits).
    fn row(&self, i: u64) -> (u64, u64) {
        (
            self.src_offset + i * self.src_stride,
            self.dst_offset + i * self.dst_stride,
        )
    }

    fn rows(&self) -> Rows {
        Rows {
            count: self.count,
            src_stride: self.src_stride,
            dst_stride: self.dst_stride,
        }
    }
}

/// One write of a plan (or one read: then the bytes go from `dst` into `src`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedWrite {
    /// Source bytes (a read's destination); a strided write's first row.
    pub src: LocalSlice,
    /// Destination bytes (a read's source); a strided write's first row.
    pub dst: RemoteSlice,
    /// A strided write's rows ([`Transport::post_write_rows`](crate::Transport::post_write_rows));
    /// `None` for a plain write.
    pub rows: Option<Rows>,
}

impl PlannedWrite {
    /// Bytes it moves: every row's.
    pub fn bytes(&self) -> u64 {
        match self.rows {
            Some(r) => self.src.len.saturating_mul(r.count),
            None => self.src.len,
        }
    }
}

/// The writes that carry one transfer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferPlan {
    /// Writes in posting order.
    pub writes: Vec<PlannedWrite>,
    /// Total bytes.
    pub bytes: u64,
}

/// Plans `segments` for a transport whose largest write is `max_msg_size` bytes.
///
/// - zero-length segments are dropped;
/// - a segment whose destination range leaves its remote region is an error (nothing is
///   planned), as is one whose destination overlaps another segment's;
/// - consecutive segments adjacent on both sides (same regions) are merged;
/// - writes longer than `max_msg_size` are split.
pub fn plan_transfer(segments: &[Segment], max_msg_size: u64) -> Result<TransferPlan> {
    if max_msg_size == 0 {
        return Err(Invalid::ZeroMessageSize.into());
    }
    check_destinations(segments)?;
    Ok(build_plan(segments, max_msg_size, false))
}

/// Plans `segments` for a transfer in `direction`: [`plan_transfer`] for a WRITE; for a
/// READ the same coalescing and splitting, with the checks turned round: the remote ranges
/// (the read's sources) must lie inside their regions, and the local ranges (its
/// destinations) must not overlap each other.
pub fn plan_directed(
    segments: &[Segment],
    max_msg_size: u64,
    direction: Direction,
) -> Result<TransferPlan> {
    plan_with_rows(segments, max_msg_size, direction, false)
}

/// [`plan_directed`], and when `rows` is set (a transport with
/// [`strided_writes`](crate::TransportLimits::strided_writes)) and the transfer is a WRITE,
/// consecutive segments (after coalescing) of one length, in the same regions, whose
/// offsets advance by constant strides no shorter than that length on both sides, become
/// one strided write of at most `max_msg_size` bytes: a tensor-parallel piece of a weight
/// matrix, one segment per row, is then a few operations instead of thousands.
pub fn plan_with_rows(
    segments: &[Segment],
    max_msg_size: u64,
    direction: Direction,
    rows: bool,
) -> Result<TransferPlan> {
    match direction {
        Direction::Write if rows => {
            if max_msg_size == 0 {
                return Err(Invalid::ZeroMessageSize.into());
            }
            check_destinations(segments)?;
            Ok(build_plan(segments, max_msg_size, true))
        }
        Direction::Write => plan_transfer(segments, max_msg_size),
        Direction::Read => {
            if max_msg_size == 0 {
                return Err(Invalid::ZeroMessageSize.into());
            }
            check_read_ranges(segments)?;
            Ok(build_plan(segments, max_msg_size, false))
        }
    }
}

/// Plans `segments` and then `runs` (whose rows lie in local region `src` and remote region
/// `dst`) as [`plan_with_rows`] plans their rows as segments, with the same checks and
/// errors, without listing the rows where it need not: for a WRITE on a transport with
/// strided writes (`rows`), a run whose rows fit in a write is checked by its first and
/// last row and planned as strided writes of at most `max_msg_size` bytes, so that its cost
/// does not grow with its rows. Runs are checked first ([`StridedRun::spans`]); where their
/// destinations' spans (and the segments) overlap, or a row is longer than a write, the
/// rows are listed and planned as segments, numbered after `segments` in errors.
pub fn plan_runs(
    segments: &[Segment],
    runs: &[StridedRun],
    src: LocalKey,
    dst: RemoteRegion,
    max_msg_size: u64,
    direction: Direction,
    rows: bool,
) -> Result<TransferPlan> {
    if max_msg_size == 0 {
        return Err(Invalid::ZeroMessageSize.into());
    }
    let mut extents = Vec::with_capacity(runs.len());
    let mut whole = rows && direction == Direction::Write;
    for (i, r) in runs.iter().enumerate() {
        let (src_span, dst_span, _) = r.spans()?;
        if r.is_empty() {
            continue;
        }
        whole &= r.count == 1 || r.len <= max_msg_size;
        r.src_offset
            .checked_add(src_span)
            .ok_or_else(|| Invalid::Overflow {
                what: format!("run {i}: local range"),
            })?;
        // The remote side's range: a WRITE's destination, a READ's source.
        check_range(r.dst_offset, dst_span, dst.len).map_err(|_| {
            Error::from(Invalid::RemoteOutOfRange {
                segment: segments.len() + i,
                role: match direction {
                    Direction::Write => "destination",
                    Direction::Read => "source",
                },
                offset: r.dst_offset,
                len: dst_span,
                region_len: dst.len,
            })
        })?;
        extents.push(Segment {
            src,
            src_offset: r.src_offset,
            dst,
            dst_offset: r.dst_offset,
            len: dst_span,
        });
    }
    if whole {
        let mut all = Vec::with_capacity(segments.len() + extents.len());
        all.extend_from_slice(segments);
        all.extend_from_slice(&extents);
        // Disjoint spans hold disjoint rows; spans that overlap (rows of two runs
        // interleaved, say) are decided row by row below.
        whole = check_bounds(segments, "destination").is_ok() && check_overlaps(&all).is_ok();
    }
    if !whole {
        let mut all = segments.to_vec();
        for r in runs.iter().filter(|r| !r.is_empty()) {
            for i in 0..r.count {
                let (so, d_o) = r.row(i);
                in_place::push(&mut all, || Segment {
                    src,
                    src_offset: so,
                    dst,
                    dst_offset: d_o,
                    len: r.len,
                });
            }
        }
        return plan_with_rows(&all, max_msg_size, direction, rows);
    }
    let mut plan = build_plan(segments, max_msg_size, true);
    for r in runs.iter().filter(|r| !r.is_empty()) {
        if r.count == 1 {
            let s = Segment {
                src,
                src_offset: r.src_offset,
                dst,
                dst_offset: r.dst_offset,
                len: r.len,
            };
            push_writes(&mut plan, &s, max_msg_size);
            continue;
        }
        // As many rows per write as fit in one.
        let per = (max_msg_size / r.len).max(1);
        let mut i = 0;
        while i < r.count {
            let n = (r.count - i).min(per);
            let (so, d_o) = r.row(i);
            in_place::push(&mut plan.writes, || PlannedWrite {
                src: LocalSlice {
                    key: src,
                    offset: so,
                    len: r.len,
                },
                dst: RemoteSlice {
                    region: dst,
                    offset: d_o,
                    len: r.len,
                },
                rows: (n > 1).then_some(Rows {
                    count: n,
                    src_stride: r.src_stride,
                    dst_stride: r.dst_stride,
                }),
            });
            plan.bytes += n * r.len;
            i += n;
        }
    }
    Ok(plan)
}

/// A READ's checks: remote ranges inside their regions, local ranges without overlap.
fn check_read_ranges(segments: &[Segment]) -> Result<()> {
    check_bounds(segments, "source")?;
    // The overlap check works on destinations: hand it the local ranges as such (one
    // "region" per local key, unbounded: the engine checks local bounds itself).
    let local: Vec<Segment> = segments
        .iter()
        .map(|s| Segment {
            src: s.src,
            src_offset: s.dst_offset,
            dst: RemoteRegion {
                addr: 0,
                len: u64::MAX,
                key: crate::types::RemoteKey(s.src.0),
            },
            dst_offset: s.src_offset,
            len: s.len,
        })
        .collect();
    check_overlaps(&local)
}

/// Coalesces and splits checked segments (and groups them into rows, with `rows`).
fn build_plan(segments: &[Segment], max_msg_size: u64, rows: bool) -> TransferPlan {
    // One write per segment unless segments merge or split: reserve for that.
    let mut b = Builder {
        plan: TransferPlan {
            writes: Vec::with_capacity(segments.len()),
            bytes: 0,
        },
        max: max_msg_size,
        rows,
        group: None,
    };
    let mut pending: Option<Segment> = None;
    for s in segments.iter().filter(|s| s.len > 0) {
        if let Some(last) = pending.as_mut()
            && last.src == s.src
            && last.dst == s.dst
            && last.src_offset + last.len == s.src_offset
            && last.dst_offset + last.len == s.dst_offset
        {
            last.len += s.len;
            continue;
        }
        if let Some(done) = pending.replace(*s) {
            // Without rows each segment is its own writes: pushed here, not through the
            // builder (its take and flush per segment made planning 1000 pages about half
            // as costly again: callgrind, 142 against 92 instructions a page).
            if rows {
                b.take(done);
            } else {
                push_writes(&mut b.plan, &done, max_msg_size);
            }
        }
    }
    if let Some(done) = pending {
        b.take(done);
    }
    b.flush();
    b.plan
}

/// Rows being gathered: the first row's segment, how many rows, and the strides.
struct Group {
    first: Segment,
    count: u64,
    src_stride: u64,
    dst_stride: u64,
}

/// Turns coalesced segments into writes.
struct Builder {
    plan: TransferPlan,
    max: u64,
    rows: bool,
    group: Option<Group>,
}

impl Builder {
    /// Takes the next coalesced segment: it extends the rows being gathered, or they are
    /// written out and it starts new ones (or, too long to be a row, is written alone).
    fn take(&mut self, s: Segment) {
        if !self.rows || s.len > self.max {
            self.flush();
            push_writes(&mut self.plan, &s, self.max);
            return;
        }
        if let Some(g) = self.group.as_mut()
            && extends(g, &s, self.max)
        {
            if g.count == 1 {
                g.src_stride = s.src_offset - g.first.src_offset;
                g.dst_stride = s.dst_offset - g.first.dst_offset;
            }
            g.count += 1;
            return;
        }
        self.flush();
        self.group = Some(Group {
            first: s,
            count: 1,
            src_stride: 0,
            dst_stride: 0,
        });
    }

    /// Writes out the rows being gathered: one plain write for a single row.
    fn flush(&mut self) {
        let Some(g) = self.group.take() else { return };
        if g.count == 1 {
            push_writes(&mut self.plan, &g.first, self.max);
            return;
        }
        let f = g.first;
        in_place::push(&mut self.plan.writes, || PlannedWrite {
            src: LocalSlice {
                key: f.src,
                offset: f.src_offset,
                len: f.len,
            },
            dst: RemoteSlice {
                region: f.dst,
                offset: f.dst_offset,
                len: f.len,
            },
            rows: Some(Rows {
                count: g.count,
                src_stride: g.src_stride,
                dst_stride: g.dst_stride,
            }),
        });
        self.plan.bytes += f.len * g.count;
    }
}

/// Whether `s` is the next row of `g`: same regions and length, at the strides (or, for
/// the second row, at strides no shorter than a row), and the rows still within `max`.
fn extends(g: &Group, s: &Segment, max: u64) -> bool {
    let f = &g.first;
    if s.src != f.src || s.dst != f.dst || s.len != f.len {
        return false;
    }
    let Some(total) = (g.count + 1).checked_mul(f.len) else {
        return false;
    };
    if total > max {
        return false;
    }
    if g.count == 1 {
        return s.src_offset >= f.src_offset.saturating_add(f.len)
            && s.dst_offset >= f.dst_offset.saturating_add(f.len)
            && f.len > 0;
    }
    let at = |base: u64, stride: u64| {
        g.count
            .checked_mul(stride)
            .and_then(|o| base.checked_add(o))
    };
    at(f.src_offset, g.src_stride) == Some(s.src_offset)
        && at(f.dst_offset, g.dst_stride) == Some(s.dst_offset)
}

/// Appends the writes of one (merged) segment, split at `max_msg_size`.
fn push_writes(plan: &mut TransferPlan, s: &Segment, max_msg_size: u64) {
    let mut done = 0;
    while done < s.len {
        let n = (s.len - done).min(max_msg_size);
        in_place::push(&mut plan.writes, || PlannedWrite {
            src: LocalSlice {
                key: s.src,
                offset: s.src_offset + done,
                len: n,
            },
            dst: RemoteSlice {
                region: s.dst,
                offset: s.dst_offset + done,
                len: n,
            },
            rows: None,
        });
        done += n;
    }
    plan.bytes += s.len;
}

/// Rejects destination ranges outside their region, overflowing ranges, and overlaps.
fn check_destinations(segments: &[Segment]) -> Result<()> {
    check_bounds(segments, "destination")?;
    check_overlaps(segments)
}

/// Rejects remote ranges outside their region (`what` the remote side is: a write's
/// destination, a read's source) and overflowing local ranges.
fn check_bounds(segments: &[Segment], what: &'static str) -> Result<()> {
    for (i, s) in segments.iter().enumerate() {
        check_range(s.dst_offset, s.len, s.dst.len).map_err(|_| {
            Error::from(Invalid::RemoteOutOfRange {
                segment: i,
                role: what,
                offset: s.dst_offset,
                len: s.len,
                region_len: s.dst.len,
            })
        })?;
        s.src_offset
            .checked_add(s.len)
            .ok_or_else(|| Invalid::Overflow {
                what: format!("segment {i}: local range"),
            })?;
    }
    Ok(())
}

/// Rejects destinations that share bytes.
fn check_overlaps(segments: &[Segment]) -> Result<()> {
    if !overlap_possible(segments) {
        return Ok(());
    }
    let Some(shape) = DestinationShape::of(segments) else {
        return check_overlaps_general(segments);
    };
    if shape.disjoint_by_cells(segments) {
        return Ok(());
    }
    if segments.len() as u64 > INDEX_MASK || shape.last_offset - shape.lo >= 1 << (64 - INDEX_BITS)
    {
        return check_overlaps_general(segments);
    }
    check_overlaps_packed(segments, shape.lo, shape.live as usize)
}

/// Whether two non-empty destinations might overlap: false when they are already in
/// increasing order of offset within one region (the common case of sorted descriptors),
/// which needs no sort.
fn overlap_possible(segments: &[Segment]) -> bool {
    let mut last: Option<&Segment> = None;
    for s in segments.iter().filter(|s| s.len > 0) {
        if let Some(a) = last
            && ((a.dst.key, a.dst.addr) != (s.dst.key, s.dst.addr)
                || a.dst_offset + a.len > s.dst_offset)
        {
            return true;
        }
        last = Some(s);
    }
    false
}

/// Where the non-empty destinations of a transfer lie, when they share one region.
struct DestinationShape {
    /// Lowest offset.
    lo: u64,
    /// Highest offset.
    last_offset: u64,
    /// Highest end (offset + length).
    end: u64,
    /// Shortest length.
    shortest: u64,
    /// Number of non-empty segments.
    live: u64,
}

impl DestinationShape {
    /// `None` if the destinations are in several regions (or there are none).
    fn of(segments: &[Segment]) -> Option<DestinationShape> {
        let mut live = segments.iter().filter(|s| s.len > 0);
        let first = live.next()?;
        let region = (first.dst.key, first.dst.addr);
        let mut shape = DestinationShape {
            lo: first.dst_offset,
            last_offset: first.dst_offset,
            end: first.dst_offset + first.len,
            shortest: first.len,
            live: 1,
        };
        for s in live {
            if (s.dst.key, s.dst.addr) != region {
                return None;
            }
            shape.lo = shape.lo.min(s.dst_offset);
            shape.last_offset = shape.last_offset.max(s.dst_offset);
            shape.end = shape.end.max(s.dst_offset + s.len);
            shape.shortest = shape.shortest.min(s.len);
            shape.live += 1;
        }
        Some(shape)
    }

    /// Proves that no two non-empty destinations overlap, without sorting: cut the span
    /// into cells of a power of two no longer than the shortest segment and mark the
    /// cells each destination covers. Destinations that share no cell share no byte. Not
    /// a proof of overlap: neighbours that meet inside a cell collide too (never when
    /// pages are aligned to their size), and the caller then sorts. Gives up (false) when
    /// the bitmap would be large for the transfer: over 128 cells per segment.
    fn disjoint_by_cells(&self, segments: &[Segment]) -> bool {
        let shift = 63 - self.shortest.leading_zeros();
        let cells = ((self.end - 1 - self.lo) >> shift) + 1;
        if cells > 128 * self.live.max(64) {
            return false;
        }
        // A small transfer's bitmap (up to 8192 cells) lives on the stack.
        let (mut on_stack, mut on_heap) = ([0u64; SMALL_WORDS], Vec::new());
        let marked = zeroed(&mut on_stack, &mut on_heap, cells.div_ceil(64) as usize);
        for s in segments.iter().filter(|s| s.len > 0) {
            let first = (s.dst_offset - self.lo) >> shift;
            let last = (s.dst_offset + s.len - 1 - self.lo) >> shift;
            for c in first..=last {
                let (word, bit) = ((c / 64) as usize, 1u64 << (c % 64));
                if marked[word] & bit != 0 {
                    return false;
                }
                marked[word] |= bit;
            }
        }
        true
    }
}

/// Words of [`DestinationShape::disjoint_by_cells`]'s bitmap kept on the stack.
const SMALL_WORDS: usize = 128;

/// Segments whose packed sort keys ([`check_overlaps_packed`]) are kept on the stack: a
/// transfer of a few pages then checks its destinations without allocating.
const SMALL_SEGMENTS: usize = 64;

/// `len` zeroed words: the front of `on_stack` when they fit there, else `on_heap` grown
/// to them (the overlap checks' scratch space, which small transfers then do not allocate).
fn zeroed<'a, const N: usize>(
    on_stack: &'a mut [u64; N],
    on_heap: &'a mut Vec<u64>,
    len: usize,
) -> &'a mut [u64] {
    if len <= N {
        &mut on_stack[..len]
    } else {
        on_heap.resize(len, 0);
        on_heap
    }
}

/// Bits of a packed sort key that hold the segment index.
const INDEX_BITS: u32 = 24;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;

/// The overlap check for destinations in one region, fewer than 2^24 segments and
/// offsets spread over less than 2^40 bytes from `lo`: each non-empty segment becomes
/// `(offset - lo) << 24 | index`, sorted as a plain integer, which is the general
/// check's order (offset, then index) at a fraction of its cost.
fn check_overlaps_packed(segments: &[Segment], lo: u64, live: usize) -> Result<()> {
    let (mut on_stack, mut on_heap) = ([0u64; SMALL_SEGMENTS], Vec::new());
    let order = zeroed(&mut on_stack, &mut on_heap, live);
    let keys = segments
        .iter()
        .enumerate()
        .filter(|(_, s)| s.len > 0)
        .map(|(i, s)| ((s.dst_offset - lo) << INDEX_BITS) | i as u64);
    for (slot, key) in order.iter_mut().zip(keys) {
        *slot = key;
    }
    order.sort_unstable();
    for w in order.windows(2) {
        let (i, j) = ((w[0] & INDEX_MASK) as usize, (w[1] & INDEX_MASK) as usize);
        let (a, b) = (&segments[i], &segments[j]);
        if a.dst_offset + a.len > b.dst_offset {
            return Err(overlap_error(i, a, j, b));
        }
    }
    Ok(())
}

/// The overlap check for any mix of regions: sort by (region, offset, index).
fn check_overlaps_general(segments: &[Segment]) -> Result<()> {
    let mut ranges: Vec<(u64, u64, u64, u64)> = segments
        .iter()
        .enumerate()
        .filter(|(_, s)| s.len > 0)
        .map(|(i, s)| (s.dst.key.0, s.dst.addr, s.dst_offset, i as u64))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        let (i, j) = (w[0].3 as usize, w[1].3 as usize);
        let (a, b) = (&segments[i], &segments[j]);
        if (w[0].0, w[0].1) == (w[1].0, w[1].1) && a.dst_offset + a.len > b.dst_offset {
            return Err(overlap_error(i, a, j, b));
        }
    }
    Ok(())
}

fn overlap_error(i: usize, a: &Segment, j: usize, b: &Segment) -> Error {
    Error::InvalidArgument(Invalid::Overlap {
        first: i,
        second: j,
        first_range: (a.dst_offset, a.len),
        second_range: (b.dst_offset, b.len),
    })
}

/// Splits `writes` over `rails` rails so that each rail carries about the same bytes.
/// Writes stay whole (each is one contiguous operation); returns one list per rail.
pub fn shard_by_bytes(writes: &[PlannedWrite], rails: usize) -> Vec<Vec<PlannedWrite>> {
    let rails = rails.max(1);
    let mut out: Vec<Vec<PlannedWrite>> = vec![Vec::new(); rails];
    let mut load = vec![0u64; rails];
    for w in writes {
        // Greedy: the least-loaded rail (ties to the lowest index) takes the next write.
        let (r, _) = load
            .iter()
            .enumerate()
            .min_by_key(|&(i, &b)| (b, i))
            .expect("rails >= 1");
        out[r].push(*w);
        load[r] += w.bytes().max(1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::RemoteKey;
    use proptest::prelude::*;

    fn region(key: u64, len: u64) -> RemoteRegion {
        RemoteRegion {
            addr: 0,
            len,
            key: RemoteKey(key),
        }
    }

    fn seg(src: u64, dst: u64, len: u64) -> Segment {
        Segment {
            src: LocalKey(1),
            src_offset: src,
            dst: region(9, 1 << 20),
            dst_offset: dst,
            len,
        }
    }

    #[test]
    fn adjacent_segments_merge_and_big_ones_split() {
        let p = plan_transfer(&[seg(0, 100, 10), seg(10, 110, 10), seg(50, 0, 25)], 16).unwrap();
        let lens: Vec<u64> = p.writes.iter().map(|w| w.src.len).collect();
        assert_eq!(lens, vec![16, 4, 16, 9]);
        assert_eq!(p.writes[1].dst.offset, 116);
        assert_eq!(p.bytes, 45);
    }

    /// `n` rows of `len` bytes: source rows `src_stride` apart from 0, destination rows
    /// `dst_stride` apart from `dst0`.
    fn rows(n: u64, len: u64, src_stride: u64, dst0: u64, dst_stride: u64) -> Vec<Segment> {
        (0..n)
            .map(|i| seg(i * src_stride, dst0 + i * dst_stride, len))
            .collect()
    }

    #[test]
    fn rows_at_constant_strides_become_one_strided_write_where_the_transport_has_them() {
        // A tensor-parallel piece: 64 rows of 2 KiB, every other 2 KiB of the source,
        // packed at the destination... which coalesces on the destination side only, so
        // it stays 64 segments, and becomes one write of rows.
        let segs = rows(64, 2048, 4096, 0, 2048);
        let p = plan_with_rows(&segs, 1 << 20, Direction::Write, true).unwrap();
        assert_eq!(p.writes.len(), 1);
        let w = p.writes[0];
        assert_eq!(
            (w.src.offset, w.src.len, w.dst.offset, w.dst.len),
            (0, 2048, 0, 2048)
        );
        assert_eq!(
            w.rows,
            Some(Rows {
                count: 64,
                src_stride: 4096,
                dst_stride: 2048
            })
        );
        assert_eq!((w.bytes(), p.bytes), (64 * 2048, 64 * 2048));
        // Without strided writes, or for a READ: one write per row.
        for (rows, dir) in [(false, Direction::Write), (true, Direction::Read)] {
            let p = plan_with_rows(&segs, 1 << 20, dir, rows).unwrap();
            assert_eq!(p.writes.len(), 64);
            assert!(p.writes.iter().all(|w| w.rows.is_none()));
        }
    }

    #[test]
    fn rows_end_where_the_pattern_or_the_size_limit_ends() {
        let mut segs = rows(10, 100, 300, 0, 200);
        // A row of another length, then rows at other strides.
        segs.push(seg(5000, 5000, 50));
        segs.extend(rows(3, 100, 1000, 0, 0).into_iter().map(|mut s| {
            s.src_offset += 6000;
            s.dst_offset = 6000 + s.src_offset - 6000;
            s
        }));
        // A size limit of 4 rows: 10 rows become 4 + 4 + 2.
        let p = plan_with_rows(&segs, 400, Direction::Write, true).unwrap();
        let shape: Vec<(u64, u64)> = p
            .writes
            .iter()
            .map(|w| (w.src.offset, w.rows.map_or(1, |r| r.count)))
            .collect();
        assert_eq!(
            shape,
            vec![(0, 4), (1200, 4), (2400, 2), (5000, 1), (6000, 3)]
        );
        assert_eq!(p.bytes, 10 * 100 + 50 + 300);
        // The rows cover exactly the segments' bytes.
        let mut covered: Vec<(u64, u64, u64)> = Vec::new();
        for w in &p.writes {
            let r = w.rows.unwrap_or(Rows {
                count: 1,
                src_stride: 0,
                dst_stride: 0,
            });
            for i in 0..r.count {
                covered.push((
                    w.src.offset + i * r.src_stride,
                    w.dst.offset + i * r.dst_stride,
                    w.src.len,
                ));
            }
        }
        let want: Vec<(u64, u64, u64)> = segs
            .iter()
            .map(|s| (s.src_offset, s.dst_offset, s.len))
            .collect();
        assert_eq!(covered, want);
    }

    #[test]
    fn rows_are_checked_for_count_strides_and_overflow() {
        let ok = Rows {
            count: 3,
            src_stride: 10,
            dst_stride: 4,
        };
        assert_eq!(ok.check(4).unwrap(), (24, 12, 12));
        for bad in [
            Rows { count: 1, ..ok },
            Rows {
                src_stride: 3,
                ..ok
            },
            Rows {
                count: u64::MAX,
                ..ok
            },
        ] {
            assert!(matches!(
                bad.check(4),
                Err(Error::InvalidArgument(Invalid::Rows { .. }))
            ));
        }
    }

    #[test]
    fn out_of_region_and_overlap_are_rejected() {
        let e = plan_transfer(&[seg(0, (1 << 20) - 5, 10)], 64).unwrap_err();
        assert!(e.to_string().contains("outside the remote region"), "{e}");
        let e = plan_transfer(&[seg(0, 0, 10), seg(100, 5, 10)], 64).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        let e = plan_transfer(&[seg(u64::MAX - 1, 0, 10)], 64).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        assert!(plan_transfer(&[seg(0, u64::MAX, 2)], 64).is_err());
    }

    #[test]
    fn zero_length_segments_vanish() {
        let p = plan_transfer(&[seg(0, 0, 0), seg(0, 0, 0)], 64).unwrap();
        assert!(p.writes.is_empty());
        assert_eq!(p.bytes, 0);
    }

    #[test]
    fn sharding_balances_bytes() {
        let p = plan_transfer(&[seg(0, 0, 1000)], 100).unwrap();
        let shards = shard_by_bytes(&p.writes, 3);
        let bytes: Vec<u64> = shards
            .iter()
            .map(|s| s.iter().map(|w| w.dst.len).sum())
            .collect();
        assert_eq!(bytes.iter().sum::<u64>(), 1000);
        assert!(bytes.iter().max().unwrap() - bytes.iter().min().unwrap() <= 100);
    }

    #[test]
    fn large_transfers_agree_with_the_general_check() {
        // Pages of several sizes at page-aligned and unaligned offsets, in random order,
        // with and without one page moved onto another.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for round in 0..200 {
            let page = [64, 4096, 100][round % 3];
            let stride = page * (1 + next(3));
            let n = 1 + next(3000) as usize;
            let mut slots: Vec<u64> = (0..n as u64 * 2).collect();
            for i in (1..slots.len()).rev() {
                slots.swap(i, next(i as u64 + 1) as usize);
            }
            let mut segs: Vec<Segment> = slots[..n]
                .iter()
                .map(|&k| Segment {
                    dst: region(9, 1 << 40),
                    len: page - next(2) * (page / 2),
                    ..seg(0, k * stride + (round as u64 % 2) * 7, page)
                })
                .collect();
            if round % 4 == 0 && n > 1 {
                let (a, b) = (next(n as u64) as usize, next(n as u64) as usize);
                segs[a].dst_offset = segs[b].dst_offset + next(page);
            }
            let fast = check_destinations(&segs).map_err(|e| e.to_string());
            let general = check_overlaps_general(&segs).map_err(|e| e.to_string());
            assert_eq!(fast, general, "round {round}");
        }
    }

    fn run(src: u64, dst: u64, len: u64, count: u64, ss: u64, ds: u64) -> StridedRun {
        StridedRun {
            src_offset: src,
            dst_offset: dst,
            len,
            count,
            src_stride: ss,
            dst_stride: ds,
        }
    }

    #[test]
    fn a_run_is_planned_as_strided_writes_whatever_its_rows() {
        let dst = region(9, 1 << 20);
        // 1000 rows of 100 bytes, every other row of the source, back to back at the
        // destination; writes of at most 1000 bytes hold 10 rows.
        let r = run(0, 0, 100, 1000, 200, 100);
        let p = plan_runs(&[], &[r], LocalKey(1), dst, 1000, Direction::Write, true).unwrap();
        assert_eq!(p.bytes, 100_000);
        assert_eq!(p.writes.len(), 100);
        assert!(
            p.writes
                .iter()
                .all(|w| w.rows.is_some_and(|r| r.count == 10))
        );
        assert_eq!(p.writes[3].src.offset, 30 * 200);
        assert_eq!(p.writes[3].dst.offset, 30 * 100);
        // Without strided writes: a write per row, as if each were a segment.
        let p = plan_runs(&[], &[r], LocalKey(1), dst, 1000, Direction::Write, false).unwrap();
        assert_eq!(p.writes.len(), 1000);
    }

    #[test]
    fn runs_are_checked_as_their_rows_would_be() {
        let dst = region(9, 10_000);
        let plan = |runs: &[StridedRun]| {
            plan_runs(
                &[seg(0, 0, 10)],
                runs,
                LocalKey(1),
                dst,
                1 << 20,
                Direction::Write,
                true,
            )
        };
        // The last row ends past the region: named as the entry after the segment.
        let e = plan(&[run(0, 100, 10, 100, 10, 100)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("segment 1"), "{e}");
        // A stride shorter than a row.
        assert!(plan(&[run(0, 100, 10, 3, 10, 5)]).is_err());
        // A row on the segment's bytes.
        let e = plan(&[run(0, 5, 10, 3, 10, 20)]).unwrap_err().to_string();
        assert!(e.contains("overlap"), "{e}");
        // Two runs whose rows interleave without touching: their spans overlap, their
        // rows do not; and then one whose rows do.
        let p = plan(&[run(0, 100, 10, 5, 10, 20), run(100, 110, 10, 5, 10, 20)]).unwrap();
        assert_eq!(p.bytes, 10 + 100);
        assert!(plan(&[run(0, 100, 10, 5, 10, 20), run(100, 105, 10, 5, 10, 20)]).is_err());
        // Empty runs hold nothing and are not checked against the region.
        let p = plan(&[
            run(1 << 40, 1 << 40, 10, 0, 0, 0),
            run(0, 1 << 40, 0, 9, 1, 1),
        ]);
        assert_eq!(p.unwrap().bytes, 10);
    }

    proptest! {
        /// The fast overlap checks (sorted input, packed keys) reject exactly what the
        /// general one rejects, with the same message (the same pair of segments).
        #[test]
        fn fast_overlap_checks_agree_with_the_general_one(
            segs in proptest::collection::vec((0u64..8, 0u64..1 << 20, 0u64..20), 0..150),
            regions in 1u64..4,
            sorted in any::<bool>(),
            span in prop_oneof![Just(200u64), Just(12_000u64)],
        ) {
            // Mostly one region (the packed path), sometimes several (the general one).
            // Up to 64 segments keep their sort keys on the stack, more on the heap; over
            // 12 000 bytes, 100 segments or more take a cell bitmap too large for the stack.
            let mut segs: Vec<Segment> = segs.iter().map(|&(r, off, len)| Segment {
                src: LocalKey(1),
                src_offset: 0,
                dst: RemoteRegion { addr: (r % regions) & 1, len: 1 << 20, key: RemoteKey(9 + (r % regions) / 2) },
                dst_offset: off % span,
                len,
            }).collect();
            if sorted {
                segs.sort_by_key(|s| (s.dst.key.0, s.dst.addr, s.dst_offset));
            }
            let fast = check_destinations(&segs).map_err(|e| e.to_string());
            let general = check_overlaps_general(&segs).map_err(|e| e.to_string());
            prop_assert_eq!(fast, general);
        }

        /// Every requested byte is covered exactly once, and lands at the right offset.
        #[test]
        fn plan_covers_every_byte_once(
            pages in proptest::collection::vec((0u64..64, 1u64..300), 0..40),
            max in 1u64..500,
            rails in 1usize..5,
        ) {
            // Distinct destination pages of 512 bytes; source pages shuffled by index.
            let mut used = std::collections::HashSet::new();
            let segs: Vec<Segment> = pages.iter().enumerate()
                .filter(|(_, (p, _))| used.insert(*p))
                .map(|(i, &(p, len))| seg(i as u64 * 512, p * 512, len))
                .collect();
            let plan = plan_transfer(&segs, max).unwrap();
            let mut covered = std::collections::HashMap::new();
            for w in &plan.writes {
                prop_assert!(w.src.len <= max && w.src.len > 0);
                prop_assert_eq!(w.src.len, w.dst.len);
                for b in 0..w.dst.len {
                    let dst = w.dst.offset + b;
                    prop_assert!(covered.insert(dst, w.src.offset + b).is_none(), "byte {} twice", dst);
                }
            }
            let want: u64 = segs.iter().map(|s| s.len).sum();
            prop_assert_eq!(covered.len() as u64, want);
            prop_assert_eq!(plan.bytes, want);
            for s in &segs {
                for b in 0..s.len {
                    prop_assert_eq!(covered[&(s.dst_offset + b)], s.src_offset + b);
                }
            }
            let shards = shard_by_bytes(&plan.writes, rails);
            prop_assert_eq!(shards.iter().map(Vec::len).sum::<usize>(), plan.writes.len());
        }

        /// Runs plan to the bytes their rows plan to as segments (or both fail), on a
        /// backend with strided writes and without, written and read.
        #[test]
        fn runs_move_the_bytes_of_their_rows(
            runs in proptest::collection::vec(
                (0u64..4000, 0u64..4000, 0u64..40, 0u64..12, 0u64..80, 0u64..80), 0..6),
            segs in proptest::collection::vec((0u64..4000, 0u64..4000, 0u64..100), 0..4),
            max in 1u64..600,
            rows in any::<bool>(),
            read in any::<bool>(),
        ) {
            let runs: Vec<StridedRun> = runs.iter().map(|&(s, d, len, count, ss, ds)| StridedRun {
                src_offset: s, dst_offset: d, len, count, src_stride: ss, dst_stride: ds,
            }).collect();
            let segs: Vec<Segment> = segs.iter().map(|&(s, d, l)| Segment {
                dst: region(9, 8000), ..seg(s, d, l)
            }).collect();
            let dir = if read { Direction::Read } else { Direction::Write };
            let got = plan_runs(&segs, &runs, LocalKey(1), region(9, 8000), max, dir, rows);
            // The same rows listed, where every run's shape is valid.
            let shapes: Result<Vec<_>> = runs.iter().map(StridedRun::spans).collect();
            let mut listed = segs.clone();
            for r in runs.iter().filter(|r| !r.is_empty()) {
                for i in 0..r.count {
                    let (so, d_o) = r.row(i);
                    listed.push(Segment { dst: region(9, 8000), ..seg(so, d_o, r.len) });
                }
            }
            let want = shapes.and_then(|_| plan_with_rows(&listed, max, dir, rows));
            match (got, want) {
                (Ok(g), Ok(w)) => {
                    prop_assert_eq!(g.bytes, w.bytes);
                    let bytes = |p: &TransferPlan| {
                        let mut v = Vec::new();
                        for w in &p.writes {
                            let r = w.rows.unwrap_or(Rows { count: 1, src_stride: 0, dst_stride: 0 });
                            assert!(w.bytes() > 0 && w.src.len <= max.max(1));
                            for i in 0..r.count {
                                for b in 0..w.src.len {
                                    v.push((w.dst.offset + i * r.dst_stride + b, w.src.offset + i * r.src_stride + b));
                                }
                            }
                        }
                        v.sort_unstable();
                        v
                    };
                    prop_assert_eq!(bytes(&g), bytes(&w));
                    if !rows || read {
                        prop_assert!(g.writes.iter().all(|w| w.rows.is_none()));
                    }
                }
                (Err(_), Err(_)) => {}
                (g, w) => prop_assert!(false, "runs {:?} against rows {:?}", g.map(|p| p.bytes), w.map(|p| p.bytes)),
            }
        }
    }
}
