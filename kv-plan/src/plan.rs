//! A request's transfer plan ([`plan`], [`KvPlan`]): per (prefill rank, decode rank), the
//! strided runs that move one (layer, component), the same for all of them.

use std::collections::BTreeMap;
use std::ops::Range;

use fabric_core::plan::StridedRun;

use crate::error::{KvError, Result, Side, add, mul};
use crate::layout::KvLayout;
use crate::request::KvRequest;

/// A request's plan: for every (prefill rank, decode rank) pair that moves something, the
/// runs that move one (layer, component) tensor's share.
///
/// Every layer and component has the same geometry, so the same runs serve them all: run
/// offsets are relative to each side's [`TensorPlace`](crate::TensorPlace) of that (layer,
/// component), and [`PairPlan::placed`] adds them and names the regions. Runs are in
/// WRITE orientation (`src` = prefill, `dst` = decode). A pull (decode READs from
/// prefill) is the same plan read the other way: [`Placed::read_runs`] swaps the sides so
/// that `src` is decode's (local) and `dst` prefill's (remote), as
/// `fabric_core`'s READs name them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvPlan {
    /// Layers each run list is applied to.
    pub num_layers: u32,
    /// Components per layer each run list is applied to.
    pub components: u32,
    /// Pairs that move bytes, sorted by (prefill, decode).
    pub pairs: Vec<PairPlan>,
}

/// What one prefill rank sends one decode rank, per (layer, component).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PairPlan {
    /// Prefill rank (index into the prefill layouts).
    pub prefill: u32,
    /// Decode rank (index into the decode layouts).
    pub decode: u32,
    /// Runs relative to the two tensors' starts: `src` in prefill's, `dst` in decode's.
    pub runs: Vec<StridedRun>,
    /// (decode block, head) cells this pair fills per (layer, component): what a path
    /// with one transfer per block and head would post.
    pub block_heads: u64,
}

/// One pair's runs for one (layer, component), placed in the ranks' regions.
#[derive(Clone, Copy, Debug)]
pub struct Placed<'a> {
    /// Prefill's region holding the tensor.
    pub prefill_region: u32,
    /// Decode's region holding the tensor.
    pub decode_region: u32,
    /// Offset of prefill's tensor in its region (added to every run's `src_offset`).
    pub prefill_offset: u64,
    /// Offset of decode's tensor in its region (added to every run's `dst_offset`).
    pub decode_offset: u64,
    runs: &'a [StridedRun],
}

impl Placed<'_> {
    /// The runs in region offsets, for prefill to WRITE: `src` in prefill's region
    /// (local), `dst` in decode's (remote).
    pub fn write_runs(&self) -> impl Iterator<Item = StridedRun> + '_ {
        // `PairPlan::placed` checked that every run ends within both tensors, whose ends
        // (offset + span) fit in 64 bits: these sums cannot overflow.
        self.runs.iter().map(|r| StridedRun {
            src_offset: self.prefill_offset + r.src_offset,
            dst_offset: self.decode_offset + r.dst_offset,
            ..*r
        })
    }

    /// The runs in region offsets, for decode to READ: `src` in decode's region (local,
    /// where the bytes land), `dst` in prefill's (remote, where they are read).
    pub fn read_runs(&self) -> impl Iterator<Item = StridedRun> + '_ {
        self.write_runs().map(|r| StridedRun {
            src_offset: r.dst_offset,
            dst_offset: r.src_offset,
            src_stride: r.dst_stride,
            dst_stride: r.src_stride,
            ..r
        })
    }
}

impl PairPlan {
    /// The runs of (layer, component) in the ranks' regions, `prefill` and `decode` being
    /// this pair's layouts. Fails when a run is malformed or leaves either tensor.
    pub fn placed<'a>(
        &'a self,
        prefill: &KvLayout,
        decode: &KvLayout,
        layer: u32,
        component: u32,
    ) -> Result<Placed<'a>> {
        let (p, d) = (
            prefill.place(layer, component)?,
            decode.place(layer, component)?,
        );
        // Both ends fit in 64 bits; a run inside both spans keeps its sums below them.
        prefill.extent(layer, component)?;
        decode.extent(layer, component)?;
        let (p_span, d_span) = (prefill.tensor_span()?, decode.tensor_span()?);
        for (i, r) in self.runs.iter().enumerate() {
            let bad = KvError::BadRun {
                prefill: self.prefill,
                decode: self.decode,
                run: i,
            };
            let (s, d, _) = r.spans().map_err(|_| bad.clone())?;
            let fits = |start: u64, span: u64, limit: u64| {
                start.checked_add(span).is_some_and(|e| e <= limit)
            };
            if !(r.is_empty() || fits(r.src_offset, s, p_span) && fits(r.dst_offset, d, d_span)) {
                return Err(bad);
            }
        }
        Ok(Placed {
            prefill_region: p.region,
            decode_region: d.region,
            prefill_offset: p.offset,
            decode_offset: d.offset,
            runs: &self.runs,
        })
    }
}

