//! How one rank's paged KV cache lies in its registered regions ([`KvLayout`]), with
//! constructors for the caches vLLM and SGLang allocate and the tensor-parallel head split
//! ([`heads_for_rank`]).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{KvError, Result, add, mul};

/// Where one (layer, component) tensor starts: which of the rank's registered regions,
/// and the byte offset in it of the component's block 0 (token 0, head 0, byte 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorPlace {
    /// Index into the rank's list of registered regions.
    pub region: u32,
    /// Offset of the tensor's first byte in that region.
    pub offset: u64,
}

/// Order of the token and head dimensions inside a block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HeadOrder {
    /// `[block_size, heads, head_dim]`: a token's heads are adjacent.
    #[default]
    Nhd,
    /// `[heads, block_size, head_dim]`: a head's tokens are adjacent.
    Hnd,
}

/// How an engine's tensors map to registered regions, for the constructors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Regions {
    /// Each tensor the engine allocates is its own region, numbered in allocation order
    /// (vLLM: one per layer; SGLang MHA: K of layer 0, V of layer 0, K of layer 1, ...).
    #[default]
    PerTensor,
    /// All those tensors back to back in region 0, in the same order (one allocation).
    Packed,
}

/// What a model's KV cache holds per token, for the constructors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvModel {
    /// Attention layers.
    pub num_layers: u32,
    /// KV heads of the whole model (1 for an MLA latent).
    pub kv_heads: u32,
    /// Elements per head (for MLA: `kv_lora_rank + qk_rope_head_dim`, 576 for DeepSeek-V3).
    pub head_dim: u32,
    /// Bytes per element (2 for BF16/FP16, 1 for FP8).
    pub elem_size: u32,
}

impl KvModel {
    /// A model with `kv_heads` K and V heads of `head_dim` elements per layer.
    pub fn new(num_layers: u32, kv_heads: u32, head_dim: u32, elem_size: u32) -> KvModel {
        KvModel {
            num_layers,
            kv_heads,
            head_dim,
            elem_size,
        }
    }

    /// An MLA model: one latent vector of `latent_dim` elements per token and layer.
    pub fn mla(num_layers: u32, latent_dim: u32, elem_size: u32) -> KvModel {
        KvModel::new(num_layers, 1, latent_dim, elem_size)
    }

    fn head_bytes(&self) -> Result<u64> {
        mul(
            u64::from(self.head_dim),
            u64::from(self.elem_size),
            "head_dim x elem_size",
        )
    }
}

/// The KV heads (of `kv_heads` in the model) that rank `rank` of a tensor-parallel group
/// of `tp` holds: a contiguous `kv_heads / tp` of them when `tp <= kv_heads` (which must
/// divide), else one head replicated on `tp / kv_heads` consecutive ranks (which must
/// divide), as vLLM and SGLang split them.
///
/// ```
/// use kv_plan::heads_for_rank;
/// assert_eq!(heads_for_rank(8, 4, 3).unwrap(), 6..8);
/// assert_eq!(heads_for_rank(2, 8, 5).unwrap(), 1..2); // ranks 4..8 hold head 1
/// assert!(heads_for_rank(6, 4, 0).is_err());
/// ```
pub fn heads_for_rank(kv_heads: u32, tp: u32, rank: u32) -> Result<Range<u32>> {
    if kv_heads == 0 {
        return Err(KvError::Zero { field: "kv_heads" });
    }
    if tp == 0 || rank >= tp {
        return Err(KvError::TpRank { tp, rank });
    }
    if tp <= kv_heads {
        if !kv_heads.is_multiple_of(tp) {
            return Err(KvError::TpSplit { kv_heads, tp });
        }
        let per = kv_heads / tp;
        // rank < tp and per * tp == kv_heads, so this stays within u32.
        Ok(rank * per..(rank + 1) * per)
    } else {
        if !tp.is_multiple_of(kv_heads) {
            return Err(KvError::TpSplit { kv_heads, tp });
        }
        let head = rank / (tp / kv_heads);
        Ok(head..head + 1)
    }
}

