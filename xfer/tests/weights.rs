//! Weight sync's planner and checker on random layouts, executed on host byte buffers.

use proptest::prelude::*;
use std::ops::Range;
use std::sync::Arc;
use xfer::weights::{
    CheckError, ElementBox, Holding, Layout, Piece, Plan, PlanError, PlanOptions, RegionSpec, Run,
    TensorSpec, check,
};

/// A small deterministic generator (splitmix64), so that a case is its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
    /// A random nonempty subset of `ranks`.
    fn some_of(&mut self, ranks: &[usize]) -> Vec<usize> {
        loop {
            let v: Vec<usize> = ranks
                .iter()
                .copied()
                .filter(|_| self.chance(1, 2))
                .collect();
            if !v.is_empty() {
                return v;
            }
        }
    }
    /// `0..n` cut at random points into nonempty ranges.
    fn cuts(&mut self, n: u64, max_parts: u64) -> Vec<Range<u64>> {
        let mut points: Vec<u64> = (0..self.below(max_parts)).map(|_| self.below(n)).collect();
        points.push(0);
        points.push(n);
        points.sort_unstable();
        points.dedup();
        points.windows(2).map(|w| w[0]..w[1]).collect()
    }
}

/// The byte `j` of element `g` of tensor `t`: what every test buffer holds there.
fn pattern(t: usize, g: u64, j: u64) -> u8 {
    let mut z = ((t as u64) << 48) ^ (g << 8) ^ j;
    z = (z ^ (z >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (z ^ (z >> 32)) as u8
}

/// The global flat indices of a holding's elements, in storage order (the test's own).
fn element_indices(h: &Holding, shape: &[u64]) -> Vec<u64> {
    match h {
        Holding::Flat(r) => r.clone().collect(),
        Holding::Box(b) => {
            let mut out = vec![0u64];
            for (d, r) in b.iter().enumerate() {
                let next: Vec<u64> = out
                    .iter()
                    .flat_map(|&base| r.clone().map(move |i| base * shape[d] + i))
                    .collect();
                out = next;
            }
            if b.iter().any(|r| r.is_empty()) {
                Vec::new()
            } else {
                out
            }
        }
    }
}

/// How a tensor is spread over ranks: `(rank, holding)`, covering it whole.
fn scheme(rng: &mut Rng, shape: &[u64], ranks: &[usize]) -> Vec<(usize, Holding)> {
    let numel: u64 = shape.iter().product();
    let mut out = Vec::new();
    match rng.below(3) {
        0 => {
            for r in rng.some_of(ranks) {
                out.push((r, Holding::whole(shape)));
            }
        }
        1 => {
            let dim = rng.below(shape.len() as u64) as usize;
            for part in rng.cuts(shape[dim], 4) {
                let mut b: Vec<Range<u64>> = shape.iter().map(|&d| 0..d).collect();
                b[dim] = part;
                for r in rng.some_of(ranks) {
                    out.push((r, Holding::Box(b.clone())));
                }
            }
        }
        _ => {
            for part in rng.cuts(numel, 9) {
                for r in rng.some_of(ranks) {
                    out.push((r, Holding::Flat(part.clone())));
                }
            }
        }
    }
    out
}

#[derive(Clone, Debug)]
struct Case {
    tensors: Vec<(Vec<u64>, u32)>,
    m: usize,
    n: usize,
    seed: u64,
}

fn cases() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(
            (
                prop::collection::vec(1u64..=5, 1..=4),
                prop::sample::select(vec![1u32, 2, 4]),
            ),
            1..=4,
        ),
        1usize..=8,
        1usize..=8,
        any::<u64>(),
    )
        .prop_map(|(tensors, m, n, seed)| Case {
            tensors,
            m,
            n,
            seed,
        })
}

