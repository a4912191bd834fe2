//! A simulated p5: `W` workers (one per GPU), each a rail group of `R` rails of a transport
//! that completes every write at once without moving a byte, so that what is measured is
//! the engine alone (planning, sharding, queues, posting, completion counting, handles).
//! Each worker thread submits transfers of `P` scattered 64 KiB pages, `D` in flight.
//!
//! ```text
//! cargo run --release -p xfer-benches --example sim_p5 -- [workers 8] [rails 4] [seconds 3] [pages 1000] [depth 8] [wait_spin_us 200] [linger_us 50] [max_chunk_kib 1024]
//! ```
//!
//! The last three set `EngineConfig::wait_spin`, `EngineConfig::linger` and
//! `Balance::max_chunk` (with `chunks_per_rail` 1 when it is larger than the default), to
//! see what spinning and chunking cost the engine at this scale.
//!
//! Prints writes per second in all (and the Gbit/s they would be at 64 KiB per write); the
//! reference's 3200 Gbps of 64 KiB pages is 6.1 M writes/s. Run it on as many cores as
//! workers × rails (plus the submitting threads) to see the engine's ceiling; with fewer,
//! the figure is the machine's.

use fabric_core::engine::{EngineConfig, GroupTransfer, RailGroup, RemoteDescriptor};
use fabric_core::{
    Access, Completion, HostBuffer, LocalKey, LocalSlice, MemoryRegion, OpKind, PeerId,
    PostOutcome, Registration, RemoteKey, RemoteRegion, RemoteSlice, Result, Transport,
    TransportLimits, WorkRequestId,
};
use std::collections::VecDeque;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const PAGE: u64 = 64 << 10;

/// Completes every write in the next poll; moves nothing.
#[derive(Default)]
struct NullTransport {
    done: Vec<Completion>,
    next_key: u64,
}

impl Transport for NullTransport {
    fn name(&self) -> &'static str {
        "null"
    }
    fn address(&self) -> Vec<u8> {
        b"null://".to_vec()
    }
    fn limits(&self) -> TransportLimits {
        TransportLimits {
            max_msg_size: 1 << 30,
            max_outstanding: 1 << 16,
            write_imm: true,
            busy_poll: false,
            strided_writes: false,
        }
    }
    fn add_peer(&mut self, _address: &[u8]) -> Result<PeerId> {
        Ok(PeerId(1))
    }
    fn remove_peer(&mut self, _peer: PeerId) -> Result<()> {
        Ok(())
    }
    fn register(&mut self, mem: Arc<dyn MemoryRegion>, _access: Access) -> Result<Registration> {
        self.next_key += 1;
        Ok(Registration {
            local: LocalKey(self.next_key),
            remote: RemoteRegion {
                addr: 0,
                len: mem.len() as u64,
                key: RemoteKey(self.next_key),
            },
        })
    }
    fn deregister(&mut self, _key: LocalKey) -> Result<()> {
        Ok(())
    }
    fn post_send(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        _imm: Option<u32>,
    ) -> Result<PostOutcome> {
        self.done.push(Completion {
            wr_id,
            op: OpKind::Send,
            result: Ok(src.len),
            peer: Some(peer),
            imm: None,
        });
        Ok(PostOutcome::Posted)
    }
    fn post_recv(&mut self, _wr_id: WorkRequestId, _dst: LocalSlice) -> Result<PostOutcome> {
        Ok(PostOutcome::Posted)
    }
    fn post_write(
        &mut self,
        peer: PeerId,
        wr_id: WorkRequestId,
        src: LocalSlice,
        _dst: RemoteSlice,
        _imm: Option<u32>,
    ) -> Result<PostOutcome> {
        if self.done.len() >= 1 << 16 {
            return Ok(PostOutcome::NoRoom);
        }
        self.done.push(Completion {
            wr_id,
            op: OpKind::Write,
            result: Ok(src.len),
            peer: Some(peer),
            imm: None,
        });
        Ok(PostOutcome::Posted)
    }
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        let n = self.done.len();
        out.append(&mut self.done);
        Ok(n)
    }
}

fn arg(i: usize, default: u64) -> u64 {
    std::env::args()
        .nth(i)
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let workers = arg(1, 8) as usize;
    let rails = arg(2, 4) as usize;
    let seconds = arg(3, 3);
    let pages = arg(4, 1000);
    let depth = arg(5, 8) as usize;
    let spin = Duration::from_micros(arg(6, 200));
    let linger = Duration::from_micros(arg(7, 50));
    let max_chunk = arg(8, 1024) << 10;
    // Pages two apart, so that none coalesce: one write each.
    let region = HostBuffer::new_shared((2 * pages * PAGE) as usize)?;
    let start = Arc::new(Barrier::new(workers + 1));
    let mut threads = Vec::new();
    for w in 0..workers {
        let region = region.clone();
        let start = start.clone();
        threads.push(std::thread::spawn(move || -> Result<(u64, f64)> {
            let cfg = EngineConfig {
                name: format!("sim-gpu{w}"),
                wait_spin: spin,
                linger,
                ..EngineConfig::default()
            };
            let group = RailGroup::spawn(rails, |_| Ok(NullTransport::default()), cfg)?;
            let mut b = group.balance();
            if max_chunk > b.max_chunk {
                b.chunks_per_rail = 1;
            }
            b.max_chunk = max_chunk;
            group.set_balance(b);
            let src = group.register(region, Access::NONE)?;
            let peer = group.add_peer(&[b"null://".to_vec()])?;
            let dst = RemoteDescriptor {
                rails: src.remote.rails.clone(),
            };
            let list: Vec<u64> = (0..pages).map(|p| 2 * p).collect();
            let t = GroupTransfer::same_pages(src, dst, &list, PAGE);
            start.wait();
            let t0 = Instant::now();
            let c0 = group.counters().ops;
            let mut inflight = VecDeque::with_capacity(depth);
            while t0.elapsed() < Duration::from_secs(seconds) {
                while inflight.len() < depth {
                    inflight.push_back(group.submit(&peer, t.clone())?);
                }
                if let Some(h) = inflight.pop_front() {
                    h.wait(Duration::from_secs(30))?;
                }
            }
            for h in inflight {
                h.wait(Duration::from_secs(30))?;
            }
            let secs = t0.elapsed().as_secs_f64();
            Ok((group.counters().ops - c0, secs))
        }));
    }
    start.wait();
    let mut total = 0.0;
    for (w, t) in threads.into_iter().enumerate() {
        let (ops, secs) = t.join().map_err(|_| "worker panicked")??;
        let rate = ops as f64 / secs;
        println!(
            "worker {w}: {ops} writes in {secs:.2}s = {:.3} M writes/s",
            rate / 1e6
        );
        total += rate;
    }
    println!(
        "{workers} workers x {rails} rails, {pages} pages of 64 KiB per transfer, depth {depth}, \
         {} cores: {:.3} M writes/s in all = {:.0} Gbps of 64 KiB pages",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        total / 1e6,
        total * PAGE as f64 * 8.0 / 1e9
    );
    Ok(())
}
