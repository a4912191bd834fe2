//! An independent proof of a plan ([`check`]): written apart from the planner, it works
//! backwards from the bytes each run touches to the (token, head, byte) they hold.

use std::collections::HashMap;
use std::fmt;

use fabric_core::plan::StridedRun;

use crate::error::{KvError, Side};
use crate::layout::KvLayout;
use crate::plan::KvPlan;
use crate::request::KvRequest;

/// A byte of the request's logical KV cache (of one layer and component).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cell {
    /// Token of the request.
    pub token: u64,
    /// Global KV head.
    pub head: u32,
    /// Byte within the head.
    pub byte: u64,
}

impl fmt::Display for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "token {} head {} byte {}",
            self.token, self.head, self.byte
        )
    }
}

/// Why a plan does not move the request exactly.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckError {
    /// The layouts or the request are not valid.
    #[error("invalid input: {0}")]
    Input(#[from] KvError),
    /// The plan's layer or component count is not the layouts'.
    #[error(
        "the plan is for {plan_layers} layers x {plan_components} components, the layouts have {layers} x {components}"
    )]
    Shape {
        /// Layers in the plan.
        plan_layers: u32,
        /// Components in the plan.
        plan_components: u32,
        /// Layers of the layouts.
        layers: u32,
        /// Components of the layouts.
        components: u32,
    },
    /// A pair names a rank that has no layout.
    #[error("a pair names {side} rank {rank}, which has no layout")]
    UnknownRank {
        /// Which side.
        side: Side,
        /// The rank.
        rank: u32,
    },
    /// A run the engine would refuse: rows shorter apart than they are long, or offsets
    /// past 64 bits.
    #[error("run {run} of prefill {prefill} -> decode {decode} is malformed: {reason}")]
    BadRun {
        /// Prefill rank.
        prefill: u32,
        /// Decode rank.
        decode: u32,
        /// Index of the run in its pair.
        run: usize,
        /// What is wrong.
        reason: String,
    },
    /// A run touches a byte that is not a byte of the request's tokens in that side's
    /// cache (a gap between cells, a block outside the request, a token past its end).
    #[error(
        "run {run} row {row} of prefill {prefill} -> decode {decode}: {side} tensor offset \
         {offset} is not a byte of the request"
    )]
    Stray {
        /// Prefill rank.
        prefill: u32,
        /// Decode rank.
        decode: u32,
        /// Run index.
        run: usize,
        /// Row of the run.
        row: u64,
        /// The side whose byte it is.
        side: Side,
        /// Offset in that side's tensor.
        offset: u64,
    },
    /// A run carries a byte to the wrong place.
    #[error(
        "run {run} row {row} of prefill {prefill} -> decode {decode} carries {from} into {into}"
    )]
    Misplaced {
        /// Prefill rank.
        prefill: u32,
        /// Decode rank.
        decode: u32,
        /// Run index.
        run: usize,
        /// Row of the run.
        row: u64,
        /// The prefill byte read.
        from: Cell,
        /// The decode byte written.
        into: Cell,
    },
    /// A decode rank receives more bytes than the request holds for it.
    #[error(
        "decode rank {decode} receives {written} bytes per tensor, its share of the request is {expected}"
    )]
    Excess {
        /// Decode rank.
        decode: u32,
        /// Bytes the plan writes into it.
        written: u128,
        /// Bytes it should receive.
        expected: u128,
    },
    /// A decode byte written twice.
    #[error("decode rank {decode}: {at} is written more than once")]
    Twice {
        /// Decode rank.
        decode: u32,
        /// The first byte written twice.
        at: Cell,
    },
    /// A decode byte never written.
    #[error("decode rank {decode}: {at} is never written")]
    Missing {
        /// Decode rank.
        decode: u32,
        /// The first byte missing.
        at: Cell,
    },
}

