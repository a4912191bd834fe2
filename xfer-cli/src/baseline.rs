//! `demo --baseline`: the demo's work done again without the engine, on the same path, so
//! that `ratio` (the engine's Gbps over the baseline's) says what the engine costs or adds.
//!
//! - tcp with host memory: [`tcp_streams`], raw TCP streams over loopback, as many as rails,
//!   moving the same bytes from and into memory of the region's size (and, for
//!   `baseline_hot_gbps`, through 1 MiB buffers that stay in the CPU's caches); and, for
//!   `baseline_pages_gbps`, [`tcp_pages`]: the same streams moving the run's page size as
//!   random pages, [`GATHER`] per `writev`, placed by `readv` into the same pages;
//! - mem: [`scattered_memcpy`], a `memcpy` of each page of the run's transfers (the same
//!   pages: [`TransferPages`]) between the run's own regions, on as many threads as rails;
//! - cuda-ipc: [`scattered_device_copies`], the same pages copied device to device with
//!   gpu-mem's batched copies ([`gpu_mem::PeerCopies`], what the transport itself issues),
//!   between the run's own regions on the same GPUs, on as many streams as rails.
//!
//! Where no like-for-like run exists in one process (efa, GPU memory over tcp or mem, and a
//! `--latency` or `--per-gpu` run), [`refusal`] says why and what to compare with instead.

use crate::backend::MemoryArg;
use crate::size::format_size;
use crate::workload::{PageDraw, TransferPages, Workload};
use fabric_core::{MemoryLocation, MemoryRegion};
use gpu_mem::{CopyMethod, Device, PeerCopies};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::Instant;
use xfer::layers::placement::{self, CorePin};
use xfer::{Congestion, TransportKind};