/// A pair's share of a plan, per (layer, component) unless named otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PairStats {
    /// Prefill rank.
    pub prefill: u32,
    /// Decode rank.
    pub decode: u32,
    /// Strided runs.
    pub runs: u64,
    /// Rows in them.
    pub rows: u64,
    /// Bytes they move.
    pub bytes: u64,
    /// (decode block, head) cells: the transfers of a per-block-per-head path.
    pub block_heads: u64,
}

/// A plan's size: per pair and in all, per (layer, component) and for the whole request.
/// Sums saturate (they are reports).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanStats {
    /// Per pair, per (layer, component).
    pub pairs: Vec<PairStats>,
    /// Runs of all pairs, per (layer, component).
    pub runs: u64,
    /// Rows of all pairs, per (layer, component).
    pub rows: u64,
    /// Bytes of all pairs, per (layer, component).
    pub bytes: u64,
    /// Strided transfers for the whole request: runs × layers × components.
    pub transfers: u64,
    /// Bytes of the whole request.
    pub request_bytes: u64,
    /// Transfers a per-block-per-head path would post for the whole request: decode
    /// blocks × heads × components × layers.
    pub per_block_head: u64,
}

impl KvPlan {
    /// The pair (prefill, decode), if it moves anything.
    pub fn pair(&self, prefill: u32, decode: u32) -> Option<&PairPlan> {
        self.pairs
            .binary_search_by_key(&(prefill, decode), |p| (p.prefill, p.decode))
            .ok()
            .map(|i| &self.pairs[i])
    }

    /// The pairs prefill rank `prefill` sends.
    pub fn pairs_from(&self, prefill: u32) -> impl Iterator<Item = &PairPlan> {
        self.pairs.iter().filter(move |p| p.prefill == prefill)
    }

    /// The pairs decode rank `decode` receives.
    pub fn pairs_to(&self, decode: u32) -> impl Iterator<Item = &PairPlan> {
        self.pairs.iter().filter(move |p| p.decode == decode)
    }

    /// Runs, rows and bytes per pair and in all, against a per-block-per-head path.
    pub fn stats(&self) -> PlanStats {
        let per_tensor = u64::from(self.num_layers).saturating_mul(u64::from(self.components));
        let mut s = PlanStats::default();
        for p in &self.pairs {
            let mut ps = PairStats {
                prefill: p.prefill,
                decode: p.decode,
                runs: p.runs.len() as u64,
                block_heads: p.block_heads,
                ..PairStats::default()
            };
            for r in &p.runs {
                ps.rows = ps.rows.saturating_add(r.count);
                ps.bytes = ps.bytes.saturating_add(r.count.saturating_mul(r.len));
            }
            s.runs = s.runs.saturating_add(ps.runs);
            s.rows = s.rows.saturating_add(ps.rows);
            s.bytes = s.bytes.saturating_add(ps.bytes);
            s.per_block_head = s
                .per_block_head
                .saturating_add(p.block_heads.saturating_mul(per_tensor));
            s.pairs.push(ps);
        }
        s.transfers = s.runs.saturating_mul(per_tensor);
        s.request_bytes = s.bytes.saturating_mul(per_tensor);
        s
    }
}

