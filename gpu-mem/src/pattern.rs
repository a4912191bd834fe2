//! The position pattern: bytes that are a function of a seed and their offset, written at
//! the memory's own speed (a kernel for device memory, every core for host memory) and
//! checkable anywhere without the source: word `i` (the 8 bytes at offset `8 i`) is
//! [`pattern_word`]`(seed, i)`, little endian.
//!
//! A benchmark fills its source regions with it and its target checks what landed. Filling
//! 32 GiB of GPU memory through host copies took 14 s on an H200 (about 2.3 GB/s); the kernel
//! writes at the HBM's rate.

use crate::device::Device;
use crate::error::{GpuMemError, check_call};
use cudarc::driver::sys;
use fabric_core::{MemoryLocation, MemoryRegion};
use std::ffi::c_void;
use std::sync::Mutex;

/// The kernel's PTX, NUL-terminated for `cuModuleLoadData`.
static PTX: &str = concat!(include_str!("pattern.ptx"), "\0");

/// The loaded kernel of each device (ordinal, `CUfunction` as an address): loaded once per
/// process, unloaded with the context.
static LOADED: Mutex<Vec<(u32, usize)>> = Mutex::new(Vec::new());

/// Word `index` of the pattern of `seed` (splitmix64 of their xor).
#[inline(always)]
pub fn pattern_word(seed: u64, index: u64) -> u64 {
    let mut z = (seed ^ index).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The pattern bytes of `seed` at `offset..offset + buf.len()` (`offset` a multiple of 8).
pub fn pattern_bytes(seed: u64, offset: u64, buf: &mut [u8]) {
    debug_assert!(offset.is_multiple_of(8));
    let first = offset / 8;
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let w = pattern_word(seed, first + i as u64).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// Whether `buf` holds the pattern bytes of `seed` at `offset` (`offset` a multiple of 8).
pub fn pattern_matches(seed: u64, offset: u64, buf: &[u8]) -> bool {
    let first = offset / 8;
    let (words, tail) = buf.as_chunks::<8>();
    if !tail.is_empty() {
        let w = pattern_word(seed, first + words.len() as u64).to_le_bytes();
        if tail != &w[..tail.len()] {
            return false;
        }
    }
    words_differ(seed, first, words) == 0
}

/// The OR of every word of `words` XOR the pattern word of `seed` it should be (`first` the
/// first's index): zero when all match. With AVX2 where the CPU has it, as for
/// [`fill_words`]; no early exit, so the loop vectorizes (a checker that stopped at the
/// first mismatch, comparing byte slices, ran at a tenth of that).
fn words_differ(seed: u64, first: u64, words: &[[u8; 8]]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: this CPU has AVX2 (checked above), the only requirement of a function
        // compiled for it.
        return unsafe { words_differ_avx2(seed, first, words) };
    }
    words_differ_plain(seed, first, words)
}

/// [`words_differ`] compiled for AVX2 (callable only where the CPU has it).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn words_differ_avx2(seed: u64, first: u64, words: &[[u8; 8]]) -> u64 {
    words_differ_plain(seed, first, words)
}

/// [`words_differ`] for any CPU.
#[inline(always)]
fn words_differ_plain(seed: u64, first: u64, words: &[[u8; 8]]) -> u64 {
    words.iter().zip(first..).fold(0, |acc, (w, i)| {
        acc | (u64::from_le_bytes(*w) ^ pattern_word(seed, i))
    })
}

