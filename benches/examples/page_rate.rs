//! Pages per second through one engine pair of a backend, for profiling the per-page cost:
//! `cargo run --release -p xfer-benches --example page_rate -- BACKEND PAGE_SIZE [PAGES] [SECONDS]`
//! with BACKEND `mem`, `tcp` or `cuda-ipc-loopback`, PAGE_SIZE in bytes. Transfers of
//! PAGES random pages (default 1024) of a 64 MiB region, 4 in flight; prints pages/s of
//! three runs of SECONDS (default 2) each, and their median. Run it under `perf record`
//! to see where a page's time goes.

use std::time::{Duration, Instant};
use xfer_benches::{Backend, DEPTH, PageLayout, Pair};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let backend = match args.first().map(String::as_str) {
        Some("mem") | None => Backend::Mem,
        Some("tcp") => Backend::Tcp { rails: 1 },
        Some("cuda-ipc-loopback") => Backend::CudaIpcLoopback,
        Some(other) => return Err(format!("unknown backend {other:?}").into()),
    };
    let page: u64 = args.get(1).map_or(Ok(64), |s| s.parse())?;
    let pages: usize = args.get(2).map_or(Ok(1024), |s| s.parse())?;
    let secs: f64 = args.get(3).map_or(Ok(2.0), |s| s.parse())?;
    let region = 64 << 20;
    let pair = Pair::new(&backend, region)?;
    let layout = PageLayout::sparse(page, region);
    let transfers = pair.transfers(&layout, pages, 16, 7);
    xfer_benches::run(&pair.initiator, &transfers, 64, DEPTH)?;
    let mut rates = Vec::new();
    for _ in 0..3 {
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < Duration::from_secs_f64(secs) {
            xfer_benches::run(&pair.initiator, &transfers, 64, DEPTH)?;
            n += 64;
        }
        let rate = (n * pages as u64) as f64 / start.elapsed().as_secs_f64();
        println!("{} {page} B: {:.3} M pages/s", backend.name(), rate / 1e6);
        rates.push(rate);
    }
    rates.sort_by(f64::total_cmp);
    println!("median {:.3} M pages/s", rates[1] / 1e6);
    Ok(())
}