/// Checks that `plan` moves `req` exactly: for every decode rank, every byte of every
/// (token below `num_tokens`, head it holds, byte of the head) lands exactly once, read
/// from the same (token, head, byte) of a prefill rank that holds the head, and nothing
/// else of the decode rank's tensors is written. Runs are checked in one tensor's
/// coordinates: the plan applies them to every (layer, component), whose tensors the
/// layouts' validation keeps apart.
///
/// It works backwards from offsets: each byte range a row touches is decoded into
/// (block, token, head, byte) through the layout's strides and into the request's token
/// through the block table, a cell (not a byte) at a time; what lands is gathered as
/// intervals of decode's logical cache and must tile it. Cost: the cells moved.
pub fn check(
    prefill: &[KvLayout],
    decode: &[KvLayout],
    req: &KvRequest,
    plan: &KvPlan,
) -> Result<(), CheckError> {
    let first = crate::plan::check_layouts(prefill, decode)?;
    let mut sides: [Vec<Rank>; 2] = [Vec::new(), Vec::new()];
    for (si, (side, layouts)) in [(Side::Prefill, prefill), (Side::Decode, decode)]
        .into_iter()
        .enumerate()
    {
        let tables = match side {
            Side::Prefill => &req.prefill_blocks,
            Side::Decode => &req.decode_blocks,
        };
        for (rank, l) in layouts.iter().enumerate() {
            let rank_u32 = u32::try_from(rank).map_err(|_| KvError::Overflow { what: "rank" })?;
            let table = match tables.len() {
                1 => &tables[0],
                n if n == layouts.len() => &tables[rank],
                n => {
                    return Err(KvError::Tables {
                        side,
                        tables: n,
                        ranks: layouts.len(),
                    }
                    .into());
                }
            };
            sides[si].push(Rank::new(side, rank_u32, l, table, req.num_tokens)?);
        }
    }
    let [pre, dec] = sides;
    if (plan.num_layers, plan.components) != (first.num_layers, first.components) {
        return Err(CheckError::Shape {
            plan_layers: plan.num_layers,
            plan_components: plan.components,
            layers: first.num_layers,
            components: first.components,
        });
    }
    let head_bytes = first.head_bytes;
    let mut landed: Vec<Vec<(u128, u128)>> = vec![Vec::new(); dec.len()];
    let mut written = vec![0u128; dec.len()];
    for pair in &plan.pairs {
        let (p, d) = (pair.prefill, pair.decode);
        let src = pre.get(p as usize).ok_or(CheckError::UnknownRank {
            side: Side::Prefill,
            rank: p,
        })?;
        let dst = dec.get(d as usize).ok_or(CheckError::UnknownRank {
            side: Side::Decode,
            rank: d,
        })?;
        // Bound the walk: a decode rank can receive no more than its share.
        for (i, r) in pair.runs.iter().enumerate() {
            run_shape(r).map_err(|reason| CheckError::BadRun {
                prefill: p,
                decode: d,
                run: i,
                reason,
            })?;
            written[d as usize] =
                written[d as usize].saturating_add(u128::from(r.count) * u128::from(r.len));
        }
        if written[d as usize] > dst.share {
            return Err(CheckError::Excess {
                decode: d,
                written: written[d as usize],
                expected: dst.share,
            });
        }
        for (i, r) in pair.runs.iter().enumerate() {
            for row in 0..r.count {
                let s0 = u128::from(r.src_offset) + u128::from(row) * u128::from(r.src_stride);
                let d0 = u128::from(r.dst_offset) + u128::from(row) * u128::from(r.dst_stride);
                let stray = |side, offset: u128| CheckError::Stray {
                    prefill: p,
                    decode: d,
                    run: i,
                    row,
                    side,
                    offset: u64::try_from(offset).unwrap_or(u64::MAX),
                };
                let mut x = 0u128;
                while x < u128::from(r.len) {
                    let from = src
                        .cell(s0 + x)
                        .ok_or_else(|| stray(Side::Prefill, s0 + x))?;
                    let into = dst
                        .cell(d0 + x)
                        .ok_or_else(|| stray(Side::Decode, d0 + x))?;
                    if from != into {
                        return Err(CheckError::Misplaced {
                            prefill: p,
                            decode: d,
                            run: i,
                            row,
                            from,
                            into,
                        });
                    }
                    let step = (u128::from(head_bytes - into.byte)).min(u128::from(r.len) - x);
                    let at = dst.logical(into);
                    let ivs = &mut landed[d as usize];
                    match ivs.last_mut() {
                        Some(last) if last.1 == at => last.1 += step,
                        _ => ivs.push((at, at + step)),
                    }
                    x += step;
                }
            }
        }
    }
    for (d, mut ivs) in landed.into_iter().enumerate() {
        let rank = &dec[d];
        ivs.sort_unstable();
        let mut cursor = 0u128;
        for (a, b) in ivs {
            if a < cursor {
                return Err(CheckError::Twice {
                    decode: d as u32,
                    at: rank.unlogical(a),
                });
            }
            if a > cursor {
                return Err(CheckError::Missing {
                    decode: d as u32,
                    at: rank.unlogical(cursor),
                });
            }
            cursor = b;
        }
        if cursor < rank.share {
            return Err(CheckError::Missing {
                decode: d as u32,
                at: rank.unlogical(cursor),
            });
        }
    }
    Ok(())
}

