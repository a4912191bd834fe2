//! What one rank holds of a model's tensors, and where ([`Layout`]).
//!
//! A layout names the rank's registered regions ([`RegionSpec`]), declares the tensors it
//! knows ([`TensorSpec`]: global shape, element size) and lists its pieces ([`Piece`]): of
//! which tensor, which part ([`Holding`]: a box of the global index space, or a flat range
//! of the row-major tensor), stored contiguously (row-major over the box, or in flat order)
//! at a byte offset of one of its regions. Layouts may come from the network: they are
//! serde types, and [`Layout::validate`] refuses every inconsistency with a typed
//! [`LayoutError`] (the planner validates what it is given).
//!
//! The tensor table is an `Arc` so that the layouts of one model built in one process share
//! it (hundreds of ranks times tens of thousands of tensors); serialised, each layout
//! carries its own copy.
//!
//! ```
//! use std::sync::Arc;
//! use xfer::weights::{Holding, Layout, TensorSpec};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let tensors: Arc<[TensorSpec]> = Arc::from(vec![TensorSpec::new("w", vec![4, 6], 2)]);
//! // Tensor-parallel rank 1 of 2 along the columns, and an FSDP shard cut mid-row.
//! let tp = Layout::pack(tensors.clone(), "weights", [(0, Holding::split(&[4, 6], 1, 2, 1)?)])?;
//! let fsdp = Layout::pack(tensors, "weights", [(0, Holding::flat_shard(24, 3, 1))])?;
//! assert_eq!(tp.pieces[0].holding, Holding::Box(vec![0..4, 3..6]));
//! assert_eq!(fsdp.pieces[0].holding, Holding::Flat(8..16));
//! assert_eq!(tp.regions[0].len, 24); // 12 elements of 2 bytes
//! tp.validate()?;
//! # Ok(())
//! # }
//! ```

use super::geometry::{Bx, dims_of, stored_boxes};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// The most dimensions a tensor may have.
pub const MAX_DIMS: usize = 8;

/// A tensor as every rank sees it: its name, global shape and element size.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorSpec {
    /// The name, unique in a layout and the same on every rank (`layers.3.mlp.up_proj`).
    pub name: String,
    /// The global shape (`[]` is a scalar).
    pub shape: Vec<u64>,
    /// Bytes per element (2 for BF16).
    pub elem_size: u32,
}

impl TensorSpec {
    /// A tensor `name` of `shape` with elements of `elem_size` bytes.
    pub fn new(name: impl Into<String>, shape: Vec<u64>, elem_size: u32) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            shape,
            elem_size,
        }
    }

    /// The number of elements, or `None` if it overflows `u64`.
    pub fn elements(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
    }

    /// The size in bytes, or `None` if it overflows `u64`.
    pub fn bytes(&self) -> Option<u64> {
        self.elements()?.checked_mul(u64::from(self.elem_size))
    }
}

/// A registered region of a rank, as the agent offers it (`Agent::offer(name, ..)`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionSpec {
    /// The name the region is offered under.
    pub name: String,
    /// Its length in bytes: every piece lies inside.
    pub len: u64,
}

/// Which elements of a tensor a piece holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Holding {
    /// A box of the global index space, `start..end` per dimension (a tensor-parallel
    /// split along any dimension, a vocab-parallel embedding, the full box of a replicated
    /// tensor), stored row-major over the box.
    Box(Vec<Range<u64>>),
    /// Elements `start..end` of the row-major flattened tensor (an FSDP/ZeRO flat shard,
    /// which may start and end mid-row), stored in that order.
    Flat(Range<u64>),
}

impl Holding {
    /// The whole tensor of `shape`, as a box.
    pub fn whole(shape: &[u64]) -> Holding {
        Holding::Box(shape.iter().map(|&d| 0..d).collect())
    }

