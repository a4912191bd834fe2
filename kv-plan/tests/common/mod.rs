//! Shared by the integration tests: layouts of every kind, fake caches filled with a
//! pattern derived from each byte's coordinates, and a byte-level replay of a plan.
#![allow(dead_code)]

use kv_plan::{
    HeadOrder, KvLayout, KvModel, KvPlan, KvRequest, Regions, TensorPlace, heads_for_rank,
};

/// The layouts the tests draw from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// vLLM FlashAttention: per layer (2, blocks, bs, heads, dim).
    FlashAttn,
    /// vLLM FlashInfer NHD: per layer (blocks, 2, bs, heads, dim).
    FlashInferNhd,
    /// vLLM FlashInfer HND: per layer (blocks, 2, heads, bs, dim).
    FlashInferHnd,
    /// SGLang MHA: per layer and component (pages × bs, heads, dim).
    Sglang,
    /// A hand-made layout with padding after every head, token and block, NHD or HND.
    Padded(HeadOrder),
    /// vLLM MLA: per layer (blocks, bs, latent).
    VllmMla,
    /// SGLang MLA: per layer (pages × bs, 1, latent).
    SglangMla,
    /// [`Kind::Padded`] NHD with one component, for MLA.
    PaddedMla,
}

pub const MHA_KINDS: [Kind; 6] = [
    Kind::FlashAttn,
    Kind::FlashInferNhd,
    Kind::FlashInferHnd,
    Kind::Sglang,
    Kind::Padded(HeadOrder::Nhd),
    Kind::Padded(HeadOrder::Hnd),
];

pub const MLA_KINDS: [Kind; 3] = [Kind::VllmMla, Kind::SglangMla, Kind::PaddedMla];

/// One rank's layout of `kind`.
pub fn layout(
    kind: Kind,
    model: &KvModel,
    heads: std::ops::Range<u32>,
    num_blocks: u32,
    block_size: u32,
    regions: Regions,
) -> KvLayout {
    let l = match kind {
        Kind::FlashAttn => KvLayout::vllm_flash_attn(model, heads, num_blocks, block_size, regions),
        Kind::FlashInferNhd => KvLayout::vllm_flashinfer(
            model,
            heads,
            num_blocks,
            block_size,
            HeadOrder::Nhd,
            regions,
        ),
        Kind::FlashInferHnd => KvLayout::vllm_flashinfer(
            model,
            heads,
            num_blocks,
            block_size,
            HeadOrder::Hnd,
            regions,
        ),
        Kind::Sglang => KvLayout::sglang_mha(model, heads, num_blocks, block_size, regions),
        Kind::VllmMla => KvLayout::vllm_mla(model, num_blocks, block_size, regions),
        Kind::SglangMla => KvLayout::sglang_mla(model, num_blocks, block_size, regions),
        Kind::Padded(order) => Ok(padded(model, heads, num_blocks, block_size, order, 2)),
        Kind::PaddedMla => Ok(padded(
            model,
            0..1,
            num_blocks,
            block_size,
            HeadOrder::Nhd,
            1,
        )),
    };
    l.expect("test layouts are valid")
}

/// A layout no engine has: padding after each head, token and block, tensors at odd
/// offsets of one region.
fn padded(
    model: &KvModel,
    heads: std::ops::Range<u32>,
    nb: u32,
    bs: u32,
    order: HeadOrder,
    components: u32,
) -> KvLayout {
    let hb = u64::from(model.head_dim * model.elem_size);
    let h = u64::from(heads.end - heads.start);
    let pad = u64::from(model.elem_size);
    let (head_stride, token_stride) = match order {
        HeadOrder::Nhd => (hb + pad, h * (hb + pad) + 3),
        HeadOrder::Hnd => (u64::from(bs) * (hb + pad) + 3, hb + pad),
    };
    let inner = (u64::from(bs) - 1) * token_stride + (h - 1) * head_stride + hb;
    let block_stride = inner + 5;
    let tensor = (u64::from(nb) - 1) * block_stride + inner + 7;
    let places = (0..model.num_layers * components)
        .map(|i| TensorPlace {
            region: 0,
            offset: 11 + u64::from(i) * tensor,
        })
        .collect();
    let l = KvLayout {
        num_layers: model.num_layers,
        components,
        num_blocks: nb,
        block_size: bs,
        elem_size: model.elem_size,
        head_dim: model.head_dim,
        head_bytes: hb,
        total_heads: model.kv_heads,
        heads,
        block_stride,
        token_stride,
        head_stride,
        places,
    };
    l.validate().expect("padded layout is valid");
    l
}