/// One rank's paged KV cache: geometry shared by every layer and component, and where each
/// (layer, component) tensor starts.
///
/// The `head_bytes` bytes of (block `b`, token `t` of the block, local head `h`) of
/// (layer `l`, component `c`) lie in region `places[l * components + c].region` at
///
/// ```text
/// places[l * components + c].offset + b * block_stride + t * token_stride + h * head_stride
/// ```
///
/// where the local head `h` is global head `heads.start + h`. Per-layer tensors, one tensor
/// for all layers, K and V apart or fused in a block, NHD or HND, padding: all are strides
/// and places. Fields are public so that any engine's cache can be described; the
/// constructors compute them for vLLM's and SGLang's, and [`validate`](Self::validate)
/// checks a hand-made one (the planner and checker call it).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvLayout {
    /// Attention layers.
    pub num_layers: u32,
    /// Tensors per layer: 2 for K and V, 1 for an MLA latent (or one fused tensor).
    pub components: u32,
    /// Blocks (pages) in the cache.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Bytes per element.
    pub elem_size: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per head: `head_dim × elem_size`, contiguous.
    pub head_bytes: u64,
    /// KV heads of the whole model.
    pub total_heads: u32,
    /// The model's KV heads that this rank holds, as global head indices.
    pub heads: Range<u32>,
    /// Bytes from one block to the next.
    pub block_stride: u64,
    /// Bytes from one token to the next within a block.
    pub token_stride: u64,
    /// Bytes from one local head to the next.
    pub head_stride: u64,
    /// Where each (layer, component) tensor starts, layer-major: index
    /// `layer * components + component`.
    pub places: Vec<TensorPlace>,
}

/// Strides and tensor packing a constructor computed, before regions are assigned.
struct Shape {
    components: u32,
    block_stride: u64,
    token_stride: u64,
    head_stride: u64,
    /// Tensors the engine allocates per layer (1, or `components` when K and V are apart).
    tensors_per_layer: u32,
    /// Bytes of one allocated tensor.
    tensor_bytes: u64,
    /// Offset of each component inside its tensor.
    component_offset: Vec<u64>,
}

impl KvLayout {
    /// vLLM's FlashAttention backend: per layer one tensor `(2, num_blocks, block_size,
    /// heads, head_dim)` (NHD), K then V.
    pub fn vllm_flash_attn(
        model: &KvModel,
        heads: Range<u32>,
        num_blocks: u32,
        block_size: u32,
        regions: Regions,
    ) -> Result<KvLayout> {
        let hb = model.head_bytes()?;
        let h = u64::from(heads.end.saturating_sub(heads.start));
        let token = mul(h, hb, "token stride")?;
        let block = mul(token, u64::from(block_size), "block stride")?;
        let comp = mul(block, u64::from(num_blocks), "component bytes")?;
        let shape = Shape {
            components: 2,
            block_stride: block,
            token_stride: token,
            head_stride: hb,
            tensors_per_layer: 1,
            tensor_bytes: mul(comp, 2, "tensor bytes")?,
            component_offset: vec![0, comp],
        };
        Self::build(model, heads, num_blocks, block_size, shape, regions)
    }

    /// vLLM's FlashInfer (and other paged) backends: per layer one tensor `(num_blocks, 2,
    /// block_size, heads, head_dim)` in NHD, or `(num_blocks, 2, heads, block_size,
    /// head_dim)` in memory for HND: K and V of a block side by side.
    pub fn vllm_flashinfer(
        model: &KvModel,
        heads: Range<u32>,
        num_blocks: u32,
        block_size: u32,
        order: HeadOrder,
        regions: Regions,
    ) -> Result<KvLayout> {
        let hb = model.head_bytes()?;
        let h = u64::from(heads.end.saturating_sub(heads.start));
        let bs = u64::from(block_size);
        let half = mul(mul(h, hb, "block bytes")?, bs, "block bytes")?;
        let (token_stride, head_stride) = match order {
            HeadOrder::Nhd => (mul(h, hb, "token stride")?, hb),
            HeadOrder::Hnd => (hb, mul(bs, hb, "head stride")?),
        };
        let block_stride = mul(half, 2, "block stride")?;
        let shape = Shape {
            components: 2,
            block_stride,
            token_stride,
            head_stride,
            tensors_per_layer: 1,
            tensor_bytes: mul(block_stride, u64::from(num_blocks), "tensor bytes")?,
            component_offset: vec![0, half],
        };
        Self::build(model, heads, num_blocks, block_size, shape, regions)
    }

