//! Write bandwidth between two endpoints of one process, over a libfabric provider on
//! loopback: how thin the transport is over the provider.
//!
//! ```text
//! cargo run --release -p transport-efa --example efa_loopback_bw -- [provider] [page KiB] [MiB total] [depth]
//! cargo run --release -p transport-efa --example efa_loopback_bw -- tcp 64 2048 64
//! ```

use fabric_core::{
    Access, HostBuffer, LocalSlice, PostOutcome, RemoteSlice, Transport, WorkRequestId,
};
use std::time::Instant;
use transport_efa::{EfaConfig, EfaTransport};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let provider = args.first().map_or("tcp", String::as_str);
    let page: u64 = args.get(1).map_or(Ok(64), |s| s.parse())? * 1024;
    let total: u64 = args.get(2).map_or(Ok(1024), |s| s.parse())? << 20;
    let depth: usize = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let mut cfg = EfaConfig::with_provider(provider);
    if matches!(provider, "tcp" | "sockets") {
        cfg = cfg.domain("lo");
    }
    let mut a = EfaTransport::new(&cfg)?;
    let mut b = EfaTransport::new(&cfg)?;
    let peer = a.add_peer(&b.address())?;
    let region = 64 << 20;
    let src = a.register(HostBuffer::new_shared(region)?, Access::NONE)?;
    let dst = b.register(HostBuffer::new_shared(region)?, Access::REMOTE_WRITE)?;
    let pages = region as u64 / page;
    let n = total / page;
    let (mut done_a, mut done_b) = (Vec::new(), Vec::new());
    let (mut posted, mut completed, mut in_flight) = (0u64, 0u64, 0usize);
    let mut start = None;
    while completed < n {
        while posted < n && in_flight < depth {
            // Scattered pages: consecutive writes never touch adjacent target pages.
            let i = (posted * 7919) % pages;
            let local = LocalSlice {
                key: src.local,
                offset: i * page,
                len: page,
            };
            let remote = RemoteSlice {
                region: dst.remote,
                offset: ((i * 31) % pages) * page,
                len: page,
            };
            match a.post_write(peer, WorkRequestId(posted), local, remote, None)? {
                PostOutcome::Posted => {
                    posted += 1;
                    in_flight += 1;
                }
                PostOutcome::NoRoom => break,
            }
        }
        a.poll(&mut done_a)?;
        b.poll(&mut done_b)?;
        for c in done_a.drain(..) {
            c.result?;
            completed += 1;
            in_flight -= 1;
            // Time from the first completion: connection set-up is not measured.
            start.get_or_insert_with(Instant::now);
        }
    }
    let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    let bytes = (n - 1) * page;
    println!(
        "{}: {} writes of {} KiB, depth {depth}: {:.2} Gbit/s",
        a.provider(),
        n,
        page / 1024,
        bytes as f64 * 8.0 / secs / 1e9
    );
    Ok(())
}
