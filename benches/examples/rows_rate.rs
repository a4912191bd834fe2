//! Rows per second through a rail group of a backend (strided writes where it has them),
//! for profiling the per-row cost of the weight-sync path:
//! `cargo run --release -p xfer-benches --example rows_rate -- BACKEND ROW [ROWS] [RAILS] [SECONDS]`
//! with BACKEND `mem` or `cuda-ipc-loopback`. Each transfer is ROWS rows (default 16384)
//! of ROW bytes, read at a stride of two rows and written back to back (a tensor-parallel
//! half of each row of a row-major matrix); 4 in flight; prints rows/s of three runs of
//! SECONDS (default 2) each, and their median, with the rows listed as segments and then
//! given as one [`StridedRun`].

use fabric_core::engine::GroupTransfer;
use fabric_core::plan::StridedRun;
use std::time::{Duration, Instant};
use xfer_benches::{Backend, DEPTH, GroupPair, TRANSFER_TIMEOUT};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let backend = match args.first().map(String::as_str) {
        Some("mem") | None => Backend::Mem,
        Some("cuda-ipc-loopback") => Backend::CudaIpcLoopback,
        Some(other) => return Err(format!("unknown backend {other:?}").into()),
    };
    let row: u64 = args.get(1).map_or(Ok(64), |s| s.parse())?;
    let rows: u64 = args.get(2).map_or(Ok(16384), |s| s.parse())?;
    let rails: usize = args.get(3).map_or(Ok(1), |s| s.parse())?;
    let secs: f64 = args.get(4).map_or(Ok(2.0), |s| s.parse())?;
    let region = (2 * row * rows).max(1 << 20);
    let pair = GroupPair::new(&backend, rails, region)?;
    let as_segments = GroupTransfer {
        src: pair.src.clone(),
        dst: pair.dst.clone(),
        segments: (0..rows).map(|i| (2 * i * row, i * row, row)).collect(),
        runs: Vec::new(),
        imm: None,
        message: None,
        timeout: Some(TRANSFER_TIMEOUT),
        direction: Default::default(),
        after: None,
    };
    let as_run = GroupTransfer {
        segments: Vec::new(),
        runs: vec![StridedRun {
            src_offset: 0,
            dst_offset: 0,
            len: row,
            count: rows,
            src_stride: 2 * row,
            dst_stride: row,
        }],
        ..as_segments.clone()
    };
    for (name, t) in [("segments", as_segments), ("one run", as_run)] {
        let transfers = vec![t];
        pair.run(&transfers, 16, DEPTH)?;
        let mut rates = Vec::new();
        for _ in 0..3 {
            let start = Instant::now();
            let mut n = 0u64;
            while start.elapsed() < Duration::from_secs_f64(secs) {
                pair.run(&transfers, 16, DEPTH)?;
                n += 16;
            }
            let rate = (n * rows) as f64 / start.elapsed().as_secs_f64();
            println!(
                "{} {row} B rows as {name}, {rails} rails: {:.3} M rows/s",
                backend.name(),
                rate / 1e6
            );
            rates.push(rate);
        }
        rates.sort_by(f64::total_cmp);
        println!("{name}: median {:.3} M rows/s", rates[1] / 1e6);
    }
    Ok(())
}
