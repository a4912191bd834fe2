//! The shapes: Llama-3-8B (32 layers, 8 KV heads of 128, BF16, blocks of 16) and
//! DeepSeek-V3's MLA cache (61 layers, a 576-element BF16 latent, vLLM blocks of 64), a
//! 4096-token request, prefill TP 2 -> decode TP 4 and TP 4 -> TP 1. Each plan is proved
//! by the checker, and its runs per pair are counted: O(blocks), never O(blocks × heads),
//! where both sides lay a block out alike.

mod common;

use kv_plan::{
    HeadOrder, KvLayout, KvModel, KvPlan, KvRequest, Regions, check, heads_for_rank, plan,
};

const TOKENS: u64 = 4096;

fn llama() -> KvModel {
    KvModel::new(32, 8, 128, 2)
}

fn deepseek() -> KvModel {
    KvModel::mla(61, 576, 2)
}

#[derive(Clone, Copy, PartialEq)]
enum L {
    Nhd,
    Hnd,
    Mla,
}

fn side(model: &KvModel, kind: L, tp: u32, num_blocks: u32, bs: u32) -> Vec<KvLayout> {
    (0..tp)
        .map(|r| {
            let heads = heads_for_rank(model.kv_heads, tp, r).unwrap();
            match kind {
                L::Nhd => {
                    KvLayout::vllm_flash_attn(model, heads, num_blocks, bs, Regions::PerTensor)
                }
                L::Hnd => KvLayout::vllm_flashinfer(
                    model,
                    heads,
                    num_blocks,
                    bs,
                    HeadOrder::Hnd,
                    Regions::PerTensor,
                ),
                L::Mla => KvLayout::vllm_mla(model, num_blocks, bs, Regions::PerTensor),
            }
            .unwrap()
        })
        .collect()
}

/// Block tables of `blocks` entries in a cache of 4 × `blocks`: consecutive ids from
/// `blocks` on, or a random choice in random order.
fn table(blocks: u32, random: bool, rng: &mut fastrand::Rng) -> Vec<u32> {
    if random {
        common::random_table(rng, 4 * blocks, blocks as usize)
    } else {
        (blocks..2 * blocks).collect()
    }
}

/// A checked plan and its prefill layouts.
struct Shape {
    prefill: Vec<KvLayout>,
    plan: KvPlan,
}

fn shape(model: &KvModel, kinds: (L, L), tp: (u32, u32), bs: u32, random: bool) -> Shape {
    let blocks = TOKENS.div_ceil(u64::from(bs)) as u32;
    let prefill = side(model, kinds.0, tp.0, 4 * blocks, bs);
    let decode = side(model, kinds.1, tp.1, 4 * blocks, bs);
    let mut rng = fastrand::Rng::with_seed(42);
    let req = KvRequest::new(
        TOKENS,
        table(blocks, random, &mut rng),
        table(blocks, random, &mut rng),
    );
    let plan = plan(&prefill, &decode, &req).unwrap();
    check(&prefill, &decode, &req, &plan).unwrap();
    Shape { prefill, plan }
}

/// Every pair's runs, and the bytes each prefill rank sends per (layer, component).
fn runs_and_sent(s: &Shape) -> (Vec<u64>, Vec<u64>) {
    let stats = s.plan.stats();
    let mut sent = vec![0; s.prefill.len()];
    for p in &stats.pairs {
        sent[p.prefill as usize] += p.bytes;
    }
    (stats.pairs.iter().map(|p| p.runs).collect(), sent)
}