/// Fills `region` with the pattern of `seed`: device memory with a kernel, host memory on
/// every core, anything else through the region's own copies. Returns once every byte is
/// written.
pub fn fill_pattern(region: &dyn MemoryRegion, seed: u64) -> Result<(), fabric_core::MemoryError> {
    let len = region.len() as u64;
    if let MemoryLocation::Cuda { device } = region.location()
        && let Some(cuda) = crate::Cuda::probe()?
    {
        let dev = cuda.device(device)?;
        let addr = region.device_addr();
        if addr.is_multiple_of(8) && dev.holds_range(addr, len)? {
            let words = len / 8;
            // SAFETY: the driver says addr..addr+len is memory of this device (holds_range),
            // the region keeps it alive while it is borrowed here, and the kernel is waited
            // for below, before the borrow ends.
            unsafe { launch(&dev, addr, words, seed)? };
            dev.synchronize()?;
            let tail = (len - words * 8) as usize;
            if tail > 0 {
                let mut t = vec![0u8; tail];
                pattern_bytes(seed, words * 8, &mut t);
                region.write_from_host(words * 8, &t)?;
            }
            return Ok(());
        }
    }
    if let Some(base) = region.host_ptr() {
        fill_host(base.as_ptr(), len, seed);
        return Ok(());
    }
    const CHUNK: u64 = 4 << 20;
    let mut buf = vec![0u8; CHUNK.min(len) as usize];
    let mut off = 0;
    while off < len {
        let n = CHUNK.min(len - off) as usize;
        pattern_bytes(seed, off, &mut buf[..n]);
        region.write_from_host(off, &buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

/// Writes the pattern over `len` bytes at `base` on every core of this process's cpuset.
fn fill_host(base: *mut u8, len: u64, seed: u64) {
    /// A base pointer handed to the filling threads.
    struct Base(*mut u8);
    // SAFETY: the threads write disjoint ranges of the region (below) and are joined before
    // fill_host returns, while the region's contract keeps the memory valid for writes from
    // any thread.
    unsafe impl Sync for Base {}
    let base = Base(base);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    // Whole 64 KiB pieces per thread, so every piece starts on a word.
    let piece = (len.div_ceil(threads).div_ceil(1 << 16) << 16).max(1 << 16);
    std::thread::scope(|s| {
        let base = &base;
        let mut at = 0;
        while at < len {
            let n = piece.min(len - at);
            s.spawn(move || {
                // Whole words first, then the region's last partial word.
                let words = n / 8;
                let first = at / 8;
                // SAFETY: the words' 8 * words <= n bytes at at lie inside the region (at +
                // n <= len), and this thread alone writes at..at+n.
                unsafe { fill_words(base.0.add(at as usize), first, words, seed) };
                let tail = (n - words * 8) as usize;
                if tail > 0 {
                    let w = pattern_word(seed, first + words).to_le_bytes();
                    // SAFETY: as above, for the last `tail` (< 8) bytes of this thread's range.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            w.as_ptr(),
                            base.0.add((at + words * 8) as usize),
                            tail,
                        )
                    };
                }
            });
            at += n;
        }
    });
}

/// Writes words `first..first + words` of the pattern of `seed` at `dst`, with the widest
/// vector unit the CPU has that the loop can use (AVX2 on x86-64: its four 64-bit lanes
/// compute splitmix64 about 1.7 times as fast as one scalar register, which on a core
/// that writes 8 GB/s is the difference between the arithmetic and the memory being the
/// bound).
///
/// # Safety
/// `dst..dst + 8 * words` must be valid for writes and written by nothing else meanwhile.
unsafe fn fill_words(dst: *mut u8, first: u64, words: u64, seed: u64) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: this CPU has AVX2 (checked above); the range is the caller's promise.
        return unsafe { fill_words_avx2(dst, first, words, seed) };
    }
    // SAFETY: the caller's promise.
    unsafe { fill_words_plain(dst, first, words, seed) }
}

/// [`fill_words`] compiled for AVX2 (the same loop; the compiler vectorizes it).
///
/// # Safety
/// The CPU must have AVX2; the range as for [`fill_words`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn fill_words_avx2(dst: *mut u8, first: u64, words: u64, seed: u64) {
    // SAFETY: the caller's promise, passed on.
    unsafe { fill_words_plain(dst, first, words, seed) }
}

/// [`fill_words`] for any CPU: one unaligned store a word (a loop the compiler keeps
/// tight: a copy of a length it cannot see was a call per word, 10 times slower than the
/// memory).
///
/// # Safety
/// As for [`fill_words`].
#[inline(always)]
unsafe fn fill_words_plain(dst: *mut u8, first: u64, words: u64, seed: u64) {
    for i in 0..words {
        let w = pattern_word(seed, first + i).to_le_bytes();
        // Through a raw pointer: no reference to memory a transport may later reach.
        // SAFETY: word i lies inside the caller's range; write_unaligned needs no alignment.
        unsafe { dst.add(8 * i as usize).cast::<[u8; 8]>().write_unaligned(w) };
    }
}

