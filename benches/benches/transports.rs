//! The demo workload on every backend available: transfers of 256 pages chosen at random
//! from a 256 MiB region, written to the same page indices of the peer's region through
//! the engine, 4 transfers in flight; 64 KiB and 4 KiB pages; 1 and 4 rails. Criterion
//! prints the throughput in GiB/s.
//!
//! Bench ids are `transports/PAGE/BACKEND/RAILS` where RAILS says what the initiator is:
//! - `1rail`: one engine, one transport, one connection;
//! - `4rail-conns`: one engine whose TCP transport opens 4 connections to the peer;
//! - `4rail-group`: a `RailGroup` of 4 engines (worker threads), each with its own transport
//!   and connection, every transfer sharded over them by bytes.
//!
//! The target is the same in every case: one engine (one worker thread, one transport) that
//! takes the initiator's 1 or 4 connections, so `4rail-conns` against `4rail-group` compares
//! one engine with 4 connections against a group of 4 engines, and nothing else.
//!
//! `cargo bench -p xfer-benches --bench transports` (add `--features efa` for libfabric).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use std::time::Duration;
use xfer_benches::{Backend, DEPTH, GroupPair, PAGES_PER_TRANSFER, PageLayout, Pair, REGION_SIZE};

const PAGE_SIZES: [u64; 2] = [64 << 10, 4 << 10];
const TRANSFERS: usize = 64;

/// One way of connecting two ends of a backend.
enum Setup {
    /// One engine per side ([`Pair`]); TCP rails are connections inside the transport.
    Engine(Backend),
    /// A rail group of `n` engines writing into one target engine ([`GroupPair`]).
    Group(Backend, usize),
}

/// What is compared, in the order it is reported.
fn setups() -> Vec<Setup> {
    #[allow(unused_mut)]
    let mut list = vec![
        Setup::Engine(Backend::Mem),
        Setup::Group(Backend::Mem, 4),
        Setup::Engine(Backend::Tcp { rails: 1 }),
        Setup::Engine(Backend::Tcp { rails: 4 }),
        Setup::Group(Backend::Tcp { rails: 1 }, 4),
        Setup::Engine(Backend::CudaIpcLoopback),
    ];
    // ---- efa joins here -------------------------------------------------------------
    // transport-efa (libfabric FI_EP_RDM) over the `tcp` provider on loopback: one
    // endpoint per engine, so 1 rail, or 4 as a rail group.
    #[cfg(feature = "efa")]
    list.extend([
        Setup::Engine(Backend::Efa { provider: "tcp" }),
        Setup::Group(Backend::Efa { provider: "tcp" }, 4),
    ]);
    // ---------------------------------------------------------------------------------
    list
}

fn group(
    c: &mut Criterion,
    page_size: u64,
) -> criterion::BenchmarkGroup<'_, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group(format!(
        "transports/{}",
        xfer_benches::size_label(page_size)
    ));
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Bytes(PAGES_PER_TRANSFER as u64 * page_size));
    g
}

fn transports(c: &mut Criterion) {
    for setup in setups() {
        match setup {
            Setup::Engine(backend) => {
                let pair = match Pair::new(&backend, REGION_SIZE) {
                    Ok(p) => p,
                    Err(e) => {
                        eprintln!("skipped backend {}: {e}", backend.name());
                        continue;
                    }
                };
                let rails = match backend.rails() {
                    1 => "1rail".to_string(),
                    n => format!("{n}rail-conns"),
                };
                for page_size in PAGE_SIZES {
                    let layout = PageLayout::dense(page_size, REGION_SIZE);
                    let transfers = pair.transfers(&layout, PAGES_PER_TRANSFER, TRANSFERS, 1);
                    let mut g = group(c, page_size);
                    g.bench_function(BenchmarkId::new(backend.name(), &rails), |b| {
                        b.iter_custom(|iters| {
                            xfer_benches::run(&pair.initiator, &transfers, iters, DEPTH)
                                .expect("transfers complete")
                        })
                    });
                    g.finish();
                }
            }
            Setup::Group(backend, n) => {
                let pair = match GroupPair::new(&backend, n, REGION_SIZE) {
                    Ok(p) => p,
                    Err(e) => {
                        eprintln!("skipped backend {} with {n} rails: {e}", backend.name());
                        continue;
                    }
                };
                for page_size in PAGE_SIZES {
                    let layout = PageLayout::dense(page_size, REGION_SIZE);
                    let transfers = pair.transfers(&layout, PAGES_PER_TRANSFER, TRANSFERS, 1);
                    let mut g = group(c, page_size);
                    let id = BenchmarkId::new(backend.name(), format!("{n}rail-group"));
                    g.bench_function(id, |b| {
                        b.iter_custom(|iters| {
                            pair.run(&transfers, iters, DEPTH)
                                .expect("transfers complete")
                        })
                    });
                    g.finish();
                }
            }
        }
    }
}

criterion_group!(benches, transports);
criterion_main!(benches);