#[test]
fn llama_tp2_to_tp4_same_layout_is_a_run_per_block_or_one_per_pair() {
    for kind in [L::Nhd, L::Hnd] {
        // Decode rank d holds heads 2d..2d+2: half of prefill rank d / 2's.
        let s = shape(&llama(), (kind, kind), (2, 4), 16, true);
        let pairs: Vec<_> = s.plan.pairs.iter().map(|p| (p.prefill, p.decode)).collect();
        assert_eq!(pairs, [(0, 0), (0, 1), (1, 2), (1, 3)]);
        let (runs, sent) = runs_and_sent(&s);
        // 256 decode blocks, 2 heads each: at most a run per block, not per (block, head).
        assert!(runs.iter().all(|&r| (128..=256).contains(&r)), "{runs:?}");
        if kind == L::Nhd {
            // A head slice of NHD blocks: rows of 2 heads (512 bytes) at the token stride.
            assert_eq!(runs, [256; 4]);
            let r = s.plan.pairs[1].runs[0];
            assert_eq!((r.len, r.src_stride, r.dst_stride), (512, 1024, 512));
            assert_eq!(r.src_offset % 1024, 512, "decode rank 1 takes heads 2..4");
        }
        assert_eq!(
            sent,
            [TOKENS * 4 * 256; 2],
            "each prefill rank its 4 heads once"
        );
        let st = s.plan.stats();
        assert_eq!(st.per_block_head, 4 * 256 * 2 * 2 * 32);
        assert!(st.transfers * 2 <= st.per_block_head);
        assert_eq!(
            st.request_bytes,
            TOKENS * 8 * 256 * 2 * 32,
            "512 MiB: the whole cache once"
        );

        // Consecutive blocks on both sides: one run per pair.
        let s = shape(&llama(), (kind, kind), (2, 4), 16, false);
        assert_eq!(runs_and_sent(&s).0, [1; 4]);
    }
}

#[test]
fn llama_tp4_to_tp1_gathers_four_slices() {
    for kind in [L::Nhd, L::Hnd] {
        let s = shape(&llama(), (kind, kind), (4, 1), 16, true);
        let (runs, sent) = runs_and_sent(&s);
        assert_eq!(s.plan.pairs.len(), 4);
        assert!(runs.iter().all(|&r| r <= 256), "{runs:?}");
        assert_eq!(sent, [TOKENS * 2 * 256; 4]);
        if kind == L::Hnd {
            // Two HND heads of a block are one span of 2 × 16 tokens × 256 bytes.
            assert!(s.plan.pairs[0].runs.iter().all(|r| r.len == 8192));
        }
        let s = shape(&llama(), (kind, kind), (4, 1), 16, false);
        assert_eq!(runs_and_sent(&s).0, [1; 4]);
    }
}

#[test]
fn llama_nhd_to_hnd_is_a_run_per_block_and_head() {
    // Transposing (token, head) to (head, token) takes a run of token rows per head.
    let s = shape(&llama(), (L::Nhd, L::Hnd), (2, 4), 16, false);
    let (runs, _) = runs_and_sent(&s);
    assert_eq!(runs, [512; 4]);
    let r = s.plan.pairs[0].runs[0];
    assert_eq!(
        (r.len, r.count, r.src_stride, r.dst_stride),
        (256, 16, 1024, 256)
    );
}

#[test]
fn llama_replicated_heads_are_shared_by_their_holders() {
    // Prefill TP 16 holds each of the 8 heads twice; decode TP 2 holds 4 heads a rank.
    let s = shape(&llama(), (L::Nhd, L::Nhd), (16, 2), 16, true);
    let (runs, sent) = runs_and_sent(&s);
    assert_eq!(
        s.plan.pairs.len(),
        16,
        "each replica serves half the tokens of its head"
    );
    assert_eq!(sent, [TOKENS / 2 * 256; 16]);
    assert!(runs.iter().all(|&r| r == 128));
}

