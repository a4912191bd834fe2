//! The Rust side of `benches/py_vs_rust.py`'s per-call figure: one-page writes between two
//! agents of this process, one at a time, each timed from submit to completion through
//! the Rust API (`Agent::submit` + `wait`), with agents built as the Python package builds
//! its engines (`xfer::Agent` from `AgentOptions`: the transport named, workers unpinned as
//! the bench's Python engines are). Prints one JSON line: `{"transport":..,"p50_us":..}`.
//!
//! `cargo run --release -p xfer-py --example one_page_rust -- tcp 20000 [imm]`

use std::time::{Duration, Instant};
use xfer::PinMode;
use xfer::{Access, Agent, AgentOptions, HostBuffer, Transfer, TransportChoice};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let transport = args.get(1).cloned().unwrap_or_else(|| "tcp".into());
    let samples: usize = args.get(2).map_or(Ok(20_000), |s| s.parse())?;
    let imm = args.get(3).is_some_and(|s| s == "imm");
    let choice = TransportChoice::from_name(&transport)
        .ok_or_else(|| format!("unknown transport {transport:?}"))?;
    let opts = AgentOptions {
        transport: choice,
        pin: PinMode::Off,
        ..AgentOptions::default()
    };
    let a = Agent::new(opts.clone())?;
    let b = Agent::new(opts)?;
    let page = 4096u64;
    let src = a.register(HostBuffer::new_shared(1 << 20)?, Access::NONE)?;
    let dst = b.register(HostBuffer::new_shared(1 << 20)?, Access::REMOTE_WRITE)?;
    let peer = a.connect(b.info())?;
    let one = || {
        let t = Transfer::segments(vec![(0, 0, page)]);
        if imm { t.imm(1) } else { t }
    };
    let mut times = Vec::with_capacity(samples);
    for i in 0..samples + 200 {
        let t0 = Instant::now();
        a.submit(&peer, &src, dst.descriptor(), one())?
            .wait(Duration::from_secs(10))?;
        if i >= 200 {
            times.push(t0.elapsed());
        }
    }
    times.sort();
    let p50 = times[times.len() / 2].as_secs_f64() * 1e6;
    println!("{{\"transport\":\"{transport}\",\"imm\":{imm},\"p50_us\":{p50:.3}}}");
    Ok(())
}