    /// SGLang's MHA pool: per layer a K and a V buffer, each `(num_pages × page_size,
    /// heads, head_dim)`; page `p` is tokens `p × page_size ..`. `num_pages` counts every
    /// page of the buffer (SGLang's padding page included); block ids are page indices.
    pub fn sglang_mha(
        model: &KvModel,
        heads: Range<u32>,
        num_pages: u32,
        page_size: u32,
        regions: Regions,
    ) -> Result<KvLayout> {
        let hb = model.head_bytes()?;
        let h = u64::from(heads.end.saturating_sub(heads.start));
        let token = mul(h, hb, "token stride")?;
        let block = mul(token, u64::from(page_size), "block stride")?;
        let shape = Shape {
            components: 2,
            block_stride: block,
            token_stride: token,
            head_stride: hb,
            tensors_per_layer: 2,
            tensor_bytes: mul(block, u64::from(num_pages), "tensor bytes")?,
            component_offset: vec![0, 0],
        };
        Self::build(model, heads, num_pages, page_size, shape, regions)
    }

    /// vLLM's MLA cache: per layer `(num_blocks, block_size, latent)`, one component, the
    /// latent held by every rank (`model.kv_heads` must be 1: see [`KvModel::mla`]).
    pub fn vllm_mla(
        model: &KvModel,
        num_blocks: u32,
        block_size: u32,
        regions: Regions,
    ) -> Result<KvLayout> {
        Self::mla(model, num_blocks, block_size, regions)
    }

    /// SGLang's MLA pool: per layer `(num_pages × page_size, 1, latent)`, one component,
    /// held by every rank; in memory the same as [`vllm_mla`](Self::vllm_mla) with pages
    /// as blocks.
    pub fn sglang_mla(
        model: &KvModel,
        num_pages: u32,
        page_size: u32,
        regions: Regions,
    ) -> Result<KvLayout> {
        Self::mla(model, num_pages, page_size, regions)
    }

    fn mla(
        model: &KvModel,
        num_blocks: u32,
        block_size: u32,
        regions: Regions,
    ) -> Result<KvLayout> {
        if model.kv_heads != 1 {
            return Err(KvError::HeadRange {
                start: 0,
                end: 1,
                total: model.kv_heads,
            });
        }
        let hb = model.head_bytes()?;
        let block = mul(hb, u64::from(block_size), "block stride")?;
        let shape = Shape {
            components: 1,
            block_stride: block,
            token_stride: hb,
            head_stride: hb,
            tensors_per_layer: 1,
            tensor_bytes: mul(block, u64::from(num_blocks), "tensor bytes")?,
            component_offset: vec![0],
        };
        Self::build(model, 0..1, num_blocks, block_size, shape, regions)
    }

    fn build(
        model: &KvModel,
        heads: Range<u32>,
        num_blocks: u32,
        block_size: u32,
        shape: Shape,
        regions: Regions,
    ) -> Result<KvLayout> {
        let mut places = Vec::new();
        for layer in 0..model.num_layers {
            for c in 0..shape.components {
                let within = if shape.tensors_per_layer == 1 { 0 } else { c };
                let tensor =
                    u64::from(layer) * u64::from(shape.tensors_per_layer) + u64::from(within);
                let comp_off = shape.component_offset[c as usize];
                let place = match regions {
                    Regions::PerTensor => TensorPlace {
                        region: u32::try_from(tensor).map_err(|_| KvError::Overflow {
                            what: "region index",
                        })?,
                        offset: comp_off,
                    },
                    Regions::Packed => TensorPlace {
                        region: 0,
                        offset: add(
                            mul(tensor, shape.tensor_bytes, "packed offset")?,
                            comp_off,
                            "packed offset",
                        )?,
                    },
                };
                places.push(place);
            }
        }
        let layout = KvLayout {
            num_layers: model.num_layers,
            components: shape.components,
            num_blocks,
            block_size,
            elem_size: model.elem_size,
            head_dim: model.head_dim,
            head_bytes: model.head_bytes()?,
            total_heads: model.kv_heads,
            heads,
            block_stride: shape.block_stride,
            token_stride: shape.token_stride,
            head_stride: shape.head_stride,
            places,
        };
        layout.validate()?;
        Ok(layout)
    }

    /// The same geometry with other tensor places (for example the offsets at which the
    /// engine's tensors lie in one registered allocation).
    pub fn with_places(mut self, places: Vec<TensorPlace>) -> Result<KvLayout> {
        self.places = places;
        self.validate()?;
        Ok(self)
    }

    /// Heads this rank holds.
    pub fn local_heads(&self) -> u32 {
        self.heads.end.saturating_sub(self.heads.start)
    }