#[test]
fn deepseek_mla_is_shared_over_every_prefill_rank() {
    for (tp, pairs, per_rank_tokens) in [
        ((2, 4), 4, 2 * TOKENS),
        ((4, 1), 4, TOKENS / 4),
        ((8, 4), 8, TOKENS / 2),
    ] {
        let s = shape(&deepseek(), (L::Mla, L::Mla), tp, 64, true);
        let (runs, sent) = runs_and_sent(&s);
        assert_eq!(
            s.plan.pairs.len(),
            pairs,
            "TP {tp:?}: whole decode ranks per holder, not every pair"
        );
        assert_eq!(
            sent,
            vec![per_rank_tokens * 1152; tp.0 as usize],
            "TP {tp:?}"
        );
        // Each pair moves whole blocks of 64 × 1152 bytes: at most a run per block.
        for (p, r) in s.plan.pairs.iter().zip(&runs) {
            let blocks = p.block_heads;
            assert!(
                *r <= blocks && p.runs.iter().all(|r| r.len % (64 * 1152) == 0),
                "TP {tp:?}: {r} runs"
            );
        }
        let st = s.plan.stats();
        assert_eq!(st.per_block_head, u64::from(tp.1) * 64 * 61);
        let s = shape(&deepseek(), (L::Mla, L::Mla), tp, 64, false);
        assert!(runs_and_sent(&s).0.iter().all(|&r| r == 1));
    }
}

#[test]
fn vllm_mla_blocks_into_sglang_pages() {
    // vLLM's 64-token blocks into SGLang's one-token pages (consecutive pages from 1).
    let model = deepseek();
    let prefill: Vec<_> = (0..2)
        .map(|_| KvLayout::vllm_mla(&model, 200, 64, Regions::Packed).unwrap())
        .collect();
    let decode = vec![KvLayout::sglang_mla(&model, 5000, 1, Regions::PerTensor).unwrap()];
    let req = KvRequest::new(TOKENS, (100..164).collect(), (1..=4096).collect());
    let p = plan(&prefill, &decode, &req).unwrap();
    check(&prefill, &decode, &req, &p).unwrap();
    let (runs, sent) = runs_and_sent(&Shape { prefill, plan: p });
    assert_eq!(runs, [1, 1]);
    assert_eq!(sent, [TOKENS / 2 * 1152; 2]);
}

#[test]
fn thousands_of_blocks_are_planned_and_checked() {
    // 65536 tokens in 4096 random blocks a side, TP 2 -> TP 4 and NHD -> HND.
    let model = llama();
    let blocks = 4096;
    let prefill = side(&model, L::Nhd, 2, 2 * blocks, 16);
    let decode = side(&model, L::Hnd, 4, 2 * blocks, 16);
    let mut rng = fastrand::Rng::with_seed(1);
    let mut t = || common::random_table(&mut rng, 2 * blocks, blocks as usize);
    let req = KvRequest::new(u64::from(blocks) * 16 - 5, t(), t());
    let p = plan(&prefill, &decode, &req).unwrap();
    check(&prefill, &decode, &req, &p).unwrap();
    assert_eq!(p.stats().runs, 4 * 4096 * 2);
}

#[test]
fn llama_bytes_land_where_slicing_the_full_cache_says() {
    // The real head size and block size, two layers to keep the fake caches small; a
    // partial last block; NHD prefill TP 2 into HND decode TP 4 and back into NHD TP 1.
    let model = KvModel::new(2, 8, 128, 2);
    let mut rng = fastrand::Rng::with_seed(3);
    let blocks = 70;
    for ((pk, dk), tp) in [((L::Nhd, L::Hnd), (2, 4)), ((L::Hnd, L::Nhd), (4, 1))] {
        let prefill = side(&model, pk, tp.0, 80, 16);
        let decode = side(&model, dk, tp.1, 80, 16);
        let req = KvRequest::new(
            blocks * 16 - 9,
            common::random_table(&mut rng, 80, blocks as usize),
            common::random_table(&mut rng, 80, blocks as usize),
        );
        let p = plan(&prefill, &decode, &req).unwrap();
        check(&prefill, &decode, &req, &p).unwrap();
        common::simulate(&prefill, &decode, &req, &p, 9, false).unwrap();
        common::simulate(&prefill, &decode, &req, &p, 9, true).unwrap();
    }
}