/// Plans `req` from the prefill ranks' caches (`prefill[p]` is rank `p`'s layout) into
/// the decode ranks' (`decode[d]`).
///
/// Every byte of decode rank `d`'s heads for tokens `0..num_tokens` is written exactly
/// once, from a prefill rank holding that head. A head held by several prefill ranks
/// (replicas when prefill's TP exceeds the KV heads; MLA's latent, held by all) is
/// shared out: for each set of ranks holding the same heads, the decode ranks' needs are
/// laid end to end and cut into equal parts, one per holder, at block boundaries, so each
/// holder sends about the same bytes and few pairs talk. Deterministic.
///
/// Runs follow the layouts: a contiguous span when both sides hold the same heads NHD, a
/// row per token when one side holds a slice of the other's heads, a row per head for HND,
/// and per head rows of one head's bytes when NHD meets HND; consecutive blocks on both
/// sides merge into one run (as a longer span or more rows). Block sizes may differ:
/// pieces are cut at both sides' block boundaries.
pub fn plan(prefill: &[KvLayout], decode: &[KvLayout], req: &KvRequest) -> Result<KvPlan> {
    check_layouts(prefill, decode)?;
    req.validate(prefill, decode)?;
    let first = &prefill[0];
    let mut out = KvPlan {
        num_layers: first.num_layers,
        components: first.components,
        pairs: Vec::new(),
    };
    if req.num_tokens == 0 {
        return Ok(out);
    }
    // Work grouped by the set of prefill ranks that can serve it.
    let mut groups: BTreeMap<Vec<u32>, Vec<Item>> = BTreeMap::new();
    for (d, dl) in decode.iter().enumerate() {
        let d = d as u32; // check_layouts bounded the rank count
        for (heads, holders) in head_spans(prefill, dl.heads.clone(), d)? {
            let unit = unit_for(dl, &holders, prefill, req.num_tokens);
            groups.entry(holders).or_default().push(Item {
                decode: d,
                heads,
                unit,
            });
        }
    }
    let mut pairs: BTreeMap<(u32, u32), PairPlan> = BTreeMap::new();
    let mut group_buf = Vec::new();
    for (holders, items) in &groups {
        for (j, pieces) in cut(items, holders.len(), req.num_tokens)
            .into_iter()
            .enumerate()
        {
            let p = holders[j];
            for (i, tokens) in pieces {
                let item = &items[i];
                let d = item.decode;
                let pair = pairs.entry((p, d)).or_insert_with(|| PairPlan {
                    prefill: p,
                    decode: d,
                    ..PairPlan::default()
                });
                let src = Endpoint {
                    layout: &prefill[p as usize],
                    table: req.table(Side::Prefill, p, prefill.len())?,
                };
                let dst = Endpoint {
                    layout: &decode[d as usize],
                    table: req.table(Side::Decode, d, decode.len())?,
                };
                let cells = emit(
                    &src,
                    &dst,
                    &item.heads,
                    tokens,
                    &mut pair.runs,
                    &mut group_buf,
                )?;
                pair.block_heads = pair.block_heads.saturating_add(cells);
            }
        }
    }
    out.pairs = pairs.into_values().filter(|p| !p.runs.is_empty()).collect();
    Ok(out)
}

/// Every layout valid, with the geometry of prefill rank 0 (returned); rank counts fit in
/// `u32`. The planner and the checker both start here (what they check independently is
/// the plan, not their inputs).
pub(crate) fn check_layouts<'a>(
    prefill: &'a [KvLayout],
    decode: &[KvLayout],
) -> Result<&'a KvLayout> {
    let first = prefill.first().ok_or(KvError::NoRanks {
        side: Side::Prefill,
    })?;
    if decode.is_empty() {
        return Err(KvError::NoRanks { side: Side::Decode });
    }
    for (side, layouts) in [(Side::Prefill, prefill), (Side::Decode, decode)] {
        for (rank, l) in layouts.iter().enumerate() {
            let rank = u32::try_from(rank).map_err(|_| KvError::Overflow { what: "rank count" })?;
            l.validate().map_err(|e| KvError::Layout {
                side,
                rank,
                source: Box::new(e),
            })?;
            for (field, expected, found) in [
                ("num_layers", first.num_layers, l.num_layers),
                ("components", first.components, l.components),
                ("elem_size", first.elem_size, l.elem_size),
                ("head_dim", first.head_dim, l.head_dim),
                ("total_heads", first.total_heads, l.total_heads),
            ] {
                if expected != found {
                    return Err(KvError::Mismatch {
                        side,
                        rank,
                        field,
                        expected: expected.into(),
                        found: found.into(),
                    });
                }
            }
        }
    }
    Ok(first)
}

/// A piece of a decode rank's needs that one set of prefill ranks can serve.
struct Item {
    decode: u32,
    heads: Range<u32>,
    /// Tokens the cuts between holders are rounded to (whole blocks on every side).
    unit: u64,
}

