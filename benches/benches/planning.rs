//! The cost of `plan_transfer` alone (a pure function): 1000 random 4 KiB segments that
//! are never adjacent, so each becomes one write. `Melem/s` is millions of segments
//! planned per second. Then a transfer of 16 random 64-byte pages of a 1 GiB region (a
//! few KV-cache blocks), whose cost is the transfer's rather than its pages'.
//!
//! `cargo bench -p xfer-benches --bench planning`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use fabric_core::plan::plan_transfer;
use fabric_core::{LocalKey, RemoteKey, RemoteRegion};
use std::hint::black_box;
use std::time::Duration;
use xfer_benches::{PageLayout, REGION_SIZE, Rng};

const SEGMENTS: usize = 1000;
const MAX_MSG: u64 = 256 << 20;

fn planning(c: &mut Criterion) {
    let dst = RemoteRegion {
        addr: 0,
        len: REGION_SIZE,
        key: RemoteKey(0x1234),
    };
    let layout = PageLayout::sparse(4096, REGION_SIZE);
    let segments = layout.segments(LocalKey(1), dst, SEGMENTS, &mut Rng::with_seed(5));
    let mut g = c.benchmark_group("planning");
    g.sample_size(50)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Elements(SEGMENTS as u64));
    g.bench_function("plan_transfer/1000 x 4KiB", |b| {
        b.iter(|| plan_transfer(black_box(&segments), black_box(MAX_MSG)).expect("valid segments"))
    });
    let small =
        PageLayout::sparse(64, REGION_SIZE).segments(LocalKey(1), dst, 16, &mut Rng::with_seed(6));
    g.throughput(Throughput::Elements(16));
    g.bench_function("plan_transfer/16 x 64B", |b| {
        b.iter(|| plan_transfer(black_box(&small), black_box(MAX_MSG)).expect("valid segments"))
    });
    g.finish();
}

criterion_group!(benches, planning);
criterion_main!(benches);
