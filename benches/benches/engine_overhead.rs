//! Operations per second through the engine on the `mem` transport with tiny writes:
//! transfers of 1024 segments of 64 bytes that are never adjacent (so none coalesce),
//! 4 transfers in flight. Criterion's `Melem/s` is millions of writes per second through
//! one worker (the target of issue 6 is at least 10).
//!
//! The same with transfers of 16 segments measures what a transfer costs beyond its writes
//! (planning, the hand-off to the worker and back, the allocations on the way), with the
//! system's allocator: its `Melem/s` is millions of transfers per second.
//!
//! `cargo bench -p xfer-benches --bench engine_overhead`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::time::Duration;
use xfer_benches::{Backend, DEPTH, GroupPair, PageLayout, Pair};

const SEGMENT: u64 = 64;
const SEGMENTS: usize = 1024;
/// Room for 8192 non-adjacent 64-byte slots.
const REGION: u64 = 1 << 20;

fn engine_overhead(c: &mut Criterion) {
    let pair = Pair::new(&Backend::Mem, REGION).expect("mem pair");
    let layout = PageLayout::sparse(SEGMENT, REGION);
    let transfers = pair.transfers(&layout, SEGMENTS, 64, 7);
    let mut g = c.benchmark_group("engine_overhead");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(SEGMENTS as u64));
    g.bench_function("mem/64B x 1024 segments", |b| {
        b.iter_custom(|iters| {
            xfer_benches::run(&pair.initiator, &transfers, iters, DEPTH)
                .expect("transfers complete")
        })
    });
    // A rail group of one rail: the path an agent's transfers take.
    let group = GroupPair::new(&Backend::Mem, 1, REGION).expect("mem group pair");
    let small = group.transfers(&layout, 16, 256, 11);
    g.throughput(Throughput::Elements(1));
    g.bench_function("mem/64B x 16 segments, rail group, per transfer", |b| {
        b.iter_custom(|iters| group.run(&small, iters, DEPTH).expect("transfers complete"))
    });
    g.finish();
}

criterion_group!(benches, engine_overhead);
criterion_main!(benches);