/// Why a baseline could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BaselineError {
    /// The raw TCP streams failed (socket, connect, read or write).
    #[error("raw TCP streams: {0}")]
    Streams(#[source] std::io::Error),
    /// The memory a baseline copies cannot be used that way.
    #[error("{0}")]
    Memory(#[from] fabric_core::MemoryError),
    /// A device copy (or its set-up: IPC export, stream, kernel) failed.
    #[error("device copies: {0}")]
    Gpu(#[from] gpu_mem::GpuMemError),
    /// A copy thread panicked.
    #[error("a copy thread panicked")]
    Panicked,
}

/// What a baseline measured: its Gbit/s and what it was, in words (the summary's
/// `baseline_kind`).
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    /// Its throughput.
    pub gbps: f64,
    /// What ran, e.g. "raw TCP streams, 2, loopback (cubic), 1.0 GiB buffers".
    pub kind: String,
}

/// Why `demo --baseline` cannot run with these flags (one line naming `--baseline` and what
/// to do instead), or `None` when it can, over `transport` (`None`: not known yet, `auto`
/// before the agents resolve it) with `memory`.
pub fn refusal(
    transport: Option<TransportKind>,
    memory: MemoryArg,
    per_gpu: bool,
    latency: bool,
) -> Option<String> {
    let why = if per_gpu {
        "--baseline measures one worker: drop --per-gpu or --baseline"
    } else if latency {
        "--baseline measures throughput, and --latency has its own floor (a raw TCP \
         ping-pong of the same pages): drop --baseline or --latency"
    } else {
        match (transport?, memory) {
            (TransportKind::Efa, _) => {
                "--baseline has no like-for-like run inside xfer for --transport efa: compare \
                 with the provider alone, `cargo run --release -p transport-efa --example \
                 fi_raw_bw` (raw fi_writemsg of scattered pages) or fabtests' fi_rma_bw, or \
                 drop --baseline"
            }
            (TransportKind::Tcp, MemoryArg::Cuda) => {
                "--baseline with --memory cuda --transport tcp has no raw equivalent here (raw \
                 TCP streams move host memory): run it with --memory host, or GPU to GPU with \
                 --transport cuda-ipc --baseline, or drop --baseline"
            }
            (TransportKind::Mem, MemoryArg::Cuda) => {
                "--baseline with --transport mem is a memcpy of host memory: drop --memory \
                 cuda (GPU to GPU: --transport cuda-ipc --baseline), or drop --baseline"
            }
            _ => return None,
        }
    };
    Some(why.to_string())
}

/// Bytes per write of [`tcp_streams`].
const CHUNK: usize = 1 << 20;

/// Each stream's share of a `footprint`, a whole number of chunks (at least one).
fn stream_share(footprint: usize, streams: usize) -> usize {
    (footprint / streams.max(1) / CHUNK).max(1) * CHUNK
}

/// The kind of [`tcp_streams`] over `footprint` bytes (all streams' buffers together, as
/// the streams round it: a whole number of 1 MiB chunks each).
pub fn tcp_kind(streams: usize, footprint: usize, congestion: &str) -> String {
    let all = stream_share(footprint, streams) as u64 * streams.max(1) as u64;
    format!(
        "raw TCP streams, {streams}, loopback ({congestion}), {} buffers",
        format_size(all)
    )
}

/// The congestion control that `congestion` gives a loopback connection here, as the
/// kernel names it: what the engine's tcp rails and the raw streams (which apply the same
/// rule) run, for the baselines' kinds.
pub fn loopback_congestion(congestion: &Congestion) -> Result<String, BaselineError> {
    // A socket toward loopback is given the algorithm before it connects, so an unconnected
    // one already says what a connection would run.
    let probe = || -> std::io::Result<String> {
        let s = congestion.socket_toward(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        Congestion::algorithm(&s)
    };
    probe().map_err(BaselineError::Streams)
}

/// A connected loopback pair, `(client, server)`, both ends running the congestion control
/// `congestion` gives a loopback connection (what the engine's tcp rails run). The
/// kernel completes the connection into the listener's backlog, so one thread makes both.
pub fn loopback_pair(congestion: &Congestion) -> std::io::Result<(TcpStream, TcpStream)> {
    let listener = congestion.listen(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let client = congestion.connect(listener.local_addr()?, None)?;
    let (server, _) = listener.accept()?;
    Ok((client, server))
}

/// The kind of [`scattered_memcpy`].
pub fn memcpy_kind(threads: usize) -> String {
    format!(
        "scattered memcpy of the same pages, {threads} thread{}",
        if threads == 1 { "" } else { "s" }
    )
}

/// The kind of [`scattered_device_copies`] from GPU `from` to GPU `to`.
pub fn device_copies_kind(method: CopyMethod, streams: usize, from: u32, to: u32) -> String {
    let how = match method {
        CopyMethod::Kernel => "copy kernel",
        CopyMethod::KernelRows => "copy kernel, strided rows as one entry",
        CopyMethod::Batch => "cuMemcpyBatchAsync",
        CopyMethod::Memcpy => "one cuMemcpyAsync a page",
    };
    format!(
        "scattered device-to-device copies of the same pages ({how}), {streams} stream{}, \
         GPU {from} -> GPU {to}",
        if streams == 1 { "" } else { "s" }
    )
}

/// Moves `bytes` over `streams` loopback connections, each stream cycling through its share
/// of a `footprint`-byte source and a `footprint`-byte destination (huge pages, faulted in
/// before the clock starts, like the regions), in 1 MiB writes with no framing; returns
/// Gbit/s.
///
/// With a 1 MiB footprint (the "hot" baseline) every byte comes from and goes to the CPU's
/// caches; with the region's size, the streams touch as much memory as the transfer does,
/// so the ratio measures the transport's own cost instead of cache effects.
pub fn tcp_streams(
    bytes: u64,
    streams: usize,
    footprint: usize,
    congestion: &Congestion,
) -> Result<f64, BaselineError> {
    tcp_streams_io(bytes, streams.max(1), footprint, congestion).map_err(BaselineError::Streams)
}

fn tcp_streams_io(
    bytes: u64,
    streams: usize,
    footprint: usize,
    congestion: &Congestion,
) -> std::io::Result<f64> {
    let share = stream_share(footprint, streams);
    let per = bytes / streams as u64;
    let (got, secs) = loopback_streams(
        streams,
        congestion,
        share,
        move |_, mine, s| {
            let mut left = per;
            let mut at = 0usize;
            while left > 0 {
                let n = left.min(CHUNK as u64) as usize;
                s.write_all(&mine[at..at + n])?;
                left -= n as u64;
                at = if at + CHUNK >= share { 0 } else { at + CHUNK };
            }
            Ok(())
        },
        move |_, buf, s| {
            let mut total = 0u64;
            let mut at = 0usize;
            loop {
                let end = (at + CHUNK).min(share);
                let n = s.read(&mut buf[at..end])?;
                if n == 0 {
                    return Ok(total);
                }
                total += n as u64;
                at = if at + n >= share { 0 } else { at + n };
            }
        },
    )?;
    if got != per * streams as u64 {
        return Err(std::io::Error::other(format!(
            "baseline moved {got} bytes, expected {}",
            per * streams as u64
        )));
    }
    Ok(got as f64 * 8.0 / secs / 1e9)
}

/// Runs `streams` loopback TCP connections, each between a writer thread and a reader
/// thread with buffers of `share` bytes of their own (huge pages, faulted in and the
/// source filled before the clock starts): `write(i, source, socket)` on stream `i`'s
/// writer, `read(i, destination, socket)` (returning the bytes it read) on its reader.
/// The connections are made before the clock starts; returns the bytes all readers read and
/// the seconds from starting the threads to the last reader's end. Both ends of each
/// connection run the congestion control `congestion` gives a loopback connection, as the
/// engine's tcp rails do.
fn loopback_streams<W, R>(
    streams: usize,
    congestion: &Congestion,
    share: usize,
    write: W,
    read: R,
) -> std::io::Result<(u64, f64)>
where
    W: Fn(usize, &mut [u8], &mut TcpStream) -> std::io::Result<()> + Copy + Send + 'static,
    R: Fn(usize, &mut [u8], &mut TcpStream) -> std::io::Result<u64> + Copy + Send + 'static,
{
    let alloc =
        || gpu_mem::HostMemory::new(share).map_err(|e| std::io::Error::other(e.to_string()));
    let mut srcs = (0..streams)
        .map(|_| alloc())
        .collect::<std::io::Result<Vec<_>>>()?;
    for s in &mut srcs {
        s.as_mut_slice().fill(0x5A);
    }
    let mut dsts = (0..streams)
        .map(|_| alloc())
        .collect::<std::io::Result<Vec<_>>>()?;
    for d in &mut dsts {
        d.as_mut_slice().fill(0);
    }
    let (clients, servers): (Vec<_>, Vec<_>) = (0..streams)
        .map(|_| loopback_pair(congestion))
        .collect::<std::io::Result<Vec<_>>>()?
        .into_iter()
        .unzip();
    let start = Instant::now();
    let readers: Vec<_> = servers
        .into_iter()
        .zip(dsts)
        .enumerate()
        .map(|(i, (mut s, mut mem))| {
            std::thread::spawn(move || read(i, mem.as_mut_slice(), &mut s))
        })
        .collect();
    // A writer's stream closes when it returns: its reader then sees the end.
    let writers: Vec<_> = clients
        .into_iter()
        .zip(srcs)
        .enumerate()
        .map(|(i, (mut s, mut mem))| {
            std::thread::spawn(move || write(i, mem.as_mut_slice(), &mut s))
        })
        .collect();
    for w in writers {
        w.join()
            .map_err(|_| std::io::Error::other("writer panicked"))??;
    }
    let mut got = 0;
    for r in readers {
        got += r
            .join()
            .map_err(|_| std::io::Error::other("reader panicked"))??;
    }
    Ok((got, start.elapsed().as_secs_f64()))
}

/// Pages gathered per `writev` (and scattered per `readv`) by [`tcp_pages`].
pub const GATHER: usize = 16;

/// The kind of [`tcp_pages`].
pub fn tcp_pages_kind(streams: usize, page: usize, footprint: usize, congestion: &str) -> String {
    let all = stream_share(footprint, streams) as u64 * streams.max(1) as u64;
    format!(
        "raw TCP streams, {streams}, loopback ({congestion}), writev of {GATHER} random {} pages \
         of {} into the same pages",
        format_size(page as u64),
        format_size(all)
    )
}

/// Moves `bytes` over `streams` loopback connections as pages: each writer sends
/// [`GATHER`] random `page`-byte pages of its share of a `footprint`-byte source with one
/// `writev`, and its reader places them with `readv` at the same offsets of a
/// `footprint`-byte destination (both ends draw the same pages from `seed`; no framing).
/// This is what a transport of scattered pages does at least, without its headers,
/// completions or scheduling; returns Gbit/s, or `None` when a share holds fewer than
/// [`GATHER`] pages.
pub fn tcp_pages(
    bytes: u64,
    streams: usize,
    (footprint, page): (usize, usize),
    seed: u64,
    congestion: &Congestion,
) -> Result<Option<f64>, BaselineError> {
    tcp_pages_io(bytes, streams.max(1), footprint, page, seed, congestion)
        .map_err(BaselineError::Streams)
}

fn tcp_pages_io(
    bytes: u64,
    streams: usize,
    footprint: usize,
    page: usize,
    seed: u64,
    congestion: &Congestion,
) -> std::io::Result<Option<f64>> {
    let share = stream_share(footprint, streams);
    if page == 0 || share / page < GATHER {
        return Ok(None);
    }
    let group = (GATHER * page) as u64;
    let groups = bytes / streams as u64 / group;
    // Stream i's pages come from seed + i at both ends.
    let (got, secs) = loopback_streams(
        streams,
        congestion,
        share,
        move |i, mine, s| {
            let mut draw = PageDraw::new((share / page) as u64, seed.wrapping_add(i as u64));
            for _ in 0..groups {
                let mut iov: Vec<std::io::IoSlice<'_>> = draw
                    .draw(GATHER)
                    .iter()
                    .map(|&p| {
                        let a = p as usize * page;
                        std::io::IoSlice::new(&mine[a..a + page])
                    })
                    .collect();
                let mut iov = &mut iov[..];
                while !iov.is_empty() {
                    let n = s.write_vectored(iov)?;
                    if n == 0 {
                        return Err(std::io::ErrorKind::WriteZero.into());
                    }
                    std::io::IoSlice::advance_slices(&mut iov, n);
                }
            }
            Ok(())
        },
        move |i, buf, s| {
            let mut draw = PageDraw::new((share / page) as u64, seed.wrapping_add(i as u64));
            let mut total = 0u64;
            for _ in 0..groups {
                // Disjoint, increasing pages: split the buffer at each of them.
                let mut rest: &mut [u8] = &mut *buf;
                let mut base = 0usize;
                let mut iov = Vec::with_capacity(GATHER);
                for &p in draw.draw(GATHER) {
                    let a = p as usize * page;
                    let (_, tail) = rest.split_at_mut(a - base);
                    let (p, tail) = tail.split_at_mut(page);
                    iov.push(std::io::IoSliceMut::new(p));
                    rest = tail;
                    base = a + page;
                }
                let mut iov = &mut iov[..];
                let mut left = group;
                while left > 0 {
                    let n = s.read_vectored(iov)?;
                    if n == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    left -= n as u64;
                    total += n as u64;
                    std::io::IoSliceMut::advance_slices(&mut iov, n);
                }
            }
            Ok(total)
        },
    )?;
    if got != groups * group * streams as u64 {
        return Err(std::io::Error::other(format!(
            "baseline moved {got} bytes, expected {}",
            groups * group * streams as u64
        )));
    }
    Ok(Some(got as f64 * 8.0 / secs / 1e9))
}

/// Checks that every page of `w` lies inside `region` (pages are below `w.region_pages()`).
fn check_pages(w: &Workload, region: &dyn MemoryRegion) -> Result<(), fabric_core::MemoryError> {
    let span = w.region_pages().saturating_mul(w.page_size);
    fabric_core::memory::check_range(0, span, region.len() as u64)
}

/// Gbit/s of `bytes` in `secs`.
fn gbps(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 * 8.0 / secs / 1e9
    } else {
        0.0
    }
}

/// Copies each page of `w`'s transfers (the pages the engine's run moved, by
/// [`TransferPages`]) from `from` to the same offset of `to`, with a plain `memcpy` per page,
/// on `threads` threads (thread `i` pinned as `pins[i]`, like rail `i`); returns Gbit/s.
///
/// As in the engine's run, the calling thread chooses each transfer's pages while the
/// copies run, at most `w.depth` transfers ahead of each copying thread. Thread `i` copies
/// the pages whose index is `i` modulo `threads`: the threads share the work as the rails
/// do, never write the same page at once, and wait for nothing but the next transfer. The
/// clock runs from the moment every thread is ready to the last one's end.
pub fn scattered_memcpy(
    from: &dyn MemoryRegion,
    to: &dyn MemoryRegion,
    w: &Workload,
    threads: usize,
    pins: &[Option<CorePin>],
) -> Result<f64, BaselineError> {
    let threads = threads.max(1);
    for r in [from, to] {
        check_pages(w, r)?;
        if r.location() != MemoryLocation::Host {
            return Err(fabric_core::MemoryError::Unsupported(format!(
                "the memcpy baseline copies host memory, not {:?}",
                r.location()
            ))
            .into());
        }
    }
    let at = |r: &dyn MemoryRegion| r.host_ptr().map_or(0, |p| p.as_ptr() as usize);
    let (a, b) = (at(from), at(to));
    if a < b + to.len() && b < a + from.len() {
        return Err(fabric_core::MemoryError::Unsupported(
            "the memcpy baseline needs two distinct regions".into(),
        )
        .into());
    }
    let page = w.page_size;
    let copy = move |i: usize, transfers: crossbeam_channel::Receiver<Arc<[u64]>>| {
        for t in transfers {
            for &p in t.iter().filter(|&&p| p as usize % threads == i) {
                let s = fabric_core::memory::checked_host_ptr(from, p * page, page)?;
                let d = fabric_core::memory::checked_host_ptr(to, p * page, page)?;
                // SAFETY: both ranges were just checked against their regions, which the
                // caller's borrows keep alive and whose host pointers are valid for reads
                // and writes from any thread (MemoryRegion's contract); the regions do not
                // overlap (checked above); only this thread writes page p of `to` (pages are
                // split among threads by index), and nothing writes `from`.
                unsafe { std::ptr::copy_nonoverlapping(s.cast_const(), d, page as usize) };
            }
        }
        Ok::<(), fabric_core::MemoryError>(())
    };
    let (copy, ready) = (&copy, &Barrier::new(threads + 1));
    let (bytes, secs) = std::thread::scope(|scope| {
        let (senders, handles): (Vec<_>, Vec<_>) = (0..threads)
            .map(|i| {
                let (tx, rx) = crossbeam_channel::bounded(w.depth_for(threads));
                let pin = pins.get(i).copied().flatten();
                let h = scope.spawn(move || {
                    placement::pin_worker(pin, &format!("xfer-baseline-{i}"));
                    ready.wait();
                    copy(i, rx)
                });
                (tx, h)
            })
            .unzip();
        ready.wait();
        let start = Instant::now();
        let mut pages = TransferPages::new(w);
        let mut bytes = 0u64;
        // A thread that failed has dropped its end: stop, and report its error below.
        'transfers: while let Some(t) = pages.next_transfer() {
            let t: Arc<[u64]> = t.into();
            bytes += t.len() as u64 * page;
            for tx in &senders {
                if tx.send(t.clone()).is_err() {
                    break 'transfers;
                }
            }
        }
        drop(senders);
        let mut result = Ok(());
        for h in handles {
            let r = h
                .join()
                .map_err(|_| BaselineError::Panicked)
                .and_then(|r| r.map_err(BaselineError::Memory));
            result = result.and(r);
        }
        result.map(|()| (bytes, start.elapsed().as_secs_f64()))
    })?;
    Ok(gbps(bytes, secs))
}

/// The GPUs and regions of a device-copy baseline: the initiator's region on `initiator`
/// (where the engine's rails issue their copies), the target's on `target`.
pub struct DeviceRegions<'a> {
    /// The initiator's GPU.
    pub initiator: &'a Device,
    /// The initiator's region (the source of a write, the destination of a read).
    pub local: &'a Arc<dyn MemoryRegion>,
    /// The target's GPU.
    pub target: &'a Device,
    /// The target's region.
    pub remote: &'a Arc<dyn MemoryRegion>,
}

