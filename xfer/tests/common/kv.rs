//! KV caches for the tests: the logical cache's bytes, the cells a rank holds, a few
//! shapes of both sides, and shuffled block tables.

use std::ops::Range;
use xfer::kv::{HeadOrder, KvLayout, KvModel, Regions, heads_for_rank};

/// The byte `i` of (layer, component, token, global head) of the logical cache.
pub fn value(layer: u32, comp: u32, token: u64, head: u32, i: u64) -> u8 {
    let x = (layer as u64 * 1_000_003 + comp as u64 * 7919 + token * 131 + head as u64 * 31 + i)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (x >> 56) as u8
}

/// Region lengths that hold every tensor of `l`.
pub fn region_lens(l: &KvLayout) -> Vec<u64> {
    let mut lens: Vec<u64> = Vec::new();
    for layer in 0..l.num_layers {
        for c in 0..l.components {
            let r = l.place(layer, c).unwrap().region as usize;
            if lens.len() <= r {
                lens.resize(r + 1, 0);
            }
            lens[r] = lens[r].max(l.extent(layer, c).unwrap());
        }
    }
    lens
}

/// Calls `f(region, offset, layer, comp, token, global head)` for each cell of the
/// request's tokens that rank `l` holds, with `table` its block table.
pub fn cells(
    l: &KvLayout,
    table: &[u32],
    tokens: u64,
    mut f: impl FnMut(usize, u64, u32, u32, u64, u32),
) {
    for layer in 0..l.num_layers {
        for c in 0..l.components {
            let place = l.place(layer, c).unwrap();
            for token in 0..tokens {
                let block = table[(token / l.block_size as u64) as usize] as u64;
                let slot = token % l.block_size as u64;
                for h in 0..(l.heads.end - l.heads.start) {
                    let off = place.offset
                        + block * l.block_stride
                        + slot * l.token_stride
                        + h as u64 * l.head_stride;
                    f(
                        place.region as usize,
                        off,
                        layer,
                        c,
                        token,
                        l.heads.start + h,
                    );
                }
            }
        }
    }
}

pub struct Shape {
    pub name: &'static str,
    pub prefill: Vec<KvLayout>,
    pub decode: Vec<KvLayout>,
}

pub fn side(tp: u32, heads: u32, mut make: impl FnMut(Range<u32>) -> KvLayout) -> Vec<KvLayout> {
    (0..tp)
        .map(|r| make(heads_for_rank(heads, tp, r).unwrap()))
        .collect()
}

pub fn shapes() -> Vec<Shape> {
    let m = KvModel::new(3, 4, 8, 2);
    let mla = KvModel::mla(2, 24, 2);
    vec![
        Shape {
            name: "flash-attn TP2 -> TP4, blocks 8 -> 4",
            prefill: side(2, 4, |h| {
                KvLayout::vllm_flash_attn(&m, h, 24, 8, Regions::PerTensor).unwrap()
            }),
            decode: side(4, 4, |h| {
                KvLayout::vllm_flash_attn(&m, h, 40, 4, Regions::PerTensor).unwrap()
            }),
        },
        Shape {
            name: "flashinfer HND TP4 -> NHD TP1, packed",
            prefill: side(4, 4, |h| {
                KvLayout::vllm_flashinfer(&m, h, 20, 8, HeadOrder::Hnd, Regions::Packed).unwrap()
            }),
            decode: side(1, 4, |h| {
                KvLayout::vllm_flashinfer(&m, h, 20, 8, HeadOrder::Nhd, Regions::PerTensor).unwrap()
            }),
        },
        Shape {
            name: "replicated heads TP8 -> sglang TP2, pages 1",
            prefill: side(8, 4, |h| {
                KvLayout::vllm_flash_attn(&m, h, 16, 4, Regions::PerTensor).unwrap()
            }),
            decode: side(2, 4, |h| {
                KvLayout::sglang_mha(&m, h, 80, 1, Regions::PerTensor).unwrap()
            }),
        },
        Shape {
            name: "MLA TP2 -> TP4",
            prefill: (0..2)
                .map(|_| KvLayout::vllm_mla(&mla, 20, 8, Regions::PerTensor).unwrap())
                .collect(),
            decode: (0..4)
                .map(|_| KvLayout::sglang_mla(&mla, 160, 1, Regions::Packed).unwrap())
                .collect(),
        },
    ]
}

/// A shuffled table of `n` distinct blocks of `of`, from `seed`.
pub fn table(n: usize, of: u32, seed: u64) -> Vec<u32> {
    let mut t: Vec<u32> = (0..of).collect();
    let mut s = seed | 1;
    for i in (1..t.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        t.swap(i, (s % (i as u64 + 1)) as usize);
    }
    t.truncate(n);
    t
}
