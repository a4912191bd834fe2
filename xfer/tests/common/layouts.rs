//! Random weight-sync layouts and the bytes they hold, shared by the planner's tests and
//! the execution's: a case is its seed.
#![allow(dead_code)]

use proptest::prelude::*;
use std::ops::Range;
use std::sync::Arc;
use xfer::weights::{Holding, Layout, Piece, RegionSpec, TensorSpec};

/// A small deterministic generator (splitmix64), so that a case is its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
    /// A random nonempty subset of `ranks`.
    pub fn some_of(&mut self, ranks: &[usize]) -> Vec<usize> {
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
    pub fn cuts(&mut self, n: u64, max_parts: u64) -> Vec<Range<u64>> {
        let mut points: Vec<u64> = (0..self.below(max_parts)).map(|_| self.below(n)).collect();
        points.push(0);
        points.push(n);
        points.sort_unstable();
        points.dedup();
        points.windows(2).map(|w| w[0]..w[1]).collect()
    }
}

/// The byte `j` of element `g` of tensor `t`: what every test buffer holds there.
pub fn pattern(t: usize, g: u64, j: u64) -> u8 {
    let mut z = ((t as u64) << 48) ^ (g << 8) ^ j;
    z = (z ^ (z >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (z ^ (z >> 32)) as u8
}

/// The global flat indices of a holding's elements, in storage order (the test's own).
pub fn element_indices(h: &Holding, shape: &[u64]) -> Vec<u64> {
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
pub fn scheme(rng: &mut Rng, shape: &[u64], ranks: &[usize]) -> Vec<(usize, Holding)> {
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
pub struct Case {
    pub tensors: Vec<(Vec<u64>, u32)>,
    pub m: usize,
    pub n: usize,
    pub seed: u64,
}

pub fn cases() -> impl Strategy<Value = Case> {
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
pub fn layouts(
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
pub fn buffers(ls: &[Layout], fill: bool) -> Vec<Vec<Vec<u8>>> {
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

pub fn tensor_id(name: &str) -> usize {
    name.trim_start_matches('t').parse().unwrap()
}

/// Builds a random case: sources cover every tensor (sometimes twice over, by two schemes on
/// disjoint ranks, so that their boxes overlap without being replicas), destinations hold
/// some of it.
pub fn build(c: &Case) -> (Vec<TensorSpec>, Vec<Layout>, Vec<Layout>) {
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
