//! The Rust side of `benches/py_vs_rust.py`'s per-call figure: one-page writes between two
//! engines of this process, one at a time, each timed from submit to completion through
//! the Rust API (`RailGroup::submit` + `wait`), with the same engines the Python package
//! builds (`EngineOptions`). Prints one JSON line: `{"transport":..,"p50_us":..}`.
//!
//! `cargo run --release -p xfer-py --example one_page_rust -- tcp 20000 [imm]`

use _xfer::backend::EngineOptions;
use fabric_core::engine::GroupTransfer;
use fabric_core::{Access, HostBuffer};
use std::time::{Duration, Instant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let transport = args.get(1).cloned().unwrap_or_else(|| "tcp".into());
    let samples: usize = args.get(2).map_or(Ok(20_000), |s| s.parse())?;
    let imm = args.get(3).is_some_and(|s| s == "imm");
    let opts = EngineOptions {
        transport: transport.clone(),
        ..EngineOptions::default()
    };
    let (_, a) = opts.spawn("rust-a")?;
    let (_, b) = opts.spawn("rust-b")?;
    let page = 4096u64;
    let src = a.register(HostBuffer::new_shared(1 << 20)?, Access::NONE)?;
    let dst = b.register(HostBuffer::new_shared(1 << 20)?, Access::REMOTE_WRITE)?;
    let peer = a.add_peer(&b.addresses())?;
    let one = || GroupTransfer {
        src: src.clone(),
        dst: dst.remote.clone(),
        segments: vec![(0, 0, page)],
        imm: imm.then_some(1),
        timeout: None,
        direction: fabric_core::engine::Direction::Write,
        after: None,
    };
    let mut times = Vec::with_capacity(samples);
    for i in 0..samples + 200 {
        let t0 = Instant::now();
        a.submit(&peer, one())?.wait(Duration::from_secs(10))?;
        if i >= 200 {
            times.push(t0.elapsed());
        }
    }
    times.sort();
    let p50 = times[times.len() / 2].as_secs_f64() * 1e6;
    println!("{{\"transport\":\"{transport}\",\"imm\":{imm},\"p50_us\":{p50:.3}}}");
    Ok(())
}