/// A TP group's layouts; MLA ranks all hold the latent.
pub fn group(
    kind: Kind,
    model: &KvModel,
    tp: u32,
    num_blocks: u32,
    block_size: u32,
    regions: Regions,
) -> Vec<KvLayout> {
    (0..tp)
        .map(|r| {
            let heads = heads_for_rank(model.kv_heads, tp, r).expect("valid TP");
            layout(kind, model, heads, num_blocks, block_size, regions)
        })
        .collect()
}

/// The byte (layer, component, token, global head, byte) holds in the full logical cache.
pub fn pattern(layer: u32, comp: u32, token: u64, head: u32, byte: u64) -> u8 {
    let mut x = (u64::from(layer) << 56)
        ^ (u64::from(comp) << 52)
        ^ (token << 24)
        ^ (u64::from(head) << 16)
        ^ byte;
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 32;
    x as u8
}

/// Bytes each region of `l` needs.
pub fn region_lens(l: &KvLayout) -> Vec<usize> {
    let mut lens: Vec<usize> = Vec::new();
    for layer in 0..l.num_layers {
        for c in 0..l.components {
            let p = l.place(layer, c).unwrap();
            let end = l.extent(layer, c).unwrap() as usize;
            let r = p.region as usize;
            if lens.len() <= r {
                lens.resize(r + 1, 0);
            }
            lens[r] = lens[r].max(end);
        }
    }
    lens
}

/// Offset of (block, token in block, global head) of (layer, comp) in its region, by the
/// layout's definition.
pub fn addr(
    l: &KvLayout,
    layer: u32,
    comp: u32,
    block: u32,
    tok: u64,
    head: u32,
) -> (usize, usize) {
    let p = l.place(layer, comp).unwrap();
    let off = p.offset
        + u64::from(block) * l.block_stride
        + tok * l.token_stride
        + u64::from(head - l.heads.start) * l.head_stride;
    (p.region as usize, off as usize)
}

/// A prefill rank's cache: junk everywhere, and in every block of its table the pattern
/// of the request's token there (tokens past the request too: they must not travel).
pub fn prefill_cache(l: &KvLayout, table: &[u32], rng: &mut fastrand::Rng) -> Vec<Vec<u8>> {
    let mut regions: Vec<Vec<u8>> = region_lens(l)
        .into_iter()
        .map(|n| (0..n).map(|_| rng.u8(..)).collect())
        .collect();
    let bs = u64::from(l.block_size);
    for layer in 0..l.num_layers {
        for c in 0..l.components {
            for (pos, &block) in table.iter().enumerate() {
                for tok in 0..bs {
                    let token = pos as u64 * bs + tok;
                    for h in l.heads.clone() {
                        let (r, off) = addr(l, layer, c, block, tok, h);
                        for b in 0..l.head_bytes {
                            regions[r][off + b as usize] = pattern(layer, c, token, h, b);
                        }
                    }
                }
            }
        }
    }
    regions
}

pub const SENTINEL: u8 = 0xA5;

/// A decode rank's cache before the transfer: the sentinel everywhere.
pub fn decode_cache(l: &KvLayout) -> Vec<Vec<u8>> {
    region_lens(l)
        .into_iter()
        .map(|n| vec![SENTINEL; n])
        .collect()
}