    /// Where (layer, component) starts.
    pub fn place(&self, layer: u32, component: u32) -> Result<TensorPlace> {
        let missing = KvError::NoTensor {
            layer,
            component,
            layers: self.num_layers,
            components: self.components,
        };
        if layer >= self.num_layers || component >= self.components {
            return Err(missing);
        }
        let i = u64::from(layer) * u64::from(self.components) + u64::from(component);
        usize::try_from(i)
            .ok()
            .and_then(|i| self.places.get(i))
            .copied()
            .ok_or(missing)
    }

    /// Bytes from a tensor's first byte to its last addressed byte + 1 (the same for every
    /// tensor: the geometry is shared).
    pub fn tensor_span(&self) -> Result<u64> {
        let last =
            |extent: u32, stride: u64, what| mul(u64::from(extent.saturating_sub(1)), stride, what);
        let mut span = self.head_bytes;
        span = add(
            span,
            last(self.num_blocks, self.block_stride, "tensor span")?,
            "tensor span",
        )?;
        span = add(
            span,
            last(self.block_size, self.token_stride, "tensor span")?,
            "tensor span",
        )?;
        span = add(
            span,
            last(self.local_heads(), self.head_stride, "tensor span")?,
            "tensor span",
        )?;
        Ok(span)
    }

    /// The end of (layer, component) in its region: its last addressed byte + 1, relative
    /// to the region's start.
    pub fn extent(&self, layer: u32, component: u32) -> Result<u64> {
        let place = self.place(layer, component)?;
        add(place.offset, self.tensor_span()?, "tensor extent")
    }

    /// Checks the geometry and places ([`validate`](Self::validate)) and that every tensor
    /// lies within its region, `region_lens[i]` being the length of region `i`.
    pub fn validate_regions(&self, region_lens: &[u64]) -> Result<()> {
        self.validate()?;
        for layer in 0..self.num_layers {
            for component in 0..self.components {
                let place = self.place(layer, component)?;
                let len = usize::try_from(place.region)
                    .ok()
                    .and_then(|r| region_lens.get(r))
                    .copied()
                    .ok_or(KvError::NoRegion {
                        layer,
                        component,
                        region: place.region,
                        regions: region_lens.len(),
                    })?;
                let needed = self.extent(layer, component)?;
                if needed > len {
                    return Err(KvError::RegionTooSmall {
                        layer,
                        component,
                        region: place.region,
                        needed,
                        len,
                    });
                }
            }
        }
        Ok(())
    }

