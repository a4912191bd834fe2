//! Random layouts and requests: every decode byte equals the slice of the full logical
//! cache (replayed byte by byte, push and pull), the checker agrees, replicas are
//! balanced, and the checker rejects every broken plan.

mod common;

use common::{Kind, MHA_KINDS, MLA_KINDS, group, random_table, simulate};
use kv_plan::{CheckError, KvLayout, KvModel, KvPlan, KvRequest, Regions, check, plan};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Case {
    mla: bool,
    kv_heads: u32,
    head_dim: u32,
    elem_size: u32,
    layers: u32,
    tp: (u32, u32),
    kinds: (Kind, Kind),
    regions: (Regions, Regions),
    block_sizes: (u32, u32),
    tokens: u64,
    extra_blocks: (u32, u32),
    per_rank_tables: (bool, bool),
    seed: u64,
}

fn tps(kv_heads: u32, mla: bool) -> Vec<u32> {
    (1..=8)
        .filter(|&t| mla || kv_heads.is_multiple_of(t) || t.is_multiple_of(kv_heads))
        .collect()
}

fn regions() -> impl Strategy<Value = Regions> {
    prop::sample::select(vec![Regions::PerTensor, Regions::Packed])
}

fn case() -> impl Strategy<Value = Case> {
    (prop::bool::weighted(0.3), 1..=16u32)
        .prop_flat_map(|(mla, k)| {
            let k = if mla { 1 } else { k };
            let t = tps(k, mla);
            let kinds = if mla {
                MLA_KINDS.to_vec()
            } else {
                MHA_KINDS.to_vec()
            };
            (
                (
                    Just(mla),
                    Just(k),
                    1..=4u32,
                    prop::sample::select(vec![1u32, 2]),
                    1..=3u32,
                ),
                (prop::sample::select(t.clone()), prop::sample::select(t)),
                (
                    prop::sample::select(kinds.clone()),
                    prop::sample::select(kinds),
                ),
                (regions(), regions()),
                (
                    prop::sample::select(vec![1u32, 2, 4, 8]),
                    prop::sample::select(vec![1u32, 2, 4]),
                    any::<bool>(),
                ),
                (1..=80u64, 0..=4u32, 0..=4u32),
                (any::<bool>(), any::<bool>(), any::<u64>()),
            )
        })
        .prop_map(
            |(
                m,
                tp,
                kinds,
                regions,
                (base, mult, prefill_big),
                (tokens, pe, de),
                (pr, dr, seed),
            )| Case {
                mla: m.0,
                kv_heads: m.1,
                head_dim: m.2,
                elem_size: m.3,
                layers: m.4,
                tp,
                kinds,
                regions,
                block_sizes: if prefill_big {
                    (base * mult, base)
                } else {
                    (base, base * mult)
                },
                tokens,
                extra_blocks: (pe, de),
                per_rank_tables: (pr, dr),
                seed,
            },
        )
}

fn build(c: &Case) -> (Vec<KvLayout>, Vec<KvLayout>, KvRequest) {
    let model = if c.mla {
        KvModel::mla(c.layers, c.head_dim, c.elem_size)
    } else {
        KvModel::new(c.layers, c.kv_heads, c.head_dim, c.elem_size)
    };
    let mut rng = fastrand::Rng::with_seed(c.seed);
    let mut side = |kind, tp, bs: u32, extra: u32, regions, per_rank: bool| {
        let need = c.tokens.div_ceil(u64::from(bs)) as u32;
        let nb = need + extra;
        let layouts = group(kind, &model, tp, nb, bs, regions);
        let tables = (0..if per_rank { tp } else { 1 })
            .map(|_| {
                let len = need + rng.u32(0..=extra);
                random_table(&mut rng, nb, len as usize)
            })
            .collect::<Vec<_>>();
        (layouts, tables)
    };
    let (prefill, pt) = side(
        c.kinds.0,
        c.tp.0,
        c.block_sizes.0,
        c.extra_blocks.0,
        c.regions.0,
        c.per_rank_tables.0,
    );
    let (decode, dt) = side(
        c.kinds.1,
        c.tp.1,
        c.block_sizes.1,
        c.extra_blocks.1,
        c.regions.1,
        c.per_rank_tables.1,
    );
    (prefill, decode, KvRequest::per_rank(c.tokens, pt, dt))
}

