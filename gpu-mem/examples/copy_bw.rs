//! Pinned host <-> device copy bandwidth, one line per direction.
//!
//! ```text
//! cargo run -p gpu-mem --release --example copy_bw -- [DEVICE] [MIB] [REPS]
//! ```
//! Defaults: device 0, 256 MiB copies, 10 repetitions (after one warm-up copy each way).
//! Each copy is one `cuMemcpy*Async` on a [`CopyStream`], timed from queueing to its event.

use gpu_mem::{CopyStream, Cuda, DeviceBuffer, PinnedHostBuffer};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: u64| -> Result<u64, String> {
        match args.get(i) {
            None => Ok(default),
            Some(s) => s
                .parse()
                .map_err(|_| format!("argument {} must be a number, got {s:?}", i + 1)),
        }
    };
    let parsed = (|| Ok::<_, String>((arg(0, 0)?, arg(1, 256)?, arg(2, 10)?)))();
    let (device, mib, reps) = match parsed {
        Ok(v) if v.1 > 0 && v.2 > 0 => v,
        Ok(_) => {
            eprintln!("copy_bw: MIB and REPS must be positive");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("copy_bw: {e}; usage: copy_bw [DEVICE] [MIB] [REPS]");
            return ExitCode::from(2);
        }
    };
    match run(device as u32, mib as usize * (1 << 20), reps as usize) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("copy_bw: {e}");
            let mut source = std::error::Error::source(&*e);
            while let Some(s) = source {
                eprintln!("  caused by: {s}");
                source = s.source();
            }
            ExitCode::FAILURE
        }
    }
}

fn run(ordinal: u32, len: usize, reps: usize) -> Result<(), Box<dyn std::error::Error>> {
    let Some(cuda) = Cuda::probe()? else {
        return Err("no CUDA on this machine".into());
    };
    let gpu = cuda.device(ordinal)?;
    let info = gpu.info()?;
    let dev = Arc::new(DeviceBuffer::new(&gpu, len)?);
    let host = Arc::new(PinnedHostBuffer::new(&gpu, len)?);
    host.fill(0, len as u64, 0x5a)?;
    dev.fill(0, len as u64, 0xa5)?;
    let mut stream = gpu.copy_stream()?;

    let h2d = measure(&mut stream, reps, |s| {
        s.copy_h2d_async(&host, 0, &dev, 0, len as u64)
    })?;
    let d2h = measure(&mut stream, reps, |s| {
        s.copy_d2h_async(&dev, 0, &host, 0, len as u64)
    })?;
    // The last copy brought the device's bytes back: check that it really moved them.
    if host.to_vec(0, 4)? != [0x5a; 4] || host.to_vec(len as u64 - 4, 4)? != [0x5a; 4] {
        return Err("copied bytes do not match".into());
    }
    let mib = len >> 20;
    for (dir, times) in [("H2D", &h2d), ("D2H", &d2h)] {
        let best = times.iter().min().copied().unwrap_or_default();
        let mean = times.iter().sum::<Duration>() / times.len().max(1) as u32;
        println!(
            "{dir} pinned {mib} MiB x{reps} on cuda:{ordinal} ({}, {}): best {:.1} GB/s, mean {:.1} GB/s",
            info.name,
            info.pci_bus_id,
            gbps(len, best),
            gbps(len, mean),
        );
    }
    Ok(())
}

/// Runs `copy` once to warm up, then `reps` times, each timed until its event completes.
fn measure(
    stream: &mut CopyStream,
    reps: usize,
    mut copy: impl FnMut(&mut CopyStream) -> Result<(), gpu_mem::GpuMemError>,
) -> Result<Vec<Duration>, gpu_mem::GpuMemError> {
    copy(stream)?;
    stream.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        copy(stream)?;
        stream.record_event()?.synchronize()?;
        times.push(t0.elapsed());
    }
    stream.synchronize()?;
    Ok(times)
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
}
