//! One request's blocks on both sides ([`KvRequest`]).

use serde::{Deserialize, Serialize};

use crate::error::{KvError, Result, Side};
use crate::layout::KvLayout;

/// A request to move: its tokens and the blocks that hold them on each side.
///
/// Token `t` of the request lies in block `table[t / block_size]`, at position
/// `t % block_size` of it, with the rank's own table and block size. A side gives one
/// table shared by all its ranks (the usual case: one scheduler allocates for a whole TP
/// group) or one per rank. Entries past the ones the tokens need are ignored; the ones
/// used must be distinct blocks of the rank's cache.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvRequest {
    /// Tokens to move, from token 0; the last block may be partly filled.
    pub num_tokens: u64,
    /// Prefill's block tables: one shared by every prefill rank, or one per rank.
    pub prefill_blocks: Vec<Vec<u32>>,
    /// Decode's block tables: one shared by every decode rank, or one per rank.
    pub decode_blocks: Vec<Vec<u32>>,
}

impl KvRequest {
    /// A request whose prefill ranks share one block table and decode ranks another.
    pub fn new(num_tokens: u64, prefill_blocks: Vec<u32>, decode_blocks: Vec<u32>) -> KvRequest {
        KvRequest {
            num_tokens,
            prefill_blocks: vec![prefill_blocks],
            decode_blocks: vec![decode_blocks],
        }
    }

    /// A request with a block table per rank (a table list of length 1 is shared).
    pub fn per_rank(
        num_tokens: u64,
        prefill_blocks: Vec<Vec<u32>>,
        decode_blocks: Vec<Vec<u32>>,
    ) -> KvRequest {
        KvRequest {
            num_tokens,
            prefill_blocks,
            decode_blocks,
        }
    }

    /// The block table of `side`'s rank `rank`, of a side with `ranks` ranks.
    pub fn table(&self, side: Side, rank: u32, ranks: usize) -> Result<&[u32]> {
        let tables = match side {
            Side::Prefill => &self.prefill_blocks,
            Side::Decode => &self.decode_blocks,
        };
        let wrong = KvError::Tables {
            side,
            tables: tables.len(),
            ranks,
        };
        match tables.len() {
            1 => Ok(&tables[0]),
            n if n == ranks => tables.get(rank as usize).map(Vec::as_slice).ok_or(wrong),
            _ => Err(wrong),
        }
    }

    /// Checks the tables against both sides' layouts: the right number of tables, each
    /// long enough for the tokens, with distinct blocks that exist.
    pub fn validate(&self, prefill: &[KvLayout], decode: &[KvLayout]) -> Result<()> {
        for (side, layouts) in [(Side::Prefill, prefill), (Side::Decode, decode)] {
            let mut seen = Vec::new();
            for (rank, layout) in layouts.iter().enumerate() {
                let rank = u32::try_from(rank).map_err(|_| KvError::Overflow { what: "rank" })?;
                let table = self.table(side, rank, layouts.len())?;
                let needed = blocks_for(self.num_tokens, layout.block_size)?;
                let used = usize::try_from(needed)
                    .ok()
                    .filter(|&n| n <= table.len())
                    .ok_or(KvError::TableTooShort {
                        side,
                        rank,
                        blocks: table.len(),
                        needed,
                        tokens: self.num_tokens,
                    })?;
                seen.clear();
                seen.resize(layout.num_blocks as usize, false);
                for (index, &block) in table[..used].iter().enumerate() {
                    let slot = seen
                        .get_mut(block as usize)
                        .ok_or(KvError::BlockOutOfRange {
                            side,
                            rank,
                            index,
                            block,
                            num_blocks: layout.num_blocks,
                        })?;
                    if std::mem::replace(slot, true) {
                        return Err(KvError::DuplicateBlock { side, rank, block });
                    }
                }
            }
        }
        Ok(())
    }
}

/// Blocks of `block_size` tokens that `tokens` tokens fill (the last one maybe partly).
pub(crate) fn blocks_for(tokens: u64, block_size: u32) -> Result<u64> {
    if block_size == 0 {
        return Err(KvError::Zero {
            field: "block_size",
        });
    }
    Ok(tokens.div_ceil(u64::from(block_size)))
}