/// Layouts of `ranks` ranks from `(rank, tensor, holding)`: each rank's tensor table in its
/// own order (or the shared one), its pieces in 1 or 2 regions, shuffled, with gaps.
fn layouts(
    rng: &mut Rng,
    specs: &[TensorSpec],
    ranks: usize,
    held: &[(usize, usize, Holding)],
) -> Vec<Layout> {
    let shared: Arc<[TensorSpec]> = Arc::from(specs.to_vec());
    (0..ranks)
        .map(|rank| {
            let mut order: Vec<usize> = (0..specs.len()).collect();
            let tensors = if rng.chance(1, 2) {
                shared.clone()
            } else {
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i as u64 + 1) as usize);
                }
                Arc::from(order.iter().map(|&i| specs[i].clone()).collect::<Vec<_>>())
            };
            let local = |t: usize| order.iter().position(|&i| i == t).unwrap() as u32;
            let mut mine: Vec<(usize, Holding)> = held
                .iter()
                .filter(|h| h.0 == rank)
                .map(|h| (h.1, h.2.clone()))
                .collect();
            for i in (1..mine.len()).rev() {
                mine.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let regions = 1 + rng.below(2) as usize;
            let mut ends = vec![0u64; regions];
            let mut pieces = Vec::new();
            for (t, holding) in mine {
                let region = rng.below(regions as u64) as usize;
                let bytes = element_indices(&holding, &specs[t].shape).len() as u64
                    * u64::from(specs[t].elem_size);
                let offset = ends[region] + rng.below(4);
                ends[region] = offset + bytes;
                pieces.push(Piece {
                    tensor: local(t),
                    holding,
                    region: region as u32,
                    offset,
                });
            }
            Layout {
                regions: ends
                    .iter()
                    .enumerate()
                    .map(|(i, &e)| RegionSpec {
                        name: format!("r{i}"),
                        len: e + rng.below(4),
                    })
                    .collect(),
                tensors,
                pieces,
            }
        })
        .collect()
}

/// Every region of every rank, filled: sources with the pattern, destinations with 0xEE.
fn buffers(ls: &[Layout], fill: bool) -> Vec<Vec<Vec<u8>>> {
    ls.iter()
        .map(|l| {
            let mut regions: Vec<Vec<u8>> = l
                .regions
                .iter()
                .map(|r| vec![0xEE; r.len as usize])
                .collect();
            if fill {
                for p in &l.pieces {
                    let spec = &l.tensors[p.tensor as usize];
                    let esize = u64::from(spec.elem_size);
                    let t = tensor_id(&spec.name);
                    for (i, g) in element_indices(&p.holding, &spec.shape)
                        .into_iter()
                        .enumerate()
                    {
                        for j in 0..esize {
                            regions[p.region as usize]
                                [(p.offset + i as u64 * esize + j) as usize] = pattern(t, g, j);
                        }
                    }
                }
            }
            regions
        })
        .collect()
}

fn tensor_id(name: &str) -> usize {
    name.trim_start_matches('t').parse().unwrap()
}

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

/// Builds a random case: sources cover every tensor (sometimes twice over, by two schemes on
/// disjoint ranks, so that their boxes overlap without being replicas), destinations hold
/// some of it.
fn build(c: &Case) -> (Vec<TensorSpec>, Vec<Layout>, Vec<Layout>) {
    let mut rng = Rng(c.seed);
    let specs: Vec<TensorSpec> = c
        .tensors
        .iter()
        .enumerate()
        .map(|(i, (shape, esize))| TensorSpec::new(format!("t{i}"), shape.clone(), *esize))
        .collect();
    let mut src_held = Vec::new();
    let mut dst_held = Vec::new();
    let all_src: Vec<usize> = (0..c.m).collect();
    let all_dst: Vec<usize> = (0..c.n).collect();
    for (t, spec) in specs.iter().enumerate() {
        if c.m >= 2 && rng.chance(1, 3) {
            let cut = 1 + rng.below(c.m as u64 - 1) as usize;
            for (r, h) in scheme(&mut rng, &spec.shape, &all_src[..cut]) {
                src_held.push((r, t, h));
            }
            for (r, h) in scheme(&mut rng, &spec.shape, &all_src[cut..]) {
                src_held.push((r, t, h));
            }
        } else {
            for (r, h) in scheme(&mut rng, &spec.shape, &all_src) {
                src_held.push((r, t, h));
            }
        }
        for (r, h) in scheme(&mut rng, &spec.shape, &all_dst) {
            if !rng.chance(1, 5) {
                dst_held.push((r, t, h));
            }
        }
    }
    let src = layouts(&mut rng, &specs, c.m, &src_held);
    let dst = layouts(&mut rng, &specs, c.n, &dst_held);
    (specs, src, dst)
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
