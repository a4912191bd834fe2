//! Weight sync's planner and checker on random layouts, executed on host byte buffers.

mod common;

use common::layouts::{buffers, build, cases, element_indices, pattern, tensor_id};
use proptest::prelude::*;
use std::ops::Range;
use std::sync::Arc;
use xfer::weights::{
    CheckError, ElementBox, Holding, Layout, Piece, Plan, PlanError, PlanOptions, RegionSpec, Run,
    TensorSpec, check,
};

/// The tiny interpreter: copies every segment of the plan between host buffers.
fn execute(plan: &Plan, src: &[Vec<Vec<u8>>], dst: &mut [Vec<Vec<u8>>]) {
    for pair in plan.pairs() {
        let from = &src[pair.src.rank as usize][pair.src.region as usize];
        let to = &mut dst[pair.dst.rank as usize][pair.dst.region as usize];
        for s in pair.segments() {
            let (a, b, n) = (s.src_offset as usize, s.dst_offset as usize, s.len as usize);
            to[b..b + n].copy_from_slice(&from[a..a + n]);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// The plan covers every destination byte exactly once (the checker says so), and
    /// executing it on host buffers gives every destination piece exactly the bytes of the
    /// full tensor at its elements.
    #[test]
    fn executing_the_plan_lands_every_destination_byte(c in cases(), q in 0u64..64) {
        let (_, src, dst) = build(&c);
        let plan = Plan::with_options(&src, &dst, &PlanOptions::default().min_split_bytes(q))
            .expect("sources cover every tensor");
        let report = check(&src, &dst, &plan).expect("the checker accepts the plan");
        let src_bufs = buffers(&src, true);
        let mut dst_bufs = buffers(&dst, false);
        execute(&plan, &src_bufs, &mut dst_bufs);
        let mut bytes = 0u64;
        for (rank, l) in dst.iter().enumerate() {
            for p in &l.pieces {
                let spec = &l.tensors[p.tensor as usize];
                let esize = u64::from(spec.elem_size);
                let t = tensor_id(&spec.name);
                for (i, g) in element_indices(&p.holding, &spec.shape).into_iter().enumerate() {
                    for j in 0..esize {
                        let at = (p.offset + i as u64 * esize + j) as usize;
                        prop_assert_eq!(
                            dst_bufs[rank][p.region as usize][at], pattern(t, g, j),
                            "destination {} tensor {} element {} byte {}", rank, &spec.name, g, j
                        );
                        bytes += 1;
                    }
                }
            }
        }
        prop_assert_eq!(report.bytes, bytes);
        prop_assert_eq!(plan.bytes(), bytes);
        // Deterministic, and the same after a trip through serde.
        let again = Plan::with_options(&src, &dst, &PlanOptions::default().min_split_bytes(q)).unwrap();
        prop_assert_eq!(&again, &plan);
        let wire: Plan = postcard::from_bytes(&postcard::to_allocvec(&plan).unwrap()).unwrap();
        prop_assert_eq!(&wire, &plan);
        let json: Vec<Layout> = serde_json::from_str(&serde_json::to_string(&dst).unwrap()).unwrap();
        prop_assert_eq!(&json, &dst);
        // The busiest rank is at least the bound (the bound is a lower bound).
        let t = plan.timing(400.0);
        prop_assert!(t.busiest.bytes >= plan.bound().bytes, "{:?} {:?}", t, plan.bound());
    }

    /// A tensor replicated on k sources (and several of them on the same k) is split so that
    /// no source carries more than ceil(total / k) + max(q, element size) bytes.
    #[test]
    fn replicas_share_the_load(
        k in 2usize..=8,
        tensors in prop::collection::vec((1u64..300, 1u64..40, prop::sample::select(vec![1u32, 2, 4])), 1..4),
        n in 1usize..=6,
        split_dim in 0usize..3,
        q in prop::sample::select(vec![0u64, 1, 64, 1000, 1 << 20]),
    ) {
        let specs: Vec<TensorSpec> = tensors
            .iter()
            .enumerate()
            .map(|(i, &(r, c, e))| TensorSpec::new(format!("t{i}"), vec![r, c], e))
            .collect();
        let table: Arc<[TensorSpec]> = Arc::from(specs.clone());
        let src: Vec<Layout> = (0..k)
            .map(|_| Layout::pack(table.clone(), "s", (0..specs.len() as u32).map(|t| (t, Holding::whole(&specs[t as usize].shape)))).unwrap())
            .collect();
        // Destinations: all whole, or a split of rows or columns over them.
        let dst: Vec<Layout> = (0..n as u64)
            .map(|d| {
                Layout::pack(table.clone(), "d", (0..specs.len() as u32).map(|t| {
                    let shape = &specs[t as usize].shape;
                    let h = if split_dim < 2 && shape[split_dim] >= n as u64 {
                        Holding::split(shape, split_dim, n as u64, d).unwrap()
                    } else {
                        Holding::whole(shape)
                    };
                    (t, h)
                })).unwrap()
            })
            .collect();
        let plan = Plan::with_options(&src, &dst, &PlanOptions::default().min_split_bytes(q)).unwrap();
        check(&src, &dst, &plan).unwrap();
        let loads = plan.source_bytes();
        let total: u64 = loads.iter().sum();
        let esize = specs.iter().map(|s| u64::from(s.elem_size)).max().unwrap();
        let bound = total.div_ceil(k as u64) + q.max(esize);
        for (s, &l) in loads.iter().enumerate() {
            prop_assert!(l <= bound, "source {} carries {} > {} (loads {:?})", s, l, bound, loads);
        }
    }

    /// Random, often invalid, layouts: the planner answers (a plan the checker accepts, or a
    /// typed error), and never panics.
    #[test]
    fn arbitrary_layouts_never_panic(
        shape in prop::collection::vec(0u64..4, 0..3),
        esize in 0u32..3,
        pieces in prop::collection::vec(
            (any::<bool>(), prop::collection::vec((0u64..5, 0u64..5), 0..3), 0u32..2, 0u64..40, 0usize..3),
            0..6,
        ),
    ) {
        let table: Arc<[TensorSpec]> = Arc::from(vec![TensorSpec::new("t0", shape, esize)]);
        let mut ls: Vec<Layout> = (0..3)
            .map(|_| Layout { regions: vec![RegionSpec { name: "r".into(), len: 40 }], tensors: table.clone(), pieces: vec![] })
            .collect();
        for (flat, ranges, region, offset, rank) in pieces {
            let holding = if flat {
                Holding::Flat(ranges.first().map(|r| r.0..r.1).unwrap_or(0..0))
            } else {
                Holding::Box(ranges.iter().map(|r| r.0..r.1).collect())
            };
            ls[rank].pieces.push(Piece { tensor: 0, holding, region, offset });
        }
        let (src, dst) = ls.split_at(2);
        if let Ok(plan) = Plan::new(src, dst) {
            check(src, dst, &plan).unwrap();
        }
    }
}

/// Tensor `w` of 4 rows of 6, BF16: sources hold flat elements 0..10 and 10..24 (cut mid-row
/// 1), destinations the column halves 0..3 and 3..6.
fn two_by_two(second: Range<u64>) -> (Vec<Layout>, Vec<Layout>) {
    let t: Arc<[TensorSpec]> = Arc::from(vec![TensorSpec::new("w", vec![4, 6], 2)]);
    let src = vec![
        Layout::pack(t.clone(), "s", [(0, Holding::Flat(0..10))]).unwrap(),
        Layout::pack(t.clone(), "s", [(0, Holding::Flat(second))]).unwrap(),
    ];
    let dst = (0..2)
        .map(|i| {
            Layout::pack(
                t.clone(),
                "d",
                [(0, Holding::split(&[4, 6], 1, 2, i).unwrap())],
            )
            .unwrap()
        })
        .collect();
    (src, dst)
}

/// The run of the pair (source `s`, destination `d`) that starts at `src_offset`.
fn run_of(plan: &mut Plan, s: u32, d: u32, src_offset: u64) -> (usize, usize) {
    let pairs = plan.pairs_mut();
    let p = pairs
        .iter()
        .position(|p| p.src.rank == s && p.dst.rank == d)
        .unwrap();
    let r = pairs[p]
        .runs
        .iter()
        .position(|r| r.src_offset == src_offset)
        .unwrap();
    (p, r)
}

#[test]
fn strided_runs_for_a_column_split_of_mid_row_shards() {
    let (src, dst) = two_by_two(10..24);
    let plan = Plan::new(&src, &dst).unwrap();
    let runs = |s: u32, d: u32| {
        plan.pairs()
            .iter()
            .find(|p| p.src.rank == s && p.dst.rank == d)
            .unwrap()
            .runs
            .clone()
    };
    let strided = |src_offset, dst_offset, len, count, src_stride, dst_stride| Run {
        src_offset,
        dst_offset,
        len,
        count,
        src_stride,
        dst_stride,
    };
    // Source 0: row 0 and the first 4 columns of row 1.
    assert_eq!(runs(0, 0), vec![strided(0, 0, 6, 2, 12, 6)]);
    assert_eq!(
        runs(0, 1),
        vec![Run::contiguous(6, 0, 6), Run::contiguous(18, 6, 2)]
    );
    // Source 1: columns 4..6 of row 1, then rows 2..4.
    assert_eq!(runs(1, 0), vec![strided(4, 12, 6, 2, 12, 6)]);
    assert_eq!(
        runs(1, 1),
        vec![Run::contiguous(0, 8, 4), strided(10, 12, 6, 2, 12, 6)]
    );
    check(&src, &dst, &plan).unwrap();
}

#[test]
fn the_checker_names_a_dropped_run() {
    let (src, dst) = two_by_two(10..24);
    let mut plan = Plan::new(&src, &dst).unwrap();
    let (p, r) = run_of(&mut plan, 1, 0, 4);
    plan.pairs_mut()[p].runs.remove(r);
    assert_eq!(
        check(&src, &dst, &plan),
        Err(CheckError::Gap {
            tensor: "w".into(),
            dst_rank: 0,
            elements: ElementBox(vec![2..4, 0..3]),
            count: 6,
        })
    );
}

#[test]
fn the_checker_names_a_duplicated_run() {
    let (src, dst) = two_by_two(10..24);
    let mut plan = Plan::new(&src, &dst).unwrap();
    let (p, r) = run_of(&mut plan, 0, 1, 18);
    let dup = plan.pairs()[p].runs[r];
    plan.pairs_mut()[p].runs.push(dup);
    let e = check(&src, &dst, &plan).unwrap_err();
    assert_eq!(
        e,
        CheckError::Overlap {
            tensor: "w".into(),
            dst_rank: 1,
            elements: ElementBox(vec![1..2, 3..4]),
            count: 1,
        }
    );
    assert_eq!(
        e.to_string(),
        "tensor w: destination 1 gets elements [1..2, 3..4] twice (1 elements)"
    );
}

#[test]
fn the_checker_names_a_run_shifted_by_one_element() {
    let (src, dst) = two_by_two(10..24);
    let mut plan = Plan::new(&src, &dst).unwrap();
    let (p, r) = run_of(&mut plan, 1, 1, 10);
    plan.pairs_mut()[p].runs[r].src_offset += 2;
    assert_eq!(
        check(&src, &dst, &plan),
        Err(CheckError::Mismatch {
            tensor: "w".into(),
            dst_rank: 1,
            elements: ElementBox(vec![2..3, 3..4]),
            src_rank: 1,
            src_tensor: "w".into(),
            read: ElementBox(vec![2..3, 4..5]),
        })
    );
    // Shifted on the destination side instead: the element before is written twice.
    let mut plan = Plan::new(&src, &dst).unwrap();
    let (p, r) = run_of(&mut plan, 1, 1, 10);
    plan.pairs_mut()[p].runs[r].dst_offset -= 2;
    assert!(matches!(
        check(&src, &dst, &plan),
        Err(CheckError::Mismatch { dst_rank: 1, .. })
    ));
    // Past the end of the source's bytes.
    let mut plan = Plan::new(&src, &dst).unwrap();
    let (p, r) = run_of(&mut plan, 0, 1, 18);
    plan.pairs_mut()[p].runs[r].src_offset += 2;
    assert!(matches!(
        check(&src, &dst, &plan),
        Err(CheckError::OutsidePieces {
            rank: 0,
            offset: 20,
            ..
        })
    ));
}

#[test]
fn an_element_no_source_holds_is_named() {
    // Elements 10 and 11 (row 1, columns 4 and 5) are nobody's; destination 1 needs them.
    let (src, dst) = two_by_two(12..24);
    assert_eq!(
        Plan::new(&src, &dst),
        Err(PlanError::Uncovered {
            tensor: "w".into(),
            dst_rank: 1,
            elements: ElementBox(vec![1..2, 4..6]),
        })
    );
    let e = Plan::new(&src, &dst).unwrap_err().to_string();
    assert_eq!(
        e,
        "tensor w: no source holds elements [1..2, 4..6] that destination 1 needs"
    );
    // A tensor no source has at all.
    let t: Arc<[TensorSpec]> = Arc::from(vec![TensorSpec::new("lm_head", vec![3, 2], 2)]);
    let dst = vec![Layout::pack(t, "d", [(0, Holding::whole(&[3, 2]))]).unwrap()];
    assert!(matches!(
        Plan::new(&[], &dst),
        Err(PlanError::Uncovered { ref tensor, dst_rank: 0, .. }) if tensor == "lm_head"
    ));
}

#[test]
fn layouts_that_disagree_on_a_tensor_are_refused() {
    let a: Arc<[TensorSpec]> = Arc::from(vec![TensorSpec::new("w", vec![4, 6], 2)]);
    let b: Arc<[TensorSpec]> = Arc::from(vec![TensorSpec::new("w", vec![6, 4], 2)]);
    let src = vec![Layout::pack(a, "s", [(0, Holding::Flat(0..24))]).unwrap()];
    let dst = vec![Layout::pack(b, "d", [(0, Holding::Flat(0..24))]).unwrap()];
    assert!(matches!(
        Plan::new(&src, &dst),
        Err(PlanError::TensorMismatch { ref tensor, .. }) if tensor == "w"
    ));
    let mut bad = src.clone();
    bad[0].pieces[0].offset = 1;
    assert!(matches!(
        Plan::new(&bad, &src),
        Err(PlanError::Layout { rank: 0, .. })
    ));
}

#[test]
fn bytes_only_one_source_holds_are_counted_before_choices() {
    // Sources 0 and 1 both hold `shared` (4 KiB); source 0 alone holds `own` (8 KiB). Given
    // out first, `shared` would be split evenly and source 0 end at 10 KiB; counted first,
    // `own` sends `shared` whole to source 1: 8 KiB each way at most, the bound.
    let t: Arc<[TensorSpec]> = Arc::from(vec![
        TensorSpec::new("shared", vec![1024], 4),
        TensorSpec::new("own", vec![2048], 4),
    ]);
    let src = vec![
        Layout::pack(
            t.clone(),
            "s",
            [(0, Holding::whole(&[1024])), (1, Holding::whole(&[2048]))],
        )
        .unwrap(),
        Layout::pack(t.clone(), "s", [(0, Holding::whole(&[1024]))]).unwrap(),
    ];
    let dst = vec![
        Layout::pack(
            t,
            "d",
            [(0, Holding::whole(&[1024])), (1, Holding::whole(&[2048]))],
        )
        .unwrap(),
    ];
    let plan = Plan::with_options(&src, &dst, &PlanOptions::default().min_split_bytes(0)).unwrap();
    check(&src, &dst, &plan).unwrap();
    assert_eq!(plan.source_bytes(), vec![8192, 4096]);
    // The destination must receive 12 KiB: that is the bound, and the plan meets it.
    assert_eq!(plan.bound().bytes, 12288);
    assert_eq!(
        plan.bound().limit,
        xfer::weights::Limit::Destination { rank: 0 }
    );
    let t = plan.timing(8e-9 * 12288.0); // 12288 bytes per second
    assert!(
        (t.predicted_s - 1.0).abs() < 1e-9 && (t.bound_s - 1.0).abs() < 1e-9,
        "{t:?}"
    );
    // With two destinations needing both, the sources bind: 24 KiB over 2 sources, and
    // source 0 alone must send `own` twice (16 KiB).
    let dst2 = vec![dst[0].clone(), dst[0].clone()];
    let plan = Plan::with_options(&src, &dst2, &PlanOptions::default().min_split_bytes(0)).unwrap();
    assert_eq!(plan.bound().bytes, 16384);
    assert_eq!(
        plan.bound().limit,
        xfer::weights::Limit::Sources { ranks: vec![0] }
    );
    assert_eq!(plan.source_bytes(), vec![16384, 8192]);
}

#[test]
fn crafted_plans_are_refused_without_replaying_them_whole() {
    let (src, dst) = two_by_two(10..24);
    let mut plan = Plan::new(&src, &dst).unwrap();
    // 2^64 rows rewriting the right bytes: the checker stops once more bytes landed than the
    // destination holds, and names those written twice (not the holes left unreplayed).
    let (p, _) = run_of(&mut plan, 1, 1, 0);
    let huge = Run {
        count: u64::MAX,
        src_stride: 0,
        dst_stride: 0,
        ..Run::contiguous(0, 8, 4)
    };
    plan.pairs_mut()[p].runs.push(huge);
    assert_eq!(
        check(&src, &dst, &plan),
        Err(CheckError::Overlap {
            tensor: "w".into(),
            dst_rank: 1,
            elements: ElementBox(vec![1..2, 4..6]),
            count: 2,
        })
    );
    // Rows of no bytes write nothing, however many.
    plan.pairs_mut()[p].runs.last_mut().unwrap().len = 0;
    check(&src, &dst, &plan).unwrap();
    // Pairs out of order, or naming ranks and regions that do not exist.
    plan.pairs_mut().reverse();
    let _ = plan.pairs_from(1);
    plan.pairs_mut()[0].dst.region = 7;
    assert!(matches!(
        check(&src, &dst, &plan),
        Err(CheckError::NoSuchRegion { region: 7, .. })
    ));
    plan.pairs_mut()[0].dst.rank = 9;
    assert!(matches!(
        check(&src, &dst, &plan),
        Err(CheckError::NoSuchRank { rank: 9, .. })
    ));
}

#[test]
fn exabyte_layouts_plan_without_overflow() {
    // 4 EiB of one tensor on 2 sources, wanted whole by 8 destinations: the sums saturate.
    let n = 1u64 << 61;
    let t: Arc<[TensorSpec]> = Arc::from(vec![TensorSpec::new("huge", vec![n], 2)]);
    let src: Vec<Layout> = (0..2)
        .map(|i| Layout::pack(t.clone(), "s", [(0, Holding::flat_shard(n, 2, i))]).unwrap())
        .collect();
    let dst: Vec<Layout> = (0..8)
        .map(|_| Layout::pack(t.clone(), "d", [(0, Holding::whole(&[n]))]).unwrap())
        .collect();
    let plan = Plan::new(&src, &dst).unwrap();
    assert_eq!(plan.run_count(), 16);
    assert_eq!(plan.bytes(), u64::MAX);
    assert_eq!(plan.bound().bytes, u64::MAX); // each source must send 8 x 2 EiB
    assert_eq!(check(&src, &dst, &plan).unwrap().bytes, u64::MAX);
    assert!(plan.timing(400.0).predicted_s > 0.0);
}