/// Decode rank `rank`'s heads `need`, cut where the prefill ranks holding them change:
/// (heads, holders) spans, holders ascending.
fn head_spans(
    prefill: &[KvLayout],
    need: Range<u32>,
    rank: u32,
) -> Result<Vec<(Range<u32>, Vec<u32>)>> {
    let mut cuts = vec![need.start, need.end];
    for p in prefill {
        for x in [p.heads.start, p.heads.end] {
            if need.start < x && x < need.end {
                cuts.push(x);
            }
        }
    }
    cuts.sort_unstable();
    cuts.dedup();
    let mut out: Vec<(Range<u32>, Vec<u32>)> = Vec::new();
    for w in cuts.windows(2) {
        let holders: Vec<u32> = prefill
            .iter()
            .enumerate()
            .filter(|(_, p)| p.heads.start <= w[0] && w[1] <= p.heads.end)
            .map(|(i, _)| i as u32)
            .collect();
        if holders.is_empty() {
            return Err(KvError::HeadNotHeld { rank, head: w[0] });
        }
        match out.last_mut() {
            Some((heads, last)) if *last == holders => heads.end = w[1],
            _ => out.push((w[0]..w[1], holders)),
        }
    }
    Ok(out)
}

/// Tokens that are whole blocks for the decode rank and every holder (their least common
/// multiple), or the whole request when that is longer.
fn unit_for(decode: &KvLayout, holders: &[u32], prefill: &[KvLayout], tokens: u64) -> u64 {
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let mut unit = u64::from(decode.block_size);
    for &p in holders {
        let bs = u64::from(prefill[p as usize].block_size);
        match (unit / gcd(unit, bs)).checked_mul(bs) {
            Some(l) if l < tokens => unit = l,
            _ => return tokens,
        }
    }
    unit.min(tokens)
}

/// Shares `items` (each `tokens` tokens of its heads) among `holders` ranks: the items
/// end to end, weighed in token-heads, cut into `holders` equal parts, each cut rounded
/// to its item's unit. Per holder: (item index, token range) pieces.
fn cut(items: &[Item], holders: usize, tokens: u64) -> Vec<Vec<(usize, Range<u64>)>> {
    let weight = |it: &Item| u128::from(tokens) * u128::from(it.heads.end - it.heads.start);
    let total: u128 = items.iter().map(weight).sum();
    let locate = |pos: u128| -> (usize, u64) {
        let mut acc = 0u128;
        for (i, it) in items.iter().enumerate() {
            let w = weight(it);
            if pos < acc + w {
                let heads = u128::from(it.heads.end - it.heads.start);
                let tok = (pos - acc) / heads;
                let unit = u128::from(it.unit.max(1));
                let rounded = (tok + unit / 2) / unit * unit;
                return if rounded >= u128::from(tokens) {
                    (i + 1, 0)
                } else {
                    // rounded < tokens: fits in u64.
                    (i, rounded as u64)
                };
            }
            acc += w;
        }
        (items.len(), 0)
    };
    let k = holders.max(1) as u128;
    let points: Vec<(usize, u64)> = (0..=k).map(|j| locate(total * j / k)).collect();
    points
        .windows(2)
        .map(|w| {
            let ((ia, ta), (ib, tb)) = (w[0], w[1]);
            (ia..=ib.min(items.len().saturating_sub(1)))
                .filter_map(|i| {
                    let start = if i == ia { ta } else { 0 };
                    let end = if i == ib { tb } else { tokens };
                    (start < end).then_some((i, start..end))
                })
                .collect()
        })
        .collect()
}

/// One side of a pair: its layout and block table.
struct Endpoint<'a> {
    layout: &'a KvLayout,
    table: &'a [u32],
}

impl Endpoint<'_> {
    /// Offset of (token of the request, global head) in a tensor of this side.
    fn offset(&self, token: u64, head: u32) -> Result<u64> {
        let l = self.layout;
        let bs = u64::from(l.block_size);
        let block = usize::try_from(token / bs)
            .ok()
            .and_then(|i| self.table.get(i))
            .ok_or(KvError::Overflow {
                what: "block table index",
            })?;
        let local = u64::from(head.checked_sub(l.heads.start).ok_or(KvError::Overflow {
            what: "local head index",
        })?);
        let off = mul(u64::from(*block), l.block_stride, "block offset")?;
        let off = add(
            off,
            mul(token % bs, l.token_stride, "token offset")?,
            "token offset",
        )?;
        add(
            off,
            mul(local, l.head_stride, "head offset")?,
            "head offset",
        )
    }
}

