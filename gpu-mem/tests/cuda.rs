//! CUDA tests. They compile everywhere and are `#[ignore]`d, so that `cargo test` on a machine
//! without a GPU counts them as ignored, not passed. On a GPU machine run them with
//! `XFER_REQUIRE_CUDA=1 cargo test -p gpu-mem -- --include-ignored --test-threads=1`
//! (`scripts/gpu-proof.sh` does): each fails, naming what is missing, where its GPUs are not
//! there. The probe test always runs: it checks that the absence of CUDA is a value, not a
//! panic, and fails when `XFER_REQUIRE_CUDA`/`XFER_REQUIRE_GPUS` ask for GPUs this machine
//! lacks.

use fabric_core::memory::SubRegion;
use fabric_core::{MemoryError, MemoryLocation, MemoryRegion};
use gpu_mem::{Cuda, DeviceBuffer, GpuMemError, PinnedHostBuffer};
use std::sync::Arc;

const MIB: usize = 1 << 20;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

#[test]
fn probe_reports_absence_as_a_value() {
    gpu_mem::testing::check_required_gpus();
    let probe = Cuda::probe();
    if !gpu_mem::driver_present() {
        assert!(
            matches!(probe, Ok(None)),
            "no libcuda here, yet probe said {probe:?}"
        );
        assert_eq!(gpu_mem::devices(), Ok(Vec::new()));
        println!("no CUDA driver on this machine: probe returned Ok(None)");
        return;
    }
    match probe {
        Ok(Some(cuda)) => {
            let n = cuda.device_count().unwrap();
            assert!(n > 0);
            println!(
                "CUDA driver {} with {n} device(s)",
                cuda.driver_version().unwrap()
            );
        }
        Ok(None) => println!("CUDA driver present but no device"),
        Err(e) => panic!("probe failed: {e:?}"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn devices_are_described() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let infos = cuda.devices().unwrap();
    assert_eq!(infos.len() as u32, cuda.device_count().unwrap());
    assert_eq!(gpu_mem::devices().unwrap(), infos);
    for (i, info) in infos.iter().enumerate() {
        println!("{info:?}");
        assert_eq!(info.ordinal, i as u32);
        assert!(!info.name.is_empty());
        assert!(info.total_memory > 0);
        assert!(info.driver_version.major >= 11);
        assert!(info.compute_capability.0 >= 3);
        // dddd:bb:dd.f, lower-case hex.
        let id = &info.pci_bus_id;
        assert_eq!(id.len(), 12, "{id}");
        assert_eq!(&id[4..5], ":");
        assert_eq!(&id[7..8], ":");
        assert_eq!(&id[10..11], ".");
        assert!(
            id.chars().all(|c| c.is_ascii_digit()
                || (c.is_ascii_hexdigit() && c.is_ascii_lowercase())
                || ":.".contains(c)),
            "{id}"
        );
        let dev = cuda.device(info.ordinal).unwrap();
        assert_eq!(dev.info().unwrap(), *info);
    }
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn bad_device_index_is_an_error() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let count = cuda.device_count().unwrap();
    for ordinal in [count, count + 7, u32::MAX] {
        let err = cuda.device(ordinal).unwrap_err();
        assert_eq!(err, GpuMemError::NoSuchDevice { ordinal, count });
        assert!(err.to_string().contains("does not exist"), "{err}");
        assert!(matches!(
            cuda.device_info(ordinal),
            Err(GpuMemError::NoSuchDevice { .. })
        ));
    }
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn zero_and_impossible_allocations_are_errors() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    assert_eq!(gpu.alloc(0).unwrap_err(), GpuMemError::ZeroSize);
    assert_eq!(gpu.alloc_pinned(0).unwrap_err(), GpuMemError::ZeroSize);
    assert_eq!(
        PinnedHostBuffer::new(&gpu, 0).unwrap_err(),
        GpuMemError::ZeroSize
    );
    // 1 PiB: more than any GPU has.
    let err = DeviceBuffer::new(&gpu, 1 << 50).unwrap_err();
    assert!(
        matches!(err, GpuMemError::DeviceAlloc { .. }) && err.is_out_of_memory(),
        "{err:?}"
    );
    println!("1 PiB allocation: {err}: {}", err.cuda_error().unwrap());
    let err = DeviceBuffer::new(&gpu, usize::MAX).unwrap_err();
    assert!(matches!(err, GpuMemError::DeviceAlloc { .. }), "{err:?}");
    // The device still works afterwards.
    let b = gpu.alloc(4096).unwrap();
    b.fill(0, 4096, 1).unwrap();
    assert_eq!(b.to_vec(4095, 1).unwrap(), vec![1]);
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn device_buffer_round_trips() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let len = 4 * MIB + 123;
    let buf = gpu.alloc(len).unwrap();
    assert_eq!(buf.len(), len);
    assert_eq!(buf.device().ordinal(), 0);
    let data = pattern(len, 7);
    buf.copy_from_host(0, &data).unwrap();
    assert_eq!(buf.to_vec(0, len).unwrap(), data);

    // Partial writes and reads at odd offsets.
    buf.copy_from_host(1001, &[9; 77]).unwrap();
    let mut out = vec![0u8; 100];
    buf.copy_to_host(990, &mut out).unwrap();
    assert_eq!(&out[..11], &data[990..1001]);
    assert_eq!(&out[11..88], &[9; 77][..]);
    assert_eq!(&out[88..], &data[1078..1090]);

    // Fill.
    buf.fill(MIB as u64, MIB as u64, 0x5a).unwrap();
    let v = buf.to_vec(MIB as u64 - 1, MIB + 2).unwrap();
    assert_eq!(v[0], data[MIB - 1]);
    assert!(v[1..=MIB].iter().all(|&b| b == 0x5a));
    assert_eq!(v[MIB + 1], data[2 * MIB]);

    // Zeroed allocation and device-to-device copy.
    let other = gpu.alloc_zeroed(2 * MIB).unwrap();
    assert!(other.to_vec(0, 2 * MIB).unwrap().iter().all(|&b| b == 0));
    other
        .copy_from_device(4096, &buf, 3 * MIB as u64, MIB as u64)
        .unwrap();
    assert_eq!(other.to_vec(4096, MIB).unwrap(), &data[3 * MIB..4 * MIB]);
    assert_eq!(other.to_vec(0, 4096).unwrap(), vec![0; 4096]);
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn device_buffer_bounds_are_checked() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let buf = gpu.alloc(10_000).unwrap();
    let oob = |r: Result<_, GpuMemError>| matches!(r, Err(GpuMemError::OutOfBounds { .. }));
    assert!(oob(buf.copy_from_host(9_991, &[0; 10])));
    assert!(oob(buf.copy_from_host(u64::MAX, &[0; 2])));
    assert!(oob(buf.copy_to_host(9_999, &mut [0; 2])));
    assert!(oob(buf.to_vec(10_001, 0).map(|_| ())));
    assert!(oob(buf.fill(5_000, 5_001, 0)));
    assert!(oob(buf.fill(u64::MAX, 2, 0)));
    let small = gpu.alloc(100).unwrap();
    assert!(oob(buf.copy_from_device(0, &small, 50, 51)));
    assert!(oob(small.copy_from_device(0, &buf, 0, 101)));
    assert!(oob(buf.export_dmabuf_range(9_000, 1_001).map(|_| ())));
    // Empty ranges at the very end are fine.
    buf.copy_from_host(10_000, &[]).unwrap();
    assert_eq!(buf.to_vec(10_000, 0).unwrap(), Vec::<u8>::new());
    buf.fill(10_000, 0, 1).unwrap();
    // The last byte is reachable.
    buf.copy_from_host(9_999, &[42]).unwrap();
    assert_eq!(buf.to_vec(9_999, 1).unwrap(), vec![42]);
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn pinned_buffer_round_trips() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let len = 3 * MIB + 5;
    let pinned = gpu.alloc_pinned(len).unwrap();
    assert_eq!(pinned.len(), len);
    assert!(pinned.to_vec(0, len).unwrap().iter().all(|&b| b == 0));
    let data = pattern(len, 3);
    pinned.write(0, &data).unwrap();
    assert_eq!(pinned.to_vec(0, len).unwrap(), data);
    pinned.fill(10, 10, 0xee).unwrap();
    assert_eq!(pinned.to_vec(9, 12).unwrap()[1..11], [0xee; 10]);
    assert!(matches!(
        pinned.write(len as u64 - 1, &[1, 2]),
        Err(GpuMemError::OutOfBounds { .. })
    ));
    assert!(matches!(
        pinned.read(u64::MAX, &mut [0]),
        Err(GpuMemError::OutOfBounds { .. })
    ));
    assert!(pinned.fill(len as u64, 1, 0).is_err());

    // As a MemoryRegion: host memory with a host pointer.
    let region: Arc<dyn MemoryRegion> = Arc::new(pinned);
    assert_eq!(region.location(), MemoryLocation::Host);
    let p = region.host_ptr().unwrap();
    assert_eq!(region.device_addr(), p.as_ptr() as u64);
    region.write_from_host(100, &[1, 2, 3]).unwrap();
    let mut back = [0u8; 3];
    region.read_to_host(100, &mut back).unwrap();
    assert_eq!(back, [1, 2, 3]);
    assert!(matches!(
        region.read_to_host(len as u64 - 2, &mut back),
        Err(MemoryError::OutOfBounds { .. })
    ));

    // The whole buffer as a slice, while nothing writes it.
    let pinned = gpu.alloc_pinned(4096).unwrap();
    pinned.fill(0, 4096, 3).unwrap();
    // SAFETY: no copy or transfer writes `pinned` while the slice lives.
    let slice = unsafe { pinned.as_slice() };
    assert_eq!(slice, &[3; 4096][..]);
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn async_copies_with_events() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let len = 8 * MIB;
    let chunk = MIB as u64;
    let src = Arc::new(gpu.alloc_pinned(len).unwrap());
    let data = pattern(len, 11);
    src.write(0, &data).unwrap();
    let dev = Arc::new(gpu.alloc(len).unwrap());
    let dst = Arc::new(gpu.alloc_pinned(len).unwrap());

    let mut up = gpu.copy_stream().unwrap();
    let mut down = gpu.copy_stream().unwrap();
    let mut events = Vec::new();
    for i in 0..(len as u64 / chunk) {
        up.copy_h2d_async(&src, i * chunk, &dev, i * chunk, chunk)
            .unwrap();
        events.push(up.record_event().unwrap());
    }
    // The stream holds one clone per copy it has not yet seen complete.
    assert!(up.copies_in_flight() <= 8);
    assert_eq!(Arc::strong_count(&src), 1 + up.copies_in_flight());
    // Pipeline: each chunk goes back down as soon as its upload is done.
    for (i, ev) in events.iter().enumerate() {
        ev.synchronize().unwrap();
        assert!(ev.query().unwrap());
        let off = i as u64 * chunk;
        down.copy_d2h_async(&dev, off, &dst, off, chunk).unwrap();
    }
    let last = down.record_event().unwrap();
    last.synchronize().unwrap();
    assert!(last.query().unwrap());
    assert_eq!(dst.to_vec(0, len).unwrap(), data);

    // Once the stream has seen everything complete it lets go of the buffers.
    assert_eq!(down.release_completed().unwrap(), 0);
    assert_eq!(up.release_completed().unwrap(), 0);
    drop(events);
    up.synchronize().unwrap();
    down.synchronize().unwrap();
    assert_eq!(Arc::strong_count(&src), 1);
    assert_eq!(Arc::strong_count(&dev), 1);
    assert_eq!(Arc::strong_count(&dst), 1);

    // Events are reused; many rounds stay correct.
    for round in 0..20u8 {
        src.fill(0, chunk, round).unwrap();
        up.copy_h2d_async(&src, 0, &dev, round as u64 * 4096, 4096)
            .unwrap();
        let e = up.record_event().unwrap();
        while !e.query().unwrap() {
            std::hint::spin_loop();
        }
        assert_eq!(
            dev.to_vec(round as u64 * 4096, 4096).unwrap(),
            vec![round; 4096]
        );
    }
    assert_eq!(up.release_completed().unwrap(), 0);
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn async_copy_checks_its_arguments() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let dev = Arc::new(gpu.alloc_zeroed(MIB).unwrap());
    let pinned = Arc::new(gpu.alloc_pinned(MIB).unwrap());
    let mut s = gpu.copy_stream().unwrap();
    let m = MIB as u64;
    // Out of range on either side.
    assert!(matches!(
        s.copy_d2h_async(&dev, 1, &pinned, 0, m),
        Err(GpuMemError::OutOfBounds { .. })
    ));
    assert!(matches!(
        s.copy_h2d_async(&pinned, 0, &dev, u64::MAX, 2),
        Err(GpuMemError::OutOfBounds { .. })
    ));
    // Host memory where device memory is expected, and the other way round.
    assert!(matches!(
        s.copy_d2h_async(&pinned, 0, &pinned, 0, 16),
        Err(GpuMemError::WrongMemory(_))
    ));
    assert!(matches!(
        s.copy_h2d_async(&dev, 0, &dev, 0, 16),
        Err(GpuMemError::WrongMemory(_))
    ));
    // Nothing was queued by the failed calls.
    assert_eq!(s.copies_in_flight(), 0);
    assert_eq!(Arc::strong_count(&dev), 1);
    // Zero-length copies are fine and queue nothing.
    s.copy_d2h_async(&dev, m, &pinned, m, 0).unwrap();
    assert_eq!(s.copies_in_flight(), 0);

    // Windows onto regions (trait objects) work too, and pageable host memory.
    let window: Arc<dyn MemoryRegion> = Arc::new(SubRegion::new(dev.clone(), 4096, 8192).unwrap());
    let host: Arc<dyn MemoryRegion> = fabric_core::HostBuffer::new_shared(8192).unwrap();
    host.write_from_host(0, &[7; 8192]).unwrap();
    s.copy_h2d_async(&host, 0, &window, 0, 8192).unwrap();
    assert!(matches!(
        s.copy_h2d_async(&host, 0, &window, 1, 8192),
        Err(GpuMemError::OutOfBounds { .. })
    ));
    s.synchronize().unwrap();
    assert_eq!(dev.to_vec(4096, 8192).unwrap(), vec![7; 8192]);
    // Bytes around the window are untouched.
    assert_eq!(dev.to_vec(4095, 1).unwrap(), vec![0]);
    assert_eq!(dev.to_vec(4096 + 8192, 1).unwrap(), vec![0]);
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn buffers_outlive_copies_in_flight() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let len = 64 * MIB;
    let mut s = gpu.copy_stream().unwrap();
    {
        let dev = Arc::new(gpu.alloc(len).unwrap());
        let pinned = Arc::new(gpu.alloc_pinned(len).unwrap());
        for _ in 0..4 {
            s.copy_d2h_async(&dev, 0, &pinned, 0, len as u64).unwrap();
            s.copy_h2d_async(&pinned, 0, &dev, 0, len as u64).unwrap();
        }
        assert_eq!(s.copies_in_flight(), 8);
        // Our handles go away here; the stream's clones keep the memory alive.
    }
    drop(s); // waits for the copies, then frees the buffers
    let mut s = gpu.copy_stream().unwrap();
    let dev = Arc::new(gpu.alloc(MIB).unwrap());
    let pinned = Arc::new(gpu.alloc_pinned(MIB).unwrap());
    s.copy_d2h_async(&dev, 0, &pinned, 0, MIB as u64).unwrap();
    let e = s.record_event().unwrap();
    drop(s); // an event may outlive its stream
    e.synchronize().unwrap();
    assert_eq!(Arc::strong_count(&dev), 1);
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn dmabuf_export_gives_an_fd_or_says_unsupported() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let buf = gpu.alloc(4 * MIB + 100).unwrap();
    println!(
        "dmabuf supported per device attribute: {}",
        gpu.dmabuf_supported().unwrap()
    );
    match buf.export_dmabuf_range(4096 + 10, MIB as u64) {
        Ok(export) => {
            use std::os::fd::AsRawFd;
            let fd = export.fd().as_raw_fd();
            assert!(fd >= 0);
            assert_eq!(export.len(), MIB as u64);
            // The range's first byte sits at the same offset inside its page.
            assert_eq!(
                export.offset() % 4096,
                (buf.device_addr() + 4096 + 10) % 4096
            );
            // SAFETY: fstat on an fd we own, into a zeroed stat buffer.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fd is open (owned by export) and st is a valid out-pointer.
            assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
            println!(
                "dmabuf export: fd {fd}, offset {}, size {}",
                export.offset(),
                st.st_size
            );
            // The whole-buffer export backs MemoryRegion::dmabuf and is cached.
            let h = buf.dmabuf_handle().unwrap();
            assert_eq!(buf.dmabuf(), Some(h));
            assert_eq!(buf.dmabuf_handle().unwrap(), h);
            assert_eq!(h.offset, buf.device_addr() % 4096);
            let owned = export.into_fd();
            drop(owned);
        }
        Err(GpuMemError::DmabufUnsupported(why)) => {
            println!("dmabuf export unsupported here: {why}");
            assert!(buf.dmabuf().is_none());
            assert!(matches!(
                buf.dmabuf_handle(),
                Err(GpuMemError::DmabufUnsupported(_)) | Err(GpuMemError::DmabufExport { .. })
            ));
        }
        Err(e) => panic!(
            "dmabuf export failed without saying unsupported: {e}: {:?}",
            e.cuda_error()
        ),
    }
    assert!(matches!(
        buf.export_dmabuf_range(0, 0),
        Err(GpuMemError::ZeroSize)
    ));
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn device_buffer_is_a_memory_region() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let buf = Arc::new(gpu.alloc(2 * MIB).unwrap());
    let region: Arc<dyn MemoryRegion> = buf.clone();
    assert_eq!(region.len(), 2 * MIB);
    assert_eq!(region.location(), MemoryLocation::Cuda { device: 0 });
    assert!(region.host_ptr().is_none());
    assert_eq!(region.device_addr(), buf.device_addr());
    let data = pattern(2 * MIB, 5);
    region.write_from_host(0, &data).unwrap();
    let mut back = vec![0u8; 2 * MIB];
    region.read_to_host(0, &mut back).unwrap();
    assert_eq!(back, data);
    assert_eq!(buf.to_vec(0, 2 * MIB).unwrap(), data);
    assert!(matches!(
        region.write_from_host(2 * MIB as u64 - 1, &[0, 0]),
        Err(MemoryError::OutOfBounds { .. })
    ));
    assert!(matches!(
        region.read_to_host(u64::MAX, &mut [0]),
        Err(MemoryError::OutOfBounds { .. })
    ));
    // A window onto it, as a transport registers part of a buffer.
    let sub = SubRegion::new(region.clone(), MIB as u64, 4096).unwrap();
    assert_eq!(sub.location(), MemoryLocation::Cuda { device: 0 });
    assert_eq!(sub.device_addr(), buf.device_addr() + MIB as u64);
    let mut page = vec![0u8; 4096];
    sub.read_to_host(0, &mut page).unwrap();
    assert_eq!(page, &data[MIB..MIB + 4096]);
    assert!(sub.write_from_host(1, &page).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn buffers_work_from_other_threads() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let buf = Arc::new(gpu.alloc(8 * MIB).unwrap());
    let pinned = Arc::new(gpu.alloc_pinned(8 * MIB).unwrap());
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let buf = buf.clone();
            let pinned = pinned.clone();
            let gpu = gpu.clone();
            std::thread::spawn(move || {
                // A fresh thread has no current context: every call must bind it.
                let off = t as u64 * MIB as u64;
                let region: &dyn MemoryRegion = &*buf;
                region.write_from_host(off, &vec![t; MIB]).unwrap();
                let mut s = gpu.copy_stream().unwrap();
                s.copy_d2h_async(&buf, off, &pinned, off, MIB as u64)
                    .unwrap();
                s.record_event().unwrap().synchronize().unwrap();
                pinned.to_vec(off, MIB).unwrap() == vec![t; MIB]
            })
        })
        .collect();
    for t in threads {
        assert!(t.join().unwrap());
    }
    // Dropped on another thread too.
    std::thread::spawn(move || drop(buf)).join().unwrap();
}

/// Copies larger than the per-thread bounce buffer, at odd offsets, from several threads at
/// once, each on its own buffer: every byte must round-trip.
#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn large_copies_from_many_threads_round_trip() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let dev = cuda.device(0).unwrap();
    let len = 9 * MIB + 123;
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                let buf = dev.alloc_zeroed(len + 4096).unwrap();
                let data = pattern(len, t);
                buf.copy_from_host(4095, &data).unwrap();
                let mut back = vec![0u8; len];
                buf.copy_to_host(4095, &mut back).unwrap();
                assert!(
                    back == data,
                    "thread {t}: bytes differ after the round trip"
                );
                assert_eq!(
                    buf.to_vec(0, 4095).unwrap(),
                    vec![0; 4095],
                    "thread {t}: bytes before"
                );
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// Many-part copies (a transport's batch of pages) round-trip, including parts larger than
/// the bounce buffer between small ones, and out-of-range parts are refused up front.
#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn many_part_copies_round_trip() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let dev = cuda.device(0).unwrap();
    let buf = dev.alloc_zeroed(32 * MIB).unwrap();
    let sizes = [4096usize, 65536, 5 * MIB + 7, 1, 0, 3 * MIB, 65536, 2 * MIB];
    let mut off = 0u64;
    let mut parts: Vec<(u64, Vec<u8>)> = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        parts.push((off, pattern(n, i as u8)));
        off += n as u64 + 100;
    }
    let refs: Vec<(u64, &[u8])> = parts.iter().map(|(o, d)| (*o, &d[..])).collect();
    buf.copy_many_from_host(&refs).unwrap();
    let mut back: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    let mut outs: Vec<(u64, &mut [u8])> = parts
        .iter()
        .zip(back.iter_mut())
        .map(|((o, _), b)| (*o, &mut b[..]))
        .collect();
    buf.copy_many_to_host(&mut outs).unwrap();
    for (i, ((_, want), got)) in parts.iter().zip(&back).enumerate() {
        assert!(want == got, "part {i} ({} bytes) differs", want.len());
    }
    assert!(matches!(
        buf.copy_many_from_host(&[(0, &[1u8; 8][..]), (32 * MIB as u64 - 4, &[1u8; 8][..])]),
        Err(GpuMemError::OutOfBounds { .. })
    ));
    assert_eq!(
        buf.to_vec(0, 8).unwrap(),
        pattern(8, 0),
        "a refused batch writes nothing"
    );
}