/// Queues the pattern kernel over `words` words at device address `addr` on the device's
/// legacy default stream.
///
/// # Safety
/// `addr..addr + 8 * words` must be live memory of `dev` that nothing else uses until the
/// kernel has finished; `addr` must be 8-byte aligned.
unsafe fn launch(dev: &Device, addr: u64, words: u64, seed: u64) -> Result<(), GpuMemError> {
    dev.bind()?;
    let func = {
        let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        match loaded.iter().find(|(o, _)| *o == dev.ordinal()) {
            Some(&(_, f)) => f as sys::CUfunction,
            None => {
                let mut module: sys::CUmodule = std::ptr::null_mut();
                check_call(
                    // SAFETY: module is a valid out-pointer, the PTX NUL-terminated text, the
                    // device's context current.
                    unsafe { sys::cuModuleLoadData(&mut module, PTX.as_ptr().cast()) },
                    "cuModuleLoadData (pattern)",
                )?;
                let mut f: sys::CUfunction = std::ptr::null_mut();
                check_call(
                    // SAFETY: f is a valid out-pointer; the module is loaded and stays so; the
                    // name is NUL-terminated.
                    unsafe { sys::cuModuleGetFunction(&mut f, module, c"xfer_pattern".as_ptr()) },
                    "cuModuleGetFunction (pattern)",
                )?;
                loaded.push((dev.ordinal(), f as usize));
                f
            }
        }
    };
    let (mut dst, mut n, mut first, mut s) = (addr, words, 0u64, seed);
    let mut params = [
        (&mut dst as *mut u64).cast::<c_void>(),
        (&mut n as *mut u64).cast::<c_void>(),
        (&mut first as *mut u64).cast::<c_void>(),
        (&mut s as *mut u64).cast::<c_void>(),
    ];
    check_call(
        // SAFETY: the kernel takes four u64, matching params; the caller guarantees the range
        // and its alignment; the context is current; the NULL stream is the legacy default.
        unsafe {
            sys::cuLaunchKernel(
                func,
                1056,
                1,
                1,
                256,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        },
        "cuLaunchKernel (pattern)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_core::HostBuffer;

    #[test]
    fn the_pattern_is_position_dependent_and_checkable() {
        let mut a = vec![0u8; 4096];
        pattern_bytes(7, 8192, &mut a);
        assert!(pattern_matches(7, 8192, &a));
        assert!(!pattern_matches(7, 0, &a));
        assert!(!pattern_matches(8, 8192, &a));
        let mut b = vec![0u8; 4096];
        pattern_bytes(7, 8192 + 2048, &mut b[..2048]);
        assert_eq!(&a[2048..], &b[..2048]);
    }

    #[test]
    fn host_memory_is_filled_on_every_core_with_the_same_bytes() {
        // An odd length: the last piece ends mid-word.
        let len = (3 << 20) + 13;
        let h = HostBuffer::new_shared(len).unwrap();
        fill_pattern(&*h, 42).unwrap();
        let got = h.to_vec(0, len).unwrap();
        let mut want = vec![0u8; len];
        pattern_bytes(42, 0, &mut want);
        assert!(got == want, "the threads' pieces make the whole pattern");
    }

    #[test]
    fn one_flipped_bit_anywhere_fails_the_check() {
        // Whole words and a 5-byte tail.
        let mut buf = vec![0u8; 8 * 1000 + 5];
        pattern_bytes(3, 4096, &mut buf);
        assert!(pattern_matches(3, 4096, &buf));
        let (words, _) = buf.as_chunks::<8>();
        assert_eq!(words_differ_plain(3, 512, words), 0);
        for at in [0, 7, 8, 4001, 8 * 1000 - 1, 8 * 1000, buf.len() - 1] {
            buf[at] ^= 0x10;
            assert!(!pattern_matches(3, 4096, &buf), "a flip at byte {at}");
            let (words, _) = buf.as_chunks::<8>();
            if at < 8 * 1000 {
                assert_ne!(words_differ_plain(3, 512, words), 0, "plain, byte {at}");
            }
            buf[at] ^= 0x10;
        }
    }

    #[test]
    fn the_vector_and_the_plain_word_writers_write_the_pattern() {
        // An odd first word and count: the vector loop's head and tail.
        let (first, words) = (1001u64, 4099usize);
        let mut want = vec![0u8; 8 * words];
        pattern_bytes(9, 8 * first, &mut want);
        let mut plain = vec![0u8; 8 * words];
        // SAFETY: the buffer holds `words` words and nothing else touches it.
        unsafe { fill_words_plain(plain.as_mut_ptr(), first, words as u64, 9) };
        assert!(plain == want, "the plain loop");
        let mut best = vec![0u8; 8 * words + 1];
        // SAFETY: as above, one byte in (an unaligned start).
        unsafe { fill_words(best.as_mut_ptr().add(1), first, words as u64, 9) };
        assert!(best[1..] == want[..], "the CPU's widest loop");
        assert_eq!(best[0], 0, "nothing before the range");
    }
}