    /// Part `index` of `parts` of an even split of dimension `dim` of `shape` (the first
    /// `shape[dim] % parts` parts one longer), as Megatron splits a tensor-parallel weight.
    /// Fails with [`LayoutError::BadSplit`] if `dim` is not a dimension or `index >= parts`.
    pub fn split(
        shape: &[u64],
        dim: usize,
        parts: u64,
        index: u64,
    ) -> Result<Holding, LayoutError> {
        if dim >= shape.len() || index >= parts {
            return Err(LayoutError::BadSplit {
                dims: shape.len(),
                dim,
                parts,
                index,
            });
        }
        let mut b: Vec<Range<u64>> = shape.iter().map(|&d| 0..d).collect();
        b[dim] = even_part(shape[dim], parts, index);
        Ok(Holding::Box(b))
    }

    /// Shard `index` of `parts` of an even split of the flat range `0..elements` (the first
    /// `elements % parts` shards one longer), as FSDP shards a flattened tensor; an index
    /// past the end gives an empty range.
    pub fn flat_shard(elements: u64, parts: u64, index: u64) -> Holding {
        if parts == 0 || index >= parts {
            return Holding::Flat(elements..elements);
        }
        Holding::Flat(even_part(elements, parts, index))
    }

    /// The number of elements held, if the holding fits a tensor of `nd` dimensions (else
    /// `None`; a reversed range counts as `None`).
    pub fn elements(&self, nd: usize) -> Option<u64> {
        match self {
            Holding::Flat(r) => r.end.checked_sub(r.start),
            Holding::Box(b) if b.len() == nd => b
                .iter()
                .try_fold(1u64, |a, r| a.checked_mul(r.end.checked_sub(r.start)?)),
            Holding::Box(_) => None,
        }
    }
}

/// `0..n` cut into `parts` near-equal ranges, the first `n % parts` one longer: range `i`.
fn even_part(n: u64, parts: u64, i: u64) -> Range<u64> {
    let (q, r) = (n / parts, n % parts);
    let start = i * q + i.min(r);
    start..start + q + u64::from(i < r)
}

/// A part of one tensor held by a rank, stored contiguously in one of its regions.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Piece {
    /// The tensor: an index into [`Layout::tensors`].
    pub tensor: u32,
    /// Which of its elements.
    pub holding: Holding,
    /// The region: an index into [`Layout::regions`].
    pub region: u32,
    /// The byte offset of the first element in the region.
    pub offset: u64,
}

/// What one rank holds of each tensor, and where (see the [module documentation](self)).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// The rank's registered regions.
    pub regions: Vec<RegionSpec>,
    /// The tensors the pieces refer to.
    pub tensors: Arc<[TensorSpec]>,
    /// The pieces this rank holds.
    pub pieces: Vec<Piece>,
}

impl Layout {
    /// A layout with one region `region`, holding `holdings` (tensor index, holding) packed
    /// one after the other in that order; the region is as long as they are. Validated.
    pub fn pack(
        tensors: Arc<[TensorSpec]>,
        region: &str,
        holdings: impl IntoIterator<Item = (u32, Holding)>,
    ) -> Result<Layout, LayoutError> {
        validate_tensors(&tensors)?;
        let mut pieces = Vec::new();
        let mut at = 0u64;
        for (tensor, holding) in holdings {
            let i = pieces.len();
            let spec = tensors
                .get(tensor as usize)
                .ok_or_else(|| LayoutError::UnknownTensor {
                    piece: i,
                    index: tensor,
                    count: tensors.len(),
                })?;
            let bytes = piece_bytes(spec, &holding, i)?;
            pieces.push(Piece {
                tensor,
                holding,
                region: 0,
                offset: at,
            });
            at = at.checked_add(bytes).ok_or(LayoutError::RegionOverflow)?;
        }
        let layout = Layout {
            regions: vec![RegionSpec {
                name: region.to_owned(),
                len: at,
            }],
            tensors,
            pieces,
        };
        layout.validate_pieces()?;
        Ok(layout)
    }

    /// The index of the region named `name`.
    pub fn region_named(&self, name: &str) -> Option<u32> {
        self.regions
            .iter()
            .position(|r| r.name == name)
            .and_then(|i| u32::try_from(i).ok())
    }

    /// The index of the tensor named `name`.
    pub fn tensor_named(&self, name: &str) -> Option<u32> {
        self.tensors
            .iter()
            .position(|t| t.name == name)
            .and_then(|i| u32::try_from(i).ok())
    }