/// Appends the runs moving `heads` × `tokens` from `src` to `dst`, chunk by chunk (a chunk
/// lies in one block on each side), merging a chunk's runs into the previous chunk's where
/// they continue them. Returns the (decode block, head) cells covered.
fn emit(
    src: &Endpoint<'_>,
    dst: &Endpoint<'_>,
    heads: &Range<u32>,
    tokens: Range<u64>,
    out: &mut Vec<StridedRun>,
    group: &mut Vec<StridedRun>,
) -> Result<u64> {
    let (sl, dl) = (src.layout, dst.layout);
    let (sbs, dbs) = (u64::from(sl.block_size), u64::from(dl.block_size));
    let nh = u64::from(heads.end - heads.start);
    let mut open: Vec<StridedRun> = Vec::new();
    let mut t = tokens.start;
    while t < tokens.end {
        let end = tokens
            .end
            .min(t.saturating_add(sbs - t % sbs))
            .min(t.saturating_add(dbs - t % dbs));
        let nt = end - t;
        group.clear();
        rect(
            src.offset(t, heads.start)?,
            dst.offset(t, heads.start)?,
            sl.head_bytes,
            [
                Dim {
                    extent: nt,
                    src: sl.token_stride,
                    dst: dl.token_stride,
                },
                Dim {
                    extent: nh,
                    src: sl.head_stride,
                    dst: dl.head_stride,
                },
            ],
            group,
        )?;
        if !extend_all(&mut open, group) {
            out.append(&mut open);
            open.extend_from_slice(group);
        }
        t = end;
    }
    out.append(&mut open);
    let first = tokens.start / dbs;
    let last = (tokens.end - 1) / dbs;
    Ok((last - first + 1).saturating_mul(nh))
}

/// A dimension of a chunk: entries, and the stride between them on each side.
#[derive(Clone, Copy)]
struct Dim {
    extent: u64,
    src: u64,
    dst: u64,
}

/// Runs for a 2-D chunk of cells of `cell` bytes whose first cell is at `src`/`dst`:
/// dimensions contiguous on both sides fold into the row; one left is a strided run; two
/// left are a run per entry of the shorter, rows along the longer (tokens on a tie).
fn rect(src: u64, dst: u64, cell: u64, dims: [Dim; 2], out: &mut Vec<StridedRun>) -> Result<()> {
    let mut len = cell;
    // At most two dimensions: an array and a count, no allocation per chunk.
    let mut left = dims;
    let mut n = 0;
    for d in dims {
        if d.extent > 1 {
            left[n] = d;
            n += 1;
        }
    }
    while let Some(i) = left[..n].iter().position(|d| d.src == len && d.dst == len) {
        len = mul(len, left[i].extent, "row length")?;
        left[i] = left[n - 1];
        n -= 1;
    }
    match left[..n] {
        [] => out.push(StridedRun::contiguous(src, dst, len)),
        [d] => out.push(rows(src, dst, len, d)),
        [a, b, ..] => {
            let (row, outer) = if b.extent > a.extent { (b, a) } else { (a, b) };
            for i in 0..outer.extent {
                let s = add(src, mul(i, outer.src, "run offset")?, "run offset")?;
                let d = add(dst, mul(i, outer.dst, "run offset")?, "run offset")?;
                out.push(rows(s, d, len, row));
            }
        }
    }
    Ok(())
}

fn rows(src: u64, dst: u64, len: u64, d: Dim) -> StridedRun {
    StridedRun {
        src_offset: src,
        dst_offset: dst,
        len,
        count: d.extent,
        src_stride: d.src,
        dst_stride: d.dst,
    }
}

/// Extends each of `open` by the run at the same index of `next` when every one of them
/// continues; otherwise changes nothing and returns false.
fn extend_all(open: &mut [StridedRun], next: &[StridedRun]) -> bool {
    if open.len() != next.len() || open.is_empty() {
        return false;
    }
    // Two passes (extend is pure and cheap) rather than a buffer per chunk.
    if !open.iter().zip(next).all(|(a, b)| extend(a, b).is_some()) {
        return false;
    }
    for (a, b) in open.iter_mut().zip(next) {
        if let Some(m) = extend(a, b) {
            *a = m;
        }
    }
    true
}