    /// Checks the layout on its own: counts positive, `head_bytes = head_dim × elem_size`,
    /// heads within the model's, strides that never let two cells share a byte, every
    /// tensor's bytes addressable in 64 bits, one place per (layer, component), and no two
    /// tensors of one region sharing a byte (tensors may interleave, as K and V do in a
    /// fused block, as long as their bytes are apart).
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("num_layers", self.num_layers),
            ("components", self.components),
            ("num_blocks", self.num_blocks),
            ("block_size", self.block_size),
            ("elem_size", self.elem_size),
            ("head_dim", self.head_dim),
            ("total_heads", self.total_heads),
        ] {
            if v == 0 {
                return Err(KvError::Zero { field });
            }
        }
        let hb = mul(
            u64::from(self.head_dim),
            u64::from(self.elem_size),
            "head_dim x elem_size",
        )?;
        if hb != self.head_bytes {
            return Err(KvError::HeadBytes {
                head_dim: self.head_dim,
                elem_size: self.elem_size,
                head_bytes: self.head_bytes,
            });
        }
        if self.heads.start >= self.heads.end || self.heads.end > self.total_heads {
            return Err(KvError::HeadRange {
                start: self.heads.start,
                end: self.heads.end,
                total: self.total_heads,
            });
        }
        // Sorted by stride, each dimension must step over everything the smaller ones span.
        let mut dims = self.dims();
        dims.sort_unstable();
        let mut span = self.head_bytes;
        for &(stride, extent) in &dims {
            if stride < span {
                return Err(self.aliasing());
            }
            span = add(span, mul(stride, extent - 1, "tensor span")?, "tensor span")?;
        }
        let expected = u64::from(self.num_layers) * u64::from(self.components);
        if u64::try_from(self.places.len()).ok() != Some(expected) {
            return Err(KvError::Places {
                layers: self.num_layers,
                components: self.components,
                found: self.places.len(),
            });
        }
        self.check_places_apart(span)
    }

    /// (stride, extent) of the block, token and head dimensions that have two or more
    /// entries (a dimension of one has no stride that matters).
    fn dims(&self) -> Vec<(u64, u64)> {
        [
            (self.block_stride, self.num_blocks),
            (self.token_stride, self.block_size),
            (self.head_stride, self.local_heads()),
        ]
        .into_iter()
        .filter(|&(_, e)| e > 1)
        .map(|(s, e)| (s, u64::from(e)))
        .collect()
    }

    fn aliasing(&self) -> KvError {
        KvError::Aliasing {
            block_stride: self.block_stride,
            token_stride: self.token_stride,
            head_stride: self.head_stride,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            heads: self.local_heads(),
            head_bytes: self.head_bytes,
        }
    }

    /// No two tensors of one region share a byte. Tensors whose byte ranges overlap (K and
    /// V interleaved block by block) share one iff their offsets differ by a difference of
    /// two cell addresses, which (strides not aliasing) a few divisions decide.
    fn check_places_apart(&self, span: u64) -> Result<()> {
        let mut order: Vec<(u32, u64, usize)> = self
            .places
            .iter()
            .enumerate()
            .map(|(i, p)| (p.region, p.offset, i))
            .collect();
        order.sort_unstable();
        let mut dims: Vec<(i128, i128)> = self
            .dims()
            .into_iter()
            .map(|(s, e)| (i128::from(s), i128::from(e)))
            .collect();
        dims.sort_unstable_by(|a, b| b.cmp(a));
        for (i, &(region, offset, a)) in order.iter().enumerate() {
            let end = add(offset, span, "tensor extent")?;
            for &(r2, o2, b) in &order[i + 1..] {
                if r2 != region || o2 >= end {
                    break;
                }
                let diff = i128::from(o2) - i128::from(offset);
                if lattice_difference(diff, &dims, i128::from(self.head_bytes)) {
                    let comps = self.components as usize;
                    let (a, b) = (a.min(b), a.max(b));
                    return Err(KvError::PlacesOverlap {
                        region,
                        a_layer: (a / comps) as u32,
                        a_component: (a % comps) as u32,
                        b_layer: (b / comps) as u32,
                        b_component: (b % comps) as u32,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Whether `diff` is the difference of two byte addresses of a tensor whose dimensions are
/// `dims` (stride, extent), largest stride first, over cells of `head_bytes`. The strides
/// do not alias, so each dimension's index difference is one of two values.
fn lattice_difference(diff: i128, dims: &[(i128, i128)], head_bytes: i128) -> bool {
    match dims.split_first() {
        None => diff.abs() < head_bytes,
        Some((&(stride, extent), rest)) => {
            let q = diff.div_euclid(stride);
            [q, q + 1].into_iter().any(|k| {
                k.abs() < extent && lattice_difference(diff - k * stride, rest, head_bytes)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama() -> KvModel {
        KvModel::new(32, 8, 128, 2)
    }

    #[test]
    fn tp_split_and_replicas() {
        assert_eq!(heads_for_rank(8, 2, 1).unwrap(), 4..8);
        assert_eq!(heads_for_rank(8, 8, 7).unwrap(), 7..8);
        let replicas: Vec<_> = (0..8)
            .map(|r| heads_for_rank(2, 8, r).unwrap().start)
            .collect();
        assert_eq!(replicas, [0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(
            heads_for_rank(3, 2, 0),
            Err(KvError::TpSplit { kv_heads: 3, tp: 2 })
        );
        assert_eq!(
            heads_for_rank(2, 3, 0),
            Err(KvError::TpSplit { kv_heads: 2, tp: 3 })
        );
        assert_eq!(
            heads_for_rank(8, 4, 4),
            Err(KvError::TpRank { tp: 4, rank: 4 })
        );
        assert_eq!(
            heads_for_rank(8, 0, 0),
            Err(KvError::TpRank { tp: 0, rank: 0 })
        );
    }

    #[test]
    fn constructors_match_the_engines_shapes() {
        let m = llama();
        // vLLM FlashAttention (2, nb, 16, 4, 128) bf16, TP 2.
        let fa = KvLayout::vllm_flash_attn(&m, 0..4, 100, 16, Regions::PerTensor).unwrap();
        assert_eq!(
            (fa.head_stride, fa.token_stride, fa.block_stride),
            (256, 1024, 16384)
        );
        assert_eq!(
            fa.place(3, 1).unwrap(),
            TensorPlace {
                region: 3,
                offset: 100 * 16384
            }
        );
        assert_eq!(fa.extent(0, 1).unwrap(), 2 * 100 * 16384);
        // FlashInfer HND (nb, 2, 4, 16, 128).
        let fi =
            KvLayout::vllm_flashinfer(&m, 0..4, 100, 16, HeadOrder::Hnd, Regions::Packed).unwrap();
        assert_eq!(
            (fi.token_stride, fi.head_stride, fi.block_stride),
            (256, 4096, 32768)
        );
        assert_eq!(
            fi.place(1, 1).unwrap(),
            TensorPlace {
                region: 0,
                offset: 100 * 32768 + 16384
            }
        );
        // SGLang: K and V apart, a region each.
        let sg = KvLayout::sglang_mha(&m, 0..8, 10, 1, Regions::PerTensor).unwrap();
        assert_eq!(
            sg.place(2, 1).unwrap(),
            TensorPlace {
                region: 5,
                offset: 0
            }
        );
        // DeepSeek-V3 MLA: 576 bf16 per token.
        let mla = KvLayout::vllm_mla(&KvModel::mla(61, 576, 2), 10, 64, Regions::Packed).unwrap();
        assert_eq!(
            (mla.components, mla.token_stride, mla.block_stride),
            (1, 1152, 73728)
        );
        assert_eq!(mla.place(60, 0).unwrap().offset, 60 * 10 * 73728);
        assert!(KvLayout::vllm_mla(&llama(), 10, 64, Regions::Packed).is_err());
    }

    #[test]
    fn validation_catches_aliasing_and_overlaps() {
        let m = llama();
        let mut l = KvLayout::vllm_flash_attn(&m, 0..4, 10, 16, Regions::Packed).unwrap();
        l.token_stride = 512; // 4 heads of 256 do not fit
        assert!(matches!(l.validate(), Err(KvError::Aliasing { .. })));
        // FlashInfer's K and V interleave but never share a byte; shifting V by one head does.
        let fi = KvLayout::vllm_flashinfer(&m, 0..4, 10, 16, HeadOrder::Nhd, Regions::PerTensor)
            .unwrap();
        let mut places = fi.places.clone();
        places[1].offset = 256;
        assert!(matches!(
            fi.clone().with_places(places),
            Err(KvError::PlacesOverlap {
                region: 0,
                a_layer: 0,
                a_component: 0,
                b_component: 1,
                ..
            })
        ));
        // Moving V to a gap that is a whole block away is fine.
        let mut places = fi.places.clone();
        places[1].offset = 16 * 1024 * 2 * 10;
        assert!(fi.clone().with_places(places).is_ok());
        let mut places = fi.places.clone();
        places.pop();
        assert!(matches!(
            fi.clone().with_places(places),
            Err(KvError::Places { .. })
        ));
        let mut bad = fi.clone();
        bad.head_bytes = 255;
        assert!(matches!(bad.validate(), Err(KvError::HeadBytes { .. })));
        let mut bad = fi.clone();
        bad.heads = 6..10;
        assert!(matches!(bad.validate(), Err(KvError::HeadRange { .. })));
        let mut bad = fi.clone();
        bad.block_stride = u64::MAX / 4;
        assert!(matches!(bad.validate(), Err(KvError::Overflow { .. })));
    }

    #[test]
    fn regions_must_hold_their_tensors() {
        let l =
            KvLayout::vllm_flash_attn(&KvModel::new(2, 2, 4, 2), 0..2, 3, 2, Regions::PerTensor)
                .unwrap();
        let need = l.extent(0, 1).unwrap();
        assert_eq!(need, 2 * 3 * 2 * 2 * 8);
        assert!(l.validate_regions(&[need, need]).is_ok());
        assert_eq!(
            l.validate_regions(&[need, need - 1]),
            Err(KvError::RegionTooSmall {
                layer: 1,
                component: 1,
                region: 1,
                needed: need,
                len: need - 1
            })
        );
        assert!(matches!(
            l.validate_regions(&[need]),
            Err(KvError::NoRegion { region: 1, .. })
        ));
    }

    #[test]
    fn serde_round_trip() {
        let l = KvLayout::vllm_flashinfer(&llama(), 2..4, 7, 16, HeadOrder::Hnd, Regions::Packed)
            .unwrap();
        let json = serde_json::to_string(&l).unwrap();
        assert_eq!(serde_json::from_str::<KvLayout>(&json).unwrap(), l);
    }
}