    /// Checks everything the planner relies on: the tensor table (element sizes, sizes
    /// that fit `u64`, unique names, at most [`MAX_DIMS`] dimensions), each piece (known
    /// tensor and region, a box inside the shape, a flat range inside the tensor, bytes
    /// inside the region), and that no two pieces hold the same element of a tensor or
    /// share a byte of a region.
    pub fn validate(&self) -> Result<(), LayoutError> {
        validate_tensors(&self.tensors)?;
        self.validate_pieces()
    }

    /// [`Layout::validate`] without the tensor table (the planner checks each shared table
    /// once).
    pub(crate) fn validate_pieces(&self) -> Result<(), LayoutError> {
        let tensors = &self.tensors;
        let mut by_region: Vec<(u32, u64, u64, usize)> = Vec::with_capacity(self.pieces.len());
        for (i, p) in self.pieces.iter().enumerate() {
            let spec =
                tensors
                    .get(p.tensor as usize)
                    .ok_or_else(|| LayoutError::UnknownTensor {
                        piece: i,
                        index: p.tensor,
                        count: tensors.len(),
                    })?;
            let region = self
                .regions
                .get(p.region as usize)
                .ok_or(LayoutError::UnknownRegion {
                    piece: i,
                    index: p.region,
                    count: self.regions.len(),
                })?;
            let bytes = piece_bytes(spec, &p.holding, i)?;
            let end = p.offset.checked_add(bytes).filter(|&e| e <= region.len);
            let Some(end) = end else {
                return Err(LayoutError::PieceOutsideRegion {
                    piece: i,
                    tensor: spec.name.clone(),
                    start: p.offset,
                    bytes,
                    region: region.name.clone(),
                    len: region.len,
                });
            };
            if bytes > 0 {
                by_region.push((p.region, p.offset, end, i));
            }
        }
        by_region.sort_unstable();
        for w in by_region.windows(2) {
            let ((ra, _, ea, a), (rb, sb, _, b)) = (w[0], w[1]);
            if ra == rb && sb < ea {
                let (a, b) = (a.min(b), a.max(b));
                return Err(LayoutError::OverlappingBytes {
                    region: self.regions[ra as usize].name.clone(),
                    first: a,
                    second: b,
                });
            }
        }
        self.check_element_overlaps()
    }

    /// No two pieces of one tensor share an element.
    fn check_element_overlaps(&self) -> Result<(), LayoutError> {
        let mut order: Vec<(u32, usize)> = self
            .pieces
            .iter()
            .enumerate()
            .map(|(i, p)| (p.tensor, i))
            .collect();
        order.sort_unstable();
        let mut boxes: Vec<(Bx, usize)> = Vec::new();
        for group in order.chunk_by(|a, b| a.0 == b.0) {
            if group.len() < 2 {
                continue;
            }
            let spec = &self.tensors[group[0].0 as usize];
            let (nd, _) = dims_of(spec);
            boxes.clear();
            for &(_, i) in group {
                stored_boxes(spec, &self.pieces[i], 0, &mut |b, _| boxes.push((b, i)));
            }
            boxes.sort_unstable_by_key(|(b, _)| (b.lo[0], b.hi[0]));
            // Sweep along the first dimension: only boxes still open there can overlap.
            let mut open: Vec<usize> = Vec::new();
            for k in 0..boxes.len() {
                let (b, i) = boxes[k];
                open.retain(|&o| boxes[o].0.hi[0] > b.lo[0]);
                for &o in &open {
                    let (ob, oi) = boxes[o];
                    if oi != i && ob.overlaps(&b, nd) {
                        let at = ob.intersect(&b, nd).unwrap_or(b);
                        return Err(LayoutError::OverlappingPieces {
                            tensor: spec.name.clone(),
                            first: oi.min(i),
                            second: oi.max(i),
                            elements: at.to_public(spec.shape.len().max(1)),
                        });
                    }
                }
                open.push(k);
            }
        }
        Ok(())
    }
}

