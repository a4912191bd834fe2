//! Write bandwidth between two endpoints of one process, over a libfabric provider on
//! loopback: how thin the transport is over the provider (compare with `fi_raw_bw`, the
//! same loop on libfabric alone).
//!
//! ```text
//! cargo run --release -p transport-efa --example efa_loopback_bw -- [provider] [page KiB] [MiB total] [depth] [1|2]
//! cargo run --release -p transport-efa --example efa_loopback_bw -- tcp 64 2048 64
//! cargo run --release -p transport-efa --example efa_loopback_bw -- tcp 64 2048 64 2
//! ```
//!
//! With `1` (the default) one thread polls both endpoints. With `2` the target has a
//! thread of its own that does what an idle engine does: `wait`, then `poll`.

use fabric_core::{
    Access, HostBuffer, LocalSlice, PostOutcome, RemoteRegion, RemoteSlice, Transport,
    WorkRequestId,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use transport_efa::{EfaConfig, EfaTransport};

const REGION: usize = 64 << 20;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The target thread's address, its region's descriptor, and the thread.
type Target = (Vec<u8>, RemoteRegion, std::thread::JoinHandle<()>);

/// The target in a thread of its own: opened there, then `wait` + `poll` until `stop`.
fn spawn_target(cfg: EfaConfig, stop: Arc<AtomicBool>) -> Res<Target> {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        let opened = EfaTransport::new(&cfg).and_then(|mut b| {
            let dst = b.register(HostBuffer::new_shared(REGION)?, Access::REMOTE_WRITE)?;
            Ok((b, dst))
        });
        let (mut b, dst) = match opened {
            Ok(x) => x,
            Err(e) => {
                let _ = tx.send(Err(e.to_string()));
                return;
            }
        };
        let _ = tx.send(Ok((b.address(), dst.remote)));
        let mut done = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            // An engine with nothing of its own in flight waits 200 µs at a time.
            let _ = b.wait(Duration::from_micros(200));
            let _ = b.poll(&mut done);
            done.clear();
        }
    });
    let (addr, remote) = rx.recv()??;
    Ok((addr, remote, handle))
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let provider = args.first().map_or("tcp", String::as_str);
    let page: u64 = args.get(1).map_or(Ok(64), |s| s.parse())? * 1024;
    let total: u64 = args.get(2).map_or(Ok(1024), |s| s.parse())? << 20;
    let depth: usize = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let threads: usize = args.get(4).map_or(Ok(1), |s| s.parse())?;
    let mut cfg = EfaConfig::with_provider(provider);
    if matches!(provider, "tcp" | "sockets") {
        cfg = cfg.domain("lo");
    }
    let mut a = EfaTransport::new(&cfg)?;
    let stop = Arc::new(AtomicBool::new(false));
    let (mut b, addr, remote, target) = if threads == 2 {
        let (addr, remote, handle) = spawn_target(cfg.clone(), stop.clone())?;
        (None, addr, remote, Some(handle))
    } else {
        let mut b = EfaTransport::new(&cfg)?;
        let dst = b.register(HostBuffer::new_shared(REGION)?, Access::REMOTE_WRITE)?;
        let addr = b.address();
        (Some(b), addr, dst.remote, None)
    };
    let peer = a.add_peer(&addr)?;
    let src = a.register(HostBuffer::new_shared(REGION)?, Access::NONE)?;
    let pages = REGION as u64 / page;
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
            let dst = RemoteSlice {
                region: remote,
                offset: ((i * 31) % pages) * page,
                len: page,
            };
            match a.post_write(peer, WorkRequestId(posted), local, dst, None)? {
                PostOutcome::Posted => {
                    posted += 1;
                    in_flight += 1;
                }
                PostOutcome::NoRoom => break,
            }
        }
        a.poll(&mut done_a)?;
        if let Some(b) = b.as_mut() {
            b.poll(&mut done_b)?;
        }
        for c in done_a.drain(..) {
            c.result?;
            completed += 1;
            in_flight -= 1;
            // Time from the first completion: connection set-up is not measured.
            start.get_or_insert_with(Instant::now);
        }
    }
    let secs = start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    stop.store(true, Ordering::Relaxed);
    if let Some(t) = target {
        let _ = t.join();
    }
    let bytes = (n - 1) * page;
    println!(
        "{}: {} writes of {} KiB, depth {depth}, {threads} thread(s): {:.2} Gbit/s",
        a.provider(),
        n,
        page / 1024,
        bytes as f64 * 8.0 / secs / 1e9
    );
    Ok(())
}