/// Whether the engine would take `r` as it is.
fn run_shape(r: &StridedRun) -> Result<(), String> {
    if r.count >= 2 && (r.src_stride < r.len || r.dst_stride < r.len) {
        return Err(format!(
            "rows of {} bytes at strides {} and {} overlap",
            r.len, r.src_stride, r.dst_stride
        ));
    }
    let last = |off: u64, stride: u64| {
        r.count
            .saturating_sub(1)
            .checked_mul(stride)
            .and_then(|v| v.checked_add(off))
            .and_then(|v| v.checked_add(r.len))
    };
    if r.count >= 1
        && (last(r.src_offset, r.src_stride).is_none()
            || last(r.dst_offset, r.dst_stride).is_none())
    {
        return Err("its rows reach past 64-bit offsets".into());
    }
    Ok(())
}

/// One rank as the checker sees it: how to turn a tensor offset into a cell of the
/// request.
struct Rank {
    /// (stride, extent, which) of the dimensions of two entries or more, largest stride
    /// first; `which` is 0 block, 1 token, 2 head.
    dims: Vec<(u128, u128, usize)>,
    head_bytes: u128,
    block_size: u128,
    first_head: u32,
    heads: u128,
    tokens: u128,
    /// Block id -> position in the request's table.
    position: HashMap<u64, u128>,
    /// Bytes of the request this rank holds per tensor (tokens × heads × head bytes).
    share: u128,
}

impl Rank {
    fn new(
        side: Side,
        rank: u32,
        l: &KvLayout,
        table: &[u32],
        tokens: u64,
    ) -> Result<Rank, KvError> {
        let heads = u128::from(l.heads.end - l.heads.start);
        let mut dims: Vec<(u128, u128, usize)> = [
            (l.block_stride, l.num_blocks, 0),
            (l.token_stride, l.block_size, 1),
            (l.head_stride, l.heads.end - l.heads.start, 2),
        ]
        .into_iter()
        .filter(|&(_, e, _)| e >= 2)
        .map(|(s, e, w)| (u128::from(s), u128::from(e), w))
        .collect();
        dims.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
        let bs = u64::from(l.block_size);
        let blocks = tokens.div_ceil(bs);
        if blocks > table.len() as u64 {
            return Err(KvError::TableTooShort {
                side,
                rank,
                blocks: table.len(),
                needed: blocks,
                tokens,
            });
        }
        let mut position = HashMap::new();
        for (i, &b) in table.iter().take(blocks as usize).enumerate() {
            if b >= l.num_blocks {
                return Err(KvError::BlockOutOfRange {
                    side,
                    rank,
                    index: i,
                    block: b,
                    num_blocks: l.num_blocks,
                });
            }
            if position.insert(u64::from(b), i as u128).is_some() {
                return Err(KvError::DuplicateBlock {
                    side,
                    rank,
                    block: b,
                });
            }
        }
        Ok(Rank {
            dims,
            head_bytes: u128::from(l.head_bytes),
            block_size: u128::from(bs),
            first_head: l.heads.start,
            heads,
            tokens: u128::from(tokens),
            position,
            share: u128::from(tokens) * heads * u128::from(l.head_bytes),
        })
    }

    /// The request's byte at tensor offset `off`, if it is one.
    fn cell(&self, mut off: u128) -> Option<Cell> {
        let mut idx = [0u128; 3];
        for &(stride, extent, which) in &self.dims {
            let q = off / stride;
            if q >= extent {
                return None;
            }
            idx[which] = q;
            off -= q * stride;
        }
        if off >= self.head_bytes {
            return None;
        }
        let pos = self.position.get(&u64::try_from(idx[0]).ok()?)?;
        let token = pos * self.block_size + idx[1];
        if token >= self.tokens {
            return None;
        }
        Some(Cell {
            token: u64::try_from(token).ok()?,
            head: self.first_head + u32::try_from(idx[2]).ok()?,
            byte: u64::try_from(off).ok()?,
        })
    }

    /// Position of a cell in this rank's logical cache, token-major.
    fn logical(&self, c: Cell) -> u128 {
        (u128::from(c.token) * self.heads + u128::from(c.head - self.first_head)) * self.head_bytes
            + u128::from(c.byte)
    }

    fn unlogical(&self, at: u128) -> Cell {
        let byte = at % self.head_bytes;
        let th = at / self.head_bytes;
        Cell {
            token: u64::try_from(th / self.heads).unwrap_or(u64::MAX),
            head: self
                .first_head
                .saturating_add(u32::try_from(th % self.heads).unwrap_or(u32::MAX)),
            byte: byte as u64,
        }
    }
}
