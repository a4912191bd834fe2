//! The errors of layouts, requests and planning ([`KvError`]); the checker's are
//! [`CheckError`](crate::CheckError).

use std::fmt;

/// Which side of a transfer a rank, table or layout belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Side {
    /// The prefill server: the ranks that computed the KV cache (the bytes' source).
    Prefill,
    /// The decode server: the ranks whose paged caches receive it.
    Decode,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        })
    }
}

/// A layout, request or plan that cannot be used, with what was wrong and where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// A count that must be positive is zero.
    #[error("{field} is 0; a KV layout needs at least one")]
    Zero {
        /// The field (`num_layers`, `block_size`, ...).
        field: &'static str,
    },
    /// `head_bytes` is not `head_dim × elem_size`.
    #[error("head_bytes {head_bytes} is not head_dim {head_dim} x elem_size {elem_size}")]
    HeadBytes {
        /// Elements per head.
        head_dim: u32,
        /// Bytes per element.
        elem_size: u32,
        /// The bytes of one head as given.
        head_bytes: u64,
    },
    /// The rank's heads are empty or reach past the model's KV heads.
    #[error("head range {start}..{end} is empty or not within the model's {total} KV heads")]
    HeadRange {
        /// First head.
        start: u32,
        /// One past the last head.
        end: u32,
        /// The model's KV heads.
        total: u32,
    },
    /// The strides let two (block, token, head) cells of one tensor share a byte: sorted by
    /// stride, each dimension's stride must be at least the bytes the smaller ones span.
    #[error(
        "strides alias: block {block_stride}, token {token_stride}, head {head_stride} \
         with {num_blocks} blocks of {block_size} tokens, {heads} heads of {head_bytes} bytes"
    )]
    Aliasing {
        /// Bytes from one block to the next.
        block_stride: u64,
        /// Bytes from one token to the next within a block.
        token_stride: u64,
        /// Bytes from one head to the next.
        head_stride: u64,
        /// Blocks.
        num_blocks: u32,
        /// Tokens per block.
        block_size: u32,
        /// The rank's heads.
        heads: u32,
        /// Bytes per head.
        head_bytes: u64,
    },
    /// `places` does not hold one place per (layer, component).
    #[error("{found} tensor places for {layers} layers x {components} components")]
    Places {
        /// Layers.
        layers: u32,
        /// Components.
        components: u32,
        /// Places given.
        found: usize,
    },
    /// A (layer, component) asked of a layout that has no such tensor.
    #[error(
        "no tensor for layer {layer}, component {component} (layout has {layers} x {components})"
    )]
    NoTensor {
        /// Layer asked.
        layer: u32,
        /// Component asked.
        component: u32,
        /// Layers.
        layers: u32,
        /// Components.
        components: u32,
    },
    /// Two (layer, component) tensors placed in one region share a byte.
    #[error(
        "region {region}: layer {a_layer} component {a_component} and layer {b_layer} \
         component {b_component} share bytes"
    )]
    PlacesOverlap {
        /// The region.
        region: u32,
        /// First tensor's layer.
        a_layer: u32,
        /// First tensor's component.
        a_component: u32,
        /// Second tensor's layer.
        b_layer: u32,
        /// Second tensor's component.
        b_component: u32,
    },
    /// A tensor is placed in a region the rank did not list.
    #[error(
        "layer {layer} component {component} is in region {region}, but {regions} regions were given"
    )]
    NoRegion {
        /// Layer.
        layer: u32,
        /// Component.
        component: u32,
        /// Its region.
        region: u32,
        /// Regions given.
        regions: usize,
    },
    /// A tensor reaches past the end of its region.
    #[error(
        "layer {layer} component {component} needs {needed} bytes of region {region}, which has {len}"
    )]
    RegionTooSmall {
        /// Layer.
        layer: u32,
        /// Component.
        component: u32,
        /// Its region.
        region: u32,
        /// Bytes from the region's start to the tensor's last byte + 1.
        needed: u64,
        /// The region's length.
        len: u64,
    },
    /// A size or offset does not fit in 64 bits.
    #[error("{what} overflows 64 bits")]
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
    /// A tensor-parallel rank outside its group.
    #[error("rank {rank} is not in a tensor-parallel group of {tp}")]
    TpRank {
        /// Group size.
        tp: u32,
        /// The rank.
        rank: u32,
    },
    /// Neither the KV heads divide over the ranks nor the ranks over the heads.
    #[error("{kv_heads} KV heads split over TP {tp}: neither divides the other")]
    TpSplit {
        /// The model's KV heads.
        kv_heads: u32,
        /// Group size.
        tp: u32,
    },
    /// A side has no ranks.
    #[error("the {side} side has no ranks")]
    NoRanks {
        /// Which side.
        side: Side,
    },
    /// A rank's geometry differs from the first prefill rank's.
    #[error("{side} rank {rank}: {field} is {found}, the first prefill rank's is {expected}")]
    Mismatch {
        /// Which side.
        side: Side,
        /// The rank.
        rank: u32,
        /// The field that differs.
        field: &'static str,
        /// The first prefill rank's value.
        expected: u64,
        /// This rank's value.
        found: u64,
    },
    /// A layout that is not valid, named by side and rank.
    #[error("{side} rank {rank}: {source}")]
    Layout {
        /// Which side.
        side: Side,
        /// The rank.
        rank: u32,
        /// What is wrong with its layout.
        #[source]
        source: Box<KvError>,
    },
    /// A request's block tables are neither one shared table nor one per rank.
    #[error("{tables} {side} block tables for {ranks} ranks (give 1 shared or 1 per rank)")]
    Tables {
        /// Which side.
        side: Side,
        /// Tables given.
        tables: usize,
        /// Ranks.
        ranks: usize,
    },
    /// A block table is shorter than the request's tokens need.
    #[error(
        "{side} rank {rank}: {blocks} blocks hold fewer than the request's {tokens} tokens ({needed} needed)"
    )]
    TableTooShort {
        /// Which side.
        side: Side,
        /// The rank.
        rank: u32,
        /// Blocks in its table.
        blocks: usize,
        /// Blocks needed.
        needed: u64,
        /// Tokens of the request.
        tokens: u64,
    },
    /// A block id past the rank's cache.
    #[error(
        "{side} rank {rank}: block {block} (table entry {index}) is not below num_blocks {num_blocks}"
    )]
    BlockOutOfRange {
        /// Which side.
        side: Side,
        /// The rank.
        rank: u32,
        /// Position in the table.
        index: usize,
        /// The block id.
        block: u32,
        /// Blocks of the rank's cache.
        num_blocks: u32,
    },
    /// A block id twice in a table's used part.
    #[error("{side} rank {rank}: block {block} appears twice in the block table")]
    DuplicateBlock {
        /// Which side.
        side: Side,
        /// The rank.
        rank: u32,
        /// The block id.
        block: u32,
    },
    /// A head a decode rank needs that no prefill rank holds.
    #[error("decode rank {rank} needs KV head {head}, which no prefill rank holds")]
    HeadNotHeld {
        /// The decode rank.
        rank: u32,
        /// The global KV head.
        head: u32,
    },
    /// A plan names a rank that is not in the layouts given.
    #[error("the plan names {side} rank {rank}, but {ranks} layouts were given")]
    UnknownRank {
        /// Which side.
        side: Side,
        /// The rank.
        rank: u32,
        /// Layouts given.
        ranks: usize,
    },
    /// A run of a plan that is not a valid strided run.
    #[error("run {run} of pair prefill {prefill} -> decode {decode} is not a valid strided run")]
    BadRun {
        /// Prefill rank.
        prefill: u32,
        /// Decode rank.
        decode: u32,
        /// Index of the run in the pair.
        run: usize,
    },
}

/// Shorthand for this crate's results.
pub type Result<T, E = KvError> = std::result::Result<T, E>;

pub(crate) fn mul(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_mul(b).ok_or(KvError::Overflow { what })
}

pub(crate) fn add(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_add(b).ok_or(KvError::Overflow { what })
}