/// The bytes a holding of `spec` takes, checking that it lies inside the tensor.
fn piece_bytes(spec: &TensorSpec, h: &Holding, piece: usize) -> Result<u64, LayoutError> {
    let elements = match h {
        Holding::Flat(r) => {
            let n = spec.elements().unwrap_or(u64::MAX);
            if r.start > r.end || r.end > n {
                return Err(LayoutError::FlatOutsideTensor {
                    piece,
                    tensor: spec.name.clone(),
                    range: r.clone(),
                    elements: n,
                });
            }
            r.end - r.start
        }
        Holding::Box(b) => {
            if b.len() != spec.shape.len() {
                return Err(LayoutError::BoxRank {
                    piece,
                    tensor: spec.name.clone(),
                    got: b.len(),
                    want: spec.shape.len(),
                });
            }
            let mut n = 1u64;
            for (dim, (r, &extent)) in b.iter().zip(&spec.shape).enumerate() {
                if r.start > r.end || r.end > extent {
                    return Err(LayoutError::BoxOutsideShape {
                        piece,
                        tensor: spec.name.clone(),
                        dim,
                        range: r.clone(),
                        extent,
                    });
                }
                n *= r.end - r.start; // no overflow: at most the tensor's elements
            }
            n
        }
    };
    // No overflow: at most the tensor's bytes, which validate_tensors checked.
    Ok(elements * u64::from(spec.elem_size))
}

/// Checks a tensor table: element sizes, sizes that fit `u64`, dimensions, unique names.
pub(crate) fn validate_tensors(tensors: &[TensorSpec]) -> Result<(), LayoutError> {
    let mut names = HashSet::with_capacity(tensors.len());
    for t in tensors {
        if t.elem_size == 0 {
            return Err(LayoutError::ZeroElementSize {
                tensor: t.name.clone(),
            });
        }
        if t.shape.len() > MAX_DIMS {
            return Err(LayoutError::TooManyDimensions {
                tensor: t.name.clone(),
                dims: t.shape.len(),
            });
        }
        if t.bytes().is_none() {
            return Err(LayoutError::SizeOverflow {
                tensor: t.name.clone(),
                shape: t.shape.clone(),
                elem_size: t.elem_size,
            });
        }
        if !names.insert(t.name.as_str()) {
            return Err(LayoutError::DuplicateTensor {
                tensor: t.name.clone(),
            });
        }
    }
    Ok(())
}

/// A box of a tensor's index space, `start..end` per dimension: how errors name elements.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ElementBox(pub Vec<Range<u64>>);

impl fmt::Display for ElementBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{}..{}", r.start, r.end)?;
        }
        write!(f, "]")
    }
}

