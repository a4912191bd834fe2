//! The baseline: plain TCP streams over loopback moving the same bytes in 1 MiB writes, with
//! no framing: the best a socket does on this machine.
//!
//! `footprint` sets how much memory the streams read from and write into. With 1 MiB (the
//! "hot" baseline) every byte comes from and goes to the CPU's caches; with the size of the
//! transfer's region, the streams touch as much memory as the transfer does, so the ratio
//! measures the transport's own cost instead of cache effects.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// Moves `bytes` over `streams` loopback connections, each stream cycling through its share
/// of a `footprint`-byte source and a `footprint`-byte destination; returns Gbit/s.
pub fn run(bytes: u64, streams: usize, footprint: usize) -> std::io::Result<f64> {
    const CHUNK: usize = 1 << 20;
    // Each stream's share, a whole number of chunks (at least one).
    let share = (footprint / streams / CHUNK).max(1) * CHUNK;
    // Memory of the same kind as the transfer's regions (huge pages, faulted in before the
    // clock starts), one source and one destination share per stream.
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
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let per = bytes / streams as u64;
    let start = Instant::now();
    let readers = std::thread::spawn(move || -> std::io::Result<u64> {
        let mut handles = Vec::new();
        for mut mem in dsts.drain(..) {
            let (mut s, _) = listener.accept()?;
            handles.push(std::thread::spawn(move || -> std::io::Result<u64> {
                let buf = mem.as_mut_slice();
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
            }));
        }
        let mut total = 0;
        for h in handles {
            total += h
                .join()
                .map_err(|_| std::io::Error::other("reader panicked"))??;
        }
        Ok(total)
    });
    let writers: Vec<_> = srcs
        .into_iter()
        .map(|mut mem| {
            std::thread::spawn(move || -> std::io::Result<()> {
                let mut s = TcpStream::connect(addr)?;
                let mine = mem.as_mut_slice();
                let mut left = per;
                let mut at = 0usize;
                while left > 0 {
                    let n = left.min(CHUNK as u64) as usize;
                    s.write_all(&mine[at..at + n])?;
                    left -= n as u64;
                    at = if at + CHUNK >= share { 0 } else { at + CHUNK };
                }
                Ok(())
            })
        })
        .collect();
    for w in writers {
        w.join()
            .map_err(|_| std::io::Error::other("writer panicked"))??;
    }
    let got = readers
        .join()
        .map_err(|_| std::io::Error::other("reader panicked"))??;
    let secs = start.elapsed().as_secs_f64();
    if got != per * streams as u64 {
        return Err(std::io::Error::other(format!(
            "baseline moved {got} bytes, expected {}",
            per * streams as u64
        )));
    }
    Ok(got as f64 * 8.0 / secs / 1e9)
}