/// A handle a peer sends is resolved through this process's own exports only when the
/// peer is provably this process: from anyone else, one of our own handles goes to the
/// driver, which refuses it, so a hostile peer cannot aim our copies into our memory.
#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn a_peers_handle_is_resolved_through_our_exports_only_for_this_process() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let ours: Arc<dyn MemoryRegion> = Arc::new(gpu.alloc_zeroed(1 << 20).unwrap());
    let export = gpu.export_ipc(&ours).unwrap();
    let e = gpu.open_peer_ipc(&export.handle(), None).unwrap_err();
    assert!(matches!(e, GpuMemError::IpcOpen { .. }), "{e:?}");
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    let same = gpu_mem::SameProcess::of_unix_peer(&a).unwrap().unwrap();
    let m = gpu.open_peer_ipc(&export.handle(), Some(&same)).unwrap();
    assert!(m.is_local());
    drop(export);
    let e = gpu.open_peer_ipc(&m.handle(), Some(&same)).unwrap_err();
    assert!(matches!(e, GpuMemError::NotOurExport), "{e:?}");
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn ipc_refuses_garbage_handles_and_host_memory() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let e = gpu
        .open_ipc(&gpu_mem::IpcHandle::from_bytes(
            [0x5a; gpu_mem::IPC_HANDLE_LEN],
        ))
        .unwrap_err();
    assert!(matches!(e, GpuMemError::IpcOpen { .. }), "{e:?}");
    let host: Arc<dyn MemoryRegion> = fabric_core::HostBuffer::new_shared(4096).unwrap();
    assert!(matches!(
        gpu.export_ipc(&host).unwrap_err(),
        GpuMemError::WrongMemory(_)
    ));
}

