//! Inputs the planner refuses, each with a typed error naming what and where; none panics.

use kv_plan::{
    HeadOrder, KvError, KvLayout, KvModel, KvRequest, Regions, Side, StridedRun, check,
    heads_for_rank, plan,
};

fn model() -> KvModel {
    KvModel::new(2, 4, 8, 2)
}

fn group(tp: u32, nb: u32) -> Vec<KvLayout> {
    (0..tp)
        .map(|r| {
            KvLayout::vllm_flash_attn(
                &model(),
                heads_for_rank(4, tp, r).unwrap(),
                nb,
                4,
                Regions::PerTensor,
            )
            .unwrap()
        })
        .collect()
}

#[test]
fn a_head_no_prefill_rank_holds() {
    let prefill = vec![group(2, 8).remove(0)]; // heads 0..2 only
    let decode = group(1, 8);
    let req = KvRequest::new(5, vec![0, 1], vec![2, 3]);
    assert_eq!(
        plan(&prefill, &decode, &req),
        Err(KvError::HeadNotHeld { rank: 0, head: 2 })
    );
}

#[test]
fn geometry_must_match() {
    let decode = vec![
        KvLayout::vllm_flash_attn(&KvModel::new(2, 4, 16, 1), 0..4, 8, 4, Regions::PerTensor)
            .unwrap(),
    ];
    let req = KvRequest::new(5, vec![0, 1], vec![2, 3]);
    assert_eq!(
        plan(&group(2, 8), &decode, &req),
        Err(KvError::Mismatch {
            side: Side::Decode,
            rank: 0,
            field: "elem_size",
            expected: 2,
            found: 1
        })
    );
    let mla = vec![KvLayout::vllm_mla(&KvModel::mla(2, 8, 2), 8, 4, Regions::Packed).unwrap()];
    assert!(matches!(
        plan(&group(2, 8), &mla, &req),
        Err(KvError::Mismatch {
            field: "components",
            ..
        })
    ));
    assert_eq!(
        plan(&[], &mla, &req),
        Err(KvError::NoRanks {
            side: Side::Prefill
        })
    );
    assert_eq!(
        plan(&mla, &[], &req),
        Err(KvError::NoRanks { side: Side::Decode })
    );
}

#[test]
fn an_invalid_layout_is_named() {
    let mut decode = group(2, 8);
    decode[1].token_stride = 8; // two heads of 16 bytes do not fit in 8
    let req = KvRequest::new(5, vec![0, 1], vec![2, 3]);
    match plan(&group(2, 8), &decode, &req) {
        Err(KvError::Layout {
            side: Side::Decode,
            rank: 1,
            source,
        }) => {
            assert!(matches!(*source, KvError::Aliasing { .. }))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn block_tables_are_checked() {
    let (prefill, decode) = (group(2, 8), group(4, 8));
    let cases = [
        (
            KvRequest::new(9, vec![0, 1], vec![0, 1, 2]),
            KvError::TableTooShort {
                side: Side::Prefill,
                rank: 0,
                blocks: 2,
                needed: 3,
                tokens: 9,
            },
        ),
        (
            KvRequest::new(9, vec![0, 1, 8], vec![0, 1, 2]),
            KvError::BlockOutOfRange {
                side: Side::Prefill,
                rank: 0,
                index: 2,
                block: 8,
                num_blocks: 8,
            },
        ),
        (
            KvRequest::new(9, vec![0, 1, 2], vec![3, 1, 3]),
            KvError::DuplicateBlock {
                side: Side::Decode,
                rank: 0,
                block: 3,
            },
        ),
        (
            KvRequest::per_rank(9, vec![vec![0, 1, 2]; 3], vec![vec![0, 1, 2]]),
            KvError::Tables {
                side: Side::Prefill,
                tables: 3,
                ranks: 2,
            },
        ),
    ];
    for (req, want) in cases {
        assert_eq!(plan(&prefill, &decode, &req), Err(want.clone()));
        assert_eq!(
            check(&prefill, &decode, &req, &Default::default()),
            Err(want.into())
        );
    }
    // Entries past the tokens are not looked at: a repeated or unknown one there is fine.
    let req = KvRequest::new(8, vec![0, 1, 1, 99], vec![5, 6, 5]);
    let p = plan(&prefill, &decode, &req).unwrap();
    check(&prefill, &decode, &req, &p).unwrap();
}

#[test]
fn an_empty_request_moves_nothing() {
    let (prefill, decode) = (group(2, 8), group(4, 8));
    let req = KvRequest::new(0, vec![], vec![]);
    let p = plan(&prefill, &decode, &req).unwrap();
    assert!(p.pairs.is_empty());
    check(&prefill, &decode, &req, &p).unwrap();
}

#[test]
fn sizes_past_64_bits_are_errors() {
    let huge = KvModel::new(1, 1 << 20, u32::MAX, 4);
    assert!(matches!(
        KvLayout::vllm_flash_attn(&huge, 0..(1 << 20), u32::MAX, u32::MAX, Regions::Packed),
        Err(KvError::Overflow { .. })
    ));
    assert!(matches!(
        KvLayout::vllm_flashinfer(
            &KvModel::new(1, 1, 1 << 30, 4),
            0..1,
            u32::MAX,
            u32::MAX,
            HeadOrder::Hnd,
            Regions::Packed
        ),
        Err(KvError::Overflow { .. })
    ));
    let mut l = group(1, 8).remove(0);
    l.places[3].offset = u64::MAX - 10;
    assert!(matches!(l.validate(), Err(KvError::Overflow { .. })));
    assert!(matches!(l.extent(1, 1), Err(KvError::Overflow { .. })));
    assert!(matches!(
        l.place(2, 0),
        Err(KvError::NoTensor {
            layer: 2,
            component: 0,
            ..
        })
    ));
}

#[test]
fn placing_a_run_outside_the_tensor_fails() {
    let (prefill, decode) = (group(2, 8), group(4, 8));
    let req = KvRequest::new(8, vec![0, 1], vec![2, 3]);
    let mut p = plan(&prefill, &decode, &req).unwrap();
    let pair = &mut p.pairs[0];
    assert!(pair.placed(&prefill[0], &decode[0], 1, 1).is_ok());
    pair.runs[0] = StridedRun {
        dst_offset: decode[0].tensor_span().unwrap(),
        ..pair.runs[0]
    };
    assert_eq!(
        pair.placed(&prefill[0], &decode[0], 1, 1).map(|_| ()),
        Err(KvError::BadRun {
            prefill: 0,
            decode: 0,
            run: 0
        })
    );
    assert!(matches!(
        pair.placed(&prefill[0], &decode[0], 2, 0).map(|_| ()),
        Err(KvError::NoTensor { .. })
    ));
}