/// What a decode rank's cache must hold after the transfer: the sentinel, and the slice
/// of the full logical cache for the request's tokens and the rank's heads.
pub fn decode_expected(l: &KvLayout, table: &[u32], tokens: u64) -> Vec<Vec<u8>> {
    let mut regions = decode_cache(l);
    let bs = u64::from(l.block_size);
    for layer in 0..l.num_layers {
        for c in 0..l.components {
            for token in 0..tokens {
                let block = table[(token / bs) as usize];
                for h in l.heads.clone() {
                    let (r, off) = addr(l, layer, c, block, token % bs, h);
                    for b in 0..l.head_bytes {
                        regions[r][off + b as usize] = pattern(layer, c, token, h, b);
                    }
                }
            }
        }
    }
    regions
}

/// The table of `rank` in `tables` (one shared, or one per rank).
pub fn table(tables: &[Vec<u32>], rank: usize) -> &[u32] {
    if tables.len() == 1 {
        &tables[0]
    } else {
        &tables[rank]
    }
}

/// Replays `plan` byte by byte for every (layer, component): prefill WRITEs, or decode
/// READs (`pull`) with the runs read the other way.
pub fn replay(
    plan: &KvPlan,
    prefill: &[KvLayout],
    decode: &[KvLayout],
    pc: &[Vec<Vec<u8>>],
    dc: &mut [Vec<Vec<u8>>],
    pull: bool,
) {
    for pair in &plan.pairs {
        let (p, d) = (pair.prefill as usize, pair.decode as usize);
        for layer in 0..plan.num_layers {
            for c in 0..plan.components {
                let placed = pair.placed(&prefill[p], &decode[d], layer, c).unwrap();
                let src = &pc[p][placed.prefill_region as usize];
                let dst = &mut dc[d][placed.decode_region as usize];
                if pull {
                    // Local = decode (src), remote = prefill (dst).
                    for r in placed.read_runs() {
                        for i in 0..r.count {
                            let (to, from) = (
                                (r.src_offset + i * r.src_stride) as usize,
                                (r.dst_offset + i * r.dst_stride) as usize,
                            );
                            let n = r.len as usize;
                            dst[to..to + n].copy_from_slice(&src[from..from + n]);
                        }
                    }
                } else {
                    for r in placed.write_runs() {
                        for i in 0..r.count {
                            let (from, to) = (
                                (r.src_offset + i * r.src_stride) as usize,
                                (r.dst_offset + i * r.dst_stride) as usize,
                            );
                            let n = r.len as usize;
                            dst[to..to + n].copy_from_slice(&src[from..from + n]);
                        }
                    }
                }
            }
        }
    }
}

/// Replays `plan` into fresh decode caches and asserts they equal the logical cache's
/// slice, sentinel elsewhere. Returns an error message naming the first wrong byte.
pub fn simulate(
    prefill: &[KvLayout],
    decode: &[KvLayout],
    req: &KvRequest,
    plan: &KvPlan,
    seed: u64,
    pull: bool,
) -> Result<(), String> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let pc: Vec<_> = prefill
        .iter()
        .enumerate()
        .map(|(p, l)| prefill_cache(l, table(&req.prefill_blocks, p), &mut rng))
        .collect();
    let mut dc: Vec<_> = decode.iter().map(decode_cache).collect();
    replay(plan, prefill, decode, &pc, &mut dc, pull);
    for (d, l) in decode.iter().enumerate() {
        let want = decode_expected(l, table(&req.decode_blocks, d), req.num_tokens);
        for (r, (got, want)) in dc[d].iter().zip(&want).enumerate() {
            if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
                return Err(format!(
                    "decode rank {d} region {r} byte {i}: got {:#04x}, want {:#04x}",
                    got[i], want[i]
                ));
            }
        }
    }
    Ok(())
}

/// A random permutation of `0..num_blocks`, cut to `len`.
pub fn random_table(rng: &mut fastrand::Rng, num_blocks: u32, len: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..num_blocks).collect();
    rng.shuffle(&mut ids);
    ids.truncate(len);
    ids
}