/// Why a layout is refused. Pieces are named by their index in [`Layout::pieces`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// A tensor's element size is 0.
    #[error("tensor {tensor}: element size 0")]
    ZeroElementSize {
        /// The tensor.
        tensor: String,
    },
    /// A tensor's size in bytes does not fit `u64`.
    #[error("tensor {tensor}: shape {shape:?} of {elem_size}-byte elements overflows u64")]
    SizeOverflow {
        /// The tensor.
        tensor: String,
        /// Its shape.
        shape: Vec<u64>,
        /// Its element size.
        elem_size: u32,
    },
    /// A tensor has more than [`MAX_DIMS`] dimensions.
    #[error("tensor {tensor}: {dims} dimensions, at most {MAX_DIMS} are supported")]
    TooManyDimensions {
        /// The tensor.
        tensor: String,
        /// Its number of dimensions.
        dims: usize,
    },
    /// Two tensors of one table share a name.
    #[error("tensor {tensor} is declared twice")]
    DuplicateTensor {
        /// The name.
        tensor: String,
    },
    /// A piece names a tensor the table does not have.
    #[error("piece {piece}: tensor {index}, but the layout declares {count}")]
    UnknownTensor {
        /// The piece.
        piece: usize,
        /// The index it names.
        index: u32,
        /// The number of tensors declared.
        count: usize,
    },
    /// A piece names a region the layout does not have.
    #[error("piece {piece}: region {index}, but the layout has {count}")]
    UnknownRegion {
        /// The piece.
        piece: usize,
        /// The index it names.
        index: u32,
        /// The number of regions.
        count: usize,
    },
    /// A box has another number of dimensions than its tensor.
    #[error("piece {piece} of {tensor}: a box of {got} dimensions for a tensor of {want}")]
    BoxRank {
        /// The piece.
        piece: usize,
        /// The tensor.
        tensor: String,
        /// The box's dimensions.
        got: usize,
        /// The tensor's.
        want: usize,
    },
    /// A box is outside the tensor's shape (or a range of it is reversed).
    #[error("piece {piece} of {tensor}: dimension {dim} holds {range:?}, outside 0..{extent}")]
    BoxOutsideShape {
        /// The piece.
        piece: usize,
        /// The tensor.
        tensor: String,
        /// The dimension.
        dim: usize,
        /// The range held.
        range: Range<u64>,
        /// The dimension's extent.
        extent: u64,
    },
    /// A flat range is outside the tensor (or reversed).
    #[error("piece {piece} of {tensor}: flat range {range:?}, outside 0..{elements}")]
    FlatOutsideTensor {
        /// The piece.
        piece: usize,
        /// The tensor.
        tensor: String,
        /// The range held.
        range: Range<u64>,
        /// The tensor's number of elements.
        elements: u64,
    },
    /// A piece's bytes are not inside its region.
    #[error(
        "piece {piece} of {tensor}: {bytes} bytes at offset {start} do not fit region {region} \
         ({len} bytes)"
    )]
    PieceOutsideRegion {
        /// The piece.
        piece: usize,
        /// The tensor.
        tensor: String,
        /// Its offset.
        start: u64,
        /// Its length in bytes.
        bytes: u64,
        /// The region.
        region: String,
        /// The region's length.
        len: u64,
    },
    /// Two pieces hold the same element of a tensor.
    #[error("pieces {first} and {second} both hold elements {elements} of {tensor}")]
    OverlappingPieces {
        /// The tensor.
        tensor: String,
        /// The first piece.
        first: usize,
        /// The second piece.
        second: usize,
        /// Elements both hold.
        elements: ElementBox,
    },
    /// Two pieces share bytes of a region.
    #[error("pieces {first} and {second} overlap in the bytes of region {region}")]
    OverlappingBytes {
        /// The region.
        region: String,
        /// The first piece.
        first: usize,
        /// The second piece.
        second: usize,
    },
    /// [`Holding::split`] of a dimension the shape lacks, or of a part past the last.
    #[error("split of dimension {dim} of a {dims}-dimensional tensor into {parts}: part {index}")]
    BadSplit {
        /// The tensor's dimensions.
        dims: usize,
        /// The dimension asked for.
        dim: usize,
        /// The number of parts.
        parts: u64,
        /// The part asked for.
        index: u64,
    },
    /// [`Layout::pack`]'s pieces do not fit a `u64` of bytes.
    #[error("the packed pieces overflow u64 bytes")]
    RegionOverflow,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(shape: Vec<u64>, esize: u32) -> Arc<[TensorSpec]> {
        Arc::from(vec![TensorSpec::new("t", shape, esize)])
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)]
    fn each_inconsistency_is_refused_with_its_error() {
        let t = one(vec![4, 6], 2);
        let bad = |pieces: Vec<Piece>, len: u64| Layout {
            regions: vec![RegionSpec {
                name: "r".into(),
                len,
            }],
            tensors: t.clone(),
            pieces,
        };
        let piece = |holding, offset| Piece {
            tensor: 0,
            holding,
            region: 0,
            offset,
        };
        let e = bad(vec![piece(Holding::Box(vec![0..4, 2..7]), 0)], 100).validate();
        assert!(
            matches!(e, Err(LayoutError::BoxOutsideShape { dim: 1, .. })),
            "{e:?}"
        );
        let e = bad(vec![piece(Holding::Box(vec![0..4]), 0)], 100).validate();
        assert!(
            matches!(
                e,
                Err(LayoutError::BoxRank {
                    got: 1,
                    want: 2,
                    ..
                })
            ),
            "{e:?}"
        );
        #[allow(clippy::reversed_empty_ranges)]
        let e = bad(vec![piece(Holding::Flat(5..3), 0)], 100).validate();
        assert!(
            matches!(e, Err(LayoutError::FlatOutsideTensor { .. })),
            "{e:?}"
        );
        let e = bad(vec![piece(Holding::Flat(0..25), 0)], 100).validate();
        assert!(
            matches!(e, Err(LayoutError::FlatOutsideTensor { .. })),
            "{e:?}"
        );
        let e = bad(vec![piece(Holding::Flat(0..24), 1)], 48).validate();
        assert!(
            matches!(e, Err(LayoutError::PieceOutsideRegion { .. })),
            "{e:?}"
        );
        let e = bad(vec![piece(Holding::Flat(0..24), u64::MAX - 2)], u64::MAX).validate();
        assert!(
            matches!(e, Err(LayoutError::PieceOutsideRegion { .. })),
            "{e:?}"
        );
        // Flat 5..9 is row 0 col 5, row 1 cols 0..3: it meets the box rows 1..2, cols 2..4.
        let e = bad(
            vec![
                piece(Holding::Flat(5..9), 0),
                piece(Holding::Box(vec![1..2, 2..4]), 8),
            ],
            100,
        )
        .validate();
        assert_eq!(
            e,
            Err(LayoutError::OverlappingPieces {
                tensor: "t".into(),
                first: 0,
                second: 1,
                elements: ElementBox(vec![1..2, 2..3]),
            })
        );
        let e = bad(
            vec![piece(Holding::Flat(0..4), 0), piece(Holding::Flat(4..8), 7)],
            100,
        )
        .validate();
        assert!(
            matches!(
                e,
                Err(LayoutError::OverlappingBytes {
                    first: 0,
                    second: 1,
                    ..
                })
            ),
            "{e:?}"
        );
        let mut l = bad(vec![piece(Holding::Flat(0..4), 0)], 100);
        l.pieces[0].region = 3;
        assert!(matches!(
            l.validate(),
            Err(LayoutError::UnknownRegion { index: 3, .. })
        ));
        l.pieces[0].region = 0;
        l.pieces[0].tensor = 9;
        assert!(matches!(
            l.validate(),
            Err(LayoutError::UnknownTensor { index: 9, .. })
        ));
    }

    #[test]
    fn tensor_tables_are_checked() {
        let e = validate_tensors(&[TensorSpec::new("z", vec![3], 0)]);
        assert!(matches!(e, Err(LayoutError::ZeroElementSize { .. })));
        let e = validate_tensors(&[TensorSpec::new("big", vec![1 << 40, 1 << 30], 2)]);
        assert!(matches!(e, Err(LayoutError::SizeOverflow { .. })));
        let e = validate_tensors(&[TensorSpec::new("d", vec![1; 9], 1)]);
        assert!(matches!(
            e,
            Err(LayoutError::TooManyDimensions { dims: 9, .. })
        ));
        let e = validate_tensors(&[
            TensorSpec::new("a", vec![1], 1),
            TensorSpec::new("a", vec![2], 1),
        ]);
        assert!(matches!(e, Err(LayoutError::DuplicateTensor { .. })));
    }

    #[test]
    fn disjoint_pieces_of_one_tensor_and_empty_pieces_are_fine() {
        let t = one(vec![4, 6], 1);
        let l = Layout::pack(
            t,
            "r",
            [
                (0, Holding::Box(vec![0..4, 0..2])),
                (0, Holding::Flat(2..6)),
                (0, Holding::Box(vec![1..4, 2..6])),
                (0, Holding::Flat(3..3)),
            ],
        )
        .unwrap();
        assert_eq!(l.regions[0].len, 8 + 4 + 12);
    }

    #[test]
    fn splits_are_even_with_the_remainder_first() {
        let parts: Vec<_> = (0..3).map(|i| even_part(10, 3, i)).collect();
        assert_eq!(parts, vec![0..4, 4..7, 7..10]);
        assert_eq!(Holding::flat_shard(2, 4, 3), Holding::Flat(2..2));
        assert!(Holding::split(&[4], 1, 2, 0).is_err());
        let s = one(vec![], 4);
        let l = Layout::pack(s, "r", [(0, Holding::Box(vec![]))]).unwrap();
        assert_eq!(l.regions[0].len, 4);
    }
}