/// A 4 MiB device source filled with `data` (`pattern(_, seed)`), and a zeroed 4 MiB
/// destination exported and opened again through CUDA IPC, as a peer's region is.
struct PeerPair {
    src: Arc<dyn MemoryRegion>,
    data: Vec<u8>,
    dst: Arc<dyn MemoryRegion>,
    export: gpu_mem::IpcExport,
    mapping: Arc<gpu_mem::IpcMapping>,
}

fn peer_pair(gpu: &gpu_mem::Device, seed: u8) -> PeerPair {
    let dst: Arc<dyn MemoryRegion> = Arc::new(gpu.alloc_zeroed(4 * MIB).unwrap());
    let export = gpu.export_ipc(&dst).unwrap();
    let mapping = gpu.open_ipc(&export.handle()).unwrap();
    let src: Arc<dyn MemoryRegion> = Arc::new(gpu.alloc(4 * MIB).unwrap());
    let data = pattern(4 * MIB, seed);
    src.write_from_host(0, &data).unwrap();
    PeerPair {
        src,
        data,
        dst,
        export,
        mapping,
    }
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn peer_copies_learn_of_finished_batches_from_the_stream_written_word() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let PeerPair {
        src,
        data,
        dst,
        export,
        mapping,
    } = peer_pair(&gpu, 11);
    let mut copies = gpu_mem::PeerCopies::new(&gpu).unwrap();
    // Every GPU this engine targets has stream memory operations: polling must not need a
    // driver call per poll (which eight rails' workers would contend on).
    assert_eq!(copies.completion(), "word");
    let mut last = 0;
    for batch in 0..64u64 {
        // Each batch rewrites the whole destination page by page, so a ticket reported done
        // too early would show the previous batch's bytes or a mix.
        for p in 0..(4 * MIB as u64 / 4096) {
            let q = (p * 7 + batch) % (4 * MIB as u64 / 4096);
            copies
                .push(&src, q * 4096, &mapping, export.offset() + p * 4096, 4096)
                .unwrap();
        }
        last = copies.submit().unwrap();
    }
    let start = std::time::Instant::now();
    while copies.completed().unwrap() < last {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "the word never reached ticket {last}"
        );
        std::hint::spin_loop();
    }
    let back = dst.to_vec_for_test();
    let pages = 4 * MIB / 4096;
    for p in 0..pages {
        let q = (p * 7 + 63) % pages;
        assert!(
            back[p * 4096..(p + 1) * 4096] == data[q * 4096..(q + 1) * 4096],
            "page {p} is not the last batch's"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn a_long_range_cut_into_pieces_for_the_copy_kernel_lands_whole() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let PeerPair {
        src,
        data,
        dst,
        export,
        mapping,
    } = peer_pair(&gpu, 5);
    let mut copies = gpu_mem::PeerCopies::with_method(&gpu, gpu_mem::CopyMethod::Kernel).unwrap();
    // Aligned ends (the kernel's path), a length that is no multiple of the pieces nor of
    // 16 bytes: the last piece ends in a byte-wise tail.
    let len = 4 * MIB as u64 - 64 - 8;
    copies
        .push(&src, 16, &mapping, export.offset() + 32, len)
        .unwrap();
    let t = copies.submit().unwrap();
    assert_eq!(copies.synchronize().unwrap(), t);
    let back = dst.to_vec_for_test();
    assert!(back[..32].iter().all(|&b| b == 0), "before the range");
    assert!(
        back[32..32 + len as usize] == data[16..16 + len as usize],
        "the range"
    );
    assert!(
        back[32 + len as usize..].iter().all(|&b| b == 0),
        "after the range"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn ipc_export_opened_in_the_same_process_copies_in_bounds_only() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let dst: Arc<dyn MemoryRegion> = Arc::new(gpu.alloc_zeroed(1 << 20).unwrap());
    let window: Arc<dyn MemoryRegion> = Arc::new(SubRegion::new(dst.clone(), 4096, 65536).unwrap());
    let export = gpu.export_ipc(&window).unwrap();
    assert_eq!((export.offset(), export.len()), (4096, 65536));
    let mapping = gpu.open_ipc(&export.handle()).unwrap();
    assert!(mapping.is_local());
    assert!(mapping.len() >= 1 << 20);
    let data = pattern(65536, 3);
    let src: Arc<dyn MemoryRegion> = Arc::new(gpu.alloc(65536).unwrap());
    src.write_from_host(0, &data).unwrap();
    eprintln!(
        "default copy method: {:?}",
        gpu_mem::PeerCopies::new(&gpu).unwrap().method()
    );
    for method in [
        gpu_mem::CopyMethod::Kernel,
        gpu_mem::CopyMethod::Batch,
        gpu_mem::CopyMethod::Memcpy,
    ] {
        let mut copies = gpu_mem::PeerCopies::with_method(&gpu, method).unwrap();
        dst.write_from_host(0, &vec![0u8; 1 << 20]).unwrap();
        // Pages in reverse order (aligned: the kernel's path), one range at an odd offset
        // with a ragged length (plain copies), and host memory.
        for i in 0..16u64 {
            let j = 15 - i;
            copies
                .push(&src, i * 4096, &mapping, export.offset() + j * 4096, 4096)
                .unwrap();
        }
        copies.push(&src, 1, &mapping, 200_001, 1001).unwrap();
        copies.push(&src, 32, &mapping, 300_000, 4000 + 7).unwrap();
        let host: Arc<dyn MemoryRegion> = fabric_core::HostBuffer::new_shared(4096).unwrap();
        host.write_from_host(0, &[9u8; 4096]).unwrap();
        copies.push(&host, 0, &mapping, 0, 4096).unwrap();
        assert!(
            copies
                .push(&src, 0, &mapping, mapping.len() - 10, 4096)
                .is_err()
        );
        assert!(copies.push(&src, 65000, &mapping, 0, 4096).is_err());
        let ticket = copies.submit().unwrap();
        assert_eq!(copies.synchronize().unwrap(), ticket);
        let mut back = vec![0u8; 1 << 20];
        dst.read_to_host(0, &mut back).unwrap();
        assert_eq!(&back[..4096], &[9u8; 4096][..], "{method:?}: host source");
        for i in 0..16usize {
            let j = 15 - i;
            let at = 4096 + j * 4096;
            assert!(
                back[at..at + 4096] == data[i * 4096..(i + 1) * 4096],
                "{method:?}: page {i}"
            );
        }
        assert!(
            back[200_001..201_002] == data[1..1002],
            "{method:?}: odd range"
        );
        assert!(
            back[300_000..304_007] == data[32..4039],
            "{method:?}: ragged range"
        );
        assert!(
            back[4096 + 65536..200_001].iter().all(|&b| b == 0),
            "{method:?}: gap"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn staged_copies_move_pages_through_pinned_staging_in_one_launch_per_mark() {
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let data = pattern(1 << 20, 9);
    let src: Arc<dyn MemoryRegion> = Arc::new(gpu.alloc(1 << 20).unwrap());
    src.write_from_host(0, &data).unwrap();
    let dst: Arc<dyn MemoryRegion> = Arc::new(gpu.alloc_zeroed(1 << 20).unwrap());
    let staging = Arc::new(gpu.alloc_pinned(1 << 20).unwrap());
    let mut c = gpu_mem::StagedCopies::new(&gpu, staging.clone()).unwrap();
    // Out: 16 pages in reverse order, and a ragged range at an odd offset.
    for i in 0..16u64 {
        c.copy_out(&src, i * 4096, (15 - i) * 4096, 4096).unwrap();
    }
    c.copy_out(&src, 3, 100_001, 999).unwrap();
    assert!(
        c.copy_out(&src, (1 << 20) - 10, 0, 4096).is_err(),
        "source out of bounds"
    );
    assert!(
        c.copy_out(&src, 0, (1 << 20) - 10, 4096).is_err(),
        "staging out of bounds"
    );
    let host: Arc<dyn MemoryRegion> = fabric_core::HostBuffer::new_shared(4096).unwrap();
    assert!(
        c.copy_out(&host, 0, 0, 16).is_err(),
        "host memory is not the device's"
    );
    c.mark().unwrap();
    let mut done = 0;
    while done < 1 {
        done += c.poll_marks().unwrap();
    }
    let mut got = vec![0u8; 1 << 20];
    staging.read(0, &mut got).unwrap();
    for i in 0..16usize {
        let at = (15 - i) * 4096;
        assert!(
            got[at..at + 4096] == data[i * 4096..(i + 1) * 4096],
            "page {i}"
        );
    }
    assert!(got[100_001..101_000] == data[3..1002], "ragged range out");
    // In: the staged pages back to device memory, in order.
    for i in 0..16u64 {
        c.copy_in((15 - i) * 4096, &dst, i * 4096, 4096).unwrap();
    }
    c.copy_in(100_001, &dst, 500_003, 999).unwrap();
    c.mark().unwrap();
    c.mark().unwrap(); // an empty mark completes too
    let mut done = 0;
    while done < 2 {
        done += c.poll_marks().unwrap();
    }
    let back = dst.to_vec_for_test();
    assert!(back[..65536] == data[..65536], "pages in");
    assert!(back[500_003..501_002] == data[3..1002], "ragged range in");
    assert!(
        back[65536..500_003].iter().all(|&b| b == 0),
        "nothing else written"
    );
}

trait ToVecForTest {
    fn to_vec_for_test(&self) -> Vec<u8>;
}

impl ToVecForTest for Arc<dyn MemoryRegion> {
    fn to_vec_for_test(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        self.read_to_host(0, &mut v).unwrap();
        v
    }
}

#[test]
#[ignore = "needs 2 CUDA GPUs (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn two_gpus_peer_copies_from_another_gpus_memory_still_land() {
    let cuda = gpu_mem::testing::require_gpus(2);
    let (g0, g1) = (cuda.device(0).unwrap(), cuda.device(1).unwrap());
    let dst: Arc<dyn MemoryRegion> = Arc::new(g0.alloc_zeroed(1 << 20).unwrap());
    let export = g0.export_ipc(&dst).unwrap();
    let mapping = g0.open_ipc(&export.handle()).unwrap();
    // The source lives on GPU 1, the copies are issued from GPU 0: the copy kernel of
    // GPU 0 must not read it (no mapping there); plain copies must move it.
    let data = pattern(65536, 5);
    let src: Arc<dyn MemoryRegion> = Arc::new(g1.alloc(65536).unwrap());
    src.write_from_host(0, &data).unwrap();
    let mut copies = gpu_mem::PeerCopies::with_method(&g0, gpu_mem::CopyMethod::Kernel).unwrap();
    for i in 0..16u64 {
        copies
            .push(&src, i * 4096, &mapping, (15 - i) * 4096, 4096)
            .unwrap();
    }
    let t = copies.submit().unwrap();
    assert_eq!(copies.synchronize().unwrap(), t);
    let mut back = vec![0u8; 65536];
    dst.read_to_host(0, &mut back).unwrap();
    for i in 0..16usize {
        let at = (15 - i) * 4096;
        assert!(
            back[at..at + 4096] == data[i * 4096..(i + 1) * 4096],
            "page {i}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn a_stream_fence_is_done_only_once_the_work_before_it_has_run() {
    use fabric_core::Fence;
    use gpu_mem::StreamRef;
    use std::time::Duration;
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    let buf = gpu.alloc_zeroed(16 * MIB).unwrap();
    gpu.synchronize().unwrap();
    gpu_mem::testing::late_fill(&buf, 9, Duration::from_millis(300), StreamRef::LEGACY).unwrap();
    let fence = gpu.fence_on(StreamRef::LEGACY).unwrap();
    assert!(
        !fence.is_done().unwrap(),
        "done before the kernel queued ahead of it has run"
    );
    fence.synchronize().unwrap();
    assert!(fence.is_done().unwrap());
    assert!(
        buf.to_vec(0, 16 * MIB).unwrap().iter().all(|&b| b == 9),
        "the kernel before the fence has filled the buffer"
    );
    // A fence on a stream with nothing queued is done at once.
    let idle = gpu.fence_on(StreamRef::PER_THREAD).unwrap();
    idle.synchronize().unwrap();
    assert!(idle.is_done().unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU (--include-ignored runs it; scripts/gpu-proof.sh)"]
fn the_position_pattern_is_written_on_the_device_and_reads_back_as_the_host_computes_it() {
    use std::time::Instant;
    let cuda = gpu_mem::testing::require_gpus(1);
    let gpu = cuda.device(0).unwrap();
    // An odd length: the kernel writes whole words, the host the tail.
    let len = 64 * MIB + 5;
    let buf = gpu.alloc_zeroed(len).unwrap();
    gpu_mem::fill_pattern(&buf, 99).unwrap();
    for (off, n) in [(0usize, 4096usize), (8 * MIB, MIB), (len - 4096 - 5, 4101)] {
        let got = buf.to_vec(off as u64, n).unwrap();
        let mut want = vec![0u8; n];
        gpu_mem::pattern_bytes(99, off as u64, &mut want);
        assert!(
            got == want,
            "bytes {off}+{n} differ from the host's pattern"
        );
    }
    // What it costs at size (printed: a figure, not a test of speed): 32 GiB where the
    // device has 80 GiB or more, else 8 GiB.
    let gib: usize = if gpu.info().unwrap().total_memory >= 80 << 30 {
        32
    } else {
        8
    };
    let big = gpu.alloc(gib << 30).unwrap();
    let t = Instant::now();
    gpu_mem::fill_pattern(&big, 1).unwrap();
    println!(
        "pattern fill of {gib} GiB of device memory: {:?}",
        t.elapsed()
    );
}
