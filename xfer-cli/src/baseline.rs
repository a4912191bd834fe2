//! The baseline: plain TCP streams over loopback moving the same bytes in 1 MiB writes, with
//! no framing: the best a socket does on this machine.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// Moves `bytes` over `streams` loopback connections; returns Gbit/s.
pub fn run(bytes: u64, streams: usize) -> std::io::Result<f64> {
    const CHUNK: usize = 1 << 20;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let per = bytes / streams as u64;
    let start = Instant::now();
    let readers = std::thread::spawn(move || -> std::io::Result<u64> {
        let mut handles = Vec::new();
        for _ in 0..streams {
            let (mut s, _) = listener.accept()?;
            handles.push(std::thread::spawn(move || -> std::io::Result<u64> {
                let mut buf = vec![0u8; CHUNK];
                let mut total = 0u64;
                loop {
                    let n = s.read(&mut buf)?;
                    if n == 0 {
                        return Ok(total);
                    }
                    total += n as u64;
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
    let writers: Vec<_> = (0..streams)
        .map(|_| {
            std::thread::spawn(move || -> std::io::Result<()> {
                let mut s = TcpStream::connect(addr)?;
                let buf = vec![0x5Au8; CHUNK];
                let mut left = per;
                while left > 0 {
                    let n = left.min(CHUNK as u64) as usize;
                    s.write_all(&buf[..n])?;
                    left -= n as u64;
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