/// Prefill ranks holding the same heads (replicas, MLA) send about the same bytes: each
/// cut between them is off by at most half a unit (the larger block), so shares differ
/// by at most two units of one head.
fn assert_balanced(prefill: &[KvLayout], p: &KvPlan, unit: u64) -> Result<(), TestCaseError> {
    let stats = p.stats();
    let mut sent = vec![0u64; prefill.len()];
    for s in &stats.pairs {
        sent[s.prefill as usize] += s.bytes;
    }
    for (a, la) in prefill.iter().enumerate() {
        for (b, lb) in prefill.iter().enumerate() {
            if a < b && la.heads == lb.heads {
                prop_assert_eq!(la.local_heads(), 1, "replicas hold one head");
                let diff = sent[a].abs_diff(sent[b]);
                let bound = 2 * (unit + 1) * la.head_bytes;
                prop_assert!(
                    diff <= bound,
                    "ranks {a} and {b} send {} and {} bytes",
                    sent[a],
                    sent[b]
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::default())]

    #[test]
    fn every_decode_byte_is_the_slice_of_the_full_cache(c in case()) {
        let (prefill, decode, req) = build(&c);
        let p = plan(&prefill, &decode, &req).map_err(|e| TestCaseError::fail(e.to_string()))?;
        check(&prefill, &decode, &req, &p).map_err(|e| TestCaseError::fail(e.to_string()))?;
        simulate(&prefill, &decode, &req, &p, c.seed, false).map_err(TestCaseError::fail)?;
        simulate(&prefill, &decode, &req, &p, c.seed, true).map_err(TestCaseError::fail)?;
        let unit = u64::from(c.block_sizes.0.max(c.block_sizes.1));
        assert_balanced(&prefill, &p, unit)?;
        // Rows are never finer than a head, nor runs more than one per (block, head)
        // chunk: a chunk lies in one block of each side, and there are at most
        // (blocks of both sides) chunks per decode rank.
        let stats = p.stats();
        for s in &stats.pairs {
            let chunks = c.tokens.div_ceil(u64::from(c.block_sizes.0.min(c.block_sizes.1)));
            prop_assert!(s.runs <= chunks * s.block_heads.max(1));
            prop_assert_eq!(s.bytes % prefill[0].head_bytes, 0);
        }
    }

    #[test]
    fn the_checker_rejects_broken_plans(c in case(), which in 0..6u32, pick in any::<prop::sample::Index>()) {
        let (prefill, decode, req) = build(&c);
        let mut p = plan(&prefill, &decode, &req).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let runs: Vec<(usize, usize)> = p
            .pairs
            .iter()
            .enumerate()
            .flat_map(|(i, pair)| (0..pair.runs.len()).map(move |j| (i, j)))
            .collect();
        let (i, j) = *pick.get(&runs);
        let hb = prefill[0].head_bytes;
        let pair = &mut p.pairs[i];
        let what = match which {
            0 => { pair.runs.remove(j); "dropped" }
            1 => { let r = pair.runs[j]; pair.runs.push(r); "doubled" }
            2 => { pair.runs[j].dst_offset += 1; "dst + 1" }
            3 => { pair.runs[j].dst_offset += hb; "dst + a head" }
            4 => { pair.runs[j].src_offset += hb; "src + a head" }
            _ => { pair.runs[j].count -= 1; "a row less" }
        };
        let verdict = check(&prefill, &decode, &req, &p);
        prop_assert!(verdict.is_err(), "a plan with a run {what} passed");
    }
}

#[test]
fn the_checker_names_what_is_wrong() {
    let model = KvModel::new(2, 4, 8, 2);
    let prefill = group(Kind::FlashAttn, &model, 2, 8, 4, Regions::PerTensor);
    let decode = group(Kind::FlashInferHnd, &model, 4, 8, 4, Regions::Packed);
    let req = KvRequest::new(10, vec![5, 2, 7], vec![0, 1, 2]);
    let good = plan(&prefill, &decode, &req).unwrap();
    check(&prefill, &decode, &req, &good).unwrap();

    let mut p = good.clone();
    p.pairs[0].runs.remove(0);
    assert!(matches!(
        check(&prefill, &decode, &req, &p),
        Err(CheckError::Missing { decode: 0, .. })
    ));

    let mut p = good.clone();
    let r = p.pairs[0].runs[0];
    p.pairs[0].runs.push(r);
    assert!(matches!(
        check(&prefill, &decode, &req, &p),
        Err(CheckError::Excess { decode: 0, .. })
    ));

    // Block 0's run in place of block 1's (as many bytes): block 0 twice, block 1 never.
    let mut p = good.clone();
    assert_eq!(p.pairs[0].runs.len(), 3);
    p.pairs[0].runs[1] = p.pairs[0].runs[0];
    assert!(matches!(
        check(&prefill, &decode, &req, &p),
        Err(CheckError::Twice { decode: 0, .. })
    ));

    let mut p = good.clone();
    p.pairs[1].runs[0].src_offset += 16;
    assert!(matches!(
        check(&prefill, &decode, &req, &p),
        Err(CheckError::Misplaced { .. })
    ));

    let mut p = good.clone();
    p.pairs[0].runs[0].dst_offset += 1 << 30;
    assert!(matches!(
        check(&prefill, &decode, &req, &p),
        Err(CheckError::Stray { .. })
    ));

    let mut p = good.clone();
    p.pairs[0].decode = 9;
    assert!(matches!(
        check(&prefill, &decode, &req, &p),
        Err(CheckError::UnknownRank { rank: 9, .. })
    ));

    let mut p = good.clone();
    p.num_layers = 3;
    assert!(matches!(
        check(&prefill, &decode, &req, &p),
        Err(CheckError::Shape { plan_layers: 3, .. })
    ));

    let mut p = good.clone();
    let r = &mut p.pairs[0].runs[0];
    (r.count, r.src_stride) = (2, r.len - 1);
    assert!(matches!(
        check(&prefill, &decode, &req, &p),
        Err(CheckError::BadRun { .. })
    ));

    // A decode block outside the request is never written: the plan for a request whose
    // decode table is [0, 1, 2] does not fit one whose table is [0, 1, 3].
    let other = KvRequest::new(10, vec![5, 2, 7], vec![0, 1, 3]);
    assert!(matches!(
        check(&prefill, &decode, &other, &good),
        Err(CheckError::Stray { .. })
    ));
}
