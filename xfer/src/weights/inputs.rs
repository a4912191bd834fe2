//! The planner's and the checker's common reading of their input: every layout validated,
//! and tensors matched across layouts by name (same shape and element size everywhere),
//! numbered in order of first appearance (destinations' tables first, then sources').

use super::layout::{Layout, TensorSpec, validate_tensors};
use super::plan::{PlanError, Side};
use rustc_hash::FxHashMap;
use std::rc::Rc;
use std::sync::Arc;

/// Tensors by global id, and each layout's table mapped onto them.
pub(crate) struct Catalog<'a> {
    /// Global id -> the first spec seen of that name.
    pub tensors: Vec<&'a TensorSpec>,
    /// Per source rank: local tensor index -> global id.
    pub src_ids: Vec<Rc<Vec<u32>>>,
    /// Per destination rank: local tensor index -> global id.
    pub dst_ids: Vec<Rc<Vec<u32>>>,
}

impl<'a> Catalog<'a> {
    /// Validates every layout and matches their tensors.
    pub fn new(sources: &'a [Layout], dests: &'a [Layout]) -> Result<Catalog<'a>, PlanError> {
        for (side, list) in [(Side::Source, sources), (Side::Destination, dests)] {
            if u32::try_from(list.len()).is_err() {
                return Err(PlanError::TooManyRanks {
                    side,
                    count: list.len(),
                });
            }
        }
        let mut by_name: FxHashMap<&'a str, u32> = FxHashMap::default();
        let mut tensors: Vec<&'a TensorSpec> = Vec::new();
        // A table shared (one Arc) by many layouts is validated and mapped once.
        let mut seen: FxHashMap<(usize, usize), Rc<Vec<u32>>> = FxHashMap::default();
        let mut map_side = |side: Side,
                            list: &'a [Layout]|
         -> Result<Vec<Rc<Vec<u32>>>, PlanError> {
            let mut out = Vec::with_capacity(list.len());
            for (rank, l) in list.iter().enumerate() {
                let rank = rank as u32;
                if u32::try_from(l.pieces.len()).is_err() {
                    return Err(PlanError::TooManyPieces { side, rank });
                }
                let key = (
                    Arc::as_ptr(&l.tensors) as *const TensorSpec as usize,
                    l.tensors.len(),
                );
                let ids = match seen.get(&key) {
                    Some(ids) => ids.clone(),
                    None => {
                        validate_tensors(&l.tensors).map_err(|source| PlanError::Layout {
                            side,
                            rank,
                            source,
                        })?;
                        let mut ids = Vec::with_capacity(l.tensors.len());
                        for t in l.tensors.iter() {
                            let id = match by_name.get(t.name.as_str()) {
                                Some(&id) => {
                                    let first = tensors[id as usize];
                                    if first.shape != t.shape || first.elem_size != t.elem_size {
                                        return Err(PlanError::TensorMismatch {
                                            tensor: t.name.clone(),
                                            side,
                                            rank,
                                            shape: t.shape.clone(),
                                            elem_size: t.elem_size,
                                            expected_shape: first.shape.clone(),
                                            expected_elem_size: first.elem_size,
                                        });
                                    }
                                    id
                                }
                                None => {
                                    let id = u32::try_from(tensors.len())
                                        .map_err(|_| PlanError::TooManyTensors)?;
                                    tensors.push(t);
                                    by_name.insert(t.name.as_str(), id);
                                    id
                                }
                            };
                            ids.push(id);
                        }
                        let ids = Rc::new(ids);
                        seen.insert(key, ids.clone());
                        ids
                    }
                };
                l.validate_pieces()
                    .map_err(|source| PlanError::Layout { side, rank, source })?;
                out.push(ids);
            }
            Ok(out)
        };
        let dst_ids = map_side(Side::Destination, dests)?;
        let src_ids = map_side(Side::Source, sources)?;
        Ok(Catalog {
            tensors,
            src_ids,
            dst_ids,
        })
    }
}

/// Pieces grouped by global tensor id: `(rank, piece index)` of every piece of tensor `g`
/// is `entries[starts[g]..starts[g + 1]]`, in rank order then piece order.
pub(crate) struct ByTensor {
    starts: Vec<usize>,
    entries: Vec<(u32, u32)>,
}

impl ByTensor {
    /// Groups `layouts`' pieces (whose tables `ids` maps) over `tensors` global ids.
    pub fn new(layouts: &[Layout], ids: &[Rc<Vec<u32>>], tensors: usize) -> ByTensor {
        let mut starts = vec![0usize; tensors + 1];
        for (l, ids) in layouts.iter().zip(ids) {
            for p in &l.pieces {
                starts[ids[p.tensor as usize] as usize + 1] += 1;
            }
        }
        for g in 0..tensors {
            starts[g + 1] += starts[g];
        }
        let mut fill = starts.clone();
        let mut entries = vec![(0u32, 0u32); starts[tensors]];
        for (rank, (l, ids)) in layouts.iter().zip(ids).enumerate() {
            for (i, p) in l.pieces.iter().enumerate() {
                let g = ids[p.tensor as usize] as usize;
                entries[fill[g]] = (rank as u32, i as u32);
                fill[g] += 1;
            }
        }
        ByTensor { starts, entries }
    }

    /// The pieces of tensor `g`.
    pub fn of(&self, g: usize) -> &[(u32, u32)] {
        &self.entries[self.starts[g]..self.starts[g + 1]]
    }
}