/// Copies each page of `w`'s transfers between the regions of `r` at the same offsets, as
/// the cuda-ipc transport does but without engine or transport: the target's region is
/// exported and opened on the initiator's GPU ([`Device::export_ipc`],
/// [`Device::open_ipc`]), and `streams` [`PeerCopies`] of the initiator's GPU (with
/// `method`, or the best here) push the pages into it (`read`: pull them from it), page `p`
/// on stream `p` modulo `streams`, one submit per transfer and stream, at most `w.depth`
/// submits in flight per stream; the pages are chosen while the copies run, as in the
/// engine's run. One page per stream is copied before the clock starts (kernel load, peer
/// mapping). Returns Gbit/s and the method used.
pub fn scattered_device_copies(
    r: &DeviceRegions<'_>,
    w: &Workload,
    read: bool,
    streams: usize,
    method: Option<CopyMethod>,
) -> Result<(f64, CopyMethod), BaselineError> {
    let streams = streams.max(1);
    check_pages(w, &**r.local)?;
    check_pages(w, &**r.remote)?;
    let export = r.target.export_ipc(r.remote)?;
    let mapping = r.initiator.open_ipc(&export.handle())?;
    let base = export.offset();
    let mut copies = (0..streams)
        .map(|_| match method {
            Some(m) => PeerCopies::with_method(r.initiator, m),
            None => PeerCopies::new(r.initiator),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let ps = w.page_size;
    let queue = |c: &mut PeerCopies, p: u64| {
        if read {
            c.pull(&mapping, base + p * ps, r.local, p * ps, ps)
        } else {
            c.push(r.local, p * ps, &mapping, base + p * ps, ps)
        }
    };
    // Warm-up: page 0 on every stream.
    for c in &mut copies {
        queue(c, 0)?;
        c.submit()?;
        c.synchronize()?;
    }
    let depth = w.depth_for(streams);
    let mut queued = vec![false; streams];
    let mut pages = TransferPages::new(w);
    let mut bytes = 0u64;
    let start = Instant::now();
    while let Some(t) = pages.next_transfer() {
        bytes += t.len() as u64 * ps;
        for &p in t {
            let s = p as usize % streams;
            queue(&mut copies[s], p)?;
            queued[s] = true;
        }
        for (c, q) in copies.iter_mut().zip(queued.iter_mut()) {
            if !std::mem::take(q) {
                continue;
            }
            while c.in_flight() >= depth {
                c.completed()?;
            }
            c.submit()?;
        }
    }
    for c in &mut copies {
        c.synchronize()?;
    }
    let secs = start.elapsed().as_secs_f64();
    let used = copies
        .first()
        .map_or(CopyMethod::Memcpy, PeerCopies::method);
    Ok((gbps(bytes, secs), used))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{self, fill_pattern};
    use fabric_core::engine::Direction;
    use fabric_core::{Access, HostBuffer};
    use std::time::Duration;

    fn workload() -> Workload {
        Workload {
            page_size: 4096,
            pages: 16,
            bytes: 40 * 16 * 4096 + 3 * 4096,
            region_size: 1 << 20,
            depth: Some(2),
            seed: 5,
            transfer_timeout: Duration::from_secs(10),
            direction: Direction::Write,
        }
    }

    /// The raw page streams' draws are what both ends need: the same pages from the same
    /// seed, distinct, increasing, whole pages inside the share, spread over all of it.
    #[test]
    fn page_draws_are_repeatable_distinct_and_inside_the_share() {
        let (share, page) = (1 << 20, 4096);
        let pages = |seed| PageDraw::new((share / page) as u64, seed);
        // Byte offsets of a stream's next gather, as the streams compute them.
        let offsets = |d: &mut PageDraw| -> Vec<usize> {
            d.draw(GATHER).iter().map(|&p| p as usize * page).collect()
        };
        let (mut a, mut b) = (pages(7), pages(7));
        let mut seen_last_lane = false;
        for _ in 0..1000 {
            let at = offsets(&mut a);
            assert_eq!(at.len(), GATHER);
            assert_eq!(at, offsets(&mut b));
            assert!(at.windows(2).all(|w| w[0] + page <= w[1]), "{at:?}");
            assert!(
                at.iter().all(|&x| x % page == 0 && x + page <= share),
                "{at:?}"
            );
            seen_last_lane |= at[GATHER - 1] >= share - share / GATHER;
        }
        assert!(seen_last_lane);
        assert_ne!(offsets(&mut pages(7)), offsets(&mut pages(8)));
    }

    /// Too few pages for a gather is no baseline, not an error; otherwise every byte moves.
    #[test]
    fn page_streams_move_whole_gathers_or_say_they_cannot() {
        assert_eq!(
            tcp_pages(1 << 20, 1, (1 << 20, 128 << 10), 1, &Congestion::Auto).expect("runs"),
            None
        );
        let gbps = tcp_pages(8 << 20, 2, (4 << 20, 4096), 1, &Congestion::Auto).expect("runs");
        assert!(gbps.is_some_and(|g| g > 0.0), "{gbps:?}");
    }

    /// The memcpy baseline copies exactly the pages the engine's run writes: run over mem
    /// rails into one region and through the baseline into another, both from the same
    /// patterned source, the two targets are equal byte for byte (and not all zero).
    #[test]
    fn the_memcpy_baseline_copies_the_pages_the_engine_run_writes() {
        let w = workload();
        let src = HostBuffer::new_shared(w.region_size as usize).expect("source");
        fill_pattern(&*src, w.seed).expect("fill");
        let (a, b) = workload::tests::mem_agents();
        let by_engine = HostBuffer::new_shared(w.region_size as usize).expect("target");
        let s = a.register(src.clone(), Access::NONE).expect("register");
        let d = b
            .register(by_engine.clone(), Access::REMOTE_WRITE)
            .expect("register");
        let peer = a.connect(b.info()).expect("peer");
        let report = workload::run(
            &a,
            &s,
            &peer,
            d.descriptor(),
            &w,
            &mut crate::progress::Progress::new(true),
        )
        .expect("run");
        drop((a, b));
        for threads in [1, 3] {
            let by_baseline = HostBuffer::new_shared(w.region_size as usize).expect("target");
            let g = scattered_memcpy(&*src, &*by_baseline, &w, threads, &[]).expect("baseline");
            assert!(g > 0.0 && g.is_finite(), "{g}");
            let (x, y) = (
                by_engine.to_vec(0, w.region_size as usize).unwrap(),
                by_baseline.to_vec(0, w.region_size as usize).unwrap(),
            );
            assert!(x == y, "{threads} threads: the targets differ");
            let written = report.written_pages().len();
            assert!(written > 16 && written < 256, "{written}");
        }
    }

    #[test]
    fn the_memcpy_baseline_refuses_overlapping_or_small_regions() {
        let w = workload();
        let r = HostBuffer::new_shared(w.region_size as usize).unwrap();
        assert!(matches!(
            scattered_memcpy(&*r, &*r, &w, 1, &[]),
            Err(BaselineError::Memory(_))
        ));
        let small = HostBuffer::new_shared(4096).unwrap();
        assert!(matches!(
            scattered_memcpy(&*r, &*small, &w, 1, &[]),
            Err(BaselineError::Memory(_))
        ));
    }

    #[test]
    fn refused_where_no_like_for_like_run_exists_and_allowed_elsewhere() {
        use MemoryArg::{Cuda, Host};
        use TransportKind::{CudaIpc, Efa, Mem, Tcp};
        for (t, m) in [(Efa, Host), (Efa, Cuda), (Tcp, Cuda), (Mem, Cuda)] {
            let why = refusal(Some(t), m, false, false).expect("refused");
            assert!(
                why.starts_with("--baseline") && !why.contains('\n'),
                "{why}"
            );
        }
        let why = refusal(Some(Efa), Host, false, false).unwrap();
        assert!(
            why.contains("fi_raw_bw") && why.contains("fi_rma_bw"),
            "{why}"
        );
        for (t, m) in [(Tcp, Host), (Mem, Host), (CudaIpc, Cuda)] {
            assert_eq!(refusal(Some(t), m, false, false), None, "{t:?} {m:?}");
            assert!(refusal(Some(t), m, true, false).is_some());
            assert!(refusal(Some(t), m, false, true).is_some());
        }
        // Not resolved yet: only what no transport changes.
        assert_eq!(refusal(None, Cuda, false, false), None);
        assert!(refusal(None, Host, true, false).is_some());
    }

    #[test]
    fn kinds_name_what_ran() {
        assert_eq!(
            tcp_kind(2, 1 << 30, "cubic"),
            "raw TCP streams, 2, loopback (cubic), 1.0 GiB buffers"
        );
        assert_eq!(
            memcpy_kind(1),
            "scattered memcpy of the same pages, 1 thread"
        );
        assert!(
            device_copies_kind(CopyMethod::Kernel, 8, 0, 1)
                .contains("(copy kernel), 8 streams, GPU 0 -> GPU 1")
        );
    }

    #[test]
    fn tcp_streams_move_the_bytes() {
        let g = tcp_streams(8 << 20, 2, 2 << 20, &Congestion::Auto).expect("streams");
        assert!(g > 0.0 && g.is_finite(), "{g}");
    }

    /// The raw streams run what the engine's rails run on loopback: a named algorithm is
    /// reported (and refused when the kernel has no such one), and the default is not BBR
    /// (the system default on the kernels here, whose pacing the rails avoid).
    #[test]
    fn the_streams_congestion_control_follows_the_engines() {
        let named = Congestion::Named("reno".into());
        assert_eq!(loopback_congestion(&named).expect("reno"), "reno");
        assert!(
            !loopback_congestion(&Congestion::Auto)
                .unwrap()
                .starts_with("bbr")
        );
        let missing = Congestion::Named("no_such_algo".into());
        assert!(loopback_congestion(&missing).is_err());
        assert!(tcp_streams(1 << 20, 1, 1 << 20, &missing).is_err());
    }

    /// The unconnected probe names what a connection made with the same choice runs, at
    /// both of its ends, for every kind of choice.
    #[test]
    fn the_probe_names_what_loopback_pairs_run() {
        for cc in [
            Congestion::Auto,
            Congestion::System,
            Congestion::Named("reno".into()),
        ] {
            let named = loopback_congestion(&cc).expect("probe");
            let (mut c, mut s) = loopback_pair(&cc).expect("a pair");
            assert_eq!(Congestion::algorithm(&c).unwrap(), named, "{cc}: client");
            assert_eq!(Congestion::algorithm(&s).unwrap(), named, "{cc}: server");
            // Connected to each other, both ways.
            c.write_all(b"ping").unwrap();
            let mut got = [0u8; 4];
            s.read_exact(&mut got).unwrap();
            s.write_all(&got).unwrap();
            c.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"ping");
        }
    }
}
