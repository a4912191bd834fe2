//! Host memory for large registered regions: anonymous mappings backed by transparent huge
//! pages where the kernel offers them, and faulted in up front.
//!
//! A transfer region is written at random pages by the network: with 4 KiB pages every
//! 64 KiB page touches 16 TLB entries and a 1 GiB region needs 262 144 of them; 2 MiB pages
//! cut both by 512. Faulting the whole region in at allocation (as RDMA registration pins
//! it) keeps page faults out of the data path.

use fabric_core::{MemoryError, MemoryLocation, MemoryRegion};
use std::ptr::NonNull;

/// Page-aligned, zeroed host memory from `mmap`, with huge pages advised and all pages
/// faulted in. Freed on drop.
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: HostMemory owns its mapping exclusively; all access goes through raw-pointer
// copies that the MemoryRegion contract already requires callers to synchronise.
unsafe impl Send for HostMemory {}
// SAFETY: as above; &HostMemory exposes no references into the bytes.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Maps `len` zeroed bytes (at least one page is mapped for `len == 0`).
    pub fn new(len: usize) -> Result<HostMemory, MemoryError> {
        let map_len = len.max(1);
        // SAFETY: an anonymous private mapping with no address hint has no preconditions.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MemoryError::Alloc(len as u64));
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(MemoryError::Alloc(len as u64))?;
        // Advice only: a kernel without THP, or with it off, just ignores it.
        // SAFETY: [p, p+map_len) is the mapping just created.
        unsafe { libc::madvise(p, map_len, libc::MADV_HUGEPAGE) };
        // Fault every page in now, on every core: the kernel zeroes each page as it maps it,
        // which for one thread is a few GB/s, far below the memory's bandwidth.
        populate(ptr.as_ptr(), map_len);
        Ok(HostMemory { ptr, len })
    }

    /// The bytes, for an owner that holds the memory alone (`&mut`: not shared with a
    /// transport, which would hold it through an `Arc`).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping holds len bytes, lives as long as self, and `&mut self` rules
        // out any other access for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Smallest share of a mapping that a thread of [`populate`] faults in (a multiple of the
/// 2 MiB huge page): below it a thread costs more to start than it saves.
const POPULATE_SHARE: usize = 64 << 20;

/// Faults in the `len` bytes of the fresh mapping at `base`, writable, on as many threads as
/// this process may run on (one per [`POPULATE_SHARE`] at most). Each thread takes a range
/// of whole huge pages and writes a zero to every 4 KiB page of it (they are zero already;
/// the write makes the kernel map a page of its own, a huge one where it can). The threads
/// inherit the caller's memory policy, so the pages land where the caller's would.
///
/// Writing is the faster way in, measured: two 32 GiB regions took 8.9-9.7 s with
/// `MADV_POPULATE_WRITE` from the same threads and 1.2-1.4 s by writing (H200 machine,
/// kernel 6.18, huge pages advised; 2.1-2.9 s against 0.9 s for two 4 GiB regions on a
/// 2-core VM).
fn populate(base: *mut u8, len: usize) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (len / POPULATE_SHARE).clamp(1, cores);
    let share = len.div_ceil(threads).div_ceil(2 << 20) * (2 << 20);
    // The mapping's address as a plain number, so that the threads may take it.
    let base = base as usize;
    let fault = move |at: usize, n: usize| {
        for off in (0..n).step_by(4096) {
            // SAFETY: off < n and at + n <= len: inside this thread's range of the fresh
            // private mapping, which nobody else uses yet; each thread writes its own range.
            unsafe { ((base + at + off) as *mut u8).write_volatile(0) };
        }
    };
    if threads == 1 {
        fault(0, len);
        return;
    }
    std::thread::scope(|s| {
        let mut at = 0;
        while at < len {
            let n = share.min(len - at);
            s.spawn(move || fault(at, n));
            at += n;
        }
    });
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping was created in `new` with this length and is unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len.max(1)) };
    }
}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostMemory({:p}, {} bytes)", self.ptr, self.len)
    }
}

// SAFETY: ptr is a live mapping of at least len bytes owned by self until drop.
unsafe impl MemoryRegion for HostMemory {
    fn len(&self) -> usize {
        self.len
    }
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Host
    }
    fn host_ptr(&self) -> Option<NonNull<u8>> {
        Some(self.ptr)
    }
    fn device_addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_bounded_and_writable() {
        let m = HostMemory::new(3 << 20).unwrap();
        let mut b = vec![1u8; 4096];
        m.read_to_host((3 << 20) - 4096, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0));
        m.write_from_host(12345, &[7; 100]).unwrap();
        m.read_to_host(12345, &mut b[..100]).unwrap();
        assert_eq!(&b[..100], &[7; 100]);
        assert!(m.write_from_host((3 << 20) - 1, &[1, 2]).is_err());
        assert!(HostMemory::new(0).unwrap().is_empty());
    }

    #[test]
    fn every_page_of_a_region_populated_on_several_threads_is_resident_and_zero() {
        // Three shares and a bit: several threads where the machine has cores, and a last
        // range that is not a whole number of huge pages.
        let len = 3 * POPULATE_SHARE + 4096 + 3;
        let m = HostMemory::new(len).unwrap();
        let pages = len.div_ceil(4096);
        let mut resident = vec![0u8; pages];
        // SAFETY: the range is m's mapping; mincore writes one byte per page into `resident`,
        // which holds one per 4 KiB page (the page size of this platform or a divisor of it).
        let rc = unsafe { libc::mincore(m.ptr.as_ptr().cast(), len, resident.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        let missing = resident.iter().filter(|&&r| r & 1 == 0).count();
        assert_eq!(missing, 0, "{missing} of {pages} pages were not faulted in");
        let mut b = vec![1u8; 4099];
        for off in [0, POPULATE_SHARE - 1, 2 * POPULATE_SHARE + 17, len - 4099] {
            m.read_to_host(off as u64, &mut b).unwrap();
            assert!(b.iter().all(|&x| x == 0), "bytes at {off} are not zero");
        }
    }
}