/// `prev` followed by `next` as one run, when they are: two spans adjacent on both sides
/// (one longer span), or rows of one length at one pair of strides.
fn extend(prev: &StridedRun, next: &StridedRun) -> Option<StridedRun> {
    if prev.count == 1
        && next.count == 1
        && prev.src_offset.checked_add(prev.len) == Some(next.src_offset)
        && prev.dst_offset.checked_add(prev.len) == Some(next.dst_offset)
    {
        return Some(StridedRun {
            len: prev.len.checked_add(next.len)?,
            ..*prev
        });
    }
    if prev.len != next.len {
        return None;
    }
    let (ss, ds) = if prev.count >= 2 {
        (prev.src_stride, prev.dst_stride)
    } else if next.count >= 2 {
        (next.src_stride, next.dst_stride)
    } else {
        (
            next.src_offset.checked_sub(prev.src_offset)?,
            next.dst_offset.checked_sub(prev.dst_offset)?,
        )
    };
    if ss < prev.len || ds < prev.len {
        return None;
    }
    if next.count >= 2 && (next.src_stride, next.dst_stride) != (ss, ds) {
        return None;
    }
    let src_next = prev.src_offset.checked_add(prev.count.checked_mul(ss)?)?;
    let dst_next = prev.dst_offset.checked_add(prev.count.checked_mul(ds)?)?;
    if (src_next, dst_next) != (next.src_offset, next.dst_offset) {
        return None;
    }
    Some(StridedRun {
        count: prev.count.checked_add(next.count)?,
        src_stride: ss,
        dst_stride: ds,
        ..*prev
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn extend_merges_spans_and_rows() {
        // Adjacent spans become one longer span.
        assert_eq!(
            extend(&run(0, 10, 4, 1, 0, 0), &run(4, 14, 6, 1, 0, 0)),
            Some(run(0, 10, 10, 1, 0, 0))
        );
        // Two spans at distances 8 and 16 become two rows.
        assert_eq!(
            extend(&run(0, 0, 4, 1, 0, 0), &run(8, 16, 4, 1, 0, 0)),
            Some(run(0, 0, 4, 2, 8, 16))
        );
        // Rows continued by rows at the same strides.
        assert_eq!(
            extend(&run(0, 0, 4, 2, 8, 16), &run(16, 32, 4, 3, 8, 16)),
            Some(run(0, 0, 4, 5, 8, 16))
        );
        // Not where the next row would be, other strides, another length, backwards.
        assert_eq!(
            extend(&run(0, 0, 4, 2, 8, 16), &run(24, 32, 4, 1, 0, 0)),
            None
        );
        assert_eq!(
            extend(&run(0, 0, 4, 2, 8, 16), &run(16, 32, 4, 2, 8, 8)),
            None
        );
        assert_eq!(extend(&run(0, 0, 4, 1, 0, 0), &run(8, 8, 5, 1, 0, 0)), None);
        assert_eq!(
            extend(&run(8, 8, 4, 1, 0, 0), &run(0, 16, 4, 1, 0, 0)),
            None
        );
        // Rows may not overlap.
        assert_eq!(extend(&run(0, 0, 4, 1, 0, 0), &run(2, 8, 4, 1, 0, 0)), None);
    }

    #[test]
    fn cut_balances_and_rounds_to_units() {
        let item = |decode, unit| Item {
            decode,
            heads: 0..1,
            unit,
        };
        // One decode rank's 64 tokens over 4 holders, blocks of 16: a block each.
        let parts = cut(&[item(0, 16)], 4, 64);
        assert_eq!(
            parts,
            vec![
                vec![(0, 0..16)],
                vec![(0, 16..32)],
                vec![(0, 32..48)],
                vec![(0, 48..64)]
            ]
        );
        // Four decode ranks over two holders: two whole ranks each (4 pairs, not 8).
        let items: Vec<_> = (0..4).map(|d| item(d, 16)).collect();
        let parts = cut(&items, 2, 64);
        assert_eq!(
            parts,
            vec![vec![(0, 0..64), (1, 0..64)], vec![(2, 0..64), (3, 0..64)]]
        );
        // Three ranks over two holders: the middle one is split at a block boundary.
        let parts = cut(&items[..3], 2, 64);
        assert_eq!(
            parts,
            vec![vec![(0, 0..64), (1, 0..32)], vec![(1, 32..64), (2, 0..64)]]
        );
        // Fewer units than holders: some holders get nothing, every token goes once.
        let parts = cut(&[item(0, 8)], 4, 5);
        let total: u64 = parts.iter().flatten().map(|(_, r)| r.end - r.start).sum();
        assert_eq!(total, 5);
    }
}
